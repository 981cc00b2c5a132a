"""Shared pieces of the chunked gated delta rule's Triton kernels: launch settings, the chunk layout, the buffer
allocator, and the @triton.jit helpers the passes share (row tiles, L2 norm, decays, the triangular inverse).

Legend: T tokens of all sequences packed along time (B*T without cu_seqlens), H heads, K key dim, V value dim,
N sequences, C chunk length (BT inside kernels), NC chunk slots (one per chunk of every sequence, plus unused ones
at the end), BK/BV tile widths over K/V, J the reverse state pass's V tiles, G the log decay summed from the chunk
start (inclusive).

Every tensor is token-major and contiguous: x_THD[t, h, d] sits at (t * H + h) * D + d; per-chunk states
states_NCHKV[c, h] are the [K, V] state entering chunk slot c. A batch of B equal sequences is the packed case with
cu_seqlens = (0, T, 2T, ...), so one code path serves both.

The forward is the WY pass (kernels_wy.py), the serial state pass (kernels_state.py) and the output pass
(kernels_output.py); for head dims whose V tile is narrower than their K tile the state pass writes the output
itself (`has_output_kernel`). KDA runs its pairs kernel before its own WY kernel (kernels_kda.py). The backward is in
kernels_bwd.py (per head) and kernels_kda.py (per channel).

Triton 3.4-3.7.0 on Hopper miscompiles tl.trans of a tl.dot result that feeds another tl.dot (fla-org/
flash-linear-attention#640): the kernels of this package only transpose tiles loaded from memory or built
elementwise from them; a transposed product of computed tiles is computed as its own dot or read back from memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.launch import with_overrides
from moe_tune.ops.linear_attention import reference

# Kernels read module globals only when they are constexpr.
L2NORM_EPS = tl.constexpr(reference.L2NORM_EPS)

# The chunk length C: 64 x 64 intra-chunk blocks fill a tensor-core tile and keep the triangular solve short.
CHUNK_SIZE = reference.DEFAULT_CHUNK_SIZE
# The triangular inverse's substitution levels below 16 rows run batched on the [C / 16, 16, 16] diagonal blocks
# (16 is the smallest tl.dot size); the levels from 16 rows up run on the whole [C, C] tile (`unit_lower_inverse`).
SUB_CHUNK_SIZE = 16
# tl.dot needs every operand dimension to be at least 16.
MIN_DOT_SIZE = 16
# Where these were measured (H200, B4 T8192 H16 K=V=128 bf16 unless said): docs/perf-history.md, "Chunked linear
# attention". Register and stack figures are from the sm_90 compile on triton 3.6.
# 32 value columns per state program: 256 serial programs for 132 SMs; the fp32 [128, 32] state: 32 registers a thread.
GPU_BLOCK_V_STATE = 32
# The per-chunk gradient kernel loops over V in tiles of 64: two iterations at V = 128.
GPU_BLOCK_V_GRAD = 64
# U's V tiles in the WY kernels; the per-head one with 16-bit inputs takes 128: WY pass 0.349 against 0.372 ms.
GPU_BLOCK_V_WY = 64
GPU_BLOCK_V_WY_16BIT = 128
# The output kernel: q k^T once per V tile, K looped in 64s; the fastest launches that compile right (per-head
# 0.267 ms at 8 warps / 3 stages, KDA 0.252 at 4 / 2; the per-head loop at 4 warps and 2-3 stages miscompiles).
GPU_BLOCK_V_OUTPUT = 128
GPU_BLOCK_K_OUTPUT = 64
GPU_NUM_WARPS_OUTPUT = 8
GPU_NUM_WARPS_OUTPUT_KDA = 4
GPU_NUM_STAGES_OUTPUT = 3
GPU_NUM_STAGES_OUTPUT_KDA = 2
# Triton 3.7 computes the per-head 16-bit o wrong, unrepeatably, at 8 warps / 3 stages; there it takes 4 warps and
# 1 stage, with which every linear-attention GPU test passes on 3.7.1 (docs/PERF.md, "GPU tests").
TRITON_37_OUTPUT_LAUNCH = (4, 1)
TRITON_37 = (3, 7)
# KDA's pairs kernel: 8 warps, the fastest of 4, 8 and 16 at B4 T8192 (docs/perf-history.md, "KDA's pairs kernel by
# row blocks").
GPU_NUM_WARPS_KDA_PAIRS = 8
# KDA's gradient kernels at 8 warps: the WY one spills 200 bytes a thread (4 warps: 2,080), the products one 568.
GPU_NUM_WARPS_KDA_GRAD_WY = 8
GPU_NUM_WARPS_KDA_GRAD_PRODUCTS = 8
# The products kernel in key tiles (KernelConfig.block_k_kda_grad_products) launches at most this many warps: at 16
# warps and 32-column tiles it made an illegal memory access on the H200, Triton 3.6 and 3.7.1, from one token up.
MAX_WARPS_KDA_PRODUCTS_TILED = 8
# 4 warps (one warpgroup) for the [64, 64] and [64, 128] tiles of the forward and the state kernels.
GPU_NUM_WARPS = 4
# The gradient kernel holds three [64, 128] fp32 accumulators: 8 warps keep them in registers.
GPU_NUM_WARPS_GRAD = 8
# The per-head backward after the state pass: the state part in the output kernel (whole K), the WY part in key tiles
# of 64 at 4 warps (254 registers, no stack: two blocks an SM). At B4 T8192 H16 bf16 on the H200 (Triton 3.7.1,
# 4c55adb) 3.548 ms a training pass against the one WY kernel's 3.905 and FLA's 3.571 (docs/PERF.md, "Where the
# gated delta rule's training pass trails FLA's").
GPU_SPLIT_GRAD_WY = dict(split_grad_wy=True, grad_state_in_output=True, block_k_grad_wy=64, num_warps_grad_wy=4)
# dq through q's L2 norm in the output kernel (no fp32 dq for the WY kernel) and dk through k's in the WY kernel's
# dk loop (no fp32 dk stored and read back there): on an H100 (Triton 3.7.1, 45a8a48) 3.604 ms a training pass at B4
# T8192 H16 bf16 against 3.964 without (docs/PERF.md, "Launch candidates on an H100").
GPU_GRAD_NORMS = dict(grad_dq_norm_in_output=True, grad_wy_norm_one_pass=True)
# KDA's products kernel in key tiles of 64 (88 bytes of stack a thread against 608 for the whole K, sm_90): 9.959 ms a
# KDA training pass against 11.012 on an H100 (Triton 3.7.1, 45a8a48).
GPU_BLOCK_K_KDA_GRAD_PRODUCTS = 64
# Two stages let the serial state loops prefetch the next chunk's tiles while the current one computes.
GPU_NUM_STAGES_STATE = 2
# fp32 inputs in the output-writing state pass take 1 stage: its FP32_DOTS dots keep both halves of each operand in
# shared memory, and at 2 stages K 128 needs 271,360 bytes (per-head) and 253,952 (KDA) against the H200's 232,448
# (a V tile of 16 still 250,880); at 1 stage 163,840 and 98,304 (sm_90 compile, triton 3.6).
GPU_NUM_STAGES_STATE_OUTPUT_FP32 = 1
# The forward's state pass (`state_fwd_launch`): the widest V tile that still gives GPU_MIN_STATE_PROGRAMS programs,
# the fastest of the pass alone at B4 T8192 (per-head 0.259 ms, KDA 0.287) and at one 32K document (0.595, 0.821).
GPU_BLOCK_V_STATE_FWD = (64, 32, 16)
GPU_MIN_STATE_PROGRAMS = 128
GPU_NUM_STAGES_STATE_FWD = 4
GPU_NUM_STAGES_STATE_FWD_KDA = 3
GPU_NUM_WARPS_STATE_FWD_KDA_WIDE = 8
# The inverse's products in fp16 (`inverse_dots`; tf32's mantissa at twice the rate): |A|, |inverse| <= 1 with normed
# keys, beta, decay <= 1 (fp64 checks), far inside fp16's range; WY pass 0.296 ms against 0.332 in tf32.
GPU_INVERSE_DOTS_16BIT = "fp16"
# tl.dot's input_precision for fp32 inputs, "tf32x3": each fp32 operand is split into its tf32 rounding (big) and the
# remainder (small, truncated to tf32 as the tensor cores read it), and three tensor-core products, small x big +
# big x small + big x big, are summed in fp32 (small x small is dropped). Each product's error is bounded by about
# 1e-6 of |a| |b| (2^-21 per remainder, 2^-22 the dropped term) and is far below that in practice: <= 5e-8 of
# sum |a| |b| on random 64 x 128 x 64 operands (CPU emulation, products in fp64), under the 3e-7 an fp32 sgemm's own
# rounding gave there, against 9e-4 of the largest entry for one tf32 product. Near fp32, not bitwise fp32: the fp32
# GPU tests (tests/gpu) hold it to their fp32 tolerances. "ieee" (exact fp32 products) has no tensor-core path on
# Hopper: Triton unrolls every dot into scalar FMAs, 1-6 minutes of compile per kernel variant and FMA-unit speed.
# The interpreter ignores input_precision: its dots are numpy fp32 matmuls whatever the setting.
FP32_DOTS = "tf32x3"
# What `_inverse_dot` takes: fp16 operands, or tl.dot's input precisions.
INVERSE_DOTS = ("fp16", "tf32", "tf32x3", "ieee")
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
    inverse_dots_16bit: str = field(metadata={"choices": INVERSE_DOTS})
    # The per-head backward's state part in a kernel of its own (kernels_bwd._chunk_grad_state_kernel), so that the
    # WY gradient kernel carries no [C, K] accumulator through its V loop.
    split_grad_wy: bool = False
    # With split_grad_wy, the WY kernel's key tile (kernels_bwd._chunk_grad_wy_tiled_kernel); None, one tile of the
    # whole key dimension.
    block_k_grad_wy: int | None = None
    # With split_grad_wy, the WY kernel's warps (None: num_warps_grad, the other gradient kernels' count).
    num_warps_grad_wy: int | None = None
    # With split_grad_wy, the state part inside the output kernel (kernels_bwd._chunk_grad_output_state_kernel: each
    # state element read once for both) rather than in a kernel of its own; that kernel's key tile (None, the whole
    # key dimension) and warps (None: num_warps_grad).
    grad_state_in_output: bool = False
    block_k_grad_output: int | None = None
    num_warps_grad_output: int | None = None
    # With the state part in the output kernel over the whole key dimension, that kernel takes dq through q's L2 norm
    # (else the WY kernel does, from an fp32 dq).
    grad_dq_norm_in_output: bool = False
    # With split_grad_wy and the L2 norm, the WY kernel takes dk through its norm in its dk loop, sum(k * dk) found
    # before it, rather than storing dk unnormed in fp32 and reading it back in a last loop.
    grad_wy_norm_one_pass: bool = False
    # With split_grad_wy, the state kernel's warps (None: num_warps_grad).
    num_warps_grad_state: int | None = None
    # KDA's products kernel in key tiles of this width (kernels_kda._kda_grad_products_tiled_kernel; None, one of the
    # whole K: _kda_grad_products_kernel).
    block_k_kda_grad_products: int | None = None

    def __post_init__(self) -> None:
        problem = KernelConfig.overrides_problem(self.__dict__)
        if problem:
            raise ValueError(problem)

    @staticmethod
    def overrides_problem(fields: dict) -> str | None:
        """Why fields (of a config, or overrides over the GPU's) launch no working kernels, or None."""
        block_k = fields.get("block_k_kda_grad_products", GPU_BLOCK_K_KDA_GRAD_PRODUCTS)
        warps = fields.get("num_warps_kda_grad_products", GPU_NUM_WARPS_KDA_GRAD_PRODUCTS)
        if block_k is not None and warps > MAX_WARPS_KDA_PRODUCTS_TILED:
            return (f"num_warps_kda_grad_products {warps} with block_k_kda_grad_products {block_k}: key tiles launch "
                    f"at most {MAX_WARPS_KDA_PRODUCTS_TILED} warps (16 made an illegal memory access on the H200)")
        return None


def pick_config(x: torch.Tensor) -> KernelConfig:
    """The launch of the kernels for x's device, with the fields MOE_TUNE_LAUNCH names for `linear_attention`
    replaced (ops/common/launch.py)."""
    return with_overrides("linear_attention", _default_config(x))


def _default_config(x: torch.Tensor) -> KernelConfig:
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
    warps_output, stages_output = GPU_NUM_WARPS_OUTPUT, GPU_NUM_STAGES_OUTPUT
    if triton_version() >= TRITON_37:
        warps_output, stages_output = TRITON_37_OUTPUT_LAUNCH
    return KernelConfig(
        GPU_BLOCK_V_STATE,
        GPU_BLOCK_V_GRAD,
        GPU_BLOCK_V_WY,
        GPU_BLOCK_V_OUTPUT,
        GPU_BLOCK_K_OUTPUT,
        GPU_NUM_WARPS,
        GPU_NUM_WARPS_GRAD,
        warps_output,
        GPU_NUM_WARPS_OUTPUT_KDA,
        GPU_NUM_WARPS_KDA_PAIRS,
        GPU_NUM_WARPS_KDA_GRAD_WY,
        GPU_NUM_WARPS_KDA_GRAD_PRODUCTS,
        GPU_NUM_STAGES_STATE,
        GPU_NUM_STAGES,
        stages_output,
        GPU_NUM_STAGES_OUTPUT_KDA,
        GPU_WU_16BIT,
        GPU_BLOCK_V_WY_16BIT,
        GPU_BLOCK_V_STATE_FWD,
        GPU_MIN_STATE_PROGRAMS,
        GPU_NUM_STAGES_STATE_FWD,
        GPU_NUM_STAGES_STATE_FWD_KDA,
        GPU_NUM_WARPS_STATE_FWD_KDA_WIDE,
        GPU_INVERSE_DOTS_16BIT,
        **GPU_SPLIT_GRAD_WY,
        **GPU_GRAD_NORMS,
        block_k_kda_grad_products=GPU_BLOCK_K_KDA_GRAD_PRODUCTS,
    )


def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor)."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(operand dots, fp32 dots of the triangular inverse).

    fp32 inputs get FP32_DOTS (3xTF32, near-fp32 products on the tensor cores); 16-bit inputs multiply 16-bit
    operands (the precision argument is then unused) and build the inverse in tf32, finer than the 16-bit W and U it
    feeds.
    """
    if dtype == torch.float32:
        return FP32_DOTS, FP32_DOTS
    return "tf32", "tf32"


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here, looked up as `kernels_common.alloc` at each call: tests replace
    it to fill buffers with NaN and guard their ends."""
    return torch.empty(shape, dtype=dtype, device=device)


def block_size(dim: int) -> int:
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


# Layouts of recent calls, newest last: every linear attention layer of a step packs the same cu_seqlens, and a
# layout is about 20 small device ops (0.06 ms of the forward at B4 T8192 H16 K=V=128 on the H200).
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
def load_chunk_state_t(ptr, i_c, i_h, num_valid, H, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
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
def load_rows(ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    """[BT, BD] tile of rows t0 .. t0 + num_valid (zeros past them and past num_cols); ptr is at column 0."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[:, None]).to(tl.int64) * row_stride + cols[None, :]
    mask = (rows[:, None] < num_valid) & (cols[None, :] < num_cols)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def load_rows_t(ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    """The transpose [BD, BT] of `load_rows`, read transposed from memory."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[None, :]).to(tl.int64) * row_stride + cols[:, None]
    mask = (rows[None, :] < num_valid) & (cols[:, None] < num_cols)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def store_rows(ptr, x, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    offsets = (t0 + rows[:, None]).to(tl.int64) * row_stride + cols[None, :]
    mask = (rows[:, None] < num_valid) & (cols[None, :] < num_cols)
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def l2norm_rows(x, USE_L2NORM: tl.constexpr):
    """fp32 x / sqrt(sum(x^2) + eps) per row when USE_L2NORM, else x in fp32."""
    x = x.to(tl.float32)
    if USE_L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + L2NORM_EPS)[:, None]
    return x


@triton.jit
def l2norm_factors(q_ptr, k_ptr, t0, num_valid, row_stride, K, USE_L2NORM: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr):  # fmt: skip
    """(q_rstd, k_rstd) [BT]: 1 / sqrt(sum(x^2) + eps) of the chunk's rows of q and k (ptrs at column 0) over the whole
    key dimension, read in tiles of BK, for kernels that hold one key tile; ones without USE_L2NORM."""
    q_rstd = tl.full([BT], 1.0, dtype=tl.float32)
    k_rstd = tl.full([BT], 1.0, dtype=tl.float32)
    if USE_L2NORM:
        q_squares = tl.zeros([BT], dtype=tl.float32)
        k_squares = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            q = load_rows(q_ptr + k0, t0, num_valid, row_stride, K - k0, BT, BK).to(tl.float32)
            k = load_rows(k_ptr + k0, t0, num_valid, row_stride, K - k0, BT, BK).to(tl.float32)
            q_squares += tl.sum(q * q, axis=1)
            k_squares += tl.sum(k * k, axis=1)
        q_rstd = tl.rsqrt(q_squares + L2NORM_EPS)
        k_rstd = tl.rsqrt(k_squares + L2NORM_EPS)
    return q_rstd, k_rstd


@triton.jit
def load_decay(g_cumsum_ptr, t0, num_valid, H, BT: tl.constexpr):
    """G [BT] fp32 of one chunk and its last value G_C; rows past the chunk's end repeat G_C, as zero-padded
    tokens (g = 0) would, so every pairwise G_i - G_j with j <= i stays <= 0."""
    rows = tl.arange(0, BT)
    is_valid = rows < num_valid
    G = tl.load(g_cumsum_ptr + (t0 + rows).to(tl.int64) * H, mask=is_valid, other=0.0)
    G_last = tl.sum(tl.where(rows == num_valid - 1, G, 0.0), axis=0)
    return tl.where(is_valid, G, G_last), G_last


@triton.jit
def load_channel_decay(g_cumsum_ptr, t0, num_valid, row_stride, num_cols, BT: tl.constexpr, BK: tl.constexpr):
    """G [BT, BK] fp32 per key channel and its last row G_C [BK]; rows past the chunk's end repeat G_C."""
    rows = tl.arange(0, BT)
    G = load_rows(g_cumsum_ptr, t0, num_valid, row_stride, num_cols, BT, BK)
    G_last = tl.sum(tl.where((rows == num_valid - 1)[:, None], G, 0.0), axis=0)
    return tl.where((rows < num_valid)[:, None], G, G_last[None, :]), G_last


@triton.jit
def load_decays(g_cumsum_ptr, i_h, t0, num_valid, H, K, IS_PER_CHANNEL: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    """The decays of one chunk, shaped to scale [BT, BK] rows and the [BK, BV] state: (exp(G), exp(G_C - G),
    exp(G_C)) as ([BT, 1], [BT, 1], scalar) per head or ([BT, BK], [BT, BK], [BK, 1]) per channel, and G."""
    if IS_PER_CHANNEL:
        G, G_last = load_channel_decay(g_cumsum_ptr + i_h * K, t0, num_valid, H * K, K, BT, BK)
        decay = tl.exp(G)
        decay_to_end = tl.exp(G_last[None, :] - G)
        state_decay = tl.exp(G_last)[:, None]
    else:
        G, G_last = load_decay(g_cumsum_ptr + i_h, t0, num_valid, H, BT)
        decay = tl.exp(G)[:, None]
        decay_to_end = tl.exp(G_last - G)[:, None]
        state_decay = tl.exp(G_last)
    return decay, decay_to_end, state_decay, G


@triton.jit
def load_state_decay(g_cumsum_ptr, i_h, t_last, H, K, IS_PER_CHANNEL: tl.constexpr, BK: tl.constexpr):
    """exp(G_C) of the chunk whose last token is t_last, shaped as `load_decays` gives it (scalar, or [BK, 1])."""
    if IS_PER_CHANNEL:
        offs_k = tl.arange(0, BK)
        G_last = tl.load(g_cumsum_ptr + (t_last.to(tl.int64) * H + i_h) * K + offs_k, mask=offs_k < K, other=0.0)
        return tl.exp(G_last)[:, None]
    else:
        return tl.exp(tl.load(g_cumsum_ptr + t_last.to(tl.int64) * H + i_h))


@triton.jit
def pair_decay(G, IS_INCLUSIVE: tl.constexpr, IS_TRANSPOSED: tl.constexpr, BT: tl.constexpr):
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
def decayed_qk(q, k, G, dot_dtype, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BT, BT] fp32 (q k^T)[i, j] exp(G_i - G_j) for j <= i, 0 above: the output's intra-chunk pairs (per-head
    decay; q and k already scaled and normed as the caller wants), products in dot_dtype."""
    qk = tl.dot(q.to(dot_dtype), tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)
    return qk * pair_decay(G, True, False, BT)


@triton.jit
def _inverse_dot(x, y, DOTS: tl.constexpr):
    """fp32 x @ y for the triangular inverse: DOTS "fp16" rounds both operands to fp16, else it is tl.dot's
    input_precision ("tf32", "tf32x3")."""
    if DOTS == "fp16":
        z = tl.dot(x.to(tl.float16), y.to(tl.float16))
    else:
        z = tl.dot(x, y, input_precision=DOTS)
    return z


@triton.jit
def unit_lower_inverse(A, BT: tl.constexpr, SB: tl.constexpr, DOTS: tl.constexpr):
    """(I + A)^-1 [BT, BT] fp32 for A strictly lower triangular fp32, by block forward substitution with the block
    size doubling: with T_s the inverse of I + (A's s x s diagonal blocks) (T_1 = I) and A_s the part of A in the
    lower-left s x s block of each 2s x 2s diagonal block, T_2s = T_s - T_s A_s T_s (N = T_s A_s has N^2 = 0, so
    (I + N)^-1 = I - N). Every product is of bounded factors (T's blocks and A's), so the rounding of 16-bit dot
    operands stays at their precision.

    Doubling the powers of A instead ((I + L)^-1 = (I - L)(I + L^2)(I + L^4)..., then a Neumann merge) takes the same
    number of products but cancels large intermediate powers: keys at cosine ~0.9 with beta near 1 give W 60x off the
    fp64 one and NaN outputs (docs/perf-history.md, linear attention). Levels below SB run batched on the
    [BT / SB, SB, SB] diagonal blocks, the others (s >= SB) on the [BT, BT] tile."""
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


def inverse_dots(dtype: torch.dtype, use_qk_l2norm: bool, config: KernelConfig) -> str:
    """The triangular inverse's dots (`_inverse_dot`): FP32_DOTS for fp32 inputs; for 16-bit inputs with L2-normed
    keys config.inverse_dots_16bit, else tf32."""
    if dtype == torch.float32:
        return FP32_DOTS
    return config.inverse_dots_16bit if use_qk_l2norm else "tf32"
