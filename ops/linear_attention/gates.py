"""The gated delta net's gates in one Triton pass each way: g = -exp(A_log) * softplus(a + dt_bias) and
beta = sigmoid(b), where eager torch runs eight to ten small kernels forward and five (frozen parameters) to twelve
backward, each with its autograd node.

Dispatch: the kernels on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either; ops/common/dispatch).
The math is in README.md ("Gates of the per-head rule"); the kernels and their autograd Function in
kernels_gates.py (imported when first used); tests/ops/test_gdn_gates.py checks them against the reference in the
Triton interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_tune.ops.common.dispatch import use_kernel

__all__ = ["gdn_gates", "gdn_gates_ref"]

# torch's F.softplus default: softplus(x) = x above it (log1p(exp(x)) differs from x by under exp(-20) = 2e-9 there).
SOFTPLUS_THRESHOLD = 20.0
# Widest head count one tile takes (models have up to 128 value heads); wider runs the reference.
MAX_HEADS = 1024
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head gated delta rule's log decay and write strength, computed in fp32.

    a:       [..., H] bf16/fp16/fp32, raw decay input (the layer's a_proj output)
    b:       a's shape, bf16/fp16/fp32, raw write strength (b_proj output)
    A_log:   [H] any float dtype, log decay rate per head
    dt_bias: [H] any float dtype, added to a
    Returns g = -exp(A_log) * softplus(a + dt_bias) (softplus as torch's F.softplus: linear above 20) and
    beta = sigmoid(b), both fp32 with a's shape. Differentiable w.r.t. all four inputs; da and db come in a's and
    b's dtypes, dA_log and ddt_bias (summed over rows in a fixed order) in theirs, and are skipped when those
    parameters do not require grad (frozen under LoRA).
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(a, b, A_log, dt_bias)
    has_kernel = all(t.dtype in _KERNEL_DTYPES for t in (a, b, A_log, dt_bias)) and a.shape[-1] <= MAX_HEADS
    if use_kernel("gdn_gates", a, b, A_log, dt_bias, has_kernel=has_kernel):
        from moe_tune.ops.linear_attention.kernels_gates import GDNGatesFunction

        return GDNGatesFunction.apply(a, b, A_log, dt_bias)
    return gdn_gates_ref(a, b, A_log, dt_bias)


def gdn_gates_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ground truth: the gates as eager torch ops, in `compute_dtype` (tests pass fp64). Shapes and results as
    `gdn_gates`."""
    # beta first, as the layer runs b_proj first: the order of the autograd nodes sets the order in which x's gradient
    # adds up its parts.
    beta = torch.sigmoid(b.to(compute_dtype))
    x = a.to(compute_dtype) + dt_bias.to(compute_dtype)
    g = -A_log.to(compute_dtype).exp() * F.softplus(x)
    return g, beta


def _check_inputs(a, b, A_log, dt_bias) -> None:
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"a: shape {tuple(a.shape)} must be [..., H] with H >= 1")
    if b.shape != a.shape:
        raise ValueError(f"b: shape {tuple(b.shape)} must match a {tuple(a.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != a.shape[-1:]:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must be [H] {tuple(a.shape[-1:])}")
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: dtype {t.dtype} must be floating point")
        if t.device != a.device:
            raise ValueError(f"{name}: device {t.device} must match a ({a.device})")
