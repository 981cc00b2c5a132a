"""Triton kernels of the MoE expert MLP through frozen FP8 expert weights (128 x 128 block scales): the two grouped
GEMMs forward and their input-gradient GEMMs backward on Hopper FP8 tensor cores, and the 1 x 128 activation
quantization they read.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank, S = N*k token-slots
(rows in expert order as in kernels.py), GD = ceil(D/128), GF = ceil(F/128).

Every GEMM here steps its reduction dim in blocks of 128, each the span of one activation group and one weight scale
block: acc += dot(a_q, b_q) * scale_a[:, None] * scale_b[None, :], scale_a per row, scale_b per output column (the
weight block of that column and this K step), so no dim need be a multiple of 128 and the gate/up halves keep their
own scale rows. The routing metadata, row tiles and LoRA passes are kernels.py's; the LoRA side path reads the
unquantized x, h, dy and d gate_up as it does with bf16 weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.fp8.reference import AMAX_FLOOR, BLOCK, E4M3_MAX, FP8_DTYPE, num_blocks, quantize_groups
from moe_tune.ops.moe.kernel_config import (
    GPU_SMALL_BLOCK_M,
    INTERPRETER_BLOCK,
    KernelConfig,
    dot_precision,
    or_dummy,
    rank_block,
    strides3,
)
from moe_tune.ops.moe.routing import MoERouting, sum_slots, tile_and_column_block, tile_rows

# Output columns of the gate_up forward (two fp32 accumulators, gate and up) and of the down backward (five fp32
# SwiGLU tiles in its epilogue): 64 keeps them in registers; the other two GEMMs take 128.
GPU_HALF_BLOCK_N = 64
GPU_BLOCK_N = 128
# 16-bit activations: 64-row tiles on one warpgroup, 4 stages (24-32 KB each). Every 128-wide K step waits for its MMA
# before the block scales apply, so more, smaller CTAs per SM keep the tensor cores busier: E64 top-8 LoRA r16
# fwd+bwd 10.97 ms against 11.69 with 128-row tiles on two warpgroups, E512 top-10 16.16 against 17.12 (H200,
# engine/bench/moe_op.py fp8_candidates).
GPU_BLOCK_M = 64
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 4
# fp32 activations keep the config the full GPU test file ran with: 128-row tiles, two warpgroups, 3 stages.
GPU_FP32_BLOCK_M = 128
GPU_FP32_NUM_WARPS = 8
GPU_FP32_NUM_STAGES = 3
# The interpreter runs each program in Python and each tile op in numpy: wide column blocks mean few programs.
INTERPRETER_BLOCK_N = 64
# Rows per program of the quantization pass: 32 x 128 elements.
QUANTIZE_ROWS = 32
QUANTIZE_NUM_WARPS = 4


@dataclass(frozen=True)
class Fp8Config:
    """Launch parameters of the four FP8 GEMMs (their block_k is always 128, the scale block) and the rows per tile of
    the routing they walk (block_m; the LoRA rank passes share it)."""

    block_m: int
    gate_up_fwd: KernelConfig
    down_fwd: KernelConfig
    down_bwd: KernelConfig
    gate_up_bwd: KernelConfig
    # The backward GEMMs: True, FP8 MMAs over a K-major copy of the weights made per call (k_major); False, the
    # weights read as stored and their codes (and the other operand's) converted to bf16 for bf16 MMAs, the same
    # exact products at bf16's MMA rate and no copy.
    is_backward_k_major: bool = True


_forced_fp8_config: Fp8Config | None = None


@contextlib.contextmanager
def forced_fp8_config(config: Fp8Config):
    """Within the block, every FP8 moe_mlp call on the kernels runs with `config` (benchmark sweeps, tests)."""
    global _forced_fp8_config
    previous, _forced_fp8_config = _forced_fp8_config, config
    try:
        yield config
    finally:
        _forced_fp8_config = previous


def pick_fp8_config(x: torch.Tensor, num_slots: int, num_experts: int) -> Fp8Config:
    if _forced_fp8_config is not None:
        return _forced_fp8_config
    if not x.is_cuda:
        # The interpreter; K steps stay 128 wide (the scale blocks).
        small = KernelConfig(INTERPRETER_BLOCK_N, BLOCK, num_warps=1, num_stages=1)
        return Fp8Config(INTERPRETER_BLOCK, small, small, small, small)
    if x.dtype == torch.float32:
        warps, stages = GPU_FP32_NUM_WARPS, GPU_FP32_NUM_STAGES
        # Experts averaging fewer rows than a 128-row tile waste most of it (kernels.py's rule).
        block_m = GPU_FP32_BLOCK_M if num_slots / max(num_experts, 1) >= GPU_FP32_BLOCK_M else GPU_SMALL_BLOCK_M
    else:
        warps, stages, block_m = GPU_NUM_WARPS, GPU_NUM_STAGES, GPU_BLOCK_M
    half = KernelConfig(GPU_HALF_BLOCK_N, BLOCK, warps, stages)
    full = KernelConfig(GPU_BLOCK_N, BLOCK, warps, stages)
    return Fp8Config(block_m, gate_up_fwd=half, down_fwd=full, down_bwd=half, gate_up_bwd=full)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every float buffer a kernel of this module writes, FP8 ones aside (tests fill them with NaN and guard them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def k_major(w: torch.Tensor) -> torch.Tensor:
    """w [E, P, Q] FP8 with the same shape and values, P contiguous (a transposed copy, E x P x Q bytes).

    The backward GEMMs reduce over P; Hopper's FP8 MMA reads both operands K-major from shared memory, and a
    Q-contiguous weight tile is transposed on every step instead (the dx GEMM took 3.9x its bf16 time
    that way at E64 top-8 on the H200: 7.7 against 2.0 ms); the copy costs one pass over the layer's weight (2.2 ms
    for both weights there, torch's byte-wise transposed copy).
    """
    # Through uint8: the copy kernels of every torch version take it.
    return w.view(torch.uint8).transpose(1, 2).contiguous().transpose(1, 2).view(w.dtype)


def _dot_mode(t: torch.Tensor, is_fp8_mma: bool = True) -> str:
    """How a kernel multiplies FP8 codes: "fp8" tensor-core MMAs, or "bf16" MMAs of the codes converted (exact), on
    the GPU; "fp32" dots of the codes in the interpreter, whose FP8 and bf16 dots do not run. All three are exact
    products (an FP8 value has a 4-bit significand) summed in fp32."""
    if not t.is_cuda:
        return "fp32"
    return "fp8" if is_fp8_mma else "bf16"


@triton.jit
def _scaled_dot(a, b, DOT_MODE: tl.constexpr):
    # [M, K] x [K, N] of FP8 operands, fp32 result.
    if DOT_MODE == "fp8":
        return tl.dot(a, b)
    elif DOT_MODE == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


# Activation quantization: q = round(clamp(x / s, -448, 448)) in e4m3, s = max(amax, floor) / 448 over each group of
# 128 columns (groups restart at every segment of seg_len columns), as ops/fp8/reference.py's quantize_groups.
@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # out [M, K] float8_e4m3fn, contiguous
    scale_ptr,  # out [M, G] fp32, contiguous
    M,
    K,
    seg_len,
    groups_per_seg,
    num_groups,
    stride_xm,
    stride_xk,
    AMAX_FLOOR: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
):
    group = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < M
    within = (group % groups_per_seg) * GROUP + tl.arange(0, GROUP)
    cols = (group // groups_per_seg) * seg_len + within
    mask = row_mask[:, None] & (within < seg_len)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # Correctly rounded divisions (Triton's default fp32 division is approximate): the reference's scales and codes.
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(scale_ptr + rows * num_groups + group, scale, mask=row_mask)


def quantize_rows(x: torch.Tensor, segments: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K], scale fp32 [M, G]) of x [M, K] in 1 x 128 groups along K, restarting at each of
    two equal segments when given (d gate_up's halves). The kernel on CUDA; ops.fp8.reference's quantize_groups on
    the CPU (the interpreter's float-to-FP8 cast rounds wrongly where a value rounds up into the next binade)."""
    if not x.is_cuda:
        x_q, scale = quantize_groups(x, segments)
        return x_q.contiguous(), scale.contiguous()
    num_rows, dim_k = x.shape
    seg_len = dim_k if segments is None else segments[0]
    assert segments is None or (len(segments) == 2 and segments[0] == segments[1] and sum(segments) == dim_k)
    groups_per_seg = triton.cdiv(seg_len, BLOCK)
    num_groups = num_blocks(dim_k, segments)
    x_q = torch.empty((num_rows, dim_k), dtype=FP8_DTYPE, device=x.device)
    scale = _alloc((num_rows, num_groups), torch.float32, x.device)
    if num_rows > 0 and num_groups > 0:
        _quantize_groups_kernel[(triton.cdiv(num_rows, QUANTIZE_ROWS), num_groups)](
            x, x_q, scale, num_rows, dim_k, seg_len, groups_per_seg, num_groups, *x.stride(),
            AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=E4M3_MAX, BLOCK_ROWS=QUANTIZE_ROWS, GROUP=BLOCK,
            num_warps=QUANTIZE_NUM_WARPS,
        )  # fmt: skip
    return x_q, scale


# Forward GEMM 1: gate_up = fq(x)[token] @ W_gu[e]^T (+ s xa B^T), h = silu(gate) * up
@triton.jit
def _fp8_gate_up_fwd_kernel(
    xq_ptr,  # [N, D] fp8, contiguous
    xs_ptr,  # [N, GD] fp32
    w_ptr,  # [E, 2F, D] fp8
    ws_ptr,  # [E, 2 GF, GD] fp32
    b_ptr,  # [E, 2F, r] LoRA B on gate_up
    xa_ptr,  # [S, r] fp32 x @ A^T (unquantized x), expert order
    h_ptr,  # out [S, F] expert order
    gate_up_ptr,  # out [S, 2F], written when SAVE_GATE_UP
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    scaling,
    stride_we,
    stride_wf,
    stride_wd,
    stride_se,
    stride_sf,
    stride_sd,
    stride_be,
    stride_bf,
    stride_br,
    HAS_LORA: tl.constexpr,
    SAVE_GATE_UP: tl.constexpr,
    DOT_MODE: tl.constexpr,
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
    num_k_blocks = tl.cdiv(D, BLOCK_K)

    x_rows = xq_ptr + tokens[:, None] * D
    xs_rows = xs_ptr + tokens * num_k_blocks
    w_gate = w_ptr + expert * stride_we + cols[:, None] * stride_wf
    w_up = w_gate + F * stride_wf
    # Column c of the gate half has scale row c // 128, of the up half GF + c // 128.
    s_gate = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sf
    s_up = s_gate + tl.cdiv(F, BLOCK_K) * stride_sf
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_k_blocks):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        x_tile = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        wg_tile = tl.load(w_gate + ks[None, :] * stride_wd, mask=w_mask, other=0.0)
        wu_tile = tl.load(w_up + ks[None, :] * stride_wd, mask=w_mask, other=0.0)
        x_scale = tl.load(xs_rows + kb, mask=row_mask, other=0.0)
        sg = tl.load(s_gate + kb * stride_sd, mask=col_mask, other=0.0)
        su = tl.load(s_up + kb * stride_sd, mask=col_mask, other=0.0)
        acc_gate += _scaled_dot(x_tile, tl.trans(wg_tile), DOT_MODE) * (x_scale[:, None] * sg[None, :])
        acc_up += _scaled_dot(x_tile, tl.trans(wu_tile), DOT_MODE) * (x_scale[:, None] * su[None, :])
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        xa = tl.load(
            xa_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        b_gate = b_ptr + expert * stride_be + cols[None, :] * stride_bf + ranks[:, None] * stride_br
        b_mask = rank_mask[:, None] & col_mask[None, :]
        bg_tile = tl.load(b_gate, mask=b_mask, other=0.0).to(tl.float32)  # [R, N]
        bu_tile = tl.load(b_gate + F * stride_bf, mask=b_mask, other=0.0).to(tl.float32)
        xa_scaled = xa * scaling
        acc_gate = tl.dot(xa_scaled, bg_tile, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(xa_scaled, bu_tile, acc_up, input_precision=DOT_PRECISION)

    out_mask = row_mask[:, None] & col_mask[None, :]
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)
    if SAVE_GATE_UP:
        gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(gate_up_rows, acc_gate.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
        tl.store(gate_up_rows + F, acc_up.to(gate_up_ptr.dtype.element_ty), mask=out_mask)


# Forward GEMM 2: y_slot = w_slot * (fq(h) @ W_d[e]^T (+ s ha B^T)), stored in slot order
@triton.jit
def _fp8_down_fwd_kernel(
    hq_ptr,  # [S, F] fp8 expert order, contiguous
    hs_ptr,  # [S, GF] fp32
    w_ptr,  # [E, D, F] fp8
    ws_ptr,  # [E, GD, GF] fp32
    b_ptr,  # [E, D, r] LoRA B on down
    ha_ptr,  # [S, r] fp32 h @ A^T (unquantized h), expert order
    weights_ptr,  # [S] routing weights in slot order
    y_ptr,  # out [S, D] slot order
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
    HAS_LORA: tl.constexpr,
    DOT_MODE: tl.constexpr,
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
    num_k_blocks = tl.cdiv(F, BLOCK_K)

    h_rows = hq_ptr + rows[:, None] * F
    hs_rows = hs_ptr + rows * num_k_blocks
    w_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wd
    s_cols = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_k_blocks):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < F
        h_tile = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_rows + ks[None, :] * stride_wf, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        h_scale = tl.load(hs_rows + kb, mask=row_mask, other=0.0)
        w_scale = tl.load(s_cols + kb * stride_sf, mask=col_mask, other=0.0)
        acc += _scaled_dot(h_tile, tl.trans(w_tile), DOT_MODE) * (h_scale[:, None] * w_scale[None, :])
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


# Backward of GEMM 2 and SwiGLU: dh = w * (fq(dy)[token] @ W_d[e] + dha A), d(gate, up), d weights, w * h
@triton.jit
def _fp8_down_bwd_kernel(
    dyq_ptr,  # [N, D] fp8, contiguous: dy quantized per token, before the routing weight
    dys_ptr,  # [N, GD] fp32
    w_ptr,  # [E, D, F] fp8
    ws_ptr,  # [E, GD, GF] fp32
    a_ptr,  # [E, r, F]
    dha_ptr,  # [S, r] s dy[token] @ B (unquantized dy), expert order (rank dtype)
    gate_up_ptr,  # [S, 2F] pre-activations saved by the forward, expert order
    weights_ptr,  # [S] slot order
    dgate_up_ptr,  # out [S, 2F] expert order
    h_ptr,  # out [S, F] w * h, written when STORE_H
    dweights_ptr,  # out [cdiv(F, BLOCK_N), S] fp32 per-column-block partial sums of <dh / w, h>
    slot_of_row_ptr,
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    S,
    D,
    F,
    rank,
    stride_we,
    stride_wd,
    stride_wf,
    stride_se,
    stride_sd,
    stride_sf,
    stride_ae,
    stride_ar,
    stride_af,
    HAS_LORA: tl.constexpr,
    STORE_H: tl.constexpr,
    DOT_MODE: tl.constexpr,
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
    num_k_blocks = tl.cdiv(D, BLOCK_K)

    dy_rows = dyq_ptr + tokens[:, None] * D
    dys_rows = dys_ptr + tokens * num_k_blocks
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wf
    # The weight's K step kb is its scale row; column c its scale column c // 128.
    s_cols = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sf
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_k_blocks):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        dy_tile = tl.load(dy_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_cols + ks[:, None] * stride_wd, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        dy_scale = tl.load(dys_rows + kb, mask=row_mask, other=0.0)
        w_scale = tl.load(s_cols + kb * stride_sd, mask=col_mask, other=0.0)
        acc += _scaled_dot(dy_tile, w_tile, DOT_MODE) * (dy_scale[:, None] * w_scale[None, :])

    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
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

    out_mask = row_mask[:, None] & col_mask[None, :]
    gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(gate_up_rows, mask=out_mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_rows + F, mask=out_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    tl.store(dweights_ptr + pid_n * S + slots, tl.sum(acc * h, axis=1), mask=row_mask)
    dh = acc * weights[:, None]
    # silu'(g) * up = sig * up + h * (1 - sig), as kernels.py's down backward.
    dgate = dh * (sig * up + h * (1.0 - sig))
    dup = dh * silu
    dgate_up_rows = dgate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    tl.store(dgate_up_rows, dgate.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dgate_up_rows + F, dup.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    if STORE_H:
        h_weighted = h * weights[:, None]
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h_weighted.to(h_ptr.dtype.element_ty), mask=out_mask)


# Backward of GEMM 1: dx_slot = fq(dgate_up) @ W_gu[e] (+ dxa A), stored in slot order
@triton.jit
def _fp8_gate_up_bwd_kernel(
    gq_ptr,  # [S, 2F] fp8 expert order, contiguous: d gate_up quantized per half
    gs_ptr,  # [S, 2 GF] fp32
    w_ptr,  # [E, 2F, D] fp8
    ws_ptr,  # [E, 2 GF, GD] fp32
    a_ptr,  # [E, r, D]
    dxa_ptr,  # [S, r] s dgate_up @ B (unquantized), expert order (rank dtype)
    dx_ptr,  # out [S, D] slot order
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
    HAS_LORA: tl.constexpr,
    DOT_MODE: tl.constexpr,
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
    # K steps never straddle the gate/up boundary: each half's groups and scale rows start at its first column.
    half_blocks = tl.cdiv(F, BLOCK_K)

    g_rows = gq_ptr + rows[:, None] * (2 * F)
    gs_rows = gs_ptr + rows * (2 * half_blocks)
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wd
    s_cols = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, 2 * half_blocks):
        half = step // half_blocks
        within = (step % half_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = within < F
        ks = half * F + within
        g_tile = tl.load(g_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_cols + ks[:, None] * stride_wf, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        g_scale = tl.load(gs_rows + step, mask=row_mask, other=0.0)
        w_scale = tl.load(s_cols + step * stride_sf, mask=col_mask, other=0.0)
        acc += _scaled_dot(g_tile, w_tile, DOT_MODE) * (g_scale[:, None] * w_scale[None, :])
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


def fp8_gate_up_fwd(
    x: torch.Tensor,
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    b_gate_up: torch.Tensor | None,
    xa: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: Fp8Config,
    save_gate_up: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = silu(gate) * up per expert-sorted row from x_q, x_scale = quantize_rows(x) (x [N, D] gives the dtype).

    b_gate_up: [E, 2F, r] LoRA B and xa: [S, r] fp32 = x[token] A^T (kernels.moe_lora_rows), or both None.
    Returns h [S, F] in x.dtype and gate_up [S, 2F] pre-activations (when save_gate_up).
    """
    num_slots, model_dim = routing.num_slots, x.shape[1]
    num_hidden = w_gate_up.shape[1] // 2
    has_lora = xa is not None
    rank = xa.shape[1] if has_lora else 0
    h = _alloc((num_slots, num_hidden), x.dtype, x.device)
    gate_up = _alloc((num_slots, 2 * num_hidden), x.dtype, x.device) if save_gate_up else None
    kernel = config.gate_up_fwd
    if routing.num_tiles > 0:
        _fp8_gate_up_fwd_kernel[(routing.num_tiles * triton.cdiv(num_hidden, kernel.block_n),)](
            x_q, x_scale, w_gate_up, gate_up_scale_inv, or_dummy(b_gate_up, h), or_dummy(xa, h), h,
            or_dummy(gate_up, h),
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *w_gate_up.stride(), *gate_up_scale_inv.stride(), *strides3(b_gate_up),
            HAS_LORA=has_lora, SAVE_GATE_UP=save_gate_up, DOT_MODE=_dot_mode(x),
            DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=BLOCK, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return h, gate_up


def fp8_down_fwd(
    h: torch.Tensor,
    h_q: torch.Tensor,
    h_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    b_down: torch.Tensor | None,
    ha: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: Fp8Config,
    num_tokens: int,
) -> torch.Tensor:
    """y [N, D] in h.dtype = sum_j w[t, j] * (fq(h) @ W_down^T (+ s ha B^T)) over each token's slots.

    h_q, h_scale = quantize_rows(h) (h [S, F] expert order, gives the dtype); b_down: [E, D, r] and ha: [S, r] fp32
    = h A^T (kernels.moe_lora_rows), or both None.
    """
    num_slots, num_hidden = h.shape
    model_dim = w_down.shape[1]
    has_lora = ha is not None
    rank = ha.shape[1] if has_lora else 0
    y_slot = _alloc((num_slots, model_dim), h.dtype, h.device)
    kernel = config.down_fwd
    if routing.num_tiles > 0:
        _fp8_down_fwd_kernel[(routing.num_tiles * triton.cdiv(model_dim, kernel.block_n),)](
            h_q, h_scale, w_down, down_scale_inv, or_dummy(b_down, h), or_dummy(ha, h), topk_weights.reshape(-1),
            y_slot,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *w_down.stride(), *down_scale_inv.stride(), *strides3(b_down),
            HAS_LORA=has_lora, DOT_MODE=_dot_mode(h), DOT_PRECISION=dot_precision(h.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=BLOCK, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(y_slot, num_tokens, routing.top_k)


def fp8_down_bwd(
    dy_q: torch.Tensor,
    dy_scale: torch.Tensor,
    gate_up: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    a_down: torch.Tensor | None,
    dha: torch.Tensor | None,
    routing: MoERouting,
    config: Fp8Config,
    store_h: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward of the down projection, the routing weights and SwiGLU, through the FP8 w_down.

    dy_q, dy_scale = quantize_rows(dy) ([N, D], per token); a_down: [E, r, F] and dha: [S, r] = s dy[token] B_down
    (kernels.moe_lora_bwd), or both None.
    Returns dgate_up [S, 2F] in gate_up.dtype, w * h [S, F] (when store_h) and d topk_weights [S] fp32 in slot order
    (<fq(dy) W_down + dha A, h>: the weight's gradient through the same straight-through product as dh).
    """
    has_lora = a_down is not None
    assert has_lora == (dha is not None), "dha needs the down adapter"
    num_slots, model_dim = routing.num_slots, w_down.shape[1]
    num_hidden = gate_up.shape[1] // 2
    rank = a_down.shape[1] if has_lora else 0
    if config.is_backward_k_major:
        w_down = k_major(w_down)
    dgate_up = _alloc((num_slots, 2 * num_hidden), gate_up.dtype, gate_up.device)
    h = _alloc((num_slots, num_hidden), gate_up.dtype, gate_up.device) if store_h else None
    kernel = config.down_bwd
    num_col_blocks = triton.cdiv(num_hidden, kernel.block_n)
    dweights_partial = _alloc((num_col_blocks, num_slots), torch.float32, gate_up.device)
    if routing.num_tiles > 0:
        _fp8_down_bwd_kernel[(routing.num_tiles * num_col_blocks,)](
            dy_q, dy_scale, w_down, down_scale_inv, or_dummy(a_down, dgate_up), or_dummy(dha, dgate_up), gate_up,
            topk_weights.reshape(-1), dgate_up, or_dummy(h, dgate_up), dweights_partial,
            routing.slot_of_row_S, routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T,
            routing.offsets_E1,
            num_slots, model_dim, num_hidden, rank,
            *w_down.stride(), *down_scale_inv.stride(), *strides3(a_down),
            HAS_LORA=has_lora, STORE_H=store_h, DOT_MODE=_dot_mode(gate_up, config.is_backward_k_major),
            DOT_PRECISION=dot_precision(gate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=BLOCK, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return dgate_up, h, dweights_partial.sum(dim=0)


def fp8_gate_up_bwd(
    dgate_up: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    a_gate_up: torch.Tensor | None,
    dxa: torch.Tensor | None,
    routing: MoERouting,
    config: Fp8Config,
    num_tokens: int,
) -> torch.Tensor:
    """dx [N, D] in dgate_up.dtype = sum over each token's slots of fq(dgate_up) @ W_gate_up (+ dxa A), dgate_up
    [S, 2F] quantized here in its two halves. a_gate_up: [E, r, D] and dxa: [S, r] = s dgate_up B_gate_up
    (kernels.moe_lora_bwd), or both None."""
    has_lora = a_gate_up is not None
    assert has_lora == (dxa is not None), "dxa needs the gate_up adapter"
    num_slots = routing.num_slots
    num_hidden, model_dim = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    rank = a_gate_up.shape[1] if has_lora else 0
    g_q, g_scale = quantize_rows(dgate_up, (num_hidden, num_hidden))
    if config.is_backward_k_major:
        w_gate_up = k_major(w_gate_up)
    dx_slot = _alloc((num_slots, model_dim), dgate_up.dtype, dgate_up.device)
    kernel = config.gate_up_bwd
    if routing.num_tiles > 0:
        _fp8_gate_up_bwd_kernel[(routing.num_tiles * triton.cdiv(model_dim, kernel.block_n),)](
            g_q, g_scale, w_gate_up, gate_up_scale_inv, or_dummy(a_gate_up, dgate_up), or_dummy(dxa, dgate_up),
            dx_slot,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank,
            *w_gate_up.stride(), *gate_up_scale_inv.stride(), *strides3(a_gate_up),
            HAS_LORA=has_lora, DOT_MODE=_dot_mode(dgate_up, config.is_backward_k_major),
            DOT_PRECISION=dot_precision(dgate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=BLOCK, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(dx_slot, num_tokens, routing.top_k)
