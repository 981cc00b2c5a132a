"""The WY pass of the chunked gated delta rule (one decay per head): the forward's first launch and the backward's
recomputation. Legend as in kernels_common.py.

`_chunk_wy_fwd_kernel`, one program per (chunk, head), all in parallel: G, A = tril(beta k k^T exp(G_i - G_j)), the
inverse (I + A)^-1 (`kernels_common.unit_lower_inverse`), the WY factors W = (I + A)^-1 diag(beta exp(G)) k and
U = (I + A)^-1 diag(beta) v (`store_w_u`, which KDA's WY kernel shares), and (store_k_end) the serial state pass's
operand k exp(G_C - G).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention import kernels_common
from moe_tune.ops.linear_attention.kernels_common import (
    SUB_CHUNK_SIZE,
    WU_16BIT_MIN_DIM,
    ChunkLayout,
    KernelConfig,
    block_size,
    dot_precisions,
    inverse_dots,
    l2norm_rows,
    load_rows,
    pair_decay,
    store_rows,
    unit_lower_inverse,
)


@triton.jit
def _chunk_wy_fwd_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    chunk_map_ptr,
    g_cumsum_ptr,
    w_ptr,
    u_ptr,
    inverse_ptr,
    k_end_ptr,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    STORE_INVERSE: tl.constexpr,
    STORE_K_END: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
    INV_DOTS: tl.constexpr,
    WU_16BIT: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h

    g = tl.load(g_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)
    # Zero-padded g past the chunk's end: G there stays at its last value.
    G = tl.cumsum(g, axis=0)
    tl.store(g_cumsum_ptr + token_head, G, mask=is_valid)
    beta = tl.load(beta_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)

    k = l2norm_rows(load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
    if STORE_K_END:
        # k exp(G_C - G), the state update's operand, as the state pass computed it (same ops, same rounding).
        G_last = tl.sum(tl.where(rows == num_valid - 1, G, 0.0), axis=0)
        store_rows(k_end_ptr + i_h * K, k * tl.exp(G_last - G)[:, None], t0, num_valid, H * K, K, BT, BK)
    k_dot = k.to(dot_dtype)
    A = tl.dot(k_dot, tl.trans(k_dot), input_precision=DOT_PRECISION) * beta[:, None]
    A = A * pair_decay(G, False, False, BT)
    inverse = unit_lower_inverse(A, BT, SB, INV_DOTS)
    if STORE_INVERSE:
        store_rows(inverse_ptr + i_h * BT, inverse, t0, num_valid, H * BT, BT, BT, BT)

    store_w_u(inverse, k * (beta * tl.exp(G))[:, None], beta, v_ptr + i_h * V, w_ptr + i_h * K, u_ptr + i_h * V, t0,
              num_valid, H, K, V, BT, BK, BV, INV_PRECISION, WU_16BIT)  # fmt: skip


@triton.jit
def store_w_u(inverse, k_scaled, beta, v_ptr, w_ptr, u_ptr, t0, num_valid, H, K, V, BT: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, INV_PRECISION: tl.constexpr, WU_16BIT: tl.constexpr):  # fmt: skip
    """W = (I + A)^-1 (k beta exp(G)) and U = (I + A)^-1 (v beta) of one chunk, stored (pointers at the head's
    column 0). WU_16BIT (see `wu_operands_16bit`): operands rounded to the stored dtype (W and U are stored in it);
    else fp32 operands (tf32 for 16-bit inputs)."""
    if WU_16BIT:
        op_dtype = w_ptr.dtype.element_ty
        inverse_op = inverse.to(op_dtype)
        w = tl.dot(inverse_op, k_scaled.to(op_dtype))
    else:
        inverse_op = inverse
        w = tl.dot(inverse, k_scaled, input_precision=INV_PRECISION)
    store_rows(w_ptr, w, t0, num_valid, H * K, K, BT, BK)
    for v0 in range(0, V, BV):
        v = load_rows(v_ptr + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        if WU_16BIT:
            u = tl.dot(inverse_op, (v * beta[:, None]).to(op_dtype))
        else:
            u = tl.dot(inverse, v * beta[:, None], input_precision=INV_PRECISION)
        store_rows(u_ptr + v0, u, t0, num_valid, H * V, V - v0, BT, BV)


def wu_operands_16bit(dtype: torch.dtype, K: int, V: int, config: KernelConfig) -> bool:
    """Whether the WY pass multiplies W's and U's operands in the 16-bit input dtype (as flash-linear-attention's
    recompute_w_u does) rather than tf32: only for K and V tiles of at least 64. With 16-bit operands, Triton 3.6 on
    the H200 returned NaN for K or V below 64 (the inverse itself was right); fp32 inputs keep fp32 operands (3xTF32 products)."""
    return (
        config.wu_16bit
        and dtype in (torch.float16, torch.bfloat16)
        and block_size(K) >= WU_16BIT_MIN_DIM
        and min(config.block_v_wy, config.block_v_wy_16bit, block_size(V)) >= WU_16BIT_MIN_DIM
    )


def has_k_end(K: int) -> bool:
    """Whether the WY pass hands the serial state pass k exp(G_C - G) (store_k_end), given the key head dim.

    Only when K fills its tile (a power of two): at K 100 (tile 128) on the H200 (triton 3.6) the states came out
    71% off in RMS and a later launch hit an illegal address, while every power of two the GPU tests run (16, 32, 64,
    128) gave the states of the path that computes the decayed k in the loop; the interpreter is right at K 100, so
    it is the compiled kernel. Other K take that path.
    """
    return K == block_size(K)


def chunk_wy_fwd(
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    use_qk_l2norm: bool,
    store_inverse: bool,
    store_k_end: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """G [T, H] fp32, W [T, H, K] and U [T, H, V] in k's dtype (fp32 for fp32 inputs), (I + A)^-1 [T, H, C] or None,
    and k exp(G_C - G) [T, H, K] (k L2-normed when use_qk_l2norm; k's dtype) for chunk_state_fwd or None."""
    T, H, K = k_THK.shape
    V = v_THV.shape[-1]
    C = layout.chunk_size
    device = k_THK.device
    alloc = kernels_common.alloc
    g_cumsum_TH = alloc((T, H), torch.float32, device)
    w_THK = alloc((T, H, K), k_THK.dtype, device)
    u_THV = alloc((T, H, V), k_THK.dtype, device)
    inverse_THC = alloc((T, H, C), k_THK.dtype, device) if store_inverse else None
    k_end_THK = alloc((T, H, K), k_THK.dtype, device) if store_k_end else None
    dot_precision, inv_precision = dot_precisions(k_THK.dtype)
    if layout.num_slots > 0:
        _chunk_wy_fwd_kernel[(layout.num_slots, H)](
            k_THK,
            v_THV,
            g_TH,
            beta_TH,
            layout.chunk_map,
            g_cumsum_TH,
            w_THK,
            u_THV,
            inverse_THC if store_inverse else w_THK,
            k_end_THK if store_k_end else w_THK,
            H,
            K=K,
            V=V,
            USE_L2NORM=use_qk_l2norm,
            STORE_INVERSE=store_inverse,
            STORE_K_END=store_k_end,
            BT=C,
            SB=SUB_CHUNK_SIZE,
            BK=block_size(K),
            BV=min(config.block_v_wy_16bit if k_THK.element_size() == 2 else config.block_v_wy, block_size(V)),
            DOT_PRECISION=dot_precision,
            INV_PRECISION=inv_precision,
            INV_DOTS=inverse_dots(k_THK.dtype, use_qk_l2norm, config),
            WU_16BIT=wu_operands_16bit(k_THK.dtype, K, V, config),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return g_cumsum_TH, w_THK, u_THV, inverse_THC, k_end_THK
