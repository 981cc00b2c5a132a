"""The forward's serial state pass of the chunked gated delta rule, per-head decay and (IS_PER_CHANNEL) KDA's; the
backward's reverse pass is in kernels_bwd.py. Legend as in kernels_common.py.

`_chunk_state_fwd_kernel`, one program per (V tile, sequence, head), serial over the sequence's chunks with the
state [K, BV] in registers (fp32): v_new = U - W S, then S = exp(G_C) S + (k exp(G_C - G))^T v_new, the decayed k
read from the WY pass (HAS_K_END, power-of-two K) or built in the loop. It writes the state entering each chunk and
v_new (store_states), which the output pass and the backward read; in the fused form (compute_output) it computes
the output o = (q exp(G)) S + (q k^T * decay, causal) v_new itself and stores the states only when the backward
keeps them. With IS_PER_CHANNEL (KDA, kernels_kda.py) the decays are [C, K] and the decayed causal q k^T is read
from KDA's pairs kernel, in either form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention import kernels_common
from moe_tune.ops.linear_attention.kernels_common import (
    ChunkLayout,
    KernelConfig,
    block_size,
    decayed_qk,
    dot_precisions,
    l2norm_rows,
    load_decays,
    load_rows,
    load_state_decay,
    store_rows,
)


@triton.jit
def _chunk_state_fwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    g_cumsum_ptr,
    qk_ptr,
    initial_state_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    o_ptr,
    final_state_ptr,
    states_ptr,
    v_new_ptr,
    k_end_ptr,
    scale,
    H,
    K,
    V,
    IS_PER_CHANNEL: tl.constexpr,
    HAS_K_END: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STORE_STATES: tl.constexpr,
    COMPUTE_OUTPUT: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
    # With k exp(G_C - G) from the WY pass, the loop reads that and G_C only (the fused output needs q, k and G).
    tl.static_assert(not (HAS_K_END and COMPUTE_OUTPUT))
    dot_dtype = k_ptr.dtype.element_ty
    bos = tl.load(cu_seqlens_ptr + i_n)
    eos = tl.load(cu_seqlens_ptr + i_n + 1)
    first_slot = tl.load(chunk_offsets_ptr + i_n)
    num_chunks = tl.cdiv(eos - bos, BT)
    v0 = i_v * BV
    offs_k = tl.arange(0, BK)
    offs_v = v0 + tl.arange(0, BV)
    state_offsets = offs_k[:, None] * V + offs_v[None, :]
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    seq_head = (i_n * H + i_h).to(tl.int64) * K * V

    if HAS_INITIAL_STATE:
        state = tl.load(initial_state_ptr + seq_head + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)

    for i_t in range(0, num_chunks):
        t0 = bos + i_t * BT
        num_valid = tl.minimum(eos - t0, BT)
        if HAS_K_END:
            state_decay = load_state_decay(g_cumsum_ptr, i_h, t0 + num_valid - 1, H, K, IS_PER_CHANNEL, BK)
            k_decayed = load_rows(k_end_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        else:
            decay, decay_to_end, state_decay, G = load_decays(
                g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL, BT, BK
            )
            k = l2norm_rows(load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
            # G_C - G_j <= 0: the decay from each token to the chunk's end never overflows.
            k_decayed = (k * decay_to_end).to(dot_dtype)
        w = load_rows(w_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        u = load_rows(u_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        if STORE_STATES:
            slot_head = ((first_slot + i_t) * H + i_h).to(tl.int64) * K * V
            tl.store(states_ptr + slot_head + state_offsets, state.to(states_ptr.dtype.element_ty), mask=state_mask)
        state_dot = state.to(dot_dtype)
        # u_j = beta_j times the delta-rule error of token j against the state entering the chunk.
        v_new = u - tl.dot(w, state_dot, input_precision=DOT_PRECISION)
        v_new_dot = v_new.to(dot_dtype)
        if STORE_STATES:
            store_rows(v_new_ptr + i_h * V + v0, v_new, t0, num_valid, H * V, V - v0, BT, BV)
        if COMPUTE_OUTPUT:
            q = l2norm_rows(load_rows(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM) * scale
            if IS_PER_CHANNEL:
                # The decayed, causal q k^T of KDA's pairs kernel: per-channel decays do not factor out of the dot.
                qk = load_rows(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
            else:
                qk = decayed_qk(q, k, G, dot_dtype, BT, DOT_PRECISION).to(dot_dtype)
            o = tl.dot((q * decay).to(dot_dtype), state_dot, input_precision=DOT_PRECISION)
            o += tl.dot(qk, v_new_dot, input_precision=DOT_PRECISION)
            store_rows(o_ptr + i_h * V + v0, o, t0, num_valid, H * V, V - v0, BT, BV)
        state = state * state_decay + tl.dot(tl.trans(k_decayed), v_new_dot, input_precision=DOT_PRECISION)

    if STORE_FINAL_STATE:
        tl.store(final_state_ptr + seq_head + state_offsets, state, mask=state_mask)


def chunk_state_fwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    w_THK: torch.Tensor,
    u_THV: torch.Tensor,
    g_cumsum: torch.Tensor,
    initial_state_NHKV: torch.Tensor | None,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    output_final_state: bool,
    compute_output: bool = True,
    store_states: bool = False,
    qk_THC: torch.Tensor | None = None,
    k_end_THK: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The serial pass: o [T, H, V] in q's dtype, final state [N, H, K, V] fp32, and when store_states the states
    entering every chunk [NC, H, K, V] and v_new [T, H, V] (fp32 for fp32 inputs, else k's dtype).

    Per-channel decays (KDA): g_cumsum is [T, H, K] and qk_THC the decayed causal q k^T of kda_wy_fwd.
    k_end_THK: k exp(G_C - G) from the WY pass (store_k_end), without compute_output: the loop then reads it and
    G_C instead of k and G (no L2 norm or decay in the serial loop)."""
    if k_end_THK is not None and compute_output:
        raise ValueError("chunk_state_fwd: k_end_THK is for the pass without the output (compute_output=False)")
    T, H, K = k_THK.shape
    V = u_THV.shape[-1]
    N = layout.num_seqs
    device = k_THK.device
    store_dtype = k_THK.dtype
    alloc = kernels_common.alloc
    o_THV = alloc((T, H, V), q_THK.dtype, device) if compute_output else None
    final_state_NHKV = alloc((N, H, K, V), torch.float32, device) if output_final_state else None
    states_NCHKV = alloc((layout.num_slots, H, K, V), store_dtype, device) if store_states else None
    v_new_THV = alloc((T, H, V), store_dtype, device) if store_states else None
    if compute_output or k_THK.element_size() != 2 or block_size(K) > 128:
        # The serial pass writing the output, fp32 inputs, wide keys: the settings measured for them.
        block_v = min(config.block_v_state, block_size(V))
        num_warps, num_stages = config.num_warps, config.num_stages_state
        if compute_output and k_THK.dtype == torch.float32:
            num_stages = min(num_stages, kernels_common.GPU_NUM_STAGES_STATE_OUTPUT_FP32)
    else:
        block_v, num_warps, num_stages = state_fwd_launch(config, V, N * H, is_per_channel=g_cumsum.ndim == 3)
    dot_precision, _ = dot_precisions(k_THK.dtype)
    if N > 0:
        _chunk_state_fwd_kernel[(triton.cdiv(V, block_v), N, H)](
            q_THK,
            k_THK,
            w_THK,
            u_THV,
            g_cumsum,
            qk_THC if qk_THC is not None else w_THK,
            initial_state_NHKV if initial_state_NHKV is not None else w_THK,
            layout.cu_seqlens,
            layout.chunk_offsets,
            o_THV if compute_output else w_THK,
            final_state_NHKV if output_final_state else w_THK,
            states_NCHKV if store_states else w_THK,
            v_new_THV if store_states else w_THK,
            k_end_THK if k_end_THK is not None else w_THK,
            scale,
            H,
            K=K,
            V=V,
            IS_PER_CHANNEL=g_cumsum.ndim == 3,
            HAS_K_END=k_end_THK is not None,
            HAS_INITIAL_STATE=initial_state_NHKV is not None,
            STORE_FINAL_STATE=output_final_state,
            STORE_STATES=store_states,
            COMPUTE_OUTPUT=compute_output,
            USE_L2NORM=use_qk_l2norm,
            BT=layout.chunk_size,
            BK=block_size(K),
            BV=block_v,
            DOT_PRECISION=dot_precision,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return o_THV, final_state_NHKV, states_NCHKV, v_new_THV


def state_fwd_launch(config: KernelConfig, V: int, num_seq_heads: int, is_per_channel: bool) -> tuple[int, int, int]:
    """(V tile, warps, stages) of the forward's state-storing serial pass for 16-bit inputs with K up to 128: the
    widest of config.block_v_state_fwd (capped at V's tile) that gives at least config.min_state_programs programs
    (V tiles x sequence-heads), else the narrowest; 8 warps for KDA's tiles of 64 and up (GPU_BLOCK_V_STATE_FWD)."""
    tiles = [min(tile, block_size(V)) for tile in config.block_v_state_fwd]
    block_v = next((tile for tile in tiles if triton.cdiv(V, tile) * num_seq_heads >= config.min_state_programs),
                   tiles[-1])  # fmt: skip
    if is_per_channel:
        num_warps = config.num_warps_state_fwd_kda_wide if block_v >= 64 else config.num_warps
        return block_v, num_warps, config.num_stages_state_fwd_kda
    return block_v, config.num_warps, config.num_stages_state_fwd
