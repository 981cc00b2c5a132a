"""The autograd Functions around the causal conv kernels (one tensor; q, k and v written as heads)."""

from __future__ import annotations

import torch

from moe_tune.ops.causal_conv.kernels import causal_conv_bwd, causal_conv_fwd, pick_launch
from moe_tune.ops.causal_conv.kernels_heads import causal_conv_heads_bwd, causal_conv_heads_fwd


class CausalConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, positions, dilation):
        x = x.contiguous()
        w = weight.contiguous()
        ctx.launch = pick_launch(x)
        y = causal_conv_fwd(x, w, positions, dilation, ctx.launch)
        ctx.save_for_backward(x, weight, positions)
        ctx.dilation = dilation
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, positions = ctx.saved_tensors
        dx, dw = causal_conv_bwd(
            grad_y.contiguous(), x, weight.contiguous(), positions, ctx.dilation, ctx.needs_input_grad[1], ctx.launch
        )
        return dx, dw.to(weight.dtype) if dw is not None else None, None, None


class CausalConvHeadsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weight, positions, dilation, key_head_dim, value_head_dim):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.launch = pick_launch(q)
        out = causal_conv_heads_fwd(
            q, k, v, weight.contiguous(), positions, dilation, key_head_dim, value_head_dim, ctx.launch
        )
        ctx.save_for_backward(q, k, v, weight, positions)
        ctx.sizes = (dilation, key_head_dim, value_head_dim)
        return out

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        q, k, v, weight, positions = ctx.saved_tensors
        dilation, key_head_dim, value_head_dim = ctx.sizes
        batch, tokens, _ = q.shape
        num_value_heads = v.shape[2] // value_head_dim
        key_shape = (batch, tokens, num_value_heads, key_head_dim)
        shapes = (key_shape, key_shape, (batch, tokens, num_value_heads, value_head_dim))
        # An output that reaches no loss has no gradient: it contributes zeros.
        grads = [q.new_zeros(shape) if g is None else g.contiguous()
                 for g, shape in zip((grad_q, grad_k, grad_v), shapes)]  # fmt: skip
        dq, dk, dv, dw = causal_conv_heads_bwd(
            *grads, q, k, v, weight.contiguous(), positions, dilation, key_head_dim, value_head_dim,
            ctx.needs_input_grad[3], ctx.launch,
        )  # fmt: skip
        return dq, dk, dv, dw.to(weight.dtype) if dw is not None else None, None, None, None, None
