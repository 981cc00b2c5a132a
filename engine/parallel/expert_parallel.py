"""Expert parallelism over ZeRO-3 data parallelism.

World = data x expert. Rank r sits at expert-parallel position r % ep of its expert-parallel group (DeepSpeed's
"ep_size_{ep}" groups: consecutive ranks; ep is the profile's parallel.expert_parallel, ExpertLayout.expert_parallel),
and holds experts [expert_parallel_rank * E_local, (expert_parallel_rank + 1) * E_local) of every MoE layer,
E_local = E / ep. Tokens travel to the rank of their expert with all_to_all_single (uneven splits,
counts exchanged first), are computed by the local experts, and come back to be combined with the routing weights;
autograd flows through both all-to-alls.

Expert parameters are tagged the way deepspeed 0.19.8 tags its AutoEP experts, so ZeRO-3 shards and reduces them
only over the expert-data-parallel group (the ranks that hold the same experts), never across ranks holding
different experts. Untagged, ZeRO-3 would treat them as replicated and train silently wrong.

Shapes: N tokens, k experts per token, D model dim, S = N * k token-slots, R rows received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

EXPERT_FAMILY = "autoep_expert"


@dataclass(frozen=True)
class ExpertLayout:
    """Where the experts of every MoE layer live. expert_parallel 1 (group None) is the single-device layout."""

    expert_parallel: int = 1
    expert_parallel_rank: int = 0
    group: object | None = None

    @property
    def group_name(self) -> str:
        return f"ep_size_{self.expert_parallel}"

    def local_experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.expert_parallel
        return range(self.expert_parallel_rank * per_rank, (self.expert_parallel_rank + 1) * per_rank)


def create_expert_layout(expert_parallel: int, world_size: int) -> ExpertLayout:
    """Create (through DeepSpeed, so ZeRO-3 resolves the same groups) the expert and expert-data groups."""
    if expert_parallel == 1:
        return ExpertLayout()
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(expert_parallel)
    name = f"ep_size_{expert_parallel}"
    group = groups._get_expert_parallel_group(name)
    return ExpertLayout(expert_parallel=expert_parallel, expert_parallel_rank=dist.get_rank(group=group), group=group)


def is_expert_parameter(param: nn.Parameter) -> bool:
    return getattr(param, "ds_zero_placement_family", None) == EXPERT_FAMILY


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def _exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts


def dispatch_compute_combine(
    x_ND: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: nn.Module,
    num_experts: int,
    layout: ExpertLayout,
) -> torch.Tensor:
    """y = sum_j w[n, j] * expert_{ids[n, j]}(x[n]) with the experts spread over the expert-parallel group.

    experts: the local experts (called as experts(x, local_ids, weights)); it runs even when this rank receives no
    rows, so ZeRO-3's gathers of expert parameters stay matched across the group.
    """
    n, k = topk_ids.shape
    per_rank = num_experts // layout.expert_parallel
    flat_ids = topk_ids.reshape(-1)
    dest_S = torch.div(flat_ids, per_rank, rounding_mode="floor")
    order_S = torch.argsort(dest_S, stable=True)
    token_S = torch.div(order_S, k, rounding_mode="floor")
    send_counts = torch.bincount(dest_S, minlength=layout.expert_parallel)
    recv_counts = _exchange_counts(send_counts, layout.group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)

    send_x = x_ND.index_select(0, token_S).contiguous()
    recv_x = _AllToAll.apply(send_x, recv_splits, send_splits, layout.group)
    send_local = (flat_ids.index_select(0, order_S) % per_rank).contiguous()
    recv_local = send_local.new_empty(num_recv)
    dist.all_to_all_single(recv_local, send_local, recv_splits, send_splits, group=layout.group)

    # Unweighted expert outputs; the routing weights are applied at home, so their gradient needs no exchange.
    out_RD = experts(recv_x, recv_local[:, None], recv_x.new_ones(num_recv, 1))
    back_SD = _AllToAll.apply(out_RD, send_splits, recv_splits, layout.group)
    weights_S = topk_weights.reshape(-1).index_select(0, order_S).to(back_SD.dtype)
    return x_ND.new_zeros(n, x_ND.shape[1]).index_add(0, token_S, back_SD * weights_S[:, None])


def gather_expert_tensor(local: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Concatenate each rank's [E_local, ...] slice into the full [E, ...] tensor (equal sizes on every rank)."""
    if layout.expert_parallel == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.expert_parallel)]
    dist.all_gather(parts, local.contiguous(), group=layout.group)
    return torch.cat(parts, dim=0)
