"""swiglu's Triton kernels on CUDA: bf16 and fp32 h and every gradient against the reference in fp64 at the model's
shapes, NaN-filled buffers with guarded ends, bitwise reruns.

Shapes: gate, up [M, F], scale [M, 1]; the benchmark model (B2 T4096 = 8192 tokens): the gated shared expert
[8192, 768]; a dense MLP's rows [8192, 5632] unscaled; odd sizes [1001, 100].
Run on a GPU on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
from kernel_fixtures import forced_kernel_path, guarded_outputs
from norm_conv_cases import GPU_GUARD_ELEMENTS, GPU_TOLERANCES, as_fp64, assert_close_to_reference

from moe_tune.ops.swiglu import kernels, swiglu
from moe_tune.ops.swiglu.reference import swiglu_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

# (rows, F, scaled)
CASES = {
    "shared_expert_768": (8192, 768, True),
    "dense_5632": (8192, 5632, False),
    "odd_scaled": (1001, 100, True),
}

kernel_path = forced_kernel_path(kernels, "_swiglu_fwd_kernel", on_gpu=True)
guarded = guarded_outputs(kernels, GPU_GUARD_ELEMENTS)


def swiglu_case(rows, width, scaled, dtype):
    generator = torch.Generator(DEVICE).manual_seed(rows + width)
    gate = (torch.randn(rows, width, generator=generator, device=DEVICE) * 4).to(dtype).requires_grad_()
    up = torch.randn(rows, width, generator=generator, device=DEVICE).to(dtype).requires_grad_()
    scale = torch.rand(rows, 1, generator=generator, device=DEVICE).to(dtype).requires_grad_() if scaled else None
    grad_h = torch.randn(rows, width, generator=generator, device=DEVICE).to(dtype)
    return gate, up, scale, grad_h


def run(fn, gate, up, scale, grad_h):
    h = fn(gate, up, scale)
    return h, torch.autograd.grad(h, [t for t in (gate, up, scale) if t is not None], grad_h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, case, dtype):
    gate, up, scale, grad_h = swiglu_case(*case, dtype)
    h, grads = run(swiglu, gate, up, scale, grad_h)
    h_ref, grads_ref = run(swiglu_ref, *as_fp64(gate, up, scale), grad_h.double())
    torch.cuda.synchronize()
    guarded.check()
    names = ("h", "dgate", "dup", "dscale")[: 1 + len(grads)]
    assert_close_to_reference(names, (h, *grads), (h_ref, *grads_ref), dtype, GPU_TOLERANCES[dtype])


def test_reruns_are_bitwise_equal(kernel_path):
    gate, up, scale, grad_h = swiglu_case(*CASES["shared_expert_768"], torch.bfloat16)
    first = run(swiglu, gate, up, scale, grad_h)
    second = run(swiglu, gate, up, scale, grad_h)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
