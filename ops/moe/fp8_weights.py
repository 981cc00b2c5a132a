"""FP8 expert weights (float8_e4m3fn codes with 128 x 128 block scales) dequantized into a transient buffer per GEMM.

Where each expert's rows fill whole scale blocks (F and D multiples of 128, as in the hub's FP8 checkpoints), the
buffer is small enough and the experts get enough rows each to pay for it, a projection's experts [E, rows, cols]
are dequantized as one [E * rows, cols] weight by ops/fp8's kernel into the activations' dtype, the GEMM runs the
16-bit kernels on it, and the buffer is freed: the forward and backward each dequantize again, and only the FP8
codes are saved. The values are those the GEMMs' in-tile dequantization computes (code * scale rounded once to the
activations' dtype), so both give the same products as the 16-bit kernels on the dequantized weights; the
tile-by-tile path (kernel_config.weight_tile) serves the other shapes.
"""

from __future__ import annotations

import torch

from moe_tune.ops.fp8.kernels import dequantize_weight_fp8
from moe_tune.ops.fp8.reference import BLOCK

# One projection's dequantized experts live for the length of its GEMM: 2 GiB at E512 F512 D2048's gate_up in bf16
# (Qwen3-Next-80B's layer); a larger projection (many experts on one rank) is dequantized tile by tile instead.
MAX_BUFFER_BYTES = 4 << 30
# Routed rows per expert from which a buffer pays for its pass over the weights: at 320 (N16384 E512 top-10) the
# buffered fwd+bwd takes 1.29x the bf16 kernels' against 1.66x in tile; at 80 (Qwen3-Next-80B at T4096) the 80B step
# takes 1.75 s buffered against 1.17 s in tile (docs/PERF.md, FP8 experts).
MIN_ROWS_PER_EXPERT = 256


def buffers_weights(w_gate_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype, num_rows: int) -> bool:
    """Whether FP8 experts w_gate_up [E, 2F, D] and w_down [E, D, F] are dequantized into a buffer per GEMM (in
    `dtype`) for num_rows routed rows (tokens times top-k): both contiguous, F and D multiples of 128, each
    projection's buffer at most MAX_BUFFER_BYTES, at least MIN_ROWS_PER_EXPERT rows per expert on average."""
    num_experts, model_dim, hidden_dim = w_down.shape
    itemsize = dtype.itemsize
    return (
        num_rows >= MIN_ROWS_PER_EXPERT * num_experts
        and w_gate_up.is_contiguous() and w_down.is_contiguous()
        and hidden_dim % BLOCK == 0 and model_dim % BLOCK == 0
        and w_gate_up.numel() * itemsize <= MAX_BUFFER_BYTES and w_down.numel() * itemsize <= MAX_BUFFER_BYTES
    )  # fmt: skip


def dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [E, rows, cols] float8_e4m3fn (contiguous, rows a multiple of 128) times its block scales scale_inv
    [E, rows / 128, ceil(cols / 128)] fp32, rounded once to `dtype`: a new [E, rows, cols] buffer."""
    num_experts, rows, cols = weight.shape
    assert rows % BLOCK == 0 and weight.is_contiguous(), "each expert's rows must fill whole scale blocks"
    flat = dequantize_weight_fp8(
        weight.view(num_experts * rows, cols), scale_inv.reshape(num_experts * scale_inv.shape[1], scale_inv.shape[2]),
        dtype,
    )  # fmt: skip
    return flat.view(num_experts, rows, cols)
