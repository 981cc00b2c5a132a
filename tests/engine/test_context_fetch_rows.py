"""engine/parallel/context.py's fetch_rows on 4 gloo ranks sharing a row of 40 tokens (shares of 10): each rank gets
exactly the rows of the ranges it asks for (ranges across shares, on its own share, on later ranks, none at all), and
backward hands every rank the gradients of its rows summed over the ranks that fetched them."""

import pickle

import torch

from moe_tune.engine.parallel.context import ContextShard, fetch_rows

from context_ranks import run_ranks

ROW_TOKENS, NUM_RANKS, WIDTH = 40, 4, 3
# The (start, stop) ranges of row tokens each rank asks for.
WANTED = [
    [],  # nothing: the rank still joins every exchange
    [[2, 5], [8, 13]],  # across the end of share 0
    [[0, 1], [9, 31]],  # over every share, its own included
    [[4, 6], [12, 14], [35, 40]],  # rows that ranks 1 and 2 fetch too, and its own
]


def row_and_weights():
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(ROW_TOKENS, WIDTH, generator=gen)
    weights = [torch.randn(ROW_TOKENS, WIDTH, generator=gen) for _ in range(NUM_RANKS)]
    return row, weights


def wanted_rows(rank: int) -> list[int]:
    return [t for start, stop in WANTED[rank] for t in range(start, stop)]


def _rank(rank: int, size: int):
    row, weights = row_and_weights()
    cu = torch.tensor([0, ROW_TOKENS], dtype=torch.int32)
    shard = ContextShard.of_row(cu, torch.distributed.group.WORLD, rank, size)
    x = shard.local(row, 0).clone().requires_grad_()
    ranges = torch.tensor(WANTED[rank], dtype=torch.int64).view(-1, 2)
    received, rows = fetch_rows(x, shard, ranges)
    (received * weights[rank][rows]).sum().backward()
    return pickle.dumps((received.detach(), rows, x.grad))


def test_fetch_rows_gives_the_rows_asked_for_and_returns_their_gradients():
    ranks = [pickle.loads(r) for r in run_ranks(_rank, NUM_RANKS)]
    row, weights = row_and_weights()
    expected_grad = torch.zeros(ROW_TOKENS, WIDTH)
    for rank, (received, rows, _) in enumerate(ranks):
        wanted = torch.tensor(wanted_rows(rank), dtype=torch.int64)
        assert torch.equal(rows, wanted), rank
        assert torch.equal(received, row[wanted]), rank
        expected_grad.index_add_(0, wanted, weights[rank][wanted])
    share = ROW_TOKENS // NUM_RANKS
    for rank, (_, _, grad) in enumerate(ranks):
        torch.testing.assert_close(grad, expected_grad[rank * share : (rank + 1) * share])
