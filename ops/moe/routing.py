"""Routing metadata of the MoE expert MLP kernels, built on the device without a host sync: the token-slots sorted by
expert, the tile map every grouped GEMM walks, and the row chunks of the passes that reduce an expert's rows.

Shapes: N tokens, E experts, k experts per token, S = N*k token-slots (slot s = t*k + j; a "row" is a slot's position
after the stable sort by expert), T tiles of BLOCK_M rows in the worst-case grid, C row chunks.

Every grouped GEMM walks the tile map of `moe_routing`: program (tile, column block) reads its expert and first row
from device memory and leaves at once when the tile has no work, so no launch needs the per-expert counts on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_tune.ops.common.dispatch import triton_interpreting
from moe_tune.ops.moe import kernel_config
from moe_tune.ops.moe.kernel_config import MoEConfig
from moe_tune.ops.moe.reference import MAX_ADD_TO

# Passes that sum an expert's rows into a small output (dB, dA) split each expert's rows into chunks of this many
# times the mean rows per expert: under uniform routing every expert fits one chunk (no partial sums), while one with
# Zipf routing's 7.7x the mean (issue 7's E64 shape) spreads over 4 programs instead of running 7.7x as long as the
# others: with one program per expert, LoRA r16 over Zipf routing cost 1.28x the frozen-expert training against 1.14x
# uniform on the H200 (docs/perf-history.md, MoE).
CHUNK_MEAN_ROWS = 2
# Slots per program of the routing kernel's int32 casts: a 4 KB int32 store per output vector.
ROUTING_BLOCK_S = 1024
# Tiles a tile-map program writes per step of its loop (a skewed expert may own every tile of the grid).
TILE_MAP_STEP = 1024
# sum_slots' blocks: up to 1024 columns of as many tokens as make 4096 outputs, 8 warps (16 elements a thread: 32-byte
# bf16 loads), so that each program has k such loads in flight.
SUM_SLOTS_BLOCK_D = 1024
SUM_SLOTS_BLOCK_ELEMENTS = 4096
SUM_SLOTS_WARPS = 8


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
    sorted_ids_ptr,  # [S] expert of each row, ascending (any integer dtype holding E)
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
    tile_expert_T = kernel_config.alloc_index((num_tiles,), device)
    tile_row_T = kernel_config.alloc_index((num_tiles,), device)
    first_tile_E1 = kernel_config.alloc_index((num_experts + 1,), device)
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
    """MoERouting's tensors from the stable sort of the slots by expert (sorted_ids_S: [S] integers ascending,
    sort_index_S: [S] int64 the sort's indices): slot_of_row, token_of_row, offsets, tile_expert, tile_row (int32),
    in one kernel launch (torch ops where kernels do not run: `_runs_kernels`)."""
    if not _runs_kernels(sorted_ids_S):
        return _routing_metadata_torch(sorted_ids_S, sort_index_S, num_experts, top_k, block_m)
    num_slots = sorted_ids_S.shape[0]
    num_tiles = max_tiles(num_slots, num_experts, block_m)
    device = sorted_ids_S.device
    slot_of_row_S = kernel_config.alloc_index((num_slots,), device)
    token_of_row_S = kernel_config.alloc_index((num_slots,), device)
    offsets_E1 = kernel_config.alloc_index((num_experts + 1,), device)
    tile_expert_T = kernel_config.alloc_index((num_tiles,), device)
    tile_row_T = kernel_config.alloc_index((num_tiles,), device)
    grid = (max(num_experts + 1, triton.cdiv(num_slots, ROUTING_BLOCK_S)),)
    # A lower-bound search over S rows has closed its range after bit_length(S) halvings.
    num_search_steps = num_slots.bit_length()
    _moe_routing_kernel[grid](
        sorted_ids_S, sort_index_S, slot_of_row_S, token_of_row_S, offsets_E1, tile_expert_T, tile_row_T,
        num_slots, num_experts, num_tiles, top_k, block_m, num_search_steps,
        BLOCK_S=ROUTING_BLOCK_S, BLOCK_E=triton.next_power_of_2(num_experts + 1), TILE_STEP=TILE_MAP_STEP,
    )  # fmt: skip
    return slot_of_row_S, token_of_row_S, offsets_E1, tile_expert_T, tile_row_T


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding every expert id and the count E (the row-range searches look for e + 1):
    a radix sort makes one pass over its keys per byte of their dtype (8 for int64 ids, 1 for uint8), and the stable
    sort of the narrowed ids orders the slots as that of the ids given."""
    if num_experts <= torch.iinfo(torch.uint8).max:
        return torch.uint8
    if num_experts <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def moe_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoERouting:
    """Sort the N*k token-slots by expert and tile each expert's rows on the device, no host sync: torch.sort, then
    one kernel launch for the rest (`_routing_metadata`).

    topk_ids: [N, k] int64/int32 with values in [0, E).
    """
    top_k = topk_ids.shape[1]
    ids_S = topk_ids.reshape(-1).to(sort_key_dtype(num_experts))
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
    kernels_bwd.py's chunk sum adds up in chunk order (deterministic), and which also zeroes experts with no rows.

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


@triton.jit
def _sum_slots_kernel(src_ptr, add_ptr, add2_ptr, out_ptr, num_tokens, D, TOP_K: tl.constexpr,
                      NUM_ADDENDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # One [BLOCK_T, BLOCK_D] block of y: the addends' rows (0, 1 or 2, in order), then the k slot rows of each token,
    # added in fp32 in slot order, rounded once.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (tokens < num_tokens)[:, None] & (cols < D)[None, :]
    token_offsets = tokens.to(tl.int64)[:, None] * D + cols[None, :]
    if NUM_ADDENDS >= 1:
        acc = tl.load(add_ptr + token_offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if NUM_ADDENDS == 2:
        acc += tl.load(add2_ptr + token_offsets, mask=mask, other=0.0).to(tl.float32)
    rows = tokens.to(tl.int64)[:, None] * TOP_K
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (rows + j) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots(
    per_slot_SD: torch.Tensor, num_tokens: int, top_k: int, addends: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """[S, D] contiguous in slot order -> [N, D]: y[t] = addends[0][t] + addends[1][t] + sum_j per_slot[t*k + j],
    added in fp32 (the addends in order, then the slots in slot order) and rounded once (deterministic), in one pass
    that reads each row once.
    addends: at most MAX_ADD_TO [N, D] contiguous tensors of per_slot's dtype (default: none)."""
    assert len(addends) <= MAX_ADD_TO, f"sum_slots takes at most {MAX_ADD_TO} addends"
    if top_k == 1 and not addends:
        return per_slot_SD
    model_dim = per_slot_SD.shape[1]
    y = kernel_config.alloc((num_tokens, model_dim), per_slot_SD.dtype, per_slot_SD.device)
    if num_tokens * model_dim == 0:
        return y
    block_d = min(SUM_SLOTS_BLOCK_D, triton.next_power_of_2(model_dim))
    block_t = max(1, SUM_SLOTS_BLOCK_ELEMENTS // block_d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(model_dim, block_d))
    # Pointers of addends not given are never read.
    add, add2 = (*addends, per_slot_SD, per_slot_SD)[:2]
    _sum_slots_kernel[grid](per_slot_SD, add, add2, y, num_tokens, model_dim, TOP_K=top_k,
                            NUM_ADDENDS=len(addends), BLOCK_T=block_t, BLOCK_D=block_d,
                            num_warps=SUM_SLOTS_WARPS)  # fmt: skip
    return y

