"""qwen3_next: hybrid of gated delta net (linear attention) and gated full attention, (1 + w) RMSNorms, partial
RoPE, softmax top-k routed SwiGLU experts plus a sigmoid-gated shared expert.

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm},
linear layers model.layers.{i}.linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm, out_proj},
full layers model.layers.{i}.self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, MoE layers model.layers.{i}.mlp.{gate,
experts.{e}.{gate,up,down}_proj (or fused: experts.gate_up_proj, experts.down_proj), shared_expert.{gate,up,
down}_proj, shared_expert_gate}, dense layers model.layers.{i}.mlp.{gate,up,down}_proj, model.norm, lm_head;
mtp.* (multi-token prediction) is not loaded.

in_proj_qkvz and in_proj_ba are interleaved per key-head group g (transformers' fix_query_key_value_ordering):
qkvz rows are [q_g (K) | k_g (K) | v_g (G*V) | z_g (G*V)] for g = 0..Hk-1 and ba rows are [b_g (G) | a_g (G)], with
G = Hv / Hk value heads per key head; value head g*G + j belongs to key head g. conv1d runs over cat(q, k, v) with
the groups undone (all q heads, then all k, then all v), the order of our ShortConv.

Shapes: D model dim, Hk key heads of dim K, Hv value heads of dim V, G = Hv / Hk, W conv width.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from moe_tune.profiles.schema import LinearAttentionSpec, ModelProfile

from .base import Family, Fp8Weight, HFConfig, Recipe, common_config, fp8_row_gather, moe_layer_indices, show, take
from .qwen3_moe import qwen_recipe

# transformers' layer_types values and our token mixers.
LAYER_KINDS = {"linear_attention": "linear", "full_attention": "full"}
_LINEAR_PARAM = re.compile(r"layers\.(\d+)\.self_attn\.(.+)")


def layer_types(
    c: HFConfig, num_layers: int, known: dict[str, str] = LAYER_KINDS, periodic: str = "full_attention"
) -> list[str]:
    """config.layer_types, each checked against `known`, or the pattern transformers derives from
    full_attention_interval (every n-th layer `periodic`, default 4, the rest linear) when a config has none."""
    types = c.get("layer_types")
    if types is None:
        interval = c.get("full_attention_interval", 4)
        return [periodic if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        c.problems.append(
            f"config.json: {c.prefix}layer_types has {len(types)} entries, num_hidden_layers is {num_layers}"
        )
    for i, kind in enumerate(types):
        if kind not in known:
            c.problems.append(
                f"config.json: {c.prefix}layer_types[{i}] ({show(kind)}) is not mapped: must be one of {list(known)}"
            )
    return list(types)


def hybrid_profile(c: HFConfig, is_moe: list[bool], renormalize: bool) -> ModelProfile:
    """The ModelProfile of a qwen3_next-style text config (qwen3_next, qwen3_5_moe's text_config): reads and checks
    every field both share, raises UnsupportedModel with all problems at once."""
    c.expect("hidden_act", ["silu"], "silu", why="also the conv activation of the linear layers")
    c.expect("attention_bias", [False], False)
    c.expect("attention_dropout", [0, 0.0], 0.0, why="moe-tune has no attention dropout")
    # Some configs spell out the output gate; transformers always applies it.
    c.expect("attn_output_gate", [True], True, why="transformers' attention always has the output gate")
    num_layers = c.require("num_hidden_layers") or 0
    kinds = layer_types(c, num_layers)
    moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    moe = {f: c.require(f, least=1) for f in moe_fields} if any(is_moe) else {}
    if moe:
        c.at_most("num_experts_per_tok", moe["num_experts_per_tok"], "num_experts", moe["num_experts"])
    linear_fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    linear = {f: c.require(f) for f in linear_fields} if "linear_attention" in kinds else {}
    # RoPE: rope_type must be default. qwen3_5_moe's mrope_section / mrope_interleaved only matter when the three
    # position streams (time, height, width) differ, i.e. for image tokens; for text all three are the token
    # position and the multimodal rotary is the plain one.
    rope_theta = c.rope_theta()
    # transformers defaults these configs to a quarter of each head rotated (Qwen3NextConfig.__post_init__).
    partial_rotary_factor = c.partial_rotary_factor(0.25)
    vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
    # No defaults of our own for these: transformers' class defaults (2 KV heads, head_dim 256, a 512-wide shared
    # expert) differ from the usual fallbacks, and configs saved by transformers always list them.
    kv_heads, head_dim = c.require("num_key_value_heads"), c.require("head_dim")
    c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    if linear:
        c.multiple_of("linear_num_value_heads", linear["linear_num_value_heads"], "linear_num_key_heads",
                      linear["linear_num_key_heads"])
    shared = c.require("shared_expert_intermediate_size") if moe else 0
    return c.profile(
        vocab_size=vocab,
        hidden_size=hidden,
        layers=[
            dict(attention=LAYER_KINDS.get(kind), mlp="moe" if is_moe_layer else "dense")
            for kind, is_moe_layer in zip(kinds, is_moe)
        ],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=c.get("intermediate_size", 0) if not all(is_moe) else 0,
        rope_theta=rope_theta,
        partial_rotary_factor=partial_rotary_factor,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        norm_one_plus=True,
        linear_attention=dict(
            num_key_heads=linear["linear_num_key_heads"],
            num_value_heads=linear["linear_num_value_heads"],
            key_head_dim=linear["linear_key_head_dim"],
            value_head_dim=linear["linear_value_head_dim"],
            conv_kernel_size=c.get("linear_conv_kernel_dim", 4),
            decay="scalar",
        ) if linear else None,
        moe=dict(
            num_experts=moe["num_experts"],
            top_k=moe["num_experts_per_tok"],
            expert_intermediate_size=moe["moe_intermediate_size"],
            score_func="softmax",
            renormalize=renormalize,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=True,
        ) if moe else None,
        attention_output_gate=True,
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        init_std=c.get("initializer_range", 0.02),
    )


class Qwen3Next(Family):
    model_types = ("qwen3_next",)
    reference_class = "Qwen3NextForCausalLM"
    ignored_key_prefixes = ("mtp.",)
    # Where the decoder's keys live in the checkpoint.
    key_prefix = "model."

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = self.text_config(config)
        num_layers = c.get("num_hidden_layers") or 0
        is_moe = moe_layer_indices(num_layers, c) if c.get("num_experts", 0) else [False] * num_layers
        return hybrid_profile(c, is_moe, renormalize=c.get("norm_topk_prob", True))

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        match = _LINEAR_PARAM.fullmatch(name)
        if match is not None and cfg.layers[int(match.group(1))].attention == "linear":
            layer = f"{self.key_prefix}layers.{match.group(1)}.linear_attn."
            return self.linear_attention_recipe(match.group(2), layer, cfg.linear_attention)
        if name.endswith(("mlp.experts.w_gate_up", "mlp.experts.w_down")):
            return fused_or_per_expert(name, module, self.key_prefix)
        return qwen_recipe(name, module, prefix=self.key_prefix)

    def linear_attention_recipe(self, param: str, layer: str, spec: LinearAttentionSpec) -> Recipe:
        """Our GatedDeltaNet parameter `param` (e.g. `q_proj.weight`) from the keys under `layer`."""
        hk, hv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
        group = hv // hk
        qkvz_parts = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "z_proj": 3}
        ba_parts = {"b_proj": 0, "a_proj": 1}
        proj = param.removesuffix(".weight")
        if proj in qkvz_parts:
            return grouped_rows(layer + "in_proj_qkvz.weight", hk, [dk, dk, group * dv, group * dv], qkvz_parts[proj])
        if proj in ba_parts:
            return grouped_rows(layer + "in_proj_ba.weight", hk, [group, group], ba_parts[proj])
        return shared_linear_attention_recipe(param, layer)

    def to_config(self, model: ModelProfile) -> dict[str, Any]:
        """The flat (text-only) config.json of this model type for `model`."""
        return {"model_type": self.model_types[0], **hybrid_config(model)}


class grouped_rows:
    """Recipe: rows of a projection stored as `num_groups` blocks of [part 0 | part 1 | ...] (`sizes` rows each):
    part `part` of every block, blocks in order -> [num_groups * sizes[part], D]. A tensor of another row count
    comes back whole, so the loader reports its shape against ours. The adapter export reads `row_indices`."""

    def __init__(self, key: str, num_groups: int, sizes: list[int], part: int):
        self.key, self.num_groups, self.sizes, self.part = key, num_groups, list(sizes), part

    def __call__(self, get) -> torch.Tensor:
        w = get(self.key)
        if w.dim() != 2 or w.shape[0] != self.num_groups * sum(self.sizes):
            return w
        blocks = w.view(self.num_groups, sum(self.sizes), w.shape[-1]).split(self.sizes, dim=1)
        return blocks[self.part].reshape(-1, w.shape[-1])

    def quantized(self, get) -> Fp8Weight | None:
        """Our rows of the stored FP8 weight with their scale rows (None: stored unquantized, or our parts split its
        128-row blocks; the loader then quantizes our rows again)."""
        stored = get.fp8(self.key)
        if stored is None or stored[0].dim() != 2 or stored[0].shape[0] != self.total_rows:
            return stored
        return fp8_row_gather(stored, self.row_indices())

    def row_indices(self) -> torch.Tensor:
        """Where our rows sit in the stored tensor: row i of ours is row row_indices()[i] of it."""
        block, offset = sum(self.sizes), sum(self.sizes[: self.part])
        within = torch.arange(self.sizes[self.part])
        return torch.cat([g * block + offset + within for g in range(self.num_groups)])

    @property
    def total_rows(self) -> int:
        return self.num_groups * sum(self.sizes)


def fused_or_per_expert(name: str, module: nn.Module, prefix: str) -> Recipe:
    """Routed experts from either hub layout: fused per layer (mlp.experts.gate_up_proj [E, 2F, D] gate rows first,
    mlp.experts.down_proj [E, D, F]: transformers 5's own layout, and how the published Qwen3.5 MoE checkpoints
    store them) or one tensor per expert (mlp.experts.{e}.{gate,up,down}_proj.weight: what save_pretrained writes,
    and the Qwen3-Next checkpoints). Only this rank's experts are read (rows of the fused tensor when the getter
    can read rows, as the CheckpointReader does)."""
    return FusedOrPerExpert(name, module, prefix)


class FusedOrPerExpert:
    """Recipe of fused_or_per_expert; FP8 experts come as stored in either layout (fused: the rows of this rank's
    experts of the weight and of its `_scale_inv`)."""

    def __init__(self, name: str, module: nn.Module, prefix: str):
        self.fused_key = prefix + name.replace("experts.w_gate_up", "experts.gate_up_proj").replace(
            "experts.w_down", "experts.down_proj"
        )
        self.per_expert = qwen_recipe(name, module, prefix=prefix)
        self.first, self.count = module.first_expert, module.num_experts

    def _expert_rows(self, get, start: int, stop: int) -> torch.Tensor:
        if hasattr(get, "rows"):
            return get.rows(self.fused_key, start, stop)
        return get(self.fused_key)[start:stop]

    def __call__(self, get) -> torch.Tensor:
        try:
            return self._expert_rows(get, self.first, self.first + self.count)
        except KeyError:
            return self.per_expert(get)

    def expert(self, get, i: int) -> torch.Tensor:
        """Local expert i alone."""
        try:
            return self._expert_rows(get, self.first + i, self.first + i + 1)[0]
        except KeyError:
            return self.per_expert.expert(get, i)

    def quantized(self, get) -> Fp8Weight | None:
        try:
            return get.fp8_rows(self.fused_key, self.first, self.first + self.count)
        except KeyError:
            return self.per_expert.quantized(get)


def shared_linear_attention_recipe(param: str, layer: str) -> Recipe:
    """The gated delta net parameters qwen3_next and qwen3_5_moe store alike."""
    if param == "conv.weight":
        # nn.Conv1d depthwise weight [C, 1, W] -> ours [C, W]; tap W-1 is the current token in both.
        return lambda get: get(layer + "conv1d.weight")[:, 0, :]
    if param == "o_proj.weight":
        return take(layer + "out_proj.weight")
    if param == "norm.weight":
        # Qwen3NextRMSNormGated scales by w (initialised at 1), not by 1 + w: our GatedRMSNorm is plain-scale.
        return take(layer + "norm.weight")
    if param in ("A_log", "dt_bias"):
        return take(layer + param)
    raise KeyError(param)


def hybrid_config(model: ModelProfile) -> dict[str, Any]:
    """The text config of a transformers qwen3_next-style model for `model` (the inverse of hybrid_profile), written
    from what transformers runs: gated delta net and gated full attention layers, (1 + w) norms, softmax routing
    with a sigmoid-gated shared expert. Fields it has no place for are left out; engine/families/hub_config.py
    reads the config back and names what differs."""
    linear, moe = model.linear_attention, model.moe
    config: dict[str, Any] = dict(
        **common_config(model),
        layer_types=["linear_attention" if layer.attention == "linear" else "full_attention" for layer in model.layers],
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta,
                         "partial_rotary_factor": model.partial_rotary_factor},
        mlp_only_layers=[i for i, layer in enumerate(model.layers) if layer.mlp == "dense"],
        decoder_sparse_step=1,
        num_experts=moe.num_experts if moe else 0,
    )
    if model.intermediate_size:
        config["intermediate_size"] = model.intermediate_size
    if linear:
        config.update(linear_num_key_heads=linear.num_key_heads, linear_num_value_heads=linear.num_value_heads,
                      linear_key_head_dim=linear.key_head_dim, linear_value_head_dim=linear.value_head_dim,
                      linear_conv_kernel_dim=linear.conv_kernel_size)
    if moe:
        config.update(num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_intermediate_size,
                      norm_topk_prob=moe.renormalize)
        # transformers always builds the shared expert: without one, its default width reads back.
        if moe.shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return config
