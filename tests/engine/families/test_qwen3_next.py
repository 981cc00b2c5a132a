"""qwen3_next from a transformers checkpoint: alignment with Qwen3NextForCausalLM (every layer, logits, KL, loss,
LoRA and weight gradients; packed documents against per-document runs), wrong mappings caught, unsupported configs
reported, and a short fine-tune whose first loss is the reference's."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import QWEN_HYBRID_TEXT, save_tiny_checkpoint, tiny_qwen3_next
from hybrid_reference import (
    KL_MAX,
    assert_gradients_match,
    assert_matches,
    documents,
    kl,
    load_ours,
    load_reference,
    run_ours,
    run_reference,
)

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint, qwen3_next

HK, HV = QWEN_HYBRID_TEXT["linear_num_key_heads"], QWEN_HYBRID_TEXT["linear_num_value_heads"]
DK, DV = QWEN_HYBRID_TEXT["linear_key_head_dim"], QWEN_HYBRID_TEXT["linear_value_head_dim"]
HIDDEN, VOCAB = QWEN_HYBRID_TEXT["hidden_size"], QWEN_HYBRID_TEXT["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_qwen3_next(), tmp_path_factory.mktemp("qwen3_next") / "checkpoint")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def test_profile_read_from_config(checkpoint):
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert family.reference_class == "Qwen3NextForCausalLM"
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [
        ("linear", "moe"), ("full", "moe"), ("linear", "dense"), ("full", "moe")
    ]
    spec = cfg.linear_attention
    assert (spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim) == (HK, HV, DK, DV)
    assert cfg.norm_one_plus and cfg.attention_output_gate and cfg.partial_rotary_factor == 0.5
    assert cfg.moe.renormalize and cfg.moe.shared_expert_intermediate_size == 20 and cfg.moe.shared_expert_gate
    assert cfg.intermediate_size == 40


@pytest.mark.parametrize("pin", [False, True])
def test_aligned_with_transformers(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin)
    assert report.passed, report.failures
    assert len(report.layers) == 4 and report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # LoRA on q, k, v, o of the full layers and o (out_proj) of the linear ones (their q, k, v are slices of
    # in_proj_qkvz), A and B; and on the experts of the 3 MoE layers.
    assert sum(".self_attn." in row.name for row in report.lora_grads) == (2 * 4 + 2) * 2
    assert {row.name.split(".mlp.")[0] for row in report.lora_grads if ".experts." in row.name} == {
        "layers.0", "layers.1", "layers.3"
    }


def test_long_document_matches_causal_lm(checkpoint, reference):
    # 70 tokens: the reference's chunked delta rule crosses its 64-token chunk boundary.
    docs = documents((70,), VOCAB)
    with torch.no_grad():
        assert_matches(run_ours(load_ours(checkpoint), docs), run_reference(reference, docs))


def test_weight_gradients_match_reference(checkpoint, reference):
    reference.zero_grad(set_to_none=True)
    ours = load_ours(checkpoint)
    docs = documents((23, 9, 40), VOCAB, seed=2)
    run_ours(ours, docs, backward=True)
    run_reference(reference, docs, backward=True)
    ref = {name: p.grad for name, p in reference.named_parameters()}
    group = HV // HK
    # transformers' in_proj_qkvz rows: per key head [q (K) | k (K) | v (G*V) | z (G*V)]; in_proj_ba: [b (G) | a (G)].
    qkvz = ref["model.layers.0.linear_attn.in_proj_qkvz.weight"].view(HK, 2 * DK + 2 * group * DV, HIDDEN)
    ba = ref["model.layers.0.linear_attn.in_proj_ba.weight"].view(HK, 2 * group, HIDDEN)
    # A_log and dt_bias are left out: their gradients are sums over tokens that nearly cancel, and transformers' own
    # chunked and token-by-token delta rules disagree on them by ~1e-4 of their scale (their forward is compared).
    assert_gradients_match(
        {
            "layers.0.self_attn.k_proj.weight": qkvz[:, DK : 2 * DK].reshape(-1, HIDDEN),
            "layers.0.self_attn.z_proj.weight": qkvz[:, 2 * DK + group * DV :].reshape(-1, HIDDEN),
            "layers.0.self_attn.a_proj.weight": ba[:, group:].reshape(-1, HIDDEN),
            "layers.0.self_attn.conv.weight": ref["model.layers.0.linear_attn.conv1d.weight"][:, 0],
            "layers.0.self_attn.norm.weight": ref["model.layers.0.linear_attn.norm.weight"],
            "layers.1.self_attn.k_norm.weight": ref["model.layers.1.self_attn.k_norm.weight"],
            "layers.1.mlp.experts.w_gate_up": ref["model.layers.1.mlp.experts.gate_up_proj"],
            "layers.1.mlp.shared_expert_gate.weight": ref["model.layers.1.mlp.shared_expert_gate.weight"],
            "layers.2.mlp.up_proj.weight": ref["model.layers.2.mlp.up_proj.weight"],
            "layers.3.input_layernorm.weight": ref["model.layers.3.input_layernorm.weight"],
        },
        ours,
    )


def test_ungrouped_qkvz_is_caught(checkpoint, monkeypatch):
    # Reading in_proj_qkvz / in_proj_ba as [all q | all k | all v | all z] (no per-key-head groups).
    grouped = qwen3_next.grouped_rows
    monkeypatch.setattr(
        qwen3_next, "grouped_rows", lambda key, n, sizes, part: grouped(key, 1, [n * s for s in sizes], part)
    )
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert not report.passed
    assert report.layers[0].max_abs > 1e-4 and report.logits.max_abs > report.tolerances.logits_max_abs


def test_plain_norms_are_caught(checkpoint, reference):
    # Reading the (1 + w) norms as plain-scale ones.
    docs = documents((23, 9), VOCAB)
    with torch.no_grad():
        ours = run_ours(load_ours(checkpoint, norm_one_plus=False), docs)
        ref = run_reference(reference, docs)
    assert kl(ref.logits_TV, ours.logits_TV) > 100 * KL_MAX


def test_unsupported_config_values_are_named(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(
        hidden_act="gelu",
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(tmp_path)
    assert err.value.problems == [
        "config.json: hidden_act ('gelu') is not mapped: must be 'silu' (also the conv activation of the linear "
        "layers)",
        "config.json: layer_types[1] ('sliding_attention') is not mapped: must be one of ['linear_attention', "
        "'full_attention']",
        "config.json: rope_parameters.rope_type ('yarn') is not mapped: must be 'default'",
    ]


def test_inconsistent_heads_are_reported_not_raised(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(linear_num_value_heads=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=r"num_value_heads \(3\) must be a multiple of .*num_key_heads \(2\)"):
        model_profile_from_checkpoint(tmp_path)


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_rotary_share_defaults_to_a_quarter(checkpoint, tmp_path):
    # transformers rotates a quarter of each head when the config does not say (Qwen3NextConfig.__post_init__).
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, _, cfg = model_profile_from_checkpoint(tmp_path)
    assert cfg.partial_rotary_factor == 0.25


def test_fields_without_a_safe_default_are_required(tiny_checkpoint):
    # transformers' class defaults (2 KV heads, head_dim 256, a 512-wide shared expert) are not what a fallback
    # would guess: a config without them is refused, naming each.
    import json

    from hf_tiny import tiny_qwen3_next

    directory = tiny_checkpoint(tiny_qwen3_next())
    config = json.loads((directory / "config.json").read_text())
    for key in ("head_dim", "num_key_value_heads", "shared_expert_intermediate_size"):
        config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    assert err.value.problems == [
        "config.json: num_key_value_heads is missing",
        "config.json: head_dim is missing",
        "config.json: shared_expert_intermediate_size is missing",
    ]
