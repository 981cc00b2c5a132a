"""Hashed n-gram embeddings injected into the residual streams (qwen4_exp's per-layer embeddings, PLE).

For each token, the n-grams of orders 2..N ending at it are hashed (per layer: odd multipliers, XOR, then a prime
modulus per head) into embedding tables; the concatenated vectors are projected to one value and one key per
residual stream. Each stream gates the value by how well its normed state matches its key, and a dilated causal
depthwise conv adds local context. An n-gram never reaches back across a boundary token (eos) or a document start:
those positions read the boundary token instead, exactly as transformers runs each document alone.

Shapes: T packed tokens, D model dim, S residual streams, N largest n-gram order, HN hashed heads ((N - 1) per
order x heads_per_ngram), E embedding width (HN x its per-head dim).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_tune.profiles.schema import ModelProfile, NGramEmbeddingSpec

from .batch import PackedBatch
from .blocks import GroupedRMSNorm, ShortConv

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep

# transformers' hash constants (splitmix64 and the per-layer seed stride): the tables are trained against them.
_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007
# |gate| is clamped here before its square root, whose gradient is unbounded at 0.
_GATE_FLOOR = 1e-6


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def hash_multipliers(vocab_size: int, ngram_size: int, ngram_layer_index: int, seed: int) -> list[int]:
    """One odd multiplier per n-gram position, small enough that token_id * multiplier fits in int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = seed + _LAYER_SEED_STRIDE * ngram_layer_index
    return [
        2 * (_splitmix64((base_seed + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def table_sizes(spec: NGramEmbeddingSpec, ngram_layer_index: int) -> list[int]:
    """Rows of each hashed head of one layer: consecutive primes after vocab_size_base - 1, every head of every
    n-gram layer taking the next one (global head g gets the (g + 1)-th prime)."""
    num_heads = (spec.ngram_size - 1) * spec.heads_per_ngram
    first, primes, value = ngram_layer_index * num_heads, [], spec.vocab_size_base - 1
    while len(primes) < first + num_heads:
        value += 1
        if _is_prime(value):
            primes.append(value)
    return primes[first:]


class NGramEmbedding(nn.Module):
    """The n-gram vectors of every token: [1, T, E]. `table` stacks the heads' tables (rows offset per head)."""

    def __init__(self, cfg: ModelProfile, ngram_layer_index: int):
        super().__init__()
        spec = cfg.ngram_embedding
        assert spec is not None, "the schema requires model.ngram_embedding for n-gram layers"
        self.ngram_size, self.heads_per_ngram = spec.ngram_size, spec.heads_per_ngram
        self.boundary_token_id = spec.boundary_token_id
        num_heads = (spec.ngram_size - 1) * spec.heads_per_ngram
        sizes = table_sizes(spec, ngram_layer_index)
        offsets = [sum(sizes[:i]) for i in range(num_heads)]
        rows = math.ceil(sum(sizes) / spec.vocab_size_multiple) * spec.vocab_size_multiple
        # Derived from the config, and stored in the checkpoint too (transformers keeps them as buffers).
        multipliers = hash_multipliers(cfg.vocab_size, spec.ngram_size, ngram_layer_index, spec.hash_seed)
        self.register_buffer("multipliers", torch.tensor(multipliers, dtype=torch.long))
        self.register_buffer("table_sizes", torch.tensor(sizes, dtype=torch.long))
        self.register_buffer("table_offsets", torch.tensor(offsets, dtype=torch.long))
        self.table = nn.Embedding(rows, spec.embed_dim // num_heads)

    def context(self, token_ids: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
        """The token `shift` steps back of every position, for shift 0..N-1 ([T] int64 each); the boundary token
        where that reaches before the document or across a boundary token strictly before the position."""
        ids = token_ids.long()
        idx = torch.arange(len(ids), device=ids.device)
        boundary_at = torch.where(ids == self.boundary_token_id, idx, -1)
        last_boundary = torch.cat([boundary_at.new_full((1,), -1), torch.cummax(boundary_at, 0).values[:-1]])
        context_start = torch.maximum(last_boundary + 1, idx - batch.positions)
        shifted = []
        for shift in range(self.ngram_size):
            source = idx - shift
            is_inside = source >= context_start
            shifted.append(torch.where(is_inside, ids[source.clamp_min(0)], self.boundary_token_id))
        return shifted

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        assert batch.token_ids is not None, "n-gram embeddings need the token ids in the PackedBatch"
        return self.embed(self.context(batch.token_ids, batch))

    def forward_cached(self, step: DecodeStep) -> torch.Tensor:
        """The n-gram vectors [1, T, E] of the step's tokens; the state keeps the last N - 1 token ids (all an
        n-gram of a later token reaches back to; a boundary token among them still cuts it)."""
        state = step.state(self)
        history = state.get("token_ids", step.token_ids[:0])
        ids = torch.cat([history, step.token_ids])
        num_history = len(history)
        positions = torch.arange(step.start - num_history, step.start + len(step.token_ids), device=ids.device)
        whole = torch.tensor([0, len(ids)], dtype=torch.int32, device=ids.device)
        shifted = self.context(ids, PackedBatch(whole, positions, torch.zeros_like(positions), ids))
        state["token_ids"] = ids[max(0, len(ids) - (self.ngram_size - 1)) :].clone()
        return self.embed([part[num_history:] for part in shifted])

    def embed(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """The vectors [1, T, E] of the n-grams whose tokens are shifted[j] = the token j steps back ([T] each)."""
        mixed = shifted[0] * self.multipliers[0]
        ids_per_order = []
        for order in range(2, self.ngram_size + 1):
            # Orders share the XOR chain: order n adds the token n - 1 steps back.
            mixed = torch.bitwise_xor(mixed, shifted[order - 1] * self.multipliers[order - 1])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            rows = torch.remainder(mixed[:, None], self.table_sizes[heads][None, :]) + self.table_offsets[heads]
            ids_per_order.append(rows)
        return self.table(torch.cat(ids_per_order, -1)).flatten(-2)[None]  # [1, T, E]


class NGramInjection(nn.Module):
    """What one layer adds to the residual streams [1, T, S * D] before its sub-layers.

    e = the token's n-gram vectors; value = W_v e [D]; key_s = norm(W_k e)_s; gate_s = key_s . norm(x)_s / sqrt(D),
    signed square root; g_s = sigmoid(gate_s) * value; out = g + silu(conv(norm(g))), the conv depthwise, causal,
    dilation N, reset at every document.
    """

    def __init__(self, cfg: ModelProfile, ngram_layer_index: int):
        super().__init__()
        spec, hc = cfg.ngram_embedding, cfg.hyper_connections
        assert spec is not None and hc is not None, "the schema requires ngram_embedding and hyper_connections"
        self.hidden, self.num_streams = cfg.hidden_size, hc.num_streams
        width = hc.num_streams * cfg.hidden_size
        self.embedding = NGramEmbedding(cfg, ngram_layer_index)
        self.key_proj = nn.Linear(spec.embed_dim, width, bias=False)
        self.value_proj = nn.Linear(spec.embed_dim, cfg.hidden_size, bias=False)
        self.key_norm = GroupedRMSNorm(hc.num_streams, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.query_norm = GroupedRMSNorm(hc.num_streams, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.conv_norm = GroupedRMSNorm(hc.num_streams, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.conv = ShortConv(width, spec.conv_kernel_size, dilation=spec.ngram_size)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        gated = self._gated(x, self.embedding(batch))
        return gated + self.conv(self.conv_norm(gated), batch.positions)

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [1, T, S * D] streams of the step's tokens -> what `forward` adds to them over the whole sequence."""
        gated = self._gated(x, self.embedding.forward_cached(step))
        return gated + self.conv.forward_cached(self.conv_norm(gated), step)

    def _gated(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The value of n-gram vectors e [1, T, E], gated per stream of x [1, T, S * D]: [1, T, S * D]."""
        t = x.shape[1]
        streams = (1, t, self.num_streams, self.hidden)
        key = self.key_norm(self.key_proj(e)).view(streams)
        query = self.query_norm(x).view(streams)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)  # [1, T, S, 1]
        gate = gate.abs().clamp_min(_GATE_FLOOR).sqrt() * gate.sign()
        return (torch.sigmoid(gate) * self.value_proj(e)[:, :, None, :]).reshape(1, t, -1)


def init_ngram(module: nn.Module) -> None:
    """Init hook: the injection's conv starts at zero, as transformers initialises it."""
    if isinstance(module, NGramInjection):
        nn.init.zeros_(module.conv.weight)
