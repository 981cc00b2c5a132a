"""align's comparison rows: LoRA gradients relative to the reference's scale, a reference gradient of zero included;
hidden states per channel, so that massive activations hide no error in the other channels; our routers' own choice
against the reference's, near ties told apart from another rule; the sparse attention rows whose budget left keys
out, and our indexers' own choice against the reference's, near ties told apart from a wrong indexer."""

import pytest
import torch

import moe_tune.engine.model.moe as moe_module
from moe_tune.engine.align import align_checkpoint, default_documents
from moe_tune.engine.align.compare import Routing, Tolerances, diff_row, lora_gradient_rows, routing_row
from moe_tune.engine.align.compare import selection_shifts
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.ops.moe import topk_route

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v3, tiny_deepseek_v32, tiny_glm4_moe, tiny_kimi_linear
from hf_tiny import tiny_qwen3_moe, tiny_qwen3_next, tiny_qwen4_exp_text

TOLERANCE = Tolerances().lora_grad_rel


def _gradient(scale: float, seed: int, shape=(4, 6)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3], ids=str)
def test_a_nonzero_reference_gradient_is_measured_against_its_own_largest_value(scale):
    ref = _gradient(scale, 0)
    ours = ref + _gradient(scale * 1e-5, 1)
    # A far larger gradient beside it changes nothing: each tensor with a reference of its own keeps its own scale.
    other = _gradient(scale * 1e3, 2)
    rows = lora_gradient_rows([("a", ours, ref), ("b", other, other)])
    diff = (ours - ref).abs().max().item()
    assert rows[0].max_abs == pytest.approx(diff)
    assert rows[0].rel == pytest.approx(diff / ref.abs().max().item())
    assert rows[1].rel == 0.0


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3], ids=str)
@pytest.mark.parametrize("noise, passes", [(1e-7, True), (1e-2, False)], ids=["rounding", "wrong"])
def test_a_zero_reference_gradient_is_measured_against_the_largest_reference_gradient(scale, noise, passes):
    # The q and k adapters of documents whose labelled tokens attend to themselves alone: the reference's gradient is
    # exactly zero, ours holds whatever it computed.
    other = _gradient(scale, 0)
    ours = _gradient(scale * noise, 1)
    (row, _) = lora_gradient_rows([("q_proj.lora_A", ours, torch.zeros_like(ours)), ("o_proj.lora_A", other, other)])
    assert row.max_abs == pytest.approx(ours.abs().max().item())
    assert row.rel == pytest.approx(ours.abs().max().item() / other.abs().max().item())
    assert (row.rel <= TOLERANCE) == passes


def test_without_any_reference_gradient_only_an_exact_zero_passes():
    zero = torch.zeros(3, 3)
    rows = lora_gradient_rows([("exact", zero, zero), ("off", zero + 1e-12, zero)])
    assert [(row.max_abs, row.rel) for row in rows] == [(0.0, 0.0), (pytest.approx(1e-12), float("inf"))]


@pytest.mark.parametrize("side", ["ours", "reference"])
def test_a_missing_gradient_fails_whatever_the_scale(side):
    grad = _gradient(1.0, 0)
    ours, ref = (None, grad) if side == "ours" else (grad, None)
    (row, _) = lora_gradient_rows([("missing", ours, ref), ("other", grad, grad)])
    assert row.name == f"missing (no gradient in {side})" and row.rel == float("inf")


def test_other_rows_keep_their_own_scale():
    # Hidden states and logits have no zero_scale: a zero reference with a difference fails as before.
    assert diff_row("layer 0", torch.ones(2), torch.zeros(2)).rel == float("inf")
    assert diff_row("layer 0", torch.zeros(2), torch.zeros(2)).rel == 0.0


# Hidden states per channel: massive activations (a few channels 100-10,000x the others) set the scale of their own
# errors only.


HIDDEN_TOLERANCE = Tolerances().hidden_rel
MASSIVE_CHANNELS = [3, 7]
MASSIVE_GAIN = 1e3


def _massive(seed: int = 0, shape=(46, 32)) -> torch.Tensor:
    hidden = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    hidden[:, MASSIVE_CHANNELS] *= MASSIVE_GAIN
    return hidden


def test_an_error_in_the_ordinary_channels_is_not_hidden_by_massive_ones():
    ref = _massive()
    ours = ref.clone()
    ordinary = [c for c in range(ref.shape[-1]) if c not in MASSIVE_CHANNELS]
    ours[:, ordinary] *= 1.01
    row = diff_row("layer 1", ours, ref)
    # Against the largest value the 1% error looks like 1e-5: within tolerance.
    assert row.rel <= HIDDEN_TOLERANCE
    assert row.channel_rel == pytest.approx(1e-2, rel=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rounding_stays_within_tolerance_per_channel_and_never_below_the_whole_tensor_figure(seed):
    ref = _massive(seed)
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 10)) * 1e-7
    row = diff_row("layer 0", ref * (1 + noise), ref)
    assert row.channel_rel <= 1e-6
    wrong = diff_row("layer 0", ref + torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)), ref)
    for checked in (row, wrong):
        assert checked.channel_rel >= checked.rel


def test_a_channel_the_reference_leaves_near_zero_is_measured_against_the_floor():
    from moe_tune.engine.align.compare import CHANNEL_FLOOR

    ref = _massive()
    ref[:, 5] = 0.0
    ours = ref.clone()
    ours[:, 5] = 1e-9
    median = ref.abs().amax(0).median().item()
    assert diff_row("layer 0", ours, ref).channel_rel == pytest.approx(1e-9 / (CHANNEL_FLOOR * median), rel=1e-4)
    # A reference of zeros: only an exact zero passes, as for the whole tensor's figure.
    zero = torch.zeros(4, 8)
    assert diff_row("layer 0", zero, zero).channel_rel == 0.0
    assert diff_row("layer 0", zero + 1e-12, zero).channel_rel == float("inf")


def test_a_nan_in_ours_fails_per_channel():
    ref = _massive()
    ours = ref.clone()
    ours[4, 9] = float("nan")
    row = diff_row("layer 0", ours, ref)
    assert not row.channel_rel <= HIDDEN_TOLERANCE


def test_lora_gradient_rows_have_a_row_and_column_figure_and_no_channel_figure():
    grad = _gradient(1.0, 0)
    rows = lora_gradient_rows([("a", grad, grad), ("zero", grad * 0, grad * 0), ("missing", None, grad)])
    # channel_rel stays null in the JSON of gradient rows; line_rel is theirs, except where the reference is all zero
    # (judged against all adapters' scale) or a gradient is missing (judged inf).
    assert [(row.channel_rel, row.line_rel) for row in rows] == [(None, 0.0), (None, None), (None, None)]
    assert [row.judged_rel for row in rows] == [0.0, 0.0, float("inf")]


# LoRA gradients per row and column: massive activations make a few columns of lora_A (the input channels it reads) or
# rows of lora_B (the output channels whose gradient it takes) 100-10,000x the others.


def _massive_gradient(axis: str, seed: int = 0) -> torch.Tensor:
    grad = _massive(seed, shape=(4, 32))
    return grad if axis == "lora_A columns" else grad.T.contiguous()


@pytest.mark.parametrize("axis", ["lora_A columns", "lora_B rows"])
def test_an_error_in_the_ordinary_rows_or_columns_of_a_gradient_is_not_hidden_by_massive_ones(axis):
    ref = _massive_gradient(axis)
    ordinary = torch.ones(ref.shape[-1] if axis == "lora_A columns" else ref.shape[0], dtype=torch.bool)
    ordinary[MASSIVE_CHANNELS] = False
    ours = ref.clone()
    if axis == "lora_A columns":
        ours[:, ordinary] *= 1.01
    else:
        ours[ordinary] *= 1.01
    (row,) = lora_gradient_rows([("layers.1.self_attn.q_proj.lora_A", ours, ref)])
    # Against the largest value the 1% error looks like 1e-5: within tolerance.
    assert row.rel <= TOLERANCE
    assert row.line_rel == pytest.approx(1e-2, rel=1e-4) and row.judged_rel == row.line_rel


@pytest.mark.parametrize("axis", ["lora_A columns", "lora_B rows"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_rounding_stays_within_tolerance_per_row_and_column_and_never_below_the_whole_figure(axis, seed):
    ref = _massive_gradient(axis, seed)
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 10)) * 1e-7
    wrong = ref + torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    rows = lora_gradient_rows([("rounding", ref * (1 + noise), ref), ("wrong", wrong, ref)])
    assert rows[0].line_rel <= 1e-6
    assert all(row.line_rel >= row.rel for row in rows)


def test_experts_no_token_chose_hold_zero_rows_measured_against_the_others():
    from moe_tune.engine.align.compare import CHANNEL_FLOOR

    # The fused layout A [E*r, in]: 6 of 8 experts got no token, so most rows are exactly zero on both sides.
    ref = torch.zeros(8 * 4, 16)
    ref[:8] = _gradient(1.0, 0, shape=(8, 16))
    (exact,) = lora_gradient_rows([("experts.lora_A.w_gate_up", ref.clone(), ref)])
    assert exact.line_rel == 0.0
    ours = ref.clone()
    ours[20, 3] = 1e-9
    (row,) = lora_gradient_rows([("experts.lora_A.w_gate_up", ours, ref)])
    # The floor is taken over the rows that are not all zero: rounding in an unchosen expert's row is finite and small.
    floor = CHANNEL_FLOOR * ref[:8].abs().amax(1).median().item()
    assert row.line_rel == pytest.approx(1e-9 / floor, rel=1e-4)


def test_a_nan_in_a_gradient_fails_per_row_and_column():
    ref = _massive_gradient("lora_A columns")
    ours = ref.clone()
    ours[2, 9] = float("nan")
    (row,) = lora_gradient_rows([("a", ours, ref)])
    assert not row.line_rel <= TOLERANCE and not row.judged_rel <= TOLERANCE


MASSIVE_FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "deepseek_v3": tiny_deepseek_v3, "qwen3_next": tiny_qwen3_next,
                    "kimi_linear": tiny_kimi_linear}
# Every document starts with this token, whose embedding holds the massive channels where they are per token.
MASSIVE_TOKEN = 5


@pytest.fixture(scope="module")
def massive_checkpoint(tmp_path_factory):
    """`massive_checkpoint(family, where)`: the family's tiny checkpoint with the embedding's MASSIVE_CHANNELS scaled
    by MASSIVE_GAIN, in every token ("channels") or in MASSIVE_TOKEN's alone ("token"); the residual stream carries
    them through every layer, in the reference and in ours alike."""
    from safetensors.torch import load_file, save_file

    built = {}

    def make(family: str, where: str):
        if (family, where) not in built:
            directory = save_tiny_checkpoint(MASSIVE_FAMILIES[family](), tmp_path_factory.mktemp(family) / where)
            tensors = load_file(str(directory / "model.safetensors"))
            (key,) = [k for k in tensors if k.endswith("embed_tokens.weight")]
            rows = slice(None) if where == "channels" else MASSIVE_TOKEN
            tensors[key][rows, MASSIVE_CHANNELS] *= MASSIVE_GAIN
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
            built[family, where] = directory
        return built[family, where]

    return make


def _documents_from(checkpoint):
    docs = default_documents(model_profile_from_checkpoint(checkpoint)[2])
    for doc in docs:
        doc.input_ids[0] = MASSIVE_TOKEN
    return docs


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("where", ["channels", "token"])
@pytest.mark.parametrize("family", MASSIVE_FAMILIES)
def test_correct_checkpoints_with_massive_activations_align(massive_checkpoint, family, where, pin):
    checkpoint = massive_checkpoint(family, where)
    report = align_checkpoint(checkpoint, _documents_from(checkpoint), pin_routing=pin)
    assert report.passed, report.failures
    assert max(row.channel_rel for row in report.layers) <= HIDDEN_TOLERANCE / 10
    assert max(row.line_rel for row in report.lora_grads) <= TOLERANCE / 10


# Planted in our model's layer 1: its attention output projection 1% off, or its input norm's weight off by 1e-2 at a
# massive channel (the normalised input is mostly that channel, so the attention's input moves by about 1%).
PLANTED = {"o_proj": ("layers.1.self_attn.o_proj.weight", lambda w: w.mul_(1.01)),
           "norm": ("layers.1.input_layernorm.weight", lambda w: w[MASSIVE_CHANNELS[0]].add_(1e-2))}


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("bug", PLANTED)
@pytest.mark.parametrize("family", MASSIVE_FAMILIES)
def test_a_bug_behind_massive_activations_fails_alignment(massive_checkpoint, monkeypatch, family, bug, pin):
    import moe_tune.engine.align.compare as compare

    load, (name, plant) = compare.load_ours, PLANTED[bug]

    def planted(cfg):
        model = load(cfg)
        with torch.no_grad():
            plant(dict(model.named_parameters())[name])
        return model

    monkeypatch.setattr(compare, "load_ours", planted)
    checkpoint = massive_checkpoint(family, "channels")
    report = align_checkpoint(checkpoint, _documents_from(checkpoint), pin_routing=pin)
    # Against its largest value the bug hides in layer 1, where it is (for most families in every layer).
    assert report.layers[1].rel <= HIDDEN_TOLERANCE, report.layers
    # Per channel it shows from layer 1 on, 20x the tolerance at least.
    failed = [line for line in report.failures if line.startswith("layer ")]
    assert [line.split(" rel ")[0] for line in failed] == [row.name for row in report.layers[1:]], report.failures
    assert all(row.channel_rel > 20 * HIDDEN_TOLERANCE for row in report.layers[1:]), report.layers
    assert not report.passed


# Planted in our model's layer 1, its forward untouched: the gradient its token mixer (or channel mixer) passes back to
# its input 1% off, as a wrong scale in one projection's backward would make it.
BACKWARD_BUGS = {"token_mixer": "self_attn", "channel_mixer": "mlp"}


def _backward_scaled(gain: float):
    def scale(_module, args):
        x = args[0]
        return (x * gain - x.detach() * (gain - 1), *args[1:])

    return scale


@pytest.mark.parametrize("family, bug", [(family, "token_mixer") for family in MASSIVE_FAMILIES]
                         + [("deepseek_v3", "channel_mixer"), ("qwen3_next", "channel_mixer")])
def test_a_backward_bug_behind_massive_activations_fails_on_lora_gradients(massive_checkpoint, monkeypatch, family,
                                                                           bug):
    import moe_tune.engine.align.compare as compare

    load = compare.load_ours

    def planted(cfg):
        model = load(cfg)
        getattr(model.layers[1], BACKWARD_BUGS[bug]).register_forward_pre_hook(_backward_scaled(1.01))
        return model

    monkeypatch.setattr(compare, "load_ours", planted)
    checkpoint = massive_checkpoint(family, "channels")
    report = align_checkpoint(checkpoint, _documents_from(checkpoint))
    # The forward is ours exactly: only the gradients of what runs before the bug differ.
    assert all(row.channel_rel <= HIDDEN_TOLERANCE / 10 for row in report.layers), report.layers
    before = ("LoRA gradient layers.0.",) + (("LoRA gradient layers.1.self_attn.",) if bug == "channel_mixer" else ())
    assert report.failures and all(line.startswith(before) for line in report.failures), report.failures
    assert max(row.line_rel for row in report.lora_grads) > 2 * TOLERANCE
    # Against each gradient's largest value the same bug is 2.4e-4 to 1.2e-3 (within tolerance but for qwen3_moe's
    # and qwen3_next's token mixer); on the checkpoint without massive channels, 8e-3 to 1.3e-2.
    if (family, bug) not in (("qwen3_moe", "token_mixer"), ("qwen3_next", "token_mixer")):
        assert max(row.rel for row in report.lora_grads) <= TOLERANCE


# Routing: our router's own choice against the reference's, a near tie told apart from another rule.


NUM_TOKENS, NUM_EXPERTS, TOP_K = 64, 8, 2
RULES = {
    "softmax": dict(score_func="softmax"),
    "sigmoid_bias": dict(score_func="sigmoid", selection_bias=torch.linspace(-0.3, 0.3, NUM_EXPERTS)),
    "sigmoid_bias_groups": dict(score_func="sigmoid", selection_bias=torch.linspace(0.3, -0.3, NUM_EXPERTS),
                                n_group=4, topk_group=2),
}


def _rule(**kwargs):
    return lambda logits_TE: topk_route(logits_TE, TOP_K, **kwargs)[0]


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed)) * 3


def _tied_logits(seed: int, rule: dict) -> torch.Tensor:
    """Logits whose choice scores (score + selection bias) take 3 values: most tokens tie at their k-th expert."""
    choice = 0.4 + 0.1 * torch.randint(0, 3, (NUM_TOKENS, NUM_EXPERTS), generator=torch.Generator().manual_seed(seed))
    if rule["score_func"] == "softmax":
        return choice * 10
    score = choice - rule.get("selection_bias", torch.zeros(NUM_EXPERTS))
    return torch.log(score / (1 - score))


def _differing(ours_Tk: torch.Tensor, ref_Tk: torch.Tensor) -> int:
    return sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ours_Tk, ref_Tk))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_rule_on_the_same_logits_differs_nowhere(rule, seed):
    logits = _logits(seed)
    choose = _rule(**RULES[rule])
    # The reference lists its experts in another order: a set is compared, not a sequence.
    ref = choose(logits).flip(-1)
    assert routing_row(3, choose, logits, ref, 1e-4) == Routing(3, NUM_TOKENS, 0, 0)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flips_between_nearly_tied_experts_are_within_a_tie(rule, seed):
    # The reference's logits differ from ours by 1e-6 of the largest: where experts tie, the two choices differ,
    # and a shift of 1e-4 of the largest logit explains every one.
    logits = _tied_logits(seed, RULES[rule])
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed + 10)) * 1e-6 * logits.abs().max()
    choose = _rule(**RULES[rule])
    ref = choose(logits + noise)
    differed = _differing(choose(logits), ref)
    assert differed >= NUM_TOKENS // 4
    n_group = RULES[rule].get("n_group", 1)
    assert routing_row(0, choose, logits, ref, 1e-4, n_group) == Routing(0, NUM_TOKENS, differed, 0)
    # Without any shift allowed nothing is a tie.
    assert routing_row(0, choose, logits, ref, 0.0, n_group) == Routing(0, NUM_TOKENS, differed, differed)


@pytest.mark.parametrize(
    "ours, reference",
    [("softmax", "sigmoid_bias"), ("sigmoid_bias", "sigmoid_bias_groups"),
     ({"score_func": "sigmoid"}, "sigmoid_bias")],
    ids=["another_score_and_bias", "group_limit_ignored", "selection_bias_ignored"],
)  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_choice_by_another_rule_is_beyond_a_tie(ours, reference, seed):
    logits = _logits(seed)
    choose = _rule(**(RULES[ours] if isinstance(ours, str) else ours))
    ref = _rule(**RULES[reference])(logits)
    differed = _differing(choose(logits), ref)
    assert differed >= NUM_TOKENS // 8
    n_group = RULES[reference].get("n_group", 1)
    assert routing_row(1, choose, logits, ref, 1e-4, n_group) == Routing(1, NUM_TOKENS, differed, differed)


def test_a_reference_of_another_top_k_differs_everywhere():
    logits = _logits(0)
    ref = topk_route(logits, TOP_K + 1)[0]
    assert routing_row(2, _rule(), logits, ref, 1e-4) == Routing(2, NUM_TOKENS, NUM_TOKENS, NUM_TOKENS)


# Planted in our model: a routing rule that a pinned routing hides from every number, for each family whose rule has
# a selection bias or a group limit; and flips between experts the checkpoint ties, which pinning absorbs.


BIASED_ROUTERS = {"deepseek_v3": tiny_deepseek_v3, "deepseek_v32": tiny_deepseek_v32, "glm4_moe": tiny_glm4_moe,
                  "kimi_linear": tiny_kimi_linear}
ROUTING_BUGS = {"selection_bias_ignored": dict(selection_bias=None),
                "group_limit_ignored": dict(n_group=1, topk_group=1)}


def _plant_routing(monkeypatch, **wrong):
    route = moe_module.topk_route
    monkeypatch.setattr(moe_module, "topk_route", lambda logits, top_k, **kw: route(logits, top_k, **{**kw, **wrong}))


# kimi_linear's tiny checkpoint has one group: no limit to ignore.
@pytest.mark.parametrize("family, bug", [(family, bug) for family in BIASED_ROUTERS for bug in ROUTING_BUGS
                                         if (family, bug) != ("kimi_linear", "group_limit_ignored")])
def test_a_wrong_routing_rule_fails_alignment_with_the_routing_pinned(tmp_path, monkeypatch, family, bug):
    checkpoint = save_tiny_checkpoint(BIASED_ROUTERS[family](), tmp_path / family)
    _plant_routing(monkeypatch, **ROUTING_BUGS[bug])
    report = align_checkpoint(checkpoint, pin_routing=True)
    # The numbers see the reference's experts only: they align.
    assert all(row.rel <= 1e-4 for row in report.layers) and report.logits.max_abs <= 1e-4
    # A token of the wrong rule may sit near a tie of its own: nearly all, not all, are beyond one.
    assert report.routing and all(route.differed >= route.beyond_tie >= 0.9 * route.differed > 0
                                  for route in report.routing)
    assert [line for line in report.failures if "routing" in line] == [
        f"layer {route.layer} routing: {route.beyond_tie} of {sum(report.documents)} tokens chose other experts "
        "than the reference beyond a tie" for route in report.routing
    ]
    assert not report.passed


@pytest.fixture
def tied_experts_checkpoint(tmp_path):
    """qwen3_moe whose routers score experts 0 and 1 alike (equal rows): every token that weighs one of them at its
    k-th place ties."""
    from safetensors.torch import load_file, save_file

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "qwen3_moe")
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for key in [k for k in tensors if k.endswith("mlp.gate.weight")]:
        tensors[key][1] = tensors[key][0]
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    return checkpoint


@pytest.mark.parametrize("bump", [1e-7, 1e-6], ids=str)
def test_flips_between_tied_experts_align_with_the_routing_pinned(tied_experts_checkpoint, monkeypatch, bump):
    # Our router tips the tie towards expert 1 by `bump` of its largest weight; the reference's goes to 0.
    import moe_tune.engine.align.compare as compare

    load = compare.load_ours

    def tipped(cfg):
        model = load(cfg)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param[1] += bump * param[1].abs().max()
        return model

    monkeypatch.setattr(compare, "load_ours", tipped)
    report = align_checkpoint(tied_experts_checkpoint, pin_routing=True)
    assert report.passed, report.failures
    assert sum(route.differed for route in report.routing) > 0
    assert all(route.beyond_tie == 0 for route in report.routing)


@pytest.mark.parametrize("topk", [6, 12, 64])
def test_selection_rows_the_budget_left_keys_out_are_counted(tmp_path, topk):
    # Token selection: a query at position p of its document sees p + 1 keys, so the budget leaves keys out of the
    # last L - topk rows; a budget covering every document leaves nothing out and so tests no indexer.
    checkpoint = save_tiny_checkpoint(tiny_deepseek_v32(index_topk=topk), tmp_path / "dsv32")
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert report.passed, report.failures
    expected = sum(max(0, length - topk) for length in report.documents)
    assert [(s.rows, s.left_out) for s in report.selections] == [(sum(report.documents), expected)] * 3


# Sparse attention: our indexer's own choice against the reference's, judged under our indexer's scores.


def _top(scores_LU: torch.Tensor, candidates_LU: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [L, U]: the k best candidates of each row, the lower index winning a tie (our indexers' rule)."""
    masked = scores_LU.masked_fill(~candidates_LU, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(candidates_LU).scatter_(1, order, True) & candidates_LU


SCORES_L, SCORES_U, SCORES_K = 32, 20, 6


def _scores(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random scores [L, U] on 3 levels (most rows tie at their k-th unit), and causal candidates."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (SCORES_L, SCORES_U), generator=gen).float() * 0.7 - 0.3
    candidates = torch.arange(SCORES_U)[None] <= torch.arange(SCORES_L)[:, None]
    return scores, candidates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_selection_needs_no_shift(seed):
    scores, candidates = _scores(seed)
    ours = _top(scores, candidates, SCORES_K)
    assert selection_shifts(scores, candidates, ours, ours.clone()).eq(0).all()


@pytest.mark.parametrize("noise", [0.0, 1e-7, 1e-6], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reference_choosing_among_nearly_tied_keys_needs_a_small_shift(seed, noise):
    # The reference scores within `noise` of the largest of ours and breaks exact ties from the top index down.
    scores, candidates = _scores(seed)
    gen = torch.Generator().manual_seed(seed + 10)
    theirs = scores + torch.randn(scores.shape, generator=gen) * noise * scores.abs().max()
    ours = _top(scores, candidates, SCORES_K)
    ref = _top(theirs.flip(-1), candidates.flip(-1), SCORES_K).flip(-1)
    shifts = selection_shifts(scores, candidates, ours, ref)
    assert (ours != ref).any(-1).sum() >= SCORES_L // 4
    assert shifts.max() <= 2 * noise


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reference_of_other_scores_is_far_beyond_a_tie(seed):
    scores, candidates = _scores(seed)
    ours = _top(scores, candidates, SCORES_K)
    ref = _top(-scores, candidates, SCORES_K)
    differs = (ours != ref).any(-1)
    shifts = selection_shifts(scores, candidates, ours, ref)
    assert differs.sum() >= SCORES_L // 2
    assert (shifts[differs] >= 0.1).all() and shifts[~differs].eq(0).all()


def test_a_choice_our_scores_do_not_make_is_beyond_a_tie():
    # Our indexer chose by other scores than those recorded (the op's activation or head weights planted wrong):
    # the reference's choice is the top-k of the recorded scores, ours is not.
    scores, candidates = _scores(0)
    ref = _top(scores, candidates, SCORES_K)
    ours = _top(-scores, candidates, SCORES_K)
    differs = (ours != ref).any(-1)
    assert (selection_shifts(scores, candidates, ours, ref)[differs] >= 0.1).all()


def test_differences_no_shift_explains_are_infinite():
    scores, candidates = _scores(1)
    ours = _top(scores, candidates, SCORES_K)
    row = SCORES_L - 1
    fewer, outside, zero = ours.clone(), ours.clone(), torch.zeros_like(scores)
    fewer[row, ours[row].nonzero()[0]] = False
    outside[5, SCORES_U - 1] = True  # a key the query does not see
    shifts = selection_shifts(scores, candidates, ours, fewer)
    assert shifts[row] == float("inf") and shifts[:row].eq(0).all()
    assert selection_shifts(scores, candidates, ours, outside)[5] == float("inf")
    # Every score 0: any set of the candidates ties.
    tied = _top(zero.flip(-1), candidates.flip(-1), SCORES_K).flip(-1)
    assert selection_shifts(zero, candidates, _top(zero, candidates, SCORES_K), tied).eq(0).all()


# Planted in our model: indexer bugs that a pinned selection hides from every number, on budgets below the documents'
# lengths (6 keys per query in deepseek_v32, 2 blocks of 4 keys in qwen4_exp).


class _NegatedSine:
    """A rotary whose sin is negated: rotate-half with its halves swapped."""

    def __init__(self, rotary):
        self.rotary = rotary

    def cos_sin(self, positions):
        cos, sin = self.rotary.cos_sin(positions)
        return cos, -sin

    def rotate(self, x, cos, sin):
        return self.rotary.rotate(x, cos, sin)


def _plant_op(monkeypatch, namespace, head_weights=None, activation=None):
    """The top-k op our indexers call from `namespace`, given other head weights (a function of them) or activation."""
    op = namespace.topk_indexer

    def planted(q_idx, k_idx, w_idx=None, **kwargs):
        if head_weights is not None:
            w_idx = head_weights(w_idx)
        if activation is not None:
            kwargs["activation"] = activation
        return op(q_idx, k_idx, w_idx, **kwargs)

    monkeypatch.setattr(namespace, "topk_indexer", planted)


def _plant_model(monkeypatch, change):
    import moe_tune.engine.align.compare as compare

    load = compare.load_ours

    def planted(cfg):
        model = load(cfg)
        with torch.no_grad():
            change(model)
        return model

    monkeypatch.setattr(compare, "load_ours", planted)


def _dsa_rope_swapped(monkeypatch):
    from moe_tune.engine.model.mla import LightningIndexer

    def swap(model):
        for module in model.modules():
            if isinstance(module, LightningIndexer):
                rotate = module.rotary.rotate
                module.rotary.rotate = lambda x, cos, sin, rotate=rotate: rotate(x, cos, -sin)

    _plant_model(monkeypatch, swap)


def _qsa_rope_swapped(monkeypatch):
    from moe_tune.engine.model.attention import QSAIndexer

    forward = QSAIndexer.forward
    monkeypatch.setattr(QSAIndexer, "forward", lambda self, x, rotary, batch: forward(self, x, _NegatedSine(rotary),
                                                                                      batch))


def _qsa_key_norm_scaled(monkeypatch):
    from moe_tune.engine.model.attention import QSAIndexer

    def scale(model):
        for module in model.modules():
            if isinstance(module, QSAIndexer):
                module.k_layernorm.weight.mul_(torch.linspace(0.25, 4.0, module.head_dim))

    _plant_model(monkeypatch, scale)


def _mla():
    import moe_tune.engine.model.mla as mla

    return mla


def _attention():
    import moe_tune.engine.model.attention as attention

    return attention


INDEXER_BUGS = {
    ("deepseek_v32", "head_weights_scaled"): lambda mp: _plant_op(
        mp, _mla(), head_weights=lambda w: w * torch.linspace(0.25, 4.0, w.shape[-1], dtype=w.dtype)),
    ("deepseek_v32", "head_weights_dropped"): lambda mp: _plant_op(mp, _mla(), head_weights=lambda w: None),
    ("deepseek_v32", "relu_dropped"): lambda mp: _plant_op(mp, _mla(), activation="none"),
    ("deepseek_v32", "rope_halves_swapped"): _dsa_rope_swapped,
    ("qwen4_exp", "relu_dropped"): lambda mp: _plant_op(mp, _attention(), activation="none"),
    ("qwen4_exp", "rope_halves_swapped"): _qsa_rope_swapped,
    ("qwen4_exp", "key_norm_scaled"): _qsa_key_norm_scaled,
}
SPARSE_FAMILIES = {"deepseek_v32": tiny_deepseek_v32, "qwen4_exp": tiny_qwen4_exp_text}


@pytest.fixture(scope="module")
def sparse_checkpoint(tmp_path_factory):
    """`sparse_checkpoint(family)`: the family's tiny checkpoint (built once)."""
    built = {}

    def make(family: str):
        if family not in built:
            built[family] = save_tiny_checkpoint(SPARSE_FAMILIES[family](), tmp_path_factory.mktemp(family) / family)
        return built[family]

    return make


@pytest.mark.parametrize("family, bug", INDEXER_BUGS, ids=[f"{f}-{b}" for f, b in INDEXER_BUGS])
def test_a_wrong_indexer_fails_alignment_with_the_selection_pinned(sparse_checkpoint, monkeypatch, family, bug):
    checkpoint = sparse_checkpoint(family)
    INDEXER_BUGS[family, bug](monkeypatch)
    report = align_checkpoint(checkpoint, pin_routing=True)
    # The numbers see the reference's keys only: they align.
    assert all(row.judged_rel <= HIDDEN_TOLERANCE for row in report.layers) and report.logits.max_abs <= 1e-4
    assert not report.passed
    assert report.selections and all(s.left_out > 0 and s.beyond_tie > 0 for s in report.selections)
    # A row of the wrong indexer may sit at a tie of its own: nearly all differing rows are beyond one.
    assert all(s.differed >= s.beyond_tie >= 0.8 * s.differed for s in report.selections), report.selections
    assert report.failures == [
        f"layer {s.layer} sparse attention: {s.beyond_tie} of {sum(report.documents)} query rows chose other keys "
        "than the reference beyond a tie" for s in report.selections
    ]


@pytest.mark.parametrize("family, bug", [("deepseek_v32", "relu_dropped"), ("qwen4_exp", "rope_halves_swapped")])
def test_a_wrong_indexer_is_reported_only_when_the_selection_is_not_pinned(sparse_checkpoint, monkeypatch, family,
                                                                           bug):  # fmt: skip
    # Unpinned the numbers judge the indexer (and each layer's choice follows every difference before it).
    INDEXER_BUGS[family, bug](monkeypatch)
    report = align_checkpoint(sparse_checkpoint(family), pin_routing=True, pin_selection=False)
    assert all(s.beyond_tie > 0 for s in report.selections)
    assert not any("sparse attention" in line for line in report.failures) and not report.passed


@pytest.fixture(scope="module")
def tied_selection_checkpoint(tmp_path_factory):
    """`tied_selection_checkpoint(kind)`: checkpoints whose indexers tie exactly.
    "zeros": deepseek_v32 with 3 indexer heads and 12 keys per query (many scores exactly 0, the docs' case);
    "repeats": deepseek_v32 whose indexer queries have no rotary part (wq_b's first 8 rows of each head 0), so keys
    of the same token score alike in layer 0 (documents of 5 distinct tokens);
    "blocks": qwen4_exp whose indexer keys are 0 (index_qk_proj's key rows), so every block scores 0."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tied_selection")
    made = {"zeros": tiny_deepseek_v32(index_n_heads=3, index_topk=12), "repeats": tiny_deepseek_v32(index_topk=12),
            "blocks": tiny_qwen4_exp_text()}
    built = {}

    def make(kind: str):
        if kind not in built:
            checkpoint = save_tiny_checkpoint(made[kind], root / kind)
            weights = checkpoint / "model.safetensors"
            tensors = load_file(str(weights))
            for key, tensor in tensors.items():
                if kind == "repeats" and key.endswith("indexer.wq_b.weight"):
                    tensor.view(8, 16, -1)[:, :8] = 0
                if kind == "blocks" and key.endswith("indexer.index_qk_proj.weight"):
                    tensor[-12:] = 0
            save_file(tensors, str(weights), metadata={"format": "pt"})
            built[kind] = checkpoint
        return built[kind]

    return make


# Our indexer tipped by `bump` of the tipped weight's largest |value|: the head weights (zeros, blocks: ties at 0
# stay), or the rotary rows of the queries (repeats: our keys of one token no longer tie, the reference's do).
TIPS = {"zeros": ("indexer.weights_proj.weight", lambda w: w),
        "repeats": ("indexer.wq_b.weight", lambda w: w.view(8, 16, -1)[:, :8]),
        "blocks": ("indexer.index_qk_proj.weight", lambda w: w[:-12])}


@pytest.mark.parametrize("bump", [0.0, 1e-7, 1e-6], ids=str)
@pytest.mark.parametrize("kind", TIPS)
def test_flips_between_tied_keys_align_with_the_selection_pinned(tied_selection_checkpoint, monkeypatch, kind, bump):
    checkpoint = tied_selection_checkpoint(kind)
    suffix, part = TIPS[kind]

    def tip(model):
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                part(param).add_(bump * param.abs().max())

    _plant_model(monkeypatch, tip)
    documents = None
    if kind == "repeats":
        gen = torch.Generator().manual_seed(0)
        documents = [torch.randint(10, 15, (n,), generator=gen) for n in (23, 9, 14)]
    report = align_checkpoint(checkpoint, documents, pin_routing=True)
    assert report.passed, report.failures
    assert report.selections[0].differed > 0 and all(s.left_out > 0 for s in report.selections)
    # The largest shift a flip needs is about the tip (rounding where there is none), far below the tolerance.
    assert all(s.beyond_tie == 0 and s.tie_shift <= HIDDEN_TOLERANCE / 10 for s in report.selections)


@pytest.mark.parametrize("n", [7, 50_000, 300_000])
def test_logits_cosine_of_equal_and_opposite_logits_is_one_and_minus_one_as_printed(n):
    """Equal logits are within 1e-12 of 1.0 and never above, opposite ones of -1.0, at every size: align prints
    1.00000000 (float32 sums put 300,000 equal logits at 1.0000027); others are float64's cosine."""
    from moe_tune.engine.align.compare import logits_cosine

    logits = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 30
    same, opposite = logits_cosine(logits, logits.clone()), logits_cosine(logits, -logits)
    assert 1.0 - 1e-12 <= same <= 1.0 and -1.0 <= opposite <= -1.0 + 1e-12
    assert (f"{same:.8f}", f"{opposite:.8f}") == ("1.00000000", "-1.00000000")
    other = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    expected = (logits.double() @ other.double()) / (logits.double().norm() * other.double().norm())
    assert logits_cosine(logits, other) == pytest.approx(expected.item(), abs=1e-12)


@pytest.mark.parametrize("scale", [1e-4, 1e-3, 1e-2])
def test_logits_kl_of_close_logits_is_the_float64_value_not_zero(scale):
    # Logits 1e-4..1e-2 apart over 1,000 tokens: the float32 difference of log-softmaxes near -7 cancelled to
    # rounding and was clamped to 0.
    from moe_tune.engine.align.compare import logits_kl

    generator = torch.Generator().manual_seed(3)
    reference = torch.randn(64, 1000, generator=generator) * 3
    ours = reference + scale * torch.randn(64, 1000, generator=generator)
    ref_logp, our_logp = reference.double().log_softmax(-1), ours.double().log_softmax(-1)
    expected = (ref_logp.exp() * (ref_logp - our_logp)).sum(-1).mean().item()
    assert expected > 0
    assert logits_kl(ours, reference) == pytest.approx(expected, rel=1e-9)
    assert logits_kl(reference, reference.clone()) == 0.0
