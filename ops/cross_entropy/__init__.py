"""Cross-entropy over a linear head (the LM loss) that never holds the [N, V] logits: chunks of tokens, each with
its logits, loss and gradients computed together in the forward.

Shapes: N tokens, D model dim, V vocabulary. The math is in README.md; the ground truth in reference.py.

Dispatch: per chunk a Triton kernel over the logits (kernels.py) on CUDA tensors, PyTorch passes over fp32 logits
elsewhere and for what the kernel does not cover (fp64, a bias gradient); MOE_TUNE_KERNELS forces the kernel or
the full-logits reference. The kernel is checked against the reference in the Triton interpreter
(tests/ops/test_cross_entropy.py) and in bf16 on the H200 (tests/gpu/test_cross_entropy_gpu.py).
"""

from __future__ import annotations

import logging

import torch

from moe_tune.ops.common.dispatch import KERNELS_ENV, kernel_mode, triton_interpreting
from moe_tune.ops.cross_entropy.autograd import (
    FP32_BYTES,
    LinearCrossEntropyFunction,
    default_chunk_size,
    linear_cross_entropy_fwd,
)
from moe_tune.ops.cross_entropy.reference import REDUCTIONS, cross_entropy_ref, linear_cross_entropy_ref

__all__ = ["cross_entropy", "linear_cross_entropy"]

_log = logging.getLogger("moe_tune.ops")
_logged_paths: set[str] = set()
# Dtypes of the kernel path's logits (fp64 runs the torch path).
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The paths _chunk_path picks between: the Triton kernel over each chunk, or PyTorch passes over fp32 logits.
KERNEL_PATH, TORCH_PATH = "chunked triton", "chunked"


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
    chunk_size:   tokens per chunk, or None (default) for default_chunk_size: one chunk's logits within 256 MiB
                  (in the inputs' dtype on the kernel path, in fp32 on the torch path), at least 128 rows
    Returns the loss: [] fp32 (fp64 for fp64 inputs). Differentiable w.r.t. hidden, weight and bias; gradients
    that are not needed (a frozen head: weight.requires_grad False) are never computed.
    Matmuls run in the inputs' dtype (as nn.Linear), softmax statistics and the loss in fp32; the gradients are
    computed during the forward and saved (grad hidden [N, D] in hidden's dtype, grad weight accumulated in fp32
    and saved in weight's dtype), so backward only scales them.
    Dispatch (_chunk_path): a Triton kernel computes each chunk's softmax, loss and dL/dz on CUDA tensors under
    MOE_TUNE_KERNELS=auto, and under triton (CPU tensors only with TRITON_INTERPRET=1, else RuntimeError); the
    PyTorch passes run on the CPU under auto, and for fp64 or a bias that needs a gradient under auto and triton;
    MOE_TUNE_KERNELS=reference runs linear_cross_entropy_ref on the full logits.
    Raises ValueError naming the tensor, its shape and the rule when inputs do not fit together.
    """
    _check_inputs(hidden, weight, labels, bias, ignore_index, reduction, chunk_size)
    if kernel_mode() == "reference":
        _log_path("reference")
        return linear_cross_entropy_ref(hidden, weight, labels, bias, ignore_index, reduction)
    path = _chunk_path(hidden, bias)
    _log_path(path)
    use_kernel = path == KERNEL_PATH
    if chunk_size is None:
        # The kernel path holds a chunk's logits in the inputs' dtype only: at bf16 twice the rows in the budget.
        bytes_per_logit = hidden.element_size() if use_kernel else FP32_BYTES
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], bytes_per_logit)
    if not torch.is_grad_enabled():
        # Under no_grad the Function would still see requires_grad inputs and compute their gradients.
        return linear_cross_entropy_fwd(
            hidden, weight, labels, bias, ignore_index, reduction, chunk_size, False, False, False, use_kernel
        )[0]
    return LinearCrossEntropyFunction.apply(
        hidden, weight, labels, bias, ignore_index, reduction, chunk_size, use_kernel
    )


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


def _chunk_path(hidden: torch.Tensor, bias: torch.Tensor | None) -> str:
    """KERNEL_PATH or TORCH_PATH for inputs that passed _check_inputs, under MOE_TUNE_KERNELS auto or triton.

    The kernel covers bf16/fp16/fp32 without a bias gradient; the torch path covers everything, so the cases the
    kernel does not cover take it under triton too. An explicit triton on CPU tensors without the interpreter
    raises, as ops/common/dispatch.py does for the kernel ops.
    """
    needs_bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    if hidden.dtype not in _KERNEL_DTYPES or needs_bias_grad:
        return TORCH_PATH
    if kernel_mode() == "triton":
        if not (hidden.is_cuda or triton_interpreting()):
            raise RuntimeError(
                f"{KERNELS_ENV}=triton but linear_cross_entropy got CPU tensors: run on a CUDA device or set "
                "TRITON_INTERPRET=1"
            )
        return KERNEL_PATH
    return KERNEL_PATH if hidden.is_cuda else TORCH_PATH


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
