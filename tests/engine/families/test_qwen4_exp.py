"""qwen4_exp (text part) from a transformers checkpoint: every decoder layer's residual streams, the logits and some
gradients equal the reference's on one document and on packed documents (each run alone by the reference), `moe-tune
align` passes and catches wrong mappings, unsupported configs are reported, and a short fine-tune starts at the
reference's loss.

Shapes: T packed tokens, S residual streams, D model dim, V vocabulary.
"""

import json

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.align.compare import load_ours, load_reference
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families import qwen4_exp as family_module
from moe_tune.engine.model.attention import QSAIndexer

from hf_tiny import QWEN4_EXP_TEXT, tiny_qwen4_exp, tiny_qwen4_exp_text

EOS = QWEN4_EXP_TEXT["eos_token_id"]
BLOCK = QWEN4_EXP_TEXT["indexer_compress_ratio"]
KEPT_BLOCKS = QWEN4_EXP_TEXT["indexer_budget"] // BLOCK
# fp32 against fp32: the logits and KL bounds; hidden states and gradients relative to the reference's max.
LOGITS_MAX_ABS, KL_MAX, HIDDEN_REL, GRAD_REL = 1e-4, 1e-6, 1e-5, 1e-4
# Our parameter -> the reference's (under model.language_model.), gradients compared: an n-gram table, a hyper-
# connection, the final mixer, a linear layer's beta input, a QSA layer's query and the routed experts. Not the decay
# parameters (a_proj, A_log, dt_bias): with the perturbed A_log the state forgets within a step or two, their
# gradients are ~1e-8 and fp32 rounding alone moves them by 30% (ours in fp32 against ours in fp64).
GRADIENT_PAIRS = {
    "layers.0.ngram.embedding.table.weight": "layers.0.ple.ple_embedding.ngram_embedding.weight",
    "layers.0.attn_hyper_connection.mix_down.weight": "layers.0.attn_hyper_connection.input_mix_weight_down.weight",
    "norm.mix_up.weight": "hyper_connection_mixer.input_mix_weight_up.weight",
    "layers.2.self_attn.b_proj.weight": "layers.2.linear_attn.in_proj_b.weight",
    "layers.3.self_attn.q_proj.weight": "layers.3.self_attn.q_proj.weight",
    "layers.1.mlp.experts.w_down": "layers.1.mlp.experts.down_proj",
}


def documents(lengths, seed=0):
    """Random token documents with an eos inside the first (n-grams must restart after it) and none at the ends
    (packed n-grams must still restart at every document)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(EOS + 1, QWEN4_EXP_TEXT["vocab_size"], (n,), generator=gen) for n in lengths]
    docs[0][len(docs[0]) // 3] = EOS
    return docs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tiny_qwen4_exp(), tmp_path_factory.mktemp("qwen4_exp") / "checkpoint")


def test_profile_read_from_config(checkpoint):
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert type(family).__name__ == "Qwen4Exp"
    assert [(layer.attention, layer.has_ngram_embedding) for layer in cfg.layers] == [
        ("linear", True), ("qsa", False), ("linear", True), ("qsa", False)
    ]
    assert (cfg.hyper_connections.num_streams, cfg.hyper_connections.mix_rank) == (3, 8)
    sa = cfg.sparse_attention
    assert (sa.index_heads, sa.index_head_dim, sa.topk, sa.block_size) == (8, 12, 8, 4)
    ngram = cfg.ngram_embedding
    assert (ngram.embed_dim, ngram.ngram_size, ngram.heads_per_ngram, ngram.boundary_token_id) == (16, 3, 2, EOS)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.renormalize, cfg.moe.shared_expert_intermediate_size) == (
        5, 2, True, 24
    )
    assert cfg.norm_one_plus and cfg.partial_rotary_factor == 0.5 and cfg.checkpoint == checkpoint


def run_both(checkpoint, docs):
    """Reference on each document alone, ours on the packed row; forward and backward of the summed next-token
    loss. Returns (per-layer (max abs, rel), logits max abs, KL, gradient rels, our QSA block choices)."""
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    reference, ours = load_reference(checkpoint, family), load_ours(cfg)
    ref_root = reference.model.language_model
    ref_hidden = [[] for _ in ref_root.layers]
    for i, layer in enumerate(ref_root.layers):
        layer.register_forward_hook(lambda _m, _i, out, i=i: ref_hidden[i].append(out[0].detach()))
    our_hidden, our_blocks = [], []
    for layer in ours.layers:
        layer.register_forward_hook(lambda _m, _i, out: our_hidden.append(out[0][0].detach()))
    for module in ours.modules():
        if isinstance(module, QSAIndexer):
            module.register_forward_hook(lambda _m, _i, out: our_blocks.append(out[0]))

    labelled = sum(len(d) - 1 for d in docs)
    ref_logits = []
    for doc in docs:
        logits = reference(input_ids=doc[None]).logits[0]
        (torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum") / labelled).backward()
        ref_logits.append(logits.detach())
    ids = torch.cat(docs)[None]
    cu_seqlens = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    out = ours(ids, cu_seqlens, labels)
    out.lm_loss.backward()

    layers = []
    for ref_h, our_h in zip(ref_hidden, our_hidden):
        ref_TW = torch.cat(ref_h)  # [T, S * D]: the streams as both models carry them
        diff = (our_h - ref_TW).abs().max().item()
        layers.append((diff, diff / ref_TW.abs().max().item()))
    ref_all, our_all = torch.cat(ref_logits), out.logits[0].detach()
    ref_logp, our_logp = ref_all.log_softmax(-1), our_all.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - our_logp)).sum(-1).mean().item()
    ref_params, our_params = dict(ref_root.named_parameters()), dict(ours.named_parameters())
    grads = {}
    for ours_name, ref_name in GRADIENT_PAIRS.items():
        g_ref, g_our = ref_params[ref_name].grad, our_params[ours_name].grad
        grads[ours_name] = ((g_our - g_ref).abs().max() / g_ref.abs().max()).item()
    return layers, (our_all - ref_all).abs().max().item(), kl, grads, our_blocks


@pytest.mark.parametrize("lengths", [(64,), (37, 23, 30)], ids=["one-document", "packed"])
def test_layers_logits_and_gradients_equal_transformers(checkpoint, lengths):
    layers, logits_max_abs, kl, grads, blocks = run_both(checkpoint, documents(lengths))
    assert max(rel for _, rel in layers) <= HIDDEN_REL, layers
    assert logits_max_abs <= LOGITS_MAX_ABS and kl <= KL_MAX, (logits_max_abs, kl)
    assert max(grads.values()) <= GRAD_REL, grads
    # QSA really drops blocks: late queries keep KEPT_BLOCKS complete blocks (+ the tail) of the many they see.
    for blocks_TS in blocks:
        assert blocks_TS.shape[-1] == KEPT_BLOCKS + 1
        last = blocks_TS[lengths[0] - 1]
        assert (last >= 0).sum() <= KEPT_BLOCKS + 1 < lengths[0] // BLOCK


def test_aligned_with_transformers(checkpoint):
    report = align_checkpoint(checkpoint, documents=documents((29, 18)))
    assert report.passed, report.failures
    assert len(report.layers) == 4 and max(row.rel for row in report.layers) <= HIDDEN_REL
    # LoRA pairs by checkpoint key: q, k, v, o of the QSA layers; only o (out_proj) of the linear layers, whose
    # q, k, v are slices of in_proj_qkv.
    names = {row.name for row in report.lora_grads}
    assert {"layers.1.self_attn.q_proj.lora_A", "layers.3.self_attn.v_proj.lora_B"} <= names
    assert "layers.0.self_attn.o_proj.lora_A" in names and "layers.0.self_attn.q_proj.lora_A" not in names


def swap_indexer_norms(original):
    def recipe(name, module, prefix="model."):
        for ours, other in (("q_layernorm", "k_layernorm"), ("k_layernorm", "q_layernorm")):
            if name.endswith(f"indexer.{ours}.weight"):
                return original(name.replace(ours, other), module, prefix)
        return original(name, module, prefix)

    return recipe


def reversed_shards(original):
    def recipe(base):
        build = original(base)
        return lambda get: torch.cat(build(get).chunk(QWEN4_EXP_TEXT["split_ngram_parts"])[::-1])

    return recipe


@pytest.mark.parametrize(
    "first_wrong_layer",
    [
        pytest.param(0, id="ngram-table-shards-reversed"),
        pytest.param(1, id="qsa-indexer-norms-swapped"),  # only the block choice changes
    ],
)
def test_wrong_mapping_is_caught(checkpoint, monkeypatch, first_wrong_layer):
    if first_wrong_layer == 0:
        monkeypatch.setattr(family_module, "sharded_rows", reversed_shards(family_module.sharded_rows))
    else:
        monkeypatch.setattr(family_module, "qwen_recipe", swap_indexer_norms(family_module.qwen_recipe))
    # Experts pinned; the block selection stays ours (a pinned one would hide the wrong indexer).
    report = align_checkpoint(checkpoint, documents=documents((29, 18)), pin_routing=True, pin_selection=False)
    assert not report.passed
    assert all(row.rel <= HIDDEN_REL for row in report.layers[:first_wrong_layer])
    if first_wrong_layer == 1:
        assert report.selections[0].differed > 0  # the swapped norms change which blocks layer 1 picks
    assert report.layers[first_wrong_layer].rel > 1e-3
    assert report.logits.max_abs > LOGITS_MAX_ABS


def test_text_only_checkpoint_equals_transformers(tiny_checkpoint):
    directory = tiny_checkpoint(tiny_qwen4_exp_text())
    family, _, cfg = model_profile_from_checkpoint(directory)
    assert type(family).__name__ == "Qwen4ExpText"
    (doc,) = documents((30,))
    with torch.no_grad():
        expected = load_reference(directory, family)(input_ids=doc[None]).logits[0]
        logits = load_ours(cfg)(doc[None], torch.tensor([0, len(doc)], dtype=torch.int32)).logits[0]
    assert (logits - expected).abs().max().item() <= LOGITS_MAX_ABS


def test_unsupported_config_names_the_field(tiny_checkpoint):
    directory = tiny_checkpoint(tiny_qwen4_exp(hidden_act="gelu", output_gate_type="silu", attention_bias=True))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    assert any("text_config.hidden_act ('gelu') is not mapped" in line for line in err.value.problems)
    assert any("text_config.attention_bias (True) is not mapped" in line for line in err.value.problems)


def test_values_transformers_would_refuse_are_reported_together(checkpoint, tmp_path):
    import shutil

    directory = shutil.copytree(checkpoint, tmp_path / "edited")
    config = json.loads((directory / "config.json").read_text())
    config["text_config"].update(indexer_kv_heads=2, ple_layer_ids=[1, 2], hc_count=1)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    problems = "\n".join(err.value.problems)
    assert "text_config.indexer_kv_heads (2) is not mapped" in problems
    assert "text_config.ple_layer_ids ([1, 2]) is not mapped: layer 2 is not a linear_attention layer" in problems
    assert "text_config.hc_count (1) is not mapped" in problems


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
