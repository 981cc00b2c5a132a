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

    Raises ProfileError when a target names no module of the model. Only adapter parameters stay trainable. PEFT's
    linear LoRA layers take the fast path of fused.py.
    """
    from peft import LoraConfig, get_peft_model

    from moe_tune.engine.model.fp8 import dequantize_modules
    from moe_tune.engine.model.moe import GroupedExperts

    from .fused import use_fused_lora

    module_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    linear_names = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    unknown = [t for t in profile.target_modules if t not in linear_names]
    problems = [
        f"lora.target_modules ('{t}') must name a linear layer of the model (known: {', '.join(linear_names)})"
        for t in unknown
    ]
    problems += [
        f"lora.modules_to_save ('{m}') must name a module of the model" for m in profile.modules_to_save if m not in module_names
    ]
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


# The vision tower's linear layers and merger (engine/model/vision.py): adapted or trained only as
# lora.vision_tower / lora.vision_merger say, never through target_modules' name suffixes.
VISION_NAMES = {"patch_embed", "qkv", "proj", "linear_fc1", "linear_fc2", "merger_norm", "merger_fc1", "merger_fc2"}
MERGER = ("merger_norm", "merger_fc1", "merger_fc2")


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

