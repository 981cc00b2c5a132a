"""Hyper-connections (qwen4_exp): the decoder carries S residual streams instead of one.

Each sub-layer (token mixer, channel mixer) reads one input mixed from the normed streams and writes its output
back into every stream with a weight of its own:

    n = RMSNorm of each stream (x)                              scale (1 + w) per stream and channel
    input = mean_s( sigmoid(W_up silu(W_down n / S))_s * n_s )  the sub-layer's input [T, D]
    x_s <- x_s + 2 sigmoid(W_inject n / S)_s * sublayer(input)

The embedding starts every stream; the final mixer (the same read, without injection) gives the hidden state the LM
head reads. Streams are stored flat and stream-major, [1, T, S * D], as transformers stores them, so a decoder
layer's output is compared with the reference's as is.

Shapes: T packed tokens, S streams, D model dim, R mix rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.engine.parallel.expert_parallel import ExpertLayout
from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .attention import build_token_mixer
from .batch import PackedBatch
from .blocks import GroupedRMSNorm
from .moe import channel_mixer
from .ngram import NGramInjection

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep


class HyperConnection(nn.Module):
    """Reads a sub-layer's input from the streams and the weights its output is written back with.
    Called as a module (the final mixer), it returns the mixed input alone."""

    def __init__(self, cfg: ModelProfile, has_injection: bool = True):
        super().__init__()
        hc = cfg.hyper_connections
        assert hc is not None, "HyperConnection needs model.hyper_connections"
        self.num_streams, self.hidden = hc.num_streams, cfg.hidden_size
        width = hc.num_streams * cfg.hidden_size
        self.norm = GroupedRMSNorm(hc.num_streams, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.mix_down = nn.Linear(width, hc.mix_rank, bias=False)
        self.mix_up = nn.Linear(hc.mix_rank, width, bias=False)
        self.inject_proj = nn.Linear(width, hc.num_streams, bias=False) if has_injection else None

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [1, T, S * D] -> the sub-layer input [1, T, D] and the injection weights [1, T, S] (None without)."""
        n = self.norm(x)
        mix = torch.sigmoid(self.mix_up(F.silu(self.mix_down(n) / self.num_streams)))
        streams = (*x.shape[:-1], self.num_streams, self.hidden)
        mixed = (mix.view(streams) * n.view(streams)).mean(-2)
        if self.inject_proj is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.inject_proj(n) / self.num_streams)

    @staticmethod
    def write(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every stream of x [1, T, S * D] plus its weight [1, T, S] times the sub-layer output y [1, T, D]."""
        return x + (y[..., None, :] * weights[..., :, None]).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.read(x)[0]


class HyperDecoderLayer(nn.Module):
    """A decoder layer over hyper-connection streams: optional n-gram injection, then the token mixer and the
    channel mixer, each reading from and writing into the streams. No pre-norms: the hyper-connections norm."""

    def __init__(self, cfg: ModelProfile, spec: LayerSpec, layout: ExpertLayout | None = None, index: int = 0):
        super().__init__()
        # The n-gram tables and hashes of a layer depend on its rank among the n-gram layers.
        ngram_rank = sum(layer.has_ngram_embedding for layer in cfg.layers[:index])
        self.ngram = NGramInjection(cfg, ngram_rank) if spec.has_ngram_embedding else None
        self.attn_hyper_connection = HyperConnection(cfg)
        self.self_attn = build_token_mixer(cfg, spec)
        self.mlp_hyper_connection = HyperConnection(cfg)
        self.mlp, self.aux_loss_coef = channel_mixer(cfg, spec, layout, index)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [1, T, S * D] streams -> (streams, weighted aux loss)."""
        if self.ngram is not None:
            x = x + self.ngram(x, batch)
        h, weights = self.attn_hyper_connection.read(x)
        x = HyperConnection.write(x, self.self_attn(h, batch), weights)
        h, weights = self.mlp_hyper_connection.read(x)
        y, aux = self.mlp(h)
        return HyperConnection.write(x, y, weights), aux * self.aux_loss_coef

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x: [1, T, S * D] streams of the step's tokens -> the streams after this layer; the token mixer and the
        n-gram injection continue from their states, the channel mixer runs without capacity limits."""
        if self.ngram is not None:
            x = x + self.ngram.forward_cached(x, step)
        h, weights = self.attn_hyper_connection.read(x)
        x = HyperConnection.write(x, self.self_attn.forward_cached(h, step), weights)
        h, weights = self.mlp_hyper_connection.read(x)
        return HyperConnection.write(x, self.mlp.forward_inference(h), weights)
