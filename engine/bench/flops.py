"""Model FLOPs of a training step and the MFU they give (docs/bench.md, "MFU").

Model FLOPs count the matmuls the model needs, 2 per multiply-add, whatever the kernels actually run (no
recomputation, no padding, no masked-out attention pairs):
- every nn.Linear of the text model: 2 * in * out per token (attention projections, router, shared expert, dense
  MLPs, hyper-connection mixers, lm_head);
- routed experts: only the top-k experts a token is sent to, 2 * (D * 2F + F * D) each;
- the attention core over the keys each query sees inside its document: full attention 2 * H * (K + V) per
  (query, key) pair of the causal triangle; sparse attention min(topk, keys visible) keys per query; the indexers
  2 * HI * DI per key (or key block) visible; linear attention the chunked algorithm's (6 C K + 4 C V + 6 K V) per
  token and head (C = 64, engine/bench/linear_attention_op.py counts the same);
- LoRA adapters: 2 * r * (in + out) per token and adapted linear; per-expert adapters for the top-k experts.
Norms, activations, rotary, short convolutions, softmax, top-k, embeddings and the vision tower are not counted.

Each forward count is multiplied by the passes a training step makes over it:
- FROZEN_PASSES (2) for a matmul with a frozen weight: forward + the input-gradient backward (no weight gradient);
- TRAINED_PASSES (3) for a trained weight (adapters, modules_to_save, full fine-tuning): + the weight gradient;
- ACTIVATION_PASSES (3) for a matmul of two activations (attention cores): a gradient for each operand;
- NO_GRAD_PASSES (1) for what runs under torch.no_grad (the sparse-attention indexers pick keys, get no gradient).
Frozen projections of the first layer are counted with their input-gradient backward although autograd skips it
(the embedding is frozen): a convention that keeps the count independent of where adapters sit.

MFU = model FLOPs of a step / step time / the GEMM peak measured on this machine in the training dtype.

Shapes: T tokens of a step, n tokens of a document piece (cu_seqlens segment), D model dim, H query heads, K / V
key / value dims per head, E experts, k experts per token, F expert hidden dim, r LoRA rank, HI / DI indexer heads
and dim, C chunk length of the linear-attention kernels.
"""

from __future__ import annotations

import functools
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moe_tune.engine.bench.timing import StepClock
from moe_tune.profiles.schema import LoraProfile, ModelProfile

FROZEN_PASSES = 2
TRAINED_PASSES = 3
ACTIVATION_PASSES = 3
NO_GRAD_PASSES = 1
# One multiply-add is two floating-point operations.
FLOPS_PER_MAC = 2

# The parts of a step's FLOPs, in the order tables list them.
PARTS = (
    "attention projections", "attention core", "linear attention core", "indexers", "routed experts",
    "shared expert / dense MLP", "router", "lm_head", "other linear", "adapters",
)  # fmt: skip
# Linear layers under torch.no_grad: the sparse-attention indexers (SparseAttention's index_*_proj, the QSA and
# lightning indexers' modules), which only choose keys.
NO_GRAD_LINEAR = re.compile(r"\.self_attn\.(indexer\.|index_)")
# The vision tower runs on image patches, not text tokens: it is left out of the count.
VISION_PREFIX = "vision."
# Attention kinds by how their core is counted.
SOFTMAX_KINDS = ("full", "mla")
SPARSE_KINDS = ("sparse", "mla_sparse")
LINEAR_KINDS = ("linear", "kda")

# CPU peak probe: small enough to time in a fraction of a second on 2 busy cores, large enough to run the BLAS
# kernels at their steady rate.
CPU_PEAK_GEMM_SIZE = 512
CPU_PEAK_REPEATS = 5
CPU_PEAK_WARMUP = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class FlopCount:
    """Model FLOPs of one step, per part: `forward` as the forward pass computes them, `training` times each
    matmul's passes (FROZEN_PASSES, TRAINED_PASSES, ...)."""

    forward: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    training: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def add(self, part: str, forward_flops: float, passes: int) -> None:
        self.forward[part] += forward_flops
        self.training[part] += forward_flops * passes

    @property
    def total(self) -> float:
        """Training FLOPs of the step (what MFU divides)."""
        return sum(self.training.values())


def _causal_keys(n: int) -> int:
    """Keys all queries of an n-token piece see together: n (n + 1) / 2."""
    return n * (n + 1) // 2


def _capped_keys(n: int, cap: int) -> int:
    """sum over queries j = 1..n of min(cap, j): each query sees at most `cap` keys."""
    if n <= cap:
        return _causal_keys(n)
    return _causal_keys(cap) + (n - cap) * cap


def _visible_blocks(n: int, block: int) -> int:
    """sum over queries j = 1..n of ceil(j / block): the key blocks (complete or not) each query can score."""
    whole, rest = divmod(n, block)
    return block * whole * (whole + 1) // 2 + rest * (whole + 1)


@functools.lru_cache(maxsize=256)
def _qsa_keys(n: int, topk: int, block: int) -> int:
    """Keys of a QSA layer over an n-token piece: query j (1-based) keeps its best complete blocks within the topk
    budget, and the incomplete block it sits in (j mod block keys)."""
    return sum(min(topk, block * (j // block)) + j % block for j in range(1, n + 1))


class FlopModel:
    """Per-token FLOPs of one model profile and LoRA set-up, computed once; `step(piece_lengths)` adds the attention
    cores of a step's pieces (the cu_seqlens segments of its micro-batches, every rank's own)."""

    def __init__(self, cfg: ModelProfile, lora: LoraProfile):
        from moe_tune.engine.plan import lora_parameters, model_parameters

        self.cfg = cfg
        params = [p for p in model_parameters(cfg) if not p.name.startswith(VISION_PREFIX)]
        adapters = lora_parameters(params, lora)
        saved = {p.name.split(".modules_to_save.")[0] for p in adapters if ".modules_to_save." in p.name}
        top_k, num_experts = (cfg.moe.top_k, cfg.moe.num_experts) if cfg.moe is not None else (0, 1)
        # (part, forward FLOPs per token, passes)
        self.per_token: list[tuple[str, float, int]] = []
        for p in params:
            is_saved = any(p.name.startswith(f"{path}.") for path in saved)
            is_trained = not lora.enabled or is_saved
            if p.is_linear:
                out_features, in_features = p.shape
                if NO_GRAD_LINEAR.search(f".{p.module}."):
                    part, passes = "indexers", NO_GRAD_PASSES
                else:
                    part, passes = _linear_part(p.module), TRAINED_PASSES if is_trained else FROZEN_PASSES
                self.per_token.append((part, FLOPS_PER_MAC * in_features * out_features, passes))
            elif p.is_expert:
                # [E, out, in] per layer; each token runs top_k of the E experts.
                per_expert = p.numel // p.shape[0]
                self.per_token.append(("routed experts", FLOPS_PER_MAC * per_expert * top_k,
                                       TRAINED_PASSES if is_trained else FROZEN_PASSES))  # fmt: skip
        for a in adapters:
            if ".modules_to_save." in a.name:
                continue  # a trained copy replaces its module: counted above with TRAINED_PASSES
            passes = NO_GRAD_PASSES if NO_GRAD_LINEAR.search(f".{a.module}.") else TRAINED_PASSES
            # Linear adapters [r, in] / [out, r] run on every token; expert factors [E, ...] on the top_k chosen.
            flops = FLOPS_PER_MAC * (a.numel // num_experts * top_k if a.is_expert else a.numel)
            self.per_token.append(("adapters", flops, passes))

    def step(self, piece_lengths: Sequence[int]) -> FlopCount:
        """Model FLOPs of a step whose micro-batches hold pieces of these lengths (tokens = their sum)."""
        count = FlopCount()
        num_tokens = sum(piece_lengths)
        for part, flops, passes in self.per_token:
            count.add(part, flops * num_tokens, passes)
        for layer in self.cfg.layers:
            for part, flops, passes in self._core(layer.attention, piece_lengths):
                count.add(part, flops, passes)
        return count

    def _core(self, kind: str, pieces: Sequence[int]) -> list[tuple[str, float, int]]:
        """(part, forward FLOPs, passes) of one layer's attention core over the pieces."""
        cfg = self.cfg
        heads = cfg.num_attention_heads
        if kind in LINEAR_KINDS:
            from moe_tune.engine.bench.linear_attention_op import chunk_flops
            from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE

            if kind == "linear":
                spec = cfg.linear_attention
                h, k, v = spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
            else:
                h, k = cfg.kda_attention.num_heads, cfg.kda_attention.head_dim
                v = k
            # The chunk form's FLOPs of one chunk, spread over its C tokens (no padding of the last chunk).
            per_token = chunk_flops(h, k, v, num_chunks=1) / DEFAULT_CHUNK_SIZE
            return [("linear attention core", per_token * sum(pieces), ACTIVATION_PASSES)]
        if kind in ("mla", "mla_sparse"):
            mla = cfg.mla
            qk_dim, v_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
        else:
            qk_dim = v_dim = cfg.head_dim
        # Scores q.k and the weighted sum of values, per (query, key) pair and head.
        per_pair = FLOPS_PER_MAC * heads * (qk_dim + v_dim)
        if kind in SOFTMAX_KINDS:
            return [("attention core", per_pair * sum(_causal_keys(n) for n in pieces), ACTIVATION_PASSES)]
        spec = cfg.sparse_attention
        if kind == "qsa":
            keys = sum(_qsa_keys(n, spec.topk, spec.block_size) for n in pieces)
        else:
            keys = sum(_capped_keys(n, spec.topk) for n in pieces)
        scored = sum(_visible_blocks(n, spec.block_size) for n in pieces)
        index_flops = FLOPS_PER_MAC * spec.index_heads * spec.index_head_dim * scored
        return [("attention core", per_pair * keys, ACTIVATION_PASSES), ("indexers", index_flops, NO_GRAD_PASSES)]


def _linear_part(module: str) -> str:
    """The part a linear layer's FLOPs belong to, by its module path in MoECausalLM."""
    if module == "lm_head":
        return "lm_head"
    if ".self_attn." in f"{module}.":
        return "attention projections"
    if module.endswith(".mlp.gate"):
        return "router"
    if ".mlp." in f"{module}.":
        return "shared expert / dense MLP"
    return "other linear"


def piece_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """The document pieces of a packed micro-batch: cu_seqlens [N + 1] -> N lengths."""
    return cu_seqlens.diff().tolist()


def gemm_peak_tflops(device: torch.device, precision: str) -> float:
    """The GEMM rate this machine reaches in the training dtype, TFLOP/s: on CUDA in bf16 the kernel benchmark's
    probe (an 8192^3 GEMM, engine/bench/kernels.py), otherwise a CPU_PEAK_GEMM_SIZE^3 GEMM (the median of a few
    calls) on the device."""
    dtype = DTYPES[precision]
    if device.type == "cuda" and dtype == torch.bfloat16:
        from moe_tune.engine.bench.kernels import measure_peaks

        return measure_peaks().tflops
    n = CPU_PEAK_GEMM_SIZE
    if device.type == "cuda":
        from moe_tune.engine.bench.kernels import PEAK_GEMM_SIZE

        n = PEAK_GEMM_SIZE
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for index in range(CPU_PEAK_WARMUP + CPU_PEAK_REPEATS):
        with StepClock(device.type == "cuda") as clock:
            a @ b
        if index >= CPU_PEAK_WARMUP:
            times.append(clock.seconds)
    return FLOPS_PER_MAC * n**3 / statistics.median(times) * 1e-12
