"""gdn_gates: the Triton kernels in the interpreter against the reference in fp64 (g, beta and every gradient), odd
shapes, the softplus threshold and tails, frozen parameters, empty input, NaN-filled buffers with guarded ends, input
checks and dispatch.

Shapes: a, b [..., H], viewed as M rows of H heads; A_log, dt_bias [H].
"""

import math

import pytest
from kernel_fixtures import forced_kernel_path, guarded_outputs
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.linear_attention import gates, kernels_gates
    from moe_tune.ops.linear_attention.gates import MAX_HEADS, SOFTPLUS_THRESHOLD, gdn_gates, gdn_gates_ref

# Against the reference in fp64 on the same input values. The gates are fp32 for every input dtype: measured at most
# 1.9e-6 relative, as torch's own fp32 ops (the rounding of x = a + dt_bias, which exp turns into a relative error of
# softplus's tail; kernel against torch in fp32: at most 3.8 ulp). Input gradients come in the input's dtype: fp32
# measured 2e-6 relative, for the same reason; fp16 adds one rounding (half an ulp, 4.9e-4 relative; subnormals and
# values that flush to 0 are what atol is for). Parameter gradients are fp32 sums over up to 1000 rows, compared
# relative to the largest head's: measured 2.4e-7 (fp32 parameters), 2.9e-4 with one fp16 rounding (fp16 ones).
TOLERANCES = {
    torch.float32: dict(gates=dict(atol=1e-6, rtol=5e-6), inputs=dict(atol=1e-6, rtol=5e-6)),
    torch.float16: dict(gates=dict(atol=1e-6, rtol=5e-6), inputs=dict(atol=1e-5, rtol=1e-3)),
}
PARAM_TOLERANCES = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
# Past the end of every kernel buffer: more than one tile (1024 elements).
GUARD_ELEMENTS = 2048
# x = a + dt_bias values that every case holds in its first rows, one row each: both sides of the softplus threshold,
# where exp(x) overflows fp32 (x > 88.7), and the tail where softplus(x) ~ exp(x) underflows toward subnormals.
SPECIAL_X = [300.0, 100.0, 60.0, SOFTPLUS_THRESHOLD + 0.5, SOFTPLUS_THRESHOLD - 0.5, 0.0, -20.0, -40.0, -100.0]


kernel_path = forced_kernel_path(kernels_gates, "_gdn_gates_fwd_kernel", on_gpu=False)
guarded = guarded_outputs(kernels_gates, GUARD_ELEMENTS)


def gates_case(shape, dtype, param_dtype=torch.float32, requires_grad=(True, True, True, True), seed=0):
    """a, b of `shape` in dtype, A_log and dt_bias [H] in param_dtype (A_log as the model initialises it: decay rates
    in [1, 16)), requires_grad per (a, b, A_log, dt_bias); a's first rows hold SPECIAL_X after dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = shape[-1]
    A_log = (torch.rand(num_heads, generator=gen) * math.log(16)).to(param_dtype)
    dt_bias = (1.0 + 0.5 * torch.randn(num_heads, generator=gen)).to(param_dtype)
    a = torch.randn(shape, generator=gen) * 12
    a_MH = a.view(-1, num_heads)
    num_special = min(len(SPECIAL_X), a_MH.shape[0])
    a_MH[:num_special] = torch.tensor(SPECIAL_X[:num_special])[:, None] - dt_bias.float()[None, :]
    b = torch.randn(shape, generator=gen) * 4
    tensors = [a.to(dtype), b.to(dtype), A_log, dt_bias]
    return [t.requires_grad_(flag) for t, flag in zip(tensors, requires_grad)]


def run_gates(op, inputs, grad_g, grad_beta, **options):
    """(g, beta) and the gradients of the inputs that require one, in (a, b, A_log, dt_bias) order (None for the
    others)."""
    g, beta = op(*inputs, **options)
    leaves = [t for t in inputs if t.requires_grad]
    # Only outputs in the graph (beta is not when b needs no gradient).
    outputs, grads = zip(*[(out, grad) for out, grad in ((g, grad_g), (beta, grad_beta)) if out.requires_grad])
    found = iter(torch.autograd.grad(outputs, leaves, grads))
    return (g, beta), [next(found) if t.requires_grad else None for t in inputs]


def reference_fp64(inputs, grad_g, grad_beta):
    copies = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    return run_gates(gdn_gates_ref, copies, grad_g.double(), grad_beta.double(), compute_dtype=torch.float64)


def grad_outputs(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


# (shape, param dtype: None for the input's)
CASES = {
    # H odd and three heads: a [256, 4] tile with a masked head column; 74 rows, one partial tile.
    "H3_T37": ((2, 37, 3), torch.float32),
    # The benchmark model's 32 heads, 1000 rows: 32 tiles of 32 rows, the last one partial (1000 = 31 * 32 + 8).
    "H32_T1000": ((1, 1000, 32), torch.float32),
    # Odd H past a power of two, 16-bit parameters (bf16 training keeps them in the model's dtype).
    "H33_params_in_input_dtype": ((3, 29, 33), None),
    # A single head and a single leading dim.
    "H1": ((300, 1), torch.float32),
    # Fewer rows than SPECIAL_X.
    "one_row": ((1, 1, 5), torch.float32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(kernel_path, guarded, case, dtype):
    shape, param_dtype = case
    inputs = gates_case(shape, dtype, param_dtype or dtype)
    grad_g, grad_beta = grad_outputs(shape)
    (g, beta), grads = run_gates(gdn_gates, inputs, grad_g, grad_beta)
    (g_ref, beta_ref), grads_ref = reference_fp64(inputs, grad_g, grad_beta)
    guarded.check()
    tol = TOLERANCES[dtype]
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == shape
    torch.testing.assert_close(g.double(), g_ref, **tol["gates"])
    torch.testing.assert_close(beta.double(), beta_ref, **tol["gates"])
    for name, grad, grad_ref, t in zip(("da", "db", "dA_log", "ddt_bias"), grads, grads_ref, inputs):
        assert grad.dtype == t.dtype and grad.shape == t.shape, name
        if name in ("da", "db"):
            torch.testing.assert_close(grad.double(), grad_ref, **tol["inputs"], msg=lambda m: f"{name}: {m}")
        else:
            # Sums over rows: relative to the largest head's (a head whose terms cancel has a sum near 0).
            scale = grad_ref.abs().max()
            ptol = PARAM_TOLERANCES[t.dtype]
            torch.testing.assert_close(grad.double() / scale, grad_ref / scale, **ptol, msg=lambda m: f"{name}: {m}")


# requires_grad of (A_log, dt_bias): frozen under LoRA (the common case), or either one alone.
PARAM_GRADS = {
    "frozen": (False, False), "A_log_only": (True, False), "dt_bias_only": (False, True), "both": (True, True),
}  # fmt: skip


@pytest.mark.parametrize("params_require_grad", PARAM_GRADS.values(), ids=PARAM_GRADS.keys())
def test_parameter_gradients_only_when_required(kernel_path, guarded, params_require_grad):
    shape = (2, 300, 3)
    inputs = gates_case(shape, torch.float32, requires_grad=(True, True, *params_require_grad))
    grad_g, grad_beta = grad_outputs(shape)
    _, grads = run_gates(gdn_gates, inputs, grad_g, grad_beta)
    _, grads_ref = reference_fp64(inputs, grad_g, grad_beta)
    guarded.check()
    for name, grad, grad_ref in zip(("da", "db", "dA_log", "ddt_bias"), grads, grads_ref):
        if grad_ref is None:
            assert grad is None, name
        elif name in ("da", "db"):
            torch.testing.assert_close(grad.double(), grad_ref, **TOLERANCES[torch.float32]["inputs"])
        else:
            scale = grad_ref.abs().max()
            torch.testing.assert_close(grad.double() / scale, grad_ref / scale, **PARAM_TOLERANCES[torch.float32])
    # g, beta; da, db; and a [2, programs, H] partial-sum buffer only when a parameter needs its gradient.
    shapes = [shape for _, _, shape in guarded.buffers]
    partial = [(2, 3, 3)] if any(params_require_grad) else []
    assert shapes == [(600, 3), (600, 3), (600, 3), (600, 3), *partial]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_softplus_tail_is_relative(kernel_path, dtype):
    # Where softplus(x) ~ exp(x) is tiny, g and da must keep their relative precision (log(1 + exp(x)) would give 0):
    # the absolute tolerances above cannot see it.
    x = torch.linspace(-80, -5, 256)
    inputs = [x.view(64, 4).to(dtype), torch.zeros(64, 4, dtype=dtype), torch.zeros(4), torch.zeros(4)]
    inputs[0].requires_grad_()
    grad_g = torch.ones(64, 4)
    (g, _), (da, *_) = run_gates(gdn_gates, inputs, grad_g, torch.zeros(64, 4))
    (g_ref, _), (da_ref, *_) = reference_fp64(inputs, grad_g, torch.zeros(64, 4))
    assert (g < 0).all()
    torch.testing.assert_close(g.double() / g_ref, torch.ones_like(g_ref), atol=0, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(da.double() / da_ref, torch.ones_like(da_ref), atol=0, rtol=1e-5)
    else:
        # fp16 subnormals (below 6.1e-5) keep few bits: only the normal range (x > -9.7, 17 values) is relative.
        normal = da_ref.abs() > torch.finfo(torch.float16).tiny
        assert normal.sum() == 17
        ratio = da.double()[normal] / da_ref[normal]
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-3, atol=0)


def test_only_one_output_in_the_loss(kernel_path):
    # beta unused: its gradient reaches backward as zeros, and db is zero.
    inputs = gates_case((2, 40, 3), torch.float32)
    grad_g, _ = grad_outputs((2, 40, 3))
    g, _ = gdn_gates(*inputs)
    grads = torch.autograd.grad(g, inputs, grad_g)
    _, grads_ref = reference_fp64(inputs, grad_g, torch.zeros_like(grad_g))
    assert torch.equal(grads[1], torch.zeros_like(grads[1]))
    torch.testing.assert_close(grads[0].double(), grads_ref[0], **TOLERANCES[torch.float32]["inputs"])


def test_non_contiguous_inputs(kernel_path, guarded):
    # Every other column of wider tensors, as a fused projection's slices would be.
    wide = gates_case((2, 45, 10), torch.float32)
    a, b = wide[0][..., ::2], wide[1][..., 1::2]
    inputs = [a, b, wide[2][:5].detach().requires_grad_(), wide[3][:5].detach().requires_grad_()]
    grad_g, grad_beta = grad_outputs((2, 45, 5))
    (g, beta), grads = run_gates(gdn_gates, inputs, grad_g, grad_beta)
    (g_ref, beta_ref), grads_ref = reference_fp64(inputs, grad_g, grad_beta)
    guarded.check()
    torch.testing.assert_close(g.double(), g_ref, **TOLERANCES[torch.float32]["gates"])
    torch.testing.assert_close(beta.double(), beta_ref, **TOLERANCES[torch.float32]["gates"])
    for grad, grad_ref in zip(grads[:2], grads_ref[:2]):
        torch.testing.assert_close(grad.double(), grad_ref, **TOLERANCES[torch.float32]["inputs"])
    for grad, grad_ref in zip(grads[2:], grads_ref[2:]):
        scale = grad_ref.abs().max()
        torch.testing.assert_close(grad.double() / scale, grad_ref / scale, **PARAM_TOLERANCES[torch.float32])


def test_empty_input(kernel_path, guarded):
    inputs = gates_case((1, 0, 3), torch.float32)
    g, beta = gdn_gates(*inputs)
    assert g.shape == beta.shape == (1, 0, 3)
    da, db, dA_log, ddt_bias = torch.autograd.grad((g.sum() + beta.sum()), inputs)
    assert da.shape == db.shape == (1, 0, 3)
    assert torch.equal(dA_log, torch.zeros(3)) and torch.equal(ddt_bias, torch.zeros(3))


def test_kernel_is_deterministic(kernel_path):
    inputs = gates_case((1, 500, 32), torch.float16, torch.float32)
    grad_g, grad_beta = grad_outputs((1, 500, 32))
    first = run_gates(gdn_gates, inputs, grad_g, grad_beta)
    second = run_gates(gdn_gates, inputs, grad_g, grad_beta)
    assert all(torch.equal(x, y) for x, y in zip([*first[0], *first[1]], [*second[0], *second[1]]))


def test_reference_is_the_eager_formula():
    # Bitwise the ops GatedDeltaNet ran before, in fp32 whatever the inputs' dtype.
    a, b, A_log, dt_bias = [t.detach() for t in gates_case((2, 20, 6), torch.float16, torch.float16)]
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    assert torch.equal(g, -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float()))
    assert torch.equal(beta, torch.sigmoid(b.float()))


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    inputs = gates_case((3, 8, 4), torch.float32)
    monkeypatch.setattr(kernels_gates, "_alloc", None)
    for out, ref in zip(gdn_gates(*inputs), gdn_gates_ref(*inputs)):
        assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "dtype, num_heads",
    [(torch.float64, 4), (torch.float32, MAX_HEADS + 1)],
    ids=["fp64", "too_many_heads"],
)
def test_forced_kernel_that_cannot_run_raises(kernel_path, dtype, num_heads):
    inputs = gates_case((2, num_heads), dtype)
    with pytest.raises(RuntimeError, match="gdn_gates has no Triton kernel"):
        gdn_gates(*inputs)


BAD_INPUTS = [
    pytest.param(dict(b=torch.ones(3, 5)), r"b: shape \(3, 5\) must match a \(3, 4\)", id="b_shape"),
    pytest.param(dict(A_log=torch.ones(5)), r"A_log: shape \(5,\) must be \[H\] \(4,\)", id="A_log_shape"),
    pytest.param(dict(dt_bias=torch.ones(1, 4)), r"dt_bias: shape \(1, 4\) must be \[H\] \(4,\)", id="dt_bias_shape"),
    pytest.param(dict(a=torch.ones(3, 0), b=torch.ones(3, 0)), r"a: shape \(3, 0\) must be \[\.\.\., H\] with H >= 1", id="no_heads"),
    pytest.param(dict(b=torch.ones(3, 4, dtype=torch.int64)), r"b: dtype torch.int64 must be floating point", id="b_int"),
]  # fmt: skip


@pytest.mark.parametrize("bad, message", BAD_INPUTS)
def test_bad_inputs_raise(bad, message):
    inputs = {"a": torch.ones(3, 4), "b": torch.ones(3, 4), "A_log": torch.ones(4), "dt_bias": torch.ones(4), **bad}
    with pytest.raises(ValueError, match=message):
        gdn_gates(**inputs)
