"""Sequence chunks of the token mixers (memory.sequence_chunk_tokens): a row longer than the chunk runs its token
mixer slab by slab, each slab recomputed in backward, with the outputs of the whole row.

The cut between two slabs is the cut between two context-parallel ranks (engine/model/linear_context.py,
attention_context.py) inside one process, the slabs run in order:

- linear attention (gated delta net, KDA): a slab's projections, short conv, gates, op, output norm and projection
  run together. The conv reads the previous slab's last (W - 1) x dilation rows (its halo: their projections are
  recomputed from the slab's input rows, which the slab keeps); the op starts a continuing document from the
  previous slab's final state [H, K, V] fp32 (its initial_state, differentiable: gradients flow back through the
  carried states). Backward keeps the slabs' inputs and the carried states.
- softmax attention (full, sliding window, top-k sparse, QSA, MLA with or without the lightning indexer): the keys
  and values of the row (MLA: its kv latent and rope key) are made once, recomputed in backward; each chunk of
  queries attends over the keys of its span (KeySpan: from the start of the document its first query belongs to,
  or the first key its window reaches, to its last query), the indexers scoring that chunk's queries over the span's
  indexer keys, made once for the row without gradient. A top-k layer's chunk selects in forward, before its
  checkpoint, and keeps the selection: backward's recomputation does not score the span again. No [T, T] or [T, T / block] tensor exists beyond a chunk's
  span. The top-k ops (and so sparse, QSA and sparse MLA) take a chunk's queries as the last C tokens of its span
  (their query_start: no padding, the indexer scores the chunk's C queries alone); full attention and MLA take the
  span as it is (varlen.offset_causal_attention).

A row of at most one chunk is the token mixer's one chunk: it runs whole under one activation checkpoint (so a chunked
mixer is recomputed whatever the row's length, as the memory policy makes no recompute region inside it). So is a
rank's share under context parallelism (the exchanges between ranks are made over whole shares), its collectives
rerun on every rank in backward. A layer whose selection is pinned or logged (align's PinnableSelection) runs whole
and plainly: its selection is the row's.

Shapes: T tokens of the row [1, T], C tokens of a slab, D model dim, M a chunk's span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_tune.engine.parallel.context import ContextShard
from moe_tune.ops.common.host_copy import host_values

from .attention_context import KeySpan, device_bounds, is_context_parallel
from .batch import PackedBatch
from .blocks import recomputed, sequence_chunks


@dataclass(frozen=True)
class Slab:
    """Row tokens [start, stop) of a row run in sequence chunks."""

    start: int
    stop: int
    # The slab's own: cu_seqlens its document pieces, positions (inside the whole documents) and the rest sliced; its
    # context places it in the row for KeySpan (a group of one: nothing is exchanged).
    batch: PackedBatch
    is_continued: bool  # its first token continues a document begun in an earlier slab

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def span(self, window: int | None = None) -> KeySpan:
        """The row keys this slab's queries may see (attention_context.KeySpan)."""
        return KeySpan.of(self.batch, window)


def runs_in_chunks(layer, x: torch.Tensor, batch: PackedBatch) -> bool:
    """Whether `layer` (a token mixer with a `sequence_chunk_tokens` attribute) runs x [1, T, D] in slabs."""
    chunk = layer.sequence_chunk_tokens
    return chunk is not None and x.shape[1] > chunk and not is_context_parallel(batch)


def runs_whole_recomputed(layer, *selectors) -> bool:
    """Whether `layer` (sequence chunks set, not run in chunks: a row of at most one chunk, or a context-parallel
    rank's share) runs whole as its one chunk, under activation checkpoint (whole_recomputed). A layer whose selection
    is pinned or logged runs plainly (its log would see the recomputation)."""
    return layer.sequence_chunk_tokens is not None and not selection_is_watched(*selectors)


def whole_recomputed(forward_whole: Callable, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """forward_whole(x, batch) under activation checkpoint; on a context-parallel share the recomputation runs to its
    end on every rank of the group (it reruns the gathers, which every rank must join)."""
    return recomputed(forward_whole, x, batch, is_collective=is_context_parallel(batch))


def selection_is_watched(*selectors) -> bool:
    """Whether any PinnableSelection of a layer is pinned or logged (align): its layer then runs whole."""
    return any(s.pinned_indices is not None or s.selection_log is not None for s in selectors)


def row_slabs(batch: PackedBatch, num_tokens: int, chunk_tokens: int) -> list[Slab]:
    """The slabs of chunk_tokens tokens (the last may be shorter) covering the row of `batch`."""
    row_cu = host_values(batch.cu_seqlens).long()
    row_starts = set(row_cu.tolist())
    slabs = []
    for start, stop in sequence_chunks(num_tokens, chunk_tokens):
        inside = row_cu[(row_cu > start) & (row_cu < stop)]
        local = torch.cat([row_cu.new_tensor([0]), inside - start, row_cu.new_tensor([stop - start])])
        shard = ContextShard(None, 0, 1, start, stop, batch.cu_seqlens)
        mrope = batch.mrope_positions[:, start:stop] if batch.mrope_positions is not None else None
        token_ids = batch.token_ids[start:stop] if batch.token_ids is not None else None
        slab_batch = PackedBatch(
            device_bounds(local, batch.cu_seqlens.device), batch.positions[start:stop], batch.doc_ids[start:stop],
            token_ids, mrope, shard,
        )  # fmt: skip
        slabs.append(Slab(start, stop, slab_batch, start > 0 and start not in row_starts))
    return slabs


def linear_attention_forward(layer, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """A linear-attention layer's forward (gated delta net, KDA): slab by slab in sequence chunks (layer._slab),
    whole under a recompute when chunks are set and the row is one, else layer.forward_whole."""
    if runs_in_chunks(layer, x, batch):
        return linear_attention_in_slabs(layer, x, batch, layer.conv.reach, layer._slab)
    if runs_whole_recomputed(layer):
        return whole_recomputed(layer.forward_whole, x, batch)
    return layer.forward_whole(x, batch)


def linear_attention_in_slabs(layer, x: torch.Tensor, batch: PackedBatch, reach: int, run_slab: Callable):
    """A linear-attention layer over x [1, T, D] slab by slab -> [1, T, D].

    run_slab(x_ext, positions_ext, num_halo, entering, slab) -> (out [1, C, D], final_state [H, K, V] fp32): the
    layer on the slab's rows x_ext[:, num_halo:], x_ext holding the `num_halo` (<= reach, the short conv's) rows
    before them, positions_ext their positions; entering the state [H, K, V] fp32 entering the slab's first
    document piece when it continues one (None when it starts one); final_state the state after the slab's last
    token. Each slab runs under activation checkpoint (blocks.recomputed)."""
    outputs, entering = [], None
    for slab in row_slabs(batch, x.shape[1], layer.sequence_chunk_tokens):
        first = max(slab.start - reach, 0)
        x_ext, positions_ext = x[:, first : slab.stop], batch.positions[first : slab.stop]
        state_in = entering if slab.is_continued else None
        out, final_state = recomputed(run_slab, x_ext, positions_ext, slab.start - first, state_in, slab)
        # A copy of its own: final_state is the last row of the op's [N, H, K, V] final states, and as a view it
        # would keep all N pieces' states alive until backward (the next slab's checkpoint saves it; engine/memory
        # counts a saved view's own bytes): a row of short documents would hold [num_documents, H, K, V] a layer.
        entering = final_state.clone()
        outputs.append(out)
    return torch.cat(outputs, 1)


def initial_states(entering: torch.Tensor | None, slab: Slab) -> torch.Tensor | None:
    """The op's initial_state [N, H, K, V] fp32 for the slab's N document pieces: `entering` for the first (a
    document continued from the previous slab), zeros for the others; None when every piece starts from zeros."""
    if entering is None:
        return None
    num_pieces = len(slab.batch.cu_seqlens) - 1
    if num_pieces == 1:
        return entering[None]
    return torch.cat([entering[None], entering.new_zeros(num_pieces - 1, *entering.shape)])


def attention_in_chunks(
    x: torch.Tensor, batch: PackedBatch, chunk_tokens: int, row_keys: Callable, run_chunk: Callable,
    index_keys: tuple[torch.Tensor, ...] = (), window: int | None = None, select: Callable | None = None,
) -> torch.Tensor:  # fmt: skip
    """A softmax-attention layer over x [1, T, D] chunk of queries by chunk -> [1, T, D].

    row_keys(x) -> tuple of [1, T, ...] tensors with gradient (keys and values, or MLA's latent and rope key), run
    once under activation checkpoint; index_keys: [1, T, ...] tensors without gradient (the indexers' keys).
    select(x_c, span, *index keys over the span) -> the chunk's selection (a top-k layer's indices), made once
    without gradient before the chunk runs: backward's recomputation of the chunk takes it as saved instead of
    scoring the span again (the indexer's scores grow with the span, the rest of the chunk does not).
    run_chunk(x_c, span, *keys over the span, selection) -> [1, C, D] (without select: run_chunk(x_c, span, *keys
    over the span)): the layer's output rows of the chunk's queries x_c [1, C, D], each chunk under activation
    checkpoint (which keeps x and the row's keys once for all chunks, and each chunk's selection)."""
    keys = recomputed(row_keys, x)
    outputs = []
    for slab in row_slabs(batch, x.shape[1], chunk_tokens):
        span = slab.span(window)
        chosen = ()
        if select is not None:
            with torch.no_grad():
                chosen = (select(x[:, slab.start : slab.stop], span, *_over_span(index_keys, slab, span)),)
        outputs.append(recomputed(_chunk_over_span, run_chunk, slab, span, len(chosen), x, *keys, *chosen))
    return torch.cat(outputs, 1)


def _over_span(row_tensors, slab: Slab, span: KeySpan) -> list[torch.Tensor]:
    """The span's rows of [1, T, ...] row tensors (views)."""
    return [t.narrow(1, span.first, slab.stop - span.first) for t in row_tensors]


def _chunk_over_span(run_chunk: Callable, slab: Slab, span: KeySpan, num_own: int, x: torch.Tensor, *tensors):
    """run_chunk on the slab's query rows of x, the span's rows of the row's keys and the chunk's own `num_own` last
    tensors. Every chunk's checkpoint takes the row's tensors whole and narrows them here, so the memory policy keeps
    each once for the layer (a view made outside would be a tensor of its own, stored and sent to the host apart for
    each chunk)."""
    row_tensors, own = tensors[: len(tensors) - num_own], tensors[len(tensors) - num_own :]
    return run_chunk(x[:, slab.start : slab.stop], span, *_over_span(row_tensors, slab, span), *own)


def row_in_pieces(fn: Callable, x: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """fn(x_c) over x [1, T, D] one chunk of rows at a time, joined: [1, T, ...] (per-token projections without
    gradient, so that no wider intermediate exists for the whole row)."""
    return torch.cat([fn(x[:, start:stop]) for start, stop in sequence_chunks(x.shape[1], chunk_tokens)], 1)
