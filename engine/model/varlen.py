"""Causal softmax attention over packed documents without a [T, T] mask (used by GatedAttention and the MLA layers):
on a GPU with the flash kernel and equal q and v head dims, one variable-length flash call over all documents;
otherwise documents grouped into buckets of padded lengths, one SDPA call per bucket.

Shapes: B rows, T tokens per row, H query heads, G key/value heads, hd / hdv head dims, N documents, S padded slots
(each document's tokens, then its padding, documents ordered by bucket).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from moe_tune.ops.common.host_copy import host_values, to_device

# Full attention pads each document at its end to a multiple of 2^(floor(log2 L) - PAD_BUCKET_BITS) tokens and runs
# one causal SDPA call per padded length. A real query never sees the padding after it, so padding changes no
# output. With 2 bits padding adds < 25% tokens to a document (< 1.57x its causal work) and the calls stay at 4 per
# octave of document length (< 4 log2 T) however many documents a row holds; grouping by exact length would take up
# to sqrt(2T) calls (256 at T = 32K), 1 bit up to 2.25x a document's work.
PAD_BUCKET_BITS = 2
# Full attention never takes cuDNN's SDPA kernel, which torch 2.11 tries first on Hopper and which builds an
# execution plan on the host for every new shape. The buckets' shapes change with each batch's documents, so every
# call waited for a plan: on the H200 (bench-qwen3-next, torch 2.11; docs/perf-history.md, end to end), one profiled
# step of 561 ms had the GPU idle for 460 ms, 345 of them in gaps before the launches of cuDNN's attention forward
# and backward. Flash and memory-efficient attention take any shape as it comes; on the CPU nothing changes (it has
# no cuDNN attention).
_NON_CUDNN_BACKENDS = (
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
)


def without_cudnn_sdpa() -> AbstractContextManager:
    """A context in which F.scaled_dot_product_attention leaves cuDNN's kernel out and takes the others as the caller
    enabled them (unchanged when cuDNN's is off or the only one enabled). Entered once around a loop of calls (the
    buckets, the images), not per call: entering sets the backends' flags on the host."""
    enabled = [backend for backend, is_enabled in _NON_CUDNN_BACKENDS if is_enabled()]
    if not enabled or not torch.backends.cuda.cudnn_sdp_enabled():
        return nullcontext()
    return sdpa_kernel(enabled)


# The variable-length flash kernel's limits (flash-attention 2 as vendored in torch): 16-bit inputs, one head dim
# for q, k and v, a multiple of 8 up to 256, an Ampere or newer GPU.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device)[0] >= 8


def flash_varlen_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether packed_causal_attention takes one variable-length flash call: CUDA inputs of one 16-bit dtype, q's
    head dim equal to v's, a multiple of 8 up to 256, and flash attention enabled (SDPA's own switch, so
    `sdpa_kernel` without FLASH_ATTENTION sends the call to the buckets)."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in FLASH_DTYPES
        and k.dtype == v.dtype == q.dtype
        and v.shape[-1] == head_dim
        and head_dim % 8 == 0
        and head_dim <= FLASH_MAX_HEAD_DIM
        and torch.backends.cuda.flash_sdp_enabled()
        and _flash_capable(q.device)
    )


class _FlashVarlenCausal(torch.autograd.Function):
    """Causal attention inside each document of [T, heads, hd] tensors: aten's variable-length flash forward and
    backward (GQA native: k and v keep their G heads, their gradients summed over each group by the kernel).
    bounds / key_bounds: the documents' query / key starts; a document with more keys than queries has its queries
    at its last keys (flash aligns the causal diagonal to the bottom right)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds: torch.Tensor, key_bounds: torch.Tensor, max_length: int, max_key_length: int,
                scale: float | None):  # fmt: skip
        o, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, key_bounds, max_length, max_key_length, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, o, lse, bounds, key_bounds, rng_state, unused)
        ctx.max_lengths, ctx.scale = (max_length, max_key_length), scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, bounds, key_bounds, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, o, lse, bounds, key_bounds, *ctx.max_lengths, 0.0, True,
            rng_state, unused, scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None


class _FlashVarlenWindowSinks(torch.autograd.Function):
    """_FlashVarlenCausal with a sliding window (flash's own: window_size_left = window - 1) and / or one sink logit
    per head [H]. The sink is a key of value 0: o' = o exp(lse - lse') with lse' = logaddexp(lse, sink). Flash's
    backward run on (o', lse') is the backward of that softmax over the keys and the sink (its P is exp(s - lse'),
    its D = rowsum(do . o') has no term from a zero value), and dsink = -sum_t exp(sink - lse'_t) (do'_t . o'_t)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bounds: torch.Tensor, key_bounds: torch.Tensor, max_length: int,
                max_key_length: int, scale: float | None, window: int | None):  # fmt: skip
        left, right = (window - 1, 0) if window is not None else (-1, -1)
        o, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, key_bounds, max_length, max_key_length, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
        if sinks is not None:
            # lse: [H, T] fp32.
            lse_with_sink = torch.logaddexp(lse, sinks.float()[:, None])
            o = (o.float() * torch.exp(lse - lse_with_sink).transpose(0, 1)[..., None]).to(o.dtype)
            lse = lse_with_sink
        ctx.save_for_backward(q, k, v, o, lse, bounds, key_bounds, rng_state, unused, sinks)
        ctx.max_lengths, ctx.scale, ctx.window_sizes = (max_length, max_key_length), scale, (left, right)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, bounds, key_bounds, rng_state, unused, sinks = ctx.saved_tensors
        do = do.contiguous()
        left, right = ctx.window_sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do, q, k, v, o, lse, bounds, key_bounds, *ctx.max_lengths, 0.0, True, rng_state, unused,
            scale=ctx.scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            do_dot_o = (do.float() * o.float()).sum(-1).transpose(0, 1)  # [H, T]
            dsinks = -(torch.exp(sinks.float()[:, None] - lse) * do_dot_o).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def padded_length(length: int) -> int:
    """The bucket of a document of `length` tokens: `length` rounded up to a multiple of its octave's step."""
    step = 1 << max(length.bit_length() - 1 - PAD_BUCKET_BITS, 0)
    return -(-length // step) * step


@dataclass(frozen=True)
class DocumentBuckets:
    """The documents of packed rows, for causal attention without a [T, T] mask: their bounds (the flash path), and
    on first use their grouping by padded length (the buckets' path).

    The slots hold the bucket of lengths[0] (counts[0] documents, each its tokens then its padding), then the next
    bucket; inside a bucket the documents keep their order in the rows. Built on the host once per forward.
    """

    num_tokens: int  # T over all rows
    bounds: torch.Tensor  # [N' + 1] int32 on cu_seqlens' device: the starts of the non-empty documents, then T
    max_length: int  # tokens of the longest document
    starts: torch.Tensor  # [N'] int64 on the host: where each non-empty document starts
    doc_lengths: torch.Tensor  # [N'] int64 on the host: its tokens

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, row_length: int | None = None) -> DocumentBuckets:
        """cu_seqlens: [N + 1] int32 document starts over all tokens, rows one after the other (empty documents
        allowed); row_length: the tokens of one row when they span several rows, each row end ending a document."""
        bounds = host_values(cu_seqlens).long()
        if bounds.ndim != 1 or len(bounds) < 2 or bounds[0] != 0 or bool((bounds[1:] < bounds[:-1]).any()):
            raise ValueError(f"cu_seqlens {bounds.tolist()} must start at 0 and never decrease")
        num_tokens = int(bounds[-1])
        if row_length is not None and (
            num_tokens % row_length or not bool(torch.isin(torch.arange(0, num_tokens, row_length), bounds).all())
        ):
            raise ValueError(
                f"cu_seqlens {bounds.tolist()} must end a document at every row end (rows of {row_length} tokens)"
            )
        lengths_N = bounds[1:] - bounds[:-1]
        starts_N, lengths_N = bounds[:-1][lengths_N > 0], lengths_N[lengths_N > 0]
        if len(starts_N) == len(bounds) - 1 and cu_seqlens.dtype == torch.int32:
            device_bounds = cu_seqlens
        else:
            device_bounds = to_device(torch.cat([starts_N, bounds[-1:]]).int(), cu_seqlens.device)
        max_length = int(lengths_N.max()) if len(lengths_N) else 0
        return cls(num_tokens, device_bounds, max_length, starts_N, lengths_N)

    @functools.cached_property
    def _plan(self) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor | None, torch.Tensor | None]:
        """(lengths, counts, gather, scatter): see the properties of those names."""
        starts_N, lengths_N, num_tokens = self.starts, self.doc_lengths, self.num_tokens
        # Few distinct lengths (< sqrt(2T)): each is padded once, in Python, whose ints have bit_length.
        distinct, which_N = torch.unique(lengths_N, return_inverse=True)
        padded_N = torch.tensor([padded_length(n) for n in distinct.tolist()], dtype=torch.long)[which_N]
        # Stable: documents of one bucket keep their order, so a row already in bucket order needs no gather.
        order_N = torch.sort(padded_N, stable=True).indices
        padded_N, lengths_N, starts_N = padded_N[order_N], lengths_N[order_N], starts_N[order_N]
        lengths, counts = torch.unique_consecutive(padded_N, return_counts=True)
        doc_S = torch.repeat_interleave(torch.arange(len(padded_N)), padded_N)
        offset_S = torch.arange(len(doc_S)) - (torch.cumsum(padded_N, 0) - padded_N)[doc_S]
        # Padding reads its document's last token: no zero row to append to q, k, v; no real query sees it and its
        # gradient is exactly zero.
        gather_S = starts_N[doc_S] + torch.minimum(offset_S, lengths_N[doc_S] - 1)
        if len(gather_S) == num_tokens and bool((gather_S == torch.arange(num_tokens)).all()):
            gather = scatter = None
        else:
            is_token_S = offset_S < lengths_N[doc_S]
            scatter_T = torch.empty(num_tokens, dtype=torch.long)
            scatter_T[gather_S[is_token_S]] = torch.arange(len(gather_S))[is_token_S]
            gather, scatter = to_device(gather_S, self.bounds.device), to_device(scatter_T, self.bounds.device)
        return tuple(lengths.tolist()), tuple(counts.tolist()), gather, scatter

    @property
    def lengths(self) -> tuple[int, ...]:
        """The padded length of each bucket, ascending."""
        return self._plan[0]

    @property
    def counts(self) -> tuple[int, ...]:
        """The documents in each bucket."""
        return self._plan[1]

    @property
    def gather(self) -> torch.Tensor | None:
        """[S] int64: the token each slot reads; None: slot s reads token s."""
        return self._plan[2]

    @property
    def scatter(self) -> torch.Tensor | None:
        """[T] int64: the slot holding each token's output; None: token t's is slot t."""
        return self._plan[3]


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    buckets: DocumentBuckets,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention inside each document of packed rows, without a [T, T] mask: one variable-length
    flash call where `flash_varlen_applies`, else one SDPA call per bucket of documents, with `is_causal` (never
    cuDNN's kernel: see `without_cudnn_sdpa`).

    q: [B, T, H, hd], k: [B, T, G, hd], v: [B, T, G, hdv], float (G divides H); buckets: of the B * T tokens
    (`DocumentBuckets.from_cu_seqlens(cu_seqlens, row_length=T)` when B > 1); scale: default 1 / sqrt(hd).
    sinks: [H] float or None (default): each head's learned sink logit, one more term exp(sink) in the softmax's
    denominator (gpt_oss). window: None (default) or the keys a query sees, itself included (keys s with
    t - window < s <= t). With either, the flash call takes flash's window and corrects its output by the sink
    through its log-sum-exp (`_FlashVarlenWindowSinks`); the buckets take a [L, L (+1)] boolean mask each
    (`_banded_sink_attention`).
    Returns [B, T, H, hdv] in q's dtype.
    """
    num_rows, row_length, num_heads = q.shape[:3]
    num_tokens = num_rows * row_length
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or num_heads % k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have q's [B, T] and G heads "
            "dividing q's H"
        )
    if buckets.num_tokens != num_tokens:
        raise ValueError(f"buckets cover {buckets.num_tokens} tokens, q {tuple(q.shape)} has {num_tokens}")
    q_S, k_S, v_S = (x.reshape(num_tokens, *x.shape[2:]) for x in (q, k, v))
    if window is not None and window < 1:
        raise ValueError(f"window ({window}) must be >= 1 or None")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks: shape {tuple(sinks.shape)} must be [H] = [{num_heads}]")
    is_plain = sinks is None and window is None
    if flash_varlen_applies(q, k, v) and num_tokens:
        q_S, k_S, v_S = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_S, k_S, v_S))
        bounds, max_length = buckets.bounds, buckets.max_length
        if is_plain:
            o_T = _FlashVarlenCausal.apply(q_S, k_S, v_S, bounds, bounds, max_length, max_length, scale)
        else:
            o_T = _FlashVarlenWindowSinks.apply(
                q_S, k_S, v_S, sinks, bounds, bounds, max_length, max_length, scale, window
            )
        return o_T.view(num_rows, row_length, num_heads, -1)
    if buckets.gather is not None:
        q_S, k_S, v_S = (x.index_select(0, buckets.gather) for x in (q_S, k_S, v_S))
    outputs, start = [], 0
    with without_cudnn_sdpa():
        for length, count in zip(buckets.lengths, buckets.counts):
            q_b, k_b, v_b = (
                x.narrow(0, start, count * length).unflatten(0, (count, length)).transpose(1, 2)
                for x in (q_S, k_S, v_S)
            )  # [count, heads, length, dim]
            if is_plain:
                o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o_b = _banded_sink_attention(q_b, k_b, v_b, scale, sinks, window)
            outputs.append(o_b.transpose(1, 2).reshape(count * length, num_heads, -1))
            start += count * length
    o_S = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    o_T = o_S if buckets.scatter is None else o_S.index_select(0, buckets.scatter)
    return o_T.view(num_rows, row_length, num_heads, -1)


# The sink's extra channel pads q and k by this many dims, so that head dims that were multiples of 8 stay so (the
# fused SDPA kernels want it; the math kernel would take any width).
SINK_CHANNELS = 8


def _banded_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """One bucket's attention with a sliding window and / or sinks: q [C, H, L, hd], k [C, G, M, hd], v [C, G, M,
    hdv] with M >= L (M > L: the queries are the last L of the M tokens, as offset_causal_attention's) -> [C, H, L,
    hdv].

    Query i (token i + M - L) sees key j when j <= i + M - L and i + M - L - j < window. A sink is one more key that
    every query sees, with value 0 and logit sinks[h]: q gains a channel of ones, that key holds sinks[h] / scale
    there and zeros elsewhere, every other key a zero (so their logits are unchanged). The sink is per query head, so
    k and v are expanded to H heads.
    """
    length, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    key_idx = torch.arange(k.shape[2], device=q.device)
    idx = key_idx[k.shape[2] - length :]
    allowed_LM = key_idx[None, :] <= idx[:, None]
    if window is not None:
        allowed_LM &= idx[:, None] - key_idx[None, :] < window
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_LM, scale=scale, enable_gqa=True)
    count, num_heads = q.shape[:2]
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    extra = q.new_zeros(count, num_heads, length, SINK_CHANNELS)
    q = torch.cat([q, extra.narrow(-1, 0, 1) + 1, extra.narrow(-1, 1, SINK_CHANNELS - 1)], -1)
    k = torch.cat([k, q.new_zeros(*k.shape[:3], SINK_CHANNELS)], -1)
    sink_key = torch.cat([
        q.new_zeros(num_heads, head_dim), (sinks / scale).to(q.dtype)[:, None], q.new_zeros(num_heads, SINK_CHANNELS - 1)
    ], -1)  # fmt: skip
    k = torch.cat([sink_key[None, :, None, :].expand(count, -1, -1, -1), k], 2)
    v = torch.cat([v.new_zeros(count, num_heads, 1, v.shape[-1]), v], 2)
    allowed_LM = torch.cat([allowed_LM.new_ones(length, 1), allowed_LM], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_LM, scale=scale)


def offset_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention inside one document whose queries are its last tokens: a document continued from
    earlier tokens held elsewhere (context parallelism, engine/model/attention_context.py).

    q: [1, Lq, H, hd], k: [1, Lk, G, hd], v: [1, Lk, G, hdv] with Lk >= Lq: query i is the document's token
    Lk - Lq + i and sees the keys s <= Lk - Lq + i (with window: also s > Lk - Lq + i - window); scale, sinks and
    window as in packed_causal_attention. One variable-length flash call where `flash_varlen_applies` (its causal
    diagonal is the bottom-right one), else one SDPA call: on CUDA with a lower-right causal bias (no [Lq, Lk] mask
    for the efficient kernel), on the CPU and with a window or sinks with a boolean [Lq, Lk (+1)] mask.
    Returns [1, Lq, H, hdv] in q's dtype.
    """
    num_queries, num_keys, num_heads = q.shape[1], k.shape[1], q.shape[2]
    if q.shape[0] != 1 or k.shape[0] != 1 or num_keys < num_queries or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: one row each, k and v of one shape [1, Lk, "
            "G] with Lk at least q's Lq"
        )
    if num_heads % k.shape[2]:
        raise ValueError(f"k's G ({k.shape[2]}) heads must divide q's H ({num_heads})")
    if window is not None and window < 1:
        raise ValueError(f"window ({window}) must be >= 1 or None")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks: shape {tuple(sinks.shape)} must be [H] = [{num_heads}]")
    is_plain = sinks is None and window is None
    if flash_varlen_applies(q, k, v) and num_queries:
        q_S, k_S, v_S = (x[0] if x.stride(-1) == 1 else x[0].contiguous() for x in (q, k, v))
        bounds = to_device(torch.tensor([0, num_queries], dtype=torch.int32), q.device)
        key_bounds = to_device(torch.tensor([0, num_keys], dtype=torch.int32), q.device)
        if is_plain:
            o_T = _FlashVarlenCausal.apply(q_S, k_S, v_S, bounds, key_bounds, num_queries, num_keys, scale)
        else:
            o_T = _FlashVarlenWindowSinks.apply(
                q_S, k_S, v_S, sinks, bounds, key_bounds, num_queries, num_keys, scale, window
            )
        return o_T[None]
    q_b, k_b, v_b = (x.transpose(1, 2) for x in (q, k, v))  # [1, heads, length, dim]
    with without_cudnn_sdpa():
        if not is_plain:
            o_b = _banded_sink_attention(q_b, k_b, v_b, scale, sinks, window)
        elif q.is_cuda:
            # The lower-right bias's efficient kernel takes no GQA: k and v come with H heads.
            group = num_heads // k.shape[2]
            k_b, v_b = k_b.repeat_interleave(group, dim=1), v_b.repeat_interleave(group, dim=1)
            bias = causal_lower_right(num_queries, num_keys)
            o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=bias, scale=scale)
        else:
            key_idx = torch.arange(num_keys, device=q.device)
            allowed_LM = key_idx[None, :] <= key_idx[num_keys - num_queries :, None]
            o_b = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=allowed_LM, scale=scale, enable_gqa=True)
    return o_b.transpose(1, 2)
