"""kimi_linear: hybrid of Kimi delta attention (KDA, per-channel decay) and multi-head latent attention without
RoPE, plain RMSNorms, DeepSeek-V3-style routing (sigmoid scores, correction bias for the choice, optional groups,
renormalised, routed scaling) over SwiGLU experts plus an ungated shared expert; the first layer(s) dense.

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm},
KDA layers model.layers.{i}.self_attn.{q,k,v}_proj, {q,k,v}_conv1d [C, 1, W], f_a_proj, f_b_proj, A_log [1, 1, H, 1],
dt_bias, b_proj, g_a_proj, g_b_proj, o_norm, o_proj; MLA layers model.layers.{i}.self_attn.{q_proj | q_a_proj,
q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; MoE layers
model.layers.{i}.block_sparse_moe.{gate.weight, gate.e_score_correction_bias, experts.{e}.{w1 (gate), w2 (down),
w3 (up)}, shared_experts.{gate,up,down}_proj}; dense layers model.layers.{i}.block_sparse_moe.{gate,up,down}_proj;
model.norm, lm_head. (transformers renames block_sparse_moe to mlp and moves f_a/f_b/A_log/dt_bias under
self_attn.forget_gate when it loads.)

Config: transformers writes layer_types / mlp_layer_types and the attribute-mapped names (num_experts,
num_experts_per_token, moe_renormalize, num_expert_group, num_shared_experts); the original hub config has
linear_attn_config {full_attn_layers, kda_layers (1-based), head_dim, num_heads, short_conv_kernel_size} and
first_k_dense_replace instead. Both are read, with transformers' defaults and precedence.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import Family, HFConfig, Recipe, common_config, concat, show, stacked_experts, take

# transformers' layer_types / mlp_layer_types values and our layer kinds.
ATTENTION_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MLP_KINDS = {"dense": "dense", "sparse": "moe"}
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(.+)")


def _first(c: HFConfig, names: tuple[str, ...], default: Any, least: int | None = None) -> Any:
    """The value under the first of `names` present in config.json (transformers' attribute-mapped name first)."""
    for name in names:
        if c.data.get(name) is not None:
            return c.get(name, default, least=least)
    return default


def _check_kinds(c: HFConfig, key: str, kinds: list[Any], allowed: dict[str, str], num_layers: int) -> None:
    if len(kinds) != num_layers:
        c.problems.append(f"config.json: {c.prefix}{key} has {len(kinds)} entries, num_hidden_layers is {num_layers}")
    for i, kind in enumerate(kinds):
        if kind not in allowed:
            c.problems.append(
                f"config.json: {c.prefix}{key}[{i}] ({show(kind)}) is not mapped: must be one of {list(allowed)}"
            )


def layer_types(c: HFConfig, num_layers: int) -> list[str]:
    """transformers' precedence: layer_types > linear_attn_config's 1-based full_attn_layers / kda_layers > every
    4th layer full (layers 4, 8, ...)."""
    types = c.get("layer_types")
    linear_cfg = c.section("linear_attn_config")
    if types is None and "full_attn_layers" in linear_cfg.data and "kda_layers" in linear_cfg.data:
        types = [None] * num_layers
        for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
            for layer in linear_cfg.get(key, []):
                if 1 <= layer <= num_layers:
                    types[layer - 1] = kind
                else:
                    c.problems.append(f"config.json: linear_attn_config layer {layer} is outside 1..{num_layers}")
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    _check_kinds(c, "layer_types", types, ATTENTION_KINDS, num_layers)
    return list(types)


def mlp_layer_types(c: HFConfig, num_layers: int) -> list[str]:
    """mlp_layer_types, or the first first_k_dense_replace (default 1) layers dense and the rest MoE."""
    types = c.get("mlp_layer_types")
    if types is None:
        first_dense = c.get("first_k_dense_replace", 1)
        types = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    _check_kinds(c, "mlp_layer_types", types, MLP_KINDS, num_layers)
    return list(types)


class KimiLinear(Family):
    model_types = ("kimi_linear",)
    reference_class = "KimiLinearForCausalLM"
    # transformers' KimiLinearTopkRouter at model.layers.{i}.mlp.gate returns (logits, weights, indices): the
    # base class's defaults (router suffix, topk ids, decoder layers returning a tensor) hold.

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        c.expect("hidden_act", ["silu"], "silu", why="also the conv activation of the KDA layers")
        c.expect("attention_bias", [False], False)
        c.expect("attention_dropout", [0, 0.0, None], 0.0, why="moe-tune has no attention dropout")
        # transformers' MLA never applies RoPE and its router is always sigmoid and grouped: a config asking for
        # something else (the original remote code honours these fields) describes a model the reference and we would
        # run differently from its training. Absent fields take transformers' meaning.
        c.expect("mla_use_nope", [True], True, why="transformers' MLA has no RoPE")
        c.expect("moe_router_activation_func", ["sigmoid"], "sigmoid")
        c.expect("moe_layer_freq", [1], 1, why="transformers reads the MoE layers from mlp_layer_types")
        c.expect("num_nextn_predict_layers", [0], 0, why="multi-token prediction layers are not mapped")
        num_layers = c.require("num_hidden_layers") or 0
        kinds = layer_types(c, num_layers)
        mlps = mlp_layer_types(c, num_layers)
        layers = [
            LayerSpec(attention=ATTENTION_KINDS.get(kind, "kda"), mlp=MLP_KINDS.get(mlp, "dense"))
            for kind, mlp in zip(kinds, mlps)
        ]
        heads = c.require("num_attention_heads")
        if heads is not None:
            c.expect("num_key_value_heads", [heads, None], heads, why="MLA expands keys and values for every head")

        kda = None
        if "linear_attention" in kinds:
            linear_cfg = c.section("linear_attn_config")
            kda = dict(
                num_heads=linear_cfg.get("num_heads", c.get("linear_num_heads", 32)),
                head_dim=linear_cfg.get("head_dim", c.get("linear_head_dim", 128)),
                conv_kernel_size=linear_cfg.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
            )
        mla = None
        if "full_attention" in kinds:
            mla = dict(
                q_lora_rank=c.get("q_lora_rank"),
                kv_lora_rank=c.get("kv_lora_rank", 512),
                qk_nope_head_dim=c.get("qk_nope_head_dim", 128),
                qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
                v_head_dim=c.get("v_head_dim") or 128,
                rope="none",
                # transformers' Kimi MLA norms both latents with the RMSNorm default epsilon, not rms_norm_eps.
                latent_norm_eps=1e-6,
            )
        moe = None
        if "sparse" in mlps:
            n_group, topk_group = _first(c, ("num_expert_group", "n_group"), 1), c.get("topk_group", 1)
            c.at_most("topk_group", topk_group, "num_expert_group", n_group)
            if topk_group < n_group:
                c.expect("use_grouped_topk", [True], True, why="transformers always routes through the groups")
            expert_size = c.get("moe_intermediate_size", 1024)
            num_experts = _first(c, ("num_experts", "num_local_experts"), 256, least=1)
            top_k = _first(c, ("num_experts_per_token", "num_experts_per_tok"), 8)
            c.at_most("num_experts_per_tok", top_k, "num_experts", num_experts)
            moe = dict(
                num_experts=num_experts,
                top_k=top_k,
                expert_intermediate_size=expert_size,
                score_func="sigmoid",
                renormalize=_first(c, ("moe_renormalize", "norm_topk_prob"), True),
                routed_scaling=c.get("routed_scaling_factor", 2.446),
                n_group=n_group,
                topk_group=topk_group,
                # The checkpoint's e_score_correction_bias shifts the choice even when fine-tuning does not update it.
                has_selection_bias=True,
                shared_expert_intermediate_size=expert_size * _first(c, ("num_shared_experts", "n_shared_experts"), 1),
                shared_expert_gate=False,
            )
        hidden = c.require("hidden_size")
        # Read by no kimi layer (MLA carries its own dims); the schema wants one.
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else (hidden or 0) // (heads or 1)
        fields = dict(
            vocab_size=c.require("vocab_size"),
            hidden_size=hidden,
            layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=head_dim,
            intermediate_size=c.get("intermediate_size", 9216) if "dense" in mlps else 0,
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            norm_one_plus=False,
            kda_attention=kda,
            mla=mla,
            moe=moe,
            attention_output_gate=False,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )
        return c.profile(**fields)

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        if name == "lm_head.weight":
            return take("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        match = _LAYER_PARAM.fullmatch(name)
        if match is None:
            return take(f"model.{name}")
        index, part, param = match.groups()
        layer = f"model.layers.{index}."
        if part == "mlp":
            return self.mlp_recipe(param, layer + "block_sparse_moe.", module)
        if cfg.layers[int(index)].attention == "kda":
            return self.kda_recipe(param, layer + "self_attn.")
        return take(f"{layer}self_attn.{param}")

    def kda_recipe(self, param: str, layer: str) -> Recipe:
        """Our KimiDeltaAttention parameter `param` from the keys under `layer`."""
        if param == "conv.weight":
            # Three depthwise convs [C, 1, W] side by side as our one [3C, W].
            convs = concat([f"{layer}{p}_conv1d.weight" for p in "qkv"])
            return lambda get: convs(get).squeeze(1)
        if param == "A_log":
            return lambda get: get(f"{layer}A_log").reshape(-1)
        return take(layer + param)

    def mlp_recipe(self, param: str, block: str, module: nn.Module) -> Recipe:
        """Our MoEBlock or DenseMLP parameter `param` (under `mlp.`) from the keys under `block`."""
        if param == "selection_bias":
            return take(block + "gate.e_score_correction_bias")
        if param == "experts.w_gate_up":
            return stacked_experts(module, lambda e: [f"{block}experts.{e}.w1.weight", f"{block}experts.{e}.w3.weight"])
        if param == "experts.w_down":
            return stacked_experts(module, lambda e: [f"{block}experts.{e}.w2.weight"])
        if param.startswith("shared_expert."):
            return take(block + "shared_experts." + param.removeprefix("shared_expert."))
        return take(block + param)

    def to_config(self, model: ModelProfile) -> dict[str, Any]:
        """config.json of a transformers kimi_linear for `model`: the inverse of to_profile, written from what
        transformers runs (KDA and RoPE-less MLA layers, plain norms, sigmoid group routing with a correction bias
        and an ungated shared expert). Fields it has no place for are left out; engine/families/hub_config.py
        reads the config back and names what differs."""
        kda, mla, moe = model.kda_attention, model.mla, model.moe
        config: dict[str, Any] = dict(
            **common_config(model),
            model_type="kimi_linear",
            layer_types=["linear_attention" if layer.attention == "kda" else "full_attention"
                         for layer in model.layers],
            mlp_layer_types=["sparse" if layer.mlp == "moe" else "dense" for layer in model.layers],
            num_key_value_heads=model.num_attention_heads,
            num_nextn_predict_layers=0,
            # transformers' defaults are Kimi's own token ids, outside a smaller vocabulary.
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        if model.intermediate_size:
            config["intermediate_size"] = model.intermediate_size
        if kda:
            config.update(linear_num_heads=kda.num_heads, linear_head_dim=kda.head_dim,
                          linear_conv_kernel_dim=kda.conv_kernel_size)
        if mla:
            config.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                          qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                          v_head_dim=mla.v_head_dim)
        if moe:
            # The shared expert is n_shared_experts routed experts wide; transformers always builds one, so without
            # it the default count reads back.
            shared = moe.shared_expert_intermediate_size // moe.expert_intermediate_size
            config.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                          moe_intermediate_size=moe.expert_intermediate_size,
                          n_group=moe.n_group, topk_group=moe.topk_group, use_grouped_topk=True,
                          norm_topk_prob=moe.renormalize, routed_scaling_factor=moe.routed_scaling)
            if shared:
                config["n_shared_experts"] = shared
        return config
