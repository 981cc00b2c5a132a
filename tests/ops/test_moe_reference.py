"""moe ops: grouped reference vs per-token oracle (forward and every gradient), LoRA merge, routing, aux loss, errors.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_tune.ops.moe import ExpertLoRA, moe_mlp, switch_aux_loss, topk_route
from moe_tune.ops.moe.reference import SIGMOID_NORM_EPS, moe_mlp_loop_ref
from moe_cases import make_case, run_with_grads

# One table per dtype. fp64 runs in fp64 end to end; fp32 differs from the oracle only by summation order; bf16
# inputs compute in fp32 on both paths, so outputs differ by at most a rounding step of the bf16 result.
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [
    pytest.param(torch.float64, id="fp64"),
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]
RANK = 4
LORA_SCALING = 0.5


def _make_case(*args, **kwargs) -> dict:
    return make_case(*args, rank=RANK, scaling=LORA_SCALING, **kwargs)


CASES = [
    pytest.param(16, 16, 32, 8, 2, "random", id="N16_E8_k2"),
    pytest.param(12, 16, 32, 8, 2, "two_experts_only", id="empty_experts"),
    pytest.param(10, 16, 32, 8, 1, "all_to_last", id="one_expert_takes_all"),
    # k = 1: the combine is a plain scaled scatter, one slot per token.
    pytest.param(9, 16, 32, 8, 1, "random", id="top1"),
    # k = E: every token visits every expert, each expert range holds all N tokens.
    pytest.param(6, 16, 32, 4, 4, "random", id="topk_equals_E"),
    # Prime E: no power-of-two assumption in counts or offsets.
    pytest.param(11, 16, 32, 7, 3, "random", id="prime_E7"),
    # N = 1: a single token, k rows in total.
    pytest.param(1, 16, 32, 8, 2, "random", id="N1"),
    # D and F not powers of two and D > F.
    pytest.param(8, 24, 12, 5, 2, "random", id="D24_F12"),
]
LORA_ON = [
    pytest.param("none", id="no_lora"),
    pytest.param("both", id="lora_both"),
    # LoRA on one projection only: the other projection must run plain.
    pytest.param("gate_up", id="lora_gate_up_only"),
    pytest.param("down", id="lora_down_only"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lora_on", LORA_ON)
@pytest.mark.parametrize("num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern", CASES)
def test_moe_mlp_matches_loop_ref(num_tokens, model_dim, hidden_dim, num_experts, top_k, pattern, lora_on, dtype):
    case = _make_case(num_tokens, model_dim, hidden_dim, num_experts, top_k, dtype, pattern, lora_on)
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


def test_moe_mlp_accepts_int32_ids():
    case = _make_case(8, 16, 32, 8, 2, torch.float64, ids_dtype=torch.int32)
    case64 = dict(case, topk_ids=case["topk_ids"].long())
    torch.testing.assert_close(moe_mlp(**case), moe_mlp_loop_ref(**case64), **TOLERANCES[torch.float64])


@pytest.mark.parametrize("lora_on", ["both", "gate_up", "down"])
def test_lora_equals_merged_weights(lora_on):
    dtype = torch.float64
    case = _make_case(12, 16, 32, 6, 2, dtype, lora_on=lora_on)
    lora = case["lora"]
    w_gate_up, w_down = case["w_gate_up"].detach(), case["w_down"].detach()
    if lora.a_gate_up is not None:
        w_gate_up = w_gate_up + lora.scaling * torch.bmm(lora.b_gate_up, lora.a_gate_up).detach()
    if lora.a_down is not None:
        w_down = w_down + lora.scaling * torch.bmm(lora.b_down, lora.a_down).detach()
    merged = dict(case, w_gate_up=w_gate_up, w_down=w_down, lora=None)

    y_lora = moe_mlp(**case)
    y_merged = moe_mlp(**merged)
    y_plain = moe_mlp(**dict(case, lora=None))

    torch.testing.assert_close(y_lora, y_merged, **TOLERANCES[dtype])
    # Guards the comparison itself: the adapter must change the output.
    assert (y_lora - y_plain).abs().max() > 1e-3


def test_moe_mlp_matches_transformers_experts():
    # Pins the fused layout (gate rows first, then up) to the implementation the models ship with.
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    case = _make_case(10, 16, 32, 8, 2, torch.float64)
    config = MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    experts = modeling.MixtralExperts(config).to(torch.float64)
    with torch.no_grad():
        experts.gate_up_proj.copy_(case["w_gate_up"])
        experts.down_proj.copy_(case["w_down"])
        y_hf = experts(case["x"], case["topk_ids"], case["topk_weights"])
        y = moe_mlp(**case)
    torch.testing.assert_close(y, y_hf, **TOLERANCES[torch.float64])


def test_moe_mlp_dispatch_raises_when_triton_is_forced(monkeypatch):
    case = _make_case(4, 16, 32, 8, 2, torch.float32)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    # CPU tensors without the Triton interpreter: an explicit request for the kernel cannot run and must say so.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="moe_mlp got CPU tensors"):
        moe_mlp(**case)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "reference")
    assert moe_mlp(**case).shape == (4, 16)


def test_topk_route_softmax_renormalized():
    # softmax(log p) = p for p summing to 1.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.2, 0.3]]).log()
    ids, weights, scores = topk_route(logits, top_k=2)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and scores.dtype == torch.float32
    torch.testing.assert_close(scores, logits.exp())
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(weights, torch.tensor([[4 / 7, 3 / 7], [4 / 7, 3 / 7]]))

    _, raw_weights, _ = topk_route(logits, top_k=2, renormalize=False)
    torch.testing.assert_close(raw_weights, torch.tensor([[0.4, 0.3], [0.4, 0.3]]))


def test_topk_route_sigmoid_renormalized_and_scaled():
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4.
    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0)]])
    ids, weights, scores = topk_route(logits, top_k=2, score_func="sigmoid", routed_scaling=2.5)
    torch.testing.assert_close(scores, torch.tensor([[0.5, 0.75, 0.25]]))
    assert ids.tolist() == [[1, 0]]
    # [0.75, 0.5] / 1.25 * 2.5
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0]]))

    _, raw_weights, _ = topk_route(logits, top_k=2, score_func="sigmoid", renormalize=False, routed_scaling=2.0)
    torch.testing.assert_close(raw_weights, torch.tensor([[1.5, 1.0]]))


def test_topk_route_selection_bias_changes_choice_not_weights():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().requires_grad_()
    bias = torch.tensor([0.25, 0.0, 0.0, 0.0])
    ids_plain, _, _ = topk_route(logits, top_k=2)
    ids, weights, scores = topk_route(logits, top_k=2, selection_bias=bias)
    assert ids_plain.tolist() == [[3, 2]]
    # Biased choice scores [0.35, 0.2, 0.3, 0.4] pick expert 0 over expert 2.
    assert ids.tolist() == [[3, 0]]
    # The weights are the unbiased scores 0.4 and 0.1, renormalised.
    torch.testing.assert_close(weights, torch.tensor([[0.8, 0.2]]))
    torch.testing.assert_close(scores, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))


def test_topk_route_weights_gradient():
    # Renormalised softmax over the chosen experts is the softmax of the chosen logits; the gradients must agree.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, generator=gen).requires_grad_()
    grad_w = torch.randn(5, 3, generator=gen)
    ids, weights, _ = topk_route(logits, top_k=3)
    (grad_logits,) = torch.autograd.grad(weights, logits, grad_w)

    logits_ref = logits.detach().clone().requires_grad_()
    weights_ref = logits_ref.gather(-1, ids).softmax(dim=-1)
    (grad_logits_ref,) = torch.autograd.grad(weights_ref, logits_ref, grad_w)
    torch.testing.assert_close(weights, weights_ref)
    torch.testing.assert_close(grad_logits, grad_logits_ref)


def _brute_force_group_limited(choice_E: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> set[int]:
    """The top_k experts of one token by enumeration: the topk_group groups whose two best scores sum highest,
    then the best top_k experts inside them."""
    size = len(choice_E) // n_group
    group_score = [sorted(choice_E[g * size : (g + 1) * size].tolist())[-2:] for g in range(n_group)]
    best_groups = max(
        itertools.combinations(range(n_group), topk_group), key=lambda gs: sum(sum(group_score[g]) for g in gs)
    )
    allowed = [e for g in best_groups for e in range(g * size, (g + 1) * size)]
    best = max(itertools.combinations(allowed, top_k), key=lambda es: sum(choice_E[e].item() for e in es))
    return set(best)


@pytest.mark.parametrize(
    "num_experts, top_k, n_group, topk_group",
    [
        (8, 2, 4, 2),
        (21, 3, 7, 2),  # groups of 3, an odd group count
        (12, 4, 3, 1),  # all k experts from one group
        (6, 2, 6, 3),  # groups of one expert: the group score is that expert's score
        (8, 3, 4, 4),  # every group kept: the plain top-k
    ],
    ids=["e8", "e21_odd_groups", "one_group_kept", "groups_of_one", "all_groups"],
)
def test_topk_route_group_limited_matches_brute_force(num_experts, top_k, n_group, topk_group):
    gen = torch.Generator().manual_seed(num_experts * 7 + top_k)
    logits = torch.randn(40, num_experts, generator=gen, dtype=torch.float64) * 3
    bias = torch.randn(num_experts, generator=gen, dtype=torch.float64) * 0.5
    ids, weights, scores = topk_route(
        logits, top_k, "sigmoid", selection_bias=bias, routed_scaling=2.5, n_group=n_group, topk_group=topk_group
    )
    choice = scores + bias
    for t in range(logits.shape[0]):
        assert set(ids[t].tolist()) == _brute_force_group_limited(choice[t], top_k, n_group, topk_group), f"token {t}"
    expected = scores.gather(-1, ids)
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True))
    if topk_group < n_group and num_experts > n_group:
        # Guards the test: the group limit must change some token's choice (groups of one never do).
        plain_ids, _, _ = topk_route(logits, top_k, score_func="sigmoid", selection_bias=bias)
        assert (ids.sort(-1).values != plain_ids.sort(-1).values).any()


def test_topk_route_group_limited_matches_transformers_router():
    # DeepSeek-V3's router (sigmoid, correction bias, groups ranked by their two best scores, renormalised, scaled).
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    router = modeling.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 16, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(12, generator=gen) * 0.5)
    x = torch.randn(30, 16, generator=gen)
    logits_hf, weights_hf, ids_hf = router(x)
    ids, weights, _ = topk_route(
        logits_hf, 3, score_func="sigmoid", selection_bias=router.e_score_correction_bias, routed_scaling=2.5,
        n_group=4, topk_group=2,
    )
    # transformers picks unsorted; compare the sets with their weights.
    order_hf, order = ids_hf.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids_hf.gather(-1, order_hf), ids.gather(-1, order))
    torch.testing.assert_close(weights.gather(-1, order), weights_hf.gather(-1, order_hf))


def test_switch_aux_loss_uniform_is_one():
    num_experts = 4
    scores = torch.full((8, num_experts), 1 / num_experts)
    ids = torch.arange(8 * 2).reshape(8, 2) % num_experts
    assert switch_aux_loss(scores, ids, num_experts).item() == 1.0
    # Balanced counts give 1 whatever the scores, since the mean scores sum to 1.
    uneven_scores = torch.randn(8, num_experts, generator=torch.Generator().manual_seed(0)).softmax(dim=-1)
    torch.testing.assert_close(switch_aux_loss(uneven_scores, ids, num_experts), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_experts, num_tokens, k", [(8, 37, 2), (64, 5, 8), (3, 1, 1)])  # some experts unused
def test_switch_aux_loss_counts_every_slot_as_the_formula_says(dtype, num_experts, num_tokens, k):
    gen = torch.Generator().manual_seed(num_experts)
    scores = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, num_experts, (num_tokens, k), generator=gen).to(dtype)
    counts = torch.tensor([(ids == e).sum().item() for e in range(num_experts)], dtype=torch.float64)
    probs = scores / (scores.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    expected = num_experts * ((counts / ids.numel()) * probs.mean(dim=0)).sum()
    torch.testing.assert_close(switch_aux_loss(scores, ids, num_experts).double(), expected, rtol=1e-6, atol=0)


def test_switch_aux_loss_skewed_is_larger():
    num_experts = 4
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(6, 1)
    ids = torch.zeros(6, 1, dtype=torch.int64)
    # f = [1, 0, 0, 0], P_0 = 0.7: 4 * 0.7
    torch.testing.assert_close(switch_aux_loss(scores, ids, num_experts), torch.tensor(2.8))


def test_switch_aux_loss_hand_computed():
    num_experts = 3
    scores = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]], requires_grad=True)
    ids = torch.tensor([[0, 1], [2, 0]])
    loss = switch_aux_loss(scores, ids, num_experts)
    # f = [2, 1, 1] / 4, P = [0.35, 0.25, 0.4]: 3 * (0.175 + 0.0625 + 0.1)
    torch.testing.assert_close(loss, torch.tensor(1.0125))
    # Rows sum to 1, so dL/ds[t, j] = E / N * (f_j - f . s_t).
    (grad,) = torch.autograd.grad(loss, scores)
    f = torch.tensor([0.5, 0.25, 0.25])
    expected = num_experts / 2 * (f[None, :] - (scores.detach() @ f)[:, None])
    torch.testing.assert_close(grad, expected)


def test_switch_aux_loss_normalizes_sigmoid_scores():
    num_experts = 3
    # Row sums 1.6 and 1.0; normalised rows [0.5, 0.25, 0.25] and [0.1, 0.3, 0.6].
    scores = torch.tensor([[0.8, 0.4, 0.4], [0.1, 0.3, 0.6]])
    ids = torch.tensor([[0, 1], [2, 0]])
    # f = [0.5, 0.25, 0.25], P = [0.3, 0.275, 0.425]: 3 * (0.15 + 0.06875 + 0.10625)
    torch.testing.assert_close(switch_aux_loss(scores, ids, num_experts), torch.tensor(0.975))


def _replace(case: dict, **changes) -> dict:
    return dict(case, **changes)


def _bad_moe_inputs():
    case = _make_case(5, 16, 32, 8, 2, torch.float32)
    E, D, F = 8, 16, 32
    return [
        pytest.param(
            _replace(case, topk_weights=torch.rand(5, 3)),
            r"topk_ids: shape \(5, 2\) must match topk_weights \(5, 3\)",
            id="ids_weights_shape",
        ),
        pytest.param(
            _replace(case, topk_ids=torch.zeros(6, 2, dtype=torch.int64), topk_weights=torch.rand(6, 2)),
            r"topk_ids: shape \(6, 2\) must be \[N, k\] with N = 5 to match x",
            id="ids_rows",
        ),
        pytest.param(
            _replace(case, topk_ids=case["topk_ids"].float()),
            r"topk_ids: dtype torch.float32 must be int64 or int32",
            id="ids_dtype",
        ),
        pytest.param(
            _replace(case, x=torch.randn(5, 16, 1)),
            r"x: shape \(5, 16, 1\) dtype torch.float32 must be a float \[N, D\]",
            id="x_rank",
        ),
        pytest.param(
            _replace(case, w_gate_up=torch.randn(E, 2 * F - 1, D)),
            r"w_gate_up: shape \(8, 63, 16\) must be \[E, 2F, D\] with an even 2F and D = 16 to match x",
            id="gate_up_odd",
        ),
        pytest.param(
            _replace(case, w_gate_up=torch.randn(E, 2 * F, D + 1)),
            r"w_gate_up: shape \(8, 64, 17\) must be \[E, 2F, D\]",
            id="gate_up_D",
        ),
        pytest.param(
            _replace(case, w_down=torch.randn(E, D, F - 2)),
            r"w_down: shape \(8, 16, 30\) must be \[E, D, F\] = \[8, 16, 32\] to match w_gate_up",
            id="down_F",
        ),
        pytest.param(
            _replace(case, w_down=torch.randn(E - 1, D, F)),
            r"w_down: shape \(7, 16, 32\) must be \[E, D, F\] = \[8, 16, 32\]",
            id="down_E",
        ),
        pytest.param(
            _replace(case, topk_ids=torch.full((5, 2), E)),
            r"topk_ids: values must be in \[0, E\) = \[0, 8\), found min 8 max 8",
            id="ids_too_large",
        ),
        pytest.param(
            _replace(case, topk_ids=torch.full((5, 2), -1)),
            r"topk_ids: values must be in \[0, E\) = \[0, 8\)",
            id="ids_negative",
        ),
        pytest.param(
            _replace(case, add_to=torch.randn(5, D + 1)),
            r"add_to: shape \(5, 17\) dtype torch.float32 on cpu must match x \(\[5, 16\] torch.float32 on cpu\)",
            id="add_to_shape",
        ),
        pytest.param(
            _replace(case, add_to=torch.randn(5, D, dtype=torch.float64)),
            r"add_to: shape \(5, 16\) dtype torch.float64 on cpu must match x",
            id="add_to_dtype",
        ),
        pytest.param(
            _replace(case, add_to=(torch.randn(5, D), torch.randn(4, D))),
            r"add_to\[1\]: shape \(4, 16\) dtype torch.float32 on cpu must match x \(\[5, 16\] torch.float32 on cpu\)",
            id="add_to_second_shape",
        ),
        pytest.param(
            _replace(case, add_to=(torch.randn(5, D), None)),
            r"add_to\[1\]: None must match x",
            id="add_to_second_none",
        ),
        pytest.param(
            _replace(case, add_to=tuple(torch.randn(5, D) for _ in range(3))),
            r"add_to: 3 tensors; at most 2 are added",
            id="add_to_three",
        ),
        pytest.param(
            _replace(case, lora=ExpertLoRA(a_down=torch.randn(E, 4, F), scaling=1.0)),
            r"ExpertLoRA.a_down is set but b_down is None: give both or neither",
            id="lora_half_pair",
        ),
        pytest.param(
            _replace(case, lora=ExpertLoRA(torch.randn(E, 4, D + 1), torch.randn(E, 2 * F, 4), scaling=1.0)),
            r"ExpertLoRA.a_gate_up: shape \(8, 4, 17\) must be \[E, r, 16\] with E = 8",
            id="lora_a_D",
        ),
        pytest.param(
            _replace(case, lora=ExpertLoRA(torch.randn(E, 4, D), torch.randn(E, 2 * F, 5), scaling=1.0)),
            r"ExpertLoRA.b_gate_up: shape \(8, 64, 5\) must be \[E, 64, r\] = \[8, 64, 4\]",
            id="lora_rank",
        ),
        pytest.param(
            _replace(case, lora=ExpertLoRA(a_down=torch.randn(E, 4, F), b_down=torch.randn(E, F, 4), scaling=1.0)),
            r"ExpertLoRA.b_down: shape \(8, 32, 4\) must be \[E, 16, r\] = \[8, 16, 4\]",
            id="lora_b_down_D",
        ),
    ]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lora_on", ["none", "both"])
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("num_add_to", [1, 2], ids=["one_tensor", "two_tensors"])
def test_moe_mlp_adds_add_to_to_its_output(dtype, lora_on, top_k, num_add_to):
    # y(add_to) = y + add_to (one tensor, or the sum of two), each add_to tensor's gradient is y's and every other
    # gradient is unchanged; add_to is not written.
    case = _make_case(11, 16, 20, 5, top_k, dtype, "random", lora_on)
    grad_y = torch.randn(11, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    gen = torch.Generator().manual_seed(2)
    addends = [torch.randn(11, 16, generator=gen).to(dtype).requires_grad_() for _ in range(num_add_to)]
    before = [t.detach().clone() for t in addends]
    add_to = addends[0] if num_add_to == 1 else tuple(addends)
    y, grads = run_with_grads(moe_mlp, dict(case, add_to=add_to), grad_y)
    y_ref, grads_ref = run_with_grads(moe_mlp_loop_ref, case, grad_y)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y, y_ref + sum(addends), **tol)
    names = ["add_to"] if num_add_to == 1 else ["add_to[0]", "add_to[1]"]
    for name, addend, addend_before in zip(names, addends, before):
        assert torch.equal(grads.pop(name), grad_y) and torch.equal(addend.detach(), addend_before), name
    assert set(grads) == set(grads_ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], **tol, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("inputs, message", _bad_moe_inputs())
def test_moe_mlp_rejects_bad_inputs(inputs, message):
    with pytest.raises(ValueError, match=message):
        moe_mlp(**inputs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(score_func="relu"), r"score_func \('relu'\) must be one of softmax, sigmoid", id="func"),
        pytest.param(dict(top_k=5), r"top_k \(5\) must be in \[1, E\] = \[1, 4\]", id="top_k_large"),
        pytest.param(dict(top_k=0), r"top_k \(0\) must be in \[1, E\]", id="top_k_zero"),
        pytest.param(
            dict(selection_bias=torch.zeros(5)), r"selection_bias: shape \(5,\) must be \[E\] = \[4\]", id="bias"
        ),
        pytest.param(dict(logits=torch.zeros(4)), r"logits: shape \(4,\) must be \[N, E\]", id="logits_rank"),
        pytest.param(dict(n_group=3), r"n_group \(3\) must be >= 1 and divide E \(4\)", id="n_group"),
        pytest.param(dict(n_group=2, topk_group=3), r"topk_group \(3\) must be in \[1, n_group\]", id="topk_group"),
        pytest.param(
            dict(top_k=3, n_group=4, topk_group=2),
            r"top_k \(3\) must be <= topk_group \(2\) x experts per group \(1\)",
            id="group_budget",
        ),
    ],
)
def test_topk_route_rejects_bad_inputs(kwargs, message):
    args = dict(logits=torch.zeros(3, 4), top_k=2) | kwargs
    with pytest.raises(ValueError, match=message):
        topk_route(**args)


def test_switch_aux_loss_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"scores: shape \(3, 4\) must be \[N, E\] with E = num_experts = 5"):
        switch_aux_loss(torch.rand(3, 4), torch.zeros(3, 1, dtype=torch.int64), num_experts=5)
    with pytest.raises(ValueError, match=r"topk_ids: shape \(2, 1\) must be \[N, k\] with N = 3"):
        switch_aux_loss(torch.rand(3, 4), torch.zeros(2, 1, dtype=torch.int64), num_experts=4)
