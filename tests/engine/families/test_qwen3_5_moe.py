"""qwen3_5_moe (text part): a tiny vision-language checkpoint built with transformers (every parameter perturbed),
its language model loaded into ours, compared with the text-only causal LM transformers builds from it
(AutoModelForCausalLM -> Qwen3_5MoeForCausalLM) in fp32: every layer, the logits, KL, the loss and weight gradients,
on one document and on a packed batch against per-document reference runs. Also the text-only checkpoint layout
(qwen3_5_moe_text)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import QWEN_HYBRID_TEXT, save_tiny_checkpoint, tiny_qwen3_5_moe, tiny_qwen3_5_moe_text
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
from moe_tune.engine.families import UnsupportedModel, load_checkpoint_weights, model_profile_from_checkpoint
from moe_tune.engine.model.model import build_model

HK, HV = QWEN_HYBRID_TEXT["linear_num_key_heads"], QWEN_HYBRID_TEXT["linear_num_value_heads"]
DK, DV = QWEN_HYBRID_TEXT["linear_key_head_dim"], QWEN_HYBRID_TEXT["linear_value_head_dim"]
VOCAB = QWEN_HYBRID_TEXT["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_qwen3_5_moe(), tmp_path_factory.mktemp("qwen3_5_moe") / "checkpoint")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_reference(checkpoint)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    return model


def test_profile_reads_the_text_config(checkpoint):
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert family.key_prefix == "model.language_model."
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [
        ("linear", "moe"), ("full", "moe"), ("linear", "moe"), ("full", "moe")
    ]
    spec = cfg.linear_attention
    assert (spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim) == (HK, HV, DK, DV)
    assert cfg.norm_one_plus and cfg.attention_output_gate and cfg.partial_rotary_factor == 0.5
    assert cfg.moe.renormalize and cfg.moe.shared_expert_intermediate_size == 20


def test_aligned_with_transformers(checkpoint):
    # align's reference is the checkpoint's own class (Qwen3_5MoeForConditionalGeneration) on text; routing pinned
    # to the reference's (its routers found by reference_router_suffix), unpinned in test_swapped_q_and_k_are_caught.
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert report.passed, report.failures
    layers = [row for row in report.layers if row.name.startswith("layer ")]
    assert len(layers) == 4 and report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # The vision tower's rows come first (the image documents: tests/engine/families/test_multimodal.py).
    assert [row.name for row in report.layers[:2]] == ["vision features", "merged embeddings"]
    # LoRA on q, k, v, o of the full layers and o (out_proj) of the linear ones, A and B; and on the experts.
    assert sum(".self_attn." in row.name for row in report.lora_grads) == (2 * 4 + 2) * 2
    assert sum(".experts." in row.name for row in report.lora_grads) > 0


def test_every_tensor_is_read_vision_tower_included(checkpoint):
    # load_checkpoint_weights reports any checkpoint tensor nothing read; model.visual.* goes to our vision tower.
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert cfg.vision is not None
    load_checkpoint_weights(build_model(cfg), cfg)


def test_one_document_matches_reference(checkpoint, reference):
    # 70 tokens: the reference's chunked delta rule crosses a 64-token chunk boundary.
    docs = documents((70,), VOCAB)
    with torch.no_grad():
        assert_matches(run_ours(load_ours(checkpoint), docs), run_reference(reference, docs))


def test_packed_batch_matches_per_document_reference(checkpoint, reference):
    docs = documents((23, 9, 40), VOCAB, seed=1)
    with torch.no_grad():
        ours, ref = run_ours(load_ours(checkpoint), docs), run_reference(reference, docs)
    assert_matches(ours, ref)


def test_gradients_match_reference(checkpoint, reference):
    reference.zero_grad(set_to_none=True)
    ours = load_ours(checkpoint)
    docs = documents((23, 9, 40), VOCAB, seed=2)
    run_ours(ours, docs, backward=True)
    run_reference(reference, docs, backward=True)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    key_dim = HK * DK
    qkv_grad = ref_grads["model.layers.2.linear_attn.in_proj_qkv.weight"]
    expected = {
        "layers.2.self_attn.q_proj.weight": qkv_grad[:key_dim],
        "layers.2.self_attn.v_proj.weight": qkv_grad[2 * key_dim :],
        "layers.2.self_attn.b_proj.weight": ref_grads["model.layers.2.linear_attn.in_proj_b.weight"],
        "layers.2.self_attn.conv.weight": ref_grads["model.layers.2.linear_attn.conv1d.weight"][:, 0],
        "layers.2.self_attn.norm.weight": ref_grads["model.layers.2.linear_attn.norm.weight"],
        "layers.2.self_attn.o_proj.weight": ref_grads["model.layers.2.linear_attn.out_proj.weight"],
        "layers.3.self_attn.q_norm.weight": ref_grads["model.layers.3.self_attn.q_norm.weight"],
        "layers.3.mlp.experts.w_down": ref_grads["model.layers.3.mlp.experts.down_proj"],
        "layers.3.mlp.gate.weight": ref_grads["model.layers.3.mlp.gate.weight"],
        "norm.weight": ref_grads["model.norm.weight"],
    }
    # A_log and dt_bias are left out, as in test_qwen3_next: near-cancelling sums, compared through the forward.
    assert_gradients_match(expected, ours)


def test_text_only_checkpoint_matches_reference(tmp_path):
    # A Qwen3_5MoeForCausalLM saved on its own: model_type qwen3_5_moe_text, a flat config, model.* keys.
    checkpoint = save_tiny_checkpoint(tiny_qwen3_5_moe_text(), tmp_path / "text")
    family, _, _ = model_profile_from_checkpoint(checkpoint)
    assert family.model_types == ("qwen3_5_moe_text",)
    docs = documents((23, 9), VOCAB)
    with torch.no_grad():
        assert_matches(run_ours(load_ours(checkpoint), docs), run_reference(load_reference(checkpoint), docs))


def _edit_config(checkpoint, tmp_path, edit):
    """A copy of the checkpoint directory whose config.json went through `edit` (a function of the dict)."""
    target = tmp_path / "edited"
    target.mkdir()
    for path in checkpoint.iterdir():
        (target / path.name).symlink_to(path)
    (target / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_unsupported_config_values_are_named(checkpoint, tmp_path):
    def edit(config):
        config["tie_word_embeddings"] = True
        config["text_config"]["attention_bias"] = True
        config["text_config"]["rope_parameters"]["rope_type"] = "yarn"

    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(_edit_config(checkpoint, tmp_path, edit))
    assert err.value.problems == [
        "config.json: tie_word_embeddings (True) is not mapped: must equal text_config.tie_word_embeddings (False)",
        "config.json: text_config.attention_bias (True) is not mapped: must be False",
        "config.json: text_config.rope_parameters.rope_type ('yarn') is not mapped: must be 'default'",
    ]


def test_missing_text_config_is_reported(checkpoint, tmp_path):
    with pytest.raises(UnsupportedModel, match="text_config is missing"):
        model_profile_from_checkpoint(_edit_config(checkpoint, tmp_path, lambda config: config.pop("text_config")))


def test_plain_norms_are_caught(checkpoint, reference):
    # Reading the (1 + w) norms as plain-scale ones: the comparison must catch it.
    docs = documents((23, 9), VOCAB)
    with torch.no_grad():
        ours, ref = run_ours(load_ours(checkpoint, norm_one_plus=False), docs), run_reference(reference, docs)
    assert kl(ref.logits_TV, ours.logits_TV) > 100 * KL_MAX


def test_swapped_q_and_k_are_caught(checkpoint, monkeypatch):
    from moe_tune.engine.families import qwen3_5_moe

    grouped = qwen3_5_moe.grouped_rows
    swapped = [1, 0, 2]  # read k's rows for q and q's for k
    monkeypatch.setattr(qwen3_5_moe, "grouped_rows", lambda key, n, sizes, part: grouped(key, n, sizes, swapped[part]))
    report = align_checkpoint(checkpoint)
    assert not report.passed
    layers = [row for row in report.layers if row.name.startswith("layer ")]
    assert layers[0].max_abs > 1e-4 and report.logits.max_abs > report.tolerances.logits_max_abs


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_fused_expert_layout_matches_reference(checkpoint, reference, tmp_path):
    # The published Qwen3.5 MoE checkpoints store each layer's experts fused (mlp.experts.gate_up_proj [E, 2F, D],
    # mlp.experts.down_proj [E, D, F]), as transformers 5 holds them: the state dict of the same weights, as it is.
    from hf_tiny import perturb_
    from safetensors.torch import save_file

    model = tiny_qwen3_5_moe()
    perturb_(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    docs = documents((23, 9), VOCAB)
    with torch.no_grad():
        assert_matches(run_ours(load_ours(tmp_path), docs), run_reference(reference, docs))


def test_fused_experts_read_only_this_ranks_rows(tmp_path):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from moe_tune.engine.families.checkpoint import CheckpointReader
    from moe_tune.engine.families.qwen3_next import fused_or_per_expert

    full = torch.arange(6 * 4 * 3, dtype=torch.float32).view(6, 4, 3)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": full}, str(tmp_path / "model.safetensors"))
    rank_experts = SimpleNamespace(first_expert=2, num_experts=3)  # the experts of rank 1 of 2 (E=6)
    recipe = fused_or_per_expert("layers.0.mlp.experts.w_gate_up", rank_experts, "model.")
    with CheckpointReader(tmp_path) as reader:
        assert torch.equal(recipe(reader), full[2:5])
        assert reader.read == {"model.layers.0.mlp.experts.gate_up_proj"}
