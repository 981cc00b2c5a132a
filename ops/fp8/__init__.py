"""FP8 e4m3 frozen weights in 128 x 128 blocks (the hub's FP8 checkpoint layout), and the dense linear through such
a weight: y = x @ deq(W)^T + bias with the dequantized weight and the activations as they are.

Shapes: x [..., I]; weight [O, I] float8_e4m3fn; scale_inv [ceil(O/128), ceil(I/128)] fp32; bias [O]. reference.py
holds the layouts, the rounding rule and the linear's ground truth; the math is in README.md.

Dispatch: the kernel path (a Triton kernel dequantizes the weight into x's dtype, torch's matmul multiplies) on CUDA
tensors of a GPU with FP8 support (compute capability 8.9 or newer), the reference elsewhere (MOE_TUNE_KERNELS
forces either). The kernel is checked against the reference in the Triton interpreter (tests/ops/test_fp8.py) and
on the H200 (tests/gpu/test_fp8_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.fp8.reference import (
    BLOCK,
    E4M3_MAX,
    FP8_DTYPE,
    dequantize_weight,
    fp8_linear_ref,
    num_blocks,
    quantize_weight,
)

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize_weight",
    "fp8_linear",
    "fp8_linear_ref",
    "num_blocks",
    "quantize_weight",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_KERNEL_DTYPES, torch.float64)
# Triton converts FP8 e4m3 (float8e4nv) from Ada (sm_89) and Hopper (sm_90) on.
MIN_CUDA_CAPABILITY = (8, 9)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ deq(W)^T + bias through a frozen FP8 weight, computed with the dequantized weight; x is not quantized.

    x:         [..., I] bf16/fp16/fp32 (fp64: the reference)
    weight:    [O, I] float8_e4m3fn, requires_grad False
    scale_inv: [ceil(O/128), ceil(I/128)] fp32; deq(W)[o, i] = weight[o, i] * scale_inv[o // 128, i // 128]
    bias:      [O] float, or None (default)
    Returns y: [..., O] in x's dtype, accumulated in fp32. Differentiable w.r.t. x (dx = dy @ deq(W), dy not
    quantized) and bias; never w.r.t. weight. The kernel path dequantizes W into x's dtype (rounded once) for the
    forward GEMM and again for the input gradient's: one transient [O, I] buffer, this layer's weight, at a time;
    only the FP8 weight and its scales are saved for backward.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, weight, scale_inv, bias)
    has_kernel = x.dtype in _KERNEL_DTYPES and (not x.is_cuda or torch.cuda.get_device_capability(x.device)
                                                >= MIN_CUDA_CAPABILITY)  # fmt: skip
    if use_kernel("fp8_linear", x, weight, scale_inv, bias, has_kernel=has_kernel):
        from moe_tune.ops.fp8.autograd import Fp8LinearFunction

        return Fp8LinearFunction.apply(x, weight, scale_inv, bias)
    return fp8_linear_ref(x, weight, scale_inv, bias)


def _check_inputs(x, weight, scale_inv, bias) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"weight: shape {tuple(weight.shape)} dtype {weight.dtype} must be a float8_e4m3fn [O, I] "
                         f"with O, I >= 1")  # fmt: skip
    if weight.requires_grad:
        raise ValueError("weight: requires_grad must be False (an FP8 weight is frozen: no gradient flows to it)")
    out_features, in_features = weight.shape
    expected = (num_blocks(out_features), num_blocks(in_features))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv: shape {tuple(scale_inv.shape)} dtype {scale_inv.dtype} must be float32 "
                         f"{list(expected)} (ceil(O/128), ceil(I/128)) for weight {tuple(weight.shape)}")  # fmt: skip
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [..., I] with I = {in_features} (weight's in_features)")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} must be bf16, fp16, fp32 or fp64")
    if bias is not None:
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias: shape {tuple(bias.shape)} must be [O] ({out_features},)")
        if bias.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"bias: dtype {bias.dtype} must be bf16, fp16, fp32 or fp64")
    for name, t in (("weight", weight), ("scale_inv", scale_inv), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: device {t.device} must match x ({x.device})")
