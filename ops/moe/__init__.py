"""MoE expert MLP (SwiGLU experts, top-k combine, optional per-expert LoRA), top-k routing and the aux loss.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token (top-k), r LoRA rank.
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.moe.reference import ExpertLoRA, moe_mlp_ref, switch_aux_loss, topk_route

__all__ = ["ExpertLoRA", "moe_mlp", "switch_aux_loss", "topk_route"]

_ID_DTYPES = (torch.int64, torch.int32)


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) with SwiGLU experts (transformers 5 layout).

    x:            [N, D] bf16/fp16/fp32/fp64
    topk_ids:     [N, k] int64/int32, values in [0, E)
    topk_weights: [N, k] float (any float dtype; combined in fp32)
    w_gate_up:    [E, 2F, D] float, gate rows first, then up
    w_down:       [E, D, F] float
    lora:         ExpertLoRA or None (default): scaling * B (A x) added on either or both projections
    Returns y: [N, D] in x.dtype. Differentiable w.r.t. x, topk_weights, the weights and the LoRA tensors.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, lora)
    # No Triton kernel yet; dispatching anyway makes MOE_TUNE_KERNELS=triton fail loudly instead of running the
    # reference silently.
    use_kernel("moe_mlp", x, w_gate_up, has_kernel=False)
    return moe_mlp_ref(x, topk_ids, topk_weights, w_gate_up, w_down, lora)


def _check_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: ExpertLoRA | None,
) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: shape {tuple(x.shape)} dtype {x.dtype} must be a float [N, D]")
    num_tokens, model_dim = x.shape
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids: dtype {topk_ids.dtype} must be int64 or int32")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: dtype {topk_weights.dtype} must be a float dtype")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} must match topk_weights {tuple(topk_weights.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} must be [N, k] with N = {num_tokens} to match x")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 != 0 or w_gate_up.shape[2] != model_dim:
        raise ValueError(
            f"w_gate_up: shape {tuple(w_gate_up.shape)} must be [E, 2F, D] with an even 2F and D = {model_dim} "
            "to match x"
        )
    num_experts, num_hidden = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, model_dim, num_hidden):
        raise ValueError(
            f"w_down: shape {tuple(w_down.shape)} must be [E, D, F] = [{num_experts}, {model_dim}, {num_hidden}] "
            "to match w_gate_up"
        )
    # The range check reads min/max on the host; on CUDA that is a sync per layer, so it runs on the CPU only.
    if not topk_ids.is_cuda and topk_ids.numel() > 0:
        low, high = torch.aminmax(topk_ids)
        if int(low) < 0 or int(high) >= num_experts:
            raise ValueError(
                f"topk_ids: values must be in [0, E) = [0, {num_experts}), found min {int(low)} max {int(high)}"
            )
    if lora is not None:
        if not isinstance(lora, ExpertLoRA):
            raise ValueError(f"lora: {type(lora).__name__} must be an ExpertLoRA or None")
        lora.check(num_experts, model_dim, num_hidden)
