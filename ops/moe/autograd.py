"""Autograd wiring of the MoE expert MLP kernels (forward: kernels_fwd.py, backward: kernels_bwd.py).

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token, r LoRA rank, S = N*k token-slots.

Saved for backward: the inputs themselves (no copies), the routing metadata (five int32 vectors), the gate/up
pre-activations [S, 2F] and, with LoRA, the rank products x A^T and h A^T [S, r] in fp32.
Recomputed: h = silu(gate) * up, in the first backward kernel, which loads gate and up anyway; keeping h [S, F]
alive from forward to backward would cost a third more activation memory to save one elementwise pass.

Backward order with LoRA on both projections: the down adapter's pass over dy (dy B_down per row, dB_down), the down
backward (dgate_up, d topk_weights, w * h), dA_down = sum (s dy B_down)^T (w h) from a thin pass over w * h, the
gate_up adapter's pass over dgate_up (dgate_up B_gate_up per row, dB_gate_up), dx, then
dA_gate_up = sum (s dgate_up B_gate_up)^T x. dA_down from the down backward's epilogue instead (no w * h written)
needs 255 registers a thread and makes the LoRA fwd+bwd 0.3-0.6 ms slower at issue 7's shapes on the H200
(docs/perf-history.md, MoE).

FP8 expert weights (float8_e4m3fn with 128 x 128 block scales) are frozen (moe_mlp refuses them with requires_grad),
so no weight gradient is computed for them. Each GEMM through them gets a dequantized buffer of its projection's
experts where fp8_weights.buffers_weights allows (made before the GEMM, freed after it; only the FP8 codes are
saved), else the same kernels dequantize each weight tile as they load it.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe_tune.ops.common.grad_handoff import handoff_of, lodge
from moe_tune.ops.moe import fp8_weights
from moe_tune.ops.moe.kernel_config import pick_config
from moe_tune.ops.moe.kernels_bwd import moe_down_bwd, moe_expert_grad, moe_gate_up_bwd, moe_lora_bwd
from moe_tune.ops.moe.kernels_fwd import moe_down_fwd, moe_gate_up_fwd, moe_lora_rows
from moe_tune.ops.moe.routing import MoERouting, moe_routing, row_chunks

# Positions in MoEFunction.forward's arguments, for ctx.needs_input_grad.
_X, _IDS, _WEIGHTS, _W_GATE_UP, _W_DOWN, _A_GATE_UP, _B_GATE_UP, _A_DOWN, _B_DOWN = range(9)
# add_to's one or two tensors.
_ADD_TO = (12, 13)


class MoEFunction(torch.autograd.Function):
    """y = moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, lora, gate_up_scale_inv=, down_scale_inv=, add_to=) on
    the Triton kernels.

    Arguments as moe_mlp, with the LoRA tensors passed one by one (each may be None), scaling a float, then the block
    scales of FP8 expert weights (both None for 16-bit/fp32 weights) and add_to's two places (None: none; the first
    filled first).
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        a_gate_up: torch.Tensor | None,
        b_gate_up: torch.Tensor | None,
        a_down: torch.Tensor | None,
        b_down: torch.Tensor | None,
        scaling: float,
        gate_up_scale_inv: torch.Tensor | None = None,
        down_scale_inv: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
        add_to_2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        num_experts = w_gate_up.shape[0]
        buffered = gate_up_scale_inv is not None and fp8_weights.buffers_weights(
            w_gate_up, w_down, x.dtype, num_tokens * top_k
        )
        fp8_codes = gate_up_scale_inv is not None and not buffered
        config = pick_config(x, num_tokens * top_k, num_experts, fp8_codes=fp8_codes)
        routing = moe_routing(topk_ids, num_experts, config.block_m)
        needs_grad = any(ctx.needs_input_grad)
        weight, scale = _gemm_weight(w_gate_up, gate_up_scale_inv, buffered, x.dtype)
        h, gate_up, xa = moe_gate_up_fwd(
            x, weight, a_gate_up, b_gate_up, scaling, routing, config, save_gate_up=needs_grad, scale_inv=scale
        )
        del weight  # a buffered projection's dequantized experts go before the next one's are made
        weight, scale = _gemm_weight(w_down, down_scale_inv, buffered, x.dtype)
        y, ha = moe_down_fwd(
            h, topk_weights, weight, a_down, b_down, scaling, routing, config, num_tokens, scale_inv=scale,
            addends=tuple(t.contiguous() for t in (add_to, add_to_2) if t is not None),
        )
        del weight
        if needs_grad:
            ctx.save_for_backward(
                x, topk_weights, w_gate_up, w_down, a_gate_up, b_gate_up, a_down, b_down, gate_up, xa, ha,
                gate_up_scale_inv, down_scale_inv, *routing.tensors(),
            )  # fmt: skip
        ctx.scaling, ctx.config, ctx.block_m, ctx.top_k = scaling, config, routing.block_m, top_k
        ctx.buffered = buffered
        # x handed on by the node before (the shared expert's gate and up): x's gradient, made here, is lodged for
        # that node to add its own parts to in place (ops/common/grad_handoff.py).
        ctx.input_handoff = handoff_of(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        (x, topk_weights, w_gate_up, w_down, a_gate_up, b_gate_up, a_down, b_down, gate_up, xa, ha,
         gate_up_scale_inv, down_scale_inv, *meta) = ctx.saved_tensors  # fmt: skip
        routing = MoERouting(*meta, block_m=ctx.block_m, top_k=ctx.top_k)
        needs = ctx.needs_input_grad
        assert not (needs[_W_GATE_UP] and gate_up_scale_inv is not None), "FP8 expert weights are frozen"
        assert not (needs[_W_DOWN] and down_scale_inv is not None), "FP8 expert weights are frozen"
        scaling, config = ctx.scaling, ctx.config
        num_tokens = x.shape[0]
        dy = dy.to(x.dtype)
        has_lora = a_gate_up is not None or a_down is not None
        # The row chunks of the passes that sum each expert's rows into a LoRA-sized output (dB, dA), built once.
        chunks = row_chunks(routing, config) if has_lora else None

        # d(h A_down^T) / w per row, the down backward's LoRA term, and dB_down from the same read of dy.
        dha = d_b_down = None
        if a_down is not None:
            dha, d_b_down = moe_lora_bwd(
                dy, b_down, ha, scaling, routing, config, compute_gb=True, compute_db=needs[_B_DOWN],
                g_by_token=True, g_weights=topk_weights, chunks=chunks,
            )  # fmt: skip
        # h_weighted = w * h per row: the routing weight of dW_down and dA_down comes with it.
        weight, scale = _gemm_weight(w_down, down_scale_inv, ctx.buffered, x.dtype)
        dgate_up, h_weighted, dweights_S = moe_down_bwd(
            dy, gate_up, topk_weights, weight, a_down, dha, routing, config, store_h=needs[_W_DOWN] or needs[_A_DOWN],
            scale_inv=scale,
        )  # fmt: skip
        del weight
        d_a_down = moe_expert_grad(dha, h_weighted, a_down, routing, config, chunks=chunks) if needs[_A_DOWN] else None
        del dha
        d_w_down = None
        if needs[_W_DOWN]:
            d_w_down = moe_expert_grad(dy, h_weighted, w_down, routing, config, lhs_by_token=True)
        # h_weighted is no longer needed: free it before the gate_up backward allocates dx.
        del h_weighted

        # d(x A_gate_up^T) per row, for dx and dA_gate_up, and dB_gate_up from the same read of dgate_up.
        dxa = d_b_gate_up = None
        if a_gate_up is not None and (needs[_X] or needs[_A_GATE_UP] or needs[_B_GATE_UP]):
            dxa, d_b_gate_up = moe_lora_bwd(
                dgate_up, b_gate_up, xa, scaling, routing, config,
                compute_gb=needs[_X] or needs[_A_GATE_UP], compute_db=needs[_B_GATE_UP], chunks=chunks,
            )  # fmt: skip
        dx = None
        if needs[_X]:
            weight, scale = _gemm_weight(w_gate_up, gate_up_scale_inv, ctx.buffered, x.dtype)
            dx = moe_gate_up_bwd(dgate_up, weight, a_gate_up, dxa, routing, config, num_tokens, scale_inv=scale)
            del weight
            lodge(ctx.input_handoff, dx)
        d_w_gate_up = d_a_gate_up = None
        if needs[_W_GATE_UP]:
            d_w_gate_up = moe_expert_grad(dgate_up, x, w_gate_up, routing, config, rhs_by_token=True)
        if needs[_A_GATE_UP]:
            d_a_gate_up = moe_expert_grad(dxa, x, a_gate_up, routing, config, rhs_by_token=True, chunks=chunks)

        d_topk_weights = dweights_S.view(topk_weights.shape).to(topk_weights.dtype) if needs[_WEIGHTS] else None
        return (
            dx, None, d_topk_weights, d_w_gate_up, d_w_down, d_a_gate_up, d_b_gate_up, d_a_down, d_b_down, None,
            None, None, *(dy if needs[i] else None for i in _ADD_TO),
        )  # fmt: skip


def _gemm_weight(
    weight: torch.Tensor, scale_inv: torch.Tensor | None, buffered: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (weight, block scales) one GEMM takes: FP8 experts dequantized into a buffer of `dtype` when `buffered`
    (no scales then), else the weight as given with its scales (None for 16-bit/fp32 weights)."""
    if buffered:
        return fp8_weights.dequantized(weight, scale_inv, dtype), None
    return weight, scale_inv
