"""ops.fp8: the quantization reference against hand-computed values and its properties, fp8_linear_ref against the
explicit formulas, the Triton kernels in the interpreter against the reference (quantize_groups_fp8; the linear's
output, dx and dbias on odd shapes, NaN-filled buffers with guarded ends), input checks and dispatch.

Shapes: x [..., I]; weight [O, I] float8_e4m3fn; scale_inv [ceil(O/128), ceil(I/128)]; bias [O]; dy [..., O].
"""

import math

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.fp8 import fp8_linear, kernels
    from moe_tune.ops.fp8.reference import (
        AMAX_FLOOR,
        E4M3_MAX,
        FP8_DTYPE,
        block_index,
        dequantize_weight,
        fp8_linear_ref,
        quantize_groups,
        quantize_weight,
    )

# Kernel against reference (fp64 comparison). The quantized operands are equal (quantize_groups_fp8 is checked
# value for value), so fp32 outputs differ by the summation order only (measured at most 1.5e-6 on outputs of
# magnitude 5); fp16/bf16 by one rounding of the output at the most (half an ulp: 4.9e-4 / 3.9e-3 relative).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself.
E4M3_RELATIVE_STEP = 2.0**-4
# The smallest e4m3 subnormal (2^-9, in units of the block's scale): half of it is the absolute rounding error there.
E4M3_SUBNORMAL_STEP = 2.0**-9
# Past the end of every kernel buffer: a whole 64 x 128 quantization tile.
GUARD_ELEMENTS = 8192
# The guard of an fp8 buffer: GuardedBuffers' 1234.5 is beyond e4m3's range.
FP8_GUARD_VALUE = 448.0

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels, "_fp8_gemm_kernel", on_gpu=False)


class Fp8GuardedBuffers(GuardedBuffers):
    """GuardedBuffers that also guard float8_e4m3fn buffers (NaN-filled, followed by FP8_GUARD_VALUE)."""

    def alloc(self, shape, dtype, device):
        if dtype == FP8_DTYPE:
            return self._alloc(shape, dtype, device, float("nan"), FP8_GUARD_VALUE)
        return super().alloc(shape, dtype, device)


@pytest.fixture
def guarded(monkeypatch, kernel_path):
    buffers = Fp8GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernels, "_alloc", buffers.alloc)
    return buffers


def values_of(q):
    """fp8 values as fp32 (the interpreter writes +0 where the conversion gives -0: equal as values)."""
    return q.float()


def ramp(*shape, gen, scale_range=(-3.0, 3.0)):
    """Random values whose magnitude spans 10^-3..10^3 along the last dim, so blocks have different scales."""
    magnitudes = torch.logspace(*scale_range, shape[-1])
    return torch.randn(*shape, generator=gen) * magnitudes


# ---- the quantization reference -------------------------------------------------------------------------------

# One group of 128 whose amax is 448 (scale 1): each value is its own e4m3 rounding case.
HAND_VALUES = [
    (448.0, 448.0),  # the amax itself
    (17.0, 16.0),  # tie between 16 and 18 (step 2): to the even mantissa
    (19.0, 20.0),  # tie between 18 and 20: to the even mantissa
    (-17.5, -18.0),  # nearer 18
    (31.0, 32.0),  # rounds up into the next binade
    (2.0**-9, 2.0**-9),  # the smallest subnormal
    (2.0**-10, 0.0),  # tie between 0 and 2^-9: to even (0)
    (3 * 2.0**-10, 2.0**-8),  # tie between 2^-9 and 2^-8: to even (2^-8)
    (0.3, 0.3125),  # normal: 0.3 = 1.2 * 2^-2, nearest 1.25 * 2^-2
]


def hand_row():
    row = torch.zeros(1, 130)
    for column, (value, _) in enumerate(HAND_VALUES):
        row[0, column] = value
    # A second group of 2 columns: amax 2 gives scale 2/448.
    row[0, 128:] = torch.tensor([2.0, -1.0])
    return row


def check_hand_values(x_q, scale):
    assert scale.shape == (1, 2)
    assert scale[0, 0].item() == 1.0
    assert scale[0, 1].item() == pytest.approx(2.0 / 448, rel=1e-7)
    expected = torch.zeros(130)
    for column, (_, rounded) in enumerate(HAND_VALUES):
        expected[column] = rounded
    expected[128:] = torch.tensor([448.0, -224.0])
    assert torch.equal(values_of(x_q)[0], expected)


def test_reference_quantizes_hand_values():
    check_hand_values(*quantize_groups(hand_row()))


@pytest.mark.parametrize("shape", [(130, 300), (128, 128), (3, 100, 257)], ids=["odd", "one_block", "batched"])
def test_weight_block_scale_is_amax_over_448(shape):
    gen = torch.Generator().manual_seed(1)
    w = ramp(*shape, gen=gen)
    w_q, scale_inv = quantize_weight(w)
    rows, cols = shape[-2:]
    assert scale_inv.shape == (*shape[:-2], math.ceil(rows / 128), math.ceil(cols / 128))
    for r in range(scale_inv.shape[-2]):
        for c in range(scale_inv.shape[-1]):
            block = w[..., r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
            torch.testing.assert_close(scale_inv[..., r, c], block.abs().amax(dim=(-2, -1)) / E4M3_MAX)
    # Every block's largest value lands on the largest e4m3 value.
    assert values_of(w_q).abs().max() == E4M3_MAX


def test_scales_and_values_are_correctly_rounded_quotients():
    gen = torch.Generator().manual_seed(4)
    x = ramp(64, 1280, gen=gen)
    x_q, scale = quantize_groups(x)
    amax = x.abs().reshape(64, 10, 128).amax(-1)
    # fp32 operands: the fp64 quotient rounded to fp32 is the correctly rounded fp32 quotient.
    assert torch.equal(scale, (amax.double() / E4M3_MAX).float())
    quotient = (x.double() / scale.repeat_interleave(128, -1).double()).float()
    assert torch.equal(values_of(x_q), quotient.to(FP8_DTYPE).float())


@pytest.mark.parametrize("row_segments", [None, (200, 100)], ids=["plain", "segments"])
def test_dequantize_recovers_within_e4m3_precision(row_segments):
    gen = torch.Generator().manual_seed(2)
    w = ramp(300, 260, gen=gen)
    w_q, scale_inv = quantize_weight(w, row_segments)
    back = dequantize_weight(w_q, scale_inv, row_segments)
    full_scale = scale_inv[block_index(300, row_segments)][:, block_index(260)]
    bound = E4M3_RELATIVE_STEP * w.abs() + E4M3_SUBNORMAL_STEP / 2 * full_scale
    assert ((back - w).abs() <= bound).all()
    # Not a trivially loose bound: the error reaches a good part of it somewhere.
    assert ((back - w).abs() / bound).max() > 0.5


def test_zero_block_gets_the_floor_scale_and_zeros():
    w = torch.zeros(130, 140)
    w[:128, :128] = torch.randn(128, 128)
    w_q, scale_inv = quantize_weight(w)
    assert (scale_inv[1, :] == AMAX_FLOOR / E4M3_MAX).all() and scale_inv[0, 1] == AMAX_FLOOR / E4M3_MAX
    assert (values_of(w_q)[128:] == 0).all() and (values_of(w_q)[:, 128:] == 0).all()
    x_q, scale = quantize_groups(torch.zeros(3, 50))
    assert (values_of(x_q) == 0).all() and (scale == AMAX_FLOOR / E4M3_MAX).all()


def test_row_segments_restart_blocks():
    # Two segments of 200 rows: the second starts its own scale rows at row 200, not at 256.
    w = torch.ones(400, 100)
    w[200:256] = 100.0
    _, plain = quantize_weight(w)
    _, segmented = quantize_weight(w, (200, 200))
    assert plain.shape == (4, 1) and segmented.shape == (4, 1)
    # plain: rows 128..255 share a block with the 100s; segments: that block is rows 128..199, all ones.
    assert plain[1, 0] == 100.0 / E4M3_MAX and segmented[1, 0] == 1.0 / E4M3_MAX
    assert segmented[2, 0] == 100.0 / E4M3_MAX and segmented[3, 0] == 1.0 / E4M3_MAX
    # Blocks of ones alone are exact: rows 0..199 (both of segment 0's blocks) and 328..399.
    back = dequantize_weight(*quantize_weight(w, (200, 200)), (200, 200))
    assert torch.equal(back[:200], w[:200]) and torch.equal(back[328:], w[328:])


def test_group_segments_restart_groups():
    x = torch.ones(2, 300)
    x[:, 150:160] = 50.0
    _, scale = quantize_groups(x, (150, 150))
    # Segment 0: groups [0,128) [128,150); segment 1: [150,278) [278,300).
    assert scale.shape == (2, 4)
    assert (scale[:, 2] == 50.0 / E4M3_MAX).all() and (scale[:, [0, 1, 3]] == 1.0 / E4M3_MAX).all()


@pytest.mark.parametrize("segments", [(100, 100), (300, 0), (-1, 301)], ids=["short", "empty", "negative"])
def test_bad_segments_raise(segments):
    with pytest.raises(ValueError, match=r"segments .* must be positive and sum to the dim's size 300"):
        quantize_groups(torch.ones(2, 300), segments)
    with pytest.raises(ValueError, match=r"segments .* must be positive and sum to the dim's size 300"):
        quantize_weight(torch.ones(300, 8), segments)


# ---- fp8_linear_ref against the formulas ----------------------------------------------------------------------


def linear_case(lead, in_features, out_features, dtype, has_bias, seed=0):
    """x [*lead, I] (requires grad), weight [O, I] fp8 with scale_inv, bias [O] (requires grad) or None, dy."""
    gen = torch.Generator().manual_seed(seed)
    x = ramp(*lead, in_features, gen=gen, scale_range=(-1.0, 1.0)).to(dtype).requires_grad_()
    weight, scale_inv = quantize_weight(ramp(out_features, in_features, gen=gen, scale_range=(-2.0, 0.0)))
    bias = torch.randn(out_features, generator=gen).to(dtype).requires_grad_() if has_bias else None
    grad_y = ramp(*lead, out_features, gen=gen, scale_range=(-1.0, 1.0)).to(dtype)
    return x, weight, scale_inv, bias, grad_y


def run_linear(fn, x, weight, scale_inv, bias, grad_y):
    """(y, dx, dbias or None) of fn on fresh leaves."""
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    y = fn(x, weight, scale_inv, bias)
    y.backward(grad_y)
    return y.detach(), x.grad, bias.grad if bias is not None else None


def test_reference_is_the_formula():
    x, weight, scale_inv, bias, grad_y = linear_case((2, 5), 300, 130, torch.float32, True)
    y, dx, dbias = run_linear(fp8_linear_ref, x, weight, scale_inv, bias, grad_y)
    w = dequantize_weight(weight, scale_inv)
    # The explicit formulas, written out per group: x = x_q * scale per 128 columns.
    x_q, x_scale = quantize_groups(x.detach())
    x_deq = values_of(x_q) * x_scale.repeat_interleave(128, -1)[..., :300]
    torch.testing.assert_close(y, x_deq @ w.T + bias.detach(), atol=1e-5, rtol=1e-5)
    dy_q, dy_scale = quantize_groups(grad_y)
    dy_deq = values_of(dy_q) * dy_scale.repeat_interleave(128, -1)[..., :130]
    torch.testing.assert_close(dx, dy_deq @ w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dbias, grad_y.sum((0, 1)))
    # FP8 quantization moves the result visibly from the unquantized product (the test sees the quantization).
    assert (y - (x.detach() @ w.T + bias.detach())).abs().max() > 1e-3


def test_reference_returns_x_dtype_and_no_weight_gradient():
    x, weight, scale_inv, bias, grad_y = linear_case((7,), 100, 130, torch.float16, True)
    y, dx, dbias = run_linear(fp8_linear_ref, x, weight, scale_inv, bias, grad_y)
    assert y.dtype == dx.dtype == dbias.dtype == torch.float16
    assert y.shape == (7, 130) and dx.shape == (7, 100)


# ---- the Triton kernels in the interpreter ----------------------------------------------------------------------

QUANTIZE_CASES = {
    # K not a multiple of 128, rows not a multiple of the 64-row tile.
    "K300": ((37, 300), None),
    # One row, one partial group.
    "one_row_K100": ((1, 100), None),
    # Two segments of 200: four groups of 128, 72, 128, 72.
    "segments_200": ((5, 400), (200, 200)),
    # A segment narrower than a group, then one spanning several.
    "segments_50_300": ((70, 350), (50, 300)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", QUANTIZE_CASES.values(), ids=QUANTIZE_CASES.keys())
def test_quantize_kernel_equals_reference(guarded, case, dtype):
    shape, segments = case
    gen = torch.Generator().manual_seed(3)
    x = ramp(*shape, gen=gen, scale_range=(-9.0, 3.0)).to(dtype)
    # An all-zero group, and values in e4m3's subnormal range of their group.
    x[0, :50] = 0
    x_q, scale = kernels.quantize_groups_fp8(x, segments)
    x_q_ref, scale_ref = quantize_groups(x, segments)
    guarded.check()
    assert x_q.dtype == FP8_DTYPE and scale.is_contiguous()
    assert torch.equal(scale, scale_ref)
    assert torch.equal(values_of(x_q), values_of(x_q_ref))


def test_quantize_kernel_hand_values(guarded):
    check_hand_values(*kernels.quantize_groups_fp8(hand_row()))
    x_q, scale = kernels.quantize_groups_fp8_for_gemm(hand_row())
    guarded.check()
    assert scale.stride() == (1, 1)
    check_hand_values(x_q, scale)


# (leading dims, I, O, has bias)
LINEAR_CASES = {
    # A single row; I under one group, O one row over a weight block.
    "M1_I100_O130_bias": ((1,), 100, 130, True),
    # 37 rows: no multiple of the row tile; I and O both off the 128 grid.
    "M37_I300_O257": ((37,), 300, 257, False),
    # Leading batch dims.
    "batch_2x3x7_I300_O130_bias": ((2, 3, 7), 300, 130, True),
    # Everything on the 128 grid.
    "M40_I256_O128_bias": ((40,), 256, 128, True),
}
LINEAR_DTYPES = {
    torch.float32: LINEAR_CASES,
    torch.float16: {k: LINEAR_CASES[k] for k in ("M37_I300_O257", "batch_2x3x7_I300_O130_bias")},
    torch.bfloat16: {k: LINEAR_CASES[k] for k in ("M1_I100_O130_bias",)},
}


@pytest.mark.parametrize(
    "dtype, case",
    [pytest.param(dtype, case, id=f"{str(dtype)[6:]}-{name}") for dtype, cases in LINEAR_DTYPES.items()
     for name, case in cases.items()],
)  # fmt: skip
def test_linear_kernel_matches_reference(guarded, case, dtype):
    lead, in_features, out_features, has_bias = case
    inputs = linear_case(lead, in_features, out_features, dtype, has_bias)
    y, dx, dbias = run_linear(fp8_linear, *inputs)
    guarded.check()
    y_ref, dx_ref, dbias_ref = run_linear(fp8_linear_ref, *inputs)
    tol = TOLERANCES[dtype]
    assert y.dtype == dx.dtype == dtype
    assert y.shape == (*lead, out_features) and dx.shape == (*lead, in_features)
    torch.testing.assert_close(y.double(), y_ref.double(), **tol)
    torch.testing.assert_close(dx.double(), dx_ref.double(), **tol)
    if has_bias:
        torch.testing.assert_close(dbias.double(), dbias_ref.double(), **tol)
    # Quantize x, GEMM; quantize dy, GEMM.
    assert len(guarded.buffers) == 6


def test_linear_kernel_without_rows(guarded):
    x, weight, scale_inv, bias, grad_y = linear_case((0,), 100, 130, torch.float32, True)
    y, dx, dbias = run_linear(fp8_linear, x, weight, scale_inv, bias, grad_y)
    assert y.shape == (0, 130) and dx.shape == (0, 100) and (dbias == 0).all()


# ---- dispatch and input checks ----------------------------------------------------------------------------------


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, weight, scale_inv, bias, _ = linear_case((5,), 100, 130, torch.float32, True)
    assert torch.equal(fp8_linear(x, weight, scale_inv, bias), fp8_linear_ref(x, weight, scale_inv, bias))


def test_forced_kernel_that_cannot_run_raises(kernel_path):
    x, weight, scale_inv, _, _ = linear_case((5,), 100, 130, torch.float64, False)
    with pytest.raises(RuntimeError, match="fp8_linear has no Triton kernel"):
        fp8_linear(x, weight, scale_inv)


def bad_inputs():
    weight, scale_inv = quantize_weight(torch.randn(130, 300))
    frozen_weight = weight.clone().requires_grad_()
    return [
        pytest.param(dict(weight=weight.float()), r"weight: shape \(130, 300\) dtype torch.float32 must be a "
                     r"float8_e4m3fn \[O, I\]", id="weight_dtype"),
        pytest.param(dict(weight=weight[0]), r"weight: shape \(300,\) .* must be a float8_e4m3fn \[O, I\]",
                     id="weight_1d"),
        pytest.param(dict(weight=frozen_weight), r"weight: requires_grad must be False", id="weight_grad"),
        pytest.param(dict(scale_inv=scale_inv[:1]), r"scale_inv: shape \(1, 3\) dtype torch.float32 must be "
                     r"float32 \[2, 3\] \(ceil\(O/128\), ceil\(I/128\)\) for weight \(130, 300\)", id="scale_shape"),
        pytest.param(dict(scale_inv=scale_inv.half()), r"scale_inv: .* dtype torch.float16 must be float32",
                     id="scale_dtype"),
        pytest.param(dict(x=torch.ones(4, 200)), r"x: shape \(4, 200\) must be \[..., I\] with I = 300",
                     id="x_features"),
        pytest.param(dict(x=torch.ones(4, 300, dtype=torch.int32)), r"x: dtype torch.int32 must be bf16, fp16",
                     id="x_int"),
        pytest.param(dict(x=torch.ones(4, 300).to(FP8_DTYPE)), r"x: dtype torch.float8_e4m3fn must be bf16",
                     id="x_fp8"),
        pytest.param(dict(bias=torch.ones(129)), r"bias: shape \(129,\) must be \[O\] \(130,\)", id="bias_shape"),
        pytest.param(dict(bias=torch.ones(130, dtype=torch.int64)), r"bias: dtype torch.int64 must be bf16",
                     id="bias_int"),
    ]  # fmt: skip


@pytest.mark.parametrize("bad, message", bad_inputs())
def test_bad_inputs_raise(bad, message):
    weight, scale_inv = quantize_weight(torch.randn(130, 300))
    inputs = {"x": torch.ones(4, 300), "weight": weight, "scale_inv": scale_inv, "bias": None, **bad}
    with pytest.raises(ValueError, match=message):
        fp8_linear(**inputs)
