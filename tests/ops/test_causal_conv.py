"""causal_conv: the reference against a per-document convolution, the Triton kernels in the interpreter against
the reference (forward and every gradient, document boundaries, odd shapes, NaN-filled buffers with guarded ends),
input checks and dispatch.

Shapes: x [B, T, C]; weight [C, W]; positions [T].
"""

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import torch.nn.functional as F
    from moe_tune.ops.causal_conv import MAX_WIDTH, causal_conv, kernels
    from moe_tune.ops.causal_conv.reference import causal_conv_ref
    from norm_conv_cases import (
        CONV_TOLERANCES, assert_close_to_reference, causal_conv_case, conv_launch, run_causal_conv,
    )  # fmt: skip

TOLERANCES = CONV_TOLERANCES
# Past the end of every kernel buffer: a whole tile.
GUARD_ELEMENTS = kernels.BLOCK_T * kernels.BLOCK_C

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels, "_causal_conv_fwd_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS, "alloc")


# (batch, document lengths, channels, width, dilation)
CASES = {
    # Documents of 1 and 63 tokens beside longer ones: taps that cross a boundary are dropped. 141 tokens: not a
    # multiple of the 64-token tile; 40 channels: less than one channel tile.
    "docs_1_63": (1, [1, 63, 7, 70], 40, 4, 1),
    # Two rows, 130 channels (two channel tiles, the second partial), dilation 2 as n-gram tables use it.
    "dilated_B2": (2, [5, 3, 100], 130, 4, 2),
    # Width 3, one long document.
    "W3_one_doc": (1, [200], 16, 3, 1),
    # Width 1: no tap reaches back (a per-channel scale, then SiLU).
    "W1": (1, [9, 4], 24, 1, 1),
    # Dilation beyond the row: only the current-token tap survives anywhere.
    "dilation_past_T": (1, [6], 8, 4, 5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(kernel_path, guarded, conv_launch, case, dtype):
    batch, lengths, channels, width, dilation = case
    x, weight, positions, grad_y = causal_conv_case(batch, lengths, channels, width, dtype)
    y, grads = run_causal_conv(causal_conv, x, weight, positions, grad_y, dilation)
    as_fp64 = [t.detach().double().requires_grad_() for t in (x, weight)]
    y_ref, grads_ref = run_causal_conv(causal_conv_ref, *as_fp64, positions, grad_y.double(), dilation)
    guarded.check()
    assert_close_to_reference(("y", "dx", "dweight"), (y, *grads), (y_ref, *grads_ref), dtype, TOLERANCES[dtype])


def test_frozen_weight_gets_no_gradient_and_no_partial_sums(kernel_path, guarded, conv_launch):
    x, weight, positions, grad_y = causal_conv_case(1, [30, 40], 20, 4, torch.float32)
    weight.requires_grad_(False)
    y, (dx,) = run_causal_conv(causal_conv, x, weight, positions, grad_y, 1)
    _, (dx_ref,) = run_causal_conv(causal_conv_ref, x, weight, positions, grad_y, 1)
    torch.testing.assert_close(dx, dx_ref, **TOLERANCES[torch.float32])
    # y, dx and (two passes) the fp32 dpre: no [tiles, C, W] buffer for dw.
    buffers = 2 if conv_launch.one_pass_backward else 3
    assert [shape for _, _, shape in guarded.buffers] == [(1, 70, 20)] * buffers


def test_kernel_is_deterministic(kernel_path):
    x, weight, positions, grad_y = causal_conv_case(1, [50, 90], 72, 4, torch.float16)
    first = run_causal_conv(causal_conv, x, weight, positions, grad_y, 1)
    second = run_causal_conv(causal_conv, x, weight, positions, grad_y, 1)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_reference_is_a_convolution_per_document():
    x, weight, positions, _ = causal_conv_case(2, [3, 8, 5], 6, 4, torch.float64)
    x, weight = x.detach(), weight.detach()
    pieces, start = [], 0
    for length in (3, 8, 5):
        doc = x[:, start : start + length].transpose(1, 2)  # [B, C, L]
        # Zero left padding, depthwise; conv1d correlates, so taps read oldest first as weight's columns do.
        pieces.append(F.conv1d(F.pad(doc, (3, 0)), weight[:, None, :], groups=6).transpose(1, 2))
        start += length
    expected = F.silu(torch.cat(pieces, dim=1))
    torch.testing.assert_close(causal_conv_ref(x, weight, positions), expected)


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, weight, positions, _ = causal_conv_case(1, [7, 9], 12, 4, torch.float32)
    assert torch.equal(causal_conv(x, weight, positions), causal_conv_ref(x, weight, positions))


@pytest.mark.parametrize(
    "dtype, width", [(torch.float64, 4), (torch.float32, MAX_WIDTH + 1)], ids=["fp64", "too_wide"]
)
def test_forced_kernel_that_cannot_run_raises(kernel_path, dtype, width):
    x, weight, positions, _ = causal_conv_case(1, [10], 8, width, dtype)
    with pytest.raises(RuntimeError, match="causal_conv has no Triton kernel"):
        causal_conv(x, weight, positions)


BAD_INPUTS = [
    pytest.param(dict(x=torch.ones(10, 8)), r"x: shape \(10, 8\) must be \[B, T, C\]", id="x_2d"),
    pytest.param(dict(weight=torch.ones(7, 4)), r"weight: shape \(7, 4\) must be \[C, W\] with C = 8", id="weight_C"),
    pytest.param(dict(positions=torch.zeros(9, dtype=torch.long)), r"positions: shape \(9,\) must be \[T\] \(10,\)", id="pos_T"),
    pytest.param(dict(positions=torch.zeros(10)), r"positions: dtype torch.float32 must be int32 or int64", id="pos_float"),
    pytest.param(dict(dilation=0), r"dilation \(0\) must be >= 1", id="dilation"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_bad_inputs_raise(bad, message):
    inputs = {"x": torch.ones(1, 10, 8), "weight": torch.ones(8, 4), "positions": torch.zeros(10, dtype=torch.long),
              **bad}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        causal_conv(**inputs)
