"""The job profile: one pydantic model per concern, composed into JobProfile.

Rules of the schema (STYLE.md): extra keys are refused, required fields have no default, every field is described.
Cross-field rules live in `check_<rule>` validators grouped by concern. A validator reports every broken rule of
its section at once: each line reads `@field (value) rule`, and the loader replaces `@` with the section's path, so
the user reads `model.moe.top_k (9) must be <= model.moe.num_experts (8)`.
"""

from __future__ import annotations

import os
import stat
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# The byte-level tokenizer's vocabulary: 256 bytes plus <bos>, <eos> and <pad>.
BYTE_VOCAB_SIZE = 259


# Sizes and counts: tensor dims, token ids and step counts stay within int32, as kernels' index math and
# tokenizers' ids do; a larger one is a typo, not a model.
MAX_SIZE = 2**31 - 1
# Seeds are 64-bit: torch.manual_seed takes up to 2**64 - 1, and a seed plus an epoch or a layer offset must fit.
MAX_SEED = 2**63 - 1
# A collective's timeout becomes a datetime.timedelta and torch's int64 milliseconds: a year is long enough.
MAX_TIMEOUT_S = 365 * 24 * 3600.0
# Decoder layers: the largest model shipped has 56; every layer is built (and planned) one by one.
MAX_LAYERS = 1024


def _number_rule(annotation: Any) -> str | None:
    """What a field of ints or floats (alone or beside None) takes: 'an integer' or 'a number'; None for a field that
    takes a bool or no number."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    kinds = {a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)}
    if bool in kinds or not kinds & {int, float}:
        return None
    return "an integer" if int in kinds else "a number"


def _is_path(annotation: Any) -> bool:
    """Whether a field takes a Path (alone or beside None)."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    return Path in (typing.get_args(annotation) if union else (annotation,))


def value_problem(annotation: Any, value: Any) -> str | None:
    """The rule a raw value breaks for a field of `annotation` before pydantic reads it (the end of the line
    `field (value) RULE`), or None: YAML's true and false (yes, no, on, off) would pass as 1 and 0 into a number
    field; an empty path would be the working directory, and `~` is no shell here (`output.dir: ~/runs` would write
    into a folder named '~' under the working directory)."""
    rule = _number_rule(annotation)
    if rule is not None and isinstance(value, bool):
        return f"must be {rule}, not a boolean"
    if isinstance(value, str) and _is_path(annotation):
        if not value.strip():
            return "is empty: name the file or folder ('.' for the working directory)"
        if value.startswith("~"):
            return "starts with '~', which is not expanded (it would name a folder '~' in the working directory): " \
                   "write the path out"
    return None


# The pydantic error type of value_problem's rules (format_errors prints them as `field (value) rule`).
VALUE_RULE = "profile_value_rule"


class Strict(BaseModel):
    # No float field takes inf or nan: each would overflow or poison the run later.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def check_value_rules(cls, value: Any, info: ValidationInfo) -> Any:
        """value_problem's rules, one field at a time: the section's other fields are still checked."""
        problem = value_problem(cls.model_fields[info.field_name].annotation, value)
        if problem is not None:
            raise PydanticCustomError(VALUE_RULE, problem)
        return value


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ValueError("\n".join(problems))


class LayerSpec(Strict):
    attention: Literal["linear", "sparse", "full", "kda", "mla", "mla_sparse", "qsa"] = Field(
        description="token mixer: linear (gated delta rule with a recurrent state), sparse (top-k selected keys), "
        "full (gated softmax attention over every causal key), kda (Kimi delta attention, per-channel decay), "
        "mla (multi-head latent attention, model.mla) or mla_sparse (MLA over the keys DeepSeek's lightning "
        "indexer picks, model.mla + model.sparse_attention) or qsa (gated attention over the key blocks QSA's "
        "indexer picks, model.sparse_attention; qwen4_exp)"
    )
    mlp: Literal["moe", "dense"] = Field("moe", description="channel mixer: routed experts (moe) or a dense SwiGLU")
    has_ngram_embedding: bool = Field(
        False, description="hashed n-gram embeddings of the tokens are injected into the residual streams before "
        "this layer (qwen4_exp's per-layer embeddings; needs model.ngram_embedding and model.hyper_connections)"
    )
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="attention: full only: each query sees only the last this many keys of "
        "its document, itself included (gpt_oss's sliding_attention layers); None: every causal key"
    )

    @model_validator(mode="after")
    def check_sliding_window(self):
        problems = []
        if self.sliding_window is not None and self.attention != "full":
            problems.append(f"@sliding_window ({self.sliding_window}) needs @attention: full (got '{self.attention}')")
        _raise_if(problems)
        return self


class LinearAttentionSpec(Strict):
    num_key_heads: int = Field(ge=1, le=MAX_SIZE, description="heads of q and k (shared by groups of value heads)")
    num_value_heads: int = Field(
        ge=1, le=MAX_SIZE, description="heads of v and of the recurrent state; a multiple of num_key_heads"
    )
    key_head_dim: int = Field(ge=1, le=MAX_SIZE, description="K: dim of q and k per head")
    value_head_dim: int = Field(ge=1, le=MAX_SIZE, description="V: dim of v per head (may differ from K)")
    conv_kernel_size: int = Field(4, ge=1, le=8, description="width of the short causal depthwise conv on q, k, v")
    decay: Literal["scalar", "per_channel"] = Field(
        "scalar", description="scalar: one log decay per head (gated delta rule); per_channel: one per key channel (KDA)"
    )
    output_gate_activation: Literal["silu", "sigmoid"] = Field(
        "silu", description="activation of the output gate z in RMSNorm(o) * act(z)"
    )

    @model_validator(mode="after")
    def check_heads(self):
        problems = []
        if self.num_value_heads % self.num_key_heads:
            problems.append(
                f"@num_value_heads ({self.num_value_heads}) must be a multiple of @num_key_heads ({self.num_key_heads})"
            )
        _raise_if(problems)
        return self


class KDASpec(Strict):
    """Kimi delta attention (Kimi Linear's KDA layers); its low-rank decay and output-gate projections have rank
    head_dim, as in FLA's KimiDeltaAttention."""

    num_heads: int = Field(
        ge=1, le=MAX_SIZE, description="H: heads of q, k, v and of the recurrent state (no grouping)"
    )
    head_dim: int = Field(ge=1, le=MAX_SIZE, description="K: dim of q, k and v per head (one dim for all three)")
    conv_kernel_size: int = Field(4, ge=1, le=8, description="width of the short causal depthwise conv on q, k, v")


class SparseAttentionSpec(Strict):
    index_heads: int = Field(ge=1, le=MAX_SIZE, description="HI: heads of the indexer that scores keys for each query")
    index_head_dim: int = Field(ge=1, le=MAX_SIZE, description="DI: dim of the indexer's query and key")
    topk: int = Field(
        ge=1, le=MAX_SIZE, description="token budget: keys each query attends to (block mode: topk / block_size "
        "blocks; qsa layers: keys from complete blocks, the incomplete block the query sits in comes on top)"
    )
    block_size: int = Field(
        1, ge=1, le=MAX_SIZE, description="1: select single tokens; >1: select blocks of this many contiguous keys "
        "(mean-pooled scores)"
    )

    @model_validator(mode="after")
    def check_budget(self):
        problems = []
        if self.topk % self.block_size:
            problems.append(f"@topk ({self.topk}) must be a multiple of @block_size ({self.block_size})")
        _raise_if(problems)
        return self


class MoESpec(Strict):
    num_experts: int = Field(ge=1, le=MAX_SIZE, description="E: routed experts per MoE layer")
    top_k: int = Field(ge=1, le=MAX_SIZE, description="k: experts each token is sent to")
    expert_intermediate_size: int = Field(ge=1, le=MAX_SIZE, description="F: hidden size of each routed SwiGLU expert")
    score_func: Literal["softmax", "sigmoid"] = Field("softmax", description="router scores from the logits")
    renormalize: bool = Field(True, description="rescale the chosen experts' weights to sum to 1")
    routed_scaling: float = Field(1.0, gt=0, description="factor on the routed experts' combined output")
    aux_loss_coef: float = Field(0.0, ge=0, description="weight of the Switch load-balancing loss (0: off)")
    bias_update_rate: float = Field(
        0.0, ge=0, description="aux-loss-free balancing: step of the per-expert selection bias after each step (0: off)"
    )
    capacity_factor: float = Field(
        0.0, ge=0, description="token-slots an expert takes per step, as a multiple of the even share N*k/E; "
        "slots past it (latest tokens first) are dropped and counted (0: no limit)"
    )
    shared_expert_intermediate_size: int = Field(
        0, ge=0, le=MAX_SIZE, description="hidden size of the shared expert (0: none)"
    )
    shared_expert_gate: bool = Field(True, description="scale the shared expert by sigmoid(x W) (qwen3_next style)")
    n_group: int = Field(
        1, ge=1, le=MAX_SIZE, description="group-limited routing (DeepSeek-V3): experts split into this many equal "
        "groups; 1: no groups"
    )
    topk_group: int = Field(
        1, ge=1, le=MAX_SIZE, description="groups a token may use: the topk_group groups with the largest sum of "
        "their two best (biased) scores; the top_k experts are chosen within them"
    )
    has_selection_bias: bool = Field(
        False, description="add the selection_bias buffer to the scores for the choice even when it is not updated "
        "(a checkpoint's trained correction bias, DeepSeek-V3's e_score_correction_bias); bias_update_rate > 0 "
        "implies it"
    )
    router_bias: bool = Field(False, description="the router's linear layer has a bias (gpt_oss)")
    expert_bias: bool = Field(
        False, description="the routed experts' gate/up and down projections have biases (gpt_oss); the down bias "
        "is added before the routing weight"
    )
    expert_activation: Literal["swiglu", "clamped_swiglu"] = Field(
        "swiglu", description="the routed experts' activation: swiglu, silu(gate) * up; clamped_swiglu (gpt_oss), "
        "gate clamped above at swiglu_limit, up to [-swiglu_limit, swiglu_limit], then "
        "gate * sigmoid(swiglu_alpha * gate) * (up + 1)"
    )
    swiglu_alpha: float = Field(1.702, gt=0, description="clamped_swiglu: the sigmoid's gain")
    swiglu_limit: float = Field(7.0, gt=0, description="clamped_swiglu: the clamp on gate and up")

    @model_validator(mode="after")
    def check_top_k(self):
        problems = []
        if self.top_k > self.num_experts:
            problems.append(f"@top_k ({self.top_k}) must be <= @num_experts ({self.num_experts})")
        if self.num_experts % self.n_group:
            problems.append(f"@n_group ({self.n_group}) must divide @num_experts ({self.num_experts})")
        elif self.topk_group > self.n_group:
            problems.append(f"@topk_group ({self.topk_group}) must be <= @n_group ({self.n_group})")
        elif self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            problems.append(
                f"@top_k ({self.top_k}) must be <= @topk_group ({self.topk_group}) x experts per group "
                f"({self.num_experts // self.n_group})"
            )
        _raise_if(problems)
        return self


class YarnSpec(Strict):
    """YaRN RoPE scaling (transformers' `rope_type: yarn`): low frequencies interpolated by `factor`, high ones kept,
    a linear ramp between, and cos/sin scaled by `attention_factor`."""

    factor: float = Field(gt=0, description="context extension factor (interpolated frequencies are divided by it)")
    original_max_position_embeddings: int = Field(ge=1, le=MAX_SIZE, description="context length of pretraining")
    beta_fast: float = Field(32.0, gt=0, description="rotations above which a frequency is kept (extrapolated)")
    beta_slow: float = Field(1.0, gt=0, description="rotations below which a frequency is interpolated")
    attention_factor: float = Field(1.0, gt=0, description="scale on cos and sin (so on the rotary dims' logits)")
    truncate: bool = Field(True, description="round the ramp's bounds to whole dims (floor low, ceil high)")


class MLASpec(Strict):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi): queries from an optional low-rank latent, keys and values
    expanded per head from one shared latent, plus a rotary part of the key shared by all heads."""

    q_lora_rank: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="rank of the query latent (q_a_proj -> RMSNorm -> q_b_proj); None: one "
        "q_proj"
    )
    kv_lora_rank: int = Field(
        ge=1, le=MAX_SIZE, description="rank of the key/value latent (kv_a_proj_with_mqa -> RMSNorm)"
    )
    qk_nope_head_dim: int = Field(
        ge=0, le=MAX_SIZE, description="per-head query/key dims without RoPE (from the latents)"
    )
    qk_rope_head_dim: int = Field(
        ge=0, le=MAX_SIZE, description="per-head query dims and shared key dims that carry the position (RoPE unless "
        "rope: none)"
    )
    v_head_dim: int = Field(ge=1, le=MAX_SIZE, description="V: value dim per head")
    rope: Literal["interleaved", "half", "none"] = Field(
        "interleaved", description="RoPE on the rotary dims: interleaved pairs (DeepSeek, rope_interleave), "
        "rotate-half, or none (Kimi's MLA: the rotary dims stay unrotated)"
    )
    softmax_scale: float | None = Field(
        None, gt=0, description="attention logit scale; None: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5"
    )
    latent_norm_eps: float = Field(
        1e-6, gt=0, description="epsilon of the RMSNorms on the q and kv latents (transformers' DeepSeek and Kimi "
        "MLA keep the RMSNorm default here, not rms_norm_eps)"
    )
    yarn: YarnSpec | None = Field(None, description="YaRN scaling of the rotary dims (None: plain RoPE)")

    @model_validator(mode="after")
    def check_dims(self):
        problems = []
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
            problems.append("@qk_nope_head_dim (0) must be > 0 when @qk_rope_head_dim is 0")
        if self.rope != "none" and (self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2):
            problems.append(
                f"@qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and > 0 with @rope ('{self.rope}')"
            )
        _raise_if(problems)
        return self


class HyperConnectionSpec(Strict):
    """Hyper-connections (qwen4_exp): the decoder carries several residual streams; each sub-layer reads a gated mix
    of the normed streams and adds its output back into every stream with a per-stream weight."""

    num_streams: int = Field(ge=2, le=MAX_SIZE, description="residual streams, each of width hidden_size")
    mix_rank: int = Field(
        ge=1, le=MAX_SIZE, description="rank of the low-rank projection that yields the per-channel mix weights"
    )


class NGramEmbeddingSpec(Strict):
    """Hashed n-gram embeddings injected into the residual streams before some layers (qwen4_exp's per-layer
    embeddings, PLE). Layer i's tables and hash multipliers depend on its rank among those layers."""

    embed_dim: int = Field(
        ge=1, le=MAX_SIZE, description="width of a token's n-gram embedding: every hashed head's vector concatenated"
    )
    ngram_size: int = Field(
        ge=2, le=MAX_SIZE, description="largest n: the n-grams of orders 2..ngram_size ending at a token are hashed"
    )
    heads_per_ngram: int = Field(
        ge=1, le=MAX_SIZE, description="independently hashed embedding tables per n-gram order"
    )
    vocab_size_base: int = Field(
        ge=2, le=MAX_SIZE, description="rows of each hashed table: a distinct prime, the next ones after this number"
    )
    vocab_size_multiple: int = Field(
        ge=1, le=MAX_SIZE, description="a layer's tables, stacked into one, are padded to a multiple of this"
    )
    hash_seed: int = Field(ge=0, le=MAX_SEED, description="seed of the per-layer hash multipliers")
    conv_kernel_size: int = Field(
        ge=1, le=MAX_SIZE, description="taps of the causal depthwise conv (dilation ngram_size) over the injected "
        "values"
    )
    boundary_token_id: int = Field(
        ge=0, le=MAX_SIZE, description="token (eos) that ends an n-gram context: n-grams never reach back across it "
        "(nor across documents); it also fills the positions before a context starts"
    )

    @model_validator(mode="after")
    def check_heads(self):
        problems = []
        num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        if self.embed_dim % num_heads:
            problems.append(
                f"@embed_dim ({self.embed_dim}) must be a multiple of the hashed heads ({num_heads} = "
                f"(@ngram_size - 1) x @heads_per_ngram)"
            )
        _raise_if(problems)
        return self


class VisionSpec(Strict):
    """The vision tower (qwen3_5_moe / qwen4_exp layout): patches -> ViT blocks -> merger into the text width; the
    image's tokens in the text are vision_start, image_token x (patches / merge^2), vision_end."""

    depth: int = Field(ge=1, le=MAX_SIZE, description="ViT blocks")
    hidden_size: int = Field(ge=1, le=MAX_SIZE, description="Dv: width of the vision blocks")
    intermediate_size: int = Field(ge=1, le=MAX_SIZE, description="hidden size of each vision block's MLP")
    num_heads: int = Field(ge=1, le=MAX_SIZE, description="attention heads of the vision blocks (divides hidden_size)")
    hidden_act: Literal["gelu_pytorch_tanh", "gelu", "silu"] = Field(
        "gelu_pytorch_tanh", description="activation of the vision MLPs"
    )
    in_channels: int = Field(3, ge=1, le=MAX_SIZE, description="colour channels of the pixels")
    patch_size: int = Field(ge=1, le=MAX_SIZE, description="p: patches are p x p pixels")
    temporal_patch_size: int = Field(2, ge=1, le=MAX_SIZE, description="frames per patch (a still image repeats)")
    spatial_merge_size: int = Field(
        2, ge=1, le=MAX_SIZE, description="m: m x m neighbouring patches become one text token"
    )
    num_position_embeddings: int = Field(
        ge=1, le=MAX_SIZE, description="learned position table, a square grid resampled per image"
    )
    rope_theta: float = Field(10000.0, gt=0, description="base of the 2D rotary positions of the vision blocks")
    image_token_id: int = Field(ge=0, le=MAX_SIZE, description="token id of each image placeholder in the text")
    vision_start_token_id: int = Field(ge=0, le=MAX_SIZE, description="token id before an image's placeholders")
    vision_end_token_id: int = Field(ge=0, le=MAX_SIZE, description="token id after an image's placeholders")
    mrope_section: tuple[int, int, int] = Field(
        (11, 11, 10), description="rotary frequencies (of the text attention) carrying the t, h and w positions of "
        "image tokens, interleaved; they sum to half the rotary dim"
    )

    @model_validator(mode="after")
    def check_vision(self):
        problems = []
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            problems.append(
                f"@hidden_size ({self.hidden_size}) must be a multiple of 4 x @num_heads ({self.num_heads}) "
                "(2D rotary positions split each head in four)"
            )
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            problems.append(f"@num_position_embeddings ({self.num_position_embeddings}) must be a square")
        _raise_if(problems)
        return self


BasePrecision = Literal["bf16", "fp8"]
BASE_PRECISION_DOC = (
    "precision of the frozen base weights: bf16 (the run's dtype), or fp8: attention projections, dense MLPs, shared "
    "and routed experts stored as FP8 e4m3 in 128x128 blocks with fp32 scales (the hub's FP8 checkpoint layout; "
    "half the bytes), embeddings, norms, routers, the LM head, linears with a dim < 128 and trained modules staying "
    "in the run's dtype; LoRA runs only (FP8 weights take no gradient)"
)


class ModelProfile(Strict):
    vocab_size: int = Field(ge=2, le=MAX_SIZE, description="rows of the token embedding and the LM head")
    hidden_size: int = Field(ge=1, le=MAX_SIZE, description="D: model width")
    layers: list[LayerSpec] = Field(
        min_length=1, max_length=MAX_LAYERS, description="the decoder, one entry per layer, bottom first"
    )
    num_attention_heads: int = Field(
        ge=1, le=MAX_SIZE, description="query heads of the sparse and full attention layers"
    )
    num_key_value_heads: int = Field(
        ge=1, le=MAX_SIZE, description="key/value heads (GQA); divides num_attention_heads"
    )
    head_dim: int = Field(ge=2, le=MAX_SIZE, description="dim per attention head")
    intermediate_size: int = Field(
        0, ge=0, le=MAX_SIZE, description="hidden size of dense SwiGLU layers (needed if any mlp: dense)"
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    partial_rotary_factor: float = Field(1.0, gt=0, le=1, description="share of each head's dims that get RoPE")
    rms_norm_eps: float = Field(1e-6, gt=0, description="epsilon of every RMSNorm")
    norm_one_plus: bool = Field(False, description="RMSNorm scales by (1 + w) with w initialised at 0 (qwen3_next)")
    linear_attention: LinearAttentionSpec | None = Field(None, description="needed if any layer is linear")
    kda_attention: KDASpec | None = Field(None, description="needed if any layer is kda")
    sparse_attention: SparseAttentionSpec | None = Field(None, description="needed if any layer is sparse")
    mla: MLASpec | None = Field(None, description="needed if any layer is mla or mla_sparse")
    moe: MoESpec | None = Field(None, description="needed if any layer has mlp: moe")
    hyper_connections: HyperConnectionSpec | None = Field(
        None, description="several residual streams mixed around each sub-layer (qwen4_exp); None: one residual "
        "stream with pre-norms. With them the final norm is the streams' mixer"
    )
    ngram_embedding: NGramEmbeddingSpec | None = Field(None, description="needed if any layer has_ngram_embedding")
    vision: VisionSpec | None = Field(None, description="the vision tower, for image input (None: text only)")
    attention_output_gate: bool = Field(
        True, description="full/sparse attention scale their output by sigmoid(gate), the gate coming from q_proj "
        "(qwen3_next layout); false: plain softmax attention (qwen3_moe)"
    )
    attention_qk_norm: bool = Field(
        True, description="full/sparse attention RMSNorm each head's query and key before RoPE (qwen3); false: no "
        "q/k norm (mixtral)"
    )
    attention_bias: bool = Field(
        False, description="the q, k and v projections of full/sparse attention carry a bias (GLM-4.5)"
    )
    attention_output_bias: bool = Field(
        False, description="o_proj of the full/sparse/qsa attention layers carries a bias (gpt_oss)"
    )
    attention_sinks: bool = Field(
        False, description="full attention layers learn one sink logit per query head, an extra term in the "
        "softmax's denominator that takes share from every key (gpt_oss); not with sparse or qsa layers"
    )
    rope_yarn: YarnSpec | None = Field(
        None, description="YaRN scaling of the full/sparse/qsa attention's rotary dims (None: plain RoPE)"
    )
    tie_word_embeddings: bool = Field(False, description="the LM head shares the token embedding's weight")
    init_std: float = Field(0.02, gt=0, description="std of the normal init of projections and embeddings")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the weight init")
    base_precision: BasePrecision = Field("bf16", description=BASE_PRECISION_DOC)
    checkpoint: Path | None = Field(
        None, description="set by moe-tune when the architecture was read from a checkpoint's config.json; "
        "the weights are then loaded from there"
    )

    @model_validator(mode="after")
    def check_sections_present(self):
        problems = []
        kinds = {layer.attention for layer in self.layers}
        for kind, section in (
            ("linear", self.linear_attention),
            ("sparse", self.sparse_attention),
            ("kda", self.kda_attention),
        ):
            if kind in kinds and section is None:
                problems.append(f"@{kind}_attention (None) must be set: a layer has attention: {kind}")
        mlps = {layer.mlp for layer in self.layers}
        if "moe" in mlps and self.moe is None:
            problems.append("@moe (None) must be set: a layer has mlp: moe")
        if "dense" in mlps and self.intermediate_size == 0:
            problems.append("@intermediate_size (0) must be > 0: a layer has mlp: dense")
        if self.attention_sinks and kinds & {"sparse", "qsa"}:
            problems.append(
                f"@attention_sinks (True) needs no sparse or qsa layer: a layer has attention: "
                f"{sorted(kinds & {'sparse', 'qsa'})[0]}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"@num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"@num_key_value_heads ({self.num_key_value_heads})"
            )
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if self.vision is not None and 2 * sum(self.vision.mrope_section) != rotary_dim:
            problems.append(
                f"@vision.mrope_section ({list(self.vision.mrope_section)}) must sum to half the rotary dim "
                f"({rotary_dim // 2})"
            )
        if rotary_dim % 2:
            problems.append(
                f"@partial_rotary_factor ({self.partial_rotary_factor}) must give an even rotary dim "
                f"(head_dim {self.head_dim} x factor = {rotary_dim})"
            )
        elif rotary_dim == 0 and {layer.attention for layer in self.layers} & {"full", "sparse", "qsa"}:
            problems.append(
                f"@partial_rotary_factor ({self.partial_rotary_factor}) must give a rotary dim of at least 2 "
                f"(head_dim {self.head_dim} x factor = {rotary_dim}): full, sparse and qsa attention rotate by it"
            )
        _raise_if(problems)
        return self

    @model_validator(mode="after")
    def check_mla(self):
        problems = []
        kinds = {layer.attention for layer in self.layers}
        if kinds & {"mla", "mla_sparse"} and self.mla is None:
            problems.append("@mla (None) must be set: a layer has attention: mla or mla_sparse")
        if "mla_sparse" in kinds and self.mla is not None:
            if self.sparse_attention is None:
                problems.append("@sparse_attention (None) must be set: a layer has attention: mla_sparse")
            elif self.sparse_attention.index_head_dim < self.mla.qk_rope_head_dim:
                problems.append(
                    f"@sparse_attention.index_head_dim ({self.sparse_attention.index_head_dim}) must be >= "
                    f"@mla.qk_rope_head_dim ({self.mla.qk_rope_head_dim}): mla_sparse ropes that many indexer dims"
                )
            if self.mla.q_lora_rank is None:
                problems.append("@mla.q_lora_rank (None) must be set: mla_sparse's indexer reads the query latent")
        _raise_if(problems)
        return self

    @model_validator(mode="after")
    def check_qsa_and_streams(self):
        problems = []
        if any(layer.attention == "qsa" for layer in self.layers):
            rotary_dim = int(self.head_dim * self.partial_rotary_factor)
            if self.sparse_attention is None:
                problems.append("@sparse_attention (None) must be set: a layer has attention: qsa")
            elif self.sparse_attention.index_head_dim < rotary_dim:
                problems.append(
                    f"@sparse_attention.index_head_dim ({self.sparse_attention.index_head_dim}) must be >= the rotary "
                    f"dim ({rotary_dim}): qsa ropes that many indexer dims"
                )
        if any(layer.has_ngram_embedding for layer in self.layers):
            if self.ngram_embedding is None:
                problems.append("@ngram_embedding (None) must be set: a layer has has_ngram_embedding: true")
            if self.hyper_connections is None:
                problems.append(
                    "@hyper_connections (None) must be set: n-gram embeddings are injected into the residual streams"
                )
        _raise_if(problems)
        return self


class CheckpointModel(Strict):
    """`model: {checkpoint: DIR}`: the architecture comes from DIR/config.json (engine/families maps it)."""

    checkpoint: Path = Field(
        description="Hugging Face checkpoint directory: config.json, *.safetensors in the hub's key layout, and "
        "usually the tokenizer files"
    )
    base_precision: BasePrecision = Field("bf16", description=BASE_PRECISION_DOC)

    @model_validator(mode="after")
    def check_checkpoint_dir(self):
        problems = []
        if not self.checkpoint.is_dir():
            problems.append(f"@checkpoint ('{self.checkpoint}') must be an existing directory")
        elif not (self.checkpoint / "config.json").is_file():
            problems.append(f"@checkpoint ('{self.checkpoint}') must hold a config.json")
        elif not any(self.checkpoint.glob("*.safetensors")):
            pickles = sorted(p.name for p in self.checkpoint.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            found = f" (found {', '.join(pickles[:3])}: moe-tune reads only safetensors, never pickles)"
            found = found if pickles else ""
            problems.append(f"@checkpoint ('{self.checkpoint}') must hold *.safetensors weights{found}")
        _raise_if(problems)
        return self


def model_kind(value: Any) -> str:
    """`{checkpoint: DIR}` alone is a checkpoint reference; a section with the architecture is a spec (a resolved
    profile keeps `checkpoint` next to the architecture read from it)."""
    if isinstance(value, dict):
        return "checkpoint" if "checkpoint" in value and "hidden_size" not in value else "spec"
    return "checkpoint" if isinstance(value, CheckpointModel) else "spec"


# The tag names the kind of `model:` section; the loader leaves it out of error paths.
ModelSection = Annotated[
    Union[Annotated[ModelProfile, Tag("spec")], Annotated[CheckpointModel, Tag("checkpoint")]],
    Discriminator(model_kind),
]


DataFormat = Literal["auto", "text", "messages", "alpaca", "sharegpt"]
_DATA_FILE = ("a data file: JSONL (one record a line), a JSON array of records ('[' first), Parquet (.parquet), or "
              "a folder written by datasets' save_to_disk (one split's folder of a DatasetDict)")
# A source's weight copies its documents into every epoch: more than this is a schedule (train.epochs), not a mix.
MAX_SOURCE_WEIGHT = 100.0


class DataSource(Strict):
    path: Path = Field(description=_DATA_FILE)
    weight: float = Field(
        1.0, gt=0, le=MAX_SOURCE_WEIGHT, description="documents of this source per epoch: each of its n documents "
        "floor(weight) times, plus round((weight - floor(weight)) * n) of them (half up) once more, chosen with "
        "data.seed without repeats: 1 each once, 2 each twice, 0.5 a seeded half; a source left with no document "
        "is an error"
    )
    format: DataFormat | None = Field(None, description="the format of this source's records; None: data.format")


class DataProfile(Strict):
    path: Path | None = Field(
        None, description=f"{_DATA_FILE}; records in data.format. None (and no data.sources): the built-in "
        "generated corpus of the tiny default"
    )
    sources: list[DataSource] | None = Field(
        None, min_length=1, description="several data files mixed by weight, instead of data.path: "
        "[{path, weight, format}]"
    )
    format: DataFormat = Field(
        "auto", description="the records' format: text {text}, messages {messages: [{role, content}], images?}, "
        "alpaca {instruction, input?, output, system?, history?} (user: instruction + '\\n' + input when input is "
        "not empty), sharegpt {conversations: [{from, value}], system?} (roles through data.roles, else human: user, "
        "gpt: assistant, system: system); auto: each source's first record decides (messages, conversations, "
        "instruction + output, text: the first found) and every record of the source must match it (text and messages "
        "records may share one)"
    )
    eval_path: Path | None = Field(
        None, description=f"the evaluation records, {_DATA_FILE[2:]}, in data.format; a training document equal to "
        "one of them (same tokens) is left out of training"
    )
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="instead of data.eval_path: hold out this fraction of each source's distinct "
        "documents (round half up, chosen with data.seed, before weights; every copy of a held-out document is held "
        "out) for evaluation; both sides must keep at least one"
    )
    tokenizer: str | None = Field(
        None, description="'byte' (built-in byte-level tokenizer) or a directory with tokenizer files (transformers); "
        "unset: the checkpoint's own tokenizer with model.checkpoint, else 'byte'"
    )
    seq_len: int = Field(
        ge=8, le=MAX_SIZE, description="tokens per packed row; documents are packed, never attending across"
    )
    text_field: str = Field("text", description="key of plain-text records")
    messages_field: str = Field("messages", description="key of chat records (list of {role, content})")
    roles: dict[str, str] = Field(
        default_factory=dict, description="record role names mapped onto the chat roles system, user and assistant, "
        "e.g. {bot: assistant}; data.format sharegpt maps human, gpt and system itself unless named here; a message "
        "whose role is none of those after the mapping is an error naming its record"
    )
    corpus: Literal["stories", "shapes"] = Field(
        "stories", description="the built-in corpus when neither data.path nor data.sources is set: generated "
        "stories (text), or pictures of coloured shapes with their descriptions (image-text, for models with "
        "model.vision)"
    )
    corpus_documents: int = Field(
        2000, ge=1, le=MAX_SIZE, description="documents of the built-in corpus (no data.path nor data.sources)"
    )
    image_min_pixels: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="images smaller than this many pixels are upscaled (None: the "
        "checkpoint's image processor setting, else 56 x 56)"
    )
    image_max_pixels: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="images larger than this many pixels are downscaled, aspect ratio kept "
        "(None: the checkpoint's image processor setting, else 28 x 28 x 1280)"
    )
    bad_images: Literal["error", "skip"] = Field(
        "error", description="a record whose image is missing or unreadable: error (stop before training, naming "
        "the record and file) or skip (leave the record out and count it)"
    )
    allow_paths_outside: bool = Field(
        False, description="image paths in records may lead outside the data file's folder, and a save_to_disk "
        "folder's files outside that folder: absolute paths, '..' and symlinks (false: such a record or folder is an "
        "error naming it)"
    )
    max_record_bytes: int = Field(
        64 * 2**20, ge=1, le=MAX_SIZE, description="the largest record in bytes (a JSONL line, a JSON array's item, "
        "a Parquet or saved dataset row as JSON): a larger one is an error naming it, and a JSON file's is never "
        "held in memory whole (64 MiB: over ten times a million-token text)"
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="seed of the data order, of data.eval_fraction's held-out records, of the "
        "documents a fractional data.sources weight picks (and of the built-in corpus)"
    )
    train_on: Literal["assistant", "all"] = Field(
        "assistant", description="chat records: the tokens trained on: assistant (each assistant turn's content and "
        "the token closing it) or all (every token of the conversation: system and user turns, headers; never an "
        "image's tokens). Text records are always trained in full"
    )
    train_on_assistant_header: bool = Field(
        False, description="chat records with train_on: assistant: also train each assistant turn's header, the "
        "tokens the chat template's generation prompt adds before it (e.g. '<|im_start|>assistant\\n'; "
        "'<|assistant|>\\n' in the built-in format); train_on: all trains them anyway"
    )
    chat_template: str | None = Field(
        None, description="the Jinja chat template chat records are rendered with, instead of the tokenizer's: the "
        "template's text, or the path of a .jinja file (a one-line value ending in .jinja without '{{' or '{%', "
        "relative to the working directory as data.path; a regular UTF-8 file of at most 1 MiB). Rendered in "
        "transformers' sandboxed Jinja environment (needs transformers), with the byte tokenizer too. None: the "
        "tokenizer's own template, else the built-in format '<|role|>\\ncontent\\n'"
    )

    @model_validator(mode="after")
    def check_chat_template(self):
        if self.chat_template is not None:
            _raise_if(read_chat_template(self.chat_template, "@chat_template", compile=True)[1])
        return self

    @property
    def uses_corpus(self) -> bool:
        """No data.path nor data.sources: the built-in corpus."""
        return self.path is None and self.sources is None

    @model_validator(mode="after")
    def check_dataset(self):
        problems = _role_problems(self.roles)
        if self.path is not None and self.sources is not None:
            problems.append("@path and @sources are two ways to name the data: give one of them")
        reads = DATA_FILES_CHECKED.get()
        if self.path is not None and reads:
            problems += _data_file_problems(self.path)
        for i, source in enumerate((self.sources or []) if reads else []):
            problems += _data_file_problems(source.path, f"@sources.{i}.path")
        if self.eval_path is not None and self.eval_fraction is not None:
            problems.append(f"@eval_path and @eval_fraction ({self.eval_fraction}) are two ways to choose the "
                            "evaluation records: give at most one of them")
        if self.eval_path is not None and reads:
            problems += _data_file_problems(self.eval_path, "@eval_path")
        if reads:
            problems += _same_file_problems(self)
        if self.text_field == self.messages_field:
            problems.append(f"@text_field and @messages_field both name the key {self.text_field!r}: a record's key "
                            "says whether it is text or a chat, so they must differ")
        if self.tokenizer not in (None, "byte") and not Path(self.tokenizer).is_dir():
            problems.append(f"@tokenizer ('{self.tokenizer}') must be 'byte' or an existing directory")
        _raise_if(problems)
        return self


# A chat template file larger than this is refused: published chat templates are a few tens of KiB.
MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def is_chat_template_path(value: str) -> bool:
    """data.chat_template's rule: one line ending in .jinja, holding no Jinja tag, names a file; else it is the
    template's text."""
    return value.endswith(".jinja") and "\n" not in value and "{{" not in value and "{%" not in value


def read_chat_template(value: str, field: str, compile: bool = False) -> tuple[str | None, list[str]]:
    """(the template's text, problems): the value itself, or the .jinja file it names (a regular UTF-8 file of at
    most MAX_CHAT_TEMPLATE_BYTES); with `compile`, a Jinja syntax error is a problem too. Problems name `field`."""
    shown = f"{field} ('{value}')" if is_chat_template_path(value) else f"{field} (inline template)"
    text = value
    if is_chat_template_path(value):
        try:
            fd = os.open(value, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None, [f"{shown} must name an existing .jinja file (a one-line value ending in .jinja is a path; "
                          "anything else is the template's text)"]
        except (OSError, ValueError) as err:
            return None, [f"{shown} cannot be read ({getattr(err, 'strerror', None) or err})"]
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            return None, [f"{shown} must be a regular file, not {file_kind(mode)}"]
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as err:
            return None, [f"{shown} must be UTF-8 text (not at byte {err.start}: {err.reason})"]
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CHAT_TEMPLATE_BYTES:
        return None, [f"{shown} must be at most {MAX_CHAT_TEMPLATE_BYTES} bytes (1 MiB)"]
    if not text.strip():
        return None, [f"{shown} must be a Jinja template or the path of a .jinja file, not empty"]
    if compile:
        problem = _jinja_problem(text)
        if problem:
            return None, [f"{shown}: {problem}"]
    return text, []


def _jinja_problem(text: str) -> str | None:
    # transformers' own sandboxed environment: its {% generation %} tag and filters parse as they will render.
    try:
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return "a chat template needs transformers (its sandboxed Jinja renderer): pip install transformers"
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:
        message = " ".join(str(err.message).split())
        return f"Jinja syntax error on line {err.lineno} of the template: {message:.200}"
    except RecursionError:
        return "the template is nested too deeply to parse"
    return None


def _role_problems(roles: dict[str, str]) -> list[str]:
    """data.roles maps record roles onto the roles every chat template knows."""
    chat_roles = ("system", "user", "assistant", "tool")
    return [f"@roles.{name} ({role!r}) must be one of {', '.join(chat_roles)}"
            for name, role in roles.items() if role not in chat_roles]


_FILE_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
               stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def file_kind(mode: int) -> str:
    """What a stat mode that is not a regular file's is, for messages: 'a FIFO', 'a directory', ..."""
    return next((name for test, name in _FILE_KINDS.items() if test(mode)), "a special file")


# Whether a profile's data files are checked as it is validated (they exist, are regular, hold a record): not when a
# finished run's profile.yaml is read to export or generate from it, which read no data (data_files_unchecked).
DATA_FILES_CHECKED: ContextVar[bool] = ContextVar("DATA_FILES_CHECKED", default=True)


@contextmanager
def data_files_unchecked() -> Iterator[None]:
    token = DATA_FILES_CHECKED.set(False)
    try:
        yield
    finally:
        DATA_FILES_CHECKED.reset(token)


def _data_file_problems(path: Path, field: str = "@path") -> list[str]:
    """A data path must be a readable regular file (a FIFO or device would block or never end) holding a record, or
    a folder written by datasets' save_to_disk (its own files are checked when it is read)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        # A shell expands wildcards, a profile does not.
        has_wildcard = bool(set("*?[") & set(str(path)))
        wildcard = " (wildcards are not expanded: name each file in data.sources)" if has_wildcard else ""
        return [f"{field} ('{path}') must be an existing file{wildcard}"]
    except (OSError, ValueError) as err:
        return [f"{field} ('{path}') cannot be read ({getattr(err, 'strerror', None) or err})"]
    if stat.S_ISDIR(mode):
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return []
        return [f"{field} ('{path}') must be a regular file or a folder written by datasets' save_to_disk (this "
                "directory has no state.json or dataset_dict.json)"]
    if not stat.S_ISREG(mode):
        return [f"{field} ('{path}') must be a regular file, not {file_kind(mode)}"]
    try:
        if not _has_content(path):
            what = "the file is empty" if path.stat().st_size == 0 else "the file holds only whitespace"
            return [f"{field} ('{path}') must hold at least one record ({what})"]
    except OSError as err:
        return [f"{field} ('{path}') cannot be read ({err.strerror or err})"]
    return []


def _same_file_problems(data: DataProfile) -> list[str]:
    """Each data file or folder may be named once (links and other spellings of one path followed): a training file
    named twice silently doubles its weight, and evaluation records that are training records leave nothing to train
    on (a training document equal to an evaluation one is left out)."""
    named = [("@path", data.path)] if data.path is not None else []
    named += [(f"@sources.{i}.path", source.path) for i, source in enumerate(data.sources or [])]
    named += [("@eval_path", data.eval_path)] if data.eval_path is not None else []
    problems = []
    first: dict[tuple[int, int], tuple[str, Path]] = {}
    for field, path in named:
        try:
            status = os.stat(path)
        except (OSError, ValueError):
            # _data_file_problems names it.
            continue
        identity = (status.st_dev, status.st_ino)
        if identity not in first:
            first[identity] = (field, path)
            continue
        first_field, first_path = first[identity]
        if field == "@eval_path":
            problems.append(f"{field} ('{path}') is the file {first_field} ('{first_path}') names: evaluation records "
                            "must not be training records (@eval_fraction holds some of them out instead)")
        else:
            problems.append(f"{field} ('{path}') is the file {first_field} ('{first_path}') names: name each file once "
                            "(a weight of 2 takes its documents twice)")
    return problems


def _has_content(path: Path) -> bool:
    # In blocks: a file of one huge line must not be read whole here.
    with path.open("rb") as f:
        head = f.read(1 << 20).removeprefix(b"\xef\xbb\xbf")
        while head:
            if head.strip():
                return True
            head = f.read(1 << 20)
    return False


class LoraProfile(Strict):
    enabled: bool = Field(True, description="LoRA fine-tuning; false trains every weight (full fine-tuning)")
    r: int = Field(8, ge=1, le=MAX_SIZE, description="rank of every adapter")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the input of each linear adapter's A while training (PEFT's "
        "lora_dropout); 0 with experts: true, as expert adapters take none"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="linear layers that get adapters, by name or dotted suffix of their full names (q_proj, "
        "self_attn.q_proj, layers.0.self_attn.q_proj: PEFT's list form of target_modules)",
    )
    experts: bool = Field(True, description="adapters on the routed experts too (per-expert A and B)")
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="modules trained in full and saved with the adapter (PEFT modules_to_save), e.g. [lm_head]",
    )
    vision_tower: Literal["frozen", "lora", "trained"] = Field(
        "frozen", description="models with a vision tower: its patch embedding and ViT blocks stay frozen, get "
        "adapters (on the blocks' linear layers), or train in full"
    )
    vision_merger: Literal["frozen", "lora", "trained"] = Field(
        "trained", description="models with a vision tower: the patch merger into the text width (usually trained)"
    )

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def check_names_are_a_list(cls, value: Any, info: ValidationInfo) -> Any:
        """PEFT also takes target_modules as one string, a regular expression over full module names ('all-linear'
        a name of its own); moe-tune takes lists of names only."""
        if not isinstance(value, str):
            return value
        if info.field_name == "target_modules":
            raise PydanticCustomError(
                VALUE_RULE,
                "must be a list of module names or dotted suffixes of them, e.g. [q_proj, self_attn.v_proj] (PEFT's "
                "single-string form, a regular expression or 'all-linear', is not supported)",
            )
        raise PydanticCustomError(
            VALUE_RULE, "must be a list of module names or dotted suffixes of them, e.g. [lm_head]"
        )

    @model_validator(mode="after")
    def check_dropout_reaches_every_adapter(self):
        """PEFT applies lora_dropout to the input of A in linear adapters and refuses it on parameter adapters
        (target_parameters, the experts' form in transformers); the per-expert adapters share their input with the
        fused expert GEMM and take none either, so dropout with expert adapters would reach only some adapters."""
        if self.enabled and self.experts and self.dropout > 0:
            raise ValueError(
                f"@dropout ({self.dropout}) must be 0 with @experts (true): expert adapters take no dropout (nor "
                "does PEFT's form of them, target_parameters), so only the linear adapters would get it: set "
                "@dropout 0, or @experts false to keep dropout on linear adapters alone"
            )
        return self


# The token mixers (LayerSpec.attention) that run on a row shared by several ranks (PackedBatch.context): each
# exchanges what crosses the cut between ranks (engine/model); the other kinds are refused under context parallelism.
CONTEXT_PARALLEL_MIXERS: tuple[str, ...] = ("linear", "sparse", "full", "kda", "mla", "mla_sparse", "qsa")


class ParallelProfile(Strict):
    zero_stage: Literal[0, 1, 2, 3] = Field(3, description="DeepSpeed ZeRO stage for dense weights")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto: nccl on GPU")
    expert_parallel: int = Field(
        1, ge=1, le=MAX_SIZE, description="ranks that share the routed experts of a layer (each holds num_experts / "
        "this many); the data-parallel size is world size / expert_parallel"
    )
    context_parallel: int = Field(
        1, ge=1, le=MAX_SIZE, description="ranks that share one packed row, each holding its next row_tokens / "
        "this many tokens (consecutive ranks form a group); the rows are split over world size / context_parallel "
        "data-parallel ranks. 1: every rank holds whole rows"
    )
    offload_optimizer: bool = Field(False, description="keep optimizer state in host memory (ZeRO offload)")
    timeout_s: float = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, description="a collective that waits longer than this (a rank died or hangs) "
        "ends the run"
    )

    @model_validator(mode="after")
    def check_zero_stage(self):
        problems = []
        # Sharded experts are reduced over their expert-data-parallel group through ZeRO-3's partition tags
        # (engine/parallel); DeepSpeed's stages 0-2 reduce such tagged parameters only through its own MoE groups,
        # which moe-tune does not create (each failed inside DeepSpeed on 2 gloo ranks, deepspeed 0.19.8).
        if self.expert_parallel > 1 and self.zero_stage != 3:
            problems.append(
                f"@zero_stage ({self.zero_stage}) must be 3 when @expert_parallel ({self.expert_parallel}) > 1 "
                "(stages 0-2 do not reduce sharded experts' gradients)"
            )
        # DeepSpeed reads the offload setting only inside ZeRO (stage >= 1); at stage 0 it would be ignored silently.
        if self.offload_optimizer and self.zero_stage == 0:
            problems.append("@offload_optimizer (True) needs @zero_stage >= 1 (got 0): stage 0 has no ZeRO optimizer")
        _raise_if(problems)
        return self


# What backward gets from an operator class's saved tensors: kept (GPU, within the budget), recomputed, or copied
# to host memory and back. docs/memory.md defines the classes, presets and tiers.
OperatorChoice = Literal["save", "recompute", "offload"]
_OPERATOR_CHOICE = "None: the preset's choice; save (GPU tier), recompute (in backward) or offload (host tier)"


class MemoryProfile(Strict):
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer whole in backward (the coarsest policy; it replaces "
        "preset and the operator classes, which must stay unset)"
    )
    preset: Literal["none", "balanced", "max-context"] = Field(
        "none", description="none: save everything on the GPU; balanced: recompute norms and activations, offload "
        "the experts' saved tensors; max-context: recompute attention, norms and activations, offload the rest, GPU "
        "budget 0. Fields set below override the preset"
    )
    linear: OperatorChoice | None = Field(None, description=f"linear layers (LoRA included): {_OPERATOR_CHOICE}")
    experts: OperatorChoice | None = Field(None, description=f"routed experts (grouped GEMM): {_OPERATOR_CHOICE}")
    attention: OperatorChoice | None = Field(
        None, description=f"token mixers (attention, linear attention and its states, short conv): {_OPERATOR_CHOICE}"
    )
    norm: OperatorChoice | None = Field(None, description=f"RMSNorms: {_OPERATOR_CHOICE}")
    activation: OperatorChoice | None = Field(
        None, description=f"SwiGLU activations (shared expert, dense MLP) and residual adds: {_OPERATOR_CHOICE}"
    )
    router: OperatorChoice | None = Field(
        None, description=f"MoE router and gating (recompute reruns the whole MoE block): {_OPERATOR_CHOICE}"
    )
    gpu_budget_gb: float | None = Field(
        None, ge=0, description="GPU memory (GB) for saved tensors kept on the GPU; past it the coldest (needed "
        "latest in backward) move to host memory. None: the preset's (none and balanced: no budget; max-context: 0)"
    )
    prefetch_layers: int | None = Field(
        None, ge=0, le=MAX_SIZE, description="swap-in runs this many layers ahead of backward (0: on demand). None: "
        "the preset's (1)"
    )
    min_offload_mb: float | None = Field(
        None, ge=0, description="smaller saved tensors stay on the GPU (not worth a copy). None: the preset's (1 MB)"
    )
    sequence_chunk_tokens: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="run each layer's per-token part (post-attention norm, MLP or MoE block: "
        "router, experts, shared expert; residual add) and its token mixer (linear attention slab by slab, its state "
        "and conv halo carried; softmax attention a chunk of queries at a time over the keys it sees; a "
        "context-parallel share is one chunk) this many tokens at a time, each chunk recomputed in backward, so no "
        "[T, k x hidden], [T, 2F] or [T, E] intermediate nor a token mixer's projections over the row exist; load "
        "counts, capacity and the aux loss stay the whole row's. Works with every policy above. None: whole rows"
    )

    @model_validator(mode="after")
    def check_checkpointing_alone(self):
        problems = []
        if self.activation_checkpointing:
            if self.preset != "none":
                problems.append(
                    f"@activation_checkpointing (true) recomputes whole layers: @preset ('{self.preset}') must be "
                    "'none' with it"
                )
            chosen = [name for name in _OPERATOR_FIELDS + _TIER_FIELDS if getattr(self, name) is not None]
            for name in chosen:
                problems.append(
                    f"@{name} ({getattr(self, name)!r}) must be unset with @activation_checkpointing (true), "
                    "which recomputes whole layers"
                )
        _raise_if(problems)
        return self


_OPERATOR_FIELDS = ("linear", "experts", "attention", "norm", "activation", "router")
# The offload tier's settings: meaningless when whole layers are recomputed.
_TIER_FIELDS = ("gpu_budget_gb", "prefetch_layers", "min_offload_mb")


class TrainProfile(Strict):
    steps: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="optimizer steps; set this or epochs, not both (a step may end in the "
        "next epoch: the shuffled rows of one epoch run on into the next)"
    )
    epochs: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="passes over the training rows instead of steps: the steps are "
        "ceil(rows of the epochs / (micro_batch_size x gradient_accumulation_steps x ranks)), so every row is "
        "trained at least this many times (the last step's remaining rows come from the next epoch's order)"
    )
    micro_batch_size: int = Field(ge=1, le=MAX_SIZE, description="packed rows per micro-batch per rank")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_SIZE, description="micro-batches per optimizer step")
    lr: float = Field(gt=0, description="peak learning rate")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warm-up")
    warmup_steps: int = Field(0, ge=0, le=MAX_SIZE, description="linear warm-up steps")
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="warm-up as a share of the run's steps (floor(ratio x steps)) instead of "
        "warmup_steps, which must then stay 0"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a share of the peak (cosine, linear)")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay, on every trained weight but biases and normalisation weights (as "
        "transformers' Trainer decays them)"
    )
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm (0: no clipping)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="compute dtype of weights and activations")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of everything random during training")
    log_every: int = Field(
        10, ge=1, le=MAX_SIZE, description="steps between log lines when the console is not a terminal"
    )
    cuda_graphs: Union[bool, Literal["auto"]] = Field(
        "auto", description="replay each MoE block's forward and backward as CUDA graphs (one GPU's step waits on "
        "the host's launches; the same kernels as eager): auto where the run allows it (a CUDA device, ZeRO stage "
        "1-2, expert_parallel 1, memory preset none without checkpointing), true (or an error saying why not), false"
    )
    eval_every: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="with eval data (data.eval_path or data.eval_fraction): steps between "
        "evaluations, plus one after the last step; None: every output.save_every steps, so each checkpoint has "
        "its eval loss"
    )
    eval_batches: int | None = Field(
        None, ge=1, le=MAX_SIZE, description="micro-batches (micro_batch_size rows on every rank) per evaluation, "
        "the first ones of the eval rows each time; None: all the eval rows"
    )

    @model_validator(mode="after")
    def check_schedule(self):
        problems = []
        if (self.steps is None) == (self.epochs is None):
            problems.append(f"@steps ({self.steps}) and @epochs ({self.epochs}): set exactly one of them (set the "
                            "other to null to switch)")
        elif self.steps is not None and self.warmup_steps >= self.steps:
            problems.append(f"@warmup_steps ({self.warmup_steps}) must be < @steps ({self.steps})")
        if self.warmup_ratio is not None and self.warmup_steps:
            problems.append(f"@warmup_ratio ({self.warmup_ratio}) and @warmup_steps ({self.warmup_steps}): set at "
                            "most one of them")
        if not all(0 <= b < 1 for b in self.betas):
            problems.append(f"@betas ({list(self.betas)}) must each be in [0, 1)")
        _raise_if(problems)
        return self


class OutputProfile(Strict):
    dir: Path = Field(description="where metrics, checkpoints, the adapter and the DeepSpeed config go")
    save_every: int = Field(
        100, ge=1, le=MAX_SIZE, description="steps between checkpoints (one is also written at the end)"
    )
    keep_last: int = Field(
        2, ge=1, le=MAX_SIZE, description="checkpoints kept; older ones are deleted, except the one with the lowest "
        "eval loss (with eval data)"
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that also get every metrics record (metrics.jsonl is always written); "
        "each needs its extra: pip install 'moe-tune[tensorboard]' (or wandb, mlflow)",
    )
    run_name: str | None = Field(
        None, min_length=1, description="the run's name in W&B and MLflow (default: the profile's name)"
    )
    wandb_project: str = Field(
        "moe-tune", min_length=1, description="W&B project (the mode comes from WANDB_MODE: online, offline)"
    )
    mlflow_tracking_uri: str | None = Field(
        None, min_length=1, description="MLflow tracking URI (default: a file store in output.dir/mlruns)"
    )
    mlflow_experiment: str = Field("moe-tune", min_length=1, description="MLflow experiment name")
    save_merged: bool = Field(
        False, description="LoRA runs: also write merged/, the model with the adapters merged in as `moe-tune export "
        "--merge` writes it (assembled on rank 0: needs the whole model in its host memory)"
    )

    @model_validator(mode="before")
    @classmethod
    def check_no_tensorboard_flag(cls, data: Any) -> Any:
        # The old switch wrote nothing when tensorboard was absent; report_to refuses instead (one spelling).
        if isinstance(data, dict) and "tensorboard" in data:
            value = data["tensorboard"]
            hint = "add tensorboard to @report_to" if value is True else "delete it (@report_to defaults to [])"
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ValueError(f"@tensorboard ({shown}) was replaced by @report_to: {hint}")
        return data

    @model_validator(mode="after")
    def check_report_to_once(self):
        repeated = sorted({name for name in self.report_to if self.report_to.count(name) > 1})
        if repeated:
            _raise_if([f"@report_to ({', '.join(repeated)}) must name each tracker once"])
        return self


class JobProfile(Strict):
    name: str = Field(description="job name, shown in logs and written to the outputs")
    model: ModelSection = Field(
        description="architecture of the model to fine-tune, or {checkpoint: DIR} to start from a Hugging Face checkpoint"
    )
    data: DataProfile = Field(description="training data and tokenizer")
    lora: LoraProfile = Field(default_factory=LoraProfile, description="adapters (or full fine-tuning)")
    parallel: ParallelProfile = Field(default_factory=ParallelProfile, description="distribution of the weights")
    memory: MemoryProfile = Field(default_factory=MemoryProfile, description="what backward keeps or recomputes")
    train: TrainProfile = Field(description="optimizer and schedule")
    output: OutputProfile = Field(description="what is written where")

    @property
    def tokenizer(self) -> str:
        """The tokenizer to load: data.tokenizer, else the checkpoint's directory, else 'byte'."""
        if self.data.tokenizer is not None:
            return self.data.tokenizer
        if self.model.checkpoint is not None:
            return str(self.model.checkpoint)
        return "byte"

    @model_validator(mode="after")
    def check_fp8_base_is_frozen(self):
        if self.model.base_precision == "fp8" and not self.lora.enabled:
            raise ValueError(
                "model.base_precision ('fp8') needs lora.enabled (true): FP8 base weights are frozen and take no "
                "gradient, so full fine-tuning (lora.enabled false) needs model.base_precision 'bf16'"
            )
        return self

    @model_validator(mode="after")
    def check_tied_head_is_not_trained_apart(self):
        """A model whose LM head is its token embedding (tie_word_embeddings): PEFT trains a module named in
        modules_to_save as its own copy and adapts a target alone, so either would part the head from the embedding,
        which a model of tied weights cannot hold (the export and generate's model keep one matrix for both)."""
        model, lora = self.model, self.lora
        if isinstance(model, CheckpointModel) or not model.tie_word_embeddings or not lora.enabled:
            return self
        problems = [f"lora.{field} ({names}): {name} shares its weight with {other} (model.tie_word_embeddings: true), "
                    f"and {how}, which a model of tied weights cannot hold; leave {name} out"
                    for field, names, how in (("modules_to_save", lora.modules_to_save, "PEFT trains a copy of it apart"),
                                              ("target_modules", lora.target_modules, "an adapter on it changes it alone"))
                    for name, other in (("lm_head", "embed_tokens"), ("embed_tokens", "lm_head"))
                    # PEFT matches a name as the end of a module's name.
                    if any(n == name or n.endswith("." + name) for n in names)]
        _raise_if(problems)
        return self

    @model_validator(mode="after")
    def check_tokenizer_fits_model(self):
        problems = []
        if isinstance(self.model, CheckpointModel):
            # The architecture is not known before engine.families reads config.json; it re-validates then.
            if self.data.uses_corpus and self.data.tokenizer != "byte":
                problems.append("data.path (None) must be set with model.checkpoint (the built-in corpus is byte-level)")
            _raise_if(problems)
            return self
        if self.tokenizer == "byte" and self.model.vocab_size < BYTE_VOCAB_SIZE:
            problems.append(
                f"model.vocab_size ({self.model.vocab_size}) must be >= {BYTE_VOCAB_SIZE} for data.tokenizer 'byte'"
            )
        if self.data.uses_corpus and self.data.corpus == "shapes" and self.model.vision is None:
            problems.append("data.corpus ('shapes') needs a model with a vision tower (model.vision)")
        ep = self.parallel.expert_parallel
        if self.model.moe is not None and self.model.moe.num_experts % ep:
            problems.append(
                f"parallel.expert_parallel ({ep}) must divide model.moe.num_experts ({self.model.moe.num_experts})"
            )
        if self.data.uses_corpus and self.tokenizer != "byte":
            problems.append(f"data.tokenizer ('{self.tokenizer}') must be 'byte' with the built-in corpus")
        _raise_if(problems)
        return self

    @model_validator(mode="after")
    def check_context_parallel(self):
        """What a row shared by parallel.context_parallel ranks needs (engine/parallel/context.py)."""
        cp = self.parallel.context_parallel
        if cp == 1:
            return self
        problems, at = [], f"parallel.context_parallel ({cp})"
        if self.data.seq_len % cp:
            problems.append(f"data.seq_len ({self.data.seq_len}) must be a multiple of {at}: each rank holds an "
                            "equal share of the row")  # fmt: skip
        model = self.model
        if isinstance(model, CheckpointModel):
            # The architecture's rules apply once engine/families has read config.json (the profile is validated again).
            _raise_if(problems)
            return self
        refused = {}
        for index, layer in enumerate(model.layers):
            if layer.attention not in CONTEXT_PARALLEL_MIXERS:
                refused.setdefault(layer.attention, index)
        for kind, index in refused.items():
            problems.append(f"model.layers[{index}].attention ('{kind}') must be one of "
                            f"{', '.join(CONTEXT_PARALLEL_MIXERS)} with {at}: those exchange what crosses the cut "
                            "between ranks")  # fmt: skip
        share = self.train.micro_batch_size * self.data.seq_len // cp
        for section in (model.linear_attention, model.kda_attention):
            # A short convolution's first taps on a rank read the previous rank's last inputs (its halo).
            if section is not None and share < section.conv_kernel_size - 1:
                problems.append(f"{at} leaves {share} tokens a rank (train.micro_batch_size x data.seq_len / "
                                f"{cp}): fewer than the short convolution's reach ({section.conv_kernel_size - 1})")
        if model.vision is not None:
            problems.append(f"{at} needs a text-only model: model.vision's images and their (t, h, w) positions span "
                            "the row")  # fmt: skip
        if model.ngram_embedding is not None:
            problems.append(f"{at} needs model.ngram_embedding (set) unset: an n-gram reaches back across the cut "
                            "between ranks")  # fmt: skip
        if model.moe is not None and model.moe.capacity_factor > 0:
            problems.append(f"model.moe.capacity_factor ({model.moe.capacity_factor}) must be 0 with {at}: capacity "
                            "positions count the row's earlier tokens, held on other ranks")  # fmt: skip
        aux = model.moe.aux_loss_coef if model.moe is not None else 0.0
        chunk = self.memory.sequence_chunk_tokens
        # The row's Switch loss is combined over the ranks from each rank's whole share, in the plain decoder layer.
        if chunk is not None and aux > 0:
            problems.append(f"memory.sequence_chunk_tokens ({chunk}) must be unset with {at} and "
                            f"model.moe.aux_loss_coef ({aux}) > 0: the row's aux loss is combined over the ranks "
                            "from whole shares, not chunks")  # fmt: skip
        if model.hyper_connections is not None and aux > 0:
            problems.append(f"model.moe.aux_loss_coef ({aux}) must be 0 with {at} and model.hyper_connections: the "
                            "row's aux loss is combined over the ranks in the plain decoder layer only")  # fmt: skip
        _raise_if(problems)
        return self


# Settings that act only on a model with a vision tower, and those of LoRA that full fine-tuning does not read (the
# vision choices it does: the parts set frozen stay frozen).
_VISION_ONLY = {"data": ("image_min_pixels", "image_max_pixels", "bad_images"), "lora": ("vision_tower",
                                                                                          "vision_merger")}
_LORA_ONLY = ("r", "alpha", "dropout", "target_modules", "experts", "modules_to_save")


def dump_with_absolute_paths(profile: JobProfile) -> dict[str, Any]:
    """The profile as JSON values with the files and folders it names absolute (relative ones are read from the
    working directory): what a run keeps of it names the same files from any folder."""
    dumped = profile.model_dump(mode="json")
    model, data = dumped["model"], dumped["data"]

    def absolute(value: Any) -> Any:
        return os.path.abspath(value) if isinstance(value, str) else value

    model["checkpoint"] = absolute(model.get("checkpoint"))
    data["path"], data["eval_path"] = absolute(data["path"]), absolute(data["eval_path"])
    for source in data["sources"] or []:
        source["path"] = absolute(source["path"])
    if data["tokenizer"] not in (None, "byte"):
        data["tokenizer"] = absolute(data["tokenizer"])
    if data["chat_template"] is not None and is_chat_template_path(data["chat_template"]):
        data["chat_template"] = absolute(data["chat_template"])
    dumped["output"]["dir"] = absolute(dumped["output"]["dir"])
    return dumped


def ignored_setting_notes(profile: JobProfile) -> list[str]:
    """One `note:` line per reason settings the profile gives (its YAML or a --set names them) do nothing in this
    run: the built-in corpus's beside data.path or data.sources, the image settings and vision choices of a model
    without a vision tower, LoRA's settings under full fine-tuning. (`profile`: resolved, a checkpoint's architecture
    read.)"""
    data, lora = profile.data, profile.lora
    ignored: list[tuple[list[str], str]] = []
    if data.path is not None or data.sources:
        given = "data.path" if data.path is not None else "data.sources"
        ignored.append(([f"data.{n}" for n in ("corpus", "corpus_documents") if n in data.model_fields_set],
                        f"{given} is set (the built-in corpus is made only without it)"))
    if profile.model.vision is None:
        ignored.append(([f"{section}.{n}" for section, names in _VISION_ONLY.items() for n in names
                         if n in getattr(profile, section).model_fields_set],
                        "the model has no vision tower (model.vision)"))  # fmt: skip
    if not lora.enabled:
        ignored.append(([f"lora.{n}" for n in _LORA_ONLY if n in lora.model_fields_set],
                        "lora.enabled is false (full fine-tuning)"))
    return [f"note: {', '.join(names)} {'is' if len(names) == 1 else 'are'} ignored: {why}"
            for names, why in ignored if names]
