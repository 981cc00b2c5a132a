"""Depthwise causal convolution over a packed row of documents, then SiLU (the short conv of linear attention
layers): one Triton pass forward, two backward, instead of about four eager passes per tap.

Shapes: x [B, T, C]; weight [C, W]; positions [T]. The math is in README.md; the ground truth in reference.py.

Dispatch: the kernel on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either). The kernels are
checked against the reference in the Triton interpreter (tests/ops/test_causal_conv.py) and in bf16 on the H200
(tests/gpu/test_causal_conv_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.causal_conv.reference import causal_conv_ref
from moe_tune.ops.common.dispatch import use_kernel

__all__ = ["causal_conv"]

# Taps the kernels unroll (the models use 4; n-gram tables a few more); wider convolutions run the reference.
MAX_WIDTH = 8
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """silu of the depthwise causal convolution of x, tap by tap within each document.

    x:         [B, T, C] bf16/fp16/fp32 (fp64: the reference)
    weight:    [C, W] any float dtype; weight[:, W-1] multiplies the current token, weight[:, W-1-j] the token j *
               dilation back
    positions: [T] int32/int64, each token's position inside its document (0 at a document start): a tap whose
               token lies in an earlier document is dropped
    dilation:  tokens between taps (default 1)
    Returns y: x's shape and dtype. The kernels compute in fp32 and round once; the reference in x's dtype.
    Differentiable w.r.t. x and weight.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, weight, positions, dilation)
    has_kernel = x.dtype in _KERNEL_DTYPES and weight.shape[1] <= MAX_WIDTH
    if use_kernel("causal_conv", x, weight, positions, has_kernel=has_kernel):
        from moe_tune.ops.causal_conv.autograd import CausalConvFunction

        return CausalConvFunction.apply(x, weight, positions, int(dilation))
    return causal_conv_ref(x, weight, positions, dilation)


def _check_inputs(x, weight, positions, dilation) -> None:
    if x.ndim != 3:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [B, T, C]")
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype} must be floating point")
    if weight.ndim != 2 or weight.shape[0] != x.shape[2] or weight.shape[1] < 1:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [C, W] with C = {x.shape[2]} and W >= 1")
    if not weight.is_floating_point():
        raise ValueError(f"weight: dtype {weight.dtype} must be floating point")
    if positions.shape != (x.shape[1],):
        raise ValueError(f"positions: shape {tuple(positions.shape)} must be [T] ({x.shape[1]},)")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: dtype {positions.dtype} must be int32 or int64")
    if dilation < 1:
        raise ValueError(f"dilation ({dilation}) must be >= 1")
    for name, t in (("weight", weight), ("positions", positions)):
        if t.device != x.device:
            raise ValueError(f"{name}: device {t.device} must match x ({x.device})")
