"""Several linear projections of one input as one autograd node (a token mixer's q, k, v, gates, ...).

As separate modules, each projection's backward makes its own part of the input's gradient and autograd adds the
parts up: one add kernel per projection after the first and one per LoRA adapter, each reading two [N, I] tensors
and writing one (the gated delta net with LoRA on q, k and v: 8 adds a layer). Here every part after the first is
accumulated inside its GEMM (`addmm_` into one buffer), and the adapters' rank products share one GEMM each way:
x [A_1; A_2; ...]^T forward, and in backward one GEMM for every dA and one for the adapters' part of dx.

Shapes: N rows (the input's leading dims flattened), I in_features, O_i the out_features of projection i, R the sum
of the adapters' ranks.

`shared_input_linears` takes this path when every projection is a bias-free nn.Linear or a LoRA layer offering its
parts (`shared_input_parts`, engine/lora/fused.py) in the input's dtype, and no hook could observe the modules it
skips: a hook on a projection or its base layer (ZeRO-3's gathers, activation checkpoints, align's captures), a global
module hook, a ZeRO-3 partitioned weight, autocast. Otherwise the modules are called, as the model would. Hooks marked
CLASS_SCOPE_HOOK (the activation-memory manager's, which only say which operator class is running) do not count:
they run around the node, as around the group's first module.

Handing the input on (`hand_on`: the MoE block's router and shared-expert gate to the shared expert, whose gate and
up hand it on again to the routed experts): the node also returns x (a view), which the input's later uses take
instead of x. Their gradient then reaches the node's backward, which starts x's gradient from it inside its first
GEMM, where x used by the node and by its later uses would have autograd add the two gradients in a kernel of its
own. That GEMM adds into the later uses' gradient in place where the node that made it lodged it as its own
(ops/common/grad_handoff.py: the shared expert's node and the routed experts' do); otherwise out of place (addmm),
which copies it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moe_tune.ops.common.grad_handoff import GradHandoff, handoff_of, lodge, offer, take_owned

# Set (True) on a forward pre- or post-hook that only marks the operator class running inside the module (engine/memory
# keeps a stack of them): shared_input_linears runs such hooks around its node instead of calling the modules.
CLASS_SCOPE_HOOK = "moe_tune_class_scope"


@dataclass(frozen=True)
class Parts:
    """One projection: out = x W^T (+ scaling (x A^T) B^T with an adapter). weight [O, I]; lora_a [r, I];
    lora_b [O, r]."""

    weight: torch.Tensor
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    scaling: float = 1.0


def shared_input_linears(
    x: torch.Tensor, modules: Sequence[nn.Module], hand_on: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """x: [..., I] -> (module(x) for each module), each [..., O_i] in x's dtype, as one autograd node; None where a
    module does not allow it (module docstring). hand_on: x itself follows the outputs, handed on by the node
    (SharedInputLinearsHandOnFunction)."""
    if len(modules) < 2 and not hand_on:
        # One plain projection gains nothing from the node (one LoRA layer takes it in its own forward).
        return None
    parts = [_parts(module, x) for module in modules]
    if any(p is None for p in parts) or has_global_hooks() or torch.is_autocast_enabled(x.device.type):
        return None
    has_lora = tuple(p.lora_a is not None for p in parts)
    scalings = tuple(p.scaling for p in parts)
    tensors = [t for p in parts for t in ((p.weight, p.lora_a, p.lora_b) if p.lora_a is not None else (p.weight,))]
    first, outs = modules[0], None
    for hook in list(first._forward_pre_hooks.values()):
        hook(first, (x,))
    try:
        if hand_on:
            handoff = GradHandoff()
            outs = SharedInputLinearsHandOnFunction.apply(x, has_lora, scalings, handoff, *tensors)
            outs = (*outs[:-1], offer(outs[-1], handoff))
        else:
            outs = SharedInputLinearsFunction.apply(x, has_lora, scalings, *tensors)
    finally:
        for hook in list(first._forward_hooks.values()):
            hook(first, (x,), outs[: len(modules)] if outs is not None else outs)
    return outs


def project(x: torch.Tensor, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """(module(x) for each module): shared_input_linears where it applies, the modules' own calls in their order
    otherwise."""
    outs = shared_input_linears(x, modules)
    return outs if outs is not None else tuple(module(x) for module in modules)


class SharedInputProjections:
    """The outputs of several projections of one input, taken by module (`of`). Where shared_input_linears applies
    they are all computed at once; otherwise each module runs when its output is taken, so that a projection used
    late in a layer (an output gate) is not held through the layer's other work, under an activation-memory policy
    that offloads or recomputes it (whose hooks on the modules keep the shared node from applying)."""

    def __init__(self, x: torch.Tensor, modules: Sequence[nn.Module], hand_on: bool = False):
        """hand_on: `x` is the input handed on by the node where it applies (the input itself otherwise), for the
        input's later uses: their gradient is added inside the node's first GEMM of the input's gradient instead of
        in an add kernel of autograd's (SharedInputLinearsHandOnFunction)."""
        self.x = x
        outs = shared_input_linears(x, modules, hand_on)
        if outs is not None and hand_on:
            self.x, outs = outs[-1], outs[:-1]
        self._outs = {} if outs is None else {id(m): out for m, out in zip(modules, outs, strict=True)}

    def of(self, *modules: nn.Module) -> tuple[torch.Tensor, ...]:
        """The outputs of `modules`, each handed out once."""
        return tuple(self._outs.pop(id(m)) if id(m) in self._outs else m(self.x) for m in modules)


def linear_plus(x: torch.Tensor, module: nn.Module, add_to: torch.Tensor) -> torch.Tensor:
    """module(x) + add_to, x [..., I] and add_to [..., O] of x's dtype: one addmm (the add inside the GEMM) where
    `module` is a bias-free nn.Linear with no hook to miss its call (its CLASS_SCOPE_HOOK hooks run around the
    addmm); else the module's call and an add."""
    weight = plain_linear_weight(module, x)
    if weight is None or add_to.dtype != x.dtype or has_global_hooks() or torch.is_autocast_enabled(x.device.type):
        return module(x) + add_to
    out = None
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, (x,))
    try:
        out = torch.addmm(add_to.reshape(-1, add_to.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
        out = out.view(add_to.shape)
    finally:
        for hook in list(module._forward_hooks.values()):
            hook(module, (x,), out)
    return out


def has_hooks(module: nn.Module) -> bool:
    """Whether a hook on `module` itself would miss its calls if shared_input_linears ran it: any backward hook, any
    forward hook taking kwargs or not marked CLASS_SCOPE_HOOK."""
    if module._backward_hooks or module._backward_pre_hooks:
        return True
    if module._forward_pre_hooks_with_kwargs or module._forward_hooks_with_kwargs:
        return True
    forward = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return not all(getattr(hook, CLASS_SCOPE_HOOK, False) for hook in forward)


def has_global_hooks() -> bool:
    """Whether a forward or backward hook is registered on all modules (nn.modules.module's global hooks)."""
    hooks = nn.modules.module
    return bool(
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def plain_linear_weight(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The weight of a bias-free nn.Linear (that exact class) in x's dtype, resident (not ZeRO-3 partitioned) and with
    no hook on the module; else None."""
    if type(module) is not nn.Linear or module.bias is not None or has_hooks(module):
        return None
    weight = module.weight
    if weight.dtype != x.dtype or hasattr(weight, "ds_id"):
        return None
    return weight


def _parts(module: nn.Module, x: torch.Tensor) -> Parts | None:
    weight = plain_linear_weight(module, x)
    if weight is not None:
        return Parts(weight)
    shared_input_parts = getattr(module, "shared_input_parts", None)
    return shared_input_parts(x) if shared_input_parts is not None else None


class SharedInputLinearsFunction(torch.autograd.Function):
    """(x W_i^T (+ s_i (x A_i^T) B_i^T) for each projection i) as one autograd node.

    x: [..., I]; has_lora, scalings: one entry per projection; tensors: W_i, then A_i and B_i where has_lora[i], all
    of x's dtype. Returns one [..., O_i] tensor per projection. Saves x (a 2D view; a copy only when x cannot be viewed
    as 2D) and the rank products x [A_1; A_2; ...]^T [N, R]; the weights by reference.
    """

    @staticmethod
    def forward(ctx, x, has_lora: tuple[bool, ...], scalings: tuple[float, ...], *tensors):
        return _shared_forward(ctx, x, has_lora, scalings, tensors)

    @staticmethod
    def backward(ctx, *grad_outs):
        return _shared_backward(ctx, grad_outs, None, None)


class SharedInputLinearsHandOnFunction(torch.autograd.Function):
    """SharedInputLinearsFunction's outputs followed by x itself (a view of it), handed on for the input's later
    uses: their gradient reaches this node's backward, which starts x's gradient from it inside its first GEMM
    (addmm, the sum in fp32 and rounded once) where x used twice would have autograd add the two gradients in a
    kernel of its own, a pass that reads two [..., I] tensors and writes one. handoff: offered with the x returned
    (grad_handoff.offer); where the later uses' gradient is the tensor lodged there, the GEMM adds into it in place."""

    @staticmethod
    def forward(ctx, x, has_lora: tuple[bool, ...], scalings: tuple[float, ...], handoff: GradHandoff, *tensors):
        ctx.handoff = handoff
        return (*_shared_forward(ctx, x, has_lora, scalings, tensors), x)

    @staticmethod
    def backward(ctx, *grad_outs):
        grads = _shared_backward(ctx, grad_outs[:-1], grad_outs[-1], ctx.handoff)
        return grads[0], None, None, None, *grads[3:]


def _shared_forward(ctx, x, has_lora, scalings, tensors) -> tuple[torch.Tensor, ...]:
    weights, adapters = _unpack(has_lora, tensors)
    x_NI = x.reshape(-1, x.shape[-1])
    outs = [torch.mm(x_NI, w.t()) for w in weights]
    a_RI = xa_NR = None
    if adapters:
        a_RI = torch.cat([a for _, a, _ in adapters]) if len(adapters) > 1 else adapters[0][1]
        xa_NR = torch.mm(x_NI, a_RI.t())
        r0 = 0
        for i, a, b in adapters:
            outs[i].addmm_(xa_NR[:, r0 : r0 + a.shape[0]], b.t(), alpha=scalings[i])
            r0 += a.shape[0]
    ctx.save_for_backward(x_NI, xa_NR, a_RI, *tensors)
    ctx.has_lora, ctx.scalings, ctx.x_shape = has_lora, scalings, x.shape
    # x handed on by the node before: x's gradient, made here, is lodged for that node to add to in place.
    ctx.input_handoff = handoff_of(x)
    ctx.set_materialize_grads(False)
    return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)


def _shared_backward(
    ctx, grad_outs, grad_x_later: torch.Tensor | None, handoff: GradHandoff | None
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of SharedInputLinearsFunction's inputs; grad_x_later: the gradient of x's later uses (the
    hand-on output's), or None, started from inside the first GEMM of x's gradient: in place where it is the tensor
    lodged in `handoff` (grad_handoff.take_owned), else out of place."""
    x_NI, xa_NR, a_RI, *tensors = ctx.saved_tensors
    has_lora, scalings = ctx.has_lora, ctx.scalings
    weights, adapters = _unpack(has_lora, tensors)
    # The tensors are the node's last inputs.
    needs = ctx.needs_input_grad[len(ctx.needs_input_grad) - len(tensors) :]
    slot = _slots(has_lora)
    dy = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grad_outs]
    grads: list[torch.Tensor | None] = [None] * len(tensors)
    later_NI = None if grad_x_later is None else grad_x_later.reshape(x_NI.shape)
    dx_NI = None
    if take_owned(handoff, grad_x_later) and ctx.needs_input_grad[0]:
        # Ours to write: every product is added into it in place.
        dx_NI, later_NI = later_NI, None
    # x's gradient: the later uses' and the projections' parts summed inside their GEMMs, in the projections' order.
    for i, w in enumerate(weights):
        if dy[i] is None:
            continue
        if ctx.needs_input_grad[0]:
            dx_NI = _add_product(dx_NI, later_NI, dy[i], w)
        if needs[slot[i]]:
            grads[slot[i]] = torch.mm(dy[i].t(), x_NI)
    live = [(i, a, b) for i, a, b in adapters if dy[i] is not None]
    if live:
        r0 = 0
        dxa_parts = []
        for i, a, b in adapters:
            rank = a.shape[0]
            if dy[i] is None:
                dxa_parts.append(torch.zeros_like(xa_NR[:, r0 : r0 + rank]))
            else:
                # d(x A^T) = s dy B, scaled inside the GEMM (beta=0: the first operand is never read).
                dxa_parts.append(torch.addmm(xa_NR[:, r0 : r0 + rank], dy[i], b, beta=0, alpha=scalings[i]))
                if needs[slot[i] + 2]:
                    grads[slot[i] + 2] = torch.addmm(b, dy[i].t(), xa_NR[:, r0 : r0 + rank], beta=0,
                                                     alpha=scalings[i])  # fmt: skip
            r0 += rank
        dxa_NR = torch.cat(dxa_parts, 1) if len(dxa_parts) > 1 else dxa_parts[0]
        if any(needs[slot[i] + 1] for i, _, _ in live):
            da_RI = torch.mm(dxa_NR.t(), x_NI)
            r0 = 0
            for i, a, _ in adapters:
                if needs[slot[i] + 1] and dy[i] is not None:
                    grads[slot[i] + 1] = da_RI[r0 : r0 + a.shape[0]]
                r0 += a.shape[0]
        if ctx.needs_input_grad[0]:
            dx_NI = _add_product(dx_NI, later_NI, dxa_NR, a_RI)
    if dx_NI is not None:
        # A tensor of this node's own (a product's output, or the lodged gradient it added to): lodged in turn for the
        # node that handed x on, as the very tensor returned.
        grad_x = dx_NI.view(ctx.x_shape)
        lodge(ctx.input_handoff, grad_x)
        return grad_x, None, None, *grads
    # No projection's output was used: x's gradient is its later uses' alone.
    grad_x = None if later_NI is None or not ctx.needs_input_grad[0] else later_NI.view(ctx.x_shape)
    return grad_x, None, None, *grads


def _add_product(dx_NI, later_NI, a, b):
    """dx + a @ b: in place into dx once it exists; the first product adds the later uses' gradient not owned
    (never written: autograd may hand the same tensor to other nodes) inside its GEMM, or stands alone without one."""
    if dx_NI is not None:
        return dx_NI.addmm_(a, b)
    return torch.mm(a, b) if later_NI is None else torch.addmm(later_NI, a, b)


def _unpack(has_lora, tensors):
    """-> (the projections' weights, [(projection index, A, B)] of those with an adapter)."""
    weights, adapters, j = [], [], 0
    for i, lora in enumerate(has_lora):
        weights.append(tensors[j])
        if lora:
            adapters.append((i, tensors[j + 1], tensors[j + 2]))
        j += 3 if lora else 1
    return weights, adapters


def _slots(has_lora) -> list[int]:
    """Where projection i's weight is in the flat tensor list (its A and B follow)."""
    slots, j = [], 0
    for lora in has_lora:
        slots.append(j)
        j += 3 if lora else 1
    return slots
