"""What a checkpoint family is: a mapping from one Hugging Face `model_type` onto moe-tune's model.

A family reads config.json into a ModelProfile (our architecture spec) and says, for every parameter and
persistent buffer of our model, how to build it from the checkpoint's tensors (a Recipe). Anything it cannot
map is reported, field by field or key by key, as UnsupportedModel: never a crash halfway through loading.

Shapes: E experts (E_local on this rank), F expert hidden dim, D model dim.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from moe_tune.profiles import _format_errors
from moe_tune.profiles.schema import ModelProfile

TensorGetter = Callable[[str], torch.Tensor]
# How one of our tensors is built from checkpoint tensors: a function of the getter. None: keep our init
# (a buffer the checkpoint does not have, such as a zero selection bias).
Recipe = Callable[[TensorGetter], torch.Tensor] | None


class UnsupportedModel(ValueError):
    """The checkpoint uses something moe-tune does not map. One line per unmapped field, value or module."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class HFConfig:
    """config.json (or its text part) with the fields a family reads recorded, and rules checked all at once."""

    def __init__(self, data: dict[str, Any], prefix: str = ""):
        self.data = data
        self.prefix = prefix
        self.problems: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.data:
            self.problems.append(f"config.json: {self.prefix}{key} is missing")
            return None
        return self.data[key]

    def expect(self, key: str, allowed: Iterable[Any], default: Any = None, why: str = "") -> Any:
        """Report the field unless its value (or the default when absent) is one of `allowed`."""
        value = self.data.get(key, default)
        allowed = list(allowed)
        if value not in allowed:
            rule = f"must be one of {allowed}" if len(allowed) > 1 else f"must be {allowed[0]!r}"
            self.problems.append(
                f"config.json: {self.prefix}{key} ({value!r}) is not mapped: {rule}{f' ({why})' if why else ''}"
            )
        return value

    def rope_theta(self, default: float = 10000.0) -> float:
        params = self.data.get("rope_parameters") or {}
        scaling = self.data.get("rope_scaling") or {}
        kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if kind not in ("default", None):
            self.problems.append(f"config.json: {self.prefix}rope_parameters.rope_type ({kind!r}) is not mapped: "
                                 "must be 'default'")
        return float(params.get("rope_theta", self.data.get("rope_theta", default)))

    def partial_rotary_factor(self) -> float:
        params = self.data.get("rope_parameters") or {}
        return float(params.get("partial_rotary_factor", self.data.get("partial_rotary_factor", 1.0)))

    def raise_problems(self) -> None:
        if self.problems:
            raise UnsupportedModel(self.problems)

    def profile(self, **fields: Any) -> ModelProfile:
        """ModelProfile(**fields) once the problems collected so far are raised. Values transformers accepts but our
        profile's rules refuse (value heads not a multiple of key heads, n_group not dividing the experts, an odd
        RoPE dim) come back as one line each, naming the config section and our field."""
        self.raise_problems()
        try:
            return ModelProfile(**fields)
        except ValidationError as err:
            where = f"config.json ({self.prefix.rstrip('.') or 'top level'})"
            raise UnsupportedModel([f"{where}: not mapped: model.{line}" for line in _format_errors(err)]) from None


class Family(ABC):
    """One Hugging Face model_type. Subclasses set the class attributes and implement `to_profile` and `recipe`."""

    model_types: tuple[str, ...] = ()
    # The transformers class `moe-tune align` runs as the reference (resolved inside transformers).
    reference_class: str = ""
    # Suffix of the names of the reference's router modules (one per MoE layer, in layer order); a forward hook
    # on each passes its output to `reference_topk_ids` (for --pin-routing).
    reference_router_suffix: str = "mlp.gate"
    # The reference's decoder layers (a dotted path to a ModuleList); their outputs are the hidden states
    # `moe-tune align` compares with our layers'.
    reference_layers: str = "model.layers"
    # The reference's vision tower (a dotted path), whose pooled output align compares with ours.
    reference_vision: str = "model.visual"
    # Checkpoint keys with these prefixes are not ours to load (e.g. a vision tower); never reported as unmapped.
    ignored_key_prefixes: tuple[str, ...] = ()

    def reference_topk_ids(self, output: Any) -> torch.Tensor:
        """The experts the reference's router chose, [T, k], from its forward output (transformers 5 routers
        return (logits, weights, indices))."""
        return output[2]

    def reference_layer_output(self, output: Any) -> torch.Tensor:
        """The hidden state [B, T, D] after a reference decoder layer, from that layer's forward output."""
        return output[0] if isinstance(output, tuple) else output

    def our_layer_output(self, output: Any) -> torch.Tensor:
        """The hidden state [1, T, D] after one of our decoder layers (they return (hidden, aux_loss))."""
        return output[0]

    def reference_name(self, key: str) -> str:
        """The name transformers gives the checkpoint tensor `key` once loaded: the key after transformers' own
        renaming rules for this model type (kimi_linear's block_sparse_moe -> mlp, say); align pairs LoRA adapters
        and the adapter export names modules through it."""
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        for rule in get_checkpoint_conversion_mapping(self.model_types[0]) or []:
            if isinstance(rule, WeightRenaming):
                key, _ = rule.rename_source_key(key)
        return key

    def reference_kwargs(self) -> dict[str, Any]:
        """Extra from_pretrained arguments of the reference (fp32, eager attention and experts are always set)."""
        return {}

    def text_config(self, config: dict[str, Any]) -> HFConfig:
        return HFConfig(config)

    @abstractmethod
    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        """Our architecture from config.json; UnsupportedModel listing every field it cannot map."""

    @abstractmethod
    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        """How our tensor `name` (a parameter or persistent buffer of `module`, the module that owns it) is built.
        Raise KeyError for a name the family does not know (a bug: our model has something the mapping misses)."""


class take:
    """Recipe: the checkpoint tensor `key` as it is. Align pairs our module with the reference's through it."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, get: TensorGetter) -> torch.Tensor:
        return get(self.key)


def concat(keys: list[str], dim: int = 0) -> Recipe:
    return lambda get: torch.cat([get(k) for k in keys], dim)


def stacked_experts(module: nn.Module, keys_of_expert: Callable[[int], list[str]], dim: int = 0) -> Recipe:
    """Grouped expert tensor [E_local, ...] of the experts this rank holds (global ids first_expert + i): each
    expert's checkpoint tensors concatenated along `dim` (gate rows then up rows for w_gate_up)."""
    first, count = module.first_expert, module.num_experts

    def build(get: TensorGetter) -> torch.Tensor:
        return torch.stack([torch.cat([get(k) for k in keys_of_expert(first + i)], dim) for i in range(count)])

    return build


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def key_pattern(key: str) -> str:
    """`model.layers.3.mlp.experts.17.up_proj.weight` -> `model.layers.*.mlp.experts.*.up_proj.weight`."""
    return _NUMBER.sub("*", key)


def moe_layer_indices(num_layers: int, config: HFConfig, first_dense: int = 0) -> list[bool]:
    """Which layers are MoE under the qwen/deepseek conventions (mlp_only_layers, decoder_sparse_step,
    first_k_dense_replace)."""
    only_dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    return [i >= first_dense and i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]
