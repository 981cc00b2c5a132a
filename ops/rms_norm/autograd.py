"""The autograd Functions around the RMSNorm kernels: the norm alone, the norm handing its input on, and the residual
add followed by the norm."""

from __future__ import annotations

import torch

from moe_tune.ops.common.grad_handoff import claim_grad_buffer
from moe_tune.ops.rms_norm.kernels import rms_norm_bwd, rms_norm_fwd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, is_one_plus, is_silu):
        num_channels = x.shape[-1]
        x_MN = x.reshape(-1, num_channels).contiguous()
        z_MN = gate.reshape(-1, num_channels).contiguous() if gate is not None else None
        y_MN, rstd_M, _ = rms_norm_fwd(x_MN, weight.contiguous(), z_MN, eps, is_one_plus, is_silu)
        ctx.save_for_backward(x_MN, weight, z_MN, rstd_M)
        ctx.is_one_plus, ctx.is_silu, ctx.shape = is_one_plus, is_silu, x.shape
        # Where x's gradient is wanted (a CUDA-graphed block's output: ops/common/grad_handoff.want_grad_in).
        ctx.dx_out = claim_grad_buffer(x)
        return y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x_MN, weight, z_MN, rstd_M = ctx.saved_tensors
        dy_MN = grad_y.reshape(x_MN.shape).contiguous()
        needs_dw = ctx.needs_input_grad[1]
        dx_out = None if ctx.dx_out is None else ctx.dx_out.view(x_MN.shape)
        dx_MN, dw_N, dz_MN = rms_norm_bwd(
            dy_MN, x_MN, weight.contiguous(), z_MN, rstd_M, ctx.is_one_plus, ctx.is_silu, needs_dw, dx_out=dx_out
        )
        dw = dw_N.to(weight.dtype) if dw_N is not None else None
        dz = dz_MN.view(ctx.shape) if dz_MN is not None and ctx.needs_input_grad[2] else None
        return dx_MN.view(ctx.shape), dw, dz, None, None, None


class RMSNormWithInputFunction(torch.autograd.Function):
    """(x, rms_norm(x)): x comes out of the norm's node (a view of it), so that the gradient of x's other uses (the
    residual stream's) reaches the norm's backward, which adds it to the norm's in the same pass instead of autograd
    adding the two in a kernel of its own."""

    @staticmethod
    def forward(ctx, x, weight, eps, is_one_plus):
        num_channels = x.shape[-1]
        x_MN = x.reshape(-1, num_channels).contiguous()
        y_MN, rstd_M, _ = rms_norm_fwd(x_MN, weight.contiguous(), None, eps, is_one_plus, True)
        ctx.save_for_backward(x_MN, weight, rstd_M)
        ctx.is_one_plus, ctx.shape = is_one_plus, x.shape
        # Where x's gradient is wanted (a CUDA-graphed block's output: ops/common/grad_handoff.want_grad_in).
        ctx.dx_out = claim_grad_buffer(x)
        # An output backward does not reach comes as None, not as zeros to add.
        ctx.set_materialize_grads(False)
        return x, y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, grad_x, grad_y):
        x_MN, weight, rstd_M = ctx.saved_tensors
        dx_out = None if ctx.dx_out is None else ctx.dx_out.view(x_MN.shape)
        dx_MN, dw = _grad_plus_norm_grad(
            grad_x, grad_y, x_MN, weight, rstd_M, ctx.is_one_plus, ctx.needs_input_grad[1], dx_out
        )
        return dx_MN.view(ctx.shape), dw, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """(h, y) = (x + residual, rms_norm(x + residual)): one pass each way, y and h written into y_buffer and h_buffer
    where given (None: new tensors). Saves h and rstd, as the norm alone saves its input; backward adds h's own
    gradient (its other uses) to the norm's in the same pass, and x and residual get that one sum."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, is_one_plus, y_buffer, h_buffer):
        num_channels = x.shape[-1]
        x_MN = x.reshape(-1, num_channels).contiguous()
        r_MN = residual.reshape(-1, num_channels).contiguous()
        y_out, h_out = (None if b is None else b.view(-1, num_channels) for b in (y_buffer, h_buffer))
        y_MN, rstd_M, h_MN = rms_norm_fwd(
            x_MN, weight.contiguous(), None, eps, is_one_plus, True, residual=r_MN, y_out=y_out, h_out=h_out
        )
        ctx.save_for_backward(h_MN, weight, rstd_M)
        ctx.is_one_plus, ctx.shape = is_one_plus, x.shape
        # An output backward does not reach comes as None, not as zeros to add.
        ctx.set_materialize_grads(False)
        return h_MN.view(x.shape), y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, grad_h, grad_y):
        h_MN, weight, rstd_M = ctx.saved_tensors
        dh_MN, dw = _grad_plus_norm_grad(grad_h, grad_y, h_MN, weight, rstd_M, ctx.is_one_plus, ctx.needs_input_grad[2])
        dx = dh_MN.view(ctx.shape)
        return dx, dx, dw, None, None, None, None


def _grad_plus_norm_grad(grad_other, grad_y, x_MN, weight, rstd_M, is_one_plus, needs_dw, dx_out=None):
    """(dx [M, N], dw) of a norm y = rms_norm(x) whose input also has the gradient grad_other from its other uses:
    the two added in the norm's backward pass (written into dx_out where given); without grad_y (only the other uses
    reached), grad_other alone."""
    dother_MN = grad_other.reshape(x_MN.shape).contiguous() if grad_other is not None else None
    if grad_y is None:
        return dother_MN, None
    dy_MN = grad_y.reshape(x_MN.shape).contiguous()
    dx_MN, dw_N, _ = rms_norm_bwd(
        dy_MN, x_MN, weight.contiguous(), None, rstd_M, is_one_plus, True, needs_dw, dh=dother_MN, dx_out=dx_out
    )
    return dx_MN, dw_N.to(weight.dtype) if dw_N is not None else None
