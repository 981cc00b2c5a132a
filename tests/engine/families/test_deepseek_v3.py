"""deepseek_v3 from a transformers checkpoint: MLA (query latent or plain q_proj; interleaved or rotate-half RoPE),
dense first layer, group-limited sigmoid routing with the correction bias, shared experts. Alignment with the
reference on one document and on a packed batch, wrong mappings caught, unsupported configs reported, and a short
fine-tune whose first loss is the reference's."""

import json

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families.base import stacked_experts
from moe_tune.engine.families.deepseek_v3 import DeepseekV3

from hf_tiny import tiny_deepseek_v3

# Every projection MLA shares with the reference gets a LoRA adapter, so align compares their gradients.
MLA_LORA_TARGETS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
VARIANTS = {
    "q_latent_interleaved": {},
    "q_proj_rotate_half": {"q_lora_rank": None, "rope_interleave": False},
}


@pytest.fixture
def latent_checkpoint(tiny_checkpoint):
    return tiny_checkpoint(tiny_deepseek_v3())


def test_profile_read_from_config(latent_checkpoint):
    _, _, cfg = model_profile_from_checkpoint(latent_checkpoint)
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [("mla", "dense"), ("mla", "moe"), ("mla", "moe")]
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (9, 3, 3, 2)
    assert moe.score_func == "sigmoid" and moe.renormalize and moe.routed_scaling == 2.5 and moe.has_selection_bias
    assert moe.shared_expert_intermediate_size == 2 * 16 and not moe.shared_expert_gate
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        24, 16, 12, 8, 10
    )
    assert mla.rope == "interleaved" and mla.latent_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    assert cfg.intermediate_size == 64 and cfg.rope_theta == 5000.0


@pytest.mark.parametrize(
    "variant, pin",
    [("q_latent_interleaved", False), ("q_latent_interleaved", True), ("q_proj_rotate_half", False)],
    ids=["q_latent_interleaved", "q_latent_interleaved-pinned_routing", "q_proj_rotate_half"],
)
def test_packed_batch_aligned_with_transformers(tiny_checkpoint, variant, pin):
    checkpoint = tiny_checkpoint(tiny_deepseek_v3(**VARIANTS[variant]))
    report = align_checkpoint(checkpoint, pin_routing=pin, lora_targets=MLA_LORA_TARGETS)
    assert report.passed, report.failures
    assert len(report.layers) == 3 and max(row.max_abs for row in report.layers) < 1e-5
    assert report.logits.max_abs <= 1e-4 and report.kl <= 1e-6
    # q (latent pair or q_proj), kv_a, kv_b and o of every layer, A and B each; align adds the experts' adapters.
    attention_rows = [row.name for row in report.lora_grads if ".self_attn." in row.name]
    num_q = 1 if any(".q_proj." in name for name in attention_rows) else 2
    assert len(attention_rows) == 3 * (num_q + 3) * 2
    assert any(".experts." in row.name for row in report.lora_grads)


def test_one_document_aligned_with_transformers(latent_checkpoint):
    document = torch.randint(0, 300, (31,), generator=torch.Generator().manual_seed(3))
    report = align_checkpoint(latent_checkpoint, documents=[document], lora_targets=MLA_LORA_TARGETS)
    assert report.passed, report.failures
    assert report.logits.max_abs <= 1e-4 and report.kl <= 1e-6


def test_swapped_gate_up_is_caught(latent_checkpoint, monkeypatch):
    original = DeepseekV3.recipe

    def swapped(self, name, module, cfg):
        if name.endswith("experts.w_gate_up"):
            base = "model." + name.removesuffix("w_gate_up")
            return stacked_experts(module, lambda e: [f"{base}{e}.up_proj.weight", f"{base}{e}.gate_proj.weight"])
        return original(self, name, module, cfg)

    monkeypatch.setattr(DeepseekV3, "recipe", swapped)
    report = align_checkpoint(latent_checkpoint, pin_routing=True)
    assert not report.passed
    assert report.layers[0].max_abs < 1e-5  # the dense first layer is still right: the table points at layer 1
    assert report.layers[1].max_abs > 1e-4 and report.logits.max_abs > report.tolerances.logits_max_abs


def test_routing_without_the_correction_bias_is_caught(latent_checkpoint, monkeypatch):
    original = DeepseekV3.recipe

    def bias_zeroed(self, name, module, cfg):
        # The checkpoint's e_score_correction_bias read, but a zero bias loaded in its place.
        recipe = original(self, name, module, cfg)
        return (lambda get: torch.zeros_like(recipe(get))) if name.endswith("mlp.selection_bias") else recipe

    monkeypatch.setattr(DeepseekV3, "recipe", bias_zeroed)
    report = align_checkpoint(latent_checkpoint)
    assert not report.passed and report.layers[0].max_abs < 1e-5 and report.layers[1].max_abs > 1e-4


def test_routing_without_the_group_limit_is_caught(latent_checkpoint, monkeypatch):
    original = DeepseekV3.moe_fields
    monkeypatch.setattr(DeepseekV3, "moe_fields", lambda self, c: original(self, c) | {"n_group": 1, "topk_group": 1})
    report = align_checkpoint(latent_checkpoint)
    assert not report.passed and report.layers[0].max_abs < 1e-5 and report.layers[1].max_abs > 1e-4


def test_rotate_half_in_place_of_interleaved_rope_is_caught(latent_checkpoint, monkeypatch):
    monkeypatch.setattr(DeepseekV3, "rope_kind", lambda self, c: "half")
    report = align_checkpoint(latent_checkpoint, pin_routing=True)
    assert not report.passed and report.layers[0].max_abs > 1e-4


# YaRN as DeepSeek-V3 ships it (scaled here to the tiny context): the ramp spans the rotary dims, and mscale and
# mscale_all_dim differ so that both the cos/sin factor and the softmax-scale factor differ from 1.
YARN = {
    "rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "original_max_position_embeddings": 16,
    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8, "beta_slow": 1,
}


def test_yarn_rope_aligned_with_transformers(tiny_checkpoint):
    checkpoint = tiny_checkpoint(tiny_deepseek_v3(rope_parameters=YARN))
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert cfg.mla.yarn.attention_factor != 1.0 and cfg.mla.softmax_scale != (12 + 8) ** -0.5
    report = align_checkpoint(checkpoint, lora_targets=MLA_LORA_TARGETS)
    assert report.passed, report.failures


@pytest.mark.parametrize(
    "drop", [{"yarn": None}, {"softmax_scale": None}, {"yarn": {"attention_factor": 1.0}}],
    ids=["plain_rope", "unscaled_softmax", "unscaled_cos_sin"],
)
def test_yarn_parts_missing_are_caught(tiny_checkpoint, monkeypatch, drop):
    checkpoint = tiny_checkpoint(tiny_deepseek_v3(rope_parameters=YARN))
    original = DeepseekV3.mla_fields

    def without(self, c):
        fields = original(self, c)
        for key, value in drop.items():
            fields[key] = fields[key] | value if isinstance(value, dict) else value
        return fields

    monkeypatch.setattr(DeepseekV3, "mla_fields", without)
    report = align_checkpoint(checkpoint, pin_routing=True)
    # Aligned, the logits agree to ~3e-7; each missing part moves them by ~2e-3 on these short documents.
    assert not report.passed and report.logits.max_abs > 1e-3


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_config_names_the_field(latent_checkpoint):
    _edit_config(
        latent_checkpoint,
        hidden_act="gelu",
        attention_bias=True,
        scoring_func="softmax",
        quantization_config={"quant_method": "fp8"},
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(latent_checkpoint)
    problems = "\n".join(err.value.problems)
    for field in ("hidden_act ('gelu')", "attention_bias (True)", "scoring_func ('softmax')", "quantization_config",
                  "rope_parameters.rope_type ('dynamic')"):
        assert f"{field}" in problems and "is not mapped" in problems, field


def test_config_our_rules_refuse_is_reported_not_raised(latent_checkpoint):
    # transformers would build it (head_dim, the dims it rotates, equal to qk_rope_head_dim); our MLA needs an even
    # RoPE dim. The report names the field.
    _edit_config(latent_checkpoint, qk_rope_head_dim=7, head_dim=7)
    with pytest.raises(UnsupportedModel, match=r"mla\.qk_rope_head_dim \(7\) must be even"):
        model_profile_from_checkpoint(latent_checkpoint)


def test_finetune_from_checkpoint_starts_at_the_reference_loss(latent_checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(
        latent_checkpoint, lora={"target_modules": ["q_b_proj", "kv_b_proj", "o_proj"]}
    )
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
