"""rms_norm's Triton kernels on CUDA: bf16 and fp32 forward and every gradient against the reference at the model's
shapes, NaN-filled buffers with guarded ends, bitwise reruns. Auto dispatch takes the kernel on CUDA since
this file passed on the H200 (ops/rms_norm/__init__.py).

Shapes: x [M, N]; the benchmark model (B2 T4096 = 8192 tokens): hidden norms [8192, 2048], per-head q/k norms
[8192 * 16, 128], the gated delta net's gated output norm [8192 * 32, 128].
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
from kernel_fixtures import forced_kernel_path, guarded_outputs
from norm_conv_cases import (GPU_GUARD_ELEMENTS, GPU_TOLERANCES, as_fp64, assert_close_to_reference, rms_norm_case,
                             run_rms_norm)

from moe_tune.ops.rms_norm import add_rms_norm, kernels, rms_norm, rms_norm_with_input
from moe_tune.ops.rms_norm.reference import rms_norm_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

# (shape, is_one_plus, gate activation or None)
CASES = {
    "hidden_2048": ((8192, 2048), True, None),
    "qk_head_128": ((8192 * 16, 128), False, None),
    "gated_silu_128": ((8192 * 32, 128), True, "silu"),
    "gated_sigmoid_odd": ((1001, 100), False, "sigmoid"),
    "wide_5000": ((37, 5000), False, None),
}


kernel_path = forced_kernel_path(kernels, "_rms_norm_fwd_kernel", on_gpu=True)
guarded = guarded_outputs(kernels, GPU_GUARD_ELEMENTS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, case, dtype):
    shape, is_one_plus, activation = case
    x, weight, gate, grad_y = rms_norm_case(shape, dtype, activation is not None, device=DEVICE)
    options = dict(eps=1e-6, is_one_plus=is_one_plus, gate_activation=activation or "silu")
    y, grads = run_rms_norm(rms_norm, x, weight, gate, grad_y, **options)
    y_ref, grads_ref = run_rms_norm(rms_norm_ref, *as_fp64(x, weight, gate), grad_y.double(), **options)
    torch.cuda.synchronize()
    guarded.check()
    names = ("y", "dx", "dweight", "dgate")[: 1 + len(grads)]
    assert_close_to_reference(names, (y, *grads), (y_ref, *grads_ref), dtype, GPU_TOLERANCES[dtype])


def test_reruns_are_bitwise_equal(kernel_path):
    x, weight, gate, grad_y = rms_norm_case((8192 * 4, 128), torch.bfloat16, True, device=DEVICE)
    first = run_rms_norm(rms_norm, x, weight, gate, grad_y, is_one_plus=True)
    second = run_rms_norm(rms_norm, x, weight, gate, grad_y, is_one_plus=True)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


# The decoder layer's stream after its token mixer and its post-attention norm: (shape, is_one_plus).
ADD_CASES = {"hidden_2048": ((8192, 2048), True), "odd": ((1001, 100), False)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_add_kernel_matches_reference(guarded, case, dtype):
    shape, is_one_plus = case
    x, weight, _, grad_y = rms_norm_case(shape, dtype, False, device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(1)
    residual = (torch.randn(shape, generator=generator, device=DEVICE) * 3).to(dtype).requires_grad_()
    grad_h = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)
    h, y = add_rms_norm(x, residual, weight, 1e-6, is_one_plus)
    grads = torch.autograd.grad((h, y), (x, residual, weight), (grad_h, grad_y))
    # The reference on h as the kernel rounds it (h itself must equal the eager add bit for bit).
    h_ref = (x.detach() + residual.detach()).double().requires_grad_()
    weight_ref = weight.detach().double().requires_grad_()
    y_ref = rms_norm_ref(h_ref, weight_ref, 1e-6, is_one_plus)
    dh_ref, dw_ref = torch.autograd.grad(y_ref, (h_ref, weight_ref), grad_y.double())
    torch.cuda.synchronize()
    guarded.check()
    assert torch.equal(h, x.detach() + residual.detach()) and torch.equal(grads[0], grads[1])
    assert_close_to_reference(("y", "dx", "dweight"), (y, grads[0], grads[2]),
                              (y_ref, dh_ref + grad_h.double(), dw_ref), dtype, GPU_TOLERANCES[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_with_input_kernel_matches_reference(guarded, case, dtype):
    """The decoder layer's stream into its input norm: x handed on, its other gradient (the residual's) added in the
    norm's backward pass."""
    shape, is_one_plus = case
    x, weight, _, grad_y = rms_norm_case(shape, dtype, False, device=DEVICE)
    grad_x = torch.randn(shape, generator=torch.Generator(DEVICE).manual_seed(1), device=DEVICE).to(dtype)
    x_out, y = rms_norm_with_input(x, weight, 1e-6, is_one_plus)
    dx, dw = torch.autograd.grad((x_out, y), (x, weight), (grad_x, grad_y))
    x_ref, weight_ref = (t.detach().double().requires_grad_() for t in (x, weight))
    y_ref = rms_norm_ref(x_ref, weight_ref, 1e-6, is_one_plus)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, weight_ref), grad_y.double())
    torch.cuda.synchronize()
    guarded.check()
    assert x_out.data_ptr() == x.data_ptr() and torch.equal(x_out, x)
    assert_close_to_reference(("y", "dx", "dweight"), (y, dx, dw), (y_ref, dx_ref + grad_x.double(), dw_ref), dtype,
                              GPU_TOLERANCES[dtype])  # fmt: skip
