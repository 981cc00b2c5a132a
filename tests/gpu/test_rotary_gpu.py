"""rotary's Triton kernel on CUDA: bf16 and fp32 forward and input gradient against the reference at the model's
shapes, NaN-filled buffers with guarded ends, bitwise reruns. Auto dispatch takes the kernel on CUDA since this
file passed on the H200 (ops/rotary/__init__.py).

Shapes: x [B, T, H, D]; the benchmark models rotate q [1, 8192, 16, 128] and k [1, 8192, 4 or 2, 128] fully
(qwen3_moe-like), or a quarter of 256-dim heads (qwen3_next-like).
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
from kernel_fixtures import forced_kernel_path, guarded_outputs
from norm_conv_cases import GPU_GUARD_ELEMENTS, GPU_TOLERANCES, assert_close_to_reference, rotary_case, run_rotary

from moe_tune.ops.rotary import apply_rotary, kernels
from moe_tune.ops.rotary.reference import rotary_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

kernel_path = forced_kernel_path(kernels, "_rotary_kernel", on_gpu=True)
guarded = guarded_outputs(kernels, GPU_GUARD_ELEMENTS)

# (B, T, H, D), R, equal table halves
CASES = {
    "moe_q": ((1, 8192, 16, 128), 128, True),
    "moe_k": ((1, 8192, 4, 128), 128, True),
    "next_q_partial": ((1, 8192, 16, 256), 64, True),
    # Odd rows and dims, unequal halves (scaled or sectioned tables).
    "odd_unequal": ((2, 1001, 5, 80), 48, False),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, case, dtype):
    shape, rotary_dim, equal_halves = case
    x, cos, sin, grad_y = rotary_case(shape, rotary_dim, dtype, equal_halves, device=DEVICE)
    y, dx = run_rotary(apply_rotary, x, cos, sin, grad_y)
    x64 = x.detach().double().requires_grad_()
    y_ref, dx_ref = run_rotary(rotary_ref, x64, cos.double(), sin.double(), grad_y.double())
    torch.cuda.synchronize()
    guarded.check()
    assert_close_to_reference(("y", "dx"), (y, dx), (y_ref, dx_ref), dtype, GPU_TOLERANCES[dtype])
    assert torch.equal(y[..., rotary_dim:], x.detach()[..., rotary_dim:])


def test_reruns_are_bitwise_equal(kernel_path):
    x, cos, sin, grad_y = rotary_case((1, 8192, 16, 128), 128, torch.bfloat16, device=DEVICE)
    first = run_rotary(apply_rotary, x, cos, sin, grad_y)
    second = run_rotary(apply_rotary, x, cos, sin, grad_y)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
