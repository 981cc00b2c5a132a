"""The autograd Function around the rotary kernel (cos and sin are constants: no gradient for them)."""

from __future__ import annotations

import torch

from moe_tune.ops.rotary.kernels import rotary_pass


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        num_heads, dim = x.shape[-2], x.shape[-1]
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        y = rotary_pass(x.contiguous().view(-1, dim), cos, sin, num_heads, is_backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        cos, sin = ctx.saved_tensors
        num_heads, dim = ctx.shape[-2], ctx.shape[-1]
        dx = rotary_pass(grad_y.contiguous().view(-1, dim), cos, sin, num_heads, is_backward=True)
        return dx.view(ctx.shape), None, None
