"""The MoE layer: router, routed SwiGLU experts stored as grouped tensors, optional gated shared expert.

Shapes: T tokens, D model dim, E experts, F expert hidden dim, k experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_tune.ops.moe import ExpertLoRA, moe_mlp, switch_aux_loss, topk_route
from moe_tune.profiles.schema import MoESpec

from .blocks import SwiGLU


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts in the transformers 5 fused layout: w_gate_up [E, 2F, D] (gate rows first),
    w_down [E, D, F]. The expert LoRA layer (engine/lora) wraps this module and passes its adapters in."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        return moe_mlp(x_TD, topk_ids, topk_weights, self.w_gate_up, self.w_down, lora=lora)


class MoEBlock(nn.Module):
    """Router -> top-k routed experts (+ shared expert). Returns the output and the Switch aux loss.

    Aux-loss-free balancing: `selection_bias` [E] shifts which experts are chosen (not their weights); the
    trainer calls `update_selection_bias()` after each optimizer step with the loads counted in forward.
    """

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.experts = GroupedExperts(spec.num_experts, hidden, spec.expert_intermediate_size)
        self.shared_expert = (
            SwiGLU(hidden, spec.shared_expert_intermediate_size) if spec.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden, 1, bias=False) if self.shared_expert is not None and spec.shared_expert_gate else None
        )
        self.register_buffer("selection_bias", torch.zeros(spec.num_experts))
        self.register_buffer("load_counts", torch.zeros(spec.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        logits_TE = self.gate(x_TD)
        bias = self.selection_bias if self.spec.bias_update_rate > 0 else None
        topk_ids, topk_weights, scores_TE = topk_route(
            logits_TE,
            self.spec.top_k,
            score_func=self.spec.score_func,
            renormalize=self.spec.renormalize,
            selection_bias=bias,
            routed_scaling=self.spec.routed_scaling,
        )
        if self.training:
            with torch.no_grad():
                self.load_counts += torch.bincount(topk_ids.flatten(), minlength=self.spec.num_experts).float()
        y_TD = self.experts(x_TD, topk_ids, topk_weights.to(x.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x_TD))
            y_TD = y_TD + shared
        if self.spec.aux_loss_coef > 0 and self.training:
            aux = switch_aux_loss(scores_TE, topk_ids, self.spec.num_experts)
        else:
            aux = logits_TE.new_zeros((), dtype=torch.float32)
        return y_TD.view(shape), aux

    @torch.no_grad()
    def update_selection_bias(self) -> None:
        """DeepSeek-V3's aux-loss-free rule: raise the bias of under-loaded experts, lower the over-loaded."""
        if self.spec.bias_update_rate > 0 and self.load_counts.sum() > 0:
            self.selection_bias += self.spec.bias_update_rate * torch.sign(self.load_counts.mean() - self.load_counts)
        self.load_counts.zero_()


class DenseMLP(SwiGLU):
    """A dense SwiGLU layer with the MoE layer's calling convention (output, aux loss)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x), x.new_zeros((), dtype=torch.float32)


def init_moe(module: nn.Module, std: float) -> None:
    if isinstance(module, GroupedExperts):
        nn.init.normal_(module.w_gate_up, std=std)
        nn.init.normal_(module.w_down, std=std)

