"""Selective operator-level caching with GPU/host tiering for the decoder layers (docs/memory.md)."""

from moe_tune.engine.memory.manager import (
    ActivationMemory,
    attach_activation_memory,
    find_activation_memory,
)
from moe_tune.engine.memory.policy import (
    CHOICES,
    OPERATOR_CLASSES,
    PRESETS,
    MemoryPolicy,
    operator_class,
    resolve_policy,
)

__all__ = [
    "CHOICES",
    "OPERATOR_CLASSES",
    "PRESETS",
    "ActivationMemory",
    "MemoryPolicy",
    "attach_activation_memory",
    "find_activation_memory",
    "operator_class",
    "resolve_policy",
]
