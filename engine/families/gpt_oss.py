"""gpt_oss (OpenAI's gpt-oss-20b / 120b): softmax attention with GQA, q/k/v/o biases, no q/k norm, one learned sink
logit per head, sliding-window and full layers as `layer_types` says, YaRN RoPE; every layer MoE, a router with a
bias (top-k of the logits, softmax over the k), experts with biases and the clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7).

Checkpoint keys (hub layout): model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks, mlp.router.{weight,bias}, mlp.experts.{gate_up_proj
[E, D, 2F] (gate and up columns interleaved), gate_up_proj_bias [E, 2F], down_proj [E, F, D], down_proj_bias
[E, D]}}, model.norm, lm_head. The published checkpoints store the two expert weights in MXFP4 instead
(`<name>_blocks` [E, rows, cols / 32, 16] uint8, two FP4 values a byte, and `<name>_scales` [E, rows, cols / 32]
uint8 exponents biased by 127, rows x cols = 2F x D for gate_up_proj and D x F for down_proj): they are dequantized
at load (`dequantize_mxfp4`), so training and export see bf16/fp32 experts.

Shapes: E experts (E_local on this rank), F expert hidden dim, D model dim, G groups of 32 values, R rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .base import Family, HFConfig, Recipe, Rule, show, take
from .deepseek_v3 import DeepseekV3

PREFIX = "model."
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig when config.json leaves these out.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_HEAD_DIM = 64
# The FP4 (E2M1) value of each 4-bit code (OCP microscaling spec; transformers' integrations/mxfp4.py FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# An MXFP4 scale byte is a power-of-two exponent stored with this bias.
MXFP4_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> floats: blocks [..., G, 16] uint8 (value 2j in the low nibble of byte j, 2j + 1 in the high one),
    scales [..., G] uint8 -> [..., G * 32] in `dtype`, value = FP4_VALUES[code] * 2 ** (scale - 127). Exact in fp32
    and bf16 (an FP4 value has two significant bits)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} must be uint8 [..., G, 16] and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - MXFP4_SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def _expert_rows(get, key: str, first: int, count: int) -> torch.Tensor:
    """Experts [first, first + count) of a fused expert tensor, read alone when the getter can read rows."""
    if hasattr(get, "rows"):
        return get.rows(key, first, first + count)
    return get(key)[first : first + count]


def expert_weight(base: str, name: str, module: nn.Module) -> Recipe:
    """Our w_gate_up [E_local, 2F, D] (gate rows first) or w_down [E_local, D, F] from `<base>gate_up_proj` /
    `down_proj` stored plain (transposed: [E, D, 2F] interleaved, [E, F, D]) or as MXFP4 blocks and scales (rows
    already ours, gate and up still interleaved)."""
    key = base + name
    first, count = module.first_expert, module.num_experts

    def build(get) -> torch.Tensor:
        try:
            weight = _expert_rows(get, key, first, count).transpose(1, 2)
        except KeyError as plain_missing:
            try:
                blocks = _expert_rows(get, key + "_blocks", first, count)
                scales = _expert_rows(get, key + "_scales", first, count)
            except KeyError:
                raise plain_missing from None
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
                # A getter of something other than the stored bytes (the export tracing where each value goes):
                # dequantization is not a rearrangement, so MXFP4 experts cannot be written back.
                raise KeyError(f"{key} (the checkpoint stores it as MXFP4 {key}_blocks and _scales, which moe-tune "
                               "reads but does not write)")
            # One expert at a time in bf16 (exact): a 120b layer's gate_up in fp32 at once would be 8.5 GB.
            weight = torch.stack([dequantize_mxfp4(b, s, torch.bfloat16) for b, s in zip(blocks, scales)])
        return deinterleave(weight) if name == "gate_up_proj" else weight

    return build


def deinterleave(gate_up: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """gpt_oss's interleaved gate/up rows (gate 2j, up 2j + 1) -> ours, gate rows first then up."""
    pairs = gate_up.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim)


class GptOss(Family):
    model_types = ("gpt_oss",)
    reference_class = "GptOssForCausalLM"
    reference_router_suffix = "mlp.router"
    reads_own_quantization = True  # MXFP4 experts, dequantized at load
    packed_key_suffixes = ("_blocks", "_scales")

    def to_profile(self, config: dict[str, Any]) -> ModelProfile:
        c = HFConfig(config)
        c.expect("attention_dropout", [0.0, 0], 0.0, why="moe-tune applies no attention dropout")
        quant = c.section("quantization_config")
        if quant.data:
            quant.expect("quant_method", ["mxfp4"], None, why="MXFP4 experts are dequantized at load; other "
                         "quantized checkpoints are not read")
        num_layers = c.require("num_hidden_layers") or 0
        types = c.get("layer_types")
        if types is None:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif len(types) != num_layers:
            c.problems.append(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
        for i, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                c.problems.append(f"config.json: layer_types[{i}] ({show(kind)}) is not mapped: must be one of "
                                  f"{list(LAYER_TYPES)}")
        window = self._positive(c, "sliding_window", None, Rule("int", 1, 2**31 - 1))
        layers = [LayerSpec(attention="full", mlp="moe",
                            sliding_window=window if kind == "sliding_attention" else None) for kind in types]
        num_experts, top_k = c.require("num_local_experts"), c.require("num_experts_per_tok")
        c.at_most("num_experts_per_tok", top_k, "num_local_experts", num_experts)
        moe = dict(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=c.require("intermediate_size"),
            # Top-k of the logits, softmax over those k: the renormalised top-k of a softmax over all experts.
            score_func="softmax",
            renormalize=True,
            router_bias=True,
            expert_bias=True,
            expert_activation="clamped_swiglu",
            swiglu_alpha=self._positive(c, "swiglu_alpha", 1.702),
            swiglu_limit=self._positive(c, "swiglu_limit", 7.0),
        )
        vocab, hidden, heads = c.require("vocab_size"), c.require("hidden_size"), c.require("num_attention_heads")
        kv_heads = c.get("num_key_value_heads", heads)
        c.multiple_of("num_attention_heads", heads, "num_key_value_heads", kv_heads)
        rope_theta, yarn = self._rope(c)
        has_bias = c.get("attention_bias", True)
        return c.profile(
            vocab_size=vocab,
            hidden_size=hidden,
            layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # GptOssConfig's head_dim is an int field: null fails its validation, absent is 64.
            head_dim=c.get("head_dim", DEFAULT_HEAD_DIM, is_null_refused=True),
            rope_theta=rope_theta,
            rope_yarn=yarn,
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            norm_one_plus=False,
            moe=moe,
            attention_output_gate=False,
            attention_qk_norm=False,
            attention_bias=has_bias,
            attention_output_bias=has_bias,
            attention_sinks=True,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            init_std=c.get("initializer_range", 0.02),
        )

    @staticmethod
    def _positive(c: HFConfig, key: str, default: Any, rule: Rule = Rule("float", above=0.0)) -> Any:
        """A gpt_oss-only config value, checked against `rule` (reported, and `default` used, when it breaks it)."""
        value = c.data.get(key)
        if value is None:
            return default
        why = rule.broken(value)
        if why is not None:
            c.problems.append(f"config.json: {key} ({show(value)}) {why}")
            return default
        return value

    @staticmethod
    def _rope(c: HFConfig) -> tuple[float, dict[str, Any] | None]:
        """(rope_theta, the YarnSpec fields or None) as transformers' GptOssRotaryEmbedding computes them: YaRN
        (transformers' defaults when config.json names no RoPE) or plain RoPE over the whole head."""
        if not c.rope().data and c.get("rope_theta") is None:
            c = HFConfig({**c.data, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": DEFAULT_ROPE_THETA}},
                         c.prefix, c.problems)
        rope = c.rope()
        rope.expect("partial_rotary_factor", [1.0, 1], 1.0, why="gpt_oss ropes every dim of the head")
        theta = float(rope.get("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA)))
        # DeepSeek-V3's reading of YaRN is transformers' generic one; its MLA-only softmax mscale does not apply here.
        yarn, _ = DeepseekV3().yarn_fields(c)
        return theta, yarn

    def recipe(self, name: str, module: nn.Module, cfg: ModelProfile) -> Recipe:
        if name == "lm_head.weight":
            return take(PREFIX + "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        if name.endswith("mlp.selection_bias"):
            return None
        if ".mlp.gate." in name:
            return take(PREFIX + name.replace(".mlp.gate.", ".mlp.router."))
        if ".mlp.experts." in name:
            base, _, ours = name.rpartition(".")
            base = PREFIX + base + "."
            if ours == "w_gate_up":
                return expert_weight(base, "gate_up_proj", module)
            if ours == "w_down":
                return expert_weight(base, "down_proj", module)
            first, count = module.first_expert, module.num_experts
            if ours == "b_gate_up":
                return lambda get: deinterleave(_expert_rows(get, base + "gate_up_proj_bias", first, count))
            if ours == "b_down":
                return lambda get: _expert_rows(get, base + "down_proj_bias", first, count)
            raise KeyError(name)
        return take(PREFIX + name)
