"""qwen3_5_moe (text part): qwen3_next's architecture with un-fused linear-attention projections, every layer MoE,
always-renormalised top-k weights, and a multimodal rotary that is the plain one for text.

Two checkpoint layouts, by model_type:
- qwen3_5_moe (the published vision-language checkpoint, Qwen3_5MoeForConditionalGeneration): config.json holds
  text_config and vision_config; the decoder's keys are model.language_model.*, the LM head lm_head.weight, the
  vision tower model.visual.* (our model.vision, engine/families/vision.py), mtp.* (multi-token prediction, not
  loaded).
- qwen3_5_moe_text (a text-only Qwen3_5MoeForCausalLM saved by transformers): a flat config and model.* keys.
transformers' AutoModelForCausalLM reads either as Qwen3_5MoeForCausalLM (text_config, model.language_model.* ->
model.*, model.visual.* ignored).

Per layer, under the decoder prefix: layers.{i}.{input_layernorm, post_attention_layernorm} ((1 + w) norms),
linear layers layers.{i}.linear_attn.{in_proj_qkv (rows [q | k | v], heads in order), in_proj_z, in_proj_b,
in_proj_a, conv1d, A_log, dt_bias, norm (plain w), out_proj}, full layers layers.{i}.self_attn.* as in qwen3_next,
layers.{i}.mlp.{gate, experts.{gate_up_proj, down_proj} (fused, as published) or experts.{e}.{gate,up,down}_proj
(as save_pretrained writes them), shared_expert.*, shared_expert_gate}, then norm; lm_head.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_tune.profiles.schema import LinearAttentionSpec, ModelProfile

from .base import HFConfig, Recipe, take
from .qwen3_next import Qwen3Next, grouped_rows, hybrid_profile, shared_linear_attention_recipe
from .vision import vision_recipe, with_vision


def split_qkv_recipe(param: str, layer: str, spec: LinearAttentionSpec) -> Recipe:
    """Our gated delta net parameter `param` from the un-fused Qwen3.5 layout under `layer`: in_proj_qkv rows
    [q | k | v], in_proj_z / in_proj_b / in_proj_a as they are."""
    key_dim, value_dim = spec.num_key_heads * spec.key_head_dim, spec.num_value_heads * spec.value_head_dim
    qkv_parts = {"q_proj.weight": 0, "k_proj.weight": 1, "v_proj.weight": 2}
    if param in qkv_parts:
        return grouped_rows(layer + "in_proj_qkv.weight", 1, [key_dim, key_dim, value_dim], qkv_parts[param])
    if param in ("z_proj.weight", "b_proj.weight", "a_proj.weight"):
        return take(layer + "in_proj_" + param[0] + ".weight")
    return shared_linear_attention_recipe(param, layer)


def nested_text_config(config: dict[str, Any], model_type: str) -> HFConfig:
    """The language model's config of a vision-language checkpoint (text_config), checked against the top level."""
    top = HFConfig(config)
    if config.get("text_config") is None:
        top.problems.append(
            f"config.json: text_config is missing (a {model_type} config holds the language model there)"
        )
    c = top.section("text_config")
    # Without its text_config nothing else of the language model can be read.
    top.raise_problems()
    top_tie, text_tie = top.get("tie_word_embeddings"), c.get("tie_word_embeddings")
    if top_tie is not None and text_tie is not None and top_tie != text_tie:
        c.problems.append(
            f"config.json: tie_word_embeddings ({top_tie!r}) is not mapped: must equal "
            f"text_config.tie_word_embeddings ({text_tie!r})"
        )
    return c


class Qwen3_5Moe(Qwen3Next):
    """The vision-language checkpoint: its language model and its vision tower."""

    model_types = ("qwen3_5_moe",)
    # The checkpoint's own class: its module names are the checkpoint's keys (model.language_model.*), so align
    # pairs LoRA adapters by key. On text its language model is the same computation as Qwen3_5MoeForCausalLM.
    reference_class = "Qwen3_5MoeForConditionalGeneration"
    reference_layers = "model.language_model.layers"
    ignored_key_prefixes = ("mtp.",)
    key_prefix = "model.language_model."

    def text_config(self, config: dict[str, Any]) -> HFConfig:
        return nested_text_config(config, "qwen3_5_moe")

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = self.text_config(config)
        # Qwen3_5MoeDecoderLayer always builds the MoE block and its router always renormalises the top-k weights
        # (the text config has no mlp_only_layers, decoder_sparse_step or norm_topk_prob).
        num_layers = c.get("num_hidden_layers") or 0
        return with_vision(hybrid_profile(c, [True] * num_layers, renormalize=True), config)

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        if name.startswith("vision."):
            return vision_recipe(name.removeprefix("vision."), prefix="model.visual.")
        return super().recipe(name, module, cfg)

    def linear_attention_recipe(self, param: str, layer: str, spec: LinearAttentionSpec) -> Recipe:
        return split_qkv_recipe(param, layer, spec)


class Qwen3_5MoeText(Qwen3_5Moe):
    """A text-only Qwen3_5MoeForCausalLM checkpoint: flat config, model.* keys."""

    model_types = ("qwen3_5_moe_text",)
    reference_class = "Qwen3_5MoeForCausalLM"
    reference_layers = "model.layers"
    ignored_key_prefixes = ("mtp.",)
    key_prefix = "model."

    def text_config(self, config: dict[str, Any]) -> HFConfig:
        return HFConfig(config)
