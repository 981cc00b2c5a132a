"""The autograd Function around the causal conv kernels."""

from __future__ import annotations

import torch

from moe_tune.ops.causal_conv.kernels import causal_conv_bwd, causal_conv_fwd


class CausalConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, positions, dilation):
        x = x.contiguous()
        w = weight.contiguous()
        y = causal_conv_fwd(x, w, positions, dilation)
        ctx.save_for_backward(x, weight, positions)
        ctx.dilation = dilation
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, positions = ctx.saved_tensors
        dx, dw = causal_conv_bwd(
            grad_y.contiguous(), x, weight.contiguous(), positions, ctx.dilation, ctx.needs_input_grad[1]
        )
        return dx, dw.to(weight.dtype) if dw is not None else None, None, None
