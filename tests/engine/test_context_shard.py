"""ContextShard's split of a packed row and the context group's differentiable collectives (engine/parallel/context)."""

import pytest
import torch

from moe_tune.engine.parallel.context import ContextShard, gather_ranks, gather_sequence, previous_rank_tail

from context_ranks import run_ranks


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("cu", [[0, 16], [0, 4, 16], [0, 8, 16], [0, 3, 5, 9, 12, 16], [0, 1, 15, 16]])
def test_local_pieces_cover_the_row(cu, size):
    """Joined over ranks, the local document pieces are the row's documents cut at every share boundary."""
    row = torch.tensor(cu, dtype=torch.int32)
    shards = [ContextShard.of_row(row, None, r, size) for r in range(size)]
    edges = sorted({int(e) + s.start for s in shards for e in s.local_cu_seqlens()})
    cuts = sorted(set(cu) | {r * 16 // size for r in range(size)})
    assert edges == cuts
    for s in shards:
        local = s.local_cu_seqlens()
        assert local.dtype == torch.int32 and int(local[0]) == 0 and int(local[-1]) == 16 // size
        assert s.continues_document() == (s.start > 0 and s.start not in cu)


def test_row_not_a_multiple_is_refused():
    with pytest.raises(ValueError, match="multiple of parallel.context_parallel"):
        ContextShard.of_row(torch.tensor([0, 10], dtype=torch.int32), None, 0, 4)


def _collectives(rank, size):
    row = torch.tensor([0, 5, 8 * size], dtype=torch.int32)
    shard = ContextShard.of_row(row, torch.distributed.group.WORLD, rank, size)
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(1, 8 * size, 3, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, 8 * size, 3, generator=gen, dtype=torch.float64)
    x = shard.local(whole, dim=1).clone().requires_grad_()
    joined = gather_sequence(x, shard)
    stacked = gather_ranks(x.sum(1), shard)
    tail = previous_rank_tail(x, shard, 2)
    loss = (joined * weights).sum() + (stacked ** 2).sum() + (tail * 3).sum()
    loss.backward()
    return joined.detach(), stacked.detach(), tail.detach(), x.grad


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_match_one_process(size):
    """Values and gradients of the summed losses of every rank equal one process holding the row."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(1, 8 * size, 3, generator=gen, dtype=torch.float64).requires_grad_()
    weights = torch.randn(1, 8 * size, 3, generator=gen, dtype=torch.float64)
    parts = whole.split(8, dim=1)
    stacked = torch.stack([p.sum(1) for p in parts])
    tails = [torch.zeros(1, 2, 3, dtype=torch.float64)] + [p[:, -2:] for p in parts[:-1]]
    # Every rank's loss holds the joined and stacked terms: size copies of them, one tail each.
    loss = size * ((whole * weights).sum() + (stacked ** 2).sum()) + sum((t * 3).sum() for t in tails)
    loss.backward()
    for rank, (joined, stacked_r, tail, grad) in enumerate(run_ranks(_collectives, size)):
        torch.testing.assert_close(joined, whole.detach(), rtol=0, atol=0)
        torch.testing.assert_close(stacked_r, stacked.detach(), rtol=0, atol=0)
        torch.testing.assert_close(tail, tails[rank].detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad, whole.grad[:, 8 * rank:8 * (rank + 1)], rtol=1e-12, atol=1e-12)


def _two_groups(rank, size):
    # World 4 = 2 context groups of 2 consecutive ranks: {0, 1} and {2, 3}, each sharing its own row.
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    group_index, member = divmod(rank, 2)
    row = torch.tensor([0, 3, 16], dtype=torch.int32)
    shard = ContextShard.of_row(row, groups[group_index], member, 2)
    whole = torch.arange(16 * 2, dtype=torch.float64).reshape(1, 16, 2) * (group_index + 1)
    x = shard.local(whole, dim=1).clone().requires_grad_()
    joined = gather_sequence(x, shard)
    weights = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(1, 16, 2)
    (joined * weights).sum().backward()
    return joined.detach(), x.grad


def test_collectives_in_several_groups():
    """Each context group gathers its own row; the backward stays inside the group (ranks 2, 3 are not ranks 0, 1 of
    the world)."""
    results = run_ranks(_two_groups, 4)
    weights = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(1, 16, 2)
    for rank, (joined, grad) in enumerate(results):
        group_index, member = divmod(rank, 2)
        whole = torch.arange(32, dtype=torch.float64).reshape(1, 16, 2) * (group_index + 1)
        torch.testing.assert_close(joined, whole, rtol=0, atol=0)
        # Both members' losses hold the whole joined tensor: each part's gradient is twice its weights.
        torch.testing.assert_close(grad, 2 * weights[:, 8 * member:8 * (member + 1)], rtol=0, atol=0)
