"""Launch configuration of the MoE expert MLP kernels (tile sizes per kernel, picked per call) and the helpers every
launcher shares: output buffers, dot precisions, dummy pointers, and the weight-tile load of every GEMM (bf16/fp16/fp32
weights cast; FP8 weights dequantized).

Shapes: as in routing.py (S token-slots, E experts, r LoRA rank, R the rank padded to a tl.dot size).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_tune.ops.common.launch import launch_text, with_overrides
from moe_tune.ops.fp8.reference import BLOCK as FP8_BLOCK

# tl.dot needs every dimension of its operands to be at least 16.
MIN_DOT_SIZE = 16
# The interpreter runs each program in Python: the smallest legal tile keeps CPU tests fast.
INTERPRETER_BLOCK = MIN_DOT_SIZE
# 128 rows x 128 columns per tile: two Hopper warpgroup MMAs, and each weight tile is reused across 128 token rows.
GPU_BLOCK_M = 128
GPU_BLOCK_N = 128
# Experts averaging fewer rows than a 128-row tile (E256 top-16 at small N) waste most of it; 64 halves the padding.
GPU_SMALL_BLOCK_M = 64
# 64 bf16/fp16 elements are 128 bytes per row: one full cache line per load, three stages fit shared memory.
GPU_BLOCK_K = 64
# 8 warps = two warpgroups, one per 64-row half of a 128-row tile.
GPU_NUM_WARPS = 8
# Three stages hide global-memory latency behind the MMAs on Hopper and still leave room for two CTAs per SM.
GPU_NUM_STAGES = 3
# fp32 tiles take twice the registers and shared memory (exact fp32 dots run on FMA units, not tensor cores):
# 64 x 64 tiles with 32-wide K steps and 4 warps keep them from spilling.
GPU_FP32_BLOCK = 64
GPU_FP32_BLOCK_K = 32
GPU_FP32_NUM_WARPS = 4
# A LoRA-rank side (16-32) leaves too little work for 8 warps.
THIN_NUM_WARPS = 4


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel.

    block_n: output columns per program (the gate_up kernels split them between gate and up; weight gradients: the
             Q side of the [P, Q] output tile; the LoRA backward pass: gradient columns; 0 for the LoRA rank pass,
             whose output is the padded rank); block_p: the P side, weight gradients only (0 elsewhere);
    block_k: reduction step (the LoRA backward pass: rows per step); maxnreg: register cap per thread (None: the
             compiler's choice); swiglu_pass: the down backward only, as a GEMM storing dy W (+ LoRA) and a separate
             pass of SwiGLU's backward over it, instead of that backward in the GEMM's epilogue; one_dot: the gate_up
             forward only, its gate and up columns loaded as one weight tile of 2 block_n rows and multiplied in one
             product a K step (split after the loop), instead of two products of block_n columns; tma: the operands
             that lie in expert order (the down forward's h, the gate_up backward's dgate_up) and the weights (of
             those two, the gate_up forward and the down backward's GEMM with swiglu_pass) loaded as tiles through
             tensor descriptors (Hopper's TMA) instead of pointer loads, where `tma_loads` allows it (pointer loads
             elsewhere; token rows gathered by index always).
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_p: int = 0
    maxnreg: int | None = None
    swiglu_pass: bool = False
    one_dot: bool = False
    tma: bool = False

    def launch_options(self) -> dict:
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        # Only passed when set: the interpreter and older Triton launchers take no maxnreg.
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


# The LoRA passes stream activation rows for 2r FLOP per element (memory-bound). Rank pass: 128-wide K steps (256
# bytes of each gathered bf16 row per load), one warpgroup for the [rows, R] product, 108 KB of stages at 128-row
# tiles (two CTAs per SM; sm_90 compile: 118 registers, no spills).
GPU_LORA_ROWS = KernelConfig(block_n=0, block_k=128, num_warps=THIN_NUM_WARPS, num_stages=3)
# Backward pass: 256 gradient columns per program, so g B is summed from 8 fp32 partials at D = 2048 (the partials
# are r fp32 per row each, 1/16 of a bf16 row of 2048), 32 rows a step, 4 warps: alone on the H200 (bf16 dB
# products) 1.03 ms for both passes at E256 top-16 against 1.24 at 8 warps (docs/perf-history.md, MoE).
GPU_LORA_BWD = KernelConfig(block_n=256, block_k=32, num_warps=THIN_NUM_WARPS, num_stages=3)
# The down-projection backward as a GEMM of full 128-column tiles storing dy W (+ LoRA), then a pass of SwiGLU's
# backward over it (swiglu_pass): the GEMM's epilogue in one kernel needs 255 registers a thread at 64-column tiles
# (capped at 128: spills), and ran at 240 TFLOP/s in a bench-qwen3-next step against 460-515 for the other GEMMs.
GPU_DOWN_BWD = KernelConfig(GPU_BLOCK_N, GPU_BLOCK_K, GPU_NUM_WARPS, GPU_NUM_STAGES, swiglu_pass=True)
# On sm_90 at 128-row tiles with 16-bit weights, 128 x 256 output tiles, which reuse each loaded byte for 85 FLOP
# instead of 64, with the weights and the operands that lie in expert order through TMA, over 4 stages of 48 KB: the
# gate_up forward as one product of 128 gate and 128 up columns (one_dot), the down forward, the gate_up backward and
# the down backward's GEMM at 256 columns. In bench-qwen3-next steps on an H100 (docs/PERF.md), 8 layers: the gate_up
# forward 5.83 ms against 6.13 at 3 stages, 6.33 with pointer loads and 6.99 at two products of 64 columns; the
# gate_up backward 5.43 against 5.48 at 3 stages and 6.44 at 128 columns with pointer loads; the down forward 3.29
# against 3.37 and 3.66; the down backward's GEMM 2.78 against 2.85 at 3 stages and 3.23 at 128 columns. A
# gathered-row GEMM alone at the gate_up forward's shape (65,536 rows, K 2048, N 1536, bf16) runs at 520 TFLOP/s at
# 128 x 128 with pointer loads, 577 at 128 x 256, 605 with the weights through TMA.
SM90_NUM_STAGES = 4
SM90_GATE_UP_FWD = KernelConfig(128, GPU_BLOCK_K, GPU_NUM_WARPS, SM90_NUM_STAGES, one_dot=True, tma=True)
SM90_WIDE_TMA = KernelConfig(256, GPU_BLOCK_K, GPU_NUM_WARPS, SM90_NUM_STAGES, tma=True)
SM90_DOWN_BWD = dataclasses.replace(GPU_DOWN_BWD, block_n=256, num_stages=SM90_NUM_STAGES, tma=True)
# Both operands of a weight gradient are gathered behind a row-index load, which takes pipeline stages of its own:
# at 3 stages the sm_90 compile keeps 2 operand buffers in shared memory, at 5 stages 3 (96 KB), as the other GEMMs.
GPU_EXPERT_GRAD_STAGES = 5


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes for one call, per kernel; picked from the dtype, the device and the average rows per expert.

    block_m: rows per tile of the routing tile map, shared by the four row-tiled GEMMs and the LoRA rank pass.
    lora_rows: the LoRA rank pass (x A^T, h A^T: one program per row tile);
    lora_bwd: the LoRA backward pass over an output gradient (g B per row and dB: one program per expert and
              block_n gradient columns).
    """

    block_m: int
    gate_up_fwd: KernelConfig
    down_fwd: KernelConfig
    down_bwd: KernelConfig
    gate_up_bwd: KernelConfig
    expert_grad: KernelConfig
    lora_rows: KernelConfig
    lora_bwd: KernelConfig


def uniform_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> MoEConfig:
    """One tile shape for every kernel (weight gradients: block_n x block_n output tiles)."""
    kernel = KernelConfig(block_n, block_k, num_warps, num_stages, block_p=block_n)
    # The gate_up forward holds two accumulators (gate and up), the down backward's SwiGLU epilogue five fp32 tiles:
    # half-width tiles keep them in registers.
    half = KernelConfig(max(MIN_DOT_SIZE, block_n // 2), block_k, num_warps, num_stages)
    return MoEConfig(
        block_m,
        gate_up_fwd=half,
        down_fwd=kernel,
        down_bwd=half,
        gate_up_bwd=kernel,
        expert_grad=kernel,
        lora_rows=KernelConfig(0, block_k, num_warps, num_stages),
        lora_bwd=KernelConfig(block_n, block_k, num_warps, num_stages),
    )


_forced_config: MoEConfig | None = None


@contextlib.contextmanager
def forced_config(config: MoEConfig):
    """Within the block, every moe_mlp call on the kernels runs with `config` (benchmark sweeps, tests)."""
    global _forced_config
    previous, _forced_config = _forced_config, config
    try:
        yield config
    finally:
        _forced_config = previous


def pick_config(x: torch.Tensor, num_slots: int, num_experts: int, fp8_codes: bool = False) -> MoEConfig:
    """The launch of every kernel for one call: `forced_config`'s where one is in force, else the defaults for x's
    device and dtype, the rows per expert and whether the GEMMs read FP8 weight codes, with MOE_TUNE_LAUNCH's fields
    laid over them."""
    if _forced_config is not None:
        return _forced_config
    return with_launch_overrides(_default_config(x, num_slots, num_experts, fp8_codes))


def _default_config(x: torch.Tensor, num_slots: int, num_experts: int, fp8_codes: bool) -> MoEConfig:
    if not x.is_cuda:
        # CPU tensors only reach a kernel under TRITON_INTERPRET=1.
        block = INTERPRETER_BLOCK
        return uniform_config(block, block, block, num_warps=1, num_stages=1)
    if x.dtype == torch.float32:
        return uniform_config(GPU_FP32_BLOCK, GPU_FP32_BLOCK, GPU_FP32_BLOCK_K, GPU_FP32_NUM_WARPS, GPU_NUM_STAGES)
    mean_rows = num_slots / max(num_experts, 1)
    block_m = GPU_BLOCK_M if mean_rows >= GPU_BLOCK_M else GPU_SMALL_BLOCK_M
    config = uniform_config(block_m, GPU_BLOCK_N, GPU_BLOCK_K, GPU_NUM_WARPS, GPU_NUM_STAGES)
    # The 5 stages of the weight gradients: docs/perf-history.md, MoE.
    config = dataclasses.replace(
        config,
        down_bwd=GPU_DOWN_BWD,
        expert_grad=dataclasses.replace(config.expert_grad, num_stages=GPU_EXPERT_GRAD_STAGES),
        lora_rows=GPU_LORA_ROWS,
        lora_bwd=GPU_LORA_BWD,
    )
    if fp8_codes or block_m != GPU_BLOCK_M or not has_tma(x):
        return config
    return dataclasses.replace(
        config, gate_up_fwd=SM90_GATE_UP_FWD, down_fwd=SM90_WIDE_TMA, down_bwd=SM90_DOWN_BWD, gate_up_bwd=SM90_WIDE_TMA
    )


def with_launch_overrides(config: MoEConfig) -> MoEConfig:
    """config with the fields MOE_TUNE_LAUNCH names for each kernel (families moe_gate_up_fwd, ..., moe_lora_bwd;
    ops/common/launch.py) replaced."""
    if not launch_text():
        return config
    kernels = {f.name: with_overrides(f"moe_{f.name}", getattr(config, f.name))
               for f in dataclasses.fields(config) if f.name != "block_m"}  # fmt: skip
    return dataclasses.replace(config, **kernels)


def dot_precision(*dtypes: torch.dtype) -> str:
    """tl.dot input precision for fp32 operands, given the dtypes of the tensors that meet in the product."""
    # Next to a 16-bit operand, tf32 (10-bit mantissa) loses nothing; all-fp32 products follow torch's matmul
    # setting ("highest", the default, means exact fp32).
    if any(dtype != torch.float32 for dtype in dtypes):
        return "tf32"
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def rank_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """dtype of the LoRA backward's rank products (d(x A^T), d(h A^T)): bf16 next to bf16 activations, so that the
    GEMM epilogues and the dA passes multiply them in bf16 MMAs (the two dA passes take 0.78x / 0.72x their fp32 time
    at the E64 / E256 anchor shapes on the H200: docs/perf-history.md, MoE); fp32 otherwise (fp16 would underflow
    small gradients)."""
    return torch.bfloat16 if activation_dtype == torch.bfloat16 else torch.float32


def rank_block(rank: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(rank))


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests replace it to fill buffers with NaN and guard their ends)."""
    return torch.empty(shape, dtype=dtype, device=device)


def alloc_index(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Every int32 buffer of routing metadata a kernel writes comes from here (tests replace it to fill buffers with a
    sentinel and guard their ends, as `alloc` with NaN, which int32 has not)."""
    return torch.empty(shape, dtype=torch.int32, device=device)


def strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride())


def or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A kernel gets a pointer for every tensor argument: a tensor it is told not to read may be any other one."""
    return dummy if t is None else t


def has_tma(t: torch.Tensor) -> bool:
    """Whether t's device loads through tensor descriptors: an sm_90 or later GPU, or the CPU (the interpreter)."""
    return not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] >= 9


def tma_loads(kernel: KernelConfig, dtype: torch.dtype, *operands: torch.Tensor) -> bool:
    """Whether a kernel launched as `kernel` loads `operands` through tensor descriptors of their rows (each taken as
    [rows, last dim]): asked for (kernel.tma), every operand in `dtype`, the dtype of the tiles they meet in the
    product (a weight of another dtype is cast as pointer loads bring it in; FP8 codes are dequantized there), 16-bit
    or fp32, a TMA-capable device (sm_90 or later; the interpreter on the CPU), and a descriptor's rules: contiguous,
    base and rows 16-byte aligned."""
    if not kernel.tma or dtype not in (torch.bfloat16, torch.float16, torch.float32) or not has_tma(operands[0]):
        return False
    return all(
        t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0
        for t in operands
    )


def row_descriptor(t: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A tensor descriptor of contiguous t as [rows, last dim], loaded in [block_rows, block_cols] tiles; a tile's
    part past the last row or column reads as zeros."""
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [block_rows, block_cols])


def halves_descriptor(w: torch.Tensor, halves: int, block_n: int, block_k: int) -> TensorDescriptor:
    """A tensor descriptor of a contiguous gate_up weight [E, 2F, D] as [E, 2, F, D], loaded in [1, halves, block_n,
    block_k] tiles: `halves` 2 gives a column block's gate and up rows in one tile, 1 one half's; rows past F and
    columns past D read as zeros."""
    num_experts, two_f, dim = w.shape
    return TensorDescriptor.from_tensor(w.view(num_experts, 2, two_f // 2, dim), [1, halves, block_n, block_k])


def check_fp8_steps(scale_inv: torch.Tensor | None, block_k: int) -> None:
    """An FP8 weight's K steps must each lie inside one 128-wide scale block (one scale per weight row or column)."""
    assert scale_inv is None or FP8_BLOCK % block_k == 0, f"block_k {block_k} must divide {FP8_BLOCK} for FP8 weights"


@triton.jit
def weight_tile(w_ptrs, w_mask, scale_ptrs, scale_mask, like, W_IS_FP8: tl.constexpr, ROW_SCALES: tl.constexpr):
    # A weight tile in the dtype of the activation tile `like`. FP8 codes (float8_e4m3fn) are dequantized through
    # fp32 (the interpreter converts FP8 only to fp32): code * the scale of its 128 x 128 block, one scale per tile row
    # (ROW_SCALES) or per tile column, then rounded to the activation dtype for the same tl.dot as 16-bit weights.
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if W_IS_FP8:
        scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0)
        if ROW_SCALES:
            w = w.to(tl.float32) * scale[:, None]
        else:
            w = w.to(tl.float32) * scale[None, :]
    return w.to(like.dtype)
