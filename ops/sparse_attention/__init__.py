"""Top-k sparse attention (DeepSeek DSA token-level, QSA-style block-level) and its top-k indexer.

Shape legend: B batch, T tokens, HQ query heads, H kv heads, HI indexer heads, K query/key head dim, V value head
dim, DI indexer head dim, S selected slots per query, N sequences (cu_seqlens has N + 1 entries).

Index conventions (see reference.py): with block_size == 1 an index is a key position in the packed row
(0 <= s < T); with block_size > 1 it is a block id j local to the query's sequence, covering row positions
[o + j * block_size, o + (j + 1) * block_size) clipped to the sequence end, o = the sequence's start offset.
-1 marks an unused slot. Only keys s <= t of the query's own sequence are ever attended.
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.sparse_attention.reference import INDEXER_ACTIVATIONS, sparse_attention_ref, topk_indexer_ref

__all__ = ["sparse_attention", "topk_indexer"]

_INDEX_DTYPES = (torch.int32, torch.int64)
# What the Triton kernels cover; anything else runs the reference (or raises under MOE_TUNE_KERNELS=triton).
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A program holds a [G, K] query tile, a [G, V] accumulator and [64, K] key tiles in registers: past 256 they spill.
_KERNEL_MAX_HEAD_DIM = 256
# The indexer holds [BQ * HI, DI] queries in registers: past 256 they spill.
_KERNEL_MAX_INDEX_DIM = 256


def _kernel_dtype_ok(x: torch.Tensor) -> bool:
    # The interpreter's tl.dot returns garbage for bf16 operands (numpy has no bf16): bf16 runs the kernel on CUDA only.
    return x.dtype in _KERNEL_DTYPES and (x.is_cuda or x.dtype != torch.bfloat16)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} ({value!r}) must be an int")
    if value < 1:
        raise ValueError(f"{name} ({value}) must be >= 1")


def _check_float_tensor(name: str, t: object, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: must be a tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: shape {_shape(t)} must be {layout} ({ndim} dims)")
    if not t.is_floating_point():
        raise ValueError(f"{name}: dtype ({t.dtype}) must be floating point")


def _check_same_dtype_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype ({t.dtype}) must match {ref_name}'s ({ref.dtype})")
    if t.device != ref.device:
        raise ValueError(f"{name}: device ({t.device}) must match {ref_name}'s ({ref.device})")


def _check_query_start(query_start: object) -> None:
    """query_start: an int >= 0 (the keys' T must then be query_start + the queries' T: checked with their shapes)."""
    if isinstance(query_start, bool) or not isinstance(query_start, int):
        raise ValueError(f"query_start ({query_start!r}) must be an int")
    if query_start < 0:
        raise ValueError(f"query_start ({query_start}) must be >= 0")


def _check_cu_seqlens(cu_seqlens: torch.Tensor | None, ref_name: str, ref: torch.Tensor, T: int) -> None:
    """cu_seqlens: [N + 1] int, 0 = cu_seqlens[0] <= ... <= cu_seqlens[N] = T (the keys); requires B == 1."""
    if cu_seqlens is None:
        return
    B = ref.shape[0]
    if B != 1:
        raise ValueError(f"cu_seqlens requires B == 1, got {ref_name} of shape {_shape(ref)}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: shape must be [N + 1] with N >= 1, got {getattr(cu_seqlens, 'shape', None)}")
    if cu_seqlens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"cu_seqlens: dtype ({cu_seqlens.dtype}) must be int32 or int64")
    # Reading the offsets costs a host sync; the reference needs them on the host anyway.
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"cu_seqlens {bounds}: must start at 0 and end at T ({T}) of {ref_name} {_shape(ref)}")
    if any(prev > nxt for prev, nxt in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds}: must be non-decreasing")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    block_size: int = 1,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    query_start: int = 0,
) -> torch.Tensor:
    """Softmax attention of each query over the union of its selected keys that are causal and in its sequence.

    Args:
        q: [B, Tq, HQ, K] bf16/fp16/fp32/fp64. HQ must be a multiple of H; query head h reads kv head h // (HQ // H).
        k: [B, T, H, K], q's dtype (T = query_start + Tq keys).
        v: [B, T, H, V], q's dtype; V may differ from K.
        indices: [B, Tq, H, S] int32/int64, or [B, Tq, S] shared by all kv heads. block_size == 1: key positions in
            the packed row (0 <= s < T). block_size > 1: block ids local to the query's sequence (block j covers
            [o + j * block_size, o + (j + 1) * block_size) clipped to the sequence, o its start offset). -1 = unused;
            keys s > t (t = query_start + i for query i) or from another sequence are never attended; duplicates
            count once.
        block_size: tokens per selected block, >= 1. Default 1 (token-level selection).
        scale: softmax scale. Default K**-0.5.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences over the T keys (requires B == 1). Default
            None: each row is one sequence.
        gate: [B, Tq, HQ, V], q's dtype: the output gate, o * sigmoid(gate), fused into the kernels (the forward's
            epilogue; dgate beside dq). Default None: no gate.
        query_start: key position of the first query, >= 0, = T - Tq: query i sits at key position
            query_start + i (causality, its sequence, its own block), the queries being the last Tq tokens of the
            keys (a chunk of queries over the keys of its span). Default 0: Tq == T.

    Returns:
        o: [B, Tq, HQ, V] in q's dtype; 0 for a query with no valid selected key. Differentiable w.r.t. q, k, v and
        gate.
    """
    _check_float_tensor("q", q, 4, "[B, T, HQ, K]")
    _check_float_tensor("k", k, 4, "[B, T, H, K]")
    _check_float_tensor("v", v, 4, "[B, T, H, V]")
    _check_query_start(query_start)
    B, Tq, HQ, K = q.shape
    # The keys: the queries' own tokens and the query_start tokens before them.
    T, H = Tq + query_start, k.shape[2]
    if k.shape[:2] != (B, T) or k.shape[3] != K:
        raise ValueError(
            f"k: shape {_shape(k)} must be [B, T, H, K] with B, T, K = {B}, {T}, {K} from q {_shape(q)}"
            f" (T = query_start {query_start} + q's {Tq} tokens)"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: shape {_shape(v)} must be [B, T, H, V] with B, T, H = {B}, {T}, {H} from k {_shape(k)}")
    if H == 0 or HQ % H != 0:
        raise ValueError(f"q: HQ ({HQ}) must be a multiple of k's H ({H})")
    _check_same_dtype_device("k", k, "q", q)
    _check_same_dtype_device("v", v, "q", q)
    if not isinstance(indices, torch.Tensor) or indices.dtype not in _INDEX_DTYPES:
        found = getattr(indices, "dtype", type(indices).__name__)
        raise ValueError(f"indices: dtype ({found}) must be int32 or int64")
    has_head_dim = indices.dim() == 4
    if indices.dim() not in (3, 4) or indices.shape[:2] != q.shape[:2] or (has_head_dim and indices.shape[2] != H):
        raise ValueError(
            f"indices: shape {_shape(indices)} must be [B, T, H, S] or [B, T, S] with B, T, H = {B}, {Tq}, {H} (T"
            " the queries')"
        )
    if indices.device != q.device:
        raise ValueError(f"indices: device ({indices.device}) must match q's ({q.device})")
    _check_positive_int("block_size", block_size)
    _check_cu_seqlens(cu_seqlens, "q", q, T)
    if gate is not None:
        _check_float_tensor("gate", gate, 4, "[B, T, HQ, V]")
        if gate.shape != (*q.shape[:3], v.shape[3]):
            raise ValueError(f"gate: shape {_shape(gate)} must be [B, T, HQ, V] = {(*q.shape[:3], v.shape[3])}")
        _check_same_dtype_device("gate", gate, "q", q)

    has_kernel = (
        _kernel_dtype_ok(q)
        and max(K, v.shape[3]) <= _KERNEL_MAX_HEAD_DIM
        and q.numel() > 0
        and v.numel() > 0
        and indices.shape[-1] > 0
    )
    if use_kernel("sparse_attention", q, k, v, indices, has_kernel=has_kernel):
        # Imported on use: Triton is a Linux-only dependency, and the reference path must import without it.
        from moe_tune.ops.sparse_attention.autograd import sparse_attention_kernel

        return sparse_attention_kernel(
            q, k, v, indices, block_size=block_size, scale=scale, cu_seqlens=cu_seqlens, gate=gate,
            query_start=query_start,
        )  # fmt: skip
    return sparse_attention_ref(
        q, k, v, indices, block_size=block_size, scale=scale, cu_seqlens=cu_seqlens, gate=gate, query_start=query_start
    )


def topk_indexer(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None = None,
    topk: int = 2048,
    scale: float | None = None,
    activation: str = "relu",
    block_size: int = 1,
    cu_seqlens: torch.Tensor | None = None,
    k_idx_is_pooled: bool = False,
    always_keep_own_block: bool = True,
    query_start: int = 0,
) -> torch.Tensor:
    """Pick, per query, the keys (or key blocks) that sparse_attention attends; no gradient.

    Score of query t on key s: sum_h w_idx[t, h] * act(scale * q_idx[t, h] . k_idx[s]), over keys s <= t of the
    query's own sequence (DeepSeek DSA's lightning indexer); query i sits at key position t = query_start + i.

    Args:
        q_idx: [B, Tq, HI, DI] bf16/fp16/fp32/fp64.
        k_idx: [B, T, DI], q_idx's dtype (one indexer key per token, shared by all indexer heads; T = query_start
            + Tq).
        w_idx: [B, Tq, HI], q_idx's dtype: per-query head weights. Default None: all ones.
        topk: selected slots S per query, >= 1: keys (block_size 1) or blocks (block_size > 1). Default 2048.
        scale: applied to q_idx . k_idx before the activation. Default DI**-0.5.
        activation: "relu" (default) or "none".
        block_size: 1 (default) selects tokens. > 1 selects blocks of block_size contiguous tokens of a sequence:
            the query's own block (the tail that contains it) is always kept; the complete blocks before it are
            scored with their mean-pooled k_idx and the topk - 1 best are kept.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences over the T keys (requires B == 1). Default
            None: each row is one sequence.
        k_idx_is_pooled: block mode only. True: k_idx already holds each block's key at the block's first row
            (the model pooled and transformed it, as QSA's normed and rotated mean); other rows are not read.
            Default False: blocks are scored with the mean of their rows' k_idx.
        always_keep_own_block: block mode only. Default True: as above. False (QSA): the candidates are the
            complete blocks the query sees, its own block included once complete, and the topk - 1 best are kept;
            the query's own block is added only while incomplete (the tail), so the last slot may stay -1.
        query_start: key position of the first query, >= 0, = T - Tq (as sparse_attention's): only the last Tq
            keys' queries are scored. Default 0: Tq == T.

    Returns:
        indices: [B, Tq, topk] int32, ascending, -1 padded when fewer than topk candidates; ties go to the lower
        index. block_size 1: key positions in the packed row (0 <= s <= t). block_size > 1: block ids j local to
        the query's sequence, covering row positions [o + j * block_size, ...) with o the sequence's start offset.
    """
    _check_float_tensor("q_idx", q_idx, 4, "[B, T, HI, DI]")
    _check_float_tensor("k_idx", k_idx, 3, "[B, T, DI]")
    _check_query_start(query_start)
    B, Tq, HI, DI = q_idx.shape
    T = Tq + query_start
    if k_idx.shape != (B, T, DI):
        raise ValueError(
            f"k_idx: shape {_shape(k_idx)} must be [B, T, DI] = {(B, T, DI)} from q_idx {_shape(q_idx)}"
            f" (T = query_start {query_start} + q_idx's {Tq} tokens)"
        )
    _check_same_dtype_device("k_idx", k_idx, "q_idx", q_idx)
    if w_idx is not None:
        _check_float_tensor("w_idx", w_idx, 3, "[B, T, HI]")
        if w_idx.shape != (B, Tq, HI):
            raise ValueError(
                f"w_idx: shape {_shape(w_idx)} must be [B, T, HI] = {(B, Tq, HI)} from q_idx {_shape(q_idx)}"
            )
        _check_same_dtype_device("w_idx", w_idx, "q_idx", q_idx)
    _check_positive_int("topk", topk)
    if activation not in INDEXER_ACTIVATIONS:
        raise ValueError(f"activation ({activation!r}) must be one of {', '.join(map(repr, INDEXER_ACTIVATIONS))}")
    _check_positive_int("block_size", block_size)
    _check_cu_seqlens(cu_seqlens, "q_idx", q_idx, T)

    has_kernel = _kernel_dtype_ok(q_idx) and DI <= _KERNEL_MAX_INDEX_DIM and q_idx.numel() > 0
    if use_kernel("topk_indexer", q_idx, k_idx, w_idx, has_kernel=has_kernel):
        from moe_tune.ops.sparse_attention.autograd import topk_indexer_kernel

        return topk_indexer_kernel(
            q_idx, k_idx, w_idx, topk=topk, scale=scale, activation=activation, block_size=block_size,
            cu_seqlens=cu_seqlens, k_idx_is_pooled=k_idx_is_pooled, always_keep_own_block=always_keep_own_block,
            query_start=query_start,
        )  # fmt: skip
    return topk_indexer_ref(
        q_idx, k_idx, w_idx, topk=topk, scale=scale, activation=activation, block_size=block_size,
        cu_seqlens=cu_seqlens, k_idx_is_pooled=k_idx_is_pooled, always_keep_own_block=always_keep_own_block,
        query_start=query_start,
    )  # fmt: skip
