"""qwen4_exp (text part): gated delta net on 3 of 4 layers, gated attention over the key blocks the QSA indexer picks
on the rest, hyper-connections (several residual streams), hashed n-gram per-layer embeddings (PLE) on some linear
layers, and softmax top-k routed SwiGLU experts (renormalised) plus a sigmoid-gated shared expert on every layer.

Two checkpoint layouts, by model_type:
- qwen4_exp (the published vision-language checkpoint, Qwen4ExpForConditionalGeneration): config.json holds
  text_config and vision_config; the decoder's keys are model.language_model.*, the LM head lm_head.weight, the
  vision tower model.visual.* (our model.vision, engine/families/vision.py). Not loaded: mtp.* (multi-token
  prediction).
- qwen4_exp_text (a text-only Qwen4ExpForCausalLM saved by transformers): a flat config and model.* keys.

Keys under the decoder prefix, with ours:
- embed_tokens; hyper_connection_mixer.{hc_norm, input_mix_weight_down, input_mix_weight_up} -> norm.{norm,
  mix_down, mix_up} (no final RMSNorm: the mixer norms the streams); lm_head.
- layers.{i}.{attn,mlp}_hyper_connection.{hc_norm, input_mix_weight_down, input_mix_weight_up, block_inject_weight}
  -> layers.{i}.{attn,mlp}_hyper_connection.{norm, mix_down, mix_up, inject_proj}; hc_norm is a (1 + w) RMSNorm per
  stream (group_size = hidden_size).
- linear layers: layers.{i}.linear_attn.{in_proj_qkv (rows [q | k | v]), in_proj_z, in_proj_b, in_proj_a, conv1d,
  A_log, dt_bias, norm (plain w; gate activation output_gate_type or hidden_act), out_proj} -> layers.{i}.self_attn.
- attention layers: layers.{i}.self_attn.{q_proj (each head's query then its gate), k_proj, v_proj, o_proj, q_norm,
  k_norm, indexer.{index_qk_proj (rows [HI query heads | 1 key head]), q_layernorm, k_layernorm}}, the same names.
- PLE layers: layers.{i}.ple.{ple_embedding.{ngram_embedding.shard_{p} (rows split in split_ngram_parts shards),
  layer_multipliers, ngram_heads_vocab_sizes, ngram_heads_offsets}, key_proj, value_proj, norm_key, norm_query,
  norm_conv, conv1d} -> layers.{i}.ngram.{embedding.{table, multipliers, table_sizes, table_offsets}, key_proj,
  value_proj, key_norm, query_norm, conv_norm, conv}.
- layers.{i}.mlp.{gate, experts.{e}.{gate,up,down}_proj, shared_expert.*, shared_expert_gate}, the same names.

What `moe-tune align` compares after each decoder layer: the residual streams as both models carry them, [T, S * D]
stream-major (transformers' layer output as is; ours the same layout).

Shapes: D model dim, S streams, Hk/Hv linear key/value heads of dim K/V, HI indexer heads of dim DI.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from moe_tune.profiles.schema import LinearAttentionSpec, ModelProfile

from .base import Family, HFConfig, MAX_SIZE, Recipe, common_config, show, take
from .qwen3_moe import qwen_recipe
from .qwen3_5_moe import nested_text_config, split_qkv_recipe
from .qwen3_next import layer_types
from .vision import vision_recipe, with_vision

# transformers' layer_types and our token mixers; real checkpoints say full_attention for the indexed layers.
LAYER_KINDS = {"linear_attention": "linear", "indexed_attention": "qsa", "full_attention": "qsa"}
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# Our hyper-connection and n-gram parameter names -> theirs (under the layer's module).
HYPER_NAMES = {
    "norm.weight": "hc_norm.weight",
    "mix_down.weight": "input_mix_weight_down.weight",
    "mix_up.weight": "input_mix_weight_up.weight",
    "inject_proj.weight": "block_inject_weight.weight",
}
NGRAM_NAMES = {
    "embedding.multipliers": "ple_embedding.layer_multipliers",
    "embedding.table_sizes": "ple_embedding.ngram_heads_vocab_sizes",
    "embedding.table_offsets": "ple_embedding.ngram_heads_offsets",
    "key_proj.weight": "key_proj.weight",
    "value_proj.weight": "value_proj.weight",
    "key_norm.weight": "norm_key.weight",
    "query_norm.weight": "norm_query.weight",
    "conv_norm.weight": "norm_conv.weight",
}
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.([a-z_]+)\.(.+)")


class Qwen4Exp(Family):
    """The vision-language checkpoint: its language model and its vision tower (engine/families/vision.py)."""

    model_types = ("qwen4_exp",)
    # The checkpoint's own class: its module names are the checkpoint's keys (model.language_model.*), so align
    # pairs LoRA adapters by key. On text its language model is the same computation as Qwen4ExpForCausalLM.
    reference_class = "Qwen4ExpForConditionalGeneration"
    reference_layers = "model.language_model.layers"
    ignored_key_prefixes = ("mtp.",)
    key_prefix = "model.language_model."
    # align: the reference's QSA indexers (one per attention layer), whose choice --pin-routing feeds to ours.
    reference_indexer_suffix = "self_attn.indexer"

    def reference_selected_keys(self, output: torch.Tensor) -> torch.Tensor:
        """Bool [L, L] (query, key) of one document from the reference QSA indexer's selection mask [1, 1, L, L]
        (whole chosen blocks plus the query's incomplete tail block, causal keys only)."""
        length = output.shape[-1]
        return output[0, 0].cpu() & torch.ones(length, length, dtype=torch.bool).tril()

    def text_config(self, config: dict[str, Any]) -> HFConfig:
        return nested_text_config(config, "qwen4_exp")

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = self.text_config(config)
        c.expect("hidden_act", ["silu"], "silu", why="the experts' and the linear layers' conv activation")
        c.expect("output_gate_type", [None, "silu", "sigmoid"], None)
        c.expect("attention_bias", [False], False)
        c.expect("attention_dropout", [0, 0.0], 0.0, why="moe-tune has no attention dropout")
        num_layers = c.require("num_hidden_layers") or 0
        # None: a layer type we do not map (reported).
        kinds = [LAYER_KINDS.get(kind) for kind in layer_types(c, num_layers, LAYER_KINDS, "indexed_attention")]
        ngram_layers = self._ngram_layers(c, kinds)
        # No fallbacks of our own: transformers' class defaults differ from them, and its saved configs list these.
        head_dim = c.require("head_dim") or 1
        sparse = self._sparse_attention(c, int(head_dim * c.partial_rotary_factor())) if "qsa" in kinds else None
        linear = self._linear_attention(c) if "linear" in kinds else None
        eos = c.get("eos_token_id")
        num_streams, mix_rank = c.get("hc_count", 4), c.get("hc_lowrank", 320)
        if not (isinstance(num_streams, int) and not isinstance(num_streams, bool) and 2 <= num_streams <= MAX_SIZE):
            c.problems.append(f"config.json: {c.prefix}hc_count ({show(num_streams)}) is not mapped: must be an int "
                              f"in [2, {MAX_SIZE}]")
        moe = {f: c.require(f, least=1) for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
        c.at_most("num_experts_per_tok", moe["num_experts_per_tok"], "num_experts", moe["num_experts"])
        shared = c.require("shared_expert_intermediate_size")
        # rope_type must be default. mrope_section / mrope_interleaved only matter when the three position streams
        # (time, height, width) differ, i.e. for image tokens; for text the multimodal rotary is the plain one.
        rope_theta, partial_rotary_factor = c.rope_theta(), c.partial_rotary_factor()
        vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
        kv_heads = c.require("num_key_value_heads")
        c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        # Sections as dicts, validated by c.profile after the problems above: our own rules (e.g. budget / block
        # size) come back as lines naming them.
        text_model = c.profile(
            vocab_size=vocab,
            hidden_size=hidden,
            layers=[
                dict(attention=kind, mlp="moe", has_ngram_embedding=i in ngram_layers)
                for i, kind in enumerate(kinds)
            ],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            partial_rotary_factor=partial_rotary_factor,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            norm_one_plus=True,
            linear_attention=linear,
            sparse_attention=sparse,
            moe=dict(
                num_experts=moe["num_experts"],
                top_k=moe["num_experts_per_tok"],
                expert_intermediate_size=moe["moe_intermediate_size"],
                score_func="softmax",
                renormalize=c.get("norm_topk_prob", True),
                shared_expert_intermediate_size=shared,
                shared_expert_gate=True,
            ),
            hyper_connections=dict(num_streams=num_streams, mix_rank=mix_rank),
            ngram_embedding=self._ngram_spec(c, hidden, eos) if ngram_layers else None,
            attention_output_gate=True,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )
        return with_vision(text_model, config)

    def _linear_attention(self, c: HFConfig) -> dict[str, Any] | None:
        """LinearAttentionSpec's fields (None when some are missing: reported)."""
        fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        values = {f: c.require(f) for f in fields}
        if None in values.values():
            return None
        c.multiple_of("linear_num_value_heads", values["linear_num_value_heads"], "linear_num_key_heads",
                      values["linear_num_key_heads"])
        return dict(
            num_key_heads=values["linear_num_key_heads"],
            num_value_heads=values["linear_num_value_heads"],
            key_head_dim=values["linear_key_head_dim"],
            value_head_dim=values["linear_value_head_dim"],
            conv_kernel_size=c.get("linear_conv_kernel_dim", 4),
            decay="scalar",
            output_gate_activation=c.get("output_gate_type") or c.get("hidden_act", "silu"),
        )

    def _sparse_attention(self, c: HFConfig, rotary_dim: int) -> dict[str, Any] | None:
        """SparseAttentionSpec's fields from QSA's (None when some are missing: reported). transformers builds the
        indexer on every attention layer, so all five are needed (it saves unset ones as null)."""
        values = {f: c.get(f) for f in QSA_FIELDS}
        missing = [f for f, value in values.items() if value is None]
        for f in missing:
            c.problems.append(f"config.json: {c.prefix}{f} is missing: the attention layers' QSA indexer needs it")
        if missing:
            return None
        c.expect("indexer_kv_heads", [1], why="QSA scores blocks with one indexer key head")
        budget, ratio = values["indexer_budget"], values["indexer_compress_ratio"]
        if isinstance(budget, int) and isinstance(ratio, int) and ratio > 0 and budget % ratio:
            c.problems.append(
                f"config.json: {c.prefix}indexer_budget ({budget}) is not mapped: must be a multiple of "
                f"indexer_compress_ratio ({ratio})"
            )
        if isinstance(values["indexer_head_dim"], int) and values["indexer_head_dim"] < rotary_dim:
            c.problems.append(
                f"config.json: {c.prefix}indexer_head_dim ({values['indexer_head_dim']}) is not mapped: must be >= "
                f"the rotary dims ({rotary_dim} = head_dim x partial_rotary_factor), which QSA rotates"
            )
        return dict(
            index_heads=values["indexer_n_heads"],
            index_head_dim=values["indexer_head_dim"],
            topk=values["indexer_budget"],
            block_size=values["indexer_compress_ratio"],
        )

    def _ngram_layers(self, c: HFConfig, kinds: list[str]) -> set[int]:
        """0-based layers with PLE (config.ple_layer_ids is 1-based); transformers runs PLE on linear layers only."""
        ids = sorted(set(c.get("ple_layer_ids") or []))
        layers = set()
        for layer_id in ids:
            if not (isinstance(layer_id, int) and 1 <= layer_id <= len(kinds)):
                c.problems.append(
                    f"config.json: {c.prefix}ple_layer_ids ({ids}) is not mapped: entries must be layer numbers in "
                    f"[1, {len(kinds)}]"
                )
            elif kinds[layer_id - 1] not in ("linear", None):
                c.problems.append(
                    f"config.json: {c.prefix}ple_layer_ids ({ids}) is not mapped: layer {layer_id} is not a "
                    "linear_attention layer"
                )
            else:
                layers.add(layer_id - 1)
        eos = c.get("eos_token_id")
        if layers and eos in (None, []):
            c.problems.append(f"config.json: {c.prefix}eos_token_id is missing: PLE n-gram contexts end at it")
        elif layers and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                for i in (eos if isinstance(eos, list) else [eos])):
            c.problems.append(f"config.json: {c.prefix}eos_token_id ({show(eos)}) must be a token id (an integer >= 0) "
                              "or a list of them")
        num_heads = (c.get("ngram_size", 3) - 1) * c.get("heads_per_ngram", 8)
        embed_dim = c.get("ple_embed_dim") or c.get("hidden_size") or 0
        if layers and (num_heads < 1 or embed_dim % num_heads):
            c.problems.append(
                f"config.json: {c.prefix}ple_embed_dim ({embed_dim}) is not mapped: must be a multiple of the hashed "
                f"heads ({num_heads} = (ngram_size - 1) x heads_per_ngram)"
            )
        return layers

    def _ngram_spec(self, c: HFConfig, hidden: int, eos: int | list[int]) -> dict[str, Any]:
        """NGramEmbeddingSpec's fields."""
        return dict(
            embed_dim=c.get("ple_embed_dim") or hidden,
            ngram_size=c.get("ngram_size", 3),
            heads_per_ngram=c.get("heads_per_ngram", 8),
            vocab_size_base=c.get("ngram_vocab_size_base", 20_000_000),
            vocab_size_multiple=c.get("make_ngram_vocab_size_divisible_by", 128),
            hash_seed=c.get("seed", 1234),
            conv_kernel_size=c.get("ple_conv_kernel_size", 4),
            # transformers takes the first of a list of eos ids.
            boundary_token_id=eos[0] if isinstance(eos, list) and eos else eos,
        )

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        prefix = self.key_prefix
        if name.startswith("vision."):
            return vision_recipe(name.removeprefix("vision."), prefix="model.visual.")
        if name.startswith("norm."):
            return take(prefix + "hyper_connection_mixer." + HYPER_NAMES[name.removeprefix("norm.")])
        match = _LAYER_PARAM.fullmatch(name)
        if match is None:
            return qwen_recipe(name, module, prefix=prefix)
        index, part, param = int(match.group(1)), match.group(2), match.group(3)
        layer = f"{prefix}layers.{index}."
        if part in ("attn_hyper_connection", "mlp_hyper_connection"):
            return take(f"{layer}{part}.{HYPER_NAMES[param]}")
        if part == "ngram":
            return self.ngram_recipe(param, layer + "ple.")
        if part == "self_attn" and cfg.layers[index].attention == "linear":
            return self.linear_attention_recipe(param, layer + "linear_attn.", cfg.linear_attention)
        return qwen_recipe(name, module, prefix=prefix)

    def linear_attention_recipe(self, param: str, layer: str, spec: LinearAttentionSpec) -> Recipe:
        return split_qkv_recipe(param, layer, spec)

    def ngram_recipe(self, param: str, layer: str) -> Recipe:
        if param == "conv.weight":
            # nn.Conv1d depthwise weight [C, 1, W] -> ours [C, W]; tap W-1 is the current token in both.
            return lambda get: get(layer + "conv1d.weight")[:, 0, :]
        if param == "embedding.table.weight":
            return sharded_rows(layer + "ple_embedding.ngram_embedding.")
        return take(layer + NGRAM_NAMES[param])


def sharded_rows(base: str) -> Recipe:
    """An embedding saved whole (`base`weight) or, as transformers saves qwen4_exp's n-gram tables, in row shards
    `base`shard_{p}.weight, p = 0..split_ngram_parts - 1, concatenated back."""

    def build(get) -> torch.Tensor:
        try:
            return get(base + "weight")
        except KeyError:
            pass
        shards = []
        while True:
            try:
                shards.append(get(f"{base}shard_{len(shards)}.weight"))
            except KeyError:
                break
        if not shards:
            raise KeyError(f"{base}shard_0.weight")
        return torch.cat(shards)

    return build


class Qwen4ExpText(Qwen4Exp):
    """A text-only Qwen4ExpForCausalLM checkpoint: flat config, model.* keys."""

    model_types = ("qwen4_exp_text",)
    reference_class = "Qwen4ExpForCausalLM"
    reference_layers = "model.layers"
    ignored_key_prefixes = ("mtp.",)
    key_prefix = "model."

    def text_config(self, config: dict[str, Any]) -> HFConfig:
        return HFConfig(config)

    def to_config(self, model: ModelProfile) -> dict[str, Any]:
        """The flat config.json of a Qwen4ExpForCausalLM for `model`: the inverse of to_profile, written from what
        transformers runs (gated delta net and QSA layers, hyper-connections, PLE on linear layers, every layer
        MoE with a gated shared expert). Fields it has no place for are left out; engine/families/hub_config.py
        reads the config back and names what differs."""
        linear, sparse, moe = model.linear_attention, model.sparse_attention, model.moe
        streams, ngram = model.hyper_connections, model.ngram_embedding
        config: dict[str, Any] = dict(
            **common_config(model),
            model_type=self.model_types[0],
            # transformers keys its masks by "indexed_attention".
            layer_types=["linear_attention" if layer.attention == "linear" else "indexed_attention"
                         for layer in model.layers],
            num_key_value_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta,
                             "partial_rotary_factor": model.partial_rotary_factor},
            # transformers runs PLE on linear layers only.
            ple_layer_ids=[i + 1 for i, layer in enumerate(model.layers)
                           if layer.has_ngram_embedding and layer.attention == "linear"],
        )
        if streams:
            config.update(hc_count=streams.num_streams, hc_lowrank=streams.mix_rank)
        if linear:
            config.update(linear_num_key_heads=linear.num_key_heads, linear_num_value_heads=linear.num_value_heads,
                          linear_key_head_dim=linear.key_head_dim, linear_value_head_dim=linear.value_head_dim,
                          linear_conv_kernel_dim=linear.conv_kernel_size,
                          output_gate_type=linear.output_gate_activation)
        if sparse:
            config.update(indexer_n_heads=sparse.index_heads, indexer_kv_heads=1,
                          indexer_head_dim=sparse.index_head_dim, indexer_budget=sparse.topk,
                          indexer_compress_ratio=sparse.block_size)
        if moe:
            config.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                          moe_intermediate_size=moe.expert_intermediate_size, norm_topk_prob=moe.renormalize)
            # transformers always builds the shared expert: without one, its default width reads back.
            if moe.shared_expert_intermediate_size:
                config["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
        if ngram and config["ple_layer_ids"]:
            # One row shard per table: the reader takes whole or sharded tables alike.
            config.update(ple_embed_dim=ngram.embed_dim, ngram_size=ngram.ngram_size,
                          heads_per_ngram=ngram.heads_per_ngram, ngram_vocab_size_base=ngram.vocab_size_base,
                          make_ngram_vocab_size_divisible_by=ngram.vocab_size_multiple, seed=ngram.hash_seed,
                          ple_conv_kernel_size=ngram.conv_kernel_size, eos_token_id=ngram.boundary_token_id,
                          split_ngram_parts=1)
        return config
