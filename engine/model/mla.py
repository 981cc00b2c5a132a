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

from collections.abc import Callable
from typing import TYPE_CHECKING

import math

import torch
from torch import nn

from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
from moe_tune.profiles.schema import MLASpec, ModelProfile, YarnSpec

from .attention_context import KeySpan, is_context_parallel, latent_attention_across_ranks
from .blocks import RMSNorm, RotaryEmbedding
from .kv_cache import (
    QUERY_CHUNK, GrowingCache, causal_keys, masked_softmax, mean_pooled_blocks, one_document_batch,
    select_cached_blocks, selected_keys,
)
from .mixer_chunks import (
    attention_in_chunks, runs_in_chunks, runs_whole_recomputed, selection_is_watched, whole_recomputed,
)
from .selection import PinnableSelection
from .varlen import packed_causal_attention

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep

    from .batch import PackedBatch

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

    # memory.sequence_chunk_tokens (MoECausalLM.set_sequence_chunk_tokens): a longer row runs its queries chunk by
    # chunk over the row's kv latent, expanded per chunk over the keys it sees (engine/model/mixer_chunks.py).
    sequence_chunk_tokens: int | None = None

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

    def project_query(self, x: torch.Tensor, cos_sin: CosSin | None):
        """x [1, T, D] -> q latent [1, T, Rq] (None without q_lora_rank), q_nope [1, T, H, Dn], rotated q_rope
        [1, T, H, Dr]."""
        t = x.shape[1]
        if self.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q_nope, q_rope = q.view(1, t, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], -1)
        return q_latent, q_nope, self._rotate(q_rope, cos_sin)

    def project_latent(self, x: torch.Tensor, cos_sin: CosSin | None):
        """x [1, T, D] -> normed kv latent [1, T, Rkv] and the rotated rope key [1, T, 1, Dr] (one for all heads)."""
        t = x.shape[1]
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        return self.kv_a_layernorm(kv_latent), self._rotate(k_rope.view(1, t, 1, self.rope_dim), cos_sin)

    def expand_latent(self, q_nope, q_rope, latent, k_rope):
        """The per-head q and k [1, T, H, Dn + Dr] and v [1, T, H, V] from project_query's and project_latent's parts."""
        t = latent.shape[1]
        kv = self.kv_b_proj(latent).view(1, t, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], -1)
        q = torch.cat([q_nope, q_rope], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.num_heads, -1)], -1)
        return q, k, v

    def project(self, x: torch.Tensor, cos_sin: CosSin | None):
        """x [1, T, D] -> q latent [1, T, Rq] (None without q_lora_rank), q and k [1, T, H, Dn + Dr], v [1, T, H, V]."""
        q_latent, q_nope, q_rope = self.project_query(x, cos_sin)
        q, k, v = self.expand_latent(q_nope, q_rope, *self.project_latent(x, cos_sin))
        return q_latent, q, k, v

    def attend(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch) -> torch.Tensor:
        return packed_causal_attention(q, k, v, batch.document_buckets, scale=self.scale)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if runs_in_chunks(self, x, batch) and not selection_is_watched(*self.selectors()):
            cos_sin = self.rotary.cos_sin(batch.positions) if self.rotary is not None else None
            return attention_in_chunks(
                x, batch, self.sequence_chunk_tokens, lambda x_row: self.project_latent(x_row, cos_sin), self._chunk,
                self.row_index_keys(x, cos_sin), select=self.select_span,
            )  # fmt: skip
        if runs_whole_recomputed(self, *self.selectors()):
            return whole_recomputed(self.forward_whole, x, batch)
        return self.forward_whole(x, batch)

    def forward_whole(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """forward() on the row (or a context-parallel rank's share) in one piece."""
        cos_sin = self.rotary.cos_sin(batch.positions) if self.rotary is not None else None
        if is_context_parallel(batch):
            o = latent_attention_across_ranks(self, x, cos_sin, batch)
        else:
            q_latent, q, k, v = self.project(x, cos_sin)
            o = self.attend(x, q_latent, q, k, v, cos_sin, batch)
        return self.o_proj(o.reshape(1, x.shape[1], self.num_heads * self.v_dim))

    def selectors(self) -> tuple:
        """The modules choosing this layer's keys (PinnableSelection): none without an indexer."""
        return ()

    def row_index_keys(self, x: torch.Tensor, cos_sin: CosSin | None) -> tuple[torch.Tensor, ...]:
        """The indexer's keys of the row [1, T, DI] without gradient, for sequence chunks: none without an indexer."""
        return ()

    # select_span(x_c, span, *index keys over the span) -> the chunk's indices without gradient, for a layer whose
    # indexer selects its keys (mixer_chunks.attention_in_chunks' `select`): None without an indexer.
    select_span: Callable | None = None

    def _chunk(self, x_c, span: KeySpan, latent, k_rope, *selection) -> torch.Tensor:
        """The output rows [1, C, D] of one chunk of queries x_c [1, C, D] over its span's normed kv latent
        [1, M, Rkv] and rope key [1, M, 1, Dr] (and the chunk's select_span): mixer_chunks.attention_in_chunks."""
        cos_sin = self.rotary.cos_sin(span.batch.positions) if self.rotary is not None else None
        q_latent, q_nope, q_rope = self.project_query(x_c, cos_sin)
        q, k, v = self.expand_latent(q_nope, q_rope, latent, k_rope)
        o = self.attend_span(x_c, q_latent, q, k, v, cos_sin, span, *selection)
        return self.o_proj(o.reshape(1, x_c.shape[1], self.num_heads * self.v_dim))

    def attend_span(self, x, q_latent, q, k, v, cos_sin: CosSin | None, span: KeySpan, *selection):
        """attend() of one chunk of queries over its span."""
        return span.causal_attention(q, k, v, scale=self.scale)

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [1, T, D] continuing the sequence of step.state(self) -> [1, T, D], the rows forward() gives over the
        whole sequence as one document. The prefill (empty state) runs forward()'s attention; later calls attend in
        the latent space (kv_b_proj absorbed into the query and the output, as DeepSeek decodes), so the cache holds
        per token only the normed kv latent "latent" [M, Rkv] and the rotated rope key "rope_k" [M, Dr]."""
        t = x.shape[1]
        batch = one_document_batch(step.positions)
        cos_sin = self.rotary.cos_sin(step.positions) if self.rotary is not None else None
        q_latent, q_nope, q_rope = self.project_query(x, cos_sin)
        latent, k_rope = self.project_latent(x, cos_sin)
        state = step.state(self)
        is_prefill = not state
        if is_prefill:
            assert step.start == 0, "a prefill starts its document at position 0"
            state.update(latent=GrowingCache(), rope_k=GrowingCache())
        latents_MR = state["latent"].append(latent[0])
        rope_keys_MR = state["rope_k"].append(k_rope[0, :, 0])
        if is_prefill:
            q, k, v = self.expand_latent(q_nope, q_rope, latent, k_rope)
            o = self.attend_prefill(x, q_latent, q, k, v, cos_sin, batch, state)
        else:
            allowed_TM = self.cached_keys(x, q_latent, cos_sin, batch, len(latents_MR), state)
            o = self.latent_attention(q_nope[0], q_rope[0], latents_MR, rope_keys_MR, allowed_TM, state)[None]
        return self.o_proj(o.reshape(1, t, self.num_heads * self.v_dim))

    def attend_prefill(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch, state: dict):
        return self.attend(x, q_latent, q, k, v, cos_sin, batch)

    def cached_keys(self, x, q_latent, cos_sin: CosSin | None, batch: PackedBatch, num_keys: int, state: dict):
        """[T, M] bool: the cached keys each new query attends."""
        return causal_keys(batch.positions, torch.arange(num_keys, device=x.device))

    def absorbed_weights(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split into its key part [Rkv, H, Dn] and value part [Rkv, H, V], kept in the state. A
        plain nn.Linear's weight is read in place; any wrapper of it (LoRA) is run once on the identity (kv_b_proj has
        no bias), which gives its merged weight in the model's dtype."""
        if "kv_b_weight" not in state:
            if type(self.kv_b_proj) is nn.Linear:
                weight_RX = self.kv_b_proj.weight.T
            else:
                latent = state["latent"].rows
                weight_RX = self.kv_b_proj(torch.eye(self.kv_lora_rank, dtype=latent.dtype, device=latent.device))
            state["kv_b_weight"] = weight_RX.unflatten(1, (self.num_heads, -1)).split([self.nope_dim, self.v_dim], -1)
        return state["kv_b_weight"]

    def latent_attention(self, q_nope, q_rope, latents_MR, rope_keys_MR, allowed_TM, state: dict) -> torch.Tensor:
        """Attention of T new queries (q_nope [T, H, Dn], rotated q_rope [T, H, Dr]) over the cached latents
        [M, Rkv] and rope keys [M, Dr], fp32: the score of key m is (q_nope W_k) . latent_m + q_rope . rope_k_m and
        the output (sum_m p_m latent_m) W_v. Returns [T, H, V] in q's dtype."""
        w_k_RHN, w_v_RHV = (w.float() for w in self.absorbed_weights(state))
        latents_MR, rope_keys_MR = latents_MR.float(), rope_keys_MR.float()
        outputs = []
        for first in range(0, q_nope.shape[0], QUERY_CHUNK):
            chunk = slice(first, first + QUERY_CHUNK)
            q_latent_THR = torch.einsum("thn,rhn->thr", q_nope[chunk].float(), w_k_RHN)
            scores_HTM = torch.einsum("thr,mr->htm", q_latent_THR, latents_MR)
            scores_HTM = scores_HTM + torch.einsum("thd,md->htm", q_rope[chunk].float(), rope_keys_MR)
            probs_HTM = masked_softmax(scores_HTM * self.scale, allowed_TM[chunk])
            o_THR = torch.einsum("htm,mr->thr", probs_HTM, latents_MR)
            outputs.append(torch.einsum("thr,rhv->thv", o_THR, w_v_RHV))
        return torch.cat(outputs).to(q_nope.dtype)


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

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin: CosSin | None):
        """x [1, T, D], q_latent [1, T, Rq] -> queries [1, T, HI, DI], keys [1, T, DI], head weights [1, T, HI]."""
        q, w = self.project_queries(x, q_latent, cos_sin)
        return q, self.project_keys(x, cos_sin), w

    def project_queries(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin: CosSin | None):
        """project()'s queries [1, T, HI, DI] and head weights [1, T, HI] alone."""
        q = self.wq_b(q_latent).view(1, x.shape[1], self.num_heads, self.head_dim)
        if cos_sin is not None:
            q = self.rotary.rotate(q, *cos_sin)
        return q, self.weights_proj(x) * self.num_heads**-0.5

    def project_keys(self, x: torch.Tensor, cos_sin: CosSin | None) -> torch.Tensor:
        """project()'s keys [1, T, DI] alone."""
        t = x.shape[1]
        k = self.k_norm(self.wk(x)).view(1, t, 1, self.head_dim)
        if cos_sin is not None:
            k = self.rotary.rotate(k, *cos_sin)
        return k.view(1, t, self.head_dim)

    def choose(self, q, k, w, batch: PackedBatch) -> torch.Tensor:
        return topk_indexer(
            q, k, w, topk=self.num_selected, block_size=self.block_size, cu_seqlens=batch.cu_seqlens,
        )

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin: CosSin | None, batch: PackedBatch):
        """x [1, T, D], q_latent [1, T, Rq] -> selected key positions [1, T, S] int32 (-1: unused slot)."""
        return self.pin_selection(self.choose(*self.project(x, q_latent, cos_sin), batch))

    @torch.no_grad()
    def select_cached(self, x, q_latent, cos_sin: CosSin | None, batch: PackedBatch, state: dict) -> torch.Tensor:
        """forward() for the tokens of one cached call: [T, S] key positions (block ids in block mode). State: "k"
        [M, DI], the normed and rotated keys (block mode pools them per call as the full forward does)."""
        is_prefill = not state
        q, k, w = self.project(x, q_latent, cos_sin)
        keys_MD = state.setdefault("k", GrowingCache()).append(k[0])
        if is_prefill:
            return self.choose(q, k, w, batch)[0]
        return select_cached_blocks(
            q[0], w[0], mean_pooled_blocks(keys_MD, self.block_size), batch.positions, self.num_selected,
            self.block_size, always_keep_own_block=True,
        )  # fmt: skip


class SparseMultiHeadLatentAttention(MultiHeadLatentAttention):
    """MLA over the keys the lightning indexer selects (layer kind `mla_sparse`, DeepSeek-V3.2's DSA)."""

    def __init__(self, cfg: ModelProfile):
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)

    def attend(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch) -> torch.Tensor:
        return self.attend_selected(q, k, v, self.indexer(x, q_latent, cos_sin, batch), batch)

    def selectors(self) -> tuple:
        return (self.indexer,)

    @torch.no_grad()
    def row_index_keys(self, x: torch.Tensor, cos_sin: CosSin | None) -> tuple[torch.Tensor, ...]:
        return (self.indexer.project_keys(x, cos_sin),)

    @torch.no_grad()
    def select_span(self, x, span: KeySpan, k_idx) -> torch.Tensor:
        indexer = self.indexer
        cos_sin = self.rotary.cos_sin(span.batch.positions) if self.rotary is not None else None
        q_idx, w_idx = indexer.project_queries(x, self.project_query(x, cos_sin)[0], cos_sin)
        return span.topk_indexer(q_idx, k_idx, w_idx, topk=indexer.num_selected, block_size=indexer.block_size)

    def attend_span(self, x, q_latent, q, k, v, cos_sin: CosSin | None, span: KeySpan, indices):
        return span.sparse_attention(q, k, v, indices, self.indexer.block_size, scale=self.scale)

    def attend_selected(self, q, k, v, indices: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return sparse_attention(
            q, k, v, indices, block_size=self.indexer.block_size, scale=self.scale, cu_seqlens=batch.cu_seqlens
        )

    def attend_prefill(self, x, q_latent, q, k, v, cos_sin: CosSin | None, batch: PackedBatch, state: dict):
        """The state adds "indexer", the indexer's own (LightningIndexer.select_cached)."""
        indices = self.indexer.select_cached(x, q_latent, cos_sin, batch, state.setdefault("indexer", {}))
        return self.attend_selected(q, k, v, indices[None], batch)

    def cached_keys(self, x, q_latent, cos_sin: CosSin | None, batch: PackedBatch, num_keys: int, state: dict):
        chosen_TS = self.indexer.select_cached(x, q_latent, cos_sin, batch, state["indexer"])
        return selected_keys(chosen_TS, batch.positions, num_keys, self.indexer.block_size)
