"""A fast path for PEFT's LoRA linear layers: fewer launches, less Python, one autograd node for the adapter.

PEFT's `lora.Linear.forward` computes base(x) + lora_B(lora_A(dropout(x))) * scaling through three modules and two
ops (autograd records 6 nodes for the adapter, 10 for a 3D input), behind a loop over adapters, casts and checks.
When the training step is bound by the host's launch rate, that overhead is step time. Over a bias-free nn.Linear
base with no hook that would miss its call, the base GEMM and the adapter are one autograd node
(engine/model/projections.py's SharedInputLinearsFunction): three GEMMs forward, and backward the adapter's part of
x's gradient accumulated inside a GEMM (no add kernel). Otherwise (a bias, a hooked or FP8 base) the base layer is
called as a module, so hooks on it (ZeRO-3 gathering its weight) fire as they do under PEFT's own forward, and the
adapter is one autograd Function: an mm and an addmm in forward (PEFT has 2 GEMMs, a multiply and an add) and at
most 4 GEMMs in backward with the scale folded in (PEFT: 4 GEMMs and a multiply).

Shapes: N rows (the input's leading dims flattened), I in_features, O out_features, R the adapter's rank.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn

from moe_tune.engine.model.projections import (
    Parts,
    SharedInputLinearsFunction,
    has_global_hooks,
    has_hooks,
    plain_linear_weight,
)

from .experts import check_not_fp8


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scaling: float, like: torch.Tensor) -> torch.Tensor:
    """scaling * (a @ b) in one GEMM launch (torch.mm has no alpha). `like` only gives addmm a tensor of the
    result's shape: with beta=0 addmm never reads it (documented: its nan and inf are not propagated)."""
    return torch.addmm(like, a, b, beta=0, alpha=scaling)


class LoraDeltaFunction(torch.autograd.Function):
    """out = base_out + scaling * (x A^T) B^T as one autograd node.

    x: [..., I], lora_a: [R, I], lora_b: [O, R], base_out: [..., O] (the base layer's output), all of one dtype
    (fp32/bf16/fp16/fp64); scaling: a Python float. Returns [..., O] in that dtype, a new tensor (base_out may be
    held by a hook or be a view). Saves x (a 2D view of it; a copy only when x cannot be viewed as 2D) and x A^T
    [N, R]; the adapter weights are saved by reference.
    """

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base_out, scaling: float):
        x_NI = x.reshape(-1, x.shape[-1])
        xa_NR = torch.mm(x_NI, lora_a.t())
        ctx.save_for_backward(x_NI, xa_NR, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        out_NO = torch.addmm(base_out.reshape(-1, base_out.shape[-1]), xa_NR, lora_b.t(), alpha=scaling)
        return out_NO.view(base_out.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x_NI, xa_NR, lora_a, lora_b = ctx.saved_tensors
        needs_x, needs_a, needs_b, needs_base = ctx.needs_input_grad[:4]
        scaling = ctx.scaling
        dy_NO = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_a = grad_b = None
        if needs_x or needs_a:
            dxa_NR = _scaled_mm(dy_NO, lora_b, scaling, like=xa_NR)
            if needs_a:
                grad_a = torch.mm(dxa_NR.t(), x_NI)
            if needs_x:
                grad_x = torch.mm(dxa_NR, lora_a).view(ctx.x_shape)
        if needs_b:
            grad_b = _scaled_mm(dy_NO.t(), xa_NR, scaling, like=lora_b)
        # The base output enters the sum unscaled: its gradient is the incoming one, with no launch.
        grad_base = grad_out if needs_base else None
        return grad_x, grad_a, grad_b, grad_base, None


class FusedLoraLinear(PeftLinear):
    """PEFT's LoRA Linear whose forward takes LoraDeltaFunction when the adapter is plain LoRA, and is PEFT's own
    forward otherwise. It adds no state: use_fused_lora swaps an existing layer's class, so state-dict keys, saving,
    loading, merging and unloading stay PEFT's."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fast = None if args or kwargs else self._fast_path_weights(x)
        if fast is None:
            return super().forward(x, *args, **kwargs)
        lora_a, lora_b, scaling = fast
        weight = plain_linear_weight(self.base_layer, x)
        if weight is not None and not has_global_hooks():
            # A bias-free nn.Linear base with no hook to miss its call: its GEMM and the adapter's in one node, whose
            # backward adds the adapter's part of x's gradient inside a GEMM (engine/model/projections.py).
            (out,) = SharedInputLinearsFunction.apply(x, (True,), (scaling,), weight, lora_a, lora_b)
            return out
        base_out = self.base_layer(x)
        if base_out.dtype != x.dtype:
            # A base layer whose output dtype is not its input's (nn.Linear's always is): PEFT's sum, cast back to
            # the base output's dtype as PEFT does, without calling the base layer twice.
            delta = nn.functional.linear(nn.functional.linear(x, lora_a), lora_b) * scaling
            return (base_out + delta).to(base_out.dtype)
        return LoraDeltaFunction.apply(x, lora_a, lora_b, base_out, scaling)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        check_not_fp8(self.get_base_layer(), "merge")
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def unmerge(self) -> None:
        check_not_fp8(self.get_base_layer(), "unmerge")
        super().unmerge()

    def shared_input_parts(self, x: torch.Tensor) -> Parts | None:
        """This layer's parts for engine/model/projections.project (its weights, its one adapter's and the scale)
        where the fast path applies over a bias-free nn.Linear base and no hook is on this layer or its base; else
        None."""
        if has_hooks(self):
            return None
        fast = self._fast_path_weights(x)
        weight = plain_linear_weight(self.base_layer, x)
        if fast is None or weight is None:
            return None
        return Parts(weight, *fast)

    def _fast_path_weights(self, x: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter, float] | None:
        """(A, B, scaling) of the one active adapter when the fast path computes what PEFT's forward would, else
        None."""
        if self.merged or self.disable_adapters or self.fan_in_fan_out:
            return None
        active = self.active_adapters
        if len(active) != 1:
            return None
        adapter = active[0]
        lora_a = self.lora_A[adapter] if adapter in self.lora_A else None
        # lora_variant holds every variant that is not plain LoRA (DoRA, aLoRA, ...); PEFT keeps use_dora for
        # compatibility only.
        if (
            lora_a is None
            or adapter in self.lora_variant
            or self.use_dora.get(adapter, False)
            or self.lora_bias.get(adapter, False)
            or type(self.lora_dropout[adapter]) is not nn.Identity
        ):
            return None
        weight_a, weight_b = lora_a.weight, self.lora_B[adapter].weight
        if x.dtype != weight_a.dtype or torch.is_autocast_enabled(x.device.type):
            return None
        # A ZeRO-3 partitioned weight is gathered only inside its own module's forward hooks, which the fast path
        # does not run.
        if hasattr(weight_a, "ds_id") or hasattr(weight_b, "ds_id"):
            return None
        return weight_a, weight_b, self.scaling[adapter]


def use_fused_lora(model: nn.Module) -> int:
    """Give every PEFT LoRA Linear of `model` (that exact class, not its subclasses) the fast path in place.

    Returns how many layers were switched. The layers stay LoraLayers with the same parameters and state-dict keys;
    setting a layer's __class__ back to peft.tuners.lora.layer.Linear undoes it."""
    num_switched = 0
    for module in model.modules():
        if type(module) is PeftLinear:
            module.__class__ = FusedLoraLinear
            num_switched += 1
    return num_switched
