"""Context parallelism (parallel.context_parallel: N): N ranks share one packed row, each holding T / N tokens.

Rank r of a context group holds the row's tokens [r T / N, (r + 1) T / N): every per-token layer (norms,
projections, MLPs, experts, the head and its loss) runs on its own tokens unchanged; the token mixers exchange
what crosses the cut through the differentiable collectives below (linear attention its recurrent states, the
short convolutions their halo, softmax attention the keys and values its queries select). Losses need nothing
more: each rank's summed cross-entropy over its own labels divided by the global labelled count over the world
size, averaged over the world as data parallel averages, is the row's mean (engine/train).

Shapes: T the row's tokens, T_local = T / N this rank's.

The collectives are autograd functions whose backward is a collective too: every rank of the group must call
them in the same order with tensors of the same shapes (fetch_rows: parts of any size, empty ones too), and use every
output in its loss (a rank whose loss leaves an output out skips that backward collective and the others wait for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextShard:
    """This rank's part of a row shared by `size` ranks; `group` None with size 1 is a row held whole."""

    group: dist.ProcessGroup | None
    rank: int  # index inside the context group: its tokens come after those of ranks 0 .. rank - 1
    size: int
    start: int  # the first token of the row held here
    stop: int  # one past the last
    row_cu_seqlens: torch.Tensor  # [N + 1] int32 document starts over the whole row (0, ..., T)

    @property
    def row_tokens(self) -> int:
        return int(self.row_cu_seqlens[-1])

    @classmethod
    def of_row(cls, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int) -> ContextShard:
        """Rank `rank`'s share of the row that cu_seqlens describes; the row's length must be a multiple of size."""
        total = int(cu_seqlens[-1])
        if total % size:
            raise ValueError(f"a row of {total} tokens cannot be shared by {size} context-parallel ranks: its length "
                             "must be a multiple of parallel.context_parallel")  # fmt: skip
        share = total // size
        return cls(group, rank, size, rank * share, (rank + 1) * share, cu_seqlens)

    def local_cu_seqlens(self) -> torch.Tensor:
        """[M + 1] int32 starts of the document pieces held here, from 0 to T_local: a document begun on an earlier
        rank continues from this rank's token 0; one going on past `stop` is cut there."""
        inside = self.row_cu_seqlens[(self.row_cu_seqlens > self.start) & (self.row_cu_seqlens < self.stop)]
        edges = torch.cat([inside.new_tensor([self.start]), inside, inside.new_tensor([self.stop])])
        return (edges - self.start).to(torch.int32)

    def continues_document(self) -> bool:
        """Whether this rank's first token belongs to a document begun on an earlier rank."""
        return self.start > 0 and not bool((self.row_cu_seqlens == self.start).any())

    def local(self, row_tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The part of a row-long tensor (token dim `dim` of length T) held here."""
        return row_tensor.narrow(dim, self.start, self.stop - self.start)


class _GatherRanks(torch.autograd.Function):
    """[size, *x.shape]: x of every rank of `group` in rank order. Backward: each rank's gradient of the stack summed
    over the group, every rank keeping its own entry (one reduce-scatter; it works in any group, gloo or nccl)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Flat: the collective splits its input along dim 0 into one equal part per rank.
        mine = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(mine, grad.contiguous().reshape(-1), group=ctx.group)
        return mine.view(grad.shape[1:]), None, None


def gather_ranks(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """x from every rank of the group, stacked in rank order: [size, *x.shape] (states, halos, per-rank summaries).
    Backward sums each rank's gradient of the stack and hands every rank its own entry's."""
    if shard.size == 1:
        return x.unsqueeze(0)
    return _GatherRanks.apply(x, shard.group, shard.size)


def gather_sequence(x: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """Every rank's part of x (T_local long on `dim`) joined in row order: T long. Backward as gather_ranks."""
    if shard.size == 1:
        return x
    return torch.cat(gather_ranks(x, shard).unbind(0), dim=dim)


def previous_rank_tail(x: torch.Tensor, shard: ContextShard, width: int, dim: int = 1) -> torch.Tensor:
    """The last `width` entries along `dim` of the previous rank's x (zeros on rank 0): the halo a causal
    convolution of width + 1 taps needs before this rank's first token. Differentiable."""
    tail = x.narrow(dim, x.shape[dim] - width, width)
    if shard.size == 1:
        return torch.zeros_like(tail)
    # Rank 0 takes its zeros through the gather too: every rank's backward then runs the same collectives.
    tails = gather_ranks(tail, shard)
    return tails[max(shard.rank - 1, 0)] * float(shard.rank > 0)


class _SendRows(torch.autograd.Function):
    """Rows of x [T_local, C] sent to the other ranks of `group`: rank d gets rows send_rows[...] of this rank's part
    for d (send_counts[d] of them, parts in rank order); returns the rows received, recv_counts[s] from rank s, in rank
    order. Backward: the reverse all-to-all, each rank adding the gradients of the rows it sent into x's (a row sent
    to several ranks sums them). Uneven all_to_all_single works in any group, gloo or nccl."""

    @staticmethod
    def forward(ctx, x, send_rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group):
        ctx.save_for_backward(send_rows)
        ctx.x_shape, ctx.send_counts, ctx.recv_counts, ctx.group = x.shape, send_counts, recv_counts, group
        received = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(received, x[send_rows].contiguous(), recv_counts, send_counts, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (send_rows,) = ctx.saved_tensors
        sent = grad.new_empty(len(send_rows), *grad.shape[1:])
        dist.all_to_all_single(sent, grad.contiguous(), ctx.send_counts, ctx.recv_counts, group=ctx.group)
        return grad.new_zeros(ctx.x_shape).index_add_(0, send_rows, sent), None, None, None, None


def rows_of_ranges(ranges: torch.Tensor) -> torch.Tensor:
    """[n, 2] int64 half-open ranges (start, stop) -> [R] int64 the rows they cover, range after range."""
    lengths = ranges[:, 1] - ranges[:, 0]
    ends = lengths.cumsum(0)
    shift = torch.repeat_interleave(ranges[:, 0] - (ends - lengths), lengths)
    return shift + torch.arange(len(shift), device=ranges.device)


def fetch_rows(x: torch.Tensor, shard: ContextShard, ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the row held by other ranks: x [T_local, C] this rank's part of a row-long tensor, ranges [n, 2] int64
    (start, stop) row tokens this rank wants, ascending and disjoint -> (the rows [R, C], in row order; their row
    tokens [R] int64). Three all-to-alls with uneven splits: how many ranges each rank wants of each, the ranges, the
    rows (differentiable: backward sends each received row's gradient back to its owner, which sums them into x's).
    Every rank of the group calls it, with no ranges when it wants none."""
    share = shard.stop - shard.start
    # Split at the shares' ends: each piece lies on one rank.
    bounds = torch.arange(1, shard.size, device=ranges.device, dtype=torch.int64) * share
    cuts = bounds[((bounds > ranges[:, :1]) & (bounds < ranges[:, 1:])).any(0)]
    wanted = torch.cat([ranges.flatten(), cuts, cuts]).sort().values.view(-1, 2)
    want_counts = torch.bincount(wanted[:, 0] // share, minlength=shard.size)
    asked_counts = torch.empty_like(want_counts)
    dist.all_to_all_single(asked_counts, want_counts, group=shard.group)
    want_counts, asked_counts = want_counts.tolist(), asked_counts.tolist()
    asked = wanted.new_empty(sum(asked_counts), 2)
    dist.all_to_all_single(asked, wanted, asked_counts, want_counts, group=shard.group)
    recv_counts, send_counts = _rows_per_rank(wanted, want_counts), _rows_per_rank(asked, asked_counts)
    send_rows = rows_of_ranges(asked) - shard.start
    received = _SendRows.apply(x, send_rows, send_counts, recv_counts, shard.group)
    return received, rows_of_ranges(wanted)


def _rows_per_rank(ranges: torch.Tensor, counts: list[int]) -> list[int]:
    """The rows covered by each rank's part of ranges [n, 2] (counts[r] ranges, rank after rank)."""
    lengths = (ranges[:, 1] - ranges[:, 0]).tolist()
    return [sum(lengths[end - n : end]) for end, n in zip(accumulate(counts), counts)]
