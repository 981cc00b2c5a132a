"""Context parallelism of the linear-attention layers (gated delta net, KDA) and their short convolutions.

Under context parallelism (engine/parallel/context.py) rank r holds tokens [r T / N, (r + 1) T / N) of one packed
row: its PackedBatch's cu_seqlens are the local document pieces, its positions those inside the whole documents.

Short convolution: a tap reaching back past token 0 reads the previous rank's last (W - 1) * dilation inputs (the
halo, previous_rank_tail); the positions keep the taps inside the document, as on one process.

Recurrent state: per head the delta rule maps the state linearly, S_t = A_t S_{t-1} + beta_t k_t v_t^T with
A_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) [K, K] (q and k L2-normed first), so the state leaving a rank is affine
in the state entering it: S_out = M S_in + B, B the state after the rank's last piece from zeros, M the product of
the A_t when that piece is the rank's first (no document starts inside the share; else M = 0). Each rank computes
its own (M, B) at once, one all-gather shares them ([H, K, K + V] fp32 a rank), and every rank composes the
earlier ranks' summaries (N small products) into its S_in: none waits for another's outputs. The outputs of the
first piece take S_in's part afterwards: o_t = o_t(zeros) + S_in^T (scale M_t^T q_t), with M_t the product of
A_1 .. A_t; the op run with v = 0 and the identity [K, K] as initial state gives scale M_t^T q_t as its output and
M as its final state (every column of the state follows the same A_t).

Shapes: T tokens held here, H heads, K key dim, V value dim, N context-parallel ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_tune.engine.parallel.context import ContextShard, gather_ranks, previous_rank_tail
from moe_tune.ops.causal_conv import causal_conv
from moe_tune.ops.common.host_copy import host_values

from .batch import PackedBatch


def is_sharded(shard: ContextShard | None) -> bool:
    """Whether a layer's row is shared with other context-parallel ranks."""
    return shard is not None and shard.size > 1


def conv_with_halo(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, dilation: int, shard: ContextShard
) -> torch.Tensor:
    """causal_conv(x, weight, positions, dilation) over this rank's tokens of a row shared by context-parallel ranks:
    x [1, T, C] with the previous rank's last (W - 1) * dilation rows before token 0 (zeros on rank 0, where
    positions start a document). The rows of the whole row's conv, exactly."""
    reach = (weight.shape[1] - 1) * dilation
    if reach == 0:
        return causal_conv(x, weight, positions, dilation)
    if x.shape[1] < reach:
        raise ValueError(
            f"context parallelism: a rank's share of the row ({x.shape[1]} tokens) must be at least the short "
            f"convolution's reach ({reach} = (conv width - 1) x dilation)"
        )
    halo = previous_rank_tail(x, shard, reach)
    # The halo's positions continue the document into the previous rank; where a document starts at token 0 the
    # taps of this rank's tokens never reach them. Only their own outputs, dropped, read these positions.
    halo_positions = (positions[:1] - reach + torch.arange(reach, device=positions.device)).clamp(min=0)
    window = torch.cat([halo, x], 1)
    y = causal_conv(window, weight, torch.cat([halo_positions.to(positions.dtype), positions]), dilation)
    return y[:, reach:]


def delta_rule(
    op: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    batch: PackedBatch, **options,
) -> torch.Tensor:  # fmt: skip
    """o = op(q, k, v, g, beta, cu_seqlens=batch.cu_seqlens, **options) [1, T, H, V] (op: gated_delta_rule or kda,
    their arguments), each document's state carried across the context-parallel ranks that share the row: the
    outputs of one process holding it whole. Without a context shard (or with one rank) the plain call."""
    shard = batch.context
    if not is_sharded(shard):
        o, _ = op(q, k, v, g, beta, cu_seqlens=batch.cu_seqlens, **options)
        return o
    num_heads, key_dim = q.shape[2], q.shape[3]
    o, final_states = op(q, k, v, g, beta, cu_seqlens=batch.cu_seqlens, output_final_state=True, **options)
    first_end = int(host_values(batch.cu_seqlens)[1])
    is_one_piece = first_end == q.shape[1]
    # Read on the host (no wait for the device): the row's document starts.
    row_starts = set(host_values(shard.row_cu_seqlens).tolist())
    is_continued = shard.start > 0 and shard.start not in row_starts
    transition = final_states.new_zeros(num_heads, key_dim, key_dim)
    if is_continued:
        piece = slice(0, first_end)
        identity = torch.eye(key_dim, dtype=torch.float32, device=q.device).expand(1, num_heads, key_dim, key_dim)
        # [1, T1, H, K]: scale M_t^T q_t per token of the first piece; the final state is M.
        queried, last = op(
            q[:, piece], k[:, piece], q.new_zeros(1, first_end, num_heads, key_dim), g[:, piece], beta[:, piece],
            initial_state=identity, output_final_state=True, **options,
        )  # fmt: skip
        if is_one_piece:
            transition = last[0]
    summaries = gather_ranks(torch.cat([transition, final_states[-1]], -1), shard)  # [N, H, K, K + V]
    entering = _entering_state(summaries, shard, row_starts, key_dim)
    if not is_continued:
        # This rank's first token starts a document: nothing enters it, but every rank runs the gather's backward.
        return _Keeping.apply(o, summaries)
    # In the state's precision (fp32, fp64 inputs fp64), rounded once to o's dtype.
    acc = torch.promote_types(o.dtype, entering.dtype)
    head = o[:, :first_end].to(acc) + torch.einsum("bthk,hkv->bthv", queried.to(acc), entering.to(acc))
    head = head.to(o.dtype)
    return head if is_one_piece else torch.cat([head, o[:, first_end:]], 1)


def _entering_state(summaries: torch.Tensor, shard: ContextShard, row_starts: set[int], key_dim: int) -> torch.Tensor:
    """[H, K, V] fp32 state entering this rank's first token, composed from the earlier ranks' (M, B) summaries
    [N, H, K, K + V]: S_in(r) = M(r - 1) S_in(r - 1) + B(r - 1) where rank r continues a document, else zeros."""
    transitions, offsets = summaries[..., :key_dim], summaries[..., key_dim:]
    state = torch.zeros_like(offsets[0])
    for rank in range(1, shard.rank + 1):
        if rank * (shard.stop - shard.start) in row_starts:
            state = torch.zeros_like(state)
        else:
            state = transitions[rank - 1] @ state + offsets[rank - 1]
    return state


class _Keeping(torch.autograd.Function):
    """x unchanged, with `kept` in its graph: backward hands kept a zero gradient, so the collective that made kept
    runs its backward on this rank too (the other ranks wait for it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.kept_meta = (kept.shape, kept.dtype, kept.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.kept_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)
