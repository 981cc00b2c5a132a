"""Plan a parallel layout on paper: parameter shapes of the profile's model, then per-device memory and traffic for
every data x expert layout of N devices. The model is built on torch's meta device (shapes only, no memory), so
every block kind counts exactly and a profile of trillions of parameters plans in seconds. docs/plan.md
gives every formula.

Symbols: N devices, ep expert-parallel size, dp = N / ep data-parallel size, E routed experts per MoE layer, k experts
per token, D model dim, F expert hidden dim, c context-parallel size (parallel.context_parallel: c devices share each
row), T_row tokens of a micro-batch's row (micro_batch_size x seq_len), T = T_row / c tokens per device per
micro-batch, b bytes per element of the training dtype, r LoRA rank.

`model.base_precision: fp8` stores the frozen base weights of the token mixers, dense MLPs, shared and routed experts
in FP8 e4m3 (1 byte an element) with one fp32 scale per 128 x 128 block (ops/fp8); everything else stays in the
training dtype.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from moe_tune.engine.lora import (
    VISION_PREFIX,
    is_vision_module,
    saved_names,
    target_module_problems,
    vision_choice,
    vision_module_parts,
)
from moe_tune.engine.memory.policy import MemoryPolicy, resolve_policy
from moe_tune.engine.memory.store import HOST_CHUNK_BYTES
from moe_tune.ops.cross_entropy.autograd import default_chunk_size
from moe_tune.ops.fp8 import num_blocks
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile, LayerSpec, LoraProfile, ModelProfile

__all__ = [
    "Param",
    "ParameterCounts",
    "Layout",
    "Plan",
    "model_parameters",
    "fp8_weight_scales",
    "fp8_parameters",
    "WeightBytes",
    "weight_bytes",
    "lora_parameters",
    "trainable_parameters",
    "count_parameters",
    "activation_bytes",
    "vision_activation_bytes",
    "vision_patches",
    "vision_training",
    "ContextExchange",
    "ContextTraffic",
    "context_exchange",
    "context_traffic",
    "fetched_rows",
    "plan_layouts",
    "sequence_chunk",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32_BYTES = 4
# An FP8 e4m3 base weight: one byte an element, and one fp32 scale (scale_inv) per 128 x 128 block.
FP8_BYTES = 1
FP8_SCALE_BYTES = 4
# The sparse-attention indexer returns int32 key indices.
INDEX_BYTES = 4
# The sparse-attention kernels' tiling of a chunk's backward (ops/sparse_attention/kernels_fwd.py and
# kernels_select.py: GPU_DKV_KEY_TILE, GPU_BLOCK_KEY_TILE, MIN_DOT_SIZE, GPU_DKV_CHUNK_PAIRS, GPU_DKV_TOKEN_CHUNKS,
# BITS_PER_WORD; tests/engine/test_plan.py checks they agree), which sizes its fp32 dk/dv partials and selection bitmap.
DKV_TOKEN_KEY_TILE = 128
BLOCK_KEY_TILE = 64
MIN_DOT_SIZE = 16
DKV_CHUNK_PAIRS = 1024
DKV_TOKEN_CHUNKS = 1024
BITS_PER_WORD = 32
# AdamW keeps two fp32 moments per trainable parameter, and an fp32 master copy when the weights are not fp32.
ADAM_MOMENT_BYTES = 2 * FP32_BYTES
MASTER_WEIGHT_BYTES = FP32_BYTES
# The chunk length of the linear-attention kernel (ops/linear_attention DEFAULT_CHUNK_SIZE): it keeps one [K, V]
# state per chunk and head for backward, which holds their gradients.
LINEAR_ATTENTION_CHUNK = 64
# Forward and backward each gather every ZeRO-3 partitioned parameter once per micro-batch.
ZERO3_GATHERS_PER_MICRO_BATCH = 2
# Dispatch and combine, in forward and again (as gradients) in backward.
ALL_TO_ALLS_PER_LAYER = 4
# Activation checkpointing re-runs each layer's forward in backward: dispatch and combine once more.
ALL_TO_ALLS_PER_LAYER_RECOMPUTED = 6
# Sequence chunks (memory.sequence_chunk_tokens) recompute each chunk's dispatch and combine in backward; under
# activation checkpointing on top of the layer's recomputed forward.
ALL_TO_ALLS_PER_CHUNKED_RECOMPUTE = 2
# Context parallelism: the top-k layers fetch earlier devices' keys in units of block_size rows, at token level in
# pages of this many rows (engine/model/attention_context.py's TOKEN_PAGE; tests/engine/test_plan.py checks they
# agree), and keep each fetched row's int64 id for backward (the index of the copy into the span's buffer).
FETCH_TOKEN_PAGE = 16
ROW_ID_BYTES = 8
# Pinned device-to-host and host-to-device copy bandwidth measured on the H200 (docs/PERF.md, "pinned host-to-device
# / device-to-host 52 / 55 GB/s"): the time the plan gives the memory policy's swaps.
PINNED_D2H_BYTES_PER_S = 55 * 10**9
PINNED_H2D_BYTES_PER_S = 52 * 10**9
# PEFT's name for the adapter moe-tune injects (one adapter per run).
ADAPTER_NAME = "default"
# The module name that makes PEFT put the per-expert LoRA layer on the routed experts (engine/lora).
EXPERTS_MODULE = "experts"


@dataclass(frozen=True)
class Param:
    """One parameter tensor, named as in `MoECausalLM.named_parameters()` (adapters as in the PeftModel, without
    its `base_model.model.` prefix)."""

    name: str
    shape: tuple[int, ...]
    # A routed-expert tensor [E, ...]: held by the expert-parallel rank of its expert, ZeRO-sharded over dp ranks.
    is_expert: bool = False
    # The weight [out, in] of an nn.Linear, which LoRA can target.
    is_linear: bool = False
    # The shape of its fp32 block scales when `model.base_precision: fp8` stores it in FP8 (fp8_weight_scales);
    # None: it stays in the training dtype.
    fp8_scale_shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def model_parameters(cfg: ModelProfile) -> list[Param]:
    """Every parameter of `build_model(cfg)` with its name and shape: the model built on the meta device, its base
    weights in the training dtype (an FP8 weight is counted by its logical shape, its scales by fp8_scale_shape)."""
    import torch
    from torch import nn

    from moe_tune.engine.model.model import MoECausalLM
    from moe_tune.engine.model.moe import GroupedExperts

    with torch.device("meta"):
        model = MoECausalLM(cfg.model_copy(update={"base_precision": "bf16"}))
    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, GroupedExperts)
               for p, _ in m.named_parameters()}
    scales = fp8_weight_scales(model)
    return [Param(name, tuple(p.shape), is_expert=name in experts, is_linear=name in linear,
                  fp8_scale_shape=scales.get(name))
            for name, p in model.named_parameters()]  # fmt: skip


def fp8_weight_scales(model) -> dict[str, tuple[int, ...]]:
    """The base weights `model.base_precision: fp8` stores in FP8 (the modules engine/model/fp8.py's
    fp8_base_modules chooses: attention projections, dense MLPs, shared and routed experts; not routers, embeddings,
    lm_head, norms or linears with a dim < 128), each with the shape of its fp32 block scales; the routed experts'
    w_gate_up has its gate and up rows scaled apart. Trained modules (lora.modules_to_save) are removed by
    fp8_parameters, as inject_lora dequantizes them."""
    from moe_tune.engine.model.fp8 import fp8_base_modules
    from moe_tune.engine.model.moe import GroupedExperts

    scales: dict[str, tuple[int, ...]] = {}
    for name, m in fp8_base_modules(model).items():
        if isinstance(m, GroupedExperts):
            e, two_f, d = m.w_gate_up.shape
            f = two_f // 2
            scales[f"{name}.w_gate_up"] = (e, num_blocks(two_f, (f, f)), num_blocks(d))
            scales[f"{name}.w_down"] = (e, num_blocks(d), num_blocks(f))
        else:
            scales[f"{name}.weight"] = (num_blocks(m.out_features), num_blocks(m.in_features))
    return scales


def _module_paths(params: list[Param]) -> list[str]:
    """Every module that holds a parameter, directly or below it, outermost first."""
    paths: dict[str, None] = {}
    for p in params:
        parts = p.module.split(".")
        for depth in range(1, len(parts) + 1):
            paths.setdefault(".".join(parts[:depth]))
    return list(paths)


def _vision_parts(params: list[Param]) -> list[tuple[str, bool]]:
    """The vision tower's modules as engine.lora.vision_module_parts takes them: (name inside the tower, whether it is
    an nn.Linear)."""
    linears = {p.module for p in params if p.is_linear}
    return [(path.removeprefix(VISION_PREFIX), path in linears) for path in _module_paths(params)
            if path.startswith(VISION_PREFIX)]  # fmt: skip


def lora_parameters(params: list[Param], lora: LoraProfile) -> list[Param]:
    """The parameters engine.lora.inject_lora adds to `params`: A [r, in] and B [out, r] per targeted linear (named
    by lora.target_modules, and the vision tower's linears of the parts lora.vision_tower / lora.vision_merger set
    to lora); per-expert A and B of both expert projections; a trainable copy of each module in modules_to_save and
    of each vision part set to trained (engine.lora.vision_module_parts). Raises ProfileError with inject_lora's
    lines for what it refuses (engine.lora.target_module_problems)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    if not lora.enabled:
        return []
    problems = target_module_problems(
        lora.target_modules, [p.module for p in params if p.is_linear],
        [path for path in _module_paths(params) if is_vision_module(path)],
    )  # fmt: skip
    vision_targets, vision_saved = vision_module_parts(_vision_parts(params), lora)
    targets = list(lora.target_modules) + vision_targets
    if lora.experts and not any(p.is_expert for p in params):
        problems.append("lora.experts (true) needs a layer with mlp: moe")
    if not targets and not lora.experts:
        problems.append("lora.target_modules ([]) must name at least one module when lora.experts is false")
    if problems:
        raise ProfileError(problems)
    saved = saved_names(_module_paths(params), list(lora.modules_to_save) + vision_saved)
    r = lora.r
    added: list[Param] = []
    for path in saved:
        for p in params:
            if p.name.startswith(f"{path}."):
                rest = p.name[len(path) + 1 :]
                added.append(Param(f"{path}.modules_to_save.{ADAPTER_NAME}.{rest}", p.shape, is_expert=p.is_expert))
    for p in params:
        if any(p.module == path or p.module.startswith(f"{path}.") for path in saved):
            continue
        if p.is_linear and matches_module_name(p.module, targets):
            out_features, in_features = p.shape
            added.append(Param(f"{p.module}.lora_A.{ADAPTER_NAME}.weight", (r, in_features)))
            added.append(Param(f"{p.module}.lora_B.{ADAPTER_NAME}.weight", (out_features, r)))
        elif p.is_expert and lora.experts and p.name.endswith(".w_gate_up"):
            e, two_f, d = p.shape
            f = two_f // 2
            added += [
                Param(f"{p.module}.lora_A.{ADAPTER_NAME}.w_gate_up", (e, r, d), is_expert=True),
                Param(f"{p.module}.lora_A.{ADAPTER_NAME}.w_down", (e, r, f), is_expert=True),
                Param(f"{p.module}.lora_B.{ADAPTER_NAME}.w_gate_up", (e, two_f, r), is_expert=True),
                Param(f"{p.module}.lora_B.{ADAPTER_NAME}.w_down", (e, d, r), is_expert=True),
            ]
    return added


def saved_module_problems(cfg: ModelProfile, lora: LoraProfile) -> list[str]:
    """What engine.lora.inject_lora refuses in the modules LoRA trains in full (lora.modules_to_save and the vision
    parts set to trained: engine.lora.saved_module_problems), checked on the model built on the meta device; none
    without LoRA or such modules."""
    import torch

    from moe_tune.engine import lora as peft_lora
    from moe_tune.engine.model.model import MoECausalLM

    if not lora.enabled or (not lora.modules_to_save and cfg.vision is None):
        return []
    with torch.device("meta"):
        model = MoECausalLM(cfg.model_copy(update={"base_precision": "bf16"}))
    vision_targets, vision_saved = peft_lora.vision_parts(model, lora)
    targets = list(lora.target_modules) + ([EXPERTS_MODULE] if lora.experts else []) + vision_targets
    saved = peft_lora.saved_modules(model, list(lora.modules_to_save) + vision_saved)
    return peft_lora.saved_module_problems(model, lora, targets, saved)


def trainable_parameters(params: list[Param], lora: LoraProfile) -> list[Param]:
    """The parameters the optimizer updates: with LoRA those inject_lora adds (lora_parameters); in full fine-tuning
    every one of `params` but those of the vision parts lora.vision_tower / lora.vision_merger keep frozen (the rule
    of engine.lora.freeze_vision_parts, which the trainer applies)."""
    if lora.enabled:
        return lora_parameters(params, lora)
    return [p for p in params if not p.name.startswith(VISION_PREFIX)
            or vision_choice(p.name.removeprefix(VISION_PREFIX), lora) != "frozen"]  # fmt: skip


def fp8_parameters(params: list[Param], cfg: ModelProfile, lora: LoraProfile) -> list[Param]:
    """The base weights stored in FP8: none with `model.base_precision: bf16`; with fp8 those fp8_weight_scales
    names, but for those in a module LoRA trains in full (named by lora.modules_to_save as inject_lora matches it)."""
    from moe_tune.engine.model.fp8 import matches_module_name

    if cfg.base_precision != "fp8":
        return []
    saved = list(lora.modules_to_save) if lora.enabled else []

    def is_saved(module: str) -> bool:
        parts = module.split(".")
        return any(matches_module_name(".".join(parts[:depth]), saved) for depth in range(1, len(parts) + 1))

    return [p for p in params if p.fp8_scale_shape is not None and not is_saved(p.module)]


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the base weights: FP8 weights at FP8_BYTES an element plus their fp32 scales, the rest at b."""

    dense: int  # every base weight but the routed experts
    experts: int  # routed experts, all layers
    fp8_parameters: int  # elements stored in FP8 (dense and experts)
    fp8_scales: int  # bytes of their fp32 block scales

    @property
    def total(self) -> int:
        return self.dense + self.experts


def _param_bytes(p: Param, fp8_names: set[str], dtype_bytes: int) -> int:
    if p.name in fp8_names:
        assert p.fp8_scale_shape is not None, "only weights with block scales are stored in FP8"
        return p.numel * FP8_BYTES + math.prod(p.fp8_scale_shape) * FP8_SCALE_BYTES
    return p.numel * dtype_bytes


def weight_bytes(params: list[Param], cfg: ModelProfile, lora: LoraProfile, precision: str) -> WeightBytes:
    """Bytes of `params` (model_parameters) held as `cfg.base_precision` says, the rest in `precision`."""
    fp8 = fp8_parameters(params, cfg, lora)
    names = {p.name for p in fp8}
    b = DTYPE_BYTES[precision]
    experts = sum(_param_bytes(p, names, b) for p in params if p.is_expert)
    dense = sum(_param_bytes(p, names, b) for p in params if not p.is_expert)
    scales = sum(math.prod(p.fp8_scale_shape) for p in fp8) * FP8_SCALE_BYTES
    return WeightBytes(dense=dense, experts=experts, fp8_parameters=sum(p.numel for p in fp8), fp8_scales=scales)


@dataclass(frozen=True)
class ParameterCounts:
    dense: int  # every base parameter but the routed experts (embedding, attention, router, shared experts, head)
    experts: int  # routed experts, all layers
    total: int  # dense + experts
    active_per_token: int  # dense + top_k of E routed experts in each MoE layer
    lora_dense: int  # adapters on linear layers, plus trainable copies of modules_to_save and trained vision parts
    lora_experts: int  # per-expert adapters (and full copies of saved modules that hold routed experts)
    trainable: int  # lora_dense + lora_experts with LoRA, else total less the vision parts kept frozen
    trainable_dense: int  # sharded over all devices
    trainable_experts: int  # sharded over the expert-data-parallel group


def count_parameters(cfg: ModelProfile, lora: LoraProfile, base: list[Param] | None = None) -> ParameterCounts:
    """Exact parameter counts of the model and its adapters (what sum(p.numel()) gives after inject_lora), and the
    trainable ones: with LoRA what inject_lora adds (lora_parameters), else every parameter but those of the vision
    parts lora.vision_tower / lora.vision_merger keep frozen (engine.lora.freeze_vision_parts).
    `base`: model_parameters(cfg) when the caller has it (the model is built once)."""
    base = model_parameters(cfg) if base is None else base
    added = lora_parameters(base, lora)
    if problems := saved_module_problems(cfg, lora):
        raise ProfileError(problems)
    experts = sum(p.numel for p in base if p.is_expert)
    dense = sum(p.numel for p in base) - experts
    lora_experts = sum(p.numel for p in added if p.is_expert)
    lora_dense = sum(p.numel for p in added) - lora_experts
    num_moe_layers = sum(layer.mlp == "moe" for layer in cfg.layers)
    active_experts = 0
    if cfg.moe is not None and num_moe_layers:
        active_experts = experts // cfg.moe.num_experts * cfg.moe.top_k
    trainable = added if lora.enabled else trainable_parameters(base, lora)
    trainable_experts = sum(p.numel for p in trainable if p.is_expert)
    trainable_dense = sum(p.numel for p in trainable) - trainable_experts
    return ParameterCounts(
        dense=dense,
        experts=experts,
        total=dense + experts,
        active_per_token=dense + active_experts,
        lora_dense=lora_dense,
        lora_experts=lora_experts,
        trainable=trainable_dense + trainable_experts,
        trainable_dense=trainable_dense,
        trainable_experts=trainable_experts,
    )


@dataclass(frozen=True)
class ActivationBytes:
    layers: int  # what backward keeps of the decoder layers
    head: int  # final norm, and the loss's saved gradient and one chunk of logits (or all logits: LoRA on the head)
    transient: int  # the linear-attention backward's state gradients, and states recomputed if offloaded (one layer)
    # Context parallelism: what the token mixers gather or fetch and keep until backward (the row's keys and values,
    # the top-k layers' span buffer and fetched rows' ids, the linear layers' state summaries and halos), on the
    # group's last device; one layer's with activation checkpointing. 0 when c is 1.
    context: int = 0
    # The memory policy (engine/memory): saved tensors of the layers it sends to pinned host memory (offloaded
    # classes, and what passes the GPU budget), by class; `layers` holds only what stays on the GPU.
    host: int = 0
    host_by_class: dict[str, int] = field(default_factory=dict)
    # Of `layers`, under a policy that moves or recomputes (0 otherwise): the offloaded tensors on the GPU at once
    # (the layer backward runs and the prefetch_layers layers being swapped in below it), and the largest module or
    # sequence chunk backward recomputes.
    prefetch: int = 0
    recompute: int = 0
    # The vision tower's saved tensors over the most image patches a micro-batch can hold (vision_activation_bytes);
    # 0 without a tower, or with its blocks and merger frozen.
    vision: int = 0

    @property
    def total(self) -> int:
        return self.layers + self.head + self.transient + self.context + self.vision


class ContextExchange(NamedTuple):
    """What one layer's token mixer receives from the rest of its context group per micro-batch and forward pass, and
    what it keeps until backward (bytes). Upper bounds, on the group's last device: one document over the row, so the
    last device's span is the whole row and every key before its share is held by an earlier device."""

    kept: int  # held until backward on the last device
    with_gradient: float  # received in forward by the last device; its exchange moves as many gradient bytes back
    without_gradient: float  # received in forward only (the indexers' keys), by every device
    with_gradient_mean: float  # with_gradient averaged over the group's c devices


class ContextTraffic(NamedTuple):
    """Bytes of one layer's context-group exchanges per micro-batch, forward and backward."""

    last: float  # the group's last device: the most, and the figure the plan reports
    mean: float  # averaged over the group's devices


def fetched_rows(row_tokens: int, c: int, rank: int, slots: int, unit: int) -> int:
    """F_r, the rows a top-k layer on device `rank` of c fetches from the earlier devices, at most: the keys of its
    document before its share (r T_row / c, a document over the row), and the units its T_row / c queries of that
    document can select (S slots a query, each a unit of U rows: block_size, or FETCH_TOKEN_PAGE at token level)."""
    share = row_tokens // c
    return min(rank * share, share * slots * unit)


def context_exchange(cfg: ModelProfile, spec: LayerSpec, row_tokens: int, c: int, dtype_bytes: int) -> ContextExchange:
    """The exchanges of one layer's token mixer when c devices share a row of T_row = row_tokens tokens
    (engine/model/linear_context.py, engine/model/attention_context.py):

    - linear / kda: one [H, K, K + V] fp32 state summary a device, and the short conv's halo (its reach x conv
      channels a device), both gathered from all c devices: a device receives (c - 1) / c of the c pieces;
    - full / mla: the whole row's keys and values (T_row x G x 2 hd; mla the normed kv latent and rope key,
      T_row x (Rkv + Dr)) gathered, (c - 1) / c of them received, and kept;
    - sparse / qsa / mla_sparse: the indexer's keys gathered ((c - 1) / c x T_row x DI received, no gradient, freed
      after the selection; qsa twice: its raw keys, then its block keys), then only the selected units fetched from
      the earlier devices (fetched_rows, R bytes a row: G x 2 hd, mla_sparse Rkv + Dr) into a span-sized buffer, kept
      with the fetched rows' ids: the last device's span is the row (T_row x R). The fetch's counts and ranges
      (8 c bytes and 16 bytes a range, a range covering a unit of U rows) are left out.
    """
    if c == 1:
        return ContextExchange(0, 0, 0, 0)
    b = dtype_bytes
    received = (c - 1) / c
    if spec.attention in ("linear", "kda"):
        if spec.attention == "linear":
            la = cfg.linear_attention
            assert la is not None, "the schema requires model.linear_attention for linear layers"
            h, k, v = la.num_value_heads, la.key_head_dim, la.value_head_dim
            channels, width = 2 * la.num_key_heads * la.key_head_dim + h * v, la.conv_kernel_size
        else:
            kda = cfg.kda_attention
            assert kda is not None, "the schema requires model.kda_attention for kda layers"
            h, k, v = kda.num_heads, kda.head_dim, kda.head_dim
            channels, width = 3 * h * k, kda.conv_kernel_size
        gathered = c * h * k * (k + v) * FP32_BYTES + c * (width - 1) * channels * b
        return ContextExchange(gathered, gathered * received, 0, gathered * received)
    if spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        row_bytes = (mla.kv_lora_rank + mla.qk_rope_head_dim) * b
    else:
        row_bytes = cfg.num_key_value_heads * 2 * cfg.head_dim * b
    if spec.attention in ("full", "mla"):
        gathered = row_tokens * row_bytes
        return ContextExchange(gathered, gathered * received, 0, gathered * received)
    sa = cfg.sparse_attention
    assert sa is not None, "the schema requires model.sparse_attention for top-k layers"
    num_index_keys = 2 if spec.attention == "qsa" else 1
    index_keys = num_index_keys * received * row_tokens * sa.index_head_dim * b
    slots = sa.topk // sa.block_size + (1 if spec.attention == "qsa" else 0)
    unit = sa.block_size if sa.block_size > 1 else FETCH_TOKEN_PAGE
    fetched = [fetched_rows(row_tokens, c, rank, slots, unit) for rank in range(c)]
    kept = row_tokens * row_bytes + fetched[-1] * ROW_ID_BYTES
    return ContextExchange(kept, fetched[-1] * row_bytes, index_keys, sum(fetched) / c * row_bytes)


def context_traffic(
    exchange: ContextExchange, is_recomputed: bool, is_mixer_recomputed: bool = False
) -> ContextTraffic:  # fmt: skip
    """Bytes of one layer's exchanges per micro-batch: what a device receives in forward (once more when backward
    recomputes the layer, and once more when it recomputes the token mixer's share on its own: sequence chunks), and
    in backward the gradients of what it received with one (a gather's reduce-scatter into the device; a fetch's
    gradients sent back to their owners)."""
    forward_passes = 1 + int(is_recomputed) + int(is_mixer_recomputed)
    without = forward_passes * exchange.without_gradient
    return ContextTraffic(
        last=without + (forward_passes + 1) * exchange.with_gradient,
        mean=without + (forward_passes + 1) * exchange.with_gradient_mean,
    )


class LayerRanks(NamedTuple):
    """LoRA rank sums of one layer: adapted linears of the token mixer x r, of the channel mixer (shared expert,
    dense MLP, router) x r, and r if the routed experts are adapted else 0."""

    token_mixer: int
    channel_mixer: int
    experts: int


def _layer_activation_elems(
    cfg: ModelProfile, spec: LayerSpec, num_tokens: int, lora_ranks: LayerRanks, is_chunked: bool = False,
    mixer_chunk: int | None = None, is_mixer_recomputed: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """(elements in the training dtype, fp32/int32 elements) that backward keeps for one layer over T tokens.

    is_chunked: the per-token part runs in sequence chunks (memory.sequence_chunk_tokens): the layer keeps its
    chunks' input rows instead of the post-attention norm's output and the channel mixer's tensors, which
    _chunk_activation_elems counts for the one chunk backward recomputes at a time.
    mixer_chunk: the token mixer runs in sequence chunks of this many tokens too (engine/model/mixer_chunks.py): it
    keeps what _chunked_mixer_elems counts instead of its tensors over T.
    is_mixer_recomputed: the token mixer runs whole under activation checkpoint (sequence chunks set, a row of at most
    one chunk or a context-parallel share): it keeps nothing but its input rows.
    """
    t, d = num_tokens, cfg.hidden_size
    # Inputs of the two RMSNorms and their outputs (the input every projection of the mixer saves, and a chunked
    # mixer's slab inputs); chunked, the second norm's input is the chunks' input rows and its output is recomputed.
    low = (3 if is_chunked else 4) * t * d
    if mixer_chunk is not None:
        mixer_low, mixer_wide = _chunked_mixer_elems(cfg, spec, t, mixer_chunk)
    elif is_mixer_recomputed:
        mixer_low = mixer_wide = 0
    else:
        mixer_low, mixer_wide = _token_mixer_elems(cfg, spec, t, lora_ranks)
    low, wide = low + mixer_low, mixer_wide
    if not is_chunked:
        mixer_low, mixer_wide = _channel_mixer_elems(cfg, spec, t, lora_ranks)
        low, wide = low + mixer_low, wide + mixer_wide
    return low, wide


def _token_mixer_elems(cfg: ModelProfile, spec: LayerSpec, t: int, lora_ranks: LayerRanks) -> tuple[int, int]:
    """(training-dtype elements, fp32 elements) the token mixer saves over t tokens, run whole."""
    low = wide = 0
    if spec.attention == "linear":
        la = cfg.linear_attention
        assert la is not None, "the schema requires model.linear_attention for linear layers"
        conv_width = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
        value_width = la.num_value_heads * la.value_head_dim
        decay_width = la.num_value_heads * la.key_head_dim if la.decay == "per_channel" else la.num_value_heads
        # Conv input and output; q and k repeated to the value heads (the op's inputs; v is the conv output);
        # z, the op's output o and the gated-norm output (o_proj's input).
        low += 2 * t * conv_width + 2 * t * la.num_value_heads * la.key_head_dim + 3 * t * value_width
        # beta, and the log decay before and after softplus, in fp32.
        wide += t * (la.num_value_heads + 2 * decay_width)
        # The op's kernel intermediates, kept for backward (ops/linear_attention's save_intermediates, which the
        # layers pass unless their class is offloaded): W, k exp(G_C - G) and q exp(G) [T, Hv, K], v_new [T, Hv, V],
        # the inverse and the decayed q k^T [T, Hv, C] (KDA: its q k^T and k k^T), the states entering every chunk
        # [ceil(T / C), Hv, K, V], and G (the summed log decay) in fp32.
        num_chunks = -(-t // LINEAR_ATTENTION_CHUNK)
        low += t * la.num_value_heads * (3 * la.key_head_dim + la.value_head_dim + 2 * LINEAR_ATTENTION_CHUNK)
        low += num_chunks * la.num_value_heads * la.key_head_dim * la.value_head_dim
        wide += t * decay_width
    elif spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        h, rq, rkv = cfg.num_attention_heads, mla.q_lora_rank or 0, mla.kv_lora_rank
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        # The q latent before and after its norm; q_proj/q_b_proj output; kv_a output and the normed kv latent;
        # kv_b output (k nope and v); q and k after RoPE (the attention's inputs); the attention output.
        low += t * (2 * rq + h * qk_dim + 2 * rkv + mla.qk_rope_head_dim + h * (mla.qk_nope_head_dim + mla.v_head_dim))
        low += 2 * t * h * qk_dim + t * h * mla.v_head_dim
        # Softmax log-sum-exp per head.
        wide += t * h
        if spec.attention == "mla_sparse":
            sa = cfg.sparse_attention
            assert sa is not None, "the schema requires model.sparse_attention for mla_sparse layers"
            wide += t * (sa.topk // sa.block_size)
    else:
        h, g, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q_proj output (query and gate), k and v; q and k after norm and RoPE; attention output and gated output.
        low += t * (2 * h * hd + 2 * g * hd) + t * (h + g) * hd + 2 * t * h * hd
        # Softmax log-sum-exp per query head.
        wide += t * h
        if spec.attention == "sparse":
            sa = cfg.sparse_attention
            assert sa is not None, "the schema requires model.sparse_attention for sparse layers"
            wide += t * (sa.topk // sa.block_size)
    # Linear adapters of the token mixer: x A for each adapted linear.
    low += t * lora_ranks.token_mixer
    return low, wide


def _linear_state_dims(cfg: ModelProfile, spec: LayerSpec) -> tuple[int, int, int]:
    """(H, K, V) of a linear / kda layer's recurrent state."""
    if spec.attention == "linear":
        la = cfg.linear_attention
        assert la is not None, "the schema requires model.linear_attention for linear layers"
        return la.num_value_heads, la.key_head_dim, la.value_head_dim
    kda = cfg.kda_attention
    assert kda is not None, "the schema requires model.kda_attention for kda layers"
    return kda.num_heads, kda.head_dim, kda.head_dim


def _chunked_mixer_elems(cfg: ModelProfile, spec: LayerSpec, t: int, chunk: int) -> tuple[int, int]:
    """(training-dtype elements, fp32 or int32 elements) a token mixer run in sequence chunks of `chunk` tokens keeps
    over t tokens besides its input rows (counted with the norms): linear / kda the state [H, K, V] fp32 carried into
    every slab; full / sparse / qsa the row's keys and values (t x G x 2 hd); mla the row's normed kv latent and rope
    key (t x (Rkv + Dr)); sparse, qsa and mla_sparse each chunk's selection (t x S int32). Nothing else grows with t:
    the rest is recomputed a chunk at a time (_mixer_chunk_elems), the indexers' scores not at all."""
    if spec.attention in ("linear", "kda"):
        h, k, v = _linear_state_dims(cfg, spec)
        return 0, -(-t // chunk) * h * k * v
    selection = 0
    if spec.attention in ("sparse", "qsa", "mla_sparse"):
        sa = cfg.sparse_attention
        assert sa is not None, "the schema requires model.sparse_attention for top-k layers"
        selection = t * (sa.topk // sa.block_size + (1 if spec.attention == "qsa" else 0))
    if spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        return t * (mla.kv_lora_rank + mla.qk_rope_head_dim), selection
    return t * cfg.num_key_value_heads * 2 * cfg.head_dim, selection


def _mixer_chunk_elems(
    cfg: ModelProfile, spec: LayerSpec, t: int, chunk: int, lora_ranks: LayerRanks
) -> tuple[int, int]:  # fmt: skip
    """What backward holds while it recomputes one chunk of a chunked token mixer: its tensors over its `chunk`
    queries (_token_mixer_elems; for the softmax kinds an upper bound, as the row's keys and values and their adapters
    are made outside the chunk), and for the kinds that work on the chunk's whole span (up to t keys: a document over
    the row) what they make over it. mla expands its latent over the span (kv_b output and the keys
    [t, H, Dn + V + Dn + Dr]). The top-k ops take the chunk's queries as the last C of the span's keys (query_start,
    attention_context.KeySpan): sparse, qsa and mla_sparse add what ops.sparse_attention makes for them
    (_sparse_chunk_op_elems), qsa its indices [C, S] (_token_mixer_elems leaves them out), mla_sparse the contiguous
    copy of the span's values the op makes [t, H, V]. Their indexers run without gradient: the indexer's queries and
    scores are freed before backward reaches the op."""
    low, wide = _token_mixer_elems(cfg, spec, chunk, lora_ranks)
    if spec.attention in ("linear", "kda", "full"):
        return low, wide
    h = cfg.num_attention_heads
    sa = cfg.sparse_attention
    if spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        qk_dim, v_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
        low += t * h * (mla.qk_nope_head_dim + v_dim + qk_dim)
        if spec.attention == "mla_sparse":
            assert sa is not None, "the schema requires model.sparse_attention for mla_sparse layers"
            op = SparseChunkOp(chunk, t, h, h, qk_dim, v_dim, sa.topk // sa.block_size, sa.block_size, False)
            op_low, op_wide = _sparse_chunk_op_elems(op)
            low, wide = low + t * h * v_dim + op_low, wide + op_wide
        return low, wide
    assert sa is not None, "the schema requires model.sparse_attention for sparse and qsa layers"
    slots = sa.topk // sa.block_size + (1 if spec.attention == "qsa" else 0)
    if spec.attention == "qsa":
        wide += chunk * slots
    hd = cfg.head_dim
    op = SparseChunkOp(chunk, t, h, cfg.num_key_value_heads, hd, hd, slots, sa.block_size, cfg.attention_output_gate)
    op_low, op_wide = _sparse_chunk_op_elems(op)
    return low + op_low, wide + op_wide


class SparseChunkOp(NamedTuple):
    """One ops.sparse_attention call of a chunk: C queries over the span's M keys."""

    num_queries: int  # C
    num_keys: int  # M
    num_heads: int  # HQ
    num_kv_heads: int  # H (MLA: its query heads, the keys expanded per head)
    k_dim: int
    v_dim: int
    slots: int  # S
    block_size: int
    is_gated: bool


def _sparse_chunk_op_elems(op: SparseChunkOp) -> tuple[int, int]:
    """(training-dtype elements, 4-byte elements) ops.sparse_attention's kernels make for a chunk beyond the layer's
    tensors over C (ops/sparse_attention/autograd.py, kernels_bwd.py), at its backward's peak: saved by forward, the
    selection bitmap [C, ceil(units / 32)] int32 (units: M keys, or ceil(M / block_size) blocks; one index head, as the
    layers pass one selection for every kv head) and the sequence layout's seq_id, seq_start and seq_end [M] int32;
    made by backward, dq [C, HQ, K], with a gate dgate and the ungated output's gradient [C, HQ, V] each, delta
    [C, HQ] fp32, dk and dv [M, H, K + V] and their fp32 partials (_dkv_partial_rows, padded dims). Its index lists
    (a few bytes a key or a selected pair) are not counted."""
    c, m, h = op.num_queries, op.num_keys, op.num_heads
    units = m if op.block_size == 1 else -(-m // op.block_size)
    partials = _dkv_partial_rows(c, m, op.slots, op.block_size)
    low = c * h * (op.k_dim + (2 * op.v_dim if op.is_gated else 0)) + m * op.num_kv_heads * (op.k_dim + op.v_dim)
    wide = c * -(-units // BITS_PER_WORD) + 3 * m + c * h
    wide += op.num_kv_heads * partials * (_padded_dim(op.k_dim) + _padded_dim(op.v_dim))
    return low, wide


def _padded_dim(dim: int) -> int:
    # A head dim as the kernels tile it (kernels_fwd.padded): the next power of two, at least one dot's size.
    return max(MIN_DOT_SIZE, 1 << (dim - 1).bit_length())


def _dkv_partial_rows(num_queries: int, num_keys: int, slots: int, block_size: int) -> int:
    """Key rows of the sparse attention backward's fp32 dk and dv partials per kv head
    (kernels_bwd.sparse_attention_bwd: [H, NC, ceil(bs / tile), tile, K] each): one chunk of at most DKV_CHUNK_PAIRS
    (query, key slot) pairs per slot, NC = the slots + ceil(pairs / pairs a chunk) (kernels_bwd.pair_chunks' bound),
    for the C queries of one document over the M keys. Token level: key tiles of DKV_TOKEN_KEY_TILE keys, each visited
    by the queries at and after it (kernels_bwd.token_chunking), in at most about DKV_TOKEN_CHUNKS chunks; block
    level: one slot per block, C x S pairs."""
    if block_size == 1:
        tile, num_sub = DKV_TOKEN_KEY_TILE, 1
        num_slots = -(-num_keys // tile)
        num_full = min(num_slots, (num_keys - num_queries) // tile + 1)
        later = num_slots - num_full
        pairs = num_full * num_queries + later * num_keys - tile * ((num_full + num_slots - 1) * later // 2)
        chunk_pairs = max(DKV_CHUNK_PAIRS, -(-pairs // DKV_TOKEN_CHUNKS))
    else:
        tile = max(MIN_DOT_SIZE, min(BLOCK_KEY_TILE, 1 << (block_size - 1).bit_length()))
        num_sub = -(-block_size // tile)
        num_slots = num_keys // block_size + 1
        pairs, chunk_pairs = num_queries * slots, DKV_CHUNK_PAIRS
    return (num_slots + -(-pairs // chunk_pairs)) * num_sub * tile


def _channel_mixer_elems(cfg: ModelProfile, spec: LayerSpec, t: int, lora_ranks: LayerRanks) -> tuple[int, int]:
    """(training-dtype elements, fp32 elements) the channel mixer (dense MLP or MoE block) saves over t tokens."""
    d = cfg.hidden_size
    low = wide = 0
    if spec.mlp == "dense":
        # gate and up outputs, and their product (down_proj's input).
        low += 3 * t * cfg.intermediate_size
    else:
        moe = cfg.moe
        assert moe is not None, "the schema requires model.moe for moe layers"
        k, f, fs = moe.top_k, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
        # Router scores and routing weights in fp32.
        wide += t * moe.num_experts + t * k
        # Dispatch buffer (the T k tokens the experts receive), gate_up output, SwiGLU product (w_down's input),
        # expert outputs before the weighted combine.
        low += t * k * d + t * k * 2 * f + t * k * f + t * k * d
        # Shared expert: gate and up outputs, their product, the gate's logit.
        low += 3 * t * fs + (t if fs and moe.shared_expert_gate else 0)
        # Per-expert adapters: x A of both projections for each of the T k routed tokens.
        low += t * k * 2 * lora_ranks.experts
    # Linear adapters of the shared expert, dense MLP or router: x A for each.
    low += t * lora_ranks.channel_mixer
    return low, wide


def _chunk_activation_elems(cfg: ModelProfile, spec: LayerSpec, chunk: int, lora_ranks: LayerRanks) -> tuple[int, int]:
    """What backward holds while it recomputes one sequence chunk of a layer's per-token part: the post-attention
    norm's output and the channel mixer's saved tensors over `chunk` tokens."""
    low, wide = _channel_mixer_elems(cfg, spec, chunk, lora_ranks)
    return low + chunk * cfg.hidden_size, wide


class Saved(NamedTuple):
    """`count` saved tensors of `nbytes` each, saved under operator class `klass` (engine/memory's classes: the class
    of the module whose code saves them, or of the module enclosing a recomputed module whose inputs they are)."""

    klass: str
    nbytes: int
    count: int = 1


class LayerSaves(NamedTuple):
    """What one decoder layer saves for backward under a memory policy: the tensors that stay saved, and the bytes
    of each region that backward recomputes (one at a time)."""

    saved: list[Saved]
    recomputed: list[int]


def _layer_saves(
    cfg: ModelProfile, spec: LayerSpec, t: int, lora_ranks: LayerRanks, lora_r: int, classes: dict[str, str],
    dtype_bytes: int, is_chunked: bool = False, mixer_chunk: int | None = None, is_mixer_recomputed: bool = False,
) -> LayerSaves:  # fmt: skip
    """The tensors of _layer_activation_elems one by one, each under its operator class, with `classes` (the
    resolved policy's choice per class) applied: the tensors of a recomputed class's modules are dropped (their
    inputs stay, under the enclosing module's class) and backward rebuilds each such module's in turn; an offloaded
    linear-attention layer does not keep its op's kernel intermediates, which its backward recomputes. With every
    class `save` the bytes are _layer_activation_elems's (tests/engine/test_plan.py checks it)."""
    b, d = dtype_bytes, cfg.hidden_size
    saved: list[Saved] = []
    recomputed: list[int] = []
    is_recomputed = {name: choice == "recompute" for name, choice in classes.items()}
    norm_class = "activation" if is_recomputed["norm"] else "norm"
    is_mixer_own_chunk = mixer_chunk is not None or is_mixer_recomputed
    # The layer's input (the first norm's) and the first norm's output (the token mixer's input: its projections',
    # or the input of the recomputed mixer kept by its checkpoint).
    saved.append(Saved(norm_class, t * d * b))
    if is_mixer_own_chunk:
        saved.append(Saved("attention", t * d * b))
    else:
        saved.append(Saved("activation" if is_recomputed["attention"] else "linear", t * d * b))
    # The hidden state after attention: the second norm's input, or the per-token chunks' input rows.
    saved.append(Saved("activation" if is_chunked else norm_class, t * d * b))
    if mixer_chunk is not None:
        saved += _chunked_mixer_saves(cfg, spec, t, mixer_chunk, b)
    elif not is_mixer_recomputed:
        mixer, lora, intermediates = _token_mixer_saves(cfg, spec, t, lora_ranks, lora_r, b)
        if is_recomputed["attention"]:
            recomputed.append(_saved_bytes(mixer + lora + intermediates))
        else:
            saved += mixer + lora
            if classes["attention"] == "offload":
                recomputed.append(_saved_bytes(intermediates))
            else:
                saved += intermediates
    if not is_chunked:
        saved_channel, recomputed_channel = _channel_mixer_saves(cfg, spec, t, lora_ranks, lora_r, is_recomputed, b)
        saved += saved_channel
        recomputed += recomputed_channel
    return LayerSaves([s for s in saved if s.nbytes and s.count], recomputed)


def _saved_bytes(saved: list[Saved]) -> int:
    return sum(s.nbytes * s.count for s in saved)


def _token_mixer_saves(
    cfg: ModelProfile, spec: LayerSpec, t: int, lora_ranks: LayerRanks, lora_r: int, b: int
) -> tuple[list[Saved], list[Saved], list[Saved]]:  # fmt: skip
    """The tensors of _token_mixer_elems: (the mixer's own, its linears' LoRA products, a linear-attention op's kernel
    intermediates)."""
    mixer: list[Saved] = []
    intermediates: list[Saved] = []
    if spec.attention == "linear":
        la = cfg.linear_attention
        assert la is not None, "the schema requires model.linear_attention for linear layers"
        hv, k, v = la.num_value_heads, la.key_head_dim, la.value_head_dim
        conv_width = 2 * la.num_key_heads * k + hv * v
        decay_width = hv * k if la.decay == "per_channel" else hv
        mixer += [Saved("attention", t * conv_width * b, 2), Saved("attention", t * hv * k * b, 2),
                  Saved("attention", t * hv * v * b, 3), Saved("attention", t * hv * FP32_BYTES),
                  Saved("attention", t * decay_width * FP32_BYTES, 2)]  # fmt: skip
        num_chunks = -(-t // LINEAR_ATTENTION_CHUNK)
        intermediates += [Saved("attention", t * hv * k * b, 3), Saved("attention", t * hv * v * b),
                          Saved("attention", t * hv * LINEAR_ATTENTION_CHUNK * b, 2),
                          Saved("attention", num_chunks * hv * k * v * b),
                          Saved("attention", t * decay_width * FP32_BYTES)]  # fmt: skip
    elif spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        h, rq, rkv = cfg.num_attention_heads, mla.q_lora_rank or 0, mla.kv_lora_rank
        dr, qk_dim = mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        mixer += [Saved("attention", t * rq * b, 2), Saved("attention", t * h * qk_dim * b),
                  Saved("attention", t * (rkv + dr) * b), Saved("attention", t * rkv * b),
                  Saved("attention", t * h * (mla.qk_nope_head_dim + mla.v_head_dim) * b),
                  Saved("attention", t * h * qk_dim * b, 2), Saved("attention", t * h * mla.v_head_dim * b),
                  Saved("attention", t * h * FP32_BYTES)]  # fmt: skip
        if spec.attention == "mla_sparse":
            sa = cfg.sparse_attention
            assert sa is not None, "the schema requires model.sparse_attention for mla_sparse layers"
            mixer.append(Saved("attention", t * (sa.topk // sa.block_size) * INDEX_BYTES))
    else:
        h, g, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mixer += [Saved("attention", t * 2 * h * hd * b), Saved("attention", t * g * hd * b, 2),
                  Saved("attention", t * h * hd * b), Saved("attention", t * g * hd * b),
                  Saved("attention", t * h * hd * b, 2), Saved("attention", t * h * FP32_BYTES)]  # fmt: skip
        if spec.attention == "sparse":
            sa = cfg.sparse_attention
            assert sa is not None, "the schema requires model.sparse_attention for sparse layers"
            mixer.append(Saved("attention", t * (sa.topk // sa.block_size) * INDEX_BYTES))
    lora = [Saved("linear", t * lora_r * b, lora_ranks.token_mixer // lora_r)] if lora_ranks.token_mixer else []
    return mixer, lora, intermediates


def _chunked_mixer_saves(cfg: ModelProfile, spec: LayerSpec, t: int, chunk: int, b: int) -> list[Saved]:
    """The tensors of _chunked_mixer_elems, saved inside the token mixer (class attention)."""
    if spec.attention in ("linear", "kda"):
        h, k, v = _linear_state_dims(cfg, spec)
        return [Saved("attention", h * k * v * FP32_BYTES, -(-t // chunk))]
    # The chunks' checkpoints take the row's input and keys whole (engine/model/mixer_chunks.attention_in_chunks):
    # saved once, by the keys' checkpoint and here. A top-k layer's chunk keeps its selection [C, S] int32, made
    # before the chunk runs (the indexer's keys are not saved: backward does not score again).
    selection = []
    if spec.attention in ("sparse", "qsa", "mla_sparse"):
        sa = cfg.sparse_attention
        assert sa is not None, "the schema requires model.sparse_attention for top-k layers"
        slots = sa.topk // sa.block_size + (1 if spec.attention == "qsa" else 0)
        selection = [Saved("attention", chunk * slots * INDEX_BYTES, t // chunk),
                     Saved("attention", t % chunk * slots * INDEX_BYTES, 1)]  # fmt: skip
    if spec.attention in ("mla", "mla_sparse"):
        mla = cfg.mla
        assert mla is not None, "the schema requires model.mla for mla layers"
        latent = [Saved("attention", t * mla.kv_lora_rank * b), Saved("attention", t * mla.qk_rope_head_dim * b)]
        return latent + selection
    return [Saved("attention", t * cfg.num_key_value_heads * cfg.head_dim * b, 2)] + selection


def _channel_mixer_saves(
    cfg: ModelProfile, spec: LayerSpec, t: int, lora_ranks: LayerRanks, lora_r: int, is_recomputed: dict[str, bool],
    b: int,
) -> tuple[list[Saved], list[int]]:  # fmt: skip
    """The tensors of _channel_mixer_elems and the second norm's output, with recomputed classes dropped: `router`
    reruns the whole MoE block; `experts` the grouped experts (their input, the dispatched rows, and their output stay,
    saved by the block's own code: class router); `activation` the shared expert's or dense MLP's SwiGLU."""
    d = cfg.hidden_size
    lora = [Saved("linear", t * lora_r * b, lora_ranks.channel_mixer // lora_r)] if lora_ranks.channel_mixer else []
    if spec.mlp == "dense":
        swiglu = [Saved("activation", t * cfg.intermediate_size * b, 3)]
        if is_recomputed["activation"]:
            return [Saved("activation", t * d * b)], [_saved_bytes(swiglu + lora)]
        return [Saved("linear", t * d * b)] + swiglu + lora, []
    moe = cfg.moe
    assert moe is not None, "the schema requires model.moe for moe layers"
    k, f, fs = moe.top_k, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
    routed = t * k
    block = [Saved("router", t * moe.num_experts * FP32_BYTES), Saved("router", t * k * FP32_BYTES)]
    if fs and moe.shared_expert_gate:
        block.append(Saved("router", t * b))
    experts = [Saved("experts", routed * 2 * f * b), Saved("experts", routed * f * b)]
    if lora_ranks.experts:
        experts.append(Saved("experts", routed * lora_ranks.experts * b, 2))
    # The dispatched rows and the experts' outputs: saved by the experts, or by the block around recomputed experts.
    ends_class = "router" if is_recomputed["experts"] else "experts"
    ends = [Saved(ends_class, routed * d * b, 2)]
    shared = [Saved("activation", t * fs * b, 3)] if fs else []
    if is_recomputed["router"]:
        return [Saved("activation", t * d * b)], [_saved_bytes(block + experts + ends + shared + lora)]
    saved, recomputed = [Saved("linear", t * d * b)] + block + ends + lora, []
    if is_recomputed["experts"]:
        recomputed.append(_saved_bytes(experts))
    else:
        saved += experts
    if is_recomputed["activation"] and shared:
        recomputed.append(_saved_bytes(shared))
    else:
        saved += shared
    return saved, recomputed


def _lora_ranks_per_layer(cfg: ModelProfile, added: list[Param], r: int) -> list[LayerRanks]:
    ranks = [[0, 0, 0] for _ in cfg.layers]
    for p in added:
        parts = p.name.split(".")
        if parts[0] != "layers" or f"lora_A.{ADAPTER_NAME}" not in p.name:
            continue
        index = int(parts[1])
        if p.is_expert:
            # One experts module has two A factors (gate_up and down); count the module once.
            if p.name.endswith("w_gate_up"):
                ranks[index][2] += r
        elif parts[2] == "mlp":
            ranks[index][1] += r
        else:
            ranks[index][0] += r
    return [LayerRanks(*layer) for layer in ranks]


def sequence_chunk(job: JobProfile) -> int | None:
    """The tokens of one sequence chunk when memory.sequence_chunk_tokens splits a device's share of a micro-batch's
    row, else None (a share of at most that many tokens runs whole)."""
    chunk = job.memory.sequence_chunk_tokens
    return chunk if chunk is not None and chunk < device_tokens(job) else None


def row_tokens(job: JobProfile) -> int:
    """T_row: the tokens of a micro-batch's packed row (micro_batch_size rows of seq_len)."""
    return job.train.micro_batch_size * job.data.seq_len


def device_tokens(job: JobProfile) -> int:
    """T: the tokens one device holds of a micro-batch, T_row / parallel.context_parallel."""
    return row_tokens(job) // job.parallel.context_parallel


def vision_patches(job: JobProfile) -> int:
    """P: the most image patches the vision tower sees in one micro-batch, 0 without a tower: every one of the
    device's T tokens an image token (no text, and no vision_start / vision_end framing counted), m x m patches each.
    T is the whole row (micro_batch_size x seq_len): the profile refuses context parallelism with a vision tower."""
    spec = job.model.vision
    return 0 if spec is None else device_tokens(job) * spec.spatial_merge_size**2


def vision_training(lora: LoraProfile) -> tuple[str, str]:
    """How the tower's blocks and its merger train: 'frozen', 'lora' or 'trained' (lora.vision_tower,
    lora.vision_merger); in full fine-tuning (lora.enabled false) a part set to lora trains in full."""
    def part(choice: str) -> str:
        return "trained" if choice == "lora" and not lora.enabled else choice

    return part(lora.vision_tower), part(lora.vision_merger)


def vision_activation_bytes(job: JobProfile) -> int:
    """What backward keeps of the vision tower (engine/model/vision.py) over P = vision_patches(job) patches, each
    distinct saved tensor once. The tower runs once per micro-batch on all the rows' images, never under activation
    checkpointing or the memory policy. Its attention counts as SDPA's flash / memory-efficient kernels keep it:
    their inputs, their output and the log-sum-exp per head, no [L, L] probabilities.

    A block whose linears train (tower trained, or lora: x A [P, r] more for each of its 4 linears), per patch in the
    training dtype: its input (norm1's), norm1's output (qkv's input), the qkv output 3 Dv (v is a view of it), q and
    k after rotary, the attention's output, their concatenation (proj's input), norm2's input and output, fc1's
    output (the GELU's input) and the GELU's output (fc2's input): 11 Dv + 2 I; in fp32 both norms' mean and rstd and
    the log-sum-exp, 4 + hv. Under lora, block 0 keeps no input and no norm1 statistics (nothing before it needs a
    gradient: the patch embedding and the positions stay frozen); trained, the patch embedding keeps its input
    (C Tp p^2 a patch). The rotary cos and sin [P, 1, hd] fp32 are kept once for all blocks.
    The merger, per patch: trained, its norm's input and output, fc1's output and the GELU's output (4 Dv) and the
    norm's statistics (2 fp32); lora, the norm's output, fc1's output and the GELU's output (3 Dv) and x A [P / m^2, r]
    of fc1 and fc2, plus the norm's input and statistics when the tower trains; frozen, when the tower trains, the
    norm's input and statistics and fc1's output (the GELU's input). A frozen tower with a frozen merger keeps nothing.
    """
    spec = job.model.vision
    if spec is None:
        return 0
    b, r = DTYPE_BYTES[job.train.precision], job.lora.r
    tower, merger = vision_training(job.lora)
    p, m2, dv, heads = vision_patches(job), spec.spatial_merge_size**2, spec.hidden_size, spec.num_heads
    low = wide = 0
    if tower != "frozen":
        low += spec.depth * (11 * dv + 2 * spec.intermediate_size + (4 * r if tower == "lora" else 0)) * p
        # Per block the norms' statistics and the log-sum-exp; cos and sin once.
        wide += spec.depth * (4 + heads) * p + 2 * (dv // heads) * p
        if tower == "lora":
            # Block 0's input and norm1 statistics: nothing before it needs a gradient.
            low, wide = low - dv * p, wide - 2 * p
        else:
            low += spec.in_channels * spec.temporal_patch_size * spec.patch_size**2 * p
    # The merger's norm keeps its input and statistics when its weights train or the tower behind it does.
    if tower != "frozen" or merger == "trained":
        low, wide = low + dv * p, wide + 2 * p
    if merger == "trained":
        low += 3 * dv * p
    elif merger == "lora":
        low += 3 * dv * p + 2 * r * (p // m2)
    elif tower != "frozen":
        low += dv * p
    return low * b + wide * FP32_BYTES


def _head_has_lora(lora: LoraProfile) -> bool:
    """Whether a LoRA adapter sits on the LM head (PEFT matches target_modules as module-name suffixes)."""
    return lora.enabled and "lm_head" in lora.target_modules


def activation_bytes(job: JobProfile, base: list[Param] | None = None) -> ActivationBytes:
    """What backward keeps per device for one micro-batch: its T = micro_batch_size x seq_len / context_parallel
    tokens, plus under context parallelism what its token mixers gather or fetch (context_exchange; docs/plan.md), and
    with a vision tower what it keeps over the most image patches those tokens can hold (vision_activation_bytes).
    `base`: model_parameters(job.model) when the caller has it."""
    cfg = job.model
    b = DTYPE_BYTES[job.train.precision]
    t = device_tokens(job)
    added = lora_parameters(model_parameters(cfg) if base is None else base, job.lora)
    ranks = _lora_ranks_per_layer(cfg, added, job.lora.r)
    chunk = sequence_chunk(job)
    c = job.parallel.context_parallel
    # The token mixers run in chunks too; a row of at most one chunk, or a share of a row held by a context group (they
    # exchange whole shares), is their one chunk, recomputed whole (engine/model/mixer_chunks.py).
    mixer_chunk = chunk if c == 1 else None
    is_share_recomputed = job.memory.sequence_chunk_tokens is not None and mixer_chunk is None
    policy = resolve_policy(job.memory)
    # Without the manager (whole layers recomputed, or a policy that keeps everything) the layers keep it all.
    is_managed = not job.memory.activation_checkpointing and not policy.keeps_everything
    per_layer, per_chunk, layer_saves = [], [0], []
    for spec, lora_ranks in zip(cfg.layers, ranks):
        low, wide = _layer_activation_elems(
            cfg, spec, t, lora_ranks, is_chunked=chunk is not None, mixer_chunk=mixer_chunk,
            is_mixer_recomputed=is_share_recomputed,
        )  # fmt: skip
        per_layer.append(low * b + wide * FP32_BYTES)
        if is_managed:
            layer_saves.append(_layer_saves(
                cfg, spec, t, lora_ranks, job.lora.r, policy.classes, b, is_chunked=chunk is not None,
                mixer_chunk=mixer_chunk, is_mixer_recomputed=is_share_recomputed,
            ))  # fmt: skip
        if is_share_recomputed:
            low, wide = _token_mixer_elems(cfg, spec, t, lora_ranks)
            per_chunk.append(low * b + wide * FP32_BYTES)
        if chunk is not None:
            low, wide = _chunk_activation_elems(cfg, spec, chunk, lora_ranks)
            per_chunk.append(low * b + wide * FP32_BYTES)
        if mixer_chunk is not None:
            # Backward recomputes a mixer chunk or a per-token chunk at a time, never both.
            low, wide = _mixer_chunk_elems(cfg, spec, t, mixer_chunk, lora_ranks)
            per_chunk.append(low * b + wide * FP32_BYTES)
    tiers = PolicyTiers(0, 0, {}, 0, 0)
    if job.memory.activation_checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time.
        layers = len(cfg.layers) * t * cfg.hidden_size * b + max(per_layer)
    elif is_managed:
        tiers = policy_tiers(layer_saves, policy)
        layers = tiers.gpu
    else:
        layers = sum(per_layer)
    # Backward recomputes one sequence chunk, or one module of a recomputed class, at a time.
    recompute = max(max(per_chunk), tiers.recompute)
    layers += recompute
    head = 2 * t * cfg.hidden_size * b
    if _head_has_lora(job.lora):
        # The model computes the full logits through the adapted head: [T, V] in the training dtype and in fp32.
        head += t * cfg.vocab_size * (b + FP32_BYTES)
    else:
        # The chunked cross-entropy (ops/cross_entropy) keeps d loss / d hidden [T, D] from its forward; one chunk's
        # logits exist at a time, in fp32 and in the training dtype for the matmuls.
        rows = min(t, default_chunk_size(t, cfg.vocab_size))
        head += t * cfg.hidden_size * b + rows * cfg.vocab_size * (b + FP32_BYTES)
    transient = 0
    la = cfg.linear_attention
    if la is not None and any(spec.attention == "linear" for spec in cfg.layers):
        # In sequence chunks the op runs one slab at a time.
        num_chunks = -(-min(t, mixer_chunk or t) // LINEAR_ATTENTION_CHUNK)
        transient = 2 * num_chunks * la.num_value_heads * la.key_head_dim * la.value_head_dim * b
    kept = [context_exchange(cfg, spec, row_tokens(job), c, b).kept for spec in cfg.layers]
    # Under activation checkpointing (or with the token mixers' shares recomputed) a layer's gathers exist while
    # backward recomputes it, one layer at a time.
    context = max(kept) if job.memory.activation_checkpointing or is_share_recomputed else sum(kept)
    return ActivationBytes(layers=layers, head=head, transient=transient, context=context, host=tiers.host,
                           host_by_class=tiers.host_by_class, prefetch=tiers.prefetch,
                           recompute=recompute if is_managed else 0, vision=vision_activation_bytes(job))


class PolicyTiers(NamedTuple):
    """Where the memory policy puts the layers' saved tensors (bytes, one micro-batch)."""

    gpu: int  # the most the layers' saved tensors take on the GPU at once, the prefetch window included
    host: int  # in pinned host memory
    host_by_class: dict[str, int]  # the offloaded classes' bytes, and "budget": what passed the GPU budget
    prefetch: int  # of gpu: the offloaded bytes swapped in at that moment
    recompute: int  # the largest module backward recomputes


def policy_tiers(layers: list[LayerSaves], policy: MemoryPolicy) -> PolicyTiers:
    """engine/memory's placement of each layer's saved tensors (TieredStore.pack): smaller than min_offload_mb they
    stay on the GPU; an offloaded class's go to the host; the others stay on the GPU, or with a GPU budget count
    against it, and what passes it moves to the host, first saved first (the lowest layers). Forward holds a layer's
    tensors until the layer ends; when backward starts layer L it swaps in layers L - 1 ... L - prefetch_layers, and
    the layers above L have freed theirs: backward at L holds what layers 0 ... L keep on the GPU and the host bytes
    of layers L - prefetch_layers ... L. The largest such sum is the layers' GPU peak."""
    threshold = max(policy.min_offload_bytes, 1)
    gpu, budgeted, host = [], [], []
    by_class: dict[str, int] = {}
    for layer in layers:
        to_gpu = to_budget = to_host = 0
        for s in layer.saved:
            size = s.nbytes * s.count
            if s.nbytes < threshold:
                to_gpu += size
            elif policy.choice(s.klass) == "offload":
                to_host += size
                by_class[s.klass] = by_class.get(s.klass, 0) + size
            elif policy.gpu_budget_bytes is not None:
                to_budget += size
            else:
                to_gpu += size
        gpu.append(to_gpu)
        budgeted.append(to_budget)
        host.append(to_host)
    evict = max(0, sum(budgeted) - (policy.gpu_budget_bytes or 0))
    for index, size in enumerate(budgeted):
        moved = min(evict, size)
        gpu[index] += size - moved
        host[index] += moved
        if moved:
            by_class["budget"] = by_class.get("budget", 0) + moved
        evict -= moved
    depth = policy.prefetch_layers
    peak = prefetch = 0
    for top in range(len(layers)):
        window = sum(host[max(0, top - depth) : top + 1])
        if sum(gpu[: top + 1]) + window > peak:
            peak, prefetch = sum(gpu[: top + 1]) + window, window
    recompute = max((size for layer in layers for size in layer.recomputed), default=0)
    return PolicyTiers(peak, sum(host), by_class, prefetch, recompute)


@dataclass(frozen=True)
class Layout:
    """One data x expert layout of N devices and what a device holds and moves under it (bytes)."""

    data_parallel: int
    expert_parallel: int
    experts_per_device: int  # routed experts of each MoE layer this device's expert-parallel rank holds
    is_profile_layout: bool  # the profile's parallel.expert_parallel
    dense_weights: int
    expert_weights: int
    lora_weights: int
    gradients: int
    optimizer: int
    activations: int
    gathered: int  # the largest module ZeRO-3 gathers whole on this device
    total: int
    fits: bool
    all_to_all_per_step: int  # bytes this device sends by all-to-all per optimizer step
    zero3_per_step: int  # bytes this device receives in ZeRO-3 all-gathers and gradient reduce-scatters per step
    # Bytes of this device's context-group exchanges per step (gathers: keys and values, indexer keys, state
    # summaries, halos; the top-k layers' fetched rows) and their gradients in backward, on the group's last device
    # (an upper bound: one document over the row, every unit selectable), and their mean over the group's devices;
    # 0 without context parallelism.
    context_per_step: int = 0
    context_mean_per_step: int = 0
    # The memory policy's host tier: the pinned pool (the offloaded bytes in whole HOST_CHUNK_BYTES chunks), the bytes
    # copied each way per step (out in forward, back in backward), and their time at the pinned-copy bandwidth.
    host_memory: int = 0
    swap_per_step: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0

    @property
    def traffic_per_step(self) -> int:
        return self.all_to_all_per_step + self.zero3_per_step + self.context_per_step


@dataclass(frozen=True)
class Plan:
    profile: str
    devices: int
    device_memory: int
    precision: str
    tokens_per_micro_batch: int  # per device: T = row_tokens / context_parallel
    gradient_accumulation_steps: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    lora_enabled: bool
    modules_to_save: list[str]  # modules LoRA trains in full (lora.modules_to_save)
    profile_expert_parallel: int
    parameters: ParameterCounts
    base_precision: str  # model.base_precision: bf16 (the training dtype) or fp8
    weights: WeightBytes  # the base weights as base_precision stores them
    weight_bytes: int  # every base weight, weights.total
    activations: ActivationBytes
    layouts: list[Layout] = field(default_factory=list)  # best first
    context_parallel: int = 1  # parallel.context_parallel: devices that share each row
    row_tokens: int = 0  # T_row: tokens of a micro-batch's row, on context_parallel devices
    vision_patches: int = 0  # P: the most image patches the vision tower sees in a micro-batch (0 without a tower)
    # How the vision tower's blocks and merger train ('frozen', 'lora' or 'trained'; vision_training); None without one.
    vision_training: tuple[str, str] | None = None

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (every size in bytes), what `moe-tune plan --json` writes."""
        data = asdict(self)
        data["activations"]["total"] = self.activations.total
        for row, layout in zip(data["layouts"], self.layouts):
            row["traffic_per_step"] = layout.traffic_per_step
        return data


def _gathered_bytes(params: list[Param], ep: int, fp8_names: set[str], dtype_bytes: int) -> int:
    """The largest module ZeRO-3 gathers at once: routed experts (with their adapters) count E / ep experts, because
    the per-expert LoRA layer is a ZeRO-3 leaf that gathers its local experts and adapters together."""
    per_module: dict[str, int] = {}
    for p in params:
        module = p.module
        size = _param_bytes(p, fp8_names, dtype_bytes)
        if p.is_expert:
            module = p.name.split(f".{EXPERTS_MODULE}.", 1)[0] + f".{EXPERTS_MODULE}"
            per_module[module] = per_module.get(module, 0) + size // ep
        else:
            per_module[module] = per_module.get(module, 0) + size
    return max(per_module.values())


def _divide(numerator: int, denominator: int) -> int:
    # Bytes per device: a shard rounds up.
    return -(-numerator // denominator)


def plan_layouts(job: JobProfile, num_devices: int, device_memory: int) -> Plan:
    """Every data x expert layout of `num_devices` (ep divides num_experts and num_devices), best first: those that
    fit `device_memory` bytes, then the least traffic per step, then the least memory."""
    if num_devices < 1:
        raise ValueError(f"num_devices ({num_devices}) must be >= 1")
    c = job.parallel.context_parallel
    if num_devices % c:
        raise ProfileError([f"parallel.context_parallel ({c}) must divide the devices ({num_devices}): each row is "
                            "shared by that many"])  # fmt: skip
    cfg = job.model
    base = model_parameters(cfg)
    added = lora_parameters(base, job.lora)
    counts = count_parameters(cfg, job.lora, base)
    acts = activation_bytes(job, base)
    wb = DTYPE_BYTES[job.train.precision]
    weights = weight_bytes(base, cfg, job.lora, job.train.precision)
    fp8_names = {p.name for p in fp8_parameters(base, cfg, job.lora)}
    # Gradients are kept in the training dtype; fp32 weights are their own master copy.
    gb = wb
    optimizer_bytes = ADAM_MOMENT_BYTES + (MASTER_WEIGHT_BYTES if wb != FP32_BYTES else 0)
    num_moe_layers = sum(layer.mlp == "moe" for layer in cfg.layers)
    has_experts = cfg.moe is not None and num_moe_layers > 0
    # Without routed experts the only layout is pure data parallelism.
    num_experts = cfg.moe.num_experts if has_experts else 1
    top_k = cfg.moe.top_k if has_experts else 0
    tokens = device_tokens(job)
    accumulation = job.train.gradient_accumulation_steps
    is_recomputed = job.memory.activation_checkpointing
    is_share_recomputed = job.memory.sequence_chunk_tokens is not None and (c > 1 or sequence_chunk(job) is None)
    context_bytes = [context_traffic(context_exchange(cfg, spec, row_tokens(job), c, wb), is_recomputed,
                                     is_share_recomputed) for spec in cfg.layers]  # fmt: skip
    all_to_alls = ALL_TO_ALLS_PER_LAYER_RECOMPUTED if job.memory.activation_checkpointing else ALL_TO_ALLS_PER_LAYER
    if sequence_chunk(job) is not None:
        all_to_alls += ALL_TO_ALLS_PER_CHUNKED_RECOMPUTE
    all_params = base + added
    # One pool serves every micro-batch of a step; each copies its offloaded bytes out and back.
    host_pool = _divide(acts.host, HOST_CHUNK_BYTES) * HOST_CHUNK_BYTES
    swap = accumulation * acts.host
    layouts = []
    # ep divides num_experts: no layout has more expert-parallel ranks than experts.
    for ep in range(1, min(num_devices, num_experts) + 1):
        if num_devices % ep or num_experts % ep:
            continue
        dp = num_devices // ep
        # Dense tensors are sharded over all N devices; a rank's E / ep experts over its dp expert-data-parallel
        # peers, which is E / N experts' worth per device for every ep.
        dense_weights = _divide(weights.dense, num_devices)
        expert_weights = _divide(weights.experts, num_devices)
        lora_weights = _divide(counts.lora_dense * wb, num_devices) + _divide(counts.lora_experts * wb, num_devices)
        gradients = _divide(counts.trainable * gb, num_devices)
        optimizer = _divide(counts.trainable * optimizer_bytes, num_devices)
        gathered = _gathered_bytes(all_params, ep, fp8_names, wb)
        total = dense_weights + expert_weights + lora_weights + gradients + optimizer + acts.total + gathered
        leaving = (ep - 1) / ep
        sent_per_layer = tokens * top_k * cfg.hidden_size * wb * leaving * all_to_alls
        all_to_all = round(accumulation * num_moe_layers * sent_per_layer)
        dense_all = weights.dense + counts.lora_dense * wb
        experts_all = weights.experts + counts.lora_experts * wb
        gather = ZERO3_GATHERS_PER_MICRO_BATCH * (
            dense_all * (num_devices - 1) / num_devices + experts_all / ep * (dp - 1) / dp
        )
        reduce = counts.trainable_dense * gb * (num_devices - 1) / num_devices
        reduce += counts.trainable_experts * gb / ep * (dp - 1) / dp
        layouts.append(
            Layout(
                data_parallel=dp,
                expert_parallel=ep,
                experts_per_device=num_experts // ep if has_experts else 0,
                is_profile_layout=ep == job.parallel.expert_parallel,
                dense_weights=dense_weights,
                expert_weights=expert_weights,
                lora_weights=lora_weights,
                gradients=gradients,
                optimizer=optimizer,
                activations=acts.total,
                gathered=gathered,
                total=total,
                fits=total <= device_memory,
                all_to_all_per_step=all_to_all,
                zero3_per_step=round(accumulation * (gather + reduce)),
                context_per_step=round(accumulation * sum(layer.last for layer in context_bytes)),
                context_mean_per_step=round(accumulation * sum(layer.mean for layer in context_bytes)),
                host_memory=host_pool,
                swap_per_step=swap,
                swap_out_s=swap / PINNED_D2H_BYTES_PER_S,
                swap_in_s=swap / PINNED_H2D_BYTES_PER_S,
            )
        )
    layouts.sort(key=lambda lay: (not lay.fits, lay.traffic_per_step, lay.total, lay.expert_parallel))
    return Plan(
        profile=job.name,
        devices=num_devices,
        device_memory=device_memory,
        precision=job.train.precision,
        tokens_per_micro_batch=tokens,
        gradient_accumulation_steps=accumulation,
        num_moe_layers=num_moe_layers,
        num_experts=num_experts if has_experts else 0,
        top_k=top_k,
        lora_enabled=job.lora.enabled,
        modules_to_save=list(job.lora.modules_to_save) if job.lora.enabled else [],
        profile_expert_parallel=job.parallel.expert_parallel,
        parameters=counts,
        base_precision=cfg.base_precision,
        weights=weights,
        weight_bytes=weights.total,
        activations=acts,
        layouts=layouts,
        context_parallel=c,
        row_tokens=row_tokens(job),
        vision_patches=vision_patches(job),
        vision_training=vision_training(job.lora) if cfg.vision is not None else None,
    )
