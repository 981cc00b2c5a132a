"""Triton kernels that decide what each query attends: the fused top-k indexer and the index canonicalisation
that the sparse attention kernels start from; plus the sequence and block layouts both build on the device.

Legend: NT tokens (keys) of all rows packed along time (B * T; a batch of B rows is the packed case with cu_seqlens
(0, T, 2T, ...)), T tokens of one row, TQ queries of one row and NQ = B * TQ of all: the last TQ tokens of each row
(query i of a row at key position Q0 + i of it, Q0 = T - TQ, the op's query_start; TQ = T by default), N
sequences, S selected slots per query, H' index heads of the indices (H, or 1 when one index set is shared by all kv
heads), NU selectable units of a row (T keys, or ceil(T / bs)
blocks), NW = ceil(NU / 32) bit words per query, NS block slots (every block of every sequence, then unused ones),
HI indexer heads, DI indexer dim, M candidates of one query (its causal keys, or its complete earlier blocks).

Every kernel indexes queries (and their indices, outputs, bitmaps) by flat query and keys by flat key position; a
query's key position, which decides causality, its sequence and its own block, is `query_key_position`.

Canonical indices (`canonical_indices`): the attention kernels never see raw indices. One program per (query,
index head) turns its S raw indices into int32 canonical ones: a flat key position (block_size 1) or a block id
local to the sequence (block_size > 1), -1 where the raw index is unused, out of range, acausal, from another
sequence, or a repeat of an earlier slot. Repeats are found without sorting: every kept unit sets its bit in the
query's selection bitmap with an atomic OR, and a slot whose bit was already set is a repeat. The bitmap [NT, H', NW]
is kept for the token-level backward, which reads it to know which (query, key) pairs were selected ([NQ, H', NW]).

Top-k indexer (`topk_indexer_fwd`): two kernels per slab of consecutive queries, the slab's scratch rows reused slab
after slab, never a [T, T] matrix. `_indexer_scores_kernel`, one program per (group of BQ queries, span of candidate
key rows): streams candidate key tiles (k_idx rows, or the mean-pooled keys of complete blocks), scores them for all
BQ x HI (query, head) rows with one tl.dot, applies the activation and the per-head weights, sums over heads, and
writes the scores, as int32 keys that order as the floats do, to the queries' scratch rows (queries with at most k
candidates keep them all and are not scored). `_topk_select_kernel`, one program per query: on long rows a sorted
sample of the keys brackets the k-th key, and one pass counts the keys above the bracket and copies those inside it
(about 1/8 of the row) to a second scratch row; then an exact radix select on the copy (on the whole row when the
bracket missed the k-th key), digits of DIGIT_BITS from the top, each pass a tl.histogram of the digits of the keys
sharing the prefix found so far, in chunks of the row; it stops once the k-th key's bin holds only kept keys. A last
pass emits the kept candidates in index order with a prefix sum, keys equal to the k-th ranked by index. Ties
therefore go to the lower index, -0.0 equals +0.0, and the output is ascending and -1 padded, exactly as
reference.select_top. One query per selecting program (10 resident per SM by registers: 48 x 128 threads) rather than
a fused kernel's selection inside the scoring program (one resident per SM) keeps enough selections in flight to hide
their latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# tl.dot needs every operand dimension to be at least 16.
MIN_DOT_SIZE = 16
# Raw index slots per step of the canonicalisation kernel: 64 int32 per step keep loads 256 bytes wide.
CANONICAL_BLOCK_SLOTS = 64
# Bits per word of the selection bitmap (int32 words, atomic OR).
BITS_PER_WORD = 32
# Radix select: digits of DIGIT_BITS, the first pass taking the 32 % DIGIT_BITS top bits (all DIGIT_BITS when it
# divides 32); a pass stops the select once the k-th key's prefix bin holds only kept keys. Why narrow digits pay, an
# estimate from the shape of Triton's tl.histogram lowering (b warp ballots, then a mask and a popcount per bin a
# thread owns), not an instruction count: about b + (2^b / 32) * (2b + 2) instructions a thread per 32 keys, 152 per
# pass at 8 bits against 17 at 5, for more passes. Measured: 5 bits beat 8 by about 10% (docs/perf-history.md).
# GPU indexer: about 256 (query, head) rows per tl.dot (4 queries of 64 heads), so each key tile read from L2 serves
# 4 queries: 13.7 ms against 15.6 ms at 128 rows (H200, T16384, HI64 DI128, top 2048; identical index sets) ...
GPU_INDEXER_ROWS = 256
# ... against 64 candidate keys per step, ...
GPU_INDEXER_KEY_TILE = 64
# ... 1024 candidate keys per scoring program (16 steps): the program's query tile (up to 64 KB) is loaded once for
# them.
GPU_INDEXER_SPAN = 1024
# fp32 keys (the pooled block keys, fp32 inputs) are scored by exact fp32 products on the FMA units, whose [rows, DI]
# query tile lives in registers: at 256 rows the sm_90 compile spills 12 KB a thread; at 32 (HI16) none (H200, T16384
# HI16 block top-32: 1.75 ms against 4.97 at 64 rows and 11.02 at 256).
GPU_INDEXER_ROWS_FP32 = 32
GPU_NUM_WARPS_INDEXER = 8
# Pipelining the key tiles of the scoring loop hides their L2 latency behind the previous tile's product.
GPU_NUM_STAGES_INDEXER = 2
# Queries scored, then selected, per pair of launches: as many as fill this much scratch (4 bytes a candidate, 4096
# queries of T16384 token candidates, all queries at block level; the sampled select's copies take as much again),
# reused slab after slab. One query per selecting program, so a slab is also the selection's grid (4096 programs;
# H200, T16384 HI16, 8-bit digits, 1024-key steps at 8 warps: 4.22 ms against 4.40 at 2048 queries and 4.79 at 1024).
GPU_SELECT_SCRATCH_BYTES = 256 << 20
# The selection reads one query's keys 512 at a time (4 per thread at 4 warps; sm_90 compile: 48 registers), in
# 5-bit digits. H200, T16384 HI16 (HI4): 3.65 (2.87) ms; 1024 keys 3.65 (2.88), 2048 keys 4.43 (3.70), 1024 keys
# at 8 warps 3.75 (2.97); 4-bit digits 3.67-3.74 (2.90-2.99), 8-bit 4.03 (3.26).
GPU_SELECT_CHUNK = 512
GPU_NUM_WARPS_SELECT = 4
GPU_SELECT_DIGIT_BITS = 5
# Bracketing the k-th key by a sample: 512 keys at even strides (sorted by tl.sort), the bracket 32 sample ranks
# either side of the expected rank (2.8 standard deviations of a uniform sample's rank at worst, k = half the row;
# 3.3 at k = a quarter), so about 1/8 of a row is copied and selected; rows of fewer candidates skip the sample.
# H200, T16384 top-2048, HI4 (HI16): 2.27 (3.07) ms against 2.90 (3.67) without; 256 keys +-16: 2.27 (3.10);
# 1024 keys +-64: 2.81 (3.61), the sort's cost growing faster than the bracket shrinks; 2048: 5.1 (5.9).
GPU_SELECT_SAMPLE = 512
GPU_SELECT_MARGIN = 32
GPU_SAMPLE_MIN_CANDIDATES = 4096
# The interpreter runs programs one after another: small tiles, spans and slabs make the tests take every loop.
INTERPRETER_KEY_TILE = MIN_DOT_SIZE
INTERPRETER_INDEXER_SPAN = 2 * MIN_DOT_SIZE
INTERPRETER_SELECT_CHUNK = MIN_DOT_SIZE
INTERPRETER_SLAB_QUERIES = 2 * MIN_DOT_SIZE
INTERPRETER_SELECT_DIGIT_BITS = 5
# A narrow bracket, so that the tests see both outcomes (the k-th key inside it, and outside: the full-row select).
INTERPRETER_SELECT_SAMPLE = MIN_DOT_SIZE
INTERPRETER_SELECT_MARGIN = 2
INTERPRETER_SAMPLE_MIN_CANDIDATES = 40


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer a kernel writes comes from here (tests fill it with NaN or poison and guard its end)."""
    return torch.empty(shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products, as the reference; 16-bit operands make the argument moot."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def query_key_position(t, TQ, T):
    """Flat key position of flat query t: rows of T keys whose last TQ are the queries."""
    return (t // TQ) * T + (T - TQ) + t % TQ


@dataclass(frozen=True)
class SequenceLayout:
    """Where every flat token's sequence starts and ends, built on the device without a host sync.

    cu_seqlens: [N + 1] int32 over the NT flat tokens. seq_id, seq_start, seq_end: [NT] int32. row_len T, and
    queries_per_row TQ (<= T): the queries are each row's last TQ tokens.
    """

    cu_seqlens: torch.Tensor
    seq_id: torch.Tensor
    seq_start: torch.Tensor
    seq_end: torch.Tensor
    row_len: int
    queries_per_row: int

    @property
    def num_tokens(self) -> int:
        return self.seq_start.numel()

    @property
    def num_queries(self) -> int:
        return self.num_tokens // self.row_len * self.queries_per_row if self.row_len else 0

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def query_positions(self) -> torch.Tensor:
        """[NQ] int64: every query's flat key position (query_key_position)."""
        t = torch.arange(self.num_queries, device=self.seq_start.device)
        TQ, T = self.queries_per_row, self.row_len
        return (t // TQ) * T + (T - TQ) + t % TQ


def sequence_layout(
    cu_seqlens: torch.Tensor | None, batch_size: int, row_len: int, device, num_queries: int | None = None
) -> SequenceLayout:
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch_size + 1, device=device, dtype=torch.int32) * row_len
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    pos = torch.arange(batch_size * row_len, device=device, dtype=torch.int32)
    # right=True puts a position equal to a boundary into the sequence that starts there (skips empty sequences).
    seq_id = torch.searchsorted(cu_seqlens[1:], pos, right=True).clamp(max=cu_seqlens.numel() - 2)
    seq_start = cu_seqlens[seq_id].contiguous()
    seq_end = cu_seqlens[seq_id + 1].contiguous()
    queries_per_row = row_len if num_queries is None else num_queries
    return SequenceLayout(cu_seqlens, seq_id.to(torch.int32).contiguous(), seq_start, seq_end, row_len, queries_per_row)


@dataclass(frozen=True)
class BlockSlots:
    """Every block of block_size tokens of every sequence, one slot each, built without a host sync.

    first, length: [NS] int32 first flat token and token count (block_size, less for a tail, 0 for unused slots).
    seq_first_slot: [NT] int32, the slot of block 0 of each token's sequence (block j of it is slot + j).
    """

    first: torch.Tensor
    length: torch.Tensor
    seq_first_slot: torch.Tensor
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.first.numel()


def block_slots(layout: SequenceLayout, block_size: int) -> BlockSlots:
    cu_seqlens = layout.cu_seqlens
    num_seqs = layout.num_seqs
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    blocks_per_seq = (lengths + block_size - 1) // block_size
    slot_offsets = F.pad(blocks_per_seq.cumsum(0), (1, 0)).to(torch.int32)
    # sum ceil(len / bs) <= NT // bs + N: an upper bound known without reading cu_seqlens on the host.
    num_slots = layout.num_tokens // block_size + num_seqs
    slot = torch.arange(num_slots, device=cu_seqlens.device, dtype=torch.int32)
    seq = torch.searchsorted(slot_offsets[1:], slot, right=True).clamp(max=num_seqs - 1)
    first = cu_seqlens[seq] + (slot - slot_offsets[seq]) * block_size
    length = (cu_seqlens[seq + 1] - first).clamp(0, block_size)
    seq_first_slot = slot_offsets[layout.seq_id.long()]
    return BlockSlots(
        first.to(torch.int32).contiguous(),
        length.to(torch.int32).contiguous(),
        seq_first_slot.to(torch.int32).contiguous(),
        block_size,
    )


@triton.jit
def _canonical_indices_kernel(
    idx_ptr,
    canon_ptr,
    bits_ptr,
    seq_start_ptr,
    T,
    TQ,
    S,
    NW,
    H_IDX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_BLOCK: tl.constexpr,
    BS: tl.constexpr,
):
    """One program per (flat query q, index head): raw indices [NQ, H', S] -> canonical [NQ, H', S] + bitmap."""
    q = tl.program_id(0)
    row = q.to(tl.int64) * H_IDX + tl.program_id(1)
    t = query_key_position(q, TQ, T)
    seq_start = tl.load(seq_start_ptr + t).to(tl.int64)
    row_base = (t // T).to(tl.int64) * T
    own_block = (t - seq_start) // BLOCK_SIZE
    slots = tl.arange(0, BS)
    for s0 in range(0, S, BS):
        in_row = s0 + slots < S
        idx = tl.load(idx_ptr + row * S + s0 + slots, mask=in_row, other=-1).to(tl.int64)
        if IS_BLOCK:
            is_valid = in_row & (idx >= 0) & (idx <= own_block)
            canon = idx
        else:
            canon = row_base + idx
            is_valid = in_row & (idx >= 0) & (idx < T) & (canon >= seq_start) & (canon <= t)
        # The bit of a unit: its key position in the row (token level) or its block id (block level).
        unit = tl.where(is_valid, idx, 0).to(tl.int32)
        bit = 1 << (unit % 32)
        old = tl.atomic_or(bits_ptr + row * NW + unit // 32, bit, mask=is_valid)
        is_first = is_valid & ((old & bit) == 0)
        tl.store(canon_ptr + row * S + s0 + slots, tl.where(is_first, canon, -1).to(tl.int32), mask=in_row)


def canonical_indices(
    indices_THS: torch.Tensor, layout: SequenceLayout, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(canonical int32 [NQ, H', S], selection bitmap int32 [NQ, H', NW]) of raw indices [NQ, H', S] (int32/64)."""
    NQ, H_idx, S = indices_THS.shape
    T = layout.row_len
    num_units = T if block_size == 1 else triton.cdiv(T, block_size)
    num_words = triton.cdiv(num_units, BITS_PER_WORD)
    canon = _alloc((NQ, H_idx, S), torch.int32, indices_THS.device)
    bits = torch.zeros((NQ, H_idx, num_words), dtype=torch.int32, device=indices_THS.device)
    _canonical_indices_kernel[(NQ, H_idx)](
        indices_THS, canon, bits, layout.seq_start, T, layout.queries_per_row, S, num_words,
        H_IDX=H_idx, BLOCK_SIZE=block_size, IS_BLOCK=block_size > 1, BS=CANONICAL_BLOCK_SLOTS,
    )  # fmt: skip
    return canon, bits


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    key_ptr,
    w_ptr,
    first_ptr,
    count_ptr,
    scratch_ptr,
    NQ,
    group0,
    max_candidates,
    select_k,
    scale,
    HI: tl.constexpr,
    DI: tl.constexpr,
    HIP: tl.constexpr,
    DIP: tl.constexpr,
    BQ: tl.constexpr,
    BM: tl.constexpr,
    SPAN: tl.constexpr,
    IS_RELU: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (g, s): the BQ queries of group group0 + g against the s-th SPAN candidate keys of the group's range.

    Query t's candidates are key table rows first[t] .. first[t] + count[t] - 1 (k_idx rows, or block keys); their
    scores go to scratch row t - group0 * BQ as int32 keys that order as the floats do. Queries that keep all their
    candidates (count <= select_k) need no score and get none.
    """
    group = group0 + tl.program_id(0)
    queries = tl.arange(0, BQ)
    t_q = group * BQ + queries
    is_query = t_q < NQ
    first = tl.load(first_ptr + t_q, mask=is_query, other=0)
    count = tl.load(count_ptr + t_q, mask=is_query, other=0)
    needs_select = is_query & (count > select_k)
    hi = tl.max(tl.where(needs_select, first + count, 0), axis=0)
    # lo = hi when no query of the group needs a score: every program of the group then has nothing to do.
    lo = tl.min(tl.where(needs_select, first, hi), axis=0)
    start = lo + tl.program_id(1) * SPAN
    if start < hi:
        rows = tl.arange(0, BQ * HIP)
        row_query = rows // HIP
        row_head = rows % HIP
        dims = tl.arange(0, DIP)
        t_rows = group * BQ + row_query
        is_row = (t_rows < NQ) & (row_head < HI)
        row_offsets = (t_rows.to(tl.int64) * HI + row_head) * DI
        q = tl.load(q_ptr + row_offsets[:, None] + dims[None, :], mask=is_row[:, None] & (dims[None, :] < DI), other=0)
        q = q.to(key_ptr.dtype.element_ty)
        w = tl.load(w_ptr + t_rows.to(tl.int64) * HI + row_head, mask=is_row, other=0).to(tl.float32)
        scratch = scratch_ptr + (queries[:, None] + (group - group0) * BQ).to(tl.int64) * max_candidates
        for p0 in range(start, tl.minimum(start + SPAN, hi), BM):
            keys = p0 + tl.arange(0, BM)
            k_t = tl.load(
                key_ptr + keys[None, :].to(tl.int64) * DI + dims[:, None],
                mask=(keys[None, :] < hi) & (dims[:, None] < DI),
                other=0,
            )
            logits = tl.dot(q, k_t, input_precision=PRECISION) * scale
            if IS_RELU:
                logits = tl.maximum(logits, 0.0)
            weighted = tl.reshape(logits * w[:, None], [BQ, HIP, BM])
            scores = tl.sum(weighted, axis=1)
            # int32 keys whose signed order is the fp32 scores' (-0.0 made +0.0): flip the magnitude bits of negatives.
            bits = scores.to(tl.int32, bitcast=True)
            bits = tl.where(bits == -2147483648, 0, bits)
            order_key = tl.where(bits >= 0, bits, bits ^ 2147483647)
            m = keys[None, :] - first[:, None]
            is_candidate = needs_select[:, None] & (m >= 0) & (m < count[:, None])
            tl.store(scratch + m, order_key, mask=is_candidate)


@triton.jit
def _topk_select_kernel(
    first_ptr,
    count_ptr,
    tail_ptr,
    out_ptr,
    scratch_ptr,
    mid_ptr,
    NQ,
    T,
    t0,
    max_candidates,
    topk,
    select_k,
    CHUNK: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
    SAMPLE: tl.constexpr,
    MARGIN: tl.constexpr,
    IS_BLOCK: tl.constexpr,
):
    """One program per query t0 + pid: the k-th largest key of its scratch row by radix select, then an ascending emit.

    The query keeps the select_k best of its count[t] candidates (topk, or topk - 1 in block mode) and then, in block
    mode, the block id tail[t] unless it is -1: the query's own block, the largest id it may select, so it goes last.
    With SAMPLE > 0, SAMPLE keys at even strides bracket the k-th key by the sample keys MARGIN ranks either side of
    its expected rank; one pass counts the keys above the bracket and copies those inside it to the query's mid_ptr
    row, and the radix select runs over that copy alone when the bracket holds the k-th key (the full row otherwise).
    """
    t = t0 + tl.program_id(0)
    if t < NQ:
        BINS: tl.constexpr = 1 << DIGIT_BITS
        bins = tl.arange(0, BINS)
        cols = tl.arange(0, CHUNK)
        first_t = tl.load(first_ptr + t)
        count_t = tl.load(count_ptr + t)
        row = scratch_ptr + tl.program_id(0).to(tl.int64) * max_candidates
        out_row = out_ptr + t.to(tl.int64) * topk
        if IS_BLOCK:
            base = 0
        else:
            # first_t: the query's first candidate, a flat key position; indices count from its row's start.
            base = first_t % T
        num_kept = tl.minimum(count_t, select_k)
        takes_all = count_t <= select_k
        # Keys above hi_bound are kept without a select; the select looks at keys from lo_bound to hi_bound, read
        # from src (src_count of them), and keeps num_target of them. Without a bracket: every key, from the row.
        lo_bound = tl.full([], -2147483648, tl.int32)
        hi_bound = tl.full([], 2147483647, tl.int32)
        src = row
        src_count = count_t
        num_target = num_kept
        if SAMPLE > 0:
            if not takes_all and num_kept > 0:
                ranks = tl.arange(0, SAMPLE)
                picks = (ranks.to(tl.int64) * count_t) // SAMPLE
                sample = tl.sort(tl.load(row + picks, mask=picks < count_t, other=0), descending=True)
                # The k-th largest key's expected rank in the sample, and the sample keys MARGIN ranks either side.
                expected = ((num_kept.to(tl.int64) * SAMPLE) // count_t).to(tl.int32)
                hi_est = tl.sum(tl.where(ranks == expected - MARGIN, sample, 0), axis=0)
                lo_est = tl.sum(tl.where(ranks == expected + MARGIN, sample, 0), axis=0)
                hi_b = tl.where(expected - MARGIN >= 0, hi_est, 2147483647)
                lo_b = tl.where(expected + MARGIN < SAMPLE, lo_est, -2147483648)
                mid_row = mid_ptr + tl.program_id(0).to(tl.int64) * max_candidates
                num_above = 0
                num_mid = 0
                for m0 in range(0, count_t, CHUNK):
                    m = m0 + cols
                    is_in = m < count_t
                    key = tl.load(row + m, mask=is_in, other=0)
                    is_mid = is_in & (key >= lo_b) & (key <= hi_b)
                    pos = num_mid + tl.cumsum(is_mid.to(tl.int32), axis=0) - 1
                    tl.store(mid_row + pos, key, mask=is_mid)
                    num_above += tl.sum((is_in & (key > hi_b)).to(tl.int32), axis=0)
                    num_mid += tl.sum(is_mid.to(tl.int32), axis=0)
                # The copies written by every thread must be visible to every thread before they are read back.
                tl.debug_barrier()
                if (num_above < num_kept) & (num_above + num_mid >= num_kept):
                    lo_bound = lo_b
                    hi_bound = hi_b
                    src = mid_row
                    src_count = num_mid
                    num_target = num_kept - num_above
        # Radix select on the signed keys, DIGIT_BITS a pass from the top (the first pass takes the FIRST_BITS that
        # remain, sign bit included): prefix is the k-th largest key shifted right by `shift`; num_left how many keys
        # of that prefix are kept (the lower-indexed ones).
        FIRST_BITS: tl.constexpr = 32 - DIGIT_BITS * ((32 - 1) // DIGIT_BITS)
        prefix = tl.zeros([], dtype=tl.int32)
        shift = tl.zeros([], dtype=tl.int32)
        num_left = num_target
        is_resolved = takes_all | (num_kept == 0)
        for radix_pass in tl.static_range((32 - 1) // DIGIT_BITS + 1):
            if not is_resolved:
                digit_shift = 32 - FIRST_BITS - DIGIT_BITS * radix_pass
                hist = tl.zeros([BINS], dtype=tl.int32)
                for m0 in range(0, src_count, CHUNK):
                    m = m0 + cols
                    is_match = m < src_count
                    key = tl.load(src + m, mask=is_match, other=0)
                    if radix_pass > 0:
                        is_match = is_match & ((key >> (digit_shift + DIGIT_BITS)) == prefix)
                        digit = (key >> digit_shift) & (BINS - 1)
                    else:
                        # The top digit holds the sign: flipping its top bit orders the digits as the keys.
                        digit = ((key >> digit_shift) & ((1 << FIRST_BITS) - 1)) ^ (1 << (FIRST_BITS - 1))
                    hist += tl.histogram(digit, BINS, mask=is_match)
                # above[d]: keys of the prefix whose digit is larger than d.
                above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
                is_chosen = (above < num_left) & (above + hist >= num_left)
                chosen = tl.sum(tl.where(is_chosen, bins, 0), axis=0)
                num_in_bin = tl.sum(tl.where(is_chosen, hist, 0), axis=0)
                num_left -= tl.sum(tl.where(is_chosen, above, 0), axis=0)
                if radix_pass == 0:
                    prefix = chosen - (1 << (FIRST_BITS - 1))
                else:
                    prefix = prefix * BINS + chosen
                shift = tl.zeros([], dtype=tl.int32) + digit_shift
                # Every key of the chosen prefix is kept: the lower digits need not be looked at.
                is_resolved = num_in_bin == num_left

        # Kept: keys above the bracket, bracketed keys above the prefix, and the first num_left bracketed keys of it:
        # all of them when the select resolved (the k-th key's bin held only kept keys), so the ranks among equal keys
        # (a second prefix sum per step) are needed only when it ran out of digits on ties.
        num_out = 0
        if is_resolved:
            for m0 in range(0, count_t, CHUNK):
                m = m0 + cols
                is_in = m < count_t
                key = tl.load(row + m, mask=is_in & ~takes_all, other=0)
                is_bracketed = is_in & (key >= lo_bound) & (key <= hi_bound)
                is_better = (key > hi_bound) | (is_bracketed & ((key >> shift) >= prefix))
                is_taken = is_in & (num_kept > 0) & (takes_all | is_better)
                pos = num_out + tl.cumsum(is_taken.to(tl.int32), axis=0) - 1
                tl.store(out_row + pos, base + m, mask=is_taken)
                num_out += tl.sum(is_taken.to(tl.int32), axis=0)
        else:
            num_equal_seen = 0
            for m0 in range(0, count_t, CHUNK):
                m = m0 + cols
                is_in = m < count_t
                key = tl.load(row + m, mask=is_in, other=0)
                top = key >> shift
                is_bracketed = is_in & (key >= lo_bound) & (key <= hi_bound)
                is_equal = is_bracketed & (top == prefix)
                equal_rank = num_equal_seen + tl.cumsum(is_equal.to(tl.int32), axis=0) - 1
                is_better = (key > hi_bound) | (is_bracketed & (top > prefix)) | (is_equal & (equal_rank < num_left))
                is_taken = is_in & is_better
                pos = num_out + tl.cumsum(is_taken.to(tl.int32), axis=0) - 1
                tl.store(out_row + pos, base + m, mask=is_taken)
                num_out += tl.sum(is_taken.to(tl.int32), axis=0)
                num_equal_seen += tl.sum(is_equal.to(tl.int32), axis=0)
        if IS_BLOCK:
            tail = tl.load(tail_ptr + t)
            if tail >= 0:
                tl.store(out_row + num_out, tail)
                num_out += 1
        for f0 in range(num_out - num_out % CHUNK, topk, CHUNK):
            f = f0 + cols
            tl.store(out_row + f, -1, mask=(f >= num_out) & (f < topk))


def pooled_block_keys(k_idx_TD: torch.Tensor, slots: BlockSlots, is_pooled: bool = False) -> torch.Tensor:
    """fp32 [NS, DI] key of each complete block slot (rows of incomplete or unused slots are unused): the mean of its
    k_idx rows, or with is_pooled the k_idx row at its first token (the model pooled it already).

    The same ops as the reference (upcast, then mean over the block dim) so that equal inputs give equal keys.
    """
    compute_dtype = torch.promote_types(k_idx_TD.dtype, torch.float32)
    last_row = k_idx_TD.shape[0] - 1
    if is_pooled:
        return k_idx_TD.to(compute_dtype)[slots.first.long().clamp(max=last_row)].contiguous()
    bs = slots.block_size
    rows = (slots.first.long()[:, None] + torch.arange(bs, device=k_idx_TD.device)).clamp(max=last_row)
    return k_idx_TD.to(compute_dtype)[rows].mean(dim=1).contiguous()


def topk_indexer_fwd(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None,
    topk: int,
    scale: float,
    activation: str,
    block_size: int,
    cu_seqlens: torch.Tensor | None,
    k_idx_is_pooled: bool = False,
    always_keep_own_block: bool = True,
) -> torch.Tensor:
    """int32 [B, TQ, topk] as reference.topk_indexer_ref; inputs already checked (fp32/fp16/bf16). q_idx [B, TQ, HI,
    DI] are the last TQ of k_idx's [B, T, DI] tokens (query_start = T - TQ).

    Block mode: by default the candidates are the complete blocks before the query's own block, which is always kept;
    with always_keep_own_block False (QSA) they are the complete blocks up to the query (its own block once complete)
    and the own block is added only while incomplete."""
    B, TQ, HI, DI = q_idx.shape
    T = k_idx.shape[1]
    NT, NQ = B * T, B * TQ
    device = q_idx.device
    layout = sequence_layout(cu_seqlens, B, T, device, num_queries=TQ)
    q_THD = q_idx.reshape(NQ, HI, DI).contiguous()
    if w_idx is None:
        w_TH = torch.ones(NQ, HI, dtype=torch.float32, device=device)
    else:
        w_TH = w_idx.reshape(NQ, HI).contiguous()
    # Per query: its key position, and the start of its sequence.
    pos = layout.query_positions()
    seq_start = layout.seq_start[pos]
    pos = pos.to(torch.int32)
    if block_size == 1:
        keys = k_idx.reshape(NT, DI).contiguous()
        first = seq_start
        count = pos - seq_start + 1
        tail = count
        max_candidates = T
        select_k = topk
    else:
        slots = block_slots(layout, block_size)
        keys = pooled_block_keys(k_idx.reshape(NT, DI), slots, is_pooled=k_idx_is_pooled)
        first = slots.seq_first_slot[pos.long()].contiguous()
        own_block = (pos - seq_start) // block_size
        if always_keep_own_block:
            count, tail = own_block, own_block
        else:
            count = (pos - seq_start + 1) // block_size
            tail = torch.where(own_block < count, -1, own_block)
        max_candidates = max(1, triton.cdiv(T, block_size))
        select_k = topk - 1
    precision = dot_precision(keys.dtype)

    hip = triton.next_power_of_2(HI)
    if q_idx.is_cuda:
        rows = GPU_INDEXER_ROWS_FP32 if keys.dtype == torch.float32 else GPU_INDEXER_ROWS
        bq = max(1, rows // max(hip, 1))
        bq = max(bq, triton.cdiv(MIN_DOT_SIZE, hip))
        key_tile, span = GPU_INDEXER_KEY_TILE, GPU_INDEXER_SPAN
        select_chunk, digit_bits = GPU_SELECT_CHUNK, GPU_SELECT_DIGIT_BITS
        sample_keys, sample_margin = GPU_SELECT_SAMPLE, GPU_SELECT_MARGIN
        sample_min_candidates = GPU_SAMPLE_MIN_CANDIDATES
        slab_queries = GPU_SELECT_SCRATCH_BYTES // (4 * max_candidates)
        score_launch = dict(num_warps=GPU_NUM_WARPS_INDEXER, num_stages=GPU_NUM_STAGES_INDEXER)
        select_launch = dict(num_warps=GPU_NUM_WARPS_SELECT)
    else:
        bq = triton.next_power_of_2(max(1, triton.cdiv(MIN_DOT_SIZE, hip)))
        key_tile, span = INTERPRETER_KEY_TILE, INTERPRETER_INDEXER_SPAN
        select_chunk, slab_queries, digit_bits = (
            INTERPRETER_SELECT_CHUNK, INTERPRETER_SLAB_QUERIES, INTERPRETER_SELECT_DIGIT_BITS
        )
        sample_keys, sample_margin, sample_min_candidates = (
            INTERPRETER_SELECT_SAMPLE, INTERPRETER_SELECT_MARGIN, INTERPRETER_SAMPLE_MIN_CANDIDATES
        )
        score_launch = select_launch = {}
    num_groups = triton.cdiv(NQ, bq)
    slab_groups = max(1, min(num_groups, slab_queries // bq))
    # A group's candidates lie within max_candidates + bq - 1 key rows (it may straddle two packed sequences), plus
    # the T - TQ keys before the queries of a row when it straddles two rows.
    num_spans = triton.cdiv(max_candidates + bq + (T - TQ if B > 1 else 0), span)
    scratch = torch.empty((slab_groups * bq, max_candidates), dtype=torch.int32, device=device)
    # The bracketed keys' copies: only where rows are long enough for a sample to pay.
    sample = sample_keys if max_candidates >= sample_min_candidates else 0
    mid = torch.empty_like(scratch) if sample else scratch
    out = _alloc((NQ, topk), torch.int32, device)
    tail = tail.to(torch.int32).contiguous()
    for group0 in range(0, num_groups, slab_groups):
        groups = min(slab_groups, num_groups - group0)
        _indexer_scores_kernel[(groups, num_spans)](
            q_THD, keys, w_TH, first, count, scratch, NQ, group0, max_candidates, select_k, scale,
            HI=HI, DI=DI, HIP=hip, DIP=max(MIN_DOT_SIZE, triton.next_power_of_2(DI)), BQ=bq, BM=key_tile,
            SPAN=span, IS_RELU=activation == "relu", PRECISION=precision, **score_launch,
        )  # fmt: skip
        _topk_select_kernel[(groups * bq,)](
            first, count, tail, out, scratch, mid, NQ, T, group0 * bq, max_candidates, topk, select_k,
            CHUNK=select_chunk, DIGIT_BITS=digit_bits, SAMPLE=sample, MARGIN=sample_margin, IS_BLOCK=block_size > 1,
            **select_launch,
        )  # fmt: skip
    return out.view(B, TQ, topk)
