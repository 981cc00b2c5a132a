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


def causal_conv_heads_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
    key_head_dim: int, value_head_dim: int, dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """causal_conv_ref over the three segments concatenated (q, k, v order), split back into heads (split_heads)."""
    y = causal_conv_ref(torch.cat([q, k, v], -1), weight, positions, dilation)
    return split_heads(y, q.shape[2], key_head_dim, value_head_dim)


def split_heads(
    qkv: torch.Tensor, key_channels: int, key_head_dim: int, value_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A conv output [B, T, 2 Hk K + Hv V] over q, k and v's channels (key_channels = Hk K) -> q, k [B, T, Hv, K]
    with each of the Hk key heads repeated for the Hv / Hk value heads after it (repeat_interleave), and
    v [B, T, Hv, V]."""
    batch, tokens = qkv.shape[:2]
    yq, yk, yv = qkv.split([key_channels, key_channels, qkv.shape[2] - 2 * key_channels], -1)
    num_key_heads, num_value_heads = key_channels // key_head_dim, yv.shape[2] // value_head_dim
    repeat = num_value_heads // num_key_heads
    heads = (batch, tokens, num_key_heads, key_head_dim)
    return (
        yq.reshape(heads).repeat_interleave(repeat, dim=2),
        yk.reshape(heads).repeat_interleave(repeat, dim=2),
        yv.reshape(batch, tokens, num_value_heads, value_head_dim),
    )
