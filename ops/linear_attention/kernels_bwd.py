"""Triton backward of the chunked gated delta rule (one decay per head): three kernels and their launchers.

Legend as in kernels_common.py: T packed tokens, H heads, K key dim, V value dim, N sequences, C chunk length (BT),
NC chunk slots, G the log decay summed from the chunk start; per chunk S0 is the state entering it, S1 the state
leaving it, q is scaled (and L2-normalised when asked), M[i, j] = exp(G_i - G_j) for j <= i.

Forward of one chunk (kernels_wy.py, kernels_state.py, kernels_output.py): v_new = U - W S0;
o = (q exp(G)) S0 + (q k^T * M) v_new; S1 = exp(G_C) S0 + (k exp(G_C - G))^T v_new, with
W = (I + A)^-1 diag(beta exp(G)) k, U = (I + A)^-1 diag(beta) v.

The backward runs on the forward's WY pass and its state pass with per-chunk states stored (kernels_wy.chunk_wy_fwd,
kernels_state.chunk_state_fwd(store_states=True)): kept from the forward (save_intermediates) or else recomputed, then:
1. `_chunk_state_bwd_kernel`, serial over each sequence's chunks in reverse, the state gradient dS [K, BV] in
   registers (fp32): writes dS1 of every chunk, dv_new = (q k^T * M)^T do + (k exp(G_C - G)) dS1, and
   dS0 = exp(G_C) dS1 + (q exp(G))^T do - W^T dv_new, the initial state's gradient at each sequence start.
   With IS_PER_CHANNEL (KDA) the decays are [C, K] and (q k^T * M)^T is read transposed from KDA's pairs
   kernel. With HAS_PREPARED (power-of-two K) the loop reads q exp(G) and (per head) (q k^T * M) from
   `_prepare_state_bwd_kernel`, a parallel pass before it, and k exp(G_C - G) from the WY pass (KDA: its pairs
   kernel): no norm or exp left in the loop but exp(G_C) (H200, B4 T8192 H16 K=V=128 bf16: 0.62 ms against 1.21
   with them in the loop, KDA 0.69 against 1.65; gradients bitwise equal).
2. `_chunk_grad_output_kernel`, one program per (chunk, head), all in parallel: the output's part, dq (final) and
   fp32 parts of dk and dG from S0, v_new and do.
3. `_chunk_grad_wy_kernel`, one program per (chunk, head), all in parallel: dv, dbeta and the rest of dk and dG from
   S0, dS1, v_new and dv_new through the triangular inverse ((I + A)^-1 is read back, not re-solved), then dk through
   the L2 norm and dg (the reverse cumulative sum of dG plus the gradient of G_C). Kernels 2 and 3 as one kernel
   would carry six fp32 accumulators through its V loop with q and k loaded before it and spill 1,176 bytes of
   stack a thread (sm_90 compile, triton 3.6, K = V = 128); split, the output kernel spills nothing and the WY
   kernel 176 bytes, for one extra fp32 [T, H, K] round trip of dk's part.
   With KernelConfig.split_grad_wy two kernels take kernel 3's place: `_chunk_grad_state_kernel`, its state part
   (dW, v_new dS1^T and the gradient of G_C, from S0 and dS1), then `_chunk_grad_wy_tiled_kernel`, the rest with
   the key dimension in tiles of KernelConfig.block_k_grad_wy (one tile of the whole K by default), so that neither
   holds S0 or dS1 and the second holds no [C, K] tensor beyond its key tile (sm_90 compile of a bf16 K = V = 128
   launch, triton 3.6, 8 warps: the state kernel 172 registers, the WY part 254 in one key tile and 224 in tiles of
   64, none of them any stack, against kernel 3's 255 and 176 bytes of stack), for dW's [T, H, K] round trip in k's
   dtype, a second read of v_new and dv_new, k read three times and dk's unnormed fp32 round trip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention import kernels_common
from moe_tune.ops.linear_attention.kernels_common import (
    L2NORM_EPS,
    ChunkLayout,
    KernelConfig,
    block_size,
    dot_precisions,
    l2norm_factors,
    l2norm_rows,
    load_decay,
    load_chunk_state_t,
    load_decays,
    load_rows,
    load_rows_t,
    load_state_decay,
    pair_decay,
    store_rows,
)


@triton.jit
def _chunk_state_bwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    g_cumsum_ptr,
    qk_ptr,
    k_end_ptr,
    q_dec_ptr,
    do_ptr,
    final_state_grad_ptr,
    cu_seqlens_ptr,
    chunk_offsets_ptr,
    initial_state_grad_ptr,
    state_grads_ptr,
    dv_new_ptr,
    scale,
    H,
    K,
    V,
    IS_PER_CHANNEL: tl.constexpr,
    HAS_PREPARED: tl.constexpr,
    HAS_FINAL_STATE_GRAD: tl.constexpr,
    STORE_INITIAL_STATE_GRAD: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
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

    if HAS_FINAL_STATE_GRAD:
        dstate = tl.load(final_state_grad_ptr + seq_head + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    else:
        dstate = tl.zeros([BK, BV], dtype=tl.float32)

    for i_r in range(0, num_chunks):
        i_t = num_chunks - 1 - i_r
        t0 = bos + i_t * BT
        num_valid = tl.minimum(eos - t0, BT)
        slot_head = ((first_slot + i_t) * H + i_h).to(tl.int64) * K * V
        dstate_out = dstate.to(state_grads_ptr.dtype.element_ty)
        tl.store(state_grads_ptr + slot_head + state_offsets, dstate_out, mask=state_mask)
        do = load_rows(do_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        if HAS_PREPARED:
            # The decayed operands from parallel passes (prepare_state_bwd, the WY pass's k exp(G_C - G)): no norm
            # and no exp in the loop but exp(G_C).
            state_decay = load_state_decay(g_cumsum_ptr, i_h, t0 + num_valid - 1, H, K, IS_PER_CHANNEL, BK)
            kq = load_rows_t(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
            k_decayed = load_rows(k_end_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        else:
            decay, decay_to_end, state_decay, G = load_decays(
                g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL, BT, BK
            )
            q = l2norm_rows(load_rows(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM) * scale
            k = l2norm_rows(load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
            # (q k^T * M)^T as [j, i]: read transposed (per channel), or k q^T times M^T.
            if IS_PER_CHANNEL:
                kq = load_rows_t(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
            else:
                kq = tl.dot(k.to(dot_dtype), tl.trans(q.to(dot_dtype)), input_precision=DOT_PRECISION)
                kq = (kq * pair_decay(G, True, True, BT)).to(dot_dtype)
            k_decayed = (k * decay_to_end).to(dot_dtype)
        dv_new = tl.dot(kq, do, input_precision=DOT_PRECISION)
        dv_new += tl.dot(k_decayed, dstate.to(dot_dtype), input_precision=DOT_PRECISION)
        store_rows(dv_new_ptr + i_h * V + v0, dv_new, t0, num_valid, H * V, V - v0, BT, BV)
        if HAS_PREPARED:
            q_t = load_rows_t(q_dec_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
        else:
            q_t = load_rows_t(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
            if USE_L2NORM:
                q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, axis=0) + L2NORM_EPS)[None, :]
            q_t = q_t * scale
            if IS_PER_CHANNEL:
                q_t = q_t * tl.trans(decay)
            else:
                q_t = q_t * tl.exp(G)[None, :]
        # The state update reads (q exp(G))^T and W^T transposed from memory and dv_new back from where it was just
        # stored (an L2-resident round trip). With them from registers (dv_new a dot result, q and W transposed with
        # tl.trans), Triton 3.6 on the H200 gave state gradients that changed from run to run (up to 48% off) and
        # illegal addresses at 110 documents; so did reusing the transposed q tile for k q^T. The round trip's form
        # gives bit-equal repeated runs on the device (tests/gpu/test_linear_attention_gpu.py). dv_new alone from
        # registers (q and W still read transposed) is no faster and its fp32 launch overflows Hopper's shared memory
        # (docs/PERF.md, "Launch candidates on an H100").
        tl.debug_barrier()
        dv_new_mem = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        w_t = load_rows_t(w_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        dstate = dstate * state_decay + tl.dot(q_t.to(dot_dtype), do, input_precision=DOT_PRECISION)
        dstate -= tl.dot(w_t, dv_new_mem, input_precision=DOT_PRECISION)

    if STORE_INITIAL_STATE_GRAD:
        tl.store(initial_state_grad_ptr + seq_head + state_offsets, dstate, mask=state_mask)


@triton.jit
def _prepare_state_bwd_kernel(
    q_ptr,
    k_ptr,
    g_cumsum_ptr,
    chunk_map_ptr,
    q_dec_ptr,
    qk_ptr,
    scale,
    H,
    K,
    IS_PER_CHANNEL: tl.constexpr,
    STORE_QK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (chunk slot, head), in parallel: the reverse serial pass's q exp(G) (q scaled, normed when asked; per
    channel for KDA) and, with STORE_QK (per-head decay), the decayed causal q k^T [C, C] its dv_new reads (KDA's
    comes from the pairs kernel)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    decay, _, _, G = load_decays(g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL, BT, BK)
    q = l2norm_rows(load_rows(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM) * scale
    store_rows(q_dec_ptr + i_h * K, q * decay, t0, num_valid, H * K, K, BT, BK)
    if STORE_QK:
        k = l2norm_rows(load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
        # decayed_qk's two lines, written out: through it this kernel compiled to other sm_90 code (the same
        # operations scheduled otherwise) than the binary checked on the H200; the forward's kernels compile alike.
        qk = tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)
        store_rows(qk_ptr + i_h * BT, qk * pair_decay(G, True, False, BT), t0, num_valid, H * BT, BT, BT, BT)


@triton.jit
def output_grad_products(states_ptr, v_new_ptr, do_ptr, i_c, i_h, t0, num_valid, H, K, V, k0, dot_dtype,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):  # fmt: skip
    """For o = (q exp(G)) S0 + P v_new of one (chunk slot, head), accumulated over V tiles, on the key tile of BK
    columns from k0 (0 and the whole K for the per-(chunk, head) kernels): do S0^T [BT, BK] and do v_new^T [BT, BT] in
    both orientations (P's gradient before its decays and mask, the same for every key tile; the transpose as its
    own dot, not tl.trans of a dot result). The states are read transposed, [BV, BK]: written out here rather than
    through load_chunk_state_t, with which KDA's gradient products kernel compiled to another sm_90 binary (11,048
    instructions, 568 bytes of stack) than the one run on the H200 (11,064, 608)."""
    offs_k = k0 + tl.arange(0, BK)
    slot_head = (i_c * H + i_h).to(tl.int64) * K * V
    has_chunk = num_valid > 0
    do_state = tl.zeros([BT, BK], dtype=tl.float32)
    dqk = tl.zeros([BT, BT], dtype=tl.float32)
    dqk_t = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        state_t_offsets = offs_k[None, :] * V + offs_v[:, None]
        state_t_mask = (offs_k[None, :] < K) & (offs_v[:, None] < V) & has_chunk
        state_t = tl.load(states_ptr + slot_head + state_t_offsets, mask=state_t_mask, other=0.0).to(dot_dtype)
        v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        do = load_rows(do_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        do_state += tl.dot(do, state_t, input_precision=DOT_PRECISION)
        dqk += tl.dot(do, tl.trans(v_new), input_precision=DOT_PRECISION)
        dqk_t += tl.dot(v_new, tl.trans(do), input_precision=DOT_PRECISION)
    return do_state, dqk, dqk_t


@triton.jit
def _chunk_grad_output_kernel(
    q_ptr,
    k_ptr,
    g_cumsum_ptr,
    states_ptr,
    v_new_ptr,
    do_ptr,
    chunk_map_ptr,
    dq_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    scale,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The output's part of one (chunk, head): dq (final), and dk and dG from o = (q exp(G)) S0 + (q k^T * M) v_new
    (fp32, before the L2 norm; the WY kernel adds the rest)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    token_head = (t0 + rows).to(tl.int64) * H + i_h
    G, _ = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)

    do_state, dqk, dqk_t = output_grad_products(states_ptr, v_new_ptr, do_ptr, i_c, i_h, t0, num_valid, H, K, V, 0,
                                                dot_dtype, BT, BK, BV, DOT_PRECISION)  # fmt: skip

    q = load_rows(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    k = load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        q_rstd = tl.rsqrt(tl.sum(q * q, axis=1) + L2NORM_EPS)
        q = q * q_rstd[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    q_scaled = q * scale
    q_dot = q_scaled.to(dot_dtype)
    k_dot = k.to(dot_dtype)
    dq = do_state * tl.exp(G)[:, None]
    dG = tl.sum(q_scaled * dq, axis=1)
    dqk = dqk * pair_decay(G, True, False, BT)
    dqk_t = dqk_t * pair_decay(G, True, True, BT)
    dq += tl.dot(dqk.to(dot_dtype), k_dot, input_precision=DOT_PRECISION)
    dk = tl.dot(dqk_t.to(dot_dtype), q_dot, input_precision=DOT_PRECISION)
    qk = tl.dot(q_dot, tl.trans(k_dot), input_precision=DOT_PRECISION)
    dG_pairs = dqk * qk
    dG += tl.sum(dG_pairs, axis=1) - tl.sum(dG_pairs, axis=0)

    dq = dq * scale
    if USE_L2NORM:
        dq = (dq - q * tl.sum(q * dq, axis=1)[:, None]) * q_rstd[:, None]
    store_rows(dq_ptr + i_h * K, dq, t0, num_valid, H * K, K, BT, BK)
    store_rows(dk_partial_ptr + i_h * K, dk, t0, num_valid, H * K, K, BT, BK)
    tl.store(dG_partial_ptr + token_head, dG, mask=rows < num_valid)


@triton.jit
def _chunk_grad_state_kernel(
    k_ptr,
    g_cumsum_ptr,
    states_ptr,
    state_grads_ptr,
    v_new_ptr,
    dv_new_ptr,
    chunk_map_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dw_ptr,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The state's part of one (chunk, head), between the output kernel and the WY kernel (split_grad_wy): from S0,
    dS1, v_new and dv_new, dW (stored in k's dtype, the precision the WY kernel multiplies it in) and the gradient
    through S1 = exp(G_C) S0 + (k exp(G_C - G))^T v_new, added into the output kernel's fp32 parts: its dk to dk's,
    its dG to dG's, and G_C's gradient to the chunk's last token's dG (dg sums dG from each token to the chunk's end,
    so every token of the chunk gets it)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h
    G, G_last = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)

    dk_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    state_dstate = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        state_t = load_chunk_state_t(states_ptr, i_c, i_h, num_valid, H, K, V, v0, BK, BV).to(dot_dtype)
        dstate_t = load_chunk_state_t(state_grads_ptr, i_c, i_h, num_valid, H, K, V, v0, BK, BV).to(dot_dtype)
        v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        dv_new = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        dk_end += tl.dot(v_new, dstate_t, input_precision=DOT_PRECISION)
        dw -= tl.dot(dv_new, state_t, input_precision=DOT_PRECISION)
        state_dstate += tl.sum(state_t.to(tl.float32) * dstate_t.to(tl.float32), axis=0)
    store_rows(dw_ptr + i_h * K, dw, t0, num_valid, H * K, K, BT, BK)

    k = load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    dk_end = dk_end * tl.exp(G_last - G)[:, None]
    dG_end = tl.sum(k * dk_end, axis=1)
    dG_last = tl.sum(dG_end, axis=0) + tl.exp(G_last) * tl.sum(state_dstate, axis=0)
    dk = load_rows(dk_partial_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK) + dk_end
    store_rows(dk_partial_ptr + i_h * K, dk, t0, num_valid, H * K, K, BT, BK)
    dG = tl.load(dG_partial_ptr + token_head, mask=is_valid, other=0.0) - dG_end
    dG += tl.where(rows == num_valid - 1, dG_last, 0.0)
    tl.store(dG_partial_ptr + token_head, dG, mask=is_valid)


@triton.jit
def _chunk_grad_output_state_kernel(
    q_ptr,
    k_ptr,
    g_cumsum_ptr,
    states_ptr,
    state_grads_ptr,
    v_new_ptr,
    do_ptr,
    dv_new_ptr,
    chunk_map_ptr,
    dq_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dw_ptr,
    scale,
    T,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    NORM_DQ: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_chunk_grad_output_kernel` and `_chunk_grad_state_kernel` in one pass over V, for one key tile of BK columns
    (program axis 2) of one (chunk, head) (split_grad_wy with grad_state_in_output): each S0 and dS1 element read
    once. Per tile: dW in k's dtype; dk (fp32, before the L2 norm) from o = (q exp(G)) S0 + (q k^T * M) v_new and from
    S1 = exp(G_C) S0 + (k exp(G_C - G))^T v_new; dq, final without USE_L2NORM or with NORM_DQ (one tile of the whole K,
    taken through q's norm here), otherwise fp32 before the norm (the WY kernel takes it through); and the tile's
    share of dG (sums over the key dimension, G_C's gradient on the chunk's last token) into its own row of
    dG_partial [NK, T, H], which the WY kernel sums. q k^T's pair gradient
    dqk depends on no key tile: each tile computes it."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    k0 = i_k * BK
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h
    G, G_last = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)

    offs_k = k0 + tl.arange(0, BK)
    slot_head = (i_c * H + i_h).to(tl.int64) * K * V
    has_chunk = num_valid > 0
    do_state = tl.zeros([BT, BK], dtype=tl.float32)
    dqk = tl.zeros([BT, BT], dtype=tl.float32)
    dqk_t = tl.zeros([BT, BT], dtype=tl.float32)
    dk_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    state_dstate = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        # The key tile's rows of S0 and dS1, read transposed: [BV, BK].
        offs_v = v0 + tl.arange(0, BV)
        state_t_offsets = offs_k[None, :] * V + offs_v[:, None]
        state_t_mask = (offs_k[None, :] < K) & (offs_v[:, None] < V) & has_chunk
        state_t = tl.load(states_ptr + slot_head + state_t_offsets, mask=state_t_mask, other=0.0).to(dot_dtype)
        dstate_t = tl.load(state_grads_ptr + slot_head + state_t_offsets, mask=state_t_mask, other=0.0)
        dstate_t = dstate_t.to(dot_dtype)
        v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        do = load_rows(do_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        dv_new = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        do_state += tl.dot(do, state_t, input_precision=DOT_PRECISION)
        dqk += tl.dot(do, tl.trans(v_new), input_precision=DOT_PRECISION)
        dqk_t += tl.dot(v_new, tl.trans(do), input_precision=DOT_PRECISION)
        dk_end += tl.dot(v_new, dstate_t, input_precision=DOT_PRECISION)
        dw -= tl.dot(dv_new, state_t, input_precision=DOT_PRECISION)
        state_dstate += tl.sum(state_t.to(tl.float32) * dstate_t.to(tl.float32), axis=0)
    store_rows(dw_ptr + i_h * K + k0, dw, t0, num_valid, H * K, K - k0, BT, BK)

    q_rstd, k_rstd = l2norm_factors(q_ptr + i_h * K, k_ptr + i_h * K, t0, num_valid, H * K, K, USE_L2NORM, BT, BK)
    q = load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32) * q_rstd[:, None]
    k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32) * k_rstd[:, None]
    q_scaled = q * scale
    q_dot = q_scaled.to(dot_dtype)
    k_dot = k.to(dot_dtype)
    dq = do_state * tl.exp(G)[:, None]
    dG = tl.sum(q_scaled * dq, axis=1)
    dqk = dqk * pair_decay(G, True, False, BT)
    dqk_t = dqk_t * pair_decay(G, True, True, BT)
    dq += tl.dot(dqk.to(dot_dtype), k_dot, input_precision=DOT_PRECISION)
    qk = tl.dot(q_dot, tl.trans(k_dot), input_precision=DOT_PRECISION)
    dG_pairs = dqk * qk
    dG += tl.sum(dG_pairs, axis=1) - tl.sum(dG_pairs, axis=0)
    if NORM_DQ:
        dq = dq * scale
        dq = (dq - q * tl.sum(q * dq, axis=1)[:, None]) * q_rstd[:, None]
        store_rows(dq_ptr + i_h * K + k0, dq, t0, num_valid, H * K, K - k0, BT, BK)
    else:
        store_rows(dq_ptr + i_h * K + k0, dq * scale, t0, num_valid, H * K, K - k0, BT, BK)

    dk_end = dk_end * tl.exp(G_last - G)[:, None]
    dG_end = tl.sum(k * dk_end, axis=1)
    dG_last = tl.sum(dG_end, axis=0) + tl.exp(G_last) * tl.sum(state_dstate, axis=0)
    dk = tl.dot(dqk_t.to(dot_dtype), q_dot, input_precision=DOT_PRECISION) + dk_end
    store_rows(dk_partial_ptr + i_h * K + k0, dk, t0, num_valid, H * K, K - k0, BT, BK)
    dG = dG - dG_end + tl.where(rows == num_valid - 1, dG_last, 0.0)
    tl.store(dG_partial_ptr + i_k.to(tl.int64) * T * H + token_head, dG, mask=is_valid)


@triton.jit
def _chunk_grad_wy_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    g_cumsum_ptr,
    inverse_ptr,
    states_ptr,
    state_grads_ptr,
    v_new_ptr,
    dv_new_ptr,
    chunk_map_ptr,
    scratch_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dk_ptr,
    dv_ptr,
    dbeta_ptr,
    dg_ptr,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The rest of one (chunk, head), after the output kernel: the state leaving the chunk and the WY factors give
    dv, dbeta and their parts of dk and dG; with the output kernel's parts added, dk through the L2 norm and dg."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h

    G, G_last = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
    exp_G = tl.exp(G)
    beta = tl.load(beta_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)
    inverse_t = load_rows_t(inverse_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)

    offs_k = tl.arange(0, BK)
    slot_head = (i_c * H + i_h).to(tl.int64) * K * V
    has_chunk = num_valid > 0
    # Accumulated over V tiles: v_new dS1^T, dW, the U part of d(I + A)^-1, the v part of dbeta, and sum(S0 * dS1)
    # per key row.
    dk_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    dinverse = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    state_dstate = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        # States and their gradients read transposed; written out here rather than through load_chunk_state_t,
        # which compiled this kernel to a different (if equivalent) sm_90 binary than the one tested on the H200.
        offs_v = v0 + tl.arange(0, BV)
        state_t_offsets = offs_k[None, :] * V + offs_v[:, None]
        state_t_mask = (offs_k[None, :] < K) & (offs_v[:, None] < V) & has_chunk
        state_t = tl.load(states_ptr + slot_head + state_t_offsets, mask=state_t_mask, other=0.0).to(dot_dtype)
        dstate_t = tl.load(state_grads_ptr + slot_head + state_t_offsets, mask=state_t_mask, other=0.0)
        dstate_t = dstate_t.to(dot_dtype)
        v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        dv_new = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        v = load_rows(v_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        dk_end += tl.dot(v_new, dstate_t, input_precision=DOT_PRECISION)
        dw -= tl.dot(dv_new, state_t, input_precision=DOT_PRECISION)
        v_scaled = (v * beta[:, None]).to(dot_dtype)
        dinverse += tl.dot(dv_new, tl.trans(v_scaled), input_precision=DOT_PRECISION)
        # d(diag(beta) v) = ((I + A)^-1)^T dU, and dU = dv_new.
        dv_scaled = tl.dot(inverse_t, dv_new, input_precision=DOT_PRECISION)
        store_rows(dv_ptr + i_h * V + v0, dv_scaled * beta[:, None], t0, num_valid, H * V, V - v0, BT, BV)
        dbeta += tl.sum(v * dv_scaled, axis=1)
        state_dstate += tl.sum(state_t.to(tl.float32) * dstate_t.to(tl.float32), axis=0)

    k = load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        k_rstd = tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)
        k = k * k_rstd[:, None]
    k_dot = k.to(dot_dtype)

    # State leaving the chunk: S1 = exp(G_C) S0 + (k exp(G_C - G))^T v_new.
    dk_end = dk_end * tl.exp(G_last - G)[:, None]
    dG_end = tl.sum(k * dk_end, axis=1)
    dG = tl.load(dG_partial_ptr + token_head, mask=is_valid, other=0.0) - dG_end
    dG_last = tl.sum(dG_end, axis=0) + tl.exp(G_last) * tl.sum(state_dstate, axis=0)

    # WY factors: W = (I + A)^-1 diag(beta exp(G)) k, U = (I + A)^-1 diag(beta) v, d(I + A)^-1 = dW K'^T + dU V'^T.
    k_scaled = (k * (beta * exp_G)[:, None]).to(dot_dtype)
    dw_dot = dw.to(dot_dtype)
    dk_scaled = tl.dot(inverse_t, dw_dot, input_precision=DOT_PRECISION)
    dinverse += tl.dot(dw_dot, tl.trans(k_scaled), input_precision=DOT_PRECISION)
    # dA = -(I + A)^-T d(I + A)^-1 (I + A)^-T, strictly lower; times exp(G_i - G_j) it is the gradient of k_i^T k_j.
    dA = tl.dot(inverse_t, dinverse.to(dot_dtype), input_precision=DOT_PRECISION)
    dA = -tl.dot(dA.to(dot_dtype), inverse_t, input_precision=DOT_PRECISION)
    dkk = dA * pair_decay(G, False, False, BT)
    kk = tl.dot(k_dot, tl.trans(k_dot), input_precision=DOT_PRECISION)
    dbeta += tl.sum(dkk * kk, axis=1)
    dkk = dkk * beta[:, None]
    dG_pairs = dkk * kk
    dG += tl.sum(dG_pairs, axis=1) - tl.sum(dG_pairs, axis=0)
    # dkk^T goes through memory (an L2-resident round trip): tl.trans of a dot result is the Hopper miscompile.
    store_rows(scratch_ptr + i_h * BT, dkk, t0, num_valid, H * BT, BT, BT, BT)
    tl.debug_barrier()
    dkk_t = load_rows_t(scratch_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
    dk = dk_end + tl.dot(dkk.to(dot_dtype), k_dot, input_precision=DOT_PRECISION)
    dk += tl.dot(dkk_t, k_dot, input_precision=DOT_PRECISION)
    k_dk_scaled = tl.sum(k * dk_scaled, axis=1)
    dk += dk_scaled * (beta * exp_G)[:, None]
    dbeta += exp_G * k_dk_scaled
    dG += beta * exp_G * k_dk_scaled

    dk += load_rows(dk_partial_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)

    # G is the cumulative sum of g: dg_t = sum over i >= t of dG_i, and every token feeds G_C.
    dg = tl.cumsum(dG, axis=0, reverse=True) + dG_last
    if USE_L2NORM:
        dk = (dk - k * tl.sum(k * dk, axis=1)[:, None]) * k_rstd[:, None]
    store_rows(dk_ptr + i_h * K, dk, t0, num_valid, H * K, K, BT, BK)
    tl.store(dbeta_ptr + token_head, dbeta.to(dbeta_ptr.dtype.element_ty), mask=is_valid)
    tl.store(dg_ptr + token_head, dg.to(dg_ptr.dtype.element_ty), mask=is_valid)


@triton.jit
def _chunk_grad_wy_tiled_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    g_cumsum_ptr,
    inverse_ptr,
    dv_new_ptr,
    chunk_map_ptr,
    scratch_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dw_ptr,
    dq_partial_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    dbeta_ptr,
    dg_ptr,
    T,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    NUM_DG_PARTS: tl.constexpr,
    NORM_DQ: tl.constexpr,
    NORM_ONE_PASS: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_chunk_grad_wy_kernel`'s work after `_chunk_grad_state_kernel` (split_grad_wy: dW read from dw_ptr, the
    state's parts of dk and dG already in the output kernel's), the key dimension in tiles of BK. The K loops: the
    keys' squared norms; d(I + A)^-1's W part, k k^T and sum(k * dK') (K' the scaled keys); then, after dA, dk per
    tile, stored unnormed into the fp32 dk_partial buffer (the output and state kernels' parts already in it) with
    sum(k * dk) accumulated, and with USE_L2NORM a last loop taking dk through the norm. dG's earlier parts are the
    sum of NUM_DG_PARTS rows of dG_partial [NUM_DG_PARTS, T, H]; with NORM_DQ (and USE_L2NORM) the last loop also
    takes the fp32 dq_partial through q's norm into dq. With NORM_ONE_PASS (and USE_L2NORM) the last loop is dq's
    alone: sum(k * dk) is known before the dk loop, which takes dk through its norm as it goes: the pairs' terms
    from k k^T (sum_c k_ic (dkk k)_ic = sum_j dkk_ij (k k^T)_ij, the other orientation by columns), the scaled keys'
    from sum(k * dK'), the earlier kernels' from a read of their parts in the norms' loop."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h

    G, _ = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
    exp_G = tl.exp(G)
    beta = tl.load(beta_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)
    inverse_t = load_rows_t(inverse_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)

    # U's part: d(I + A)^-1 = dU V'^T with dU = dv_new, V' = diag(beta) v; dv and dbeta's v part.
    dinverse = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        dv_new = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        v = load_rows(v_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        v_scaled = (v * beta[:, None]).to(dot_dtype)
        dinverse += tl.dot(dv_new, tl.trans(v_scaled), input_precision=DOT_PRECISION)
        dv_scaled = tl.dot(inverse_t, dv_new, input_precision=DOT_PRECISION)
        store_rows(dv_ptr + i_h * V + v0, dv_scaled * beta[:, None], t0, num_valid, H * V, V - v0, BT, BV)
        dbeta += tl.sum(v * dv_scaled, axis=1)

    k_rstd = tl.full([BT], 1.0, dtype=tl.float32)
    q_rstd = tl.full([BT], 1.0, dtype=tl.float32)
    q_dq = tl.zeros([BT], dtype=tl.float32)
    k_dk_partial = tl.zeros([BT], dtype=tl.float32)
    if USE_L2NORM:
        squares = tl.zeros([BT], dtype=tl.float32)
        q_squares = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
            squares += tl.sum(k * k, axis=1)
            if NORM_ONE_PASS:
                dk = load_rows(dk_partial_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
                k_dk_partial += tl.sum(k * dk, axis=1)
            if NORM_DQ:
                q = load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
                dq = load_rows(dq_partial_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
                q_squares += tl.sum(q * q, axis=1)
                q_dq += tl.sum(q * dq, axis=1)
        k_rstd = tl.rsqrt(squares + L2NORM_EPS)
        q_rstd = tl.rsqrt(q_squares + L2NORM_EPS)

    # W's part of d(I + A)^-1 (dW K'^T, K' = diag(beta exp(G)) k), k k^T and sum(k * (I + A)^-T dW) per row.
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    k_dk_scaled = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32) * k_rstd[:, None]
        k_dot = k.to(dot_dtype)
        dw_dot = load_rows(dw_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(dot_dtype)
        k_scaled = (k * (beta * exp_G)[:, None]).to(dot_dtype)
        dinverse += tl.dot(dw_dot, tl.trans(k_scaled), input_precision=DOT_PRECISION)
        kk += tl.dot(k_dot, tl.trans(k_dot), input_precision=DOT_PRECISION)
        dk_scaled = tl.dot(inverse_t, dw_dot, input_precision=DOT_PRECISION)
        k_dk_scaled += tl.sum(k * dk_scaled, axis=1)

    # dA = -(I + A)^-T d(I + A)^-1 (I + A)^-T, strictly lower; times exp(G_i - G_j) it is the gradient of k_i^T k_j.
    dG = tl.zeros([BT], dtype=tl.float32)
    for part in tl.static_range(NUM_DG_PARTS):
        dG += tl.load(dG_partial_ptr + T.to(tl.int64) * H * part + token_head, mask=is_valid, other=0.0)
    dA = tl.dot(inverse_t, dinverse.to(dot_dtype), input_precision=DOT_PRECISION)
    dA = -tl.dot(dA.to(dot_dtype), inverse_t, input_precision=DOT_PRECISION)
    dkk = dA * pair_decay(G, False, False, BT)
    dbeta += tl.sum(dkk * kk, axis=1)
    dkk = dkk * beta[:, None]
    dG_pairs = dkk * kk
    dG += tl.sum(dG_pairs, axis=1) - tl.sum(dG_pairs, axis=0)
    # dkk^T goes through memory (an L2-resident round trip): tl.trans of a dot result is the Hopper miscompile.
    store_rows(scratch_ptr + i_h * BT, dkk, t0, num_valid, H * BT, BT, BT, BT)
    tl.debug_barrier()
    dkk_t = load_rows_t(scratch_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
    dkk_dot = dkk.to(dot_dtype)
    dbeta += exp_G * k_dk_scaled
    dG += beta * exp_G * k_dk_scaled

    # dk per key tile: the pairs' terms, the scaled keys' term and the earlier kernels' parts; then the norm.
    k_dk = tl.zeros([BT], dtype=tl.float32)
    if NORM_ONE_PASS:
        kk_dkk = dkk_dot.to(tl.float32) * kk
        k_dk = tl.sum(kk_dkk, axis=1) + tl.sum(kk_dkk, axis=0) + beta * exp_G * k_dk_scaled + k_rstd * k_dk_partial
    for k0 in range(0, K, BK):
        k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32) * k_rstd[:, None]
        k_dot = k.to(dot_dtype)
        dw_dot = load_rows(dw_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(dot_dtype)
        dk_scaled = tl.dot(inverse_t, dw_dot, input_precision=DOT_PRECISION)
        dk = tl.dot(dkk_dot, k_dot, input_precision=DOT_PRECISION)
        dk += tl.dot(dkk_t, k_dot, input_precision=DOT_PRECISION)
        dk += dk_scaled * (beta * exp_G)[:, None]
        dk += load_rows(dk_partial_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
        if USE_L2NORM and NORM_ONE_PASS:
            dk = (dk - k * k_dk[:, None]) * k_rstd[:, None]
            store_rows(dk_ptr + i_h * K + k0, dk, t0, num_valid, H * K, K - k0, BT, BK)
        elif USE_L2NORM:
            k_dk += tl.sum(k * dk, axis=1)
            store_rows(dk_partial_ptr + i_h * K + k0, dk, t0, num_valid, H * K, K - k0, BT, BK)
        else:
            store_rows(dk_ptr + i_h * K + k0, dk, t0, num_valid, H * K, K - k0, BT, BK)
    # The last loop: dk through its norm (unless done above), dq through q's.
    if USE_L2NORM and not (NORM_ONE_PASS and not NORM_DQ):
        if not NORM_ONE_PASS:
            # dk_partial's tiles were just stored by other threads of this program.
            tl.debug_barrier()
        for k0 in range(0, K, BK):
            if not NORM_ONE_PASS:
                k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
                k = k * k_rstd[:, None]
                dk = load_rows(dk_partial_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
                dk = (dk - k * k_dk[:, None]) * k_rstd[:, None]
                store_rows(dk_ptr + i_h * K + k0, dk, t0, num_valid, H * K, K - k0, BT, BK)
            if NORM_DQ:
                # q^ = q q_rstd: dq = (dq' - q^ sum(q^ dq')) q_rstd, and sum(q^ dq') = q_rstd sum(q dq').
                q = load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
                dq = load_rows(dq_partial_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
                dq = (dq - q * (q_rstd * q_rstd * q_dq)[:, None]) * q_rstd[:, None]
                store_rows(dq_ptr + i_h * K + k0, dq, t0, num_valid, H * K, K - k0, BT, BK)

    # G is the cumulative sum of g: dg_t = sum over i >= t of dG_i (G_C's gradient is in the last token's dG).
    dg = tl.cumsum(dG, axis=0, reverse=True)
    tl.store(dbeta_ptr + token_head, dbeta.to(dbeta_ptr.dtype.element_ty), mask=is_valid)
    tl.store(dg_ptr + token_head, dg.to(dg_ptr.dtype.element_ty), mask=is_valid)


def chunk_state_bwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    w_THK: torch.Tensor,
    g_cumsum: torch.Tensor,
    do_THV: torch.Tensor,
    final_state_grad_NHKV: torch.Tensor | None,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    initial_state_grad_dtype: torch.dtype | None,
    qk_THC: torch.Tensor | None = None,
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The reverse serial pass: dS1 of every chunk [NC, H, K, V] and dv_new [T, H, V] (fp32 for fp32 inputs, else
    k's dtype), and the initial state's gradient [N, H, K, V] when initial_state_grad_dtype is given.

    g_cumsum: [T, H] per head, or [T, H, K] per channel (KDA), with qk_THC the decayed causal q k^T of kda_wy_fwd.
    prepared: (k exp(G_C - G) from the WY pass, then prepare_state_bwd's q exp(G) and decayed causal q k^T): the
    loop reads them instead of norming q and k and building the decays itself.
    """
    T, H, K = k_THK.shape
    V = do_THV.shape[-1]
    N = layout.num_seqs
    device = k_THK.device
    state_grads_NCHKV = kernels_common.alloc((layout.num_slots, H, K, V), k_THK.dtype, device)
    dv_new_THV = kernels_common.alloc((T, H, V), k_THK.dtype, device)
    initial_state_grad_NHKV = None
    if initial_state_grad_dtype is not None:
        initial_state_grad_NHKV = kernels_common.alloc((N, H, K, V), initial_state_grad_dtype, device)
    block_v = min(config.block_v_state, block_size(V))
    dot_precision, _ = dot_precisions(k_THK.dtype)
    if prepared is not None:
        k_end_THK, q_dec_THK, qk_THC = prepared
    if N > 0:
        _chunk_state_bwd_kernel[(triton.cdiv(V, block_v), N, H)](
            q_THK,
            k_THK,
            w_THK,
            g_cumsum,
            qk_THC if qk_THC is not None else w_THK,
            k_end_THK if prepared is not None else w_THK,
            q_dec_THK if prepared is not None else w_THK,
            do_THV,
            final_state_grad_NHKV if final_state_grad_NHKV is not None else w_THK,
            layout.cu_seqlens,
            layout.chunk_offsets,
            initial_state_grad_NHKV if initial_state_grad_NHKV is not None else w_THK,
            state_grads_NCHKV,
            dv_new_THV,
            scale,
            H,
            K=K,
            V=V,
            IS_PER_CHANNEL=g_cumsum.ndim == 3,
            HAS_PREPARED=prepared is not None,
            HAS_FINAL_STATE_GRAD=final_state_grad_NHKV is not None,
            STORE_INITIAL_STATE_GRAD=initial_state_grad_NHKV is not None,
            USE_L2NORM=use_qk_l2norm,
            BT=layout.chunk_size,
            BK=block_size(K),
            BV=block_v,
            DOT_PRECISION=dot_precision,
            num_warps=config.num_warps,
            num_stages=config.num_stages_state,
        )
    return state_grads_NCHKV, dv_new_THV, initial_state_grad_NHKV


def prepare_state_bwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    g_cumsum: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    store_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q exp(G) [T, H, K] (q scaled, L2-normed when asked; G per head [T, H] or per channel [T, H, K]) and, when
    store_qk, the decayed causal q k^T [T, H, C] (per head), in k's dtype: chunk_state_bwd's prepared operands."""
    T, H, K = k_THK.shape
    C = layout.chunk_size
    q_dec_THK = kernels_common.alloc((T, H, K), k_THK.dtype, k_THK.device)
    qk_THC = kernels_common.alloc((T, H, C), k_THK.dtype, k_THK.device) if store_qk else None
    dot_precision, _ = dot_precisions(k_THK.dtype)
    if layout.num_slots > 0:
        _prepare_state_bwd_kernel[(layout.num_slots, H)](
            q_THK,
            k_THK,
            g_cumsum,
            layout.chunk_map,
            q_dec_THK,
            qk_THC if store_qk else q_dec_THK,
            scale,
            H,
            K=K,
            IS_PER_CHANNEL=g_cumsum.ndim == 3,
            STORE_QK=store_qk,
            USE_L2NORM=use_qk_l2norm,
            BT=C,
            BK=block_size(K),
            DOT_PRECISION=dot_precision,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return q_dec_THK, qk_THC


def chunk_grad(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_dtype: torch.dtype,
    beta_TH: torch.Tensor,
    g_cumsum_TH: torch.Tensor,
    inverse_THC: torch.Tensor,
    states_NCHKV: torch.Tensor,
    state_grads_NCHKV: torch.Tensor,
    v_new_THV: torch.Tensor,
    dv_new_THV: torch.Tensor,
    do_THV: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk [T, H, K], dv [T, H, V] in q's dtype; dbeta [T, H] in beta's dtype and dg [T, H] in g_dtype."""
    T, H, K = k_THK.shape
    V = v_THV.shape[-1]
    C = layout.chunk_size
    device = k_THK.device
    dq_THK = kernels_common.alloc((T, H, K), q_THK.dtype, device)
    dk_THK = kernels_common.alloc((T, H, K), k_THK.dtype, device)
    dv_THV = kernels_common.alloc((T, H, V), v_THV.dtype, device)
    dbeta_TH = kernels_common.alloc((T, H), beta_TH.dtype, device)
    dg_TH = kernels_common.alloc((T, H), g_dtype, device)
    scratch_THC = kernels_common.alloc((T, H, C), k_THK.dtype, device)
    # The output kernel's parts of dk and dG, fp32, summed into the WY kernel's; with grad_state_in_output, one row
    # of dG parts per key tile of block_k_grad_output, and with the L2 norm dq before it, fp32.
    fused = config.split_grad_wy and config.grad_state_in_output
    block_k_output = min(config.block_k_grad_output or block_size(K), block_size(K)) if fused else block_size(K)
    num_k_tiles = triton.cdiv(K, block_k_output)
    dk_partial_THK = kernels_common.alloc((T, H, K), torch.float32, device)
    dG_partial_NTH = kernels_common.alloc((num_k_tiles, T, H), torch.float32, device)
    # With the L2 norm, dq goes through it in the output kernel when that kernel has the whole key dimension and
    # grad_dq_norm_in_output asks for it, else in the WY kernel from fp32.
    norm_dq_in_output = fused and use_qk_l2norm and num_k_tiles == 1 and config.grad_dq_norm_in_output
    norm_dq_in_wy = fused and use_qk_l2norm and not norm_dq_in_output
    dq_partial_THK = kernels_common.alloc((T, H, K), torch.float32, device) if norm_dq_in_wy else dq_THK
    dot_precision, _ = dot_precisions(k_THK.dtype)
    meta = dict(
        K=K, V=V, USE_L2NORM=use_qk_l2norm, BT=C, BK=block_size(K), BV=min(config.block_v_grad, block_size(V)),
        DOT_PRECISION=dot_precision, num_warps=config.num_warps_grad, num_stages=config.num_stages,
    )  # fmt: skip
    # split_grad_wy: dW between the state part and the WY kernel, in k's dtype.
    dw_THK = kernels_common.alloc((T, H, K), k_THK.dtype, device) if config.split_grad_wy else None
    if layout.num_slots > 0:
        if fused:
            _chunk_grad_output_state_kernel[(layout.num_slots, H, num_k_tiles)](
                q_THK, k_THK, g_cumsum_TH, states_NCHKV, state_grads_NCHKV, v_new_THV, do_THV, dv_new_THV,
                layout.chunk_map, dq_partial_THK, dk_partial_THK, dG_partial_NTH, dw_THK, scale, T, H,
                **dict(meta, BK=block_k_output, NORM_DQ=norm_dq_in_output,
                       num_warps=config.num_warps_grad_output or config.num_warps_grad),
            )  # fmt: skip
        else:
            _chunk_grad_output_kernel[(layout.num_slots, H)](
                q_THK, k_THK, g_cumsum_TH, states_NCHKV, v_new_THV, do_THV, layout.chunk_map,
                dq_THK, dk_partial_THK, dG_partial_NTH, scale, H, **meta,
            )  # fmt: skip
        if config.split_grad_wy and not fused:
            _chunk_grad_state_kernel[(layout.num_slots, H)](
                k_THK, g_cumsum_TH, states_NCHKV, state_grads_NCHKV, v_new_THV, dv_new_THV, layout.chunk_map,
                dk_partial_THK, dG_partial_NTH, dw_THK, H,
                **dict(meta, num_warps=config.num_warps_grad_state or config.num_warps_grad),
            )  # fmt: skip
        if config.split_grad_wy:
            # One key tile of the whole K unless block_k_grad_wy is narrower.
            block_k_wy = min(config.block_k_grad_wy or block_size(K), block_size(K))
            _chunk_grad_wy_tiled_kernel[(layout.num_slots, H)](
                q_THK, k_THK, v_THV, beta_TH, g_cumsum_TH, inverse_THC, dv_new_THV, layout.chunk_map, scratch_THC,
                dk_partial_THK, dG_partial_NTH, dw_THK, dq_partial_THK, dq_THK, dk_THK, dv_THV, dbeta_TH, dg_TH, T, H,
                **dict(meta, BK=block_k_wy, NUM_DG_PARTS=num_k_tiles, NORM_DQ=norm_dq_in_wy,
                       NORM_ONE_PASS=config.grad_wy_norm_one_pass,
                       num_warps=config.num_warps_grad_wy or config.num_warps_grad),
            )  # fmt: skip
        else:
            _chunk_grad_wy_kernel[(layout.num_slots, H)](
                k_THK, v_THV, beta_TH, g_cumsum_TH, inverse_THC, states_NCHKV, state_grads_NCHKV, v_new_THV,
                dv_new_THV, layout.chunk_map, scratch_THC, dk_partial_THK, dG_partial_NTH, dk_THK, dv_THV, dbeta_TH,
                dg_TH, H, **meta,
            )  # fmt: skip
    return dq_THK, dk_THK, dv_THV, dbeta_TH, dg_TH
