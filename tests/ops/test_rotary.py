"""rotary: the reference against the model's rotation by angle (complex multiplication), the Triton kernel in the
interpreter against the reference (forward and the input gradient, partial rotary dims, unequal table halves, odd
row counts, NaN-filled buffers with guarded ends), input checks and dispatch.

Shapes: x [B, T, H, D]; cos, sin [T, R].
"""

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.engine.model.blocks import RotaryEmbedding
    from moe_tune.ops.rotary import apply_rotary, kernels
    from moe_tune.ops.rotary.reference import rotary_ref
    from norm_conv_cases import assert_close_to_reference, rotary_case, run_rotary

# Against the reference on fp64 copies, relative to each tensor's largest entry. fp32: the same two products and a
# sum per value, rounded in fp32; fp16: one rounding of y and of dx (2^-11 relative).
TOLERANCES = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
# Past the end of every kernel buffer: a whole tile of the widest head.
GUARD_ELEMENTS = kernels.BLOCK_M * 256

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels, "_rotary_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS)


# (B, T, H, D), R
CASES = {
    # Full rotary at the models' head dim; 37 rows of heads: not a multiple of the 16-row tile.
    "full_D128": ((1, 37, 1, 128), 128),
    # Partial rotary (qwen3_next: a quarter of a 256-dim head): dims R..D copied.
    "partial_D256_R64": ((1, 21, 3, 256), 64),
    # Odd head counts, two rows, a head dim that is no power of two and a rotary part whose half is not either.
    "B2_H5_D80_R48": ((2, 13, 5, 80), 48),
    # The smallest rotary part: one frequency.
    "R2": ((1, 9, 2, 6), 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(kernel_path, guarded, case, dtype):
    shape, rotary_dim = case
    x, cos, sin, grad_y = rotary_case(shape, rotary_dim, dtype)
    y, dx = run_rotary(apply_rotary, x, cos, sin, grad_y)
    x64 = x.detach().double().requires_grad_()
    y_ref, dx_ref = run_rotary(rotary_ref, x64, cos.double(), sin.double(), grad_y.double())
    guarded.check()
    assert_close_to_reference(("y", "dx"), (y, dx), (y_ref, dx_ref), dtype, TOLERANCES[dtype])
    # The unrotated dims come through bit for bit, both ways.
    assert torch.equal(y[..., rotary_dim:], x.detach()[..., rotary_dim:])
    assert torch.equal(dx[..., rotary_dim:], grad_y[..., rotary_dim:])


def test_kernel_does_not_assume_equal_table_halves(kernel_path, guarded):
    # Scaled or sectioned tables: the halves differ, so the backward is the transpose, not the inverse rotation.
    x, cos, sin, grad_y = rotary_case((1, 19, 2, 64), 64, torch.float32, equal_halves=False)
    y, dx = run_rotary(apply_rotary, x, cos, sin, grad_y)
    x64 = x.detach().double().requires_grad_()
    y_ref, dx_ref = run_rotary(rotary_ref, x64, cos.double(), sin.double(), grad_y.double())
    assert_close_to_reference(("y", "dx"), (y, dx), (y_ref, dx_ref), torch.float32, TOLERANCES[torch.float32])


def test_kernel_takes_the_models_table_shape_and_a_strided_x(kernel_path, guarded):
    rotary = RotaryEmbedding(head_dim=32, partial_rotary_factor=0.5, theta=10000.0)
    cos, sin = rotary.cos_sin(torch.cat([torch.arange(5), torch.arange(6)]))  # [1, T, 1, R]
    wide = torch.randn(1, 11, 3, 40)
    x = wide[..., :32].requires_grad_()  # not contiguous
    y = apply_rotary(x, cos, sin)
    expected = rotary_ref(x.detach(), cos.reshape(11, 16), sin.reshape(11, 16))
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


def test_kernel_is_deterministic(kernel_path):
    x, cos, sin, grad_y = rotary_case((1, 33, 4, 64), 64, torch.float16)
    first = run_rotary(apply_rotary, x, cos, sin, grad_y)
    second = run_rotary(apply_rotary, x, cos, sin, grad_y)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_reference_is_a_rotation_by_angle():
    # Pair (x_j, x_{j + R/2}) as a complex number: rotary multiplies it by cos_j + i sin_j = exp(i * angle_j).
    x, cos, sin, _ = rotary_case((1, 12, 2, 16), 16, torch.float64)
    x, cos, sin = x.detach(), cos.double(), sin.double()
    z = torch.complex(x[..., :8], x[..., 8:]) * torch.complex(cos[:, :8], sin[:, :8])[:, None, :]
    torch.testing.assert_close(rotary_ref(x, cos, sin), torch.cat([z.real, z.imag], -1))


def test_model_rotation_is_the_op():
    rotary = RotaryEmbedding(head_dim=16, partial_rotary_factor=1.0, theta=10000.0)
    positions = torch.cat([torch.arange(4), torch.arange(3)])
    x = torch.randn(1, 7, 2, 16)
    cos, sin = rotary.cos_sin(positions)
    assert torch.equal(rotary(x, positions), rotary_ref(x, cos.reshape(7, 16), sin.reshape(7, 16)))


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, cos, sin, _ = rotary_case((1, 10, 2, 32), 32, torch.float32)
    assert torch.equal(apply_rotary(x, cos, sin), rotary_ref(x, cos, sin))


def test_forced_kernel_that_cannot_run_raises(kernel_path):
    x, cos, sin, _ = rotary_case((1, 10, 2, 32), 32, torch.float64)
    with pytest.raises(RuntimeError, match="rotary has no Triton kernel"):
        apply_rotary(x, cos, sin)


BAD_INPUTS = [
    pytest.param(dict(x=torch.ones(10, 2, 32)), r"x: shape \(10, 2, 32\) must be \[B, T, H, D\]", id="x_3d"),
    pytest.param(dict(sin=torch.ones(10, 16)), r"sin: shape \(10, 16\) must match cos \(10, 32\)", id="sin_shape"),
    pytest.param(dict(cos=torch.ones(9, 32), sin=torch.ones(9, 32)), r"cos: shape \(9, 32\) must hold \[T, R\] with T = 10", id="cos_T"),
    pytest.param(dict(cos=torch.ones(10, 3), sin=torch.ones(10, 3)), r"rotary dim R \(3\) must be even", id="R_odd"),
    pytest.param(dict(cos=torch.ones(10, 34), sin=torch.ones(10, 34)), r"R \(34\) must be even, positive and <= x's head dim \(32\)", id="R_wide"),
    pytest.param(dict(cos=torch.ones(10, 32, dtype=torch.long), sin=torch.ones(10, 32, dtype=torch.long)), r"cos: dtype torch.int64 must be floating point", id="cos_int"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_bad_inputs_raise(bad, message):
    inputs = {"x": torch.ones(1, 10, 2, 32), "cos": torch.ones(10, 32), "sin": torch.ones(10, 32), **bad}
    with pytest.raises(ValueError, match=message):
        apply_rotary(**inputs)
