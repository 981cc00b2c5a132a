"""causal_conv's Triton kernels on CUDA: bf16 and fp32 forward and every gradient against the reference at the model's
shapes, NaN-filled buffers with guarded ends, bitwise reruns. Auto dispatch takes the kernel on CUDA since
this file passed on the H200 (ops/causal_conv/__init__.py).

Shapes: x [B, T, C]; the benchmark model's gated delta nets convolve q, k, v together: C = 2 * 16 * 128 + 32 * 128
= 8192 channels over a packed row of 8192 tokens, width 4.
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
from kernel_fixtures import forced_kernel_path, guarded_outputs
from norm_conv_cases import (
    GPU_GUARD_ELEMENTS,
    GPU_TOLERANCES,
    assert_close_to_reference,
    causal_conv_case,
    conv_launch,
    conv_sweep_launches,
    run_causal_conv,
    use_conv_launch,
)

from moe_tune.ops.causal_conv import causal_conv, kernels
from moe_tune.ops.causal_conv.reference import causal_conv_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

kernel_path = forced_kernel_path(kernels, "_causal_conv_fwd_kernel", on_gpu=True)
guarded = guarded_outputs(kernels, GPU_GUARD_ELEMENTS, "alloc")
SWEEP_LAUNCHES = conv_sweep_launches()

# (batch, document lengths, channels, width, dilation)
CASES = {
    # The benchmark model's row: ~150-token documents (the built-in corpus), 8192 tokens, 8192 channels.
    "bench_row": (1, [150] * 54 + [92], 8192, 4, 1),
    # One document of 4096 tokens, KDA's 3 x 16 x 128 channels.
    "kda_one_doc": (1, [4096], 6144, 4, 1),
    # Documents of 1 and 63 tokens, odd channels, dilation 3 (n-gram tables).
    "odd_dilated": (2, [1, 63, 700, 5], 1000, 4, 3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, conv_launch, case, dtype):
    assert_matches_reference(guarded, case, dtype)


@pytest.mark.parametrize("launch", SWEEP_LAUNCHES.values(), ids=SWEEP_LAUNCHES.keys())
@pytest.mark.parametrize("case, dtype", [(CASES["bench_row"], torch.bfloat16), (CASES["odd_dilated"], torch.float32)],
                         ids=["bench_row-bf16", "odd_dilated-fp32"])  # fmt: skip
def test_sweep_launch_matches_reference(guarded, monkeypatch, launch, case, dtype):
    use_conv_launch(monkeypatch, launch)
    assert_matches_reference(guarded, case, dtype)


def assert_matches_reference(guarded, case, dtype):
    batch, lengths, channels, width, dilation = case
    x, weight, positions, grad_y = causal_conv_case(batch, lengths, channels, width, dtype, device=DEVICE)
    y, grads = run_causal_conv(causal_conv, x, weight, positions, grad_y, dilation)
    as_fp64 = [t.detach().double().requires_grad_() for t in (x, weight)]
    y_ref, grads_ref = run_causal_conv(causal_conv_ref, *as_fp64, positions, grad_y.double(), dilation)
    torch.cuda.synchronize()
    guarded.check()
    assert_close_to_reference(("y", "dx", "dweight"), (y, *grads), (y_ref, *grads_ref), dtype, GPU_TOLERANCES[dtype])


def test_reruns_are_bitwise_equal(kernel_path):
    x, weight, positions, grad_y = causal_conv_case(1, [150] * 54 + [92], 8192, 4, torch.bfloat16, device=DEVICE)
    first = run_causal_conv(causal_conv, x, weight, positions, grad_y, 1)
    second = run_causal_conv(causal_conv, x, weight, positions, grad_y, 1)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
