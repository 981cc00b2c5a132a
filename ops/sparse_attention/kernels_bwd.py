"""Triton backward of top-k sparse attention: dq query by query, dk and dv key tile by key tile, no atomics.

Legend as kernels_fwd.py (queries indexed by flat query, their key positions by query_key_position); R (query,
head) rows of a backward tile = BQ queries x GP heads (GP = G padded to a power of two), BKT keys of a key tile, NS
key slots (blocks; at token level, key tiles), NC chunks of the slots' query lists, P (query, block) pairs.

1. `_sparse_attn_bwd_dq_kernel`, one program per (query, kv head), the forward's loop again: p from the saved
   lse, dp = do v^T, ds = p (dp - delta), dq += ds k. It also writes delta = rowsum(do * o) [NT, HQ] for step 2.
2. `_sparse_attn_bwd_dkv_kernel`, one program per (chunk of a key tile's queries, kv head): it visits the queries
   that may have selected its keys, BQ at a time, and accumulates dv += p^T do and dk += ds^T q in registers; no
   atomics. Each key tile's query list is cut into chunks of at most dkv_chunk_pairs queries (`pair_chunks`), so
   that the tiles visited by the most queries do not serialise the pass; every program writes fp32 partials and
   `_dkv_reduce_kernel` sums them per key tile in chunk order (deterministic).
   - Token level: key tile = BKT consecutive key positions of a row; queries = every query at a later key position
     of the sequence of the tile's last key, consecutive. Which (query, key) pairs were selected comes from the
     selection bitmap of the canonicalisation: the BKT / 32 words of each query row, one load per (row, word). The
     products run for every visited query tile (no branch, so the loads of the next tile can be pipelined).
   - Block level: key tile = (part of) one block slot; queries = exactly the queries that selected that block,
     read from a key-sorted pair list (CSR: `block_pairs`, one stable sort of the canonical indices), so no
     unselected query is ever visited.
   The products are written key-major (sT = k q^T); q and do are loaded once and transposed in registers, never a
   product (see kernels_fwd.py on the Triton bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_tune.ops.sparse_attention.kernels_fwd import LOG2E, AttentionConfig, num_steps, padded
from moe_tune.ops.sparse_attention.kernels_select import (
    BITS_PER_WORD,
    BlockSlots,
    SequenceLayout,
    dot_precision,
    query_key_position,
)

# Kernels read module globals only when they are constexpr.
_BITS_PER_WORD = tl.constexpr(BITS_PER_WORD)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests replace it to fill buffers with NaN and guard their ends)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _sparse_attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, idx_ptr, seq_start_ptr, gate_ptr, dq_ptr, delta_ptr, dgate_ptr,
    do_attn_ptr,
    S, num_steps, qk_scale, scale, T, TQ,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, H_IDX: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BKEY: tl.constexpr, IS_BLOCK: tl.constexpr,
    GATED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (flat query, kv head). GATED: o is the gated output o_g = o_attn * sigmoid(gate);
    delta = rowsum(do * o_g) is the same sum for the attention's own gradient do_attn = do * sigmoid(gate), written
    here for the dk/dv kernel with dgate = do * o_g * (1 - sigmoid(gate))."""
    query = tl.program_id(0)
    h = tl.program_id(1)
    t64 = query.to(tl.int64)
    # The query's key position.
    t = query_key_position(query, TQ, T)
    rows = tl.arange(0, GP)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    is_row = rows < G
    head_rows = t64 * (H * G) + h * G + rows
    q = tl.load(q_ptr + head_rows[:, None] * K + dk[None, :], mask=is_row[:, None] & (dk[None, :] < K), other=0.0)
    v_mask = is_row[:, None] & (dv[None, :] < V)
    v_offsets = head_rows[:, None] * V + dv[None, :]
    do = tl.load(do_ptr + v_offsets, mask=v_mask, other=0.0)
    o = tl.load(o_ptr + v_offsets, mask=v_mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(delta_ptr + head_rows, delta, mask=is_row)
    if GATED:
        sig = tl.sigmoid(tl.load(gate_ptr + v_offsets, mask=v_mask, other=0.0).to(tl.float32))
        dgate = do.to(tl.float32) * o.to(tl.float32) * (1.0 - sig)
        tl.store(dgate_ptr + v_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=v_mask)
        do = (do.to(tl.float32) * sig).to(do.dtype)
        tl.store(do_attn_ptr + v_offsets, do, mask=v_mask)
    lse = tl.load(lse_ptr + head_rows, mask=is_row, other=0.0)
    acc = tl.zeros([GP, BK], dtype=tl.float32)
    idx_row = idx_ptr + (t64 * H_IDX + h % H_IDX) * S
    seq_start = tl.load(seq_start_ptr + t)
    steps_per_block = (BLOCK_SIZE + BKEY - 1) // BKEY
    for step in range(num_steps):
        if IS_BLOCK:
            k0 = (step % steps_per_block) * BKEY + tl.arange(0, BKEY)
            j = tl.load(idx_row + step // steps_per_block)
            pos = seq_start + j * BLOCK_SIZE + k0
            is_key = (j >= 0) & (k0 < BLOCK_SIZE) & (pos <= t)
        else:
            slots = step * BS + tl.arange(0, BS)
            pos = tl.load(idx_row + slots, mask=slots < S, other=-1)
            is_key = pos >= 0
        # No branch (as in the forward): masked tiles add 0, and the next tile's loads can be pipelined.
        pos64 = tl.where(is_key, pos, 0).to(tl.int64)
        # One key tile serves both products: s = q k^T (k transposed in registers) and dq += ds k.
        k_tile = tl.load(
            k_ptr + (pos64[:, None] * H + h) * K + dk[None, :], mask=is_key[:, None] & (dk[None, :] < K), other=0.0
        )
        p = tl.exp2(tl.dot(q, tl.trans(k_tile), input_precision=PRECISION) * qk_scale - lse[:, None])
        p = tl.where(is_key[None, :], p, 0.0)
        v_t = tl.load(
            v_ptr + (pos64[None, :] * H + h) * V + dv[:, None], mask=is_key[None, :] & (dv[:, None] < V), other=0.0
        )
        dp = tl.dot(do, v_t, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        acc += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PRECISION)
    tl.store(
        dq_ptr + head_rows[:, None] * K + dk[None, :],
        (acc * scale).to(dq_ptr.dtype.element_ty),
        mask=is_row[:, None] & (dk[None, :] < K),
    )


@triton.jit
def _dkv_tile(
    q_ptr, do_ptr, lse_ptr, delta_ptr, k_tile, v_tile, dk_acc, dv_acc, t_rows, is_row, is_pair, h, row_head, dk, dv,
    qk_scale, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dk_acc += ds^T q and dv_acc += p^T do over one tile of R (query, head) rows, in key-major orientation."""
    head_rows = t_rows.to(tl.int64) * (H * G) + h * G + row_head
    q_rows = tl.load(q_ptr + head_rows[:, None] * K + dk[None, :], mask=is_row[:, None] & (dk[None, :] < K), other=0.0)
    do_rows = tl.load(
        do_ptr + head_rows[:, None] * V + dv[None, :], mask=is_row[:, None] & (dv[None, :] < V), other=0.0
    )
    lse = tl.load(lse_ptr + head_rows, mask=is_row, other=0.0)
    delta = tl.load(delta_ptr + head_rows, mask=is_row, other=0.0)
    # q and do are read once and transposed in registers (a loaded tile, not a product: see kernels_fwd.py).
    s_t = tl.dot(k_tile, tl.trans(q_rows), input_precision=PRECISION) * qk_scale
    p_t = tl.where(is_pair, tl.exp2(s_t - lse[None, :]), 0.0)
    dv_acc += tl.dot(p_t.to(do_rows.dtype), do_rows, input_precision=PRECISION)
    dp_t = tl.dot(v_tile, tl.trans(do_rows), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk_acc += tl.dot(ds_t.to(q_rows.dtype), q_rows, input_precision=PRECISION)
    return dk_acc, dv_acc


@triton.jit
def _sparse_attn_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, part_dk_ptr, part_dv_ptr,
    bits_ptr, slot_first_ptr, slot_len_ptr, chunk_slot_ptr, chunk_pair_ptr, chunk_num_ptr, pair_query_ptr,
    T, TQ, NW, NC, NSUB, qk_scale,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, H_IDX: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKT: tl.constexpr, BQ: tl.constexpr, IS_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 partial dk (unscaled), dv [H, NC, NSUB, BKT, BK / BV] of (part NSUB of) a key slot over one chunk of its
    queries. Token level: a slot is a key tile, a chunk's queries are chunk_num consecutive flat queries from
    chunk_pair (NSUB 1). Block level: a slot is a block, a chunk lists chunk_num flat queries at
    pair_query[chunk_pair:]."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    h_idx = h % H_IDX
    rows = tl.arange(0, BQ * GP)
    row_query = rows // GP
    row_head = rows % GP
    keys = tl.arange(0, BKT)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    chunk = pid // NSUB
    sub0 = (pid % NSUB) * BKT
    slot = tl.load(chunk_slot_ptr + h_idx * NC + chunk)
    num_tokens = tl.load(slot_len_ptr + slot)
    k0 = tl.load(slot_first_ptr + slot) + sub0
    is_key = sub0 + keys < num_tokens
    pair_lo = tl.load(chunk_pair_ptr + h_idx * NC + chunk)
    num_queries = tl.where(sub0 < num_tokens, tl.load(chunk_num_ptr + h_idx * NC + chunk), 0)
    if not IS_BLOCK:
        # Key tiles never cross a row: the bitmap's words count key positions from the row's start.
        key_in_row = k0 % T + keys
        word0 = (k0 % T) // _BITS_PER_WORD
        key_word = (key_in_row // _BITS_PER_WORD - word0)[:, None]
        key_bit = (key_in_row % _BITS_PER_WORD)[:, None]
    pos64 = (k0 + keys).to(tl.int64)
    k_tile = tl.load(
        k_ptr + (pos64[:, None] * H + h) * K + dk[None, :], mask=is_key[:, None] & (dk[None, :] < K), other=0.0
    )
    v_tile = tl.load(
        v_ptr + (pos64[:, None] * H + h) * V + dv[None, :], mask=is_key[:, None] & (dv[None, :] < V), other=0.0
    )
    dk_acc = tl.zeros([BKT, BK], dtype=tl.float32)
    dv_acc = tl.zeros([BKT, BV], dtype=tl.float32)
    for q0 in range(0, num_queries, BQ):
        is_row = (q0 + row_query < num_queries) & (row_head < G)
        if IS_BLOCK:
            t_rows = tl.load(pair_query_ptr + pair_lo + q0 + row_query, mask=is_row, other=0)
            # Every listed query selected the block; it sees the block's keys up to its own key position.
            t_keys = query_key_position(t_rows, TQ, T)
            is_pair = is_key[:, None] & is_row[None, :] & (k0 + keys[:, None] <= t_keys[None, :])
        else:
            t_rows = pair_lo + q0 + row_query
            word_ptr = bits_ptr + (t_rows.to(tl.int64) * H_IDX + h_idx) * NW + word0
            words = tl.zeros([BKT, BQ * GP], dtype=tl.int32)
            for j in tl.static_range((BKT + _BITS_PER_WORD - 1) // _BITS_PER_WORD):
                word = tl.load(word_ptr + j, mask=is_row & (word0 + j < NW), other=0)
                words = tl.where(key_word == j, word[None, :], words)
            is_pair = is_key[:, None] & (((words >> key_bit) & 1) != 0)
        dk_acc, dv_acc = _dkv_tile(
            q_ptr, do_ptr, lse_ptr, delta_ptr, k_tile, v_tile, dk_acc, dv_acc, t_rows, is_row, is_pair, h,
            row_head, dk, dv, qk_scale, H, G, K, V, PRECISION,
        )  # fmt: skip
    part = ((h * NC + chunk).to(tl.int64) * NSUB + pid % NSUB) * BKT + keys
    tl.store(part_dk_ptr + part[:, None] * BK + dk[None, :], dk_acc)
    tl.store(part_dv_ptr + part[:, None] * BV + dv[None, :], dv_acc)


@triton.jit
def _dkv_reduce_kernel(
    part_dk_ptr, part_dv_ptr, dk_ptr, dv_ptr, slot_first_ptr, slot_len_ptr, chunk_offsets_ptr,
    NS, NC, NSUB, scale,
    H: tl.constexpr, H_IDX: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKT: tl.constexpr,
):  # fmt: skip
    """One program per (key slot part, kv head): dk, dv = the sum of the slot's chunk partials, in chunk order."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    slot = pid // NSUB
    sub = pid % NSUB
    keys = tl.arange(0, BKT)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    offsets = chunk_offsets_ptr + (h % H_IDX) * (NS + 1) + slot
    c0 = tl.load(offsets)
    c1 = tl.load(offsets + 1)
    dk_acc = tl.zeros([BKT, BK], dtype=tl.float32)
    dv_acc = tl.zeros([BKT, BV], dtype=tl.float32)
    for c in range(c0, c1):
        part = ((h * NC + c).to(tl.int64) * NSUB + sub) * BKT + keys
        dk_acc += tl.load(part_dk_ptr + part[:, None] * BK + dk[None, :])
        dv_acc += tl.load(part_dv_ptr + part[:, None] * BV + dv[None, :])
    is_key = sub * BKT + keys < tl.load(slot_len_ptr + slot)
    pos64 = (tl.load(slot_first_ptr + slot) + sub * BKT + keys).to(tl.int64)
    tl.store(
        dk_ptr + (pos64[:, None] * H + h) * K + dk[None, :],
        (dk_acc * scale).to(dk_ptr.dtype.element_ty),
        mask=is_key[:, None] & (dk[None, :] < K),
    )
    tl.store(
        dv_ptr + (pos64[:, None] * H + h) * V + dv[None, :],
        dv_acc.to(dv_ptr.dtype.element_ty),
        mask=is_key[:, None] & (dv[None, :] < V),
    )


def key_tiles(NT: int, T: int, key_tile: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The key tiles of rows of T tokens, key_tile keys each (less at a row's end): (first flat key, key count),
    [NT / T * ceil(T / key_tile)] int32 each."""
    tiles_per_row = triton.cdiv(T, key_tile)
    tile = torch.arange(NT // T * tiles_per_row, device=device, dtype=torch.int32)
    key_in_row = tile % tiles_per_row * key_tile
    first = tile // tiles_per_row * T + key_in_row
    return first.contiguous(), (T - key_in_row).clamp(max=key_tile).to(torch.int32).contiguous()


def token_chunking(
    NT: int, T: int, key_tile: int, min_chunk: int, max_chunks: int, TQ: int | None = None
) -> tuple[int, int]:
    """(max_pairs, chunk_pairs) of the token-level key tiles: tile j of a row is visited by at most
    min(TQ, T - j * key_tile) queries (exactly that many without packed documents; TQ the row's queries, default T);
    chunks take at least min_chunk queries and more when needed to keep their number near max_chunks."""
    TQ = T if TQ is None else TQ
    tiles_per_row = triton.cdiv(T, key_tile)
    # Tiles 0 .. num_full - 1 are visited by all TQ queries, the later ones by T - j * key_tile.
    num_full = min(tiles_per_row, (T - TQ) // key_tile + 1)
    later_tiles = tiles_per_row - num_full
    sum_later_j = (num_full + tiles_per_row - 1) * later_tiles // 2
    max_pairs = NT // T * (num_full * TQ + later_tiles * T - key_tile * sum_later_j)
    return max_pairs, max(min_chunk, triton.cdiv(max_pairs, max_chunks))


def block_pairs(
    canon_THS: torch.Tensor, layout: SequenceLayout, slots: BlockSlots
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (query, block) pairs of canonical block ids [NQ, H', S] grouped by block: (pair_query [P] int32, flat
    queries ascending per block; pair_start, pair_end [H', NS] int32, each block slot's range in pair_query). No host
    sync."""
    NQ, H_idx, S = canon_THS.shape
    NT = layout.num_tokens
    query_seq_start = layout.seq_start if NQ == NT else layout.seq_start[layout.query_positions()]
    block_first = query_seq_start.long()[:, None, None] + canon_THS.long() * slots.block_size
    head = torch.arange(H_idx, device=canon_THS.device)[None, :, None]
    # Unused slots sort to the end under a key no block has.
    pair_key = torch.where(canon_THS >= 0, head * NT + block_first, H_idx * NT).flatten()
    sorted_key, order = torch.sort(pair_key, stable=True)
    pair_query = torch.div(order, H_idx * S, rounding_mode="floor").to(torch.int32)
    slot_key = torch.arange(H_idx, device=canon_THS.device)[:, None] * NT + slots.first.long()[None, :]
    pair_start = torch.searchsorted(sorted_key, slot_key).to(torch.int32)
    pair_end = torch.searchsorted(sorted_key, slot_key, right=True).to(torch.int32)
    return pair_query.contiguous(), pair_start.contiguous(), pair_end.contiguous()


@dataclass(frozen=True)
class PairChunks:
    """The pair lists of the key slots (blocks, or key tiles at token level) cut into chunks of at most chunk_pairs
    pairs, at least one chunk per slot, so that the dk/dv programs get similar work however many queries visit a
    slot (early blocks are picked most; at token level, early key tiles are visited by the most queries).

    chunk_offsets: [H', NS + 1] int32, slot j's chunks are [chunk_offsets[j], chunk_offsets[j + 1]).
    chunk_slot, chunk_pair, chunk_num: [H', NC] int32: a chunk's slot, first pair and pair count (0 past the end).
    """

    chunk_offsets: torch.Tensor
    chunk_slot: torch.Tensor
    chunk_pair: torch.Tensor
    chunk_num: torch.Tensor


def pair_chunks(
    pair_start: torch.Tensor, pair_end: torch.Tensor, max_pairs: int, chunk_pairs: int
) -> PairChunks:
    """Chunks of the pair lists (pair_start, pair_end [H', NS]) without a host sync: NC is the bound
    NS + ceil(max_pairs / chunk_pairs) on sum_j max(1, ceil(pairs_j / chunk_pairs))."""
    H_idx, NS = pair_start.shape
    num_pairs = (pair_end - pair_start).long()
    num_chunks = torch.clamp((num_pairs + chunk_pairs - 1) // chunk_pairs, min=1)
    chunk_offsets = F.pad(num_chunks.cumsum(1), (1, 0))
    NC = NS + triton.cdiv(max_pairs, chunk_pairs)
    chunk = torch.arange(NC, device=pair_start.device).expand(H_idx, NC).contiguous()
    slot = torch.searchsorted(chunk_offsets[:, 1:].contiguous(), chunk, right=True)
    is_chunk = slot < NS
    slot = slot.clamp(max=NS - 1)
    first = pair_start.long().gather(1, slot) + (chunk - chunk_offsets.gather(1, slot)) * chunk_pairs
    num = (pair_end.long().gather(1, slot) - first).clamp(0, chunk_pairs)
    return PairChunks(
        chunk_offsets.to(torch.int32).contiguous(),
        slot.to(torch.int32).contiguous(),
        torch.where(is_chunk, first, 0).to(torch.int32).contiguous(),
        torch.where(is_chunk, num, 0).to(torch.int32).contiguous(),
    )


def sparse_attention_bwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    o_THV: torch.Tensor,
    lse_TH: torch.Tensor,
    do_THV: torch.Tensor,
    canon_THS: torch.Tensor,
    bits: torch.Tensor,
    layout: SequenceLayout,
    slots: BlockSlots | None,
    block_size: int,
    scale: float,
    config: AttentionConfig,
    gate_THV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dgate) in the inputs' dtype; o_THV is the forward's (gated) output, dgate None without a gate.
    Queries (q, o, do, lse, canonical indices, bitmap, dq, dgate) [NQ, ...], keys (k, v, dk, dv) [NT, ...]."""
    NQ, HQ, K = q_THK.shape
    NT = k_THK.shape[0]
    H, V = k_THK.shape[1], v_THV.shape[2]
    G = HQ // H
    H_idx, S = canon_THS.shape[1:]
    device = q_THK.device
    precision = dot_precision(q_THK.dtype)
    T, TQ = layout.row_len, layout.queries_per_row
    dq = _alloc((NQ, HQ, K), q_THK.dtype, device)
    delta = _alloc((NQ, HQ), torch.float32, device)
    gated = gate_THV is not None
    # With the gate, the dq kernel writes the attention's own output gradient do * sigmoid(gate) for the dk/dv kernel.
    dgate = _alloc((NQ, HQ, V), gate_THV.dtype, device) if gated else None
    do_attn = _alloc((NQ, HQ, V), do_THV.dtype, device) if gated else do_THV
    common = dict(H=H, G=G, GP=padded(G), H_IDX=H_idx, K=K, V=V, BK=padded(K), BV=padded(V), PRECISION=precision)
    _sparse_attn_bwd_dq_kernel[(NQ, H)](
        q_THK, k_THK, v_THV, o_THV, do_THV, lse_TH, canon_THS, layout.seq_start, gate_THV if gated else do_THV,
        dq, delta, dgate if gated else dq, do_attn,
        S, num_steps(S, block_size, config), scale * LOG2E, scale, T, TQ,
        BS=config.token_tile, BLOCK_SIZE=block_size, BKEY=config.block_key_tile, IS_BLOCK=block_size > 1,
        GATED=gated, **common, **config.launch_dq,
    )  # fmt: skip

    key_tile = config.dkv_key_tile
    group_rows = triton.next_power_of_2(G)
    queries_per_tile = max(1, triton.cdiv(config.dkv_rows, group_rows))
    common.update(GP=group_rows)
    if block_size == 1:
        slot_first, slot_len, num_sub = *key_tiles(NT, T, key_tile, device), 1
        # A key tile's queries: from the query at its first key (or the row's first query) to the one at the end of
        # the sequence of its last key, as flat queries (query i of row b at key position b * T + T - TQ + i).
        row_base = slot_first // T * T
        query_base = slot_first // T * TQ - (T - TQ)
        pair_start = (query_base + torch.clamp(slot_first - row_base, min=T - TQ)).to(torch.int32)
        last_end = layout.seq_end[(slot_first + slot_len - 1).long()]
        pair_end = torch.maximum(query_base + last_end - row_base, pair_start).to(torch.int32)
        pair_start = pair_start[None, :].expand(H_idx, -1).contiguous()
        pair_end = pair_end[None, :].expand(H_idx, -1).contiguous()
        max_pairs, chunk_pairs = token_chunking(
            NT, T, key_tile, config.dkv_chunk_pairs, config.dkv_token_chunks, TQ
        )  # fmt: skip
        pair_query = layout.seq_end  # unused at token level
    else:
        slot_first, slot_len, num_sub = slots.first, slots.length, triton.cdiv(block_size, key_tile)
        pair_query, pair_start, pair_end = block_pairs(canon_THS, layout, slots)
        max_pairs, chunk_pairs = NQ * S, config.dkv_chunk_pairs
    chunks = pair_chunks(pair_start, pair_end, max_pairs, chunk_pairs)
    NC = chunks.chunk_slot.shape[1]
    part_shape = (H, NC, num_sub, key_tile)
    part_dk = torch.empty((*part_shape, common["BK"]), dtype=torch.float32, device=device)
    part_dv = torch.empty((*part_shape, common["BV"]), dtype=torch.float32, device=device)
    _sparse_attn_bwd_dkv_kernel[(NC * num_sub, H)](
        q_THK, k_THK, v_THV, do_attn, lse_TH, delta, part_dk, part_dv,
        bits, slot_first, slot_len, chunks.chunk_slot, chunks.chunk_pair, chunks.chunk_num, pair_query,
        T, TQ, bits.shape[2], NC, num_sub, scale * LOG2E,
        BKT=key_tile, BQ=queries_per_tile, IS_BLOCK=block_size > 1, **common, **config.launch_dkv,
    )  # fmt: skip
    dk = _alloc((NT, H, K), k_THK.dtype, device)
    dv = _alloc((NT, H, V), v_THV.dtype, device)
    _dkv_reduce_kernel[(slot_first.numel() * num_sub, H)](
        part_dk, part_dv, dk, dv, slot_first, slot_len, chunks.chunk_offsets,
        slot_first.numel(), NC, num_sub, scale,
        H=H, H_IDX=H_idx, K=K, V=V, BK=common["BK"], BV=common["BV"], BKT=key_tile, **config.launch_dkv,
    )  # fmt: skip
    return dq, dk, dv, dgate
