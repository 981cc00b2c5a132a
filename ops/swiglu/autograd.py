"""The autograd Function around the SwiGLU activation kernels."""

from __future__ import annotations

import math

import torch

from moe_tune.ops.swiglu.kernels import swiglu_bwd, swiglu_fwd


class SwiGLUFunction(torch.autograd.Function):
    """gate, up [..., F] (same shape and dtype), scale [..., 1] or None -> h [..., F]. Saves its inputs only: the
    backward recomputes silu(gate) from gate."""

    @staticmethod
    def forward(ctx, gate, up, scale):
        # Rows counted from the leading dims: reshape cannot infer them when F is 0.
        shape_MF = (math.prod(gate.shape[:-1]), gate.shape[-1])
        gate_MF = gate.reshape(shape_MF).contiguous()
        up_MF = up.reshape(shape_MF).contiguous()
        scale_M = scale.reshape(shape_MF[0]).contiguous() if scale is not None else None
        h_MF = swiglu_fwd(gate_MF, up_MF, scale_M)
        ctx.save_for_backward(gate_MF, up_MF, scale_M)
        ctx.shapes = gate.shape, None if scale is None else scale.shape
        return h_MF.view(gate.shape)

    @staticmethod
    def backward(ctx, grad_h):
        gate_MF, up_MF, scale_M = ctx.saved_tensors
        gate_shape, scale_shape = ctx.shapes
        needs_dscale = scale_M is not None and ctx.needs_input_grad[2]
        dh_MF = grad_h.reshape(gate_MF.shape).contiguous()
        dgate, dup, dscale = swiglu_bwd(dh_MF, gate_MF, up_MF, scale_M, needs_dscale)
        dscale = dscale.view(scale_shape) if dscale is not None else None
        return dgate.view(gate_shape), dup.view(gate_shape), dscale
