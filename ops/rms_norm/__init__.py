"""RMSNorm over the last dim, optionally gated: y = x / rms(x) * w [* act(z)], one Triton pass forward and one
backward instead of about eight eager kernels forward and sixteen backward; a residual add followed by the norm of
its result (add_rms_norm), in the same passes; and the norm handing its input on (rms_norm_with_input), so that its
backward adds the input's other gradient in the same pass.

Shapes: x [..., N]; weight [N]; gate x's shape. The math is in README.md; the ground truth in reference.py.

Dispatch: the kernel on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either). The kernels are
checked against the reference in the Triton interpreter (tests/ops/test_rms_norm.py) and in bf16 on the H200
(tests/gpu/test_rms_norm_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.rms_norm.reference import GATE_ACTIVATIONS, add_rms_norm_ref, rms_norm_ref

__all__ = ["add_rms_norm", "rms_norm", "rms_norm_with_input"]

# Widest row the kernel takes in one tile (the model's norms are 128 to 8192 wide); wider rows run the reference.
MAX_N = 16384
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    is_one_plus: bool = False,
    gate: torch.Tensor | None = None,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled per channel, optionally multiplied by act(gate).

    x:               [..., N] bf16/fp16/fp32 (fp64: the reference)
    weight:          [N] any float dtype; the scale is weight, or 1 + weight when is_one_plus (default False)
    eps:             added to mean(x^2) (default 1e-6)
    gate:            x's shape and dtype, or None (default); y = norm(x) * act(gate)
    gate_activation: "silu" (default; gated delta net) or "sigmoid" (KDA)
    Returns y: x's shape and dtype. Statistics and products in fp32. Differentiable w.r.t. x, weight and gate;
    the weight gradient is skipped when weight does not require one.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, weight, eps, gate, gate_activation)
    has_kernel = x.dtype in _KERNEL_DTYPES and x.shape[-1] <= MAX_N
    if use_kernel("rms_norm", x, weight, gate, has_kernel=has_kernel):
        from moe_tune.ops.rms_norm.autograd import RMSNormFunction

        return RMSNormFunction.apply(x, weight, gate, float(eps), is_one_plus, gate_activation == "silu")
    return rms_norm_ref(x, weight, eps, is_one_plus, gate, gate_activation)


def rms_norm_with_input(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, is_one_plus: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, rms_norm(x, weight, eps, is_one_plus)) with x handed on by the norm (the decoder layer's stream into its
    token mixer's norm): what the caller does with the x returned (the residual add) sends its gradient through the
    norm's backward, which adds it to the norm's own in one pass, summed in fp32 and rounded once, where the x passed
    in, used twice, would have autograd add the two gradients in a kernel of its own.

    x, weight, eps, is_one_plus: as rms_norm. Returns (x as a view, y of x's shape and dtype). The reference (CPU)
    returns x itself: autograd adds the two gradients there.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, weight, eps, None, "silu")
    has_kernel = x.dtype in _KERNEL_DTYPES and x.shape[-1] <= MAX_N
    if use_kernel("rms_norm", x, weight, has_kernel=has_kernel):
        from moe_tune.ops.rms_norm.autograd import RMSNormWithInputFunction

        return RMSNormWithInputFunction.apply(x, weight, float(eps), is_one_plus)
    return x, rms_norm_ref(x, weight, eps, is_one_plus)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    is_one_plus: bool = False,
    y_buffer: torch.Tensor | None = None,
    h_buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm of its result: h = x + residual (rounded to x's dtype, as the eager add) and
    y = rms_norm(h, weight, eps, is_one_plus), in one pass each way (the decoder layer's stream after its token
    mixer, and the post-attention norm of it).

    x, residual: [..., N] of one shape and dtype; weight, eps, is_one_plus: as rms_norm.
    y_buffer, h_buffer: contiguous tensors of x's shape and dtype (a CUDA-graphed MoE block's static inputs), or
              None (default): the kernel writes y and h there and returns views of them, which saves the copies
              into the buffers that reading y and h would cost; the reference returns new tensors. Use the tensors
              returned either way.
    Returns (h, y), both x's shape and dtype. Backward: x and residual get h's gradient plus the norm's, summed in
    fp32 and rounded once.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, weight, eps, None, "silu")
    if residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual: dtype {residual.dtype} must match x ({x.dtype})")
    if residual.device != x.device:
        raise ValueError(f"residual: device {residual.device} must match x ({x.device})")
    for name, buffer in (("y_buffer", y_buffer), ("h_buffer", h_buffer)):
        if buffer is not None and (buffer.shape != x.shape or buffer.dtype != x.dtype or buffer.device != x.device
                                   or not buffer.is_contiguous()):  # fmt: skip
            raise ValueError(f"{name}: shape {tuple(buffer.shape)} dtype {buffer.dtype} on {buffer.device} must be "
                             f"contiguous, of x's shape {tuple(x.shape)}, dtype and device")  # fmt: skip
    if y_buffer is not None and h_buffer is not None and y_buffer.data_ptr() == h_buffer.data_ptr():
        raise ValueError("y_buffer and h_buffer: must be two tensors, not one")
    has_kernel = x.dtype in _KERNEL_DTYPES and x.shape[-1] <= MAX_N
    if use_kernel("rms_norm", x, residual, weight, has_kernel=has_kernel):
        from moe_tune.ops.rms_norm.autograd import AddRMSNormFunction

        return AddRMSNormFunction.apply(x, residual, weight, float(eps), is_one_plus, y_buffer, h_buffer)
    return add_rms_norm_ref(x, residual, weight, eps, is_one_plus)


def _check_inputs(x, weight, eps, gate, gate_activation) -> None:
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [..., N] with N >= 1")
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype} must be floating point")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [N] {tuple(x.shape[-1:])}")
    if not weight.is_floating_point():
        raise ValueError(f"weight: dtype {weight.dtype} must be floating point")
    if eps < 0:
        raise ValueError(f"eps ({eps}) must be >= 0")
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate: shape {tuple(gate.shape)} must match x {tuple(x.shape)}")
        if gate.dtype != x.dtype:
            raise ValueError(f"gate: dtype {gate.dtype} must match x ({x.dtype})")
    if gate_activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gate_activation ({gate_activation!r}) must be one of {', '.join(GATE_ACTIVATIONS)}")
    for name, t in (("weight", weight), ("gate", gate)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: device {t.device} must match x ({x.device})")
