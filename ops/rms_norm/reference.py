"""RMSNorm in pure PyTorch: the ground truth of the kernels, and what runs on the CPU.

Shapes: x [..., N]; weight [N]; gate (optional) x's shape. The math is in README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_ACTIVATIONS = ("silu", "sigmoid")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    is_one_plus: bool = False,
    gate: torch.Tensor | None = None,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """x / rms(x) * w (or * (1 + w)), optionally * act(gate); computed in fp32, returned in x's dtype.

    With a gate the normalised value is rounded to x's dtype before the gate multiplies it, as the model's gated
    norm always did (the kernel keeps it in fp32: the two differ by one rounding of a 16-bit value)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    scale = 1.0 + weight.float() if is_one_plus else weight.float()
    y = (normed * scale).to(x.dtype)
    if gate is None:
        return y
    act = F.silu if gate_activation == "silu" else torch.sigmoid
    return (y.float() * act(gate.float())).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, is_one_plus: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm_ref(h)) with h = x + residual in x's dtype."""
    h = x + residual
    return h, rms_norm_ref(h, weight, eps, is_one_plus)
