"""The vision tower's tensors in the qwen3_5_moe / qwen4_exp checkpoint layout (model.visual.*), for the families
that carry one, and its config (vision_config + the image token ids) as our VisionSpec."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from moe_tune.profiles import format_errors
from moe_tune.profiles.schema import ModelProfile, VisionSpec

from .base import HFConfig, Recipe, UnsupportedModel, show, take

# Our VisionTower's names -> the checkpoint's, below the tower's prefix.
_RENAMES = {
    "merger_norm": "merger.norm",
    "merger_fc1": "merger.linear_fc1",
    "merger_fc2": "merger.linear_fc2",
    "qkv": "attn.qkv",
    "proj": "attn.proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}


def vision_spec(config: dict[str, Any]) -> VisionSpec:
    """VisionSpec from a multimodal config.json (vision_config and the top-level image token ids)."""
    top = HFConfig(config)
    c = top.section("vision_config")
    rope = c.section("rope_parameters")
    c.expect("in_channels", [3], 3)
    if rope.get("rope_type", "axial") != "axial":
        c.problems.append(f"config.json: vision_config.rope_parameters.rope_type ({show(rope.get('rope_type'))}) is "
                          "not mapped: must be 'axial'")
    spec = dict(
        depth=c.require("depth"),
        hidden_size=c.require("hidden_size"),
        intermediate_size=c.require("intermediate_size", least=1),
        num_heads=c.require("num_heads"),
        hidden_act=c.expect("hidden_act", ["gelu_pytorch_tanh", "gelu", "silu"], "gelu_pytorch_tanh"),
        patch_size=c.require("patch_size"),
        temporal_patch_size=c.get("temporal_patch_size", 2),
        spatial_merge_size=c.get("spatial_merge_size", 2),
        num_position_embeddings=c.require("num_position_embeddings"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=top.require("image_token_id"),
        vision_start_token_id=top.require("vision_start_token_id"),
        vision_end_token_id=top.require("vision_end_token_id"),
    )
    top.raise_problems()
    try:
        return VisionSpec(**spec)
    except ValidationError as err:
        raise UnsupportedModel([f"config.json: not mapped: vision.{line}" for line in format_errors(err)]) from None


def vision_recipe(name: str, prefix: str = "model.visual.") -> Recipe:
    """Recipe for our tensor `name` below `vision.` (the name without that prefix). The patch embedding is a
    Conv3d with stride equal to its kernel in the checkpoint: the same map as our Linear over flattened patches."""
    if name.startswith("patch_embed."):
        key = prefix + "patch_embed.proj." + name.rsplit(".", 1)[1]
        if name.endswith("weight"):
            return lambda get: get(key).reshape(get(key).shape[0], -1)
        return take(key)
    parts = name.split(".")
    parts = [_RENAMES.get(p, p) for p in parts]
    return take(prefix + ".".join(parts))


def with_vision(cfg: ModelProfile, config: dict[str, Any]) -> ModelProfile:
    """`cfg` (the language model read from text_config) with the vision tower of a multimodal config, and the
    multimodal rotary its image tokens use: (t, h, w) positions on interleaved frequency sections of the text
    attention's rotary dims (text_config.rope_parameters.mrope_section). Unchanged without a vision_config."""
    top = HFConfig(config)
    if top.get("vision_config") is None:
        top.raise_problems()
        return cfg
    rope = HFConfig(config, problems=top.problems).section("text_config").section("rope_parameters")
    section = tuple(rope.get("mrope_section", [11, 11, 10]))
    if not rope.get("mrope_interleaved", True):
        rope.problems.append("config.json: text_config.rope_parameters.mrope_interleaved (False) is not mapped: "
                             "must be True")
    if len(section) != 3:
        rope.problems.append(f"config.json: text_config.rope_parameters.mrope_section ({show(list(section))}) is not "
                             "mapped: must have 3 entries")
    rope.raise_problems()
    vision = vision_spec(config).model_copy(update={"mrope_section": section})
    try:
        return ModelProfile.model_validate({**cfg.model_dump(), "vision": vision.model_dump()})
    except ValidationError as err:
        raise UnsupportedModel([f"config.json: not mapped: {e['msg'].removeprefix('Value error, ').replace('@', '')}"
                                for e in err.errors()]) from None
