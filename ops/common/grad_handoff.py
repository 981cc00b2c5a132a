"""Gradients handed between autograd nodes without copies: a gradient handed from the node that makes it to the node
that sums into it, in place where that is safe (GradHandoff), and a buffer a tensor's gradient is wanted in
(want_grad_in).

A node that hands its input x on (returns x as a view, which x's later uses take instead of x) gets the gradient of
those later uses in its backward and adds its own parts of x's gradient to it inside its GEMMs. Out of place, the
first such GEMM (`torch.addmm`) copies that gradient into its output before adding to it; in place (`addmm_`) it
writes the tensor autograd passed it, which is safe only if nothing else holds that tensor: autograd may hand one
tensor to several nodes (an add's backward returns its gradient for both operands) or sum several into a new one.

So the node that hands x on offers a GradHandoff with the view (`offer`); the node that consumes the view and makes
x's gradient as a tensor of its own (a fresh output, or an owned gradient it summed into) lodges that tensor there
(`lodge`); the handing node's backward writes in place only the very tensor lodged (`take_owned`). The handoff's
reference keeps autograd from summing anything else into that tensor in place, so any other path (a second use of
the view, a cast, a reshape that copies) reaches the handing node as another tensor, which it adds to out of place.
"""

from __future__ import annotations

import torch

# The attribute of a handed-on view that holds its GradHandoff.
HANDOFF_ATTR = "_moe_tune_grad_handoff"


class GradHandoff:
    """Where the consumer of a handed-on view lodges the gradient it made for it (None until then)."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


def offer(view: torch.Tensor, handoff: GradHandoff) -> torch.Tensor:
    """Attach `handoff` to the handed-on `view` for its consumer to find (handoff_of); returns the view."""
    setattr(view, HANDOFF_ATTR, handoff)
    return view


def handoff_of(x: torch.Tensor) -> GradHandoff | None:
    """The GradHandoff offered with x, if x is a handed-on view; else None."""
    return getattr(x, HANDOFF_ATTR, None)


def lodge(handoff: GradHandoff | None, grad: torch.Tensor | None) -> None:
    """Lodge `grad`, a gradient of the handed-on view that the caller made and holds nowhere else, for the handing
    node to sum into in place (nothing where handoff is None)."""
    if handoff is not None:
        handoff.grad = grad


def take_owned(handoff: GradHandoff | None, grad: torch.Tensor | None) -> bool:
    """Whether `grad`, the gradient autograd passed for the handed-on view, is the tensor lodged in `handoff` and so
    may be written in place. Empties the handoff either way. Never while backward builds a graph (create_graph):
    an in-place write would change a tensor that graph saved."""
    if handoff is None:
        return False
    lodged, handoff.grad = handoff.grad, None
    return grad is not None and lodged is grad and not torch.is_grad_enabled()


# The attribute of a tensor that holds the buffer where its gradient is wanted (a one-item list until claimed).
GRAD_BUFFER_ATTR = "_moe_tune_grad_buffer"


def want_grad_in(t: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Ask that t's gradient be written into `buffer` (of t's shape and dtype, contiguous: a CUDA graph's static input
    of its backward), by the one op that consumes t and makes t's whole gradient (claim_grad_buffer); returns t.
    Whoever reads t's gradient then finds it there, with no copy, where that op claimed the buffer."""
    setattr(t, GRAD_BUFFER_ATTR, [buffer])
    return t


def claim_grad_buffer(x: torch.Tensor) -> torch.Tensor | None:
    """The buffer x's gradient is wanted in, for the op about to consume x whose backward makes x's whole gradient
    (no other term added to it), where it fits x (shape, dtype, device, contiguous); None otherwise. Each buffer is
    given out once: a second consumer of x gets None, and autograd sums the two consumers' gradients apart from
    it."""
    holder = getattr(x, GRAD_BUFFER_ATTR, None)
    if not holder:
        return None
    buffer = holder.pop()
    fits = buffer.shape == x.shape and buffer.dtype == x.dtype and buffer.device == x.device
    return buffer if fits and buffer.is_contiguous() else None
