"""glm4_moe (GLM-4.5, GLM-4.5-Air, GLM-4.6): softmax attention with GQA, q/k/v biases (`attention_bias`), optional
q/k RMSNorm (`use_qk_norm`) and rotate-half RoPE on the first `partial_rotary_factor` of each head's dims (0.5 when
the config gives none); dense SwiGLU on the first `first_k_dense_replace` layers, then sigmoid-scored routed SwiGLU
experts whose choice adds the correction bias and is limited to the best `topk_group` of `n_group` groups, the
chosen weights renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`, plus an ungated shared expert
of `n_shared_experts` x `moe_intermediate_size`.

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj (dense
layers) | mlp.{gate.weight, gate.e_score_correction_bias, experts.{e}.{gate,up,down}_proj,
shared_experts.{gate,up,down}_proj}}, model.norm, lm_head. Our module names are theirs without `model.`, except
the MoE layer's: selection_bias <- gate.e_score_correction_bias, experts.w_gate_up / w_down <- the per-expert
projections stacked, shared_expert <- shared_experts. The multi-token-prediction layers that follow the decoder
(`num_nextn_predict_layers`) are not loaded, as transformers does not load them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import Family, HFConfig, Recipe, quantization_problems
from .deepseek_v3 import deepseek_recipe

# transformers' Glm4MoeConfig sets partial_rotary_factor 0.5 where config.json gives none.
GLM_PARTIAL_ROTARY_FACTOR = 0.5
# The multi-token-prediction layer of GLM-4.5 / 4.6 (92 decoder layers) and GLM-4.5-Air (46): transformers'
# Glm4MoePreTrainedModel drops these two prefixes when it loads, and so do we.
MTP_LAYER_PREFIXES = ("model.layers.92.", "model.layers.46.")


class Glm4Moe(Family):
    model_types = ("glm4_moe",)
    reference_class = "Glm4MoeForCausalLM"
    ignored_key_prefixes = MTP_LAYER_PREFIXES

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        c.expect("hidden_act", ["silu"], "silu")
        c.expect("attention_dropout", [0, 0.0], 0.0, why="no attention dropout")
        c.problems += quantization_problems(config)
        use_qk_norm = c.expect("use_qk_norm", [False, True], False)
        c.get("num_nextn_predict_layers")
        num_layers = c.require("num_hidden_layers") or 0
        first_dense = c.get("first_k_dense_replace", 1)
        is_moe = [i >= first_dense for i in range(num_layers)]
        vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
        kv_heads = c.get("num_key_value_heads", heads)
        c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        return c.profile(
            vocab_size=vocab,
            hidden_size=hidden,
            layers=[LayerSpec(attention="full", mlp="moe" if moe else "dense") for moe in is_moe],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # transformers derives an absent head_dim (getattr's default) but fails on an explicit null.
            head_dim=c.get("head_dim", hidden // heads if hidden and heads else None, is_null_refused=True),
            intermediate_size=c.require("intermediate_size", least=1) if not all(is_moe) else 0,
            rope_theta=c.rope_theta(),
            partial_rotary_factor=c.partial_rotary_factor(GLM_PARTIAL_ROTARY_FACTOR),
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            norm_one_plus=False,
            moe=self.moe_fields(c) if any(is_moe) else None,
            attention_output_gate=False,
            attention_qk_norm=use_qk_norm is True,
            attention_bias=c.get("attention_bias", False),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )

    def moe_fields(self, c: HFConfig) -> dict[str, Any]:
        expert_hidden = c.require("moe_intermediate_size") or 0
        num_experts, top_k = c.require("n_routed_experts"), c.require("num_experts_per_tok")
        n_group, topk_group = c.get("n_group", 1), c.get("topk_group", 1)
        c.at_most("num_experts_per_tok", top_k, "n_routed_experts", num_experts)
        c.multiple_of("n_routed_experts", num_experts, "n_group", n_group)
        c.at_most("topk_group", topk_group, "n_group", n_group)
        # transformers builds a shared expert of width 0 for n_shared_experts 0, whose empty tensors nothing maps.
        num_shared = c.get("n_shared_experts", 1, least=1)
        return dict(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_hidden,
            score_func="sigmoid",
            renormalize=c.get("norm_topk_prob", True),
            routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
            shared_expert_intermediate_size=num_shared * expert_hidden,
            shared_expert_gate=False,
            n_group=n_group,
            topk_group=topk_group,
            # The checkpoint's e_score_correction_bias shifts the choice even when fine-tuning does not update it.
            has_selection_bias=True,
        )

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        return deepseek_recipe(name, module, cfg)

