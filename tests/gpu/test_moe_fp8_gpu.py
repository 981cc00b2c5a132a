"""moe Triton kernels through frozen FP8 expert weights on CUDA (dequantized in the kernels' weight tiles for odd D
and F, into a buffer per GEMM where D and F are multiples of 128: ops/moe/fp8_weights.py): bf16 and fp32 forward and
every gradient against the reference (the ordinary reference on the dequantized weights) at odd and real sizes,
NaN-filled buffers with guarded ends, the FP8 kernels against the same kernels on the dequantized weights rounded to
bf16 (bit for bit on the buffered path), no host sync.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
import torch

from moe_tune.ops.fp8.reference import dequantize_weight, quantize_weight
from moe_tune.ops.moe import ExpertLoRA, fp8_weights, kernel_config, kernels_fwd, moe_mlp
from moe_tune.ops.moe.reference import moe_mlp_ref
from moe_cases import LORA_NAMES, make_case, run_with_grads

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# One table per dtype, errors against the largest magnitude of each reference tensor: test_moe_gpu.py's, since the
# kernels compute as with bf16 weights (bf16: the dequantized weights, h, gate/up and d gate/up rounded to bf16 between
# kernels; fp32: the reference's fp32 weights, exact fp32 dots in another order).
TOLERANCES = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
}
# bf16 activations: the FP8 path rounds W_q * scale_inv to bf16 as the bf16 weights are, so the two differ only where
# the compiled dots sum in another order (the gate/up backward runs one K loop per half with FP8 weights): a bf16 ulp.
BF16_WEIGHT_TOLERANCE = dict(atol=1e-2, rtol=1e-2)
RANK = 16
LORA_SCALING = 2.0
GUARD_ELEMENTS = 1 << 16


kernel_path = forced_kernel_path(kernels_fwd, "_moe_gate_up_fwd_kernel", on_gpu=True)


@pytest.fixture
def guarded(monkeypatch, kernel_path) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernel_config, "alloc", buffers.alloc)
    monkeypatch.setattr(kernel_config, "alloc_index", buffers.alloc_index)
    return buffers


def make_fp8_case(*args, rank=RANK, **kwargs) -> dict:
    """make_case's inputs on CUDA, expert weights quantized to FP8 (frozen) with their block scales."""
    case = make_case(*args, rank=rank, scaling=LORA_SCALING, device=DEVICE, **kwargs)
    num_hidden = case["w_down"].shape[2]
    case["w_gate_up"], case["gate_up_scale_inv"] = quantize_weight(
        case["w_gate_up"].detach().float(), row_segments=(num_hidden, num_hidden)
    )
    case["w_down"], case["down_scale_inv"] = quantize_weight(case["w_down"].detach().float())
    return case


def dequantized(case: dict, dtype: torch.dtype) -> dict:
    """The case with its FP8 weights replaced by their dequantized values in `dtype` (frozen) and no scales."""
    num_hidden = case["w_down"].shape[2]
    return dict(
        case,
        w_gate_up=dequantize_weight(case["w_gate_up"], case["gate_up_scale_inv"], (num_hidden, num_hidden), dtype),
        w_down=dequantize_weight(case["w_down"], case["down_scale_inv"], None, dtype),
        gate_up_scale_inv=None,
        down_scale_inv=None,
    )


def _freeze(case: dict, names: tuple[str, ...]) -> dict:
    case = dict(case)
    pairs = {} if case["lora"] is None else {name: getattr(case["lora"], name) for name in LORA_NAMES}
    for name in names:
        if name.startswith("lora."):
            pairs[name.removeprefix("lora.")] = pairs[name.removeprefix("lora.")].detach()
        else:
            case[name] = case[name].detach()
    if case["lora"] is not None:
        case["lora"] = ExpertLoRA(**pairs, scaling=LORA_SCALING)
    return case


def _assert_close_scaled(actual, expected, tol, name):
    atol = tol["atol"] * max(float(expected.detach().abs().max()), 1e-6)
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=tol["rtol"], msg=lambda m: f"{name}: {m}"
    )


def _grad_y(case: dict, dtype: torch.dtype) -> torch.Tensor:
    num_tokens, model_dim = case["x"].shape
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return torch.randn(num_tokens, model_dim, device=DEVICE, generator=gen).to(dtype)


def _assert_matches_reference(case: dict, dtype: torch.dtype) -> None:
    grad_y = _grad_y(case, dtype)
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_ref, case, grad_y)
    assert y.dtype == dtype and y.shape == case["x"].shape
    _assert_close_scaled(y, y_ref, TOLERANCES[dtype], "y")
    assert set(grads) == set(grads_ref) and "topk_weights" in grads
    assert not any(name.startswith("w_") for name in grads), "FP8 weights got a gradient"
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        _assert_close_scaled(grad, grads_ref[name], TOLERANCES[dtype], f"grad {name}")


# (N, D, F, E, k, routing)
SHAPES = {
    # D and F not multiples of 128 (or of 16): partial K blocks, partial scale blocks, the halves' own scale rows.
    "odd_dims": (513, 200, 136, 5, 2, "random"),
    "D200_F72": (301, 200, 72, 7, 3, "random"),
    "empty_experts": (1024, 512, 256, 8, 2, "two_experts_only"),
    "one_expert_takes_all": (777, 256, 384, 6, 2, "all_to_last"),
    "top1": (1000, 520, 264, 8, 1, "random"),
    "E1": (300, 264, 200, 1, 1, "random"),
    # 512 rows per expert on average: 128-row tiles; E256 top-16: 64-row tiles.
    "E64_top8": (4096, 1024, 512, 64, 8, "random"),
    "E256_top16": (1024, 512, 256, 256, 16, "random"),
}
# fp32 on the odd shapes only: the large ones add nothing that bf16 does not check there.
CASES = [
    pytest.param(shape, lora_on, dtype, id=f"{shape}-{lora_on}-{name}")
    for shape in SHAPES
    for lora_on in ("none", "both")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
    if name == "bf16" or shape in ("odd_dims", "D200_F72", "empty_experts")
]


@pytest.mark.parametrize("shape, lora_on, dtype", CASES)
def test_fp8_kernel_matches_reference(guarded, shape, lora_on, dtype):
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    _assert_matches_reference(case, dtype)
    guarded.check()


LORA_VARIANTS = {
    "gate_up_only": ("gate_up", 16, ()),
    "down_only": ("down", 16, ()),
    "r24": ("both", 24, ()),
    "a_frozen_x_frozen": ("both", 16, ("x", "lora.a_gate_up", "lora.a_down")),
}


@pytest.mark.parametrize("variant", list(LORA_VARIANTS))
def test_fp8_kernel_lora_variants(guarded, variant):
    lora_on, rank, frozen = LORA_VARIANTS[variant]
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["odd_dims"]
    case = make_fp8_case(
        num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, lora_on, rank=rank
    )
    _assert_matches_reference(_freeze(case, frozen), torch.bfloat16)
    guarded.check()


@pytest.mark.parametrize("shape", ["odd_dims", "E64_top8"])
def test_fp8_kernel_matches_bf16_weight_kernel(kernel_path, shape):
    # The same kernels on dequantize_weight(W).to(bf16), bf16 activations, LoRA on both: y and every gradient.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, "both")
    grad_y = _grad_y(case, torch.bfloat16)
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_bf16, grads_bf16 = run_with_grads(moe_mlp, dequantized(case, torch.bfloat16), grad_y)
    _assert_close_scaled(y, y_bf16, BF16_WEIGHT_TOLERANCE, "y")
    assert set(grads) == set(grads_bf16)
    for name, grad in grads.items():
        _assert_close_scaled(grad, grads_bf16[name], BF16_WEIGHT_TOLERANCE, f"grad {name}")


@pytest.mark.parametrize("shape", ["E64_top8", "empty_experts"])
def test_fp8_buffered_experts_equal_the_bf16_weight_kernels_bitwise(kernel_path, shape):
    # D and F multiples of 128: each GEMM runs the bf16 kernels on a buffer holding code * scale rounded to bf16,
    # the same values dequantize_weight gives, so y and every gradient are those of the bf16-weight run exactly.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, "both")
    assert fp8_weights.buffers_weights(case["w_gate_up"], case["w_down"], torch.bfloat16, num_tokens * top_k)
    grad_y = _grad_y(case, torch.bfloat16)
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_bf16, grads_bf16 = run_with_grads(moe_mlp, dequantized(case, torch.bfloat16), grad_y)
    torch.testing.assert_close(y, y_bf16, atol=0, rtol=0)
    assert set(grads) == set(grads_bf16)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_bf16[name], atol=0, rtol=0, msg=lambda m: f"grad {name}: {m}")


def test_fp8_kernel_has_no_host_sync(kernel_path):
    case = make_fp8_case(2048, 512, 256, 16, 4, torch.bfloat16, lora_on="both")
    grad_y = torch.randn(2048, 512, device=DEVICE, dtype=torch.bfloat16)
    run_with_grads(moe_mlp, case, grad_y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_with_grads(moe_mlp, case, grad_y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
