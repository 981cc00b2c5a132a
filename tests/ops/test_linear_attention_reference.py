"""linear_attention references: the chunked form against the token recurrence, the convention, and input checks.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_tune.ops.common.host_copy import host_values, remember
from moe_tune.ops.linear_attention import gated_delta_rule, kda
from moe_tune.ops.linear_attention.reference import (
    chunk_gated_delta_rule_ref,
    gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

# Two exact algorithms, so the gaps are rounding only; bf16 is for the output cast of an fp32 computation.
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-11),
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(
    B=1,
    T=8,
    H=2,
    K=16,
    V=16,
    *,
    dtype=torch.float64,
    is_per_channel=False,
    min_log_decay=-1.0,
    is_k_normalized=True,
    num_seqs=None,
    has_initial_state=True,
    seed=0,
):
    """Leaf tensors requiring grad. k is unit-norm unless asked: the delta rule is only stable for beta |k|^2 < 2."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = randn(B, T, H, K)
    if is_k_normalized:
        k = F.normalize(k, dim=-1)
    inputs = dict(
        q=randn(B, T, H, K),
        k=k,
        v=randn(B, T, H, V),
        # Log decay in [min_log_decay, 0].
        g=min_log_decay * rand(B, T, H, K) if is_per_channel else min_log_decay * rand(B, T, H),
        beta=rand(B, T, H).clamp(0.05, 0.95),
        initial_state=randn(num_seqs or B, H, K, V) if has_initial_state else None,
    )
    # States are fp32, or fp64 with fp64 inputs.
    state_dtype = torch.promote_types(dtype, torch.float32)
    return {
        name: None if x is None else x.to(state_dtype if name == "initial_state" else dtype).requires_grad_()
        for name, x in inputs.items()
    }


def forward_and_grads(fn, inputs, **options):
    """o, final state and the gradients of every input under a fixed random cotangent."""
    o, final_state = fn(**inputs, output_final_state=True, **options)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dfinal = torch.randn(final_state.shape, generator=gen, dtype=torch.float64).to(final_state.dtype)
    loss = (o * do).sum() + (final_state * dfinal).sum()
    names = [name for name in GRAD_NAMES if inputs[name] is not None]
    grads = torch.autograd.grad(loss, [inputs[name] for name in names])
    return {"o": o, "final_state": final_state, **{f"d{name}": grad for name, grad in zip(names, grads)}}


def assert_all_close(actual, expected, dtype):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


AGREE_CASES = [
    pytest.param(dict(T=1), id="T1"),  # a single token: one mostly padded chunk
    pytest.param(dict(T=63), id="T63"),  # one short of a chunk
    pytest.param(dict(T=64), id="T64"),  # exactly one chunk, no padding
    pytest.param(dict(T=65), id="T65"),  # one token into the second chunk
    pytest.param(dict(T=200), id="T200"),  # three chunks and a partial one
    pytest.param(dict(T=70, K=16, V=24), id="K16-V24"),  # K != V: the state is not square
    pytest.param(dict(B=2, T=70, H=3), id="B2-H3"),  # batch and an odd head count, vectorised
    pytest.param(dict(T=70, has_initial_state=False), id="zero-state"),  # no initial_state: zeros, no gradient
    pytest.param(dict(T=70, scale=0.3), id="scale"),  # explicit scale instead of K**-0.5
    pytest.param(dict(T=70, is_k_normalized=False, use_qk_l2norm=True), id="l2norm"),  # normalised inside
    pytest.param(dict(T=70, min_log_decay=-5.0), id="strong-decay"),  # per-head decay down to e^-5 a step
    pytest.param(dict(T=130, is_per_channel=True), id="kda"),  # per-channel decay, several chunks
    # Per-channel decay down to -5: cumulative log decay reaches about -160 in a chunk; exp(-G) would overflow.
    pytest.param(dict(T=130, is_per_channel=True, min_log_decay=-5.0), id="kda-strong-decay"),
    pytest.param(dict(T=50, chunk_size=16), id="chunk16"),  # another chunk length, 4 chunks
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", AGREE_CASES)
def test_chunk_matches_recurrent(case, dtype):
    case = dict(case)
    options = {name: case.pop(name) for name in ("scale", "use_qk_l2norm") if name in case}
    chunk_size = case.pop("chunk_size", 64)
    inputs = make_inputs(**case, dtype=dtype)
    expected = forward_and_grads(recurrent_gated_delta_rule_ref, inputs, **options)
    actual = forward_and_grads(chunk_gated_delta_rule_ref, inputs, chunk_size=chunk_size, **options)
    assert_all_close(actual, expected, dtype)


# 5: shorter than a chunk; 70: crosses a chunk boundary; 61: ends the pack mid-chunk.
DOC_LENGTHS = [5, 70, 61]


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(
    "doc_lengths",
    [
        pytest.param(DOC_LENGTHS, id="3docs"),
        pytest.param([5, 0, 70], id="empty-doc"),  # an empty document keeps its initial state
    ],
)
def test_varlen_equals_separate_documents(doc_lengths, is_per_channel):
    num_docs = len(doc_lengths)
    # Weak decay: without a reset, the previous document would leak visibly into the next one.
    inputs = make_inputs(T=sum(doc_lengths), num_seqs=num_docs, is_per_channel=is_per_channel, min_log_decay=-0.2)
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed_recurrent = forward_and_grads(recurrent_gated_delta_rule_ref, inputs, cu_seqlens=cu_seqlens)
    packed_chunk = forward_and_grads(chunk_gated_delta_rule_ref, inputs, cu_seqlens=cu_seqlens)
    assert_all_close(packed_chunk, packed_recurrent, torch.float64)

    o, final_state = chunk_gated_delta_rule_ref(
        **{name: x.detach() for name, x in inputs.items()}, output_final_state=True, cu_seqlens=cu_seqlens
    )
    for n, (bos, eos) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        doc = {name: x.detach()[:, bos:eos] for name, x in inputs.items() if name != "initial_state"}
        doc_state = inputs["initial_state"].detach()[n : n + 1]
        o_doc, final_doc = recurrent_gated_delta_rule_ref(**doc, initial_state=doc_state, output_final_state=True)
        torch.testing.assert_close(o[:, bos:eos], o_doc, **TOLERANCES[torch.float64], msg=lambda m: f"doc {n}: {m}")
        torch.testing.assert_close(final_state[n : n + 1], final_doc, **TOLERANCES[torch.float64])


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule_ref, chunk_gated_delta_rule_ref], ids=["recurrent", "chunk"])
def test_two_steps_match_hand_written_formula(fn, is_per_channel):
    # Pins the convention: decay before the delta rule, the delta measured on the decayed state, scale on the output.
    inputs = {name: x.detach() for name, x in make_inputs(T=2, H=1, K=3, V=2, is_per_channel=is_per_channel).items()}
    q, k, v, g, beta = (inputs[name][0, :, 0] for name in ("q", "k", "v", "g", "beta"))
    S0 = inputs["initial_state"][0, 0]  # [K, V]
    scale = 3**-0.5
    a1, a2 = g[0].exp(), g[1].exp()  # scalars, or [K] per channel
    a1, a2 = (a1[:, None], a2[:, None]) if is_per_channel else (a1, a2)
    S1 = a1 * S0
    S1 = S1 + beta[0] * torch.outer(k[0], v[0] - S1.T @ k[0])
    S2 = a2 * S1
    S2 = S2 + beta[1] * torch.outer(k[1], v[1] - S2.T @ k[1])
    expected_o = torch.stack([scale * S1.T @ q[0], scale * S2.T @ q[1]])

    o, final_state = fn(**inputs, output_final_state=True)
    torch.testing.assert_close(o[0, :, 0], expected_o, **TOLERANCES[torch.float64])
    torch.testing.assert_close(final_state[0, 0], S2, **TOLERANCES[torch.float64])


def test_qk_l2norm_is_flash_linear_attention_l2norm():
    inputs = {name: x.detach() for name, x in make_inputs(T=10, is_k_normalized=False).items()}
    o, _ = gated_delta_rule_ref(**inputs, use_qk_l2norm=True)
    for name in ("q", "k"):
        x = inputs[name]
        inputs[name] = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    expected, _ = gated_delta_rule_ref(**inputs)
    torch.testing.assert_close(o, expected, **TOLERANCES[torch.float64])


def test_low_precision_inputs_compute_in_fp32():
    inputs = {name: x.detach() for name, x in make_inputs(T=70).items()}
    low = {name: x.float() if name == "initial_state" else x.to(torch.bfloat16) for name, x in inputs.items()}
    o, final_state = gated_delta_rule_ref(**low, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert final_state.dtype == torch.float32
    expected, expected_state = recurrent_gated_delta_rule_ref(
        **{name: x.double() for name, x in low.items()}, output_final_state=True
    )
    torch.testing.assert_close(o, expected.to(torch.bfloat16), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(final_state, expected_state.float(), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("op", [gated_delta_rule, kda], ids=["gated_delta_rule", "kda"])
def test_public_op_runs_chunk_reference(op):
    inputs = make_inputs(T=70, num_seqs=2, is_per_channel=op is kda)
    cu_seqlens = torch.tensor([0, 30, 70])
    expected = forward_and_grads(chunk_gated_delta_rule_ref, inputs, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
    actual = forward_and_grads(op, inputs, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    assert_all_close(actual, expected, torch.float64)


def test_public_op_raises_when_kernel_forced(monkeypatch):
    # fp64 has no Triton kernel: an explicit request for one must fail, not fall back silently.
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="gated_delta_rule has no Triton kernel"):
        gated_delta_rule(**make_inputs())


BAD_INPUTS = [
    pytest.param(gated_delta_rule, "q", (8, 2, 16), r"q: shape \(8, 2, 16\) must be \[B, T, H, K\]", id="q-3d"),
    pytest.param(
        gated_delta_rule, "k", (1, 7, 2, 16), r"k: shape \(1, 7, 2, 16\) must match q \(1, 8, 2, 16\)", id="k-T"
    ),
    pytest.param(gated_delta_rule, "v", (1, 8, 3, 16), r"v: shape \(1, 8, 3, 16\) must be \[B, T, H, V\]", id="v-H"),
    pytest.param(
        gated_delta_rule,
        "g",
        (1, 8, 2, 16),
        r"g: shape \(1, 8, 2, 16\) must be \[B, T, H\] \(1, 8, 2\).*use kda",
        id="gdn-g-per-channel",
    ),
    pytest.param(
        kda, "g", (1, 8, 2), r"g: shape \(1, 8, 2\) must be \[B, T, H, K\] \(1, 8, 2, 16\)", id="kda-g-per-head"
    ),
    pytest.param(
        gated_delta_rule, "beta", (1, 8, 2, 1), r"beta: shape \(1, 8, 2, 1\) must be \[B, T, H\]", id="beta-4d"
    ),
    pytest.param(
        gated_delta_rule,
        "initial_state",
        (1, 2, 16, 8),
        r"initial_state: shape \(1, 2, 16, 8\) must be \[N, H, K, V\] \(1, 2, 16, 16\)",
        id="state-V",
    ),
]


@pytest.mark.parametrize("op, bad_name, bad_shape, message", BAD_INPUTS)
def test_bad_shapes_raise(op, bad_name, bad_shape, message):
    inputs = {name: x.detach() for name, x in make_inputs(is_per_channel=op is kda).items()}
    inputs[bad_name] = torch.zeros(bad_shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        op(**inputs)


def test_mixed_dtypes_raise():
    inputs = {name: x.detach() for name, x in make_inputs().items()}
    inputs["k"] = inputs["k"].float()
    with pytest.raises(ValueError, match=r"k: dtype torch.float32 must match q \(torch.float64\)"):
        gated_delta_rule(**inputs)


BAD_GATES = [
    pytest.param(dict(use_gate_in_kernel=True, dt_bias=torch.zeros(32)), r"A_log: required", id="no-A_log"),
    pytest.param(
        dict(use_gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(32)),
        r"A_log: shape \(3,\) must be \[2\]",
        id="A_log-heads",
    ),
    pytest.param(
        dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(16)),
        r"dt_bias: shape \(16,\) must be \[32\] or \[2, 16\]",
        id="dt_bias-width",
    ),
    pytest.param(dict(A_log=torch.zeros(2), dt_bias=torch.zeros(32)), r"given without use_gate_in_kernel=True",
                 id="without-flag"),  # fmt: skip
]


@pytest.mark.parametrize("options, message", BAD_GATES)
def test_bad_kda_gates_raise(options, message):
    inputs = {name: x.detach() for name, x in make_inputs(is_per_channel=True).items()}
    with pytest.raises(ValueError, match=message):
        kda(**inputs, **options)


def test_kda_gate_in_kernel_equals_the_gate_applied_first():
    # The reference path: use_gate_in_kernel computes -exp(A_log) softplus(a + dt_bias), then the same op.
    inputs = {name: x.detach() for name, x in make_inputs(is_per_channel=True).items()}
    a = torch.randn(inputs["g"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    A_log, dt_bias = torch.tensor([0.5, 2.0]), torch.linspace(-4, 1, 32)
    g = -A_log.double().exp()[:, None] * torch.nn.functional.softplus(a + dt_bias.double().view(2, 16))
    gated = kda(**{**inputs, "g": a}, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    plain = kda(**{**inputs, "g": g}, output_final_state=True)
    for x, y in zip(gated, plain):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


BAD_CU_SEQLENS = [
    pytest.param(dict(B=2), torch.tensor([0, 8]), r"cu_seqlens requires B == 1", id="B2"),
    pytest.param({}, torch.tensor([0.0, 8.0]), r"cu_seqlens: dtype torch.float32 must be int32 or int64", id="float"),
    pytest.param({}, torch.tensor([0, 5]), r"must start at 0 and end at T \(8\), got 0 ... 5", id="short"),
    pytest.param({}, torch.tensor([0, 6, 4, 8]), r"must never decrease", id="decreasing"),
    # Two sequences need two initial states.
    pytest.param(
        {}, torch.tensor([0, 4, 8]), r"initial_state: shape \(1, 2, 16, 16\) must be .* \(2, 2, 16, 16\)", id="state-N"
    ),
]


@pytest.mark.parametrize("shape, cu_seqlens, message", BAD_CU_SEQLENS)
def test_bad_cu_seqlens_raise(shape, cu_seqlens, message):
    inputs = {name: x.detach() for name, x in make_inputs(**shape).items()}
    with pytest.raises(ValueError, match=message):
        gated_delta_rule(**inputs, cu_seqlens=cu_seqlens)


def test_cu_seqlens_are_checked_from_the_host_copy_and_a_change_in_place_is_seen():
    # The op checks the bounds on the host through ops/common/host_copy.py (a device tensor is read once, then
    # remembered; tests/ops/test_host_copy.py). A remembered copy that disagrees shows that the check reads it; a
    # change in place is seen, so the check cannot go stale.
    inputs = {name: x.detach() for name, x in make_inputs(has_initial_state=False).items() if x is not None}
    cu_seqlens = torch.tensor([0, 3, 8])
    remember(cu_seqlens, torch.tensor([0, 9, 8]))
    with pytest.raises(ValueError, match=r"must never decrease, got \[0, 9, 8\]"):
        gated_delta_rule(**inputs, cu_seqlens=cu_seqlens)
    # An equal tensor is another tensor: its own values are read.
    first, _ = gated_delta_rule(**inputs, cu_seqlens=cu_seqlens.clone())
    cu_seqlens[1] = 3  # the same value, written in place: the remembered copy is stale now
    second, _ = gated_delta_rule(**inputs, cu_seqlens=cu_seqlens)
    assert torch.equal(first, second) and host_values(cu_seqlens).tolist() == [0, 3, 8]
    cu_seqlens[1] = 9
    with pytest.raises(ValueError, match=r"must never decrease, got \[0, 9, 8\]"):
        gated_delta_rule(**inputs, cu_seqlens=cu_seqlens)
