"""Triton kernel of the rotary embedding: one pass over x forward, one over dy backward (the transposed rotation).

Shapes: x, y, dy, dx [M, D] contiguous, M = B * T * H rows, the token of row m being (m // H) % T; cos, sin [T, R]
fp32 contiguous. The math is in README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of one program: 16 rows of 128 dims are 4 KB of bf16, enough in flight per program at 4 warps.
BLOCK_M = 16


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, M, T, H, D, R,
    IS_BACKWARD: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):  # fmt: skip
    """Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (halves 1 and 2 of the first R dims, c and s the halves of
    the token's cos and sin rows). Backward (x holds dy): the transpose, dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1.
    Dims R..D are copied either way."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    token = (rows // H) % T
    half = R // 2
    j = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (j < half)[None, :]
    x_row = x_ptr + rows.to(tl.int64)[:, None] * D
    y_row = y_ptr + rows.to(tl.int64)[:, None] * D
    table = token.to(tl.int64)[:, None] * R + j[None, :]
    x1 = tl.load(x_row + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + table, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + table + half, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + table, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + table + half, mask=mask, other=0.0)
    if IS_BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + j[None, :], y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + half + j[None, :], y2.to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_REST:
        k = tl.arange(0, BLOCK_REST)
        rest_mask = row_mask[:, None] & (k < D - R)[None, :]
        rest = tl.load(x_row + R + k[None, :], mask=rest_mask, other=0.0)
        tl.store(y_row + R + k[None, :], rest, mask=rest_mask)


def rotary_pass(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, is_backward: bool
) -> torch.Tensor:
    """x [M, D] contiguous (dy for the backward); cos, sin [T, R] fp32 contiguous; num_heads H. Returns [M, D] in
    x's dtype."""
    num_rows, dim = x.shape
    num_tokens, rotary_dim = cos.shape
    y = _alloc((num_rows, dim), x.dtype, x.device)
    if num_rows == 0:
        return y
    has_rest = dim > rotary_dim
    _rotary_kernel[(triton.cdiv(num_rows, BLOCK_M),)](
        x, cos, sin, y, num_rows, num_tokens, num_heads, dim, rotary_dim,
        IS_BACKWARD=is_backward, HAS_REST=has_rest, BLOCK_M=BLOCK_M,
        BLOCK_HALF=triton.next_power_of_2(max(rotary_dim // 2, 1)),
        BLOCK_REST=triton.next_power_of_2(max(dim - rotary_dim, 1)), num_warps=4,
    )  # fmt: skip
    return y
