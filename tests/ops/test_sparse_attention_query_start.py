"""sparse_attention and topk_indexer with query_start: queries that are the last TQ tokens of the keys (a chunk of
queries over its key span, engine/model/attention_context.py's KeySpan). The op on the last TQ queries equals the
full-length op's last TQ rows: outputs and every gradient (q, k, v, gate) in fp64 on the reference, selections
exactly for the indexer; the Triton kernels (interpreter, fp32) against the reference on the same offset inputs.

Shapes: B batch, T keys, TQ queries (T = Q0 + TQ), HQ query heads, H kv heads, K / V head dims, S slots, HI indexer
heads, DI indexer dim.
"""

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.sparse_attention import kernels_bwd, kernels_fwd, kernels_select
    from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
    from moe_tune.ops.sparse_attention.reference import sparse_attention_ref, topk_indexer_ref

# The Triton kernels against the reference in fp64 on the same fp32 values: the interpreter's dots are fp32 products,
# only the summation order and the online softmax's rescaling differ (as test_sparse_attention_triton.py's table).
KERNEL_TOLERANCE = dict(atol=2e-5, rtol=2e-5)
# Elements past the end of every kernel buffer: a whole 16-row tile of the widest per-token tensor (HQ6 x V32).
GUARD_ELEMENTS = 16 * 6 * 32

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


kernel_path = forced_kernel_path(kernels_fwd, "_sparse_attn_fwd_kernel", on_gpu=False)


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)

    def alloc(shape, dtype, device):
        # Float buffers start as NaN, int32 ones (indices) as INDEX_FILL; each is followed by a guard.
        return buffers.alloc(shape, dtype, device) if dtype.is_floating_point else buffers.alloc_index(shape, device)

    for module in (kernels_fwd, kernels_bwd, kernels_select):
        monkeypatch.setattr(module, "_alloc", alloc)
    return buffers


def make_inputs(B, T, HQ, H, K, V, S, block_size, dtype, seed=0):
    """q, k, v, gate and raw indices [B, T, H, S] in [-2, units + 2): unused, out of range, acausal, repeated."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, HQ, K), (B, T, H, K), (B, T, H, V), (B, T, HQ, V)]
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]
    num_units = T if block_size == 1 else -(-T // block_size)
    indices = torch.randint(-2, num_units + 2, (B, T, H, S), generator=gen)
    return leaves, indices


def forward_and_grads(op, q, k, v, gate, indices, do, **options):
    leaves = [x.detach().requires_grad_() for x in (q, k, v, gate)]
    o = op(*leaves[:3], indices, gate=leaves[3], **options)
    grads = torch.autograd.grad(o, leaves, do)
    return dict(zip(("o", "dq", "dk", "dv", "dgate"), (o.detach().double(), *(g.double() for g in grads))))


def last_rows(x, query_start):
    return x[:, query_start:]


ATTENTION_CASES = [
    # Token level, GQA 4:2, K != V, one document; the queries start inside a 16-key tile.
    pytest.param(dict(B=1, T=37, HQ=4, H=2, K=16, V=32, S=9, block_size=1), 21, None, id="token-gqa"),
    # Two rows without cu_seqlens: query i of row b at key b * T + Q0 + i.
    pytest.param(dict(B=2, T=29, HQ=2, H=1, K=16, V=16, S=7, block_size=1), 11, None, id="token-two-rows"),
    # Packed documents; the queries start in the middle of the second document.
    pytest.param(dict(B=1, T=40, HQ=2, H=1, K=16, V=16, S=8, block_size=1), 17, [0, 9, 9, 26, 40],
                 id="token-varlen"),  # fmt: skip
    # Blocks of 4; the queries start in the middle of a block, selections below the document's blocks.
    pytest.param(dict(B=1, T=38, HQ=4, H=2, K=16, V=16, S=3, block_size=4), 14, None, id="block4"),
    # Blocks of 3 in packed documents, G = 3; the first query continues a document begun in the prefix.
    pytest.param(dict(B=1, T=41, HQ=6, H=2, K=16, V=16, S=3, block_size=3), 22, [0, 1, 1, 20, 41],
                 id="block3-varlen-G3"),  # fmt: skip
    # A block of 20 tokens spans two 16-key tiles; two rows.
    pytest.param(dict(B=2, T=43, HQ=2, H=1, K=16, V=16, S=2, block_size=20), 25, None, id="block20-two-rows"),
    # The whole row as queries: query_start 0 with TQ = T, the default.
    pytest.param(dict(B=1, T=23, HQ=2, H=1, K=16, V=16, S=5, block_size=4), 0, [0, 10, 23], id="block4-start0"),
]


def cu_of(cu_seqlens):
    return None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)


@pytest.mark.parametrize("shape, query_start, cu_seqlens", ATTENTION_CASES)
def test_reference_with_query_start_equals_last_rows_of_full(shape, query_start, cu_seqlens):
    (q, k, v, gate), indices = make_inputs(**shape, dtype=torch.float64)
    options = dict(block_size=shape["block_size"], cu_seqlens=cu_of(cu_seqlens))
    do = torch.randn(shape["B"], shape["T"], shape["HQ"], shape["V"], generator=torch.Generator().manual_seed(2),
                     dtype=torch.float64)  # fmt: skip
    # The full op's gradient flows from its last rows only (the rows before them get zero upstream gradient).
    do[:, :query_start] = 0
    full = forward_and_grads(sparse_attention_ref, q, k, v, gate, indices, do, **options)
    rows = [last_rows(x, query_start) for x in (q, gate, indices, do)]
    offset = forward_and_grads(
        sparse_attention_ref, rows[0], k, v, rows[1], rows[2], rows[3], query_start=query_start, **options
    )
    for name in ("o", "dq", "dgate"):
        torch.testing.assert_close(offset[name], last_rows(full[name], query_start), msg=lambda m: f"{name}: {m}")
    for name in ("dk", "dv"):
        torch.testing.assert_close(offset[name], full[name], msg=lambda m: f"{name}: {m}")
    # Every output row saw some key (the own key is causal; at block level the own block is often selected).
    assert offset["o"].abs().sum() > 0


@pytest.mark.parametrize("shape, query_start, cu_seqlens", ATTENTION_CASES)
def test_kernels_with_query_start_match_reference(kernel_path, guarded, shape, query_start, cu_seqlens):
    (q, k, v, gate), indices = make_inputs(**shape, dtype=torch.float32)
    options = dict(block_size=shape["block_size"], cu_seqlens=cu_of(cu_seqlens), query_start=query_start)
    q, gate, indices = (last_rows(x, query_start) for x in (q, gate, indices))
    do = torch.randn(*q.shape[:3], shape["V"], generator=torch.Generator().manual_seed(2)).to(q.dtype)
    actual = forward_and_grads(sparse_attention, q, k, v, gate, indices, do, **options)
    expected = forward_and_grads(
        sparse_attention_ref, *(x.double() for x in (q, k, v, gate)), indices, do.double(), **options
    )
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **KERNEL_TOLERANCE, msg=lambda m: f"{name}: {m}")
    guarded.check()


def make_indexer_inputs(B, T, HI, DI, block_size, seed=0):
    """Integer-valued inputs: every score exact in both implementations, so the selections (ties included) must be
    identical; k_idx a multiple of block_size so that block means are exact too."""
    gen = torch.Generator().manual_seed(seed)
    q_idx = torch.randint(-3, 4, (B, T, HI, DI), generator=gen).float()
    k_idx = (torch.randint(-3, 4, (B, T, DI), generator=gen) * block_size).float()
    w_idx = torch.randint(-2, 3, (B, T, HI), generator=gen).float()
    return q_idx, k_idx, w_idx


INDEXER_CASES = [
    # topk 6 of up to 40 keys: the queries start where most have more candidates than topk.
    pytest.param(dict(B=1, T=40, HI=2, DI=16), dict(topk=6), 13, None, id="token"),
    # Two rows, no weights: a scoring group of queries straddles the rows (row 1's queries start at key T + Q0).
    pytest.param(dict(B=2, T=35, HI=3, DI=16), dict(topk=5, no_weights=True), 19, None, id="token-two-rows"),
    # Packed documents; the queries start inside the third.
    pytest.param(dict(B=1, T=45, HI=2, DI=16), dict(topk=4), 24, [0, 1, 1, 20, 45], id="token-varlen"),
    # Blocks of 4: own block plus the 2 best complete earlier ones (fewer than the document's blocks).
    pytest.param(dict(B=1, T=43, HI=2, DI=16, block_size=4), dict(topk=3), 18, None, id="block4"),
    # Blocks of 3 in packed documents; the queries start inside a block.
    pytest.param(dict(B=1, T=44, HI=4, DI=16, block_size=3), dict(topk=3), 25, [0, 7, 7, 30, 44],
                 id="block3-varlen"),  # fmt: skip
    # QSA: pooled block keys, the own block only while incomplete.
    pytest.param(dict(B=1, T=41, HI=2, DI=16, block_size=4),
                 dict(topk=3, k_idx_is_pooled=True, always_keep_own_block=False), 15, [0, 5, 41],
                 id="block4-qsa-pooled-varlen"),  # fmt: skip
]


def indexer_case(shape, options, cu_seqlens):
    shape, options = dict(shape), dict(options)
    block_size = shape.pop("block_size", 1)
    q_idx, k_idx, w_idx = make_indexer_inputs(**shape, block_size=block_size)
    if options.pop("no_weights", False):
        w_idx = None
    return q_idx, k_idx, w_idx, dict(block_size=block_size, cu_seqlens=cu_of(cu_seqlens), **options)


@pytest.mark.parametrize("shape, options, query_start, cu_seqlens", INDEXER_CASES)
def test_reference_indexer_with_query_start_equals_last_rows_of_full(shape, options, query_start, cu_seqlens):
    q_idx, k_idx, w_idx, options = indexer_case(shape, options, cu_seqlens)
    full = topk_indexer_ref(q_idx, k_idx, w_idx, **options)
    w_rows = None if w_idx is None else last_rows(w_idx, query_start)
    offset = topk_indexer_ref(last_rows(q_idx, query_start), k_idx, w_rows, query_start=query_start, **options)
    assert torch.equal(offset, last_rows(full, query_start))
    # The budget binds: some query keeps fewer keys than it could see.
    assert (offset >= 0).sum(-1).max() == options["topk"]


@pytest.mark.parametrize("shape, options, query_start, cu_seqlens", INDEXER_CASES)
def test_indexer_kernel_with_query_start_equals_reference(
    kernel_path, guarded, shape, options, query_start, cu_seqlens
):
    q_idx, k_idx, w_idx, options = indexer_case(shape, options, cu_seqlens)
    q_idx = last_rows(q_idx, query_start)
    w_idx = None if w_idx is None else last_rows(w_idx, query_start)
    actual = topk_indexer(q_idx, k_idx, w_idx, query_start=query_start, **options)
    expected = topk_indexer_ref(q_idx, k_idx, w_idx, query_start=query_start, **options)
    mismatched = (actual != expected).any(dim=-1).nonzero().tolist()
    assert not mismatched, f"{len(mismatched)} queries differ, first (b, i): {mismatched[:3]}"
    guarded.check()


def test_token_chunking_counts_only_the_queries():
    # Rows of 300 keys whose last 100 are queries, key tiles of 128: tiles 0 and 1 are visited by all 100 queries
    # (tile 1 starts at key 128 <= 200), tile 2 by the 44 from key 256 on.
    assert kernels_bwd.token_chunking(600, 300, 128, min_chunk=5, max_chunks=1 << 30, TQ=100) == (2 * 244, 5)
    for T, TQ, tile in [(1000, 1000, 128), (1000, 1, 128), (1000, 999, 64), (4096, 1024, 128), (77, 30, 16)]:
        brute = sum(min(TQ, T - j * tile) for j in range(-(-T // tile)))
        assert kernels_bwd.token_chunking(3 * T, T, tile, 1, 1 << 30, TQ)[0] == 3 * brute


def _qkv(T=8, TQ=8):
    return torch.randn(1, TQ, 4, 16), torch.randn(1, T, 2, 16), torch.randn(1, T, 2, 16)


@pytest.mark.parametrize(
    "query_start, T, TQ, match",
    [
        pytest.param(-1, 8, 8, r"query_start \(-1\) must be >= 0", id="negative"),
        pytest.param(2.0, 8, 6, r"query_start \(2.0\) must be an int", id="float"),
        pytest.param(True, 8, 7, r"query_start \(True\) must be an int", id="bool"),
        pytest.param(3, 8, 6, r"k: shape \(1, 8, 2, 16\) must be \[B, T, H, K\] with B, T, K = 1, 9, 16 .*"
                     r"\(T = query_start 3 \+ q's 6 tokens\)", id="keys-not-start-plus-queries"),  # fmt: skip
        pytest.param(0, 8, 6, r"with B, T, K = 1, 6, 16", id="queries-fewer-than-keys-at-start0"),
    ],
)
def test_sparse_attention_rejects_bad_query_start(query_start, T, TQ, match):
    q, k, v = _qkv(T, TQ)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, torch.zeros(1, TQ, 2, dtype=torch.int32), query_start=query_start)


@pytest.mark.parametrize(
    "query_start, match",
    [
        pytest.param(-2, r"query_start \(-2\) must be >= 0", id="negative"),
        pytest.param(5, r"k_idx: shape \(1, 8, 4\) must be \[B, T, DI\] = \(1, 11, 4\) .*"
                     r"\(T = query_start 5 \+ q_idx's 6 tokens\)", id="keys-not-start-plus-queries"),  # fmt: skip
    ],
)
def test_topk_indexer_rejects_bad_query_start(query_start, match):
    with pytest.raises(ValueError, match=match):
        topk_indexer(torch.randn(1, 6, 2, 4), torch.randn(1, 8, 4), torch.randn(1, 6, 2), topk=4,
                     query_start=query_start)  # fmt: skip


def test_cu_seqlens_cover_the_keys():
    q, k, v = _qkv(T=8, TQ=3)
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 3\]: must start at 0 and end at T \(8\)"):
        sparse_attention(q, k, v, torch.zeros(1, 3, 2, dtype=torch.int32), query_start=5,
                         cu_seqlens=torch.tensor([0, 3]))  # fmt: skip
