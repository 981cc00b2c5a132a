"""Triton forward of the chunked gated delta rule (one decay per head): chunk layout, shared pieces, two kernels.

Legend: T tokens of all sequences packed along time (B*T without cu_seqlens), H heads, K key dim, V value dim,
N sequences, C chunk length (BT inside kernels), NC chunk slots (one per chunk of every sequence, plus unused ones
at the end), BK/BV tile widths over K/V, G the log decay summed from the chunk start (inclusive).

Every tensor is token-major and contiguous: x_THD[t, h, d] sits at (t * H + h) * D + d; per-chunk states
states_NCHKV[c, h] are the [K, V] state entering chunk slot c. A batch of B equal sequences is the packed case with
cu_seqlens = (0, T, 2T, ...), so one code path serves both.

The forward is three launches (two for head dims whose V tile is narrower than their K tile, `has_output_kernel`;
KDA runs its pairs kernel before the WY pass, kernels_kda.py):
1. `_chunk_wy_fwd_kernel`, one program per (chunk, head), all in parallel: G, A = tril(beta k k^T exp(G_i - G_j)),
   the inverse (I + A)^-1 (block forward substitution, the block size doubling: `_unit_lower_inverse`), the WY
   factors W = (I + A)^-1 diag(beta exp(G)) k and U = (I + A)^-1 diag(beta) v, and (store_k_end)
   the serial pass's operand k exp(G_C - G).
2. `_chunk_state_fwd_kernel`, one program per (V tile, sequence, head), serial over the sequence's chunks with the
   state [K, BV] in registers (fp32): v_new = U - W S, then S = exp(G_C) S + (k exp(G_C - G))^T v_new, the decayed
   k read from the WY pass (HAS_K_END, power-of-two K) or built in the loop. It writes the
   state entering each chunk and v_new (store_states), which the backward's recomputation also uses; in the fused
   form (compute_output) it computes the output o = (q exp(G)) S + (q k^T * decay, causal) v_new itself and stores
   the states only when the backward keeps them. With IS_PER_CHANNEL (KDA, kernels_kda.py) the decays are [C, K]
   and the decayed causal q k^T is read from KDA's pairs kernel, in either form.
3. `_chunk_output_kernel`, one program per (chunk, head, V tile), all in parallel: the same output from the stored
   state and v_new, building q k^T itself (per-head decay). Out of the serial pass, the output's products run on
   every SM even when few sequences run the serial pass (H200, B4 T8192 H16 K=V=128: serial pass 0.44 ms storing
   states against 1.11 ms with the output, output kernel 0.50 ms; one 32K-token document's forward 2.67 against
   4.62 ms).

Triton 3.4-3.7.0 on Hopper miscompiles tl.trans of a tl.dot result that feeds another tl.dot (fla-org/
flash-linear-attention#640): the kernels here and in kernels_bwd.py only transpose tiles loaded from memory or built
elementwise from them; a transposed product of computed tiles is computed as its own dot or read back from memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE, L2NORM_EPS

# Kernels read module globals only when they are constexpr.
_L2NORM_EPS = tl.constexpr(L2NORM_EPS)

# The chunk length C: 64 x 64 intra-chunk blocks fill a tensor-core tile and keep the triangular solve short.
CHUNK_SIZE = DEFAULT_CHUNK_SIZE
# The triangular inverse's substitution levels below 16 rows run batched on the [C / 16, 16, 16] diagonal blocks
# (16 is the smallest tl.dot size); the levels from 16 rows up run on the whole [C, C] tile (`_unit_lower_inverse`).
SUB_CHUNK_SIZE = 16
# tl.dot needs every operand dimension to be at least 16.
MIN_DOT_SIZE = 16
# 32 value columns per state program: B4 H16 V128 gives 256 serial programs to fill 132 SMs, and the fp32 state
# [128, 32] is 32 registers per thread at 4 warps.
GPU_BLOCK_V_STATE = 32
# The per-chunk gradient kernel loops over V in tiles of 64: two iterations at V = 128.
GPU_BLOCK_V_GRAD = 64
# The WY kernels loop over V in tiles of 64 for U; the per-head one with 16-bit inputs in tiles of 128: 0.349 against
# 0.372 ms for the WY pass alone on the H200, B4 T8192 H16 K=V=128 bf16 (docs/PERF.md, linear attention).
GPU_BLOCK_V_WY = 64
GPU_BLOCK_V_WY_16BIT = 128
# The output kernel builds q k^T once per V tile (one tile of 128 at V = 128) and loops over K in tiles of 64; the
# fastest launches that compile right on triton 3.6 (the per-head loop at 4 warps and 2-3 stages does not), H200, B4
# T8192 H16 K=V=128 bf16: per-head 8 warps, 3 stages (0.267 ms), KDA 4 warps, 2 stages (0.252 ms); docs/PERF.md,
# linear attention.
GPU_BLOCK_V_OUTPUT = 128
GPU_BLOCK_K_OUTPUT = 64
GPU_NUM_WARPS_OUTPUT = 8
GPU_NUM_WARPS_OUTPUT_KDA = 4
GPU_NUM_STAGES_OUTPUT = 3
GPU_NUM_STAGES_OUTPUT_KDA = 2
# KDA's pairs kernel (kernels_kda.py) builds two decayed [64, 64] products by sub-chunk (sm_90 compile, triton 3.6,
# K = V = 128: 16 bytes of stack a thread at 8 warps; at 4, 608). On the H200 (B4 T8192 H16 bf16) 1.15 ms a launch at
# 8 warps; with its sub-chunk loop not unrolled 1.62 at 8 warps and 2.25 at 16 (128 registers a thread, no stack).
GPU_NUM_WARPS_KDA_PAIRS = 8
# KDA's two gradient kernels (kernels_kda.py), sm_90 compile, triton 3.6, K = V = 128: the WY kernel spills 200
# bytes of stack a thread at 8 warps (16: 304, 4: 2,080), the products kernel 568 (with 16-bit dot operands 536; 16
# warps: 392 at half the registers a thread, 4: 2,648); the single kernel they replace spilled 3,784 at 8 warps.
GPU_NUM_WARPS_KDA_GRAD_WY = 8
GPU_NUM_WARPS_KDA_GRAD_PRODUCTS = 8
# 4 warps (one warpgroup) for the [64, 64] and [64, 128] tiles of the forward and the state kernels.
GPU_NUM_WARPS = 4
# The gradient kernel holds three [64, 128] fp32 accumulators: 8 warps keep them in registers.
GPU_NUM_WARPS_GRAD = 8
# Two stages let the serial state loops prefetch the next chunk's tiles while the current one computes.
GPU_NUM_STAGES_STATE = 2
# The forward's serial pass that stores the states (beside the output kernel, and the backward's recomputation),
# 16-bit inputs with K up to 128 (`state_fwd_launch`): the widest V tile of these that still gives at least
# GPU_MIN_STATE_PROGRAMS programs (V tiles x sequences x heads; the H200 has 132 SMs), deeper pipelines, and 8 warps
# for KDA's tiles of 64: the fastest settings of the pass alone on the H200, K=V=128 bf16, at B4 T8192 H16 (per-head
# 0.259 ms, KDA 0.287) and at one 32K-token document (per-head 0.595 ms, KDA 0.821); docs/PERF.md, linear attention.
GPU_BLOCK_V_STATE_FWD = (64, 32, 16)
GPU_MIN_STATE_PROGRAMS = 128
GPU_NUM_STAGES_STATE_FWD = 4
GPU_NUM_STAGES_STATE_FWD_KDA = 3
GPU_NUM_WARPS_STATE_FWD_KDA_WIDE = 8
# The triangular inverse's products for 16-bit inputs with L2-normed keys (`inverse_dots`): fp16 operands, whose
# 10-bit mantissa is tf32's, at twice the tensor-core rate and half the bytes. A's entries are at most 1 in magnitude
# (normed keys, beta <= 1, decays <= 1) and the inverse's were at most 1.0 in every case measured (fp64, random,
# correlated, and beta-1 keys), far inside fp16's 6.5e4. H200, B4 T8192 H16 K=V=128 bf16: WY pass 0.296 ms against
# 0.332 in tf32, W and U as far from the fp64 ones (docs/PERF.md, linear attention).
GPU_INVERSE_DOTS_16BIT = "fp16"
# The parallel kernels handle one chunk each: their short V loops have little to prefetch.
GPU_NUM_STAGES = 1
# The WY pass multiplies W's and U's operands in 16 bits where the tiles allow (wu_operands_16bit).
GPU_WU_16BIT = True
WU_16BIT_MIN_DIM = 64
# The interpreter runs each program in Python: 16-wide V tiles make V = 32 take the multi-tile paths in CPU tests.
INTERPRETER_BLOCK_V = MIN_DOT_SIZE


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch settings of one call, picked from the device."""

    block_v_state: int
    block_v_grad: int
    block_v_wy: int
    block_v_output: int
    block_k_output: int
    num_warps: int
    num_warps_grad: int
    num_warps_output: int
    num_warps_output_kda: int
    num_warps_kda_pairs: int
    num_warps_kda_grad_wy: int
    num_warps_kda_grad_products: int
    num_stages_state: int
    num_stages: int
    num_stages_output: int
    num_stages_output_kda: int
    wu_16bit: bool
    block_v_wy_16bit: int
    # The forward's state-storing serial pass (state_fwd_launch).
    block_v_state_fwd: tuple[int, ...]
    min_state_programs: int
    num_stages_state_fwd: int
    num_stages_state_fwd_kda: int
    num_warps_state_fwd_kda_wide: int
    inverse_dots_16bit: str


def pick_config(x: torch.Tensor) -> KernelConfig:
    if not x.is_cuda:
        # CPU tensors only reach a kernel under TRITON_INTERPRET=1.
        block_v = INTERPRETER_BLOCK_V
        return KernelConfig(
            block_v, block_v, block_v, block_v, block_k_output=MIN_DOT_SIZE, num_warps=1, num_warps_grad=1,
            num_warps_output=1, num_warps_output_kda=1, num_warps_kda_pairs=1, num_warps_kda_grad_wy=1,
            num_warps_kda_grad_products=1, num_stages_state=1, num_stages=1, num_stages_output=1,
            num_stages_output_kda=1, wu_16bit=True, block_v_wy_16bit=block_v, block_v_state_fwd=(block_v,),
            min_state_programs=1, num_stages_state_fwd=1, num_stages_state_fwd_kda=1, num_warps_state_fwd_kda_wide=1,
            inverse_dots_16bit=GPU_INVERSE_DOTS_16BIT,
        )
    return KernelConfig(
        GPU_BLOCK_V_STATE,
        GPU_BLOCK_V_GRAD,
        GPU_BLOCK_V_WY,
        GPU_BLOCK_V_OUTPUT,
        GPU_BLOCK_K_OUTPUT,
        GPU_NUM_WARPS,
        GPU_NUM_WARPS_GRAD,
        GPU_NUM_WARPS_OUTPUT,
        GPU_NUM_WARPS_OUTPUT_KDA,
        GPU_NUM_WARPS_KDA_PAIRS,
        GPU_NUM_WARPS_KDA_GRAD_WY,
        GPU_NUM_WARPS_KDA_GRAD_PRODUCTS,
        GPU_NUM_STAGES_STATE,
        GPU_NUM_STAGES,
        GPU_NUM_STAGES_OUTPUT,
        GPU_NUM_STAGES_OUTPUT_KDA,
        GPU_WU_16BIT,
        GPU_BLOCK_V_WY_16BIT,
        GPU_BLOCK_V_STATE_FWD,
        GPU_MIN_STATE_PROGRAMS,
        GPU_NUM_STAGES_STATE_FWD,
        GPU_NUM_STAGES_STATE_FWD_KDA,
        GPU_NUM_WARPS_STATE_FWD_KDA_WIDE,
        GPU_INVERSE_DOTS_16BIT,
    )


def dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(operand dots, fp32 dots of the triangular inverse).

    fp32 inputs get exact fp32 products, as the reference; 16-bit inputs multiply 16-bit operands (the precision
    argument is then unused) and build the inverse in tf32, finer than the 16-bit W and U it feeds.
    """
    if dtype == torch.float32:
        return "ieee", "ieee"
    return "tf32", "tf32"


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests replace it to fill buffers with NaN and guard their ends)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block(dim: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(dim))


@dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk of every sequence lives, built on the device without a host sync.

    cu_seqlens: [N + 1] int32 sequence starts in the packed token axis.
    chunk_offsets: [N + 1] int32, the first chunk slot of each sequence (slots of one sequence are consecutive).
    chunk_map: [NC, 2] int32, (first token, number of tokens) of each chunk slot; unused slots have 0 tokens.
    """

    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_map: torch.Tensor
    num_slots: int
    chunk_size: int

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


# Layouts of recent calls, newest last. Every linear attention layer of a model step packs the same cu_seqlens, and
# building a layout is about 20 small device ops a call: the cache saves 0.06 ms of the op's forward at B4 T8192 H16
# K=V=128 on the H200 (docs/PERF.md, linear attention).
_LAYOUT_CACHE_SIZE = 8
_layout_cache: OrderedDict[tuple, tuple[torch.Tensor | None, ChunkLayout]] = OrderedDict()


def prepare_chunks(
    cu_seqlens: torch.Tensor | None, batch_size: int, seq_len: int, chunk_size: int = CHUNK_SIZE, device=None
) -> ChunkLayout:
    """The chunk layout of `batch_size` sequences of `seq_len` tokens, or of the packed sequences of cu_seqlens.

    The same cu_seqlens tensor (the same object, not changed in place since) or the same fixed-length shape and
    device gives the same layout object back; the layout's tensors are only read, by every kernel."""
    if cu_seqlens is not None and cu_seqlens.is_inference():
        # Inference tensors keep no version counter to tell an in-place change.
        return _build_chunks(cu_seqlens, batch_size, seq_len, chunk_size, device)
    if cu_seqlens is None:
        key = (None, 0, batch_size, seq_len, chunk_size, str(torch.device(device or "cpu")))
    else:
        # The entry holds the tensor itself, so its id is not reused while the entry lives.
        key = (id(cu_seqlens), cu_seqlens._version, batch_size, seq_len, chunk_size, str(cu_seqlens.device))
    entry = _layout_cache.get(key)
    if entry is not None and entry[0] is cu_seqlens:
        _layout_cache.move_to_end(key)
        return entry[1]
    layout = _build_chunks(cu_seqlens, batch_size, seq_len, chunk_size, device)
    _layout_cache[key] = (cu_seqlens, layout)
    if len(_layout_cache) > _LAYOUT_CACHE_SIZE:
        _layout_cache.popitem(last=False)
    return layout


def _build_chunks(
    cu_seqlens: torch.Tensor | None, batch_size: int, seq_len: int, chunk_size: int, device
) -> ChunkLayout:
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch_size + 1, device=device) * seq_len
        num_slots = batch_size * triton.cdiv(seq_len, chunk_size)
        num_tokens = batch_size * seq_len
    else:
        num_tokens = seq_len
        num_seqs = cu_seqlens.numel() - 1
        # sum ceil(len / C) <= T // C + N: an upper bound known without reading cu_seqlens on the host.
        num_slots = num_tokens // chunk_size + num_seqs
    cu_seqlens = cu_seqlens.to(torch.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
    chunk_offsets = torch.nn.functional.pad(chunks_per_seq.cumsum(0), (1, 0)).to(torch.int32)
    slot = torch.arange(num_slots, device=cu_seqlens.device, dtype=torch.int32)
    num_seqs = lengths.numel()
    seq = torch.searchsorted(chunk_offsets[1:], slot, right=True).clamp(max=max(num_seqs - 1, 0))
    first_token = cu_seqlens[seq] + (slot - chunk_offsets[seq]) * chunk_size
    num_tokens_in_chunk = (cu_seqlens[seq + 1] - first_token).clamp(0, chunk_size)
    chunk_map = torch.stack([first_token, num_tokens_in_chunk], dim=1).to(torch.int32).contiguous()
    return ChunkLayout(cu_seqlens.contiguous(), chunk_offsets.contiguous(), chunk_map, num_slots, chunk_size)


@triton.jit
def _load_chunk_state_t(ptr, i_c, i_h, num_valid, H, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """[BV, BK]: V tile v0 of the per-chunk state (or its gradient) of slot i_c and head i_h, stored [NS, H, K, V],
    read transposed; zeros for a slot holding no chunk (it stored nothing)."""
    offs_k = tl.arange(0, BK)
    slot_head = (i_c * H + i_h).to(tl.int64) * K * V
    has_chunk = num_valid > 0
    offs_v = v0 + tl.arange(0, BV)
    offsets = offs_k[None, :] * V + offs_v[:, None]
    mask = (offs_k[None, :] < K) & (offs_v[:, None] < V) & has_chunk
    return tl.load(ptr + slot_head + offsets, mask=mask, other=0.0)


@triton.jit
def _load_rows(ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    """[BT, BD] tile of rows t0 .. t0 + num_valid (zeros past them and past num_cols); ptr is at column 0."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[:, None]).to(tl.int64) * row_stride + cols[None, :]
    mask = (rows[:, None] < num_valid) & (cols[None, :] < num_cols)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _load_rows_t(ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    """The transpose [BD, BT] of `_load_rows`, read transposed from memory."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[None, :]).to(tl.int64) * row_stride + cols[:, None]
    mask = (rows[None, :] < num_valid) & (cols[:, None] < num_cols)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, x, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[:, None]).to(tl.int64) * row_stride + cols[None, :]
    mask = (rows[:, None] < num_valid) & (cols[None, :] < num_cols)
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_rows(x, USE_L2NORM: tl.constexpr):
    """fp32 x / sqrt(sum(x^2) + eps) per row when USE_L2NORM, else x in fp32."""
    x = x.to(tl.float32)
    if USE_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + _L2NORM_EPS)[:, None]
    return x


@triton.jit
def _load_decay(g_cumsum_ptr, t0, num_valid, H, BT: tl.constexpr):
    """G [BT] fp32 of one chunk and its last value G_C; rows past the chunk's end repeat G_C, as zero-padded
    tokens (g = 0) would, so every pairwise G_i - G_j with j <= i stays <= 0."""
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    G = tl.load(g_cumsum_ptr + (t0 + rows).to(tl.int64) * H, mask=is_valid, other=0.0)
    G_last = tl.sum(tl.where(rows == num_valid - 1, G, 0.0), axis=0)
    return tl.where(is_valid, G, G_last), G_last


@triton.jit
def _load_channel_decay(g_cumsum_ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BK: tl.constexpr):
    """G [BT, BK] fp32 per key channel and its last row G_C [BK]; rows past the chunk's end repeat G_C."""
    rows = tl.arange(0, BT)
    G = _load_rows(g_cumsum_ptr, t0, num_valid, row_stride, num_cols, BT, BK)
    G_last = tl.sum(tl.where((rows == num_valid - 1)[:, None], G, 0.0), axis=0)
    return tl.where((rows < num_valid)[:, None], G, G_last[None, :]), G_last


@triton.jit
def _decays(g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The decays of one chunk, shaped to scale [BT, BK] rows and the [BK, BV] state: (exp(G), exp(G_C - G),
    exp(G_C)) as ([BT, 1], [BT, 1], scalar) per head or ([BT, BK], [BT, BK], [BK, 1]) per channel, and G."""
    if IS_PER_CHANNEL:
        G, G_last = _load_channel_decay(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
        decay = tl.exp(G)
        decay_to_end = tl.exp(G_last[None, :] - G)
        state_decay = tl.exp(G_last)[:, None]
    else:
        G, G_last = _load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
        decay = tl.exp(G)[:, None]
        decay_to_end = tl.exp(G_last - G)[:, None]
        state_decay = tl.exp(G_last)
    return decay, decay_to_end, state_decay, G


@triton.jit
def _state_decay(g_cumsum_ptr, i_h, t_last, H, K, IS_PER_CHANNEL: tl.constexpr, BK: tl.constexpr):
    """exp(G_C) of the chunk whose last token is t_last, shaped as `_decays` gives it (scalar, or [BK, 1])."""
    if IS_PER_CHANNEL:
        offs_k = tl.arange(0, BK)
        G_last = tl.load(g_cumsum_ptr + (t_last.to(tl.int64) * H + i_h) * K + offs_k, mask=offs_k < K, other=0.0)
        return tl.exp(G_last)[:, None]
    else:
        return tl.exp(tl.load(g_cumsum_ptr + t_last.to(tl.int64) * H + i_h))


@triton.jit
def _pair_decay(G, IS_INCLUSIVE: tl.constexpr, IS_TRANSPOSED: tl.constexpr, BT: tl.constexpr):
    """[BT, BT] exp(G_i - G_j) for j <= i (j < i unless IS_INCLUSIVE), 0 elsewhere; IS_TRANSPOSED gives [j, i].

    The exponent is masked before the exp: for j > i it is positive and may overflow fp32.
    """
    rows = tl.arange(0, BT)
    if IS_TRANSPOSED:
        log_decay = G[None, :] - G[:, None]
        if IS_INCLUSIVE:
            mask = rows[None, :] >= rows[:, None]
        else:
            mask = rows[None, :] > rows[:, None]
    else:
        log_decay = G[:, None] - G[None, :]
        if IS_INCLUSIVE:
            mask = rows[:, None] >= rows[None, :]
        else:
            mask = rows[:, None] > rows[None, :]
    return tl.where(mask, tl.exp(tl.where(mask, log_decay, 0.0)), 0.0)


@triton.jit
def _decayed_qk(q, k, G, dot_dtype, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BT, BT] fp32 (q k^T)[i, j] exp(G_i - G_j) for j <= i, 0 above: the output's intra-chunk pairs (per-head
    decay; q and k already scaled and normed as the caller wants), products in dot_dtype."""
    qk = tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)
    return qk * _pair_decay(G, True, False, BT)


@triton.jit
def _inverse_dot(x, y, DOTS: tl.constexpr):
    """fp32 x @ y for the triangular inverse: DOTS "fp16" rounds both operands to fp16, else it is tl.dot's
    input_precision ("tf32", "ieee")."""
    if DOTS == "fp16":
        z = tl.dot(x.to(tl.float16), y.to(tl.float16))
    else:
        z = tl.dot(x, y, input_precision=DOTS)
    return z


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, SB: tl.constexpr, DOTS: tl.constexpr):
    """(I + A)^-1 [BT, BT] fp32 for A strictly lower triangular fp32, by block forward substitution with the block
    size doubling: with T_s the inverse of I + (A's s x s diagonal blocks) (T_1 = I) and A_s the part of A in the
    lower-left s x s block of each 2s x 2s diagonal block, T_2s = T_s - T_s A_s T_s (N = T_s A_s has N^2 = 0, so
    (I + N)^-1 = I - N). Every product is of bounded factors (T's blocks and A's), so the rounding of 16-bit dot
    operands stays at their precision.

    Doubling the powers of A instead ((I + L)^-1 = (I - L)(I + L^2)(I + L^4)..., then a Neumann merge) takes the same
    number of products but cancels large intermediate powers: keys at cosine ~0.9 with beta near 1 give W 60x off the
    fp64 one and NaN outputs (docs/PERF.md, linear attention). Levels below SB run batched on the [BT / SB, SB, SB]
    diagonal blocks, the others (s >= SB) on the [BT, BT] tile."""
    NB: tl.constexpr = BT // SB
    blocks = tl.arange(0, NB)
    is_diag_block = blocks[:, None, None, None] == blocks[None, None, :, None]  # [NB, 1, NB, 1]
    # A_diag[b, i, j] = A[b SB + i, b SB + j]: the other blocks of each block row are masked out of the sum.
    A_diag = tl.sum(tl.where(is_diag_block, tl.reshape(A, (NB, SB, NB, SB)), 0.0), axis=2)
    r = tl.arange(0, SB)
    i = r[:, None]
    j = r[None, :]
    # T_2: the 2 x 2 diagonal blocks of (I + A)^-1 are I - A there.
    inv_b = tl.where(i == j, 1.0, 0.0)[None, :, :] - tl.where(((i // 2) == (j // 2))[None, :, :], A_diag, 0.0)
    for e in tl.static_range(1, 7):
        if (1 << e) < SB:
            A_s = tl.where((((i >> (e + 1)) == (j >> (e + 1))) & ((i >> e) > (j >> e)))[None, :, :], A_diag, 0.0)
            inv_b -= _inverse_dot(_inverse_dot(inv_b, A_s, DOTS), inv_b, DOTS)
    inv = tl.reshape(tl.where(is_diag_block, inv_b[:, :, None, :], 0.0), (BT, BT))
    rows = tl.arange(0, BT)
    ii = rows[:, None]
    jj = rows[None, :]
    for e in tl.static_range(1, 8):
        if ((1 << e) >= SB) and ((1 << e) < BT):
            A_s = tl.where(((ii >> (e + 1)) == (jj >> (e + 1))) & ((ii >> e) > (jj >> e)), A, 0.0)
            inv -= _inverse_dot(_inverse_dot(inv, A_s, DOTS), inv, DOTS)
    return inv


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

    k = _l2norm_rows(_load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
    if STORE_K_END:
        # k exp(G_C - G), the state update's operand, as the state pass computed it (same ops, same rounding).
        G_last = tl.sum(tl.where(rows == num_valid - 1, G, 0.0), axis=0)
        _store_rows(k_end_ptr + i_h * K, k * tl.exp(G_last - G)[:, None], t0, num_valid, H * K, K, BT, BK)
    k_dot = k.to(dot_dtype)
    A = tl.dot(k_dot, tl.trans(k_dot), input_precision=DOT_PRECISION) * beta[:, None]
    A = A * _pair_decay(G, False, False, BT)
    inverse = _unit_lower_inverse(A, BT, SB, INV_DOTS)
    if STORE_INVERSE:
        _store_rows(inverse_ptr + i_h * BT, inverse, t0, num_valid, H * BT, BT, BT, BT)

    _store_w_u(inverse, k * (beta * tl.exp(G))[:, None], beta, v_ptr + i_h * V, w_ptr + i_h * K, u_ptr + i_h * V, t0,
               num_valid, H, K, V, BT, BK, BV, INV_PRECISION, WU_16BIT)  # fmt: skip


@triton.jit
def _store_w_u(inverse, k_scaled, beta, v_ptr, w_ptr, u_ptr, t0, num_valid, H, K, V, BT: tl.constexpr,
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
    _store_rows(w_ptr, w, t0, num_valid, H * K, K, BT, BK)
    for v0 in range(0, V, BV):
        v = _load_rows(v_ptr + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        if WU_16BIT:
            u = tl.dot(inverse_op, (v * beta[:, None]).to(op_dtype))
        else:
            u = tl.dot(inverse, v * beta[:, None], input_precision=INV_PRECISION)
        _store_rows(u_ptr + v0, u, t0, num_valid, H * V, V - v0, BT, BV)


def inverse_dots(dtype: torch.dtype, use_qk_l2norm: bool, config: KernelConfig) -> str:
    """The triangular inverse's dots (`_inverse_dot`): exact for fp32 inputs; for 16-bit inputs with L2-normed keys
    config.inverse_dots_16bit, else tf32."""
    if dtype == torch.float32:
        return "ieee"
    return config.inverse_dots_16bit if use_qk_l2norm else "tf32"


def wu_operands_16bit(dtype: torch.dtype, K: int, V: int, config: KernelConfig) -> bool:
    """Whether the WY pass multiplies W's and U's operands in the 16-bit input dtype (as flash-linear-attention's
    recompute_w_u does) rather than tf32: only for K and V tiles of at least 64. With 16-bit operands, Triton 3.6 on
    the H200 returned NaN for K or V below 64 (the inverse itself was right); fp32 inputs keep exact products."""
    return (
        config.wu_16bit
        and dtype in (torch.float16, torch.bfloat16)
        and _block(K) >= WU_16BIT_MIN_DIM
        and min(config.block_v_wy, config.block_v_wy_16bit, _block(V)) >= WU_16BIT_MIN_DIM
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
            state_decay = _state_decay(g_cumsum_ptr, i_h, t0 + num_valid - 1, H, K, IS_PER_CHANNEL, BK)
            k_decayed = _load_rows(k_end_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        else:
            decay, decay_to_end, state_decay, G = _decays(
                g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL, BT, BK
            )
            k = _l2norm_rows(_load_rows(k_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM)
            # G_C - G_j <= 0: the decay from each token to the chunk's end never overflows.
            k_decayed = (k * decay_to_end).to(dot_dtype)
        w = _load_rows(w_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK).to(dot_dtype)
        u = _load_rows(u_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(tl.float32)
        if STORE_STATES:
            slot_head = ((first_slot + i_t) * H + i_h).to(tl.int64) * K * V
            tl.store(states_ptr + slot_head + state_offsets, state.to(states_ptr.dtype.element_ty), mask=state_mask)
        state_dot = state.to(dot_dtype)
        # u_j = beta_j times the delta-rule error of token j against the state entering the chunk.
        v_new = u - tl.dot(w, state_dot, input_precision=DOT_PRECISION)
        v_new_dot = v_new.to(dot_dtype)
        if STORE_STATES:
            _store_rows(v_new_ptr + i_h * V + v0, v_new, t0, num_valid, H * V, V - v0, BT, BV)
        if COMPUTE_OUTPUT:
            q = _l2norm_rows(_load_rows(q_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK), USE_L2NORM) * scale
            if IS_PER_CHANNEL:
                # The decayed, causal q k^T of the WY kernel: per-channel decays do not factor out of the dot.
                qk = _load_rows(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT).to(dot_dtype)
            else:
                qk = _decayed_qk(q, k, G, dot_dtype, BT, DOT_PRECISION).to(dot_dtype)
            o = tl.dot((q * decay).to(dot_dtype), state_dot, input_precision=DOT_PRECISION)
            o += tl.dot(qk, v_new_dot, input_precision=DOT_PRECISION)
            _store_rows(o_ptr + i_h * V + v0, o, t0, num_valid, H * V, V - v0, BT, BV)
        state = state * state_decay + tl.dot(tl.trans(k_decayed), v_new_dot, input_precision=DOT_PRECISION)

    if STORE_FINAL_STATE:
        tl.store(final_state_ptr + seq_head + state_offsets, state, mask=state_mask)


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
        q = _load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
        state_mask = (k0 + offs_k[:, None] < K) & (offs_v[None, :] < V) & has_chunk
        state = tl.load(
            states_ptr + slot_head + (k0 + offs_k[:, None]) * V + offs_v[None, :], mask=state_mask, other=0.0
        )
        if USE_L2NORM:
            q_sq += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        if IS_PER_CHANNEL:
            G = _load_rows(g_cumsum_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
            q = q.to(tl.float32) * tl.exp(G)
        else:
            k = _load_rows(k_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK)
            if USE_L2NORM:
                k_sq += tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1)
            qk += tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)
        o += tl.dot(q.to(dot_dtype), state.to(dot_dtype), input_precision=DOT_PRECISION)
    q_factor = tl.full([BT], scale, tl.float32)
    if USE_L2NORM:
        q_factor = q_factor * tl.rsqrt(q_sq + _L2NORM_EPS)
    if IS_PER_CHANNEL:
        qk = _load_rows(qk_ptr + i_h * BT, t0, num_valid, H * BT, BT, BT, BT)
    else:
        G, _ = _load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
        qk = qk * q_factor[:, None] * _pair_decay(G, True, False, BT)
        if USE_L2NORM:
            qk = qk * tl.rsqrt(k_sq + _L2NORM_EPS)[None, :]
        q_factor = q_factor * tl.exp(G)
    v_new = _load_rows(v_new_ptr + i_h * V + v0, t0, num_valid, H * V, V - v0, BT, BV).to(dot_dtype)
    o = o * q_factor[:, None] + tl.dot(qk.to(dot_dtype), v_new, input_precision=DOT_PRECISION)
    _store_rows(o_ptr + i_h * V + v0, o, t0, num_valid, H * V, V - v0, BT, BV)
    if STORE_BWD_OPERANDS:
        if v0 == 0:
            for k0 in range(0, K, BK):
                q = _load_rows(q_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK).to(tl.float32)
                if IS_PER_CHANNEL:
                    q = q * tl.exp(_load_rows(g_cumsum_ptr + i_h * K + k0, t0, num_valid, H * K, K - k0, BT, BK))
                _store_rows(q_dec_ptr + i_h * K + k0, q * q_factor[:, None], t0, num_valid, H * K, K - k0, BT, BK)
            if not IS_PER_CHANNEL:
                _store_rows(qk_out_ptr + i_h * BT, qk, t0, num_valid, H * BT, BT, BT, BT)


def has_output_kernel(K: int, V: int, config: KernelConfig) -> bool:
    """Whether the forward computes the output in the parallel kernel (either decay), given the head dims.

    Only when its V tile is at least as wide as its K tile: at K 32 with V 16, triton 3.6 compiled the output
    kernel into one that reads past its shared memory on the H200 (compute-sanitizer memcheck, at 8 and at 4 warps;
    it surfaced as an illegal address in a later kernel). Of the GPU tests' other shapes, the one with a narrower V
    tile (K 128, V 64) ran clean, as did all with V tiles as wide as their K tiles; the rule keeps to the
    side of what was seen clean. Other shapes take the serial pass that also writes the output.
    """
    return min(config.block_v_output, _block(V)) >= _block(K)


def has_k_end(K: int) -> bool:
    """Whether the WY pass hands the serial state pass k exp(G_C - G) (store_k_end), given the key head dim.

    Only when K fills its tile (a power of two): at K 100 (tile 128) on the H200 (triton 3.6) the states came out
    71% off in RMS and a later launch hit an illegal address, while every power of two the GPU tests run (16, 32, 64,
    128) gave the states of the path that computes the decayed k in the loop; the interpreter is right at K 100, so
    it is the compiled kernel. Other K take that path.
    """
    return K == _block(K)


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
    o_THV = _alloc((T, H, V), q_THK.dtype, q_THK.device)
    q_dec_THK = _alloc((T, H, K), k_THK.dtype, q_THK.device) if store_bwd_operands else None
    qk_out_THC = _alloc((T, H, C), k_THK.dtype, q_THK.device) if store_bwd_operands and qk_THC is None else None
    block_v = min(config.block_v_output, _block(V))
    dot_precision, _ = dot_precisions(q_THK.dtype)
    if qk_THC is not None:
        num_warps, num_stages = config.num_warps_output_kda, config.num_stages_output_kda
    elif q_THK.element_size() == 2 and not store_bwd_operands:
        num_warps, num_stages = config.num_warps_output, config.num_stages_output
    else:
        # fp32 tiles (twice the shared memory a stage), or the variant that also stores the backward's operands:
        # that variant at 8 warps and 3 stages compiles wrong on the H200 (forward output 1.1e-2 off the fp32
        # reference against 4.9e-4 at 4 warps and 1 stage; docs/PERF.md, linear attention).
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
            BK=min(config.block_k_output, _block(K)),
            BV=block_v,
            DOT_PRECISION=dot_precision,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return o_THV, q_dec_THK, qk_out_THC


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
    g_cumsum_TH = _alloc((T, H), torch.float32, device)
    w_THK = _alloc((T, H, K), k_THK.dtype, device)
    u_THV = _alloc((T, H, V), k_THK.dtype, device)
    inverse_THC = _alloc((T, H, C), k_THK.dtype, device) if store_inverse else None
    k_end_THK = _alloc((T, H, K), k_THK.dtype, device) if store_k_end else None
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
            BK=_block(K),
            BV=min(config.block_v_wy_16bit if k_THK.element_size() == 2 else config.block_v_wy, _block(V)),
            DOT_PRECISION=dot_precision,
            INV_PRECISION=inv_precision,
            INV_DOTS=inverse_dots(k_THK.dtype, use_qk_l2norm, config),
            WU_16BIT=wu_operands_16bit(k_THK.dtype, K, V, config),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return g_cumsum_TH, w_THK, u_THV, inverse_THC, k_end_THK


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

    Per-channel decays (KDA): g_cumsumK is [T, H, K] and qk_THC the decayed causal q k^T of kda_wy_fwd.
    k_end_THK: k exp(G_C - G) from the WY pass (store_k_end), without compute_output: the loop then reads it and
    G_C instead of k and G (no L2 norm or decay in the serial loop)."""
    if k_end_THK is not None and compute_output:
        raise ValueError("chunk_state_fwd: k_end_THK is for the pass without the output (compute_output=False)")
    T, H, K = k_THK.shape
    V = u_THV.shape[-1]
    N = layout.num_seqs
    device = k_THK.device
    store_dtype = k_THK.dtype
    o_THV = _alloc((T, H, V), q_THK.dtype, device) if compute_output else None
    final_state_NHKV = _alloc((N, H, K, V), torch.float32, device) if output_final_state else None
    states_NCHKV = _alloc((layout.num_slots, H, K, V), store_dtype, device) if store_states else None
    v_new_THV = _alloc((T, H, V), store_dtype, device) if store_states else None
    if compute_output or k_THK.element_size() != 2 or _block(K) > 128:
        # The serial pass writing the output, fp32 inputs, wide keys: the settings measured for them.
        block_v, num_warps, num_stages = min(config.block_v_state, _block(V)), config.num_warps, config.num_stages_state
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
            BK=_block(K),
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
    tiles = [min(tile, _block(V)) for tile in config.block_v_state_fwd]
    block_v = next((tile for tile in tiles if triton.cdiv(V, tile) * num_seq_heads >= config.min_state_programs),
                   tiles[-1])  # fmt: skip
    if is_per_channel:
        num_warps = config.num_warps_state_fwd_kda_wide if block_v >= 64 else config.num_warps
        return block_v, num_warps, config.num_stages_state_fwd_kda
    return block_v, config.num_warps, config.num_stages_state_fwd
