"""Depthwise causal convolution over packed documents, then SiLU, in pure PyTorch: the ground truth of the kernels
and what runs on the CPU.

Shapes: x [B, T, C]; weight [C, W] (tap W-1 multiplies the current token, tap W-1-j the token j * dilation back);
positions [T] int, each token's position inside its document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """silu(sum_j weight[:, W-1-j] * x[t - j*dilation]) over the taps whose token lies in t's document; computed in
    x's dtype, as the model always did (the kernels compute in fp32 and round once)."""
    width = weight.shape[1]
    out = x * weight[:, -1]
    for tap in range(1, width):
        shift = tap * dilation
        shifted = F.pad(x[:, :-shift], (0, 0, shift, 0)) if shift < x.shape[1] else torch.zeros_like(x)
        keep = (positions >= shift).to(x.dtype)[None, :, None]
        out = out + shifted * keep * weight[:, -1 - tap]
    return F.silu(out)
