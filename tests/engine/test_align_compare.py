"""align's comparison rows: LoRA gradients relative to the reference's scale, a reference gradient of zero included;
hidden states per channel, so that massive activations hide no error in the other channels; our routers' own choice
against the reference's, near ties told apart from another rule; the sparse attention rows whose budget left keys
out."""

import pytest
import torch

import moe_tune.engine.model.moe as moe_module
from moe_tune.engine.align import align_checkpoint, default_documents
from moe_tune.engine.align.compare import Routing, Tolerances, diff_row, lora_gradient_rows, routing_row
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.ops.moe import topk_route

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v3, tiny_deepseek_v32, tiny_glm4_moe, tiny_kimi_linear
from hf_tiny import tiny_qwen3_moe, tiny_qwen3_next

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


def test_lora_gradient_rows_have_no_channel_figure():
    grad = _gradient(1.0, 0)
    assert [row.channel_rel for row in lora_gradient_rows([("a", grad, grad)])] == [None]


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
