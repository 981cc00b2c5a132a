"""Multi-head latent attention (DeepSeek-V2/V3, Kimi Linear), with or without RoPE, and its DSA variant (DeepSeek-V3.2).

Both token mixers are built from ModelProfile fields only: hidden_size, num_attention_heads, rope_theta and the
`mla` section (MLASpec: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope,
softmax_scale, latent_norm_eps, yarn); the sparse variant also reads `sparse_attention` (index_heads, index_head_dim,
topk, block_size). `mla.rope: none` is MLA without RoPE (Kimi Linear): the rotary dims exist and are used, but are
never rotated. Modules and parameters carry the checkpoints' own names (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; indexer.{wq_b, wk, k_norm, weights_proj}), so a family maps
them by name and LoRA target_modules use the hub's names.

    q      = q_b_proj(RMSNorm(q_a_proj(x)))  or  q_proj(x)                 per head: [nope Dn | rope Dr]
    c, kr  = kv_a_proj_with_mqa(x)                                          c: kv latent Rkv, kr: shared rope key Dr
    k, v   = kv_b_proj(RMSNorm(c))                                          per head: k nope Dn, v V
    o      = softmax(scale * [q_nope | rope(q_rope)] . [k_nope | rope(kr)]) v     over causal (or selected) keys

Shapes: T packed tokens of one row [1, T], D model dim, H heads, Dn / Dr the query-key dims without / with RoPE,
V value dim, Rq / Rkv the query / key-value latent ranks, HI indexer heads, DI indexer head dim, S selected keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import torch
from torch import nn

from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
from moe_tune.profiles.schema import MLASpec, ModelProfile, YarnSpec

from .blocks import RMSNorm, RotaryEmbedding
from .selection import PinnableSelection
from .varlen import packed_causal_attention

if TYPE_CHECKING:
    from .attention import PackedBatch

# DeepSeek-V3.2's indexer normalises its key with a LayerNorm of this fixed epsilon (not rms_norm_eps).
INDEXER_KEY_NORM_EPS = 1e-6

CosSin = tuple[torch.Tensor, torch.Tensor]


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [..., Dr], the pair i turned by frequency i; the result
    lists the rotated even dims, then the rotated odd dims (transformers' DeepSeek layout: q and k both get it, so
    their dot product is that of plain interleaved RoPE). cos, sin: [..., Dr] as RotaryEmbedding.cos_sin gives them
    (the frequencies repeated twice)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1).to(x.dtype)


def yarn_inv_freq(dim: int, theta: float, yarn: YarnSpec) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] fp32, as transformers computes them: frequencies that turn fewer than
    beta_slow times over the original context are divided by `factor`, those above beta_fast kept, a ramp between."""

    def correction_dim(num_rotations: float) -> float:
        wavelengths = yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        # Keeps the ramp finite (transformers' constant).
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_share = 1 - ramp
    return 1.0 / (yarn.factor * pos_freqs) * (1 - extrapolation_share) + 1.0 / pos_freqs * extrapolation_share


class LatentRotary(RotaryEmbedding):
    """RoPE over the Dr rotary dims (the first Dr dims of a wider head pass through rotate()), plain or YaRN-scaled."""

    def __init__(self, spec: MLASpec, theta: float):
        super().__init__(spec.qk_rope_head_dim, 1.0, theta)
        self.attention_factor = 1.0
        if spec.yarn is not None:
            self.inv_freq.copy_(yarn_inv_freq(spec.qk_rope_head_dim, theta, spec.yarn))
            self.attention_factor = spec.yarn.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().cos_sin(positions)
        if self.attention_factor == 1.0:
            return cos, sin
        return cos * self.attention_factor, sin * self.attention_factor


class MultiHeadLatentAttention(nn.Module):
    """MLA over every causal key of the query's document (layer kind `mla`)."""

    def __init__(self, cfg: ModelProfile):
        super().__init__()
        spec = cfg.mla
        assert spec is not None, "the schema requires model.mla for mla layers"
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = spec.q_lora_rank, spec.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = spec.softmax_scale if spec.softmax_scale is not None else self.qk_dim**-0.5
        self.rope = spec.rope
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, spec.latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, spec.latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, d, bias=False)
        self.rotary = LatentRotary(spec, cfg.rope_theta) if self.rope != "none" else None

    def _rotate(self, x: torch.Tensor, cos_sin: CosSin | None) -> torch.Tensor:
        if cos_sin is None:
            return x
        if self.rope == "interleaved":
            return rotate_interleaved(x, *cos_sin)
        return self.rotary.rotate(x, *cos_sin)

    def project(self, x: torch.Tensor, cos_sin: CosSin | None):
        """x [1, T, D] -> q latent [1, T, Rq] (None without q_lora_rank), q and k [1, T, H, Dn + Dr], v [1, T, H, V]."""
        t = x.shape[1]
        if self.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q_nope, q_rope = q.view(1, t, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], -1)
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(1, t, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], -1)
        # One rope key for all heads.
        k_rope = self._rotate(k_rope.view(1, t, 1, self.rope_dim), cos_sin).expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, self._rotate(q_rope, cos_sin)], -1)
        k = torch.cat([k_nope, k_rope], -1)
        return q_latent, q, k, v

    def attend(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch) -> torch.Tensor:
        return packed_causal_attention(q, k, v, batch.document_buckets, scale=self.scale)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        cos_sin = self.rotary.cos_sin(batch.positions) if self.rotary is not None else None
        q_latent, q, k, v = self.project(x, cos_sin)
        o = self.attend(x, q_latent, q, k, v, cos_sin, batch)
        return self.o_proj(o.reshape(1, x.shape[1], self.num_heads * self.v_dim))


class LightningIndexer(PinnableSelection, nn.Module):
    """DeepSeek-V3.2's DSA indexer: picks the keys each query attends to; it gets no gradient (run under no_grad).

    Query heads come from the MLA query latent (wq_b), one key per token from x (wk, then a LayerNorm); the first
    Dr dims of both get rotate-half RoPE (not interleaved, unlike the attention). Score of query t on key s:
    sum_h w[t, h] relu(DI**-0.5 q[t, h] . k[s]) with w = weights_proj(x) HI**-0.5, which is ops.topk_indexer.
    """

    def __init__(self, cfg: ModelProfile):
        super().__init__()
        spec, mla = cfg.sparse_attention, cfg.mla
        assert spec is not None and mla is not None and mla.q_lora_rank is not None, "the schema checks mla_sparse"
        self.num_heads, self.head_dim = spec.index_heads, spec.index_head_dim
        self.num_selected, self.block_size = spec.topk // spec.block_size, spec.block_size
        self.wq_b = nn.Linear(mla.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)
        # Rotates the first Dr dims of a wider head; the rest pass through.
        self.rotary = LatentRotary(mla, cfg.rope_theta) if mla.rope != "none" else None

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin: CosSin | None, batch: PackedBatch):
        """x [1, T, D], q_latent [1, T, Rq] -> selected key positions [1, T, S] int32 (-1: unused slot)."""
        t = x.shape[1]
        q = self.wq_b(q_latent).view(1, t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(1, t, 1, self.head_dim)
        if cos_sin is not None:
            q, k = self.rotary.rotate(q, *cos_sin), self.rotary.rotate(k, *cos_sin)
        w = self.weights_proj(x) * self.num_heads**-0.5
        indices = topk_indexer(
            q, k.view(1, t, self.head_dim), w, topk=self.num_selected, block_size=self.block_size,
            cu_seqlens=batch.cu_seqlens,
        )
        return self.pin_selection(indices)


class SparseMultiHeadLatentAttention(MultiHeadLatentAttention):
    """MLA over the keys the lightning indexer selects (layer kind `mla_sparse`, DeepSeek-V3.2's DSA)."""

    def __init__(self, cfg: ModelProfile):
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)

    def attend(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch) -> torch.Tensor:
        indices = self.indexer(x, q_latent, cos_sin, batch)
        return sparse_attention(
            q, k, v, indices, block_size=self.indexer.block_size, scale=self.scale, cu_seqlens=batch.cu_seqlens
        )
