"""LoRA injection through PEFT: linear adapters by target_modules, per-expert adapters by our custom layer."""

from __future__ import annotations

from torch import nn

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import LoraProfile

EXPERTS_MODULE = "experts"


def inject_lora(model: nn.Module, profile: LoraProfile):
    """Wrap `model` in a PeftModel with adapters on profile.target_modules (and the routed experts).

    Raises ProfileError when a target names no module of the model. Only adapter parameters stay trainable.
    """
    from peft import LoraConfig, get_peft_model

    from moe_tune.engine.model.moe import GroupedExperts

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
    if not targets:
        raise ProfileError(["lora.target_modules ([]) must name at least one module when lora.experts is false"])
    config = LoraConfig(
        r=profile.r,
        lora_alpha=profile.alpha,
        lora_dropout=profile.dropout,
        target_modules=targets,
        modules_to_save=list(profile.modules_to_save) or None,
        bias="none",
    )
    return get_peft_model(model, with_expert_lora(config))


def with_expert_lora(config):
    """Register the per-expert LoRA layer on a LoraConfig (PEFT does not store custom layers in its files)."""
    from moe_tune.engine.model.moe import GroupedExperts

    from .experts import GroupedExpertsLoRA

    config._register_custom_module({GroupedExperts: GroupedExpertsLoRA})
    return config


def load_adapter(model: nn.Module, directory, is_trainable: bool = False):
    """Load a saved moe-tune adapter (PEFT files) onto `model` in one process."""
    from peft import LoraConfig, PeftModel

    config = with_expert_lora(LoraConfig.from_pretrained(str(directory)))
    return PeftModel.from_pretrained(model, str(directory), config=config, is_trainable=is_trainable)

