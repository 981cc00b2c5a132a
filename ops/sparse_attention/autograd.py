"""Autograd wiring of the sparse attention kernels (kernels_fwd.py, kernels_bwd.py) and the kernel path of the
top-k indexer (kernels_select.py).

Shapes: B batch, T keys, TQ queries (the last TQ keys: query i at key position query_start + i), NT = B * T flat
keys, NQ = B * TQ flat queries, HQ query heads, H kv heads, H' index heads (H or 1), K / V head
dims, S slots, NW selection bitmap words per query.

Saved for backward: q, k, v and o as given (no copies beyond making them contiguous), the log-sum-exp [NQ, HQ] fp32,
the canonical indices [NQ, H', S] int32 and the selection bitmap [NQ, H', NW] int32 (the token-level backward reads
it; ceil(T / 32) words per query, 32 MB per index head at T = TQ = 16384).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe_tune.ops.sparse_attention.kernels_bwd import sparse_attention_bwd
from moe_tune.ops.sparse_attention.kernels_fwd import pick_config, sparse_attention_fwd
from moe_tune.ops.sparse_attention.kernels_select import (
    SequenceLayout,
    block_slots,
    canonical_indices,
    sequence_layout,
    topk_indexer_fwd,
)


class SparseAttentionFunction(torch.autograd.Function):
    """o = sparse_attention(q, k, v, indices, block_size, scale, cu_seqlens, gate, query_start) on the Triton kernels.

    Arguments as `moe_tune.ops.sparse_attention.sparse_attention`, already checked, with scale a float.
    """

    @staticmethod
    def forward(ctx, q, k, v, indices, block_size, scale, cu_seqlens, gate, query_start):
        B, TQ, HQ, K = q.shape
        T, H, V = k.shape[1], k.shape[2], v.shape[3]
        NT, NQ = B * T, B * TQ
        indices_BTHS = indices if indices.dim() == 4 else indices.unsqueeze(2)
        q_THK = q.reshape(NQ, HQ, K).contiguous()
        k_THK = k.reshape(NT, H, K).contiguous()
        v_THV = v.reshape(NT, H, V).contiguous()
        layout = sequence_layout(cu_seqlens, B, T, q.device, num_queries=TQ)
        canon, bits = canonical_indices(
            indices_BTHS.reshape(NQ, indices_BTHS.shape[2], indices_BTHS.shape[3]).contiguous(), layout, block_size
        )
        config = pick_config(q, block_size)
        gate_THV = None if gate is None else gate.reshape(NQ, HQ, V).contiguous()
        o_THV, lse = sparse_attention_fwd(
            q_THK, k_THK, v_THV, canon, layout, block_size, scale, config, gate_THV
        )
        ctx.save_for_backward(
            q_THK, k_THK, v_THV, o_THV, lse, canon, bits, layout.cu_seqlens, layout.seq_id, layout.seq_start,
            layout.seq_end, gate_THV,
        )  # fmt: skip
        ctx.block_size, ctx.scale, ctx.shape = block_size, scale, (B, T, TQ, HQ, H, K, V)
        return o_THV.view(B, TQ, HQ, V)

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q_THK, k_THK, v_THV, o_THV, lse, canon, bits, cu_seqlens, seq_id, seq_start, seq_end, gate_THV = (
            ctx.saved_tensors
        )
        B, T, TQ, HQ, H, K, V = ctx.shape
        block_size = ctx.block_size
        layout = SequenceLayout(cu_seqlens, seq_id, seq_start, seq_end, T, TQ)
        slots = block_slots(layout, block_size) if block_size > 1 else None
        do_THV = do.reshape(B * TQ, HQ, V).contiguous()
        dq, dk, dv, dgate = sparse_attention_bwd(
            q_THK, k_THK, v_THV, o_THV, lse, do_THV, canon, bits, layout, slots, block_size, ctx.scale,
            pick_config(q_THK, block_size), gate_THV,
        )  # fmt: skip
        dgate = None if dgate is None else dgate.view(B, TQ, HQ, V)
        return dq.view(B, TQ, HQ, K), dk.view(B, T, H, K), dv.view(B, T, H, V), None, None, None, None, dgate, None


def sparse_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    block_size: int = 1,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    query_start: int = 0,
) -> torch.Tensor:
    """The kernel path of `sparse_attention`; inputs already checked."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return SparseAttentionFunction.apply(q, k, v, indices, block_size, float(scale), cu_seqlens, gate, query_start)


@torch.no_grad()
def topk_indexer_kernel(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None = None,
    topk: int = 2048,
    scale: float | None = None,
    activation: str = "relu",
    block_size: int = 1,
    cu_seqlens: torch.Tensor | None = None,
    k_idx_is_pooled: bool = False,
    always_keep_own_block: bool = True,
    query_start: int = 0,
) -> torch.Tensor:
    """The kernel path of `topk_indexer`; inputs already checked."""
    scale = q_idx.shape[-1] ** -0.5 if scale is None else scale
    return topk_indexer_fwd(q_idx, k_idx, w_idx, topk, float(scale), activation, block_size, cu_seqlens,
                            k_idx_is_pooled, always_keep_own_block)  # fmt: skip
