"""MoE expert MLP (SwiGLU experts, top-k combine, optional per-expert LoRA), top-k routing and the aux loss.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token (top-k), r LoRA rank.
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import use_kernel
from moe_tune.ops.fp8.reference import FP8_DTYPE, num_blocks
from moe_tune.ops.moe.reference import (
    MAX_ADD_TO,
    AddTo,
    ClampedSwiGLU,
    ExpertLoRA,
    addends_of,
    moe_mlp_ref,
    switch_aux_loss,
    topk_route,
)

__all__ = ["AddTo", "ClampedSwiGLU", "ExpertLoRA", "addends_of", "moe_mlp", "switch_aux_loss", "topk_route"]

_ID_DTYPES = (torch.int64, torch.int32)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: ExpertLoRA | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamped_swiglu: ClampedSwiGLU | None = None,
    gate_up_scale_inv: torch.Tensor | None = None,
    down_scale_inv: torch.Tensor | None = None,
    add_to: AddTo = None,
) -> torch.Tensor:
    """y[t] = add_to[t] + sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) with SwiGLU experts
    (transformers 5 layout).

    x:            [N, D] bf16/fp16/fp32/fp64
    topk_ids:     [N, k] int64/int32, values in [0, E)
    topk_weights: [N, k] float (any float dtype; combined in fp32)
    w_gate_up:    [E, 2F, D] float, gate rows first, then up
    w_down:       [E, D, F] float
    lora:         ExpertLoRA or None (default): scaling * B (A x) added on either or both projections
    b_gate_up:    [E, 2F] float or None (default): bias of the gate/up projection (gpt_oss)
    b_down:       [E, D] float or None (default): bias of the down projection, added before the routing weight
    clamped_swiglu: ClampedSwiGLU or None (default: silu(gate) * up): gpt_oss's clamped activation
    gate_up_scale_inv: [E, 2*ceil(F/128), ceil(D/128)] fp32 and down_scale_inv: [E, ceil(D/128), ceil(F/128)] fp32,
                  or both None (default): the 128 x 128 block scales of frozen FP8 experts, w_gate_up and w_down then
                  float8_e4m3fn (gate and up halves with their own scale rows). Every GEMM through them computes
                  with the dequantized weight W_q * scale_inv and the unquantized activation (ops/moe/README.md,
                  FP8); no gradient reaches them.
    add_to:       [N, D] of x's dtype, a sequence of one or two such tensors (added in order), or None (default):
                  added to the experts' sum before its one rounding (the kernels add them in the fp32 sum over each
                  token's slots), where an add of its own would read and write the output again; the gradient of
                  each is y's.
    Returns y: [N, D] in x.dtype. Differentiable w.r.t. x, topk_weights, the weights (not FP8 ones), the LoRA
    tensors and add_to.
    Runs the Triton kernels (kernels_fwd.py, kernels_bwd.py) when every tensor is on CUDA and every float but FP8
    expert weights is fp16/bf16/fp32, the reference otherwise (always with biases or the clamped activation, which
    the kernels do not take); MOE_TUNE_KERNELS=reference|triton forces a path (ops/common/dispatch.py).
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, lora)
    addends = _check_addends(x, add_to)
    _check_gpt_oss_inputs(w_gate_up, b_gate_up, b_down, clamped_swiglu)
    is_fp8 = _check_fp8_inputs(w_gate_up, w_down, gate_up_scale_inv, down_scale_inv)
    lora_tensors = (None,) * 4 if lora is None else (lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down)
    is_plain = b_gate_up is None and b_down is None and clamped_swiglu is None
    # FP8 codes are no operand dtype of the kernels, which dequantize them: their fp32 scales are checked instead.
    weights = (gate_up_scale_inv, down_scale_inv) if is_fp8 else (w_gate_up, w_down)
    has_kernel = is_plain and _kernel_takes(x, topk_weights, *weights, *lora_tensors)
    if use_kernel("moe_mlp", x, topk_ids, topk_weights, w_gate_up, w_down, gate_up_scale_inv, down_scale_inv,
                  *lora_tensors, *addends, has_kernel=has_kernel):
        # Imported on use: Triton is a Linux-only dependency, and the reference path must import without it.
        from moe_tune.ops.moe.autograd import MoEFunction

        scaling = 1.0 if lora is None else float(lora.scaling)
        return MoEFunction.apply(
            x, topk_ids, topk_weights, w_gate_up, w_down, *lora_tensors, scaling, gate_up_scale_inv, down_scale_inv,
            *(addends + (None,) * (MAX_ADD_TO - len(addends))),
        )  # fmt: skip
    return moe_mlp_ref(
        x, topk_ids, topk_weights, w_gate_up, w_down, lora, b_gate_up=b_gate_up, b_down=b_down,
        clamped_swiglu=clamped_swiglu, gate_up_scale_inv=gate_up_scale_inv, down_scale_inv=down_scale_inv,
        add_to=addends,
    )  # fmt: skip


def _check_addends(x: torch.Tensor, add_to: AddTo) -> tuple[torch.Tensor, ...]:
    """moe_mlp's add_to as a tuple of at most MAX_ADD_TO tensors, each of x's shape, dtype and device."""
    addends = addends_of(add_to)
    if len(addends) > MAX_ADD_TO:
        raise ValueError(f"add_to: {len(addends)} tensors; at most {MAX_ADD_TO} are added")
    for i, t in enumerate(addends):
        name = "add_to" if isinstance(add_to, torch.Tensor) else f"add_to[{i}]"
        if not isinstance(t, torch.Tensor) or t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            got = f"shape {tuple(t.shape)} dtype {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name}: {got} must match x ({list(x.shape)} {x.dtype} on {x.device})")
    return addends


def _check_gpt_oss_inputs(
    w_gate_up: torch.Tensor,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    clamped_swiglu: ClampedSwiGLU | None,
) -> None:
    num_experts, two_f, model_dim = w_gate_up.shape
    for name, bias, shape in (("b_gate_up", b_gate_up, (num_experts, two_f)), ("b_down", b_down, (num_experts, model_dim))):
        if bias is not None and (tuple(bias.shape) != shape or not bias.is_floating_point()):
            raise ValueError(f"{name}: shape {tuple(bias.shape)} dtype {bias.dtype} must be a float {list(shape)} "
                             "to match w_gate_up")
    if clamped_swiglu is not None and not isinstance(clamped_swiglu, ClampedSwiGLU):
        raise ValueError(f"clamped_swiglu: {type(clamped_swiglu).__name__} must be a ClampedSwiGLU or None")


def _check_fp8_inputs(
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_up_scale_inv: torch.Tensor | None,
    down_scale_inv: torch.Tensor | None,
) -> bool:
    """Whether the experts are FP8 (both weights float8_e4m3fn with their block scales); raises ValueError naming
    every tensor that breaks the rule (independent problems together, one line each)."""
    num_experts, two_f, model_dim = w_gate_up.shape
    num_hidden = two_f // 2
    is_fp8 = {"w_gate_up": w_gate_up.dtype == FP8_DTYPE, "w_down": w_down.dtype == FP8_DTYPE}
    scales = {"gate_up_scale_inv": gate_up_scale_inv, "down_scale_inv": down_scale_inv}
    if not any(is_fp8.values()) and all(scale is None for scale in scales.values()):
        return False
    problems = []
    if not all(is_fp8.values()):
        problems.extend(
            f"{name}: dtype {weight.dtype} must be float8_e4m3fn like the other expert weight (both FP8 or neither)"
            for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)) if not is_fp8[name]
        )
    expected = {
        "gate_up_scale_inv": (num_experts, num_blocks(two_f, (num_hidden, num_hidden)), num_blocks(model_dim)),
        "down_scale_inv": (num_experts, num_blocks(model_dim), num_blocks(num_hidden)),
    }
    for name, scale in scales.items():
        if scale is None:
            problems.append(f"{name}: None, but FP8 expert weights need their block scales {list(expected[name])} fp32")
        elif tuple(scale.shape) != expected[name] or scale.dtype != torch.float32:
            problems.append(
                f"{name}: shape {tuple(scale.shape)} dtype {scale.dtype} must be fp32 {list(expected[name])} "
                "(128 x 128 blocks, the gate and up halves with their own rows)"
            )
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if is_fp8[name] and weight.requires_grad:
            problems.append(f"{name}: FP8 expert weights are frozen: requires_grad must be False")
    for name, scale in scales.items():
        if scale is not None and scale.requires_grad:
            problems.append(f"{name}: block scales are frozen: requires_grad must be False")
    if problems:
        raise ValueError("\n".join(problems))
    return True


def _kernel_takes(x: torch.Tensor, *floats: torch.Tensor | None) -> bool:
    """Whether the Triton kernels run these inputs: every float tensor fp16/bf16/fp32 (fp64 stays on the reference)."""
    if not all(t is None or t.dtype in _KERNEL_DTYPES for t in (x, *floats)):
        return False
    # The interpreter's tl.dot returns garbage for bf16 operands (numpy has no bf16), and x sets the operand dtype.
    return x.is_cuda or x.dtype != torch.bfloat16


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
