"""FP8 e4m3 frozen weights in 128 x 128 blocks (the hub's FP8 checkpoint layout) and activations in 1 x 128 groups.

reference.py holds the layouts and the one rounding rule every FP8 kernel reproduces.
"""

from __future__ import annotations

from moe_tune.ops.fp8.reference import (
    BLOCK,
    E4M3_MAX,
    FP8_DTYPE,
    dequantize_groups,
    dequantize_weight,
    fake_quantize_groups,
    num_blocks,
    quantize_groups,
    quantize_weight,
)

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize_groups",
    "dequantize_weight",
    "fake_quantize_groups",
    "num_blocks",
    "quantize_groups",
    "quantize_weight",
]
