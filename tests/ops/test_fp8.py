"""ops.fp8: the quantization reference against hand-computed values and its properties, fp8_linear_ref against the
explicit formula (the dequantized weight, x and dy unquantized), the Triton dequantization kernel in the interpreter
bit for bit against the reference on odd shapes, fp8_linear's kernel path (output, dx and dbias) against the reference
and against F.linear on the dequantized weight in x's dtype, what it saves for backward, input checks and dispatch.

Shapes: x [..., I]; weight [O, I] float8_e4m3fn; scale_inv [ceil(O/128), ceil(I/128)]; bias [O]; dy [..., O].
"""

import math

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import torch.nn.functional as F
    from moe_tune.ops.fp8 import fp8_linear, kernels
    from moe_tune.ops.fp8.reference import (
        AMAX_FLOOR,
        E4M3_MAX,
        FP8_DTYPE,
        block_index,
        dequantize_weight,
        fp8_linear_ref,
        quantize_weight,
    )

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Kernel path against the reference, in units of the reference's largest value (atol = tolerance * max|ref|, rtol =
# tolerance). fp32: the same fp32 operands, the summation order only; fp16/bf16: the weight rounded once to x's
# dtype (2^-11 / 2^-8 relative per element) and one rounding of the output. Largest measured over LINEAR_CASES and
# the random cases (y, dx; dbias 0): fp32 1.0e-7, 0; fp16 9.6e-4, 5.9e-4; bf16 5.7e-3, 6.5e-3. About twice those.
TOLERANCES = {torch.float32: 2e-7, torch.float16: 2e-3, torch.bfloat16: 1.3e-2}
# Kernel path against F.linear on deq(W) rounded to x's dtype: the same operands through torch's matmul, equal bit
# for bit on the CPU (measured); one output ulp allowed for a GEMM that orders the reduction otherwise.
SAME_OPERANDS_TOLERANCES = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself.
E4M3_RELATIVE_STEP = 2.0**-4
# The smallest e4m3 subnormal (2^-9, in units of the block's scale): half of it is the absolute rounding error there.
E4M3_SUBNORMAL_STEP = 2.0**-9
# Past the end of every kernel buffer: more than a whole 64 x 128 dequantization tile.
GUARD_ELEMENTS = 8192

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels, "_dequantize_weight_kernel", on_gpu=False)


@pytest.fixture
def guarded(monkeypatch, kernel_path):
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernels, "_alloc", buffers.alloc)
    return buffers


def values_of(q):
    """fp8 values as fp32 (the interpreter writes +0 where the conversion gives -0: equal as values)."""
    return q.float()


def ramp(*shape, gen, scale_range=(-3.0, 3.0)):
    """Random values whose magnitude spans 10^-3..10^3 along the last dim, so blocks have different scales."""
    magnitudes = torch.logspace(*scale_range, shape[-1])
    return torch.randn(*shape, generator=gen) * magnitudes


def bits_of(t):
    """A float tensor's bits as integers of its width (bitwise comparison, -0 and +0 apart)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


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
    # One weight row: its two column blocks are the groups of 128 and 2.
    check_hand_values(*quantize_weight(hand_row()))


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
    # 64 one-row weights: each row's blocks are 1 x 128.
    x_q, scale = (t.squeeze(1) for t in quantize_weight(x.unsqueeze(1)))
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
    x_q, scale = quantize_weight(torch.zeros(3, 1, 50))
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


@pytest.mark.parametrize("segments", [(100, 100), (300, 0), (-1, 301)], ids=["short", "empty", "negative"])
def test_bad_segments_raise(segments):
    with pytest.raises(ValueError, match=r"segments .* must be positive and sum to the dim's size 300"):
        quantize_weight(torch.ones(300, 8), segments)


# ---- fp8_linear_ref against the formula ------------------------------------------------------------------------


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
    # The explicit formula in fp64, the weight written out per 128 x 128 block.
    full_scale = scale_inv.double().repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :300]
    w = values_of(weight).double() * full_scale
    torch.testing.assert_close(y.double(), x.detach().double() @ w.T + bias.detach().double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.double(), grad_y.double() @ w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dbias, grad_y.sum((0, 1)))


def test_reference_returns_x_dtype_and_no_weight_gradient():
    x, weight, scale_inv, bias, grad_y = linear_case((7,), 100, 130, torch.float16, True)
    y, dx, dbias = run_linear(fp8_linear_ref, x, weight, scale_inv, bias, grad_y)
    assert y.dtype == dx.dtype == dbias.dtype == torch.float16
    assert y.shape == (7, 130) and dx.shape == (7, 100)
    assert weight.grad is None and not weight.requires_grad


# ---- the dequantization kernel in the interpreter ----------------------------------------------------------------

# (O, I): every tile and scale-block edge case the kernel indexes.
DEQUANTIZE_SHAPES = {
    "1x1": (1, 1),  # one element: one partial block
    "1x300": (1, 300),  # one row over three column blocks
    "300x1": (300, 1),  # one column over three row blocks
    "130x257": (130, 257),  # neither dim a multiple of 128 (or of the 64-row tile)
    "257x130": (257, 130),
    "128x128": (128, 128),  # exactly one block
    "200x384": (200, 384),  # columns on the grid, rows not
}


def odd_weight(out_features, in_features, seed=3):
    """A weight over 10^-9..10^3 (subnormal e4m3 codes in its blocks), its first block all zero when it has two or
    more."""
    gen = torch.Generator().manual_seed(seed)
    w = ramp(out_features, in_features, gen=gen, scale_range=(-9.0, 3.0))
    if out_features > 128 or in_features > 128:
        w[:128, :128] = 0
    return quantize_weight(w)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("shape", DEQUANTIZE_SHAPES.values(), ids=DEQUANTIZE_SHAPES.keys())
def test_dequantize_kernel_is_bitwise_reference(guarded, shape, dtype):
    weight, scale_inv = odd_weight(*shape)
    out = kernels.dequantize_weight_fp8(weight, scale_inv, dtype)
    guarded.check()
    expected = dequantize_weight(weight, scale_inv).to(dtype)
    assert out.dtype == dtype and out.shape == shape
    assert torch.equal(bits_of(out), bits_of(expected))
    if min(shape) > 1 and max(shape) > 128:
        assert (out[:128, :128] == 0).all() and out.abs().max() > 0


def test_dequantize_kernel_rounds_ties_to_even(guarded):
    """Products exactly halfway between two values of the output dtype: round to the even one (a truncating or
    half-up conversion gives the odd one)."""
    # Block 0's scale 1 + 2^-7 + 2^-8 times a power of two lies halfway between two bf16 values (step 2^-7 at 1):
    # to even, 1 + 2^-6. Block 1's 1 + 2^-10 + 2^-11 likewise in fp16 (step 2^-10): 1 + 2^-9.
    scale_inv = torch.tensor([[1 + 2.0**-7 + 2.0**-8, 1 + 2.0**-10 + 2.0**-11]])
    codes = torch.tensor([1.0, -2.0, 0.5, 256.0, -448.0, 0.0, 2.0**-9, 3.0])
    weight = torch.zeros(1, 256)
    weight[0, : len(codes)] = codes
    weight[0, 128 : 128 + len(codes)] = codes
    weight = weight.to(FP8_DTYPE)
    bf16 = kernels.dequantize_weight_fp8(weight, scale_inv, torch.bfloat16)
    fp16 = kernels.dequantize_weight_fp8(weight, scale_inv, torch.float16)
    guarded.check()
    assert bf16[0, 0].item() == 1 + 2.0**-6 and bf16[0, 1].item() == -2 * (1 + 2.0**-6)
    assert fp16[0, 128].item() == 1 + 2.0**-9 and fp16[0, 129].item() == -2 * (1 + 2.0**-9)
    for out, dtype in ((bf16, torch.bfloat16), (fp16, torch.float16)):
        assert torch.equal(bits_of(out), bits_of(dequantize_weight(weight, scale_inv).to(dtype)))


# ---- fp8_linear's kernel path in the interpreter --------------------------------------------------------------

# (leading dims, I, O, has bias)
LINEAR_CASES = {
    # A single row; I under one block, O one row over a weight block.
    "M1_I100_O130_bias": ((1,), 100, 130, True),
    # 37 rows; I and O both off the 128 grid.
    "M37_I300_O257": ((37,), 300, 257, False),
    # Leading batch dims.
    "batch_2x3x7_I300_O130_bias": ((2, 3, 7), 300, 130, True),
    # Everything on the 128 grid.
    "M40_I256_O128_bias": ((40,), 256, 128, True),
    # One input feature, one output feature.
    "M5_I1_O1_bias": ((5,), 1, 1, True),
}
LINEAR_PARAMS = [pytest.param(dtype, case, id=f"{name_of}-{name}") for dtype, name_of in DTYPES.items()
                 for name, case in LINEAR_CASES.items()]  # fmt: skip


def assert_near(name, value, reference, tolerance):
    scale = reference.double().abs().max().item()
    torch.testing.assert_close(value.double(), reference.double(), atol=tolerance * scale, rtol=tolerance,
                               msg=lambda text: f"{name}: {text}")  # fmt: skip


@pytest.mark.parametrize("dtype, case", LINEAR_PARAMS)
def test_linear_kernel_matches_reference(guarded, case, dtype):
    lead, in_features, out_features, has_bias = case
    inputs = linear_case(lead, in_features, out_features, dtype, has_bias)
    weight = inputs[1]
    y, dx, dbias = run_linear(fp8_linear, *inputs)
    guarded.check()
    # Forward and backward each dequantize the weight once, into x's dtype.
    assert [b[0].dtype for b in guarded.buffers] == [dtype, dtype]
    y_ref, dx_ref, dbias_ref = run_linear(fp8_linear_ref, *inputs)
    assert y.dtype == dx.dtype == dtype
    assert y.shape == (*lead, out_features) and dx.shape == (*lead, in_features)
    assert_near("y", y, y_ref, TOLERANCES[dtype])
    assert_near("dx", dx, dx_ref, TOLERANCES[dtype])
    if has_bias:
        assert dbias.dtype == dtype
        assert_near("dbias", dbias, dbias_ref, TOLERANCES[dtype])
    assert weight.grad is None and not weight.requires_grad


def random_linear_cases(count, seed):
    """(leading dims, I, O, has bias, seed) drawn at random: dims from 1 to 400, zero to two leading dims."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (), generator=gen))

    return [(tuple(draw(1, 9) for _ in range(draw(0, 2))) or (draw(1, 40),), draw(1, 400), draw(1, 400),
             bool(draw(0, 1)), index) for index in range(count)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("case", random_linear_cases(4, seed=35), ids=lambda c: f"lead{c[0]}_I{c[1]}_O{c[2]}")
def test_linear_is_f_linear_on_the_dequantized_weight(kernel_path, case, dtype):
    """The property that defines the op: fp8_linear(x, W_q, s, b) is F.linear(x, deq(W_q, s) in x's dtype, b)."""
    lead, in_features, out_features, has_bias, seed = case
    x, weight, scale_inv, bias, grad_y = linear_case(lead, in_features, out_features, dtype, has_bias, seed)
    y, dx, dbias = run_linear(fp8_linear, x, weight, scale_inv, bias, grad_y)
    w = dequantize_weight(weight, scale_inv).to(dtype)
    y_twin, dx_twin, dbias_twin = run_linear(lambda x, _w, _s, b: F.linear(x, w, b), x, weight, scale_inv, bias,
                                             grad_y)  # fmt: skip
    assert_near("y", y, y_twin, SAME_OPERANDS_TOLERANCES[dtype])
    assert_near("dx", dx, dx_twin, SAME_OPERANDS_TOLERANCES[dtype])
    if has_bias:
        assert_near("dbias", dbias, dbias_twin, SAME_OPERANDS_TOLERANCES[dtype])


def test_linear_kernel_saves_only_the_fp8_weight_and_scales(kernel_path):
    x, weight, scale_inv, bias, grad_y = linear_case((3, 4), 300, 130, torch.bfloat16, True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_linear(x, weight, scale_inv, bias)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(FP8_DTYPE, (130, 300)), (torch.float32, (2, 3))]
    assert saved[0].data_ptr() == weight.data_ptr() and saved[1].data_ptr() == scale_inv.data_ptr()
    y.backward(grad_y)
    assert weight.grad is None and x.grad is not None


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
