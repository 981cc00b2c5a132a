"""linear_attention Triton kernels in the interpreter: output, final state and every gradient against reference.py,
odd lengths, packed documents, NaN-filled buffers with guarded ends, the chunk map, dispatch.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

import dataclasses
import math
import types

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import record_constexpr, record_launches
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import torch.nn.functional as F
    from moe_tune.ops.linear_attention import gated_delta_rule, kda
    from moe_tune.ops.linear_attention import autograd, kernels_common, kernels_kda, kernels_output, kernels_state
    from moe_tune.ops.linear_attention import kernels_bwd, kernels_wy
    from moe_tune.ops.linear_attention.autograd import GatedDeltaRuleFunction
    from moe_tune.ops.linear_attention.reference import chunk_gated_delta_rule_ref, kda_gate_ref
    import triton
    import triton.language as tl

    @triton.jit
    def _unit_lower_inverse_kernel(a_ptr, out_ptr, BT: tl.constexpr, SB: tl.constexpr, DOTS: tl.constexpr):
        rows = tl.arange(0, BT)
        offsets = rows[:, None] * BT + rows[None, :]
        inverse = kernels_common.unit_lower_inverse(tl.load(a_ptr + offsets), BT, SB, DOTS)
        tl.store(out_ptr + offsets, inverse)

# One table per dtype, against the reference run in fp64 on the same input values. fp32: the interpreter's dots are
# fp32 products and only the summation order differs (measured max error 7.7e-6 on gradients of magnitude 17).
# fp16: W, U, the per-chunk states and v_new are rounded to fp16 between kernels and every dot takes fp16 operands,
# while the reference keeps fp32 throughout (measured max error 9.9e-3 on dk of magnitude 17, 1.1e-3 on o).
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
}
# Elements past the end of every kernel buffer: a whole 64-token chunk of the widest per-token tensor (H2 x V32).
GUARD_ELEMENTS = 64 * 2 * 32


pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernels_common, "alloc", buffers.alloc)
    return buffers


def make_inputs(
    B,
    T,
    H=2,
    K=16,
    V=32,
    *,
    dtype=torch.float32,
    is_per_channel=False,
    num_seqs=None,
    has_initial_state=True,
    max_decay=1.0,
    seed=0,
):
    """Leaf tensors requiring grad; k unit-norm (the delta rule is stable for beta |k|^2 < 2), initial state fp32,
    g [B, T, H] per head or [B, T, H, K] per channel (KDA)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs = dict(
        q=randn(B, T, H, K),
        k=F.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, H, V),
        # Log decay in [-max_decay, 0].
        g=-max_decay * torch.rand(B, T, H, *((K,) if is_per_channel else ()), generator=gen, dtype=torch.float64),
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64).clamp(0.05, 0.95),
        initial_state=randn(num_seqs or B, H, K, V) if has_initial_state else None,
    )
    return {
        name: None if x is None else x.to(torch.float32 if name == "initial_state" else dtype).requires_grad_()
        for name, x in inputs.items()
    }


def forward_and_grads(op, inputs, **options):
    """o, final_state and the gradient of every input for fixed random cotangents, all as fp64."""
    leaves = {name: x for name, x in inputs.items() if x is not None}
    o, final_state = op(**inputs, output_final_state=True, **options)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dfinal = torch.randn(final_state.shape, generator=gen, dtype=torch.float64).to(final_state.dtype)
    grads = torch.autograd.grad((o, final_state), list(leaves.values()), (do, dfinal))
    results = {"o": o, "final_state": final_state, **{f"d{name}": grad for name, grad in zip(leaves, grads)}}
    return {name: x.detach().double() for name, x in results.items()}


def assert_equal_to_fp32_rounding(actual, expected):
    """Two fp32 computations of the same values in another summation order: within 1e-5 of each element and 1e-6 of
    the tensor's largest (dg is a reverse cumulative sum: an element near zero keeps the rounding of its larger
    terms, a few ulp of the tensor's scale, whatever the order; 1.4e-6 on dg of scale 6.8 on one machine's numpy)."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        atol = 1e-6 * max(1.0, value.abs().max().item())
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_candidate_matches(candidate, default, inputs, dtype, guarded, cu_seqlens):
    """A launch candidate's outputs and gradients (L2 norm in the kernels): the fp64 reference's to the dtype's
    tolerance and, fp32, the default launch's to fp32 rounding."""
    expected = reference_in_fp64(inputs, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
    for name, value in expected.items():
        torch.testing.assert_close(candidate[name], value, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
    if dtype == torch.float32:
        assert_equal_to_fp32_rounding(candidate, default)
    guarded.check()


def reference_in_fp64(inputs, **options):
    as_fp64 = {name: None if x is None else x.detach().double().requires_grad_() for name, x in inputs.items()}
    return forward_and_grads(chunk_gated_delta_rule_ref, as_fp64, **options)


def assert_matches_reference(inputs, dtype, guarded, **options):
    op = kda if inputs["g"].ndim == 4 else gated_delta_rule
    actual = forward_and_grads(op, inputs, **options)
    options = {"use_qk_l2norm": options.pop("use_qk_l2norm_in_kernel", False), **options}
    expected = reference_in_fp64(inputs, **options)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
    guarded.check()


FIXED_LENGTH_CASES = [
    pytest.param(dict(B=2, T=1), {}, id="T1"),  # a single token: one chunk with one valid row
    pytest.param(dict(B=1, T=63, has_initial_state=False), {}, id="T63-no_h0"),  # one token short of a chunk
    pytest.param(dict(B=2, T=65), {"use_qk_l2norm_in_kernel": True}, id="T65-l2norm"),  # one token past a chunk
    pytest.param(dict(B=1, T=130), {}, id="T130"),  # three chunks, the last with two tokens
    pytest.param(dict(B=1, T=70, K=24, V=16), {}, id="K24-V16"),  # K > V, K not a power of two (masked K tile)
    # 64 steps of up to -5: exp(-G_j) alone would overflow fp32, the pairwise decays must not.
    pytest.param(dict(B=1, T=65, max_decay=5.0), {}, id="strong_decay"),
]


@pytest.mark.parametrize("shape, options", FIXED_LENGTH_CASES)
def test_gated_delta_rule_fp32_matches_reference(kernel_path, guarded, shape, options):
    inputs = make_inputs(**shape)
    assert_matches_reference(inputs, torch.float32, guarded, **options)


DOC_LENGTHS = [
    # Shorter than a chunk, one short of a chunk, and one crossing a chunk boundary.
    pytest.param([1, 63, 71], {"use_qk_l2norm_in_kernel": True}, True, id="1-63-71-l2norm"),
    # An empty document keeps its initial state; a full chunk is followed by a three-token document.
    pytest.param([64, 0, 3], {}, False, id="64-0-3-no_h0"),
]


@pytest.mark.parametrize("doc_lengths, options, has_initial_state", DOC_LENGTHS)
def test_gated_delta_rule_varlen_matches_reference(kernel_path, guarded, doc_lengths, options, has_initial_state):
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = make_inputs(1, sum(doc_lengths), num_seqs=len(doc_lengths), has_initial_state=has_initial_state)
    assert_matches_reference(inputs, torch.float32, guarded, cu_seqlens=cu_seqlens, **options)


SPLIT_GRAD_CASES = [
    *FIXED_LENGTH_CASES,
    pytest.param(dict(B=1, T=135, num_seqs=3), {"cu_seqlens": [0, 1, 64, 135], "use_qk_l2norm_in_kernel": True},
                 id="varlen-1-63-71-l2norm"),  # fmt: skip
    pytest.param(dict(B=1, T=67, num_seqs=3, has_initial_state=False), {"cu_seqlens": [0, 64, 64, 67]},
                 id="varlen-64-0-3-no_h0"),  # fmt: skip
    # K 40 in key tiles of 16 (k_tiles): two full tiles and a masked one, with and without the L2 norm.
    pytest.param(dict(B=1, T=135, K=40, num_seqs=3), {"cu_seqlens": [0, 1, 64, 135], "use_qk_l2norm_in_kernel": True},
                 id="K40-varlen-l2norm"),  # fmt: skip
    pytest.param(dict(B=2, T=65, K=40, V=16), {}, id="K40-V16"),
]


# split_grad_wy's launches: the WY kernel on the whole K or in key tiles of 16, its state part in a kernel of its own
# or in the output kernel (grad_state_in_output), and the kernels each launches besides the forward's.
SPLIT_GRAD_CONFIGS = [
    pytest.param(dict(block_k_grad_wy=None), {"_chunk_grad_output_kernel", "_chunk_grad_state_kernel"},
                 id="whole_k"),  # fmt: skip
    pytest.param(dict(block_k_grad_wy=16), {"_chunk_grad_output_kernel", "_chunk_grad_state_kernel"}, id="k_tiles"),
    pytest.param(dict(grad_state_in_output=True), {"_chunk_grad_output_state_kernel"}, id="state_in_output"),
    pytest.param(dict(block_k_grad_wy=16, grad_state_in_output=True, block_k_grad_output=16),
                 {"_chunk_grad_output_state_kernel"}, id="k_tiles-state_in_output_k_tiles"),  # fmt: skip
    pytest.param(dict(block_k_grad_wy=16, grad_state_in_output=True, grad_dq_norm_in_output=True),
                 {"_chunk_grad_output_state_kernel"}, id="k_tiles-state_in_output-dq_norm_in_output"),  # fmt: skip
]


@pytest.mark.parametrize("split, state_kernels", SPLIT_GRAD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, options", SPLIT_GRAD_CASES)
def test_backward_with_the_state_part_split_off_matches_reference(kernel_path, guarded, monkeypatch, shape, options,
                                                                   dtype, split, state_kernels):  # fmt: skip
    # split_grad_wy: the state part writes dW and adds its parts of dk and dG (G_C's gradient on the chunk's last
    # token) before the WY kernel runs; each token's dg must still get G_C's gradient, and an empty or one-token
    # chunk its own.
    launched = record_launches(monkeypatch, kernels_bwd, (
        "_chunk_grad_output_kernel", "_chunk_grad_state_kernel", "_chunk_grad_output_state_kernel",
        "_chunk_grad_wy_tiled_kernel", "_chunk_grad_wy_kernel"))  # fmt: skip
    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
        kernels_common.pick_config(x), split_grad_wy=True, **split))  # fmt: skip
    options = dict(options)
    if "cu_seqlens" in options:
        options["cu_seqlens"] = torch.tensor(options["cu_seqlens"], dtype=torch.int32)
    inputs = make_inputs(**shape, dtype=dtype)
    assert_matches_reference(inputs, dtype, guarded, **options)
    # Split, the tiled WY kernel takes the one-kernel WY kernel's place (in one key tile where block_k_grad_wy is
    # None or K's tile is no wider).
    assert set(launched) == state_kernels | {"_chunk_grad_wy_tiled_kernel"}


@pytest.mark.parametrize(
    "split",
    [{}, dict(grad_state_in_output=True, block_k_grad_output=16), dict(grad_state_in_output=True,
                                                                        grad_dq_norm_in_output=True)],
    ids=["state_kernel", "state_in_output_k_tiles", "state_in_output-dq_norm_in_output"],
)  # fmt: skip
def test_split_backward_equals_the_one_kernel_backward(kernel_path, monkeypatch, split):
    # The same gradients to fp32 rounding: only the order of a few fp32 sums differs (dk_end added to the output
    # kernel's part before the pairs' terms, G_C's gradient summed into the last token's dG).
    inputs = make_inputs(1, 135, num_seqs=3)
    cu_seqlens = torch.tensor([0, 1, 64, 135], dtype=torch.int32)
    whole = forward_and_grads(gated_delta_rule, inputs, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
        kernels_common.pick_config(x), split_grad_wy=True, **split))  # fmt: skip
    split = forward_and_grads(gated_delta_rule, inputs, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    assert_equal_to_fp32_rounding(split, whole)


@pytest.mark.parametrize("split, shape, cu_seqlens, dtype", [
    # dq through its norm in the same loop (the state part in the output kernel, whole K there), WY key tiles of 16
    # over K 40: two full tiles and a masked one.
    pytest.param(dict(block_k_grad_wy=16, grad_state_in_output=True), dict(B=1, T=135, K=40, num_seqs=3),
                 [0, 1, 64, 135], torch.float32, id="K40-k_tiles-dq_norm_in_wy-fp32"),
    pytest.param(dict(block_k_grad_wy=16, grad_state_in_output=True, block_k_grad_output=16),
                 dict(B=1, T=135, K=40, num_seqs=3), [0, 1, 64, 135], torch.float16,
                 id="K40-k_tiles-output_k_tiles-fp16"),
    # dq's norm in the output kernel; the WY kernel on the whole K.
    pytest.param(dict(grad_state_in_output=True, grad_dq_norm_in_output=True), dict(B=2, T=65), None, torch.float32,
                 id="whole_k-dq_norm_in_output-fp32"),
    # The state part in a kernel of its own (no dq in the WY kernel).
    pytest.param(dict(block_k_grad_wy=16), dict(B=1, T=67, num_seqs=3, has_initial_state=False), [0, 64, 64, 67],
                 torch.float16, id="state_kernel-fp16"),
])  # fmt: skip
def test_wy_kernel_norms_in_one_pass_match_the_two_pass_form(kernel_path, guarded, monkeypatch, split, shape,
                                                               cu_seqlens, dtype):  # fmt: skip
    # KernelConfig.grad_wy_norm_one_pass: sum(k * dk) from k k^T, the pairs' gradient, sum(k * dK') and the earlier
    # kernels' parts before the dk loop, dk normed as it is made (dq in the last loop alone): the reference's values,
    # and in fp32 the two-pass form's to fp32 rounding (fp16: the pairs' term takes k's fp16 rounding on one side).
    def launch(**fields):
        monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
            kernels_common.pick_config(x), split_grad_wy=True, **split, **fields))  # fmt: skip

    options = dict(use_qk_l2norm_in_kernel=True)
    if cu_seqlens is not None:
        options["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32)
    inputs = make_inputs(**shape, dtype=dtype)
    # Keys of norms 0.5 to 3 (make_inputs' are unit-norm): the norm's factors must not cancel.
    norms = torch.linspace(0.5, 3.0, inputs["k"].shape[1]).to(dtype)[None, :, None, None]
    inputs["k"] = (inputs["k"].detach() * norms).requires_grad_()
    flags = record_constexpr(monkeypatch, kernels_bwd, "_chunk_grad_wy_tiled_kernel", "NORM_ONE_PASS")
    launch()
    two_pass = forward_and_grads(gated_delta_rule, inputs, **options)
    launch(grad_wy_norm_one_pass=True)
    one_pass = forward_and_grads(gated_delta_rule, inputs, **options)
    assert flags == [False, True]
    assert_candidate_matches(one_pass, two_pass, inputs, dtype, guarded, options.get("cu_seqlens"))


def test_gated_delta_rule_without_final_state(kernel_path, guarded):
    # The training call: no state in or out, so the backward starts from a zero state gradient it never receives.
    names = ("q", "k", "v", "g", "beta")
    inputs = make_inputs(1, 65, has_initial_state=False)
    as_fp64 = {name: inputs[name].detach().double().requires_grad_() for name in names}
    o, final_state = gated_delta_rule(**inputs)
    o_ref = chunk_gated_delta_rule_ref(**as_fp64)[0]
    assert final_state is None
    grads = torch.autograd.grad(o.sum(), [inputs[name] for name in names])
    grads_ref = torch.autograd.grad(o_ref.sum(), list(as_fp64.values()))
    for name, actual, expected in zip(("o", *names), (o, *grads), (o_ref, *grads_ref)):
        torch.testing.assert_close(actual.double(), expected, **TOLERANCES[torch.float32], msg=lambda m: f"{name}: {m}")
    guarded.check()


FP16_CASES = [
    pytest.param(dict(B=1, T=65), None, id="T65"),
    pytest.param(dict(B=1, T=135, num_seqs=3), [0, 1, 64, 135], id="varlen-1-63-71"),
]


@pytest.mark.parametrize("shape, cu_seqlens", FP16_CASES)
def test_gated_delta_rule_fp16_matches_reference(kernel_path, guarded, shape, cu_seqlens):
    inputs = make_inputs(**shape, dtype=torch.float16)
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    assert_matches_reference(inputs, torch.float16, guarded, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
def test_16bit_wu_operands_match_reference(kernel_path, guarded, monkeypatch, is_per_channel):
    # K = V = 64 with the GPU's U tile of 64: the WY pass multiplies W's and U's operands in fp16
    # (wu_operands_16bit), as on the GPU.
    def wide_wy_tile(x):
        return dataclasses.replace(
            kernels_common.pick_config(x), block_v_wy=kernels_common.GPU_BLOCK_V_WY,
            block_v_wy_16bit=kernels_common.GPU_BLOCK_V_WY_16BIT,
        )

    monkeypatch.setattr(autograd, "pick_config", wide_wy_tile)
    inputs = make_inputs(1, 70, H=1, K=64, V=64, dtype=torch.float16, is_per_channel=is_per_channel)
    assert kernels_wy.wu_operands_16bit(torch.float16, 64, 64, wide_wy_tile(inputs["k"]))
    assert_matches_reference(inputs, torch.float16, guarded, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("K, takes_k_end", [(16, True), (12, False)])
def test_state_passes_read_the_decayed_k_only_for_full_key_tiles(kernel_path, monkeypatch, is_per_channel, K,
                                                                  takes_k_end):  # fmt: skip
    # The forward (with the output kernel: K's tile no wider than the interpreter's V tile of 16) and the backward's
    # recomputation both run the serial pass; K 12 (a tile of 16) keeps the decay in its loop (has_k_end: what the
    # H200 got wrong at K 100).
    calls = []
    chunk_state_fwd, chunk_state_bwd = autograd.chunk_state_fwd, autograd.chunk_state_bwd

    def recording(*args, **kwargs):
        calls.append(kwargs.get("k_end_THK") is not None)
        return chunk_state_fwd(*args, **kwargs)

    def recording_bwd(*args, **kwargs):
        calls.append(kwargs.get("prepared") is not None)
        return chunk_state_bwd(*args, **kwargs)

    monkeypatch.setattr(autograd, "chunk_state_fwd", recording)
    monkeypatch.setattr(autograd, "chunk_state_bwd", recording_bwd)
    inputs = make_inputs(1, 70, K=K, V=32, is_per_channel=is_per_channel)
    assert kernels_output.has_output_kernel(K, 32, kernels_common.pick_config(inputs["q"]))
    op = kda if is_per_channel else gated_delta_rule
    o, _ = op(**inputs, use_qk_l2norm_in_kernel=True)
    o.sum().backward()
    # Forward, the backward's recomputation, the reverse pass (prepared operands with the decayed k).
    assert calls == [takes_k_end] * 3
    assert kernels_wy.has_k_end(K) is takes_k_end and not kernels_wy.has_k_end(100)


SAVED_CASES = [
    # The output kernel, the WY pass's decayed k and the output kernel's prepared operands (K's tile no wider than the
    # interpreter's V tile): no prepare_state_bwd in backward.
    pytest.param(16, 32, torch.float32, True, id="K16-V32-output_kernel"),
    # V's tile narrower than K's: the serial pass writes the output and, when saving, the states too.
    pytest.param(32, 16, torch.float32, False, id="K32-V16-serial_output"),
    # K not a power of two: no decayed k from the WY pass and no prepared operands, either way.
    pytest.param(12, 32, torch.float32, False, id="K12-V32-no_k_end"),
    pytest.param(16, 32, torch.float16, True, id="K16-V32-fp16"),
]


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("K, V, dtype, skips_prepare", SAVED_CASES)
def test_saved_intermediates_match_reference_with_fewer_passes(kernel_path, guarded, monkeypatch, is_per_channel, K,
                                                               V, dtype, skips_prepare):  # fmt: skip
    # Keeping the forward's passes: the WY and serial state passes run once (forward) instead of twice, and where the
    # output kernel wrote the reverse pass's operands no prepare pass runs; documents of 1, 63 and 6 tokens.
    calls = []

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name in ("_wy_pass", "chunk_state_fwd", "prepare_state_bwd"):
        monkeypatch.setattr(autograd, name, recording(name, getattr(autograd, name)))
    cu_seqlens = torch.tensor([0, 1, 64, 70], dtype=torch.int32)
    inputs = make_inputs(1, 70, K=K, V=V, dtype=dtype, is_per_channel=is_per_channel, num_seqs=3)
    op = kda if is_per_channel else gated_delta_rule
    options = dict(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    recomputed = forward_and_grads(op, inputs, **options)
    has_prepare = kernels_wy.has_k_end(K)
    assert calls == ["_wy_pass", "chunk_state_fwd"] * 2 + ["prepare_state_bwd"] * has_prepare
    calls.clear()
    saved = forward_and_grads(op, inputs, save_intermediates=True, **options)
    assert calls == ["_wy_pass", "chunk_state_fwd"] + ["prepare_state_bwd"] * (has_prepare and not skips_prepare)
    expected = reference_in_fp64(inputs, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
        if skips_prepare:
            # Only the prepared operands' rounding differs (the output kernel scales raw products after its loop).
            torch.testing.assert_close(saved[name], recomputed[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(saved[name], recomputed[name]), name
    guarded.check()


def test_saved_intermediates_take_the_bytes_docs_plan_counts(kernel_path):
    # docs/plan.md (engine/plan.py) counts T H (3K + V + 2C) + ceil(T / C) H K V values in the inputs' dtype
    # and T H fp32 (G) for a layer that keeps them; the op must save exactly that much more than without.
    T, H, K, V, C = 128, 2, 16, 32, kernels_common.CHUNK_SIZE

    def saved_bytes(**options):
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        inputs = make_inputs(1, T, H=H, K=K, V=V, dtype=torch.float16, has_initial_state=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True, **options)
        return sum(storages.values())

    expected = (T * H * (3 * K + V + 2 * C) + -(-T // C) * H * K * V) * 2 + T * H * 4
    assert saved_bytes(save_intermediates=True) - saved_bytes() == expected


def test_saved_intermediates_are_kept_only_when_a_gradient_is_needed(kernel_path):
    inputs = {name: x.detach() for name, x in make_inputs(1, 70).items()}
    stored = []

    def recording_wy(*args, **kwargs):
        stored.append(args[9])  # store_for_backward
        return wy_pass(*args, **kwargs)

    wy_pass = autograd._wy_pass
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autograd, "_wy_pass", recording_wy)
        o, _ = gated_delta_rule(**inputs, save_intermediates=True)
        inputs["q"].requires_grad_()
        o_grad, _ = gated_delta_rule(**inputs, save_intermediates=True)
    assert stored == [False, True]
    assert o.grad_fn is None and torch.equal(o, o_grad.detach())


@pytest.mark.parametrize("dtype, K, V, expected", [
    (torch.bfloat16, 128, 128, True), (torch.float16, 64, 64, True), (torch.bfloat16, 128, 32, False),
    (torch.bfloat16, 32, 128, False), (torch.float32, 128, 128, False),
])  # fmt: skip
def test_wu_operands_16bit_only_for_16bit_inputs_and_wide_tiles(dtype, K, V, expected):
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))
    assert kernels_wy.wu_operands_16bit(dtype, K, V, gpu) is expected
    assert not kernels_wy.wu_operands_16bit(dtype, K, V, dataclasses.replace(gpu, wu_16bit=False))


KDA_CASES = [
    pytest.param(dict(B=2, T=1), {}, id="T1"),  # a single token: one chunk with one valid row
    pytest.param(dict(B=1, T=65), {"use_qk_l2norm_in_kernel": True}, id="T65-l2norm"),  # one token past a chunk
    pytest.param(dict(B=1, T=70, K=24, V=16, has_initial_state=False), {}, id="K24-V16-no_h0"),  # K > V, masked K
    # Per channel, 64 steps of up to -6: exp(-G_j) alone would overflow fp32 in every sub-chunk split.
    pytest.param(dict(B=1, T=130, H=1, max_decay=6.0), {}, id="T130-strong_decay"),
]


@pytest.mark.parametrize("shape, options", KDA_CASES)
def test_kda_fp32_matches_reference(kernel_path, guarded, shape, options):
    inputs = make_inputs(**shape, is_per_channel=True)
    assert_matches_reference(inputs, torch.float32, guarded, **options)


def test_kda_varlen_and_fp16_match_reference(kernel_path, guarded):
    # Documents of 1, 63 and 71 tokens, fp16: the packed path and the 16-bit path of the per-channel kernels at once.
    cu_seqlens = torch.tensor([0, 1, 64, 135], dtype=torch.int32)
    inputs = make_inputs(1, 135, H=1, dtype=torch.float16, is_per_channel=True, num_seqs=3)
    assert_matches_reference(inputs, torch.float16, guarded, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)


def mild_then_strong_decays(dtype):
    """KDA inputs of three chunks: the first with decays of at most 0.25 per token (a sub-chunk's span <= 3.75, within
    both bounds: pairs in one sub-chunk by dots), the second of up to 30 (spans up to 450: elementwise), the third
    two tokens of mild ones."""
    inputs = make_inputs(1, 130, dtype=dtype, is_per_channel=True)
    gen = torch.Generator().manual_seed(7)
    g = -0.25 * torch.rand(inputs["g"].shape, generator=gen, dtype=torch.float64)
    g[:, 64:128] *= 120.0
    inputs["g"] = g.to(dtype).requires_grad_()
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("within_sub_chunk", ["by_span", "elementwise_only"])
def test_kda_pairs_within_a_sub_chunk_both_paths_match_reference(
    kernel_path, guarded, monkeypatch, dtype, within_sub_chunk
):
    # Each program takes pairs within a sub-chunk by tensor-core dots when its chunk's decays are mild and
    # elementwise otherwise (kernels_kda's module docstring); "elementwise_only" sets the bounds below every span.
    if within_sub_chunk == "elementwise_only":
        monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND", -1.0)
        monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND_NORMED", -1.0)
        monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND_FP16", -1.0)
    assert_matches_reference(mild_then_strong_decays(dtype), dtype, guarded, use_qk_l2norm_in_kernel=True)


@pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)
def test_kda_dot_path_needs_its_span_bound(kernel_path, guarded, monkeypatch):
    # The bound is what keeps exp(G_r - G_j) finite: without it the strong chunk's dots overflow (e^450 in fp32).
    monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND", float("inf"))
    monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND_NORMED", float("inf"))
    o, _ = kda(**mild_then_strong_decays(torch.float32), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert not bool(o[:, 64:128].isfinite().all())
    assert bool(o[:, :64].isfinite().all())


def blocks_by_span(dtype, bound=None):
    """KDA inputs of four chunks and a 7-token tail whose per-token decays (0.9-1.0 of d, every channel) put each
    chunk's span in another path of the kernels taking pairs by blocks: the whole chunk as one block, its halves,
    its sub-chunks by dots, its sub-chunks elementwise (d = 0.8 B / 63, 0.8 B / 31, 0.8 B / 15, 2 B / 15 for the
    bound B: the forward's unless given)."""
    if bound is None:
        bound = kernels_kda.fast_span_bound(dtype, is_normed=True)
    decays = [0.8 * bound / 63, 0.8 * bound / 31, 0.8 * bound / 15, 2 * bound / 15, 0.8 * bound / 63]
    inputs = make_inputs(1, 4 * 64 + 7, is_per_channel=True, dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    scale = 0.9 + 0.1 * torch.rand(inputs["g"].shape, generator=gen, dtype=torch.float64)
    per_token = torch.tensor([decays[t // 64] for t in range(4 * 64 + 7)], dtype=torch.float64)
    inputs["g"] = (-scale * per_token[None, :, None, None]).to(dtype).requires_grad_()
    # Each chunk's spans (G at a block's first row minus G at its last) pick its path as the docstring says.
    G = inputs["g"].detach().double()[0, : 4 * 64].reshape(4, 64, -1).cumsum(1)
    spans = {rows: (G[:, 0:64 - rows + 1:rows] - G[:, rows - 1::rows]).amax(dim=(1, 2)) for rows in (64, 32, 16)}
    expected_paths = [
        spans[64][0] <= bound,
        spans[64][1] > bound >= spans[32][1],
        spans[32][2] > bound >= spans[16][2],
        spans[16][3] > bound,
    ]
    assert all(bool(path) for path in expected_paths), spans
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kda_pairs_by_every_block_size_match_reference(kernel_path, guarded, dtype):
    # One chunk on each path of the pairs kernel (whole, halves, sub-chunks, elementwise), with L2-normed q and k (the
    # forward's larger bound).
    assert_matches_reference(blocks_by_span(dtype), dtype, guarded, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_k_products", [None, 16], ids=["whole_k", "k_tiles"])
def test_kda_decayed_products_by_every_block_size_match_reference(kernel_path, guarded, monkeypatch, dtype,
                                                                   block_k_products):  # fmt: skip
    # The gradient's decayed products take blocks by their own bound (unnormed operands; kernels_kda._product_blocks):
    # one chunk on each path, spans per key tile too.
    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
        kernels_common.pick_config(x), block_k_kda_grad_products=block_k_products))  # fmt: skip
    inputs = blocks_by_span(dtype, kernels_kda.fast_span_bound(dtype))
    assert_matches_reference(inputs, dtype, guarded, use_qk_l2norm_in_kernel=True)


@pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)
def test_kda_decayed_products_need_their_span_bound(kernel_path, guarded, monkeypatch):
    # Without the gradient's bound its blocks take the strong chunk whole: exp(G_e - G_j) overflows there, and only
    # there; the forward (L2-normed q and k, its own bound) stays finite.
    monkeypatch.setattr(kernels_kda, "FAST_SPAN_BOUND", float("inf"))
    results = forward_and_grads(kda, mild_then_strong_decays(torch.float32), use_qk_l2norm_in_kernel=True)
    assert bool(results["o"].isfinite().all())
    assert not bool(results["dq"][:, 64:128].isfinite().all())
    assert bool(results["dq"][:, :64].isfinite().all())


# KDA's products kernel in key tiles of 16 (KernelConfig.block_k_kda_grad_products): K 24 and 40 (a masked last tile),
# with and without the L2 norm (its factors over the whole row, its backward in a kernel of its own), fp32 and fp16,
# packed documents, strong decays (pairs within a sub-chunk elementwise, the re-read rows scaled by their norms).
KDA_TILED_CASES = [
    pytest.param(dict(B=1, T=65, K=40), {"use_qk_l2norm_in_kernel": True}, torch.float32, id="T65-K40-l2norm"),
    pytest.param(dict(B=2, T=70, K=24, V=16, has_initial_state=False), {}, torch.float32, id="K24-V16-no_h0"),
    pytest.param(dict(B=1, T=130, H=1, K=40, max_decay=6.0), {"use_qk_l2norm_in_kernel": True}, torch.float32,
                 id="T130-K40-strong_decay-l2norm"),  # fmt: skip
    pytest.param(dict(B=1, T=135, H=1, K=40, num_seqs=3), {"cu_seqlens": [0, 1, 64, 135], "use_qk_l2norm_in_kernel":
                 True}, torch.float16, id="varlen-K40-fp16-l2norm"),  # fmt: skip
]


@pytest.mark.parametrize("within_sub_chunk", ["by_span", "elementwise_only"])
@pytest.mark.parametrize("shape, options, dtype", KDA_TILED_CASES)
def test_kda_products_in_key_tiles_match_reference(kernel_path, guarded, monkeypatch, shape, options, dtype,
                                                   within_sub_chunk):  # fmt: skip
    launched = record_launches(monkeypatch, kernels_kda, (
        "_kda_grad_products_kernel", "_kda_grad_products_tiled_kernel", "_l2norm_bwd_rows_kernel"))  # fmt: skip
    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
        kernels_common.pick_config(x), block_k_kda_grad_products=16))  # fmt: skip
    if within_sub_chunk == "elementwise_only":
        for bound in ("FAST_SPAN_BOUND", "FAST_SPAN_BOUND_NORMED", "FAST_SPAN_BOUND_FP16"):
            monkeypatch.setattr(kernels_kda, bound, -1.0)
    options = dict(options)
    if "cu_seqlens" in options:
        options["cu_seqlens"] = torch.tensor(options["cu_seqlens"], dtype=torch.int32)
    is_normed = options.get("use_qk_l2norm_in_kernel", False)
    assert_matches_reference(make_inputs(**shape, dtype=dtype, is_per_channel=True), dtype, guarded, **options)
    assert set(launched) == {"_kda_grad_products_tiled_kernel"} | ({"_l2norm_bwd_rows_kernel"} if is_normed else set())


@pytest.mark.parametrize("dtype, shape, doc_lengths", [
    pytest.param(torch.float32, dict(T=130, K=24, V=16), None, id="fp32-T130-K24"),
    pytest.param(torch.float32, dict(T=70, K=40), [1, 63, 6], id="fp32-varlen-K40"),
    pytest.param(torch.float16, dict(T=65), None, id="fp16-T65"),
])  # fmt: skip
@pytest.mark.parametrize("block_k_products", [None, 16], ids=["whole_k", "k_tiles"])
def test_kda_gate_in_kernel_matches_reference(kernel_path, guarded, monkeypatch, dtype, shape, doc_lengths,
                                              block_k_products):  # fmt: skip
    # The log decay -exp(A_log) softplus(a + dt_bias) computed in the kernels, against the reference applying the
    # same gate first: o, the final state and the gradients of q, k, v, a, beta, the initial state, A_log, dt_bias;
    # with the products kernel in key tiles too (dA_log's per-chunk sums one a tile).
    monkeypatch.setattr(autograd, "pick_config", lambda x: dataclasses.replace(
        kernels_common.pick_config(x), block_k_kda_grad_products=block_k_products))  # fmt: skip
    num_seqs = None if doc_lengths is None else len(doc_lengths)
    inputs = make_inputs(1, **shape, dtype=dtype, is_per_channel=True, num_seqs=num_seqs)
    H, K = inputs["q"].shape[2], inputs["q"].shape[3]
    gen = torch.Generator().manual_seed(5)
    # FLA's KDA init (decay rates in [1, 16), dt = softplus(dt_bias) in [1e-3, 0.1]) and raw gates of std 2:
    # a + dt_bias from about -13 to 4, softplus's flat tail and its curved part, log decays down to about -60.
    inputs["g"] = (2 * torch.randn(inputs["g"].shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    A_log = torch.empty(H, dtype=torch.float64).uniform_(1, 16, generator=gen).log().float().requires_grad_()
    dt = torch.empty(H * K, dtype=torch.float64).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).float().requires_grad_()
    options = {}
    if doc_lengths is not None:
        options["cu_seqlens"] = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
    actual = forward_and_grads(
        kda, {**inputs, "A_log": A_log, "dt_bias": dt_bias}, use_gate_in_kernel=True, **options
    )

    def reference(q, k, v, g, beta, initial_state, A_log, dt_bias, **rest):
        return chunk_gated_delta_rule_ref(
            q, k, v, kda_gate_ref(g, A_log, dt_bias), beta, initial_state=initial_state, **rest
        )

    as_fp64 = {name: None if x is None else x.detach().double().requires_grad_() for name, x in inputs.items()}
    expected = forward_and_grads(
        reference, {**as_fp64, "A_log": A_log.detach().double().requires_grad_(),
                    "dt_bias": dt_bias.detach().double().requires_grad_()}, **options,
    )  # fmt: skip
    assert actual.keys() == expected.keys() and {"dA_log", "ddt_bias", "dg"} <= actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")
    guarded.check()


def correlated_keys_matrix(BT, gen):
    """A = beta tril(k k^T, -1) of unit keys at cosine ~0.9 and beta near 1, no decay: the exact inverse stays near
    1 in every entry, while the powers of its 16 x 16 diagonal blocks reach ~1.5e3 (fp64, 20 draws: what broke the
    doubling products this replaced)."""
    k = F.normalize(torch.randn(1, 128, generator=gen, dtype=torch.float64)
                    + 0.3 * torch.randn(BT, 128, generator=gen, dtype=torch.float64), dim=-1)  # fmt: skip
    beta = 0.9 + 0.1 * torch.rand(BT, 1, generator=gen, dtype=torch.float64)
    return (beta * (k @ k.T)).tril(-1)


# Bounds on the largest error relative to the largest entry: the fp32 inputs' dots ("tf32x3"; the interpreter ignores
# input_precision and multiplies in fp32, measured <= 1.7e-7) and fp16 operands ("fp16", the 16-bit inputs' inverse;
# measured <= 1.2e-3). The doubling products this replaced gave 2.3e-4 and 0.74 on the correlated keys at BT 64.
INVERSE_BOUNDS = {"tf32x3": 1e-6, "fp16": 3e-3}


@pytest.mark.parametrize("dots", ["tf32x3", "fp16"])
@pytest.mark.parametrize("case", ["uniform", "correlated_keys"])
@pytest.mark.parametrize("BT", [16, 32, 64])
def test_unit_lower_inverse_equals_the_exact_inverse(BT, case, dots):
    # The WY pass's (I + A)^-1 by block forward substitution. Uniform entries up to 0.5 reach every level of the
    # substitution; correlated keys make the powers of A large, so a form that cancels them loses the result.
    gen = torch.Generator().manual_seed(0)
    if case == "uniform":
        A = ((torch.rand(BT, BT, generator=gen, dtype=torch.float64) - 0.5)).tril(-1)
    else:
        A = correlated_keys_matrix(BT, gen)
    expected = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A)
    actual = torch.empty(BT, BT)
    _unit_lower_inverse_kernel[(1,)](A.float().contiguous(), actual, BT=BT, SB=16, DOTS=dots)
    error = (actual.double() - expected).abs().max() / expected.abs().max()
    assert error < INVERSE_BOUNDS[dots], f"relative error {error:.1e}"


@pytest.mark.parametrize("dtype, use_qk_l2norm, expected", [
    (torch.float32, True, "tf32x3"), (torch.float32, False, "tf32x3"), (torch.bfloat16, True, "fp16"),
    (torch.float16, True, "fp16"), (torch.bfloat16, False, "tf32"),
])  # fmt: skip
def test_inverse_takes_fp16_products_only_for_16bit_inputs_with_normed_keys(dtype, use_qk_l2norm, expected):
    # fp16 operands need the factors' range: keys the op norms itself bound A's entries by beta <= 1.
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))
    assert kernels_common.inverse_dots(dtype, use_qk_l2norm, gpu) == expected


@pytest.mark.parametrize("dtype, expected", [
    (torch.float32, ("tf32x3", "tf32x3")), (torch.bfloat16, ("tf32", "tf32")), (torch.float16, ("tf32", "tf32")),
])  # fmt: skip
def test_fp32_inputs_take_3xtf32_dots(dtype, expected):
    # fp32: 3xTF32 on the tensor cores ("ieee" compiles to unrolled FMAs on Hopper); 16-bit: tf32 for fp32 tiles.
    assert kernels_common.dot_precisions(dtype) == expected


def test_chunk_map_covers_every_chunk_once():
    cu_seqlens = torch.tensor([0, 1, 1, 65, 200], dtype=torch.int32)
    layout = kernels_common.prepare_chunks(cu_seqlens, 1, 200, chunk_size=64)
    # 1 + 0 + 1 + 3 chunks within the bound T // C + N = 7 slots.
    assert layout.num_slots == 7
    assert layout.chunk_offsets.tolist() == [0, 1, 1, 2, 5]
    assert layout.chunk_map.tolist() == [[0, 1], [1, 64], [65, 64], [129, 64], [193, 7], [257, 0], [321, 0]]


def test_chunk_layout_is_reused_for_the_same_cu_seqlens_until_it_changes():
    cu_seqlens = torch.tensor([0, 1, 1, 65, 200], dtype=torch.int32)
    layout = kernels_common.prepare_chunks(cu_seqlens, 1, 200)
    assert kernels_common.prepare_chunks(cu_seqlens, 1, 200) is layout
    # Equal values in another tensor: built again (the cache goes by the tensor, never by an id that could be reused).
    assert kernels_common.prepare_chunks(cu_seqlens.clone(), 1, 200) is not layout
    # Changed in place: built again, from the new values.
    cu_seqlens[1:4] = torch.tensor([64, 64, 64], dtype=torch.int32)
    changed = kernels_common.prepare_chunks(cu_seqlens, 1, 200)
    assert changed is not layout and changed.chunk_offsets.tolist() == [0, 1, 1, 1, 4]
    with torch.inference_mode():
        frozen = torch.tensor([0, 200], dtype=torch.int32)
        assert kernels_common.prepare_chunks(frozen, 1, 200) is not kernels_common.prepare_chunks(frozen, 1, 200)
    fixed = kernels_common.prepare_chunks(None, 2, 70)
    assert kernels_common.prepare_chunks(None, 2, 70) is fixed
    assert kernels_common.prepare_chunks(None, 2, 71) is not fixed
    for _ in range(kernels_common._LAYOUT_CACHE_SIZE):
        kernels_common.prepare_chunks(None, 1, 1000 + _)
    assert kernels_common.prepare_chunks(None, 2, 70) is not fixed, "the oldest entry is evicted"


@pytest.mark.parametrize("K, V, expected", [(16, 16, True), (16, 32, True), (128, 128, True), (32, 16, False),
                                             (256, 128, False), (128, 64, False)])
def test_output_kernel_only_where_its_v_tile_is_as_wide_as_its_k_tile(K, V, expected):
    # The H200's tiles (V tile capped at GPU_BLOCK_V_OUTPUT): K 32 with V 16 read past shared memory there.
    config = dataclasses.replace(
        kernels_common.pick_config(torch.empty(0)), block_v_output=kernels_common.GPU_BLOCK_V_OUTPUT
    )
    assert kernels_output.has_output_kernel(K, V, config) is expected


def _output_from_states(q, k, g_cumsum, states, v_new, layout, scale, qk):
    """The output kernel's result in fp32 torch, chunk by chunk: o = (q^ exp(G)) S0 + (q^ k^T * M) v_new with q^ the
    scaled, L2-normed q (per-head decay), or + qk v_new with qk as given (per channel)."""
    q_n = F.normalize(q.double(), dim=-1, eps=0) * scale
    k_n = F.normalize(k.double(), dim=-1, eps=0)
    o = torch.zeros(*q.shape[:2], v_new.shape[-1], dtype=torch.float64)
    for slot, (t0, n) in enumerate(layout.chunk_map.tolist()):
        if n == 0:
            continue
        rows = slice(t0, t0 + n)
        G = g_cumsum[rows].double()
        S0 = states[slot].double()
        if G.ndim == 3:
            inter = torch.einsum("thk,hkv->thv", q_n[rows] * G.exp(), S0)
            pairs = qk[rows, :, :n].double().permute(1, 0, 2)  # [H, t, s]
        else:
            inter = torch.einsum("thk,hkv->thv", q_n[rows] * G.exp()[..., None], S0)
            decay = (G.T[:, :, None] - G.T[:, None, :]).exp()  # [H, t, s]
            pairs = torch.einsum("thk,shk->hts", q_n[rows], k_n[rows]) * decay * torch.ones(n, n).tril()
        o[rows] = inter + torch.einsum("hts,shv->thv", pairs, v_new[rows].double())
    return o


@pytest.mark.parametrize("K", [48, 100])
@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
def test_output_kernel_k_loop_over_several_tiles(kernel_path, guarded, is_per_channel, K):
    # The forward's op tests take the output kernel only where K fits one interpreter tile; here the kernel runs
    # directly at K 48 (three 16-wide tiles) and K 100 (seven, the last one 4 wide), with a chunk cut short.
    gen = torch.Generator().manual_seed(0)
    T, H, V, scale = 150, 2, 32, 0.3
    layout = kernels_common.prepare_chunks(None, 1, T)
    config = dataclasses.replace(kernels_common.pick_config(torch.empty(0)), block_v_output=32)
    assert config.block_k_output == 16 and config.block_v_output == V
    q, k = (torch.randn(T, H, K, generator=gen) for _ in range(2))
    log_decay = -0.2 * torch.rand(T, H, *((K,) if is_per_channel else ()), generator=gen)
    # G restarts at every chunk, as the WY pass writes it.
    g_cumsum = torch.cat([chunk.cumsum(0) for chunk in log_decay.split(64)])
    states = torch.randn(layout.num_slots, H, K, V, generator=gen)
    v_new = torch.randn(T, H, V, generator=gen)
    qk = torch.randn(T, H, 64, generator=gen).tril() if is_per_channel else None
    o, _, _ = kernels_output.chunk_output(q, k, g_cumsum, states, v_new, layout, config, scale, True, qk)
    expected = _output_from_states(q, k, g_cumsum, states, v_new, layout, scale, qk)
    torch.testing.assert_close(o.double(), expected, **TOLERANCES[torch.float32])
    guarded.check()


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
def test_output_kernel_pipelines_the_per_head_loop_only_at_8_warps(kernel_path, monkeypatch, is_per_channel):
    # On the H200 triton 3.6 compiled the per-head decay's pipelined K loop wrong at 4 warps (kernels_common.py, at
    # GPU_NUM_STAGES_OUTPUT): the GPU launch pipelines it at 8 warps only, KDA's at 4; the interpreter takes one stage.
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append(options)

    monkeypatch.setattr(kernels_output, "_chunk_output_kernel", Recorder())
    # pick_config's GPU branch reads nothing but is_cuda.
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))
    T, H, K, V = 70, 2, 128, 128
    layout = kernels_common.prepare_chunks(None, 1, T)
    qk = torch.zeros(T, H, 64) if is_per_channel else None
    g_cumsum = torch.zeros(T, H, K) if is_per_channel else torch.zeros(T, H)
    args = (torch.zeros(T, H, K), torch.zeros(T, H, K), g_cumsum, torch.zeros(layout.num_slots, H, K, V),
            torch.zeros(T, H, V), layout)  # fmt: skip
    kernels_output.chunk_output(*args, gpu, 1.0, True, qk)
    kernels_output.chunk_output(*args, kernels_common.pick_config(torch.empty(0)), 1.0, True, qk)
    as_bf16 = [x.bfloat16() if x.is_floating_point() else x for x in args[:5]]
    kernels_output.chunk_output(*as_bf16, layout, gpu, 1.0, True, qk)
    kernels_output.chunk_output(*as_bf16, layout, gpu, 1.0, True, qk, store_bwd_operands=True)
    assert (kernels_common.GPU_NUM_STAGES_OUTPUT, kernels_common.GPU_NUM_WARPS_OUTPUT) == (3, 8)
    assert (kernels_common.GPU_NUM_STAGES_OUTPUT_KDA, kernels_common.GPU_NUM_WARPS_OUTPUT_KDA) == (2, 4)
    # fp32 on the GPU, the interpreter, 16 bits on the GPU, 16 bits storing the backward's operands (fp32 tiles and
    # the storing variant keep the 4-warp unpipelined per-head launch).
    assert [(options["num_stages"], options["BK"], options["num_warps"]) for options in launches] == [
        (2, 64, 4) if is_per_channel else (1, 64, 4),
        (1, kernels_common.MIN_DOT_SIZE, 1),
        (2, 64, 4) if is_per_channel else (3, 64, 8),
        (2, 64, 4) if is_per_channel else (1, 64, 4),
    ]


@pytest.mark.parametrize("V, num_seq_heads, is_per_channel, expected", [
    pytest.param(128, 64, False, (64, 4, 4), id="B4-H16-gdn"),  # the anchor shape: 128 programs of 64
    pytest.param(128, 64, True, (64, 8, 3), id="B4-H16-kda"),  # KDA's tiles of 64 at 8 warps
    pytest.param(128, 32, False, (32, 4, 4), id="B2-H16"),  # 64 programs of 64: tiles of 32 give 128
    pytest.param(128, 16, True, (16, 4, 3), id="B1-H16-kda"),  # one long document: tiles of 16, 4 warps
    pytest.param(128, 4, False, (16, 4, 4), id="B1-H4"),  # too few at any tile: the narrowest
    pytest.param(32, 1000, False, (32, 4, 4), id="V32-many_documents"),  # capped at V's tile
])  # fmt: skip
def test_state_fwd_launch_takes_the_widest_tile_with_enough_programs(V, num_seq_heads, is_per_channel, expected):
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))
    assert kernels_state.state_fwd_launch(gpu, V, num_seq_heads, is_per_channel) == expected


@pytest.mark.parametrize("dtype, compute_output, K, expected", [
    (torch.float16, False, 128, (64, 4, 4)), (torch.float16, True, 128, (32, 4, 2)),
    (torch.float32, False, 128, (32, 4, 2)), (torch.float32, True, 128, (32, 4, 1)),
    (torch.float16, False, 256, (32, 4, 2)),
])  # fmt: skip
def test_state_fwd_takes_the_tuned_launch_only_where_it_was_measured(monkeypatch, dtype, compute_output, K, expected):
    # 16-bit inputs, K up to 128, the state-storing pass: state_fwd_launch's settings; otherwise the landed ones
    # (fp32 tiles at 4 stages would not fit the H200's shared memory), and 1 stage for fp32 inputs writing the output
    # (GPU_NUM_STAGES_STATE_OUTPUT_FP32: 2 stages of its 3xTF32 operands would not fit either).
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((grid, options))

    monkeypatch.setattr(kernels_state, "_chunk_state_fwd_kernel", Recorder())
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))
    B, T, H, V = 4, 128, 16, 128
    layout = kernels_common.prepare_chunks(None, B, T)
    x = torch.zeros(B * T, H, K, dtype=dtype)
    kernels_state.chunk_state_fwd(x, x, x, torch.zeros(B * T, H, V, dtype=dtype), torch.zeros(B * T, H), None, layout,
                                gpu, 1.0, False, False, compute_output=compute_output,
                                store_states=not compute_output)  # fmt: skip
    [(grid, options)] = launches
    settings = (options["BV"], options["num_warps"], options["num_stages"])
    assert settings == expected
    assert grid == (V // options["BV"], B, H)


def test_state_fwd_values_do_not_depend_on_the_v_tile(kernel_path, guarded):
    # The tuned launch changes the V tile with the number of sequence-heads: V tiles of 16 and 32 give the same
    # states, v_new and final state (fp16 inputs, V 48: the last tile of 32 half masked; documents of 1, 63, 71).
    cu_seqlens = torch.tensor([0, 1, 64, 135], dtype=torch.int32)
    inputs = {name: x.detach() for name, x in make_inputs(1, 135, K=16, V=48, dtype=torch.float16, num_seqs=3).items()}
    q, k, v = (inputs[name][0] for name in "qkv")
    layout = kernels_common.prepare_chunks(cu_seqlens, 1, 135)
    config = kernels_common.pick_config(q)
    g_cumsum, w, u, _, _, _, k_end = autograd._wy_pass(
        q, k, v, inputs["g"][0], inputs["beta"][0], layout, config, 0.25, True, False, store_k_end=True
    )
    results = []
    for tiles in ((16,), (32,)):
        tiled = dataclasses.replace(config, block_v_state_fwd=tiles)
        assert kernels_state.state_fwd_launch(tiled, 48, 3, False)[0] == tiles[0]
        results.append(kernels_state.chunk_state_fwd(
            q, k, w, u, g_cumsum, inputs["initial_state"], layout, tiled, 0.25, True, True, compute_output=False,
            store_states=True, k_end_THK=k_end,
        )[1:])  # fmt: skip
    # Each column of a dot reduces the same products whatever the tile: bitwise, unless the interpreter's numpy
    # matmul rounds a column differently by the width of its output (OpenBLAS on some CPUs, e.g. AMD EPYC: a few
    # fp32 ulps); then within that rounding. A masking bug in the half-masked tile differs by whole values.
    tolerance = {"rtol": 0, "atol": 0} if _dots_are_column_independent(q.device) else {"rtol": 1e-5, "atol": 1e-6}
    for name, a, b in zip(("final_state", "states", "v_new"), *results):
        # The unused slot at the end stays unwritten: NaN in both (guarded buffers).
        torch.testing.assert_close(a, b, **tolerance, equal_nan=True, msg=lambda m: f"{name}: {m}")
    guarded.check()


def _dots_are_column_independent(device: torch.device) -> bool:
    """Whether a fp32 matmul's columns come out the same at output widths 16 and 32 where the kernels' dots run:
    on a GPU (Triton's dots), always; in the interpreter, as numpy's matmul on this CPU does."""
    if device.type == "cuda":
        return True
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64), dtype=np.float32), rng.standard_normal((64, 32), dtype=np.float32)
    return np.array_equal(a @ b[:, :16], (a @ b)[:, :16])


@pytest.mark.parametrize("is_per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("K, V, takes_output_kernel", [(16, 32, True), (32, 16, False)])
def test_forward_takes_the_output_kernel_by_the_head_dims(
    kernel_path, monkeypatch, K, V, takes_output_kernel, is_per_channel
):
    # Either decay: KDA's output kernel reads the pairs kernel's decayed q k^T instead of building it.
    calls = []
    output = autograd.chunk_output
    monkeypatch.setattr(autograd, "chunk_output", lambda *args, **kwargs: calls.append(args) or output(*args, **kwargs))
    inputs = make_inputs(1, 70, K=K, V=V, is_per_channel=is_per_channel)
    op = kda if is_per_channel else gated_delta_rule
    o, final_state = op(**inputs, output_final_state=True)
    expected_o, expected_state = chunk_gated_delta_rule_ref(
        **{name: x.detach() for name, x in inputs.items()}, output_final_state=True
    )
    assert len(calls) == int(takes_output_kernel)
    torch.testing.assert_close(o, expected_o, **TOLERANCES[torch.float32])
    torch.testing.assert_close(final_state, expected_state, **TOLERANCES[torch.float32])


def _spy_kernel(monkeypatch):
    calls = []
    apply = GatedDeltaRuleFunction.apply

    def spy(*args):
        calls.append(args[0].dtype)
        return apply(*args)

    monkeypatch.setattr(GatedDeltaRuleFunction, "apply", spy)
    return calls


def test_auto_takes_the_kernel_only_on_cuda(monkeypatch):
    # auto means "kernel on CUDA, reference elsewhere": on CPU tensors it takes the reference even when the
    # interpreter could run the kernel (only an explicit MOE_TUNE_KERNELS=triton does that).
    calls = _spy_kernel(monkeypatch)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    inputs = make_inputs(1, 4, has_initial_state=False)
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        gated_delta_rule(**inputs)
    assert calls == []
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gated_delta_rule(**inputs)
    assert calls == [torch.float32]


@pytest.mark.parametrize(
    "op, shape, dtype, interpret, message",
    [
        pytest.param(gated_delta_rule, {}, torch.float64, "1", "gated_delta_rule has no Triton kernel", id="fp64"),
        pytest.param(gated_delta_rule, {"K": 272}, torch.float32, "1", "has no Triton kernel", id="K_over_256"),
        pytest.param(gated_delta_rule, {}, torch.float32, "0", "gated_delta_rule got CPU tensors", id="no_interpreter"),
        pytest.param(kda, {}, torch.float64, "1", "kda has no Triton kernel", id="kda-fp64"),
    ],
)
def test_forced_kernel_raises_when_it_cannot_run(monkeypatch, op, shape, dtype, interpret, message):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    inputs = make_inputs(1, 4, dtype=dtype, is_per_channel=op is kda, **shape)
    with pytest.raises(RuntimeError, match=message):
        op(**inputs)
