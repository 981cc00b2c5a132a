"""Pinning the keys a top-k sparse attention layer attends, as MoEBlock.pinned_topk_ids pins experts.

`moe-tune align --pin-routing` feeds the reference's selection to our indexers, so a different choice between
keys whose index scores tie (or nearly tie) can neither cause nor hide a mismatch in the attention itself; it also
reads each indexer's own choice to report how many query rows chose differently.
"""

from __future__ import annotations

import torch


class PinnableSelection:
    """Mixin of a module that chooses the keys (or key blocks) its attention sees; it passes its choice, int [1, T, S]
    in ops.sparse_attention's index convention, through `pin_selection`.

    pinned_indices: None (default), or the choice to use instead, same shape (set by align, then reset to None).
    selection_log: None (default), or a list that receives the module's own choice at every forward.
    """

    pinned_indices: torch.Tensor | None = None
    selection_log: list[torch.Tensor] | None = None

    def pin_selection(self, indices: torch.Tensor) -> torch.Tensor:
        if self.selection_log is not None:
            self.selection_log.append(indices.detach())
        pinned = self.pinned_indices
        if pinned is None:
            return indices
        if pinned.shape != indices.shape:
            raise ValueError(f"pinned_indices: shape {tuple(pinned.shape)} must be the selection's {tuple(indices.shape)}")
        return pinned.to(device=indices.device, dtype=indices.dtype)
