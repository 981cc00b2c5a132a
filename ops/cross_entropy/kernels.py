"""Triton kernel of the chunked linear cross-entropy: the elementwise passes over one chunk's logits, fused.

Shapes: C rows of one chunk, V vocabulary; logits [C, V] in the GEMM's dtype (bf16/fp16/fp32), rows at a stride;
labels [C] int64; loss [C] fp32; scale [] fp32. The math is in README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Logits of one row a program holds at a time (32 a thread at NUM_WARPS). The fastest of 1024 to 16384 at 4, 8 and
# 16 warps on the H200 (bf16 chunks of 4096 x 32000 and 862 x 151936, loss and gradient: 181 and 223 us, 4.3 and
# 3.5 TB/s counted over three passes; 4096 took 196 and 264 us, 2048 and narrower more).
BLOCK_V = 8192
# Threads per program, measured with BLOCK_V: 4 warps were 15-20% slower, 16 about even.
NUM_WARPS = 8
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernel path writes comes from here, the chunk's logits too (tests swap in guarded, NaN-filled
    buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _cross_entropy_chunk_kernel(
    logits_ptr, labels_ptr, loss_ptr, scale_ptr,
    V, stride_row, ignore_index,
    HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    is_labelled = label != ignore_index
    # Labels out of [0, V) are not checked on the device (that would sync): such a row's loss is NaN, read nothing.
    is_in_range = (label >= 0) & (label < V)
    target_logit = tl.load(row_ptr + tl.where(is_in_range, label, 0), mask=is_in_range, other=float("nan"))

    # Pass 1: running max and sum of exp(z - max) over the row's tiles, in fp32.
    row_max = -float("inf")
    sum_exp = 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        z = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        row_max = new_max
    lse = row_max + tl.log(sum_exp)
    loss = tl.where(is_labelled, lse - target_logit.to(tl.float32), 0.0)
    tl.store(loss_ptr + row, loss)

    # Pass 2: dL/dz = (softmax - onehot) * scale over the logits, in place, rounded once to their dtype.
    if HAS_GRAD:
        row_scale = tl.where(is_labelled, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            onehot = tl.where(start + cols == label, 1.0, 0.0)
            grad = (tl.exp(z - lse) - onehot) * row_scale
            tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def block_size(vocab_size: int) -> int:
    """BLOCK_V, or for a narrower vocabulary one tile of its width rounded up to a power of two (tl.arange needs
    one)."""
    return min(BLOCK_V, triton.next_power_of_2(vocab_size))


def cross_entropy_chunk_fwd(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    loss_C: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    has_grad: bool,
) -> None:
    """Per row of one chunk: loss_C = logsumexp(z) - z[label] (0 for ignored rows); with has_grad, logits_CV is
    overwritten by (softmax(z) - onehot(label)) * scale (0 for ignored rows) in its own dtype.

    logits_CV: [C, V] bf16/fp16/fp32, rows at any stride, unit column stride
    labels_C:  [C] int64 contiguous, class ids in [0, V) or ignore_index
    loss_C:    [C] fp32 contiguous, written
    scale:     [] fp32 on the logits' device, read by the kernel (no host sync)
    """
    num_rows, vocab_size = logits_CV.shape
    assert logits_CV.dtype in KERNEL_DTYPES and logits_CV.stride(1) == 1, (logits_CV.dtype, logits_CV.stride())
    assert labels_C.is_contiguous() and loss_C.is_contiguous() and loss_C.dtype == torch.float32
    assert scale.dtype == torch.float32 and scale.numel() == 1
    if num_rows == 0:
        return
    _cross_entropy_chunk_kernel[(num_rows,)](
        logits_CV, labels_C, loss_C, scale, vocab_size, logits_CV.stride(0), ignore_index,
        HAS_GRAD=has_grad, BLOCK_V=block_size(vocab_size), num_warps=NUM_WARPS,
    )  # fmt: skip
