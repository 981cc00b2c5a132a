"""The autograd Function of the FP8 linear: the weight dequantized by the Triton kernel, the GEMMs by torch (cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_tune.ops.fp8.kernels import dequantize_weight_fp8


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale_inv, bias):
        in_features = x.shape[-1]
        x_MI = x.reshape(-1, in_features)
        weight, scale_inv = weight.contiguous(), scale_inv.contiguous()
        w_OI = dequantize_weight_fp8(weight, scale_inv, x.dtype)
        # bias enters the GEMM's epilogue (addmm): added to the fp32 accumulator, one rounding of y.
        y_MO = F.linear(x_MI, w_OI, bias.to(x.dtype) if bias is not None else None)
        # Only the FP8 weight and its scales are kept (backward dequantizes again): no gradient flows to the
        # weight, so neither x nor the dequantized weight is needed backward.
        ctx.save_for_backward(weight, scale_inv)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y_MO.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        weight, scale_inv = ctx.saved_tensors
        dy_MO = grad_y.reshape(-1, weight.shape[0])
        dx = None
        if ctx.needs_input_grad[0]:
            w_OI = dequantize_weight_fp8(weight, scale_inv, ctx.x_dtype)
            dx = (dy_MO.to(ctx.x_dtype) @ w_OI).view(ctx.x_shape)
        dbias = None
        if ctx.needs_input_grad[3]:
            dbias = dy_MO.float().sum(0).to(ctx.bias_dtype)
        return dx, None, None, dbias
