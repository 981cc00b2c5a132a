"""Triton kernels of causal_conv_heads: the causal conv + SiLU of a linear-attention layer over its q, k and v
projections held apart, written straight as attention heads (q and k repeated for the value heads that share them).

Shapes: q, k [B, T, Hk*K], v [B, T, Hv*V] contiguous (the segments); w [2 Hk K + Hv V, W] (the channels of the three
segments in that order); outputs q, k [B, T, Hv, K] and v [B, T, Hv, V]; G = Hv / Hk. Output channel of input channel
c = h * D + d of a segment with head dim D and repeat R: (h * R + r) * D + d for r < R (R = G for q and k, 1 for v).
dpre [B, T, 2 Hk K + Hv V] fp32; dw_partial [B * T-tiles, 2 Hk K + Hv V, W] fp32. The math is in README.md.

One launch covers the three segments: the channel axis of the grid enumerates q's channel tiles, then k's, then
v's, and each program reads the pointers and sizes of its own segment. The backward is two passes (dpre through
memory) or, with `ConvLaunch.one_pass_backward`, one (kernels.py says how).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.causal_conv import kernels
from moe_tune.ops.causal_conv.kernels import DEFAULT_LAUNCH, ConvLaunch, conv_dx_dw, conv_dx_dw_one_pass, conv_pre


@triton.jit
def _segment(pid_c, blocks_qk, q_ptr, k_ptr, v_ptr, out_q_ptr, out_k_ptr, out_v_ptr, C_QK, C_V, KD, VD, G):
    # The segment of channel tile pid_c: (its input, its output, its channels, head dim, repeat, first channel in
    # the concatenated weight, tile within the segment).
    is_k = pid_c >= blocks_qk
    is_v = pid_c >= 2 * blocks_qk
    if is_v:
        ptr, out_ptr = v_ptr, out_v_ptr
    elif is_k:
        ptr, out_ptr = k_ptr, out_k_ptr
    else:
        ptr, out_ptr = q_ptr, out_q_ptr
    first = tl.where(is_v, 2 * C_QK, tl.where(is_k, C_QK, 0))
    tile = pid_c - tl.where(is_v, 2 * blocks_qk, tl.where(is_k, blocks_qk, 0))
    return ptr, out_ptr, tl.where(is_v, C_V, C_QK), tl.where(is_v, VD, KD), tl.where(is_v, 1, G), first, tile


@triton.jit
def _segment_ptr(pid_c, blocks_qk, q_ptr, k_ptr, v_ptr):
    # Of three pointers, the one of channel tile pid_c's segment.
    ptr = q_ptr
    if pid_c >= 2 * blocks_qk:
        ptr = v_ptr
    elif pid_c >= blocks_qk:
        ptr = k_ptr
    return ptr


@triton.jit
def _conv_heads_fwd_kernel(
    xq_ptr, xk_ptr, xv_ptr, w_ptr, pos_ptr, yq_ptr, yk_ptr, yv_ptr, dpre_ptr, T, C_QK, C_V, KD, VD, G, dilation,
    blocks_qk, IS_DPRE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """pre for one tile of one segment, then y = silu(pre) written to each of its channel's R output heads
    (forward), or (IS_DPRE, the backward's first pass) dpre = (sum of those R heads' dy) * silu'(pre) in fp32 into
    the concatenated channels of dpre; y*_ptr then hold dy."""
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    x_ptr, y_ptr, channels, head_dim, repeat, first, tile = _segment(
        pid_c, blocks_qk, xq_ptr, xk_ptr, xv_ptr, yq_ptr, yk_ptr, yv_ptr, C_QK, C_V, KD, VD, G
    )
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < T
    col_mask = cols < channels
    mask = row_mask[:, None] & col_mask[None, :]
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    pre = conv_pre(
        x_ptr, w_ptr + first * W, pos, rows, cols, row_mask, col_mask, batch * T * channels, T, channels, dilation,
        W, BLOCK_T, BLOCK_C,
    )  # fmt: skip
    sig = tl.sigmoid(pre)
    # The first of the R output heads of each channel; the others follow head_dim channels apart.
    out_row = channels * repeat
    out_offsets = batch * T * out_row + rows[:, None].to(tl.int64) * out_row + (
        (cols // head_dim) * repeat * head_dim + cols % head_dim
    )[None, :]
    if IS_DPRE:
        dy = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for r in range(repeat):
            dy += tl.load(y_ptr + out_offsets + r * head_dim, mask=mask, other=0.0).to(tl.float32)
        total = 2 * C_QK + C_V
        dpre_offsets = batch * T * total + rows[:, None].to(tl.int64) * total + (first + cols)[None, :]
        tl.store(dpre_ptr + dpre_offsets, dy * sig * (1.0 + pre * (1.0 - sig)), mask=mask)
    else:
        y = (pre * sig).to(y_ptr.dtype.element_ty)
        for r in range(repeat):
            tl.store(y_ptr + out_offsets + r * head_dim, y, mask=mask)


@triton.jit
def _conv_heads_bwd_kernel(
    xq_ptr, xk_ptr, xv_ptr, w_ptr, pos_ptr, dpre_ptr, dxq_ptr, dxk_ptr, dxv_ptr, dw_partial_ptr, T, C_QK, C_V,
    dilation, blocks_qk, num_t_tiles, W: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx of one tile of one segment from the concatenated dpre, and its share of dw (per T-tile partials)."""
    tile_t = tl.program_id(0)
    batch = tl.program_id(2)
    x_ptr, dx_ptr, channels, _, _, first, tile = _segment(
        tl.program_id(1), blocks_qk, xq_ptr, xk_ptr, xv_ptr, dxq_ptr, dxk_ptr, dxv_ptr, C_QK, C_V, 1, 1, 1
    )
    total = 2 * C_QK + C_V
    rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < T
    col_mask = cols < channels
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    x_base = batch.to(tl.int64) * T * channels
    partial_row = (batch * num_t_tiles + tile_t).to(tl.int64) * total * W + first * W
    dx = conv_dx_dw(
        x_ptr, x_base, channels, w_ptr + first * W, pos_ptr, pos, dpre_ptr, batch.to(tl.int64) * T * total + first,
        total, dw_partial_ptr, partial_row, rows, cols, row_mask, col_mask, T, dilation, W, HAS_DW, BLOCK_T, BLOCK_C,
    )  # fmt: skip
    tl.store(
        dx_ptr + x_base + rows[:, None].to(tl.int64) * channels + cols[None, :],
        dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :],
    )  # fmt: skip


@triton.jit
def _conv_heads_bwd_one_pass_kernel(
    xq_ptr, xk_ptr, xv_ptr, w_ptr, pos_ptr, dyq_ptr, dyk_ptr, dyv_ptr, dxq_ptr, dxk_ptr, dxv_ptr, dw_partial_ptr, T,
    C_QK, C_V, KD, VD, G, dilation, blocks_qk, num_t_tiles, W: tl.constexpr, HAS_DW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx of one tile of one segment straight from the R output heads' dy (dpre recomputed per tap), and its share of
    dw (per T-tile partials)."""
    tile_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2)
    x_ptr, dx_ptr, channels, head_dim, repeat, first, tile = _segment(
        pid_c, blocks_qk, xq_ptr, xk_ptr, xv_ptr, dxq_ptr, dxk_ptr, dxv_ptr, C_QK, C_V, KD, VD, G
    )
    dy_ptr = _segment_ptr(pid_c, blocks_qk, dyq_ptr, dyk_ptr, dyv_ptr)
    total = 2 * C_QK + C_V
    rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < T
    col_mask = cols < channels
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    x_base = batch.to(tl.int64) * T * channels
    out_row = channels * repeat
    dy_cols = (cols // head_dim) * repeat * head_dim + cols % head_dim
    partial_row = (batch * num_t_tiles + tile_t).to(tl.int64) * total * W + first * W
    dx = conv_dx_dw_one_pass(
        x_ptr, x_base, channels, w_ptr + first * W, pos_ptr, pos, dy_ptr, batch.to(tl.int64) * T * out_row, out_row,
        dy_cols, head_dim, repeat, dw_partial_ptr, partial_row, rows, cols, row_mask, col_mask, T, dilation, W,
        HAS_DW, BLOCK_T, BLOCK_C,
    )  # fmt: skip
    tl.store(
        dx_ptr + x_base + rows[:, None].to(tl.int64) * channels + cols[None, :],
        dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :],
    )  # fmt: skip


def _grid(
    batch: int, tokens: int, channels_qk: int, channels_v: int, block_t: int, block_c: int
) -> tuple[tuple[int, int, int], int]:
    blocks_qk = triton.cdiv(channels_qk, block_c)
    return (triton.cdiv(tokens, block_t), 2 * blocks_qk + triton.cdiv(channels_v, block_c), batch), blocks_qk


def causal_conv_heads_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, dilation: int,
    key_head_dim: int, value_head_dim: int, launch: ConvLaunch = DEFAULT_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k [B, T, Hk*K], v [B, T, Hv*V] contiguous; w [2 Hk K + Hv V, W] contiguous. Returns q, k [B, T, Hv, K] and
    v [B, T, Hv, V] in the inputs' dtype."""
    batch, tokens, channels_qk = q.shape
    channels_v = v.shape[2]
    num_value_heads = channels_v // value_head_dim
    repeat = num_value_heads // (channels_qk // key_head_dim)
    alloc = kernels.alloc
    yq = alloc((batch, tokens, num_value_heads, key_head_dim), q.dtype, q.device)
    yk = alloc((batch, tokens, num_value_heads, key_head_dim), q.dtype, q.device)
    yv = alloc((batch, tokens, num_value_heads, value_head_dim), q.dtype, q.device)
    if batch * tokens == 0:
        return yq, yk, yv
    grid, blocks_qk = _grid(batch, tokens, channels_qk, channels_v, launch.block_t, launch.block_c)
    _conv_heads_fwd_kernel[grid](
        q, k, v, w, positions, yq, yk, yv, yq, tokens, channels_qk, channels_v, key_head_dim, value_head_dim, repeat,
        dilation, blocks_qk, IS_DPRE=False, W=w.shape[1], BLOCK_T=launch.block_t, BLOCK_C=launch.block_c,
        num_warps=launch.num_warps,
    )  # fmt: skip
    return yq, yk, yv


def causal_conv_heads_bwd(
    dyq: torch.Tensor, dyk: torch.Tensor, dyv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    w: torch.Tensor, positions: torch.Tensor, dilation: int, key_head_dim: int, value_head_dim: int, needs_dw: bool,
    launch: ConvLaunch = DEFAULT_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """dy* as causal_conv_heads_fwd's outputs, contiguous; q, k, v its inputs. Returns dq, dk, dv (the inputs'
    shapes and dtype) and dw [2 Hk K + Hv V, W] fp32 (or None)."""
    batch, tokens, channels_qk = q.shape
    channels_v = v.shape[2]
    total, width = 2 * channels_qk + channels_v, w.shape[1]
    repeat = (channels_v // value_head_dim) // (channels_qk // key_head_dim)
    alloc = kernels.alloc
    dq, dk, dv = (alloc(t.shape, t.dtype, t.device) for t in (q, k, v))
    if batch * tokens == 0:
        return dq, dk, dv, torch.zeros(total, width, dtype=torch.float32, device=q.device) if needs_dw else None
    block_t, block_c, warps = launch.grad_block_t, launch.grad_block_c, launch.grad_num_warps
    grid, blocks_qk = _grid(batch, tokens, channels_qk, channels_v, block_t, block_c)
    num_t_tiles = grid[0]
    dw_partial = alloc((batch * num_t_tiles, total, width), torch.float32, q.device) if needs_dw else None
    if launch.one_pass_backward:
        _conv_heads_bwd_one_pass_kernel[grid](
            q, k, v, w, positions, dyq, dyk, dyv, dq, dk, dv, dw_partial if dw_partial is not None else dq, tokens,
            channels_qk, channels_v, key_head_dim, value_head_dim, repeat, dilation, blocks_qk, num_t_tiles, W=width,
            HAS_DW=needs_dw, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
    else:
        dpre = alloc((batch, tokens, total), torch.float32, q.device)
        _conv_heads_fwd_kernel[grid](
            q, k, v, w, positions, dyq, dyk, dyv, dpre, tokens, channels_qk, channels_v, key_head_dim,
            value_head_dim, repeat, dilation, blocks_qk, IS_DPRE=True, W=width, BLOCK_T=block_t, BLOCK_C=block_c,
            num_warps=warps,
        )  # fmt: skip
        _conv_heads_bwd_kernel[grid](
            q, k, v, w, positions, dpre, dq, dk, dv, dw_partial if dw_partial is not None else dpre, tokens,
            channels_qk, channels_v, dilation, blocks_qk, num_t_tiles, W=width, HAS_DW=needs_dw, BLOCK_T=block_t,
            BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
    return dq, dk, dv, dw_partial.sum(0) if dw_partial is not None else None
