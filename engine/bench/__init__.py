"""Benchmarks of the fused ops: the shared harness behind `moe-tune profile --kernels` (see kernels.py)."""

from moe_tune.engine.bench.kernels import (
    COMPLETE_KEY,
    OPS,
    PRESETS,
    REGRESSION_TOLERANCE,
    ROW_KEYS,
    SHAPE_DIMS,
    find_regressions,
    is_partial,
    parse_shapes,
    run_kernels,
    write_rows,
)

__all__ = [
    "COMPLETE_KEY",
    "OPS",
    "PRESETS",
    "REGRESSION_TOLERANCE",
    "ROW_KEYS",
    "SHAPE_DIMS",
    "find_regressions",
    "is_partial",
    "parse_shapes",
    "run_kernels",
    "write_rows",
]
