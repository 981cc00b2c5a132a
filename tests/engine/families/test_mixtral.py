"""mixtral from a transformers checkpoint: softmax top-2 routing renormalised on every layer, experts stored as
block_sparse_moe.experts.{e}.w1/w2/w3, attention with neither q/k norm nor biases, causal or within a sliding window.
Alignment with the reference on packed documents (routing pinned or not, a window shorter than the documents, a
config.json in the hub's older flat form), wrong mappings caught, unsupported configs reported one line each, and a
short fine-tune whose first loss is the reference's."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families.base import stacked_experts
from moe_tune.engine.families.mixtral import MIXTRAL_ROPE_THETA, Mixtral

from hf_tiny import save_tiny_checkpoint, tiny_mixtral


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_mixtral(), tmp_path_factory.mktemp("mixtral") / "checkpoint")


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
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [("full", "moe"), ("full", "moe")]
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.score_func, moe.renormalize) == (
        5, 2, 24, "softmax", True
    )
    assert moe.shared_expert_intermediate_size == 0 and not moe.has_selection_bias and moe.routed_scaling == 1.0
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 12)
    assert not cfg.attention_qk_norm and not cfg.attention_bias and not cfg.attention_output_gate
    assert cfg.rope_theta == 5000.0 and cfg.partial_rotary_factor == 1.0 and cfg.rms_norm_eps == 1e-5


def test_packed_batch_aligned_with_transformers(checkpoint):
    # Our own routing (the wrong-mapping tests below run pinned, so the router hooks are exercised too).
    report = align_checkpoint(checkpoint)
    assert report.passed, report.failures
    assert len(report.layers) == 2 and max(row.rel for row in report.layers) < 1e-5
    assert report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # A and B of q, k, v, o in both layers, and of both expert projections of both (MoE) layers.
    assert len(report.lora_grads) == 2 * 4 * 2 + 2 * 2 * 2
    assert max(row.rel for row in report.lora_grads) < 1e-5


# Mixtral-8x7B's config.json: rope_theta at the top level and no rope_parameters (transformers reads either).
def test_flat_hub_config_read(config):
    flat = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 1234.0}
    assert Mixtral().to_profile(flat).rope_theta == 1234.0


def test_default_rope_theta_aligned(checkpoint, tmp_path):
    # No theta anywhere: both sides take MixtralConfig's default.
    directory = _copy_with_config(checkpoint, tmp_path / "flat", rope_parameters=None, torch_dtype="bfloat16",
                                  transformers_version="4.36.0.dev0")
    _, _, cfg = model_profile_from_checkpoint(directory)
    assert cfg.rope_theta == MIXTRAL_ROPE_THETA
    report = align_checkpoint(directory, pin_routing=True)
    assert report.passed, report.failures


def _swapped_gate_up(original):
    def recipe(self, name, module, cfg):
        if name.endswith("experts.w_gate_up"):
            base = "model." + name.removesuffix("mlp.experts.w_gate_up") + "block_sparse_moe.experts."
            return stacked_experts(module, lambda e: [f"{base}{e}.w3.weight", f"{base}{e}.w1.weight"])
        return original(self, name, module, cfg)

    return recipe


def _profile_changed(**update):
    original = Mixtral.to_profile
    return lambda self, config: original(self, config).model_copy(update=update)


# The window the tests' documents (23, 9 and 14 tokens) outgrow.
WINDOW = 6


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_mixtral(sliding_window=WINDOW), tmp_path_factory.mktemp("mixtral") / "windowed")


def test_sliding_window_aligned_with_transformers(windowed_checkpoint):
    _, _, cfg = model_profile_from_checkpoint(windowed_checkpoint)
    assert [layer.sliding_window for layer in cfg.layers] == [WINDOW, WINDOW]
    report = align_checkpoint(windowed_checkpoint)
    assert report.passed, report.failures
    assert max(row.rel for row in report.layers) < 1e-5 and report.logits.max_abs < 1e-5


@pytest.mark.parametrize("window", [WINDOW - 1, None], ids=["one_key_fewer", "no_window"])
def test_wrong_sliding_window_is_caught(windowed_checkpoint, monkeypatch, window):
    original = Mixtral.to_profile

    def with_window(self, config):
        cfg = original(self, config)
        return cfg.model_copy(update={"layers": [layer.model_copy(update={"sliding_window": window})
                                                 for layer in cfg.layers]})

    monkeypatch.setattr(Mixtral, "to_profile", with_window)
    report = align_checkpoint(windowed_checkpoint, pin_routing=True)
    assert not report.passed and report.layers[0].max_abs > 1e-4


@pytest.mark.parametrize("what", ["swapped_w1_w3", "not_renormalised"])
def test_wrong_mapping_is_caught(checkpoint, monkeypatch, what):
    if what == "swapped_w1_w3":
        monkeypatch.setattr(Mixtral, "recipe", _swapped_gate_up(Mixtral.recipe))
    else:
        cfg = model_profile_from_checkpoint(checkpoint)[2]
        monkeypatch.setattr(Mixtral, "to_profile", _profile_changed(moe=cfg.moe.model_copy(update={"renormalize": False})))
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert not report.passed
    assert report.layers[0].max_abs > 1e-4 and report.logits.max_abs > report.tolerances.logits_max_abs


# One change each, one line each: what is refused names the field, its value and the rule.
UNSUPPORTED = {
    "sliding_window_zero": ({"sliding_window": 0}, "config.json: sliding_window (0) must be >= 1"),
    "sliding_window_not_int": ({"sliding_window": 4096.5}, "config.json: sliding_window (4096.5) must be an integer"),
    "sliding_window_bool": ({"sliding_window": True}, "config.json: sliding_window (True) must be an integer"),
    "hidden_act": ({"hidden_act": "gelu"}, "config.json: hidden_act ('gelu') is not mapped: must be 'silu'"),
    "router_jitter_noise": ({"router_jitter_noise": 0.1}, "config.json: router_jitter_noise (0.1) is not mapped: "
                            "must be one of [0, 0.0] (no router jitter: training would not be transformers')"),
    "attention_dropout": ({"attention_dropout": 0.1}, "config.json: attention_dropout (0.1) is not mapped: must be "
                          "one of [0, 0.0] (no attention dropout)"),
    "quantization_config": ({"quantization_config": {"quant_method": "awq"}}, "config.json: quantization_config."
                            "quant_method ('awq') is not read: moe-tune reads quant_method fp8 with weight_block_size "
                            "[128, 128]"),
    "rope_type": ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0}},
                  "config.json: rope_parameters.rope_type ('dynamic') is not mapped: must be 'default'"),
    "top_k_over_experts": ({"num_experts_per_tok": 6}, "config.json: num_experts_per_tok (6) must be <= "
                           "num_local_experts (5)"),
    "no_experts": ({"num_local_experts": 0}, "config.json: num_local_experts (0) must be >= 1"),
    "no_expert_width": ({"intermediate_size": 0}, "config.json: intermediate_size (0) must be >= 1"),
    "heads_not_multiple": ({"num_key_value_heads": 3}, "config.json: num_attention_heads (4) must be a multiple of "
                           "num_key_value_heads (3)"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_is_one_line_naming_the_field(config, case):
    changes, line = UNSUPPORTED[case]
    with pytest.raises(UnsupportedModel) as err:
        Mixtral().to_profile({**config, **changes})
    assert err.value.problems == [line]


def test_unsupported_config_reports_every_problem_at_once(config):
    cases = ("sliding_window_zero", "hidden_act", "router_jitter_noise", "no_experts")
    changes = {k: v for case in cases for k, v in UNSUPPORTED[case][0].items()}
    with pytest.raises(UnsupportedModel) as err:
        Mixtral().to_profile({**config, **changes})
    assert sorted(err.value.problems) == sorted(UNSUPPORTED[case][1] for case in cases)


@pytest.mark.parametrize("is_present", [True, False], ids=["null_window", "no_window_key"])
def test_no_sliding_window_is_causal_attention(config, is_present):
    config = {k: v for k, v in config.items() if is_present or k != "sliding_window"}
    assert "sliding_window" in config if is_present else "sliding_window" not in config
    assert [(layer.attention, layer.sliding_window) for layer in Mixtral().to_profile(config).layers] == [
        ("full", None), ("full", None)
    ]


def test_align_cli_refuses_a_bad_config_value(checkpoint, tmp_path):
    directory = _copy_with_config(checkpoint, tmp_path / "jitter", router_jitter_noise=0.1)
    result = CliRunner().invoke(app, ["align", "--reference", str(directory)])
    assert result.exit_code == 2
    assert "router_jitter_noise (0.1) is not mapped" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
