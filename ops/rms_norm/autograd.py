"""The autograd Function around the RMSNorm kernels."""

from __future__ import annotations

import torch

from moe_tune.ops.rms_norm.kernels import rms_norm_bwd, rms_norm_fwd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, is_one_plus, is_silu):
        num_channels = x.shape[-1]
        x_MN = x.reshape(-1, num_channels).contiguous()
        z_MN = gate.reshape(-1, num_channels).contiguous() if gate is not None else None
        y_MN, rstd_M = rms_norm_fwd(x_MN, weight.contiguous(), z_MN, eps, is_one_plus, is_silu)
        ctx.save_for_backward(x_MN, weight, z_MN, rstd_M)
        ctx.is_one_plus, ctx.is_silu, ctx.shape = is_one_plus, is_silu, x.shape
        return y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x_MN, weight, z_MN, rstd_M = ctx.saved_tensors
        dy_MN = grad_y.reshape(x_MN.shape).contiguous()
        needs_dw = ctx.needs_input_grad[1]
        dx_MN, dw_N, dz_MN = rms_norm_bwd(
            dy_MN, x_MN, weight.contiguous(), z_MN, rstd_M, ctx.is_one_plus, ctx.is_silu, needs_dw
        )
        dw = dw_N.to(weight.dtype) if dw_N is not None else None
        dz = dz_MN.view(ctx.shape) if dz_MN is not None and ctx.needs_input_grad[2] else None
        return dx_MN.view(ctx.shape), dw, dz, None, None, None
