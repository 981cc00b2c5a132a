"""Context parallelism's attention frames (engine/model/attention_context.py) on a CUDA device, one process: for every
rank of a row shared by 4, its queries over its key span, through the paths a GPU takes (the variable-length flash
call with its own key bounds, SDPA's lower-right causal bias, the sparse attention and indexer kernels with the
queries as the span's last tokens, query_start, in fp32 and bf16), equal the whole row's rows of those queries.
The gather itself is tested on gloo (tests/engine/test_context_parallel_attention.py). Run on the GPU machine:
pytest -m gpu tests/gpu/test_context_parallel_attention_gpu.py

Shapes: T the row's tokens, H query heads, G key/value heads, hd head dim, S selected slots.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_tune.engine.model.attention_context import KeySpan
from moe_tune.engine.model.batch import PackedBatch
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.engine.model.varlen import (
    DocumentBuckets, flash_varlen_applies, offset_causal_attention, packed_causal_attention,
)
from moe_tune.engine.parallel.context import ContextShard
from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer

pytestmark = pytest.mark.gpu

# Against the fp32 reference (offset attention) or the same kernels on the whole row: relative to the largest entry.
REL_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
# Document starts of the row: a document over every share of 4 ranks, one starting at a share boundary.
ROW_STARTS = [0, 300, 3500, 4096, 6000, 8192]
ROW_TOKENS = 8192
NUM_RANKS = 4


def _rel(actual, expected):
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).abs().max() / expected.abs().max())


def reference_offset_attention(q, k, v, sinks, window):
    """fp32 dense attention of q [1, Lq, H, hd] as the last Lq of k's Lk tokens, with sinks [H] and a window."""
    num_queries, num_keys, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = (x.float().repeat_interleave(group, 2) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q[0].float(), k[0]) * q.shape[-1] ** -0.5
    pos_q = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
    pos_k = torch.arange(num_keys, device=q.device)[None, :]
    allowed = (pos_k <= pos_q) & ((pos_q - pos_k < window) if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([sinks.float()[:, None, None].expand(-1, num_queries, 1), scores], -1)
    probs = torch.softmax(scores, -1)[..., -num_keys:]
    return torch.einsum("hqk,khd->qhd", probs, v[0])[None]


@pytest.mark.parametrize("variant", ["plain", "window-sinks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-flash", "fp32-sdpa"])
def test_offset_attention_equals_the_reference(dtype, variant):
    gen = torch.Generator(device="cuda").manual_seed(0)
    Lq, Lk, H, G, hd = 1000, 3000, 16, 4, 128
    q = torch.randn(1, Lq, H, hd, generator=gen, device="cuda").to(dtype).requires_grad_()
    k, v = (torch.randn(1, Lk, G, hd, generator=gen, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    sinks = torch.randn(H, generator=gen, device="cuda").to(dtype).requires_grad_() if variant != "plain" else None
    window = 700 if variant != "plain" else None
    assert flash_varlen_applies(q, k, v) is (dtype == torch.bfloat16)
    o = offset_causal_attention(q, k, v, sinks=sinks, window=window)
    do = torch.randn(o.shape, generator=gen, device="cuda").to(dtype)
    inputs = [x for x in (q, k, v, sinks) if x is not None]
    grads = torch.autograd.grad(o, inputs, do)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    o_ref = reference_offset_attention(*ref_inputs[:3], ref_inputs[3] if sinks is not None else None, window)
    grads_ref = torch.autograd.grad(o_ref, ref_inputs, do.float())
    names = ("o", "dq", "dk", "dv", "dsinks")
    errors = {name: _rel(a, e) for name, a, e in zip(names, (o, *grads), (o_ref, *grads_ref))}
    assert all(err <= REL_TOL[dtype] for err in errors.values()), errors


def spans():
    """KeySpan of each rank of the row, and the row's positions."""
    cu = torch.tensor(ROW_STARTS, dtype=torch.int32, device="cuda")
    positions, doc_ids = document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS)
    for rank in range(NUM_RANKS):
        shard = ContextShard.of_row(cu, None, rank, NUM_RANKS)
        batch = PackedBatch(shard.local_cu_seqlens(), shard.local(positions), shard.local(doc_ids), context=shard)
        yield KeySpan.of(batch)


def span_rows(x, span):
    """The span's rows [1, M, ...] of a row-long x."""
    return x.narrow(1, span.first, span.shard.stop - span.first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-flash", "fp32-sdpa"])
def test_full_attention_in_the_span_equals_the_row(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, G, hd = 8, 2, 128
    cu = torch.tensor(ROW_STARTS, dtype=torch.int32, device="cuda")
    q = torch.randn(1, ROW_TOKENS, H, hd, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(1, ROW_TOKENS, G, hd, generator=gen, device="cuda").to(dtype) for _ in range(2))
    o = packed_causal_attention(q, k, v, DocumentBuckets.from_cu_seqlens(cu))
    for span in spans():
        o_span = span.causal_attention(span.shard.local(q, 1), span_rows(k, span), span_rows(v, span))
        assert _rel(o_span, span.shard.local(o, 1)) <= REL_TOL[dtype], span.shard.rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 64], ids=["token", "block"])
def test_sparse_kernels_in_the_span_equal_the_row(block_size, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, G, hd, HI, DI = 8, 2, 64, 4, 32
    num_selected = 256 // block_size
    cu = torch.tensor(ROW_STARTS, dtype=torch.int32, device="cuda")
    # Integer-valued indexer inputs: exact scores, so both frames see the same ties (the lower index wins in both).
    q_idx = torch.randint(-3, 4, (1, ROW_TOKENS, HI, DI), generator=gen, device="cuda").to(dtype)
    k_idx = torch.randint(-3, 4, (1, ROW_TOKENS, DI), generator=gen, device="cuda").to(dtype)
    w_idx = torch.randint(0, 3, (1, ROW_TOKENS, HI), generator=gen, device="cuda").to(dtype)
    chosen = topk_indexer(q_idx, k_idx, w_idx, topk=num_selected, block_size=block_size, cu_seqlens=cu)
    q = torch.randn(1, ROW_TOKENS, H, hd, generator=gen, device="cuda").to(dtype).requires_grad_()
    k, v = (
        torch.randn(1, ROW_TOKENS, G, hd, generator=gen, device="cuda").to(dtype).requires_grad_() for _ in range(2)
    )
    gate = torch.randn(1, ROW_TOKENS, H, hd, generator=gen, device="cuda").to(dtype).requires_grad_()
    do = torch.randn(1, ROW_TOKENS, H, hd, generator=gen, device="cuda").to(dtype)
    o = sparse_attention(q, k, v, chosen, block_size=block_size, cu_seqlens=cu, gate=gate)
    grads = torch.autograd.grad(o, (q, k, v, gate), do)
    key_scales = [float(g.abs().max()) for g in grads[1:3]]
    grads = [g.float() for g in grads]
    for span in spans():
        shard = span.shard
        mine = span.topk_indexer(
            shard.local(q_idx, 1), span_rows(k_idx, span), shard.local(w_idx, 1), topk=num_selected,
            block_size=block_size,
        )  # fmt: skip
        assert torch.equal(span.row_indices(mine, block_size), shard.local(chosen, 1)), shard.rank
        local = [shard.local(x, 1).detach().requires_grad_() for x in (q, gate)]
        keys = [span_rows(x, span).detach().requires_grad_() for x in (k, v)]
        o_span = span.sparse_attention(local[0], *keys, mine, block_size, gate=local[1])
        assert _rel(o_span, shard.local(o, 1)) <= REL_TOL[dtype], shard.rank
        got = torch.autograd.grad(o_span, (*local, *keys), shard.local(do, 1))
        assert _rel(got[0], shard.local(grads[0], 1)) <= REL_TOL[dtype], shard.rank
        assert _rel(got[1], shard.local(grads[3], 1)) <= REL_TOL[dtype], shard.rank
        # The span's dk and dv hold what this rank's queries give: taken off the row's, every rank's leaves nothing.
        for part, whole in zip(got[2:], grads[1:3]):
            whole.narrow(1, span.first, part.shape[1]).sub_(part)
    for name, whole, scale in zip(("dk", "dv"), grads[1:3], key_scales):
        assert float(whole.abs().max()) <= REL_TOL[dtype] * scale, name
