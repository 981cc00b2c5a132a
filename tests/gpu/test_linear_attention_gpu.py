"""linear_attention Triton kernels on a CUDA device (gated delta rule and KDA): output, final state and every
gradient against reference.py in bf16 and fp32, at odd and at realistic shapes, packed documents, NaN-filled
buffers with guarded ends.

Run on the GPU machine in its own session (tests/ops imports the kernels in interpreter mode):
pytest -m gpu tests/gpu/test_linear_attention_gpu.py
Triton 3.4-3.7.0 miscompiles some gated chunk backward kernels on Hopper (fla-org/flash-linear-attention#640): the
interpreter tests cannot see that, these can.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

import math

import pytest
from gpu_memory import GPU_MEMORY_GROUP
from guarded_buffers import GuardedBuffers
from kernel_fixtures import INTERPRETED_ON_GPU, fail_if_interpreted
import torch
import torch.nn.functional as F

from moe_tune.ops.linear_attention import gated_delta_rule, kda
from moe_tune.ops.linear_attention.reference import chunk_gated_delta_rule_ref, kda_gate_ref

pytestmark = pytest.mark.gpu

# One table per dtype: rel_rms = ||actual - expected|| / ||expected|| per tensor, rel_max = max |actual - expected|
# / max |expected| (catches one wrong row or chunk that an RMS over 8192 tokens would average away).
# fp32: 3xTF32 dots (each product within about 1e-6 of |a||b|) against the fp64 reference, besides summation
# order and exp rounding.
# bf16: W, U, the per-chunk states, v_new and every dot operand are bf16 (8 mantissa bits, 2e-3 per rounding),
# against the fp32 reference on the same bf16 inputs; flash-linear-attention's own bf16 tests allow RMS ratios of
# 5e-3 to 2e-2 for this op.
TOLERANCES = {
    torch.float32: dict(rel_rms=2e-5, rel_max=2e-4),
    torch.bfloat16: dict(rel_rms=2e-2, rel_max=1e-1),
}
GUARD_ELEMENTS = 64 * 16 * 128


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    from triton.runtime.interpreter import InterpretedFunction

    from moe_tune.ops.linear_attention import kernels_common, kernels_wy

    if isinstance(kernels_wy._chunk_wy_fwd_kernel, InterpretedFunction):
        pytest.fail(INTERPRETED_ON_GPU)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernels_common, "alloc", buffers.alloc)
    return buffers


def make_inputs(
    B, T, H, K, V, *, dtype, is_per_channel=False, num_seqs=None, has_initial_state=True, max_decay=None, seed=0
):
    """Leaf CUDA tensors: unit-norm k, gates as a model makes them (logsigmoid, sigmoid), or uniform decays in
    [-max_decay, 0]; g [B, T, H] per head or [B, T, H, K] per channel (KDA)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    g_shape = (B, T, H, K) if is_per_channel else (B, T, H)
    if max_decay is None:
        g = F.logsigmoid(randn(*g_shape))
    else:
        g = -max_decay * torch.rand(*g_shape, generator=gen, device="cuda")
    inputs = dict(
        q=randn(B, T, H, K),
        k=F.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, H, V),
        g=g,
        beta=torch.sigmoid(randn(B, T, H)),
        initial_state=0.1 * randn(num_seqs or B, H, K, V) if has_initial_state else None,
    )
    return {
        # g stays fp32 as models compute it; the rest takes the tested dtype.
        name: None if x is None else (x if name in ("initial_state", "g") else x.to(dtype)).requires_grad_()
        for name, x in inputs.items()
    }


def forward_and_grads(op, inputs, **options):
    leaves = {name: x for name, x in inputs.items() if x is not None}
    o, final_state = op(**inputs, output_final_state=True, **options)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype)
    dfinal = torch.randn(final_state.shape, generator=gen, device="cuda").to(final_state.dtype)
    grads = torch.autograd.grad((o, final_state), list(leaves.values()), (do, dfinal))
    results = {"o": o, "final_state": final_state, **{f"d{name}": grad for name, grad in zip(leaves, grads)}}
    return {name: x.detach() for name, x in results.items()}


def assert_matches_reference(inputs, dtype, guarded, use_qk_l2norm=False, cu_seqlens=None, **options):
    op = kda if inputs["g"].ndim == 4 else gated_delta_rule
    actual = forward_and_grads(op, inputs, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens, **options)
    # fp32 inputs against fp64; 16-bit inputs against the fp32 reference on the same (rounded) values.
    reference_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    as_reference = {
        name: None if x is None else x.detach().to(reference_dtype).requires_grad_() for name, x in inputs.items()
    }
    expected = forward_and_grads(
        chunk_gated_delta_rule_ref, as_reference, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens
    )
    errors = {}
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        assert bool(a.isfinite().all()), f"{name}: non-finite values (an unwritten element or an overflow)"
        errors[name] = dict(
            rel_rms=((a - e).norm() / e.norm().clamp_min(1e-30)).item(),
            rel_max=((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item(),
        )
    tolerance = TOLERANCES[dtype]
    failed = {name: err for name, err in errors.items() if any(err[m] > tolerance[m] for m in tolerance)}
    assert not failed, f"over {tolerance}: {failed}; all errors: {errors}"
    guarded.check()


ODD_CASES = [
    pytest.param(dict(B=2, T=1, H=4, K=64, V=128), False, id="T1-K64-V128"),
    pytest.param(dict(B=1, T=63, H=4, K=128, V=64), False, id="T63-K128-V64"),
    pytest.param(dict(B=2, T=65, H=4, K=100, V=96), True, id="T65-K100-V96-l2norm"),
    pytest.param(dict(B=1, T=130, H=4, K=128, V=128, has_initial_state=False), False, id="T130-no_h0"),
    # 64 steps of up to -5 per chunk: exp(-G_j) alone would overflow fp32, the pairwise decays must not.
    pytest.param(dict(B=1, T=1000, H=2, K=128, V=128, max_decay=5.0), False, id="T1000-strong_decay"),
]


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, use_qk_l2norm", ODD_CASES)
def test_odd_shapes_match_reference(guarded, shape, use_qk_l2norm, dtype, is_per_channel):
    inputs = make_inputs(**shape, dtype=dtype, is_per_channel=is_per_channel)
    assert_matches_reference(inputs, dtype, guarded, use_qk_l2norm=use_qk_l2norm)


@pytest.mark.parametrize(
    "shape, bounds",
    [
        pytest.param(dict(T=1000, H=4, K=128, V=128), None, id="K128"),
        pytest.param(dict(T=512, H=4, K=16, V=16), [0, 5, 130, 300, 512], id="K16-varlen"),
    ],
)
def test_kda_gate_in_kernel_bf16_matches_reference(guarded, shape, bounds):
    # KDA with the log decay -exp(A_log) softplus(a + dt_bias) computed in the kernels (FLA's KDA init, raw gates of
    # std 2), against the reference applying the same gate first: every gradient, dA_log and ddt_bias included.
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device="cuda")
    inputs = make_inputs(1, **shape, dtype=torch.bfloat16, is_per_channel=True,
                         num_seqs=None if bounds is None else len(bounds) - 1)  # fmt: skip
    H, K = shape["H"], shape["K"]
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs["g"] = (2 * torch.randn(inputs["g"].shape, generator=gen, device="cuda")).bfloat16().requires_grad_()
    inputs["A_log"] = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log().requires_grad_()
    dt = torch.empty(H * K, device="cuda").uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
    inputs["dt_bias"] = (dt + torch.log(-torch.expm1(-dt))).requires_grad_()
    options = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    actual = forward_and_grads(kda, inputs, use_gate_in_kernel=True, **options)

    def reference(q, k, v, g, beta, initial_state, A_log, dt_bias, use_qk_l2norm_in_kernel, **rest):
        return chunk_gated_delta_rule_ref(q, k, v, kda_gate_ref(g, A_log, dt_bias), beta, initial_state=initial_state,
                                          use_qk_l2norm=use_qk_l2norm_in_kernel, **rest)  # fmt: skip

    as_fp32 = {name: None if x is None else x.detach().float().requires_grad_() for name, x in inputs.items()}
    expected = forward_and_grads(reference, as_fp32, **options)
    # dA_log[h] and ddt_bias[h, k] are sums over tokens (and channels) of da times a weight: by the chain rule
    # da * softplus(x) / sigmoid(x) and da, x = a + dt_bias. Those sums cancel (sum |term| is about 30x |sum| here), so
    # the bf16 error of da they inherit is measured against the sum's scale, sum |term| (the bound of a sum's error
    # for a given relative error per term), and the kernel's own sums must follow from its own da (tight: only da's
    # bf16 rounding differs; a lost chunk or head would be some 30% off).
    x = inputs["g"].detach().double() + inputs["dt_bias"].detach().double().view(H, K)
    weights = {"dA_log": F.softplus(x) / torch.sigmoid(x), "ddt_bias": torch.ones_like(x)}
    sum_dims = {"dA_log": (0, 1, 3), "ddt_bias": (0, 1)}
    errors, consistency = {}, {}
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        assert bool(a.isfinite().all()), f"{name}: non-finite values"
        scale = e
        if name in weights:
            scale = (expected["dg"].double() * weights[name]).abs().sum(dim=sum_dims[name]).reshape(e.shape)
            implied = (actual["dg"].double() * weights[name]).sum(dim=sum_dims[name]).reshape(e.shape)
            consistency[name] = ((a - implied).norm() / implied.norm()).item()
        errors[name] = dict(rel_rms=((a - e).norm() / scale.norm().clamp_min(1e-30)).item(),
                            rel_max=((a - e).abs().max() / scale.abs().max().clamp_min(1e-30)).item())  # fmt: skip
    tolerance = TOLERANCES[torch.bfloat16]
    failed = {name: err for name, err in errors.items() if any(err[m] > tolerance[m] for m in tolerance)}
    assert not failed, f"over {tolerance}: {failed}; all errors: {errors}"
    assert all(err <= 1e-2 for err in consistency.values()), consistency
    guarded.check()


SMALL_HEAD_CASES = [
    # The tiny model's linear layers (profiles/tiny.yaml): K = V = 16, four heads, packed documents, decays of up to
    # 30 per token as -exp(A_log) * softplus(a) makes them; bf16 gave NaN there with 16-wide key tiles.
    pytest.param(dict(T=512, H=4, K=16, V=16, max_decay=30.0), [0, 5, 130, 300, 512], id="tiny_model-K16-V16-varlen"),
    pytest.param(dict(T=200, H=4, K=32, V=32), None, id="K32-V32"),
    pytest.param(dict(T=130, H=2, K=16, V=32), None, id="K16-V32"),
    pytest.param(dict(T=65, H=2, K=32, V=16), None, id="K32-V16"),
]


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("shape, bounds", SMALL_HEAD_CASES)
def test_small_head_dims_bf16_match_reference(guarded, shape, bounds, is_per_channel):
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device="cuda")
    num_seqs = None if bounds is None else len(bounds) - 1
    inputs = make_inputs(1, **shape, dtype=torch.bfloat16, is_per_channel=is_per_channel, num_seqs=num_seqs)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True, cu_seqlens=cu_seqlens)


def test_auto_dispatch_takes_the_kernel_on_the_gpu(guarded, monkeypatch):
    from moe_tune.ops.linear_attention.autograd import GatedDeltaRuleFunction

    calls = []
    apply = GatedDeltaRuleFunction.apply
    monkeypatch.setattr(GatedDeltaRuleFunction, "apply", lambda *args: calls.append(args[0].shape) or apply(*args))
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    for head_dim in (16, 64):
        gated_delta_rule(**make_inputs(1, 64, 2, head_dim, head_dim, dtype=torch.bfloat16, has_initial_state=False))
    gated_delta_rule(**make_inputs(1, 64, 2, 64, 64, dtype=torch.float32, has_initial_state=False))
    assert calls == [(1, 64, 2, 16), (1, 64, 2, 64)]  # fp32 ran the reference


@GPU_MEMORY_GROUP
@pytest.mark.parametrize("num_docs", [8, 110])
def test_long_packed_batch_bf16_matches_reference(guarded, num_docs):
    # The shape that failed on the H200 (2026-11-29): T16384 H32 K=V=128 in 8 or 110 documents (the hybrid benchmark
    # model's linear layers on a packed row of short documents): wrong dk/dv at 8, an illegal access at 110.
    bounds = torch.linspace(0, 16384, num_docs + 1).round().to(torch.int32).tolist()
    inputs = make_inputs(1, 16384, 32, 128, 128, dtype=torch.bfloat16, num_seqs=num_docs)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True,
                             cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
def test_repeated_runs_are_bitwise_equal(guarded, is_per_channel):
    # The state-gradient pass once changed from run to run on the H200 (a 16-bit dot result fed from registers into
    # the next product, kernels_bwd.py): two runs on the same inputs must agree bit for bit.
    num_heads = 8 if is_per_channel else 32
    inputs = make_inputs(1, 8192, num_heads, 128, 128, dtype=torch.bfloat16, is_per_channel=is_per_channel, num_seqs=8)
    bounds = torch.linspace(0, 8192, 9).round().to(torch.int32).to("cuda")
    op = kda if is_per_channel else gated_delta_rule
    first = forward_and_grads(op, inputs, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    second = forward_and_grads(op, inputs, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    assert [name for name in first if not torch.equal(first[name], second[name])] == []
    guarded.check()


@GPU_MEMORY_GROUP
@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T, V", [(8192, 128), (1000, 64)], ids=["T8192-V128", "T1000-V64-serial_output"])
def test_saved_intermediates_match_reference(guarded, is_per_channel, T, V):
    # save_intermediates: backward from what the forward's kernels wrote (at V 128 the output kernel's prepared
    # operands too; V 64 takes the serial pass that writes the output and, saving, the states), 8 packed documents;
    # two runs bitwise equal.
    num_heads = 8 if is_per_channel else 32
    inputs = make_inputs(1, T, num_heads, 128, V, dtype=torch.bfloat16, is_per_channel=is_per_channel, num_seqs=8)
    bounds = torch.linspace(0, T, 9).round().to(torch.int32).to("cuda")
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True, cu_seqlens=bounds,
                             save_intermediates=True)  # fmt: skip
    op = kda if is_per_channel else gated_delta_rule
    options = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=bounds, save_intermediates=True)
    first, second = (forward_and_grads(op, inputs, **options) for _ in range(2))
    assert [name for name in first if not torch.equal(first[name], second[name])] == []


@GPU_MEMORY_GROUP
def test_anchor_shape_saved_intermediates_bf16_matches_reference(guarded):
    inputs = make_inputs(4, 8192, 16, 128, 128, dtype=torch.bfloat16)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True, save_intermediates=True)


@GPU_MEMORY_GROUP
def test_anchor_shape_bf16_matches_reference(guarded):
    # The shape of the speed targets (docs/PERF.md, linear attention): B4 T8192 H16 K=V=128, forward and backward.
    inputs = make_inputs(4, 8192, 16, 128, 128, dtype=torch.bfloat16)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True)


@GPU_MEMORY_GROUP
def test_kda_long_sequence_bf16_matches_reference(guarded):
    # KDA at T8192 H16 K=V=128 with B1: the reference holds [B, H, 64, 64, K] pairwise decays per chunk for autograd
    # (about 15 GB at B1), four times that at B4.
    inputs = make_inputs(1, 8192, 16, 128, 128, dtype=torch.bfloat16, is_per_channel=True)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True)


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
def test_correlated_keys_bf16_match_reference(guarded, is_per_channel):
    # Keys at cosine ~0.9 within each head, beta near 1, almost no decay: (I + A)^-1 stays near 1 in every entry but
    # the powers of its 16 x 16 diagonal blocks reach ~1.5e3. The doubling products the inverse once took cancelled
    # them and gave NaN outputs here (H200, docs/PERF.md, nineteenth session); block substitution multiplies only
    # bounded factors.
    B, T, H, K, V = 1, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    g_shape = (B, T, H, K) if is_per_channel else (B, T, H)
    inputs = dict(
        q=randn(B, T, H, K).to(torch.bfloat16),
        k=(randn(1, 1, H, K) + 0.3 * randn(B, T, H, K)).to(torch.bfloat16),
        v=randn(B, T, H, V).to(torch.bfloat16),
        g=-1e-3 * torch.rand(*g_shape, generator=gen, device="cuda"),
        beta=(0.9 + 0.1 * torch.rand(B, T, H, generator=gen, device="cuda")).to(torch.bfloat16),
        initial_state=0.1 * randn(B, H, K, V),
    )
    inputs = {name: x.requires_grad_() for name, x in inputs.items()}
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True)


@pytest.mark.parametrize("is_normed", [True, False], ids=["pairs_bound", "products_bound"])
def test_kda_pairs_by_every_block_size_bf16_match_reference(guarded, is_normed):
    # Four chunks whose decay spans put each on another path of the kernels taking pairs by blocks (the whole chunk
    # as one block, its halves, its sub-chunks by dots, its sub-chunks elementwise) by the forward pairs kernel's
    # bound or the gradient's decayed products' (tf32 dots), as tests/ops' CPU tests of the two.
    from moe_tune.ops.linear_attention import kernels_kda

    bound = kernels_kda.fast_span_bound(torch.bfloat16, is_normed=is_normed)
    decays = torch.tensor([0.8 * bound / 63, 0.8 * bound / 31, 0.8 * bound / 15, 2 * bound / 15], device="cuda")
    inputs = make_inputs(1, 4 * 64 + 7, 2, 128, 128, dtype=torch.bfloat16, is_per_channel=True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    per_token = decays[torch.arange(4 * 64 + 7, device="cuda").clamp(max=4 * 64 - 1) // 64]
    scale = 0.9 + 0.1 * torch.rand(inputs["g"].shape, generator=gen, device="cuda")
    inputs["g"] = (-scale * per_token[None, :, None, None]).requires_grad_()
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True)


# Eight documents: lengths 1 and 63 (inside one chunk), 64 and 65 (at a chunk boundary), and long ones.
DOC_LENGTHS = [1, 63, 64, 65, 700, 1500, 2047, 3753]


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype, num_heads", [(torch.float32, 4), (torch.bfloat16, 16)], ids=["fp32", "bf16"])
def test_varlen_matches_reference(guarded, dtype, num_heads, is_per_channel):
    cu_seqlens = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    # KDA's reference pads every document to the longest and holds [N, H, 64, 64, K] decays per chunk: fewer heads.
    num_heads = num_heads // 4 if is_per_channel else num_heads
    inputs = make_inputs(
        1, sum(DOC_LENGTHS), num_heads, 128, 128, dtype=dtype, is_per_channel=is_per_channel, num_seqs=len(DOC_LENGTHS)
    )
    assert_matches_reference(inputs, dtype, guarded, use_qk_l2norm=True, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("params_trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_gates_kernels_match_the_reference(monkeypatch, params_trainable, dtype):
    """ops.linear_attention.gates on the device at the benchmark model's shape (T8192, 32 heads): g, beta and every
    gradient against the fp64 reference on the same inputs, with a's values across softplus's threshold."""
    from moe_tune.ops.linear_attention import kernels_gates
    from moe_tune.ops.linear_attention.gates import gdn_gates, gdn_gates_ref

    fail_if_interpreted(kernels_gates._gdn_gates_fwd_kernel)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    buffers = GuardedBuffers(guard_elements=1 << 14)
    monkeypatch.setattr(kernels_gates, "_alloc", buffers.alloc)
    gen = torch.Generator(device="cuda").manual_seed(3)
    T, H = 8192, 32
    a = (torch.randn(1, T, H, device="cuda", generator=gen) * 12).to(dtype).requires_grad_()
    b = (torch.randn(1, T, H, device="cuda", generator=gen) * 4).to(dtype).requires_grad_()
    A_log = (torch.rand(H, device="cuda", generator=gen) * math.log(16)).requires_grad_(params_trainable)
    dt_bias = (1 + 0.5 * torch.randn(H, device="cuda", generator=gen)).requires_grad_(params_trainable)
    grad_g, grad_beta = (torch.randn(1, T, H, device="cuda", generator=gen) for _ in range(2))

    def run(op, *inputs):
        leaves = [t for t in inputs if t.requires_grad]
        g, beta = op(*inputs)
        grads = torch.autograd.grad((g * grad_g).sum() + (beta * grad_beta).sum(), leaves)
        return [g, beta, *grads]

    ours = run(gdn_gates, a, b, A_log, dt_bias)
    buffers.check()
    exact = run(lambda *x: gdn_gates_ref(*x, compute_dtype=torch.float64), a, b, A_log, dt_bias)
    # fp32 math on both sides; the input gradients are rounded to the input dtype (bf16: 2^-9 relative).
    rtol = 8e-3 if dtype == torch.bfloat16 else 2e-5
    for name, got, want in zip(["g", "beta", "da", "db", "dA_log", "ddt_bias"], ours, exact):
        assert got.dtype == (torch.float32 if name in ("g", "beta", "dA_log", "ddt_bias") else dtype), name
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= rtol, f"{name}: {err:.2e}"


# The cases a launch other than pick_config's is checked on (split_grad_wy's, KDA's key tiles).
EIGHT_DOCS = dict(B=1, T=sum(DOC_LENGTHS), H=4, K=128, V=128, num_seqs=len(DOC_LENGTHS))
LAUNCH_CASES = [*ODD_CASES, pytest.param(EIGHT_DOCS, True, id="8-docs")]
# KDA's 8-docs case in fp32 peaks at 33.4 GiB (docs/PERF.md, "The whole GPU suite, the hybrid against transformers +
# FLA, ..."): two of them on two workers beside a third test ran an 80 GB card out of memory, so it runs in the memory
# group.
KDA_LAUNCH_CASES = [*ODD_CASES, pytest.param(EIGHT_DOCS, True, id="8-docs", marks=GPU_MEMORY_GROUP)]


def launch_with(monkeypatch, **fields):
    """The kernels launched with pick_config's choice but for `fields` (KernelConfig's)."""
    import dataclasses

    from moe_tune.ops.linear_attention import autograd, kernels_common

    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(kernels_common.pick_config(x), **fields))


def assert_launch_case_matches_reference(guarded, shape, use_qk_l2norm, dtype, is_per_channel):
    """One of LAUNCH_CASES: its inputs (packed documents of DOC_LENGTHS where it has num_seqs) against the reference."""
    inputs = make_inputs(**shape, dtype=dtype, is_per_channel=is_per_channel)
    cu_seqlens = None
    if "num_seqs" in shape:
        cu_seqlens = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    assert_matches_reference(inputs, dtype, guarded, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)


# The per-head backward's launches beside pick_config's (kernels_common.GPU_SPLIT_GRAD_WY: the state part in the output
# kernel, the WY kernel in key tiles of 64 at 4 warps), which every other test here runs.
# The norms' backward in the WY kernel's fp32 loops, not where pick_config takes them (kernels_common.GPU_GRAD_NORMS).
NORMS_IN_WY_LOOPS = dict(grad_dq_norm_in_output=False, grad_wy_norm_one_pass=False)
SPLIT_WY_4_WARPS = dict(split_grad_wy=True, grad_state_in_output=False, block_k_grad_wy=64, num_warps_grad_wy=4,
                        **NORMS_IN_WY_LOOPS)  # fmt: skip


@pytest.fixture(
    params=[
        dict(split_grad_wy=False),
        dict(split_grad_wy=True, grad_state_in_output=False, block_k_grad_wy=None, num_warps_grad_wy=None,
             **NORMS_IN_WY_LOOPS),
        SPLIT_WY_4_WARPS,
        dict(SPLIT_WY_4_WARPS, num_warps_grad_state=4),
        dict(SPLIT_WY_4_WARPS, grad_state_in_output=True),
        dict(SPLIT_WY_4_WARPS, grad_state_in_output=True, block_k_grad_output=64),
        dict(SPLIT_WY_4_WARPS, grad_state_in_output=True, grad_dq_norm_in_output=True),
        dict(SPLIT_WY_4_WARPS, grad_state_in_output=True, grad_wy_norm_one_pass=True),
        dict(SPLIT_WY_4_WARPS, grad_state_in_output=True, grad_dq_norm_in_output=True, grad_wy_norm_one_pass=True),
    ],
    ids=["one_wy_kernel", "whole_k", "k_tiles-4_warps", "k_tiles-4_warps-state_4_warps", "state_in_output",
         "state_in_output_k_tiles", "state_in_output-dq_norm_in_output", "state_in_output-norms_one_pass",
         "state_in_output-dq_norm_in_output-norms_one_pass"],
)  # fmt: skip
def split_grad_wy(monkeypatch, request):
    """The per-head backward as one WY kernel (split_grad_wy False) or split: its state part in a kernel of its own
    or in the output kernel (grad_state_in_output, whole or in key tiles: block_k_grad_output; dq's norm there or in
    the WY kernel), its WY kernel on the whole key dimension or in key tiles of 64 (block_k_grad_wy) at 4 warps of its
    own (num_warps_grad_wy), taking dk through its norm after a last loop or as it goes (grad_wy_norm_one_pass).
    pick_config's own is "state_in_output-dq_norm_in_output-norms_one_pass"."""
    launch_with(monkeypatch, **request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, use_qk_l2norm", LAUNCH_CASES)
def test_split_state_part_matches_reference(guarded, split_grad_wy, shape, use_qk_l2norm, dtype):
    assert_launch_case_matches_reference(guarded, shape, use_qk_l2norm, dtype, is_per_channel=False)


@GPU_MEMORY_GROUP
def test_split_state_part_anchor_and_110_documents_bf16(guarded, split_grad_wy):
    # The speed shape with the forward's passes kept (as the model calls it), and the packed row of 110 documents
    # that once read out of bounds; then two runs on the same inputs bit for bit.
    inputs = make_inputs(4, 8192, 16, 128, 128, dtype=torch.bfloat16)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True, save_intermediates=True)
    bounds = torch.linspace(0, 16384, 111).round().to(torch.int32).to("cuda")
    inputs = make_inputs(1, 16384, 32, 128, 128, dtype=torch.bfloat16, num_seqs=110)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True, cu_seqlens=bounds)
    options = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=bounds, save_intermediates=True)
    first, second = (forward_and_grads(gated_delta_rule, inputs, **options) for _ in range(2))
    assert [name for name in first if not torch.equal(first[name], second[name])] == []


@pytest.fixture(params=[(64, 8), (32, 8), (None, 8)], ids=["k64-8_warps", "k32-8_warps", "whole_k-8_warps"])
def kda_products_tiles(monkeypatch, request):
    """KDA's products kernel in key tiles (KernelConfig.block_k_kda_grad_products; pick_config's 64) or over the
    whole K, at the kernel's warps (num_warps_kda_grad_products): sm_90 compile, Triton 3.6, 88 bytes of stack at 64
    and 8 warps, none at 32, 608 whole. At 16 warps and 32 columns the kernel made an illegal memory access
    (KernelConfig refuses more than 8 warps in tiles)."""
    block_k, num_warps = request.param
    launch_with(monkeypatch, block_k_kda_grad_products=block_k, num_warps_kda_grad_products=num_warps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, use_qk_l2norm", KDA_LAUNCH_CASES)
def test_kda_products_in_key_tiles_match_reference(guarded, kda_products_tiles, shape, use_qk_l2norm, dtype):
    assert_launch_case_matches_reference(guarded, shape, use_qk_l2norm, dtype, is_per_channel=True)


@GPU_MEMORY_GROUP
def test_kda_products_in_key_tiles_long_sequence_bf16(guarded, kda_products_tiles):
    # KDA at T8192 H16 K=V=128 (the reference's memory: test_kda_long_sequence_bf16_matches_reference).
    inputs = make_inputs(1, 8192, 16, 128, 128, dtype=torch.bfloat16, is_per_channel=True)
    assert_matches_reference(inputs, torch.bfloat16, guarded, use_qk_l2norm=True)


def test_kda_products_in_key_tiles_gate_bf16(guarded, kda_products_tiles):
    # The gate in the kernels: dA_log's per-chunk sums one a key tile.
    test_kda_gate_in_kernel_bf16_matches_reference(guarded, dict(T=1000, H=4, K=128, V=128), None)
