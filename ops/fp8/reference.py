"""FP8 e4m3 block quantization in pure PyTorch: the layouts and the rounding every FP8 kernel must reproduce.

Weights (the hub's FP8 checkpoints, `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`):
a weight W [..., O, I] is stored as W_q float8_e4m3fn [..., O, I] and scale_inv fp32 [..., R, C] with
W[o, i] = W_q[o, i] * scale_inv[o // 128, i // 128]. With `row_segments` (a fused weight made of several hub
tensors stacked along O, as w_gate_up = [gate_proj; up_proj]) the row blocks restart at every segment: segment s's
rows get their own ceil(rows_s / 128) scale rows, in order.

The linear through an FP8 weight (fp8_linear_ref) computes with the dequantized weight and the activations as they
are: y = x @ deq(W)^T, dx = dy @ deq(W), in fp32.

The rounding rule: scale = max(amax, AMAX_FLOOR) / 448 over the block,
q = round_to_nearest_even(clamp(x / scale, -448, 448)) in float8_e4m3fn; both divisions correctly rounded fp32
quotients on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
# The hub's FP8 checkpoints' block edge (weight_block_size [128, 128]).
BLOCK = 128
# An all-zero block or group still gets a finite, nonzero scale (its values quantize to 0).
AMAX_FLOOR = 1e-12


def num_blocks(size: int, segments: Sequence[int] | None = None) -> int:
    """Scale entries along a dim of `size` elements: ceil(size / 128), or the sum over its segments."""
    if segments is None:
        return math.ceil(size / BLOCK)
    if sum(segments) != size or any(s <= 0 for s in segments):
        raise ValueError(f"segments {list(segments)} must be positive and sum to the dim's size {size}")
    return sum(math.ceil(s / BLOCK) for s in segments)


def block_index(size: int, segments: Sequence[int] | None = None) -> torch.Tensor:
    """[size] int64: the scale entry of each index along a dim (blocks of 128 restarting at every segment)."""
    # Raises on segments that do not fit the dim.
    num_blocks(size, segments)
    parts, first = [], 0
    for seg in segments if segments is not None else [size]:
        parts.append(first + torch.arange(seg) // BLOCK)
        first += math.ceil(seg / BLOCK)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor: divided by a Python float, CUDA tensors get amax * (1 / 448), one ulp off the CPU's quotient.
    return amax.float().clamp(min=AMAX_FLOOR) / amax.new_full((), E4M3_MAX, dtype=torch.float32)


def _to_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_weight(
    w: torch.Tensor, row_segments: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q float8_e4m3fn [..., O, I], scale_inv fp32 [..., R, ceil(I/128)]) of a float weight w [..., O, I] in
    128 x 128 blocks (rows restarting at every row segment). Dims need not be multiples of 128."""
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"w: shape {tuple(w.shape)} dtype {w.dtype} must be a float [..., O, I]")
    rows, cols = w.shape[-2:]
    row_of = block_index(rows, row_segments).to(w.device)
    col_of = block_index(cols).to(w.device)
    num_r, num_c = num_blocks(rows, row_segments), num_blocks(cols)
    lead = w.shape[:-2]
    amax = torch.zeros(*lead, num_r, num_c, dtype=torch.float32, device=w.device)
    absw = w.detach().abs().float()
    # amax over each block: max over the block's columns, then over its rows (scatter_reduce handles segments).
    col_max = torch.zeros(*lead, rows, num_c, dtype=torch.float32, device=w.device)
    col_max.scatter_reduce_(-1, col_of.expand(*lead, rows, cols), absw, reduce="amax", include_self=True)
    amax.scatter_reduce_(-2, row_of[:, None].expand(*lead, rows, num_c), col_max, reduce="amax", include_self=True)
    scale_inv = _scales(amax)
    full_scale = scale_inv[..., row_of, :][..., col_of]
    return _to_fp8(w, full_scale), scale_inv


def dequantize_weight(
    w_q: torch.Tensor,
    scale_inv: torch.Tensor,
    row_segments: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [..., O, I] in `dtype` (fp32 default) from W_q float8_e4m3fn [..., O, I] and its block scales."""
    rows, cols = w_q.shape[-2:]
    expected = (*w_q.shape[:-2], num_blocks(rows, row_segments), num_blocks(cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv: shape {tuple(scale_inv.shape)} must be {list(expected)} for a weight of "
                         f"shape {tuple(w_q.shape)} in 128 x 128 blocks")
    row_of = block_index(rows, row_segments).to(w_q.device)
    col_of = block_index(cols).to(w_q.device)
    full_scale = scale_inv.float()[..., row_of, :][..., col_of]
    return (w_q.float() * full_scale).to(dtype)


class Fp8LinearRefFunction(torch.autograd.Function):
    """y = x @ deq(W)^T + bias; dx = dy @ deq(W); dbias = sum of dy; in fp32, no gradient to W."""

    @staticmethod
    def forward(ctx, x, weight, scale_inv, bias):
        y = x.float() @ dequantize_weight(weight, scale_inv).T
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(weight, scale_inv)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        weight, scale_inv = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (grad_y.float() @ dequantize_weight(weight, scale_inv)).to(grad_y.dtype)
        dbias = None
        if ctx.needs_input_grad[3]:
            dbias = grad_y.float().reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.bias_dtype)
        return dx, None, None, dbias


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The FP8 linear in fp32: x [..., I] times the dequantized weight [O, I] (float8_e4m3fn with scale_inv
    [ceil(O/128), ceil(I/128)]), plus bias [O]; returns [..., O] in x's dtype. Backward: dx = dy @ deq(W) in dy's
    dtype, dbias = dy summed over rows; no weight gradient. Neither x nor dy is quantized."""
    return Fp8LinearRefFunction.apply(x, weight, scale_inv, bias)
