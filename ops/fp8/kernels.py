"""Triton kernel of the FP8 linear: the frozen FP8 weight dequantized into a buffer of the activations' dtype, which
torch's matmul (cuBLAS on CUDA) then multiplies with fp32 accumulation.

Shapes: weight W_q float8_e4m3fn [O, I] (contiguous), scale_inv fp32 [ceil(O/128), ceil(I/128)]: 128 x 128 blocks;
the output W [O, I] in bf16/fp16/fp32, W[o, i] = W_q[o, i] * scale_inv[o // 128, i // 128] rounded once to its
dtype, bit for bit reference.dequantize_weight(W_q, scale_inv).to(dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.dispatch import triton_interpreting
from moe_tune.ops.fp8.reference import BLOCK

# bf16 keeps the top 16 of fp32's 32 bits: round to nearest even by adding half a step less one plus the kept last
# bit, then clearing the dropped bits.
BF16_DROPPED_BITS = tl.constexpr(16)
BF16_HALF_STEP_BITS = tl.constexpr((1 << 15) - 1)
BF16_KEPT_BITS = tl.constexpr(-(1 << 16))


@dataclass(frozen=True)
class DequantizeConfig:
    """One launch of _dequantize_weight_kernel: a [block_o, block_i] tile of W; both divide 128, so a tile lies in
    one scale block."""

    block_o: int
    block_i: int
    num_warps: int


# 32 x 128 tiles at 4 warps: each thread converts 32 elements, 16-byte FP8 loads; the kernel only moves bytes (1 read,
# 2 or 4 written per element).
GPU_DEQUANTIZE = DequantizeConfig(block_o=32, block_i=128, num_warps=4)
# The interpreter runs each program in Python: few programs keep CPU tests fast; 64 rows put two row tiles in each
# scale block, so CPU tests see the tile-to-scale-row indexing.
INTERPRETER_DEQUANTIZE = DequantizeConfig(block_o=64, block_i=128, num_warps=1)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _round_to_bf16(v):
    """v (fp32) rounded to nearest even on the bf16 grid, still in fp32: the conversion to bf16 is then exact (the
    Triton interpreter's own conversion truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> BF16_DROPPED_BITS) & 1
    return ((bits + BF16_HALF_STEP_BITS + lsb) & BF16_KEPT_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_weight_kernel(
    w_ptr, scale_ptr, out_ptr,
    O, I, stride_scale_r, stride_scale_c,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, SCALE_BLOCK: tl.constexpr, ROUND_TO_BF16_IN_FP32: tl.constexpr,
):  # fmt: skip
    pid_o = tl.program_id(0)
    pid_i = tl.program_id(1)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    cols = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < O)[:, None] & (cols < I)[None, :]
    offsets = rows[:, None].to(tl.int64) * I + cols[None, :]
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # The tile lies in one 128 x 128 block (BLOCK_O and BLOCK_I divide it): one scale.
    scale = tl.load(scale_ptr + (pid_o * BLOCK_O // SCALE_BLOCK) * stride_scale_r
                    + (pid_i * BLOCK_I // SCALE_BLOCK) * stride_scale_c)  # fmt: skip
    value = w * scale
    if ROUND_TO_BF16_IN_FP32:
        value = _round_to_bf16(value)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, config: DequantizeConfig | None = None
) -> torch.Tensor:
    """W [O, I] in `dtype` (bf16/fp16/fp32) = weight float8_e4m3fn [O, I] (contiguous) * scale_inv fp32
    [ceil(O/128), ceil(I/128)] per 128 x 128 block, rounded once to `dtype`. A new buffer of O * I elements: the
    caller holds one layer's weight at a time. config: the launch (default: the GPU's or the interpreter's)."""
    out_features, in_features = weight.shape
    assert weight.is_contiguous(), "dequantize_weight_fp8 needs a contiguous weight"
    out = _alloc((out_features, in_features), dtype, weight.device)
    config = config or (GPU_DEQUANTIZE if weight.is_cuda else INTERPRETER_DEQUANTIZE)
    assert BLOCK % config.block_o == 0 and BLOCK % config.block_i == 0, f"{config} tiles must divide {BLOCK}"
    is_interpreting = triton_interpreting()
    grid = (triton.cdiv(out_features, config.block_o), triton.cdiv(in_features, config.block_i))
    _dequantize_weight_kernel[grid](
        weight, scale_inv, out, out_features, in_features, scale_inv.stride(0), scale_inv.stride(1),
        BLOCK_O=config.block_o, BLOCK_I=config.block_i, SCALE_BLOCK=BLOCK,
        ROUND_TO_BF16_IN_FP32=is_interpreting and dtype == torch.bfloat16, num_warps=config.num_warps,
    )  # fmt: skip
    return out
