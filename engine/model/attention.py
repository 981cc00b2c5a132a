"""Token mixers: gated delta net (linear attention), top-k sparse attention and full gated attention.

Shapes: T packed tokens of one row [1, T], D model dim, H query heads, G key/value heads, hd head dim; linear
attention: Hk key heads of dim K, Hv value heads of dim V; indexer: HI heads of dim DI.
Every layer takes a PackedBatch, whose cu_seqlens keep documents from seeing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.ops.causal_conv.reference import split_heads
from moe_tune.ops.linear_attention import gated_delta_rule, kda
from moe_tune.ops.linear_attention.gates import gdn_gates
from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
from moe_tune.profiles.schema import LayerSpec, ModelProfile, YarnSpec

from .attention_context import (
    KeySpan, gated_attention_across_ranks, is_context_parallel, qsa_attention_across_ranks,
    sparse_attention_across_ranks,
)
from .batch import PackedBatch
from .blocks import GatedRMSNorm, RMSNorm, RotaryEmbedding, ShortConv, delta_rule_cached
from .kda import KimiDeltaAttention
from .linear_context import delta_rule
from .kv_cache import (
    GrowingCache, cached_attention, causal_keys, mean_pooled_blocks, one_document_batch, select_cached_blocks,
    selected_keys,
)
from .mixer_chunks import (
    Slab, attention_in_chunks, initial_states, linear_attention_forward, row_in_pieces, runs_in_chunks,
    runs_whole_recomputed, selection_is_watched, whole_recomputed,
)
from .mla import MultiHeadLatentAttention, SparseMultiHeadLatentAttention, yarn_inv_freq
from .projections import SharedInputProjections, project
from .selection import PinnableSelection
from .varlen import packed_causal_attention

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep


class GatedAttention(nn.Module):
    """Softmax attention with GQA, q/k RMSNorm, partial RoPE and a sigmoid output gate (qwen3_next layout: q_proj
    yields each head's query followed by its gate); without `attention_output_gate`, plain attention (qwen3_moe).
    `attention_qk_norm: false` drops the q/k norm (mixtral); `attention_bias` gives q, k and v a bias (GLM-4.5)."""

    # memory.sequence_chunk_tokens (MoECausalLM.set_sequence_chunk_tokens): a longer row runs its queries chunk by
    # chunk over the keys each chunk sees (engine/model/mixer_chunks.py). None: whole rows.
    sequence_chunk_tokens: int | None = None
    # The projections of the layer's input, run as one node where engine/model/projections allows it.
    shared_input_projections = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelProfile, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.gated = cfg.attention_output_gate
        has_bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim * (2 if self.gated else 1), bias=has_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=has_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=has_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=cfg.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_one_plus) if cfg.attention_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_one_plus) if cfg.attention_qk_norm else None
        mrope = cfg.vision.mrope_section if cfg.vision is not None else None
        if cfg.rope_yarn is None:
            self.rotary = RotaryEmbedding(self.head_dim, cfg.partial_rotary_factor, cfg.rope_theta, mrope)
        else:
            self.rotary = YarnRotary(self.head_dim, cfg.partial_rotary_factor, cfg.rope_theta, cfg.rope_yarn, mrope)
        # gpt_oss: sliding-window layers and one learned sink logit per head (engine/model/varlen.py).
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None

    def project(self, x: torch.Tensor, batch: PackedBatch):
        """x [1, T, D] -> q [1, T, H, hd], k and v [1, T, G, hd], gate [1, T, H, hd] (None when ungated)."""
        t = x.shape[1]
        q, k, v = project(x, [getattr(self, name) for name in self.shared_input_projections])
        if self.gated:
            q, gate = q.view(1, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q, gate = q.view(1, t, self.num_heads, self.head_dim), None
        k = k.view(1, t, self.num_kv_heads, self.head_dim)
        v = v.view(1, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(batch.rotary_positions)
        return self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin), v, gate

    def attend(self, x, q, k, v, gate, batch: PackedBatch) -> torch.Tensor:
        """The heads' attention output [1, T, H, hd], times sigmoid(gate) when gated."""
        if is_context_parallel(batch):
            o = gated_attention_across_ranks(self, q, k, v, batch)
        else:
            o = packed_causal_attention(q, k, v, batch.document_buckets, sinks=self.sinks, window=self.sliding_window)
        return o if gate is None else o * torch.sigmoid(gate)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if runs_in_chunks(self, x, batch) and not selection_is_watched(*self.selectors()):
            return attention_in_chunks(
                x, batch, self.sequence_chunk_tokens, lambda x_row: self.project_keys(x_row, batch), self._chunk,
                self.row_index_keys(x, batch), window=self.sliding_window, select=self.select_span,
            )  # fmt: skip
        if runs_whole_recomputed(self, *self.selectors()):
            return whole_recomputed(self.forward_whole, x, batch)
        return self.forward_whole(x, batch)

    def forward_whole(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """forward() on the row (or a context-parallel rank's share) in one piece."""
        q, k, v, gate = self.project(x, batch)
        return self.o_proj(self.attend(x, q, k, v, gate, batch).reshape(1, x.shape[1], -1))

    def project_queries(self, x: torch.Tensor, batch: PackedBatch):
        """project()'s q [1, T, H, hd] and gate [1, T, H, hd] (None when ungated) alone."""
        t = x.shape[1]
        if self.gated:
            q, gate = self.q_proj(x).view(1, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q, gate = self.q_proj(x).view(1, t, self.num_heads, self.head_dim), None
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self.rotary.rotate(q, *self.rotary.cos_sin(batch.rotary_positions)), gate

    def project_keys(self, x: torch.Tensor, batch: PackedBatch):
        """project()'s k and v [1, T, G, hd] alone."""
        t = x.shape[1]
        k = self.k_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self.rotary.rotate(k, *self.rotary.cos_sin(batch.rotary_positions)), v

    def selectors(self) -> tuple:
        """The modules choosing this layer's keys (PinnableSelection): none for full attention."""
        return ()

    def row_index_keys(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, ...]:
        """The indexer's keys of the row [1, T, ...] without gradient, for sequence chunks: none for full attention."""
        return ()

    # select_span(x_c, span, *index keys over the span) -> the chunk's indices without gradient, for a layer whose
    # indexer selects its keys (mixer_chunks.attention_in_chunks' `select`): None for full attention.
    select_span: Callable | None = None

    def _chunk(self, x_c, span: KeySpan, k, v, *selection) -> torch.Tensor:
        """The output rows [1, C, D] of one chunk of queries x_c [1, C, D] over its span's keys and values k, v
        [1, M, G, hd] (and the chunk's select_span): mixer_chunks.attention_in_chunks."""
        q, gate = self.project_queries(x_c, span.batch)
        return self.o_proj(self.attend_span(x_c, q, k, v, gate, span, *selection).reshape(1, x_c.shape[1], -1))

    def attend_span(self, x, q, k, v, gate, span: KeySpan, *selection) -> torch.Tensor:
        """attend() of one chunk of queries over its span."""
        o = span.causal_attention(q, k, v, sinks=self.sinks, window=self.sliding_window)
        return o if gate is None else o * torch.sigmoid(gate)

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [1, T, D] continuing the sequence of step.state(self) -> [1, T, D], the rows forward() gives over the
        whole sequence as one document. The prefill (empty state) runs forward()'s attention; later calls project
        only their own tokens and attend over the cache (engine/model/kv_cache.py). State: "k", "v" [M, G, hd]
        (a sliding window keeps its last window - 1 keys between calls) and the position of the first kept key."""
        batch = one_document_batch(step.positions, step.mrope_positions)
        q, k, v, gate = self.project(x, batch)
        o = self.attend_cached(x, q, k, v, gate, batch, step.state(self))
        return self.o_proj(o.reshape(1, x.shape[1], -1))

    def cache_keys_values(self, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, state: dict):
        """Appends this call's k and v [1, T, G, hd] to the state's caches; returns (is_prefill, k and v [M, G, hd],
        the positions [M] of the cached keys)."""
        is_prefill = not state
        if is_prefill:
            assert int(batch.positions[0]) == 0, "a prefill starts its document at position 0"
            state.update(k=GrowingCache(), v=GrowingCache(), first_position=0)
        k_cache, v_cache = state["k"].append(k[0]), state["v"].append(v[0])
        key_positions = state["first_position"] + torch.arange(len(k_cache), device=k.device)
        return is_prefill, k_cache, v_cache, key_positions

    def attend_cached(self, x, q, k, v, gate, batch: PackedBatch, state: dict) -> torch.Tensor:
        """attend() for the tokens of one cached call: q, k, v, gate of those tokens -> [1, T, H, hd]."""
        is_prefill, k_cache, v_cache, key_positions = self.cache_keys_values(k, v, batch, state)
        if is_prefill:
            o = self.attend(x, q, k, v, gate, batch)
        else:
            allowed_TM = causal_keys(batch.positions, key_positions, self.sliding_window)
            gate_THV = None if gate is None else gate[0]
            o = cached_attention(q[0], k_cache, v_cache, allowed_TM, sinks=self.sinks, gate=gate_THV)[None]
        if self.sliding_window is not None:
            # Later queries sit past this call's last token: they see at most its last window - 1 keys.
            num_kept = min(self.sliding_window - 1, len(k_cache))
            state["k"].keep_last(num_kept)
            state["v"].keep_last(num_kept)
            state["first_position"] = int(key_positions[-1]) + 1 - num_kept
        return o


class SparseAttention(PinnableSelection, GatedAttention):
    """Gated attention where each query sees only the keys picked by a DSA-style indexer (multi-head ReLU scores
    weighted per head; single tokens or mean-pooled key blocks within a token budget)."""

    def __init__(self, cfg: ModelProfile):
        super().__init__(cfg)
        spec = cfg.sparse_attention
        assert spec is not None, "the schema requires model.sparse_attention for sparse layers"
        self.index_heads, self.index_dim = spec.index_heads, spec.index_head_dim
        self.block_size = spec.block_size
        self.num_selected = spec.topk // spec.block_size
        d = cfg.hidden_size
        self.index_q_proj = nn.Linear(d, self.index_heads * self.index_dim, bias=False)
        self.index_k_proj = nn.Linear(d, self.index_dim, bias=False)
        self.index_weights_proj = nn.Linear(d, self.index_heads, bias=False)

    def index_inputs(self, x: torch.Tensor):
        """The indexer's queries [1, T, HI, DI], keys [1, T, DI] and head weights [1, T, HI] of x [1, T, D]."""
        t = x.shape[1]
        q_idx = self.index_q_proj(x).view(1, t, self.index_heads, self.index_dim)
        return q_idx, self.index_k_proj(x), self.index_weights_proj(x) * self.index_heads**-0.5

    def attend(self, x, q, k, v, gate, batch: PackedBatch, index_inputs=None) -> torch.Tensor:
        """index_inputs: index_inputs(x) when the caller has them already."""
        if is_context_parallel(batch):
            return sparse_attention_across_ranks(self, x, q, k, v, gate, batch, index_inputs)
        # The indexer only chooses keys; as in DeepSeek's DSA it gets no gradient from the language-model loss.
        with torch.no_grad():
            q_idx, k_idx, w_idx = self.index_inputs(x) if index_inputs is None else index_inputs
            indices = topk_indexer(
                q_idx, k_idx, w_idx, topk=self.num_selected, block_size=self.block_size, cu_seqlens=batch.cu_seqlens
            )
            indices = self.pin_selection(indices)
        indices = indices.unsqueeze(2).expand(-1, -1, self.num_kv_heads, -1)
        # The output gate runs inside the sparse attention kernels (their forward's epilogue, dgate beside dq).
        return sparse_attention(q, k, v, indices, block_size=self.block_size, cu_seqlens=batch.cu_seqlens, gate=gate)

    def selectors(self) -> tuple:
        return (self,)

    @torch.no_grad()
    def row_index_keys(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, ...]:
        return (self.index_k_proj(x),)

    @torch.no_grad()
    def select_span(self, x, span: KeySpan, k_idx) -> torch.Tensor:
        q_idx, _, w_idx = self.index_inputs(x)
        return span.topk_indexer(q_idx, k_idx, w_idx, topk=self.num_selected, block_size=self.block_size)

    def attend_span(self, x, q, k, v, gate, span: KeySpan, indices) -> torch.Tensor:
        indices = indices.unsqueeze(2).expand(-1, -1, self.num_kv_heads, -1)
        return span.sparse_attention(q, k, v, indices, self.block_size, gate=gate)

    def attend_cached(self, x, q, k, v, gate, batch: PackedBatch, state: dict) -> torch.Tensor:
        """The cached call's attention; the state adds "index_k" [M, DI], the indexer's keys (block mode pools them
        per call as the full forward does)."""
        is_prefill, k_cache, v_cache, _ = self.cache_keys_values(k, v, batch, state)
        with torch.no_grad():
            q_idx, k_idx, w_idx = self.index_inputs(x)
        index_keys = state.setdefault("index_k", GrowingCache()).append(k_idx[0])
        if is_prefill:
            return self.attend(x, q, k, v, gate, batch, (q_idx, k_idx, w_idx))
        chosen_TS = select_cached_blocks(
            q_idx[0], w_idx[0], mean_pooled_blocks(index_keys, self.block_size), batch.positions, self.num_selected,
            self.block_size, always_keep_own_block=True,
        )  # fmt: skip
        allowed_TM = selected_keys(chosen_TS, batch.positions, len(k_cache), self.block_size)
        return cached_attention(q[0], k_cache, v_cache, allowed_TM, gate=None if gate is None else gate[0])[None]


class QSAIndexer(PinnableSelection, nn.Module):
    """qwen4_exp's QSA indexer: per query, the key blocks of `block_size` tokens to attend.

    Block key: the mean of the block's raw indexer keys, RMS-normed, then rotated at the block's first position.
    Score of query t on a block: sum_h relu(q_idx[t, h] . key) / sqrt(DI), q_idx normed and rotated at t. The
    topk / block_size best complete blocks the query sees (its own once complete) are kept, plus the incomplete
    block it sits in (the tail), so S = topk / block_size + 1 slots. The rotary dims are the attention's.
    """

    def __init__(self, cfg: ModelProfile):
        super().__init__()
        spec = cfg.sparse_attention
        assert spec is not None, "the schema requires model.sparse_attention for qsa layers"
        self.num_heads, self.head_dim, self.block_size = spec.index_heads, spec.index_head_dim, spec.block_size
        self.num_selected = spec.topk // spec.block_size + 1
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.k_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_one_plus)

    def project_queries(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: PackedBatch):
        """x [1, T, D] -> normed and rotated queries [1, T, HI, DI], raw keys [1, T, DI], and the rows' (cos, sin)."""
        t = x.shape[1]
        q_idx, k_idx = self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], -1)
        cos, sin = rotary.cos_sin(batch.rotary_positions)
        q_idx = rotary.rotate(self.q_layernorm(q_idx.view(1, t, self.num_heads, self.head_dim)), cos, sin)
        return q_idx, k_idx, (cos, sin)

    def project(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: PackedBatch):
        """x [1, T, D] -> normed and rotated queries [1, T, HI, DI], raw keys [1, T, DI] and the key of the block
        starting at each row [1, T, DI]."""
        q_idx, k_idx, (cos, sin) = self.project_queries(x, rotary, batch)
        return q_idx, k_idx, self.block_keys(k_idx, rotary, cos, sin)

    def block_keys(self, k_idx: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor):
        """Raw keys [1, T, DI] -> the key of the block starting at each row [1, T, DI], rotated by (cos, sin) of the
        rows."""
        # Rows where no complete block of the document starts are never read (the op reads block j at row
        # o + j * block_size), so windows crossing documents do no harm.
        windows_TD = F.pad(k_idx[0], (0, 0, 0, self.block_size - 1)).unfold(0, self.block_size, 1).mean(-1)
        return rotary.rotate(self.k_layernorm(windows_TD)[None, :, None, :], cos, sin)[:, :, 0]

    def raw_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The raw indexer keys [1, T, DI] of x [1, T, D]."""
        return self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], -1)[1]

    def choose(self, q_idx: torch.Tensor, block_k: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return topk_indexer(
            q_idx, block_k, None, topk=self.num_selected, block_size=self.block_size, cu_seqlens=batch.cu_seqlens,
            k_idx_is_pooled=True, always_keep_own_block=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: PackedBatch) -> torch.Tensor:
        """x [1, T, D] -> block ids [1, T, S] local to each document (ops.sparse_attention's convention)."""
        q_idx, _, block_k = self.project(x, rotary, batch)
        return self.pin_selection(self.choose(q_idx, block_k, batch))

    def select_cached(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: PackedBatch, state: dict) -> torch.Tensor:
        """forward() for the tokens of one cached call: block ids [T, S]. State: "block_k" [J, DI], the normed and
        rotated key of each complete block, and "tail_k" [< block_size, DI], "tail_positions" [< block_size] (or
        [< block_size, 3] under multimodal RoPE), the raw keys and rotary positions of the incomplete one: a block is
        rotated at its first row's rotary position, as forward() rotates it."""
        # Rows first: [T] token positions, or [T, 3] (t, h, w) ones.
        rotary_rows = batch.rotary_positions if batch.rotary_positions.dim() == 1 else batch.rotary_positions.T
        if not state:
            q_idx, k_idx, block_k = self.project(x, rotary, batch)
            num_complete = x.shape[1] // self.block_size
            state.update(block_k=GrowingCache(), tail_k=GrowingCache(), tail_positions=GrowingCache())
            state["block_k"].append(block_k[0, : num_complete * self.block_size : self.block_size])
            state["tail_k"].append(k_idx[0, num_complete * self.block_size :])
            state["tail_positions"].append(rotary_rows[num_complete * self.block_size :])
            return self.choose(q_idx, block_k, batch)[0]
        q_idx, k_idx, _ = self.project_queries(x, rotary, batch)
        raw_k = state["tail_k"].append(k_idx[0])
        tail_positions = state["tail_positions"].append(rotary_rows)
        num_new = len(raw_k) // self.block_size
        if num_new:
            # Pooled as forward() pools its windows: [J, DI, block_size] means.
            pooled_JD = raw_k[: num_new * self.block_size].unfold(0, self.block_size, self.block_size).mean(-1)
            starts = tail_positions[: num_new * self.block_size : self.block_size]
            block_cos, block_sin = rotary.cos_sin(starts if starts.dim() == 1 else starts.T)
            block_k = rotary.rotate(self.k_layernorm(pooled_JD)[None, :, None, :], block_cos, block_sin)[0, :, 0]
            state["block_k"].append(block_k)
            state["tail_k"].keep_last(len(raw_k) - num_new * self.block_size)
            state["tail_positions"].keep_last(len(raw_k) - num_new * self.block_size)
        return select_cached_blocks(
            q_idx[0], None, state["block_k"].rows, batch.positions, self.num_selected, self.block_size,
            always_keep_own_block=False,
        )  # fmt: skip


class QSAAttention(GatedAttention):
    """Gated attention where each query sees only the key blocks QSA's indexer picks (qwen4_exp)."""

    def __init__(self, cfg: ModelProfile):
        super().__init__(cfg)
        self.indexer = QSAIndexer(cfg)

    def attend(self, x, q, k, v, gate, batch: PackedBatch) -> torch.Tensor:
        if is_context_parallel(batch):
            return qsa_attention_across_ranks(self, x, q, k, v, gate, batch)
        # The choice is a mask in the reference too: the indexer gets no gradient from the language-model loss.
        with torch.no_grad():
            indices = self.indexer(x, self.rotary, batch)
        indices = indices.unsqueeze(2).expand(-1, -1, self.num_kv_heads, -1)
        return sparse_attention(
            q, k, v, indices, block_size=self.indexer.block_size, cu_seqlens=batch.cu_seqlens, gate=gate
        )

    def selectors(self) -> tuple:
        return (self.indexer,)

    @torch.no_grad()
    def row_index_keys(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, ...]:
        # The raw keys a chunk at a time: the projection makes the HI query heads too.
        k_idx = row_in_pieces(self.indexer.raw_keys, x, self.sequence_chunk_tokens)
        return (self.indexer.block_keys(k_idx, self.rotary, *self.rotary.cos_sin(batch.rotary_positions)),)

    @torch.no_grad()
    def select_span(self, x, span: KeySpan, block_k) -> torch.Tensor:
        indexer = self.indexer
        q_idx, _, _ = indexer.project_queries(x, self.rotary, span.batch)
        return span.topk_indexer(
            q_idx, block_k, None, topk=indexer.num_selected, block_size=indexer.block_size, k_idx_is_pooled=True,
            always_keep_own_block=False,
        )  # fmt: skip

    def attend_span(self, x, q, k, v, gate, span: KeySpan, indices) -> torch.Tensor:
        indices = indices.unsqueeze(2).expand(-1, -1, self.num_kv_heads, -1)
        return span.sparse_attention(q, k, v, indices, self.indexer.block_size, gate=gate)

    def attend_cached(self, x, q, k, v, gate, batch: PackedBatch, state: dict) -> torch.Tensor:
        """The cached call's attention; the state adds "indexer", the indexer's own (QSAIndexer.select_cached)."""
        is_prefill, k_cache, v_cache, _ = self.cache_keys_values(k, v, batch, state)
        chosen_TS = self.indexer.select_cached(x, self.rotary, batch, state.setdefault("indexer", {}))
        block_size = self.indexer.block_size
        if is_prefill:
            indices = chosen_TS[None, :, None, :].expand(-1, -1, self.num_kv_heads, -1)
            return sparse_attention(q, k, v, indices, block_size=block_size, cu_seqlens=batch.cu_seqlens, gate=gate)
        allowed_TM = selected_keys(chosen_TS, batch.positions, len(k_cache), block_size)
        return cached_attention(q[0], k_cache, v_cache, allowed_TM, gate=None if gate is None else gate[0])[None]


class GatedDeltaNet(nn.Module):
    """Linear attention with a recurrent state (qwen3_next's gated delta net; per-channel decay gives KDA).

    g = -exp(A_log) * softplus(a + dt_bias) is the log decay, beta = sigmoid(b) the delta-rule step; q and k are
    L2-normalised inside the op; the output is RMSNorm(o) * silu(z) per head.
    """

    # Whether the op keeps its kernels' per-chunk states and WY factors for backward instead of recomputing them
    # (ops.linear_attention's save_intermediates): faster when saved tensors stay on the GPU; the memory manager
    # turns it off where this class's saved tensors go to host memory (engine/memory).
    saves_op_intermediates = True
    # memory.sequence_chunk_tokens (MoECausalLM.set_sequence_chunk_tokens): a longer row runs slab by slab
    # (engine/model/mixer_chunks.py). None: whole rows.
    sequence_chunk_tokens: int | None = None
    # The projections of the layer's input, in the order the layer takes them (one node sums x's gradient in it
    # where engine/model/projections allows; otherwise the modules run in it).
    shared_input_projections = ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "z_proj")

    def __init__(self, cfg: ModelProfile):
        super().__init__()
        spec = cfg.linear_attention
        assert spec is not None, "the schema requires model.linear_attention for linear layers"
        self.hk, self.hv = spec.num_key_heads, spec.num_value_heads
        self.dk, self.dv = spec.key_head_dim, spec.value_head_dim
        self.per_channel = spec.decay == "per_channel"
        d = cfg.hidden_size
        decay_width = self.hv * self.dk if self.per_channel else self.hv
        self.q_proj = nn.Linear(d, self.hk * self.dk, bias=False)
        self.k_proj = nn.Linear(d, self.hk * self.dk, bias=False)
        self.v_proj = nn.Linear(d, self.hv * self.dv, bias=False)
        self.z_proj = nn.Linear(d, self.hv * self.dv, bias=False)
        self.b_proj = nn.Linear(d, self.hv, bias=False)
        self.a_proj = nn.Linear(d, decay_width, bias=False)
        self.conv = ShortConv(2 * self.hk * self.dk + self.hv * self.dv, spec.conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(decay_width))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, gate_activation=spec.output_gate_activation)
        self.o_proj = nn.Linear(self.hv * self.dv, d, bias=False)

    def reset_decay_parameters(self) -> None:
        # Decay rates spread over [1, 16) per head, as qwen3_next initialises them; dt_bias starts at 1.
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            self.dt_bias.fill_(1.0)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return linear_attention_forward(self, x, batch)

    def forward_whole(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """forward() on the row (or a context-parallel rank's share) in one piece."""
        out = self._projections(x)
        # Under context parallelism the conv and the state continue from the previous rank's tokens (linear_context).
        q, k, v = self.conv(out.of(self.q_proj, self.k_proj, self.v_proj), batch.positions, batch.context,
                            (self.dk, self.dv))  # fmt: skip
        g, beta = self._gates(*out.of(self.b_proj, self.a_proj))
        op = kda if self.per_channel else gated_delta_rule
        o = delta_rule(
            op, q, k, v, g, beta, batch, use_qk_l2norm_in_kernel=True, save_intermediates=self.saves_op_intermediates
        )
        return self._output(o, *out.of(self.z_proj))

    def _slab(self, x_ext, positions_ext, num_halo: int, entering, slab: Slab):
        """One slab of a row in sequence chunks (mixer_chunks.linear_attention_in_slabs): -> (out [1, C, D], the
        state after its last token [Hv, K, V] fp32)."""
        qkv = torch.cat(project(x_ext, (self.q_proj, self.k_proj, self.v_proj)), -1)
        q, k, v = self._heads(self.conv(qkv, positions_ext)[:, num_halo:])
        out = SharedInputProjections(x_ext[:, num_halo:], (self.b_proj, self.a_proj, self.z_proj))
        g, beta = self._gates(*out.of(self.b_proj, self.a_proj))
        op = kda if self.per_channel else gated_delta_rule
        o, final_states = op(
            q, k, v, g, beta, initial_state=initial_states(entering, slab), output_final_state=True,
            cu_seqlens=slab.batch.cu_seqlens, use_qk_l2norm_in_kernel=True,
            save_intermediates=self.saves_op_intermediates,
        )  # fmt: skip
        return self._output(o, *out.of(self.z_proj)), final_states[-1]

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [1, T, D] continuing one sequence -> [1, T, D]; state: the conv's last inputs and the recurrent state."""
        out = self._projections(x)
        qkv = torch.cat(out.of(self.q_proj, self.k_proj, self.v_proj), -1)
        q, k, v = self._heads(self.conv.forward_cached(qkv, step))
        g, beta = self._gates(*out.of(self.b_proj, self.a_proj))
        return self._output(delta_rule_cached(step.state(self), q, k, v, g, beta), *out.of(self.z_proj))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [1, T, 2 Hk K + Hv V] -> q, k [1, T, Hv, K] (key heads repeated per group) and
        v [1, T, Hv, V]."""
        return split_heads(qkv, self.hk * self.dk, self.dk, self.dv)

    def _projections(self, x: torch.Tensor) -> SharedInputProjections:
        """x [1, T, D]'s six projections: q, k [1, T, Hk K], v, z [1, T, Hv V], b [1, T, Hv], a [1, T, Hv] (per
        channel: [1, T, Hv K])."""
        return SharedInputProjections(x, [getattr(self, name) for name in self.shared_input_projections])

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b_proj's and a_proj's outputs -> the log decay g [1, T, Hv] (per channel: [1, T, Hv, K]) and beta
        [1, T, Hv], fp32."""
        if self.per_channel:
            beta = torch.sigmoid(b.float())
            a = a.float() + self.dt_bias.float()
            return -self.A_log.float().exp()[:, None] * F.softplus(a.view(*a.shape[:2], self.hv, self.dk)), beta
        # Both gates in one kernel each way (eight to ten eager ops otherwise).
        return gdn_gates(a, b, self.A_log, self.dt_bias)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The op's output o [1, T, Hv, V] and z_proj's [1, T, Hv V] -> [1, T, D]."""
        t = z.shape[1]
        return self.o_proj(self.norm(o, z.view(1, t, self.hv, self.dv)).reshape(1, t, self.hv * self.dv))


class YarnRotary(RotaryEmbedding):
    """RoPE with YaRN's frequencies (engine/model/mla.py's yarn_inv_freq), cos and sin scaled by its attention
    factor, as transformers applies `rope_type: yarn` to softmax attention (gpt_oss)."""

    def __init__(self, head_dim: int, partial_rotary_factor: float, theta: float, yarn: YarnSpec,
                 mrope_section: tuple[int, ...] | None = None):
        super().__init__(head_dim, partial_rotary_factor, theta, mrope_section)
        self.inv_freq.copy_(yarn_inv_freq(self.rotary_dim, theta, yarn))
        self.attention_factor = yarn.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().cos_sin(positions)
        return cos * self.attention_factor, sin * self.attention_factor


TOKEN_MIXERS = {
    "linear": GatedDeltaNet,
    "sparse": SparseAttention,
    "full": GatedAttention,
    "kda": KimiDeltaAttention,
    "mla": MultiHeadLatentAttention,
    "mla_sparse": SparseMultiHeadLatentAttention,
    "qsa": QSAAttention,
}


def build_token_mixer(cfg: ModelProfile, spec: LayerSpec) -> nn.Module:
    """The token mixer of a layer as its LayerSpec says (a full layer with its sliding window, if any)."""
    if spec.sliding_window is not None:
        return GatedAttention(cfg, sliding_window=spec.sliding_window)
    return TOKEN_MIXERS[spec.attention](cfg)


def init_token_mixer(module: nn.Module, std: float) -> None:
    """Init hook for the parts nn.Linear init does not cover.

    The linear attention's short conv starts as transformers' qwen3_next and kimi_linear start theirs (their generic
    Conv1d init: normal(init_std)), so a random model here and the one `moe-tune profile --against transformers`
    builds share it. With normal(1 / sqrt(width)) instead (0.5 at width 4), the conv amplified the projections 25x
    over transformers' at init and a random model learned more slowly than transformers' did on the same rows
    (docs/bench.md, "Losses")."""
    if isinstance(module, GatedAttention) and module.sinks is not None:
        nn.init.normal_(module.sinks, std=std)
    if isinstance(module, GatedDeltaNet):
        module.reset_decay_parameters()
        nn.init.normal_(module.conv.weight, std=std)
    elif isinstance(module, KimiDeltaAttention):
        module.reset_decay_parameters()
        nn.init.normal_(module.conv.weight, std=std)
