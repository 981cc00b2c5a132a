"""Cross-entropy over a linear head (the LM loss) that never holds the [N, V] logits: chunks of tokens, each with
its logits, loss and gradients computed together in the forward.

Shapes: N tokens, D model dim, V vocabulary. The math is in README.md; the ground truth in reference.py.
"""

from __future__ import annotations

import logging

import torch

from moe_tune.ops.common.dispatch import KERNELS_ENV, kernel_mode
from moe_tune.ops.cross_entropy.autograd import (
    LinearCrossEntropyFunction,
    default_chunk_size,
    linear_cross_entropy_fwd,
)
from moe_tune.ops.cross_entropy.reference import REDUCTIONS, cross_entropy_ref, linear_cross_entropy_ref

__all__ = ["cross_entropy", "linear_cross_entropy"]

_log = logging.getLogger("moe_tune.ops")
_logged_paths: set[str] = set()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits hidden W^T + b against labels, computed chunk_size tokens at a time.

    hidden:       [N, D] bf16/fp16/fp32/fp64
    weight:       [V, D] hidden's dtype (an LM head's weight: nn.Linear layout)
    labels:       [N] int64, class ids in [0, V) or ignore_index
    bias:         [V] hidden's dtype, or None (default)
    ignore_index: label of tokens without a loss (default -100): no loss, zero gradient, not counted by "mean"
    reduction:    "mean" (default): the summed loss over max(labelled tokens, 1), so 0 with zero gradients when
                  nothing is labelled (F.cross_entropy gives NaN there); "sum": the summed loss
    chunk_size:   tokens per chunk, or None (default) for default_chunk_size: one chunk's fp32 logits within
                  256 MiB, at least 128 rows
    Returns the loss: [] fp32 (fp64 for fp64 inputs). Differentiable w.r.t. hidden, weight and bias; gradients
    that are not needed (a frozen head: weight.requires_grad False) are never computed.
    Matmuls run in the inputs' dtype (as nn.Linear), softmax statistics and the loss in fp32; the gradients are
    computed during the forward and saved (grad hidden [N, D] in hidden's dtype, grad weight accumulated in fp32
    and saved in weight's dtype), so backward only scales them. MOE_TUNE_KERNELS=reference runs
    linear_cross_entropy_ref on the full logits instead; the chunked path is pure PyTorch (no Triton kernel), so
    it also runs under auto and triton.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(hidden, weight, labels, bias, ignore_index, reduction, chunk_size)
    if kernel_mode() == "reference":
        _log_path("reference")
        return linear_cross_entropy_ref(hidden, weight, labels, bias, ignore_index, reduction)
    _log_path("chunked")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0])
    if not torch.is_grad_enabled():
        # Under no_grad the Function would still see requires_grad inputs and compute their gradients.
        return linear_cross_entropy_fwd(
            hidden, weight, labels, bias, ignore_index, reduction, chunk_size, False, False, False
        )[0]
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, bias, ignore_index, reduction, chunk_size)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """The same loss on logits that already exist (a head linear_cross_entropy cannot take): F.cross_entropy in
    fp32 with linear_cross_entropy's conventions, so both paths give one loss.

    logits: [N, V] float; labels: [N] int64; ignore_index, reduction: as linear_cross_entropy ("mean" over no
    labelled token is 0). Returns the loss: [] fp32 (fp64 for fp64 logits).
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: shape {tuple(logits.shape)} dtype {logits.dtype} must be a float [N, V]")
    if tuple(labels.shape) != (logits.shape[0],):
        raise ValueError(f"labels: shape {tuple(labels.shape)} must be [N] with N = {logits.shape[0]} to match logits")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction ({reduction!r}) must be one of {', '.join(REDUCTIONS)}")
    return cross_entropy_ref(logits, labels, ignore_index, reduction)


def _log_path(path: str) -> None:
    """Log the dispatch choice once per process, as ops/common/dispatch.py does for the kernel ops."""
    if path not in _logged_paths:
        _logged_paths.add(path)
        _log.info("linear_cross_entropy: %s path (%s=%s)", path, KERNELS_ENV, kernel_mode())


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    chunk_size: int | None,
) -> None:
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden: shape {tuple(hidden.shape)} dtype {hidden.dtype} must be a float [N, D]")
    num_tokens, model_dim = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != model_dim:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [V, D] with D = {model_dim} to match hidden")
    vocab_size = weight.shape[0]
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} must match hidden ({hidden.dtype})")
    if bias is not None:
        if tuple(bias.shape) != (vocab_size,):
            raise ValueError(f"bias: shape {tuple(bias.shape)} must be [V] with V = {vocab_size} to match weight")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias: dtype {bias.dtype} must match hidden ({hidden.dtype})")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels: dtype {labels.dtype} must be int64")
    if tuple(labels.shape) != (num_tokens,):
        raise ValueError(f"labels: shape {tuple(labels.shape)} must be [N] with N = {num_tokens} to match hidden")
    for name, tensor in (("weight", weight), ("labels", labels), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name}: device {tensor.device} must match hidden ({hidden.device})")
    # The range check reads the labels on the host; on CUDA that is a sync per step, so it runs on the CPU only.
    if not labels.is_cuda and num_tokens > 0:
        is_labelled = labels != ignore_index
        if is_labelled.any():
            low, high = torch.aminmax(labels[is_labelled])
            if int(low) < 0 or int(high) >= vocab_size:
                raise ValueError(
                    f"labels: values must be in [0, V) = [0, {vocab_size}) or ignore_index ({ignore_index}), "
                    f"found min {int(low)} max {int(high)}"
                )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction ({reduction!r}) must be one of {', '.join(REDUCTIONS)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive int or None")
