"""Sequence chunks of the token mixers (engine/model/mixer_chunks.py): every layer kind run slab by slab (linear
attention carrying its state and conv halo; softmax attention chunk of queries by chunk over the keys each sees)
equals the layer on the whole row: output, input gradient and every parameter gradient within 1e-5 (fp32, CPU
reference paths), the sparse layers' selection exactly; a 4,096-token row of a small hybrid model has the loss and
gradients of the unchunked model."""

import pytest
import torch
from torch import nn

from moe_tune.engine.lora import inject_lora
from moe_tune.engine.model.attention import build_token_mixer
from moe_tune.engine.model.batch import PackedBatch
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.engine.model.model import build_model
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import LayerSpec, LoraProfile, ModelProfile

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
ROW_TOKENS, CHUNK = 96, 24
# Document starts of the row; slabs start at 0, 24, 48, 72.
LAYOUTS = {
    # crossing 24 and 72, one starting exactly at 48, short ones inside a slab
    "mixed": [0, 5, 30, 48, 51, 55, 96],
    # one document over every slab
    "one-document": [0, 96],
    # starting exactly at every slab, plus one a token before a slab (its halo crosses two documents)
    "at-boundaries": [0, 24, 47, 48, 72, 96],
}
LINEAR = load_profile("tiny").model.linear_attention.model_dump()
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
# (layer spec, ModelProfile overrides); sparse budgets below the documents' lengths, so the selection matters.
CASES = {
    "linear-scalar": ({"attention": "linear"}, {}),
    "linear-per-channel": ({"attention": "linear"}, {"linear_attention": {**LINEAR, "decay": "per_channel"}}),
    "kda": ({"attention": "kda"}, {"kda_attention": {"num_heads": 2, "head_dim": 16}}),
    "full": ({"attention": "full"}, {}),
    "full-window-sinks": (
        {"attention": "full", "sliding_window": 7}, dict(attention_sinks=True, attention_output_gate=False)
    ),
    "sparse-token": ({"attention": "sparse"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=6))),
    "sparse-block": (
        {"attention": "sparse"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=12, block_size=4))
    ),
    "qsa-block": (
        {"attention": "qsa"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=8, block_size=4))
    ),
    "qsa-token": ({"attention": "qsa"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=6))),
    "mla": ({"attention": "mla"}, dict(mla=MLA)),
    "mla-no-rope-no-q-latent": ({"attention": "mla"}, dict(mla=dict(MLA, q_lora_rank=None, rope="none"))),
    "mla-sparse-token": (
        {"attention": "mla_sparse"}, dict(mla=MLA, sparse_attention=dict(index_heads=2, index_head_dim=8, topk=6))
    ),
    "mla-sparse-block": (
        {"attention": "mla_sparse"},
        dict(mla=dict(MLA, rope="half"), sparse_attention=dict(index_heads=2, index_head_dim=8, topk=8, block_size=4)),
    ),
}
LINEAR_CASES = ("linear-scalar", "linear-per-channel", "kda")
LOSS_SCALE = 0.01


def build_mixer(name: str) -> nn.Module:
    layer, overrides = CASES[name]
    base = load_profile("tiny").model.model_dump()
    base.update(layers=[layer], **overrides)
    cfg = ModelProfile.model_validate(base)
    torch.manual_seed(0)
    mixer = build_token_mixer(cfg, LayerSpec.model_validate(layer))
    with torch.no_grad():
        for p in mixer.parameters():
            if p.dim() == 1:
                # Norm weights and sinks away from their init, so that each of them matters.
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(std=0.2)
        if name in LINEAR_CASES:
            # Decay rates exp(A_log) near 0.1: the state entering a slab still weighs on its outputs.
            mixer.A_log.uniform_(-2.5, -2)
    return mixer


def selector(mixer: nn.Module) -> nn.Module | None:
    if hasattr(mixer, "indexer"):
        return mixer.indexer
    return mixer if hasattr(mixer, "pin_selection") else None


def run(mixer: nn.Module, layout: str, chunk: int | None):
    """Output, input gradient, every parameter gradient and (sparse layers) the selection of one forward and
    backward of sum(mixer(x) * weights) on the row."""
    cu = torch.tensor(LAYOUTS[layout], dtype=torch.int32)
    batch = PackedBatch(cu, document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS))
    gen = torch.Generator().manual_seed(len(layout))
    width = mixer.o_proj.out_features
    x = torch.randn(1, ROW_TOKENS, width, generator=gen).requires_grad_()
    # Small loss weights: gradients of order one, whose fp32 rounding (~1e-7 relative) stays below the tolerance.
    weights = torch.randn(1, ROW_TOKENS, width, generator=gen) * LOSS_SCALE
    mixer.sequence_chunk_tokens = chunk
    mixer.zero_grad(set_to_none=True)
    out = mixer(x, batch)
    (out * weights).sum().backward()
    grads = {name: p.grad for name, p in mixer.named_parameters() if p.grad is not None}
    selection = None
    chooser = selector(mixer)
    if chooser is not None:
        # The selection is read with the layer run whole (a logged layer runs whole), compared below with the
        # selection the chunks made, read back through a pinned forward.
        chooser.selection_log = []
        with torch.no_grad():
            mixer(x, batch)
        selection = chooser.selection_log[0]
        chooser.selection_log = None
    return out.detach(), x.grad, grads, selection


def chunk_selection(mixer: nn.Module, layout: str, chunk: int) -> torch.Tensor:
    """The selection the chunked layer makes: each chunk's topk_indexer call over its span, joined."""
    from moe_tune.engine.model import attention_context

    chosen = []
    original = attention_context.KeySpan.topk_indexer

    def logged(span, *args, **kw):
        indices = original(span, *args, **kw)
        chosen.append(span.row_indices(indices, kw["block_size"]))
        return indices

    attention_context.KeySpan.topk_indexer = logged
    try:
        cu = torch.tensor(LAYOUTS[layout], dtype=torch.int32)
        batch = PackedBatch(cu, document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS))
        x = torch.randn(1, ROW_TOKENS, mixer.o_proj.out_features, generator=torch.Generator().manual_seed(len(layout)))
        mixer.sequence_chunk_tokens = chunk
        with torch.no_grad():
            mixer(x, batch)
    finally:
        attention_context.KeySpan.topk_indexer = original
    return torch.cat(chosen, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_mixer_equals_whole_row(name):
    mixer = build_mixer(name)
    for layout in LAYOUTS:
        out, x_grad, grads, selection = run(mixer, layout, None)
        got_out, got_x_grad, got_grads, _ = run(mixer, layout, CHUNK)
        torch.testing.assert_close(got_out, out, **TOLERANCE, msg=f"{layout}: output")
        torch.testing.assert_close(got_x_grad, x_grad, **TOLERANCE, msg=f"{layout}: dx")
        assert set(got_grads) == set(grads) and grads, layout
        for param, grad in grads.items():
            torch.testing.assert_close(got_grads[param], grad, **TOLERANCE, msg=f"{layout}: {param}'s gradient")
        if selection is not None:
            assert torch.equal(chunk_selection(mixer, layout, CHUNK), selection), f"{layout}: selection"
            # The budget is below the documents' lengths: the selection leaves keys out.
            assert bool((selection < 0).any()) or selection.shape[-1] < ROW_TOKENS


@pytest.mark.parametrize("name", ["sparse-token", "sparse-block", "qsa-block", "mla-sparse-token"])
def test_backward_takes_each_chunks_selection_instead_of_scoring_again(name, monkeypatch):
    # The indexer's scores grow with the span: each chunk scores its queries once, in forward; the chunk's
    # recomputation in backward takes the selection it kept.
    from moe_tune.engine.model import attention_context

    calls = []
    original = attention_context.KeySpan.topk_indexer

    def counted(span, *args, **kw):
        calls.append(torch.is_grad_enabled())
        return original(span, *args, **kw)

    monkeypatch.setattr(attention_context.KeySpan, "topk_indexer", counted)
    mixer = build_mixer(name)
    _, x_grad, grads, _ = run(mixer, "one-document", CHUNK)
    # One call a chunk, then the whole-row logged run's (run() reads the selection with the layer run whole, which
    # does not go through KeySpan).
    assert len(calls) == ROW_TOKENS // CHUNK and not any(calls)
    assert x_grad is not None and grads


@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_chunks_keep_the_slab_inputs_and_states(name):
    """What a chunked linear layer saves for backward: the slabs' input rows (views of x) and one [H, K, V] fp32
    state a continued slab; unchunked, its [T, 2 Hk K + Hv V] projections among much more."""
    mixer = build_mixer(name)
    cu = torch.tensor([0, ROW_TOKENS], dtype=torch.int32)
    batch = PackedBatch(cu, document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS))
    x = torch.randn(1, ROW_TOKENS, mixer.o_proj.out_features, requires_grad=True)
    saved = {}
    for chunk in (None, CHUNK):
        mixer.sequence_chunk_tokens = chunk
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mixer(x, batch).sum().backward()
        saved[chunk] = sizes
    width = x.shape[-1]
    assert max(saved[None]) > ROW_TOKENS * width
    assert max(saved[CHUNK]) <= ROW_TOKENS * width


# ---- the 4K-token row: a small hybrid model, chunked and whole ----

HYBRID_LAYERS = [
    {"attention": "linear", "mlp": "moe"},
    {"attention": "sparse", "mlp": "moe"},
    {"attention": "kda", "mlp": "moe"},
    {"attention": "sparse", "mlp": "dense"},
]


def hybrid_step(chunk: int | None) -> dict:
    raw = load_profile("tiny").model.model_dump(mode="json")
    raw.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
               layers=HYBRID_LAYERS, kda_attention={"num_heads": 2, "head_dim": 8})  # fmt: skip
    raw["linear_attention"].update(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=8)
    # Block level, 4 blocks of 16 keys: far below the documents' lengths.
    raw["sparse_attention"].update(index_heads=2, index_head_dim=8, topk=64, block_size=16)
    raw["moe"].update(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16)
    cfg = ModelProfile.model_validate(raw)
    torch.manual_seed(0)
    lora = LoraProfile(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], experts=True)
    model = inject_lora(build_model(cfg), lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.base_model.model.set_sequence_chunk_tokens(chunk)
    model.train()
    num_tokens = 4096
    ids = torch.randint(0, 259, (1, num_tokens), generator=torch.Generator().manual_seed(2))
    # Documents crossing the chunks' bounds, one starting exactly at 2048.
    cu = torch.tensor([0, 1500, 2048, 3000, num_tokens], dtype=torch.int32)
    out = model(input_ids=ids, cu_seqlens=cu, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), **grads}


def test_4096_token_hybrid_row_equals_whole_row():
    expected, got = hybrid_step(None), hybrid_step(1024)
    assert got.keys() == expected.keys() and len(expected) > 10
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, **TOLERANCE, msg=name)


# ---- context parallelism: a rank's share longer than the chunk runs as one recomputed chunk ----

CP_LAYOUT = "mixed"


def _chunked_share(rank: int, size: int, name: str):
    import pickle

    from moe_tune.engine.parallel.context import ContextShard

    mixer = build_mixer(name)
    mixer.sequence_chunk_tokens = CHUNK
    cu = torch.tensor(LAYOUTS[CP_LAYOUT], dtype=torch.int32)
    gen = torch.Generator().manual_seed(len(CP_LAYOUT))
    width = mixer.o_proj.out_features
    x = torch.randn(1, ROW_TOKENS, width, generator=gen)
    weights = torch.randn(1, ROW_TOKENS, width, generator=gen) * LOSS_SCALE
    shard = ContextShard.of_row(cu, torch.distributed.group.WORLD, rank, size)
    batch = PackedBatch(shard.local_cu_seqlens(), shard.local(document_positions(cu, ROW_TOKENS)),
                        shard.local(document_ids(cu, ROW_TOKENS)), context=shard)  # fmt: skip
    x_local = shard.local(x, 1).clone().requires_grad_()
    recomputations = []
    original = mixer.forward_whole
    mixer.forward_whole = lambda *args: recomputations.append(1) or original(*args)
    out = mixer(x_local, batch)
    (out * shard.local(weights, 1)).sum().backward()
    grads = {n: p.grad for n, p in mixer.named_parameters() if p.grad is not None}
    return pickle.dumps((out.detach(), x_local.grad, grads, len(recomputations)))


@pytest.mark.dist
@pytest.mark.parametrize("name", ["linear-scalar", "kda", "sparse-block", "mla-sparse-token"])
def test_context_parallel_shares_run_as_one_recomputed_chunk(name):
    import pickle

    from context_ranks import run_ranks

    ranks = [pickle.loads(r) for r in run_ranks(_chunked_share, 2, name)]
    out, x_grad, grads, _ = run(build_mixer(name), CP_LAYOUT, None)
    torch.testing.assert_close(torch.cat([r[0] for r in ranks], 1), out, **TOLERANCE)
    torch.testing.assert_close(torch.cat([r[1] for r in ranks], 1), x_grad, **TOLERANCE)
    for param, grad in grads.items():
        torch.testing.assert_close(sum(r[2][param] for r in ranks), grad, **TOLERANCE, msg=param)
    # Each rank's share (48 tokens, chunks of 24) ran whole, and again when backward recomputed it.
    assert [r[3] for r in ranks] == [2, 2]


@pytest.mark.parametrize("name", ["linear-scalar", "sparse-block", "mla"])
def test_a_row_of_one_chunk_runs_whole_recomputed_bitwise(name):
    # A row of at most one chunk is the mixer's one chunk: the unchunked code under activation checkpoint (the
    # memory policy makes no recompute region in a chunked mixer), bitwise the plain run.
    mixer = build_mixer(name)
    expected = run(mixer, "mixed", None)
    runs = []
    original = mixer.forward_whole
    mixer.forward_whole = lambda *args: runs.append(1) or original(*args)
    got = run(mixer, "mixed", ROW_TOKENS)
    # Forward and its recomputation in backward; a sparse layer's selection, read with its log set, runs plainly.
    assert len(runs) == 2 + (selector(mixer) is not None)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(torch.equal(got[2][param], grad) for param, grad in expected[2].items())
