"""What a checkpoint family is: a mapping from one Hugging Face `model_type` onto moe-tune's model.

A family reads config.json into a ModelProfile (our architecture spec) and says, for every parameter and
persistent buffer of our model, how to build it from the checkpoint's tensors (a Recipe). Anything it cannot
map is reported, field by field or key by key, as UnsupportedModel: never a crash halfway through loading.

Shapes: E experts (E_local on this rank), F expert hidden dim, D model dim.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from moe_tune.profiles import format_errors
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


# The largest count or size a config may give: a tensor dim beyond int32, or more layers than this, is no model
# (and lists built per layer must stay small).
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class Rule:
    """The type (and range) of a config.json value. kind: int, float, bool, str, dict, int_list, str_list, and
    float_dtype (the name of a floating-point torch dtype, as transformers reads `dtype` / `torch_dtype`)."""

    kind: str
    least: float | None = None
    most: float | None = None
    # Floats: the exclusive lower bound (eps, theta, scales are > 0).
    above: float | None = None

    def broken(self, value: Any) -> str | None:
        """The rule `value` breaks, or None."""
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                return "must be an integer"
            return self._range(value)
        if self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return "must be a number"
            if not math.isfinite(value):
                return "must be a finite number"
            if self.above is not None and value <= self.above:
                return f"must be > {_bound(self.above)}"
            return self._range(value)
        if self.kind == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind == "str":
            return None if isinstance(value, str) else "must be a string"
        if self.kind == "dict":
            return None if isinstance(value, dict) else "must be a JSON object"
        if self.kind == "float_dtype":
            # transformers turns the name into getattr(torch, name): anything else fails there or is no weight dtype.
            # (vars: a name is looked up, never imported through torch's lazy submodules.)
            dtype = vars(torch).get(value) if isinstance(value, str) else None
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return None
            return "must name a floating-point torch dtype (float32, bfloat16, float16, ...)"
        if self.kind in ("int_list", "str_list"):
            what = "must be a list of integers" if self.kind == "int_list" else "must be a list of strings"
            if not isinstance(value, list):
                return what
            entry = Rule("int", self.least, self.most) if self.kind == "int_list" else Rule("str")
            for i, item in enumerate(value):
                why = entry.broken(item)
                if why is not None:
                    return f"{what}: entry [{i}] ({show(item)}) {why}"
            return None
        raise AssertionError(f"unknown rule kind {self.kind}")

    def _range(self, value: float) -> str | None:
        if self.least is not None and value < self.least:
            return f"must be >= {_bound(self.least)}"
        if self.most is not None and value > self.most:
            return f"must be <= {_bound(self.most)}"
        return None


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _count(least: int = 1, most: int = MAX_SIZE) -> Rule:
    return Rule("int", least, most)


_POSITIVE = Rule("float", above=0.0)
_NUMBER = Rule("float")
_FLAG = Rule("bool")
_SECTION = Rule("dict")
# The rules of every config key a family reads, by key name (the same name means the same thing in every family
# and section). A family may tighten a rule where it reads the key (num_experts >= 1 where every layer is MoE).
CONFIG_RULES: dict[str, Rule] = {
    **{key: _count() for key in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "num_experts_per_tok",
        "num_experts_per_token", "n_group", "num_expert_group", "topk_group", "n_routed_experts",
        "decoder_sparse_step", "full_attention_interval", "moe_layer_freq", "linear_num_key_heads",
        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_num_heads",
        "linear_head_dim", "num_heads", "q_lora_rank", "kv_lora_rank", "v_head_dim", "index_n_heads",
        "index_head_dim", "index_topk", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
        "indexer_compress_ratio", "hc_lowrank", "ple_embed_dim", "heads_per_ngram",
        "make_ngram_vocab_size_divisible_by",
        "ple_conv_kernel_size", "split_ngram_parts", "max_position_embeddings", "original_max_position_embeddings",
        "depth", "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings", "in_channels",
        "out_hidden_size",
    )},
    **{key: _count(0) for key in (
        "intermediate_size", "num_experts", "num_local_experts", "shared_expert_intermediate_size", "n_shared_experts",
        "num_shared_experts", "first_k_dense_replace", "qk_nope_head_dim", "qk_rope_head_dim", "image_token_id",
        "vision_start_token_id", "vision_end_token_id", "num_nextn_predict_layers",
    )},
    "vocab_size": _count(2),
    "head_dim": _count(2),
    "num_hidden_layers": _count(1, MAX_LAYERS),
    "ngram_size": _count(2),
    "ngram_vocab_size_base": _count(2),
    "linear_conv_kernel_dim": _count(1, 8),
    "short_conv_kernel_size": _count(1, 8),
    "seed": Rule("int", -MAX_SIZE, 2**64),
    **{key: _POSITIVE for key in (
        "rms_norm_eps", "initializer_range", "rope_theta", "routed_scaling_factor", "factor", "beta_fast",
        "beta_slow", "attention_factor",
    )},
    "partial_rotary_factor": Rule("float", most=1.0, above=0.0),
    **{key: _NUMBER for key in ("mscale", "mscale_all_dim", "attention_dropout")},
    **{key: _FLAG for key in (
        "tie_word_embeddings", "norm_topk_prob", "moe_renormalize", "attention_bias", "use_sliding_window",
        "rope_interleave", "mla_use_nope", "use_grouped_topk", "truncate", "mrope_interleaved", "attn_output_gate",
    )},
    **{key: Rule("str") for key in ("model_type", "hidden_act", "rope_type", "type", "output_gate_type", "scoring_func",
                                    "topk_method", "moe_router_activation_func")},
    **{key: _SECTION for key in (
        "rope_parameters", "rope_scaling", "linear_attn_config", "text_config", "vision_config",
    )},
    "mlp_only_layers": Rule("int_list", 0, MAX_LAYERS),
    "ple_layer_ids": Rule("int_list", 1, MAX_LAYERS),
    "full_attn_layers": Rule("int_list", 1, MAX_LAYERS),
    "kda_layers": Rule("int_list", 1, MAX_LAYERS),
    "mrope_section": Rule("int_list", 0, MAX_SIZE),
    "layer_types": Rule("str_list"),
    "mlp_layer_types": Rule("str_list"),
    "architectures": Rule("str_list"),
    **{key: Rule("float_dtype") for key in ("torch_dtype", "dtype")},
}
# Keys no family needs to map onto our model but transformers reads when it loads the checkpoint (or its export):
# checked by their rule wherever config.json gives them (declared_key_problems), so a bad value is refused here,
# not by a traceback in transformers later. A family reading one of them checks it the same way.
DECLARED_KEYS = ("architectures", "torch_dtype", "dtype", "max_position_embeddings", "head_dim")
# The sections of config.json transformers builds a config of its own from (a vision-language model's).
SUB_CONFIGS = ("text_config", "vision_config")


def show(value: Any) -> str:
    """A config value as it goes into a message: repr, with control and bidirectional characters escaped (repr
    escapes every non-printable character), cut to 60 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = "null" if value is None else repr(value)
    except (ValueError, RecursionError):
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


class HFConfig:
    """config.json (or one of its sections) with every value a family reads checked against its rule
    (CONFIG_RULES), and all problems collected to be raised at once. A section shares its parent's problems."""

    def __init__(self, data: dict[str, Any], prefix: str = "", problems: list[str] | None = None):
        self.data = data
        self.prefix = prefix
        self.problems: list[str] = [] if problems is None else problems

    def _report(self, key: str, value: Any, why: str) -> None:
        self.problems.append(f"config.json: {self.prefix}{key} ({show(value)}) {why}")

    def _checked(self, key: str, value: Any, least: float | None, most: float | None) -> tuple[bool, Any]:
        rule = CONFIG_RULES.get(key)
        if rule is None:
            return True, value
        if least is not None or most is not None:
            rule = Rule(rule.kind, rule.least if least is None else least, rule.most if most is None else most,
                        rule.above)
        why = rule.broken(value)
        if why is not None:
            self._report(key, value, why)
            return False, None
        return True, value

    def get(self, key: str, default: Any = None, least: float | None = None, most: float | None = None,
            is_null_refused: bool = False) -> Any:
        """The value, checked against its rule; `default` when it is absent or null, or (reported) breaks the rule.
        `least` / `most` tighten the rule's range. is_null_refused: an explicit null is reported (where transformers
        fails on it rather than taking its default) instead of standing for absent."""
        value = self.data.get(key)
        if value is None and is_null_refused and key in self.data:
            rule = CONFIG_RULES.get(key)
            self._report(key, value, rule.broken(None) if rule is not None else "must not be null")
            return default
        if value is None:
            return default
        ok, value = self._checked(key, value, least, most)
        return value if ok else default

    def require(self, key: str, least: float | None = None, most: float | None = None) -> Any:
        """The value, checked against its rule; None (reported) when it is missing, null or breaks the rule."""
        if key not in self.data:
            self.problems.append(f"config.json: {self.prefix}{key} is missing")
            return None
        value = self.data[key]
        if value is None and key in CONFIG_RULES:
            self._report(key, value, CONFIG_RULES[key].broken(None))
            return None
        return self._checked(key, value, least, most)[1]

    def expect(self, key: str, allowed: Iterable[Any], default: Any = None, why: str = "") -> Any:
        """Report the field unless its value (or the default when absent) is one of `allowed` (of the same type:
        1 is not True, 0 is not False)."""
        value = self.data.get(key, default)
        allowed = list(allowed)
        if not any(value == a and type(value) is type(a) or (value == a and {type(value), type(a)} <= {int, float})
                   for a in allowed):
            rule = f"must be one of {allowed}" if len(allowed) > 1 else f"must be {allowed[0]!r}"
            self.problems.append(
                f"config.json: {self.prefix}{key} ({show(value)}) is not mapped: {rule}{f' ({why})' if why else ''}"
            )
        return value

    def section(self, key: str) -> HFConfig:
        """The nested object `key` (empty when absent or null; reported when not an object), checked the same way."""
        value = self.get(key)
        return HFConfig(value if isinstance(value, dict) else {}, f"{self.prefix}{key}.", self.problems)

    def at_most(self, key: str, value: Any, limit_key: str, limit: Any) -> None:
        """Report `key` unless value <= the value of `limit_key` (both read already; None: reported already)."""
        if isinstance(value, int) and isinstance(limit, int) and value > limit:
            self.problems.append(
                f"config.json: {self.prefix}{key} ({value}) must be <= {self.prefix}{limit_key} ({limit})"
            )

    def multiple_of(self, key: str, value: Any, divisor_key: str, divisor: Any) -> None:
        """Report `key` unless value is a multiple of the value of `divisor_key` (both read already; None: reported
        already)."""
        if isinstance(value, int) and isinstance(divisor, int) and divisor >= 1 and value % divisor:
            self.problems.append(f"config.json: {self.prefix}{key} ({value}) must be a multiple of "
                                 f"{self.prefix}{divisor_key} ({divisor})")

    def rope(self) -> HFConfig:
        """rope_parameters (transformers 5) over the older rope_scaling, as one section."""
        scaling, params = self.section("rope_scaling"), self.section("rope_parameters")
        return HFConfig({**scaling.data, **params.data}, f"{self.prefix}rope_parameters.", self.problems)

    def rope_theta(self, default: float = 10000.0) -> float:
        rope = self.rope()
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            self.problems.append(f"config.json: {self.prefix}rope_parameters.rope_type ({show(kind)}) is not mapped: "
                                 "must be 'default'")
        return float(rope.get("rope_theta", self.get("rope_theta", default)))

    def partial_rotary_factor(self, default: float = 1.0) -> float:
        return float(self.rope().get("partial_rotary_factor", self.get("partial_rotary_factor", default)))

    def raise_problems(self) -> None:
        if self.problems:
            raise UnsupportedModel(list(dict.fromkeys(self.problems)))

    def profile(self, **fields: Any) -> ModelProfile:
        """ModelProfile(**fields) once the problems collected so far are raised. Values transformers accepts but our
        profile's rules refuse (value heads not a multiple of key heads, n_group not dividing the experts, an odd
        RoPE dim) come back as one line each, naming the config section and our field."""
        self.raise_problems()
        try:
            return ModelProfile(**fields)
        except ValidationError as err:
            where = f"config.json ({self.prefix.rstrip('.') or 'top level'})"
            raise UnsupportedModel([f"{where}: not mapped: model.{line}" for line in format_errors(err)]) from None


# The quantized layout moe-tune reads (a family may read one of its own instead: gpt_oss's MXFP4 experts): the hub's
# FP8 checkpoints, float8_e4m3fn weights in 128 x 128 blocks with fp32 `<name>_scale_inv`.
FP8_METHOD = "fp8"
FP8_BLOCK_SIZE = [128, 128]
FP8_RULE = "moe-tune reads quant_method fp8 with weight_block_size [128, 128]"
# The other fields of an fp8 quantization_config that change what the tensors mean, and the values read.
FP8_FIELDS = {
    "activation_scheme": ["dynamic"],  # static activation scales (input_scale tensors) are not read
    "scale_fmt": ["float"],  # ue8m0 (float8_e8m0fnu) scales: DeepSeek-V4's layout
    "expert_dtype": ["fp8"],  # fp4-packed experts: DeepSeek-V4's layout
    "fmt": ["e4m3"],  # DeepSeek-V3's own spelling of the element format
}


def quantization_config(config: dict[str, Any]) -> tuple[str, Any]:
    """(where, value) of config.json's quantization_config: at the top level, or under text_config (where
    transformers puts a vision-language model's); ("", None) when there is none."""
    if config.get("quantization_config") is not None:
        return "quantization_config", config["quantization_config"]
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config") is not None:
        return "text_config.quantization_config", text["quantization_config"]
    return "", None


def quantization_problems(config: dict[str, Any]) -> list[str]:
    """One line per field of config.json's quantization_config that is not the FP8 block layout moe-tune reads."""
    where, quant = quantization_config(config)
    if quant is None:
        return []
    if not isinstance(quant, dict):
        return [f"config.json: {where} ({show(quant)}) is not read: must be a JSON object; {FP8_RULE}"]
    problems = []
    method = quant.get("quant_method")
    if method != FP8_METHOD:
        problems.append(f"config.json: {where}.quant_method ({show(method)}) is not read: {FP8_RULE}")
        return problems
    block = quant.get("weight_block_size")
    if block != FP8_BLOCK_SIZE or any(isinstance(b, bool) or not isinstance(b, int) for b in block):
        problems.append(f"config.json: {where}.weight_block_size ({show(block)}) is not read: {FP8_RULE}")
    for key, allowed in FP8_FIELDS.items():
        if key in quant and quant[key] not in allowed:
            problems.append(f"config.json: {where}.{key} ({show(quant[key])}) is not read: must be "
                            f"{allowed[0]!r}; {FP8_RULE}")
    return problems


def declared_key_problems(config: dict[str, Any]) -> list[str]:
    """One line per DECLARED_KEYS value of config.json (top level, text_config, vision_config) that breaks its rule."""
    top = HFConfig(config)
    sections = [top] + [HFConfig(config[key], f"{key}.", top.problems) for key in SUB_CONFIGS
                        if isinstance(config.get(key), dict)]
    for section in sections:
        for key in DECLARED_KEYS:
            section.get(key)
    return top.problems


def is_fp8_checkpoint(config: dict[str, Any]) -> bool:
    """Whether config.json declares the hub's FP8 block layout (quantization_problems says what else it may be)."""
    _, quant = quantization_config(config)
    return isinstance(quant, dict) and quant.get("quant_method") == FP8_METHOD


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
    # The family's to_profile reads config.json's quantization_config itself (a layout of its own, as gpt_oss's
    # MXFP4 experts) instead of the shared FP8 check.
    reads_own_quantization: bool = False
    # Checkpoint keys ending so hold packed bytes its recipes decode into weights (gpt_oss's MXFP4 `_blocks` and
    # `_scales`, uint8): the only integer tensors a floating weight of ours may be read from.
    packed_key_suffixes: tuple[str, ...] = ()

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


# An FP8 weight as the hub stores it: (W_q float8_e4m3fn [..., O, I], scale_inv fp32 [..., R, C]), with
# W[o, i] = W_q[o, i] * scale_inv[o // 128, i // 128] (ops/fp8/reference.py; R restarts at row segments).
Fp8Weight = tuple[torch.Tensor, torch.Tensor]


class take:
    """Recipe: the checkpoint tensor `key` as it is. Align pairs our module with the reference's through it."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, get: TensorGetter) -> torch.Tensor:
        return get(self.key)

    def quantized(self, get) -> Fp8Weight | None:
        """The stored FP8 bits and scales (None when the checkpoint keeps this tensor unquantized)."""
        return get.fp8(self.key)


def fp8_row_gather(weight: Fp8Weight, rows: torch.Tensor) -> Fp8Weight | None:
    """Rows `rows` [N] of a stored FP8 weight [O, I] as a weight of its own: its bits, and for each 128-row block
    of ours the scale row of the stored block it lies in. None when one of our blocks takes rows of two stored blocks
    (the parts of a fused projection not aligned to 128 rows): no scale row fits it."""
    from moe_tune.ops.fp8 import BLOCK

    w_q, scale = weight
    stored_block = rows // BLOCK
    first_rows = stored_block[::BLOCK]  # the stored block of the first row of each of our blocks
    if not torch.equal(stored_block, first_rows.repeat_interleave(BLOCK)[: len(rows)]):
        return None
    return w_q[rows], scale[first_rows]


def concat(keys: list[str], dim: int = 0) -> Recipe:
    return lambda get: torch.cat([get(k) for k in keys], dim)


class stacked_experts:
    """Recipe: grouped expert tensor [E_local, ...] of the experts this rank holds (global ids first_expert + i):
    each expert's checkpoint tensors concatenated along `dim` (gate rows then up rows for w_gate_up). FP8 pieces
    keep their own scale rows, in order: w_gate_up's scales are [gate rows; up rows], row_segments (F, F)."""

    def __init__(self, module: nn.Module, keys_of_expert: Callable[[int], list[str]], dim: int = 0):
        self.first, self.count = module.first_expert, module.num_experts
        self.keys_of_expert, self.dim = keys_of_expert, dim

    def expert(self, get: TensorGetter, i: int) -> torch.Tensor:
        """Local expert i's tensor (its pieces concatenated)."""
        return torch.cat([get(k) for k in self.keys_of_expert(self.first + i)], self.dim)

    def __call__(self, get: TensorGetter) -> torch.Tensor:
        return torch.stack([self.expert(get, i) for i in range(self.count)])

    def quantized(self, get) -> Fp8Weight | None:
        """The experts' stored FP8 bits and scales stacked (None unless every piece is FP8 and they join by rows)."""
        if self.dim != 0:
            return None
        weights, scales = [], []
        for i in range(self.count):
            pieces = [get.fp8(k) for k in self.keys_of_expert(self.first + i)]
            if any(p is None for p in pieces):
                return None
            weights.append(torch.cat([w for w, _ in pieces]))
            scales.append(torch.cat([s for _, s in pieces]))
        return torch.stack(weights), torch.stack(scales)


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def key_pattern(key: str) -> str:
    """`model.layers.3.mlp.experts.17.up_proj.weight` -> `model.layers.*.mlp.experts.*.up_proj.weight`."""
    return _NUMBER.sub("*", key)


def moe_layer_indices(num_layers: int, config: HFConfig, first_dense: int = 0) -> list[bool]:
    """Which layers are MoE under the qwen/deepseek conventions (mlp_only_layers, decoder_sparse_step,
    first_k_dense_replace)."""
    only_dense = set(config.get("mlp_only_layers", None) or [])
    if any(isinstance(i, int) and i >= num_layers for i in only_dense):
        config.problems.append(f"config.json: {config.prefix}mlp_only_layers ({show(sorted(only_dense))}) must name "
                               f"layers below {config.prefix}num_hidden_layers ({num_layers})")
    step = config.get("decoder_sparse_step", 1)
    return [i >= first_dense and i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]


def common_config(model: ModelProfile) -> dict[str, Any]:
    """The config.json fields every family's to_config writes alike for a profile-built model: sizes, the norm, the
    SwiGLU activation, no attention bias or dropout, tying and the init scale."""
    return dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        num_hidden_layers=len(model.layers),
        num_attention_heads=model.num_attention_heads,
        rms_norm_eps=model.rms_norm_eps,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.init_std,
    )
