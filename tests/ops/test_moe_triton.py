"""moe Triton kernels in the interpreter: forward and every gradient against the per-token oracle, odd routings,
NaN-filled buffers with guarded ends, the LoRA passes alone against torch, routing metadata, determinism, dispatch.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank, S = N*k token-slots.
"""

import dataclasses

import pytest
from guarded_buffers import GuardedBuffers
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    import triton.runtime.interpreter as triton_interpreter
    from moe_tune.ops.moe import ExpertLoRA, moe_mlp
    import moe_tune.ops.moe.routing as routing_kernels
    from moe_tune.ops.moe import kernel_config, kernels_bwd, kernels_fwd
    from moe_tune.ops.moe.autograd import MoEFunction
    from moe_tune.ops.moe.reference import moe_mlp_loop_ref
    from moe_cases import LORA_NAMES, make_case, route_pattern, run_with_grads

# One table per dtype. fp32: the interpreter's dots are fp32 products, only the summation order differs (measured
# max error 8e-6 on gradients of magnitude 40). fp16: gate/up, h, d(gate/up) and the per-slot outputs are rounded to
# fp16 between kernels while the reference keeps fp32 until its one final rounding; measured error at most 0.7x this.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
RANK = 4
LORA_SCALING = 0.5
# Elements past the end of every kernel buffer: a whole 16-row tile of the widest test tensor (2F = 64 columns).
GUARD_ELEMENTS = 16 * 64


pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")


@pytest.fixture
def kernel_path(monkeypatch):
    assert isinstance(kernels_fwd._moe_gate_up_fwd_kernel, triton_interpreter.InterpretedFunction), (
        "ops/moe/kernels_fwd.py was imported before TRITON_INTERPRET=1 was set: its kernels are compiled for a GPU"
    )
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def guarded(monkeypatch) -> GuardedBuffers:
    buffers = GuardedBuffers(GUARD_ELEMENTS)
    monkeypatch.setattr(kernel_config, "alloc", buffers.alloc)
    monkeypatch.setattr(kernel_config, "alloc_index", buffers.alloc_index)
    return buffers


def _make_case(*args, rank=RANK, **kwargs) -> dict:
    return make_case(*args, rank=rank, scaling=LORA_SCALING, **kwargs)


def _assert_matches_oracle(case: dict, dtype: torch.dtype, grad_y: torch.Tensor | None = None) -> None:
    num_tokens, model_dim = case["x"].shape
    if grad_y is None:
        grad_y = torch.randn(num_tokens, model_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, grads = run_with_grads(moe_mlp, case, grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_loop_ref, case, grad_y)
    tol = TOLERANCES[dtype]
    assert y.dtype == dtype and y.shape == (num_tokens, model_dim)
    torch.testing.assert_close(y, y_ref, **tol, msg=lambda m: f"y: {m}")
    assert set(grads) == set(grads_ref)
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad, grads_ref[name], **tol, msg=lambda m, name=name: f"grad {name}: {m}")


# (N, D, F, E, k, routing)
SHAPES = {
    # Prime E, N*k = 111 rows not a multiple of the 16-row tile, D != F.
    "prime_E7": (37, 24, 20, 7, 3, "random"),
    "empty_experts": (12, 16, 32, 8, 2, "two_experts_only"),
    # 42 rows on one expert: three tiles, the last one partial, and every other expert empty.
    "one_expert_takes_all": (21, 16, 24, 6, 2, "all_to_last"),
    # k = 1: each token has one slot, the slot sum is the identity.
    "top1": (9, 16, 32, 8, 1, "random"),
    # k = E: every token visits every expert, each expert's range holds all N tokens.
    "topk_equals_E": (6, 16, 32, 4, 4, "random"),
    # A single token: k rows in total, most tiles of the worst-case grid have no work.
    "N1": (1, 16, 32, 8, 2, "random"),
    # D > F, 80 rows: several full tiles per expert.
    "D32_F16_N40": (40, 32, 16, 5, 2, "random"),
}


def _params(pairs: list[tuple[str, str, torch.dtype]]) -> list:
    names = {torch.float32: "fp32", torch.float16: "fp16"}
    return [
        pytest.param(*SHAPES[shape], lora_on, dtype, id=f"{shape}-{lora_on}-{names[dtype]}")
        for shape, lora_on, dtype in pairs
    ]


KERNEL_CASES = _params(
    [(shape, lora_on, torch.float32) for shape in SHAPES for lora_on in ("none", "both")]
    + [
        # LoRA on one projection only: the other projection must run plain.
        ("prime_E7", "gate_up", torch.float32),
        ("prime_E7", "down", torch.float32),
        # fp16 where the interpreter's dot is exact (bf16 dots are not: that dtype runs on the GPU only).
        ("prime_E7", "both", torch.float16),
        ("empty_experts", "none", torch.float16),
        ("one_expert_takes_all", "both", torch.float16),
        ("topk_equals_E", "none", torch.float16),
    ]
)


@pytest.mark.parametrize("num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on, dtype", KERNEL_CASES)
def test_moe_mlp_kernel_matches_loop_ref(
    kernel_path, guarded, num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on, dtype
):
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    _assert_matches_oracle(case, dtype)
    guarded.check()


@pytest.mark.parametrize("shape, lora_on, dtype", [("prime_E7", "both", torch.float32), ("top1", "none", torch.float32),
                                                   ("N1", "both", torch.float32), ("prime_E7", "none", torch.float16)])
@pytest.mark.parametrize("add_grad", [True, False], ids=["add_to_trained", "add_to_frozen"])
@pytest.mark.parametrize("num_add_to", [1, 2], ids=["one_tensor", "two_tensors"])
def test_moe_mlp_kernel_adds_add_to_inside_the_slot_sum(
    kernel_path, guarded, shape, lora_on, dtype, add_grad, num_add_to
):
    # add_to (one tensor, or two: a MoE block's shared expert and residual) joins each token's fp32 slot sum (k = 1
    # too, where the slots alone are the output): y against the oracle plus add_to, each add_to tensor's gradient
    # y's (or none when it needs none; the second always trained), every other gradient as without it.
    num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern = SHAPES[shape]
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
    gen = torch.Generator().manual_seed(3)
    grad_y = torch.randn(num_tokens, model_dim, generator=gen).to(dtype)
    addends = [torch.randn(num_tokens, model_dim, generator=gen).to(dtype).requires_grad_(add_grad or i > 0)
               for i in range(num_add_to)]  # fmt: skip
    add_to = addends[0] if num_add_to == 1 else tuple(addends)
    y, grads = run_with_grads(moe_mlp, dict(case, add_to=add_to), grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_loop_ref, case, grad_y)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y, (y_ref.float() + sum(t.float() for t in addends)).to(dtype), **tol)
    names = ["add_to"] if num_add_to == 1 else ["add_to[0]", "add_to[1]"]
    for name, addend in zip(names, addends):
        if addend.requires_grad:
            assert torch.equal(grads.pop(name), grad_y), name
    assert set(grads) == set(grads_ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], **tol, msg=lambda m, name=name: f"grad {name}: {m}")
    guarded.check()


def test_moe_mlp_kernel_frozen_base_weights(kernel_path, guarded):
    # LoRA fine-tuning: x and the expert weights need no gradient, so dx and the big weight gradients are skipped and
    # the gate_up backward runs its LoRA product alone.
    case = _make_case(37, 24, 20, 7, 3, torch.float32, lora_on="both")
    for name in ("x", "w_gate_up", "w_down"):
        case[name] = case[name].detach()
    _assert_matches_oracle(case, torch.float32)
    guarded.check()


def test_moe_mlp_kernel_frozen_experts_without_lora(kernel_path, guarded):
    # The baseline of the LoRA overhead target: experts frozen, no adapters, so only dx and d topk_weights run (the
    # down backward stores no h, no weight-gradient kernel launches).
    case = _make_case(37, 24, 20, 7, 3, torch.float32)
    for name in ("w_gate_up", "w_down"):
        case[name] = case[name].detach()
    _assert_matches_oracle(case, torch.float32)
    guarded.check()


# Which tensors of the adapters (and of x) are frozen: each turns a part of the LoRA backward off.
PARTLY_FROZEN = {
    # LoRA-FA: A frozen, so dA is skipped (no dA partials in the down backward, no dA_gate_up pass); B and dx run.
    "a_frozen": ("lora.a_gate_up", "lora.a_down"),
    # B frozen: the LoRA backward passes compute the per-row products and skip dB.
    "b_frozen": ("lora.b_gate_up", "lora.b_down"),
    # Only B and the routing weights train: the gate_up pass computes dB alone (no dx, no per-row product).
    "only_b_and_weights": ("x", "lora.a_gate_up", "lora.a_down"),
    # Only A trains besides the routing weights: the gate_up pass computes the per-row product for dA, no dB, no dx.
    "only_a_and_weights": ("x", "lora.b_gate_up", "lora.b_down"),
}


@pytest.mark.parametrize("frozen", [pytest.param(names, id=case) for case, names in PARTLY_FROZEN.items()])
def test_moe_mlp_kernel_partly_frozen_adapters(kernel_path, guarded, frozen):
    case = _make_case(37, 24, 20, 7, 3, torch.float32, lora_on="both")
    for name in ("w_gate_up", "w_down"):
        case[name] = case[name].detach()
    pairs = {name: getattr(case["lora"], name) for name in LORA_NAMES}
    for name in frozen:
        if name == "x":
            case["x"] = case["x"].detach()
        else:
            pairs[name.removeprefix("lora.")] = pairs[name.removeprefix("lora.")].detach()
    case["lora"] = ExpertLoRA(**pairs, scaling=LORA_SCALING)
    _assert_matches_oracle(case, torch.float32)
    guarded.check()


@pytest.mark.parametrize(
    "rank",
    [
        pytest.param(1, id="r1"),  # one live column of the 16-wide rank block
        pytest.param(20, id="r20"),  # padded to a 32-wide rank block
    ],
)
def test_moe_mlp_kernel_lora_ranks(kernel_path, guarded, rank):
    case = _make_case(37, 24, 20, 7, 3, torch.float32, lora_on="both", rank=rank)
    _assert_matches_oracle(case, torch.float32)
    guarded.check()


# The LoRA passes alone against torch, on routings with empty experts and with one expert over several tiles.
# (N, E, k, routing)
LORA_PASS_CASES = [
    pytest.param(37, 7, 3, "random", id="prime_E7"),
    pytest.param(12, 8, 2, "two_experts_only", id="empty_experts"),
    pytest.param(21, 6, 2, "all_to_last", id="one_expert_takes_all"),
]
# 40 reduction elements or gradient columns: three 16-wide steps or blocks, the last one partial. Rank 5: a
# 16-wide rank block with 11 masked columns.
PASS_DIM = 40
PASS_RANK = 5


def _pass_setup(num_tokens: int, num_experts: int, top_k: int, pattern: str):
    gen = torch.Generator().manual_seed(0)
    topk_ids = route_pattern(pattern, gen, num_tokens, num_experts, top_k)
    # CPU tensors: the interpreter's 16-row tiles.
    config = kernel_config.pick_config(torch.zeros(1), num_tokens * top_k, num_experts)
    routing = routing_kernels.moe_routing(topk_ids, num_experts, config.block_m)
    slot_S = routing.slot_of_row_S.long()
    expert_S = topk_ids.reshape(-1)[slot_S]
    return gen, config, routing, slot_S, expert_S, routing.token_of_row_S.long()


@pytest.mark.parametrize("u_by_token", [pytest.param(True, id="x_by_token"), pytest.param(False, id="h_by_row")])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, pattern", LORA_PASS_CASES)
def test_moe_lora_rows_matches_torch(kernel_path, guarded, num_tokens, num_experts, top_k, pattern, u_by_token):
    gen, config, routing, _, expert_S, token_S = _pass_setup(num_tokens, num_experts, top_k, pattern)
    u = torch.randn(num_tokens if u_by_token else num_tokens * top_k, PASS_DIM, generator=gen)
    a = torch.randn(num_experts, PASS_RANK, PASS_DIM, generator=gen)
    ua = kernels_fwd.moe_lora_rows(u, a, routing, config, u_by_token=u_by_token)
    u_rows = u[token_S] if u_by_token else u
    expected = torch.einsum("sk,srk->sr", u_rows.double(), a[expert_S].double())
    assert ua.dtype == torch.float32
    torch.testing.assert_close(ua.double(), expected, **TOLERANCES[torch.float32])
    guarded.check()


@pytest.mark.parametrize(
    "compute_gb, compute_db",
    [
        pytest.param(True, True, id="gb_and_db"),
        pytest.param(True, False, id="gb_only"),
        pytest.param(False, True, id="db_only"),
    ],
)
@pytest.mark.parametrize(
    "g_by_token", [pytest.param(True, id="dy_by_token_weighted"), pytest.param(False, id="dgate_up_by_row")]
)
@pytest.mark.parametrize("num_tokens, num_experts, top_k, pattern", LORA_PASS_CASES)
def test_moe_lora_bwd_matches_torch(
    kernel_path, guarded, num_tokens, num_experts, top_k, pattern, g_by_token, compute_gb, compute_db
):
    gen, config, routing, slot_S, expert_S, token_S = _pass_setup(num_tokens, num_experts, top_k, pattern)
    num_slots, scale = num_tokens * top_k, 0.5
    g = torch.randn(num_tokens if g_by_token else num_slots, PASS_DIM, generator=gen)
    b = torch.randn(num_experts, PASS_DIM, PASS_RANK, generator=gen)
    ua = torch.randn(num_slots, PASS_RANK, generator=gen)
    # The down projection's pass reads dy by token and weights its rows for dB; the gate_up one reads dgate_up rows.
    topk_weights = torch.rand(num_tokens, top_k, generator=gen) if g_by_token else None
    gb, db = kernels_bwd.moe_lora_bwd(
        g, b, ua, scale, routing, config, compute_gb, compute_db, g_by_token=g_by_token, g_weights=topk_weights
    )
    g_rows = (g[token_S] if g_by_token else g).double()
    if compute_gb:
        expected_gb = scale * torch.einsum("sq,sqr->sr", g_rows, b[expert_S].double())
        assert gb.dtype == torch.float32
        torch.testing.assert_close(gb.double(), expected_gb, **TOLERANCES[torch.float32])
    else:
        assert gb is None
    if compute_db:
        weights_S = topk_weights.reshape(-1)[slot_S].double() if g_by_token else torch.ones(num_slots).double()
        per_row = torch.einsum("sq,sr->sqr", weights_S[:, None] * g_rows, ua.double())
        # Experts without rows get zeros, written by their programs (the buffers start as NaN).
        expected_db = scale * torch.zeros(num_experts, PASS_DIM, PASS_RANK).double().index_add_(0, expert_S, per_row)
        assert db.dtype == b.dtype and db.shape == b.shape
        torch.testing.assert_close(db.double(), expected_db, **TOLERANCES[torch.float32])
    else:
        assert db is None
    guarded.check()


@pytest.mark.parametrize("num_tokens, num_experts, top_k, pattern", LORA_PASS_CASES)
def test_moe_down_bwd_lora_da_matches_torch(kernel_path, guarded, num_tokens, num_experts, top_k, pattern):
    # dA_down as the backward computes it: the down backward stores w * h (with LoRA on, whatever the weights
    # need), and the per-expert gradient pass sums dha^T (w h); F = 20 spans two 16-column blocks.
    gen, config, routing, slot_S, expert_S, token_S = _pass_setup(num_tokens, num_experts, top_k, pattern)
    num_slots, model_dim, hidden_dim = num_tokens * top_k, 24, 20
    dy = torch.randn(num_tokens, model_dim, generator=gen)
    gate_up = torch.randn(num_slots, 2 * hidden_dim, generator=gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    w_down = torch.randn(num_experts, model_dim, hidden_dim, generator=gen)
    a_down = torch.randn(num_experts, PASS_RANK, hidden_dim, generator=gen)
    dha = torch.randn(num_slots, PASS_RANK, generator=gen)
    _, h_weighted, _ = kernels_bwd.moe_down_bwd(dy, gate_up, topk_weights, w_down, a_down, dha, routing, config, True)
    d_a_down = kernels_bwd.moe_expert_grad(dha, h_weighted, a_down, routing, config)
    gate, up = gate_up.double().split(hidden_dim, dim=1)
    weights_S = topk_weights.reshape(-1)[slot_S].double()
    expected_h_weighted = weights_S[:, None] * torch.nn.functional.silu(gate) * up
    per_row = torch.einsum("sr,sf->srf", dha.double(), expected_h_weighted)
    expected_da = torch.zeros(num_experts, PASS_RANK, hidden_dim).double().index_add_(0, expert_S, per_row)
    torch.testing.assert_close(h_weighted.double(), expected_h_weighted, **TOLERANCES[torch.float32])
    assert d_a_down.dtype == a_down.dtype
    torch.testing.assert_close(d_a_down.double(), expected_da, **TOLERANCES[torch.float32])
    guarded.check()


# Every kernel with its own tile: gate/up and down-backward columns, down-forward and dx columns, weight-gradient P
# and Q sides all differ, so a launcher that sized its grid from one kernel's config and its blocks from another's
# would leave columns unwritten (NaN-filled buffers) and fail the oracle.
PER_KERNEL_CONFIG = kernel_config.MoEConfig(
    block_m=16,
    gate_up_fwd=kernel_config.KernelConfig(32, 16, num_warps=1, num_stages=1),
    down_fwd=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1),
    down_bwd=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1),
    gate_up_bwd=kernel_config.KernelConfig(32, 16, num_warps=1, num_stages=1),
    expert_grad=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1, block_p=32),
    lora_rows=kernel_config.KernelConfig(0, 32, num_warps=1, num_stages=1),
    lora_bwd=kernel_config.KernelConfig(32, 16, num_warps=1, num_stages=1),
)


@pytest.mark.parametrize("lora_on", [pytest.param("none", id="no_lora"), pytest.param("both", id="lora_both")])
def test_moe_mlp_kernel_per_kernel_config(kernel_path, guarded, lora_on):
    # D = 40 and F = 36: partial column blocks under each of the tile widths above.
    case = _make_case(29, 40, 36, 5, 2, torch.float32, lora_on=lora_on)
    with kernel_config.forced_config(PER_KERNEL_CONFIG):
        _assert_matches_oracle(case, torch.float32)
    guarded.check()


# The down backward as a GEMM storing dy W (+ LoRA) and a pass of SwiGLU's backward over it: F = 36 (the GEMM's last
# column tile partial), 56, 300 (the pass's 256-column steps: a full and a partial one; 64-wide tiles elsewhere keep
# the interpreted programs few).
SWIGLU_PASS = dataclasses.replace(
    PER_KERNEL_CONFIG, down_bwd=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1, swiglu_pass=True)
)
WIDE_SWIGLU_PASS = dataclasses.replace(
    kernel_config.uniform_config(16, 64, 32, num_warps=1, num_stages=1),
    down_bwd=kernel_config.KernelConfig(64, 32, num_warps=1, num_stages=1, swiglu_pass=True),
)


@pytest.mark.parametrize("num_tokens, hidden_dim, lora_on", [
    pytest.param(29, 36, "none", id="F36-no_lora"),
    pytest.param(29, 36, "both", id="F36-lora_both"),
    pytest.param(29, 56, "none", id="F56-no_lora"),
    pytest.param(29, 56, "both", id="F56-lora_both"),
    pytest.param(29, 300, "both", id="F300-lora_both"),
])  # fmt: skip
def test_moe_mlp_kernel_down_bwd_with_swiglu_pass(kernel_path, guarded, num_tokens, hidden_dim, lora_on):
    case = _make_case(num_tokens, 40, hidden_dim, 5, 2, torch.float32, lora_on=lora_on)
    with kernel_config.forced_config(WIDE_SWIGLU_PASS if hidden_dim > 256 else SWIGLU_PASS):
        _assert_matches_oracle(case, torch.float32)
    guarded.check()


# The gate_up forward with its gate and up columns in one product: F = 36 under 16 columns a half (a partial last
# block, whose masked rows sit in both halves of the tile), F = 56 under 32.
@pytest.mark.parametrize("hidden_dim, block_n", [(36, 16), (56, 32)], ids=["F36-n16", "F56-n32"])
@pytest.mark.parametrize("lora_on", ["none", "both"])
def test_moe_mlp_kernel_gate_up_forward_in_one_product(kernel_path, guarded, hidden_dim, block_n, lora_on):
    case = _make_case(29, 40, hidden_dim, 5, 2, torch.float32, lora_on=lora_on)
    one_dot = kernel_config.KernelConfig(block_n, 16, num_warps=1, num_stages=1, one_dot=True)
    with kernel_config.forced_config(dataclasses.replace(PER_KERNEL_CONFIG, gate_up_fwd=one_dot)):
        _assert_matches_oracle(case, torch.float32)
    guarded.check()


# Every GEMM with tma: the down forward's h and the gate_up backward's dgate_up (rows in expert order) and every
# weight loaded as whole tiles through tensor descriptors; gathered token rows keep pointer loads. Rows past an
# expert's end (another expert's), columns past D or F and K steps past D, F or 2F (zeros, or the next expert's weight
# rows beside zeros) are computed and never stored. D = 40, F = 36 (fp32 rows of 160 and 144 bytes) under tiles that
# leave every one of those parts partial, the gate_up forward in one product or two; 4 experts, so tiles of an
# expert's last rows run into the next one's.
def _tma_config(one_dot: bool, tma: bool = True):
    return dataclasses.replace(
        PER_KERNEL_CONFIG,
        gate_up_fwd=kernel_config.KernelConfig(32, 16, num_warps=1, num_stages=1, one_dot=one_dot, tma=tma),
        down_fwd=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1, tma=tma),
        down_bwd=kernel_config.KernelConfig(16, 32, num_warps=1, num_stages=1, swiglu_pass=True, tma=tma),
        gate_up_bwd=kernel_config.KernelConfig(32, 16, num_warps=1, num_stages=1, tma=tma),
    )


@pytest.fixture
def descriptors_made(monkeypatch) -> list[tuple]:
    """The block shapes of every tensor descriptor the MoE launchers make (row_descriptor's, halves_descriptor's)."""
    made = []
    for module in (kernels_fwd, kernels_bwd):
        for name in ("row_descriptor", "halves_descriptor"):
            if hasattr(module, name):
                make = getattr(kernel_config, name)
                monkeypatch.setattr(module, name, lambda *a, make=make: made.append(a[1:]) or make(*a))
    return made


@pytest.mark.parametrize("one_dot", [True, False], ids=["one_product", "two_products"])
@pytest.mark.parametrize("lora_on", ["none", "both"])
def test_moe_mlp_kernel_tma_loads(kernel_path, guarded, descriptors_made, lora_on, one_dot):
    case = _make_case(29, 40, 36, 4, 2, torch.float32, lora_on=lora_on)
    with kernel_config.forced_config(_tma_config(one_dot)):
        _assert_matches_oracle(case, torch.float32)
    guarded.check()
    # Every kernel took its descriptors: gate_up's weights in [1, 2 or 1, 32, 16] tiles, h and w_down [16, 32] /
    # [16, 32], w_down in the down backward [32, 16], dgate_up and w_gate_up [16, 16] / [16, 32].
    assert sorted(set(descriptors_made)) == sorted({(2 if one_dot else 1, 32, 16), (16, 32), (32, 16), (16, 16)})


@pytest.mark.parametrize(
    "activation_dtype, expected",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float32)],
)
def test_rank_products_of_the_backward_follow_the_activations(activation_dtype, expected):
    # bf16 next to bf16 (bf16 MMAs in the epilogues and dA passes); never fp16, whose range would underflow small
    # gradients. The bf16 path itself is checked on the H200 (tests/gpu/test_moe_gpu.py, bf16 LoRA gradients).
    assert kernel_config.rank_dtype(activation_dtype) == expected


def test_forced_config_is_restored():
    x = torch.zeros(4, 16)
    default = kernel_config.pick_config(x, 8, 4)
    with kernel_config.forced_config(PER_KERNEL_CONFIG):
        assert kernel_config.pick_config(x, 8, 4) is PER_KERNEL_CONFIG
    assert kernel_config.pick_config(x, 8, 4) == default


def test_sweep_candidates_start_with_the_bf16_gpu_choice(monkeypatch):
    # bench.sweep_candidates() promises that the first candidate of each kernel is what pick_config launches for bf16
    # on an sm_90 GPU (the sweep's baseline). A stand-in for a CUDA tensor takes pick_config's GPU branch on this
    # machine; block_p is only read by the weight gradients.
    import dataclasses
    from types import SimpleNamespace

    from moe_tune.engine.bench.moe_op import sweep_candidates

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda_bf16 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0")
    config = kernel_config.pick_config(cuda_bf16, 16384 * 8, 64)
    for name, candidates in sweep_candidates().items():
        chosen = getattr(config, name)
        if name != "expert_grad":
            chosen = dataclasses.replace(chosen, block_p=0)
        assert candidates[0] == chosen, name


@pytest.mark.parametrize("capability, dtype, rows_per_expert, fp8_codes, wide", [
    ((9, 0), torch.bfloat16, 1024, False, True),
    ((9, 0), torch.float16, 128, False, True),
    ((10, 0), torch.bfloat16, 1024, False, True),
    ((8, 0), torch.bfloat16, 1024, False, False),
    ((9, 0), torch.bfloat16, 1024, True, False),
    ((9, 0), torch.bfloat16, 127, False, False),
    ((9, 0), torch.float32, 1024, False, False),
])  # fmt: skip
def test_the_wide_tiles_are_picked_where_they_were_measured(monkeypatch, capability, dtype, rows_per_expert,
                                                             fp8_codes, wide):  # fmt: skip
    # 128 x 256 tiles through TMA (the gate_up forward in one product, the down forward, the gate_up backward and the
    # down backward's GEMM) on sm_90 and later, at 128-row tiles with 16-bit weights; every other kernel's launch the
    # same either way.
    import dataclasses
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    x = SimpleNamespace(is_cuda=True, dtype=dtype, device="cuda:0")
    config = kernel_config.pick_config(x, 64 * rows_per_expert, 64, fp8_codes=fp8_codes)
    wide_fields = dict(gate_up_fwd=kernel_config.SM90_GATE_UP_FWD, down_fwd=kernel_config.SM90_WIDE_TMA,
                       down_bwd=kernel_config.SM90_DOWN_BWD, gate_up_bwd=kernel_config.SM90_WIDE_TMA)  # fmt: skip
    assert all((getattr(config, name) == kernel) == wide for name, kernel in wide_fields.items())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    narrow = kernel_config.pick_config(x, 64 * rows_per_expert, 64, fp8_codes=fp8_codes)
    assert config == (dataclasses.replace(narrow, **wide_fields) if wide else narrow)


def test_moe_mlp_kernel_tma_asked_with_weights_of_another_dtype(kernel_path, guarded, descriptors_made):
    # fp16 experts (frozen) under fp32 activations: the weights are cast as pointer loads bring them in, so a launch
    # asking for tma takes pointer loads and gives what the launch without it gives, bit for bit.
    case = _make_case(29, 40, 48, 4, 2, torch.float32, lora_on="both")
    for name in ("w_gate_up", "w_down"):
        case[name] = case[name].detach().to(torch.float16)
    grad_y = torch.randn(29, 40, generator=torch.Generator().manual_seed(1))
    for one_dot in (True, False):
        with kernel_config.forced_config(_tma_config(one_dot)):
            y, grads = run_with_grads(moe_mlp, case, grad_y)
        with kernel_config.forced_config(_tma_config(one_dot, tma=False)):
            y_plain, grads_plain = run_with_grads(moe_mlp, case, grad_y)
        assert torch.equal(y, y_plain) and set(grads) == set(grads_plain)
        assert all(torch.equal(grads[name], grads_plain[name]) for name in grads)
    assert descriptors_made == []
    guarded.check()


def _operand(kind: str) -> torch.Tensor:
    base = torch.zeros(4, 3, 80, dtype=torch.bfloat16)
    return {
        "bf16": base[..., :64],  # rows of 128 bytes, but not contiguous
        "bf16_contiguous": base[..., :64].contiguous(),
        "fp16": torch.zeros(4, 3, 64, dtype=torch.float16),
        "fp32_rows_of_36": torch.zeros(4, 36),  # 144-byte rows
        "bf16_rows_of_36": torch.zeros(4, 36, dtype=torch.bfloat16),  # 72-byte rows
        "offset_8_bytes": torch.zeros(4 * 64 + 4, dtype=torch.bfloat16)[4:].view(4, 64),
        "transposed": torch.zeros(64, 4, dtype=torch.bfloat16).t(),
        "fp8": torch.zeros(4, 64).to(torch.float8_e4m3fn),
    }[kind]


@pytest.mark.parametrize("dtype, kinds, loads", [
    (torch.bfloat16, ("bf16_contiguous", "bf16_contiguous"), True),
    (torch.float16, ("fp16",), True),
    (torch.float32, ("fp32_rows_of_36",), True),
    (torch.bfloat16, ("bf16",), False),
    (torch.bfloat16, ("bf16_contiguous", "bf16_rows_of_36"), False),
    (torch.bfloat16, ("offset_8_bytes",), False),
    (torch.bfloat16, ("transposed",), False),
    (torch.bfloat16, ("fp8",), False),
    (torch.bfloat16, ("bf16_contiguous", "fp16"), False),  # a weight of another dtype than the activations
    (torch.bfloat16, ("fp32_rows_of_36",), False),
])  # fmt: skip
def test_which_operands_load_through_tma(dtype, kinds, loads):
    # A descriptor of rows needs them contiguous, 16-byte aligned at the base and a multiple of 16 bytes long, in the
    # 16-bit or fp32 dtype of the tiles they meet in the product; every operand of the launch must allow it, and the
    # launch must ask for it.
    operands = [_operand(kind) for kind in kinds]
    asked = kernel_config.KernelConfig(64, 64, num_warps=8, num_stages=3, tma=True)
    assert kernel_config.tma_loads(asked, dtype, *operands) is loads
    assert kernel_config.tma_loads(dataclasses.replace(asked, tma=False), dtype, *operands) is False


def test_tma_loads_need_sm90_on_a_gpu(monkeypatch):
    from types import SimpleNamespace

    operand = SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.bfloat16, shape=(4, 64),
                              is_contiguous=lambda: True, data_ptr=lambda: 1 << 20, element_size=lambda: 2)  # fmt: skip
    asked = kernel_config.KernelConfig(64, 64, num_warps=8, num_stages=3, tma=True)
    for capability, loads in [((8, 9), False), ((9, 0), True), ((10, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernel_config.tma_loads(asked, torch.bfloat16, operand) is loads


def test_moe_mlp_kernel_strided_inputs_and_expanded_grad(kernel_path, guarded):
    # x a column slice, w_down transposed in memory, topk ids int32, and y.sum() giving a stride-0 dy.
    case = _make_case(13, 24, 20, 7, 3, torch.float32, lora_on="both")
    wide = torch.randn(13, 40, generator=torch.Generator().manual_seed(2))
    case["x"] = wide[:, 8:32].requires_grad_()
    case["w_down"] = case["w_down"].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    case["topk_ids"] = case["topk_ids"].to(torch.int32)
    assert not case["x"].is_contiguous() and not case["w_down"].is_contiguous()
    _assert_matches_oracle(case, torch.float32, grad_y=torch.ones(13, 24).expand(13, 24))
    guarded.check()


@pytest.mark.parametrize("lora_on", [pytest.param("none", id="no_lora"), pytest.param("both", id="lora_both")])
def test_moe_mlp_kernel_no_tokens(kernel_path, lora_on):
    # N = 0: empty row grids; y is empty and every weight gradient is zero (the per-expert LoRA passes still write
    # their zero dB and dA).
    case = _make_case(0, 16, 32, 4, 2, torch.float32, lora_on=lora_on)
    y, grads = run_with_grads(moe_mlp, case, torch.zeros(0, 16))
    assert y.shape == (0, 16)
    assert all(bool((grad == 0).all()) for grad in grads.values())


def test_moe_mlp_kernel_is_deterministic(kernel_path):
    # No atomics anywhere: two runs agree bit for bit.
    case = _make_case(13, 24, 20, 7, 3, torch.float32, lora_on="both")
    grad_y = torch.randn(13, 24, generator=torch.Generator().manual_seed(1))
    y1, grads1 = run_with_grads(moe_mlp, case, grad_y)
    y2, grads2 = run_with_grads(moe_mlp, case, grad_y)
    assert torch.equal(y1, y2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name


# (N, D, k): D above one column block and not a multiple of it, a token block with a partial last one, one token,
# one column, k = 1 (the slots are the output), odd k.
SUM_SLOTS_SHAPES = [(37, 1030, 3), (5, 24, 8), (1, 1, 2), (300, 7, 5), (9, 64, 1), (0, 16, 4)]


@pytest.mark.parametrize("num_tokens, model_dim, top_k", SUM_SLOTS_SHAPES)
# fp32 and fp16: the interpreter rounds fp32 to bf16 toward zero (bf16 runs on the GPU, tests/gpu/test_moe_gpu.py).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_addends", [0, 1, 2], ids=["slots", "addend", "two_addends"])
def test_sum_slots_adds_each_tokens_slots_in_slot_order(guarded, num_tokens, model_dim, top_k, dtype, num_addends):
    # Against the addends (in order) and then the slots added one by one in fp32 (slot 0 first) and rounded once:
    # equal bit for bit; every output written (NaN-filled buffers) and nothing past the end; the inputs unchanged.
    gen = torch.Generator().manual_seed(num_tokens * 131 + model_dim)
    per_slot = (torch.randn(num_tokens * top_k, model_dim, generator=gen) * 4).to(dtype)
    addends = [(torch.randn(num_tokens, model_dim, generator=gen) * 4).to(dtype) for _ in range(num_addends)]
    inputs = [t.clone() for t in (per_slot, *addends)]
    y = routing_kernels.sum_slots(per_slot, num_tokens, top_k, addends)
    expected = torch.zeros(num_tokens, model_dim)
    for t in (*addends, *(per_slot[j::top_k] for j in range(top_k))):
        expected += t.float()
    assert y.dtype == dtype and y.shape == (num_tokens, model_dim)
    assert torch.equal(y, expected.to(dtype))
    assert all(torch.equal(t, before) for t, before in zip((per_slot, *addends), inputs))
    if (top_k > 1 or num_addends) and num_tokens > 0:
        guarded.check()


@pytest.mark.parametrize("block_m", [pytest.param(16, id="block16"), pytest.param(4, id="block4")])
def test_moe_routing_metadata(block_m):
    num_experts, top_k = 7, 3
    gen = torch.Generator().manual_seed(0)
    # Skewed: experts 0 and 6 empty, expert 3 takes most slots.
    topk_ids = torch.tensor([1, 2, 3, 3, 3, 4, 5, 3, 3])[torch.randint(0, 9, (29, top_k), generator=gen)]
    routing = routing_kernels.moe_routing(topk_ids, num_experts, block_m)
    ids_S = topk_ids.reshape(-1)
    slot_of_row = routing.slot_of_row_S.long()

    assert torch.equal(slot_of_row.sort().values, torch.arange(ids_S.numel()))
    assert torch.equal(ids_S[slot_of_row], ids_S.sort(stable=True).values)
    assert torch.equal(routing.token_of_row_S.long(), slot_of_row // top_k)
    counts_E = torch.bincount(ids_S, minlength=num_experts)
    assert torch.equal(routing.offsets_E1.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts_E.cumsum(0)]))
    # Stable: an expert's rows keep increasing slot order.
    for e in range(num_experts):
        rows = slot_of_row[routing.offsets_E1[e] : routing.offsets_E1[e + 1]]
        assert torch.equal(rows, rows.sort().values)

    # The tile map covers every row of every expert exactly once, tiles never cross an expert boundary, and the
    # worst-case grid holds the rest as no-work tiles (-1).
    covered = torch.zeros(ids_S.numel(), dtype=torch.long)
    num_busy_tiles = 0
    for expert, first_row in zip(routing.tile_expert_T.tolist(), routing.tile_row_T.tolist()):
        if expert < 0:
            continue
        num_busy_tiles += 1
        end = min(first_row + block_m, int(routing.offsets_E1[expert + 1]))
        assert int(routing.offsets_E1[expert]) <= first_row < end
        covered[first_row:end] += 1
    assert bool((covered == 1).all())
    assert num_busy_tiles == int(((counts_E + block_m - 1) // block_m).sum())
    # Each expert's tiles are one consecutive range of the tile map, in expert order.
    tiles_E = (counts_E + block_m - 1) // block_m
    tile_end_E = tiles_E.cumsum(0)
    for e in range(num_experts):
        begin, end = int(tile_end_E[e] - tiles_E[e]), int(tile_end_E[e])
        assert bool((routing.tile_expert_T[begin:end] == e).all())
    assert routing.num_tiles == routing_kernels.max_tiles(ids_S.numel(), num_experts, block_m) >= num_busy_tiles
    busy = routing.tile_expert_T >= 0
    # Busy tiles come first, so a grid larger than the work only adds programs that exit at once.
    assert bool(busy[: num_busy_tiles].all()) and not bool(busy[num_busy_tiles:].any())


def test_row_chunks_cover_each_experts_rows():
    # Skewed as above, 87 slots over 7 experts (mean 13 rows): chunks of 2 x 13 rows rounded up to the 16-row
    # reduction step = 32; expert 3 (51 rows) spans two chunks, experts 0 and 6 own none.
    num_experts, top_k = 7, 3
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.tensor([1, 2, 3, 3, 3, 4, 5, 3, 3])[torch.randint(0, 9, (29, top_k), generator=gen)]
    config = kernel_config.pick_config(torch.zeros(1), topk_ids.numel(), num_experts)
    routing = routing_kernels.moe_routing(topk_ids, num_experts, config.block_m)
    chunks = routing_kernels.row_chunks(routing, config)
    assert chunks.chunk_rows == 32
    offsets = routing.offsets_E1.tolist()
    first = chunks.first_chunk_E1.tolist()
    covered = torch.zeros(topk_ids.numel(), dtype=torch.long)
    for chunk, (expert, row) in enumerate(zip(chunks.chunk_expert_C.tolist(), chunks.chunk_row_C.tolist())):
        if expert < 0:
            assert chunk >= first[-1]
            continue
        assert first[expert] <= chunk < first[expert + 1]
        end = min(row + chunks.chunk_rows, offsets[expert + 1])
        assert offsets[expert] <= row < end
        covered[row:end] += 1
    assert bool((covered == 1).all())
    counts = [offsets[e + 1] - offsets[e] for e in range(num_experts)]
    assert [first[e + 1] - first[e] for e in range(num_experts)] == [-(-c // 32) for c in counts]
    assert max(counts) > chunks.chunk_rows and counts[0] == counts[6] == 0
    assert chunks.num_chunks == routing_kernels.max_tiles(topk_ids.numel(), num_experts, chunks.chunk_rows)


def test_max_tiles_is_an_upper_bound():
    # Worst case: every non-empty expert holds one row more than a multiple of the tile.
    block_m, num_experts = 16, 5
    counts = [block_m + 1] * num_experts
    assert sum(-(-c // block_m) for c in counts) <= routing_kernels.max_tiles(sum(counts), num_experts, block_m)
    assert routing_kernels.max_tiles(3, 64, block_m) == 3
    assert routing_kernels.max_tiles(0, 8, block_m) == 0


# Rows per expert for the routing-metadata kernels against their torch versions: (counts_E, k).
ROUTING_COUNTS = {
    # Prime E = 7, experts 0, 3 and 6 empty (the first and the last too), 56 rows.
    "first_and_last_empty_E7": ([0, 5, 17, 0, 33, 1, 0], 2),
    # Every row on one expert: it owns every busy tile (10 steps of the tile loop at block 16 and step 2).
    "one_expert_takes_all": ([0, 0, 0, 300, 0, 0, 0, 0], 3),
    # Prime E = 61, every fifth expert empty, 240 rows: a block of 64 expert lanes per program.
    "prime_E61": ([(7 * e) % 10 if e % 5 else 0 for e in range(61)], 3),
    "E1": ([77], 1),
    # N = 0: no slots, no tiles; every offset and first tile is 0.
    "no_slots": ([0, 0, 0, 0], 2),
    # Counts that are whole multiples of the 16- and 64-row blocks: no partial tile at those sizes.
    "whole_tiles": ([64, 128, 0, 192], 2),
}
# Every count pattern at every tile size, but prime_E61 (the many expert lanes, slow in the interpreter) at 16 rows
# only, its most tiles: the tile sizes' own cases (partial and whole tiles, several steps a program) are the others'.
ROUTING_CASES = [
    pytest.param(counts_E, top_k, block, id=f"{name}-block{block}")
    for name, (counts_E, top_k) in ROUTING_COUNTS.items()
    for block in (16, 64, 128)
    if name != "prime_E61" or block == 16
]


def _offsets(counts_E: list[int]) -> torch.Tensor:
    """[E+1] int64 row offsets of experts with these row counts."""
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(counts_E, dtype=torch.long).cumsum(0)])


def _topk_ids(counts_E: list[int], top_k: int) -> torch.Tensor:
    """[N, k] int64 ids, shuffled, with counts_E[e] slots on expert e."""
    ids_S = torch.repeat_interleave(torch.arange(len(counts_E)), torch.tensor(counts_E))
    ids_S = ids_S[torch.randperm(ids_S.numel(), generator=torch.Generator().manual_seed(0))]
    return ids_S.view(-1, top_k)


def _assert_equal_int32(got: tuple, expected: tuple, names: tuple[str, ...]) -> None:
    for name, tensor, reference in zip(names, got, expected, strict=True):
        assert tensor.dtype == torch.int32, name
        assert torch.equal(tensor, reference), f"{name}: {tensor.tolist()} != {reference.tolist()}"


@pytest.mark.parametrize("counts_E, top_k, block", ROUTING_CASES)
@pytest.mark.parametrize(
    "tile_step",
    [
        pytest.param(routing_kernels.TILE_MAP_STEP, id="step_default"),
        # Two tiles a step: every expert with more than two tiles, and the no-work tail, loop several times.
        pytest.param(2, id="step2"),
    ],
)
def test_tile_map_kernel_matches_torch(kernel_path, guarded, monkeypatch, counts_E, top_k, block, tile_step):
    monkeypatch.setattr(routing_kernels, "TILE_MAP_STEP", tile_step)
    offsets_E1 = _offsets(counts_E)
    num_slots = sum(counts_E)
    expected = routing_kernels._tile_map_torch(offsets_E1, num_slots, block)
    # int32 offsets as row_chunks passes them (MoERouting's), int64 as the torch version takes them.
    for offsets in (offsets_E1.to(torch.int32), offsets_E1):
        got = routing_kernels._tile_map(offsets, num_slots, block)
        _assert_equal_int32(got, expected, ("tile_expert", "tile_row", "first_tile"))
    assert got[0].shape == (routing_kernels.max_tiles(num_slots, len(counts_E), block),)
    guarded.check()


@pytest.mark.parametrize("counts_E, top_k, block", ROUTING_CASES)
@pytest.mark.parametrize(
    "block_s",
    [
        pytest.param(routing_kernels.ROUTING_BLOCK_S, id="slots_default"),
        # 16 slots a program: more programs than E+1 (up to 19), the ones past E only cast their slots.
        pytest.param(16, id="slots16"),
    ],
)
def test_moe_routing_kernel_matches_torch(kernel_path, guarded, monkeypatch, counts_E, top_k, block, block_s):
    monkeypatch.setattr(routing_kernels, "ROUTING_BLOCK_S", block_s)
    monkeypatch.setattr(routing_kernels, "TILE_MAP_STEP", 4)
    topk_ids = _topk_ids(counts_E, top_k)
    num_experts = len(counts_E)
    sorted_ids_S, sort_index_S = torch.sort(topk_ids.reshape(-1), stable=True)
    expected = routing_kernels._routing_metadata_torch(sorted_ids_S, sort_index_S, num_experts, top_k, block)
    names = ("slot_of_row", "token_of_row", "offsets", "tile_expert", "tile_row")
    # int32 ids are sorted as given (no cast): the same rows as int64 ids.
    for ids_dtype in (torch.int64, torch.int32):
        routing = routing_kernels.moe_routing(topk_ids.to(ids_dtype), num_experts, block)
        _assert_equal_int32(routing.tensors(), expected, names)
    guarded.check()


@pytest.mark.parametrize("num_experts, key_dtype", [(7, torch.uint8), (255, torch.uint8), (256, torch.int16),
                                                     (32767, torch.int16), (32768, torch.int32)])
def test_routing_sorts_the_narrowest_key_that_holds_e(num_experts, key_dtype):
    # One radix pass per key byte: every id and E itself (the last row-range search looks for E) must fit the key.
    assert routing_kernels.sort_key_dtype(num_experts) == key_dtype
    assert torch.iinfo(key_dtype).max >= num_experts


@pytest.mark.parametrize("num_experts", [255, 256], ids=["E255_uint8_keys", "E256_int16_keys"])
def test_moe_routing_on_narrowed_keys_matches_int64_ids(kernel_path, guarded, num_experts):
    # The ids sorted as uint8 (E <= 255) or int16 keys give the metadata of the stable int64 sort, at the largest E of
    # each key dtype and the first past it; the largest id and experts with no slot among them.
    top_k = 4
    gen = torch.Generator().manual_seed(num_experts)
    topk_ids = torch.randint(0, num_experts, (61, top_k), generator=gen)
    topk_ids[0, 0] = num_experts - 1
    sorted_ids_S, sort_index_S = torch.sort(topk_ids.reshape(-1), stable=True)
    expected = routing_kernels._routing_metadata_torch(sorted_ids_S, sort_index_S, num_experts, top_k, 16)
    routing = routing_kernels.moe_routing(topk_ids, num_experts, 16)
    _assert_equal_int32(routing.tensors(), expected, ("slot_of_row", "token_of_row", "offsets", "tile_expert",
                                                      "tile_row"))  # fmt: skip
    guarded.check()


class _NoLaunch:
    """Stands in for a kernel that must not launch."""

    def __getitem__(self, grid):
        raise AssertionError("a routing kernel ran on CPU tensors without the interpreter")


def test_routing_metadata_takes_torch_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(routing_kernels, "_moe_routing_kernel", _NoLaunch())
    monkeypatch.setattr(routing_kernels, "_moe_tile_map_kernel", _NoLaunch())
    counts_E, top_k = ROUTING_COUNTS["first_and_last_empty_E7"]
    topk_ids = _topk_ids(counts_E, top_k)
    config = kernel_config.pick_config(torch.zeros(1), topk_ids.numel(), len(counts_E))
    routing = routing_kernels.moe_routing(topk_ids, len(counts_E), config.block_m)
    chunks = routing_kernels.row_chunks(routing, config)
    assert torch.equal(routing.offsets_E1.long(), _offsets(counts_E))
    expected = routing_kernels._tile_map_torch(_offsets(counts_E), topk_ids.numel(), chunks.chunk_rows)
    got = (chunks.chunk_expert_C, chunks.chunk_row_C, chunks.first_chunk_E1)
    _assert_equal_int32(got, expected, ("chunk_expert", "chunk_row", "first_chunk"))


def _spy_kernel(monkeypatch) -> list:
    calls = []
    apply = MoEFunction.apply

    def spy(*args):
        calls.append(args[0].dtype)
        return apply(*args)

    monkeypatch.setattr(MoEFunction, "apply", spy)
    return calls


def test_auto_takes_the_kernel_only_on_cuda(monkeypatch):
    # auto means "kernel on CUDA, reference elsewhere": on CPU tensors it takes the reference even when the
    # interpreter could run the kernel (only an explicit MOE_TUNE_KERNELS=triton does that).
    calls = _spy_kernel(monkeypatch)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "auto")
    case = _make_case(5, 16, 16, 4, 2, torch.float32)
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        moe_mlp(**case)
    assert calls == []
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe_mlp(**case)
    assert calls == [torch.float32]


@pytest.mark.parametrize(
    "dtype, interpret, message",
    [
        pytest.param(torch.float64, "1", "moe_mlp has no Triton kernel for these inputs", id="fp64"),
        pytest.param(torch.bfloat16, "1", "moe_mlp has no Triton kernel for these inputs", id="bf16_interpreter"),
        pytest.param(torch.float32, "0", "moe_mlp got CPU tensors", id="cpu_without_interpreter"),
    ],
)
def test_forced_kernel_raises_when_it_cannot_run(monkeypatch, dtype, interpret, message):
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(RuntimeError, match=message):
        moe_mlp(**_make_case(5, 16, 16, 4, 2, dtype))
