"""Triton kernels of SwiGLU's activation h = silu(gate) * up (* scale): one forward pass, one backward pass.

Shapes: M rows of F columns (gate, up, h, dh viewed as [M, F], rows contiguous); scale, dscale [M] (one value a
row). The math is in README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of one step along a row, and elements of one [rows, columns] fp32 tile: 16 rows of 256 columns.
MAX_BLOCK_F = 256
TILE_ELEMENTS = 4096
NUM_WARPS = 4


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def block_sizes(num_columns: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_F columns) of one program's tile; a program steps along its rows BLOCK_F at a time."""
    block_f = min(MAX_BLOCK_F, triton.next_power_of_2(num_columns))
    return max(1, TILE_ELEMENTS // block_f), block_f


@triton.jit
def _row_block(scale_ptr, M, F, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    # The program's rows, their mask, their first element's offsets [BLOCK_M, 1] and their scales in fp32 (1.0 without
    # a scale).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    return rows, row_mask, rows[:, None].to(tl.int64) * F, scale


@triton.jit
def _column_step(gate_ptr, up_ptr, row_offsets, row_mask, f0, F, BLOCK_F: tl.constexpr):
    # The [BLOCK_M, BLOCK_F] tile from column f0: its offsets, its mask, and gate and up in fp32.
    cols = f0 + tl.arange(0, BLOCK_F)
    mask = row_mask[:, None] & (cols < F)[None, :]
    offsets = row_offsets + cols[None, :]
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return offsets, mask, g, u


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, scale_ptr, h_ptr,
    M, F,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows, row_mask, row_offsets, scale = _row_block(scale_ptr, M, F, HAS_SCALE, BLOCK_M)
    for f0 in range(0, F, BLOCK_F):
        offsets, mask, g, u = _column_step(gate_ptr, up_ptr, row_offsets, row_mask, f0, F, BLOCK_F)
        h = g * tl.sigmoid(g) * u
        if HAS_SCALE:
            h = h * scale[:, None]
        tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    gate_ptr, up_ptr, scale_ptr, dh_ptr, dgate_ptr, dup_ptr, dscale_ptr,
    M, F,
    HAS_SCALE: tl.constexpr, HAS_DSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows, row_mask, row_offsets, scale = _row_block(scale_ptr, M, F, HAS_SCALE, BLOCK_M)
    dscale = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offsets, mask, g, u = _column_step(gate_ptr, up_ptr, row_offsets, row_mask, f0, F, BLOCK_F)
        dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        act = g * sig
        if HAS_DSCALE:
            dscale += tl.sum(dh * act * u, axis=1)
        if HAS_SCALE:
            dh = dh * scale[:, None]
        tl.store(dup_ptr + offsets, (dh * act).to(dup_ptr.dtype.element_ty), mask=mask)
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    if HAS_DSCALE:
        tl.store(dscale_ptr + rows, dscale.to(dscale_ptr.dtype.element_ty), mask=row_mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """gate, up: [M, F] contiguous; scale: [M] or None. Returns h [M, F] in gate's dtype."""
    num_rows, num_columns = gate.shape
    h = _alloc((num_rows, num_columns), gate.dtype, gate.device)
    if h.numel() == 0:
        return h
    block_m, block_f = block_sizes(num_columns)
    _swiglu_fwd_kernel[(triton.cdiv(num_rows, block_m),)](
        gate, up, scale if scale is not None else gate, h, num_rows, num_columns,
        HAS_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_F=block_f, num_warps=NUM_WARPS,
    )  # fmt: skip
    return h


def swiglu_bwd(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None, needs_dscale: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dh, gate, up: [M, F] contiguous; scale [M] or None. Returns dgate, dup [M, F] (gate's and up's dtypes) and,
    when needs_dscale, dscale [M] in scale's dtype (the row sums of dh * silu(gate) * up)."""
    num_rows, num_columns = gate.shape
    dgate = _alloc((num_rows, num_columns), gate.dtype, gate.device)
    dup = _alloc((num_rows, num_columns), up.dtype, up.device)
    dscale = _alloc((num_rows,), scale.dtype, scale.device) if needs_dscale else None
    if num_rows == 0:
        return dgate, dup, dscale
    if num_columns == 0:
        return dgate, dup, dscale.zero_() if dscale is not None else None
    block_m, block_f = block_sizes(num_columns)
    _swiglu_bwd_kernel[(triton.cdiv(num_rows, block_m),)](
        gate, up, scale if scale is not None else gate, dh, dgate, dup, dscale if dscale is not None else dgate,
        num_rows, num_columns,
        HAS_SCALE=scale is not None, HAS_DSCALE=needs_dscale, BLOCK_M=block_m, BLOCK_F=block_f, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dgate, dup, dscale
