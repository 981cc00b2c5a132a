"""ops.fp8's kernel path on CUDA: the Triton dequantization kernel bit for bit against the reference, fp8_linear's
output, dx and dbias against fp8_linear_ref and against F.linear on the dequantized weight in x's dtype (cuBLAS) on
odd and real shapes in bf16, fp16 and fp32, NaN-filled buffers with guarded ends, no dequantized weight kept past the
call, bitwise reruns.

Shapes: x [..., I]; weight [O, I] float8_e4m3fn; scale_inv [ceil(O/128), ceil(I/128)]; the real shape is a 30B-A3B
attention projection over B1 T8192: M 8192, I 2048, O 4096.
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
import torch
import torch.nn.functional as F
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path

from moe_tune.ops.fp8 import fp8_linear, kernels
from moe_tune.ops.fp8.reference import dequantize_weight, fp8_linear_ref, quantize_weight

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# Against the reference's fp32 result (x, bias and dy upcast), errors relative to the reference's largest value:
# atol = TOLERANCE * max|ref|, rtol = TOLERANCE. fp32: the same operands, cuBLAS's summation order; fp16/bf16: the
# weight rounded once to x's dtype and one rounding of the output. On the CPU the largest were fp32 1.0e-7, fp16
# 9.6e-4, bf16 6.5e-3 (tests/ops/test_fp8.py); these bounds are not yet measured on the H200.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}
# Against F.linear on deq(W) in x's dtype: the same operands through the same cuBLAS GEMM; one output ulp.
SAME_OPERANDS_TOLERANCES = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
GUARD_ELEMENTS = 65536
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (leading dims, I, O, has bias)
CASES = {
    "M1_I100_O130_bias": ((1,), 100, 130, True),
    "M37_I300_O257": ((37,), 300, 257, False),
    "batch_2x3x7_I300_O130_bias": ((2, 3, 7), 300, 130, True),
    "M5_I1_O1_bias": ((5,), 1, 1, True),
    "M65_I768_O2048_bias": ((65,), 768, 2048, True),
    "M8192_I2048_O4096_bias": ((8192,), 2048, 4096, True),
}
# (O, I) of the dequantization kernel: one element, one row or column, dims off the 128 grid, the real shape.
DEQUANTIZE_SHAPES = {"1x1": (1, 1), "1x300": (1, 300), "300x1": (300, 1), "130x257": (130, 257),
                     "4096x2048": (4096, 2048)}  # fmt: skip

kernel_path = forced_kernel_path(kernels, "_dequantize_weight_kernel", on_gpu=True)


@pytest.fixture
def guarded(monkeypatch, kernel_path):
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernels, "_alloc", buffers.alloc)
    return buffers


def linear_case(lead, in_features, out_features, dtype, has_bias):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(*lead, in_features, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen, device=DEVICE) * in_features**-0.5
    weight, scale_inv = quantize_weight(w)
    bias = torch.randn(out_features, generator=gen, device=DEVICE).to(dtype) if has_bias else None
    grad_y = torch.randn(*lead, out_features, generator=gen, device=DEVICE).to(dtype)
    return x, weight, scale_inv, bias, grad_y


def run_linear(fn, x, weight, scale_inv, bias, grad_y):
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    y = fn(x, weight, scale_inv, bias)
    y.backward(grad_y)
    return y.detach(), x.grad, bias.grad if bias is not None else None


def assert_near(name, value, reference, tolerance, record_property):
    scale = reference.float().abs().max().item()
    # The measured error in the table's unit (--junitxml keeps it): max |value - ref| over max |ref|.
    record_property(f"{name}_err", (value.float() - reference.float()).abs().max().item() / scale)
    torch.testing.assert_close(value.float(), reference.float(), atol=tolerance * scale, rtol=tolerance,
                               msg=lambda text: f"{name}: {text}")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("shape", DEQUANTIZE_SHAPES.values(), ids=DEQUANTIZE_SHAPES.keys())
def test_dequantize_kernel_is_bitwise_reference(guarded, shape, dtype):
    w = torch.randn(*shape, device=DEVICE) * torch.logspace(-9, 3, shape[1], device=DEVICE)
    if max(shape) > 128 and min(shape) > 1:
        w[:128, :128] = 0
    weight, scale_inv = quantize_weight(w)
    out = kernels.dequantize_weight_fp8(weight, scale_inv, dtype)
    torch.cuda.synchronize()
    guarded.check()
    expected = dequantize_weight(weight, scale_inv).to(dtype)
    view = {4: torch.int32, 2: torch.int16}[out.element_size()]
    assert torch.equal(out.view(view), expected.view(view))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_linear_kernel_matches_reference(guarded, case, dtype, record_property):
    lead, in_features, out_features, has_bias = case
    x, weight, scale_inv, bias, grad_y = linear_case(lead, in_features, out_features, dtype, has_bias)
    y, dx, dbias = run_linear(fp8_linear, x, weight, scale_inv, bias, grad_y)
    torch.cuda.synchronize()
    guarded.check()
    assert len(guarded.buffers) == 2  # the weight dequantized forward and again backward
    as_fp32 = [t.float() if t is not None else None for t in (x, bias, grad_y)]
    y_ref, dx_ref, dbias_ref = run_linear(fp8_linear_ref, as_fp32[0], weight, scale_inv, as_fp32[1], as_fp32[2])
    assert y.dtype == dx.dtype == dtype
    assert_near("y", y, y_ref, TOLERANCES[dtype], record_property)
    assert_near("dx", dx, dx_ref, TOLERANCES[dtype], record_property)
    if has_bias:
        assert_near("dbias", dbias, dbias_ref, TOLERANCES[dtype], record_property)
    assert weight.grad is None


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_linear_is_f_linear_on_the_dequantized_weight(kernel_path, case, dtype, record_property):
    x, weight, scale_inv, bias, grad_y = linear_case(*case[:3], dtype, case[3])
    w = dequantize_weight(weight, scale_inv).to(dtype)
    got = run_linear(fp8_linear, x, weight, scale_inv, bias, grad_y)
    twin = run_linear(lambda x, _w, _s, b: F.linear(x, w, b), x, weight, scale_inv, bias, grad_y)
    for name, value, reference in zip(("y", "dx", "dbias"), got, twin):
        if reference is not None:
            assert_near(name, value, reference, SAME_OPERANDS_TOLERANCES[dtype], record_property)


def test_no_dequantized_weight_outlives_the_call(kernel_path):
    # 8 rows through a 4096 x 2048 weight: y is 64 KB, the dequantized weight 16 MB.
    x, weight, scale_inv, _, grad_y = linear_case((8,), 2048, 4096, torch.bfloat16, False)
    x.requires_grad_()
    fp8_linear(x, weight, scale_inv).backward(grad_y)  # cuBLAS's workspace allocated
    x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fp8_linear(x, weight, scale_inv)
    kept = torch.cuda.memory_allocated() - before
    assert kept < weight.numel() * 2 // 4, f"{kept} bytes kept after forward (y is {y.numel() * 2})"
    y.backward(grad_y)
    del y
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= x.numel() * 2 + 512  # x.grad only


def test_reruns_are_bitwise_equal(kernel_path):
    inputs = linear_case((8192,), 2048, 768, torch.bfloat16, True)
    first = run_linear(fp8_linear, *inputs)
    second = run_linear(fp8_linear, *inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
