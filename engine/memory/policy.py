"""Operator classes, the presets, and the policy a profile's `memory:` section resolves to.

An operator class is a kind of module. What a module's own code saves for backward (not its children's) belongs to
its class; a module with no class of its own (containers, dropout) belongs to its parent's. docs/memory.md lists
what each class saves in our model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_tune.profiles.schema import MemoryProfile

OPERATOR_CLASSES = ("linear", "experts", "attention", "norm", "activation", "router")
CHOICES = ("save", "recompute", "offload")
BYTES_PER_GB = 10**9
BYTES_PER_MB = 10**6

# Settings of each preset; a field set in the profile overrides the preset's.
PRESETS: dict[str, dict] = {
    "none": dict(
        classes={name: "save" for name in OPERATOR_CLASSES},
        gpu_budget_gb=None, prefetch_layers=1, min_offload_mb=1.0,
    ),
    # Norms and activations are cheap elementwise work that saves several fp32 copies; the experts' saved gate/up
    # pre-activations are the largest single tensor of a MoE layer and are needed only late in its backward.
    "balanced": dict(
        classes=dict(linear="save", experts="offload", attention="save", norm="recompute", activation="recompute",
                     router="save"),
        gpu_budget_gb=None, prefetch_layers=1, min_offload_mb=1.0,
    ),
    # Token mixers save the most per token (projections, conv taps, gates, states): recompute them; move every other
    # saved tensor to host memory (budget 0), so the GPU holds about one layer's working set.
    "max-context": dict(
        classes=dict(linear="offload", experts="offload", attention="recompute", norm="recompute",
                     activation="recompute", router="offload"),
        gpu_budget_gb=0.0, prefetch_layers=1, min_offload_mb=1.0,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class MemoryPolicy:
    """The resolved `memory:` section: a choice per operator class and the tiering knobs."""

    classes: dict[str, str]
    gpu_budget_bytes: int | None  # None: no budget
    prefetch_layers: int
    min_offload_bytes: int

    def choice(self, operator_class: str) -> str:
        return self.classes[operator_class]

    @property
    def keeps_everything(self) -> bool:
        """Every class saved and no GPU budget: nothing moves or is recomputed."""
        return self.gpu_budget_bytes is None and all(choice == "save" for choice in self.classes.values())


def resolve_policy(memory: MemoryProfile) -> MemoryPolicy:
    """The preset with the profile's explicit fields laid over it."""
    preset = PRESETS[memory.preset]
    classes = {name: getattr(memory, name) or preset["classes"][name] for name in OPERATOR_CLASSES}
    budget_gb = memory.gpu_budget_gb if memory.gpu_budget_gb is not None else preset["gpu_budget_gb"]
    prefetch = memory.prefetch_layers if memory.prefetch_layers is not None else preset["prefetch_layers"]
    min_mb = memory.min_offload_mb if memory.min_offload_mb is not None else preset["min_offload_mb"]
    return MemoryPolicy(
        classes=classes,
        gpu_budget_bytes=None if budget_gb is None else int(budget_gb * BYTES_PER_GB),
        prefetch_layers=prefetch,
        min_offload_bytes=int(min_mb * BYTES_PER_MB),
    )


def operator_class(module: nn.Module) -> str | None:
    """The class of a module's own code; None: it inherits its parent's (containers, dropout, identity)."""
    from peft.tuners.lora import LoraLayer

    from moe_tune.engine.lora.experts import GroupedExpertsLoRA
    from moe_tune.engine.model.attention import TOKEN_MIXERS
    from moe_tune.engine.model.blocks import RMSNorm, ShortConv, SwiGLU
    from moe_tune.engine.model.model import DecoderLayer
    from moe_tune.engine.model.moe import GroupedExperts, MoEBlock

    # Order matters: the expert LoRA layer is a LoraLayer too, GatedRMSNorm an RMSNorm, DenseMLP a SwiGLU.
    table: tuple[tuple[tuple[type, ...], str], ...] = (
        ((GroupedExperts, GroupedExpertsLoRA), "experts"),
        ((nn.Linear, LoraLayer), "linear"),
        ((RMSNorm,), "norm"),
        (tuple(TOKEN_MIXERS.values()) + (ShortConv,), "attention"),
        ((SwiGLU,), "activation"),
        ((MoEBlock,), "router"),
        # The decoder layer's own code is the residual adds.
        ((DecoderLayer,), "activation"),
    )
    for types, name in table:
        if isinstance(module, types):
            return name
    return None
