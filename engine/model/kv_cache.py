"""Cached decoding of the softmax-attention token mixers: the key caches they grow, the attention of a few new queries
over them, and the indexers' top-k choice for those queries (the same rule as ops.sparse_attention's reference).

Each mixer's `forward_cached(x, step)` (engine/generate/cache.py's DecodeStep) runs its full packed forward on the
prefill (an empty state) and keeps what later queries need; later calls project only their own T tokens and attend
over the cache with the functions below. One sequence at a time: a cache holds one document, whose positions start
at 0, so a key's row in the cache is its position (less the rows a sliding window dropped).

Shapes: T new tokens, M cached keys (the new ones included), H query heads, G key/value heads, K / V key / value head
dims, HI / DI indexer heads / head dim, J complete key blocks, S selected slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_tune.ops.sparse_attention.reference import index_scores, select_from_block_scores, select_top

from .batch import PackedBatch
from .varlen import without_cudnn_sdpa

# New queries attended at once over the cache: bounds the [H, chunk, M] fp32 scores of a long continuation.
QUERY_CHUNK = 256


class GrowingCache:
    """Rows appended along dim 0 into a buffer whose capacity doubles, so decoding N tokens copies O(N) rows in all
    (torch.cat per token would copy the whole cache each step)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Appends rows [T, ...]; returns every row so far [M, ...] (a view of the buffer)."""
        needed = self.length + rows.shape[0]
        if self.buffer is None or needed > self.buffer.shape[0]:
            capacity = max(needed, 2 * (0 if self.buffer is None else self.buffer.shape[0]))
            grown = rows.new_empty(capacity, *rows.shape[1:])
            if self.buffer is not None:
                grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        self.buffer[self.length : needed] = rows
        self.length = needed
        return self.buffer[:needed]

    def keep_last(self, num_rows: int) -> None:
        """Drops all but the last num_rows rows (a sliding window's keys no later query sees)."""
        if self.length > num_rows:
            self.buffer[:num_rows] = self.buffer[self.length - num_rows : self.length].clone()
            self.length = num_rows

    @property
    def rows(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer[: self.length]


def one_document_batch(positions: torch.Tensor, mrope_positions: torch.Tensor | None = None) -> PackedBatch:
    """The PackedBatch of T tokens forming one document at `positions` [T] (the prefill's: 0 .. T - 1), rotated
    by `mrope_positions` [3, T] when given (a multimodal-RoPE model's tokens after or among images)."""
    num_tokens = positions.numel()
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=positions.device)
    return PackedBatch(cu_seqlens, positions, torch.zeros_like(positions), mrope_positions=mrope_positions)


def causal_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[T, M] bool: query t sees key m (key position <= query position, and within `window` keys of it when given)."""
    allowed_TM = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        allowed_TM &= query_positions[:, None] - key_positions[None, :] < window
    return allowed_TM


def selected_keys(indices_TS: torch.Tensor, query_positions: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """[T, M] bool: the keys an indexer's choice lets query t see, as ops.sparse_attention reads indices [T, S]
    (key positions, or block ids with block_size > 1; -1 unused), keys after the query left out."""
    num_slots = num_keys if block_size == 1 else math.ceil(num_keys / block_size)
    slot_TS = torch.where((indices_TS >= 0) & (indices_TS < num_slots), indices_TS.long(), num_slots)
    is_slot_selected = torch.zeros(indices_TS.shape[0], num_slots + 1, dtype=torch.bool, device=indices_TS.device)
    is_slot_selected.scatter_(-1, slot_TS, True)
    key_M = torch.arange(num_keys, device=indices_TS.device)
    allowed_TM = is_slot_selected[:, key_M // block_size]
    return allowed_TM & causal_keys(query_positions, key_M)


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(scores) over the allowed keys (last dim), fp32; a row with no allowed key gets all-zero weights (as
    ops.sparse_attention's reference: its output is 0)."""
    has_key = allowed.any(-1, keepdim=True)
    # Rows without a key would softmax to NaN: give them finite scores, then zero weights.
    scores = scores.float().masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    return torch.softmax(scores, -1) * has_key


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed_TM: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of T new queries over M cached keys, fp32 throughout.

    q: [T, H, K], k: [M, G, K], v: [M, G, V] (query head h reads kv head h // (H / G)); allowed_TM: [T, M] bool;
    scale: default K**-0.5; sinks: [H] or None, one more logit per head whose value is 0 (gpt_oss); gate: [T, H, V]
    or None, the output times sigmoid(gate). A query that sees no key (and no sink) gets 0. Returns [T, H, V] in
    q's dtype. On CUDA without sinks: one SDPA call (its fused kernels read the cache in its own dtype and keep the
    scores in fp32); every query must see a key (as causal, windowed and top-k choices always do).
    """
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if q.is_cuda and sinks is None:
        return sdpa_cached_attention(q, k, v, allowed_TM, scale, gate)
    k32, v32 = k.float(), v.float()
    outputs = []
    for first in range(0, num_queries, QUERY_CHUNK):
        q_TGJK = q[first : first + QUERY_CHUNK].float().unflatten(1, (num_kv_heads, group))
        allowed_TM1 = allowed_TM[first : first + QUERY_CHUNK]
        scores_GJTM = torch.einsum("tgjk,mgk->gjtm", q_TGJK, k32) * scale
        if sinks is not None:
            # The sink is one more key, always allowed, whose value is 0: its column is dropped after the softmax.
            sink_GJT1 = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, len(allowed_TM1), 1)
            scores_GJTM = torch.cat([sink_GJT1, scores_GJTM], -1)
            allowed_TM1 = F.pad(allowed_TM1, (1, 0), value=True)
        probs_GJTM = masked_softmax(scores_GJTM, allowed_TM1)
        if sinks is not None:
            probs_GJTM = probs_GJTM[..., 1:]
        o_THV = torch.einsum("gjtm,mgv->tgjv", probs_GJTM, v32).flatten(1, 2)
        if gate is not None:
            o_THV = o_THV * torch.sigmoid(gate[first : first + QUERY_CHUNK].float())
        outputs.append(o_THV)
    return torch.cat(outputs).to(q.dtype)


def sdpa_cached_attention(q, k, v, allowed_TM, scale: float, gate: torch.Tensor | None) -> torch.Tensor:
    """cached_attention through SDPA: the queries of each kv head's group are rows of that head, so k and v [M, G, .]
    are read as they are (no copy per query head)."""
    num_queries, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # [1, G, J * T, K]: row j * T + t is query head g * J + j at token t.
    q_1GRK = q.unflatten(1, (num_kv_heads, group)).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * num_queries, -1)
    k_1GMK, v_1GMV = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    with without_cudnn_sdpa():
        o_1GRV = F.scaled_dot_product_attention(q_1GRK, k_1GMK, v_1GMV, attn_mask=allowed_TM.repeat(group, 1), scale=scale)
    o_THV = o_1GRV[0].unflatten(1, (group, num_queries)).permute(2, 0, 1, 3).flatten(1, 2)
    if gate is not None:
        o_THV = (o_THV.float() * torch.sigmoid(gate.float())).to(q.dtype)
    return o_THV


def select_cached_keys(
    q_THD: torch.Tensor, w_TH: torch.Tensor | None, keys_MD: torch.Tensor, query_positions: torch.Tensor, topk: int,
    scale: float | None = None,
) -> torch.Tensor:
    """ops.topk_indexer (block_size 1) for T new queries over the M cached indexer keys of their document: the topk
    best keys at or before each query, int64 [T, topk] key positions, ascending, -1 padded, ties to the lower key."""
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    w_TH = torch.ones(q_THD.shape[:2], device=q_THD.device) if w_TH is None else w_TH
    scores_TM = index_scores(q_THD.float(), w_TH.float(), keys_MD.float(), scale, "relu")
    key_M = torch.arange(keys_MD.shape[0], device=keys_MD.device)
    return select_top(scores_TM, causal_keys(query_positions, key_M), topk)


def select_cached_blocks(
    q_THD: torch.Tensor,
    w_TH: torch.Tensor | None,
    block_keys_JD: torch.Tensor,
    query_positions: torch.Tensor,
    topk: int,
    block_size: int,
    always_keep_own_block: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """ops.topk_indexer in block mode for T new queries, given the keys of the J complete blocks of their document
    (pooled as the caller's full forward pools them): block ids int64 [T, topk], ascending, -1 padded.

    always_keep_own_block True (DSA): the query's own block plus the topk - 1 best complete blocks before it.
    False (QSA): the topk - 1 best complete blocks it sees, its own once complete, plus its own while incomplete.
    block_size 1 (either): the topk best keys up to the query, as the op selects tokens.
    """
    if block_size == 1:
        # The op's token mode: the topk best keys up to the query, its own among the candidates, no tail slot.
        return select_cached_keys(q_THD, w_TH, block_keys_JD, query_positions, topk, scale)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    w_TH = torch.ones(q_THD.shape[:2], device=q_THD.device) if w_TH is None else w_TH
    num_complete = block_keys_JD.shape[0]
    pos_T1 = query_positions[:, None]
    num_blocks = max(num_complete, int(query_positions.max()) // block_size + 1)
    scores_TJ = F.pad(
        index_scores(q_THD.float(), w_TH.float(), block_keys_JD.float(), scale, "relu"), (0, num_blocks - num_complete)
    )
    return select_from_block_scores(scores_TJ, pos_T1, topk, block_size, always_keep_own_block)


def mean_pooled_blocks(keys_MD: torch.Tensor, block_size: int) -> torch.Tensor:
    """The mean key of each complete block [J, D], as ops.sparse_attention's reference pools raw keys (block_size 1:
    the keys themselves)."""
    if block_size == 1:
        return keys_MD
    num_complete = keys_MD.shape[0] // block_size
    return keys_MD[: num_complete * block_size].float().view(num_complete, block_size, keys_MD.shape[-1]).mean(dim=1)
