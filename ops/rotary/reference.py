"""Rotary position embedding in the rotate-half layout, pure PyTorch: the ground truth of the kernels."""

from __future__ import annotations

import torch


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with its first R dims rotated: y = x_r * cos + rotate_half(x_r) * sin in fp32, where
    rotate_half(x_r) = [-x_r[R/2:], x_r[:R/2]]; dims R..D copied. cos, sin: [T, R]. Returns x's shape and dtype."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([(rot * c + rotated * s).to(x.dtype), rest], -1)
