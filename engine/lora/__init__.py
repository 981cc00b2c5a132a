"""LoRA injection through PEFT: linear adapters by target_modules, per-expert adapters by our custom layer.

PEFT's linear LoRA layers then get the fast path of fused.py (one autograd node for the adapter, PEFT's own forward
whenever the fast path does not apply)."""

from __future__ import annotations

import re

from torch import nn

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import LoraProfile

EXPERTS_MODULE = "experts"


def inject_lora(model: nn.Module, profile: LoraProfile):
    """Wrap `model` in a PeftModel with adapters on profile.target_modules (and the routed experts).

    The vision tower's parts get adapters or train in full as lora.vision_tower / lora.vision_merger say
    (vision_parts). modules_to_save trains in full the outermost of the modules PEFT's rule matches (saved_modules;
    peft_saved_names says what PEFT is given for them). Raises ProfileError when a target names no linear layer of the
    model or a part of the vision tower (target_problems), and for what PEFT cannot train in full or would leave no
    adapter (saved_module_problems). Only adapter parameters and the modules trained in full stay trainable. PEFT's
    linear LoRA layers take the fast path of fused.py.
    """
    from peft import LoraConfig, get_peft_model

    from moe_tune.engine.model.fp8 import dequantize_modules
    from moe_tune.engine.model.moe import GroupedExperts

    from .fused import use_fused_lora

    problems = target_problems(model, profile)
    has_experts = any(isinstance(m, GroupedExperts) for m in model.modules())
    if profile.experts and not has_experts:
        problems.append("lora.experts (true) needs a layer with mlp: moe")
    if problems:
        raise ProfileError(problems)
    vision_targets, vision_saved = vision_parts(model, profile)
    targets = list(profile.target_modules) + ([EXPERTS_MODULE] if profile.experts else []) + vision_targets
    if not targets:
        raise ProfileError(["lora.target_modules ([]) must name at least one module when lora.experts is false"])
    to_save = list(profile.modules_to_save) + vision_saved
    saved = saved_modules(model, to_save)
    problems = saved_module_problems(model, profile, targets, saved)
    if problems:
        raise ProfileError(problems)
    to_save = peft_saved_names(model, targets, to_save)
    # Trained in full, so never FP8: an FP8 module PEFT copies is dequantized before it does.
    dequantize_modules(model, saved)
    config = LoraConfig(
        r=profile.r,
        lora_alpha=profile.alpha,
        lora_dropout=profile.dropout,
        target_modules=targets,
        modules_to_save=to_save or None,
        bias="none",
    )
    peft_model = get_peft_model(model, with_expert_lora(config))
    use_fused_lora(peft_model)
    return peft_model


def target_problems(model: nn.Module, profile: LoraProfile) -> list[str]:
    """What inject_lora refuses in profile.target_modules and modules_to_save, one line each (target_module_problems
    for the targets; a modules_to_save entry that names no module of the model, or a dotted suffix of its name)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    names = [name for name, _ in model.named_modules() if name]
    linears = [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]
    vision = [name for name, m in model.named_modules()
              if is_vision_module(name) and next(m.parameters(), None) is not None]  # fmt: skip
    problems = target_module_problems(profile.target_modules, linears, vision)
    problems += [
        f"lora.modules_to_save ('{key}') must name a module of the model, or a dotted suffix of its name"
        for key in profile.modules_to_save
        if not any(matches_module_name(name, [key]) for name in names)
    ]
    return problems


def saved_modules(model: nn.Module, keys) -> list[str]:
    """Full names of the modules trained in full for modules_to_save `keys` (saved_names over the model's modules)."""
    return saved_names([name for name, _ in model.named_modules()], keys)


def saved_names(names, keys) -> list[str]:
    """Of module full `names` (outermost first, as named_modules gives them), those trained in full for
    modules_to_save `keys`, by PEFT's rule: a plain suffix of the module's full name (`gate` also matches
    `shared_expert_gate`), and of matches inside one another the outermost alone, which trains the inner ones with
    it. engine/plan.py counts with it from parameter names."""
    saved: list[str] = []
    for name in names:
        if name and not _inside(name, saved) and name.endswith(tuple(keys)):
            saved.append(name)
    return saved


def _inside(name: str, outer: list[str]) -> bool:
    """Whether the module `name` is one of `outer` or inside one."""
    return any(name == o or name.startswith(f"{o}.") for o in outer)


def saved_module_problems(model: nn.Module, profile: LoraProfile, targets: list[str], saved: list[str]) -> list[str]:
    """What inject_lora refuses once the modules trained in full are known (`saved`: saved_modules of
    lora.modules_to_save and the vision parts trained in full): a list of modules among them (PEFT wraps modules, not
    lists); a lora.target_modules entry, lora.experts or the vision tower's adapters (among `targets`) reaching only
    modules inside them, which take no adapter; a module PEFT cannot be told to wrap alone (peft_saved_names)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    modules = dict(model.named_modules())
    problems = [
        f"lora.modules_to_save ('{key}') names a list of modules ({name}), which PEFT cannot train in full as one "
        f"module: name the modules in it ({name}.0, ...)"
        for key in profile.modules_to_save
        for name in saved
        if name.endswith(key) and isinstance(modules[name], (nn.ModuleList, nn.ModuleDict))
    ]
    entries = [(f"lora.target_modules ('{key}')", [key]) for key in profile.target_modules]
    entries += [("lora.experts (true)", [EXPERTS_MODULE])] if profile.experts else []
    vision_targets = [target for target in targets if is_vision_module(target)]
    entries += [("lora.vision_tower / lora.vision_merger ('lora')", vision_targets)] if vision_targets else []
    held = (f"lora.modules_to_save ({list(profile.modules_to_save)}) trains in full ({', '.join(saved[:3])}"
            f"{', ...' if len(saved) > 3 else ''})")
    for field, keys in entries:
        reached = [name for name in modules if name and matches_module_name(name, keys)]
        if reached and all(_inside(name, saved) for name in reached):
            problems.append(f"{field} adapts nothing: every layer it reaches lies inside the modules {held}, and a "
                            "module trained in full takes no adapter")
    _, unnamed = _wrapped_units(model, saved)
    problems += [
        f"lora.modules_to_save ({list(profile.modules_to_save)}) trains {name} in full, and {inner} inside "
        f"{outer}: PEFT's rule (a plain suffix of the full name) cannot name {name} without {inner}, and a module "
        "wrapped inside a wrapped one trains a copy the model never runs; leave out the entry that names one of them"
        for name, (inner, outer) in unnamed.items()
    ]
    return problems


def _wrapped_units(model: nn.Module, saved: list[str]) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(the modules to wrap so that `saved` trains in full, each named alone by its full name; {a module of `saved`
    that cannot be: (the module inside another one of them whose name ends with its name, that other one)}). PEFT
    wraps every module whose name ends with a modules_to_save entry, so a module's full name names it alone unless a
    module inside one wrapped ends with it too (`norm` and `norm.norm`): such a module is wrapped as its children
    instead, which hold the same parameters, unless it holds parameters of its own."""
    names = [name for name, _ in model.named_modules() if name]
    units, unnamed = list(saved), {}
    while True:
        clash = next(((unit, name, outer) for outer in units for name in names if name.startswith(f"{outer}.")
                      for unit in units if name.endswith(unit)), None)  # fmt: skip
        if clash is None:
            return units, unnamed
        unit, name, outer = clash
        module = model.get_submodule(unit)
        at = units.index(unit)
        if next(module.parameters(recurse=False), None) is not None:
            unnamed[unit] = (name, outer)
            units[at : at + 1] = []
        else:
            units[at : at + 1] = [f"{unit}.{child}" for child, m in module.named_children()
                                  if next(m.parameters(), None) is not None]  # fmt: skip


def peft_saved_names(model: nn.Module, targets, keys) -> list[str]:
    """modules_to_save for the LoraConfig on `model` with `targets` that makes PEFT train in full exactly
    saved_modules(model, keys) and adapt nothing inside them: `keys` as they are where PEFT's own rules do that; else
    the full names of the modules that hold those parameters (_wrapped_units).

    PEFT's own rules fall short where matches of `keys` nest (it wraps the outer module, then the inner one again
    inside the outer one's copy, which leaves the copy's inner module frozen, and cannot load the adapter it saves: a
    KeyError on the inner module's tensors), and where a targeted module inside one is not excluded by PEFT's rule
    for that (a key as whole dotted parts of the name: `gate` keeps the adapter of `shared_expert_gate`, which PEFT
    then refuses to wrap)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    keys = list(keys)
    saved = saved_modules(model, keys)
    names = [name for name, _ in model.named_modules() if name]
    matched = [name for name in names if name.endswith(tuple(keys))]
    excluded = {name for name in names if any(re.match(rf"(^|.*\.){re.escape(key)}($|\..*)", name) for key in keys)}
    adapted_inside = {name for name in names if matches_module_name(name, targets) and _inside(name, saved)}
    if matched == saved and adapted_inside <= excluded:
        return keys
    return _wrapped_units(model, saved)[0]


def target_module_problems(keys: list[str], linears: list[str], vision: list[str]) -> list[str]:
    """The lines for lora.target_modules entries `keys` that inject_lora refuses, matched by PEFT's rule (the full
    name, or a dotted suffix of it: `q_proj`, `self_attn.q_proj`, `layers.0.self_attn.q_proj`) against `linears`,
    the full names of the model's linear layers, and `vision`, those of the vision tower's modules that hold
    parameters: an entry that matches a module of the tower (its layer names alone, `qkv`, or dotted, `blocks.0.qkv`),
    whose parts are adapted or trained as lora.vision_tower / lora.vision_merger say; else an entry that names no
    linear layer. plan.py checks profiles with it too, from the parameter names of the model on the meta device."""
    from moe_tune.engine.model.fp8 import matches_module_name

    known = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linears if not is_vision_module(name)}))
    problems = []
    for key in keys:
        reached = [name for name in vision if matches_module_name(name, [key])]
        if reached:
            problems.append(
                f"lora.target_modules ('{key}') names layers of the vision tower ({', '.join(reached[:3])}"
                f"{', ...' if len(reached) > 3 else ''}): their adapters are chosen by lora.vision_tower and "
                "lora.vision_merger ('lora')"
            )
        elif not any(matches_module_name(name, [key]) for name in linears):
            problems.append(
                f"lora.target_modules ('{key}') must name a linear layer of the model, or a dotted suffix of its name "
                f"as PEFT matches it (known: {known})"
            )
    return problems


# The vision tower's module (engine/model/vision.py), and its merger's parts: adapted or trained only as
# lora.vision_tower / lora.vision_merger say, never through target_modules.
VISION_MODULE = "vision"
VISION_PREFIX = f"{VISION_MODULE}."
MERGER = ("merger_norm", "merger_fc1", "merger_fc2")


def is_vision_module(name: str) -> bool:
    """Whether a module or parameter, by its full name in the model, is the vision tower or part of it."""
    return name == VISION_MODULE or name.startswith(VISION_PREFIX)


def vision_choice(name: str, profile: LoraProfile) -> str:
    """'frozen', 'lora' or 'trained' for a module or parameter of the vision tower, by its name inside the tower:
    lora.vision_merger for the merger's parts, lora.vision_tower for the rest."""
    return profile.vision_merger if name.startswith(MERGER) else profile.vision_tower


def vision_parts(model: nn.Module, profile: LoraProfile) -> tuple[list[str], list[str]]:
    """(full names of vision linears that get adapters, full names of vision modules trained in full)."""
    tower = getattr(model, VISION_MODULE, None)
    if tower is None:
        return [], []
    return vision_module_parts([(name, isinstance(m, nn.Linear)) for name, m in tower.named_modules() if name],
                               profile)  # fmt: skip


def vision_module_parts(modules: list[tuple[str, bool]], profile: LoraProfile) -> tuple[list[str], list[str]]:
    """vision_parts from the tower's modules as (name inside the tower, whether it is an nn.Linear): LoRA on the ViT
    blocks' (and the merger's) linear layers, the patch embedding (a Conv3d in the checkpoints) left as it is; in
    full the merger's parts, the patch and position embeddings and whole blocks."""
    targets, saved = [], []
    for name, is_linear in modules:
        choice = vision_choice(name, profile)
        if choice == "lora" and is_linear and name != "patch_embed":
            targets.append(f"{VISION_PREFIX}{name}")
        elif choice == "trained" and (name in MERGER or name in ("patch_embed", "pos_embed") or name.count(".") == 1):
            saved.append(f"{VISION_PREFIX}{name}")
    return targets, saved


def freeze_vision_parts(model: nn.Module, profile: LoraProfile) -> None:
    """Full fine-tuning: freeze the vision parts the profile keeps frozen (LoRA runs freeze through PEFT)."""
    tower = getattr(model, VISION_MODULE, None)
    if tower is None:
        return
    for name, param in tower.named_parameters():
        if vision_choice(name, profile) == "frozen":
            param.requires_grad_(False)


def with_expert_lora(config):
    """Register the per-expert LoRA layer on a LoraConfig (PEFT does not store custom layers in its files)."""
    from moe_tune.engine.model.moe import GroupedExperts

    from .experts import GroupedExpertsLoRA

    config._register_custom_module({GroupedExperts: GroupedExpertsLoRA})
    return config


def load_adapter(model: nn.Module, directory, is_trainable: bool = False):
    """Load a saved moe-tune adapter (PEFT files) onto `model` in one process, its modules_to_save given to PEFT as
    inject_lora gives them (peft_saved_names); linear adapters take fused.py's path."""
    from peft import LoraConfig, PeftModel

    from moe_tune.engine.model.fp8 import dequantize_modules

    from .fused import use_fused_lora

    config = with_expert_lora(LoraConfig.from_pretrained(str(directory)))
    config.modules_to_save = peft_saved_names(model, config.target_modules, config.modules_to_save or ()) or None
    dequantize_modules(model, saved_modules(model, config.modules_to_save or ()))
    peft_model = PeftModel.from_pretrained(model, str(directory), config=config, is_trainable=is_trainable)
    use_fused_lora(peft_model)
    return peft_model

