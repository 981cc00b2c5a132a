"""Model-agnostic building blocks: norms, rotary embedding, the short causal conv, packed-batch helpers.

Shapes: T packed tokens (the model runs on one packed row [1, T] with cu_seqlens marking documents), D model dim,
H heads, C channels, W conv width.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_tune.ops.causal_conv import causal_conv, causal_conv_heads
from moe_tune.ops.causal_conv.reference import split_heads
from moe_tune.ops.fp8 import BLOCK, E4M3_MAX, FP8_DTYPE, quantize_weight
from moe_tune.ops.fp8.reference import AMAX_FLOOR
from moe_tune.ops.linear_attention import gated_delta_rule, kda
from moe_tune.ops.linear_attention.reference import kda_gate_ref, recurrent_gated_delta_rule_ref
from moe_tune.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_with_input
from moe_tune.ops.rms_norm.reference import GATE_ACTIVATIONS
from moe_tune.ops.rotary import apply_rotary
from moe_tune.ops.swiglu import swiglu

from .linear_context import conv_with_halo, is_sharded
from .projections import SharedInputProjections, linear_plus

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep
    from moe_tune.engine.parallel.context import ContextShard


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `one_plus` scales by (1 + w) with w starting at 0 (qwen3_next convention)."""

    def __init__(self, dim: int, eps: float = 1e-6, one_plus: bool = False):
        super().__init__()
        self.eps = eps
        self.one_plus = one_plus
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        with_input: bool = False,
        y_buffer: torch.Tensor | None = None,
        h_buffer: torch.Tensor | None = None,
    ):
        """The norm of x; with `residual`, (x + residual, the norm of that sum): one op where both have one shape
        and dtype (which writes the norm and the sum into y_buffer and h_buffer where it can: add_rms_norm), else
        the add (with torch's promotion) and the norm. with_input (no residual): (x, the norm of x), x handed on by
        the norm so that its backward adds the gradient of x's other uses (rms_norm_with_input)."""
        if residual is None:
            if with_input:
                return rms_norm_with_input(x, self.weight, self.eps, self.one_plus)
            return rms_norm(x, self.weight, self.eps, self.one_plus)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            h = x + residual
            return h, rms_norm(h, self.weight, self.eps, self.one_plus)
        return add_rms_norm(x, residual, self.weight, self.eps, self.one_plus, y_buffer, h_buffer)


class GroupedRMSNorm(RMSNorm):
    """RMSNorm of each group of `group_size` channels on its own, scaled per channel (weight [num_groups *
    group_size]); the hyper-connection streams are the groups."""

    def __init__(self, num_groups: int, group_size: int, eps: float = 1e-6, one_plus: bool = False):
        super().__init__(num_groups * group_size, eps, one_plus)
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float().unflatten(-1, (-1, self.group_size))
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        scale = 1.0 + self.weight.float() if self.one_plus else self.weight.float()
        return (normed * scale).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * act(z): the output norm of linear attention layers, applied per head; act is silu (gated delta
    net) or sigmoid (Kimi's KDA)."""

    def __init__(self, dim: int, eps: float = 1e-6, one_plus: bool = False, gate_activation: str = "silu"):
        super().__init__(dim, eps, one_plus)
        if gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_activation ({gate_activation!r}) must be one of {', '.join(GATE_ACTIVATIONS)}")
        self.gate_activation_name = gate_activation

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return rms_norm(x, self.weight, self.eps, self.one_plus, gate=z, gate_activation=self.gate_activation_name)


def document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token inside its own document: [T] int64."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - offsets


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Index of the document each packed token belongs to: [T] int64."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


class RotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` dims of each head (partial rotary), rotate-half convention.

    Multimodal RoPE (`mrope_section`, qwen3_5_moe / qwen4_exp): positions [3, T] give each token a (t, h, w)
    position (equal for text tokens); frequency j takes stream h when j % 3 == 1 and j < 3 * section[1], stream w
    when j % 3 == 2 and j < 3 * section[2], else stream t (the interleaved layout)."""

    def __init__(
        self, head_dim: int, partial_rotary_factor: float, theta: float, mrope_section: tuple[int, ...] | None = None
    ):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = mrope_section

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, T, 1, rotary_dim] for positions [T] (restarting at every document), or [3, T] (t, h, w)
        positions with multimodal RoPE."""
        if positions.dim() == 2:
            streams = positions.float()[:, :, None] * self.inv_freq  # [3, T, rotary_dim / 2]
            freqs = streams[0].clone()
            for stream in (1, 2):
                picked = slice(stream, 3 * self.mrope_section[stream], 3)
                freqs[:, picked] = streams[stream][:, picked]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim / 2]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[None, :, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[None, :, None, :]
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [1, T, H, hd]; positions: [T] (restart at every document)."""
        return self.rotate(x, *self.cos_sin(positions))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [1, T, H, hd] rotated on its first rotary_dim dims by cos, sin [1, T, 1, rotary_dim] (ops.rotary)."""
        return apply_rotary(x, cos, sin)


class ShortConv(nn.Module):
    """Depthwise causal conv over time, reset at every document start, followed by SiLU.

    Tap j reads the token j * dilation steps back; it is masked where that token lies in the previous document,
    which is exactly a per-document conv with zero left padding.
    """

    def __init__(self, channels: int, width: int, dilation: int = 1):
        super().__init__()
        self.width = width
        self.dilation = dilation
        self.weight = nn.Parameter(torch.empty(channels, width))

    @property
    def reach(self) -> int:
        """How many earlier tokens a tap reaches back: (W - 1) x dilation."""
        return (self.width - 1) * self.dilation

    def forward(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        context: ContextShard | None = None,
        head_dims: tuple[int, int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [1, T, C]; positions: [T] position inside the document; context: the row's share held here under
        context parallelism (the first taps then read the previous rank's last inputs).

        With head_dims (K, V), x is a linear-attention layer's projections (q, k [1, T, Hk K], v [1, T, Hv V]), the
        channels in that order, and the result their heads: q, k [1, T, Hv, K] (key heads repeated for the value
        heads sharing them) and v [1, T, Hv, V] (causal_conv_heads: no concatenated or repeated copy)."""
        if head_dims is None:
            if is_sharded(context):
                return conv_with_halo(x, self.weight, positions, self.dilation, context)
            return causal_conv(x, self.weight, positions, self.dilation)
        if is_sharded(context):
            y = conv_with_halo(torch.cat(x, -1), self.weight, positions, self.dilation, context)
            return split_heads(y, x[0].shape[-1], *head_dims)
        return causal_conv_heads(*x, self.weight, positions, *head_dims, self.dilation)

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x: [1, T, C], the step's tokens of one sequence -> [1, T, C], the rows `forward` gives them over the whole
        sequence. The state keeps the last (W - 1) * dilation inputs, all a later token's taps can reach."""
        state = step.state(self)
        history = state.get("inputs")  # [1, h, C], h <= reach
        window = x if history is None else torch.cat([history, x], 1)
        num_history = window.shape[1] - x.shape[1]
        positions = torch.arange(step.start - num_history, step.start + x.shape[1], device=x.device)
        y = causal_conv(window, self.weight, positions, self.dilation)[:, num_history:]
        reach = (self.width - 1) * self.dilation
        # A copy: a slice would keep the whole prompt's inputs alive.
        state["inputs"] = window[:, max(0, window.shape[1] - reach) :].clone()
        return y


def delta_rule_cached(
    state: dict,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The linear attention ops (ops.linear_attention) over T tokens continuing one sequence whose recurrent state
    [1, H, K, V] fp32 is `state["recurrent"]` (absent: zeros), which is replaced by the state after them.

    q, k: [1, T, H, K]; v: [1, T, H, V]; g: [1, T, H] (gated delta rule) or [1, T, H, K] (KDA; with A_log [H] and
    dt_bias, the raw gate as `kda(use_gate_in_kernel=True)` takes it); beta [1, T, H]; q and k are L2-normalised
    here. One token runs the recurrence itself (the reference's definition, fp32); more run the chunked op.
    Returns o [1, T, H, V] in q's dtype.
    """
    initial = state.get("recurrent")
    is_per_channel = g.ndim == 4
    if q.shape[1] == 1:
        if A_log is not None:
            g = kda_gate_ref(g, A_log, dt_bias)
        o, state["recurrent"] = recurrent_gated_delta_rule_ref(
            q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm=True
        )
        return o
    if is_per_channel:
        gate = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias} if A_log is not None else {}
        o, state["recurrent"] = kda(
            q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True, **gate
        )
    else:
        o, state["recurrent"] = gated_delta_rule(
            q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    return o


def sequence_chunks(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of at most chunk_tokens tokens covering num_tokens (the last may be
    shorter)."""
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def recomputed(fn, *args, is_collective: bool = False):
    """fn(*args) under non-reentrant activation checkpoint when autograd records: forward keeps only the tensor
    arguments (saved through the saved-tensor hooks in force, so engine/memory's tiers see them) and backward reruns
    fn to get what it saved. `is_collective`: fn runs collectives (expert-parallel all-to-alls), so its recomputation
    runs to the end on every rank; early stop would end it after the last saved tensor, a point where ranks may
    differ (a rank that receives no rows saves fewer)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False, early_stop=not is_collective)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    # The projections of the input, run as one node where engine/model/projections allows it.
    shared_input_projections = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        scale: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
        hand_on: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> down(silu(gate(x)) * up(x)) [..., D]; with `scale` [..., 1] the hidden rows are scaled before
        the down projection, and `add_to` [..., D] is added to its output inside its GEMM (linear_plus). hand_on:
        -> (that output, x as the gate and up projections' node hands it on for x's later uses: their gradient of x
        is added inside the node's backward GEMMs; x itself where the node does not apply)."""
        projections = SharedInputProjections(x, (self.gate_proj, self.up_proj), hand_on=hand_on)
        gate, up = projections.of(self.gate_proj, self.up_proj)
        h = swiglu(gate, up, scale)
        out = self.down_proj(h) if add_to is None else linear_plus(h, self.down_proj, add_to)
        return (out, projections.x) if hand_on else out


# The bits of fp32 1.0, the unit scale of an FP8 weight before its init or checkpoint: built as an int32 tensor,
# since zero.Init casts every floating tensor a constructor makes to the run's dtype (fp32 ones would become bf16).
FP32_ONE_BITS = 0x3F800000


def quantize_blocks(w: torch.Tensor, row_segments: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.fp8.quantize_weight(w, row_segments), bit for bit, about 8x faster when every row segment and the column
    dim are multiples of 128 (the blocks are then a reshape: no scatter, no full-size scale tensor); the random init
    of an FP8 model quantizes every weight it draws. Other shapes take quantize_weight itself."""
    rows, cols = w.shape[-2:]
    segments = row_segments if row_segments is not None else (rows,)
    if cols % BLOCK or any(seg % BLOCK for seg in segments) or not w.is_floating_point():
        return quantize_weight(w, row_segments)
    lead = w.shape[:-2]
    blocks = w.detach().float().reshape(*lead, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    # The reference's rounding rule: a tensor divisor, then round to nearest even in float8_e4m3fn.
    scale_inv = amax.clamp(min=AMAX_FLOOR) / amax.new_full((), E4M3_MAX)
    w_q = (blocks / scale_inv[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return w_q.reshape(w.shape), scale_inv


@contextmanager
def saved_as_parameters(*params: nn.Parameter):
    """Within the block, a tensor autograd saves that is one of `params` under another dtype (an FP8 weight's
    float8 view of its uint8 bits: a dtype view, which autograd does not track as a view of the parameter) is kept
    as the parameter and viewed again when backward reads it; every other saved tensor goes to the hooks in force
    around the block (engine/memory's tiering, activation checkpointing), as without it.

    Under ZeRO-3 a kept view would hold the storage gathered for forward until backward (and never see the one
    gathered for backward); engine/memory would take it for an activation and copy it to the host."""
    # torch has no public getter for the hooks in force; this one private call reads them (as engine/memory does).
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor):
        for param in params:
            if t.shape == param.shape and t.numel() and t.data_ptr() == param.data_ptr():
                return _ParameterView(param, t.dtype)
        return outer_pack(t) if outer_pack is not None else t

    def unpack(packed):
        if isinstance(packed, _ParameterView):
            return packed.param.view(packed.dtype)
        return outer_unpack(packed) if outer_unpack is not None else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _ParameterView:
    """A saved tensor kept as (parameter, dtype)."""

    __slots__ = ("param", "dtype")

    def __init__(self, param: nn.Parameter, dtype: torch.dtype):
        self.param, self.dtype = param, dtype
