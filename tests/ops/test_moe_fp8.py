"""moe_mlp through frozen FP8 expert weights: the reference is the ordinary reference on the dequantized weights; the
Triton kernels (interpreter) against it on odd shapes (D and F not multiples of 128, empty experts, k = 1, E = 1),
outputs and every gradient; the kernels with FP8 weights against the same kernels on bf16 weights; the refusals.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
The interpreter runs fp32 and fp16 activations (its bf16 tl.dot does not compute); bf16 runs in
tests/gpu/test_moe_fp8_gpu.py.
"""

import dataclasses
import re

import pytest
from guarded_buffers import GuardedBuffers
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import triton.runtime.interpreter as triton_interpreter
    from moe_tune.ops.fp8.reference import dequantize_weight, quantize_weight
    from moe_tune.ops.moe import ClampedSwiGLU, ExpertLoRA, autograd, fp8_weights, kernel_config, kernels_fwd, moe_mlp
    from moe_tune.ops.moe.reference import moe_mlp_ref
    from moe_cases import LORA_NAMES, make_case, run_with_grads

# atol is relative to the largest magnitude of each expected tensor, rtol elementwise. fp32: the kernels dequantize
# to the reference's fp32 weights exactly, and their fp32 sums run in another order. fp16: the weights, gate_up, h and
# d gate_up are rounded to fp16 between kernels while the reference keeps fp32 (test_moe_triton.py's fp16 row).
KERNEL_TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
# FP8 weights against their dequantized values rounded to bf16 (the bf16-weight kernel): 2^-9 relative per weight.
BF16_WEIGHT_TOLERANCE = dict(atol=1e-2, rtol=1e-2)
RANK = 4
LORA_SCALING = 0.5
GUARD_ELEMENTS = 16 * 512

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

# 64-wide K steps and 64 columns (32 for the two-accumulator kernels): few interpreted programs; 64 divides the
# 128-wide scale blocks, as every K step of an FP8 weight must.
INTERPRETER_CONFIG = kernel_config.uniform_config(16, 128, 64, num_warps=1, num_stages=1)


@pytest.fixture
def kernel_path(monkeypatch):
    assert isinstance(kernels_fwd._moe_gate_up_fwd_kernel, triton_interpreter.InterpretedFunction), (
        "ops/moe/kernels_fwd.py was imported before TRITON_INTERPRET=1 was set: its kernels are compiled for a GPU"
    )
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kernel_config.forced_config(INTERPRETER_CONFIG):
        yield


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernel_config, "alloc", buffers.alloc)
    monkeypatch.setattr(kernel_config, "alloc_index", buffers.alloc_index)
    return buffers


def make_fp8_case(*args, rank=RANK, **kwargs) -> dict:
    """make_case's inputs with the expert weights quantized to FP8 (frozen) and their block scales."""
    case = make_case(*args, rank=rank, scaling=LORA_SCALING, **kwargs)
    num_hidden = case["w_down"].shape[2]
    case["w_gate_up"], case["gate_up_scale_inv"] = quantize_weight(
        case["w_gate_up"].detach().float(), row_segments=(num_hidden, num_hidden)
    )
    case["w_down"], case["down_scale_inv"] = quantize_weight(case["w_down"].detach().float())
    return case


def dequantized(case: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The case with its FP8 weights replaced by their dequantized values in `dtype` (frozen) and no scales."""
    num_hidden = case["w_down"].shape[2]
    return dict(
        case,
        w_gate_up=dequantize_weight(case["w_gate_up"], case["gate_up_scale_inv"], (num_hidden, num_hidden), dtype),
        w_down=dequantize_weight(case["w_down"], case["down_scale_inv"], None, dtype),
        gate_up_scale_inv=None,
        down_scale_inv=None,
    )


def _assert_close_scaled(actual, expected, tol, name):
    atol = tol["atol"] * max(float(expected.detach().abs().max()), 1e-6)
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=tol["rtol"], msg=lambda m: f"{name}: {m}"
    )


def _assert_matches(fn, fn_expected, case, tol, dtype, expected_case=None):
    num_tokens, model_dim = case["x"].shape
    grad_y = torch.randn(num_tokens, model_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, grads = run_with_grads(fn, case, grad_y)
    y_ref, grads_ref = run_with_grads(fn_expected, case if expected_case is None else expected_case, grad_y)
    assert y.dtype == dtype and y.shape == (num_tokens, model_dim)
    _assert_close_scaled(y, y_ref, tol, "y")
    assert set(grads) == set(grads_ref) and "topk_weights" in grads
    assert not any(name.startswith("w_") for name in grads), "FP8 weights got a gradient"
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        _assert_close_scaled(grad, grads_ref[name], tol, f"grad {name}")


# (N, D, F, E, k, routing)
SHAPES = {
    # D = 200: a full and a partial 128-wide scale block along D; F = 72: one partial block per half.
    "D200_F72": (9, 200, 72, 3, 2, "random"),
    # F = 130: two scale blocks per half, the second 2 rows wide; the up half's rows start at scale row 2.
    "F130": (7, 136, 130, 4, 3, "random"),
    # Experts 1 and 4 only: every other expert is empty.
    "empty_experts": (10, 130, 40, 6, 2, "two_experts_only"),
    # k = 1, D < 128: one partial K block.
    "top1_D72": (9, 72, 48, 4, 1, "random"),
    # One expert takes every token.
    "E1": (11, 136, 40, 1, 1, "random"),
    # D and F multiples of 128 (the hub's FP8 models): the experts are dequantized into a buffer per GEMM (from one
    # routed row per expert on, in this module).
    "D256_F128": (9, 256, 128, 3, 2, "random"),
    "D128_F256_empty": (10, 128, 256, 5, 2, "two_experts_only"),
}


def _case_params(rows):
    return [
        pytest.param(*SHAPES[shape], lora_on, dtype, id=f"{shape}-{lora_on}-{str(dtype).removeprefix('torch.')}")
        for shape, lora_on, dtype in rows
    ]


def test_fp8_reference_is_the_reference_on_dequantized_weights():
    # No quantization of x, h, dy or d gate_up: the FP8 reference equals the fp32 reference run on W_q * scale_inv,
    # bitwise, y and every gradient (biases and the clamped activation included); the FP8 weights get none.
    case = make_fp8_case(13, 200, 72, 5, 2, torch.float32, lora_on="both")
    gen = torch.Generator().manual_seed(5)
    extras = dict(
        b_gate_up=torch.randn(5, 144, generator=gen).requires_grad_(),
        b_down=torch.randn(5, 200, generator=gen).requires_grad_(),
        clamped_swiglu=ClampedSwiGLU(),
    )
    for extra in ({}, extras):
        grad_y = torch.randn(13, 200, generator=torch.Generator().manual_seed(1))
        inputs = [t for t in (case["x"], case["topk_weights"], *extra.values()) if isinstance(t, torch.Tensor)]
        inputs += [getattr(case["lora"], name) for name in LORA_NAMES]
        y = moe_mlp_ref(**case, **extra)
        y_plain = moe_mlp_ref(**dequantized(case), **extra)
        torch.testing.assert_close(y, y_plain, atol=0, rtol=0)
        grads = torch.autograd.grad(y, inputs, grad_y)
        grads_plain = torch.autograd.grad(y_plain, inputs, grad_y)
        for grad, grad_plain in zip(grads, grads_plain, strict=True):
            torch.testing.assert_close(grad, grad_plain, atol=0, rtol=0)
    assert not case["w_gate_up"].requires_grad and not case["w_down"].requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_cpu_auto_path_is_the_reference(monkeypatch, dtype):
    # auto on CPU tensors takes the reference for FP8 experts (no kernel launch), bf16 activations too.
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    monkeypatch.setattr(autograd.MoEFunction, "apply", None)
    case = make_fp8_case(5, 136, 40, 4, 2, dtype, lora_on="both")
    y = moe_mlp(**case)
    assert y.dtype == dtype
    torch.testing.assert_close(y, moe_mlp_ref(**dequantized(case)), atol=0, rtol=0)


KERNEL_CASES = _case_params([
    ("D200_F72", "both", torch.float32),
    ("F130", "both", torch.float32),
    ("empty_experts", "both", torch.float32),
    ("top1_D72", "none", torch.float32),
    ("E1", "gate_up", torch.float32),
    ("F130", "down", torch.float16),
    ("D256_F128", "both", torch.float32),
    ("D128_F256_empty", "gate_up", torch.float16),
])


# The rule's own value, before buffer_from_one_row replaces it for the module's tests.
MIN_ROWS_PER_EXPERT = fp8_weights.MIN_ROWS_PER_EXPERT


@pytest.fixture(autouse=True)
def buffer_from_one_row(monkeypatch):
    """The cases here route a few rows to each expert: buffers from one row on (the rows rule has its own tests)."""
    monkeypatch.setattr(fp8_weights, "MIN_ROWS_PER_EXPERT", 1)


@pytest.fixture
def dequantize_calls(monkeypatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every fp8_weights.dequantized call's (weight shape, dtype), the calls themselves unchanged."""
    calls, dequantize = [], fp8_weights.dequantized

    def recorded(weight, scale_inv, dtype):
        calls.append((tuple(weight.shape), dtype))
        return dequantize(weight, scale_inv, dtype)

    monkeypatch.setattr(fp8_weights, "dequantized", recorded)
    return calls


@pytest.mark.parametrize("shape, lora_on, dtype", [
    ("D256_F128", "both", torch.float32),
    ("D128_F256_empty", "down", torch.float32),
    ("D256_F128", "none", torch.float16),
])  # fmt: skip
def test_fp8_buffered_experts_are_the_16_bit_kernels_on_dequantized_weights(
    kernel_path, guarded, dequantize_calls, shape, lora_on, dtype
):
    # D and F multiples of 128: each GEMM dequantizes its projection's experts into a buffer and runs the 16-bit
    # kernels, so y and every gradient equal, bit for bit, the same kernels given the dequantized weights in x's dtype.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    grad_y = torch.randn(num_tokens, model_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    gate_up, down = (num_experts, 2 * hidden_dim, model_dim), (num_experts, model_dim, hidden_dim)
    # Forward: gate_up then down; backward: down then gate_up (dx).
    assert dequantize_calls == [(gate_up, dtype), (down, dtype), (down, dtype), (gate_up, dtype)]
    y_plain, grads_plain = run_with_grads(moe_mlp, dequantized(case, dtype), grad_y)
    torch.testing.assert_close(y, y_plain, atol=0, rtol=0)
    assert set(grads) == set(grads_plain)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_plain[name], atol=0, rtol=0, msg=lambda m: f"grad {name}: {m}")
    guarded.check()


def test_fp8_buffered_experts_save_only_the_fp8_codes(kernel_path, dequantize_calls):
    # The buffers live for one GEMM: what autograd keeps for backward holds the FP8 codes, no dequantized expert stack.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["D256_F128"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        moe_mlp(**case)
    assert len(dequantize_calls) == 2
    stacks = {tuple(case["w_gate_up"].shape), tuple(case["w_down"].shape)}
    assert {dtype for shape, dtype in saved if shape in stacks} == {torch.float8_e4m3fn}


@pytest.mark.parametrize("limit_elements", [0, 1])
def test_fp8_experts_over_the_buffer_limit_dequantize_tile_by_tile(kernel_path, guarded, monkeypatch,
                                                                   dequantize_calls, limit_elements):  # fmt: skip
    # A projection whose buffer would pass MAX_BUFFER_BYTES takes the in-tile path, which matches the reference too.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["D256_F128"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    # The down projection (the smaller one) fits at limit_elements=1, the gate_up projection never: neither buffers.
    down_bytes = case["w_down"].numel() * 4
    monkeypatch.setattr(fp8_weights, "MAX_BUFFER_BYTES", down_bytes * limit_elements)
    _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float32], torch.float32)
    assert dequantize_calls == []
    guarded.check()


@pytest.mark.parametrize("fp8, limit_elements, fp8_codes", [
    (True, None, False),  # buffered: the GEMMs read dequantized 16-bit experts
    (True, 0, True),  # over the buffer limit: the GEMMs read the FP8 codes tile by tile
    (False, None, False),
])  # fmt: skip
def test_the_launch_is_picked_knowing_whether_the_gemms_read_fp8_codes(kernel_path, monkeypatch, fp8, limit_elements,
                                                                      fp8_codes):  # fmt: skip
    # pick_config keeps the wide sm_90 tiles from GEMMs that dequantize FP8 codes in their tile loads (not measured).
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["D256_F128"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "none")
    if not fp8:
        case = dequantized(case, torch.float32)
    if limit_elements is not None:
        monkeypatch.setattr(fp8_weights, "MAX_BUFFER_BYTES", limit_elements)
    picked = []
    pick_config = kernel_config.pick_config
    monkeypatch.setattr(autograd, "pick_config", lambda *a, **k: picked.append(k["fp8_codes"]) or pick_config(*a, **k))
    moe_mlp(**case)
    assert picked == [fp8_codes]


@pytest.mark.parametrize("model_dim, hidden_dim, contiguous, buffered", [
    (256, 128, True, True),
    (256, 130, True, False),  # an expert's gate rows end inside a scale block
    (200, 128, True, False),  # an expert's down rows end inside a scale block
    (256, 128, False, False),
])  # fmt: skip
def test_which_fp8_experts_are_buffered(model_dim, hidden_dim, contiguous, buffered):
    w_gate_up = torch.zeros(3, 2 * hidden_dim, model_dim, dtype=torch.float8_e4m3fn)
    w_down = torch.zeros(3, model_dim, hidden_dim, dtype=torch.float8_e4m3fn)
    if not contiguous:
        w_down = torch.zeros(3, hidden_dim, model_dim, dtype=torch.float8_e4m3fn).transpose(1, 2)
    assert fp8_weights.buffers_weights(w_gate_up, w_down, torch.bfloat16, num_rows=3) is buffered


@pytest.mark.parametrize("num_experts", [1, 3, 512])
@pytest.mark.parametrize("rows_over", [-1, 0, 1])
def test_fp8_experts_buffer_from_enough_rows_per_expert(monkeypatch, num_experts, rows_over):
    # A buffer costs a pass over every expert's weights: it is made only where the experts get, on average, at least
    # MIN_ROWS_PER_EXPERT routed rows each (tokens times top-k).
    monkeypatch.setattr(fp8_weights, "MIN_ROWS_PER_EXPERT", MIN_ROWS_PER_EXPERT)
    w_gate_up = torch.zeros(num_experts, 256, 128, dtype=torch.float8_e4m3fn)
    w_down = torch.zeros(num_experts, 128, 128, dtype=torch.float8_e4m3fn)
    num_rows = MIN_ROWS_PER_EXPERT * num_experts + rows_over
    assert fp8_weights.buffers_weights(w_gate_up, w_down, torch.bfloat16, num_rows) is (rows_over >= 0)


@pytest.mark.parametrize("rows_per_expert, buffered", [(6, True), (7, False)])
def test_fp8_experts_count_routed_rows_not_tokens(kernel_path, monkeypatch, dequantize_calls, rows_per_expert,
                                                  buffered):  # fmt: skip
    # D256_F128 routes 9 tokens x top-2 = 18 rows to 3 experts: 6 rows each, 3 if tokens were counted. Backward
    # takes forward's choice: two buffers each way, or none.
    monkeypatch.setattr(fp8_weights, "MIN_ROWS_PER_EXPERT", rows_per_expert)
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["D256_F128"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float32], torch.float32)
    assert len(dequantize_calls) == (4 if buffered else 0)


@pytest.mark.parametrize("num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on, dtype", KERNEL_CASES)
def test_fp8_kernel_matches_reference(
    kernel_path, guarded, num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on, dtype
):
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[dtype], dtype)
    guarded.check()


# Launches other than the default that read FP8 weights their own way. The down backward as a GEMM and a SwiGLU pass:
# the GEMM dequantizes its weight tiles as the fused kernel does, the pass reads no weight. The gate-up forward in one
# product: one weight tile of gate and up rows, each row taking its own half's scale rows (F = 130: the up half's
# from row 2; the 32-column blocks end inside a scale block and past F).
FP8_LAUNCHES = {
    "down_bwd_swiglu_pass": dict(down_bwd=kernel_config.KernelConfig(64, 64, num_warps=1, num_stages=1,
                                                                     swiglu_pass=True)),
    "gate_up_fwd_one_dot": dict(gate_up_fwd=kernel_config.KernelConfig(32, 64, num_warps=1, num_stages=1,
                                                                       one_dot=True)),
}  # fmt: skip


@pytest.mark.parametrize("launch", FP8_LAUNCHES.values(), ids=FP8_LAUNCHES.keys())
@pytest.mark.parametrize("shape", ["D200_F72", "F130"])
def test_fp8_kernel_launch_variants_match_reference(kernel_path, guarded, shape, launch):
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    with kernel_config.forced_config(dataclasses.replace(INTERPRETER_CONFIG, **launch)):
        _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float32], torch.float32)
    guarded.check()


def test_fp8_kernel_matches_bf16_weight_kernel(kernel_path, guarded):
    # The same kernels on dequantize_weight(W).to(bf16): FP8 weights change only what the weight tile holds. F = 130:
    # two scale rows per half, the up half's from row 2; D = 136: two scale blocks along each K loop of the forward.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["F130"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern)
    with torch.no_grad():
        y = moe_mlp(**case)
        y_bf16_weights = moe_mlp(**dequantized(case, torch.bfloat16))
    _assert_close_scaled(y, y_bf16_weights, BF16_WEIGHT_TOLERANCE, "y")
    # The comparison can fail: the bf16-rounded weights move y by more than fp32 rounding.
    assert not torch.allclose(y, y_bf16_weights, atol=1e-5, rtol=1e-5)
    guarded.check()


def test_fp8_kernel_frozen_x_and_adapters_a(kernel_path, guarded):
    # x frozen and A frozen: no dx GEMM and no dA passes; B and the routing weights still get gradients.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["D200_F72"]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    case["x"] = case["x"].detach()
    pairs = {name: getattr(case["lora"], name) for name in LORA_NAMES}
    case["lora"] = ExpertLoRA(
        pairs["a_gate_up"].detach(), pairs["b_gate_up"], pairs["a_down"].detach(), pairs["b_down"], scaling=LORA_SCALING
    )
    grad_y = torch.randn(num_tokens, model_dim, generator=torch.Generator().manual_seed(1))
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_ref, case, grad_y)
    assert set(grads) == {"topk_weights", "lora.b_gate_up", "lora.b_down"}
    tol = KERNEL_TOLERANCES[torch.float32]
    _assert_close_scaled(y, y_ref, tol, "y")
    for name in grads:
        _assert_close_scaled(grads[name], grads_ref[name], tol, name)
    guarded.check()


def test_fp8_kernel_no_tokens(kernel_path):
    case = make_fp8_case(0, 200, 72, 4, 2, torch.float32, lora_on="both")
    y, grads = run_with_grads(moe_mlp, case, torch.zeros(0, 200))
    assert y.shape == (0, 200)
    assert all(bool((grad == 0).all()) for grad in grads.values())


def _refusal_case():
    # F = 130: 2F = 260 has ceil(260 / 128) = 3 row blocks, but the halves' own blocks make 2 * 2 = 4.
    return make_fp8_case(5, 136, 130, 4, 2, torch.float32)


REFUSALS = {
    "one_weight_fp8": (
        lambda c: c.update(w_down=dequantize_weight(c["w_down"], c["down_scale_inv"]), down_scale_inv=None),
        [r"w_down: dtype torch.float32 must be float8_e4m3fn like the other expert weight \(both FP8 or neither\)",
         r"down_scale_inv: None, but FP8 expert weights need their block scales \[4, 2, 2\] fp32"],
    ),
    "scales_without_fp8": (
        lambda c: c.update(w_gate_up=c["w_gate_up"].float(), w_down=c["w_down"].float()),
        [r"w_gate_up: dtype torch.float32 must be float8_e4m3fn", r"w_down: dtype torch.float32 must be float8_e4m3fn"],
    ),
    "scale_missing": (
        lambda c: c.update(gate_up_scale_inv=None),
        [r"gate_up_scale_inv: None, but FP8 expert weights need their block scales \[4, 4, 2\] fp32"],
    ),
    "gate_up_scale_unsegmented": (
        lambda c: c.update(gate_up_scale_inv=c["gate_up_scale_inv"][:, :3]),
        [r"gate_up_scale_inv: shape \(4, 3, 2\) dtype torch.float32 must be fp32 \[4, 4, 2\]"],
    ),
    "down_scale_transposed": (
        lambda c: c.update(down_scale_inv=torch.ones(4, 1, 2)),
        [r"down_scale_inv: shape \(4, 1, 2\) dtype torch.float32 must be fp32 \[4, 2, 2\]"],
    ),
    "scale_bf16": (
        lambda c: c.update(down_scale_inv=c["down_scale_inv"].bfloat16()),
        [r"down_scale_inv: shape \(4, 2, 2\) dtype torch.bfloat16 must be fp32 \[4, 2, 2\]"],
    ),
    "fp8_weight_requires_grad": (
        lambda c: c["w_gate_up"].requires_grad_(),
        [r"w_gate_up: FP8 expert weights are frozen: requires_grad must be False"],
    ),
    "scale_requires_grad": (
        lambda c: c["down_scale_inv"].requires_grad_(),
        [r"down_scale_inv: block scales are frozen: requires_grad must be False"],
    ),
}


@pytest.mark.parametrize("edit, messages", [pytest.param(*v, id=k) for k, v in REFUSALS.items()])
def test_fp8_inputs_refused(edit, messages):
    case = _refusal_case()
    edit(case)
    with pytest.raises(ValueError) as info:
        moe_mlp(**case)
    lines = str(info.value).splitlines()
    assert len(lines) == len(messages), lines
    for line, message in zip(lines, messages):
        assert re.match(message, line), (message, line)


def test_fp8_reference_takes_gpt_oss_biases_and_activation(monkeypatch):
    # gpt_oss's biases and clamped SwiGLU stay on the reference with FP8 weights: b_down adds sum_j w_j b_down[e]
    # to y (weighted), zero biases change nothing, and the clamped activation changes h.
    case = make_fp8_case(9, 136, 40, 4, 2, torch.float32)
    b_down = torch.randn(4, 136, generator=torch.Generator().manual_seed(3))
    y = moe_mlp(**case)
    zero = moe_mlp(**case, b_gate_up=torch.zeros(4, 80), b_down=torch.zeros(4, 136))
    torch.testing.assert_close(zero, y, atol=0, rtol=0)
    shifted = moe_mlp(**case, b_down=b_down)
    expected_shift = (case["topk_weights"][:, :, None] * b_down[case["topk_ids"]]).sum(dim=1)
    torch.testing.assert_close(shifted - y, expected_shift, atol=1e-5, rtol=1e-5)
    clamped = moe_mlp(**case, clamped_swiglu=ClampedSwiGLU())
    assert not torch.allclose(clamped, y)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="moe_mlp has no Triton kernel for these inputs"):
        moe_mlp(**case, b_down=b_down)
