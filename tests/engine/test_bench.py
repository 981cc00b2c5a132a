"""The kernel benchmark harness: its registry, the CPU fallback's rows, and the regression check."""

import pytest
import torch

from moe_tune.engine.bench import OPS, ROW_KEYS, find_regressions, run_kernels


@pytest.fixture
def no_cuda(monkeypatch):
    # The CPU path, even on a machine with a GPU: these tests must stay fast and device-free.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_registry_names_every_op():
    assert list(OPS) == ["moe", "gated_delta_rule", "kda", "sparse_attention"]


def test_unknown_op_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"ops \('foo'\) must name registered ops: moe, gated_delta_rule, kda"):
        run_kernels(["foo"])


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match=r"shapes \('huge'\) must be one of small, anchor"):
        run_kernels(["moe"], "huge")


def test_cpu_run_says_so_and_times_the_sparse_reference(no_cuda):
    said = []
    rows, peaks, machine = run_kernels(["sparse_attention"], "small", on_start=said.append)
    assert said == ["no CUDA device: timing the pure-PyTorch references on small shapes (time.perf_counter medians)"]
    assert peaks.tflops is None and machine["device"] == "cpu"
    (row,) = rows
    assert tuple(row) == ROW_KEYS
    assert row["op"] == "sparse_attention" and "no sparse attention kernel exists yet" in row["note"]
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["fwd_tflops"] > 0
    assert row["fwd_peak_fraction"] is None and row["peak_memory_bytes"] is None
    assert row["commit"] and row["date"] and row["torch"] == torch.__version__


def _row(impl="reference", fwd_ms=1.0, fwd_bwd_ms=3.0):
    return dict(op="moe", case="uniform", impl=impl, shape="N128", fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms)


def test_regression_is_a_row_more_than_ten_percent_slower():
    baseline = [_row(), _row(impl="triton")]
    assert find_regressions([_row(fwd_ms=1.09), _row(impl="triton", fwd_bwd_ms=3.2)], baseline) == []
    (line,) = find_regressions([_row(fwd_ms=1.09), _row(impl="triton", fwd_bwd_ms=3.6)], baseline)
    assert line.startswith("moe / uniform / triton / N128: fwd_bwd_ms 3.600 > 3.000 (+20%")


def test_rows_without_a_match_or_a_timing_are_not_regressions():
    assert find_regressions([_row(impl="new"), _row(fwd_ms=None)], [_row(fwd_ms=0.1), _row(impl="other")]) == []
