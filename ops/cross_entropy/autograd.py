"""Chunked cross-entropy over a linear head: one chunk of logits at a time, its gradients computed in the forward.

Shapes: N tokens, D model dim, V vocabulary, C rows of one chunk (C <= chunk_size).
Per chunk two matmuls (the device's GEMMs) around the softmax, loss and dL/dz over the [C, V] logits: either one
Triton kernel over the logits in the GEMM's dtype (kernels.py) or a handful of PyTorch passes in fp32 (README.md).
"""

from __future__ import annotations

import math

import torch

from moe_tune.ops.cross_entropy.reference import compute_dtype

# One chunk's logits stay under 256 MiB; their gradient overwrites them in place. The torch path holds them in
# fp32 (441 rows at a 152K vocabulary) plus a low-precision copy for the matmuls under bf16; the kernel path holds
# them only in the GEMM's dtype, so at bf16 the same budget takes twice the rows (default_chunk_size's
# bytes_per_logit): fewer chunks, each one fewer read-modify-write of the fp32 [V, D] grad weight.
CHUNK_LOGITS_BYTES = 256 * 2**20
# Bytes of one logit on the torch path (fp32), the default of default_chunk_size.
FP32_BYTES = 4
# Thinner chunks leave the [C, D] x [D, V] products too few rows to fill the GPU's matmul tiles.
MIN_CHUNK_ROWS = 128


def default_chunk_size(num_tokens: int, vocab_size: int, bytes_per_logit: int = FP32_BYTES) -> int:
    """Rows per chunk: as many as keep one chunk's logits, bytes_per_logit each (default 4: the torch path's fp32;
    the kernel path passes its GEMM dtype's size), within CHUNK_LOGITS_BYTES (never fewer than MIN_CHUNK_ROWS),
    evened out over the chunks so that the last one is not a sliver."""
    max_rows = max(MIN_CHUNK_ROWS, CHUNK_LOGITS_BYTES // (bytes_per_logit * vocab_size))
    num_chunks = max(1, math.ceil(num_tokens / max_rows))
    return max(1, math.ceil(num_tokens / num_chunks))


def chunk_logits(
    hidden_CD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, out_CV: torch.Tensor | None = None
) -> torch.Tensor:
    """One chunk's logits [C, V] in the inputs' dtype, the matmul as nn.Linear runs it; into out_CV when given.

    Every chunk's logits come from here: the tests wrap it to check that no call sees more than chunk_size rows.
    """
    if bias_V is None:
        return torch.mm(hidden_CD, weight_VD.T, out=out_CV)
    return torch.addmm(bias_V, hidden_CD, weight_VD.T, out=out_CV)


def linear_cross_entropy_fwd(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    bias_V: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    needs_hidden_grad: bool,
    needs_weight_grad: bool,
    needs_bias_grad: bool,
    use_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The loss and its gradients (for a grad_output of 1), walking the tokens chunk_size rows at a time.

    Per chunk, in fp32 (fp64 for fp64 inputs): logits, logsumexp, the labelled rows' loss, then in place over the
    logits d loss / d logits = scale * (softmax - onehot) on labelled rows and 0 on ignored rows, with scale
    1 / max(labelled tokens, 1) for "mean" and 1 for "sum". That gradient, cast to the inputs' dtype, feeds
    grad_hidden = G W (written into the chunk's rows) and grad_weight += G^T hidden (accumulated in fp32).
    use_kernel: the softmax, loss and gradient of each chunk in one Triton kernel over the logits in the inputs'
    dtype (bf16/fp16/fp32, no bias gradient: the caller's dispatch checks), else in PyTorch passes over fp32 logits.

    Returns loss [] (fp32, fp64 for fp64 inputs), grad_hidden [N, D] in hidden's dtype, grad_weight [V, D] in
    weight's dtype and grad_bias [V] in bias's dtype; a gradient that is not needed is None and never computed.
    """
    num_tokens = hidden_ND.shape[0]
    dtype = compute_dtype(hidden_ND.dtype)
    is_labelled_N = labels_N != ignore_index
    if reduction == "mean":
        # A device tensor, not a Python number: no host sync to read the count.
        scale = 1.0 / is_labelled_N.sum().clamp(min=1).to(dtype)
    else:
        scale = torch.ones((), dtype=dtype, device=hidden_ND.device)

    grad_hidden_ND = torch.empty_like(hidden_ND, memory_format=torch.contiguous_format) if needs_hidden_grad else None
    grad_weight_VD = torch.zeros(weight_VD.shape, dtype=dtype, device=weight_VD.device) if needs_weight_grad else None
    grad_bias_V = torch.zeros(bias_V.shape, dtype=dtype, device=bias_V.device) if needs_bias_grad else None
    if use_kernel:
        # The kernel writes dL/dz only; the bias gradient (a column sum of it in fp32) stays on the torch path, the
        # simplest way to keep it: the dispatch sends that case, and fp64, there.
        assert not needs_bias_grad and hidden_ND.dtype != torch.float64, (needs_bias_grad, hidden_ND.dtype)
        loss = _kernel_chunks(
            hidden_ND, weight_VD, labels_N, bias_V, ignore_index, chunk_size, scale, grad_hidden_ND, grad_weight_VD
        )
    else:
        loss = _torch_chunks(
            hidden_ND, weight_VD, labels_N, bias_V, is_labelled_N, chunk_size, scale,
            grad_hidden_ND, grad_weight_VD, grad_bias_V,
        )  # fmt: skip

    loss = loss * scale
    if grad_weight_VD is not None:
        grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
    if grad_bias_V is not None:
        grad_bias_V = grad_bias_V.to(bias_V.dtype)
    return loss, grad_hidden_ND, grad_weight_VD, grad_bias_V


def _torch_chunks(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    bias_V: torch.Tensor | None,
    is_labelled_N: torch.Tensor,
    chunk_size: int,
    scale: torch.Tensor,
    grad_hidden_ND: torch.Tensor | None,
    grad_weight_VD: torch.Tensor | None,
    grad_bias_V: torch.Tensor | None,
) -> torch.Tensor:
    """The torch path: each chunk's logits in fp32 (fp64 stays), a few elementwise passes over them. Returns the
    summed loss of the labelled tokens (not yet scaled); fills the gradients that are not None."""
    num_tokens = hidden_ND.shape[0]
    dtype = scale.dtype
    loss = torch.zeros((), dtype=dtype, device=hidden_ND.device)
    needs_any_grad = grad_hidden_ND is not None or grad_weight_VD is not None or grad_bias_V is not None
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        hidden_CD = hidden_ND[start:end]
        logits_CV = chunk_logits(hidden_CD, weight_VD, bias_V).to(dtype)
        is_labelled_C = is_labelled_N[start:end]
        # Ignored rows read class 0 (any valid id); their loss and gradient are masked out below.
        target_C1 = labels_N[start:end].masked_fill(~is_labelled_C, 0)[:, None]
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        token_loss_C = lse_C - logits_CV.gather(1, target_C1)[:, 0]
        loss += torch.where(is_labelled_C, token_loss_C, 0.0).sum()
        if not needs_any_grad:
            continue
        # From here logits_CV holds the gradient: softmax, minus the one-hot target, times the row's weight.
        grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
        grad_CV.scatter_add_(1, target_C1, torch.full_like(target_C1, -1, dtype=dtype))
        grad_CV.mul_((is_labelled_C.to(dtype) * scale)[:, None])
        if grad_bias_V is not None:
            grad_bias_V += grad_CV.sum(dim=0)
        # The matmul operand in the inputs' dtype, as autograd casts the gradient of `logits.float()` in the
        # full-logits path; bf16 GEMMs are an order of magnitude faster than fp32 ones on the GPU.
        _add_chunk_grads(grad_CV.to(hidden_ND.dtype), hidden_CD, weight_VD, start, grad_hidden_ND, grad_weight_VD)
    return loss


def _kernel_chunks(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    bias_V: torch.Tensor | None,
    ignore_index: int,
    chunk_size: int,
    scale: torch.Tensor,
    grad_hidden_ND: torch.Tensor | None,
    grad_weight_VD: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel path: each chunk's logits stay in the inputs' dtype, and one Triton kernel writes the rows' losses
    into a per-token fp32 buffer and, when a gradient is needed, dL/dz over the logits in place. Returns the summed
    loss of the labelled tokens (one reduction at the end, not yet scaled); fills the gradients that are not None."""
    from moe_tune.ops.cross_entropy import kernels

    num_tokens, vocab_size = hidden_ND.shape[0], weight_VD.shape[0]
    labels_N = labels_N.contiguous()
    token_loss_N = kernels.alloc((num_tokens,), torch.float32, hidden_ND.device)
    has_grad = grad_hidden_ND is not None or grad_weight_VD is not None
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        hidden_CD = hidden_ND[start:end]
        logits_CV = chunk_logits(
            hidden_CD, weight_VD, bias_V, kernels.alloc((end - start, vocab_size), hidden_ND.dtype, hidden_ND.device)
        )
        kernels.cross_entropy_chunk_fwd(
            logits_CV, labels_N[start:end], token_loss_N[start:end], scale, ignore_index, has_grad
        )
        if has_grad:
            # logits_CV now holds dL/dz in the inputs' dtype: the matmul operand as on the torch path.
            _add_chunk_grads(logits_CV, hidden_CD, weight_VD, start, grad_hidden_ND, grad_weight_VD)
    return token_loss_N.sum()


def _add_chunk_grads(
    grad_CV: torch.Tensor,
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    start: int,
    grad_hidden_ND: torch.Tensor | None,
    grad_weight_VD: torch.Tensor | None,
) -> None:
    """grad hidden of the chunk's rows = G W; grad weight (fp32, fp64 stays) += G^T hidden. G in the inputs' dtype."""
    if grad_hidden_ND is not None:
        torch.mm(grad_CV, weight_VD, out=grad_hidden_ND[start : start + grad_CV.shape[0]])
    if grad_weight_VD is not None:
        if grad_CV.dtype == grad_weight_VD.dtype:
            grad_weight_VD.addmm_(grad_CV.T, hidden_CD)
        else:
            # Each chunk's product is rounded once to the inputs' dtype, the sum over chunks stays in fp32.
            grad_weight_VD += grad_CV.T @ hidden_CD


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward computes the loss and every needed gradient chunk by chunk (linear_cross_entropy_fwd, on the kernel
    path when use_kernel) and saves the gradients, never the logits; backward scales them by grad_output. Only one
    chunk's [C, V] logits exist at any time."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, bias_V, ignore_index, reduction, chunk_size, use_kernel):
        needs_hidden_grad, needs_weight_grad, _, needs_bias_grad = ctx.needs_input_grad[:4]
        loss, grad_hidden_ND, grad_weight_VD, grad_bias_V = linear_cross_entropy_fwd(
            hidden_ND, weight_VD, labels_N, bias_V, ignore_index, reduction, chunk_size,
            needs_hidden_grad, needs_weight_grad, needs_bias_grad, use_kernel,
        )  # fmt: skip
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD, grad_bias_V)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden_ND, grad_weight_VD, grad_bias_V = ctx.saved_tensors
        # Out of place: a backward with retain_graph=True may run again on the same saved gradients. A 0-dim
        # grad_loss is not rounded to a bf16 gradient's dtype first: the product is computed in fp32.
        grads = [None if g is None else g * grad_loss for g in (grad_hidden_ND, grad_weight_VD, grad_bias_V)]
        return grads[0], grads[1], None, grads[2], None, None, None, None
