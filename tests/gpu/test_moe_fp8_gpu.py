"""moe Triton kernels through frozen FP8 expert weights on CUDA (Hopper FP8 tensor cores): bf16 and fp32 forward and
every gradient against the reference at odd and real sizes, NaN-filled buffers with guarded ends, the quantization
kernel bit for bit against ops/fp8/reference.py, no host sync.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
import torch

from moe_tune.ops.fp8.reference import quantize_groups, quantize_weight
from moe_tune.ops.moe import ExpertLoRA, kernels_fp8, moe_mlp
from moe_tune.ops.moe.reference import moe_mlp_ref
from moe_cases import LORA_NAMES, make_case, run_with_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
# One table per dtype, errors against the largest magnitude of each reference tensor. The reference quantizes its
# fp32 activations; the kernels quantize h, gate_up and d gate_up as they compute and round them (bf16: after the bf16
# rounding; fp32: values an ulp apart), which moves a few elements one FP8 step (1/16 of their value). One such step
# in h at F = 72-136 moved a y element by up to 2.0e-2 of y's largest magnitude in fp32 (odd shapes, H200), so
# both dtypes take the same bound.
TOLERANCES = {
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
    torch.float32: dict(atol=5e-2, rtol=5e-2),
}
RANK = 16
LORA_SCALING = 2.0
GUARD_ELEMENTS = 1 << 16


kernel_path = forced_kernel_path(kernels_fp8, "_fp8_gate_up_fwd_kernel", on_gpu=True)


@pytest.fixture
def guarded(monkeypatch, kernel_path) -> GuardedBuffers:
    from moe_tune.ops.moe import kernel_config, kernels_fp8

    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernel_config, "alloc", buffers.alloc)
    monkeypatch.setattr(kernel_config, "alloc_index", buffers.alloc_index)
    monkeypatch.setattr(kernels_fp8, "_alloc", buffers.alloc)
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


def _assert_close_scaled(actual, expected, dtype, name):
    tol = TOLERANCES[dtype]
    atol = tol["atol"] * max(float(expected.detach().abs().max()), 1e-6)
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=tol["rtol"], msg=lambda m: f"{name}: {m}"
    )


def _assert_matches_reference(case: dict, dtype: torch.dtype) -> None:
    num_tokens, model_dim = case["x"].shape
    grad_y = torch.randn(num_tokens, model_dim, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    y, grads = run_with_grads(moe_mlp, case, grad_y.to(dtype))
    y_ref, grads_ref = run_with_grads(moe_mlp_ref, case, grad_y.to(dtype))
    assert y.dtype == dtype and y.shape == (num_tokens, model_dim)
    _assert_close_scaled(y, y_ref, dtype, "y")
    assert set(grads) == set(grads_ref)
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        _assert_close_scaled(grad, grads_ref[name], dtype, f"grad {name}")


# (N, D, F, E, k, routing)
SHAPES = {
    # D and F not multiples of 128 (or of 16): partial K blocks, partial scale blocks, the halves' own scale rows.
    "odd_dims": (513, 200, 136, 5, 2, "random"),
    "D200_F72": (301, 200, 72, 7, 3, "random"),
    "empty_experts": (1024, 512, 256, 8, 2, "two_experts_only"),
    "one_expert_takes_all": (777, 256, 384, 6, 2, "all_to_last"),
    "top1": (1000, 512, 256, 8, 1, "random"),
    # 512 rows per expert on average: 128-row tiles; E256 top-16: the 64-row tile config.
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


@pytest.mark.parametrize("segments", [pytest.param(None, id="one_segment"), pytest.param((136, 136), id="halves")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_matches_reference_bitwise(kernel_path, segments, dtype):
    from moe_tune.ops.moe.kernels_fp8 import quantize_rows

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = (torch.randn(333, 272, generator=gen, device=DEVICE) * 3).to(dtype)
    # A zero row (the amax floor) and a strided view (dy from y.sum() is stride 0).
    x[5] = 0
    for operand in (x, x.T.contiguous().T, torch.ones(1, 272, device=DEVICE, dtype=dtype).expand(7, 272)):
        x_q, scale = quantize_rows(operand, segments)
        x_q_ref, scale_ref = quantize_groups(operand, segments)
        assert torch.equal(scale, scale_ref)
        assert torch.equal(x_q.view(torch.uint8), x_q_ref.view(torch.uint8))


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


def _candidate_params() -> list:
    from moe_tune.engine.bench.moe_op import fp8_candidates

    return [
        pytest.param(name, shape, id=f"{name}-{shape}") for name in fp8_candidates() for shape in ("odd_dims", "E64_top8")
    ]


@pytest.mark.parametrize("name, shape", _candidate_params())
def test_fp8_kernel_candidate_configs(guarded, name, shape):
    # Every launch config the FP8 sweep times (engine/bench/moe_op.py), bf16 with LoRA on both projections.
    from moe_tune.engine.bench.moe_op import fp8_candidates
    from moe_tune.ops.moe.kernels_fp8 import forced_fp8_config

    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = make_fp8_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, "both")
    with forced_fp8_config(fp8_candidates()[name]):
        _assert_matches_reference(case, torch.bfloat16)
    guarded.check()
