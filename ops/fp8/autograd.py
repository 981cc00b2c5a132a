"""The autograd Function around the FP8 linear kernels."""

from __future__ import annotations

import torch

from moe_tune.ops.fp8.kernels import fp8_linear_bwd_input, fp8_linear_fwd


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale_inv, bias):
        in_features = x.shape[-1]
        x_MI = x.reshape(-1, in_features).contiguous()
        scale_inv = scale_inv.contiguous()
        y_MO = fp8_linear_fwd(x_MI, weight.contiguous(), scale_inv, bias.contiguous() if bias is not None else None)
        # Only the weight is kept: no gradient flows to it, so x is not needed backward.
        ctx.save_for_backward(weight, scale_inv)
        ctx.x_shape = x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y_MO.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        weight, scale_inv = ctx.saved_tensors
        dy_MO = grad_y.reshape(-1, weight.shape[0]).contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8_linear_bwd_input(dy_MO, weight, scale_inv).view(ctx.x_shape)
        dbias = None
        if ctx.needs_input_grad[3]:
            dbias = dy_MO.float().sum(0).to(ctx.bias_dtype)
        return dx, None, None, dbias
