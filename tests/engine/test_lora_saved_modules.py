"""lora.modules_to_save where PEFT's rule (a plain suffix of the full name) reaches a module and one inside it
(qwen4_exp's `norm`, the hyper-connection mixer, holds `norm.norm`; `mlp` and `gate`; a vision block trained in full
and `norm1`), or a targeted layer it does not exclude (`gate` and an adapter on `shared_expert_gate`): the outermost
module trains in full, every parameter of it in the model's forward, no wrapper sits inside another, the counts are
the plan's, and the adapter saved reloads through load_adapter and plain PEFT with the logits it was saved with.
What PEFT cannot do is refused in one line naming the field, the value and the rule."""

from __future__ import annotations

import pytest
import torch
from peft.utils import ModulesToSaveWrapper
from typer.testing import CliRunner

from hf_tiny import tiny_qwen4_exp_text
from moe_tune.cli import app
from moe_tune.engine.align.compare import default_documents, pack_documents
from moe_tune.engine.lora import inject_lora, load_adapter
from moe_tune.engine.model.model import build_model
from moe_tune.engine.plan import lora_parameters, model_parameters
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import LoraProfile

CASES = {
    "qwen4-norm": ("qwen4_exp_text", dict(target_modules=["q_proj", "mix_down"], modules_to_save=["norm"])),
    "mlp-and-gate": ("tiny", dict(target_modules=["q_proj"], modules_to_save=["mlp", "gate"])),
    "gate-and-shared-expert-gate": ("tiny", dict(target_modules=["q_proj"], modules_to_save=["gate"])),
    "vision-block-and-norm1": ("tiny-vl", dict(target_modules=["q_proj"], modules_to_save=["norm1"],
                                               vision_tower="trained")),
}


def model_cfg(name: str, tmp_path):
    if name == "qwen4_exp_text":
        from moe_tune.engine.families import model_profile_from_checkpoint

        tiny_qwen4_exp_text().config.save_pretrained(tmp_path / "config")
        return model_profile_from_checkpoint(tmp_path / "config")[2]
    return load_profile(name).model


def built(cfg):
    torch.manual_seed(0)
    return build_model(cfg).eval()


def outermost_matches(model, keys: list[str]) -> list[str]:
    """PEFT's modules_to_save rule (peft.utils.other._set_trainable: `key.endswith(target_key)`), outermost only."""
    saved: list[str] = []
    for name, _ in model.named_modules():
        if name and name.endswith(tuple(keys)) and not any(name.startswith(f"{s}.") for s in saved):
            saved.append(name)
    return saved


def logits(model, cfg):
    ids, cu, _, images = pack_documents(default_documents(cfg))
    with torch.no_grad():
        return model.eval()(input_ids=ids, cu_seqlens=cu, **images).logits


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_outermost_match_trains_in_full_and_reloads_with_equal_logits(case, tmp_path):
    from peft import PeftModel

    name, fields = case
    cfg = model_cfg(name, tmp_path)
    lora = LoraProfile(r=4, alpha=8, **{"experts": False, **fields})
    model = inject_lora(built(cfg), lora)
    base = model.get_base_model()
    wrappers = [n for n, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    assert wrappers and not any(n.startswith(f"{w}.") for n in wrappers for w in wrappers)
    # Every parameter of the outermost matches (the vision parts lora.vision_tower trains with them) is trained, as
    # the copy the forward runs.
    saved = outermost_matches(built(cfg), list(lora.modules_to_save) + (["vision.blocks.0", "vision.blocks.1"]
                                                                         if lora.vision_tower == "trained" else []))
    expected = {n for n, _ in built(cfg).named_parameters() if any(n.startswith(f"{s}.") for s in saved)}
    trained = {n.replace(".modules_to_save.default", "") for n, p in base.named_parameters()
               if p.requires_grad and ".modules_to_save." in n}  # fmt: skip
    assert expected and expected <= trained
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    planned = lora_parameters(model_parameters(cfg), lora)
    assert sum(p.numel() for p in trainable.values()) == sum(torch.Size(p.shape).numel() for p in planned)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable.values():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    before = logits(model, cfg)
    assert (before - logits(built(cfg), cfg)).abs().max() > 1e-2
    model.save_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(load_adapter(built(cfg), tmp_path / "adapter"), cfg), before, rtol=0, atol=1e-6)
    if not lora.experts:
        # The saved config is PEFT's own: plain PEFT (no moe-tune layer registered) loads it alike.
        plain = PeftModel.from_pretrained(built(cfg), str(tmp_path / "adapter"))
        torch.testing.assert_close(logits(plain, cfg), before, rtol=0, atol=1e-5)


LIST_LINE = ("lora.modules_to_save ('layers') names a list of modules (layers), which PEFT cannot train in full as one "
             "module: name the modules in it (layers.0, ...)")
NONE_LEFT_LINE = ("lora.target_modules ('q_proj') adapts nothing: every layer it reaches lies inside the modules "
                  "lora.modules_to_save (['self_attn']) trains in full (layers.0.self_attn, layers.1.self_attn, "
                  "layers.2.self_attn, ...), and a module trained in full takes no adapter")
EXPERTS_LINE = ("lora.experts (true) adapts nothing: every layer it reaches lies inside the modules "
                "lora.modules_to_save (['mlp']) trains in full (layers.0.mlp, layers.1.mlp, layers.2.mlp, ...), and a "
                "module trained in full takes no adapter")
ONE_OF_TWO_LINE = ("lora.target_modules ('gate_proj') adapts nothing: every layer it reaches lies inside the modules "
                   "lora.modules_to_save (['mlp']) trains in full (layers.0.mlp, layers.1.mlp, layers.2.mlp, ...), and "
                   "a module trained in full takes no adapter")
UNNAMED_LINE = ("lora.modules_to_save (['self_attn', 'norm']) trains norm in full, and layers.0.self_attn.norm inside "
                "layers.0.self_attn: PEFT's rule (a plain suffix of the full name) cannot name norm without "
                "layers.0.self_attn.norm, and a module wrapped inside a wrapped one trains a copy the model never "
                "runs; leave out the entry that names one of them")
SUFFIX_LINE = ("lora.target_modules ('shared_expert_gate') adapts nothing: every layer it reaches lies inside the "
               "modules lora.modules_to_save (['gate']) trains in full (layers.0.mlp.gate, "
               "layers.0.mlp.shared_expert_gate, layers.1.mlp.gate, ...), and a module trained in full takes no "
               "adapter")
REFUSED = {
    "a-list": (dict(target_modules=["lm_head"], modules_to_save=["layers"]), LIST_LINE),
    "no-adapter-left": (dict(target_modules=["q_proj"], modules_to_save=["self_attn"]), NONE_LEFT_LINE),
    "one-target-of-two-inside": (dict(target_modules=["q_proj", "gate_proj"], modules_to_save=["mlp"]),
                                 ONE_OF_TWO_LINE),
    "the-experts-inside": (dict(target_modules=["q_proj"], modules_to_save=["mlp"], experts=True), EXPERTS_LINE),
    "a-target-a-plain-suffix-saves": (dict(target_modules=["q_proj", "shared_expert_gate"], modules_to_save=["gate"]),
                                      SUFFIX_LINE),
    "a-name-peft-cannot-single-out": (dict(target_modules=["gate_proj"],
                                           modules_to_save=["self_attn", "norm"]), UNNAMED_LINE),
}


@pytest.mark.parametrize("fields, line", REFUSED.values(), ids=REFUSED.keys())
def test_what_peft_cannot_wrap_is_refused_in_one_line(fields, line):
    with pytest.raises(ProfileError) as err:
        inject_lora(built(load_profile("tiny").model), LoraProfile(r=4, alpha=8, **{"experts": False, **fields}))
    assert err.value.problems == [line]


@pytest.mark.parametrize("fields, line", REFUSED.values(), ids=REFUSED.keys())
def test_plan_and_validate_refuse_it_with_finetunes_line(fields, line):
    # Before any model is loaded: plan counts on the meta device, validate checks what finetune would refuse.
    from moe_tune.engine.plan import plan_layouts

    sets = ["lora.experts=false"] + [f"lora.{key}={str(value).lower() if isinstance(value, bool) else value}"
                                     for key, value in fields.items()]  # fmt: skip
    with pytest.raises(ProfileError) as err:
        plan_layouts(load_profile("tiny", sets), 2, 80 * 10**9)
    assert err.value.problems == [line]
    result = CliRunner().invoke(app, ["validate", "tiny", "--no-data"] + [a for o in sets for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {line}"]


def test_finetune_refuses_before_training_with_exit_2(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "tiny", "--set", f"output.dir={out}", "--set", "train.steps=2",
                                      "--set", "train.warmup_steps=0", "--set", "lora.experts=false",
                                      "--set", "lora.target_modules=[q_proj]", "--set",
                                      "lora.modules_to_save=[self_attn]"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: {NONE_LEFT_LINE}"]
    assert not (out / "adapter").exists()
