"""SwiGLU's activation in pure PyTorch: the ground truth of the kernels, and what runs on the CPU.

Shapes: gate, up [..., F]; scale [..., 1]. The math is in README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (* scale), computed in fp32 (fp64 inputs in fp64) and rounded once to gate's dtype."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    h = F.silu(gate.to(compute)) * up.to(compute)
    if scale is not None:
        h = h * scale.to(compute)
    return h.to(gate.dtype)
