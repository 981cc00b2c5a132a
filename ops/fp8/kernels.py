"""Triton kernels of the block-scaled FP8 linear: quantization in 1 x 128 groups, and one GEMM through FP8 operands.

Shapes: x [M, K] (rows contiguous), its groups G = ceil(K / 128) (or per segment); a GEMM c [M, N] = a [M, K] @
b [N, K]^T with a_q float8_e4m3fn [M, K] and a_scale fp32 [M, G] (any strides), b_q float8_e4m3fn [N, K] (rows
contiguous) and b_scale fp32 [ceil(N / 128), G]: b's 128 x 128 weight blocks. The rounding is reference.py's.

The forward y = x @ W^T is fp8_gemm(quantized x, W_q); the input gradient dx = dy @ W is fp8_gemm(quantized dy,
W_q^T) over a transposed copy of W_q (1 byte an element), so both run the kernel whose operands are K-major, the
layout Hopper's FP8 tensor cores take.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.dispatch import triton_interpreting
from moe_tune.ops.fp8.reference import AMAX_FLOOR, BLOCK, E4M3_MAX, FP8_DTYPE, num_blocks

# Rows of x per quantization program: 64 x 128 values, 32 a thread at 4 warps.
QUANT_BLOCK_M = 64
QUANT_NUM_WARPS = 4
# e4m3 keeps 3 of fp32's 23 mantissa bits (20 dropped: round to nearest even by adding half a step less one,
# plus the kept last bit, then clearing them); below 2^-6 it is subnormal with a fixed step of 2^-9.
E4M3_DROPPED_BITS = tl.constexpr(20)
E4M3_HALF_STEP_BITS = tl.constexpr((1 << 19) - 1)
E4M3_KEPT_BITS = tl.constexpr(-(1 << 20))
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)
E4M3_SUBNORMAL_STEPS_PER_UNIT = tl.constexpr(2.0**9)
# Adding and subtracting 1.5 * 2^23 rounds an fp32 value below 2^22 to an integer, to nearest even.
ROUND_MAGIC = tl.constexpr(12582912.0)
# reference.py's constants, as the kernels read them.
QUANT_MAX = tl.constexpr(E4M3_MAX)
SCALE_FLOOR = tl.constexpr(AMAX_FLOOR)


@dataclass(frozen=True)
class GemmConfig:
    """One launch of _fp8_gemm_kernel: a [block_m, block_n] output tile, K in steps of 128 (one scale block);
    block_n divides 128, so a tile's columns share one weight scale per K step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Programs of this many row tiles run column tile by column tile, so a weight tile is reused from L2.
    group_m: int = 8


# 128 x 128 tiles, K step 128: 32 KB of FP8 operands a stage, 4 stages in flight; two warpgroups per tile. As fast
# as or faster than 3 or 5 stages, 64 x 128 and 128 x 64 tiles at M 8192 on the H200 (engine/bench/fp8_op.py).
GPU_GEMM = GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=4)
# Few rows (decoding, small batches): 64-row tiles waste less of the tile, one warpgroup.
GPU_SMALL_M_GEMM = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)
GPU_SMALL_M = 64
# The interpreter runs each program in Python: few programs keep CPU tests fast; with 64 columns two column tiles
# read each weight scale row, so CPU tests see the tile-to-scale-row indexing.
INTERPRETER_GEMM = GemmConfig(block_m=32, block_n=64, num_warps=1, num_stages=1, group_m=2)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest even on the e4m3 grid, still in fp32: the conversion to fp8 is then
    exact (the Triton interpreter's own conversion rounds wrongly where a value rounds up into the next binade)."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> E4M3_DROPPED_BITS) & 1
    normal = ((bits + E4M3_HALF_STEP_BITS + lsb) & E4M3_KEPT_BITS).to(tl.float32, bitcast=True)
    steps = (tl.abs(v) * E4M3_SUBNORMAL_STEPS_PER_UNIT + ROUND_MAGIC) - ROUND_MAGIC
    # The sign from the bits, so that values rounding to zero keep it (-0 as the reference's conversion gives).
    subnormal = tl.where(bits < 0, -steps, steps) * E4M3_SUBNORMAL_STEP
    return tl.where(tl.abs(v) >= E4M3_MIN_NORMAL, normal, subnormal)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, group_cols_ptr,
    M, K, stride_scale_m, stride_scale_g,
    HAS_SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if HAS_SEGMENTS:
        col_start = tl.load(group_cols_ptr + 2 * group)
        col_end = tl.load(group_cols_ptr + 2 * group + 1)
    else:
        col_start = group * GROUP
        col_end = tl.minimum(col_start + GROUP, K)
    cols = col_start + tl.arange(0, GROUP)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < col_end)[None, :]
    offsets = rows[:, None].to(tl.int64) * K + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, SCALE_FLOOR), QUANT_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -QUANT_MAX, QUANT_MAX)
    # The GPU's conversion rounds to nearest even as the reference does; the interpreter's needs the rounding done
    # first.
    if ROUND_IN_FP32:
        q = _round_to_e4m3(q)
    tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows.to(tl.int64) * stride_scale_m + group * stride_scale_g, scale, mask=row_mask)


@functools.lru_cache(maxsize=64)
def _group_columns(segments: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[G, 2] int32: the first and one-past-last column of each group, groups of 128 restarting at every segment."""
    bounds, first = [], 0
    for seg in segments:
        for start in range(0, seg, BLOCK):
            bounds.append((first + start, first + min(start + BLOCK, seg)))
        first += seg
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _quantize_groups(
    x: torch.Tensor, segments: tuple[int, ...] | None, is_scale_m_contiguous: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x: shape {tuple(x.shape)} strides {x.stride()} must be a contiguous [M, K]")
    num_rows, size = x.shape
    num_groups = num_blocks(size, segments)
    x_q = _alloc((num_rows, size), FP8_DTYPE, x.device)
    if is_scale_m_contiguous:
        scale = _alloc((num_groups, num_rows), torch.float32, x.device).t()
    else:
        scale = _alloc((num_rows, num_groups), torch.float32, x.device)
    if num_rows == 0 or num_groups == 0:
        return x_q, scale
    group_cols = _group_columns(tuple(segments), x.device) if segments is not None else x
    grid = (triton.cdiv(num_rows, QUANT_BLOCK_M), num_groups)
    _quantize_groups_kernel[grid](
        x, x_q, scale, group_cols, num_rows, size, scale.stride(0), scale.stride(1),
        HAS_SEGMENTS=segments is not None, BLOCK_M=QUANT_BLOCK_M, GROUP=BLOCK, ROUND_IN_FP32=triton_interpreting(),
        num_warps=QUANT_NUM_WARPS,
    )  # fmt: skip
    return x_q, scale


def quantize_groups_fp8(
    x: torch.Tensor, segments: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.quantize_groups of x [M, K] contiguous bf16/fp16/fp32 in one pass: (x_q float8_e4m3fn [M, K],
    scale fp32 [M, G] contiguous), groups of 128 along K restarting at every segment (segments sum to K)."""
    return _quantize_groups(x, segments, is_scale_m_contiguous=False)


def quantize_groups_fp8_for_gemm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups_fp8(x) with the scale [M, G] stored M-contiguous (a [G, M] buffer, transposed view): each K
    step of fp8_gemm then reads its tile's row scales in one coalesced load."""
    return _quantize_groups(x, None, is_scale_m_contiguous=True)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm, stride_as_m, stride_as_g, stride_bs_r, stride_bs_g,
    HAS_BIAS: tl.constexpr, DOT_IN_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_in_group) % group_size_m
    pid_n = (pid % pids_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the end read a valid row instead (never stored): only the K tail needs a mask.
    rows_a = (offs_m % M).to(tl.int64)
    rows_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] with K contiguous: the K-major B operand of FP8 MMAs.
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]
    a_scale_ptrs = a_scale_ptr + rows_a * stride_as_m
    # A column tile never straddles a 128-row weight block (BLOCK_N divides 128): one weight scale per K step.
    b_scale_ptrs = b_scale_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_bs_r

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_scale = tl.load(a_scale_ptrs + kb * stride_as_g)
        b_scale = tl.load(b_scale_ptrs + kb * stride_bs_g)
        if DOT_IN_FP8:
            partial = tl.dot(a, b)
        else:
            partial = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        acc += partial * (a_scale * b_scale)[:, None]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


_forced_gemm_config: GemmConfig | None = None


@contextlib.contextmanager
def forced_gemm_config(config: GemmConfig):
    """Within the block, every fp8_gemm call without its own config runs with `config` (benchmark sweeps, tests)."""
    global _forced_gemm_config
    previous, _forced_gemm_config = _forced_gemm_config, config
    try:
        yield config
    finally:
        _forced_gemm_config = previous


def pick_gemm_config(num_rows: int, is_cuda: bool) -> GemmConfig:
    if _forced_gemm_config is not None:
        return _forced_gemm_config
    if not is_cuda:
        # CPU tensors only reach a kernel under TRITON_INTERPRET=1.
        return INTERPRETER_GEMM
    return GPU_SMALL_M_GEMM if num_rows <= GPU_SMALL_M else GPU_GEMM


def fp8_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """c [M, N] in out_dtype = (a_q * a_scale) @ (b_q * b_scale)^T (+ bias), accumulated in fp32.

    a_q: [M, K] float8_e4m3fn, rows contiguous; a_scale: [M, ceil(K/128)] fp32, any strides (M-contiguous reads
    fastest); b_q: [N, K] float8_e4m3fn, rows contiguous; b_scale: [ceil(N/128), ceil(K/128)] fp32; bias: [N] or
    None. config: the launch (default pick_gemm_config's).
    """
    num_rows, size = a_q.shape
    num_cols = b_q.shape[0]
    c = _alloc((num_rows, num_cols), out_dtype, a_q.device)
    if num_rows == 0 or num_cols == 0:
        return c
    assert a_q.stride(1) == 1 and b_q.stride(1) == 1, "fp8_gemm operands need contiguous rows"
    config = config or pick_gemm_config(num_rows, a_q.is_cuda)
    assert BLOCK % config.block_n == 0, f"block_n ({config.block_n}) must divide the weight block {BLOCK}"
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_cols, config.block_n),)
    _fp8_gemm_kernel[grid](
        a_q, a_scale, b_q, b_scale, bias if bias is not None else a_scale, c,
        num_rows, num_cols, size,
        a_q.stride(0), b_q.stride(0), c.stride(0), a_scale.stride(0), a_scale.stride(1),
        b_scale.stride(0), b_scale.stride(1),
        HAS_BIAS=bias is not None, DOT_IN_FP8=not triton_interpreting(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return c


def fp8_linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y [M, O] in x's dtype = quantized x [M, I] (contiguous) @ deq(weight [O, I])^T (+ bias [O])."""
    x_q, x_scale = quantize_groups_fp8_for_gemm(x)
    return fp8_gemm(x_q, x_scale, weight, scale_inv, bias, x.dtype)


def fp8_linear_bwd_input(dy: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """dx [M, I] in dy's dtype = quantized dy [M, O] (contiguous, groups along O) @ deq(weight [O, I])."""
    dy_q, dy_scale = quantize_groups_fp8_for_gemm(dy)
    return fp8_gemm(dy_q, dy_scale, weight.t().contiguous(), scale_inv.t().contiguous(), None, dy.dtype)
