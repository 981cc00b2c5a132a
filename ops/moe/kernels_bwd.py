"""Backward kernels of the MoE expert MLP: the LoRA backward pass (g B per row and dB), the input-gradient GEMMs of
both projections (the down one with SwiGLU's and the routing weights' gradients in its epilogue, or followed by a pass
over its output that computes them: KernelConfig.swiglu_pass) and the per-expert weight and adapter gradients.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank,
S = N*k token-slots in expert order (routing.py), R the LoRA rank padded to a tl.dot size, C row chunks.

LoRA: the backward thin pass computes each [S, r] rank product (dy B, dgate_up B) once and reduces dB from the
gradient rows it reads; dA of both adapters comes from the per-expert gradient kernel over the rank products and x
(or the w * h the down backward stores). These four reductions into LoRA-sized outputs run one program per row chunk
of an expert (RowChunks), not per expert, so a skewed expert's rows spread over several programs; split experts'
partials are summed by _moe_sum_chunks_kernel. FP8 expert weights (W_IS_FP8) are read as stored and dequantized tile
by tile as in kernels_fwd.py (one scale per tile column: each K step lies inside one 128-wide scale block), GF =
ceil(F/128), GD = ceil(D/128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.moe import kernel_config
from moe_tune.ops.moe.kernel_config import (
    FP8_BLOCK,
    MIN_DOT_SIZE,
    THIN_NUM_WARPS,
    KernelConfig,
    MoEConfig,
    check_fp8_steps,
    dot_precision,
    or_dummy,
    rank_block,
    rank_dtype,
    row_descriptor,
    strides3,
    tma_loads,
    weight_tile,
)
from moe_tune.ops.moe.routing import MoERouting, RowChunks, row_chunks, sum_slots, tile_and_column_block, tile_rows

# Elements of a per-expert output per program of the chunk sum.
SUM_CHUNKS_BLOCK = 1024
# The SwiGLU backward pass (kernel.swiglu_pass): 16 rows x 256 columns a step, 4 warps (memory-bound, 32 fp32
# elements of each operand a thread).
SWIGLU_BWD_ROWS = 16
SWIGLU_BWD_COLS = 256


# LoRA backward pass over an output gradient g of a projection with adapter (A, B) and saved ua = u @ A^T:
# partial gb = s * g[:, block] @ B[block] per column block (summed over blocks afterwards), dB = s * sum (w g)^T ua.
@triton.jit
def _moe_lora_bwd_kernel(
    g_ptr,  # [*, Q]: rows in expert order, or token rows gathered when G_BY_TOKEN
    b_ptr,  # [E, Q, r]
    ua_ptr,  # [S, r] fp32, expert order, read when COMPUTE_DB
    weights_ptr,  # [S] slot order, multiplied into g's rows for dB when G_TIMES_WEIGHT
    gb_partial_ptr,  # out [cdiv(Q, BLOCK_Q), S, r] rank dtype, written when COMPUTE_GB
    db_ptr,  # out [E, Q, r], written when COMPUTE_DB (by the chunk of an expert with one chunk)
    db_partial_ptr,  # out [C, Q, r] fp32, written when COMPUTE_DB by the chunks of split experts
    slot_of_row_ptr,
    token_of_row_ptr,
    offsets_ptr,
    chunk_expert_ptr,
    chunk_row_ptr,
    first_chunk_ptr,
    chunk_rows,
    S,
    Q,
    rank,
    scale,
    stride_gn,
    stride_gq,
    stride_be,
    stride_bq,
    stride_br,
    stride_de,
    stride_dq,
    stride_dr,
    G_BY_TOKEN: tl.constexpr,
    G_TIMES_WEIGHT: tl.constexpr,
    COMPUTE_GB: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    DB_IN_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # 1-D grid, chunk slowest, as in _moe_expert_grad_kernel: one program reduces the rows of one chunk of an expert
    # (RowChunks) for its column block in a fixed order (dB without atomics) and reads each of those gradient
    # elements once for both products.
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(Q, BLOCK_Q)
    chunk = pid // num_q_blocks
    pid_q = pid % num_q_blocks
    expert = tl.load(chunk_expert_ptr + chunk)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    row_begin = tl.load(chunk_row_ptr + chunk)
    row_end = tl.minimum(row_begin + chunk_rows, tl.load(offsets_ptr + expert + 1))
    is_split = tl.load(first_chunk_ptr + expert + 1) - tl.load(first_chunk_ptr + expert) > 1
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = qs < Q
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank

    b_tile = tl.load(
        b_ptr + expert * stride_be + qs[:, None] * stride_bq + ranks[None, :] * stride_br,
        mask=q_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )  # [Q, R]
    gb_partial = gb_partial_ptr + pid_q.to(tl.int64) * S * rank
    acc_db = tl.zeros((BLOCK_Q, BLOCK_R), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        row_mask = rows < row_end
        tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        rows = rows.to(tl.int64)
        g_rows = tokens if G_BY_TOKEN else rows
        g = tl.load(
            g_ptr + g_rows[:, None] * stride_gn + qs[None, :] * stride_gq,
            mask=row_mask[:, None] & q_mask[None, :],
            other=0.0,
        )  # [K, Q]
        rank_rows_mask = row_mask[:, None] & rank_mask[None, :]
        if COMPUTE_GB:
            gb = tl.dot(g, b_tile.to(g.dtype), input_precision=DOT_PRECISION)  # [K, R]
            tl.store(gb_partial + rows[:, None] * rank + ranks[None, :], gb * scale, mask=rank_rows_mask)
        if COMPUTE_DB:
            ua = tl.load(ua_ptr + rows[:, None] * rank + ranks[None, :], mask=rank_rows_mask, other=0.0)  # [K, R]
            if G_TIMES_WEIGHT:
                # (w g)^T ua = g^T (w ua): the weight goes on the rank-wide tile, so g reaches both dots as loaded
                # (a g tile rescaled in registers made the compiler load it without asynchronous copies).
                slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0)
                weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
                ua = ua * weights[:, None]
            if DB_IN_BF16:
                # bf16 operands: one warpgroup MMA instead of fp32 copies of both tiles and a tf32 product.
                acc_db = tl.dot(tl.trans(g), ua.to(tl.bfloat16), acc_db)
            else:
                acc_db = tl.dot(tl.trans(g.to(tl.float32)), ua, acc_db, input_precision=DOT_PRECISION)
    if COMPUTE_DB:
        db_mask = q_mask[:, None] & rank_mask[None, :]
        if is_split:
            db_partial = db_partial_ptr + chunk.to(tl.int64) * Q * rank + qs[:, None] * rank + ranks[None, :]
            tl.store(db_partial, acc_db * scale, mask=db_mask)
        else:
            db = db_ptr + expert * stride_de + qs[:, None] * stride_dq + ranks[None, :] * stride_dr
            tl.store(db, (acc_db * scale).to(db_ptr.dtype.element_ty), mask=db_mask)


# Backward of GEMM 2 and SwiGLU: dh = w * (dy[token] @ w_down[e] + dha A), d(gate, up), d weights, w * h recomputed
@triton.jit
def _down_bwd_product(
    dy_ptr, w_ptr, ws_ptr, a_ptr, dha_ptr, w_desc, tokens, rows, row_mask, first_col, cols, col_mask, expert, D,
    rank, stride_dyn, stride_dyd, stride_we, stride_wd, stride_wf, stride_se, stride_sd, stride_sf, stride_ae, stride_ar,
    stride_af, W_IS_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, HAS_LORA: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    # dy[token] @ W_down[e] (+ dha @ A_down[e]) for one tile's rows and columns, fp32: the gradient of
    # <dy, y_slot> by h before the routing weight. With TMA, w_desc holds w as [E D, F]: a tile's K steps past D
    # read the next expert's rows, which meet dy's zeros there, and its columns past F read zeros.
    dy_rows = dy_ptr + tokens[:, None] * stride_dyn
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wf
    s_cols = ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sf
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        dy_tile = tl.load(dy_rows + ks[None, :] * stride_dyd, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if TMA:
            w_tile = w_desc.load([expert.to(tl.int32) * D + k0, first_col])
        else:
            w_tile = weight_tile(
                w_cols + ks[:, None] * stride_wd, k_mask[:, None] & col_mask[None, :],
                s_cols + (k0 // SCALE_BLOCK) * stride_sd, col_mask, dy_tile, W_IS_FP8, ROW_SCALES=False,
            )  # fmt: skip
        acc = tl.dot(dy_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        dha = tl.load(
            dha_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        a_tile = tl.load(
            a_ptr + expert * stride_ae + ranks[:, None] * stride_ar + cols[None, :] * stride_af,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(dha.dtype)  # [R, N]
        acc = tl.dot(dha, a_tile, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _moe_down_bwd_kernel(
    dy_ptr,  # [N, D]
    w_ptr,  # [E, D, F] 16-bit/fp32, or FP8 codes when W_IS_FP8
    ws_ptr,  # [E, GD, GF] fp32 block scales of an FP8 w
    a_ptr,  # [E, r, F]
    dha_ptr,  # [S, r] d(h @ A^T) / w = s dy[token] @ B, expert order, from the LoRA backward pass (rank_dtype)
    gate_up_ptr,  # [S, 2F] pre-activations saved by the forward, expert order
    weights_ptr,  # [S] slot order
    dgate_up_ptr,  # out [S, 2F] expert order
    h_ptr,  # out [S, F] expert order, w * h with h recomputed from gate_up; written only when STORE_H
    dweights_ptr,  # out [cdiv(F, BLOCK_N), S] fp32 per-column-block partial sums of <dy_token, y_slot / w_slot>
    slot_of_row_ptr,
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    S,
    D,
    F,
    rank,
    stride_dyn,
    stride_dyd,
    stride_we,
    stride_wd,
    stride_wf,
    stride_se,
    stride_sd,
    stride_sf,
    stride_ae,
    stride_ar,
    stride_af,
    W_IS_FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    STORE_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(F, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < F

    # acc: dy @ W_down (+ LoRA) before the routing weight, i.e. d<dy, y_slot>/dh without w.
    acc = _down_bwd_product(
        dy_ptr, w_ptr, ws_ptr, a_ptr, dha_ptr, None, tokens, rows, row_mask, pid_n * BLOCK_N, cols, col_mask, expert,
        D, rank, stride_dyn, stride_dyd, stride_we, stride_wd, stride_wf, stride_se, stride_sd, stride_sf, stride_ae,
        stride_ar, stride_af, W_IS_FP8, SCALE_BLOCK, HAS_LORA, False, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        BLOCK_R,
    )  # fmt: skip
    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(gate_up_rows, mask=out_mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_rows + F, mask=out_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    # <dy_token, y_slot unweighted> = <dy @ W_down (+ LoRA), h>, summed here over this block's F columns.
    tl.store(dweights_ptr + pid_n * S + slots, tl.sum(acc * h, axis=1), mask=row_mask)
    dh = acc * weights[:, None]
    # silu'(g) * up = sig * up + h * (1 - sig): written through h so that the compiler keeps one copy of the SwiGLU
    # tiles (sm_90, triton 3.6: 180 registers a thread, against 255 and spills for up * sig * (1 + g * (1 - sig))).
    dgate = dh * (sig * up + h * (1.0 - sig))
    dup = dh * silu
    dgate_up_rows = dgate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    tl.store(dgate_up_rows, dgate.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dgate_up_rows + F, dup.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    if STORE_H:
        # w * h: the weight gradients of the down projection read it as is, with no per-row scaling in their loop.
        h_weighted = h * weights[:, None]
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h_weighted.to(h_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_down_bwd_gemm_kernel(
    dy_ptr,  # [N, D]
    w_ptr,  # [E, D, F] 16-bit/fp32, or FP8 codes when W_IS_FP8
    ws_ptr,  # [E, GD, GF] fp32 block scales of an FP8 w
    a_ptr,  # [E, r, F]
    dha_ptr,  # [S, r] as _moe_down_bwd_kernel's
    dh_ptr,  # out [S, F] expert order: dy[token] @ W_down (+ LoRA), before the routing weight
    w_desc,  # with TMA: a tensor descriptor of w as [E D, F]; None otherwise
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    stride_dyn,
    stride_dyd,
    stride_we,
    stride_wd,
    stride_wf,
    stride_se,
    stride_sd,
    stride_sf,
    stride_ae,
    stride_ar,
    stride_af,
    W_IS_FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(F, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < F

    acc = _down_bwd_product(
        dy_ptr, w_ptr, ws_ptr, a_ptr, dha_ptr, w_desc, tokens, rows, row_mask, pid_n * BLOCK_N, cols, col_mask,
        expert, D, rank, stride_dyn, stride_dyd, stride_we, stride_wd, stride_wf, stride_se, stride_sd, stride_sf,
        stride_ae, stride_ar, stride_af, W_IS_FP8, SCALE_BLOCK, HAS_LORA, TMA, DOT_PRECISION, BLOCK_M, BLOCK_N,
        BLOCK_K, BLOCK_R,
    )  # fmt: skip
    tl.store(
        dh_ptr + rows[:, None] * F + cols[None, :], acc.to(dh_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )  # fmt: skip


@triton.jit
def _moe_swiglu_bwd_kernel(
    dh_ptr,  # [S, F] expert order, _moe_down_bwd_gemm_kernel's output
    gate_up_ptr,  # [S, 2F] pre-activations saved by the forward, expert order
    weights_ptr,  # [S] slot order
    slot_of_row_ptr,
    dgate_up_ptr,  # out [S, 2F] expert order
    h_ptr,  # out [S, F] expert order, w * h; written only when STORE_H
    dweights_ptr,  # out [S] fp32 slot order: <dy_token, y_slot / w_slot> = <dh, h>
    S,
    F,
    STORE_H: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # SwiGLU's and the routing weight's backward for BLOCK_ROWS rows, their F columns in steps of BLOCK_F.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < S
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    dweights = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_mask[:, None] & (cols < F)[None, :]
        dh = tl.load(dh_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
        gate = tl.load(gate_up_rows, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_rows + F, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        h = silu * up
        dweights += tl.sum(dh * h, axis=1)
        dh = dh * weights[:, None]
        dgate_up_rows = dgate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(dgate_up_rows, (dh * (sig * up + h * (1.0 - sig))).to(dgate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_up_rows + F, (dh * silu).to(dgate_up_ptr.dtype.element_ty), mask=mask)
        if STORE_H:
            h_weighted = h * weights[:, None]
            tl.store(h_ptr + rows[:, None] * F + cols[None, :], h_weighted.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(dweights_ptr + slots, dweights, mask=row_mask)


# Backward of GEMM 1: dx_slot = dgate_up @ w_gate_up[e] (+ dxa A), stored in slot order
@triton.jit
def _moe_gate_up_bwd_kernel(
    dgate_up_ptr,  # [S, 2F] expert order
    w_ptr,  # [E, 2F, D] 16-bit/fp32, or FP8 codes when W_IS_FP8
    ws_ptr,  # [E, 2 GF, GD] fp32 block scales of an FP8 w (gate rows, then up rows)
    a_ptr,  # [E, r, D]
    dxa_ptr,  # [S, r] d(x @ A^T) = s dgate_up @ B, expert order, from the LoRA backward pass (rank_dtype)
    dx_ptr,  # out [S, D] slot order
    g_desc,  # with TMA: tensor descriptors of dgate_up [S, 2F] and w as [E 2F, D]; None otherwise
    w_desc,
    slot_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    stride_we,
    stride_wf,
    stride_wd,
    stride_se,
    stride_sf,
    stride_sd,
    stride_ae,
    stride_ar,
    stride_ad,
    W_IS_FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    NUM_HALVES: tl.constexpr,
    HAS_LORA: tl.constexpr,
    TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(D, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D

    # gate and up rows are contiguous in both dgate_up and w_gate_up, so one K loop runs over all 2F; with FP8 weights
    # one loop per half, so that no K step crosses from a gate scale block into an up one.
    half_len = 2 * F // NUM_HALVES
    g_rows = dgate_up_ptr + rows[:, None] * (2 * F)
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wd
    s_cols = ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # Whole tiles: rows past the expert's (another expert's dgate_up) and columns past D (read as zeros) are
        # computed and never stored; K past 2F reads as zeros in dgate_up, so the next expert's w rows there add 0.
        first_row = tl.load(tile_row_ptr + tile)
        first_w_row = expert.to(tl.int32) * 2 * F
        for k0 in range(0, 2 * F, BLOCK_K):
            g_tile = g_desc.load([first_row, k0])
            w_tile = w_desc.load([first_w_row + k0, pid_n * BLOCK_N])
            acc = tl.dot(g_tile, w_tile, acc, input_precision=DOT_PRECISION)
    else:
        for half in tl.static_range(NUM_HALVES):
            s_half = s_cols + half * tl.cdiv(F, SCALE_BLOCK) * stride_sf
            for k0 in range(0, half_len, BLOCK_K):
                ks = half * half_len + k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < (half + 1) * half_len
                g_tile = tl.load(g_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w_tile = weight_tile(
                    w_cols + ks[:, None] * stride_wf, k_mask[:, None] & col_mask[None, :],
                    s_half + (k0 // SCALE_BLOCK) * stride_sf, col_mask, g_tile, W_IS_FP8, ROW_SCALES=False,
                )  # fmt: skip
                acc = tl.dot(g_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        dxa = tl.load(
            dxa_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        a_tile = tl.load(
            a_ptr + expert * stride_ae + ranks[:, None] * stride_ar + cols[None, :] * stride_ad,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(dxa.dtype)  # [R, N]
        acc = tl.dot(dxa, a_tile, acc, input_precision=DOT_PRECISION)
    tl.store(
        dx_ptr + slots[:, None] * D + cols[None, :],
        acc.to(dx_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# Per-expert weight gradients: out[e] = scale * sum over the expert's rows of lhs_row^T rhs_row
@triton.jit
def _moe_expert_grad_kernel(
    lhs_ptr,  # [*, P]: rows in expert order, or token rows gathered when LHS_BY_TOKEN
    rhs_ptr,  # [*, Q]: likewise with RHS_BY_TOKEN
    weights_ptr,  # [S] slot order, read when LHS_TIMES_WEIGHT
    out_ptr,  # out [E, P, Q]
    partial_ptr,  # out [C, P, Q] fp32, written by the chunks of split experts when SPLIT_ROWS
    slot_of_row_ptr,
    token_of_row_ptr,
    offsets_ptr,
    chunk_expert_ptr,  # RowChunks, read when SPLIT_ROWS
    chunk_row_ptr,
    first_chunk_ptr,
    chunk_rows,
    P,
    Q,
    scale,
    stride_ln,
    stride_lp,
    stride_rn,
    stride_rq,
    stride_oe,
    stride_op,
    stride_oq,
    LHS_BY_TOKEN: tl.constexpr,
    RHS_BY_TOKEN: tl.constexpr,
    LHS_TIMES_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1-D grid, expert (or chunk, SPLIT_ROWS) slowest: the programs of one expert run together and read its rows from
    # L2, not from memory once per output tile.
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(Q, BLOCK_Q)
    blocks_per_expert = tl.cdiv(P, BLOCK_P) * num_q_blocks
    pid_p = (pid % blocks_per_expert) // num_q_blocks
    pid_q = pid % num_q_blocks
    if SPLIT_ROWS:
        chunk = pid // blocks_per_expert
        expert = tl.load(chunk_expert_ptr + chunk)
        if expert < 0:
            return
        expert = expert.to(tl.int64)
        row_begin = tl.load(chunk_row_ptr + chunk)
        row_end = tl.minimum(row_begin + chunk_rows, tl.load(offsets_ptr + expert + 1))
    else:
        expert = (pid // blocks_per_expert).to(tl.int64)
        row_begin = tl.load(offsets_ptr + expert)
        row_end = tl.load(offsets_ptr + expert + 1)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = ps < P
    q_mask = qs < Q
    # One program reduces all rows of its expert (or chunk) in a fixed order: deterministic, no atomics.
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        row_mask = rows < row_end
        tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        lhs_rows = tokens if LHS_BY_TOKEN else rows.to(tl.int64)
        rhs_rows = tokens if RHS_BY_TOKEN else rows.to(tl.int64)
        lhs = tl.load(
            lhs_ptr + lhs_rows[:, None] * stride_ln + ps[None, :] * stride_lp,
            mask=row_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # [K, P]
        rhs = tl.load(
            rhs_ptr + rhs_rows[:, None] * stride_rn + qs[None, :] * stride_rq,
            mask=row_mask[:, None] & q_mask[None, :],
            other=0.0,
        )  # [K, Q]
        if UPCAST:
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
        if LHS_TIMES_WEIGHT:
            slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0)
            weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
            lhs = (lhs.to(tl.float32) * weights[:, None]).to(rhs.dtype)
        acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)
    out_mask = p_mask[:, None] & q_mask[None, :]
    out = out_ptr + expert * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq
    if SPLIT_ROWS:
        if tl.load(first_chunk_ptr + expert + 1) - tl.load(first_chunk_ptr + expert) > 1:
            partial = partial_ptr + chunk.to(tl.int64) * P * Q + ps[:, None] * Q + qs[None, :]
            tl.store(partial, acc * scale, mask=out_mask)
        else:
            tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)


# The per-expert outputs of split experts: out[e] = sum of its chunks' fp32 partials, in chunk order; zeros for an
# expert without rows; nothing for an expert with one chunk (that chunk's program stored it).
@triton.jit
def _moe_sum_chunks_kernel(
    partial_ptr,  # [C, M] fp32
    out_ptr,  # out [E, M]
    first_chunk_ptr,
    M,
    BLOCK: tl.constexpr,
):
    expert = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < M
    first = tl.load(first_chunk_ptr + expert)
    last = tl.load(first_chunk_ptr + expert + 1)
    if last - first == 1:
        return
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    partial = partial_ptr + first.to(tl.int64) * M + cols
    for _ in range(first, last):
        acc += tl.load(partial, mask=col_mask, other=0.0)
        partial += M
    tl.store(out_ptr + expert * M + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def _sum_chunks(partial: torch.Tensor, out: torch.Tensor, chunks: RowChunks) -> None:
    """Complete `out` [E, ...] (contiguous) from the fp32 partials [C, ...] of its split experts."""
    num_experts = out.shape[0]
    per_expert = out[0].numel() if num_experts else 0
    if not per_expert:
        return
    block = min(SUM_CHUNKS_BLOCK, triton.next_power_of_2(per_expert))
    _moe_sum_chunks_kernel[(num_experts, triton.cdiv(per_expert, block))](
        partial, out, chunks.first_chunk_E1, per_expert, BLOCK=block, num_warps=THIN_NUM_WARPS
    )


def moe_lora_bwd(
    g: torch.Tensor,
    b: torch.Tensor,
    ua: torch.Tensor,
    scale: float,
    routing: MoERouting,
    config: MoEConfig,
    compute_gb: bool,
    compute_db: bool,
    g_by_token: bool = False,
    g_weights: torch.Tensor | None = None,
    chunks: RowChunks | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One pass over the output gradient g of a projection with LoRA: out += scale * ua B^T, ua = u A^T saved.

    g: [S, Q] in expert order, or [N, Q] read at each row's token when g_by_token; b: [E, Q, r]; ua: [S, r] fp32.
    g_weights: [N, k] routing weights multiplied into g's rows for dB (not for gb), or None. chunks: row_chunks(routing,
    config), built here when None (the backward builds it once for all its passes).
    Returns gb = scale * g[row] @ B[e] [S, r] in expert order, typed rank_dtype(g.dtype) (when compute_gb; d(ua) for
    the backward GEMM's epilogue and for dA) and dB[e] = scale * sum_{rows of e} (w g_row)^T ua_row, shaped and typed
    like b (when compute_db; bf16 products with fp32 sums when g is bf16).
    """
    _, dim_q, rank = b.shape
    num_slots = routing.num_slots
    kernel = config.lora_bwd
    block_q = min(kernel.block_n, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_q)))
    num_q_blocks = triton.cdiv(dim_q, block_q)
    # Each program sums g B over its block_q columns only: the column blocks' [S, r] partials are added up below in a
    # fixed order (deterministic where atomics would not be).
    # bf16 partials next to bf16 gradients (the sum accumulates in fp32 and gb is bf16 anyway): half the bytes.
    gb_dtype = rank_dtype(g.dtype)
    gb_partial = kernel_config.alloc((num_q_blocks, num_slots, rank), gb_dtype, g.device) if compute_gb else None
    chunks = row_chunks(routing, config) if chunks is None else chunks
    db = db_partial = None
    if compute_db:
        db = kernel_config.alloc(tuple(b.shape), b.dtype, b.device)
        db_partial = kernel_config.alloc((chunks.num_chunks, dim_q, rank), torch.float32, b.device)
    if chunks.num_chunks > 0:
        _moe_lora_bwd_kernel[(chunks.num_chunks * num_q_blocks,)](
            g, b, ua, or_dummy(g_weights, ua).reshape(-1), or_dummy(gb_partial, ua), or_dummy(db, ua),
            or_dummy(db_partial, ua),
            routing.slot_of_row_S, routing.token_of_row_S, routing.offsets_E1,
            chunks.chunk_expert_C, chunks.chunk_row_C, chunks.first_chunk_E1, chunks.chunk_rows,
            num_slots, dim_q, rank, scale,
            *g.stride(), *b.stride(), *strides3(db),
            G_BY_TOKEN=g_by_token, G_TIMES_WEIGHT=g_weights is not None, COMPUTE_GB=compute_gb, COMPUTE_DB=compute_db,
            DB_IN_BF16=g.dtype == torch.bfloat16,
            DOT_PRECISION=dot_precision(g.dtype, ua.dtype),
            BLOCK_Q=block_q, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    if compute_db:
        _sum_chunks(db_partial, db, chunks)
    gb = None
    if compute_gb:
        gb = gb_partial[0] if num_q_blocks == 1 else gb_partial.sum(dim=0)
    return gb, db


def moe_down_bwd(
    dy: torch.Tensor,
    gate_up: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    a_down: torch.Tensor | None,
    dha: torch.Tensor | None,
    routing: MoERouting,
    config: MoEConfig,
    store_h: bool,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward of the down projection, the routing weights and SwiGLU.

    scale_inv: [E, GD, GF] fp32 block scales when w_down is FP8 (float8_e4m3fn codes), else None.
    a_down: [E, r, F] and dha: [S, r] (rank_dtype) = scaling * dy[token] @ B_down (moe_lora_bwd; unweighted,
    d(h A^T) / w), both None without LoRA on the down projection.
    Returns dgate_up [S, 2F] in gate_up.dtype, w * h [S, F] recomputed and weighted by each row's routing weight
    (when store_h; dW_down = sum dy^T (w h) and dA_down = sum dha^T (w h) read it) and d topk_weights [S] fp32 in
    slot order.
    """
    has_lora = a_down is not None
    assert has_lora == (dha is not None), "dha needs the down adapter"
    num_slots, model_dim = routing.num_slots, dy.shape[1]
    num_hidden = gate_up.shape[1] // 2
    rank = a_down.shape[1] if has_lora else 0
    dgate_up = kernel_config.alloc((num_slots, 2 * num_hidden), gate_up.dtype, dy.device)
    h = kernel_config.alloc((num_slots, num_hidden), gate_up.dtype, dy.device) if store_h else None
    kernel = config.down_bwd
    check_fp8_steps(scale_inv, kernel.block_k)
    if kernel.swiglu_pass:
        return _down_bwd_two_passes(
            dy, gate_up, topk_weights, w_down, a_down, dha, routing, kernel, dgate_up, h, scale_inv
        )
    num_col_blocks = triton.cdiv(num_hidden, kernel.block_n)
    # Partial sums per column block, added up below in a fixed order: deterministic where atomics would not be.
    dweights_partial = kernel_config.alloc((num_col_blocks, num_slots), torch.float32, dy.device)
    if routing.num_tiles > 0:
        _moe_down_bwd_kernel[(routing.num_tiles * num_col_blocks,)](
            dy, w_down, or_dummy(scale_inv, dgate_up), or_dummy(a_down, w_down), or_dummy(dha, dgate_up), gate_up,
            topk_weights.reshape(-1),
            dgate_up, or_dummy(h, dgate_up), dweights_partial,
            routing.slot_of_row_S, routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T,
            routing.offsets_E1,
            num_slots, model_dim, num_hidden, rank,
            *dy.stride(), *w_down.stride(), *strides3(scale_inv), *strides3(a_down),
            W_IS_FP8=scale_inv is not None, SCALE_BLOCK=FP8_BLOCK,
            HAS_LORA=has_lora, STORE_H=store_h, DOT_PRECISION=dot_precision(gate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return dgate_up, h, dweights_partial.sum(dim=0)


def _down_bwd_two_passes(
    dy: torch.Tensor, gate_up: torch.Tensor, topk_weights: torch.Tensor, w_down: torch.Tensor,
    a_down: torch.Tensor | None, dha: torch.Tensor | None, routing: MoERouting, kernel: KernelConfig,
    dgate_up: torch.Tensor,
    h: torch.Tensor | None, scale_inv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """moe_down_bwd as a GEMM storing dh = dy[token] W_down (+ LoRA) [S, F] in gate_up's dtype and a pass of SwiGLU's
    and the routing weights' backward over it (kernel.swiglu_pass)."""
    num_slots, model_dim = routing.num_slots, dy.shape[1]
    num_hidden = gate_up.shape[1] // 2
    rank = a_down.shape[1] if a_down is not None else 0
    dh = kernel_config.alloc((num_slots, num_hidden), gate_up.dtype, dy.device)
    dweights = kernel_config.alloc((num_slots,), torch.float32, dy.device)
    tma = tma_loads(kernel, dy.dtype, w_down)
    if routing.num_tiles > 0:
        _moe_down_bwd_gemm_kernel[(routing.num_tiles * triton.cdiv(num_hidden, kernel.block_n),)](
            dy, w_down, or_dummy(scale_inv, dgate_up), or_dummy(a_down, w_down), or_dummy(dha, dgate_up), dh,
            row_descriptor(w_down, kernel.block_k, kernel.block_n) if tma else None,
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank,
            *dy.stride(), *w_down.stride(), *strides3(scale_inv), *strides3(a_down),
            W_IS_FP8=scale_inv is not None, SCALE_BLOCK=FP8_BLOCK, HAS_LORA=a_down is not None, TMA=tma,
            DOT_PRECISION=dot_precision(gate_up.dtype), BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n,
            BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank), **kernel.launch_options(),
        )  # fmt: skip
    if num_slots > 0:
        _moe_swiglu_bwd_kernel[(triton.cdiv(num_slots, SWIGLU_BWD_ROWS),)](
            dh, gate_up, topk_weights.reshape(-1), routing.slot_of_row_S, dgate_up, or_dummy(h, dgate_up), dweights,
            num_slots, num_hidden, STORE_H=h is not None, BLOCK_ROWS=SWIGLU_BWD_ROWS, BLOCK_F=SWIGLU_BWD_COLS,
            num_warps=THIN_NUM_WARPS,
        )  # fmt: skip
    return dgate_up, h, dweights


def moe_gate_up_bwd(
    dgate_up: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_gate_up: torch.Tensor | None,
    dxa: torch.Tensor | None,
    routing: MoERouting,
    config: MoEConfig,
    num_tokens: int,
    scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx [N, D] in dgate_up.dtype.

    scale_inv: [E, 2 GF, GD] fp32 block scales when w_gate_up is FP8 (float8_e4m3fn codes), else None.
    a_gate_up: [E, r, D] and dxa: [S, r] (rank_dtype) = scaling * dgate_up @ B_gate_up (moe_lora_bwd), both None
    without LoRA on the gate_up projection.
    """
    has_lora = a_gate_up is not None
    assert has_lora == (dxa is not None), "dxa needs the gate_up adapter"
    num_slots = routing.num_slots
    num_hidden, model_dim = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    rank = a_gate_up.shape[1] if has_lora else 0
    dx_slot = kernel_config.alloc((num_slots, model_dim), dgate_up.dtype, dgate_up.device)
    kernel = config.gate_up_bwd
    check_fp8_steps(scale_inv, kernel.block_k)
    num_col_blocks = triton.cdiv(model_dim, kernel.block_n)
    tma = tma_loads(kernel, dgate_up.dtype, dgate_up, w_gate_up)
    if routing.num_tiles > 0:
        _moe_gate_up_bwd_kernel[(routing.num_tiles * num_col_blocks,)](
            dgate_up, w_gate_up, or_dummy(scale_inv, dx_slot), or_dummy(a_gate_up, w_gate_up), or_dummy(dxa, dgate_up),
            dx_slot,
            row_descriptor(dgate_up, routing.block_m, kernel.block_k) if tma else None,
            row_descriptor(w_gate_up, kernel.block_k, kernel.block_n) if tma else None,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank,
            *w_gate_up.stride(), *strides3(scale_inv), *strides3(a_gate_up),
            W_IS_FP8=scale_inv is not None, SCALE_BLOCK=FP8_BLOCK, NUM_HALVES=1 if scale_inv is None else 2,
            HAS_LORA=has_lora, TMA=tma, DOT_PRECISION=dot_precision(dgate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(dx_slot, num_tokens, routing.top_k)


def moe_expert_grad(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    out_like: torch.Tensor,
    routing: MoERouting,
    config: MoEConfig,
    lhs_by_token: bool = False,
    rhs_by_token: bool = False,
    lhs_weights: torch.Tensor | None = None,
    scale: float = 1.0,
    chunks: RowChunks | None = None,
) -> torch.Tensor:
    """out[e] = scale * sum_{rows of e} (w_row * lhs_row)^T rhs_row, shaped and typed like out_like [E, P, Q].

    lhs: [S, P] in expert order, or [N, P] read by token when lhs_by_token; rhs likewise [S or N, Q].
    lhs_weights: [N, k] routing weights multiplied into the lhs rows, or None.
    A thin output (a LoRA rank side, too few output tiles per expert to spread a skewed expert's rows) is reduced by
    row chunks (chunks: row_chunks(routing, config), built here when None); a weight gradient by expert.
    """
    num_experts, dim_p, dim_q = out_like.shape
    out = kernel_config.alloc(tuple(out_like.shape), out_like.dtype, out_like.device)
    # Mixed operands (a 16-bit activation against an fp32 LoRA intermediate) meet in fp32.
    upcast = lhs.dtype != rhs.dtype
    kernel = config.expert_grad
    is_thin = min(dim_p, dim_q) < min(kernel.block_p, kernel.block_n)
    block_p = min(kernel.block_p, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_p)))
    block_q = min(kernel.block_n, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_q)))
    weights = lhs_weights.reshape(-1) if lhs_weights is not None else lhs
    partial = None
    if is_thin:
        chunks = row_chunks(routing, config) if chunks is None else chunks
        partial = kernel_config.alloc((chunks.num_chunks, dim_p, dim_q), torch.float32, out.device)
    if is_thin:
        split = (chunks.chunk_expert_C, chunks.chunk_row_C, chunks.first_chunk_E1, chunks.chunk_rows)
        num_programs = chunks.num_chunks
    else:
        # Not read (SPLIT_ROWS off): any int32 vectors and row count.
        split = (routing.offsets_E1, routing.offsets_E1, routing.offsets_E1, 0)
        num_programs = num_experts
    grid = (num_programs * triton.cdiv(dim_p, block_p) * triton.cdiv(dim_q, block_q),)
    # No rows (an expert-parallel rank that received no tokens) leaves no chunk: nothing to launch, zeros below.
    if grid[0] > 0:
        _moe_expert_grad_kernel[grid](
            lhs, rhs, weights, out, or_dummy(partial, out),
            routing.slot_of_row_S, routing.token_of_row_S, routing.offsets_E1, *split,
            dim_p, dim_q, scale,
            *lhs.stride(), *rhs.stride(), *out.stride(),
            LHS_BY_TOKEN=lhs_by_token, RHS_BY_TOKEN=rhs_by_token, LHS_TIMES_WEIGHT=lhs_weights is not None,
            UPCAST=upcast, SPLIT_ROWS=is_thin, DOT_PRECISION=dot_precision(lhs.dtype, rhs.dtype),
            BLOCK_P=block_p, BLOCK_Q=block_q, BLOCK_K=kernel.block_k,
            num_warps=min(kernel.num_warps, THIN_NUM_WARPS) if is_thin else kernel.num_warps,
            num_stages=kernel.num_stages,
            **({} if is_thin or kernel.maxnreg is None else dict(maxnreg=kernel.maxnreg)),
        )  # fmt: skip
    if is_thin:
        _sum_chunks(partial, out, chunks)
    return out
