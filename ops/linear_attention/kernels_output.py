"""The forward's output pass of the chunked gated delta rule, per-head decay and (IS_PER_CHANNEL) KDA's. Legend as in
kernels_common.py.

`_chunk_output_kernel`, one program per (chunk, head, V tile), all in parallel: o = (q exp(G)) S0 + (q k^T * M) v_new
from the state entering each chunk and v_new that the serial state pass stored, building q k^T itself (per-head
decay). Out of the serial pass, the output's products run on every SM even when few sequences run the serial pass
(H200, B4 T8192 H16 K=V=128: serial pass 0.44 ms storing states against 1.11 ms with the output, output kernel
0.50 ms; one 32K-token document's forward 2.67 against 4.62 ms).
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
    load_decay,
    load_rows,
    pair_decay,
    store_rows,
)


@triton.jit
def _chunk_output_kernel(
    q_ptr,
    k_ptr,
    g_cumsum_ptr,
    qk_ptr,  # [T, H, BT] the decayed causal q k^T (KDA's pairs kernel), read when IS_PER_CHANNEL
    states_ptr,
    v_new_ptr,
    chunk_map_ptr,
    o_ptr,
    q_dec_ptr,
    qk_out_ptr,
    scale,
    H,
    K,
    V,
    IS_PER_CHANNEL: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    STORE_BWD_OPERANDS: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """o = (q exp(G)) S0 + (q k^T * M) v_new of one (chunk slot, head, V tile), in parallel over all of them, from the
    state entering the chunk and v_new that the serial pass stored.

    A loop over K in tiles of BK (pipelined by the launch's stages) takes the products of the raw q and k; q's and k's
    L2 norms, the scale and the per-head decays are row and column factors, applied once after it. Per-channel decay
    (KDA): q exp(G) per tile, and q k^T read, decayed and masked, from the pairs kernel.

    STORE_BWD_OPERANDS (the op saving its intermediates): the first V tile's program also writes the reverse serial
    pass's prepared operands, q exp(G) (scaled, normed) and, per head, the decayed causal q k^T it just built, so
    that backward needs no prepare_state_bwd pass (q is read again for that, from L2)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    offs_k = tl.arange(0, BK)
    offs_v = v0 + tl.arange(0, BV)
    slot_head = (i_c * H + i_h).to(tl.int64) * K * V
    # A slot past the last chunk (num_valid 0) stored no state: nothing is read or written for it.
    has_chunk = num_valid > 0
    o = tl.zeros([BT, BV], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    q_sq = tl.zeros([BT], dtype=tl.float32)
    k_sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        q = load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
        state_mask = (k0 + offs_k[:, None] < K) & (offs_v[None, :] < V) & has_chunk
        state = tl.load(
            states_ptr + slot_head + (k0 + offs_k[:, None]) * V + offs_v[None, :], mask=state_mask, other=0.0
        )
        if USE_L2NORM:
            q_sq += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        if IS_PER_CHANNEL:
            G = load_rows(g_cumsum_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
            q = q.to(tl.float32) * tl.exp(G)
        else:
            k = load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
            if USE_L2NORM:
                k_sq += tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1)
            qk += tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)
        o += tl.dot(q.to(dot_dtype), state.to(dot_dtype), input_precision=DOT_PRECISION)
    q_factor = tl.full([BT], scale, tl.float32)
    if USE_L2NORM:
        q_factor = q_factor * tl.rsqrt(q_sq + L2NORM_EPS)
    if IS_PER_CHANNEL:
        qk = load_rows(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT)
    else:
        G, _ = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
        qk = qk * q_factor[:, None] * pair_decay(G, True, False, BT)
        if USE_L2NORM:
            qk = qk * tl.rsqrt(k_sq + L2NORM_EPS)[None, :]
        q_factor = q_factor * tl.exp(G)
    v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
    o = o * q_factor[:, None] + tl.dot(qk.to(dot_dtype), v_new, input_precision=DOT_PRECISION)
    store_rows(o_ptr + i_h * V + v0, o, t0, num_valid, H * V, V - v0, BT, BV)
    if STORE_BWD_OPERANDS:
        if v0 == 0:
            for k0 in range(0, K, BK):
                q = load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
                if IS_PER_CHANNEL:
                    q = q * tl.exp(load_rows(g_cumsum_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK))
                store_rows(q_dec_ptr + i_h * K + k0, q * q_factor[:, None], t0, num_valid, H * K, K - k0, BT, BK)
            if not IS_PER_CHANNEL:
                store_rows(qk_out_ptr + i_h * BT, qk, t0, num_valid, H * BT, BT, BT, BT)


def has_output_kernel(K: int, V: int, config: KernelConfig) -> bool:
    """Whether the forward computes the output in the parallel kernel (either decay), given the head dims.

    Only when its V tile is at least as wide as its K tile: at K 32 with V 16, triton 3.6 compiled the output
    kernel into one that reads past its shared memory on the H200 (compute-sanitizer memcheck, at 8 and at 4 warps;
    it surfaced as an illegal address in a later kernel). Of the GPU tests' other shapes, the one with a narrower V
    tile (K 128, V 64) ran clean, as did all with V tiles as wide as their K tiles; the rule keeps to the
    side of what was seen clean. Other shapes take the serial pass that also writes the output.
    """
    return min(config.block_v_output, block_size(V)) >= block_size(K)


def chunk_output(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    g_cumsum_TH: torch.Tensor,
    states_NCHKV: torch.Tensor,
    v_new_THV: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    qk_THC: torch.Tensor | None = None,
    store_bwd_operands: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """o [T, H, V] in q's dtype from the per-chunk states and v_new of chunk_state_fwd(store_states=True); one
    program per (chunk slot, head, V tile), all in parallel. Per-head decay: g_cumsum_TH [T, H]; per-channel (KDA):
    [T, H, K] with qk_THC the decayed causal q k^T of kda_wy_fwd. With store_bwd_operands also what
    kernels_bwd.prepare_state_bwd would write, in k's dtype: q exp(G) [T, H, K] and (per head) the decayed causal
    q k^T [T, H, C]; else None, None."""
    T, H, K = q_THK.shape
    V = v_new_THV.shape[-1]
    C = layout.chunk_size
    alloc = kernels_common.alloc
    o_THV = alloc((T, H, V), q_THK.dtype, q_THK.device)
    q_dec_THK = alloc((T, H, K), k_THK.dtype, q_THK.device) if store_bwd_operands else None
    qk_out_THC = alloc((T, H, C), k_THK.dtype, q_THK.device) if store_bwd_operands and qk_THC is None else None
    block_v = min(config.block_v_output, block_size(V))
    dot_precision, _ = dot_precisions(q_THK.dtype)
    if qk_THC is not None:
        num_warps, num_stages = config.num_warps_output_kda, config.num_stages_output_kda
    elif q_THK.element_size() == 2 and not store_bwd_operands:
        num_warps, num_stages = config.num_warps_output, config.num_stages_output
    else:
        # fp32 tiles (twice the shared memory a stage), or the variant that also stores the backward's operands:
        # that variant at 8 warps and 3 stages compiles wrong on the H200 (forward output 1.1e-2 off the fp32
        # reference against 4.9e-4 at 4 warps and 1 stage; docs/perf-history.md, linear attention).
        num_warps, num_stages = config.num_warps, 1
    if layout.num_slots > 0:
        _chunk_output_kernel[(layout.num_slots, H, triton.cdiv(V, block_v))](
            q_THK,
            k_THK,
            g_cumsum_TH,
            qk_THC if qk_THC is not None else q_THK,
            states_NCHKV,
            v_new_THV,
            layout.chunk_map,
            o_THV,
            q_dec_THK if store_bwd_operands else o_THV,
            qk_out_THC if qk_out_THC is not None else o_THV,
            scale,
            H,
            K=K,
            V=V,
            IS_PER_CHANNEL=g_cumsum_TH.ndim == 3,
            USE_L2NORM=use_qk_l2norm,
            STORE_BWD_OPERANDS=store_bwd_operands,
            BT=C,
            BK=min(config.block_k_output, block_size(K)),
            BV=block_v,
            DOT_PRECISION=dot_precision,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return o_THV, q_dec_THK, qk_out_THC
