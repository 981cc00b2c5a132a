"""The gradient handoff between autograd nodes (ops/common/grad_handoff.py): a handing node may write in place only the
very tensor its consumer lodged, once, and never while backward builds a graph."""

import torch

from moe_tune.ops.common.grad_handoff import GradHandoff, handoff_of, lodge, offer, take_owned


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
