"""Triton kernels and launchers for the MoE expert MLP: routing metadata, two grouped GEMMs forward, their backward.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank,
S = N*k token-slots (slot s = t*k + j; a "row" is a slot's position after the stable sort by expert),
T tiles of BLOCK_M rows in the worst-case grid, R the LoRA rank padded to a tl.dot size.

Every grouped GEMM walks the tile map of `moe_routing`: program (tile, column block) reads its expert and first row
from device memory and leaves at once when the tile has no work, so no launch needs the per-expert counts on the host.
Token rows of x (and of dy) are gathered by index while loading; rows of the outputs are scattered back to slot order
while storing; no permuted copy of an activation is ever made.

LoRA: each [S, r] rank product (x A^T, h A^T forward; dy B, dgate_up B backward) is computed once, by a thin pass
before the big kernel that needs it, which then adds the rank-r update in its epilogue with one [rows, R] x [R, cols]
dot. The backward thin pass also reduces dB from the gradient rows it reads; dA of both adapters comes from the
per-expert gradient kernel over the rank products and x (or the w * h the down backward stores). These four
reductions into LoRA-sized outputs run one program per row chunk of an expert (RowChunks), not per expert, so a
skewed expert's rows spread over several programs; split experts' partials are summed by _moe_sum_chunks_kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.dispatch import triton_interpreting

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
# Passes that sum an expert's rows into a small output (dB, dA) split each expert's rows into chunks of this many
# times the mean rows per expert: under uniform routing every expert fits one chunk (no partial sums), while one with
# Zipf routing's 7.7x the mean (issue 7's E64 shape) spreads over 4 programs instead of running 7.7x as long as the
# others: with one program per expert, LoRA r16 over Zipf routing cost 1.28x the frozen-expert training against 1.14x
# uniform on the H200 (docs/PERF.md, MoE).
CHUNK_MEAN_ROWS = 2
# Elements of a per-expert output per program of the chunk sum.
SUM_CHUNKS_BLOCK = 1024
# Slots per program of the routing kernel's int32 casts: a 4 KB int32 store per output vector.
ROUTING_BLOCK_S = 1024
# Tiles a tile-map program writes per step of its loop (a skewed expert may own every tile of the grid).
TILE_MAP_STEP = 1024


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel.

    block_n: output columns per program (the gate_up kernels split them between gate and up; weight gradients: the
             Q side of the [P, Q] output tile; the LoRA backward pass: gradient columns; 0 for the LoRA rank pass,
             whose output is the padded rank); block_p: the P side, weight gradients only (0 elsewhere);
    block_k: reduction step (the LoRA backward pass: rows per step); maxnreg: register cap per thread (None: the
             compiler's choice).
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_p: int = 0
    maxnreg: int | None = None

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
# products) 1.03 ms for both passes at E256 top-16 against 1.24 at 8 warps (docs/PERF.md, MoE).
GPU_LORA_BWD = KernelConfig(block_n=256, block_k=32, num_warps=THIN_NUM_WARPS, num_stages=3)
# The down-projection backward needs 180 registers a thread, one 8-warp CTA per SM; capped at 128 (sm_90 compile: 240
# bytes spilled) two fit.
GPU_DOWN_BWD_MAXNREG = 128
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


def pick_config(x: torch.Tensor, num_slots: int, num_experts: int) -> MoEConfig:
    if _forced_config is not None:
        return _forced_config
    if not x.is_cuda:
        # CPU tensors only reach a kernel under TRITON_INTERPRET=1.
        block = INTERPRETER_BLOCK
        return uniform_config(block, block, block, num_warps=1, num_stages=1)
    if x.dtype == torch.float32:
        return uniform_config(GPU_FP32_BLOCK, GPU_FP32_BLOCK, GPU_FP32_BLOCK_K, GPU_FP32_NUM_WARPS, GPU_NUM_STAGES)
    mean_rows = num_slots / max(num_experts, 1)
    block_m = GPU_BLOCK_M if mean_rows >= GPU_BLOCK_M else GPU_SMALL_BLOCK_M
    config = uniform_config(block_m, GPU_BLOCK_N, GPU_BLOCK_K, GPU_NUM_WARPS, GPU_NUM_STAGES)
    # The register cap and the 5 stages: E64 trained fwd+bwd 12.35 against 13.16 ms without either, the down backward
    # 2.08 against 2.78 (H200, docs/PERF.md, MoE).
    return dataclasses.replace(
        config,
        down_bwd=dataclasses.replace(config.down_bwd, maxnreg=GPU_DOWN_BWD_MAXNREG),
        expert_grad=dataclasses.replace(config.expert_grad, num_stages=GPU_EXPERT_GRAD_STAGES),
        lora_rows=GPU_LORA_ROWS,
        lora_bwd=GPU_LORA_BWD,
    )


def dot_precision(*dtypes: torch.dtype) -> str:
    """tl.dot input precision for fp32 operands, given the dtypes of the tensors that meet in the product."""
    # Next to a 16-bit operand, tf32 (10-bit mantissa) loses nothing; all-fp32 products follow torch's matmul
    # setting ("highest", the default, means exact fp32).
    if any(dtype != torch.float32 for dtype in dtypes):
        return "tf32"
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def rank_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """dtype of the LoRA backward's rank products (d(x A^T), d(h A^T)): bf16 next to bf16 activations, so that the
    GEMM epilogues and the dA passes multiply them in bf16 MMAs (on the H200 the two dA passes alone: 0.23 -> 0.18 ms
    at issue 7's E64 shape, 0.36 -> 0.26 ms at E256; docs/PERF.md, MoE); fp32 otherwise (fp16 would
    underflow small gradients)."""
    return torch.bfloat16 if activation_dtype == torch.bfloat16 else torch.float32


def rank_block(rank: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(rank))


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests replace it to fill buffers with NaN and guard their ends)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _alloc_index(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Every int32 buffer of routing metadata a kernel writes comes from here (tests replace it to fill buffers with a
    sentinel and guard their ends, as `_alloc` with NaN, which int32 has not)."""
    return torch.empty(shape, dtype=torch.int32, device=device)


def _runs_kernels(t: torch.Tensor) -> bool:
    """Whether the routing metadata of tensors like `t` is built by kernels: where moe_mlp's kernels run (CUDA, or CPU
    tensors under TRITON_INTERPRET=1); torch ops elsewhere (the CPU without the interpreter)."""
    return t.is_cuda or triton_interpreting()


@dataclass(frozen=True)
class MoERouting:
    """Expert-sorted layout of the token-slots, built on the device without reading anything back to the host.

    slot_of_row_S:  [S] int32   slot (t*k + j) of each expert-sorted row; the inverse permutation is applied by
                                scattering rows to this index when storing, so no row_of_slot array is needed
    token_of_row_S: [S] int32   token t of each row (slot // k)
    offsets_E1:     [E+1] int32 rows of expert e are offsets[e] .. offsets[e+1]; counts are its differences
    tile_expert_T:  [T] int32   expert of each BLOCK_M tile, -1 for a tile of the worst-case grid with no work
    tile_row_T:     [T] int32   first row of each tile (an expert's tiles are consecutive; busy tiles come first)
    """

    slot_of_row_S: torch.Tensor
    token_of_row_S: torch.Tensor
    offsets_E1: torch.Tensor
    tile_expert_T: torch.Tensor
    tile_row_T: torch.Tensor
    block_m: int
    top_k: int

    @property
    def num_slots(self) -> int:
        return self.slot_of_row_S.shape[0]

    @property
    def num_experts(self) -> int:
        return self.offsets_E1.shape[0] - 1

    @property
    def num_tiles(self) -> int:
        return self.tile_expert_T.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.slot_of_row_S, self.token_of_row_S, self.offsets_E1, self.tile_expert_T, self.tile_row_T


def max_tiles(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / block_m) over any routing: the size of the grid, known on the host."""
    # ceil(c / B) <= (c + B - 1) / B, and only non-empty experts (at most min(E, S) of them) add the B - 1.
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m


def _tile_map_torch(offsets_E1: torch.Tensor, num_slots: int, block: int) -> tuple[torch.Tensor, ...]:
    """`_tile_map` in torch ops (offsets_E1: [E+1] int64), ~20 launches: the path without kernels, and the ground
    truth of the kernel tests."""
    num_experts = offsets_E1.shape[0] - 1
    device = offsets_E1.device
    counts_E = offsets_E1[1:] - offsets_E1[:-1]
    tiles_E = (counts_E + block - 1) // block
    tile_end_E = tiles_E.cumsum(0)
    tile_T = torch.arange(max_tiles(num_slots, num_experts, block), device=device, dtype=torch.int64)
    # Tile t belongs to the expert whose tile range [end_{e-1}, end_e) holds it; empty experts own no range.
    tile_expert_T = torch.searchsorted(tile_end_E, tile_T, right=True)
    has_work_T = tile_expert_T < num_experts
    expert_T = tile_expert_T.clamp(max=num_experts - 1)
    first_tile_E = tile_end_E - tiles_E
    tile_row_T = offsets_E1[expert_T] + (tile_T - first_tile_E[expert_T]) * block
    first_tile_E1 = torch.cat([first_tile_E, tile_end_E[-1:]])
    return (
        torch.where(has_work_T, tile_expert_T, -1).to(torch.int32),
        torch.where(has_work_T, tile_row_T, 0).to(torch.int32),
        first_tile_E1.to(torch.int32),
    )


@triton.jit
def _bisect_step(sorted_ids_ptr, lo, hi, value):
    # One halving of a lower-bound search for `value` in rows [lo, hi) of the sorted ids; a closed range stays closed.
    is_open = lo < hi
    mid = lo + (hi - lo) // 2
    key = tl.load(sorted_ids_ptr + mid, mask=is_open, other=0)
    is_below = key < value
    return tl.where(is_open & is_below, mid + 1, lo), tl.where(is_open & ~is_below, mid, hi)


@triton.jit
def _expert_row_ranges(sorted_ids_ptr, num_slots, experts, num_search_steps):
    # Rows [start, end) of each expert lane in the expert-sorted ids: start = searchsorted(ids, e), end = that of e + 1.
    # Both searches step in the same loop, so their loads are in flight together.
    start_lo = tl.zeros_like(experts)
    start_hi = start_lo + num_slots
    end_lo = start_lo
    end_hi = start_hi
    for _ in range(num_search_steps):
        start_lo, start_hi = _bisect_step(sorted_ids_ptr, start_lo, start_hi, experts)
        end_lo, end_hi = _bisect_step(sorted_ids_ptr, end_lo, end_hi, experts + 1)
    return start_lo, end_lo


@triton.jit
def _store_tiles(
    pid, start_E, end_E, experts, num_experts, num_tiles, block, tile_expert_ptr, tile_row_ptr,
    TILE_STEP: tl.constexpr,
):  # fmt: skip
    # Program pid < E stores its expert's tiles; program E the no-work tail [busy tiles, T) as expert -1, row 0.
    # start_E, end_E: every expert's rows (lanes from E on are ignored). Returns the program's first row (start_E[pid])
    # and first tile (the tiles of the experts before it; for program E, all busy tiles).
    tiles_E = tl.where(experts < num_experts, tl.cdiv(end_E - start_E, block), 0)
    first_tile = tl.sum(tl.where(experts < pid, tiles_E, 0))
    first_row = tl.sum(tl.where(experts == pid, start_E, 0))
    is_tail = pid == num_experts
    num_own = tl.where(is_tail, num_tiles - first_tile, tl.sum(tl.where(experts == pid, tiles_E, 0)))
    expert = tl.where(is_tail, -1, pid)
    row_start = tl.where(is_tail, 0, first_row)
    row_step = tl.where(is_tail, 0, block)
    for step in range(0, num_own, TILE_STEP):
        j = step + tl.arange(0, TILE_STEP)
        tile = first_tile + j
        mask = (j < num_own) & (tile < num_tiles)
        tl.store(tile_expert_ptr + tile, (expert + tl.zeros_like(j)).to(tl.int32), mask=mask)
        tl.store(tile_row_ptr + tile, (row_start + j * row_step).to(tl.int32), mask=mask)
    return first_row, first_tile


# All routing metadata after the sort, in one launch. Every program casts a block of the sort's indices to
# slot_of_row and token_of_row; programs 0..E also search all experts' row ranges in the sorted ids (each for itself:
# E+1 vector searches of log2(S) steps cost less than a second launch that would share them) and store offsets[pid]
# and expert pid's tiles (program E: the no-work tail).
@triton.jit
def _moe_routing_kernel(
    sorted_ids_ptr,  # [S] expert of each row, ascending
    sort_index_ptr,  # [S] int64 slot of each row (the sort's indices)
    slot_of_row_ptr,  # out [S] int32
    token_of_row_ptr,  # out [S] int32
    offsets_ptr,  # out [E+1] int32
    tile_expert_ptr,  # out [T] int32
    tile_row_ptr,  # out [T] int32
    num_slots, num_experts, num_tiles, top_k, block_m, num_search_steps,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILE_STEP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    row_mask = rows < num_slots
    slot = tl.load(sort_index_ptr + rows, mask=row_mask, other=0)
    tl.store(slot_of_row_ptr + rows, slot.to(tl.int32), mask=row_mask)
    tl.store(token_of_row_ptr + rows, (slot // top_k).to(tl.int32), mask=row_mask)
    if pid <= num_experts:
        experts = tl.arange(0, BLOCK_E)
        start_E, end_E = _expert_row_ranges(sorted_ids_ptr, num_slots, experts, num_search_steps)
        first_row, _ = _store_tiles(
            pid, start_E, end_E, experts, num_experts, num_tiles, block_m, tile_expert_ptr, tile_row_ptr, TILE_STEP
        )
        tl.store(offsets_ptr + pid, first_row.to(tl.int32))


# The tile map of given row offsets, one program per expert and one (program E) for the no-work tail.
@triton.jit
def _moe_tile_map_kernel(
    offsets_ptr,  # [E+1] int32/int64
    tile_expert_ptr,  # out [T] int32
    tile_row_ptr,  # out [T] int32
    first_tile_ptr,  # out [E+1] int32
    num_experts, num_tiles, block,
    BLOCK_E: tl.constexpr,
    TILE_STEP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    start_E = tl.load(offsets_ptr + experts, mask=experts <= num_experts, other=0)
    end_E = tl.load(offsets_ptr + experts + 1, mask=experts < num_experts, other=0)
    _, first_tile = _store_tiles(
        pid, start_E, end_E, experts, num_experts, num_tiles, block, tile_expert_ptr, tile_row_ptr, TILE_STEP
    )
    tl.store(first_tile_ptr + pid, first_tile.to(tl.int32))


def _tile_map(offsets_E1: torch.Tensor, num_slots: int, block: int) -> tuple[torch.Tensor, ...]:
    """Cut each expert's rows (offsets_E1: [E+1] int32/int64) into tiles of `block` rows on the device, in one kernel
    launch (torch ops where kernels do not run: `_runs_kernels`).

    Returns tile_expert_T [T] int32 (-1 past the busy tiles), tile_row_T [T] int32 (first row; 0 past the busy
    tiles), first_tile_E1 [E+1] int32 (expert e owns tiles first[e] .. first[e+1]), T = max_tiles(num_slots, E, block).
    """
    if not _runs_kernels(offsets_E1):
        return _tile_map_torch(offsets_E1.long(), num_slots, block)
    num_experts = offsets_E1.shape[0] - 1
    num_tiles = max_tiles(num_slots, num_experts, block)
    device = offsets_E1.device
    tile_expert_T = _alloc_index((num_tiles,), device)
    tile_row_T = _alloc_index((num_tiles,), device)
    first_tile_E1 = _alloc_index((num_experts + 1,), device)
    _moe_tile_map_kernel[(num_experts + 1,)](
        offsets_E1, tile_expert_T, tile_row_T, first_tile_E1, num_experts, num_tiles, block,
        BLOCK_E=triton.next_power_of_2(num_experts + 1), TILE_STEP=TILE_MAP_STEP,
    )  # fmt: skip
    return tile_expert_T, tile_row_T, first_tile_E1


def _routing_metadata_torch(
    sorted_ids_S: torch.Tensor, sort_index_S: torch.Tensor, num_experts: int, top_k: int, block_m: int
) -> tuple[torch.Tensor, ...]:
    """`_routing_metadata` in torch ops: the path without kernels, and the ground truth of the kernel tests."""
    experts_E1 = torch.arange(num_experts + 1, device=sorted_ids_S.device, dtype=sorted_ids_S.dtype)
    # searchsorted on the sorted ids instead of bincount: CUDA bincount reads the largest id back to the host.
    offsets_E1 = torch.searchsorted(sorted_ids_S, experts_E1)
    tile_expert_T, tile_row_T, _ = _tile_map_torch(offsets_E1, sort_index_S.shape[0], block_m)
    return (
        sort_index_S.to(torch.int32),
        (sort_index_S // top_k).to(torch.int32),
        offsets_E1.to(torch.int32),
        tile_expert_T,
        tile_row_T,
    )


def _routing_metadata(
    sorted_ids_S: torch.Tensor, sort_index_S: torch.Tensor, num_experts: int, top_k: int, block_m: int
) -> tuple[torch.Tensor, ...]:
    """MoERouting's tensors from the stable sort of the slots by expert (sorted_ids_S: [S] int64/int32 ascending,
    sort_index_S: [S] int64 the sort's indices): slot_of_row, token_of_row, offsets, tile_expert, tile_row (int32),
    in one kernel launch (torch ops where kernels do not run: `_runs_kernels`)."""
    if not _runs_kernels(sorted_ids_S):
        return _routing_metadata_torch(sorted_ids_S, sort_index_S, num_experts, top_k, block_m)
    num_slots = sorted_ids_S.shape[0]
    num_tiles = max_tiles(num_slots, num_experts, block_m)
    device = sorted_ids_S.device
    slot_of_row_S = _alloc_index((num_slots,), device)
    token_of_row_S = _alloc_index((num_slots,), device)
    offsets_E1 = _alloc_index((num_experts + 1,), device)
    tile_expert_T = _alloc_index((num_tiles,), device)
    tile_row_T = _alloc_index((num_tiles,), device)
    grid = (max(num_experts + 1, triton.cdiv(num_slots, ROUTING_BLOCK_S)),)
    # A lower-bound search over S rows has closed its range after bit_length(S) halvings.
    num_search_steps = num_slots.bit_length()
    _moe_routing_kernel[grid](
        sorted_ids_S, sort_index_S, slot_of_row_S, token_of_row_S, offsets_E1, tile_expert_T, tile_row_T,
        num_slots, num_experts, num_tiles, top_k, block_m, num_search_steps,
        BLOCK_S=ROUTING_BLOCK_S, BLOCK_E=triton.next_power_of_2(num_experts + 1), TILE_STEP=TILE_MAP_STEP,
    )  # fmt: skip
    return slot_of_row_S, token_of_row_S, offsets_E1, tile_expert_T, tile_row_T


def moe_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoERouting:
    """Sort the N*k token-slots by expert and tile each expert's rows on the device, no host sync: torch.sort, then
    one kernel launch for the rest (`_routing_metadata`).

    topk_ids: [N, k] int64/int32 with values in [0, E).
    """
    top_k = topk_ids.shape[1]
    # Sorted as given: a stable sort of int32 ids orders the slots as one of int64 ids, without a cast launch.
    ids_S = topk_ids.reshape(-1)
    # Stable, so each expert's rows stay in token order (the order the reference uses).
    sorted_ids_S, sort_index_S = torch.sort(ids_S, stable=True)
    metadata = _routing_metadata(sorted_ids_S, sort_index_S, num_experts, top_k, block_m)
    return MoERouting(*metadata, block_m=block_m, top_k=top_k)


@dataclass(frozen=True)
class RowChunks:
    """Each expert's rows cut into chunks of at most chunk_rows, for the kernels that sum over an expert's rows into a
    small per-expert output (the LoRA backward pass's dB, the dA passes): one program per chunk (and output block)
    instead of one per expert, so a skewed expert's rows spread over several programs. An expert with one chunk has
    its output stored by that chunk's program; the chunks of a split expert store fp32 partials, which
    `_moe_sum_chunks_kernel` adds up in chunk order (deterministic), and which also zeroes experts with no rows.

    chunk_expert_C: [C] int32 expert of each chunk, -1 past the busy ones; chunk_row_C: [C] int32 its first row;
    first_chunk_E1: [E+1] int32, expert e owns chunks first[e] .. first[e+1].
    """

    chunk_expert_C: torch.Tensor
    chunk_row_C: torch.Tensor
    first_chunk_E1: torch.Tensor
    chunk_rows: int

    @property
    def num_chunks(self) -> int:
        return self.chunk_expert_C.shape[0]


def chunk_rows_for(num_slots: int, num_experts: int, config: MoEConfig) -> int:
    """Rows per chunk: CHUNK_MEAN_ROWS times an expert's mean rows, a whole number of both reduction steps."""
    step = max(config.lora_bwd.block_k, config.expert_grad.block_k)
    mean_rows = triton.cdiv(max(num_slots, 1), max(num_experts, 1))
    return triton.cdiv(CHUNK_MEAN_ROWS * mean_rows, step) * step


def row_chunks(routing: MoERouting, config: MoEConfig) -> RowChunks:
    """The chunks of chunk_rows_for(...) rows of every expert: one kernel launch (`_tile_map`), no host sync."""
    chunk_rows = chunk_rows_for(routing.num_slots, routing.num_experts, config)
    chunk_expert_C, chunk_row_C, first_chunk_E1 = _tile_map(routing.offsets_E1, routing.num_slots, chunk_rows)
    return RowChunks(chunk_expert_C, chunk_row_C, first_chunk_E1, chunk_rows)


@triton.jit
def tile_and_column_block(num_cols, BLOCK_N: tl.constexpr):
    # 1-D grid, column blocks fastest: the programs of one row tile run together and share its gathered rows in L2,
    # and the tiles of one expert follow each other and share its weights.
    pid = tl.program_id(0)
    num_col_blocks = tl.cdiv(num_cols, BLOCK_N)
    return pid // num_col_blocks, pid % num_col_blocks


@triton.jit
def tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M: tl.constexpr):
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(offsets_ptr + expert + 1)
    rows = row_start + tl.arange(0, BLOCK_M)
    return rows, rows < row_end


# LoRA rank pass: ua = u[row] @ A[e]^T once per row, read by every column block of the GEMM that adds ua B^T
@triton.jit
def _moe_lora_rows_kernel(
    u_ptr,  # [*, K]: rows in expert order, or token rows gathered when U_BY_TOKEN
    a_ptr,  # [E, r, K]
    ua_ptr,  # out [S, r] fp32, expert order
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    K,
    rank,
    stride_un,
    stride_uk,
    stride_ae,
    stride_ar,
    stride_ak,
    U_BY_TOKEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    u_rows = tokens if U_BY_TOKEN else rows
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank

    u_row_ptrs = u_ptr + u_rows[:, None] * stride_un
    a_rows = a_ptr + expert * stride_ae + ranks[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        u_tile = tl.load(u_row_ptrs + ks[None, :] * stride_uk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(
            a_rows + ks[None, :] * stride_ak, mask=rank_mask[:, None] & k_mask[None, :], other=0.0
        ).to(u_tile.dtype)  # [R, K]
        acc = tl.dot(u_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)
    tl.store(ua_ptr + rows[:, None] * rank + ranks[None, :], acc, mask=row_mask[:, None] & rank_mask[None, :])


# Forward GEMM 1: gate_up = x[token] @ w_gate_up[e]^T (+ s xa B^T), h = silu(gate) * up
@triton.jit
def _moe_gate_up_fwd_kernel(
    x_ptr,  # [N, D]
    w_ptr,  # [E, 2F, D]
    b_ptr,  # [E, 2F, r] LoRA B on gate_up, unused without LoRA
    xa_ptr,  # [S, r] fp32 x @ A^T from the rank pass, expert order
    h_ptr,  # out [S, F] rows in expert order
    gate_up_ptr,  # out [S, 2F] pre-activations, written only when SAVE_GATE_UP
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    scaling,
    stride_xn,
    stride_xd,
    stride_we,
    stride_wf,
    stride_wd,
    stride_be,
    stride_bf,
    stride_br,
    HAS_LORA: tl.constexpr,
    SAVE_GATE_UP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(F, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < F

    x_rows = x_ptr + tokens[:, None] * stride_xn
    w_gate = w_ptr + expert * stride_we + cols[:, None] * stride_wf
    w_up = w_gate + F * stride_wf
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        x_tile = tl.load(x_rows + ks[None, :] * stride_xd, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        wg_tile = tl.load(w_gate + ks[None, :] * stride_wd, mask=w_mask, other=0.0).to(x_tile.dtype)
        wu_tile = tl.load(w_up + ks[None, :] * stride_wd, mask=w_mask, other=0.0).to(x_tile.dtype)
        acc_gate = tl.dot(x_tile, tl.trans(wg_tile), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x_tile, tl.trans(wu_tile), acc_up, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        xa = tl.load(
            xa_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        b_gate = b_ptr + expert * stride_be + cols[None, :] * stride_bf + ranks[:, None] * stride_br
        b_mask = rank_mask[:, None] & col_mask[None, :]
        bg_tile = tl.load(b_gate, mask=b_mask, other=0.0).to(tl.float32)  # [R, N]
        bu_tile = tl.load(b_gate + F * stride_bf, mask=b_mask, other=0.0).to(tl.float32)
        xa_scaled = xa * scaling
        acc_gate = tl.dot(xa_scaled, bg_tile, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(xa_scaled, bu_tile, acc_up, input_precision=DOT_PRECISION)

    out_mask = row_mask[:, None] & col_mask[None, :]
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(h_ptr + rows[:, None] * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)
    if SAVE_GATE_UP:
        gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(gate_up_rows, acc_gate.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
        tl.store(gate_up_rows + F, acc_up.to(gate_up_ptr.dtype.element_ty), mask=out_mask)


# Forward GEMM 2: y_slot = w_slot * (h @ w_down[e]^T (+ s ha B^T)), stored in slot order
@triton.jit
def _moe_down_fwd_kernel(
    h_ptr,  # [S, F] expert order
    w_ptr,  # [E, D, F]
    b_ptr,  # [E, D, r] LoRA B on down
    ha_ptr,  # [S, r] fp32 h @ A^T from the rank pass, expert order
    weights_ptr,  # [S] routing weights in slot order
    y_ptr,  # out [S, D] in slot order
    slot_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    scaling,
    stride_we,
    stride_wd,
    stride_wf,
    stride_be,
    stride_bd,
    stride_br,
    HAS_LORA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(D, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D

    h_rows = h_ptr + rows[:, None] * F
    w_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < F
        h_tile = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(
            w_rows + ks[None, :] * stride_wf, mask=col_mask[:, None] & k_mask[None, :], other=0.0
        ).to(h_tile.dtype)
        acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        ha = tl.load(
            ha_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        b_tile = tl.load(
            b_ptr + expert * stride_be + cols[None, :] * stride_bd + ranks[:, None] * stride_br,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [R, N]
        acc = tl.dot(ha * scaling, b_tile, acc, input_precision=DOT_PRECISION)

    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * weights[:, None]
    tl.store(
        y_ptr + slots[:, None] * D + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# LoRA backward pass over an output gradient g of a projection with adapter (A, B) and saved ua = u @ A^T:
# partial gb = s * g[:, block] @ B[block] per column block (summed over blocks afterwards), dB = s * sum (w g)^T ua.
@triton.jit
def _moe_lora_bwd_kernel(
    g_ptr,  # [*, Q]: rows in expert order, or token rows gathered when G_BY_TOKEN
    b_ptr,  # [E, Q, r]
    ua_ptr,  # [S, r] fp32, expert order, read when COMPUTE_DB
    weights_ptr,  # [S] slot order, multiplied into g's rows for dB when G_TIMES_WEIGHT
    gb_partial_ptr,  # out [cdiv(Q, BLOCK_Q), S, r] rank dtype, written when COMPUTE_GB
    db_ptr,  # out [E, Q, r], written when COMPUTE_DB (by the chunk of an expert with one chunk)
    db_partial_ptr,  # out [C, Q, r] fp32, written when COMPUTE_DB by the chunks of split experts
    slot_of_row_ptr,
    token_of_row_ptr,
    offsets_ptr,
    chunk_expert_ptr,
    chunk_row_ptr,
    first_chunk_ptr,
    chunk_rows,
    S,
    Q,
    rank,
    scale,
    stride_gn,
    stride_gq,
    stride_be,
    stride_bq,
    stride_br,
    stride_de,
    stride_dq,
    stride_dr,
    G_BY_TOKEN: tl.constexpr,
    G_TIMES_WEIGHT: tl.constexpr,
    COMPUTE_GB: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    DB_IN_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # 1-D grid, chunk slowest, as in _moe_expert_grad_kernel: one program reduces the rows of one chunk of an expert
    # (RowChunks) for its column block in a fixed order (dB without atomics) and reads each of those gradient
    # elements once for both products.
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(Q, BLOCK_Q)
    chunk = pid // num_q_blocks
    pid_q = pid % num_q_blocks
    expert = tl.load(chunk_expert_ptr + chunk)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    row_begin = tl.load(chunk_row_ptr + chunk)
    row_end = tl.minimum(row_begin + chunk_rows, tl.load(offsets_ptr + expert + 1))
    is_split = tl.load(first_chunk_ptr + expert + 1) - tl.load(first_chunk_ptr + expert) > 1
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = qs < Q
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank

    b_tile = tl.load(
        b_ptr + expert * stride_be + qs[:, None] * stride_bq + ranks[None, :] * stride_br,
        mask=q_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )  # [Q, R]
    gb_partial = gb_partial_ptr + pid_q.to(tl.int64) * S * rank
    acc_db = tl.zeros((BLOCK_Q, BLOCK_R), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        row_mask = rows < row_end
        tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        rows = rows.to(tl.int64)
        g_rows = tokens if G_BY_TOKEN else rows
        g = tl.load(
            g_ptr + g_rows[:, None] * stride_gn + qs[None, :] * stride_gq,
            mask=row_mask[:, None] & q_mask[None, :],
            other=0.0,
        )  # [K, Q]
        rank_rows_mask = row_mask[:, None] & rank_mask[None, :]
        if COMPUTE_GB:
            gb = tl.dot(g, b_tile.to(g.dtype), input_precision=DOT_PRECISION)  # [K, R]
            tl.store(gb_partial + rows[:, None] * rank + ranks[None, :], gb * scale, mask=rank_rows_mask)
        if COMPUTE_DB:
            ua = tl.load(ua_ptr + rows[:, None] * rank + ranks[None, :], mask=rank_rows_mask, other=0.0)  # [K, R]
            if G_TIMES_WEIGHT:
                # (w g)^T ua = g^T (w ua): the weight goes on the rank-wide tile, so g reaches both dots as loaded
                # (a g tile rescaled in registers made the compiler load it without asynchronous copies).
                slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0)
                weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
                ua = ua * weights[:, None]
            if DB_IN_BF16:
                # bf16 operands: one warpgroup MMA instead of fp32 copies of both tiles and a tf32 product.
                acc_db = tl.dot(tl.trans(g), ua.to(tl.bfloat16), acc_db)
            else:
                acc_db = tl.dot(tl.trans(g.to(tl.float32)), ua, acc_db, input_precision=DOT_PRECISION)
    if COMPUTE_DB:
        db_mask = q_mask[:, None] & rank_mask[None, :]
        if is_split:
            db_partial = db_partial_ptr + chunk.to(tl.int64) * Q * rank + qs[:, None] * rank + ranks[None, :]
            tl.store(db_partial, acc_db * scale, mask=db_mask)
        else:
            db = db_ptr + expert * stride_de + qs[:, None] * stride_dq + ranks[None, :] * stride_dr
            tl.store(db, (acc_db * scale).to(db_ptr.dtype.element_ty), mask=db_mask)


# Backward of GEMM 2 and SwiGLU: dh = w * (dy[token] @ w_down[e] + dha A), d(gate, up), d weights, w * h recomputed
@triton.jit
def _moe_down_bwd_kernel(
    dy_ptr,  # [N, D]
    w_ptr,  # [E, D, F]
    a_ptr,  # [E, r, F]
    dha_ptr,  # [S, r] d(h @ A^T) / w = s dy[token] @ B, expert order, from the LoRA backward pass (rank_dtype)
    gate_up_ptr,  # [S, 2F] pre-activations saved by the forward, expert order
    weights_ptr,  # [S] slot order
    dgate_up_ptr,  # out [S, 2F] expert order
    h_ptr,  # out [S, F] expert order, w * h with h recomputed from gate_up; written only when STORE_H
    dweights_ptr,  # out [cdiv(F, BLOCK_N), S] fp32 per-column-block partial sums of <dy_token, y_slot / w_slot>
    slot_of_row_ptr,
    token_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    S,
    D,
    F,
    rank,
    stride_dyn,
    stride_dyd,
    stride_we,
    stride_wd,
    stride_wf,
    stride_ae,
    stride_ar,
    stride_af,
    HAS_LORA: tl.constexpr,
    STORE_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(F, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < F

    dy_rows = dy_ptr + tokens[:, None] * stride_dyn
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wf
    # acc: dy @ W_down (+ LoRA) before the routing weight, i.e. d<dy, y_slot>/dh without w.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        dy_tile = tl.load(dy_rows + ks[None, :] * stride_dyd, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(
            w_cols + ks[:, None] * stride_wd, mask=k_mask[:, None] & col_mask[None, :], other=0.0
        ).to(dy_tile.dtype)  # [K, N]
        acc = tl.dot(dy_tile, w_tile, acc, input_precision=DOT_PRECISION)

    weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        dha = tl.load(
            dha_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        a_tile = tl.load(
            a_ptr + expert * stride_ae + ranks[:, None] * stride_ar + cols[None, :] * stride_af,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(dha.dtype)  # [R, N]
        acc = tl.dot(dha, a_tile, acc, input_precision=DOT_PRECISION)

    out_mask = row_mask[:, None] & col_mask[None, :]
    gate_up_rows = gate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(gate_up_rows, mask=out_mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_rows + F, mask=out_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    # <dy_token, y_slot unweighted> = <dy @ W_down (+ LoRA), h>, summed here over this block's F columns.
    tl.store(dweights_ptr + pid_n * S + slots, tl.sum(acc * h, axis=1), mask=row_mask)
    dh = acc * weights[:, None]
    # silu'(g) * up = sig * up + h * (1 - sig): written through h so that the compiler keeps one copy of the SwiGLU
    # tiles (sm_90, triton 3.6: 180 registers a thread, against 255 and spills for up * sig * (1 + g * (1 - sig))).
    dgate = dh * (sig * up + h * (1.0 - sig))
    dup = dh * silu
    dgate_up_rows = dgate_up_ptr + rows[:, None] * (2 * F) + cols[None, :]
    tl.store(dgate_up_rows, dgate.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dgate_up_rows + F, dup.to(dgate_up_ptr.dtype.element_ty), mask=out_mask)
    if STORE_H:
        # w * h: the weight gradients of the down projection read it as is, with no per-row scaling in their loop.
        h_weighted = h * weights[:, None]
        tl.store(h_ptr + rows[:, None] * F + cols[None, :], h_weighted.to(h_ptr.dtype.element_ty), mask=out_mask)


# Backward of GEMM 1: dx_slot = dgate_up @ w_gate_up[e] (+ dxa A), stored in slot order
@triton.jit
def _moe_gate_up_bwd_kernel(
    dgate_up_ptr,  # [S, 2F] expert order
    w_ptr,  # [E, 2F, D]
    a_ptr,  # [E, r, D]
    dxa_ptr,  # [S, r] d(x @ A^T) = s dgate_up @ B, expert order, from the LoRA backward pass (rank_dtype)
    dx_ptr,  # out [S, D] slot order
    slot_of_row_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    offsets_ptr,
    D,
    F,
    rank,
    stride_we,
    stride_wf,
    stride_wd,
    stride_ae,
    stride_ar,
    stride_ad,
    HAS_LORA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile, pid_n = tile_and_column_block(D, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask = tile_rows(tile, expert, tile_row_ptr, offsets_ptr, BLOCK_M)
    slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D

    # gate and up rows are contiguous in both dgate_up and w_gate_up, so one K loop runs over all 2F.
    g_rows = dgate_up_ptr + rows[:, None] * (2 * F)
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, 2 * F, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < 2 * F
        g_tile = tl.load(g_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(
            w_cols + ks[:, None] * stride_wf, mask=k_mask[:, None] & col_mask[None, :], other=0.0
        ).to(g_tile.dtype)  # [K, N]
        acc = tl.dot(g_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < rank
        dxa = tl.load(
            dxa_ptr + rows[:, None] * rank + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :], other=0.0
        )  # [M, R]
        a_tile = tl.load(
            a_ptr + expert * stride_ae + ranks[:, None] * stride_ar + cols[None, :] * stride_ad,
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(dxa.dtype)  # [R, N]
        acc = tl.dot(dxa, a_tile, acc, input_precision=DOT_PRECISION)
    tl.store(
        dx_ptr + slots[:, None] * D + cols[None, :],
        acc.to(dx_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# Per-expert weight gradients: out[e] = scale * sum over the expert's rows of lhs_row^T rhs_row
@triton.jit
def _moe_expert_grad_kernel(
    lhs_ptr,  # [*, P]: rows in expert order, or token rows gathered when LHS_BY_TOKEN
    rhs_ptr,  # [*, Q]: likewise with RHS_BY_TOKEN
    weights_ptr,  # [S] slot order, read when LHS_TIMES_WEIGHT
    out_ptr,  # out [E, P, Q]
    partial_ptr,  # out [C, P, Q] fp32, written by the chunks of split experts when SPLIT_ROWS
    slot_of_row_ptr,
    token_of_row_ptr,
    offsets_ptr,
    chunk_expert_ptr,  # RowChunks, read when SPLIT_ROWS
    chunk_row_ptr,
    first_chunk_ptr,
    chunk_rows,
    P,
    Q,
    scale,
    stride_ln,
    stride_lp,
    stride_rn,
    stride_rq,
    stride_oe,
    stride_op,
    stride_oq,
    LHS_BY_TOKEN: tl.constexpr,
    RHS_BY_TOKEN: tl.constexpr,
    LHS_TIMES_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1-D grid, expert (or chunk, SPLIT_ROWS) slowest: the programs of one expert run together and read its rows from
    # L2, not from memory once per output tile.
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(Q, BLOCK_Q)
    blocks_per_expert = tl.cdiv(P, BLOCK_P) * num_q_blocks
    pid_p = (pid % blocks_per_expert) // num_q_blocks
    pid_q = pid % num_q_blocks
    if SPLIT_ROWS:
        chunk = pid // blocks_per_expert
        expert = tl.load(chunk_expert_ptr + chunk)
        if expert < 0:
            return
        expert = expert.to(tl.int64)
        row_begin = tl.load(chunk_row_ptr + chunk)
        row_end = tl.minimum(row_begin + chunk_rows, tl.load(offsets_ptr + expert + 1))
    else:
        expert = (pid // blocks_per_expert).to(tl.int64)
        row_begin = tl.load(offsets_ptr + expert)
        row_end = tl.load(offsets_ptr + expert + 1)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = ps < P
    q_mask = qs < Q
    # One program reduces all rows of its expert (or chunk) in a fixed order: deterministic, no atomics.
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        row_mask = rows < row_end
        tokens = tl.load(token_of_row_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        lhs_rows = tokens if LHS_BY_TOKEN else rows.to(tl.int64)
        rhs_rows = tokens if RHS_BY_TOKEN else rows.to(tl.int64)
        lhs = tl.load(
            lhs_ptr + lhs_rows[:, None] * stride_ln + ps[None, :] * stride_lp,
            mask=row_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # [K, P]
        rhs = tl.load(
            rhs_ptr + rhs_rows[:, None] * stride_rn + qs[None, :] * stride_rq,
            mask=row_mask[:, None] & q_mask[None, :],
            other=0.0,
        )  # [K, Q]
        if UPCAST:
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
        if LHS_TIMES_WEIGHT:
            slots = tl.load(slot_of_row_ptr + rows, mask=row_mask, other=0)
            weights = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
            lhs = (lhs.to(tl.float32) * weights[:, None]).to(rhs.dtype)
        acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)
    out_mask = p_mask[:, None] & q_mask[None, :]
    out = out_ptr + expert * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq
    if SPLIT_ROWS:
        if tl.load(first_chunk_ptr + expert + 1) - tl.load(first_chunk_ptr + expert) > 1:
            partial = partial_ptr + chunk.to(tl.int64) * P * Q + ps[:, None] * Q + qs[None, :]
            tl.store(partial, acc * scale, mask=out_mask)
        else:
            tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)


# The per-expert outputs of split experts: out[e] = sum of its chunks' fp32 partials, in chunk order; zeros for an
# expert without rows; nothing for an expert with one chunk (that chunk's program stored it).
@triton.jit
def _moe_sum_chunks_kernel(
    partial_ptr,  # [C, M] fp32
    out_ptr,  # out [E, M]
    first_chunk_ptr,
    M,
    BLOCK: tl.constexpr,
):
    expert = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < M
    first = tl.load(first_chunk_ptr + expert)
    last = tl.load(first_chunk_ptr + expert + 1)
    if last - first == 1:
        return
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    partial = partial_ptr + first.to(tl.int64) * M + cols
    for _ in range(first, last):
        acc += tl.load(partial, mask=col_mask, other=0.0)
        partial += M
    tl.store(out_ptr + expert * M + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def _sum_chunks(partial: torch.Tensor, out: torch.Tensor, chunks: RowChunks) -> None:
    """Complete `out` [E, ...] (contiguous) from the fp32 partials [C, ...] of its split experts."""
    num_experts = out.shape[0]
    per_expert = out[0].numel() if num_experts else 0
    if not per_expert:
        return
    block = min(SUM_CHUNKS_BLOCK, triton.next_power_of_2(per_expert))
    _moe_sum_chunks_kernel[(num_experts, triton.cdiv(per_expert, block))](
        partial, out, chunks.first_chunk_E1, per_expert, BLOCK=block, num_warps=THIN_NUM_WARPS
    )


def strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride())


def or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A kernel gets a pointer for every tensor argument: a tensor it is told not to read may be any other one."""
    return dummy if t is None else t


def sum_slots(per_slot_SD: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[S, D] in slot order -> [N, D]: y[t] = sum_j per_slot[t*k + j], in a fixed order (deterministic)."""
    if top_k == 1:
        return per_slot_SD
    return per_slot_SD.view(num_tokens, top_k, per_slot_SD.shape[1]).sum(dim=1)


def moe_lora_rows(
    u: torch.Tensor, a: torch.Tensor, routing: MoERouting, config: MoEConfig, u_by_token: bool
) -> torch.Tensor:
    """The LoRA rank product ua[row] = u[row] @ A[e]^T of every expert-sorted row, e the row's expert.

    u: [S, K] in expert order, or [N, K] read at each row's token when u_by_token; a: [E, r, K].
    Returns ua [S, r] fp32 in expert order.
    """
    num_slots, dim_k = routing.num_slots, u.shape[1]
    rank = a.shape[1]
    ua = _alloc((num_slots, rank), torch.float32, u.device)
    kernel = config.lora_rows
    if routing.num_tiles > 0:
        _moe_lora_rows_kernel[(routing.num_tiles,)](
            u, a, ua,
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            dim_k, rank,
            *u.stride(), *a.stride(),
            U_BY_TOKEN=u_by_token, DOT_PRECISION=dot_precision(u.dtype),
            BLOCK_M=routing.block_m, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return ua


def moe_lora_bwd(
    g: torch.Tensor,
    b: torch.Tensor,
    ua: torch.Tensor,
    scale: float,
    routing: MoERouting,
    config: MoEConfig,
    compute_gb: bool,
    compute_db: bool,
    g_by_token: bool = False,
    g_weights: torch.Tensor | None = None,
    chunks: RowChunks | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One pass over the output gradient g of a projection with LoRA: out += scale * ua B^T, ua = u A^T saved.

    g: [S, Q] in expert order, or [N, Q] read at each row's token when g_by_token; b: [E, Q, r]; ua: [S, r] fp32.
    g_weights: [N, k] routing weights multiplied into g's rows for dB (not for gb), or None. chunks: row_chunks(routing,
    config), built here when None (the backward builds it once for all its passes).
    Returns gb = scale * g[row] @ B[e] [S, r] in expert order, typed rank_dtype(g.dtype) (when compute_gb; d(ua) for
    the backward GEMM's epilogue and for dA) and dB[e] = scale * sum_{rows of e} (w g_row)^T ua_row, shaped and typed
    like b (when compute_db; bf16 products with fp32 sums when g is bf16).
    """
    _, dim_q, rank = b.shape
    num_slots = routing.num_slots
    kernel = config.lora_bwd
    block_q = min(kernel.block_n, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_q)))
    num_q_blocks = triton.cdiv(dim_q, block_q)
    # Each program sums g B over its block_q columns only: the column blocks' [S, r] partials are added up below in a
    # fixed order (deterministic where atomics would not be).
    # bf16 partials next to bf16 gradients (the sum accumulates in fp32 and gb is bf16 anyway): half the bytes.
    gb_dtype = rank_dtype(g.dtype)
    gb_partial = _alloc((num_q_blocks, num_slots, rank), gb_dtype, g.device) if compute_gb else None
    chunks = row_chunks(routing, config) if chunks is None else chunks
    db = db_partial = None
    if compute_db:
        db = _alloc(tuple(b.shape), b.dtype, b.device)
        db_partial = _alloc((chunks.num_chunks, dim_q, rank), torch.float32, b.device)
    if chunks.num_chunks > 0:
        _moe_lora_bwd_kernel[(chunks.num_chunks * num_q_blocks,)](
            g, b, ua, or_dummy(g_weights, ua).reshape(-1), or_dummy(gb_partial, ua), or_dummy(db, ua),
            or_dummy(db_partial, ua),
            routing.slot_of_row_S, routing.token_of_row_S, routing.offsets_E1,
            chunks.chunk_expert_C, chunks.chunk_row_C, chunks.first_chunk_E1, chunks.chunk_rows,
            num_slots, dim_q, rank, scale,
            *g.stride(), *b.stride(), *strides3(db),
            G_BY_TOKEN=g_by_token, G_TIMES_WEIGHT=g_weights is not None, COMPUTE_GB=compute_gb, COMPUTE_DB=compute_db,
            DB_IN_BF16=g.dtype == torch.bfloat16,
            DOT_PRECISION=dot_precision(g.dtype, ua.dtype),
            BLOCK_Q=block_q, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    if compute_db:
        _sum_chunks(db_partial, db, chunks)
    gb = None
    if compute_gb:
        gb = gb_partial[0] if num_q_blocks == 1 else gb_partial.sum(dim=0)
    return gb, db


def moe_gate_up_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_gate_up: torch.Tensor | None,
    b_gate_up: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: MoEConfig,
    save_gate_up: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """h = silu(gate) * up per expert-sorted row.

    Returns h [S, F] in x.dtype, gate_up [S, 2F] pre-activations (when save_gate_up) and xa [S, r] fp32 (with LoRA).
    """
    num_slots, model_dim = routing.num_slots, x.shape[1]
    num_hidden = w_gate_up.shape[1] // 2
    has_lora = a_gate_up is not None
    rank = a_gate_up.shape[1] if has_lora else 0
    xa = moe_lora_rows(x, a_gate_up, routing, config, u_by_token=True) if has_lora else None
    h = _alloc((num_slots, num_hidden), x.dtype, x.device)
    gate_up = _alloc((num_slots, 2 * num_hidden), x.dtype, x.device) if save_gate_up else None
    kernel = config.gate_up_fwd
    grid = (routing.num_tiles * triton.cdiv(num_hidden, kernel.block_n),)
    if routing.num_tiles > 0:
        _moe_gate_up_fwd_kernel[grid](
            x, w_gate_up, or_dummy(b_gate_up, w_gate_up), or_dummy(xa, h), h, or_dummy(gate_up, h),
            routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *x.stride(), *w_gate_up.stride(), *strides3(b_gate_up),
            HAS_LORA=has_lora, SAVE_GATE_UP=save_gate_up, DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return h, gate_up, xa


def moe_down_fwd(
    h: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    a_down: torch.Tensor | None,
    b_down: torch.Tensor | None,
    scaling: float,
    routing: MoERouting,
    config: MoEConfig,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y[t] = sum_j w[t, j] * (h @ w_down^T (+ LoRA)) over the token's slots.

    Returns y [N, D] in h.dtype and ha [S, r] fp32 (with LoRA).
    """
    num_slots, num_hidden = h.shape
    model_dim = w_down.shape[1]
    has_lora = a_down is not None
    rank = a_down.shape[1] if has_lora else 0
    ha = moe_lora_rows(h, a_down, routing, config, u_by_token=False) if has_lora else None
    # Slot-order rows and a fixed-order sum over k instead of fp32 atomics into y: deterministic, one rounding per slot.
    y_slot = _alloc((num_slots, model_dim), h.dtype, h.device)
    kernel = config.down_fwd
    grid = (routing.num_tiles * triton.cdiv(model_dim, kernel.block_n),)
    if routing.num_tiles > 0:
        _moe_down_fwd_kernel[grid](
            h, w_down, or_dummy(b_down, w_down), or_dummy(ha, h), topk_weights.reshape(-1), y_slot,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank, scaling,
            *w_down.stride(), *strides3(b_down),
            HAS_LORA=has_lora, DOT_PRECISION=dot_precision(h.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(y_slot, num_tokens, routing.top_k), ha


def moe_down_bwd(
    dy: torch.Tensor,
    gate_up: torch.Tensor,
    topk_weights: torch.Tensor,
    w_down: torch.Tensor,
    a_down: torch.Tensor | None,
    dha: torch.Tensor | None,
    routing: MoERouting,
    config: MoEConfig,
    store_h: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward of the down projection, the routing weights and SwiGLU.

    a_down: [E, r, F] and dha: [S, r] (rank_dtype) = scaling * dy[token] @ B_down (moe_lora_bwd; unweighted,
    d(h A^T) / w), both None without LoRA on the down projection.
    Returns dgate_up [S, 2F] in gate_up.dtype, w * h [S, F] recomputed and weighted by each row's routing weight
    (when store_h; dW_down = sum dy^T (w h) and dA_down = sum dha^T (w h) read it) and d topk_weights [S] fp32 in
    slot order.
    """
    has_lora = a_down is not None
    assert has_lora == (dha is not None), "dha needs the down adapter"
    num_slots, model_dim = routing.num_slots, dy.shape[1]
    num_hidden = gate_up.shape[1] // 2
    rank = a_down.shape[1] if has_lora else 0
    dgate_up = _alloc((num_slots, 2 * num_hidden), gate_up.dtype, dy.device)
    h = _alloc((num_slots, num_hidden), gate_up.dtype, dy.device) if store_h else None
    kernel = config.down_bwd
    num_col_blocks = triton.cdiv(num_hidden, kernel.block_n)
    # Partial sums per column block, added up below in a fixed order: deterministic where atomics would not be.
    dweights_partial = _alloc((num_col_blocks, num_slots), torch.float32, dy.device)
    if routing.num_tiles > 0:
        _moe_down_bwd_kernel[(routing.num_tiles * num_col_blocks,)](
            dy, w_down, or_dummy(a_down, w_down), or_dummy(dha, dgate_up), gate_up, topk_weights.reshape(-1),
            dgate_up, or_dummy(h, dgate_up), dweights_partial,
            routing.slot_of_row_S, routing.token_of_row_S, routing.tile_expert_T, routing.tile_row_T,
            routing.offsets_E1,
            num_slots, model_dim, num_hidden, rank,
            *dy.stride(), *w_down.stride(), *strides3(a_down),
            HAS_LORA=has_lora, STORE_H=store_h, DOT_PRECISION=dot_precision(gate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return dgate_up, h, dweights_partial.sum(dim=0)


def moe_gate_up_bwd(
    dgate_up: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_gate_up: torch.Tensor | None,
    dxa: torch.Tensor | None,
    routing: MoERouting,
    config: MoEConfig,
    num_tokens: int,
) -> torch.Tensor:
    """dx [N, D] in dgate_up.dtype.

    a_gate_up: [E, r, D] and dxa: [S, r] (rank_dtype) = scaling * dgate_up @ B_gate_up (moe_lora_bwd), both None
    without LoRA on the gate_up projection.
    """
    has_lora = a_gate_up is not None
    assert has_lora == (dxa is not None), "dxa needs the gate_up adapter"
    num_slots = routing.num_slots
    num_hidden, model_dim = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    rank = a_gate_up.shape[1] if has_lora else 0
    dx_slot = _alloc((num_slots, model_dim), dgate_up.dtype, dgate_up.device)
    kernel = config.gate_up_bwd
    num_col_blocks = triton.cdiv(model_dim, kernel.block_n)
    if routing.num_tiles > 0:
        _moe_gate_up_bwd_kernel[(routing.num_tiles * num_col_blocks,)](
            dgate_up, w_gate_up, or_dummy(a_gate_up, w_gate_up), or_dummy(dxa, dgate_up), dx_slot,
            routing.slot_of_row_S, routing.tile_expert_T, routing.tile_row_T, routing.offsets_E1,
            model_dim, num_hidden, rank,
            *w_gate_up.stride(), *strides3(a_gate_up),
            HAS_LORA=has_lora, DOT_PRECISION=dot_precision(dgate_up.dtype),
            BLOCK_M=routing.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k, BLOCK_R=rank_block(rank),
            **kernel.launch_options(),
        )  # fmt: skip
    return sum_slots(dx_slot, num_tokens, routing.top_k)


def moe_expert_grad(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    out_like: torch.Tensor,
    routing: MoERouting,
    config: MoEConfig,
    lhs_by_token: bool = False,
    rhs_by_token: bool = False,
    lhs_weights: torch.Tensor | None = None,
    scale: float = 1.0,
    chunks: RowChunks | None = None,
) -> torch.Tensor:
    """out[e] = scale * sum_{rows of e} (w_row * lhs_row)^T rhs_row, shaped and typed like out_like [E, P, Q].

    lhs: [S, P] in expert order, or [N, P] read by token when lhs_by_token; rhs likewise [S or N, Q].
    lhs_weights: [N, k] routing weights multiplied into the lhs rows, or None.
    A thin output (a LoRA rank side, too few output tiles per expert to spread a skewed expert's rows) is reduced by
    row chunks (chunks: row_chunks(routing, config), built here when None); a weight gradient by expert.
    """
    num_experts, dim_p, dim_q = out_like.shape
    out = _alloc(tuple(out_like.shape), out_like.dtype, out_like.device)
    # Mixed operands (a 16-bit activation against an fp32 LoRA intermediate) meet in fp32.
    upcast = lhs.dtype != rhs.dtype
    kernel = config.expert_grad
    is_thin = min(dim_p, dim_q) < min(kernel.block_p, kernel.block_n)
    block_p = min(kernel.block_p, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_p)))
    block_q = min(kernel.block_n, max(MIN_DOT_SIZE, triton.next_power_of_2(dim_q)))
    weights = lhs_weights.reshape(-1) if lhs_weights is not None else lhs
    partial = None
    if is_thin:
        chunks = row_chunks(routing, config) if chunks is None else chunks
        partial = _alloc((chunks.num_chunks, dim_p, dim_q), torch.float32, out.device)
    if is_thin:
        split = (chunks.chunk_expert_C, chunks.chunk_row_C, chunks.first_chunk_E1, chunks.chunk_rows)
        num_programs = chunks.num_chunks
    else:
        # Not read (SPLIT_ROWS off): any int32 vectors and row count.
        split = (routing.offsets_E1, routing.offsets_E1, routing.offsets_E1, 0)
        num_programs = num_experts
    grid = (num_programs * triton.cdiv(dim_p, block_p) * triton.cdiv(dim_q, block_q),)
    # No rows (an expert-parallel rank that received no tokens) leaves no chunk: nothing to launch, zeros below.
    if grid[0] > 0:
        _moe_expert_grad_kernel[grid](
            lhs, rhs, weights, out, or_dummy(partial, out),
            routing.slot_of_row_S, routing.token_of_row_S, routing.offsets_E1, *split,
            dim_p, dim_q, scale,
            *lhs.stride(), *rhs.stride(), *out.stride(),
            LHS_BY_TOKEN=lhs_by_token, RHS_BY_TOKEN=rhs_by_token, LHS_TIMES_WEIGHT=lhs_weights is not None,
            UPCAST=upcast, SPLIT_ROWS=is_thin, DOT_PRECISION=dot_precision(lhs.dtype, rhs.dtype),
            BLOCK_P=block_p, BLOCK_Q=block_q, BLOCK_K=kernel.block_k,
            num_warps=min(kernel.num_warps, THIN_NUM_WARPS) if is_thin else kernel.num_warps,
            num_stages=kernel.num_stages,
            **({} if is_thin or kernel.maxnreg is None else dict(maxnreg=kernel.maxnreg)),
        )  # fmt: skip
    if is_thin:
        _sum_chunks(partial, out, chunks)
    return out

