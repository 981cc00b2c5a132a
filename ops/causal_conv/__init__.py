"""Depthwise causal convolution over a packed row of documents, then SiLU (the short conv of linear attention
layers): one Triton pass forward, two backward, instead of about four eager passes per tap. `causal_conv_heads`
takes a layer's q, k and v projections apart and writes its output as attention heads, q and k repeated for the
value heads that share them: what concatenating, convolving, splitting and repeating would give, in one launch
(backward: two) with no concatenated copy, no repeated copy and no strided v.

Shapes: x [B, T, C]; weight [C, W]; positions [T]. The math is in README.md; the ground truth in reference.py.

Dispatch: the kernel on CUDA tensors, the reference elsewhere (MOE_TUNE_KERNELS forces either). The kernels are
checked against the reference in the Triton interpreter (tests/ops/test_causal_conv.py) and in bf16 on the H200
(tests/gpu/test_causal_conv_gpu.py).
"""

from __future__ import annotations

import torch

from moe_tune.ops.causal_conv.reference import causal_conv_heads_ref, causal_conv_ref
from moe_tune.ops.common.dispatch import use_kernel

__all__ = ["causal_conv", "causal_conv_heads"]

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


def causal_conv_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
    key_head_dim: int, value_head_dim: int, dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """causal_conv over the channels of q, k and v (in that order), returned as heads.

    q, k:      [B, T, Hk * K], one dtype with v (bf16/fp16/fp32 for the kernels)
    v:         [B, T, Hv * V], Hv a multiple of Hk
    weight:    [2 Hk K + Hv V, W], as causal_conv's over the concatenated channels
    positions: [T], as causal_conv's
    Returns q, k [B, T, Hv, K] (key head h as value heads h G .. h G + G - 1, G = Hv / Hk, as repeat_interleave
    gives) and v [B, T, Hv, V], all contiguous, equal to splitting causal_conv(cat([q, k, v], -1), ...) into heads.
    Differentiable w.r.t. q, k, v and weight.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_heads(q, k, v, key_head_dim, value_head_dim)
    _check_conv(q.shape[1], 2 * q.shape[2] + v.shape[2], q.device, weight, positions, dilation, "q, k and v")
    has_kernel = q.dtype in _KERNEL_DTYPES and weight.shape[1] <= MAX_WIDTH
    if use_kernel("causal_conv", q, k, v, weight, positions, has_kernel=has_kernel):
        from moe_tune.ops.causal_conv.autograd import CausalConvHeadsFunction

        return CausalConvHeadsFunction.apply(
            q, k, v, weight, positions, int(dilation), int(key_head_dim), int(value_head_dim)
        )
    return causal_conv_heads_ref(q, k, v, weight, positions, key_head_dim, value_head_dim, dilation)


def _check_heads(q, k, v, key_head_dim, value_head_dim) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 3 or t.shape[:2] != q.shape[:2]:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must be [B, T, C] with [B, T] = {tuple(q.shape[:2])}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: {t.dtype} on {t.device} must match q ({q.dtype} on {q.device})")
    if k.shape != q.shape:
        raise ValueError(f"k: shape {tuple(k.shape)} must equal q's {tuple(q.shape)}")
    if key_head_dim < 1 or q.shape[2] % key_head_dim or value_head_dim < 1 or v.shape[2] % value_head_dim:
        raise ValueError(f"key_head_dim ({key_head_dim}) and value_head_dim ({value_head_dim}) must divide q's "
                         f"{q.shape[2]} and v's {v.shape[2]} channels")  # fmt: skip
    num_key_heads, num_value_heads = q.shape[2] // key_head_dim, v.shape[2] // value_head_dim
    if num_key_heads == 0 or num_value_heads % num_key_heads:
        raise ValueError(f"v: {num_value_heads} value heads must be a multiple of q's {num_key_heads} key heads")


def _check_inputs(x, weight, positions, dilation) -> None:
    if x.ndim != 3:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [B, T, C]")
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype} must be floating point")
    _check_conv(x.shape[1], x.shape[2], x.device, weight, positions, dilation, "x")


def _check_conv(tokens, channels, device, weight, positions, dilation, inputs: str) -> None:
    """weight, positions and dilation against the inputs' T tokens and C channels on `device` (`inputs` names them)."""
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [C, W] with C = {channels} and W >= 1")
    if not weight.is_floating_point():
        raise ValueError(f"weight: dtype {weight.dtype} must be floating point")
    if positions.shape != (tokens,):
        raise ValueError(f"positions: shape {tuple(positions.shape)} must be [T] ({tokens},)")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: dtype {positions.dtype} must be int32 or int64")
    if dilation < 1:
        raise ValueError(f"dilation ({dilation}) must be >= 1")
    for name, t in (("weight", weight), ("positions", positions)):
        if t.device != device:
            raise ValueError(f"{name}: device {t.device} must match {inputs} ({device})")
