"""Rotary position embedding (rotate-half layout) on the first R dims of every head: one Triton pass forward and one
backward instead of about eight eager kernels each way (an fp32 copy, two slices, a negation, a concatenation, two
products and a sum, the cast and the concatenation with the unrotated dims).

Shapes: x [B, T, H, D]; cos, sin [T, R] with R even, R <= D. The math is in README.md; the ground truth in
reference.py.

Dispatch: the kernel on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either). The kernel is
checked against the reference in the Triton interpreter (tests/ops/test_rotary.py) and in bf16 on the H200
(tests/gpu/test_rotary_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.rotary.reference import rotary_ref

__all__ = ["apply_rotary"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x with its first R dims rotated per token: y = x_r * cos + rotate_half(x_r) * sin, rotate_half(x_r) =
    [-x_r[R/2:], x_r[:R/2]]; dims R..D unchanged.

    x:        [B, T, H, D] bf16/fp16/fp32 (fp64: the reference)
    cos, sin: [T, R] (or any shape that reshapes to it, e.g. [1, T, 1, R]), R even and <= D; the two halves of a row
              may differ (scaled or multimodal tables are fine). Constants: no gradient flows to them.
    Returns y: x's shape and dtype, the products in fp32. Differentiable w.r.t. x.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    cos, sin = _check_inputs(x, cos, sin)
    has_kernel = x.dtype in _KERNEL_DTYPES and not (cos.requires_grad or sin.requires_grad)
    if use_kernel("rotary", x, cos, sin, has_kernel=has_kernel):
        from moe_tune.ops.rotary.autograd import RotaryFunction

        return RotaryFunction.apply(x, cos, sin)
    return rotary_ref(x, cos, sin)


def _check_inputs(x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [T, R] views; ValueError when the shapes do not fit."""
    if x.ndim != 4:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [B, T, H, D]")
    num_tokens, dim = x.shape[1], x.shape[3]
    if cos.shape != sin.shape:
        raise ValueError(f"sin: shape {tuple(sin.shape)} must match cos {tuple(cos.shape)}")
    if cos.ndim < 1 or cos.numel() != num_tokens * cos.shape[-1]:
        raise ValueError(f"cos: shape {tuple(cos.shape)} must hold [T, R] with T = {num_tokens} (x's dim 1)")
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= dim:
        raise ValueError(f"cos: rotary dim R ({rotary_dim}) must be even, positive and <= x's head dim ({dim})")
    for name, t in (("cos", cos), ("sin", sin)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: dtype {t.dtype} must be floating point")
        if t.device != x.device:
            raise ValueError(f"{name}: device {t.device} must match x ({x.device})")
    return cos.reshape(num_tokens, rotary_dim), sin.reshape(num_tokens, rotary_dim)
