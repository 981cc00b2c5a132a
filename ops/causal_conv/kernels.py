"""Triton kernels of the depthwise causal convolution + SiLU over packed documents.

Shapes: x, y, dy, dx [B, T, C] contiguous; w [C, W]; positions [T] int; dpre [B, T, C] fp32; dw_partial
[B * T-tiles, C, W] fp32. The math is in README.md.

The backward runs in two passes (dpre through memory in fp32) or, with `ConvLaunch.one_pass_backward`, in one:
each program recomputes dpre at the rows each tap reaches (W pre's of W taps, from L1/L2) instead of reading a
dpre pass wrote, which moves x once and no fp32 tensor (README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.launch import with_overrides

# Tokens x channels of one program's tile: 256-byte bf16 row segments (128 channels) in the forward, and in the
# backward 64 tokens, which reuse each loaded row for the W taps of the next rows. These are the launch sweep's
# fastest at the hybrid's shape on the H200 (engine/bench/causal_conv_sweep.py, docs/perf-history.md).
BLOCK_T = 32
BLOCK_C = 128
GRAD_BLOCK_T = 64
GRAD_BLOCK_C = 64


@dataclass(frozen=True)
class ConvLaunch:
    """How the conv kernels launch: the forward's tile (tokens x channels) and warps, the backward's, and whether
    the backward is one pass (dpre recomputed per tap) or two (dpre written in fp32, then read)."""

    block_t: int = BLOCK_T
    block_c: int = BLOCK_C
    num_warps: int = 4
    grad_block_t: int = GRAD_BLOCK_T
    grad_block_c: int = GRAD_BLOCK_C
    grad_num_warps: int = 4
    one_pass_backward: bool = False


DEFAULT_LAUNCH = ConvLaunch()


def pick_launch(x: torch.Tensor) -> ConvLaunch:
    """The launch the autograd functions use: DEFAULT_LAUNCH with the fields MOE_TUNE_LAUNCH names for
    `causal_conv` replaced (ops/common/launch.py; the sweep, engine/bench/causal_conv_sweep.py, swaps the function)."""
    return with_overrides("causal_conv", DEFAULT_LAUNCH)


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def conv_pre(
    x_ptr, w_ptr, pos, rows, cols, row_mask, col_mask, base, T, C, dilation,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """pre for a [BLOCK_T, BLOCK_C] tile, fp32."""
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = tap * dilation
        src = rows - shift
        keep = row_mask & (src >= 0) & (pos >= shift)
        mask = keep[:, None] & col_mask[None, :]
        offsets = base + src[:, None].to(tl.int64) * C + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * W + (W - 1 - tap), mask=col_mask, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    return acc


@triton.jit
def _causal_conv_fwd_kernel(
    x_ptr, w_ptr, pos_ptr, dy_ptr, out_ptr, T, C, dilation,
    IS_DPRE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """pre for one tile, then y = silu(pre) (forward), or dpre = dy * silu'(pre) in fp32 (IS_DPRE: the backward's
    first pass, which recomputes pre instead of saving it)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = tl.program_id(2).to(tl.int64) * T * C
    row_mask = rows < T
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    pre = conv_pre(x_ptr, w_ptr, pos, rows, cols, row_mask, col_mask, base, T, C, dilation, W, BLOCK_T, BLOCK_C)
    offsets = base + rows[:, None].to(tl.int64) * C + cols[None, :]
    sig = tl.sigmoid(pre)
    if IS_DPRE:
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, dy * sig * (1.0 + pre * (1.0 - sig)), mask=mask)
    else:
        tl.store(out_ptr + offsets, (pre * sig).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def conv_dx_dw(
    x_ptr, x_base, x_row, w_ptr, pos_ptr, pos, dpre_ptr, dpre_base, dpre_row, dw_partial_ptr, partial_row, rows, cols,
    row_mask, col_mask, T, dilation, W: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx of a [BLOCK_T, BLOCK_C] tile, fp32, from dpre; with HAS_DW also its share of dw, stored at partial_row +
    cols * W + W-1-tap. x's rows lie x_row elements apart from x_base, dpre's dpre_row apart from dpre_base (both the
    tile's channel 0 of token 0); w_ptr points at the tile's channel 0's weights ([C, W] rows)."""
    dpre_here = tl.load(
        dpre_ptr + dpre_base + rows[:, None].to(tl.int64) * dpre_row + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :], other=0.0,
    )  # fmt: skip
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = tap * dilation
        w = tl.load(w_ptr + cols * W + (W - 1 - tap), mask=col_mask, other=0.0).to(tl.float32)
        # dx: the rows this row feeds through tap j, shift tokens ahead in the same document.
        dst = rows + shift
        dst_pos = tl.load(pos_ptr + dst, mask=row_mask & (dst < T), other=0)
        feeds = row_mask & (dst < T) & (dst_pos >= shift)
        dpre = tl.load(
            dpre_ptr + dpre_base + dst[:, None].to(tl.int64) * dpre_row + cols[None, :],
            mask=feeds[:, None] & col_mask[None, :], other=0.0,
        )  # fmt: skip
        dx += dpre * w[None, :]
        if HAS_DW:
            # dw: this tile's rows against the tokens shift back.
            src = rows - shift
            reads = row_mask & (src >= 0) & (pos >= shift)
            x = tl.load(
                x_ptr + x_base + src[:, None].to(tl.int64) * x_row + cols[None, :],
                mask=reads[:, None] & col_mask[None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
            dw = tl.sum(dpre_here * x, axis=0)
            tl.store(dw_partial_ptr + partial_row + cols * W + (W - 1 - tap), dw, mask=col_mask)
    return dx


@triton.jit
def conv_dx_dw_one_pass(
    x_ptr, x_base, x_row, w_ptr, pos_ptr, pos, dy_ptr, dy_base, dy_row, dy_cols, head_dim, repeat, dw_partial_ptr,
    partial_row, rows, cols, row_mask, col_mask, T, dilation, W: tl.constexpr, HAS_DW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """conv_dx_dw without dpre in memory: for each tap, dpre at the rows it feeds (shift tokens ahead) from pre
    recomputed there and dy. dy's rows lie dy_row elements apart from dy_base; channel c's dy is the sum of the
    `repeat` entries dy_cols[c] + r * head_dim (causal_conv: dy_cols = cols, repeat 1)."""
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = tap * dilation
        dst = rows + shift
        in_row = row_mask & (dst < T)
        dst_pos = tl.load(pos_ptr + dst, mask=in_row, other=0)
        # The rows this row feeds through tap `tap`: in the same document.
        feeds = in_row & (dst_pos >= shift)
        mask = feeds[:, None] & col_mask[None, :]
        pre = conv_pre(
            x_ptr, w_ptr, dst_pos, dst, cols, feeds, col_mask, x_base, T, x_row, dilation, W, BLOCK_T, BLOCK_C
        )  # fmt: skip
        dy_offsets = dy_base + dst[:, None].to(tl.int64) * dy_row + dy_cols[None, :]
        dy = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for r in range(repeat):
            dy += tl.load(dy_ptr + dy_offsets + r * head_dim, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        dpre = dy * sig * (1.0 + pre * (1.0 - sig))
        w = tl.load(w_ptr + cols * W + (W - 1 - tap), mask=col_mask, other=0.0).to(tl.float32)
        dx += dpre * w[None, :]
        if HAS_DW:
            if tap == 0:
                # dpre of the tile's own rows: its share of dw, against the tokens each tap reads.
                for back in tl.static_range(W):
                    src = rows - back * dilation
                    reads = row_mask & (src >= 0) & (pos >= back * dilation)
                    x = tl.load(
                        x_ptr + x_base + src[:, None].to(tl.int64) * x_row + cols[None, :],
                        mask=reads[:, None] & col_mask[None, :], other=0.0,
                    ).to(tl.float32)  # fmt: skip
                    dw = tl.sum(dpre * x, axis=0)
                    tl.store(dw_partial_ptr + partial_row + cols * W + (W - 1 - back), dw, mask=col_mask)
    return dx


@triton.jit
def _causal_conv_bwd_kernel(
    x_ptr, w_ptr, pos_ptr, dpre_ptr, dx_ptr, dw_partial_ptr, T, C, dilation, num_t_tiles,
    W: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr = False,
):  # fmt: skip
    """dx of one tile and its share of dw: from the first pass's dpre, or (ONE_PASS) from dy itself, which dpre_ptr
    then points at."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    batch = tl.program_id(2)
    base = batch.to(tl.int64) * T * C
    row_mask = rows < T
    col_mask = cols < C
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    partial_row = (batch * num_t_tiles + tile).to(tl.int64) * C * W
    if ONE_PASS:
        dx = conv_dx_dw_one_pass(
            x_ptr, base, C, w_ptr, pos_ptr, pos, dpre_ptr, base, C, cols, 0, 1, dw_partial_ptr, partial_row, rows,
            cols, row_mask, col_mask, T, dilation, W, HAS_DW, BLOCK_T, BLOCK_C,
        )  # fmt: skip
    else:
        dx = conv_dx_dw(
            x_ptr, base, C, w_ptr, pos_ptr, pos, dpre_ptr, base, C, dw_partial_ptr, partial_row, rows, cols, row_mask,
            col_mask, T, dilation, W, HAS_DW, BLOCK_T, BLOCK_C,
        )  # fmt: skip
    offsets = base + rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _grid(batch: int, tokens: int, channels: int, block_t: int, block_c: int) -> tuple[int, int, int]:
    return triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c), batch


def causal_conv_fwd(
    x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, dilation: int, launch: ConvLaunch = DEFAULT_LAUNCH
) -> torch.Tensor:
    """x: [B, T, C] contiguous; w: [C, W] contiguous; positions: [T]. Returns y [B, T, C] in x's dtype."""
    batch, tokens, channels = x.shape
    y = alloc((batch, tokens, channels), x.dtype, x.device)
    if x.numel() == 0:
        return y
    _causal_conv_fwd_kernel[_grid(batch, tokens, channels, launch.block_t, launch.block_c)](
        x, w, positions, x, y, tokens, channels, dilation, IS_DPRE=False, W=w.shape[1], BLOCK_T=launch.block_t,
        BLOCK_C=launch.block_c, num_warps=launch.num_warps,
    )  # fmt: skip
    return y


def causal_conv_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, dilation: int, needs_dw: bool,
    launch: ConvLaunch = DEFAULT_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """dy, x: [B, T, C] contiguous. Returns dx [B, T, C] (x's dtype) and dw [C, W] fp32 (or None)."""
    batch, tokens, channels = x.shape
    width = w.shape[1]
    dx = alloc((batch, tokens, channels), x.dtype, x.device)
    if x.numel() == 0:
        return dx, torch.zeros(channels, width, dtype=torch.float32, device=x.device) if needs_dw else None
    block_t, block_c, warps = launch.grad_block_t, launch.grad_block_c, launch.grad_num_warps
    grid = _grid(batch, tokens, channels, block_t, block_c)
    num_t_tiles = grid[0]
    dw_partial = alloc((batch * num_t_tiles, channels, width), torch.float32, x.device) if needs_dw else None
    if launch.one_pass_backward:
        _causal_conv_bwd_kernel[grid](
            x, w, positions, dy, dx, dw_partial if dw_partial is not None else dx, tokens, channels, dilation,
            num_t_tiles, W=width, HAS_DW=needs_dw, BLOCK_T=block_t, BLOCK_C=block_c, ONE_PASS=True, num_warps=warps,
        )  # fmt: skip
    else:
        dpre = alloc((batch, tokens, channels), torch.float32, x.device)
        _causal_conv_fwd_kernel[grid](
            x, w, positions, dy, dpre, tokens, channels, dilation, IS_DPRE=True, W=width, BLOCK_T=block_t,
            BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
        _causal_conv_bwd_kernel[grid](
            x, w, positions, dpre, dx, dw_partial if dw_partial is not None else dpre, tokens, channels, dilation,
            num_t_tiles, W=width, HAS_DW=needs_dw, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
    return dx, dw_partial.sum(0) if dw_partial is not None else None
