"""deepseek_v3: multi-head latent attention (MLA, interleaved RoPE on the rotary dims), dense SwiGLU on the first
`first_k_dense_replace` layers, then sigmoid-scored routed SwiGLU experts with an aux-loss-free correction bias,
group-limited choice (n_group, topk_group), renormalised and scaled weights, and an ungated shared expert.

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj},
mlp.{gate_proj, up_proj, down_proj} (dense layers) | mlp.{gate.weight, gate.e_score_correction_bias,
experts.{e}.{gate,up,down}_proj, shared_experts.{gate,up,down}_proj}}, model.norm, lm_head.
Our module names are theirs without `model.`, except the MoE layer's: selection_bias <- gate.e_score_correction_bias,
experts.w_gate_up / w_down <- the per-expert projections stacked, shared_expert <- shared_experts.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import Family, HFConfig, Recipe, common_config, quantization_problems, show, stacked_experts, take

PREFIX = "model."
# Transformers drops DeepSeek-V3's multi-token-prediction layer (model.layers.61) when it loads; so do we.
MTP_LAYER_PREFIX = "model.layers.61."


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class DeepseekV3(Family):
    model_types = ("deepseek_v3",)
    reference_class = "DeepseekV3ForCausalLM"
    ignored_key_prefixes = (MTP_LAYER_PREFIX,)
    # Whether transformers' rotary embedding runs on config.json's head_dim (DeepseekV3Config writes head_dim =
    # qk_rope_head_dim, but a head_dim given in the file replaces it; null falls back to hidden // heads).
    is_head_dim_rotary: bool = True

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        num_layers = c.require("num_hidden_layers") or 0
        is_moe = self.moe_layers(c, num_layers)
        heads = c.require("num_attention_heads")
        if heads is not None:
            c.expect("num_key_value_heads", [heads, None], heads, why="MLA expands keys and values for every head")
        c.expect("hidden_act", ["silu"], "silu")
        c.expect("attention_dropout", [0, 0.0], 0.0, why="no attention dropout")
        c.expect("pretraining_tp", [1], 1)
        c.problems += quantization_problems(config)
        mla = self.mla_fields(c)
        sparse = self.sparse_fields(c)
        moe = self.moe_fields(c) if any(is_moe) else None
        fields = dict(
            vocab_size=c.require("vocab_size"),
            hidden_size=c.require("hidden_size"),
            layers=[LayerSpec(attention=self.attention_kind, mlp="moe" if m else "dense") for m in is_moe],
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=(mla["qk_nope_head_dim"] or 0) + (mla["qk_rope_head_dim"] or 0),
            intermediate_size=c.get("intermediate_size", 0) if not all(is_moe) else 0,
            rope_theta=self.rope_theta(c),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            norm_one_plus=False,
            sparse_attention=sparse,
            mla=mla,
            moe=moe,
            attention_output_gate=False,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )
        return c.profile(**fields)

    # The layer kind of every decoder layer.
    attention_kind = "mla"

    def rope_kind(self, c: HFConfig) -> str:
        return "interleaved" if c.get("rope_interleave", True) else "half"

    def sparse_fields(self, c: HFConfig) -> dict[str, Any] | None:
        return None

    def moe_layers(self, c: HFConfig, num_layers: int) -> list[bool]:
        c.expect("moe_layer_freq", [1], 1, why="transformers makes every layer from first_k_dense_replace on MoE")
        first_dense = c.get("first_k_dense_replace", 3) or 0
        return [i >= first_dense for i in range(num_layers)]

    def mla_fields(self, c: HFConfig) -> dict[str, Any]:
        c.expect("attention_bias", [False], False)
        nope, rope = c.require("qk_nope_head_dim"), c.require("qk_rope_head_dim")
        # Any head_dim but qk_rope_head_dim would rotate other dims than the query's and key's rope parts.
        head_dim = c.get("head_dim", rope, is_null_refused=True)
        if self.is_head_dim_rotary and isinstance(head_dim, int) and isinstance(rope, int) and head_dim != rope:
            c.problems.append(f"config.json: {c.prefix}head_dim ({head_dim}) is not mapped: must equal "
                              f"{c.prefix}qk_rope_head_dim ({rope}), the dims transformers rotates")
        yarn, mscale = self.yarn_fields(c)
        return dict(
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c.require("kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=c.require("v_head_dim"),
            rope=self.rope_kind(c),
            # In transformers' order of operations: qk_head_dim ** -0.5 * mscale * mscale.
            softmax_scale=(nope + rope) ** -0.5 * mscale * mscale if mscale != 1.0 and nope and rope else None,
            # transformers' DeepSeek MLA norms both latents with the RMSNorm default epsilon, not rms_norm_eps.
            latent_norm_eps=1e-6,
            yarn=yarn,
        )

    def rope_theta(self, c: HFConfig) -> float:
        return float(c.rope().get("rope_theta", c.get("rope_theta", 10000.0)))

    def yarn_fields(self, c: HFConfig) -> tuple[dict[str, Any] | None, float]:
        """YaRN as transformers applies it to DeepSeek's MLA: (the YarnSpec fields, or None for default RoPE; the
        mscale whose square multiplies the softmax scale)."""
        rope = c.rope()
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            return None, 1.0
        if kind != "yarn":
            c.problems.append(f"config.json: rope_parameters.rope_type ({show(kind)}) is not mapped: must be one of "
                              "['default', 'yarn']")
            return None, 1.0
        original = rope.get("original_max_position_embeddings")
        if original is None:
            c.problems.append("config.json: rope_parameters.original_max_position_embeddings is missing (yarn)")
            return None, 1.0
        factor = rope.get("factor") or c.get("max_position_embeddings", original) / original
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        fields = dict(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            attention_factor=attention_factor,
            truncate=rope.get("truncate", True),
        )
        # transformers' MLA multiplies its softmax scale by mscale(factor, mscale_all_dim) squared.
        return fields, yarn_mscale(rope.get("factor") or factor, mscale_all_dim) if mscale_all_dim else 1.0

    def moe_fields(self, c: HFConfig) -> dict[str, Any]:
        c.expect("scoring_func", ["sigmoid"], "sigmoid", why="transformers' DeepSeek-V3 router scores by sigmoid")
        c.expect("topk_method", ["noaux_tc"], "noaux_tc", why="transformers' router is the group-limited noaux_tc")
        expert_hidden = c.require("moe_intermediate_size") or 0
        num_experts, top_k = c.require("n_routed_experts"), c.require("num_experts_per_tok")
        n_group, topk_group = c.require("n_group"), c.require("topk_group")
        c.at_most("num_experts_per_tok", top_k, "n_routed_experts", num_experts)
        c.multiple_of("n_routed_experts", num_experts, "n_group", n_group)
        c.at_most("topk_group", topk_group, "n_group", n_group)
        return dict(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_hidden,
            score_func="sigmoid",
            renormalize=c.get("norm_topk_prob", True),
            routed_scaling=float(c.get("routed_scaling_factor", 2.5)),
            shared_expert_intermediate_size=c.get("n_shared_experts", 1) * expert_hidden,
            shared_expert_gate=False,
            n_group=n_group,
            topk_group=topk_group,
            # The checkpoint's e_score_correction_bias shifts the choice even when fine-tuning does not update it.
            has_selection_bias=True,
        )

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        return deepseek_recipe(name, module, cfg)

    def to_config(self, model: ModelProfile) -> dict[str, Any]:
        """config.json of this model type for `model`: the inverse of to_profile, written from what transformers
        runs (MLA on every layer, dense layers first, sigmoid group routing with a correction bias and an ungated
        shared expert). deepseek_v32 reads the indexer fields and mlp_layer_types too; deepseek_v3 ignores them.
        Fields it has no place for are left out; engine/families/hub_config.py reads the config back and names
        what differs."""
        mla, moe, sparse = model.mla, model.moe, model.sparse_attention
        is_dense = [layer.mlp == "dense" for layer in model.layers]
        leading_dense = next((i for i, dense in enumerate(is_dense) if not dense), len(is_dense))
        config: dict[str, Any] = dict(
            **common_config(model),
            model_type=self.model_types[0],
            num_key_value_heads=model.num_attention_heads,
            first_k_dense_replace=leading_dense,
            mlp_layer_types=["dense" if dense else "sparse" for dense in is_dense],
            moe_layer_freq=1,
            rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        )
        if model.intermediate_size:
            config["intermediate_size"] = model.intermediate_size
        if mla:
            config.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                          qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                          v_head_dim=mla.v_head_dim, rope_interleave=mla.rope == "interleaved")
            if mla.yarn:
                yarn = mla.yarn
                config["rope_parameters"] = dict(
                    rope_type="yarn", rope_theta=model.rope_theta, factor=yarn.factor,
                    original_max_position_embeddings=yarn.original_max_position_embeddings,
                    beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, attention_factor=yarn.attention_factor,
                    truncate=yarn.truncate,
                )
        if moe:
            # The shared expert is n_shared_experts routed experts wide; transformers always builds one, so without
            # it the default count reads back.
            shared = moe.shared_expert_intermediate_size // moe.expert_intermediate_size
            config.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                          moe_intermediate_size=moe.expert_intermediate_size,
                          n_group=moe.n_group, topk_group=moe.topk_group, norm_topk_prob=moe.renormalize,
                          routed_scaling_factor=moe.routed_scaling, scoring_func="sigmoid", topk_method="noaux_tc")
            if shared:
                config["n_shared_experts"] = shared
        if sparse:
            config.update(index_n_heads=sparse.index_heads, index_head_dim=sparse.index_head_dim,
                          index_topk=sparse.topk)
        return config



def deepseek_recipe(name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
    """Our tensor `name` from the DeepSeek-V3 key layout (glm4_moe stores its tensors alike): our names under
    `model.`, the router's correction bias as our selection bias, per-expert gate/up/down stacked into our grouped
    experts, `shared_experts` for our shared expert."""
    if name == "lm_head.weight":
        return take(PREFIX + "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    if name.endswith("mlp.selection_bias"):
        return take(PREFIX + name.removesuffix("selection_bias") + "gate.e_score_correction_bias")
    if name.endswith("mlp.experts.w_gate_up"):
        base = PREFIX + name.removesuffix("w_gate_up")
        return stacked_experts(module, lambda e: [f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"])
    if name.endswith("mlp.experts.w_down"):
        base = PREFIX + name.removesuffix("w_down")
        return stacked_experts(module, lambda e: [f"{base}{e}.down_proj.weight"])
    return take(PREFIX + name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
