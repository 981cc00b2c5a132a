"""Context parallelism of the softmax attention layers (engine/model/attention_context.py): on 2 and 4 gloo ranks
sharing one packed row, every layer kind's outputs joined over the ranks, the input gradient and every parameter
gradient summed over the ranks equal one process's on the whole row (fp32, CPU reference paths), and the sparse
layers select exactly what one process selects (full attention and MLA gather the row's keys, the top-k layers fetch
their selected ones); the top-k layers fetch from earlier ranks exactly the units their selection needs."""

import pickle

import pytest
import torch
from torch import nn

from moe_tune.engine.model import attention_context
from moe_tune.engine.model.attention import PackedBatch, build_token_mixer
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.engine.model.model import build_model
from moe_tune.engine.parallel.context import ContextShard
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import LayerSpec, ModelProfile

from context_ranks import run_ranks

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
ROW_TOKENS = 48
# Document starts of the row. Rank shares start at 0, 24 (2 ranks) and 0, 12, 24, 36 (4 ranks).
LAYOUTS = {
    # in one rank, ending at a share boundary, starting at one (4 ranks) and crossing 24, crossing 36 (4 ranks)
    "mixed": [0, 5, 12, 30, 33, 48],
    # one document over every share: 4 ranks' rank 2 holds none of its own
    "long": [0, 3, 45, 48],
    # starting at 24 (2 ranks), crossing 12 and 36 (4 ranks)
    "at-boundaries": [0, 10, 24, 48],
}
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
# (layer spec, ModelProfile overrides); sparse budgets below the documents' lengths, so the selection matters.
CASES = {
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
    # block_size 1: QSA's indexer selects tokens (its block keys are single normed, rotated keys).
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


def build_mixer(name: str) -> nn.Module:
    layer, overrides = CASES[name]
    base = load_profile("tiny").model.model_dump()
    base.update(layers=[layer], **overrides)
    cfg = ModelProfile.model_validate(base)
    torch.manual_seed(0)
    mixer = build_token_mixer(cfg, LayerSpec.model_validate(layer))
    # Norm weights and sinks away from their init, so that each of them matters.
    with torch.no_grad():
        for p in mixer.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return mixer


def selector(mixer: nn.Module) -> nn.Module | None:
    """The module whose selection_log receives the layer's choice of keys (None: full attention)."""
    if hasattr(mixer, "indexer"):
        return mixer.indexer
    return mixer if hasattr(mixer, "pin_selection") else None


def row_inputs(mixer: nn.Module, layout: str):
    """The row's cu_seqlens, its input x [1, T, D] and the loss weights [1, T, D]."""
    gen = torch.Generator().manual_seed(len(layout))
    width = mixer.o_proj.out_features
    x = torch.randn(1, ROW_TOKENS, width, generator=gen)
    weights = torch.randn(1, ROW_TOKENS, width, generator=gen)
    return torch.tensor(LAYOUTS[layout], dtype=torch.int32), x, weights


def run_forward_backward(mixer: nn.Module, x, weights, batch: PackedBatch):
    """The output, the input's gradient, every parameter's gradient and the selection of one forward and backward."""
    mixer.zero_grad(set_to_none=True)
    chooser = selector(mixer)
    if chooser is not None:
        chooser.selection_log = []
    x = x.clone().requires_grad_()
    out = mixer(x, batch)
    (out * weights).sum().backward()
    grads = {name: p.grad for name, p in mixer.named_parameters() if p.grad is not None}
    selection = chooser.selection_log[0] if chooser is not None else None
    return out.detach(), x.grad, grads, selection


def one_process(mixer: nn.Module, layout: str):
    cu, x, weights = row_inputs(mixer, layout)
    batch = PackedBatch(cu, document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS))
    return run_forward_backward(mixer, x, weights, batch)


def _rank(rank: int, size: int, mixer: nn.Module):
    results = {}
    for layout in LAYOUTS:
        cu, x, weights = row_inputs(mixer, layout)
        shard = ContextShard.of_row(cu, torch.distributed.group.WORLD, rank, size)
        batch = PackedBatch(
            shard.local_cu_seqlens(), shard.local(document_positions(cu, ROW_TOKENS)),
            shard.local(document_ids(cu, ROW_TOKENS)), context=shard,
        )  # fmt: skip
        results[layout] = run_forward_backward(mixer, shard.local(x, 1), shard.local(weights, 1), batch)
    # Pickled here, by value: a tensor put on the queue as it is travels as a file descriptor of this process, which
    # may have exited before the test reads it.
    return pickle.dumps(results)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_one_process(name, size):
    mixer = build_mixer(name)
    ranks = [pickle.loads(r) for r in run_ranks(_rank, size, mixer)]
    for layout in LAYOUTS:
        out, x_grad, grads, selection = one_process(mixer, layout)
        parts = [r[layout] for r in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), out, **TOLERANCE, msg=f"{layout}: output")
        torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), x_grad, **TOLERANCE, msg=f"{layout}: dx")
        assert all(set(p[2]) == set(grads) for p in parts), layout
        for param, grad in grads.items():
            summed = sum(p[2][param] for p in parts)
            torch.testing.assert_close(summed, grad, **TOLERANCE, msg=f"{layout}: {param}'s gradient")
        if selection is not None:
            # The row's convention on every rank: token positions in the row, block ids local to the document.
            assert torch.equal(torch.cat([p[3] for p in parts], 1), selection), layout


def test_one_rank_shard_takes_the_unsharded_path():
    """A context group of one rank is the row held whole: the same calls, the same bits."""
    mixer = build_mixer("sparse-block")
    cu, x, weights = row_inputs(mixer, "mixed")
    positions, doc_ids = document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS)
    whole = run_forward_backward(mixer, x, weights, PackedBatch(cu, positions, doc_ids))
    shard = ContextShard.of_row(cu, None, 0, 1)
    held = run_forward_backward(mixer, x, weights, PackedBatch(cu, positions, doc_ids, context=shard))
    assert torch.equal(whole[0], held[0]) and torch.equal(whole[1], held[1])
    assert all(torch.equal(whole[2][name], held[2][name]) for name in whole[2])


# A decoder with every softmax kind and a linear layer between them: the layers' collectives interleave in backward.
MODEL_LAYERS = [
    {"attention": "linear", "mlp": "dense"}, {"attention": "full", "sliding_window": 5, "mlp": "dense"},
    {"attention": "qsa", "mlp": "dense"}, {"attention": "mla_sparse", "mlp": "dense"},
    {"attention": "mla", "mlp": "dense"}, {"attention": "sparse", "mlp": "dense"},
]


def build_decoder() -> nn.Module:
    base = load_profile("tiny").model.model_dump()
    base.update(
        layers=MODEL_LAYERS, intermediate_size=48, mla=MLA,
        sparse_attention=dict(index_heads=2, index_head_dim=8, topk=8, block_size=4),
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(ModelProfile.model_validate(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def decoder_rows():
    """cu_seqlens, input ids and labels [1, T] of the row."""
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 259, (2, 1, ROW_TOKENS), generator=gen)
    return torch.tensor(LAYOUTS["mixed"], dtype=torch.int32), ids, labels


def decoder_loss_and_grads(model: nn.Module, shard: ContextShard | None):
    cu, ids, labels = decoder_rows()
    model.zero_grad(set_to_none=True)
    if shard is None:
        out = model(ids, cu, labels=labels, loss_denominator=float(ROW_TOKENS))
    else:
        out = model(shard.local(ids), shard.local_cu_seqlens(), labels=shard.local(labels),
                    loss_denominator=float(ROW_TOKENS), context=shard)  # fmt: skip
    out.loss.backward()
    return out.loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _decoder_rank(rank: int, size: int, model: nn.Module):
    shard = ContextShard.of_row(decoder_rows()[0], torch.distributed.group.WORLD, rank, size)
    return pickle.dumps(decoder_loss_and_grads(model, shard))


@pytest.mark.parametrize("size", [2, 4])
def test_decoder_with_every_softmax_kind_equals_one_process(size):
    """The row's loss (each rank's share of it summed) and every parameter's gradient (summed over ranks)."""
    model = build_decoder()
    ranks = [pickle.loads(r) for r in run_ranks(_decoder_rank, size, model)]
    loss, grads = decoder_loss_and_grads(model, None)
    torch.testing.assert_close(sum(r[0] for r in ranks), loss, **TOLERANCE)
    assert all(set(r[1]) == set(grads) for r in ranks)
    for name, grad in grads.items():
        torch.testing.assert_close(sum(r[1][name] for r in ranks), grad, **TOLERANCE, msg=name)


# The traffic of the top-k layers: a rank fetches from the earlier ranks only the units (blocks; pages of TOKEN_PAGE
# span rows at token level) that the queries of its continued document selected. Row of 128 tokens, 4 ranks (shares
# start at 0, 32, 64, 96): rank 1 continues the document begun at 20, rank 2 its last 6 queries, rank 3 the one begun
# at 70 (block ids count from the document's start, not the row's).
TRAFFIC_ROW = [0, 20, 70, 128]
TRAFFIC_RANKS = 4
# Block level selects a few blocks out of many, so the union stays below the span; at token level random scores
# reach every page, so those cases zero the indexer's keys (is_concentrated): every score ties, the lowest positions
# win, and every query selects its document's first keys.
TRAFFIC_CASES = {
    "sparse-token": True, "sparse-block": False, "qsa-token": True, "qsa-block": False, "mla-sparse-token": True,
    "mla-sparse-block": False,
}  # fmt: skip


def concentrate_selection(mixer: nn.Module) -> None:
    """Zeroes the indexer's keys (SparseAttention's, QSA's raw ones, the lightning indexer's after its LayerNorm)."""
    with torch.no_grad():
        if hasattr(mixer, "index_k_proj"):
            mixer.index_k_proj.weight.zero_()
        elif hasattr(mixer.indexer, "index_qk_proj"):
            mixer.indexer.index_qk_proj.weight[-mixer.indexer.head_dim :].zero_()
        else:
            mixer.indexer.wk.weight.zero_()
            mixer.indexer.k_norm.bias.zero_()


def traffic_inputs(mixer: nn.Module):
    num_tokens = TRAFFIC_ROW[-1]
    cu = torch.tensor(TRAFFIC_ROW, dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    x, weights = torch.randn(2, 1, num_tokens, mixer.o_proj.out_features, generator=gen)
    return cu, x, weights, PackedBatch(cu, document_positions(cu, num_tokens), document_ids(cu, num_tokens))


def _traffic_rank(rank: int, size: int, mixer: nn.Module):
    cu, x, weights, row = traffic_inputs(mixer)
    shard = ContextShard.of_row(cu, torch.distributed.group.WORLD, rank, size)
    batch = PackedBatch(shard.local_cu_seqlens(), shard.local(row.positions), shard.local(row.doc_ids), context=shard)
    attention_context.fetch_log = []
    run_forward_backward(mixer, shard.local(x, 1), shard.local(weights, 1), batch)
    (fetch,) = attention_context.fetch_log
    return pickle.dumps((fetch.rows, fetch.row_bytes, fetch.bytes_received))


def expected_fetch(selection: torch.Tensor, block_size: int, rank: int) -> tuple[list[int], int]:
    """From one process's selection [1, T, S] (the row's convention): the row tokens rank `rank` needs from the
    earlier ranks, and the keys of its span held there."""
    share = TRAFFIC_ROW[-1] // TRAFFIC_RANKS
    start = rank * share
    first = max(b for b in TRAFFIC_ROW if b <= start)
    end = min(b for b in TRAFFIC_ROW if b > start)
    unit = block_size if block_size > 1 else attention_context.TOKEN_PAGE
    rows = set()
    for t in range(start, min(end, start + share)) if first < start else range(0):
        for index in selection[0, t].tolist():
            # Token level: a row position; block level: a block id counted from the document's start.
            offset = index - first if block_size == 1 else index * block_size
            if index >= 0 and offset < start - first:
                page = offset // unit * unit
                rows.update(range(first + page, min(first + page + unit, start)))
    return sorted(rows), start - first


@pytest.mark.parametrize("name", list(TRAFFIC_CASES))
def test_ranks_fetch_the_selected_units_of_earlier_ranks(name):
    mixer = build_mixer(name)
    if TRAFFIC_CASES[name]:
        concentrate_selection(mixer)
    ranks = [pickle.loads(r) for r in run_ranks(_traffic_rank, TRAFFIC_RANKS, mixer)]
    chooser = selector(mixer)
    _, x, weights, row = traffic_inputs(mixer)
    selection = run_forward_backward(mixer, x, weights, row)[3]
    # Keys and values of every kv head; MLA: the normed kv latent and the rope key. fp32.
    if "mla" in name:
        row_bytes = 4 * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])
    else:
        row_bytes = 4 * 2 * mixer.num_kv_heads * mixer.head_dim
    num_fetched = num_span = 0
    for rank, (rows, fetched_row_bytes, num_bytes) in enumerate(ranks):
        expected, num_earlier = expected_fetch(selection, chooser.block_size, rank)
        assert rows.tolist() == expected, f"rank {rank}"
        assert fetched_row_bytes == row_bytes and num_bytes == len(expected) * row_bytes
        num_fetched, num_span = num_fetched + len(expected), num_span + num_earlier
    assert 0 < num_fetched < num_span
