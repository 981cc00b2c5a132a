"""The MoE layer: router, routed SwiGLU experts stored as grouped tensors, optional gated shared expert.

Shapes: T tokens, D model dim, E experts, F expert hidden dim, k experts per token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_tune.engine.parallel.expert_parallel import ExpertLayout, dispatch_compute_combine
from moe_tune.ops.moe import ClampedSwiGLU, ExpertLoRA, moe_mlp, switch_aux_loss, topk_route
from moe_tune.profiles.schema import MoESpec

from .blocks import SwiGLU


def expert_generator(*key: int) -> torch.Generator:
    """A generator for one expert's random init: the same expert draws the same numbers on any layout."""
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + part) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class GroupedExperts(nn.Module):
    """The routed SwiGLU experts this rank holds, in the transformers 5 fused layout: w_gate_up [E_local, 2F, D]
    (gate rows first), w_down [E_local, D, F]; global expert `first_expert + i` is local expert i. gpt_oss's experts
    add biases b_gate_up [E_local, 2F] (gate first) and b_down [E_local, D] (`has_bias`) and take the clamped SwiGLU.
    The expert LoRA layer (engine/lora) wraps this module and passes its adapters in; the biases stay as they are."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        first_expert: int = 0,
        layer_index: int = 0,
        has_bias: bool = False,
        clamped_swiglu: ClampedSwiGLU | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.first_expert, self.layer_index = first_expert, layer_index
        self.has_bias, self.clamped_swiglu = has_bias, clamped_swiglu
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if has_bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, hidden)) if has_bias else None

    def rebuilt(self) -> GroupedExperts:
        """A fresh module of the same experts and options (the trainer rebuilds experts outside ZeRO-3's init)."""
        return GroupedExperts(self.num_experts, self.hidden, self.intermediate, self.first_expert, self.layer_index,
                              self.has_bias, self.clamped_swiglu)

    @torch.no_grad()
    def reset_parameters(self, std: float, seed: int) -> None:
        for i in range(self.num_experts):
            gen = expert_generator(seed, self.layer_index, self.first_expert + i)
            # Drawn in place (no temporaries: bench-qwen3-next builds in 34 s instead of 50 on 2 cores), the same
            # numbers as randn(...) * std.
            for weight in (self.w_gate_up.detach()[i], self.w_down.detach()[i]):
                torch.randn(weight.shape, generator=gen, out=weight).mul_(std)
        if self.has_bias:
            self.b_gate_up.zero_()
            self.b_down.zero_()

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        return moe_mlp(x_TD, topk_ids, topk_weights, self.w_gate_up, self.w_down, lora=lora, b_gate_up=self.b_gate_up,
                       b_down=self.b_down, clamped_swiglu=self.clamped_swiglu)


class MoEBlock(nn.Module):
    """Router -> top-k routed experts (+ shared expert). Returns the output and the Switch aux loss.

    Aux-loss-free balancing: `selection_bias` [E] shifts which experts are chosen (not their weights); the
    trainer calls `update_selection_bias()` after each optimizer step with the loads counted in forward.
    """

    def __init__(self, hidden: int, spec: MoESpec, layout: ExpertLayout | None = None, layer_index: int = 0):
        super().__init__()
        self.spec = spec
        self.layout = layout or ExpertLayout()
        local = self.layout.local_experts(spec.num_experts)
        self.gate = nn.Linear(hidden, spec.num_experts, bias=spec.router_bias)
        clamped = None
        if spec.expert_activation == "clamped_swiglu":
            clamped = ClampedSwiGLU(spec.swiglu_alpha, spec.swiglu_limit)
        self.experts = GroupedExperts(
            len(local), hidden, spec.expert_intermediate_size, first_expert=local.start, layer_index=layer_index,
            has_bias=spec.expert_bias, clamped_swiglu=clamped,
        )
        self.shared_expert = (
            SwiGLU(hidden, spec.shared_expert_intermediate_size) if spec.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden, 1, bias=False) if self.shared_expert is not None and spec.shared_expert_gate else None
        )
        self.register_buffer("selection_bias", torch.zeros(spec.num_experts))
        self.register_buffer("load_counts", torch.zeros(spec.num_experts), persistent=False)
        self.register_buffer("dropped_slots", torch.zeros(()), persistent=False)
        # Set by `moe-tune align --pin-routing`: the experts to use for the next forward [T, k] (the reference's
        # choice); the weights still come from our own router scores at those experts.
        self.pinned_topk_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        logits_TE, topk_ids, topk_weights, scores_TE = self._route(x_TD)
        if self.spec.capacity_factor > 0:
            topk_weights = self._drop_over_capacity(topk_ids, topk_weights)
        if self.training:
            with torch.no_grad():
                # Not bincount: on a GPU it waits for the device to size its output. Adding ones is exact.
                ids = topk_ids.flatten()
                self.load_counts.index_add_(0, ids, torch.ones_like(ids, dtype=self.load_counts.dtype))
        y_TD = self._experts_and_shared(x_TD, topk_ids, topk_weights)
        if self.spec.aux_loss_coef > 0 and self.training:
            aux = switch_aux_loss(scores_TE, topk_ids, self.spec.num_experts)
        else:
            aux = logits_TE.new_zeros((), dtype=torch.float32)
        return y_TD.view(shape), aux

    def forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        """The output alone, as the exported model computes it: every token gets its top-k experts whatever other
        tokens run with it (no capacity limit: it only steers training, and transformers' models have none); no
        load counts, no aux loss."""
        x_TD = x.reshape(-1, x.shape[-1])
        _, topk_ids, topk_weights, _ = self._route(x_TD)
        return self._experts_and_shared(x_TD, topk_ids, topk_weights).view(x.shape)

    def _route(self, x_TD: torch.Tensor):
        """Router logits [T, E], chosen experts [T, k], their weights [T, k] and the scores [T, E]."""
        logits_TE = self.gate(x_TD)
        bias = self.selection_bias if self.spec.bias_update_rate > 0 or self.spec.has_selection_bias else None
        topk_ids, topk_weights, scores_TE = topk_route(
            logits_TE,
            self.spec.top_k,
            score_func=self.spec.score_func,
            renormalize=self.spec.renormalize,
            selection_bias=bias,
            routed_scaling=self.spec.routed_scaling,
            pinned_ids=self.pinned_topk_ids,
            n_group=self.spec.n_group,
            topk_group=self.spec.topk_group,
        )
        return logits_TE, topk_ids, topk_weights, scores_TE

    def _experts_and_shared(self, x_TD, topk_ids, topk_weights) -> torch.Tensor:
        """The routed experts' weighted sum plus the (gated) shared expert: [T, D]."""
        if self.layout.ep_size == 1:
            y_TD = self.experts(x_TD, topk_ids, topk_weights.to(x_TD.dtype))
        else:
            y_TD = dispatch_compute_combine(
                x_TD, topk_ids, topk_weights, self.experts, self.spec.num_experts, self.layout
            )
        if self.shared_expert is not None:
            shared = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x_TD))
            y_TD = y_TD + shared
        return y_TD

    def _drop_over_capacity(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Zero the weights of token-slots past each expert's capacity (in token order, so the latest tokens drop
        first): they leave the output, as in GShard/Switch. The dropped count accumulates in `dropped_slots`."""
        num_slots = topk_ids.numel()
        capacity = math.ceil(self.spec.capacity_factor * num_slots / self.spec.num_experts)
        one_hot = torch.nn.functional.one_hot(topk_ids.reshape(-1), self.spec.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # [S] arrival order within the slot's expert
        kept = (position < capacity).view_as(topk_weights)
        if self.training:
            self.dropped_slots += (~kept).sum().float()
        return topk_weights * kept

    @torch.no_grad()
    def update_selection_bias(self) -> None:
        """DeepSeek-V3's aux-loss-free rule: raise the bias of under-loaded experts, lower the over-loaded."""
        # No loads counted: mean - counts is 0 everywhere and the bias stays (no test on the host, which would wait
        # for the GPU).
        if self.spec.bias_update_rate > 0:
            self.selection_bias += self.spec.bias_update_rate * torch.sign(self.load_counts.mean() - self.load_counts)
        self.load_counts.zero_()


class DenseMLP(SwiGLU):
    """A dense SwiGLU layer with the MoE layer's calling convention (output, aux loss)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x), x.new_zeros((), dtype=torch.float32)

    def forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def channel_mixer(cfg, spec, layout: ExpertLayout | None, index: int) -> tuple[nn.Module, float]:
    """A decoder layer's channel mixer as its LayerSpec says (routed experts or a dense SwiGLU), and the weight of
    its aux loss."""
    if spec.mlp == "moe":
        assert cfg.moe is not None, "the schema requires model.moe for moe layers"
        return MoEBlock(cfg.hidden_size, cfg.moe, layout, layer_index=index), cfg.moe.aux_loss_coef
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size), 0.0


def init_moe(module: nn.Module, std: float, seed: int) -> None:
    if isinstance(module, GroupedExperts):
        module.reset_parameters(std, seed)

