"""LoRA injection through PEFT: linear adapters by target_modules, per-expert adapters by our custom layer.

PEFT's linear LoRA layers then get the fast path of fused.py (one autograd node for the adapter, PEFT's own forward
whenever the fast path does not apply)."""

from __future__ import annotations

from torch import nn

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import LoraProfile

EXPERTS_MODULE = "experts"


def inject_lora(model: nn.Module, profile: LoraProfile):
    """Wrap `model` in a PeftModel with adapters on profile.target_modules (and the routed experts).

    Raises ProfileError when a target names no module of the model (target_problems). Only adapter parameters stay
    trainable. PEFT's linear LoRA layers take the fast path of fused.py.
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
    targets = list(profile.target_modules) + ([EXPERTS_MODULE] if profile.experts else [])
    to_save = list(profile.modules_to_save)
    # Trained in full, so never FP8: an FP8 module named here is dequantized before PEFT copies it.
    dequantize_modules(model, to_save)
    vision_targets, vision_saved = vision_parts(model, profile)
    targets, to_save = [t for t in targets if t not in VISION_NAMES] + vision_targets, to_save + vision_saved
    if not targets:
        raise ProfileError(["lora.target_modules ([]) must name at least one module when lora.experts is false"])
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
    """What inject_lora refuses in profile.target_modules and modules_to_save, one line each: an entry that names no
    linear layer (modules_to_save: no module) of the model by PEFT's rule (the name, or a dotted suffix of it:
    `q_proj`, `self_attn.q_proj`, `layers.0.self_attn.q_proj`), and a dotted target that reaches into the vision
    tower, whose parts are adapted as lora.vision_tower / lora.vision_merger say (its layer names alone, VISION_NAMES,
    are left to those fields)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    names = [name for name, _ in model.named_modules() if name]
    linears = [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]
    leaf_names = sorted({name.rsplit(".", 1)[-1] for name in linears})
    problems = []
    for key in profile.target_modules:
        found = [name for name in linears if matches_module_name(name, [key])]
        if not found:
            problems.append(
                f"lora.target_modules ('{key}') must name a linear layer of the model, or a dotted suffix of its name "
                f"as PEFT matches it (known: {', '.join(leaf_names)})"
            )
        vision = [name for name in found if name.startswith(VISION_PREFIX)]
        if vision and key not in VISION_NAMES:
            problems.append(
                f"lora.target_modules ('{key}') names layers of the vision tower ({', '.join(vision[:3])}"
                f"{', ...' if len(vision) > 3 else ''}): their adapters are chosen by lora.vision_tower and "
                "lora.vision_merger ('lora')"
            )
    problems += [
        f"lora.modules_to_save ('{key}') must name a module of the model, or a dotted suffix of its name"
        for key in profile.modules_to_save
        if not any(matches_module_name(name, [key]) for name in names)
    ]
    return problems


# The vision tower's linear layers and merger (engine/model/vision.py): adapted or trained only as
# lora.vision_tower / lora.vision_merger say, never through target_modules' name suffixes.
VISION_NAMES = {"patch_embed", "qkv", "proj", "linear_fc1", "linear_fc2", "merger_norm", "merger_fc1", "merger_fc2"}
MERGER = ("merger_norm", "merger_fc1", "merger_fc2")
VISION_PREFIX = "vision."


def vision_parts(model: nn.Module, profile: LoraProfile) -> tuple[list[str], list[str]]:
    """(full names of vision linears that get adapters, full names of vision modules trained in full)."""
    tower = getattr(model, "vision", None)
    if tower is None:
        return [], []
    targets, saved = [], []
    for name, module in tower.named_modules():
        if not name:
            continue
        is_merger = name in MERGER
        choice = profile.vision_merger if is_merger else profile.vision_tower
        # LoRA on the ViT blocks' (and the merger's) linear layers; the patch embedding (a Conv3d in the checkpoints)
        # stays as it is.
        if choice == "lora" and isinstance(module, nn.Linear) and name != "patch_embed":
            targets.append(f"vision.{name}")
        elif choice == "trained" and (is_merger or name in ("patch_embed", "pos_embed") or name.count(".") == 1):
            saved.append(f"vision.{name}")  # the merger parts, patch/pos embeddings and whole blocks
    return targets, saved


def freeze_vision_parts(model: nn.Module, profile: LoraProfile) -> None:
    """Full fine-tuning: freeze the vision parts the profile keeps frozen (LoRA runs freeze through PEFT)."""
    tower = getattr(model, "vision", None)
    if tower is None:
        return
    for name, param in tower.named_parameters():
        choice = profile.vision_merger if name.startswith(MERGER) else profile.vision_tower
        if choice == "frozen":
            param.requires_grad_(False)


def with_expert_lora(config):
    """Register the per-expert LoRA layer on a LoraConfig (PEFT does not store custom layers in its files)."""
    from moe_tune.engine.model.moe import GroupedExperts

    from .experts import GroupedExpertsLoRA

    config._register_custom_module({GroupedExperts: GroupedExpertsLoRA})
    return config


def load_adapter(model: nn.Module, directory, is_trainable: bool = False):
    """Load a saved moe-tune adapter (PEFT files) onto `model` in one process; linear adapters take fused.py's path."""
    from peft import LoraConfig, PeftModel

    from moe_tune.engine.model.fp8 import dequantize_modules

    from .fused import use_fused_lora

    config = with_expert_lora(LoraConfig.from_pretrained(str(directory)))
    dequantize_modules(model, sorted(config.modules_to_save or ()))
    peft_model = PeftModel.from_pretrained(model, str(directory), config=config, is_trainable=is_trainable)
    use_fused_lora(peft_model)
    return peft_model

