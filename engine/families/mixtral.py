"""mixtral: softmax attention with GQA (no q/k norm, no biases; causal, or within the last `sliding_window` keys
when the config sets one), and on every layer the softmax top-k router over SwiGLU experts, the chosen experts'
weights renormalised to sum to 1 (no shared expert).

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, block_sparse_moe.gate, block_sparse_moe.experts.{e}.{w1 (gate), w2 (down), w3 (up)}},
model.norm, lm_head. Our module names are theirs without `model.`, with mlp for block_sparse_moe; w1 and w3 of each
expert stack into experts.w_gate_up (gate rows first), w2 into experts.w_down.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import MAX_SIZE, Family, HFConfig, Recipe, Rule, quantization_problems, show, stacked_experts, take

PREFIX = "model."
# transformers' MixtralConfig.default_theta: the base of configs that give none.
MIXTRAL_ROPE_THETA = 1_000_000.0
# A window is a count of keys (null: no window).
WINDOW_RULE = Rule("int", 1, MAX_SIZE)


class Mixtral(Family):
    model_types = ("mixtral",)
    reference_class = "MixtralForCausalLM"

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        c.expect("hidden_act", ["silu"], "silu")
        c.expect("attention_dropout", [0, 0.0], 0.0, why="no attention dropout")
        c.expect("router_jitter_noise", [0, 0.0], 0.0, why="no router jitter: training would not be transformers'")
        c.problems += quantization_problems(config)
        num_layers = c.require("num_hidden_layers") or 0
        # The same window on every layer: each query sees the last `sliding_window` keys of its document, itself
        # included (transformers' sliding_window_causal_mask_function).
        window = c.get("sliding_window")
        why = WINDOW_RULE.broken(window) if window is not None else None
        if why is not None:
            c.problems.append(f"config.json: sliding_window ({show(window)}) {why}")
            window = None
        num_experts = c.get("num_local_experts", 8, least=1)
        top_k = c.get("num_experts_per_tok", 2)
        c.at_most("num_experts_per_tok", top_k, "num_local_experts", num_experts)
        vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
        kv_heads = c.get("num_key_value_heads", heads)
        c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        return c.profile(
            vocab_size=vocab,
            hidden_size=hidden,
            layers=[LayerSpec(attention="full", mlp="moe", sliding_window=window) for _ in range(num_layers)],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=c.get("head_dim") or (hidden // heads if hidden and heads else None),
            rope_theta=c.rope_theta(MIXTRAL_ROPE_THETA),
            partial_rotary_factor=c.partial_rotary_factor(),
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            norm_one_plus=False,
            moe=dict(
                num_experts=num_experts,
                top_k=top_k,
                # Mixtral's intermediate_size is each expert's hidden size: every layer is MoE.
                expert_intermediate_size=c.require("intermediate_size", least=1),
                score_func="softmax",
                renormalize=True,
            ),
            attention_output_gate=False,
            attention_qk_norm=False,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        if name == "lm_head.weight":
            return take(PREFIX + "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        if name.endswith("mlp.selection_bias"):
            return None
        if name.endswith("mlp.experts.w_gate_up"):
            base = PREFIX + name.removesuffix("mlp.experts.w_gate_up") + "block_sparse_moe.experts."
            return stacked_experts(module, lambda e: [f"{base}{e}.w1.weight", f"{base}{e}.w3.weight"])
        if name.endswith("mlp.experts.w_down"):
            base = PREFIX + name.removesuffix("mlp.experts.w_down") + "block_sparse_moe.experts."
            return stacked_experts(module, lambda e: [f"{base}{e}.w2.weight"])
        return take(PREFIX + name.replace(".mlp.", ".block_sparse_moe."))
