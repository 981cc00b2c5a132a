"""moe Triton kernels on CUDA: bf16 and fp32 forward and every gradient against the reference at realistic sizes,
NaN-filled buffers with guarded ends, no host sync, determinism, and the issue's N16384 D2048 F1024 E64 top-8 shape;
LoRA on one or both projections, at several ranks, with parts of the adapters frozen.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
Run on the H200 on its own (tests/ops imports the kernels in interpreter mode): pytest -m gpu tests/gpu
"""

import pytest
from guarded_buffers import GuardedBuffers
from kernel_fixtures import forced_kernel_path
import torch

import moe_tune.ops.moe.routing as routing_kernels
from moe_tune.ops.moe import ExpertLoRA, kernel_config, kernels_fwd, moe_mlp, topk_route
from moe_tune.ops.moe.reference import moe_mlp_ref
from moe_cases import LORA_NAMES, make_case, run_with_grads

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# One table per dtype, errors measured against the largest magnitude of each reference tensor (weight gradients
# sum thousands of rows, so an element-relative bound would fail on their near-zero entries).
# bf16: h, gate/up, d(gate/up) and per-slot outputs are rounded to bf16 between kernels (2^-9 relative each) while
# the reference computes in fp32 from the same bf16 inputs. fp32: exact fp32 dots on both sides (torch's default
# "highest" matmul precision), only the summation order differs.
TOLERANCES = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
}
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


def _make_case(*args, rank=RANK, **kwargs) -> dict:
    return make_case(*args, rank=rank, scaling=LORA_SCALING, device=DEVICE, **kwargs)


def _freeze(case: dict, names: tuple[str, ...]) -> dict:
    """The case with the named tensors (x, w_gate_up, w_down, lora.<name>) detached: no gradient for them."""
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


def _assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    tol = TOLERANCES[dtype]
    atol = tol["atol"] * max(float(expected.abs().max()), 1e-6)
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
    # Prime N and E, F = 384 not a multiple of the 128-column tile, D != F.
    "prime_E7": (1531, 512, 384, 7, 3, "random"),
    "empty_experts": (1024, 512, 256, 8, 2, "two_experts_only"),
    # 1554 rows on one expert: 13 tiles of 128, the last one partial.
    "one_expert_takes_all": (777, 256, 512, 6, 2, "all_to_last"),
    "top1": (1000, 512, 256, 8, 1, "random"),
    "topk_equals_E": (300, 256, 256, 4, 4, "random"),
    # Dims that are not multiples of 16: masked K steps and unaligned rows.
    "odd_dims": (513, 200, 136, 5, 2, "random"),
    # 512 rows per expert on average: 128-row tiles.
    "E64_top8": (4096, 1024, 512, 64, 8, "random"),
    # 64 rows per expert on average: the 64-row tile config.
    "E256_top16": (1024, 512, 256, 256, 16, "random"),
}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
LORA_ON = [pytest.param("none", id="no_lora"), pytest.param("both", id="lora_both")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lora_on", LORA_ON)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_mlp_kernel_matches_reference(guarded, shape, lora_on, dtype):
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    _assert_matches_reference(case, dtype)
    guarded.check()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["prime_E7", "top1", "E64_top8"])
@pytest.mark.parametrize("num_add_to", [1, 2], ids=["one_tensor", "two_tensors"])
def test_moe_mlp_kernel_adds_add_to_inside_the_slot_sum(guarded, shape, dtype, num_add_to):
    # add_to (the shared expert's output in the MoE block, and the layer's residual) joins the fp32 slot sum, k = 1
    # included: y and every gradient, add_to's among them, against the reference given the same add_to.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, "both")
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    addends = tuple(torch.randn(num_tokens, model_dim, device=DEVICE, generator=gen).to(dtype).requires_grad_()
                    for _ in range(num_add_to))  # fmt: skip
    case["add_to"] = addends[0] if num_add_to == 1 else addends
    _assert_matches_reference(case, dtype)
    guarded.check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_mlp_kernel_frozen_base_weights(guarded, dtype):
    # LoRA fine-tuning: only the adapters, x and the routing weights get gradients.
    case = _make_case(2048, 512, 256, 16, 4, dtype, lora_on="both")
    for name in ("w_gate_up", "w_down"):
        case[name] = case[name].detach()
    _assert_matches_reference(case, dtype)
    guarded.check()


# LoRA variants on the odd-dims shape (masked K steps, unaligned rows), bf16: (lora_on, rank, frozen tensors).
LORA_VARIANTS = {
    # LoRA training as the bench times it: experts frozen, x and the routing weights get gradients.
    "frozen_experts_r16": ("both", 16, ("w_gate_up", "w_down")),
    # One projection only: the other runs plain.
    "gate_up_only": ("gate_up", 16, ("w_gate_up", "w_down")),
    "down_only": ("down", 16, ("w_gate_up", "w_down")),
    # Ranks that are not a power of 2 / wider than the 16-wide rank block.
    "r8": ("both", 8, ("w_gate_up", "w_down")),
    "r24": ("both", 24, ("w_gate_up", "w_down")),
    "r64": ("both", 64, ("w_gate_up", "w_down")),
    # LoRA-FA: A frozen (no dA passes); B and dx run.
    "a_frozen": ("both", 16, ("w_gate_up", "w_down", "lora.a_gate_up", "lora.a_down")),
    # Only B and the routing weights train: the gate_up LoRA pass computes dB alone, no dx.
    "only_b": ("both", 16, ("x", "w_gate_up", "w_down", "lora.a_gate_up", "lora.a_down")),
    # Every weight trains, the adapters too.
    "all_trained": ("both", 16, ()),
}


@pytest.mark.parametrize("variant", list(LORA_VARIANTS))
def test_moe_mlp_kernel_lora_variants(guarded, variant):
    lora_on, rank, frozen = LORA_VARIANTS[variant]
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["odd_dims"]
    case = _make_case(
        num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, lora_on, rank=rank
    )
    _assert_matches_reference(_freeze(case, frozen), torch.bfloat16)
    guarded.check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_mlp_kernel_frozen_experts_without_lora(guarded, dtype):
    # The baseline of the LoRA overhead target: experts frozen, no adapters; dx and d topk_weights only.
    case = _make_case(2048, 512, 256, 16, 4, dtype)
    for name in ("w_gate_up", "w_down"):
        case[name] = case[name].detach()
    _assert_matches_reference(case, dtype)
    guarded.check()


def _sweep_params() -> list:
    from moe_tune.engine.bench.moe_op import sweep_candidates

    return [
        pytest.param(kernel, index, id=f"{kernel}-{index}")
        for kernel, configs in sweep_candidates().items()
        for index in range(len(configs))
    ]


@pytest.mark.parametrize("kernel, index", _sweep_params())
def test_moe_mlp_kernel_sweep_candidates(guarded, kernel, index):
    # Every launch config the bench sweep may pick, on the 128-row tile shape: outputs and all gradients.
    import dataclasses

    from moe_tune.engine.bench.moe_op import sweep_candidates

    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES["E64_top8"]
    # The LoRA passes' candidates run with adapters on frozen experts, as LoRA training does.
    lora_on = "both" if kernel.startswith("lora_") else "none"
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, torch.bfloat16, pattern, lora_on)
    if lora_on != "none":
        case = _freeze(case, ("w_gate_up", "w_down"))
    default = kernel_config.pick_config(case["x"], num_tokens * top_k, num_experts)
    config = dataclasses.replace(default, **{kernel: sweep_candidates()[kernel][index]})
    with kernel_config.forced_config(config):
        _assert_matches_reference(case, torch.bfloat16)
    guarded.check()


def test_moe_mlp_kernel_has_no_host_sync(kernel_path):
    case = _make_case(2048, 512, 256, 16, 4, torch.bfloat16, lora_on="both")
    grad_y = torch.randn(2048, 512, device=DEVICE, dtype=torch.bfloat16)
    # Compile outside the check: the first launch may query the device.
    run_with_grads(moe_mlp, case, grad_y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_with_grads(moe_mlp, case, grad_y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_moe_mlp_kernel_is_deterministic(kernel_path):
    case = _make_case(4096, 1024, 512, 64, 8, torch.bfloat16, lora_on="both")
    grad_y = torch.randn(4096, 1024, device=DEVICE, dtype=torch.bfloat16)
    y1, grads1 = run_with_grads(moe_mlp, case, grad_y)
    y2, grads2 = run_with_grads(moe_mlp, case, grad_y)
    assert torch.equal(y1, y2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name


def test_moe_mlp_kernel_issue_shape_bf16(kernel_path):
    # The issue's target shape with a softmax router: N16384 D2048 F1024 E64 top-8, bf16.
    num_tokens, model_dim, hidden_dim, num_experts, top_k = 16384, 2048, 1024, 64, 8
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=DEVICE)
    topk_ids, topk_weights, _ = topk_route(logits, top_k)
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype)
    case["topk_ids"] = topk_ids
    case["topk_weights"] = topk_weights.to(dtype).requires_grad_()
    _assert_matches_reference(case, dtype)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((16384, 2048, 1024, 64, 8), id="E64_top8"),
        pytest.param((16384, 2048, 512, 256, 16), id="E256_top16"),
    ],
)
def test_moe_mlp_kernel_issue_shapes_lora_bf16(kernel_path, shape):
    # The LoRA target's shapes as the bench times them: LoRA r16 on both projections, experts frozen, softmax router.
    num_tokens, model_dim, hidden_dim, num_experts, top_k = shape
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=DEVICE)
    topk_ids, topk_weights, _ = topk_route(logits, top_k)
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, lora_on="both")
    case["topk_ids"] = topk_ids
    case["topk_weights"] = topk_weights.to(dtype).requires_grad_()
    _assert_matches_reference(_freeze(case, ("w_gate_up", "w_down")), dtype)


@pytest.mark.parametrize("num_experts, skew", [(64, None), (61, "one"), (256, "empty_ends"), (1, None)])
@pytest.mark.parametrize("block", [16, 64, 128])
def test_routing_kernels_match_torch_bitwise(num_experts, skew, block):
    """The routing metadata and tile maps of the Triton kernels against their torch versions, on the device (the
    moe_mlp tests above would only see a wrong map through the outputs)."""
    gen = torch.Generator(device=DEVICE).manual_seed(num_experts + block)
    num_tokens, top_k = 16384, min(8, num_experts)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, device=DEVICE)
    if skew == "one":
        ids[: num_tokens * 3 // 4] = 5  # three quarters of the slots on one expert
    elif skew == "empty_ends":
        ids = ids.clamp(1, num_experts - 2)
    sorted_ids, sort_index = torch.sort(ids.reshape(-1), stable=True)
    ours = routing_kernels._routing_metadata(sorted_ids, sort_index, num_experts, top_k, block)
    theirs = routing_kernels._routing_metadata_torch(sorted_ids, sort_index, num_experts, top_k, block)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
    offsets = theirs[2].long()
    for chunk_rows in (block, 512, 4096):
        ours_map = routing_kernels._tile_map(offsets, sorted_ids.numel(), chunk_rows)
        theirs_map = routing_kernels._tile_map_torch(offsets, sorted_ids.numel(), chunk_rows)
        for a, b in zip(ours_map, theirs_map, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("num_tokens, model_dim, top_k", [(8192, 2048, 8), (4099, 2056, 10), (33, 7, 3), (65, 9, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_addends", [0, 1, 2], ids=["slots", "addend", "two_addends"])
def test_sum_slots_adds_each_tokens_slots_in_slot_order(guarded, num_tokens, model_dim, top_k, dtype, num_addends):
    """The top-k slot sum against the addends (in order) and the slots added one by one in fp32 and rounded once:
    equal bit for bit (bf16 rounds to nearest even here, toward zero in the interpreter); bench-qwen3-next's shape
    first."""
    gen = torch.Generator(device=DEVICE).manual_seed(model_dim + top_k)
    per_slot = (torch.randn(num_tokens * top_k, model_dim, generator=gen, device=DEVICE) * 4).to(dtype)
    addends = [(torch.randn(num_tokens, model_dim, generator=gen, device=DEVICE) * 4).to(dtype)
               for _ in range(num_addends)]  # fmt: skip
    y = routing_kernels.sum_slots(per_slot, num_tokens, top_k, addends)
    expected = torch.zeros(num_tokens, model_dim, device=DEVICE)
    for t in (*addends, *(per_slot[j::top_k] for j in range(top_k))):
        expected += t.float()
    assert y.dtype == dtype and torch.equal(y, expected.to(dtype))
    if top_k == 1 and not addends:
        return
    guarded.check()
