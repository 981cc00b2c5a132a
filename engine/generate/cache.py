"""State carried between the calls of cached (incremental) decoding.

A DecodeCache holds each module's own state dict (key and value caches for softmax attention, the recurrent state
and the conv inputs for linear attention, the last token ids for n-gram embeddings) and the number of tokens seen.
A DecodeStep is one call: the positions and ids of the T tokens it runs, and the cache it reads and extends. Every
token mixer's `forward_cached(x [1, T, D], step)` reads `step.state(self)`: empty on the first call (the prefill of
T tokens), then what its earlier calls left there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class DecodeCache:
    """Per-module states of one sequence being decoded and the number of its tokens seen so far."""

    num_tokens: int = 0
    states: dict[int, dict] = field(default_factory=dict)
    # Multimodal RoPE after a prompt with images: the tokens past the prompt rotate by their position plus this on
    # all three (t, h, w) streams (an image's tokens take fewer positions than tokens); None: by their position.
    rotary_offset: int | None = None
    # The modules the states belong to: keys are id(module), kept alive (and checked) so an id is never reused.
    owners: dict[int, nn.Module] = field(default_factory=dict)

    def state(self, module: nn.Module) -> dict:
        """The module's own state dict, created empty at its first use; the module mutates it in place."""
        key = id(module)
        if key not in self.states:
            self.states[key] = {}
            self.owners[key] = module
        return self.states[key]

    def reset(self) -> None:
        """Forget every state: the next call is a prefill again."""
        self.num_tokens = 0
        self.rotary_offset = None
        self.states.clear()
        self.owners.clear()


@dataclass
class DecodeStep:
    """One cached forward over T tokens continuing a sequence."""

    positions: torch.Tensor  # [T] int64, start .. start + T - 1
    token_ids: torch.Tensor  # [T] int64
    cache: DecodeCache
    # [3, T] (t, h, w) rotary positions of a multimodal-RoPE model's tokens (engine/model/vision.py
    # mrope_positions); None: each stream is the token's position.
    mrope_positions: torch.Tensor | None = None

    @property
    def start(self) -> int:
        """The position of this step's first token: the number of tokens the cache had seen before it."""
        return int(self.positions[0])

    @property
    def is_prefill(self) -> bool:
        """Whether no token ran before this step (every state is empty)."""
        return self.start == 0

    def state(self, module: nn.Module) -> dict:
        """`module`'s own state dict (see DecodeCache.state)."""
        return self.cache.state(module)

    @classmethod
    def next(cls, cache: DecodeCache, token_ids: torch.Tensor,
             mrope_positions: torch.Tensor | None = None) -> DecodeStep:
        """The step running token_ids [T] after the cache's tokens (positions cache.num_tokens ...); its rotary
        positions `mrope_positions` [3, T] when given, else its positions plus cache.rotary_offset when set."""
        positions = torch.arange(cache.num_tokens, cache.num_tokens + token_ids.numel(), device=token_ids.device)
        if mrope_positions is None and cache.rotary_offset is not None:
            mrope_positions = (positions + cache.rotary_offset).expand(3, -1)
        return cls(positions, token_ids.reshape(-1).long(), cache, mrope_positions)
