"""Pure-PyTorch cross-entropy over a linear head with the full logits: the ground truth for the chunked op.

Shapes: N tokens, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_nn

REDUCTIONS = ("mean", "sum")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses are computed in: fp32 at least; fp64 inputs stay fp64 so that gradient checks in fp64
    can be tight."""
    return torch.promote_types(dtype, torch.float32)


def cross_entropy_ref(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """F.cross_entropy on full logits, except that "mean" over no labelled token is 0 (F.cross_entropy: nan).

    logits_NV: [N, V] float, computed in fp32 (fp64 stays fp64)
    labels_N:  [N] int64, class ids in [0, V) or ignore_index
    Returns the loss: [] fp32 (fp64 for fp64 logits). "mean" divides the summed loss by max(labelled tokens, 1),
    as the data-parallel trainer divides by max(global labelled tokens, 1): a row with nothing labelled gives 0
    and zero gradients instead of NaN.
    """
    logits_NV = logits_NV.to(compute_dtype(logits_NV.dtype))
    loss = F_nn.cross_entropy(logits_NV, labels_N, ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return loss
    return loss / (labels_N != ignore_index).sum().clamp(min=1)


def linear_cross_entropy_ref(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy_ref(hidden W^T + b, labels): the [N, V] logits in fp32 (fp64 for fp64 inputs), autograd.

    hidden_ND: [N, D] float; weight_VD: [V, D] float; bias_V: [V] float or None; labels_N: [N] int64.
    Returns the loss: [] fp32 (fp64 for fp64 inputs); gradients reach the inputs in their own dtypes.
    """
    dtype = compute_dtype(hidden_ND.dtype)
    bias = None if bias_V is None else bias_V.to(dtype)
    logits_NV = F_nn.linear(hidden_ND.to(dtype), weight_VD.to(dtype), bias)
    return cross_entropy_ref(logits_NV, labels_N, ignore_index, reduction)
