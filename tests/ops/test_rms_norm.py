"""rms_norm, rms_norm_with_input and add_rms_norm: the reference against the formula in fp64, the Triton kernels in the
interpreter against the reference (forward and every gradient, odd shapes, NaN-filled buffers with guarded ends; the
residual add's outputs and the handed-on input used alone or together), input checks and dispatch.

Shapes: x [..., N] viewed as M rows of N channels.
"""

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.common.grad_handoff import want_grad_in
    from moe_tune.ops.rms_norm import MAX_N, add_rms_norm, kernels, rms_norm, rms_norm_with_input
    from moe_tune.ops.rms_norm.reference import add_rms_norm_ref, rms_norm_ref
    from norm_conv_cases import as_fp64, assert_close_to_reference, rms_norm_case, run_rms_norm

# Against the reference on fp64 copies of the inputs (it computes in fp32). fp32: only the summation order differs (measured at most 1.5e-6 on outputs of
# magnitude 4). fp16: one rounding of the output (and, gated, the reference's extra rounding of the normalised
# value); measured at most 2e-3 absolute on outputs of magnitude 4, 3.4e-4 relative on gradients.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
# Past the end of every kernel buffer: a whole tile of the widest case.
GUARD_ELEMENTS = 4096

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


kernel_path = forced_kernel_path(kernels, "_rms_norm_fwd_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS)


# (shape, is_one_plus, gate_activation or None)
CASES = {
    # N not a power of two, three leading dims.
    "N48_3d": ((5, 7, 48), False, None),
    # 37 rows: not a multiple of any row tile; one_plus as qwen3_next's norms.
    "N100_one_plus": ((37, 100), True, None),
    # Per-head gated norm of a gated delta net (silu) with one_plus.
    "gated_silu": ((3, 13, 64), True, "silu"),
    # KDA's output norm (sigmoid gate).
    "gated_sigmoid": ((70, 128), False, "sigmoid"),
    # A model-width norm: one row per tile, the widest tile.
    "N2048": ((6, 2048), True, None),
    # Three channels: fewer than any tile (one channel is no test: there dx is pure rounding, 1 - x_hat^2).
    "N3": ((9, 3), False, None),
    # A single row.
    "one_row": ((1, 96), False, "silu"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(kernel_path, guarded, case, dtype):
    shape, is_one_plus, activation = case
    x, weight, gate, grad_y = rms_norm_case(shape, dtype, activation is not None)
    options = dict(eps=1e-6, is_one_plus=is_one_plus, gate_activation=activation or "silu")
    y, grads = run_rms_norm(rms_norm, x, weight, gate, grad_y, **options)
    y_ref, grads_ref = run_rms_norm(rms_norm_ref, *as_fp64(x, weight, gate), grad_y.double(), **options)
    guarded.check()
    tol = TOLERANCES[dtype]
    assert y.dtype == dtype and y.shape == shape
    torch.testing.assert_close(y.double(), y_ref, **tol)
    assert_close_to_reference(("dx", "dweight", "dgate")[: len(grads)], grads, grads_ref, dtype, tol)


def test_frozen_weight_gets_no_gradient_and_no_partial_sums(kernel_path, guarded):
    x, weight, gate, grad_y = rms_norm_case((11, 40), torch.float32, True, weight_requires_grad=False)
    y, (dx, dgate) = run_rms_norm(rms_norm, x, weight, gate, grad_y)
    _, (dx_ref, dgate_ref) = run_rms_norm(rms_norm_ref, x, weight, gate, grad_y)
    torch.testing.assert_close(dx, dx_ref, **TOLERANCES[torch.float32])
    torch.testing.assert_close(dgate, dgate_ref, **TOLERANCES[torch.float32])
    # y, rstd, dx, dz: no [programs, N] buffer for dw.
    assert [shape for _, _, shape in guarded.buffers] == [(11, 40), (11,), (11, 40), (11, 40)]


def test_empty_input(kernel_path):
    x, weight, _, _ = rms_norm_case((0, 32), torch.float32, False)
    y = rms_norm(x, weight)
    (dw,) = torch.autograd.grad(y.sum(), [weight])
    assert y.shape == (0, 32) and dw is not None and torch.equal(dw, torch.zeros(32))


def test_kernel_is_deterministic(kernel_path):
    x, weight, gate, grad_y = rms_norm_case((50, 72), torch.float16, True)
    first = run_rms_norm(rms_norm, x, weight, gate, grad_y)
    second = run_rms_norm(rms_norm, x, weight, gate, grad_y)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_reference_is_the_formula():
    x, weight, gate, _ = rms_norm_case((4, 6, 10), torch.float64, True)
    x, weight, gate = x.detach(), weight.detach(), gate.detach()
    normed = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5)
    # fp64 inputs are computed in fp32 too, as transformers' RMSNorm does (the families' alignment depends on it).
    fp32 = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5, is_one_plus=True), normed * (1 + weight), **fp32)
    gated = rms_norm_ref(x, weight, 1e-5, gate=gate, gate_activation="sigmoid")
    torch.testing.assert_close(gated, normed * weight * torch.sigmoid(gate), **fp32)
    gated = rms_norm_ref(x, weight, 1e-5, gate=gate, gate_activation="silu")
    torch.testing.assert_close(gated, normed * weight * gate * torch.sigmoid(gate), **fp32)


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, weight, gate, _ = rms_norm_case((5, 16), torch.float32, True)
    # Bitwise: the model's norms on the CPU are unchanged by the op.
    assert torch.equal(rms_norm(x, weight, gate=gate), rms_norm_ref(x, weight, gate=gate))


@pytest.mark.parametrize(
    "dtype, width, message",
    [(torch.float64, 16, "rms_norm has no Triton kernel"), (torch.float32, MAX_N + 1, "rms_norm has no")],
    ids=["fp64", "too_wide"],
)
def test_forced_kernel_that_cannot_run_raises(kernel_path, dtype, width, message):
    x, weight, _, _ = rms_norm_case((2, width), dtype, False)
    with pytest.raises(RuntimeError, match=message):
        rms_norm(x, weight)


BAD_INPUTS = [
    pytest.param(dict(weight=torch.ones(5)), r"weight: shape \(5,\) must be \[N\] \(8,\)", id="weight_shape"),
    pytest.param(dict(gate=torch.ones(3, 7)), r"gate: shape \(3, 7\) must match x \(3, 8\)", id="gate_shape"),
    pytest.param(dict(gate=torch.ones(3, 8, dtype=torch.float16)), r"gate: dtype torch.float16 must match x", id="gate_dtype"),
    pytest.param(dict(gate_activation="gelu"), r"gate_activation \('gelu'\) must be one of silu, sigmoid", id="act"),
    pytest.param(dict(eps=-1.0), r"eps \(-1.0\) must be >= 0", id="eps"),
    pytest.param(dict(x=torch.ones(3, 8, dtype=torch.int64)), r"x: dtype torch.int64 must be floating point", id="x_int"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_bad_inputs_raise(bad, message):
    inputs = {"x": torch.ones(3, 8), "weight": torch.ones(8), **bad}
    with pytest.raises(ValueError, match=message):
        rms_norm(**inputs)


# (shape, is_one_plus): the residual add before the norm.
ADD_CASES = {
    "N48_3d": ((5, 7, 48), False),
    "N100_one_plus": ((37, 100), True),
    "N2048": ((6, 2048), True),
    "N3": ((9, 3), False),
}


def add_case(shape, dtype, seed=0):
    x, weight, _, grad_y = rms_norm_case(shape, dtype, False, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    residual = (torch.randn(shape, generator=generator) * 3).to(dtype).requires_grad_()
    grad_h = torch.randn(shape, generator=generator).to(dtype)
    return x, residual, weight, grad_h, grad_y


def run_add(op, x, residual, weight, grad_h, grad_y, is_one_plus, uses=("h", "y")):
    """(h, y) and the gradients of x, residual and weight (those that require one) through the outputs `uses`."""
    h, y = op(x, residual, weight, 1e-6, is_one_plus)
    outputs, grads = zip(*[(t, g) for name, t, g in (("h", h, grad_h), ("y", y, grad_y)) if name in uses])
    # Through h alone the weight plays no part.
    leaves = [t for t in (x, residual, weight) if t.requires_grad and (t is not weight or "y" in uses)]
    return (h, y), torch.autograd.grad(outputs, leaves, grads)


@pytest.mark.parametrize("uses", [("h", "y"), ("y",), ("h",)], ids=["both", "norm_only", "sum_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_add_kernel_matches_reference(guarded, case, dtype, uses):
    shape, is_one_plus = case
    x, residual, weight, grad_h, grad_y = add_case(shape, dtype)
    (h, y), grads = run_add(add_rms_norm, x, residual, weight, grad_h, grad_y, is_one_plus, uses)
    # The reference's add in fp64 of the same values: the kernel rounds h to x's dtype first, so the norm is compared
    # against the reference's norm of that rounded h (as the eager add then norm computes it).
    h_ref = (x.double() + residual.double()).to(dtype)
    leaves = [t.detach().double().requires_grad_() for t in (x, residual, weight)]
    (_, y_ref), grads_ref = run_add(
        lambda a, r, w, eps, one_plus: (a + r, rms_norm_ref(a + r, w, eps, one_plus)), *leaves, grad_h.double(),
        grad_y.double(), is_one_plus, uses,
    )  # fmt: skip
    guarded.check()
    tol = TOLERANCES[dtype]
    assert torch.equal(h, h_ref) and h.dtype == dtype and y.dtype == dtype
    y_of_rounded = rms_norm_ref(h_ref.double(), weight.double(), 1e-6, is_one_plus)
    torch.testing.assert_close(y.double(), y_of_rounded, **tol)
    names = ("dx", "dresidual", "dweight")[: len(grads)]
    assert_close_to_reference(names, grads, grads_ref, dtype, tol)
    # x and residual get the one sum.
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("buffers", [("y",), ("h",), ("y", "h")], ids=["norm", "sum", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_add_kernel_writes_into_the_buffers_given(guarded, case, dtype, buffers):
    # y_buffer, h_buffer (NaN-filled, with a guard past their ends): y and h are views of them, bit for bit the y, h
    # and gradients of a call without them; nothing written past a buffer.
    shape, is_one_plus = case
    x, residual, weight, grad_h, grad_y = add_case(shape, dtype)
    expected, expected_grads = run_add(add_rms_norm, x, residual, weight, grad_h, grad_y, is_one_plus)
    given = {f"{name}_buffer": guarded.alloc(shape, dtype, x.device) for name in buffers}
    outputs, grads = run_add(lambda *args: add_rms_norm(*args, **given), x, residual, weight, grad_h, grad_y,
                             is_one_plus)  # fmt: skip
    guarded.check()
    for name, output, want in zip(("h", "y"), outputs, expected):
        buffer = given.get(f"{name}_buffer")
        assert buffer is None or (output.data_ptr() == buffer.data_ptr() and torch.equal(buffer, want)), name
    for got, want in zip((*outputs, *grads), (*expected, *expected_grads), strict=True):
        assert torch.equal(got, want)


def test_add_reference_leaves_the_buffer_alone(monkeypatch):
    # The reference returns a new tensor (the caller uses what is returned).
    monkeypatch.setenv("MOE_TUNE_KERNELS", "reference")
    x, residual, weight, _, _ = add_case((4, 10), torch.float32)
    buffers = torch.zeros(2, 4, 10)
    h, y = add_rms_norm(x, residual, weight, 1e-6, False, y_buffer=buffers[0], h_buffer=buffers[1])
    assert torch.equal(y, rms_norm_ref(x + residual, weight, 1e-6, False)) and not buffers.any()


def test_add_reference_is_the_eager_add_then_the_norm():
    x, residual, weight, _, _ = add_case((4, 6, 10), torch.bfloat16)
    h, y = add_rms_norm_ref(x, residual, weight, 1e-5, True)
    assert torch.equal(h, x + residual) and torch.equal(y, rms_norm_ref(x + residual, weight, 1e-5, True))


def test_add_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, residual, weight, _, _ = add_case((5, 16), torch.float32)
    h, y = add_rms_norm(x, residual, weight)
    h_ref, y_ref = add_rms_norm_ref(x, residual, weight)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


def test_add_kernel_frozen_weight_gets_no_gradient_and_no_partial_sums(kernel_path, guarded):
    x, residual, weight, grad_h, grad_y = add_case((11, 40), torch.float32)
    weight.requires_grad_(False)
    _, (dx, dresidual) = run_add(add_rms_norm, x, residual, weight, grad_h, grad_y, False)
    _, (dx_ref, _) = run_add(add_rms_norm_ref, x, residual, weight, grad_h, grad_y, False)
    torch.testing.assert_close(dx, dx_ref, **TOLERANCES[torch.float32])
    # y, rstd, h, dx: no [programs, N] buffer for dw.
    assert [shape for _, _, shape in guarded.buffers] == [(11, 40), (11,), (11, 40), (11, 40)]


def run_with_input(op, x, weight, grad_x, grad_y, is_one_plus, uses=("x", "y")):
    """(x handed on, y) and the gradients of x and weight (those that require one) through the outputs `uses`."""
    x_out, y = op(x, weight, 1e-6, is_one_plus)
    outputs, grads = zip(*[(t, g) for name, t, g in (("x", x_out, grad_x), ("y", y, grad_y)) if name in uses])
    leaves = [t for t in (x, weight) if t.requires_grad and (t is not weight or "y" in uses)]
    return (x_out, y), torch.autograd.grad(outputs, leaves, grads)


@pytest.mark.parametrize("uses", [("x", "y"), ("y",), ("x",)], ids=["both", "norm_only", "input_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_with_input_kernel_matches_reference(kernel_path, guarded, case, dtype, uses):
    # x's other gradient (grad_x, what the residual add sends back) and the norm's, against the fp64 reference where
    # autograd adds the two: summed in fp32 and rounded once, within one rounding of x's dtype.
    shape, is_one_plus = case
    x, _, weight, grad_x, grad_y = add_case(shape, dtype)
    (x_out, y), grads = run_with_input(rms_norm_with_input, x, weight, grad_x, grad_y, is_one_plus, uses)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)]
    reference = lambda a, w, eps, one_plus: (a, rms_norm_ref(a, w, eps, one_plus))  # noqa: E731
    (_, y_ref), grads_ref = run_with_input(reference, *leaves, grad_x.double(), grad_y.double(), is_one_plus, uses)
    tol = TOLERANCES[dtype]
    # x handed on as a view of the same memory, its values untouched.
    assert x_out.data_ptr() == x.data_ptr() and torch.equal(x_out, x) and x_out.grad_fn is not None
    torch.testing.assert_close(y.double(), y_ref, **tol)
    assert_close_to_reference(("dx", "dweight")[: len(grads)], grads, grads_ref, dtype, tol)
    if uses == ("x",):
        # Through x alone the gradient passes unchanged, and no kernel runs in backward.
        assert torch.equal(grads[0], grad_x)
    else:
        guarded.check()


def test_with_input_on_cpu_hands_on_x_itself(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    x, weight, _, _ = rms_norm_case((5, 16), torch.float32, False)
    x_out, y = rms_norm_with_input(x, weight, 1e-5, True)
    assert x_out is x and torch.equal(y, rms_norm_ref(x, weight, 1e-5, True))


def test_with_input_kernel_frozen_weight_gets_no_gradient_and_no_partial_sums(kernel_path, guarded):
    x, _, weight, grad_x, grad_y = add_case((11, 40), torch.float32)
    weight.requires_grad_(False)
    _, (dx,) = run_with_input(rms_norm_with_input, x, weight, grad_x, grad_y, False)
    reference = lambda a, w, eps, one_plus: (a, rms_norm_ref(a, w, eps, one_plus))  # noqa: E731
    _, (dx_ref,) = run_with_input(reference, x, weight, grad_x, grad_y, False)
    torch.testing.assert_close(dx, dx_ref, **TOLERANCES[torch.float32])
    # y, rstd, dx: no [programs, N] buffer for dw, and no buffer for a separate add.
    assert [shape for _, _, shape in guarded.buffers] == [(11, 40), (11,), (11, 40)]


def norm_input_grads(op, x, weight, grad_x, grad_y, is_one_plus, buffer=None, consumers=1):
    """The gradients of x and weight through rms_norm (op "norm") or rms_norm_with_input (its two outputs), called
    `consumers` times on x (the i-th call's output gradients scaled by i + 1, so that each makes another gradient of
    x), whose gradient is asked for in `buffer` (want_grad_in) where one is given."""
    leaf = x.detach().requires_grad_()
    if buffer is not None:
        want_grad_in(leaf, buffer)
    outputs, grads = [], []
    for i in range(consumers):
        if op == "norm":
            outputs.append(rms_norm(leaf, weight, 1e-6, is_one_plus))
            grads.append(grad_y * (i + 1))
        else:
            outputs += rms_norm_with_input(leaf, weight, 1e-6, is_one_plus)
            grads += [grad_x * (i + 1), grad_y * (i + 1)]
    return torch.autograd.grad(outputs, [leaf, weight], grads)


@pytest.mark.parametrize("op", ["norm", "with_input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ADD_CASES.values(), ids=ADD_CASES.keys())
def test_kernel_writes_the_input_gradient_where_it_is_wanted(kernel_path, guarded, case, dtype, op):
    # x's gradient asked for in a buffer (a CUDA-graphed block's static input, want_grad_in; NaN-filled, guarded
    # ends): the norm's backward writes it there (the gradient returned is a view of it), every gradient bit for bit
    # that of a call without it; nothing written past the buffer.
    shape, is_one_plus = case
    x, _, weight, grad_x, grad_y = add_case(shape, dtype)
    expected = norm_input_grads(op, x, weight, grad_x, grad_y, is_one_plus)
    buffer = guarded.alloc(shape, dtype, x.device)
    grads = norm_input_grads(op, x, weight, grad_x, grad_y, is_one_plus, buffer)
    guarded.check()
    assert grads[0].data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected[0])
    assert all(torch.equal(got, want) for got, want in zip(grads, expected, strict=True))


@pytest.mark.parametrize("op", ["norm", "with_input"])
def test_a_wanted_buffer_goes_to_one_consumer_only(kernel_path, op):
    # x consumed by two norms: the first writes its gradient into the buffer, the second makes its own, and autograd
    # sums the two into a tensor apart from the buffer (the second never writes the buffer over); a buffer that does
    # not fit x (shape, dtype, strides) is never written.
    x, _, weight, grad_x, grad_y = add_case((6, 40), torch.float32)
    expected = norm_input_grads(op, x, weight, grad_x, grad_y, False, consumers=2)
    buffer = torch.full((6, 40), float("nan"))
    grads = norm_input_grads(op, x, weight, grad_x, grad_y, False, buffer, consumers=2)
    assert grads[0].data_ptr() != buffer.data_ptr() and not torch.isnan(buffer).any()
    assert all(torch.equal(got, want) for got, want in zip(grads, expected, strict=True))
    once = norm_input_grads(op, x, weight, grad_x, grad_y, False)
    for misfit in (torch.full((6, 41), float("nan")), torch.full((6, 40), float("nan"), dtype=torch.float64),
                   torch.full((40, 6), float("nan")).t()):  # fmt: skip
        grads = norm_input_grads(op, x, weight, grad_x, grad_y, False, misfit)
        assert torch.isnan(misfit).all() and all(torch.equal(got, want) for got, want in zip(grads, once))


@pytest.mark.parametrize("bad, message", BAD_INPUTS[:1] + BAD_INPUTS[-2:])
def test_with_input_bad_inputs_raise(bad, message):
    inputs = {"x": torch.ones(3, 8), "weight": torch.ones(8), **bad}
    with pytest.raises(ValueError, match=message):
        rms_norm_with_input(**inputs)


SHARED_BUFFER = torch.ones(3, 8)
ADD_BAD_INPUTS = [
    pytest.param(dict(residual=torch.ones(3, 7)), r"residual: shape \(3, 7\) must match x \(3, 8\)", id="shape"),
    pytest.param(dict(residual=torch.ones(3, 8, dtype=torch.float16)), r"residual: dtype torch.float16 must match x",
                 id="dtype"),
    pytest.param(dict(weight=torch.ones(5)), r"weight: shape \(5,\) must be \[N\] \(8,\)", id="weight_shape"),
    pytest.param(dict(eps=-1.0), r"eps \(-1.0\) must be >= 0", id="eps"),
    pytest.param(dict(y_buffer=torch.ones(3, 9)), r"y_buffer: shape \(3, 9\) dtype torch.float32 on cpu must be "
                 r"contiguous, of x's shape \(3, 8\), dtype and device", id="buffer_shape"),
    pytest.param(dict(y_buffer=torch.ones(3, 8, dtype=torch.float16)), r"y_buffer: .* dtype torch.float16",
                 id="buffer_dtype"),
    pytest.param(dict(h_buffer=torch.ones(8, 3).t()), r"h_buffer: shape \(3, 8\) .* must be contiguous",
                 id="buffer_strided"),
    pytest.param(dict(y_buffer=SHARED_BUFFER, h_buffer=SHARED_BUFFER),
                 r"y_buffer and h_buffer: must be two tensors, not one", id="one_buffer_for_both"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", ADD_BAD_INPUTS)
def test_add_bad_inputs_raise(bad, message):
    inputs = {"x": torch.ones(3, 8), "residual": torch.ones(3, 8), "weight": torch.ones(8), **bad}
    with pytest.raises(ValueError, match=message):
        add_rms_norm(**inputs)
