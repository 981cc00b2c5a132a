"""Context parallelism of the softmax attention layers: full (with sliding window and sinks), top-k sparse at token and
block level (SparseAttention, QSA) and MLA with or without DSA's lightning indexer.

Under `parallel.context_parallel: N` a layer's queries stay on their rank and see the keys of their span: the row's
tokens from the start of the document the rank's first token belongs to (or the first key its sliding window
reaches) to its own last token. Later ranks' keys are never attended (causality). In the span this rank's tokens come
after `prefix` keys of its first document, held by earlier ranks. The keys and values of the span come so:

- full attention and MLA without an indexer attend every key: the row's keys and values are gathered
  (engine/parallel/context.py's gather_sequence, one differentiable collective per layer, so the gradients of other
  ranks' keys flow back to them) and the span kept;
- the top-k layers (SparseAttention, QSA, mla_sparse): the indexer's keys of the row are gathered (no gradient, DI
  numbers a token), the rank's queries scored over the span's and their keys selected; then from the earlier ranks
  only the units its continued document's queries selected (blocks, or TOKEN_PAGE pages of tokens) are fetched
  (context.py's fetch_rows: counts, ranges, then rows, all_to_all with uneven splits; backward sends their gradients
  back). They land in a span-sized buffer at their span rows, the rank's own rows at its end and zeros elsewhere
  that the ops never read (each query reads only its selection). fetch_log records what each layer fetched.

Every attention runs on tensors where queries and keys share the span's frame:

- full attention: the first document piece (continued from earlier ranks) is one document whose queries are its
  last tokens (varlen.offset_causal_attention), the pieces begun here are the usual packed documents;
- top-k sparse attention and its indexers: the ops take the rank's queries as the last T_local of the span's M keys
  (query_start = `prefix`): no padding, the indexer scores only this rank's queries. The span's first document
  starts at the same token as the row's, so block ids (local to a document) are the row's; token positions are the
  row's minus the span's first token.

Every rank runs the same collectives in the same order whatever its documents (context.py's rule; a rank that needs
nothing from the others still joins the exchanges with empty parts), and the layer's exchanged tensor with a
gradient is used through its span, which always holds the rank's own tokens.

Shapes: T_local this rank's tokens, M = prefix + T_local the span's keys, H query heads, G key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moe_tune.engine.parallel.context import ContextShard, fetch_rows, gather_sequence
from moe_tune.ops.common.host_copy import host_values, remember, to_device
from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer

from .varlen import DocumentBuckets, offset_causal_attention, packed_causal_attention

if TYPE_CHECKING:
    from torch import nn

    from .batch import PackedBatch

# A token-level selection is fetched from earlier ranks in pages of this many span rows: 16 times fewer ranges to
# exchange and copy than rows, for at most 15 unselected rows fetched beside a selected one.
TOKEN_PAGE = 16


@dataclass(frozen=True)
class KeyFetch:
    """What one top-k layer's forward on one rank fetched from the earlier ranks of its context group."""

    rows: torch.Tensor  # [R] int64 the row tokens received, ascending
    row_bytes: int  # one row of the tensors fetched: keys and values of every kv head (MLA: latent and rope key)

    @property
    def bytes_received(self) -> int:
        """The rows' bytes (backward sends as many bytes of their gradients back to their owners)."""
        return len(self.rows) * self.row_bytes


# None, or a list that receives every top-k layer's KeyFetch at every forward under context parallelism (tests and
# traffic reports read it).
fetch_log: list[KeyFetch] | None = None


def is_context_parallel(batch: PackedBatch) -> bool:
    """Whether the batch is one rank's share of a row held by several ranks."""
    return batch.context is not None and batch.context.size > 1


def device_bounds(host_bounds: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Document bounds made on the host, as int32 on `device`, their host copy remembered (the ops and the buckets
    read them back without waiting for the device)."""
    host_bounds = host_bounds.to(torch.int32)
    bounds = to_device(host_bounds, device)
    if bounds is not host_bounds:
        remember(bounds, host_bounds)
    return bounds


@dataclass(frozen=True)
class KeySpan:
    """The keys this rank's queries may see: row tokens [first, shard.stop)."""

    batch: PackedBatch  # this rank's share of the row
    first: int  # the span's first row token: the start of this rank's first document, or its window's first key
    cu_seqlens: torch.Tensor  # [P + 1] int32: the batch's P document pieces over the span (after `prefix` keys)
    num_continued: int  # queries of the first document piece when it continues from earlier ranks (prefix > 0)

    @classmethod
    def of(cls, batch: PackedBatch, window: int | None = None) -> KeySpan:
        shard = batch.context
        bounds = host_values(shard.row_cu_seqlens)
        first = int(bounds[bounds <= shard.start].max())
        if window is not None:
            first = max(first, shard.start - (window - 1))
        prefix = shard.start - first
        local = host_values(batch.cu_seqlens)
        span_cu = device_bounds(torch.cat([local[:1], local[1:] + prefix]), batch.cu_seqlens.device)
        num_continued = int(local[1]) if prefix else 0
        return cls(batch, first, span_cu, num_continued)

    @property
    def shard(self) -> ContextShard:
        return self.batch.context

    @property
    def prefix(self) -> int:
        return self.shard.start - self.first

    @property
    def num_local(self) -> int:
        return self.shard.stop - self.shard.start

    def gather(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """xs [1, T_local, ...] -> each over the span, [1, M, ...], in one collective (the gathered tensors' gradients
        flow back to their ranks)."""
        span = gather_sequence(_joined(xs), self.shard).narrow(1, self.first, self.shard.stop - self.first)
        return _split(span, xs)

    def selected_ranges(self, indices: torch.Tensor, block_size: int) -> torch.Tensor:
        """[n, 2] int64 (start, stop) row tokens, ascending: the units held by earlier ranks (the span's first
        `prefix` keys) that the queries of the continued document piece selected in indices [1, T_local, (G,) S] (the
        span's convention), each unit a block, or at token level a TOKEN_PAGE page of the span. No other query sees
        those keys (they belong to its document only)."""
        unit = block_size if block_size > 1 else TOKEN_PAGE
        chosen = indices[0, : self.num_continued].reshape(-1).long()
        num_earlier = -(-self.prefix // block_size)  # blocks (or tokens) that begin before this rank's first token
        chosen = chosen[(chosen >= 0) & (chosen < num_earlier)]
        starts = torch.unique(chosen if block_size > 1 else chosen // unit) * unit
        return torch.stack([starts, (starts + unit).clamp(max=self.prefix)], 1) + self.first

    def fetch_selected(self, indices: torch.Tensor, block_size: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """xs [1, T_local, ...] -> each over the span, [1, M, ...]: this rank's rows at its end, and of the earlier
        ranks' rows only the units selected in indices (selected_ranges), fetched from their owners (context.py's
        fetch_rows; their gradients flow back to them). The other rows are zeros the top-k ops never read."""
        joined = _joined(xs)[0]
        received, rows = fetch_rows(joined, self.shard, self.selected_ranges(indices, block_size))
        if fetch_log is not None:
            fetch_log.append(KeyFetch(rows, joined.shape[1] * joined.element_size()))
        earlier = joined.new_zeros(self.prefix, joined.shape[1]).index_copy(0, rows - self.first, received)
        return _split(torch.cat([earlier, joined])[None], xs)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, M, ...] -> this rank's rows [1, T_local, ...]."""
        return x.narrow(1, self.prefix, self.num_local) if self.prefix else x

    def causal_attention(self, q, k, v, scale: float | None = None, sinks=None, window: int | None = None):
        """Causal attention of this rank's queries q [1, T_local, H, hd] over the span's keys and values k [1, M, G,
        hd], v [1, M, G, hdv] -> [1, T_local, H, hdv]."""
        kw = dict(scale=scale, sinks=sinks, window=window)
        num_first = self.num_continued
        if not num_first:
            return packed_causal_attention(q, self.own_rows(k), self.own_rows(v), self.batch.document_buckets, **kw)
        num_keys = self.prefix + num_first
        o_first = offset_causal_attention(q[:, :num_first], k[:, :num_keys], v[:, :num_keys], **kw)
        if num_first == self.num_local:
            return o_first
        rest_cu = host_values(self.batch.cu_seqlens)[1:] - num_first
        buckets = DocumentBuckets.from_cu_seqlens(device_bounds(rest_cu, q.device))
        o_rest = packed_causal_attention(q[:, num_first:], k[:, num_keys:], v[:, num_keys:], buckets, **kw)
        return torch.cat([o_first, o_rest], 1)

    def sparse_attention(self, q, k, v, indices, block_size: int, scale: float | None = None, gate=None):
        """ops.sparse_attention of this rank's queries q [1, T_local, H, K] (gate [1, T_local, H, V] or None) over the
        span's k [1, M, G, K] and v [1, M, G, V]; indices [1, T_local, (G,) S] in the span's convention
        (`span_indices`) -> [1, T_local, H, V]: the queries are the span's last T_local tokens (query_start)."""
        if indices.dim() == 4 and indices.stride(2) == 0:
            # One selection expanded over the kv heads, given once: the kernels keep one canonical set and bitmap.
            indices = indices[:, :, 0]
        return sparse_attention(
            q, k, v, indices, block_size=block_size, scale=scale, cu_seqlens=self.cu_seqlens, gate=gate,
            query_start=self.prefix,
        )  # fmt: skip

    @torch.no_grad()
    def topk_indexer(self, q_idx, k_idx, w_idx, **kw) -> torch.Tensor:
        """ops.topk_indexer of this rank's queries q_idx [1, T_local, HI, DI] (weights w_idx [1, T_local, HI] or
        None) over the span's keys k_idx [1, M, DI] -> [1, T_local, S] in the span's convention (the queries scored
        alone, as the span's last T_local tokens)."""
        return topk_indexer(q_idx, k_idx, w_idx, cu_seqlens=self.cu_seqlens, query_start=self.prefix, **kw)

    def row_indices(self, indices: torch.Tensor, block_size: int) -> torch.Tensor:
        """Selected keys in the span's convention -> the row's (token positions move by `first`; block ids, local to
        their document, stay)."""
        if block_size > 1 or not self.first:
            return indices
        return torch.where(indices >= 0, indices + self.first, indices)

    def span_indices(self, indices: torch.Tensor, block_size: int) -> torch.Tensor:
        """row_indices' inverse."""
        if block_size > 1 or not self.first:
            return indices
        return torch.where(indices >= 0, indices - self.first, indices)

    def pinned(self, layer: nn.Module, indices: torch.Tensor, block_size: int) -> torch.Tensor:
        """The selection after the layer's pin_selection (engine/model/selection.py), which sees it in the row's
        convention."""
        return self.span_indices(layer.pin_selection(self.row_indices(indices, block_size)), block_size)


def _joined(xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """xs [1, T, ...] -> [1, T, C]: their rows side by side, to move in one collective."""
    return torch.cat([x.flatten(2) for x in xs], -1) if len(xs) > 1 else xs[0].flatten(2)


def _split(joined: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """_joined's inverse on [1, M, C] rows: each of xs' shape with M rows."""
    parts = joined.split([x[0, 0].numel() for x in xs], -1)
    return tuple(part.view(1, part.shape[1], *x.shape[2:]) for part, x in zip(parts, xs))


def gather_rows(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """x [1, T_local, ...] of every rank joined: the row [1, T, ...], no gradient (the indexers' inputs)."""
    with torch.no_grad():
        return gather_sequence(x, batch.context)


def gated_attention_across_ranks(layer, q, k, v, batch: PackedBatch) -> torch.Tensor:
    """GatedAttention.attend's attention (before the gate): q [1, T_local, H, hd], this rank's k and v."""
    span = KeySpan.of(batch, layer.sliding_window)
    k, v = span.gather(k, v)
    return span.causal_attention(q, k, v, sinks=layer.sinks, window=layer.sliding_window)


def sparse_attention_across_ranks(layer, x, q, k, v, gate, batch: PackedBatch, index_inputs=None) -> torch.Tensor:
    """SparseAttention.attend: the indexer's keys of the span gathered, then the selected keys and values fetched."""
    span = KeySpan.of(batch)
    with torch.no_grad():
        q_idx, k_idx, w_idx = layer.index_inputs(x) if index_inputs is None else index_inputs
        (k_idx,) = span.gather(k_idx)
        indices = span.topk_indexer(q_idx, k_idx, w_idx, topk=layer.num_selected, block_size=layer.block_size)
        indices = span.pinned(layer, indices, layer.block_size)
    k, v = span.fetch_selected(indices, layer.block_size, k, v)
    indices = indices.unsqueeze(2).expand(-1, -1, layer.num_kv_heads, -1)
    return span.sparse_attention(q, k, v, indices, layer.block_size, gate=gate)


def qsa_attention_across_ranks(layer, x, q, k, v, gate, batch: PackedBatch) -> torch.Tensor:
    """QSAAttention.attend. The block key at each row pools the raw indexer keys of the rows from it on, which may
    lie on the next rank: the raw keys of the row are gathered, this rank's block keys made from them, then those
    of the span gathered."""
    indexer, span = layer.indexer, KeySpan.of(batch)
    shard, block_size = batch.context, layer.indexer.block_size
    with torch.no_grad():
        q_idx, k_idx, (cos, sin) = indexer.project_queries(x, layer.rotary, batch)
        raw_TD = F.pad(gather_rows(k_idx, batch)[0], (0, 0, 0, block_size - 1))
        windows_TD = raw_TD.narrow(0, shard.start, shard.stop - shard.start + block_size - 1)
        windows_TD = windows_TD.unfold(0, block_size, 1).mean(-1)
        block_k = layer.rotary.rotate(indexer.k_layernorm(windows_TD)[None, :, None, :], cos, sin)[:, :, 0]
        (block_k,) = span.gather(block_k)
        indices = span.topk_indexer(
            q_idx, block_k, None, topk=indexer.num_selected, block_size=block_size, k_idx_is_pooled=True,
            always_keep_own_block=False,
        )  # fmt: skip
        indices = span.pinned(indexer, indices, block_size)
    k, v = span.fetch_selected(indices, block_size, k, v)
    indices = indices.unsqueeze(2).expand(-1, -1, layer.num_kv_heads, -1)
    return span.sparse_attention(q, k, v, indices, block_size, gate=gate)


def latent_attention_across_ranks(layer, x, cos_sin, batch: PackedBatch) -> torch.Tensor:
    """MultiHeadLatentAttention.forward's attention [1, T_local, H, V]: the span's normed kv latents and rope keys
    (the compressed cache, Rkv + Dr numbers a token) expanded per head here. Without an indexer they are gathered;
    with the lightning indexer (mla_sparse) its keys of the span are gathered and only the selected ones fetched."""
    span = KeySpan.of(batch)
    q_latent, q_nope, q_rope = layer.project_query(x, cos_sin)
    latent_keys = layer.project_latent(x, cos_sin)
    indexer = getattr(layer, "indexer", None)
    if indexer is None:
        q, k, v = layer.expand_latent(q_nope, q_rope, *span.gather(*latent_keys))
        return span.causal_attention(q, k, v, scale=layer.scale)
    with torch.no_grad():
        q_idx, k_idx, w_idx = indexer.project(x, q_latent, cos_sin)
        (k_idx,) = span.gather(k_idx)
        indices = span.topk_indexer(q_idx, k_idx, w_idx, topk=indexer.num_selected, block_size=indexer.block_size)
        indices = span.pinned(indexer, indices, indexer.block_size)
    q, k, v = layer.expand_latent(q_nope, q_rope, *span.fetch_selected(indices, indexer.block_size, *latent_keys))
    return span.sparse_attention(q, k, v, indices, indexer.block_size, scale=layer.scale)
