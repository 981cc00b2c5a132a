"""Forward kernels of the MoE expert MLP: the LoRA rank pass and the two grouped GEMMs (gate_up with SwiGLU, down
with the routing weight).

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank,
S = N*k token-slots in expert order (routing.py), R the LoRA rank padded to a tl.dot size.

Token rows of x are gathered by index while loading; rows of the outputs are scattered back to slot order while
storing; no permuted copy of an activation is ever made. LoRA: each [S, r] rank product (x A^T, h A^T) is computed
once, by the rank pass before the GEMM that needs it, which then adds the rank-r update in its epilogue with one
[rows, R] x [R, cols] dot. FP8 expert weights (W_IS_FP8) are dequantized tile by tile as the GEMMs load them
(kernel_config.weight_tile): each K step lies inside one 128-wide scale block, so a tile takes one scale per weight
row, GF = ceil(F/128) scale rows per gate/up half, GD = ceil(D/128).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moe_tune.ops.moe import kernel_config
from moe_tune.ops.moe.kernel_config import (
    FP8_BLOCK,
    MoEConfig,
    check_fp8_steps,
    dot_precision,
    halves_descriptor,
    or_dummy,
    rank_block,
    row_descriptor,
    strides3,
    tma_loads,
    weight_tile,
)
from moe_tune.ops.moe.routing import MoERouting, sum_slots, tile_and_column_block, tile_rows


# LoRA rank pass: ua = u[row] @ A[e]^T once per row, read by every column block of the GEMM that adds ua B^T
@triton.jit
def _moe_lora_rows_kernel(
    u_ptr,  # [*, K]: rows in expert order, or token rows gathered when U_BY_TOKEN
    a_ptr,  # [E, r, K]
    ua_ptr,  # out [S, r] fp32, expert order
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    K,
    rank,
    stride_un,
    stride_uk,
    stride_ae,
    stride_ar,
    stride_ak,
    U_BY_TOKEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    u_rows = tokens if U_BY_TOKEN else rows
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank

    u_row_ptrs = u_ptr + u_rows[:, None] * stride_un
    a_rows = a_ptr + expert * stride_ae + ranks[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        u_tile = tl.load(u_row_ptrs + ks[None, :] * stride_uk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(
            a_rows + ks[None, :] * stride_ak, mask=rank_mask[:, None] & k_mask[None, :], other=0.0
        ).to(u_tile.dtype)  # [R, K]
        acc = tl.dot(u_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)
    tl.store(ua_ptr + rows[:, None] * rank + ranks[None, :], acc, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _scaled_rank_rows(xa_ptr, rows, row_mask, ranks, rank_mask, rank, scaling):
    # s * (x A^T) of the tile's rows [M, R] (fp32, from the rank pass).
    xa = tl.load(xa_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    return xa * scaling


# Forward GEMM 1: gate_up = x[token] @ w_gate_up[e]^T (+ s xa B^T), h = silu(gate) * up
@triton.jit
def _moe_gate_up_fwd_kernel(
    x_ptr,  # [N, D]
    w_ptr,  # [E, 2F, D] 16-bit/fp32, or FP8 codes when W_IS_FP8
    ws_ptr,  # [E, 2 GF, GD] fp32 block scales of an FP8 w (gate rows, then up rows)
    b_ptr,  # [E, 2F, r] LoRA B on gate_up, unused without LoRA
    xa_ptr,  # [S, r] fp32 x @ A^T from the rank pass, expert order
    h_ptr,  # out [S, F] rows in expert order
    gate_up_ptr,  # out [S, 2F] pre-activations, written only when SAVE_GATE_UP
    w_desc,  # with TMA: a tensor descriptor of w as [E, 2, F, D] (kernel_config.halves_descriptor); None otherwise
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    scaling,
    stride_xn,
    stride_xd,
    stride_we,
    stride_wf,
    stride_wd,
    stride_se,
    stride_sf,
    stride_sd,
    stride_be,
    stride_bf,
    stride_br,
    W_IS_FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    SAVE_GATE_UP: tl.constexpr,
    ONE_DOT: tl.constexpr,
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

    x_rows = x_ptr + tokens[:, None] * stride_xn
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    if ONE_DOT:
        # The gate and up columns as one [2 BLOCK_N, K] weight tile (its first BLOCK_N rows the gate's): one product
        # of twice the width a K step, split into the two halves after the loop.
        halves = tl.arange(0, 2 * BLOCK_N)
        is_up = halves >= BLOCK_N
        both_cols = pid_n * BLOCK_N + halves % BLOCK_N
        both_mask = both_cols < F
        w_both = w_ptr + expert * stride_we + (both_cols + tl.where(is_up, F, 0))[:, None] * stride_wf
        scale_rows = both_cols // SCALE_BLOCK + tl.where(is_up, tl.cdiv(F, SCALE_BLOCK), 0)
        s_both = ws_ptr + expert * stride_se + scale_rows * stride_sf
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < D
            x_tile = tl.load(x_rows + ks[None, :] * stride_xd, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if TMA:
                # Both halves' rows of the column block (zeros past F and D).
                w_tile = w_desc.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            else:
                s_col = (k0 // SCALE_BLOCK) * stride_sd
                w_tile = weight_tile(
                    w_both + ks[None, :] * stride_wd, both_mask[:, None] & k_mask[None, :], s_both + s_col,
                    both_mask, x_tile, W_IS_FP8, ROW_SCALES=True,
                )  # fmt: skip
            acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
        if HAS_LORA:
            xa_scaled = _scaled_rank_rows(xa_ptr, rows, row_mask, ranks, rank_mask, rank, scaling)
            b_both = b_ptr + expert * stride_be + (both_cols + tl.where(is_up, F, 0))[None, :] * stride_bf
            b_tile = tl.load(
                b_both + ranks[:, None] * stride_br, mask=rank_mask[:, None] & both_mask[None, :], other=0.0
            ).to(tl.float32)  # [R, 2N]
            acc = tl.dot(xa_scaled, b_tile, acc, input_precision=DOT_PRECISION)
        acc_gate, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        w_gate = w_ptr + expert * stride_we + cols[:, None] * stride_wf
        w_up = w_gate + F * stride_wf
        # Scale rows of the gate and up halves (an up row's block counts from its half's start).
        s_gate = ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sf
        s_up = s_gate + tl.cdiv(F, SCALE_BLOCK) * stride_sf
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < D
            x_tile = tl.load(x_rows + ks[None, :] * stride_xd, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            if TMA:
                wg_tile = w_desc.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                wu_tile = w_desc.load([expert.to(tl.int32), 1, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            else:
                w_mask = col_mask[:, None] & k_mask[None, :]
                s_col = (k0 // SCALE_BLOCK) * stride_sd
                wg_tile = weight_tile(
                    w_gate + ks[None, :] * stride_wd, w_mask, s_gate + s_col, col_mask, x_tile, W_IS_FP8,
                    ROW_SCALES=True,
                )  # fmt: skip
                wu_tile = weight_tile(
                    w_up + ks[None, :] * stride_wd, w_mask, s_up + s_col, col_mask, x_tile, W_IS_FP8, ROW_SCALES=True
                )
            acc_gate = tl.dot(x_tile, tl.trans(wg_tile), acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x_tile, tl.trans(wu_tile), acc_up, input_precision=DOT_PRECISION)
        if HAS_LORA:
            xa_scaled = _scaled_rank_rows(xa_ptr, rows, row_mask, ranks, rank_mask, rank, scaling)
            b_gate = b_ptr + expert * stride_be + cols[None, :] * stride_bf + ranks[:, None] * stride_br
            b_mask = rank_mask[:, None] & col_mask[None, :]
            bg_tile = tl.load(b_gate, mask=b_mask, other=0.0).to(tl.float32)  # [R, N]
            bu_tile = tl.load(b_gate + F * stride_bf, mask=b_mask, other=0.0).to(tl.float32)
            acc_gate = tl.dot(xa_scaled, bg_tile, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xa_scaled, bu_tile, acc_up, input_precision=DOT_PRECISION)

    out_mask = row_mask[:, None] & col_mask[None, :]
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)
    if SAVE_GATE_UP:
        gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(gate_up_rows, acc_gate.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
        tl.store(gate_up_rows + F, acc_up.to(gate_up_ptr.dtype.element_ty), mask=out_mask)


# Forward GEMM 2: y_slot = w_slot * (h @ w_down[e]^T (+ s ha B^T)), stored in slot order
@triton.jit
def _moe_down_fwd_kernel(
    h_ptr,  # [S, F] expert order
    w_ptr,  # [E, D, F] 16-bit/fp32, or FP8 codes when W_IS_FP8
    ws_ptr,  # [E, GD, GF] fp32 block scales of an FP8 w
    b_ptr,  # [E, D, r] LoRA B on down
    ha_ptr,  # [S, r] fp32 h @ A^T from the rank pass, expert order
    weights_ptr,  # [S] routing weights in slot order
    y_ptr,  # out [S, D] in slot order
    h_desc,  # with TMA: tensor descriptors of h [S, F] and w as [E D, F]; None otherwise
    w_desc,
    slot_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    scaling,
    stride_we,
    stride_wd,
    stride_wf,
    stride_se,
    stride_sd,
    stride_sf,
    stride_be,
    stride_bd,
    stride_br,
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

    h_rows = h_ptr + rows[:, None] * F
    w_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wd
    s_rows = ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # Whole tiles: rows past the expert's (another expert's h) and columns past its D (the next expert's w rows)
        # are computed and never stored; K past F reads as zeros in both operands.
        first_row = tl.load(tile_row_ptr + tile)
        first_w_row = expert.to(tl.int32) * D + pid_n * BLOCK_N
        for k0 in range(0, F, BLOCK_K):
            h_tile = h_desc.load([first_row, k0])
            w_tile = w_desc.load([first_w_row, k0])
            acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, F, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < F
            h_tile = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_tile = weight_tile(
                w_rows + ks[None, :] * stride_wf, col_mask[:, None] & k_mask[None, :],
                s_rows + (k0 // SCALE_BLOCK) * stride_sf, col_mask, h_tile, W_IS_FP8, ROW_SCALES=True,
            )  # fmt: skip
            acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        ha = tl.load(
            ha_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        b_tile = tl.load(
            b_ptr + expert * stride_be + cols[None, :] * stride_bd + ranks[:, None] * stride_br,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [R, N]
        acc = tl.dot(ha * scaling, b_tile, acc, input_precision=DOT_PRECISION)

    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * weights[:, None]
    tl.store(
        y_ptr + slots[:, None] * D + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def moe_lora_rows(
    u: torch.Tensor, a: torch.Tensor, routing: MoERouting, config: MoEConfig, u_by_token: bool
) -> torch.Tensor:
    """The LoRA rank product ua[row] = u[row] @ A[e]^T of every expert-sorted row, e the row's expert.

    u: [S, K] in expert order, or [N, K] read at each row's token when u_by_token; a: [E, r, K].
    Returns ua [S, r] fp32 in expert order.
    """
    num_slots, dim_k = routing.num_slots, u.shape[1]
    rank = a.shape[1]
    ua = kernel_config.alloc((num_slots, rank), torch.float32, u.device)
    kernel = config.lora_rows
    if routing.num_tiles > 0:
        _moe_lora_rows_kernel[(routing.num_tiles,)](
            u, a, ua,
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            dim_k, rank,
            *u.stride(), *a.stride(),
            U_BY_TOKEN=u_by_token, DOT_PRECISION=dot_precision(u.dtype),
            BLOCK_M=routing.block_m, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return ua


def moe_gate_up_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_gate_up: torch.Tensor | None,
    b_gate_up: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: MoEConfig,
    save_gate_up: bool,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """h = silu(gate) * up per expert-sorted row.

    scale_inv: [E, 2 GF, GD] fp32 block scales when w_gate_up is FP8 (float8_e4m3fn codes), else None.
    Returns h [S, F] in x.dtype, gate_up [S, 2F] pre-activations (when save_gate_up) and xa [S, r] fp32 (with LoRA).
    """
    num_slots, model_dim = routing.num_slots, x.shape[1]
    num_hidden = w_gate_up.shape[1] // 2
    has_lora = a_gate_up is not None
    rank = a_gate_up.shape[1] if has_lora else 0
    xa = moe_lora_rows(x, a_gate_up, routing, config, u_by_token=True) if has_lora else None
    h = kernel_config.alloc((num_slots, num_hidden), x.dtype, x.device)
    gate_up = kernel_config.alloc((num_slots, 2 * num_hidden), x.dtype, x.device) if save_gate_up else None
    kernel = config.gate_up_fwd
    check_fp8_steps(scale_inv, kernel.block_k)
    grid = (routing.num_tiles * triton.cdiv(num_hidden, kernel.block_n),)
    tma = tma_loads(kernel, x.dtype, w_gate_up)
    if routing.num_tiles > 0:
        _moe_gate_up_fwd_kernel[grid](
            x, w_gate_up, or_dummy(scale_inv, h), or_dummy(b_gate_up, w_gate_up), or_dummy(xa, h), h,
            or_dummy(gate_up, h),
            halves_descriptor(w_gate_up, 2 if kernel.one_dot else 1, kernel.block_n, kernel.block_k) if tma else None,
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *x.stride(), *w_gate_up.stride(), *strides3(scale_inv), *strides3(b_gate_up),
            W_IS_FP8=scale_inv is not None, SCALE_BLOCK=FP8_BLOCK,
            HAS_LORA=has_lora, SAVE_GATE_UP=save_gate_up, ONE_DOT=kernel.one_dot, TMA=tma,
            DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return h, gate_up, xa


def moe_down_fwd(
    h: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    a_down: torch.Tensor | None,
    b_down: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: MoEConfig,
    num_tokens: int,
    scale_inv: torch.Tensor | None = None,
    addends: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y[t] = (sum of addends[i][t]) + sum_j w[t, j] * (h @ w_down^T (+ LoRA)) over the token's slots (sum_slots).

    scale_inv: [E, GD, GF] fp32 block scales when w_down is FP8 (float8_e4m3fn codes), else None.
    addends: up to two [N, D] contiguous tensors of h's dtype (default: none).
    Returns y [N, D] in h.dtype and ha [S, r] fp32 (with LoRA).
    """
    num_slots, num_hidden = h.shape
    model_dim = w_down.shape[1]
    has_lora = a_down is not None
    rank = a_down.shape[1] if has_lora else 0
    ha = moe_lora_rows(h, a_down, routing, config, u_by_token=False) if has_lora else None
    # Slot-order rows and a fixed-order sum over k instead of fp32 atomics into y: deterministic, one rounding per slot.
    y_slot = kernel_config.alloc((num_slots, model_dim), h.dtype, h.device)
    kernel = config.down_fwd
    check_fp8_steps(scale_inv, kernel.block_k)
    grid = (routing.num_tiles * triton.cdiv(model_dim, kernel.block_n),)
    tma = tma_loads(kernel, h.dtype, h, w_down)
    if routing.num_tiles > 0:
        _moe_down_fwd_kernel[grid](
            h, w_down, or_dummy(scale_inv, h), or_dummy(b_down, w_down), or_dummy(ha, h), topk_weights.reshape(-1),
            y_slot,
            row_descriptor(h, routing.block_m, kernel.block_k) if tma else None,
            row_descriptor(w_down, kernel.block_n, kernel.block_k) if tma else None,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *w_down.stride(), *strides3(scale_inv), *strides3(b_down),
            W_IS_FP8=scale_inv is not None, SCALE_BLOCK=FP8_BLOCK,
            HAS_LORA=has_lora, TMA=tma, DOT_PRECISION=dot_precision(h.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(y_slot, num_tokens, routing.top_k, addends), ha
