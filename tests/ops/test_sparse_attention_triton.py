"""sparse_attention and topk_indexer Triton kernels in the interpreter: output and every gradient against reference.py,
index sets equal to the reference's top-k (ties included), GQA/MQA, K != V, odd lengths and blocks, packed documents,
raw indices that are unused, out of range, acausal, from another document or repeated, NaN- or poison-filled
buffers with guarded ends, dispatch.

Shapes: B batch, T tokens, HQ query heads, H kv heads, K / V head dims, S selected slots, HI indexer heads, DI
indexer dim, NT = B * T.
"""

import dataclasses

import pytest
from guarded_buffers import GUARD_VALUE, GuardedBuffers
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.sparse_attention import autograd, kernels_bwd, kernels_fwd, kernels_select
    from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
    from moe_tune.ops.sparse_attention.autograd import SparseAttentionFunction
    from moe_tune.ops.sparse_attention.reference import sparse_attention_ref, topk_indexer_ref

# One table per dtype, against the reference run in fp64 on the same input values. fp32: the interpreter's dots are
# fp32 products, only the summation order and the online softmax's rescaling differ (measured max error 1e-6 on
# values of magnitude 1-5). fp16: p and ds are rounded to fp16 before their products, every dot takes fp16
# operands, and o is stored in fp16 (measured max error 2.4e-3 on dq of magnitude 3).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}
# Elements past the end of every kernel buffer: a whole 16-row tile of the widest per-token tensor (HQ6 x V32).
GUARD_ELEMENTS = 16 * 6 * 32
# Integer buffers (indices) start as this, so an unwritten slot is neither a valid index nor -1.
INT_POISON = -777


pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class GuardedIntBuffers(GuardedBuffers):
    """GuardedBuffers that also hands out integer buffers: poisoned with INT_POISON, guarded by GUARD_VALUE."""

    def alloc(self, shape, dtype, device):
        if dtype.is_floating_point:
            return super().alloc(shape, dtype, device)
        numel = 1
        for size in shape:
            numel *= size
        flat = torch.full((numel + self.guard_elements,), INT_POISON, dtype=dtype, device=device)
        flat[numel:] = int(GUARD_VALUE)
        self.buffers.append((flat, numel, tuple(shape)))
        return flat[:numel].view(shape)

    def check(self):
        assert self.buffers, "no kernel buffer was allocated: the kernel path did not run"
        for flat, numel, shape in self.buffers:
            guard = GUARD_VALUE if flat.dtype.is_floating_point else int(GUARD_VALUE)
            assert bool((flat[numel:] == guard).all()), f"a kernel wrote past the end of a buffer of shape {shape}"


@pytest.fixture
def guarded(monkeypatch) -> GuardedIntBuffers:
    buffers = GuardedIntBuffers(GUARD_ELEMENTS)
    for module in (kernels_fwd, kernels_bwd, kernels_select):
        monkeypatch.setattr(module, "_alloc", buffers.alloc)
    return buffers


def make_qkv(B, T, HQ, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, HQ, K), (B, T, H, K), (B, T, H, V)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for shape in shapes]


def raw_indices(shape, num_units, seed=1):
    """Random raw indices in [-2, num_units + 2): unused (-1, -2), out of range, acausal, repeated slots."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, num_units + 2, shape, generator=gen)


def forward_and_grads(op, q, k, v, indices, **options):
    o = op(q, k, v, indices, **options)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(o.dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return {name: x.detach().double() for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads))}


def assert_attention_matches_reference(q, k, v, indices, guarded, **options):
    actual = forward_and_grads(sparse_attention, q, k, v, indices, **options)
    as_fp64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = forward_and_grads(sparse_attention_ref, *as_fp64, indices, **options)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[q.dtype], msg=lambda m: f"{name}: {m}")
    guarded.check()


ATTENTION_CASES = [
    # GQA 4:2, K != V, T not a multiple of the 16-key tile, 18 raw slots (two tiles) many invalid or repeated.
    pytest.param(dict(B=1, T=23, HQ=4, H=2, K=16, V=32), dict(S=18, block_size=1), None, id="token-gqa-K16-V32"),
    # MQA with one index set shared by the kv head ([B, T, S]), two rows, K > V.
    pytest.param(dict(B=2, T=17, HQ=4, H=1, K=32, V=16), dict(S=7, block_size=1, shared=True), None, id="token-mqa"),
    # Packed documents: 1 token, empty, 11 and 10 tokens; absolute key positions cross document boundaries.
    pytest.param(dict(B=1, T=22, HQ=2, H=1, K=16, V=16), dict(S=9, block_size=1), [0, 1, 1, 12, 22],
                 id="token-varlen"),  # fmt: skip
    # Blocks of 4 with a 3-token tail block.
    pytest.param(dict(B=1, T=23, HQ=4, H=2, K=16, V=32), dict(S=4, block_size=4), None, id="block4-tail"),
    # Block size 3 (not a power of two), G = 3 query heads per kv head, packed documents, shared indices.
    pytest.param(dict(B=1, T=22, HQ=6, H=2, K=16, V=16), dict(S=3, block_size=3, shared=True), [0, 1, 1, 12, 22],
                 id="block3-varlen-G3"),  # fmt: skip
    # A block of 20 tokens spans two 16-key tiles in forward and backward.
    pytest.param(dict(B=1, T=41, HQ=2, H=1, K=16, V=16), dict(S=2, block_size=20), None, id="block20-two-tiles"),
]


@pytest.mark.parametrize("shape, selection, cu_seqlens", ATTENTION_CASES)
def test_sparse_attention_fp32_matches_reference(kernel_path, guarded, shape, selection, cu_seqlens):
    q, k, v = make_qkv(**shape, dtype=torch.float32)
    B, T, H = shape["B"], shape["T"], shape["H"]
    block_size = selection["block_size"]
    num_units = T if block_size == 1 else -(-T // block_size)
    index_shape = (B, T, selection["S"]) if selection.get("shared") else (B, T, H, selection["S"])
    indices = raw_indices(index_shape, num_units)
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=block_size, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("block_size", [1, 4], ids=["token", "block4"])
def test_sparse_attention_fp16_matches_reference(kernel_path, guarded, block_size):
    q, k, v = make_qkv(1, 20, 2, 1, 16, 32, dtype=torch.float16)
    num_units = 20 if block_size == 1 else 5
    indices = raw_indices((1, 20, 1, 5), num_units)
    cu_seqlens = torch.tensor([0, 5, 20], dtype=torch.int32)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=block_size, cu_seqlens=cu_seqlens)


def test_sparse_attention_on_indexer_output_with_scale(kernel_path, guarded):
    # The model's path: the indexer's ascending, -1 padded blocks (every query has fewer than 4 blocks early on),
    # expanded to the kv heads, with an explicit softmax scale.
    q, k, v = make_qkv(1, 21, 4, 2, 16, 16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    indices = topk_indexer_ref(torch.randn(1, 21, 2, 16, generator=gen), torch.randn(1, 21, 16, generator=gen),
                               topk=3, block_size=4)  # fmt: skip
    indices = indices.unsqueeze(2).expand(-1, -1, 2, -1)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=4, scale=0.3)


@pytest.mark.parametrize("key_tile", [32, 64, 128])
def test_token_dkv_key_tiles_of_several_bitmap_words(kernel_path, guarded, monkeypatch, key_tile):
    # The GPU's token-level dk/dv key tiles span 2 (64 keys) or 4 (128) words of each query's selection bitmap; a
    # tile of 32 is one word. 150 tokens in two rows of 75 give tiles cut by each row's end, packed documents split
    # tiles inside a row, and chunks of 5 queries split every tile's query list.
    real_pick_config = autograd.pick_config

    def pick_config(x, block_size):
        return dataclasses.replace(real_pick_config(x, block_size), dkv_key_tile=key_tile)

    monkeypatch.setattr(autograd, "pick_config", pick_config)
    q, k, v = make_qkv(2, 75, 2, 1, 16, 16, dtype=torch.float32)
    indices = raw_indices((2, 75, 1, 40), 75)
    assert_attention_matches_reference(q, k, v, indices, guarded)
    q, k, v = make_qkv(1, 150, 2, 1, 16, 16, dtype=torch.float32, seed=5)
    indices = raw_indices((1, 150, 1, 40), 150)
    cu_seqlens = torch.tensor([0, 40, 41, 97, 150], dtype=torch.int32)
    assert_attention_matches_reference(q, k, v, indices, guarded, cu_seqlens=cu_seqlens)


def test_token_chunking_bounds_the_pairs_and_the_chunks():
    # Rows of T = 300 tokens in key tiles of 128: 300 + 172 + 44 queries visit the three tiles of a row.
    assert kernels_bwd.token_chunking(600, 300, 128, min_chunk=5, max_chunks=1 << 30) == (2 * 516, 5)
    # Long rows: chunks grow so that at most about max_chunks exist, never below min_chunk.
    max_pairs, chunk = kernels_bwd.token_chunking(65536, 65536, 128, min_chunk=1024, max_chunks=1024)
    assert max_pairs == sum(65536 - 128 * j for j in range(512)) and chunk == -(-max_pairs // 1024) > 1024
    # Issue 6's row: 1,056,768 pairs, chunks of 1032 queries.
    assert kernels_bwd.token_chunking(16384, 16384, 128, min_chunk=1024, max_chunks=1024) == (1056768, 1032)


GATED_CASES = [
    # GQA 4:2, K != V, raw slots; the gate's large magnitudes put sigmoid near 0 and 1 too.
    pytest.param(dict(B=1, T=23, HQ=4, H=2, K=16, V=32), 1, None, torch.float32, id="token-gqa-fp32"),
    pytest.param(dict(B=1, T=22, HQ=6, H=2, K=16, V=16), 3, [0, 1, 1, 12, 22], torch.float32, id="block3-varlen-fp32"),
    pytest.param(dict(B=1, T=20, HQ=2, H=1, K=16, V=32), 1, [0, 5, 20], torch.float16, id="token-varlen-fp16"),
    pytest.param(dict(B=1, T=20, HQ=2, H=1, K=16, V=32), 4, None, torch.float16, id="block4-fp16"),
]


@pytest.mark.parametrize("shape, block_size, cu_seqlens, dtype", GATED_CASES)
def test_gated_sparse_attention_matches_reference(kernel_path, guarded, shape, block_size, cu_seqlens, dtype):
    # The output gate fused into the kernels: o * sigmoid(gate), and dgate beside dq, dk, dv (the dk/dv kernel gets
    # do * sigmoid(gate) from the dq kernel).
    q, k, v = make_qkv(**shape, dtype=dtype)
    B, T, HQ, H, V = (shape[n] for n in ("B", "T", "HQ", "H", "V"))
    gate = (4 * torch.randn(B, T, HQ, V, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    gate = gate.to(dtype).requires_grad_()
    num_units = T if block_size == 1 else -(-T // block_size)
    indices = raw_indices((B, T, H, 6), num_units)
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)

    def run(op, leaves):
        o = op(*leaves[:3], indices, block_size=block_size, cu_seqlens=cu_seqlens, gate=leaves[3])
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(o.dtype)
        grads = torch.autograd.grad(o, leaves, do)
        return {name: x.detach().double() for name, x in zip(("o", "dq", "dk", "dv", "dgate"), (o, *grads))}

    actual = run(sparse_attention, [q, k, v, gate])
    expected = run(sparse_attention_ref, [x.detach().double().requires_grad_() for x in (q, k, v, gate)])
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
    guarded.check()
    # The gate mattered: the same inputs without it give another output.
    ungated = sparse_attention(q, k, v, indices, block_size=block_size, cu_seqlens=cu_seqlens)
    assert not torch.allclose(ungated.double(), actual["o"], atol=1e-2)


def test_canonical_indices_drop_invalid_and_repeated_slots(guarded):
    # Query 5 of a document [2, 8): keys 2..5 are visible. Raw slots: a repeat, unused, acausal, another document's
    # key, out of range, and a repeat across 64-slot steps.
    layout = kernels_select.sequence_layout(torch.tensor([0, 2, 8], dtype=torch.int32), 1, 8, "cpu")
    raw = torch.full((8, 1, 70), -1, dtype=torch.int64)
    raw[5, 0, :8] = torch.tensor([3, 3, -1, 6, 1, 9, 5, 2])
    raw[5, 0, 69] = 5
    canon, bits = kernels_select.canonical_indices(raw, layout, block_size=1)
    assert canon[5, 0, :8].tolist() == [3, -1, -1, -1, -1, -1, 5, 2]
    assert canon[5, 0, 8:].eq(-1).all()
    assert bits[5, 0].tolist() == [(1 << 2) | (1 << 3) | (1 << 5)]
    guarded.check()


def test_pair_chunks_cover_every_pair_once():
    # Two index heads, 3 block slots with 0, 7 and 3 pairs at most 3 per chunk: 1 + 3 + 1 chunks per head, every
    # pair in exactly one chunk and in order, an empty slot still owning one (empty) chunk; past the end, 0 pairs.
    pair_start = torch.tensor([[0, 0, 7], [10, 12, 12]], dtype=torch.int32)
    pair_end = torch.tensor([[0, 7, 10], [12, 12, 13]], dtype=torch.int32)
    chunks = kernels_bwd.pair_chunks(pair_start, pair_end, max_pairs=13, chunk_pairs=3)
    assert chunks.chunk_offsets.tolist() == [[0, 1, 4, 5], [0, 1, 2, 3]]
    num_chunks = chunks.chunk_slot.shape[1]
    assert num_chunks >= 5
    assert chunks.chunk_slot[0, :5].tolist() == [0, 1, 1, 1, 2]
    assert chunks.chunk_pair[0, :5].tolist() == [0, 0, 3, 6, 7]
    assert chunks.chunk_num[0, :5].tolist() == [0, 3, 3, 1, 3]
    assert chunks.chunk_slot[1, :3].tolist() == [0, 1, 2]
    assert chunks.chunk_pair[1, :3].tolist() == [10, 12, 12]
    assert chunks.chunk_num[1, :3].tolist() == [2, 0, 1]
    assert chunks.chunk_num[0, 5:].eq(0).all() and chunks.chunk_num[1, 3:].eq(0).all()


def make_indexer_inputs(B, T, HI, DI, dtype, block_size=1, is_integer=True, seed=0):
    """Integer-valued inputs make every score exact in both implementations, so selections (ties included) must be
    identical; k_idx is a multiple of block_size so that its block means are exact too."""
    gen = torch.Generator().manual_seed(seed)
    if not is_integer:
        return [torch.randn(shape, generator=gen).to(dtype) for shape in ((B, T, HI, DI), (B, T, DI), (B, T, HI))]
    q_idx = torch.randint(-3, 4, (B, T, HI, DI), generator=gen)
    k_idx = torch.randint(-3, 4, (B, T, DI), generator=gen) * block_size
    w_idx = torch.randint(-2, 3, (B, T, HI), generator=gen)
    return [x.to(dtype) for x in (q_idx, k_idx, w_idx)]


def assert_indexer_matches_reference(guarded, q_idx, k_idx, w_idx, **options):
    actual = topk_indexer(q_idx, k_idx, w_idx, **options)
    expected = topk_indexer_ref(q_idx, k_idx, w_idx, **options)
    assert actual.dtype == expected.dtype == torch.int32
    mismatched = (actual != expected).any(dim=-1).nonzero().tolist()
    assert not mismatched, f"{len(mismatched)} queries differ, first (b, t): {mismatched[:3]}"
    guarded.check()


INDEXER_CASES = [
    # topk 8 of up to 40 causal keys: the first 8 queries have fewer candidates than topk (-1 padding).
    pytest.param(dict(B=1, T=40, HI=2, DI=16), dict(topk=8), None, id="token-relu"),
    # Two rows, 3 heads (padded to 4), no activation, no weights (all ones).
    pytest.param(dict(B=2, T=23, HI=3, DI=16), dict(topk=5, activation="none", no_weights=True), None,
                 id="token-none-no_weights"),  # fmt: skip
    # Packed documents: 1 token, empty, 19 and 21 tokens; positions are absolute in the row.
    pytest.param(dict(B=1, T=41, HI=2, DI=16), dict(topk=6), [0, 1, 1, 20, 41], id="token-varlen"),
    # Blocks of 4 (10 blocks, the last incomplete): own block plus the 3 best complete earlier ones.
    pytest.param(dict(B=1, T=39, HI=2, DI=16, block_size=4), dict(topk=4), None, id="block4"),
    # Blocks of 3 in packed documents; a 1-token document selects only its own block.
    pytest.param(dict(B=1, T=41, HI=4, DI=16, block_size=3), dict(topk=3), [0, 1, 1, 20, 41],
                 id="block3-varlen"),  # fmt: skip
    # QSA (always_keep_own_block False): complete blocks up to the query compete, its own block once complete;
    # the incomplete tail block is added on top. k_idx holds each block's (already pooled) key at its first row.
    pytest.param(dict(B=1, T=41, HI=2, DI=16, block_size=4), dict(topk=3, k_idx_is_pooled=True,
                 always_keep_own_block=False), [0, 1, 1, 20, 41], id="block4-qsa-pooled-varlen"),  # fmt: skip
    # QSA with mean-pooled blocks and topk 1: only the tail slot, -1 whenever the own block is complete.
    pytest.param(dict(B=2, T=21, HI=2, DI=16, block_size=3), dict(topk=1, always_keep_own_block=False), None,
                 id="block3-qsa-tail_only"),  # fmt: skip
    # Random (non-integer) fp32 scores: no ties, exact order by value.
    pytest.param(dict(B=1, T=40, HI=2, DI=16, is_integer=False), dict(topk=8), None, id="token-random-fp32"),
]


@pytest.mark.parametrize("shape, options, cu_seqlens", INDEXER_CASES)
def test_topk_indexer_equals_reference(kernel_path, guarded, shape, options, cu_seqlens):
    block_size = shape.pop("block_size", 1)
    q_idx, k_idx, w_idx = make_indexer_inputs(**shape, dtype=torch.float32, block_size=block_size)
    if options.pop("no_weights", False):
        w_idx = None
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    assert_indexer_matches_reference(
        guarded, q_idx, k_idx, w_idx, block_size=block_size, cu_seqlens=cu_seqlens, **options
    )


@pytest.mark.parametrize("block_size", [1, 4], ids=["token", "block4"])
def test_topk_indexer_fp16_equals_reference(kernel_path, guarded, block_size):
    q_idx, k_idx, w_idx = make_indexer_inputs(1, 38, 2, 16, torch.float16, block_size=block_size)
    assert_indexer_matches_reference(guarded, q_idx, k_idx, w_idx, topk=5, block_size=block_size)


def test_topk_indexer_breaks_ties_toward_lower_index(kernel_path, guarded):
    # Half the queries score every key 0 (relu of negative logits), with negative weights making some of them -0.0:
    # ties everywhere, so the lowest positions win; the other half has ties among a few distinct integer scores.
    q_idx, k_idx, w_idx = make_indexer_inputs(1, 36, 2, 16, torch.float32)
    q_idx[:, ::2] = -1.0
    k_idx = k_idx.abs() + 1
    w_idx[:, ::4] = -1.0
    assert_indexer_matches_reference(guarded, q_idx, k_idx, w_idx, topk=6)
    ties_only = topk_indexer(q_idx, k_idx, w_idx, topk=6)[0, 20]
    assert ties_only.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("digit_bits", [3, 4, 8])
def test_topk_indexer_digit_widths_equal_reference(kernel_path, guarded, monkeypatch, digit_bits):
    # The select at other digit widths than the default 5: 3 and 8 leave a first pass of 2 and 8 bits, 4 one of 4.
    # Packed documents, ties among integer scores and signed scores (negative weights) in one batch.
    monkeypatch.setattr(kernels_select, "INTERPRETER_SELECT_DIGIT_BITS", digit_bits)
    q_idx, k_idx, w_idx = make_indexer_inputs(1, 41, 2, 16, torch.float32)
    cu_seqlens = torch.tensor([0, 1, 1, 20, 41], dtype=torch.int32)
    assert_indexer_matches_reference(guarded, q_idx, k_idx, w_idx, topk=6, cu_seqlens=cu_seqlens)


def _top_positions_ref(keys_RM: torch.Tensor, counts: list[int], k: int) -> torch.Tensor:
    """Ascending positions of each row's k largest keys among its first counts[r] (ties to the lower position),
    -1 padded: the selection the indexer's select kernel makes on its scratch rows."""
    out = torch.full((keys_RM.shape[0], k), -1, dtype=torch.int32)
    for r, count in enumerate(counts):
        order = sorted(range(count), key=lambda m: (-int(keys_RM[r, m]), m))[:k]
        out[r, : len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out


@pytest.mark.parametrize("pattern", ["random", "ties", "sample_trap"])
@pytest.mark.parametrize("sample", [0, 16], ids=["full_row", "bracketed"])
def test_topk_select_kernel_on_crafted_keys(kernel_path, pattern, sample):
    # The select alone, on int32 keys written straight into its scratch rows. "sample_trap" puts the largest keys
    # exactly where a 16-key sample picks (every 200 // 16 = 12.5th position), so the sample's bracket misses the
    # k-th key and the kernel must fall back to the full row; "ties" leaves 7 distinct keys for 200 candidates.
    num_rows, num_keys, k = 6, 200, 37
    counts = [200, 199, 150, 101, 38, 37]
    gen = torch.Generator().manual_seed(3)
    if pattern == "random":
        keys = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_keys), generator=gen, dtype=torch.int64)
    elif pattern == "ties":
        keys = torch.randint(-3, 4, (num_rows, num_keys), generator=gen)
    else:
        keys = torch.randint(0, 1000, (num_rows, num_keys), generator=gen)
        for r, count in enumerate(counts):
            picks = torch.arange(16) * count // 16
            keys[r, picks] = 10**6 + torch.arange(16)
    keys = keys.to(torch.int32)
    out = torch.full((num_rows, k), INT_POISON, dtype=torch.int32)
    first = torch.zeros(num_rows, dtype=torch.int32)
    kernels_select._topk_select_kernel[(num_rows,)](
        first, torch.tensor(counts, dtype=torch.int32), first, out, keys.clone(), torch.empty_like(keys),
        num_rows, num_keys, 0, num_keys, k, k,
        CHUNK=16, DIGIT_BITS=5, SAMPLE=sample, MARGIN=2, IS_BLOCK=False,
    )  # fmt: skip
    assert torch.equal(out, _top_positions_ref(keys, counts, k))


def _spy_kernel(monkeypatch):
    calls = []
    apply = SparseAttentionFunction.apply

    def spy(*args):
        calls.append(args[0].dtype)
        return apply(*args)

    monkeypatch.setattr(SparseAttentionFunction, "apply", spy)
    return calls


def test_auto_takes_the_kernel_only_on_cuda(monkeypatch):
    # auto means "kernel on CUDA, reference elsewhere": on CPU tensors it takes the reference even when the
    # interpreter could run the kernel (only an explicit MOE_TUNE_KERNELS=triton does that).
    calls = _spy_kernel(monkeypatch)
    q, k, v = make_qkv(1, 4, 2, 1, 16, 16, dtype=torch.float32)
    indices = torch.zeros(1, 4, 1, 2, dtype=torch.int64)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        sparse_attention(q, k, v, indices)
    assert calls == []
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sparse_attention(q, k, v, indices)
    assert calls == [torch.float32]


@pytest.mark.parametrize(
    "dtype, interpret, message",
    [
        pytest.param(torch.float64, "1", "has no Triton kernel", id="fp64"),
        pytest.param(torch.float32, "0", "got CPU tensors", id="no_interpreter"),
    ],
)
def test_forced_kernel_raises_when_it_cannot_run(monkeypatch, dtype, interpret, message):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = make_qkv(1, 4, 2, 1, 16, 16, dtype=dtype)
    with pytest.raises(RuntimeError, match=f"sparse_attention {message}"):
        sparse_attention(q, k, v, torch.zeros(1, 4, 2, dtype=torch.int64))
    q_idx, k_idx, w_idx = make_indexer_inputs(1, 4, 2, 16, dtype)
    with pytest.raises(RuntimeError, match=f"topk_indexer {message}"):
        topk_indexer(q_idx, k_idx, w_idx, topk=2)


@pytest.mark.parametrize(
    "block_size, options",
    [(1, dict(topk=5)), (1, dict(topk=2)), (3, dict(topk=3)),
     (4, dict(topk=3, k_idx_is_pooled=True, always_keep_own_block=False))],
    ids=["tok5", "tok2", "blk3", "qsa-blk4-pooled"],
)
def test_topk_indexer_relu_zero_ties_equal_reference(kernel_path, guarded, block_size, options):
    # 3 heads (padded to 4) of dim 12 (padded to 16), mostly negative queries: after the ReLU most candidates score
    # exactly 0 (some -0.0 through negative weights), so the topk-th and next candidates tie in many rows, where the
    # rule (the lower index wins) decides; packed documents of odd lengths (1, 0, 20, 17).
    q_idx, k_idx, w_idx = make_indexer_inputs(1, 38, 3, 12, torch.float32, block_size=block_size, seed=5)
    q_idx = q_idx - 2.0
    w_idx[:, 1::3] = -1.0
    cu_seqlens = torch.tensor([0, 1, 1, 21, 38], dtype=torch.int32)
    assert_indexer_matches_reference(guarded, q_idx, k_idx, w_idx, block_size=block_size, cu_seqlens=cu_seqlens,
                                     **options)
