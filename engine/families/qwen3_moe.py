"""qwen3_moe: softmax attention with GQA and q/k RMSNorm, softmax top-k routed SwiGLU experts (no shared
expert), dense SwiGLU on `mlp_only_layers` / off `decoder_sparse_step`.

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.gate, mlp.experts.{e}.{gate,up,down}_proj | mlp.{gate,up,
down}_proj}, model.norm, lm_head.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import Family, HFConfig, Recipe, common_config, moe_layer_indices, stacked_experts, take


class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    reference_class = "Qwen3MoeForCausalLM"

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        c.expect("hidden_act", ["silu"])
        c.expect("attention_bias", [False], False)
        c.expect("use_sliding_window", [False], False)
        num_layers = c.require("num_hidden_layers") or 0
        num_experts = c.get("num_experts", c.get("num_local_experts", 0))
        is_moe = moe_layer_indices(num_layers, c) if num_experts else [False] * num_layers
        layers = [LayerSpec(attention="full", mlp="moe" if moe else "dense") for moe in is_moe]
        moe = None
        if any(is_moe):
            top_k = c.require("num_experts_per_tok")
            c.at_most("num_experts_per_tok", top_k, "num_experts", num_experts)
            moe = dict(
                num_experts=num_experts,
                top_k=top_k,
                expert_intermediate_size=c.require("moe_intermediate_size"),
                score_func="softmax",
                renormalize=c.get("norm_topk_prob", False),
            )
        rope_theta = c.rope_theta()
        vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
        kv_heads = c.get("num_key_value_heads", heads)
        c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        return c.profile(
            vocab_size=vocab,
            hidden_size=hidden,
            layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # transformers derives an absent head_dim (getattr's default) but fails on an explicit null.
            head_dim=c.get("head_dim", hidden // heads if hidden and heads else None, is_null_refused=True),
            intermediate_size=c.get("intermediate_size", 0) if not all(is_moe) else 0,
            rope_theta=rope_theta,
            partial_rotary_factor=c.partial_rotary_factor(),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            norm_one_plus=False,
            moe=moe,
            attention_output_gate=False,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        return qwen_recipe(name, module)

    def to_config(self, model: ModelProfile) -> dict[str, Any]:
        return qwen3_moe_config(model)


def qwen_recipe(name: str, module: nn.Module, prefix: str = "model.") -> Recipe:
    """The naming the Qwen MoE families share: our module names are theirs under `prefix`, the routed experts are
    stored per expert, and the selection bias is ours alone."""
    if name == "lm_head.weight":
        return take("lm_head.weight")
    if name.endswith("mlp.selection_bias"):
        return None
    if name.endswith("mlp.experts.w_gate_up"):
        base = prefix + name.removesuffix("w_gate_up")
        return stacked_experts(module, lambda e: [f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"])
    if name.endswith("mlp.experts.w_down"):
        base = prefix + name.removesuffix("w_down")
        return stacked_experts(module, lambda e: [f"{base}{e}.down_proj.weight"])
    return take(prefix + name)


def qwen3_moe_config(model: ModelProfile) -> dict[str, Any]:
    """config.json of a transformers qwen3_moe for `model`, written from what Qwen3MoeForCausalLM runs: full
    attention with whole-head RoPE, plain norms, softmax routing without shared experts or a selection bias. Fields
    it has no place for are left out; engine/families/hub_config.py reads the config back and names what differs."""
    moe = model.moe
    config: dict[str, Any] = dict(
        **common_config(model),
        model_type="qwen3_moe",
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        use_sliding_window=False,
        mlp_only_layers=[i for i, layer in enumerate(model.layers) if layer.mlp == "dense"],
        decoder_sparse_step=1,
        num_experts=moe.num_experts if moe else 0,
    )
    if model.intermediate_size:
        config["intermediate_size"] = model.intermediate_size
    if moe:
        config.update(num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_intermediate_size,
                      norm_topk_prob=moe.renormalize)
    return config
