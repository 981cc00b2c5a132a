"""moe-tune's LoRA options mean what PEFT's do, PEFT itself the reference: the modules target_modules and
modules_to_save reach (names, dotted suffixes, full names), the scale alpha / r, the init (A as nn.Linear's, B zero),
dropout on the input of A in train mode only; what PEFT would do otherwise (dropout on expert adapters, names as
one regex string) is refused in one line naming the field, the value and the rule."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as PeftLinear
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import ModulesToSaveWrapper
from torch import nn
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.lora import inject_lora
from moe_tune.engine.lora.experts import GroupedExpertsLoRA
from moe_tune.engine.lora.fused import FusedLoraLinear
from moe_tune.engine.model.model import build_model
from moe_tune.engine.plan import lora_parameters, model_parameters
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import LoraProfile


def tiny_cfg(name="tiny"):
    return load_profile(name).model


def built(cfg):
    torch.manual_seed(0)
    return build_model(cfg)


def adapted_linears(model: nn.Module) -> set[str]:
    """Names (inside the PeftModel's base model) of the linear layers carrying a LoRA adapter."""
    base = model.get_base_model()
    return {
        name for name, m in base.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, GroupedExpertsLoRA)
    }


def saved_modules(model: nn.Module) -> set[str]:
    base = model.get_base_model()
    return {name for name, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)}


def ids_and_cu(vocab: int, length: int = 40):
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(3))
    return ids, torch.tensor([0, 17, length], dtype=torch.int32)


# Leaf names, dotted suffixes, full names and a mix: PEFT matches a list entry as the module's full name or as the
# end of it after a dot ('mlp.gate' is not 'shared_expert_gate'; 'self_attn.q_proj' is every layer's q_proj).
TARGETS = {
    "leaf-names": ["q_proj", "v_proj", "gate"],
    "dotted-suffixes": ["self_attn.q_proj", "shared_expert.up_proj", "mlp.gate"],
    "full-names": ["layers.0.self_attn.q_proj", "layers.3.mlp.shared_expert.down_proj", "lm_head"],
    "mixed": ["o_proj", "layers.1.self_attn.k_proj", "shared_expert.gate_proj", "index_q_proj"],
}


@pytest.mark.parametrize("experts", [False, True], ids=["linear", "with-experts"])
@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
def test_target_modules_reach_the_layers_peft_adapts(targets, experts):
    cfg = tiny_cfg()
    ours = inject_lora(built(cfg), LoraProfile(r=4, alpha=8, target_modules=targets, experts=experts))
    reference = get_peft_model(built(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    expected = adapted_linears(reference)
    assert expected and adapted_linears(ours) == expected
    expert_layers = [m for m in ours.modules() if isinstance(m, GroupedExpertsLoRA)]
    assert len(expert_layers) == (len(cfg.layers) if experts else 0)


SAVED = {
    "leaf": ["lm_head", "norm"],
    "dotted": ["mlp.gate"],
    "full": ["layers.0.mlp.shared_expert", "layers.2.self_attn.o_proj"],
}


@pytest.mark.parametrize("to_save", SAVED.values(), ids=SAVED.keys())
def test_modules_to_save_wrap_the_modules_peft_wraps(to_save):
    cfg = tiny_cfg()
    profile = LoraProfile(r=4, alpha=8, target_modules=["q_proj", "o_proj"], experts=False, modules_to_save=to_save)
    ours = inject_lora(built(cfg), profile)
    reference = get_peft_model(
        built(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], modules_to_save=to_save)
    )
    assert saved_modules(ours) and saved_modules(ours) == saved_modules(reference)
    assert adapted_linears(ours) == adapted_linears(reference)


@pytest.mark.parametrize("target", ["qq_proj", "attn.q_proj", ".q_proj", "layers.9.self_attn.q_proj", "experts"])
def test_a_target_peft_would_not_match_is_refused(target):
    cfg = tiny_cfg()
    model = built(cfg)
    config = LoraConfig(target_modules=[target])
    assert not any(
        check_target_module_exists(config, name) and isinstance(m, nn.Linear) for name, m in model.named_modules()
    )
    with pytest.raises(ProfileError) as err:
        inject_lora(model, LoraProfile(target_modules=["q_proj", target]))
    assert err.value.problems == [
        f"lora.target_modules ('{target}') must name a linear layer of the model, or a dotted suffix of its name as "
        "PEFT matches it (known: a_proj, b_proj, down_proj, gate, gate_proj, index_k_proj, index_q_proj, "
        "index_weights_proj, k_proj, lm_head, o_proj, q_proj, shared_expert_gate, up_proj, v_proj, z_proj)"
    ]


def refusals(cfg, profile: LoraProfile) -> list[str]:
    """The lines inject_lora refuses `profile` with on the model of `cfg`, checked equal to the plan's."""
    with pytest.raises(ProfileError) as injected:
        inject_lora(built(cfg), profile)
    with pytest.raises(ProfileError) as planned:
        lora_parameters(model_parameters(cfg), profile)
    assert planned.value.problems == injected.value.problems
    return injected.value.problems


VISION_LINE_END = "their adapters are chosen by lora.vision_tower and lora.vision_merger ('lora')"
# The vision tower's layer names (engine/model/vision.py): its linears, norms and embeddings.
VISION_LAYERS = ["patch_embed", "pos_embed", "qkv", "proj", "linear_fc1", "linear_fc2", "norm1", "norm2",
                 "merger_norm", "merger_fc1", "merger_fc2"]  # fmt: skip


@pytest.mark.parametrize("target", ["blocks.0.qkv", "vision.blocks.1.proj", "0.linear_fc1"])
def test_a_dotted_target_into_the_vision_tower_is_refused(target):
    """The vision tower is adapted as lora.vision_tower says; a dotted suffix would reach its layers past it."""
    profile = LoraProfile(target_modules=["q_proj", target], vision_tower="frozen")
    [line] = refusals(tiny_cfg("tiny-vl"), profile)
    assert line.startswith(f"lora.target_modules ('{target}') names layers of the vision tower (vision.blocks.")
    assert line.endswith(VISION_LINE_END)


@pytest.mark.parametrize("vision_tower", ["frozen", "lora", "trained"])
@pytest.mark.parametrize("target", VISION_LAYERS)
def test_a_vision_layer_name_alone_is_refused_as_a_dotted_one(target, vision_tower):
    """A vision layer's name alone reaches the tower as much as a dotted one does: refused in the same line, by
    finetune and plan alike, whatever lora.vision_tower says."""
    profile = LoraProfile(target_modules=["q_proj", target, "o_proj"], vision_tower=vision_tower)
    [line] = refusals(tiny_cfg("tiny-vl"), profile)
    assert line.startswith(f"lora.target_modules ('{target}') names layers of the vision tower (vision.")
    assert line.endswith(VISION_LINE_END)


def test_vision_targets_mixed_with_valid_ones_are_each_refused():
    targets = ["q_proj", "proj", "gate_proj", "blocks.1.linear_fc2", "merger_fc1", "qq_proj"]
    profile = LoraProfile(target_modules=targets)
    assert refusals(tiny_cfg("tiny-vl"), profile) == [
        f"lora.target_modules ('proj') names layers of the vision tower (vision.blocks.0.proj, vision.blocks.1.proj): "
        f"{VISION_LINE_END}",
        f"lora.target_modules ('blocks.1.linear_fc2') names layers of the vision tower (vision.blocks.1.linear_fc2): "
        f"{VISION_LINE_END}",
        f"lora.target_modules ('merger_fc1') names layers of the vision tower (vision.merger_fc1): {VISION_LINE_END}",
        # The known names are the text model's: the tower's are not targets.
        "lora.target_modules ('qq_proj') must name a linear layer of the model, or a dotted suffix of its name as "
        "PEFT matches it (known: a_proj, b_proj, down_proj, gate, gate_proj, index_k_proj, index_q_proj, "
        "index_weights_proj, k_proj, lm_head, o_proj, q_proj, shared_expert_gate, up_proj, v_proj, z_proj)",
    ]


@pytest.mark.parametrize("target", VISION_LAYERS)
def test_a_vision_layer_name_names_a_layer_only_of_a_model_with_a_tower(target):
    """On a text-only model a vision layer's name is one more name of no linear layer."""
    profile = LoraProfile(target_modules=["q_proj", target])
    assert refusals(tiny_cfg(), profile) == [
        f"lora.target_modules ('{target}') must name a linear layer of the model, or a dotted suffix of its name as "
        "PEFT matches it (known: a_proj, b_proj, down_proj, gate, gate_proj, index_k_proj, index_q_proj, "
        "index_weights_proj, k_proj, lm_head, o_proj, q_proj, shared_expert_gate, up_proj, v_proj, z_proj)"
    ]
    [line] = refusals(tiny_cfg("tiny-vl"), profile)
    assert line.startswith(f"lora.target_modules ('{target}') names layers of the vision tower (vision.")


@pytest.mark.parametrize("r, alpha", [(1, 1.0), (4, 8.0), (16, 2.5), (8, 64.0)])
def test_scale_and_init_are_peft_s(r, alpha):
    """Every adapter (linear and per expert) scales by alpha / r as PEFT's layer for the same r and alpha; A is
    uniform within nn.Linear's bound 1 / sqrt(fan_in) (PEFT: kaiming_uniform_, a = sqrt(5)); B is zero, so the
    fresh adapters leave the logits as they were."""
    cfg = tiny_cfg()
    base = built(cfg)
    ids, cu = ids_and_cu(cfg.vocab_size)
    with torch.no_grad():
        before = base(input_ids=ids, cu_seqlens=cu).logits
    model = inject_lora(base, LoraProfile(r=r, alpha=alpha, target_modules=["q_proj", "o_proj", "gate_proj"]))
    peft_layer = get_peft_model(nn.Sequential(nn.Linear(8, 8)), LoraConfig(r=r, lora_alpha=alpha, target_modules=["0"]))
    expected_scale = peft_layer.base_model.model[0].scaling["default"]
    assert expected_scale == alpha / r
    layers = [m for m in model.modules() if isinstance(m, (PeftLinear, GroupedExpertsLoRA))]
    assert {type(m) for m in layers} == {FusedLoraLinear, GroupedExpertsLoRA}
    for layer in layers:
        assert layer.scaling == {"default": expected_scale}
        a_side, b_side = layer.lora_A["default"], layer.lora_B["default"]
        for a in a_side.parameters():
            bound = 1 / math.sqrt(a.shape[-1])
            assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound and a.abs().mean() > 0.25 * bound
        assert all(not b.any() for b in b_side.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, cu_seqlens=cu).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_peft_s_on_the_input_of_a_in_train_mode_only(p):
    """Train mode: the same draws as PEFT's own forward (its dropout before A), so equal logits for one seed and
    others for another; eval mode: the adapters without dropout."""
    cfg = tiny_cfg()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = inject_lora(built(cfg), LoraProfile(r=4, alpha=8, dropout=p, target_modules=targets, experts=False))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    ids, cu = ids_and_cu(cfg.vocab_size)
    dropouts = [m.lora_dropout["default"] for m in model.modules() if isinstance(m, PeftLinear)]
    assert dropouts and all(type(d) is nn.Dropout and d.p == p for d in dropouts)

    def logits(seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, cu_seqlens=cu).logits.detach()

    model.train()
    ours = [logits(seed) for seed in (5, 6)]
    with torch.no_grad():
        model.eval()
        evaluated = logits(5)
        for m in model.modules():
            if isinstance(m, PeftLinear):
                m.lora_dropout["default"] = nn.Identity()
        undropped = logits(5)
    for m in model.modules():
        if type(m) is FusedLoraLinear:
            m.__class__ = PeftLinear  # PEFT's own forward
            m.lora_dropout["default"] = nn.Dropout(p)
    model.train()
    peft = [logits(seed) for seed in (5, 6)]
    torch.testing.assert_close(ours[0], peft[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], peft[1], rtol=0, atol=0)
    assert (ours[0] - ours[1]).abs().max() > 1e-3 and (ours[0] - undropped).abs().max() > 1e-3
    torch.testing.assert_close(evaluated, undropped, rtol=1e-5, atol=1e-5)


DROPOUT_RULE = (
    "lora.dropout ({value}) must be 0 with lora.experts (true): expert adapters take no dropout (nor does PEFT's "
    "form of them, target_parameters), so only the linear adapters would get it: set lora.dropout 0, or "
    "lora.experts false to keep dropout on linear adapters alone"
)


@pytest.mark.parametrize("value", ["0.05", "0.5", "1.0e-06"])
def test_dropout_with_expert_adapters_is_refused(value):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"lora.dropout={value}"])
    assert err.value.problems == [DROPOUT_RULE.format(value=float(value))]
    # Without expert adapters (or adapters at all) dropout has no adapter to miss.
    assert load_profile("tiny", [f"lora.dropout={value}", "lora.experts=false"]).lora.dropout == float(value)
    assert load_profile("tiny", [f"lora.dropout={value}", "lora.enabled=false"]).lora.dropout == float(value)


def test_dropout_with_expert_adapters_exits_2_in_one_line():
    result = CliRunner().invoke(app, ["validate", "tiny", "--no-data", "--set", "lora.dropout=0.1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == ["error: " + DROPOUT_RULE.format(value=0.1)]


NAME_LIST = "must be a list of module names or dotted suffixes of them"


@pytest.mark.parametrize(
    "override, line",
    [
        ("lora.target_modules=.*proj", f"lora.target_modules ('.*proj') {NAME_LIST}"),
        ("lora.target_modules=all-linear", f"lora.target_modules ('all-linear') {NAME_LIST}"),
        ("lora.target_modules=q_proj", f"lora.target_modules ('q_proj') {NAME_LIST}"),
        ("lora.modules_to_save=lm_head", f"lora.modules_to_save ('lm_head') {NAME_LIST}, e.g. [lm_head]"),
    ],
    ids=["regex", "all-linear", "one-name", "modules_to_save"],
)
def test_names_as_one_string_are_refused(override, line):
    """PEFT reads target_modules as one string as a regular expression (or 'all-linear'); moe-tune takes lists."""
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [override])
    [problem] = err.value.problems
    assert problem.startswith(line)
    if "target_modules" in override:
        assert problem.endswith("(PEFT's single-string form, a regular expression or 'all-linear', is not supported)")


@pytest.mark.parametrize("targets", [TARGETS["dotted-suffixes"], TARGETS["full-names"]], ids=["dotted", "full"])
def test_saved_linear_adapter_loads_in_plain_peft_with_equal_logits(targets, tmp_path):
    """Linear adapters only: the files save_pretrained writes are PEFT's, with the profile's settings, and plain
    PeftModel.from_pretrained (no moe-tune layer registered) gives the same logits."""
    import json

    from peft import PeftModel

    cfg = tiny_cfg()
    lora = LoraProfile(r=4, alpha=12, dropout=0.1, target_modules=targets, experts=False, modules_to_save=["norm"])
    model = inject_lora(built(cfg), lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 12, 0.1)
    assert sorted(config["target_modules"]) == sorted(targets) and config["modules_to_save"] == ["norm"]
    assert not config["use_rslora"] and config["init_lora_weights"] is True and config["bias"] == "none"
    reference = PeftModel.from_pretrained(built(cfg), str(tmp_path / "adapter")).eval()
    assert adapted_linears(reference) == adapted_linears(model)
    ids, cu = ids_and_cu(cfg.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=ids, cu_seqlens=cu).logits
        got = model.eval()(input_ids=ids, cu_seqlens=cu).logits
        base = built(cfg)(input_ids=ids, cu_seqlens=cu).logits
    assert (got - base).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
