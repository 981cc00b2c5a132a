"""Triton kernels of RMSNorm (optionally gated): one forward pass, one backward pass.

Shapes: M rows of N channels (x viewed as [M, N], rows contiguous); w [N]; z (the gate) [M, N]; rstd [M] fp32;
dw_partial [P, N] fp32, one row per backward program. The math is in README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.dispatch import sm_count

# Elements of one [rows, N] fp32 tile a program holds: enough rows per program for narrow norms (per-head norms
# of 128 channels get 32 rows), one row at a time for the widest, without spilling.
TILE_ELEMENTS = 4096
# Backward programs per SM: each sums dw over a contiguous range of rows, so fewer programs means a smaller
# dw_partial buffer to add up and more rows per program.
BWD_PROGRAMS_PER_SM = 4
# Backward programs without a GPU (the interpreter): a few, so that the dw partial sums are exercised.
BWD_PROGRAMS_CPU = 3


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Threads per program: 4 warps hold a TILE_ELEMENTS tile at 32 fp32 values a thread; a single row wider than the
# tile gets one more warp per 1024 channels (up to 16), so a thread never holds more than 32 values of it.
MIN_WARPS, MAX_WARPS = 4, 16


def block_sizes(num_channels: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_N channels) of one program's tile."""
    block_n = triton.next_power_of_2(num_channels)
    block_m = max(1, min(64, TILE_ELEMENTS // block_n))
    return block_m, block_n


def num_warps(block_m: int, block_n: int) -> int:
    return min(MAX_WARPS, max(MIN_WARPS, block_m * block_n // 1024))


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, r_ptr, h_ptr, w_ptr, z_ptr, y_ptr, rstd_ptr,
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, IS_SILU: tl.constexpr, IS_ONE_PLUS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # h = x + r rounded to the stored dtype, as the eager add: the norm is h's.
        r = tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offsets, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if IS_ONE_PLUS:
        w = w + 1.0
    y = x * rstd[:, None] * w[None, :]
    if HAS_GATE:
        z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        if IS_SILU:
            y = y * (z * sig)
        else:
            y = y * sig
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, z_ptr, dy_ptr, dh_ptr, rstd_ptr, dx_ptr, dz_ptr, dw_partial_ptr,
    M, N, rows_per_program,
    HAS_GATE: tl.constexpr, IS_SILU: tl.constexpr, IS_ONE_PLUS: tl.constexpr, HAS_DW: tl.constexpr,
    HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if IS_ONE_PLUS:
        w = w + 1.0
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        if HAS_GATE:
            z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            if IS_SILU:
                act = z * sig
                act_grad = sig * (1.0 + z * (1.0 - sig))
            else:
                act = sig
                act_grad = sig * (1.0 - sig)
            dz = dy * (x_hat * w[None, :]) * act_grad
            tl.store(dz_ptr + offsets, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            g = dy * act
        else:
            g = dy
        if HAS_DW:
            dw += tl.sum(g * x_hat, axis=0)
        gs = g * w[None, :]
        mean_gs_x = tl.sum(gs * x_hat, axis=1) / N
        dx = rstd[:, None] * (gs - x_hat * mean_gs_x[:, None])
        if HAS_DH:
            # The gradient the normalised input's other uses (the residual stream) send it, added before one rounding.
            dx += tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(dw_partial_ptr + pid * N + cols, dw, mask=col_mask)


def rms_norm_fwd(
    x: torch.Tensor, w: torch.Tensor, z: torch.Tensor | None, eps: float, is_one_plus: bool, is_silu: bool,
    residual: torch.Tensor | None = None, y_out: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x, z, residual: [M, N] contiguous; w: [N]; y_out, h_out (with a residual): [M, N] contiguous of x's dtype,
    where y and h are written (None: new tensors). Returns y [M, N] (x's dtype), rstd [M] fp32 and, with a residual,
    h = x + residual [M, N] (x's dtype), the tensor normalised; None without one."""
    num_rows, num_channels = x.shape
    y = y_out if y_out is not None else _alloc((num_rows, num_channels), x.dtype, x.device)
    rstd = _alloc((num_rows,), torch.float32, x.device)
    h = None
    if residual is not None:
        h = h_out if h_out is not None else _alloc((num_rows, num_channels), x.dtype, x.device)
    if num_rows == 0:
        return y, rstd, h
    block_m, block_n = block_sizes(num_channels)
    grid = (triton.cdiv(num_rows, block_m),)
    _rms_norm_fwd_kernel[grid](
        x, residual if residual is not None else x, h if h is not None else y, w, z if z is not None else x, y, rstd,
        num_rows, num_channels, eps,
        HAS_RESIDUAL=residual is not None, HAS_GATE=z is not None, IS_SILU=is_silu, IS_ONE_PLUS=is_one_plus,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps(block_m, block_n),
    )  # fmt: skip
    return y, rstd, h


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    z: torch.Tensor | None,
    rstd: torch.Tensor,
    is_one_plus: bool,
    is_silu: bool,
    needs_dw: bool,
    dh: torch.Tensor | None = None,
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dy, x, z, dh: [M, N] contiguous; rstd [M] from the forward; dh, the gradient x gets from its other uses,
    added to dx; dx_out: [M, N] contiguous of x's dtype, overlapping no input, where dx is written (None: a new
    tensor). Returns dx [M, N] (dx_out where given), dw [N] fp32 (or None), dz [M, N] (or None)."""
    num_rows, num_channels = x.shape
    dx = _alloc((num_rows, num_channels), x.dtype, x.device) if dx_out is None else dx_out
    dz = _alloc((num_rows, num_channels), z.dtype, z.device) if z is not None else None
    if num_rows == 0:
        dw = torch.zeros(num_channels, dtype=torch.float32, device=x.device) if needs_dw else None
        return dx, dw, dz
    block_m, block_n = block_sizes(num_channels)
    if x.is_cuda:
        max_programs = sm_count(x.device) * BWD_PROGRAMS_PER_SM
    else:
        max_programs = BWD_PROGRAMS_CPU
    # Whole row tiles per program, so only the last program's last tile is partial.
    rows_per_program = triton.cdiv(triton.cdiv(num_rows, max_programs), block_m) * block_m
    num_programs = triton.cdiv(num_rows, rows_per_program)
    dw_partial = _alloc((num_programs, num_channels), torch.float32, x.device) if needs_dw else None
    _rms_norm_bwd_kernel[(num_programs,)](
        x, w, z if z is not None else x, dy, dh if dh is not None else dy, rstd, dx, dz if dz is not None else dx,
        dw_partial if dw_partial is not None else rstd,
        num_rows, num_channels, rows_per_program,
        HAS_GATE=z is not None, IS_SILU=is_silu, IS_ONE_PLUS=is_one_plus, HAS_DW=needs_dw, HAS_DH=dh is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps(block_m, block_n),
    )  # fmt: skip
    return dx, dw_partial.sum(0) if dw_partial is not None else None, dz
