"""Kimi delta attention (KDA): the delta rule with one log decay per key channel, in Kimi Linear's layout.

Shapes: T packed tokens of one row [1, T], D model dim, H heads, K head dim (q, k and v share it), R = K the rank
of the low-rank decay and output-gate projections (FLA's KimiDeltaAttention fixes it to the head dim).

Per token: q, k, v = SiLU(short causal conv(x W_q | x W_k | x W_v)); per-channel log decay
g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias) <= 0; beta = sigmoid(b(x)); o = kda(q, k, v, g, beta) with q and k
L2-normalised inside the op and scale K ** -0.5; output o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x)))) per head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_tune.ops.causal_conv.reference import split_heads
from moe_tune.ops.linear_attention import kda
from moe_tune.profiles.schema import ModelProfile

from .blocks import GatedRMSNorm, ShortConv, delta_rule_cached
from .linear_context import delta_rule
from .mixer_chunks import initial_states, linear_attention_forward
from .projections import SharedInputProjections, project

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep

    from .batch import PackedBatch
    from .mixer_chunks import Slab

# FLA's KDA init: dt = softplus(dt_bias) starts uniform in log space over [1e-3, 1e-1], decay rates over [1, 16).
DT_INIT_RANGE = (1e-3, 1e-1)
A_INIT_RANGE = (1.0, 16.0)


class KimiDeltaAttention(nn.Module):
    """Token mixer of Kimi Linear's KDA layers. Module names are the checkpoint's (q_proj, f_a_proj, ...), so LoRA
    target_modules read the same as for the Hugging Face model; `conv` is the q, k and v convs side by side."""

    # As GatedDeltaNet's: keep the op's intermediates for backward unless the memory manager offloads this class.
    saves_op_intermediates = True
    # As GatedDeltaNet's: a row longer than this runs slab by slab (engine/model/mixer_chunks.py). None: whole rows.
    sequence_chunk_tokens: int | None = None
    # As GatedDeltaNet's: the projections of the layer's input, in the order the layer takes them.
    shared_input_projections = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")

    def __init__(self, cfg: ModelProfile):
        super().__init__()
        spec = cfg.kda_attention
        assert spec is not None, "the schema requires model.kda_attention for kda layers"
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        d, width = cfg.hidden_size, spec.num_heads * spec.head_dim
        self.q_proj = nn.Linear(d, width, bias=False)
        self.k_proj = nn.Linear(d, width, bias=False)
        self.v_proj = nn.Linear(d, width, bias=False)
        self.conv = ShortConv(3 * width, spec.conv_kernel_size)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, cfg.rms_norm_eps, gate_activation="sigmoid")
        self.o_proj = nn.Linear(width, d, bias=False)

    @torch.no_grad()
    def reset_decay_parameters(self) -> None:
        """FLA's init of the gate's parameters: A_log and dt_bias (inverse softplus of dt); the conv is
        attention.init_token_mixer's."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE).log())
        low, high = (math.log(x) for x in DT_INIT_RANGE)
        dt = torch.empty_like(self.dt_bias).uniform_(low, high).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """x: [1, T, D] -> [1, T, D]; the conv and the recurrent state restart at every document of `batch` (under
        context parallelism they continue from the previous rank's tokens: engine/model/linear_context; in sequence
        chunks from the previous slab's: engine/model/mixer_chunks)."""
        return linear_attention_forward(self, x, batch)

    def forward_whole(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """forward() on the row (or a context-parallel rank's share) in one piece."""
        out = self._projections(x)
        q, k, v = self.conv(out.of(self.q_proj, self.k_proj, self.v_proj), batch.positions, batch.context,
                            (self.head_dim, self.head_dim))  # fmt: skip
        a, beta = self._gates(*out.of(self.f_a_proj, self.b_proj))
        # The log decay -exp(A_log) softplus(a + dt_bias) [1, T, H, K] is computed inside the op (its kernels'
        # WY pass; the reference applies it first).
        o = delta_rule(
            kda, q, k, v, a, beta, batch, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
            dt_bias=self.dt_bias, save_intermediates=self.saves_op_intermediates,
        )  # fmt: skip
        return self._output(o, *out.of(self.g_a_proj))

    def _slab(self, x_ext, positions_ext, num_halo: int, entering, slab: Slab):
        """One slab of a row in sequence chunks (mixer_chunks.linear_attention_in_slabs): -> (out [1, C, D], the
        state after its last token [H, K, K] fp32)."""
        qkv = torch.cat(project(x_ext, (self.q_proj, self.k_proj, self.v_proj)), -1)
        q, k, v = self._heads(self.conv(qkv, positions_ext)[:, num_halo:])
        out = SharedInputProjections(x_ext[:, num_halo:], (self.f_a_proj, self.b_proj, self.g_a_proj))
        a, beta = self._gates(*out.of(self.f_a_proj, self.b_proj))
        o, final_states = kda(
            q, k, v, a, beta, initial_state=initial_states(entering, slab), output_final_state=True,
            cu_seqlens=slab.batch.cu_seqlens, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=self.A_log, dt_bias=self.dt_bias, save_intermediates=self.saves_op_intermediates,
        )  # fmt: skip
        return self._output(o, *out.of(self.g_a_proj)), final_states[-1]

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [1, T, D] continuing one sequence -> [1, T, D]; state: the conv's last inputs and the recurrent state."""
        out = self._projections(x)
        qkv = torch.cat(out.of(self.q_proj, self.k_proj, self.v_proj), -1)
        q, k, v = self._heads(self.conv.forward_cached(qkv, step))
        a, beta = self._gates(*out.of(self.f_a_proj, self.b_proj))
        o = delta_rule_cached(step.state(self), q, k, v, a, beta, self.A_log, self.dt_bias)
        return self._output(o, *out.of(self.g_a_proj))

    def _projections(self, x: torch.Tensor) -> SharedInputProjections:
        """x [1, T, D]'s six projections: q, k, v [1, T, H K], the decay's first low-rank factor [1, T, K], b [1, T, H]
        and the output gate's first factor [1, T, K]."""
        return SharedInputProjections(x, [getattr(self, name) for name in self.shared_input_projections])

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [1, T, 3 H K] -> q, k, v [1, T, H, K]."""
        return split_heads(qkv, self.num_heads * self.head_dim, self.head_dim, self.head_dim)

    def _gates(self, f_a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f_a_proj's and b_proj's outputs -> the raw decay gate a [1, T, H, K] (x's dtype) and beta [1, T, H] fp32."""
        a = self.f_b_proj(f_a).view(*f_a.shape[:2], self.num_heads, self.head_dim)
        return a, torch.sigmoid(b.float())

    def _output(self, o: torch.Tensor, g_a: torch.Tensor) -> torch.Tensor:
        """The op's output o [1, T, H, K] and g_a_proj's [1, T, K] -> [1, T, D]."""
        t = g_a.shape[1]
        gate = self.g_b_proj(g_a).view(1, t, self.num_heads, self.head_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(1, t, -1))
