"""Gradients handed between autograd nodes (ops/common/grad_handoff.py): a handing node may write in place only the
very tensor its consumer lodged, once, and never while backward builds a graph; a buffer a tensor's gradient is
wanted in goes to one consumer, and only where it fits."""

import torch

from moe_tune.ops.common.grad_handoff import (
    GradHandoff,
    claim_grad_buffer,
    handoff_of,
    lodge,
    offer,
    take_owned,
    want_grad_in,
)


def test_offer_attaches_the_handoff_to_the_view_only():
    x = torch.randn(3, 4)
    view = x.view(3, 4)
    handoff = GradHandoff()
    assert offer(view, handoff) is view
    assert handoff_of(view) is handoff
    assert handoff_of(x) is None and handoff_of(view.view(12)) is None


def test_only_the_lodged_tensor_is_owned_and_only_once():
    grad = torch.randn(3, 4)
    # As in a backward pass: no graph built.
    with torch.no_grad():
        for other in (grad.clone(), grad.view(3, 4), grad[:], None):
            handoff = GradHandoff()
            lodge(handoff, grad)
            # An equal tensor, a view of the lodged one or no gradient: not the tensor lodged.
            assert not take_owned(handoff, other)
            assert handoff.grad is None
        handoff = GradHandoff()
        lodge(handoff, grad)
        assert take_owned(handoff, grad)
        # Emptied: a second take (the same tensor passed again) owns nothing.
        assert not take_owned(handoff, grad)
        assert not take_owned(None, grad)
        lodge(None, grad)


def test_nothing_is_owned_while_backward_builds_a_graph():
    grad = torch.randn(3, 4)
    handoff = GradHandoff()
    lodge(handoff, grad)
    with torch.enable_grad():
        assert not take_owned(handoff, grad)
    assert handoff.grad is None


def test_a_wanted_buffer_is_claimed_once_and_only_where_it_fits():
    x = torch.randn(3, 4)
    buffer = torch.empty(3, 4)
    assert claim_grad_buffer(x) is None
    assert want_grad_in(x, buffer) is x
    assert claim_grad_buffer(x) is buffer
    assert claim_grad_buffer(x) is None
    for misfit in (torch.empty(3, 5), torch.empty(3, 4, dtype=torch.float64), torch.empty(4, 3).t(), torch.empty(12)):
        want_grad_in(x, misfit)
        assert claim_grad_buffer(x) is None
