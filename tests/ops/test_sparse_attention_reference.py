"""ops.sparse_attention reference: dense equivalence, explicit selection masks, varlen, indexer brute force, errors.

Shape legend: B batch, T tokens, HQ query heads, H kv heads, HI indexer heads, K/V head dims, DI indexer dim,
S selected slots, NB block slots per row (ceil(T / block_size)).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float64: dict(atol=1e-10, rtol=1e-9),
}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]

# Packed documents: a 1-token doc, an empty doc, lengths that are not multiples of the block sizes used below.
CU_SEQLENS = [0, 1, 1, 9, 22, 37]


def make_qkv(B, T, HQ, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, HQ, K), (B, T, H, K), (B, T, H, V)]
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for shape in shapes]


def forward_and_grads(attention, q, k, v, seed=1):
    o = attention(q, k, v)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=o.dtype)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def assert_all_close(actual, expected, dtype):
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(a, e, **TOLERANCES[dtype], msg=lambda m, name=name: f"{name}: {m}")


def spans_of(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    return [(0, start, end) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def explicit_mask(indices, HQ, block_size, spans):
    """Bool [B, HQ, T, T] built key by key: the keys each query head may attend under `indices`."""
    B, T = indices.shape[:2]
    H = indices.shape[2] if indices.dim() == 4 else 1
    mask = torch.zeros(B, HQ, T, T, dtype=torch.bool)
    for b, start, end in spans:
        for t in range(start, end):
            for i in range(HQ):
                row = indices[b, t, i // (HQ // H)] if indices.dim() == 4 else indices[b, t]
                for j in row.tolist():
                    if j < 0:
                        continue
                    keys = [j] if block_size == 1 else range(start + j * block_size, start + (j + 1) * block_size)
                    for s in keys:
                        if start <= s <= t:
                            mask[b, i, t, s] = True
    return mask


def masked_attention(q, k, v, mask, scale):
    """Attention gathered query by query over the keys set in mask [B, HQ, T, T]; 0 for a query with none."""
    B, T, HQ, _ = q.shape
    num_groups = HQ // k.shape[2]
    rows = []
    for b in range(B):
        for t in range(T):
            for i in range(HQ):
                keys = mask[b, i, t].nonzero().flatten()
                if keys.numel() == 0:
                    rows.append(v.new_zeros(v.shape[-1]))
                    continue
                weights = torch.softmax(k[b, keys, i // num_groups] @ q[b, t, i] * scale, dim=0)
                rows.append(weights @ v[b, keys, i // num_groups])
    return torch.stack(rows).view(B, T, HQ, -1)


def covering_indices(B, T, H, block_size, is_exact, has_head_dim):
    """Indices that select every causal key: exactly (s <= t, -1 after) or a superset (every slot of the row)."""
    num_slots = math.ceil(T / block_size)
    slots = torch.arange(num_slots).expand(T, num_slots)
    if is_exact:
        own_slot_T1 = (torch.arange(T) // block_size)[:, None]
        slots = torch.where(slots <= own_slot_T1, slots, -1)
    indices = slots.expand(B, H, T, num_slots).permute(0, 2, 1, 3) if has_head_dim else slots.expand(B, T, num_slots)
    return indices.to(torch.int32).contiguous()


def random_indices(shape, num_slots, seed):
    """int32 in [-1, num_slots), about a quarter -1, plus a few rows with no selection at all."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, num_slots, shape, generator=gen)
    indices = torch.where(torch.rand(shape, generator=gen) < 0.25, -1, indices)
    indices[:, 3] = -1
    return indices.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16], ids=lambda bs: f"bs{bs}")
@pytest.mark.parametrize("is_exact", [True, False], ids=["exact", "superset"])
@pytest.mark.parametrize("has_head_dim", [True, False], ids=["BTHS", "BTS"])
def test_sparse_attention_equals_dense_causal_when_all_keys_selected(dtype, block_size, is_exact, has_head_dim):
    # T odd: not a multiple of any block size; GQA with 2 query heads per kv head; K != V.
    B, T, HQ, H, K, V = 2, 37, 4, 2, 16, 8
    q, k, v = make_qkv(B, T, HQ, H, K, V, dtype)
    indices = covering_indices(B, T, H, block_size, is_exact, has_head_dim)

    def dense(q, k, v):
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2)

    actual = forward_and_grads(lambda q, k, v: sparse_attention(q, k, v, indices, block_size=block_size), q, k, v)
    assert_all_close(actual, forward_and_grads(dense, q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3], ids=lambda bs: f"bs{bs}")
@pytest.mark.parametrize("has_head_dim", [True, False], ids=["BTHS", "BTS"])
def test_sparse_attention_equals_explicit_selection_mask(dtype, block_size, has_head_dim):
    B, T, HQ, H, K, V, S = 2, 19, 4, 2, 8, 6, 5
    scale = 0.3
    q, k, v = make_qkv(B, T, HQ, H, K, V, dtype)
    shape = (B, T, H, S) if has_head_dim else (B, T, S)
    indices = random_indices(shape, math.ceil(T / block_size), seed=2)
    mask = explicit_mask(indices, HQ, block_size, spans_of(B, T, None))
    # The random draw must exercise empty rows, non-causal picks and partial selections.
    assert not mask[:, :, 3].any() and mask.any(-1).float().mean() > 0.5

    actual = forward_and_grads(
        lambda q, k, v: sparse_attention(q, k, v, indices, block_size=block_size, scale=scale), q, k, v
    )
    expected = forward_and_grads(lambda q, k, v: masked_attention(q, k, v, mask, scale), q, k, v)
    assert_all_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4], ids=lambda bs: f"bs{bs}")
def test_sparse_attention_varlen_equals_documents_run_separately(dtype, block_size):
    T, HQ, H, K, V, S = CU_SEQLENS[-1], 4, 2, 8, 8, 4
    q, k, v = make_qkv(1, T, HQ, H, K, V, dtype)
    # Picks from the whole row, so packed queries also select keys of other documents, which must be ignored.
    indices = random_indices((1, T, H, S), math.ceil(T / block_size), seed=3)
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)

    def per_document(q, k, v):
        outputs = []
        for start, end in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
            doc_indices = indices[:, start:end]
            if block_size == 1:
                # Token positions are absolute in the row: shift into the document, drop the ones outside it.
                is_inside = (doc_indices >= start) & (doc_indices < end)
                doc_indices = torch.where(is_inside, doc_indices - start, -1)
            doc = slice(start, end)
            outputs.append(sparse_attention(q[:, doc], k[:, doc], v[:, doc], doc_indices, block_size=block_size))
        return torch.cat(outputs, dim=1)

    def packed(q, k, v):
        return sparse_attention(q, k, v, indices, block_size=block_size, cu_seqlens=cu_seqlens)

    actual = forward_and_grads(packed, q, k, v)
    assert_all_close(actual, forward_and_grads(per_document, q, k, v), dtype)
    mask = explicit_mask(indices, HQ, block_size, spans_of(1, T, CU_SEQLENS))
    expected = forward_and_grads(lambda q, k, v: masked_attention(q, k, v, mask, K**-0.5), q, k, v)
    assert_all_close(actual, expected, dtype)


def test_sparse_attention_computes_in_fp32_and_returns_input_dtype():
    q, k, v = make_qkv(1, 11, 2, 1, 8, 8, torch.bfloat16)
    indices = covering_indices(1, 11, 1, 1, is_exact=False, has_head_dim=False)
    o = sparse_attention(q, k, v, indices)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, sparse_attention(q.float(), k.float(), v.float(), indices).bfloat16(), atol=0, rtol=0)


def brute_force_indexer(q_idx, k_idx, w_idx, topk, scale, activation, block_size, spans):
    """Indexer output built query by query with Python sorting: [B, T, topk] int32."""
    B, T, HI, DI = q_idx.shape
    act = torch.relu if activation == "relu" else (lambda x: x)
    scale = DI**-0.5 if scale is None else scale
    w_idx = torch.ones(B, T, HI, dtype=q_idx.dtype) if w_idx is None else w_idx
    out = torch.full((B, T, topk), -1, dtype=torch.int32)
    for b, start, end in spans:
        for t in range(start, end):
            def score(key_D, b=b, t=t):
                return sum((w_idx[b, t, h] * act(scale * (q_idx[b, t, h] @ key_D))).item() for h in range(HI))

            if block_size == 1:
                candidates = [(score(k_idx[b, s]), s) for s in range(start, t + 1)]
                chosen = [s for _, s in sorted(candidates, key=lambda c: (-c[0], c[1]))[:topk]]
            else:
                own = (t - start) // block_size
                blocks = [k_idx[b, start + j * block_size : start + (j + 1) * block_size] for j in range(own)]
                candidates = [(score(block.mean(0)), j) for j, block in enumerate(blocks)]
                chosen = [j for _, j in sorted(candidates, key=lambda c: (-c[0], c[1]))[: topk - 1]] + [own]
            out[b, t, : len(chosen)] = torch.tensor(sorted(chosen))
    return out


def make_indexer_inputs(B, T, HI, DI, dtype, has_weights, seed=4):
    gen = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(B, T, HI, DI, generator=gen, dtype=dtype)
    k_idx = torch.randn(B, T, DI, generator=gen, dtype=dtype)
    w_idx = torch.randn(B, T, HI, generator=gen, dtype=dtype) if has_weights else None
    return q_idx, k_idx, w_idx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size, topk, activation, has_weights, is_varlen",
    [
        (1, 5, "relu", True, False),
        (1, 5, "none", False, True),
        (1, 1, "relu", True, True),  # a single slot
        (1, 64, "relu", True, False),  # topk > T: every causal key plus -1 padding
        (3, 3, "relu", True, False),
        (3, 2, "none", True, True),
        (4, 1, "relu", False, True),  # only the query's own block
        (4, 16, "relu", True, True),  # topk > blocks per document
    ],
    ids=["tok-relu", "tok-none-varlen", "tok-top1-varlen", "tok-all", "blk3", "blk3-none-varlen", "blk4-top1-varlen",
         "blk4-all-varlen"],
)
def test_topk_indexer_equals_brute_force(dtype, block_size, topk, activation, has_weights, is_varlen):
    B, T, HI, DI = (1, CU_SEQLENS[-1], 3, 8) if is_varlen else (2, 21, 3, 8)
    cu_list = CU_SEQLENS if is_varlen else None
    cu_seqlens = torch.tensor(cu_list) if is_varlen else None
    q_idx, k_idx, w_idx = make_indexer_inputs(B, T, HI, DI, dtype, has_weights)
    indices = topk_indexer(
        q_idx, k_idx, w_idx, topk=topk, activation=activation, block_size=block_size, cu_seqlens=cu_seqlens
    )
    expected = brute_force_indexer(q_idx, k_idx, w_idx, topk, None, activation, block_size, spans_of(B, T, cu_list))
    assert indices.dtype == torch.int32 and indices.shape == (B, T, topk)
    torch.testing.assert_close(indices, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "block_size, topk", [(1, 6), (1, 40), (5, 2), (5, 40)], ids=["tok", "tok-all", "blk", "blk-all"]
)
def test_topk_indexer_selects_causal_sorted_padded(block_size, topk):
    T = CU_SEQLENS[-1]
    q_idx, k_idx, w_idx = make_indexer_inputs(1, T, 2, 8, torch.float32, has_weights=True)
    indices = topk_indexer(q_idx, k_idx, w_idx, topk=topk, block_size=block_size, cu_seqlens=torch.tensor(CU_SEQLENS))
    for start, end in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        for t in range(start, end):
            row = indices[0, t].tolist()
            # Highest selectable index and number of candidates: own position / own block.
            last = t if block_size == 1 else (t - start) // block_size
            first = start if block_size == 1 else 0
            num_valid = min(topk, last - first + 1)
            assert row[num_valid:] == [-1] * (topk - num_valid), f"t={t}: -1 padding {row}"
            valid = row[:num_valid]
            assert valid == sorted(set(valid)), f"t={t}: not ascending and unique {row}"
            assert first <= valid[0] and valid[-1] <= last, f"t={t}: outside [{first}, {last}] {row}"
            if block_size > 1:
                assert valid[-1] == last, f"t={t}: own block {last} missing {row}"
            if topk >= last - first + 1:
                assert valid == list(range(first, last + 1)), f"t={t}: topk covers everything {row}"


@pytest.mark.parametrize("block_size", [1, 4], ids=lambda bs: f"bs{bs}")
def test_topk_indexer_breaks_ties_toward_lower_index(block_size):
    # All-zero keys give every candidate the score 0.
    T, topk = 23, 3
    q_idx, _, w_idx = make_indexer_inputs(1, T, 2, 4, torch.float32, has_weights=True)
    indices = topk_indexer(q_idx, torch.zeros(1, T, 4), w_idx, topk=topk, block_size=block_size)
    for t in range(T):
        if block_size == 1:
            expected = list(range(min(topk, t + 1)))
        else:
            own = t // block_size
            expected = list(range(min(topk - 1, own))) + [own]
        assert indices[0, t].tolist() == expected + [-1] * (topk - len(expected)), f"t={t}"


def brute_force_qsa(q_idx, k_idx, topk, block_size, is_pooled, spans):
    """QSA block choice query by query, as transformers' Qwen4ExpTextQSAIndexer makes it: the complete blocks up to
    the query (its own once complete) scored by sum_h relu(q . key) / sqrt(DI), the topk - 1 best kept, plus the
    incomplete tail block. Block keys: read at block starts (is_pooled) or the mean of the block's rows."""
    B, T, HI, DI = q_idx.shape
    out = torch.full((B, T, topk), -1, dtype=torch.int32)
    for b, start, end in spans:
        for t in range(start, end):
            num_complete = (t - start + 1) // block_size
            blocks = [k_idx[b, start + j * block_size : start + (j + 1) * block_size] for j in range(num_complete)]
            keys = [block[0] if is_pooled else block.mean(0) for block in blocks]
            scores = [(torch.relu(q_idx[b, t] @ key).sum() / math.sqrt(DI)).item() for key in keys]
            chosen = sorted(range(num_complete), key=lambda j: (-scores[j], j))[: topk - 1]
            if (t - start + 1) % block_size:
                chosen.append((t - start) // block_size)
            out[b, t, : len(chosen)] = torch.tensor(sorted(chosen), dtype=torch.int32)
    return out


@pytest.mark.parametrize(
    "block_size, topk, is_pooled, is_varlen",
    [
        (4, 3, True, True),
        (3, 2, False, False),
        (4, 1, True, True),  # the tail slot only: complete own blocks leave every slot -1
        (4, 16, True, True),  # topk > blocks per document
    ],
    ids=["pooled-varlen", "mean", "tail-only", "all-varlen"],
)
def test_topk_indexer_qsa_equals_brute_force(block_size, topk, is_pooled, is_varlen):
    B, T = (1, CU_SEQLENS[-1]) if is_varlen else (2, 21)
    cu_list = CU_SEQLENS if is_varlen else None
    q_idx, k_idx, _ = make_indexer_inputs(B, T, 3, 8, torch.float64, has_weights=False)
    indices = topk_indexer(
        q_idx, k_idx, None, topk=topk, block_size=block_size, cu_seqlens=torch.tensor(cu_list) if is_varlen else None,
        k_idx_is_pooled=is_pooled, always_keep_own_block=False,
    )  # fmt: skip
    expected = brute_force_qsa(q_idx, k_idx, topk, block_size, is_pooled, spans_of(B, T, cu_list))
    assert indices.dtype == torch.int32 and indices.shape == (B, T, topk)
    torch.testing.assert_close(indices, expected, atol=0, rtol=0)


def _qkv(B=1, T=8, HQ=4, H=2, K=16, V=16, dtype=torch.float32):
    return torch.randn(B, T, HQ, K, dtype=dtype), torch.randn(B, T, H, K), torch.randn(B, T, H, V)


def _attention_args(**changes):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, indices=torch.zeros(1, 8, 2, dtype=torch.int32))
    args.update(changes)
    return args


def _indexer_args(**changes):
    args = dict(q_idx=torch.randn(1, 8, 2, 4), k_idx=torch.randn(1, 8, 4), w_idx=torch.randn(1, 8, 2), topk=4)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, match",
    [
        pytest.param(
            _attention_args(q=torch.randn(1, 8, 6, 16), k=torch.randn(1, 8, 4, 16), v=torch.randn(1, 8, 4, 16)),
            r"q: HQ \(6\) must be a multiple of k's H \(4\)",
            id="gqa-ratio",
        ),
        pytest.param(
            _attention_args(q=torch.randn(1, 8, 16)), r"q: shape \(1, 8, 16\) must be \[B, T, HQ, K\]", id="q-ndim"
        ),
        pytest.param(
            _attention_args(k=torch.randn(1, 8, 2, 12)),
            r"k: shape \(1, 8, 2, 12\) must be \[B, T, H, K\] with B, T, K = 1, 8, 16",
            id="k-head-dim",
        ),
        pytest.param(
            _attention_args(v=torch.randn(1, 7, 2, 16)),
            r"v: shape \(1, 7, 2, 16\) must be \[B, T, H, V\] with B, T, H = 1, 8, 2",
            id="v-tokens",
        ),
        pytest.param(
            _attention_args(k=torch.randn(1, 8, 2, 16, dtype=torch.float64)),
            r"k: dtype \(torch.float64\) must match q's \(torch.float32\)",
            id="dtype-mismatch",
        ),
        pytest.param(
            _attention_args(indices=torch.zeros(1, 8, 2)),
            r"indices: dtype \(torch.float32\) must be int32 or int64",
            id="indices-dtype",
        ),
        pytest.param(
            _attention_args(indices=torch.zeros(1, 8, 3, 2, dtype=torch.int32)),
            r"indices: shape \(1, 8, 3, 2\) must be \[B, T, H, S\] or \[B, T, S\] with B, T, H = 1, 8, 2",
            id="indices-heads",
        ),
        pytest.param(_attention_args(block_size=0), r"block_size \(0\) must be >= 1", id="block-size-zero"),
        pytest.param(_attention_args(block_size=2.0), r"block_size \(2.0\) must be an int", id="block-size-float"),
        pytest.param(
            _attention_args(
                q=torch.randn(2, 8, 4, 16),
                k=torch.randn(2, 8, 2, 16),
                v=torch.randn(2, 8, 2, 16),
                indices=torch.zeros(2, 8, 2, dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 8]),
            ),
            r"cu_seqlens requires B == 1, got q of shape \(2, 8, 4, 16\)",
            id="cu-seqlens-batch",
        ),
        pytest.param(
            _attention_args(cu_seqlens=torch.tensor([0, 3, 7])),
            r"cu_seqlens \[0, 3, 7\]: must start at 0 and end at T \(8\)",
            id="cu-seqlens-end",
        ),
        pytest.param(
            _attention_args(cu_seqlens=torch.tensor([0, 5, 3, 8])),
            r"cu_seqlens \[0, 5, 3, 8\]: must be non-decreasing",
            id="cu-seqlens-order",
        ),
        pytest.param(
            _attention_args(cu_seqlens=torch.tensor([0.0, 8.0])),
            r"cu_seqlens: dtype \(torch.float32\) must be int32 or int64",
            id="cu-seqlens-dtype",
        ),
        pytest.param(
            _attention_args(gate=torch.randn(1, 8, 2, 16)),
            r"gate: shape \(1, 8, 2, 16\) must be \[B, T, HQ, V\] = \(1, 8, 4, 16\)",
            id="gate-heads",
        ),
        pytest.param(
            _attention_args(gate=torch.randn(1, 8, 4, 16, dtype=torch.float64)),
            r"gate: dtype \(torch.float64\) must match q's \(torch.float32\)",
            id="gate-dtype",
        ),
    ],
)
def test_sparse_attention_rejects_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        sparse_attention(**args)


@pytest.mark.parametrize(
    "args, match",
    [
        pytest.param(
            _indexer_args(k_idx=torch.randn(1, 8, 5)),
            r"k_idx: shape \(1, 8, 5\) must be \[B, T, DI\] = \(1, 8, 4\)",
            id="k-idx-dim",
        ),
        pytest.param(
            _indexer_args(w_idx=torch.randn(1, 8, 3)),
            r"w_idx: shape \(1, 8, 3\) must be \[B, T, HI\] = \(1, 8, 2\)",
            id="w-idx-heads",
        ),
        pytest.param(_indexer_args(topk=0), r"topk \(0\) must be >= 1", id="topk-zero"),
        pytest.param(
            _indexer_args(activation="gelu"), r"activation \('gelu'\) must be one of 'relu', 'none'", id="activation"
        ),
        pytest.param(_indexer_args(block_size=0), r"block_size \(0\) must be >= 1", id="block-size-zero"),
        pytest.param(
            _indexer_args(
                q_idx=torch.randn(2, 8, 2, 4), k_idx=torch.randn(2, 8, 4), w_idx=None, cu_seqlens=torch.tensor([0, 8])
            ),
            r"cu_seqlens requires B == 1, got q_idx of shape \(2, 8, 2, 4\)",
            id="cu-seqlens-batch",
        ),
    ],
)
def test_topk_indexer_rejects_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        topk_indexer(**args)


def test_explicit_triton_request_raises_without_kernel(monkeypatch):
    # The kernels cover fp32/fp16/bf16 (tests/ops/test_sparse_attention_triton.py); fp64 has none.
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    q, k, v = (x.double() for x in _qkv())
    with pytest.raises(RuntimeError, match="sparse_attention has no Triton kernel"):
        sparse_attention(**_attention_args(q=q, k=k, v=v))
    with pytest.raises(RuntimeError, match="topk_indexer has no Triton kernel"):
        topk_indexer(**_indexer_args(q_idx=torch.randn(1, 8, 2, 4).double(), k_idx=torch.randn(1, 8, 4).double(),
                                     w_idx=None))  # fmt: skip


def relu_tie_inputs(T, HI, DI, block_size, seed=7):
    """Integer indexer inputs, most dot products negative: after the ReLU many candidates score exactly 0 and others
    equal small integers, so the topk-th and the next candidate often tie. Keys are constant over each block, so
    block means are exact, and every score is exact whatever the summation order."""
    gen = torch.Generator().manual_seed(seed)
    q_idx = torch.randint(-3, 2, (1, T, HI, DI), generator=gen).double()
    k_idx = torch.randint(-1, 2, (1, -(-T // block_size), DI), generator=gen).double()
    k_idx = k_idx.repeat_interleave(block_size, dim=1)[:, :T].contiguous()
    w_idx = torch.randint(1, 3, (1, T, HI), generator=gen).double()
    return q_idx, k_idx, w_idx


def count_straddling_ties(q_idx, k_idx, w_idx, topk, spans):
    """Token queries whose topk-th and (topk + 1)-th best causal scores are equal (where the tie rule decides)."""
    count = 0
    for _, start, end in spans:
        for t in range(start, end):
            scores = sorted((sum(w_idx[0, t, h].item() * max(0.0, (q_idx[0, t, h] @ k_idx[0, s]).item())
                                 for h in range(q_idx.shape[2])) for s in range(start, t + 1)), reverse=True)
            count += len(scores) > topk and scores[topk - 1] == scores[topk]
    return count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size, topk, qsa",
    [(1, 5, False), (1, 2, False), (3, 3, False), (4, 3, True), (3, 2, True)],
    ids=["tok5", "tok2", "blk3", "qsa-blk4", "qsa-blk3"],
)
def test_relu_zero_ties_go_to_the_lower_index(dtype, block_size, topk, qsa):
    # 3 heads of dim 12 (16 for QSA: its scale 1/4 is exact), packed documents of odd lengths (1, 0, 8, 13, 15).
    T = CU_SEQLENS[-1]
    q_idx, k_idx, w_idx = relu_tie_inputs(T, 3, 16 if qsa else 12, block_size)
    q_idx, k_idx, w_idx = (x.to(dtype) for x in (q_idx, k_idx, w_idx))
    spans = spans_of(1, T, CU_SEQLENS)
    cu_seqlens = torch.tensor(CU_SEQLENS)
    if qsa:
        indices = topk_indexer(q_idx, k_idx, None, topk=topk, block_size=block_size, cu_seqlens=cu_seqlens,
                               always_keep_own_block=False)
        expected = brute_force_qsa(q_idx, k_idx, topk, block_size, False, spans)
    else:
        indices = topk_indexer(q_idx, k_idx, w_idx, topk=topk, scale=1.0, block_size=block_size, cu_seqlens=cu_seqlens)
        expected = brute_force_indexer(q_idx, k_idx, w_idx, topk, 1.0, "relu", block_size, spans)
        if block_size == 1:
            assert count_straddling_ties(q_idx, k_idx, w_idx, topk, spans) >= 3  # the rule is what decides
    torch.testing.assert_close(indices, expected, atol=0, rtol=0)
