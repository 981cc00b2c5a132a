"""moe_mlp through frozen FP8 expert weights: the reference against a per-token oracle (forward and every gradient),
the Triton kernels in the interpreter against the reference on odd shapes (D and F not multiples of 128, empty
experts, k = 1, LoRA on both, one or no projection), and the refusals.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
"""

import dataclasses
import re

import pytest
from guarded_buffers import GuardedBuffers
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.ops.fp8.reference import dequantize_weight, fake_quantize_groups, quantize_weight
    from moe_tune.ops.moe import ExpertLoRA, moe_mlp
    from moe_tune.ops.moe import kernel_config, kernels_fp8
    from moe_tune.ops.moe.reference import moe_mlp_ref
    from moe_cases import LORA_NAMES, make_case, run_with_grads

# One table per comparison and dtype: atol is relative to the largest magnitude of each expected tensor, rtol
# elementwise. reference vs oracle: the same fp32 products grouped differently (measured max 1.2e-6 of the largest
# magnitude). kernels vs reference, fp32: fp32 sums in another order (9.4e-7), and now and then an h element whose
# fp32 value differs from the reference's by an ulp and lands one FP8 step away (measured max 5e-5, F130 without
# LoRA). fp16: h, gate_up and d gate_up are rounded to fp16 before they are quantized, which moves some elements one
# FP8 step (measured max 1.7e-2, on dx at F = 48, where one step weighs most).
ORACLE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
KERNEL_TOLERANCES = {
    torch.float32: dict(atol=1e-3, rtol=1e-4),
    torch.float16: dict(atol=3e-2, rtol=3e-2),
}
RANK = 4
LORA_SCALING = 0.5
GUARD_ELEMENTS = 16 * 512

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


# The LoRA passes (tested on their own in test_moe_triton.py) with 64-wide steps: fewer interpreted programs.
LORA_PASS_CONFIG = kernel_config.uniform_config(16, 64, 64, num_warps=1, num_stages=1)


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kernel_config.forced_config(LORA_PASS_CONFIG):
        yield


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernel_config, "alloc", buffers.alloc)
    monkeypatch.setattr(kernel_config, "alloc_index", buffers.alloc_index)
    monkeypatch.setattr(kernels_fp8, "_alloc", buffers.alloc)
    return buffers


def make_fp8_case(*args, rank=RANK, **kwargs) -> dict:
    """make_case's inputs with the expert weights quantized to FP8 (frozen) and their block scales."""
    case = make_case(*args, rank=rank, scaling=LORA_SCALING, **kwargs)
    num_hidden = case["w_down"].shape[2]
    case["w_gate_up"], case["gate_up_scale_inv"] = quantize_weight(
        case["w_gate_up"].detach(), row_segments=(num_hidden, num_hidden)
    )
    case["w_down"], case["down_scale_inv"] = quantize_weight(case["w_down"].detach())
    return case


class _FqMatvec(torch.autograd.Function):
    # One token's GEMM through a dequantized FP8 weight: fq(u) @ W^T, du = fq(d out) @ W.
    @staticmethod
    def forward(ctx, u, w, out_segments):
        ctx.save_for_backward(w)
        ctx.out_segments = out_segments
        return fake_quantize_groups(u[None])[0] @ w.T

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return fake_quantize_groups(grad[None], ctx.out_segments)[0] @ w, None, None


class _WeightedFqDown(torch.autograd.Function):
    # One slot's down projection w * (fq(h) @ W^T), the token's dy quantized before the routing weight; the weight's
    # gradient is <fq(dy) @ W, h> (the module's straight-through rule).
    @staticmethod
    def forward(ctx, h, weight, w):
        ctx.save_for_backward(h, weight, w)
        return weight * (fake_quantize_groups(h[None])[0] @ w.T)

    @staticmethod
    def backward(ctx, grad):
        h, weight, w = ctx.saved_tensors
        dh = fake_quantize_groups(grad[None])[0] @ w
        return weight * dh, (dh * h).sum(), None


def fp8_loop_oracle(x, topk_ids, topk_weights, w_gate_up, w_down, lora, gate_up_scale_inv, down_scale_inv):
    """Per token and slot, in fp32: dequantize the chosen expert's weights, fake-quantize its operands."""
    num_hidden = w_down.shape[2]
    halves = (num_hidden, num_hidden)
    w_gate_up_E2FD = dequantize_weight(w_gate_up, gate_up_scale_inv, halves)
    w_down_EDF = dequantize_weight(w_down, down_scale_inv)
    x_ND, weights_Nk = x.float(), topk_weights.float()
    rows = []
    for t in range(x.shape[0]):
        y_D = torch.zeros(x.shape[1])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up_2F = _FqMatvec.apply(x_ND[t], w_gate_up_E2FD[e], halves)
            if lora is not None and lora.a_gate_up is not None:
                xa_r = lora.a_gate_up[e].float() @ x_ND[t]
                gate_up_2F = gate_up_2F + lora.scaling * (lora.b_gate_up[e].float() @ xa_r)
            gate_F, up_F = gate_up_2F[:num_hidden], gate_up_2F[num_hidden:]
            h_F = gate_F * torch.sigmoid(gate_F) * up_F
            y_D = y_D + _WeightedFqDown.apply(h_F, weights_Nk[t, j], w_down_EDF[e])
            if lora is not None and lora.a_down is not None:
                y_D = y_D + weights_Nk[t, j] * lora.scaling * (lora.b_down[e].float() @ (lora.a_down[e].float() @ h_F))
        rows.append(y_D)
    return torch.stack(rows).to(x.dtype)


def _assert_close_scaled(actual, expected, tol, name):
    atol = tol["atol"] * max(float(expected.detach().abs().max()), 1e-6)
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=tol["rtol"], msg=lambda m: f"{name}: {m}"
    )


def _assert_matches(fn, fn_expected, case, tol, dtype):
    num_tokens, model_dim = case["x"].shape
    grad_y = torch.randn(num_tokens, model_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, grads = run_with_grads(fn, case, grad_y)
    y_ref, grads_ref = run_with_grads(fn_expected, case, grad_y)
    assert y.dtype == dtype and y.shape == (num_tokens, model_dim)
    _assert_close_scaled(y, y_ref, tol, "y")
    assert set(grads) == set(grads_ref) and "x" in grads and "topk_weights" in grads
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        _assert_close_scaled(grad, grads_ref[name], tol, f"grad {name}")


# (N, D, F, E, k, routing)
SHAPES = {
    # D = 200: a full and a partial 128-wide K block; F = 72: one partial block per half, 2F = 144 spans both halves'.
    "D200_F72": (13, 200, 72, 5, 2, "random"),
    # F = 130: two scale blocks per half, the second 2 columns wide (a K step must not cross the gate/up boundary).
    "F130": (7, 136, 130, 4, 3, "random"),
    # Experts 1 and 4 only: every other expert is empty.
    "empty_experts": (10, 130, 40, 6, 2, "two_experts_only"),
    # k = 1, D < 128: one partial K block.
    "top1_D72": (9, 72, 48, 4, 1, "random"),
}


def _case_params(pairs):
    return [pytest.param(*SHAPES[shape], lora_on, id=f"{shape}-{lora_on}") for shape, lora_on in pairs]


ORACLE_CASES = _case_params(
    [("D200_F72", "both"), ("F130", "gate_up"), ("empty_experts", "down"), ("top1_D72", "none")]
)


@pytest.mark.parametrize("num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on", ORACLE_CASES)
def test_fp8_reference_matches_loop_oracle(num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on):
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, lora_on)
    _assert_matches(moe_mlp_ref, fp8_loop_oracle, case, ORACLE_TOLERANCE, torch.float32)


def test_fp8_reference_quantizes_every_gemm_operand():
    # Each of the four operands quantized (x, h, dy, d gate_up): the result differs from the dequantized weights
    # run in plain fp32 by FP8 rounding, far above the oracle tolerance, and the FP8 weights get no gradient.
    case = make_fp8_case(13, 200, 72, 5, 2, torch.float32, lora_on="both")
    plain = dict(case, gate_up_scale_inv=None, down_scale_inv=None)
    plain["w_gate_up"] = dequantize_weight(case["w_gate_up"], case["gate_up_scale_inv"], (72, 72))
    plain["w_down"] = dequantize_weight(case["w_down"], case["down_scale_inv"])
    grad_y = torch.randn(13, 200, generator=torch.Generator().manual_seed(1))
    y, grads = run_with_grads(moe_mlp_ref, case, grad_y)
    y_plain, grads_plain = run_with_grads(moe_mlp_ref, plain, grad_y)
    for name, value, plain_value in [("y", y, y_plain)] + [(n, grads[n], grads_plain[n]) for n in grads]:
        relative = float((value - plain_value).abs().max() / plain_value.abs().max().detach())
        assert 1e-3 < relative < 0.2, (name, relative)


# Every shape once with LoRA on both projections or none, and each LoRA placement on D200_F72.
KERNEL_CASES = _case_params(
    [("D200_F72", lora_on) for lora_on in ("none", "both", "gate_up", "down")]
    + [("F130", "both"), ("empty_experts", "both"), ("top1_D72", "none")]
)


@pytest.mark.parametrize("num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on", KERNEL_CASES)
def test_fp8_kernel_matches_reference(
    kernel_path, guarded, num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on
):
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, lora_on)
    _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float32], torch.float32)
    guarded.check()


def test_fp8_kernel_backward_reads_weights_as_stored(kernel_path, guarded):
    # Fp8Config.is_backward_k_major False: the backward GEMMs read the FP8 weights with their stored strides (no
    # K-major copy); on the GPU their codes meet in bf16 MMAs. F = 130: two scale blocks per half.
    shape = "F130"
    config = dataclasses.replace(kernels_fp8.pick_fp8_config(torch.zeros(1), 1, 1), is_backward_k_major=False)
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.float32, pattern, "both")
    with kernels_fp8.forced_fp8_config(config):
        _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float32], torch.float32)
    guarded.check()


def test_fp8_kernel_fp16_matches_reference(kernel_path, guarded):
    case = make_fp8_case(13, 200, 72, 5, 2, torch.float16, lora_on="both")
    _assert_matches(moe_mlp, moe_mlp_ref, case, KERNEL_TOLERANCES[torch.float16], torch.float16)
    guarded.check()


def test_fp8_kernel_frozen_x_and_adapters_a(kernel_path, guarded):
    # x frozen and A frozen: no dx GEMM and no dA passes; B and the routing weights still get gradients.
    case = make_fp8_case(13, 200, 72, 5, 2, torch.float32, lora_on="both")
    case["x"] = case["x"].detach()
    pairs = {name: getattr(case["lora"], name) for name in LORA_NAMES}
    case["lora"] = ExpertLoRA(
        pairs["a_gate_up"].detach(), pairs["b_gate_up"], pairs["a_down"].detach(), pairs["b_down"], scaling=LORA_SCALING
    )
    grad_y = torch.randn(13, 200, generator=torch.Generator().manual_seed(1))
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_ref, case, grad_y)
    assert set(grads) == {"topk_weights", "lora.b_gate_up", "lora.b_down"}
    tol = KERNEL_TOLERANCES[torch.float32]
    _assert_close_scaled(y, y_ref, tol, "y")
    for name in grads:
        _assert_close_scaled(grads[name], grads_ref[name], tol, name)


def test_fp8_kernel_no_tokens(kernel_path):
    case = make_fp8_case(0, 200, 72, 4, 2, torch.float32, lora_on="both")
    y, grads = run_with_grads(moe_mlp, case, torch.zeros(0, 200))
    assert y.shape == (0, 200)
    assert all(bool((grad == 0).all()) for grad in grads.values())


def test_fp8_auto_takes_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    monkeypatch.setattr(kernels_fp8, "fp8_gate_up_fwd", None)
    case = make_fp8_case(5, 136, 40, 4, 2, torch.float32)
    torch.testing.assert_close(moe_mlp(**case), moe_mlp_ref(**case))


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


@pytest.mark.parametrize("dtype, index", [(torch.bfloat16, 0), (torch.float16, 0), (torch.float32, 1)])
def test_fp8_sweep_candidates_start_with_the_gpu_choices(dtype, index):
    # engine/bench/moe_op.fp8_candidates promises its first two are pick_fp8_config's GPU choices (16-bit, fp32) at
    # the benchmark shapes. A stand-in for a CUDA tensor takes the GPU branch on this machine.
    from types import SimpleNamespace

    from moe_tune.engine.bench.moe_op import fp8_candidates

    cuda_x = SimpleNamespace(is_cuda=True, dtype=dtype)
    chosen = kernels_fp8.pick_fp8_config(cuda_x, 16384 * 8, 64)
    assert list(fp8_candidates().values())[index] == chosen


def test_fp8_reference_takes_gpt_oss_biases_and_activation(monkeypatch):
    # gpt_oss's biases and clamped SwiGLU stay on the reference with FP8 weights: b_down adds sum_j w_j b_down[e]
    # to y (after the FP8 GEMM, weighted), zero biases change nothing, and the clamped activation changes h.
    from moe_tune.ops.moe import ClampedSwiGLU

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
