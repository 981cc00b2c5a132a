"""swiglu: the reference against the formula, the Triton kernels in the interpreter against the reference in fp64
(h and every gradient, odd shapes, rows wider than one column step, with and without a scale, a frozen scale),
NaN-filled buffers with guarded ends, determinism, empty inputs, input checks and dispatch.

Shapes: gate, up [..., F], viewed as M rows of F columns; scale [..., 1].
"""

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import torch.nn.functional as F
    from moe_tune.ops.swiglu import kernels, swiglu
    from moe_tune.ops.swiglu.reference import swiglu_ref
    from norm_conv_cases import as_fp64, assert_close_to_reference

# Against the reference on fp64 copies of the inputs, relative to each tensor's largest entry. fp32: the kernel's
# sigmoid and the order of dscale's row sums (up to 600 columns) against fp64. fp16: one rounding of each output
# (half an ulp, 4.9e-4 relative).
TOLERANCES = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
# Past the end of every kernel buffer: more than one tile.
GUARD_ELEMENTS = 8192

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels, "_swiglu_fwd_kernel", on_gpu=False)
guarded = guarded_outputs(kernels, GUARD_ELEMENTS)

# (leading shape, F, scaled)
CASES = {
    # F not a power of two, rows not a multiple of the row tile, three dims.
    "F48_3d": ((3, 7), 48, False),
    # A shared expert's rows: scaled, F wider than one 256-column step with a partial last step.
    "F600_scaled": ((19,), 600, True),
    # Exactly one column step.
    "F256_scaled": ((5,), 256, True),
    # One column; one row.
    "F1_scaled": ((11,), 1, True),
    "one_row": ((1,), 130, False),
}


def swiglu_case(lead, width, dtype, scaled, scale_requires_grad=True):
    generator = torch.Generator().manual_seed(width * 31 + len(lead))
    # Gate values spread over silu's curved part and both tails (|g| up to about 12).
    gate = (torch.randn(*lead, width, generator=generator) * 4).to(dtype).requires_grad_()
    up = torch.randn(*lead, width, generator=generator).to(dtype).requires_grad_()
    scale = None
    if scaled:
        scale = torch.rand(*lead, 1, generator=generator).to(dtype).requires_grad_(scale_requires_grad)
    grad_h = torch.randn(*lead, width, generator=generator).to(dtype)
    return gate, up, scale, grad_h


def run(fn, gate, up, scale, grad_h):
    h = fn(gate, up, scale)
    inputs = [t for t in (gate, up, scale) if t is not None and t.requires_grad]
    return h, torch.autograd.grad(h, inputs, grad_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, case, dtype):
    lead, width, scaled = case
    gate, up, scale, grad_h = swiglu_case(lead, width, dtype, scaled)
    h, grads = run(swiglu, gate, up, scale, grad_h)
    h_ref, grads_ref = run(swiglu_ref, *as_fp64(gate, up, scale), grad_h.double())
    guarded.check()
    names = ("h", "dgate", "dup", "dscale")[: 1 + len(grads)]
    assert_close_to_reference(names, (h, *grads), (h_ref, *grads_ref), dtype, TOLERANCES[dtype])


def test_frozen_scale_gets_no_gradient_and_no_buffer(guarded):
    gate, up, scale, grad_h = swiglu_case((13,), 40, torch.float32, True, scale_requires_grad=False)
    h, (dgate, dup) = run(swiglu, gate, up, scale, grad_h)
    _, (dgate_ref, dup_ref) = run(swiglu_ref, *as_fp64(gate, up, scale), grad_h.double())
    assert_close_to_reference(("dgate", "dup"), (dgate, dup), (dgate_ref, dup_ref), torch.float32,
                              TOLERANCES[torch.float32])
    # h, dgate, dup: no dscale buffer.
    assert [shape for _, _, shape in guarded.buffers] == [(13, 40), (13, 40), (13, 40)]


def test_scale_of_another_dtype_gets_its_gradient_in_that_dtype(kernel_path):
    gate, up, _, grad_h = swiglu_case((9,), 70, torch.float16, False)
    scale = torch.rand(9, 1, generator=torch.Generator().manual_seed(3)).requires_grad_()
    h, (_, _, dscale) = run(swiglu, gate, up, scale, grad_h)
    h_ref, (_, _, dscale_ref) = run(swiglu_ref, *as_fp64(gate, up, scale), grad_h.double())
    assert h.dtype == torch.float16 and dscale.dtype == torch.float32
    assert_close_to_reference(("h",), (h,), (h_ref,), torch.float16, TOLERANCES[torch.float16])
    # dscale sums fp32 products of fp16 inputs: fp32's tolerance.
    assert_close_to_reference(("dscale",), (dscale,), (dscale_ref,), torch.float32, TOLERANCES[torch.float32])


def test_kernel_is_deterministic(kernel_path):
    gate, up, scale, grad_h = swiglu_case((33,), 300, torch.float16, True)
    first = run(swiglu, gate, up, scale, grad_h)
    second = run(swiglu, gate, up, scale, grad_h)
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


@pytest.mark.parametrize("lead, width", [((0,), 32), ((4,), 0)], ids=["no_rows", "no_columns"])
def test_empty_input(kernel_path, lead, width):
    gate, up, scale, grad_h = swiglu_case(lead, width, torch.float32, True)
    h, (dgate, dup, dscale) = run(swiglu, gate, up, scale, grad_h)
    assert h.shape == gate.shape and dgate.shape == gate.shape and dup.shape == up.shape
    assert torch.equal(dscale, torch.zeros_like(scale))


def test_reference_is_the_formula():
    gate, up, scale, _ = swiglu_case((4, 6), 10, torch.float64, True)
    gate, up, scale = gate.detach(), up.detach(), scale.detach()
    expected = gate / (1 + torch.exp(-gate)) * up * scale
    torch.testing.assert_close(swiglu_ref(gate, up, scale), expected, atol=1e-12, rtol=1e-12)
    # 16-bit inputs: computed in fp32 and rounded once (not after silu and after each product).
    half = [t.to(torch.bfloat16) for t in (gate, up, scale)]
    once = (F.silu(half[0].float()) * half[1].float() * half[2].float()).to(torch.bfloat16)
    assert torch.equal(swiglu_ref(*half), once)


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    gate, up, scale, _ = swiglu_case((5,), 16, torch.float32, True)
    assert torch.equal(swiglu(gate, up, scale), swiglu_ref(gate, up, scale))


def test_forced_kernel_that_cannot_run_raises(kernel_path):
    gate, up, _, _ = swiglu_case((2,), 16, torch.float64, False)
    with pytest.raises(RuntimeError, match="swiglu has no Triton kernel"):
        swiglu(gate, up)


BAD_INPUTS = [
    pytest.param(dict(up=torch.ones(3, 7)), r"up: shape \(3, 7\) must match gate \(3, 8\)", id="up_shape"),
    pytest.param(dict(up=torch.ones(3, 8, dtype=torch.float16)), r"up: dtype torch.float16 must match gate",
                 id="up_dtype"),
    pytest.param(dict(scale=torch.ones(3)), r"scale: shape \(3,\) must be \[\.\.\., 1\] \(3, 1\)", id="scale_shape"),
    pytest.param(dict(scale=torch.ones(3, 8)), r"scale: shape \(3, 8\) must be \[\.\.\., 1\]", id="scale_per_column"),
    pytest.param(dict(scale=torch.ones(3, 1, dtype=torch.int64)), r"scale: dtype torch.int64 must be floating",
                 id="scale_int"),
    pytest.param(dict(gate=torch.ones(3, 8, dtype=torch.int64)), r"gate: dtype torch.int64 must be floating point",
                 id="gate_int"),
    pytest.param(dict(gate=torch.tensor(1.0), up=torch.tensor(1.0)), r"gate: shape \(\) must be \[\.\.\., F\]",
                 id="scalar"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_bad_inputs_raise(bad, message):
    inputs = {"gate": torch.ones(3, 8), "up": torch.ones(3, 8), **bad}
    with pytest.raises(ValueError, match=message):
        swiglu(**inputs)
