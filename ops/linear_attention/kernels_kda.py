"""Triton kernels of KDA (the gated delta rule with one decay per key channel) that differ from the per-head ones.

Legend as in kernels_common.py; G [C, K] is the per-channel log decay summed from the chunk start (inclusive), SB the
sub-chunk length, "later" and "earlier" the two tokens of a pair (i >= j).

Per-channel decays do not factor out of a dot: sum_c x_ic y_jc exp(G_ic - G_jc) needs its own decay per pair and
channel, and exp(G_i) * exp(-G_j) overflows fp32 (exp(-G_j) reaches exp(320) over one chunk of g = -5). So every
such product is split by blocks of rows, with r the first row of the later token's block:
exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), the first factor <= 1, the second <= 1 for earlier blocks and at
most exp(span) within the block, span the largest G_r - G_j of the block and any channel. One tl.dot per block takes
its rows against every earlier row and its own; the pairs above the diagonal that it also forms are masked after it.
It holds while exp(span) fits the dot's operand type with room for the sum, span <= FAST_SPAN:
- FAST_SPAN_BOUND (60: e^60 = 1e26 against bf16's and fp32's 3e38) in general;
- FAST_SPAN_BOUND_NORMED (80) for the forward's products of L2-normed q and k: each entry is then at most e^span
  (Cauchy-Schwarz over the channels), e^80 = 6e34, and e^-80 = 2e-35 stays a normal bf16 or fp32 number;
- FAST_SPAN_BOUND_FP16 (8: e^8 = 3e3 against fp16's 6.5e4, and e^-8 stays a normal fp16 number).
The forward's pairs kernel takes the largest blocks within the bound (the whole chunk, its halves, or its 16-row
sub-chunks); past it even for a sub-chunk, the pairs within each sub-chunk go elementwise, one offset jj at a time:
row i meets row SB * (i // SB) + jj, re-read from memory (the chunk's own rows, L1/L2-resident), as a register tile
cannot be indexed by row. Each program (one chunk and head) takes its path as its spans say.
The backward's decayed products Z = D y (Z_i = sum_j D_ij y_j exp(G_i - G_j)) and D^T y take the largest of the same
blocks within their own bound (60 or 8: their operands are not normed; `_product_blocks`), r the first row of the
later token's block or the last of the earlier token's (`_decayed_dots`), with fp32 operands in the dots (tf32 for
16-bit inputs; `_decayed_dots` says why).

Kernels here: `_kda_pairs_kernel` (G, the decayed k k^T and q k^T, W's operand k beta exp(G) and for power-of-two K
the serial pass's k exp(G_C - G) per channel; 8 warps) then `_kda_wy_fwd_kernel` ((I + A)^-1, W, U, at 4 warps, as
the per-head WY kernel; one kernel of both at 8 warps took 1.78 ms against 1.54 for the two, docs/perf-history.md), and
the per-chunk gradient in two kernels, as kernels_bwd.py splits the per-head one: `_kda_grad_wy_kernel` (the state
and WY terms: dv, dbeta, and for the next kernel fp32 parts of dk and dG, the gradient of G_C and dkk) then
`_kda_grad_products_kernel` (the output's terms and the four decayed products dP k, dP^T q, dkk k, dkk^T k: dq, dk,
dg). They were one kernel, which spilled 3,784 bytes of stack a thread (sm_90
compile, triton 3.6, K = V = 128, 8 warps); split, 200 and 568, for an fp32 [T, H, K] round trip of dk's and of dG's
parts, dkk in fp32 [T, H, C] where the scratch was k's dtype, and G, k, the states and v_new read by both kernels.
The products kernel still holds 255 registers and 608 bytes of stack; `_kda_grad_products_tiled_kernel` is the same
work in key tiles (KernelConfig.block_k_kda_grad_products: 88 bytes at 64 columns, none at 32), every term per
channel but the L2 norms', whose backward `_l2norm_bwd_rows_kernel` then runs on whole rows.
The serial state passes are `_chunk_state_fwd_kernel` (kernels_state.py) and `_chunk_state_bwd_kernel`
(kernels_bwd.py) with IS_PER_CHANNEL, and the forward's `_chunk_output_kernel` (kernels_output.py) with
IS_PER_CHANNEL: they read the decayed causal q k^T the pairs kernel writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention import kernels_common
from moe_tune.ops.linear_attention.kernels_bwd import output_grad_products
from moe_tune.ops.linear_attention.kernels_common import (
    L2NORM_EPS,
    SUB_CHUNK_SIZE,
    ChunkLayout,
    KernelConfig,
    block_size,
    dot_precisions,
    inverse_dots,
    l2norm_factors,
    l2norm_rows,
    load_channel_decay,
    load_chunk_state_t,
    load_rows,
    load_rows_t,
    store_rows,
    unit_lower_inverse,
)
from moe_tune.ops.linear_attention.kernels_wy import store_w_u, wu_operands_16bit


@triton.jit
def _load_same_block_rows(ptr, t0, num_valid, row_stride, num_cols, jj, BT: tl.constexpr, BD: tl.constexpr,
                          SB: tl.constexpr):  # fmt: skip
    """[BT, BD]: row i holds chunk row SB * (i // SB) + jj (zeros past num_valid and num_cols)."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    partner = (rows // SB) * SB + jj
    offsets = (t0 + partner[:, None]).to(tl.int64) * row_stride + cols[None, :]
    mask = (partner[:, None] < num_valid) & (cols[None, :] < num_cols)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _gate_terms(a, a_log_ptr, dt_bias_ptr, i_h, K, is_row, BK: tl.constexpr):
    """For the raw gate a [BT, BK] of head i_h: (g, sigmoid(x), exp(A_log)) with x = a + dt_bias and the log decay
    g = -exp(A_log) * softplus(x); g is 0 on rows outside is_row and on columns past K, as zero-padded g is."""
    cols = tl.arange(0, BK)
    is_col = cols < K
    x = a + tl.load(dt_bias_ptr + i_h * K + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    # softplus(x) = max(x, 0) + log(1 + exp(-|x|)): no overflow for large x.
    softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
    a_exp = tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
    g = tl.where(is_row[:, None] & is_col[None, :], -a_exp * softplus, 0.0)
    return g, tl.sigmoid(x), a_exp


@triton.jit
def _masked_exp(log_decay, mask):
    """exp(log_decay) where mask, 0 elsewhere; the exponent is masked first (unmasked ones may overflow)."""
    return tl.where(mask, tl.exp(tl.where(mask, log_decay, 0.0)), 0.0)


# The largest span (G at a sub-chunk's first row minus G at one of its rows, any channel) for which pairs within a
# sub-chunk take a tensor-core dot: e^span must fit the dot's operand type (module docstring). Read at each launch.
FAST_SPAN_BOUND = 60.0
FAST_SPAN_BOUND_FP16 = 8.0
FAST_SPAN_BOUND_NORMED = 80.0
# Rows a program of the L2 norm's backward takes (after the key-tiled products kernel).
L2NORM_BWD_ROWS = 32


def fast_span_bound(dtype: torch.dtype, is_normed: bool = False) -> float:
    if dtype == torch.float16:
        return FAST_SPAN_BOUND_FP16
    return FAST_SPAN_BOUND_NORMED if is_normed else FAST_SPAN_BOUND


@triton.jit
def _subchunk_first_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, BT: tl.constexpr, BK: tl.constexpr,
                         SB: tl.constexpr):  # fmt: skip
    """[BT, BK] G at the first row of each row's sub-chunk (>= G there: g <= 0), read from g_cumsum_ptr (the chunk's
    rows, at column 0; rows past the chunk's end take its last row, where G stays)."""
    return _block_edge_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, SB, 0, BT, BK)


@triton.jit
def _block_edge_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, block, offset, BT: tl.constexpr, BK: tl.constexpr):
    """[BT, BK] G at row `offset` of each row's block of `block` rows (0 its first, block - 1 its last), as
    _subchunk_first_rows."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BK)
    edge = tl.minimum((rows // block) * block + offset, num_valid - 1)
    offsets = (t0 + edge).to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(g_cumsum_ptr + offsets, mask=(edge >= 0)[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _product_blocks(G, g_cumsum_ptr, t0, num_valid, row_stride, K, BT: tl.constexpr, SB: tl.constexpr,
                    BK: tl.constexpr, FAST_SPAN: tl.constexpr):  # fmt: skip
    """(block, is_mild) for the backward's decayed products of one chunk (and key tile): the rows of the largest of
    the whole chunk, its halves and its sub-chunks whose decay span (G at the block's first row minus G at one of
    its rows, any channel) is within FAST_SPAN, and whether the sub-chunks' is (else SB, their pairs elementwise)."""
    rows = tl.arange(0, BT)
    G_first = _subchunk_first_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, BT, BK, SB)
    G_0 = _load_g_row(g_cumsum_ptr, t0, num_valid, row_stride, K, 0, BK)
    whole_span = tl.max(tl.max(G_0[None, :] - G, axis=1), axis=0)
    G_halves = tl.where((rows < 2 * SB)[:, None], G_0[None, :],
                        _load_g_row(g_cumsum_ptr, t0, num_valid, row_stride, K, 2 * SB, BK)[None, :])  # fmt: skip
    half_span = tl.max(tl.max(G_halves - G, axis=1), axis=0)
    block = tl.where(whole_span <= FAST_SPAN, BT, tl.where(half_span <= FAST_SPAN, 2 * SB, SB))
    return block, tl.max(tl.max(G_first - G, axis=1), axis=0) <= FAST_SPAN


@triton.jit
def _decayed_dots(D, y, G, g_cumsum_ptr, t0, num_valid, row_stride, K, block, own_rows, IS_TRANSPOSED: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """_decayed_matmul's pairs in different blocks of `block` rows, and with own_rows = block those in one block too
    (D must be zero on the pairs the causal order excludes).

    Each output row i takes its pairs through the edge row e of its own block: exp(G_i - G_j) =
    exp(G_i - G_e) * exp(G_e - G_j), e the block's first row when i is the later token (Z = D y), its last row when i
    is the earlier one (D^T y). The first factor is at most 1 and scales the output once, after the loop; the second
    is at most 1 for partners in other blocks and at most exp(span) within i's own, and scales the dot's right
    operand, one block of output rows a step (D's other rows zeroed), summed in the dot's accumulator.

    The dots take fp32 operands (tf32 products for 16-bit inputs, 3xTF32 for fp32), not 16-bit ones as the
    forward's: dg counts each pair's term twice with opposite signs (at the later and at the earlier token) and the
    chunk's reverse cumsum cancels them, so the two must round alike. With bf16 operands dg's relative RMS error
    against the fp32 reference was 3.8% (H200, KDA test with decays up to 5 a token; 1.9% with logsigmoid decays),
    with tf32 0.6% (0.4%), with fp32 arithmetic 0.3%; the gradient kernel took 4.4 instead of 3.2 ms a launch
    (B4 T8192 H16 K=V=128, docs/perf-history.md)."""
    rows = tl.arange(0, BT)
    Z = tl.zeros([BT, BK], dtype=tl.float32)
    # The edge row's offset in its block; a block's rows meet the earlier rows (the later token's output) or the
    # later ones (the earlier token's), and their own when own_rows is block.
    if IS_TRANSPOSED:
        offset = block - 1
    else:
        offset = 0
    # A loop, not tl.static_range: unrolled, the four sub-chunks' decay tiles and dots were interleaved and spilled
    # (sm_90 compile, triton 3.6: 1,904 bytes of stack a thread in the single gradient kernel against 3,784).
    for a in range(0, BT // block):
        G_e = _load_g_row(g_cumsum_ptr, t0, num_valid, row_stride, K, a * block + offset, BK)
        if IS_TRANSPOSED:
            partner_decay = _masked_exp(G - G_e[None, :], (rows >= (a + 1) * block - own_rows)[:, None])
        else:
            partner_decay = _masked_exp(G_e[None, :] - G, (rows < a * block + own_rows)[:, None])
        is_own = ((rows // block) == a)[:, None]
        Z = tl.dot(tl.where(is_own, D, 0.0), y * partner_decay, Z, input_precision=DOT_PRECISION)
    G_edge = _block_edge_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, block, offset, BT, BK)
    # At most 1 (rows past the chunk's end repeat G_C, as its edge rows do).
    if IS_TRANSPOSED:
        return tl.exp(G_edge - G) * Z
    return tl.exp(G - G_edge) * Z


@triton.jit
def _load_g_row(g_cumsum_ptr, t0, num_valid, row_stride, K, r, BK: tl.constexpr):
    """[BK] G at chunk row r, or at the chunk's last row when r is past its end (G stays there)."""
    cols = tl.arange(0, BK)
    row = tl.minimum(r, num_valid - 1)
    return tl.load(g_cumsum_ptr + (t0 + row).to(tl.int64) * row_stride + cols, mask=(cols < K) & (row >= 0), other=0.0)


@triton.jit
def _decayed_matmul(
    D,
    y,
    G,
    y_ptr,
    g_cumsum_ptr,
    t0,
    num_valid,
    row_stride,
    K,
    y_scale,
    y_rstd,
    block,
    is_mild,
    USE_L2NORM: tl.constexpr,
    IS_TRANSPOSED: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    SB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BT, BK] fp32 Z with per-channel pair decays.

    IS_TRANSPOSED False: Z_i = sum_{j <= i} D[i, j] y_j exp(G_i - G_j)   (D [BT, BT], zero above the diagonal).
    IS_TRANSPOSED True:  Z_j = sum_{i >= j} D[j, i] y_i exp(G_i - G_j)   (D given as [j, i], zero below it).
    y: [BT, BK] fp32 tile; y_ptr / g_cumsum_ptr: the same chunk's raw rows of y and G in memory, at the tile's first
    column, K its columns there, read back for pairs in one sub-chunk (L2-normalised when USE_L2NORM, then times
    y_scale, as y was) unless is_mild (the tile's span within the bound: those pairs take the dots too). block: the
    rows the dots take together (_product_blocks: BT, BT / 2 or SB, the latter two only when is_mild). y_rstd: None
    when the tile is the whole key dimension (a re-read row is normalised by itself), else [BT] the chunk rows'
    L2-norm factors over the whole key dimension (ones without the norm), which the re-read rows are scaled by.
    """
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    # As in the WY kernel: no branch between the two paths, the loop runs no step when the dots took its pairs.
    own_rows = tl.where(is_mild, SB, 0)
    Z = _decayed_dots(D, y, G, g_cumsum_ptr, t0, num_valid, row_stride, K, block, tl.where(is_mild, block, 0),
                      IS_TRANSPOSED, BT, BK, DOT_PRECISION)  # fmt: skip
    for jj in range(0, SB - own_rows):
        partner = (rows // SB) * SB + jj
        y_partner = _load_same_block_rows(y_ptr, t0, num_valid, row_stride, K, jj, BT, BK, SB)
        if y_rstd is None:
            y_partner = l2norm_rows(y_partner, USE_L2NORM) * y_scale
        else:
            partner_rstd = tl.sum(tl.where(cols[None, :] == partner[:, None], y_rstd[None, :], 0.0), axis=1)
            y_partner = y_partner.to(tl.float32) * (partner_rstd * y_scale)[:, None]
        G_partner = _load_same_block_rows(g_cumsum_ptr, t0, num_valid, row_stride, K, jj, BT, BK, SB)
        d = tl.sum(tl.where(cols[None, :] == partner[:, None], D, 0.0), axis=1)
        if IS_TRANSPOSED:
            is_pair = ((partner >= rows) & (partner < num_valid))[:, None]
            Z += d[:, None] * y_partner * _masked_exp(G_partner - G, is_pair)
        else:
            is_pair = ((partner <= rows) & (partner < num_valid))[:, None]
            Z += d[:, None] * y_partner * _masked_exp(G - G_partner, is_pair)
    return Z


@triton.jit
def _kda_pairs_kernel(
    q_ptr,
    k_ptr,
    g_ptr,  # the log decay g, or the raw gate a when GATE_IN_KERNEL
    a_log_ptr,  # [H], read when GATE_IN_KERNEL
    dt_bias_ptr,  # [H * K], read when GATE_IN_KERNEL
    beta_ptr,
    chunk_map_ptr,
    g_cumsum_ptr,
    qk_ptr,
    kk_ptr,
    k_beta_ptr,
    k_end_ptr,
    scale,
    H,
    K,
    USE_L2NORM: tl.constexpr,
    STORE_K_END: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    FAST_SPAN: tl.constexpr,
):
    """G, the decayed causal q k^T and strictly lower k k^T, and the WY kernel's k beta exp(G) and k exp(G_C - G) of
    one (chunk, head).

    The products go by row blocks (`_pairs_row_block`): a block's rows meet every earlier row and their own in one dot
    per product, with r the block's first row. The blocks are the largest of the whole chunk, its two halves and its
    four sub-chunks whose decay span is within FAST_SPAN; the sub-chunks' rows meet the chunk's first NJ = 16, 32,
    64, 64 rows, and past the bound they take their own rows by the elementwise loop. H200, B4 T8192 H16 K=V=128
    bf16, g = logsigmoid(randn) (the harness's; the whole chunk within a span of 80): 0.91 ms a launch, writing W's
    operand and the decayed k too, against 1.01 for the masked [64, 64] tiles of all four sub-chunks; the WY kernel,
    without those operands to make, 0.24 against 0.47 ms (docs/perf-history.md, linear attention)."""
    tl.static_assert(BT == 4 * SB)
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid

    g = load_rows(g_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if GATE_IN_KERNEL:
        g, _, _ = _gate_terms(g, a_log_ptr, dt_bias_ptr, i_h, K, is_valid, BK)
    # Zero-padded g past the chunk's end: G there stays at its last row.
    G = tl.cumsum(g, axis=0)
    store_rows(g_cumsum_ptr + i_h * K, G, t0, num_valid, H * K, K, BT, BK)
    # G's rows are read back below (each block's first row; the same-sub-chunk pairs' partners): other threads
    # wrote them.
    tl.debug_barrier()
    # The largest block whose decay span (G at its first row minus G at one of its rows, any channel) is within the
    # bound: the whole chunk, its halves, or its sub-chunks (these also by an elementwise loop, past the bound).
    G_0 = _load_g_row(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, 0, BK)
    whole_span = tl.max(tl.max(G_0[None, :] - G, axis=1), axis=0)
    G_halves = tl.where((rows < 2 * SB)[:, None], G_0[None, :],
                        _load_g_row(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, 2 * SB, BK)[None, :])  # fmt: skip
    half_span = tl.max(tl.max(G_halves - G, axis=1), axis=0)
    if whole_span <= FAST_SPAN:
        _pairs_row_block(q_ptr + i_h * K, k_ptr + i_h * K, g_cumsum_ptr + i_h * K, qk_ptr + i_h * BT,
                         kk_ptr + i_h * BT, t0, num_valid, H, K, scale, BT, 0, BT, USE_L2NORM, BT, BT, BK,
                         DOT_PRECISION)  # fmt: skip
    elif half_span <= FAST_SPAN:
        for a in tl.static_range(0, 2):
            _pairs_row_block(q_ptr + i_h * K, k_ptr + i_h * K, g_cumsum_ptr + i_h * K, qk_ptr + i_h * BT,
                             kk_ptr + i_h * BT, t0, num_valid, H, K, scale, 2 * SB, a * 2 * SB, (2 * SB) << a,
                             USE_L2NORM, BT, 2 * SB, BK, DOT_PRECISION)  # fmt: skip
    else:
        G_first = _subchunk_first_rows(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK, SB)
        is_mild = tl.max(tl.max(G_first - G, axis=1), axis=0) <= FAST_SPAN
        own_rows = tl.where(is_mild, SB, 0)
        for a in tl.static_range(0, BT // SB):
            # The first NJ rows, a power of two covering sub-chunk a's: 16, 32, 64, 64.
            _pairs_row_block(q_ptr + i_h * K, k_ptr + i_h * K, g_cumsum_ptr + i_h * K, qk_ptr + i_h * BT,
                             kk_ptr + i_h * BT, t0, num_valid, H, K, scale, own_rows, a * SB, SB << (a - a // 3),
                             USE_L2NORM, BT, SB, BK, DOT_PRECISION)  # fmt: skip
    # After the blocks: computed before them, k's tile stayed live through them (H200, B4 T8192 H16: pairs kernel
    # 0.967 against 0.912 ms).
    _wy_operands(k_ptr + i_h * K, beta_ptr, k_beta_ptr + i_h * K, k_end_ptr + i_h * K, G, t0, num_valid, H, K, i_h,
                 USE_L2NORM, STORE_K_END, BT, BK)  # fmt: skip


@triton.jit
def _wy_operands(k_ptr, beta_ptr, k_beta_ptr, k_end_ptr, G, t0, num_valid, H, K, i_h, USE_L2NORM: tl.constexpr,
                 STORE_K_END: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The WY kernel's operands that take G per channel: W's k beta exp(G) and the serial pass's k exp(G_C - G)
    (pointers at the head's column 0)."""
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    k = l2norm_rows(load_rows(k_ptr, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
    beta = tl.load(beta_ptr + (t0 + rows).to(tl.int64) * H + i_h, mask=is_valid, other=0.0).to(tl.float32)
    store_rows(k_beta_ptr, k * tl.exp(G) * beta[:, None], t0, num_valid, H * K, K, BT, BK)
    if STORE_K_END:
        G_last = tl.sum(tl.where((rows == num_valid - 1)[:, None], G, 0.0), axis=0)
        store_rows(k_end_ptr, k * tl.exp(G_last[None, :] - G), t0, num_valid, H * K, K, BT, BK)


@triton.jit
def _pairs_row_block(q_ptr, k_ptr, g_cumsum_ptr, qk_ptr, kk_ptr, t0, num_valid, H, K, scale, own_rows,
                     r0: tl.constexpr, NJ: tl.constexpr, USE_L2NORM: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr,
                     BK: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Rows r0 .. r0 + SB of the decayed causal q k^T and strictly lower k k^T against the chunk's first NJ rows,
    stored with zeros up to BT columns (pointers at the head's column 0)."""
    dot_dtype = k_ptr.dtype.element_ty
    sub = tl.arange(0, SB)
    cols = tl.arange(0, NJ)
    is_row = (r0 + sub) < num_valid
    k_a = l2norm_rows(load_rows(k_ptr, t0 + r0, num_valid - r0, H * K, K, SB, BK), USE_L2NORM)
    q_a = l2norm_rows(load_rows(q_ptr, t0 + r0, num_valid - r0, H * K, K, SB, BK), USE_L2NORM)
    q_a = q_a * scale
    G_a = load_rows(g_cumsum_ptr, t0 + r0, num_valid - r0, H * K, K, SB, BK)
    G_r = _load_g_row(g_cumsum_ptr, t0, num_valid, H * K, K, r0, BK)
    later = _masked_exp(G_a - G_r[None, :], is_row[:, None])
    k_j = l2norm_rows(load_rows(k_ptr, t0, num_valid, H * K, K, NJ, BK), USE_L2NORM)
    G_j = load_rows(g_cumsum_ptr, t0, num_valid, H * K, K, NJ, BK)
    k_earlier = tl.trans((k_j * _masked_exp(G_r[None, :] - G_j, (cols < r0 + own_rows)[:, None])).to(dot_dtype))
    kk = tl.dot((k_a * later).to(dot_dtype), k_earlier, input_precision=DOT_PRECISION)
    qk = tl.dot((q_a * later).to(dot_dtype), k_earlier, input_precision=DOT_PRECISION)
    for jj in range(0, SB - own_rows):
        partner = r0 + jj
        k_p = l2norm_rows(load_rows(k_ptr, t0 + partner, num_valid - partner, H * K, K, 1, BK),
                          USE_L2NORM)  # fmt: skip
        G_p = load_rows(g_cumsum_ptr, t0 + partner, num_valid - partner, H * K, K, 1, BK)
        is_pair = ((r0 + sub) >= partner) & (partner < num_valid) & is_row
        k_p = k_p * _masked_exp(G_a - G_p, is_pair[:, None])
        is_partner_col = (cols == partner)[None, :]
        kk = tl.where(is_partner_col & ((r0 + sub) > partner)[:, None], tl.sum(k_a * k_p, axis=1)[:, None], kk)
        qk = tl.where(is_partner_col & is_pair[:, None], tl.sum(q_a * k_p, axis=1)[:, None], qk)
    kk = tl.where((r0 + sub)[:, None] > cols[None, :], kk, 0.0)
    qk = tl.where((r0 + sub)[:, None] >= cols[None, :], qk, 0.0)
    store_rows(qk_ptr, qk, t0 + r0, num_valid - r0, H * BT, NJ, SB, NJ)
    store_rows(kk_ptr, kk, t0 + r0, num_valid - r0, H * BT, NJ, SB, NJ)
    if NJ < BT:
        zeros = tl.zeros([SB, BT], dtype=tl.float32)
        store_rows(qk_ptr + NJ, zeros, t0 + r0, num_valid - r0, H * BT, BT - NJ, SB, BT)
        store_rows(kk_ptr + NJ, zeros, t0 + r0, num_valid - r0, H * BT, BT - NJ, SB, BT)


@triton.jit
def _kda_wy_fwd_kernel(
    k_beta_ptr,
    v_ptr,
    beta_ptr,
    chunk_map_ptr,
    kk_ptr,
    w_ptr,
    u_ptr,
    inverse_ptr,
    H,
    K,
    V,
    STORE_INVERSE: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    INV_PRECISION: tl.constexpr,
    INV_DOTS: tl.constexpr,
    WU_16BIT: tl.constexpr,
):
    """(I + A)^-1 with A = diag(beta) kk (kk from the pairs kernel, fp32), W and U of one (chunk, head); W's operand
    k beta exp(G) is the pairs kernel's too."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h

    beta = tl.load(beta_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)
    kk = load_rows(kk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(tl.float32)
    if INV_DOTS == "tf32":
        # Through a tf32 product with the identity (kk rounded to tf32, as the inverse's own tf32 products round it):
        # the tile then has a dot result's register layout; timed with the powers-doubling inverse only (0.546 against
        # 0.582 ms, H200, B4 T8192 H16), not with the substitution one. The fp16 inverse skips it.
        eye = tl.where(rows[:, None] == tl.arange(0, BT)[None, :], 1.0, 0.0)
        kk = tl.dot(kk, eye, input_precision=INV_PRECISION)
    inverse = unit_lower_inverse(kk * beta[:, None], BT, SB, INV_DOTS)
    if STORE_INVERSE:
        store_rows(inverse_ptr + i_h * BT, inverse, t0, num_valid, H * BT, BT, BT, BT)
    # k beta exp(G) from the pairs kernel (in W's dtype when W's operands are 16-bit, else fp32), possibly in W's own
    # buffer: each W element is written after the loads of its own column, which it depends on.
    k_beta = load_rows(k_beta_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    store_w_u(inverse, k_beta, beta, v_ptr + i_h * V, w_ptr + i_h * K, u_ptr + i_h * V, t0, num_valid, H, K, V, BT, BK,
              BV, INV_PRECISION, WU_16BIT)  # fmt: skip


@triton.jit
def _kda_grad_wy_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    g_cumsum_ptr,
    inverse_ptr,
    kk_ptr,
    states_ptr,
    state_grads_ptr,
    v_new_ptr,
    dv_new_ptr,
    chunk_map_ptr,
    dv_ptr,
    dbeta_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dG_last_ptr,
    dkk_ptr,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The state and WY terms of one (chunk, head): dv and dbeta (final); for the products kernel, fp32, the state's
    and the WY factors' parts of dk and dG [BT, BK] (before the L2 norm), the gradient of G_C [BK] and dkk [BT, BT]
    (the gradient of the decayed k k^T, times beta)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    token_head = (t0 + rows).to(tl.int64) * H + i_h

    beta = tl.load(beta_ptr + token_head, mask=is_valid, other=0.0).to(tl.float32)

    offs_k = tl.arange(0, BK)
    # Accumulated over V tiles: v_new dS1^T, dW, the U part of d(I + A)^-1, the v part of dbeta, and sum(S0 * dS1)
    # per key row.
    dk_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    dinverse = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    state_dstate = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        state_t = load_chunk_state_t(states_ptr, i_c, i_h, num_valid, H, K, V, v0, BK, BV).to(dot_dtype)
        dstate_t = load_chunk_state_t(state_grads_ptr, i_c, i_h, num_valid, H, K, V, v0, BK, BV).to(dot_dtype)
        v_new = load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        dv_new = load_rows(dv_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
        v = load_rows(v_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        dk_end += tl.dot(v_new, dstate_t, input_precision=DOT_PRECISION)
        dw -= tl.dot(dv_new, state_t, input_precision=DOT_PRECISION)
        v_scaled = (v * beta[:, None]).to(dot_dtype)
        dinverse += tl.dot(dv_new, tl.trans(v_scaled), input_precision=DOT_PRECISION)
        # d(diag(beta) v) = ((I + A)^-1)^T dU, and dU = dv_new; the inverse read per tile (L1/L2-resident).
        inverse_t = load_rows_t(inverse_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
        dv_scaled = tl.dot(inverse_t, dv_new, input_precision=DOT_PRECISION)
        store_rows(dv_ptr + i_h * V + v0, dv_scaled * beta[:, None], t0, num_valid, H * V, V - v0, BT, BV)
        dbeta += tl.sum(v * dv_scaled, axis=1)
        state_dstate += tl.sum(state_t.to(tl.float32) * dstate_t.to(tl.float32), axis=0)

    # WY factors, as in _chunk_grad_wy_kernel, with A = diag(beta) kk and kk read back from the pairs kernel; the
    # inverse is read again here (held through the loop, it spilled). This order spilled least of those tried
    # (sm_90 compile).
    G, G_last = load_channel_decay(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
    k = l2norm_rows(load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
    exp_G = tl.exp(G)
    dw_dot = dw.to(dot_dtype)
    inverse_t = load_rows_t(inverse_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
    k_scaled = (k * (beta[:, None] * exp_G)).to(dot_dtype)
    dinverse += tl.dot(dw_dot, tl.trans(k_scaled), input_precision=DOT_PRECISION)
    dA = tl.dot(inverse_t, dinverse.to(dot_dtype), input_precision=DOT_PRECISION)
    dA = -tl.dot(dA.to(dot_dtype), inverse_t, input_precision=DOT_PRECISION)
    dA = tl.where(rows[:, None] > rows[None, :], dA, 0.0)
    kk = load_rows(kk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(tl.float32)
    dbeta += tl.sum(dA * kk, axis=1)
    store_rows(dkk_ptr + i_h * BT, dA * beta[:, None], t0, num_valid, H * BT, BT, BT, BT)
    dk_scaled = tl.dot(inverse_t, dw_dot, input_precision=DOT_PRECISION)
    # State leaving the chunk: S1 = diag(exp(G_C)) S0 + (k exp(G_C - G))^T v_new.
    dk_end = dk_end * tl.exp(G_last[None, :] - G)
    dG_last = tl.sum(k * dk_end, axis=0) + tl.exp(G_last) * state_dstate
    tl.store(dG_last_ptr + (i_c * H + i_h) * K + offs_k, dG_last, mask=offs_k < K)
    k_dk_scaled = k * dk_scaled * exp_G
    dbeta += tl.sum(k_dk_scaled, axis=1)
    tl.store(dbeta_ptr + token_head, dbeta.to(dbeta_ptr.dtype.element_ty), mask=is_valid)
    dk = dk_end + dk_scaled * (beta[:, None] * exp_G)
    store_rows(dk_partial_ptr + i_h * K, dk, t0, num_valid, H * K, K, BT, BK)
    dG = beta[:, None] * k_dk_scaled - k * dk_end
    store_rows(dG_partial_ptr + i_h * K, dG, t0, num_valid, H * K, K, BT, BK)


@triton.jit
def _kda_grad_products_kernel(
    q_ptr,
    k_ptr,
    a_ptr,  # the raw gate, read when GATE_IN_KERNEL
    a_log_ptr,
    dt_bias_ptr,
    g_cumsum_ptr,
    states_ptr,
    v_new_ptr,
    do_ptr,
    chunk_map_ptr,
    dkk_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dG_last_ptr,
    dq_ptr,
    dk_ptr,
    dg_ptr,  # dg, or da when GATE_IN_KERNEL
    da_log_partial_ptr,  # [NC, H] fp32, written when GATE_IN_KERNEL
    ddt_bias_partial_ptr,  # [NC, H, K] fp32, written when GATE_IN_KERNEL
    scale,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    FAST_SPAN: tl.constexpr,
):
    """The rest of one (chunk, head), after the WY kernel: the output's terms from o = (q exp(G)) S0 + P v_new (P the
    decayed causal q k^T) with dq (final), and the four decayed products (dP k, dP^T q, dkk k, dkk^T k) with their
    parts of dk and dG; with the WY kernel's parts added, dk through the L2 norm and dg (or da and the gate's partial
    sums)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid

    do_state, dqk, dqk_t = output_grad_products(states_ptr, v_new_ptr, do_ptr, i_c, i_h, t0, num_valid, H, K, V, 0,
                                                dot_dtype, BT, BK, BV, DOT_PRECISION)  # fmt: skip

    G, _ = load_channel_decay(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
    q_ptr_h = q_ptr + i_h * K
    k_ptr_h = k_ptr + i_h * K
    g_ptr_h = g_cumsum_ptr + i_h * K
    # Pairs by tensor-core dots in the largest blocks the chunk's decays allow, within a sub-chunk too where they
    # allow it (module docstring).
    block, is_mild = _product_blocks(G, g_ptr_h, t0, num_valid, H * K, K, BT, SB, BK, FAST_SPAN)
    # Output: d(decayed product)/dG per channel is x * dx for the later token and -y * dy for the earlier one. q and
    # k are loaded where they are needed, not held through the other products.
    dqk = tl.where(rows[:, None] >= rows[None, :], dqk, 0.0)
    dq = do_state * tl.exp(G)
    k = l2norm_rows(load_rows(k_ptr_h, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
    dq += _decayed_matmul(dqk, k, G, k_ptr_h, g_ptr_h, t0, num_valid, H * K, K, 1.0, None, block, is_mild,
                          USE_L2NORM, False, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    q = load_rows(q_ptr_h, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        q_rstd = tl.rsqrt(tl.sum(q * q, axis=1) + L2NORM_EPS)
        q = q * q_rstd[:, None]
    dG = q * scale * dq
    dq = dq * scale
    if USE_L2NORM:
        dq = (dq - q * tl.sum(q * dq, axis=1)[:, None]) * q_rstd[:, None]
    store_rows(dq_ptr + i_h * K, dq, t0, num_valid, H * K, K, BT, BK)
    dqk_t = tl.where(rows[None, :] >= rows[:, None], dqk_t, 0.0)
    dk = _decayed_matmul(dqk_t, q * scale, G, q_ptr_h, g_ptr_h, t0, num_valid, H * K, K, scale, None, block, is_mild,
                         USE_L2NORM, True, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    k = load_rows(k_ptr_h, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
    if USE_L2NORM:
        k_rstd = tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)
        k = k * k_rstd[:, None]
    dG -= k * dk

    # WY: dkk (the WY kernel's, fp32) times the decayed k in both orientations; dkk^T is read transposed (no tl.trans
    # of a dot result: the Hopper miscompile, kernels_common.py) and rounded to k's dtype, as a 16-bit scratch holds it.
    dkk = load_rows(dkk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT)
    dk_later = _decayed_matmul(dkk, k, G, k_ptr_h, g_ptr_h, t0, num_valid, H * K, K, 1.0, None, block, is_mild,
                               USE_L2NORM, False, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    dk += dk_later
    dG += k * dk_later
    dkk_t = load_rows_t(dkk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype).to(tl.float32)
    dk_earlier = _decayed_matmul(dkk_t, k, G, k_ptr_h, g_ptr_h, t0, num_valid, H * K, K, 1.0, None, block, is_mild,
                                 USE_L2NORM, True, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    dk += dk_earlier
    dG -= k * dk_earlier
    dk += load_rows(dk_partial_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
    dG += load_rows(dG_partial_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)

    # G is the cumulative sum of g along the chunk, per channel.
    offs_k = tl.arange(0, BK)
    dG_last = tl.load(dG_last_ptr + (i_c * H + i_h) * K + offs_k, mask=offs_k < K, other=0.0)
    dg = tl.cumsum(dG, axis=0, reverse=True) + dG_last[None, :]
    if USE_L2NORM:
        dk = (dk - k * tl.sum(k * dk, axis=1)[:, None]) * k_rstd[:, None]
    store_rows(dk_ptr + i_h * K, dk, t0, num_valid, H * K, K, BT, BK)
    if GATE_IN_KERNEL:
        # g = -exp(A_log) softplus(a + dt_bias): da = -dg exp(A_log) sigmoid(a + dt_bias), dA_log = sum dg g and
        # ddt_bias = sum over tokens of da, summed here per chunk (the caller adds the chunks up in a fixed order).
        a = load_rows(a_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(tl.float32)
        g_raw, sig, a_exp = _gate_terms(a, a_log_ptr, dt_bias_ptr, i_h, K, is_valid, BK)
        da = tl.where(is_valid[:, None], -dg * a_exp * sig, 0.0)
        tl.store(da_log_partial_ptr + i_c * H + i_h, tl.sum(tl.sum(dg * g_raw, axis=1), axis=0))
        cols = tl.arange(0, BK)
        tl.store(ddt_bias_partial_ptr + (i_c * H + i_h) * K + cols, tl.sum(da, axis=0), mask=cols < K)
        dg = da
    store_rows(dg_ptr + i_h * K, dg, t0, num_valid, H * K, K, BT, BK)


@triton.jit
def _kda_grad_products_tiled_kernel(
    q_ptr,
    k_ptr,
    a_ptr,  # the raw gate, read when GATE_IN_KERNEL
    a_log_ptr,
    dt_bias_ptr,
    g_cumsum_ptr,
    states_ptr,
    v_new_ptr,
    do_ptr,
    chunk_map_ptr,
    dkk_ptr,
    dk_partial_ptr,
    dG_partial_ptr,
    dG_last_ptr,
    dq_ptr,
    dk_ptr,
    dg_ptr,  # dg, or da when GATE_IN_KERNEL
    da_log_partial_ptr,  # [NC, H, NK] fp32, written when GATE_IN_KERNEL
    ddt_bias_partial_ptr,  # [NC, H, K] fp32, written when GATE_IN_KERNEL
    scale,
    H,
    K,
    V,
    USE_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    FAST_SPAN: tl.constexpr,
):
    """`_kda_grad_products_kernel` for one key tile of BK columns (program axis 2;
    KernelConfig.block_k_kda_grad_products): every term but the L2 norms' is per key channel. The norms' factors come
    from the whole rows (a loop over the tiles); with USE_L2NORM dq and dk are stored before the norm's backward,
    fp32, into dq_ptr and dk_ptr (which `_l2norm_bwd_rows_kernel` then takes through it), else final. Pairs within a
    sub-chunk take the dots where the tile's own decays allow (its span); q k^T's pair gradients (sums over V) are
    computed by each tile; with the gate, dA_log's per-chunk sum is one entry per tile."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    k0 = i_k * BK
    t0 = tl.load(chunk_map_ptr + 2 * i_c)
    num_valid = tl.load(chunk_map_ptr + 2 * i_c + 1)
    dot_dtype = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    num_cols = K - k0
    offs_k = k0 + tl.arange(0, BK)

    do_state, dqk, dqk_t = output_grad_products(states_ptr, v_new_ptr, do_ptr, i_c, i_h, t0, num_valid, H, K, V, k0,
                                                dot_dtype, BT, BK, BV, DOT_PRECISION)  # fmt: skip

    q_ptr_h = q_ptr + i_h * K
    k_ptr_h = k_ptr + i_h * K
    q_rstd, k_rstd = l2norm_factors(q_ptr_h, k_ptr_h, t0, num_valid, H * K, K, USE_L2NORM, BT, BK)
    q_ptr_t = q_ptr_h + k0
    k_ptr_t = k_ptr_h + k0
    g_ptr_t = g_cumsum_ptr + i_h * K + k0
    G, _ = load_channel_decay(g_ptr_t, t0, num_valid, H * K, num_cols, BT, BK)
    block, is_mild = _product_blocks(G, g_ptr_t, t0, num_valid, H * K, num_cols, BT, SB, BK, FAST_SPAN)

    dqk = tl.where(rows[:, None] >= rows[None, :], dqk, 0.0)
    dq = do_state * tl.exp(G)
    k = load_rows(k_ptr_t, t0, num_valid, H * K, num_cols, BT, BK).to(tl.float32) * k_rstd[:, None]
    dq += _decayed_matmul(dqk, k, G, k_ptr_t, g_ptr_t, t0, num_valid, H * K, num_cols, 1.0, k_rstd, block,
                          is_mild, USE_L2NORM, False, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    q = load_rows(q_ptr_t, t0, num_valid, H * K, num_cols, BT, BK).to(tl.float32) * q_rstd[:, None]
    dG = q * scale * dq
    store_rows(dq_ptr + i_h * K + k0, dq * scale, t0, num_valid, H * K, num_cols, BT, BK)
    dqk_t = tl.where(rows[None, :] >= rows[:, None], dqk_t, 0.0)
    dk = _decayed_matmul(dqk_t, q * scale, G, q_ptr_t, g_ptr_t, t0, num_valid, H * K, num_cols, scale, q_rstd,
                         block, is_mild, USE_L2NORM, True, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    dG -= k * dk

    dkk = load_rows(dkk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT)
    dk_later = _decayed_matmul(dkk, k, G, k_ptr_t, g_ptr_t, t0, num_valid, H * K, num_cols, 1.0, k_rstd, block,
                               is_mild, USE_L2NORM, False, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    dk += dk_later
    dG += k * dk_later
    dkk_t = load_rows_t(dkk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype).to(tl.float32)
    dk_earlier = _decayed_matmul(dkk_t, k, G, k_ptr_t, g_ptr_t, t0, num_valid, H * K, num_cols, 1.0, k_rstd,
                                 block, is_mild, USE_L2NORM, True, BT, BK, SB, DOT_PRECISION)  # fmt: skip
    dk += dk_earlier
    dG -= k * dk_earlier
    dk += load_rows(dk_partial_ptr + i_h * K + k0, t0, num_valid, H * K, num_cols, BT, BK)
    dG += load_rows(dG_partial_ptr + i_h * K + k0, t0, num_valid, H * K, num_cols, BT, BK)

    dG_last = tl.load(dG_last_ptr + (i_c * H + i_h) * K + offs_k, mask=offs_k < K, other=0.0)
    dg = tl.cumsum(dG, axis=0, reverse=True) + dG_last[None, :]
    store_rows(dk_ptr + i_h * K + k0, dk, t0, num_valid, H * K, num_cols, BT, BK)
    if GATE_IN_KERNEL:
        # As `_kda_grad_products_kernel`'s gate step, on the tile's channels (`_gate_terms` written out for the
        # column offset).
        a = load_rows(a_ptr + i_h * K + k0, t0, num_valid, H * K, num_cols, BT, BK).to(tl.float32)
        is_col = offs_k < K
        x = a + tl.load(dt_bias_ptr + i_h * K + offs_k, mask=is_col, other=0.0).to(tl.float32)[None, :]
        softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        a_exp = tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
        g_raw = tl.where(is_valid[:, None] & is_col[None, :], -a_exp * softplus, 0.0)
        da = tl.where(is_valid[:, None], -dg * a_exp * tl.sigmoid(x), 0.0)
        num_k_tiles = tl.num_programs(2)
        tl.store(da_log_partial_ptr + (i_c * H + i_h) * num_k_tiles + i_k, tl.sum(tl.sum(dg * g_raw, axis=1), axis=0))
        tl.store(ddt_bias_partial_ptr + (i_c * H + i_h) * K + offs_k, tl.sum(da, axis=0), mask=is_col)
        dg = da
    store_rows(dg_ptr + i_h * K + k0, dg, t0, num_valid, H * K, num_cols, BT, BK)


@triton.jit
def _l2norm_bwd_rows_kernel(x_ptr, dy_ptr, dx_ptr, num_rows, K, BR: tl.constexpr, BK: tl.constexpr):
    """dx = (dy - y sum(y dy)) / ||x|| per row of x [num_rows, K], y = x / ||x|| (eps as the kernels' norm): the L2
    norm's backward for dy (fp32) given before it, in BR rows a program."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    mask = (rows < num_rows)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + L2NORM_EPS)
    y = x * rstd[:, None]
    dx = (dy - y * tl.sum(y * dy, axis=1)[:, None]) * rstd[:, None]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def kda_wy_fwd(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_THK: torch.Tensor,
    beta_TH: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    store_for_backward: bool,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_k_end: bool = False,
) -> tuple[torch.Tensor, ...]:
    """G [T, H, K] fp32; W [T, H, K], U [T, H, V] and the decayed causal q k^T [T, H, C] in k's dtype (fp32 for fp32
    inputs), the decayed k k^T (strictly lower) [T, H, C] fp32; with store_for_backward also (I + A)^-1 [T, H, C]
    (else None); with store_k_end k exp(G_C - G) [T, H, K] in k's dtype for chunk_state_fwd (else None).

    Two kernels: the pairs kernel (G, q k^T, k k^T by row blocks; W's operand k beta exp(G) and k exp(G_C - G), the
    two products with per-channel decays) then the WY kernel (the inverse, W, U), so that each runs at its own warp
    count (one kernel at 8 warps: 1.78 ms against 1.54; docs/perf-history.md); k k^T goes between them in fp32;
    W's operand in W's dtype through W's own buffer where W's products take 16-bit operands (else in fp32 scratch).

    gate: (A_log [H], dt_bias [H * K]) when g_THK is the raw gate a, the log decay being
    -exp(A_log) * softplus(a + dt_bias), computed in the kernel."""
    T, H, K = k_THK.shape
    V = v_THV.shape[-1]
    C = layout.chunk_size
    device = k_THK.device
    alloc = kernels_common.alloc
    g_cumsum_THK = alloc((T, H, K), torch.float32, device)
    w_THK = alloc((T, H, K), k_THK.dtype, device)
    u_THV = alloc((T, H, V), k_THK.dtype, device)
    qk_THC = alloc((T, H, C), k_THK.dtype, device)
    kk_THC = alloc((T, H, C), torch.float32, device)
    inverse_THC = alloc((T, H, C), k_THK.dtype, device) if store_for_backward else None
    k_end_THK = alloc((T, H, K), k_THK.dtype, device) if store_k_end else None
    dot_precision, inv_precision = dot_precisions(k_THK.dtype)
    wu_16bit = wu_operands_16bit(k_THK.dtype, K, V, config)
    # W's operand k beta exp(G), from the pairs kernel to the WY kernel, rounded as the W product takes it: in W's own
    # buffer where it has W's dtype.
    k_beta_THK = w_THK if wu_16bit or k_THK.dtype == torch.float32 else alloc((T, H, K), torch.float32, device)
    meta = dict(K=K, BT=C, SB=SUB_CHUNK_SIZE, BK=block_size(K), num_stages=config.num_stages)
    if layout.num_slots > 0:
        grid = (layout.num_slots, H)
        _kda_pairs_kernel[grid](
            q_THK, k_THK, g_THK, *(gate if gate is not None else (g_THK, g_THK)), beta_TH, layout.chunk_map,
            g_cumsum_THK, qk_THC, kk_THC, k_beta_THK, k_end_THK if store_k_end else k_beta_THK, scale, H,
            STORE_K_END=store_k_end, DOT_PRECISION=dot_precision, GATE_IN_KERNEL=gate is not None,
            FAST_SPAN=fast_span_bound(k_THK.dtype, use_qk_l2norm),
            USE_L2NORM=use_qk_l2norm, num_warps=config.num_warps_kda_pairs, **meta,
        )  # fmt: skip
        _kda_wy_fwd_kernel[grid](
            k_beta_THK, v_THV, beta_TH, layout.chunk_map, kk_THC, w_THK, u_THV,
            inverse_THC if store_for_backward else kk_THC, H, V=V,
            STORE_INVERSE=store_for_backward, BV=min(config.block_v_wy, block_size(V)),
            INV_PRECISION=inv_precision, INV_DOTS=inverse_dots(k_THK.dtype, use_qk_l2norm, config),
            WU_16BIT=wu_16bit, num_warps=config.num_warps, **meta,
        )  # fmt: skip
    return g_cumsum_THK, w_THK, u_THV, qk_THC, inverse_THC, kk_THC, k_end_THK


def kda_grad(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_dtype: torch.dtype,
    beta_TH: torch.Tensor,
    g_cumsum_THK: torch.Tensor,
    inverse_THC: torch.Tensor,
    kk_THC: torch.Tensor,
    states_NCHKV: torch.Tensor,
    state_grads_NCHKV: torch.Tensor,
    v_new_THV: torch.Tensor,
    dv_new_THV: torch.Tensor,
    do_THV: torch.Tensor,
    layout: ChunkLayout,
    config: KernelConfig,
    scale: float,
    use_qk_l2norm: bool,
    gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """dq, dk [T, H, K], dv [T, H, V] in q's dtype; dbeta [T, H] in beta's dtype and dg [T, H, K] in g_dtype.

    gate: (a [T, H, K], A_log [H], dt_bias [H * K]) when the kernel computed the log decay from the raw gate a: the
    fifth gradient is then da, and dA_log [H] and ddt_bias [H * K] (fp32) follow it; without a gate they are None.
    """
    T, H, K = k_THK.shape
    V = v_THV.shape[-1]
    C = layout.chunk_size
    device = k_THK.device
    alloc = kernels_common.alloc
    dq_THK = alloc((T, H, K), q_THK.dtype, device)
    dk_THK = alloc((T, H, K), k_THK.dtype, device)
    dv_THV = alloc((T, H, V), v_THV.dtype, device)
    dbeta_TH = alloc((T, H), beta_TH.dtype, device)
    dg_THK = alloc((T, H, K), g_dtype, device)
    # From the WY kernel to the products kernel, fp32: its parts of dk and dG, the gradient of G_C per chunk slot, and
    # dkk (its transpose is read transposed: no tl.trans of a dot result, the Hopper miscompile in kernels_common.py).
    dk_partial_THK = alloc((T, H, K), torch.float32, device)
    dG_partial_THK = alloc((T, H, K), torch.float32, device)
    dG_last_NCHK = alloc((layout.num_slots, H, K), torch.float32, device)
    dkk_THC = alloc((T, H, C), torch.float32, device)
    # The products kernel's key tiles (KernelConfig.block_k_kda_grad_products; None, one of the whole K).
    block_k_products = min(config.block_k_kda_grad_products or block_size(K), block_size(K))
    num_k_tiles = triton.cdiv(K, block_k_products)
    # Per chunk slot (and key tile), summed below in slot order (deterministic where atomics would not be).
    da_log_partial = alloc((layout.num_slots, H, num_k_tiles), torch.float32, device) if gate is not None else None
    ddt_bias_partial = alloc((layout.num_slots, H, K), torch.float32, device) if gate is not None else None
    dot_precision, _ = dot_precisions(k_THK.dtype)
    meta = dict(K=K, USE_L2NORM=use_qk_l2norm, BT=C, BK=block_size(K), DOT_PRECISION=dot_precision,
                num_stages=config.num_stages)  # fmt: skip
    block_v = min(config.block_v_grad, block_size(V))
    fast_span = fast_span_bound(k_THK.dtype)
    if layout.num_slots > 0:
        grid = (layout.num_slots, H)
        _kda_grad_wy_kernel[grid](
            k_THK, v_THV, beta_TH, g_cumsum_THK, inverse_THC, kk_THC, states_NCHKV, state_grads_NCHKV, v_new_THV,
            dv_new_THV, layout.chunk_map, dv_THV, dbeta_TH, dk_partial_THK, dG_partial_THK, dG_last_NCHK, dkk_THC,
            H, V=V, BV=block_v, num_warps=config.num_warps_kda_grad_wy, **meta,
        )  # fmt: skip
        products = dict(
            scale=scale, H=H, V=V, SB=SUB_CHUNK_SIZE, BV=block_v, GATE_IN_KERNEL=gate is not None,
            FAST_SPAN=fast_span, num_warps=config.num_warps_kda_grad_products, **meta,
        )  # fmt: skip
        if num_k_tiles == 1:
            _kda_grad_products_kernel[grid](
                q_THK, k_THK, *(gate if gate is not None else (g_cumsum_THK,) * 3), g_cumsum_THK, states_NCHKV,
                v_new_THV, do_THV, layout.chunk_map, dkk_THC, dk_partial_THK, dG_partial_THK, dG_last_NCHK,
                dq_THK, dk_THK, dg_THK, *((da_log_partial, ddt_bias_partial) if gate is not None else (dg_THK,) * 2),
                **products,
            )  # fmt: skip
        else:
            # With the L2 norm, dq and dk before its backward (fp32: dk into dk_partial, each tile read there first).
            dq_before_norm = alloc((T, H, K), torch.float32, device) if use_qk_l2norm else dq_THK
            dk_before_norm = dk_partial_THK if use_qk_l2norm else dk_THK
            _kda_grad_products_tiled_kernel[(layout.num_slots, H, num_k_tiles)](
                q_THK, k_THK, *(gate if gate is not None else (g_cumsum_THK,) * 3), g_cumsum_THK, states_NCHKV,
                v_new_THV, do_THV, layout.chunk_map, dkk_THC, dk_partial_THK, dG_partial_THK, dG_last_NCHK,
                dq_before_norm, dk_before_norm, dg_THK,
                *((da_log_partial, ddt_bias_partial) if gate is not None else (dg_THK,) * 2),
                **dict(products, BK=block_k_products),
            )  # fmt: skip
            if use_qk_l2norm:
                norm_grid = (triton.cdiv(T * H, L2NORM_BWD_ROWS),)
                for x, dy, dx in ((q_THK, dq_before_norm, dq_THK), (k_THK, dk_before_norm, dk_THK)):
                    _l2norm_bwd_rows_kernel[norm_grid](x, dy, dx, T * H, K, BR=L2NORM_BWD_ROWS, BK=block_size(K),
                                                       num_warps=config.num_warps)  # fmt: skip
    if gate is None:
        return dq_THK, dk_THK, dv_THV, dbeta_TH, dg_THK, None, None
    da_log = da_log_partial.sum((0, 2))
    return dq_THK, dk_THK, dv_THV, dbeta_TH, dg_THK, da_log, ddt_bias_partial.sum(0).reshape(H * K)
