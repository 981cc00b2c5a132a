"""SwiGLU's activation h = silu(gate) * up, optionally times a per-row scale (a gated shared expert's
sigmoid gate), in one Triton pass forward and one backward instead of three eager kernels forward and about nine
backward.

Shapes: gate, up [..., F]; scale [..., 1]. The math is in README.md; the ground truth in reference.py.

Dispatch: the kernel on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either). The kernels' tests:
against the reference in the Triton interpreter (tests/ops/test_swiglu.py), compiled for sm_90 without a GPU
(tests/ops/test_kernels_compile_sm90.py), and on a GPU (tests/gpu/test_swiglu_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.swiglu.reference import swiglu_ref

__all__ = ["swiglu"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def swiglu(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, times scale when given.

    gate:  [..., F] bf16/fp16/fp32 (fp64: the reference), the gate projection's output
    up:    gate's shape and dtype, the up projection's output
    scale: [..., 1] (gate's leading dims) any float dtype, or None (default)
    Returns h: gate's shape and dtype, computed in fp32 and rounded once. Differentiable w.r.t. all three; scale's
    gradient (the row sums of dh * silu(gate) * up) comes in scale's dtype.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(gate, up, scale)
    has_kernel = gate.dtype in _KERNEL_DTYPES and (scale is None or scale.dtype in _KERNEL_DTYPES)
    if use_kernel("swiglu", gate, up, scale, has_kernel=has_kernel):
        from moe_tune.ops.swiglu.autograd import SwiGLUFunction

        return SwiGLUFunction.apply(gate, up, scale)
    return swiglu_ref(gate, up, scale)


def _check_inputs(gate, up, scale) -> None:
    if gate.ndim < 1:
        raise ValueError(f"gate: shape {tuple(gate.shape)} must be [..., F]")
    if not gate.is_floating_point():
        raise ValueError(f"gate: dtype {gate.dtype} must be floating point")
    if up.shape != gate.shape:
        raise ValueError(f"up: shape {tuple(up.shape)} must match gate {tuple(gate.shape)}")
    if up.dtype != gate.dtype:
        raise ValueError(f"up: dtype {up.dtype} must match gate ({gate.dtype})")
    if scale is not None:
        if scale.shape != (*gate.shape[:-1], 1):
            raise ValueError(f"scale: shape {tuple(scale.shape)} must be [..., 1] {(*gate.shape[:-1], 1)}")
        if not scale.is_floating_point():
            raise ValueError(f"scale: dtype {scale.dtype} must be floating point")
    for name, t in (("up", up), ("scale", scale)):
        if t is not None and t.device != gate.device:
            raise ValueError(f"{name}: device {t.device} must match gate ({gate.device})")
