"""align's comparison rows: LoRA gradients relative to the reference's scale, a reference gradient of zero included."""

import pytest
import torch

from moe_tune.engine.align.compare import Tolerances, diff_row, lora_gradient_rows

TOLERANCE = Tolerances().lora_grad_rel


def _gradient(scale: float, seed: int, shape=(4, 6)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3], ids=str)
def test_a_nonzero_reference_gradient_is_measured_against_its_own_largest_value(scale):
    ref = _gradient(scale, 0)
    ours = ref + _gradient(scale * 1e-5, 1)
    # A far larger gradient beside it changes nothing: each tensor with a reference of its own keeps its own scale.
    other = _gradient(scale * 1e3, 2)
    rows = lora_gradient_rows([("a", ours, ref), ("b", other, other)])
    diff = (ours - ref).abs().max().item()
    assert rows[0].max_abs == pytest.approx(diff)
    assert rows[0].rel == pytest.approx(diff / ref.abs().max().item())
    assert rows[1].rel == 0.0


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3], ids=str)
@pytest.mark.parametrize("noise, passes", [(1e-7, True), (1e-2, False)], ids=["rounding", "wrong"])
def test_a_zero_reference_gradient_is_measured_against_the_largest_reference_gradient(scale, noise, passes):
    # The q and k adapters of documents whose labelled tokens attend to themselves alone: the reference's gradient is
    # exactly zero, ours holds whatever it computed.
    other = _gradient(scale, 0)
    ours = _gradient(scale * noise, 1)
    (row, _) = lora_gradient_rows([("q_proj.lora_A", ours, torch.zeros_like(ours)), ("o_proj.lora_A", other, other)])
    assert row.max_abs == pytest.approx(ours.abs().max().item())
    assert row.rel == pytest.approx(ours.abs().max().item() / other.abs().max().item())
    assert (row.rel <= TOLERANCE) == passes


def test_without_any_reference_gradient_only_an_exact_zero_passes():
    zero = torch.zeros(3, 3)
    rows = lora_gradient_rows([("exact", zero, zero), ("off", zero + 1e-12, zero)])
    assert [(row.max_abs, row.rel) for row in rows] == [(0.0, 0.0), (pytest.approx(1e-12), float("inf"))]


@pytest.mark.parametrize("side", ["ours", "reference"])
def test_a_missing_gradient_fails_whatever_the_scale(side):
    grad = _gradient(1.0, 0)
    ours, ref = (None, grad) if side == "ours" else (grad, None)
    (row, _) = lora_gradient_rows([("missing", ours, ref), ("other", grad, grad)])
    assert row.name == f"missing (no gradient in {side})" and row.rel == float("inf")


def test_other_rows_keep_their_own_scale():
    # Hidden states and logits have no zero_scale: a zero reference with a difference fails as before.
    assert diff_row("layer 0", torch.ones(2), torch.zeros(2)).rel == float("inf")
    assert diff_row("layer 0", torch.zeros(2), torch.zeros(2)).rel == 0.0
