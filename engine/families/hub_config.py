"""A model built from a profile as a Hugging Face checkpoint: the transformers model type that expresses its
architecture exactly, that type's config.json, and the keys save_pretrained writes for it (with shapes and dtypes).

Each family's `to_config(model)` writes the config.json of a ModelProfile (the inverse of its `to_profile`,
written from what transformers runs). The candidate types are tried in a fixed order; a config counts only when the
family's `to_profile` reads it back as the same architecture (every field of `model_dump()` but those that do not
change what the model computes). When no candidate does, UnsupportedModel names, for the closest candidate (the
fewest layer kinds it lacks, then the fewest differences), each field and value it cannot express.

The key layout is what transformers' save_pretrained writes for that config: the model built on the meta device,
tied weights dropped, and transformers' load-time conversions reverted (qwen3_moe's fused experts saved one tensor
per expert, say). The family's recipes read exactly these keys.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch

from moe_tune.profiles import error_line
from moe_tune.profiles.schema import ModelProfile

from . import family_for, supported_model_types
from .base import Family, UnsupportedModel, show

# Tried in this order: the plainest type first, so the first that reads back the architecture is the simplest
# checkpoint that expresses it. Families registered later join after these, in name order, once they have a
# to_config.
CANDIDATES = (
    "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text", "deepseek_v3", "deepseek_v32", "kimi_linear",
    "qwen3_5_moe", "qwen4_exp",
)
# Vision-language types: config.json nests their text twin's config under text_config, next to vision_config.
VISION_TWINS = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text"}
# Fields that are not the architecture config.json states: where the weights came from, how they were initialised,
# and the base weights' storage precision (an FP8 checkpoint says it in quantization_config, beside the config).
NOT_ARCHITECTURE = ("checkpoint", "seed", "init_std", "base_precision")
# MoE fields that only steer training (the balancing loss, the bias update, dropped slots); a bias that was
# updated is architecture, as moe.has_selection_bias.
MOE_TRAINING_ONLY = ("aux_loss_coef", "bias_update_rate", "capacity_factor")
# Layer kinds that read head_dim, num_key_value_heads, partial_rotary_factor and attention_output_gate.
SOFTMAX_KINDS = {"full", "sparse", "qsa"}
MLA_KINDS = {"mla", "mla_sparse"}
# The layer field and values that read each model field: without such layers the field is not architecture, and a
# field missing (None or 0) only because the layers that read it are not expressed is not a line of its own.
READ_BY_LAYERS = {
    "linear_attention": ("attention", {"linear"}), "kda_attention": ("attention", {"kda"}),
    "sparse_attention": ("attention", {"sparse", "qsa", "mla_sparse"}), "mla": ("attention", MLA_KINDS),
    "moe": ("mlp", {"moe"}), "intermediate_size": ("mlp", {"dense"}),
    "ngram_embedding": ("has_ngram_embedding", {True}),
}
# Longest value shown in a line (a section's fields).
MAX_SHOWN = 100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Key -> (shape, dtype), in save_pretrained's order.
KeyLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def hub_config_for_profile(model: ModelProfile, precision: str = "fp32") -> tuple[Family, dict[str, Any], KeyLayout]:
    """(family, config.json, key layout) of the transformers model type that expresses `model` exactly.

    precision: the run's train.precision ('fp32' or 'bf16'), the dtype of the floating tensors and config.dtype
    (tensors transformers keeps in fp32, such as DeepSeek's router, stay fp32).
    UnsupportedModel: no candidate reads its config back as `model`; one line per field and value that the closest
    candidate cannot express, e.g. "model.layers[3].attention ('sparse'): qwen3_next has no 'sparse' attention
    layers"."""
    dtype = DTYPES[precision]
    attempts = []
    for model_type in candidate_types():
        family = family_for({"model_type": model_type})
        config, problems, is_refused = attempt(family, model_type, model, dtype)
        if not problems:
            return family, config, key_layout(family, config, dtype)
        # Closest: a config its own reader refuses says least (last); then the fewest layer kinds the type lacks,
        # then the fewest lines.
        kind_lines = sum(line.startswith("model.layers[") and "].attention (" in line for line in problems)
        attempts.append(((is_refused, kind_lines, len(problems)), problems))
    raise UnsupportedModel(min(attempts, key=lambda a: a[0])[1])


def candidate_types() -> list[str]:
    """The types tried, in order: those whose family (or, vision-language, whose text twin's) has a to_config."""
    supported = supported_model_types()

    def writes(model_type: str) -> bool:
        writer = VISION_TWINS.get(model_type, model_type)
        return writer in supported and hasattr(family_for({"model_type": writer}), "to_config")

    later = sorted(t for t in supported if t not in CANDIDATES)
    return [t for t in (*CANDIDATES, *later) if t in supported and writes(t)]


def attempt(family: Family, model_type: str, model: ModelProfile, dtype: torch.dtype
            ) -> tuple[dict[str, Any], list[str], bool]:
    """(config.json as transformers writes it, what it does not express, whether reading it back failed)."""
    written = write_config(model_type, model)
    try:
        config = transformers_config(family, written, dtype)
    # Config classes validate their fields each their own way (ValueError, huggingface_hub's validation errors).
    except Exception as err:
        return {}, [f"model: transformers refuses the {model_type} config written for it: {error_line(err)}"], True
    try:
        back = family.to_profile(config)
    except UnsupportedModel as err:
        return config, [f"model: {model_type} cannot express it ({line})" for line in err.problems], True
    return config, differences(architecture(model), architecture(back), model_type), False


def write_config(model_type: str, model: ModelProfile) -> dict[str, Any]:
    """The family's config.json of `model`; for a vision-language type, its text twin's under text_config with
    the vision tower's vision_config and image token ids."""
    if model_type not in VISION_TWINS:
        return family_for({"model_type": model_type}).to_config(model)
    text = family_for({"model_type": VISION_TWINS[model_type]}).to_config(model.model_copy(update={"vision": None}))
    config: dict[str, Any] = {"model_type": model_type, "text_config": text,
                              "tie_word_embeddings": model.tie_word_embeddings}
    vision = model.vision
    if vision is not None:
        text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": list(vision.mrope_section),
                                   "mrope_interleaved": True}
        config["vision_config"] = dict(
            depth=vision.depth, hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
            num_heads=vision.num_heads, hidden_act=vision.hidden_act, in_channels=vision.in_channels,
            patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            spatial_merge_size=vision.spatial_merge_size, num_position_embeddings=vision.num_position_embeddings,
            out_hidden_size=model.hidden_size, rope_parameters={"rope_type": "axial", "rope_theta": vision.rope_theta},
        )
        config.update(image_token_id=vision.image_token_id, vision_start_token_id=vision.vision_start_token_id,
                      vision_end_token_id=vision.vision_end_token_id)
    return config


def transformers_config(family: Family, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`config` through transformers' config class, as config.json holds it: every field with transformers'
    defaults filled in, the model class and dtype named."""
    cfg = hf_config(config)
    cfg.architectures = [family.reference_class]
    cfg.dtype = str(dtype).removeprefix("torch.")
    return json.loads(cfg.to_json_string(use_diff=False))


def hf_config(config: dict[str, Any]):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(config["model_type"], **fields)


def key_layout(family: Family, config: dict[str, Any], dtype: torch.dtype) -> KeyLayout:
    """The keys, shapes and dtypes save_pretrained writes for `config`'s model (built on the meta device: no
    memory, no init)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model_class = getattr(transformers, family.reference_class)
    with torch.device("meta"):
        hf = model_class._from_config(hf_config(config), dtype=dtype)
    state = hf.state_dict()
    for key in hf._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = revert_weight_conversion(hf, remove_tied_weights_from_state_dict(state, hf))
    return {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in state.items()}


def architecture(model: ModelProfile) -> dict[str, Any]:
    """model_dump() of what the model computes: fields no layer reads dropped (a section of a layer kind the model
    lacks, the dense width without dense layers, the head dims of softmax attention without such layers), and the
    training-only fields."""
    arch = model.model_dump(mode="json")
    for field in NOT_ARCHITECTURE:
        arch.pop(field, None)
    kinds = {layer.attention for layer in model.layers}
    for name, (field, values) in READ_BY_LAYERS.items():
        if not any(getattr(layer, field) in values for layer in model.layers):
            arch[name] = 0 if name == "intermediate_size" else None
    if not kinds & SOFTMAX_KINDS:
        for field in ("head_dim", "num_key_value_heads", "partial_rotary_factor", "attention_output_gate"):
            arch.pop(field)
        if not kinds & MLA_KINDS:
            arch.pop("num_attention_heads")
        if not (kinds & MLA_KINDS and model.mla is not None and model.mla.rope != "none"):
            arch.pop("rope_theta")
    if arch["moe"] is not None:
        moe = model.moe
        for field in MOE_TRAINING_ONLY:
            arch["moe"].pop(field)
        arch["moe"]["has_selection_bias"] = moe.has_selection_bias or moe.bias_update_rate > 0
    return arch


def differences(ours: dict[str, Any], theirs: dict[str, Any], model_type: str) -> list[str]:
    """One line per field and value of `ours` that `theirs` (the architecture read back) does not have; a field of
    several layers with the same value is one line (model.layers[0, 1, 2].attention)."""
    found: list[tuple[str, Any, Any]] = []
    _walk(ours, theirs, "", found)
    unexpressed = {(path.split("].", 1)[1], json.dumps(mine)) for path, mine, _ in found if path.startswith("layers[")}
    by_layer_field: dict[tuple[str, str], list[tuple[int, Any]]] = defaultdict(list)
    lines = []
    for path, mine, read_back in found:
        if path.startswith("layers["):
            index, field = path.removeprefix("layers[").split("].", 1)
            key = (field, json.dumps(mine))
            if key not in by_layer_field:
                lines.append(key)
            by_layer_field[key].append((int(index), read_back))
        elif path == "moe.has_selection_bias" and mine is False:
            # A zero correction bias is no bias: our buffer (zeros) is written as theirs.
            continue
        elif path == "moe.has_selection_bias":
            lines.append(f"model.moe.has_selection_bias (True, or moe.bias_update_rate > 0): {model_type}'s router "
                         "has no selection (correction) bias")
        elif read_back in (None, 0) and path in READ_BY_LAYERS and _only_for_unexpressed(path, ours, unexpressed):
            continue
        elif path == "rope_theta" and read_back is None and any(p == "mla.rope" for p, _, _ in found):
            continue  # their MLA has no RoPE: the mla.rope line says it
        else:
            lines.append(_line(f"model.{path}", mine, read_back, model_type))
    out = []
    for entry in lines:
        if isinstance(entry, str):
            out.append(entry)
            continue
        field, mine = entry[0], json.loads(entry[1])
        indices = [i for i, _ in by_layer_field[entry]]
        where = f"model.layers[{', '.join(map(str, indices))}].{field}"
        if field == "attention":
            out.append(f"{where} ({show(mine)}): {model_type} has no {show(mine)} attention layers")
        else:
            out.append(_line(where, mine, by_layer_field[entry][0][1], model_type))
    return out


def _only_for_unexpressed(path: str, ours: dict[str, Any], unexpressed: set[tuple[str, str]]) -> bool:
    """Whether every layer that reads model field `path` has a line of its own (its kind is not expressed)."""
    field, values = READ_BY_LAYERS[path]
    used = {json.dumps(layer[field]) for layer in ours["layers"] if layer[field] in values}
    return all((field, value) in unexpressed for value in used)


def _walk(ours: Any, theirs: Any, path: str, found: list[tuple[str, Any, Any]]) -> None:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in ours:
            _walk(ours[key], theirs.get(key), f"{path}.{key}" if path else key, found)
    elif isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs) and path == "layers":
        for i, (mine, read_back) in enumerate(zip(ours, theirs)):
            _walk(mine, read_back, f"{path}[{i}]", found)
    elif ours != theirs:
        found.append((path, ours, theirs))


def _line(where: str, mine: Any, read_back: Any, model_type: str) -> str:
    if read_back is None:
        return f"{where} ({_brief(mine)}): {model_type} has none"
    if mine is None:
        return f"{where} (None): {model_type} always has one ({_brief(read_back)})"
    return f"{where} ({_brief(mine)}): not expressible as {model_type}, whose config reads back {_brief(read_back)}"


def _brief(value: Any) -> str:
    """A section as its fields (`num_streams=2, mix_rank=8`), anything else as `show` writes it."""
    if isinstance(value, dict):
        text = ", ".join(f"{k}={show(v)}" for k, v in value.items() if v is not None)
    else:
        text = show(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
