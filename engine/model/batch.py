"""The packed batch every layer takes: one row [1, T] of documents, with cu_seqlens marking where each starts.

It sits below the token mixers (attention, kda, mla, kv_cache) and the model that builds it, so they import it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from moe_tune.engine.parallel.context import ContextShard

from .varlen import DocumentBuckets


@dataclass(frozen=True)
class PackedBatch:
    """Where the documents of a packed row start and end, computed once per forward."""

    cu_seqlens: torch.Tensor  # [N + 1] int32
    positions: torch.Tensor  # [T] position inside the document
    doc_ids: torch.Tensor  # [T] document index
    token_ids: torch.Tensor | None = None  # [T] int64 input ids (n-gram embeddings hash them)
    mrope_positions: torch.Tensor | None = None  # [3, T] (t, h, w) rotary positions when images are in the row
    # Under context parallelism the row's part held here (the fields above then describe that part: cu_seqlens
    # its document pieces, positions inside the whole documents); None: the row is held whole.
    context: ContextShard | None = None

    @property
    def rotary_positions(self) -> torch.Tensor:
        """What the softmax attention layers rotate by: (t, h, w) positions with images, else `positions`."""
        return self.mrope_positions if self.mrope_positions is not None else self.positions

    @cached_property
    def document_buckets(self) -> DocumentBuckets:
        """The row's documents grouped for full attention (computed at the first full-attention layer)."""
        return DocumentBuckets.from_cu_seqlens(self.cu_seqlens)

    def causal_mask(self) -> torch.Tensor:
        """[T, T] bool: query t may see key s (same document, s <= t). The attention layers never build it (varlen.py);
        tests compare against it."""
        same_doc = self.doc_ids[:, None] == self.doc_ids[None, :]
        idx = torch.arange(len(self.doc_ids), device=self.doc_ids.device)
        return same_doc & (idx[None, :] <= idx[:, None])
