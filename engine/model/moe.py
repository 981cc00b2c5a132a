"""The MoE layer: router, routed SwiGLU experts stored as grouped tensors, optional gated shared expert.

Shapes: T tokens, D model dim, E experts, F expert hidden dim, k experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from moe_tune.engine.parallel.expert_parallel import ExpertLayout, dispatch_compute_combine
from moe_tune.ops.fp8 import FP8_DTYPE, dequantize_weight, num_blocks
from moe_tune.ops.moe import AddTo, ClampedSwiGLU, ExpertLoRA, addends_of, moe_mlp, switch_aux_loss, topk_route
from moe_tune.ops.moe.reference import SIGMOID_NORM_EPS
from moe_tune.profiles.schema import MoESpec

from .blocks import FP32_ONE_BITS, SwiGLU, quantize_blocks, recomputed, saved_as_parameters, sequence_chunks
from .projections import SharedInputProjections


def expert_generator(*key: int, device: torch.device | None = None) -> torch.Generator:
    """A generator for one expert's random init: the same expert draws the same numbers on any layout (of the same
    device type: a CUDA generator draws other numbers than the CPU's). `device`: a CUDA device, or None (the CPU)."""
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + part) % (2**63 - 1)
    return torch.Generator(device=device if device is not None else "cpu").manual_seed(seed)


class GroupedExperts(nn.Module):
    """The routed SwiGLU experts this rank holds, in the transformers 5 fused layout: w_gate_up [E_local, 2F, D]
    (gate rows first), w_down [E_local, D, F]; global expert `first_expert + i` is local expert i. gpt_oss's experts
    add biases b_gate_up [E_local, 2F] (gate first) and b_down [E_local, D] (`has_bias`) and take the clamped SwiGLU.
    The expert LoRA layer (engine/lora) wraps this module and passes its adapters in; the biases stay as they are.

    `fp8` (model.base_precision fp8): the weights are frozen FP8 e4m3 in 128 x 128 blocks, stored as bits so that
    no mixed-precision cast touches them: w_gate_up uint8 [E_local, 2F, D] with w_gate_up_scale_inv int32
    [E_local, 2*ceil(F/128), ceil(D/128)] (gate and up rows scaled apart), w_down uint8 [E_local, D, F] with
    w_down_scale_inv int32 [E_local, ceil(D/128), ceil(F/128)] (the bits of the fp32 scales); fp8_tensors() views
    them as float8_e4m3fn and fp32."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        first_expert: int = 0,
        layer_index: int = 0,
        has_bias: bool = False,
        clamped_swiglu: ClampedSwiGLU | None = None,
        fp8: bool = False,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.first_expert, self.layer_index = first_expert, layer_index
        self.has_bias, self.clamped_swiglu, self.fp8 = has_bias, clamped_swiglu, fp8
        if fp8:
            bits, frozen = {"dtype": torch.uint8}, {"requires_grad": False}
            scale_rows = num_blocks(2 * intermediate, (intermediate, intermediate))
            self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **bits), **frozen)
            self.w_gate_up_scale_inv = nn.Parameter(
                _unit_scale_bits(num_experts, scale_rows, num_blocks(hidden)), **frozen
            )
            self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **bits), **frozen)
            self.w_down_scale_inv = nn.Parameter(
                _unit_scale_bits(num_experts, num_blocks(hidden), num_blocks(intermediate)), **frozen
            )
        else:
            self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
            self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if has_bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, hidden)) if has_bias else None

    def rebuilt(self) -> GroupedExperts:
        """A fresh module of the same experts and options (the trainer rebuilds experts outside ZeRO-3's init)."""
        return GroupedExperts(self.num_experts, self.hidden, self.intermediate, self.first_expert, self.layer_index,
                              self.has_bias, self.clamped_swiglu, self.fp8)

    def fp8_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 experts: (w_gate_up float8_e4m3fn, its scale_inv fp32, w_down float8_e4m3fn, its scale_inv fp32),
        views of the parameters' bits."""
        assert self.fp8, "fp8_tensors: these experts are not FP8"
        return (self.w_gate_up.view(FP8_DTYPE), self.w_gate_up_scale_inv.view(torch.float32),
                self.w_down.view(FP8_DTYPE), self.w_down_scale_inv.view(torch.float32))  # fmt: skip

    @property
    def gate_up_segments(self) -> tuple[int, int]:
        """w_gate_up's row segments: the gate and up halves get their own scale rows."""
        return (self.intermediate, self.intermediate)

    @torch.no_grad()
    def set_quantized_expert(self, index: int, gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
                             down: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
        """Store local expert `index`'s (W_q float8_e4m3fn, scale_inv fp32) pairs: gate_up [2F, D] with
        [2*ceil(F/128), ceil(D/128)], down [D, F] with [ceil(D/128), ceil(F/128)]."""
        assert self.fp8, "set_quantized_expert: these experts are not FP8"
        for pair, weight, scale in ((gate_up, self.w_gate_up, self.w_gate_up_scale_inv),
                                    (down, self.w_down, self.w_down_scale_inv)):  # fmt: skip
            if pair is None:
                continue
            w_q, scale_inv = pair
            if w_q.dtype != FP8_DTYPE or w_q.shape != weight.shape[1:] or scale_inv.shape != scale.shape[1:]:
                raise ValueError(f"expert weights: shape {tuple(w_q.shape)} dtype {w_q.dtype} with scales "
                                 f"{tuple(scale_inv.shape)} must be {list(weight.shape[1:])} {FP8_DTYPE} with "
                                 f"{list(scale.shape[1:])}")  # fmt: skip
            weight[index].copy_(w_q.view(torch.uint8))
            scale[index].copy_(scale_inv.float().contiguous().view(torch.int32))

    def dequantized_twin(self) -> GroupedExperts:
        """The same experts with float weights (fp32): FP8 experts dequantized, biases copied."""
        twin = GroupedExperts(self.num_experts, self.hidden, self.intermediate, self.first_expert, self.layer_index,
                              self.has_bias, self.clamped_swiglu)  # fmt: skip
        with torch.no_grad():
            w_gate_up, gate_up_scale, w_down, down_scale = self.fp8_tensors()
            twin.w_gate_up.copy_(dequantize_weight(w_gate_up, gate_up_scale, self.gate_up_segments))
            twin.w_down.copy_(dequantize_weight(w_down, down_scale))
            if self.has_bias:
                twin.b_gate_up.copy_(self.b_gate_up)
                twin.b_down.copy_(self.b_down)
        return twin

    @torch.no_grad()
    def reset_parameters(self, std: float, seed: int) -> None:
        # Drawn where the experts live: a model built on the GPU (moe-tune profile) draws there, in a fraction of the
        # time the CPU takes at 30B-80B parameters.
        device = self.w_gate_up.device if self.w_gate_up.is_cuda else None
        for i in range(self.num_experts):
            gen = expert_generator(seed, self.layer_index, self.first_expert + i, device=device)
            if self.fp8:
                # The numbers of the float init, one expert's tensor at a time, quantized as drawn.
                gate_up = torch.randn(self.w_gate_up.shape[1:], generator=gen, device=device).mul_(std)
                gate_up_pair = quantize_blocks(gate_up, self.gate_up_segments)
                del gate_up
                down = torch.randn(self.w_down.shape[1:], generator=gen, device=device).mul_(std)
                self.set_quantized_expert(i, gate_up_pair, quantize_blocks(down))
                continue
            # Drawn in place (no temporaries: bench-qwen3-next builds in 34 s instead of 50 on 2 cores), the same
            # numbers as randn(...) * std.
            for weight in (self.w_gate_up.detach()[i], self.w_down.detach()[i]):
                if weight.dtype == torch.float32:
                    torch.randn(weight.shape, generator=gen, out=weight).mul_(std)
                else:
                    # Built in bf16: the fp32 draws rounded once, the numbers an FP8 base quantizes.
                    weight.copy_(torch.randn(weight.shape, generator=gen, device=device).mul_(std))
        if self.has_bias:
            self.b_gate_up.zero_()
            self.b_down.zero_()

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
        add_to: AddTo = None,
    ) -> torch.Tensor:
        """moe_mlp of the experts' weights (add_to, one tensor or two: added inside the experts' sum over each token's
        slots)."""
        if self.fp8:
            w_gate_up, gate_up_scale_inv, w_down, down_scale_inv = self.fp8_tensors()
            # The kernels save the weights' float8 views: kept as the parameters (ZeRO-3 regathers them for backward;
            # engine/memory never takes them for activations).
            with saved_as_parameters(self.w_gate_up, self.w_gate_up_scale_inv, self.w_down, self.w_down_scale_inv):
                return moe_mlp(x_TD, topk_ids, topk_weights, w_gate_up, w_down, lora=lora, b_gate_up=self.b_gate_up,
                               b_down=self.b_down, clamped_swiglu=self.clamped_swiglu,
                               gate_up_scale_inv=gate_up_scale_inv, down_scale_inv=down_scale_inv,
                               add_to=add_to)  # fmt: skip
        return moe_mlp(x_TD, topk_ids, topk_weights, self.w_gate_up, self.w_down, lora=lora, b_gate_up=self.b_gate_up,
                       b_down=self.b_down, clamped_swiglu=self.clamped_swiglu, add_to=add_to)


def _unit_scale_bits(*shape: int) -> torch.Tensor:
    """int32 [*shape]: the bits of fp32 ones (unit scales until the init or a checkpoint writes them)."""
    return torch.full(shape, FP32_ONE_BITS, dtype=torch.int32)


class RowChunk(NamedTuple):
    """Where a chunk of tokens sits in its packed row (memory.sequence_chunk_tokens): the MoE block routes it as a part
    of the whole row."""

    start: int  # the chunk's first token in the row
    row_tokens: int  # T, tokens of the whole row
    slots_before_E: torch.Tensor  # [E] int64: token-slots the row's earlier chunks routed to each expert


class ChunkRouting(NamedTuple):
    """What routing one chunk adds to its row's statistics; MoEBlock.finish_row sums them."""

    counts_E: torch.Tensor  # [E] int64: token-slots routed to each expert (capacity drops included)
    dropped: torch.Tensor  # [] fp32: token-slots dropped over capacity
    # [E] fp32: the sum over the chunk's tokens of the normalised router scores (the aux loss's P_e before the mean);
    # None when no aux loss is computed.
    prob_sum_E: torch.Tensor | None


class MoEBlock(nn.Module):
    """Router -> top-k routed experts (+ shared expert). Returns the output and the Switch aux loss.

    Aux-loss-free balancing: `selection_bias` [E] shifts which experts are chosen (not their weights); the
    trainer calls `update_selection_bias()` after each optimizer step with the loads counted in forward.

    `sequence_chunk_tokens` (memory.sequence_chunk_tokens; None: off): a row longer than this runs chunk by chunk,
    each chunk recomputed in backward (channel_mixer_in_chunks), with the load counts, capacity order and aux loss
    of the whole row.
    """

    def __init__(
        self, hidden: int, spec: MoESpec, layout: ExpertLayout | None = None, layer_index: int = 0, fp8: bool = False
    ):
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
            has_bias=spec.expert_bias, clamped_swiglu=clamped, fp8=fp8,
        )
        self.shared_expert = (
            SwiGLU(hidden, spec.shared_expert_intermediate_size) if spec.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden, 1, bias=False) if self.shared_expert is not None and spec.shared_expert_gate else None
        )
        # The router's and the shared expert gate's projections of the input, one node where
        # engine/model/projections allows it.
        self.shared_input_projections = ("gate", "shared_expert_gate") if self.shared_expert_gate is not None else ()
        self.register_buffer("selection_bias", torch.zeros(spec.num_experts))
        self.register_buffer("load_counts", torch.zeros(spec.num_experts), persistent=False)
        self.register_buffer("dropped_slots", torch.zeros(()), persistent=False)
        # Set by `moe-tune align --pin-routing`: the experts to use for the next forward [T, k] (the reference's
        # choice); the weights still come from our own router scores at those experts.
        self.pinned_topk_ids: torch.Tensor | None = None
        self.sequence_chunk_tokens: int | None = None

    def input_buffers(self, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where the block's next input x and residual, of `like`'s shape, dtype and device, may be written by the op
        that makes them: a CUDA-graphed block's static inputs (engine/train/graphs.py sets this method on the
        block), which its replay then reads with no copy; (None, None) here: no such place."""
        return None, None

    def forward(self, x: torch.Tensor, chunk: RowChunk | None = None, residual: torch.Tensor | None = None):
        """x [1, T, D] -> (y [1, T, D], aux loss []); with `residual` [1, T, D], y + residual, added inside the ops
        that make y (the decoder layer's residual add). With `chunk` (no residual), x is that chunk of a row:
        -> (y, ChunkRouting), and no buffer is written (the chunk is recomputed in backward; finish_row counts the
        row once)."""
        if chunk is not None:
            assert residual is None, "a chunk of a row is routed without its residual"
            return self._forward_chunk(x, chunk)
        if self.sequence_chunk_tokens is not None and x.shape[1] > self.sequence_chunk_tokens:
            y, aux = channel_mixer_in_chunks(self, apply_mixer, x, self.sequence_chunk_tokens)
            return (y if residual is None else y + residual), aux
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        gates = self._gate_projections(x_TD)
        logits_TE, topk_ids, topk_weights, scores_TE = self._route(x_TD, gates)
        if self.spec.capacity_factor > 0:
            topk_weights = self._drop_over_capacity(topk_ids, topk_weights)
        if self.training:
            with torch.no_grad():
                # Not bincount: on a GPU it waits for the device to size its output. Adding ones is exact.
                ids = topk_ids.flatten()
                self.load_counts.index_add_(0, ids, torch.ones_like(ids, dtype=self.load_counts.dtype))
        residual_TD = None if residual is None else residual.reshape(x_TD.shape)
        y_TD = self._experts_and_shared(topk_ids, topk_weights, gates, residual_TD)
        if self.spec.aux_loss_coef > 0 and self.training:
            aux = switch_aux_loss(scores_TE, topk_ids, self.spec.num_experts)
        else:
            aux = logits_TE.new_zeros((), dtype=torch.float32)
        return y_TD.view(shape), aux

    def _forward_chunk(self, x: torch.Tensor, chunk: RowChunk) -> tuple[torch.Tensor, ChunkRouting]:
        """One chunk of a row: routed as in the whole row (pinned ids sliced, capacity positions continuing from the
        row's earlier chunks), its statistics returned instead of counted."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        pinned = self.pinned_topk_ids
        if pinned is not None:
            pinned = pinned[chunk.start : chunk.start + x_TD.shape[0]]
        gates = self._gate_projections(x_TD)
        logits_TE, topk_ids, topk_weights, scores_TE = self._route(x_TD, gates, pinned)
        dropped = x_TD.new_zeros((), dtype=torch.float32)
        if self.spec.capacity_factor > 0:
            kept = self._kept_under_capacity(topk_ids, chunk.row_tokens * self.spec.top_k, chunk.slots_before_E)
            dropped = (~kept).sum().float()
            topk_weights = topk_weights * kept
        with torch.no_grad():
            ids = topk_ids.flatten()
            counts_E = torch.zeros(self.spec.num_experts, dtype=torch.long, device=ids.device)
            counts_E.index_add_(0, ids, torch.ones_like(ids))
        prob_sum_E = None
        if self.spec.aux_loss_coef > 0 and self.training:
            # switch_aux_loss's per-token normalisation; the row's mean and its f_e come in finish_row.
            scores_TE = scores_TE.float()
            prob_sum_E = (scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)).sum(dim=0)
        y_TD = self._experts_and_shared(topk_ids, topk_weights, gates)
        return y_TD.view(shape), ChunkRouting(counts_E, dropped, prob_sum_E)

    def finish_row(self, routings: list[ChunkRouting], row_tokens: int) -> torch.Tensor:
        """After the last chunk of a row: count its loads and drops (training), and return the Switch aux loss of the
        whole row (switch_aux_loss over all T tokens: f_e from the row's counts, P_e the mean over the row)."""
        counts_E = torch.stack([r.counts_E for r in routings]).sum(dim=0)
        if self.training:
            with torch.no_grad():
                self.load_counts += counts_E.to(self.load_counts.dtype)
                if self.spec.capacity_factor > 0:
                    self.dropped_slots += torch.stack([r.dropped for r in routings]).sum()
        if self.spec.aux_loss_coef > 0 and self.training:
            fraction_E = counts_E.float() / (row_tokens * self.spec.top_k)
            mean_prob_E = torch.stack([r.prob_sum_E for r in routings]).sum(dim=0) / row_tokens
            return self.spec.num_experts * (fraction_E * mean_prob_E).sum()
        return counts_E.new_zeros((), dtype=torch.float32)

    def forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        """The output alone, as the exported model computes it: every token gets its top-k experts whatever other
        tokens run with it (no capacity limit: it only steers training, and transformers' models have none); no
        load counts, no aux loss."""
        x_TD = x.reshape(-1, x.shape[-1])
        gates = self._gate_projections(x_TD)
        _, topk_ids, topk_weights, _ = self._route(x_TD, gates)
        return self._experts_and_shared(topk_ids, topk_weights, gates).view(x.shape)

    def _gate_projections(self, x_TD: torch.Tensor) -> SharedInputProjections:
        """The router's logits [T, E] and the shared expert's gate logit [T, 1] (with one) as one node where
        engine/model/projections allows it, which hands x_TD on to the experts (`.x`): their gradient of it is added
        inside the node's backward GEMMs."""
        modules = [self.gate] if self.shared_expert_gate is None else [self.gate, self.shared_expert_gate]
        return SharedInputProjections(x_TD, modules, hand_on=True)

    def _route(self, x_TD: torch.Tensor, gates: SharedInputProjections, pinned_ids: torch.Tensor | None = None):
        """Router logits [T, E], chosen experts [T, k], their weights [T, k] and the scores [T, E]. gates:
        _gate_projections(x_TD); pinned_ids: the experts to use [T, k]; default the block's pinned_topk_ids."""
        (logits_TE,) = gates.of(self.gate)
        bias = self.selection_bias if self.spec.bias_update_rate > 0 or self.spec.has_selection_bias else None
        topk_ids, topk_weights, scores_TE = topk_route(
            logits_TE,
            self.spec.top_k,
            score_func=self.spec.score_func,
            renormalize=self.spec.renormalize,
            selection_bias=bias,
            routed_scaling=self.spec.routed_scaling,
            pinned_ids=self.pinned_topk_ids if pinned_ids is None else pinned_ids,
            n_group=self.spec.n_group,
            topk_group=self.spec.topk_group,
        )
        return logits_TE, topk_ids, topk_weights, scores_TE

    def _experts_and_shared(
        self, topk_ids, topk_weights, gates: SharedInputProjections, residual_TD: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' weighted sum plus the (gated) shared expert of the input [T, D] that `gates` hands on,
        plus residual_TD [T, D] where given: [T, D]. The gate scales the shared expert's hidden rows [T, F] before its
        down projection: sigmoid(g) (h W_down^T) = (sigmoid(g) h) W_down^T, on F < D columns.

        The shared expert runs first, and its gate and up projections' node hands the input on again to the routed
        experts, which add the shared expert's output and the residual inside their sum over each token's slots
        (moe_mlp's add_to; without a shared expert the residual alone): the output needs no add kernel, and every
        use's gradient of the input is summed inside the two nodes' backward GEMMs. Across an expert-parallel group
        the routed experts run first and the shared expert's down projection adds their sum (and the residual, added
        to it) inside its GEMM."""
        x_TD = gates.x
        mlp = self.shared_expert
        if mlp is None:
            return self._routed_experts(x_TD, topk_ids, topk_weights, add_to=residual_TD)
        scale_T1 = torch.sigmoid(gates.of(self.shared_expert_gate)[0]) if self.shared_expert_gate is not None else None
        if self.layout.expert_parallel > 1:
            return mlp(x_TD, scale=scale_T1, add_to=self._routed_experts(x_TD, topk_ids, topk_weights, residual_TD))
        shared_TD, x_TD = mlp(x_TD, scale=scale_T1, hand_on=True)
        addends = shared_TD if residual_TD is None else (shared_TD, residual_TD)
        return self._routed_experts(x_TD, topk_ids, topk_weights, add_to=addends)

    def _routed_experts(self, x_TD: torch.Tensor, topk_ids, topk_weights, add_to: AddTo = None) -> torch.Tensor:
        """The routed experts' weighted sum [T, D] of x_TD [T, D], plus add_to (one [T, D] tensor or two) where given:
        local (add_to inside their slot sum), or across the expert-parallel group (added after the combine)."""
        if self.layout.expert_parallel == 1:
            return self.experts(x_TD, topk_ids, topk_weights.to(x_TD.dtype), add_to=add_to)
        y_TD = dispatch_compute_combine(x_TD, topk_ids, topk_weights, self.experts, self.spec.num_experts, self.layout)
        for addend in addends_of(add_to):
            y_TD = y_TD + addend
        return y_TD

    def _drop_over_capacity(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Zero the weights of token-slots past each expert's capacity (in token order, so the latest tokens drop
        first): they leave the output, as in GShard/Switch. The dropped count accumulates in `dropped_slots`."""
        kept = self._kept_under_capacity(topk_ids, topk_ids.numel())
        if self.training:
            self.dropped_slots += (~kept).sum().float()
        return topk_weights * kept

    def _kept_under_capacity(
        self, topk_ids: torch.Tensor, num_slots: int, slots_before_E: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, k] bool: the token-slots within their expert's capacity ceil(capacity_factor * num_slots / E), in
        arrival order after slots_before_E [E] earlier slots of the row (None: none)."""
        capacity = math.ceil(self.spec.capacity_factor * num_slots / self.spec.num_experts)
        flat_ids = topk_ids.reshape(-1)
        one_hot = torch.nn.functional.one_hot(flat_ids, self.spec.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # [S] arrival order within the slot's expert
        if slots_before_E is not None:
            position = position + slots_before_E.index_select(0, flat_ids)
        return (position < capacity).view_as(topk_ids)

    @torch.no_grad()
    def update_selection_bias(self) -> None:
        """DeepSeek-V3's aux-loss-free rule: raise the bias of under-loaded experts, lower the over-loaded."""
        # No loads counted: mean - counts is 0 everywhere and the bias stays (no test on the host, which would wait
        # for the GPU).
        if self.spec.bias_update_rate > 0:
            self.selection_bias += self.spec.bias_update_rate * torch.sign(self.load_counts.mean() - self.load_counts)
        self.load_counts.zero_()


class DenseMLP(SwiGLU):
    """A dense SwiGLU layer with the MoE layer's calling convention (output, aux loss); `sequence_chunk_tokens` as
    MoEBlock's."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.sequence_chunk_tokens: int | None = None

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, D] -> (y [1, T, D], zero aux loss); with `residual`, y + residual, added inside the down
        projection's GEMM (the decoder layer's residual add)."""
        if self.sequence_chunk_tokens is not None and x.shape[1] > self.sequence_chunk_tokens:
            y, aux = channel_mixer_in_chunks(self, apply_mixer, x, self.sequence_chunk_tokens)
            return (y if residual is None else y + residual), aux
        return super().forward(x, add_to=residual), x.new_zeros((), dtype=torch.float32)

    def forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def apply_mixer(x: torch.Tensor, mlp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The channel mixer alone: a `mix` for channel_mixer_in_chunks whose output is mlp(x)."""
    return mlp(x)


def channel_mixer_in_chunks(
    mixer: nn.Module,
    mix: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor],
    x: torch.Tensor,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token part of a decoder layer over x [1, T, W], chunk_tokens tokens at a time.

    mix(x_c, mlp) -> [1, C, W']: the part on chunk x_c [1, C, W] (e.g. x_c + mlp(norm(x_c))), calling mlp(h) -> y
    once, where mlp runs `mixer` (a MoEBlock or a DenseMLP) on h [1, C, D]. Each chunk runs under activation
    checkpoint (blocks.recomputed): forward keeps its input rows and its routing statistics, backward recomputes one
    chunk at a time, so no [T, k D], [T, 2F] or [T, E] intermediate exists. A MoE block routes every chunk as a part of
    the row: capacity positions continue across chunks, and its load counts, dropped slots and aux loss are the whole
    row's (MoEBlock.finish_row). Every rank of an expert-parallel group runs the same chunks (its rows have
    data.seq_len tokens on every rank), so the all-to-alls of a chunk pair up.
    Returns (the parts concatenated [1, T, W'], the mixer's unweighted aux loss [] fp32).
    """
    num_tokens = x.shape[1]
    chunks = sequence_chunks(num_tokens, chunk_tokens)
    if not isinstance(mixer, MoEBlock):
        parts = [recomputed(_dense_chunk, mix, mixer, x[:, start:end]) for start, end in chunks]
        return torch.cat(parts, dim=1), x.new_zeros((), dtype=torch.float32)
    slots_before_E = torch.zeros(mixer.spec.num_experts, dtype=torch.long, device=x.device)
    parts, routings = [], []
    for start, end in chunks:
        part, routing = recomputed(_moe_chunk, mix, mixer, x[:, start:end], slots_before_E, start, num_tokens,
                                   is_collective=mixer.layout.expert_parallel > 1)  # fmt: skip
        slots_before_E = slots_before_E + routing.counts_E
        parts.append(part)
        routings.append(routing)
    return torch.cat(parts, dim=1), mixer.finish_row(routings, num_tokens)


def _dense_chunk(mix, mixer: nn.Module, x_c: torch.Tensor) -> torch.Tensor:
    return mix(x_c, lambda h: mixer(h)[0])


def _moe_chunk(mix, mixer: MoEBlock, x_c: torch.Tensor, slots_before_E: torch.Tensor, start: int, row_tokens: int):
    routing = []

    def mlp(h: torch.Tensor) -> torch.Tensor:
        y, chunk_routing = mixer(h, chunk=RowChunk(start, row_tokens, slots_before_E))
        routing.append(chunk_routing)
        return y

    return mix(x_c, mlp), routing[0]


def channel_mixer(cfg, spec, layout: ExpertLayout | None, index: int) -> tuple[nn.Module, float]:
    """A decoder layer's channel mixer as its LayerSpec says (routed experts or a dense SwiGLU), and the weight of
    its aux loss."""
    if spec.mlp == "moe":
        assert cfg.moe is not None, "the schema requires model.moe for moe layers"
        fp8 = cfg.base_precision == "fp8"
        return MoEBlock(cfg.hidden_size, cfg.moe, layout, layer_index=index, fp8=fp8), cfg.moe.aux_loss_coef
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size), 0.0


def init_moe(module: nn.Module, std: float, seed: int) -> None:
    if isinstance(module, GroupedExperts):
        module.reset_parameters(std, seed)

