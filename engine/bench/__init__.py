"""Benchmarks of the fused ops: the shared harness behind `moe-tune profile --kernels` (see kernels.py)."""

from moe_tune.engine.bench.kernels import (
    OPS,
    PRESETS,
    REGRESSION_TOLERANCE,
    ROW_KEYS,
    SHAPE_DIMS,
    find_regressions,
    parse_shapes,
    run_kernels,
)

__all__ = [
    "OPS",
    "PRESETS",
    "REGRESSION_TOLERANCE",
    "ROW_KEYS",
    "SHAPE_DIMS",
    "find_regressions",
    "parse_shapes",
    "run_kernels",
]
