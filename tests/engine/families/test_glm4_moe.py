"""glm4_moe from a transformers checkpoint: q/k/v biases, optional q/k RMSNorm, RoPE on half of each head, a dense
first layer, sigmoid routing with the correction bias inside groups, scaled weights, shared experts; the
multi-token-prediction layer not loaded. Alignment with the reference on packed documents (config variants, routing
pinned or not, and a config.json in the hub's flat form), wrong mappings caught, unsupported configs reported one
line each, and a short fine-tune whose first loss is the reference's."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, load_checkpoint_weights, model_profile_from_checkpoint
from moe_tune.engine.families.base import stacked_experts
from moe_tune.engine.families.glm4_moe import Glm4Moe
from moe_tune.engine.model.model import build_model

from hf_tiny import save_tiny_checkpoint, tiny_glm4_moe


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_glm4_moe(), tmp_path_factory.mktemp("glm4_moe") / "checkpoint")


@pytest.fixture(scope="module")
def config(checkpoint):
    return json.loads((checkpoint / "config.json").read_text())


def _copy_with_config(checkpoint, directory, **changes):
    """The checkpoint copied to `directory` with config.json keys set (None: removed)."""
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return directory


def test_profile_read_from_config(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [("full", "dense"), ("full", "moe"), ("full", "moe")]
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.expert_intermediate_size) == (8, 3, 4, 2, 16)
    assert moe.score_func == "sigmoid" and moe.renormalize and moe.routed_scaling == 2.5 and moe.has_selection_bias
    assert moe.shared_expert_intermediate_size == 2 * 16 and not moe.shared_expert_gate
    assert cfg.attention_bias and cfg.attention_qk_norm and not cfg.attention_output_gate
    assert (cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta, cfg.intermediate_size) == (16, 0.5, 5000.0, 48)


VARIANTS = {
    "bias_qk_norm_groups": {},
    # GLM-4.5-Air's shape: no q/k norm, one group.
    "bias_no_qk_norm_one_group": {"use_qk_norm": False, "n_group": 1, "topk_group": 1},
    "no_bias_unnormalised_unscaled": {"attention_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_batch_aligned_with_transformers(checkpoint, tmp_path, variant):
    directory = checkpoint if not VARIANTS[variant] else save_tiny_checkpoint(
        tiny_glm4_moe(**VARIANTS[variant]), tmp_path / variant
    )
    # Our own routing (the wrong-mapping tests below run pinned, so the router hooks are exercised too).
    report = align_checkpoint(directory)
    assert report.passed, report.failures
    assert len(report.layers) == 3 and max(row.rel for row in report.layers) < 1e-5
    assert report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # A and B of q, k, v, o in 3 layers, and of both expert projections of the 2 MoE layers.
    assert len(report.lora_grads) == 3 * 4 * 2 + 2 * 2 * 2
    assert max(row.rel for row in report.lora_grads) < 1e-5


# GLM-4.5's config.json: rope_theta and partial_rotary_factor at the top level, no rope_parameters (transformers
# reads either; rope_parameters first).
@pytest.mark.parametrize("where", ["top_level", "both"])
def test_flat_hub_config_read(config, where):
    flat = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 1234.0,
                                                                        "partial_rotary_factor": 0.25}
    if where == "both":
        flat["rope_parameters"] = {"rope_type": "default", "rope_theta": 4321.0, "partial_rotary_factor": 0.75}
    cfg = Glm4Moe().to_profile(flat)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == ((1234.0, 0.25) if where == "top_level" else (4321.0, 0.75))


def test_default_partial_rotary_factor_aligned(checkpoint, tmp_path):
    # No factor anywhere: both sides take Glm4MoeConfig's 0.5.
    directory = _copy_with_config(checkpoint, tmp_path / "flat", rope_parameters=None, rope_theta=5000.0,
                                  torch_dtype="bfloat16", transformers_version="4.54.0")
    _, _, cfg = model_profile_from_checkpoint(directory)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (5000.0, 0.5)
    report = align_checkpoint(directory, pin_routing=True)
    assert report.passed, report.failures


def _profile_changed(**update):
    original = Glm4Moe.to_profile
    return lambda self, config: original(self, config).model_copy(update=update)


def _recipe_changed(suffix, replace):
    """Glm4Moe.recipe with the tensors of names ending in `suffix` replaced by replace(the right tensor)."""
    original = Glm4Moe.recipe

    def recipe(self, name, module, cfg):
        right = original(self, name, module, cfg)
        return (lambda get: replace(right(get))) if name.endswith(suffix) else right

    return recipe


def _swapped_gate_up(self, name, module, cfg):
    if name.endswith("experts.w_gate_up"):
        base = "model." + name.removesuffix("w_gate_up")
        return stacked_experts(module, lambda e: [f"{base}{e}.up_proj.weight", f"{base}{e}.gate_proj.weight"])
    return ORIGINAL_RECIPE(self, name, module, cfg)


ORIGINAL_RECIPE = Glm4Moe.recipe


# Which wrong mapping, and the first layer it shows in (the dense layer 0 stays right for the MoE ones).
WRONG = {
    "swapped_gate_up": (lambda: ("recipe", _swapped_gate_up), 1),
    "correction_bias_zeroed": (lambda: ("recipe", _recipe_changed("mlp.selection_bias", torch.zeros_like)), 1),
    "q_bias_zeroed": (lambda: ("recipe", _recipe_changed("q_proj.bias", torch.zeros_like)), 0),
    "full_rotary": (lambda: ("to_profile", _profile_changed(partial_rotary_factor=1.0)), 0),
}


ROUTING_CASES = ("correction_bias_zeroed",)


@pytest.mark.parametrize("what", list(WRONG))
def test_wrong_mapping_is_caught(checkpoint, monkeypatch, what):
    make, first_wrong_layer = WRONG[what]
    monkeypatch.setattr(Glm4Moe, *make())
    # Pinned routing would hide a wrong choice: the routing cases run on our own router's choice.
    report = align_checkpoint(checkpoint, pin_routing=what not in ROUTING_CASES)
    assert not report.passed
    if first_wrong_layer:
        assert report.layers[0].max_abs < 1e-5  # the table points at the first MoE layer
    assert report.layers[first_wrong_layer].max_abs > 1e-4
    assert report.logits.max_abs > report.tolerances.logits_max_abs


def test_routing_without_the_group_limit_is_caught(checkpoint, monkeypatch):
    original = Glm4Moe.moe_fields
    monkeypatch.setattr(Glm4Moe, "moe_fields", lambda self, c: original(self, c) | {"n_group": 1, "topk_group": 1})
    report = align_checkpoint(checkpoint)
    assert not report.passed and report.layers[0].max_abs < 1e-5 and report.layers[1].max_abs > 1e-4


MTP_KEYS = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "self_attn.q_proj.weight")


@pytest.mark.parametrize("layer, is_loaded", [(46, True), (92, True), (3, False)],
                         ids=["air_mtp_layer", "glm45_mtp_layer", "other_index"])
def test_mtp_layer_keys(checkpoint, tmp_path, layer, is_loaded):
    """The MTP layer at transformers' indices (46: GLM-4.5-Air, 92: GLM-4.5/4.6) is skipped as transformers skips
    it; extra layers anywhere else are reported by key pattern, not loaded silently."""
    directory = shutil.copytree(checkpoint, tmp_path / "with_mtp")
    tensors = load_file(str(directory / "model.safetensors"))
    tensors.update({f"model.layers.{layer}.{key}": torch.ones(4) for key in MTP_KEYS})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _, _, cfg = model_profile_from_checkpoint(directory)
    if is_loaded:
        load_checkpoint_weights(build_model(cfg), cfg)
        return
    with pytest.raises(UnsupportedModel) as err:
        load_checkpoint_weights(build_model(cfg), cfg)
    assert sorted(err.value.problems) == sorted(
        f"{directory}: module not mapped: model.layers.*.{key}" for key in MTP_KEYS
    )


UNSUPPORTED = {
    "hidden_act": ({"hidden_act": "gelu"}, "config.json: hidden_act ('gelu') is not mapped: must be 'silu'"),
    "use_qk_norm_not_bool": ({"use_qk_norm": 1}, "config.json: use_qk_norm (1) is not mapped: must be one of "
                             "[False, True]"),
    "attention_bias_not_bool": ({"attention_bias": "yes"}, "config.json: attention_bias ('yes') must be true or "
                                "false"),
    "attention_dropout": ({"attention_dropout": 0.1}, "config.json: attention_dropout (0.1) is not mapped: must be "
                          "one of [0, 0.0] (no attention dropout)"),
    "quantization_config": ({"quantization_config": {"quant_method": "fp8"}}, "config.json: quantization_config."
                            "weight_block_size (null) is not read: moe-tune reads quant_method fp8 with "
                            "weight_block_size [128, 128]"),
    "rope_type": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0}},
                  "config.json: rope_parameters.rope_type ('yarn') is not mapped: must be 'default'"),
    "no_shared_expert": ({"n_shared_experts": 0}, "config.json: n_shared_experts (0) must be >= 1"),
    "groups_not_dividing": ({"n_routed_experts": 10}, "config.json: n_routed_experts (10) must be a multiple of "
                            "n_group (4)"),
    "topk_group_over_n_group": ({"topk_group": 5}, "config.json: topk_group (5) must be <= n_group (4)"),
    "top_k_over_experts": ({"num_experts_per_tok": 9}, "config.json: num_experts_per_tok (9) must be <= "
                           "n_routed_experts (8)"),
    "mtp_layers_negative": ({"num_nextn_predict_layers": -1}, "config.json: num_nextn_predict_layers (-1) must be "
                            ">= 0"),
    # transformers builds it; our RoPE needs an even rotary dim (16 x 0.3125 = 5).
    "odd_rotary_dim": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                                            "partial_rotary_factor": 0.3125}},
                       "config.json (top level): not mapped: model.partial_rotary_factor (0.3125) must give an even "
                       "rotary dim (head_dim 16 x factor = 5)"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_is_one_line_naming_the_field(config, case):
    changes, line = UNSUPPORTED[case]
    with pytest.raises(UnsupportedModel) as err:
        Glm4Moe().to_profile({**config, **changes})
    assert err.value.problems == [line]


def test_unsupported_config_reports_every_problem_at_once(config):
    cases = ("hidden_act", "use_qk_norm_not_bool", "quantization_config", "no_shared_expert")
    changes = {k: v for case in cases for k, v in UNSUPPORTED[case][0].items()}
    with pytest.raises(UnsupportedModel) as err:
        Glm4Moe().to_profile({**config, **changes})
    assert sorted(err.value.problems) == sorted(UNSUPPORTED[case][1] for case in cases)


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
