"""Triton forward of top-k sparse attention over canonical indices (kernels_select.canonical_indices).

Legend: NT flat tokens (keys), NQ flat queries (each row's last TQ tokens: kernels_select.query_key_position gives
a query's key position, which causality and its sequence read; queries, indices, o and lse are indexed by query),
HQ query heads, H kv heads, G = HQ / H query heads per kv head, GP = G padded to a power of
two (at least 16, the smallest tl.dot size), K / V head dims (BK / BV padded), S slots, bs block_size.

One program per (query t, kv head h) holds the G query heads that read kv head h as a [GP, K] tile and runs an
online softmax over its selected keys, gathered straight from k and v by pointer arithmetic: [B, T, S, D] gathered
copies are never built. Token level (bs 1): tiles of BS slots, each slot one key row. Block level: one slot at a
time, its bs contiguous keys in tiles of BKEY rows, causally masked inside the query's own block. Unused slots (-1)
are skipped. Writes o [NT, HQ, V] and the log2-domain log-sum-exp lse [NT, HQ] fp32 that the backward reuses
(0 for a query without any key, whose output is 0).

Triton 3.4-3.7.0 on Hopper miscompiles tl.trans of a tl.dot result that feeds another tl.dot (fla-org/
flash-linear-attention#640): no kernel here or in kernels_bwd.py transposes a product; the backward transposes only
loaded tiles (k, q, do), so that each is read once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.sparse_attention.kernels_select import (
    MIN_DOT_SIZE,
    SequenceLayout,
    dot_precision,
    query_key_position,
)

# log2(e): the kernels use exp2 with the scale folded in.
LOG2E = math.log2(math.e)
# Token level: 64 gathered keys per step, one [16, 128] x [128, 64] product per tile at 16 query heads per kv head.
GPU_TOKEN_TILE = 64
# Block level: a 64-token block is one tile; larger blocks loop.
GPU_BLOCK_KEY_TILE = 64
GPU_NUM_WARPS_FWD = 4
# Branch-free loop bodies pipeline: forward 2 stages 2.14 / 2.68 ms (block / token) against 2.17 / 3.02 at 3 stages and
# 2.84 / 4.57 at 8 warps, dq at 3 stages (H200, issue 6's shapes; docs/perf-history.md).
GPU_NUM_STAGES_FWD = 2
GPU_NUM_STAGES_DQ = 3
# Backward key-major kernel: 64 (query, head) rows per step; token level 128 keys a tile, block level one block (at
# most 64 keys). At 64 keys Triton laid the [64, 64] products over 8 warps of 16 rows (warpsPerCTA [8, 1], sm_90
# TTGIR), a layout that puts both warpgroups on the same 64 rows (read off the layout, not profiled). The dk/dv
# kernel alone at issue 6's token shape on the H200: 6.07 ms at 128 keys in query chunks against 9.36 at 64 keys on 4
# warps with 2 stages (op fwd+bwd 11.91 against 12.15 ms; docs/perf-history.md, sparse attention).
GPU_DKV_KEY_TILE = 128
GPU_DKV_ROWS = 64
# 8 warps: the [128, 128] fp32 dk and dv accumulators are 128 registers a thread (ptxas sm_90a: 254 in all, no
# spill).
GPU_NUM_WARPS_DKV = 8
# A dk/dv program takes at most this many (query, key tile) pairs (256 steps of 4 queries): block level, the early
# blocks, picked by up to 3x the average number of queries, are split over several programs; token level, every
# key tile's queries run to the end of its sequence, so the first tiles of a row would serialise the pass. The
# programs write fp32 partials that a second kernel sums in order (deterministic).
GPU_DKV_CHUNK_PAIRS = 1024
# Token level: at most about this many chunks a launch (longer sequences take longer chunks), so the fp32 partials
# stay near NT x 1 KB (K = V = 128) plus this many chunks of [128, 256] fp32 (128 MB).
GPU_DKV_TOKEN_CHUNKS = 1024
# The interpreter: 16-wide tiles make the small test shapes take the multi-tile paths, and 5-pair chunks split the
# pair lists of the test shapes' blocks and key tiles unevenly.
INTERPRETER_TILE = MIN_DOT_SIZE
INTERPRETER_DKV_CHUNK_PAIRS = 5
INTERPRETER_DKV_TOKEN_CHUNKS = 1 << 30


@dataclass(frozen=True)
class AttentionConfig:
    token_tile: int
    block_key_tile: int
    dkv_key_tile: int
    dkv_rows: int
    dkv_chunk_pairs: int
    dkv_token_chunks: int
    launch: dict
    launch_dq: dict
    launch_dkv: dict


def pick_config(x: torch.Tensor, block_size: int) -> AttentionConfig:
    if not x.is_cuda:
        # CPU tensors only reach a kernel under TRITON_INTERPRET=1.
        tile = INTERPRETER_TILE
        return AttentionConfig(
            tile, tile, tile, tile, INTERPRETER_DKV_CHUNK_PAIRS, INTERPRETER_DKV_TOKEN_CHUNKS, {}, {}, {}
        )
    key_tile = max(MIN_DOT_SIZE, min(GPU_BLOCK_KEY_TILE, triton.next_power_of_2(block_size)))
    return AttentionConfig(
        GPU_TOKEN_TILE,
        key_tile,
        GPU_DKV_KEY_TILE if block_size == 1 else key_tile,
        GPU_DKV_ROWS,
        GPU_DKV_CHUNK_PAIRS,
        GPU_DKV_TOKEN_CHUNKS,
        dict(num_warps=GPU_NUM_WARPS_FWD, num_stages=GPU_NUM_STAGES_FWD),
        dict(num_warps=GPU_NUM_WARPS_FWD, num_stages=GPU_NUM_STAGES_DQ),
        dict(num_warps=GPU_NUM_WARPS_DKV, num_stages=1),
    )


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests replace it to fill buffers with NaN and guard their ends)."""
    return torch.empty(shape, dtype=dtype, device=device)


def padded(dim: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(dim))


@triton.jit
def _sparse_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, seq_start_ptr, gate_ptr, o_ptr, lse_ptr,
    S, num_steps, qk_scale, T, TQ,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, H_IDX: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BKEY: tl.constexpr, IS_BLOCK: tl.constexpr,
    GATED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (flat query, kv head). num_steps: cdiv(S, BS) tiles of slots (token level) or
    S x cdiv(bs, BKEY) key tiles (block level). GATED: o is multiplied by sigmoid(gate) [NQ, HQ, V] before it is
    stored (the output gate, fused)."""
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
    # A finite floor instead of -inf: a query whose first tiles are all masked must not compute -inf - -inf.
    m = tl.full([GP], -1e30, dtype=tl.float32)
    l = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BV], dtype=tl.float32)
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
        # No branch around the products: a tile of unused slots (-1 padding of early queries) loads nothing and
        # adds exp2(-inf) = 0, and a loop body without branches lets Triton pipeline the next tile's loads.
        pos64 = tl.where(is_key, pos, 0).to(tl.int64)
        k_t = tl.load(
            k_ptr + (pos64[None, :] * H + h) * K + dk[:, None], mask=is_key[None, :] & (dk[:, None] < K), other=0.0
        )
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
        s = tl.where(is_key[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(
            v_ptr + (pos64[:, None] * H + h) * V + dv[None, :], mask=is_key[:, None] & (dv[None, :] < V), other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m = m_new
    has_key = l > 0
    o = acc / tl.where(has_key, l, 1.0)[:, None]
    o_offsets = head_rows[:, None] * V + dv[None, :]
    o_mask = is_row[:, None] & (dv[None, :] < V)
    if GATED:
        o = o * tl.sigmoid(tl.load(gate_ptr + o_offsets, mask=o_mask, other=0.0).to(tl.float32))
    tl.store(o_ptr + o_offsets, o.to(o_ptr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + head_rows, tl.where(has_key, m + tl.log2(tl.where(has_key, l, 1.0)), 0.0), mask=is_row)


def num_steps(S: int, block_size: int, config: AttentionConfig) -> int:
    """Loop steps of the query-major kernels: slot tiles (token level) or one key tile per slot and block part."""
    if block_size == 1:
        return triton.cdiv(S, config.token_tile)
    return S * triton.cdiv(block_size, config.block_key_tile)


def sparse_attention_fwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    canon_THS: torch.Tensor,
    layout: SequenceLayout,
    block_size: int,
    scale: float,
    config: AttentionConfig,
    gate_THV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [NQ, HQ, V] in q's dtype, times sigmoid(gate_THV) when given, and lse [NQ, HQ] fp32 in log2 units, of the
    ungated attention) of queries q_THK [NQ, HQ, K] over keys [NT, H, K / V] and canonical indices [NQ, H', S]."""
    NQ, HQ, K = q_THK.shape
    H, V = k_THK.shape[1], v_THV.shape[2]
    G = HQ // H
    S = canon_THS.shape[2]
    o = _alloc((NQ, HQ, V), q_THK.dtype, q_THK.device)
    lse = _alloc((NQ, HQ), torch.float32, q_THK.device)
    _sparse_attn_fwd_kernel[(NQ, H)](
        q_THK, k_THK, v_THV, canon_THS, layout.seq_start, o if gate_THV is None else gate_THV, o, lse,
        S, num_steps(S, block_size, config), scale * LOG2E, layout.row_len, layout.queries_per_row,
        H=H, G=G, GP=padded(G), H_IDX=canon_THS.shape[1], K=K, V=V, BK=padded(K), BV=padded(V),
        BS=config.token_tile, BLOCK_SIZE=block_size, BKEY=config.block_key_tile, IS_BLOCK=block_size > 1,
        GATED=gate_THV is not None, PRECISION=dot_precision(q_THK.dtype), **config.launch,
    )  # fmt: skip
    return o, lse
