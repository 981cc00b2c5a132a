"""`moe-tune profile --kernels`: argument errors, the CPU run's JSON rows, --baseline and --plot."""

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli.profile import app
from moe_tune.engine.bench import OPS, ROW_KEYS

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    # The CPU path, even on a machine with a GPU: small shapes, seconds in all.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def moe_rows(tmp_path):
    out = tmp_path / "run.json"
    result = runner.invoke(app, ["--kernels", "--ops", "moe", "--shapes", "small", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "no CUDA device" in result.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("args", [[], ["tiny", "--kernels"]], ids=["neither", "both"])
def test_profile_or_kernels_but_not_both_is_one_line_exit_2(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: pass a PROFILE (time its training steps) or --kernels (time the fused ops), not both or neither"
    ]


def test_unknown_ops_are_one_line_exit_2():
    result = runner.invoke(app, ["--kernels", "--ops", "foo"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: --ops ('foo') must name registered ops: {', '.join(OPS)}"


def test_cpu_moe_run_writes_rows_with_positive_medians(moe_rows):
    (row,) = moe_rows
    assert list(row) == list(ROW_KEYS)
    assert (row["op"], row["impl"], row["device"]) == ("moe", "reference", "cpu")
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["fwd_tflops"] > 0
    assert row["fwd_peak_fraction"] is None and row["peak_memory_bytes"] is None


def _doctored(rows, factor, tmp_path):
    path = tmp_path / f"baseline-{factor}.json"
    path.write_text(json.dumps([dict(row, fwd_ms=row["fwd_ms"] * factor, fwd_bwd_ms=row["fwd_bwd_ms"] * factor)
                                for row in rows]))  # fmt: skip
    return path


def test_baseline_much_faster_than_now_fails_naming_the_row(moe_rows, tmp_path):
    baseline = _doctored(moe_rows, 1e-3, tmp_path)
    result = runner.invoke(app, ["--kernels", "--ops", "moe", "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "moe / uniform / reference / N128 D64 F32 E4 k2: fwd_ms" in result.stdout


def test_baseline_of_a_slower_run_passes(moe_rows, tmp_path):
    # A generous margin: the saved run is 100x slower, so CPU noise cannot turn this into a failure.
    baseline = _doctored(moe_rows, 100.0, tmp_path)
    result = runner.invoke(app, ["--kernels", "--ops", "moe", "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    assert "no row slower than" in result.stdout


def test_plot_without_matplotlib_is_one_line_exit_2(monkeypatch, tmp_path):
    # None in sys.modules makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(app, ["--kernels", "--ops", "moe", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --plot ('{tmp_path / 'p.png'}') needs matplotlib, which is not installed"
    ]


def test_bad_shape_spec_is_one_line_exit_2():
    result = runner.invoke(app, ["--kernels", "--ops", "gated_delta_rule", "--shapes", "B4,T8192,H16,K128"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --shapes ('B4,T8192,H16,K128'): gated_delta_rule takes exactly B,T,H,K,V (missing V)"
    ]


def test_shape_spec_runs_each_op_at_that_shape(tmp_path):
    out = tmp_path / "spec.json"
    args = ["--kernels", "--ops", "gated_delta_rule", "--shapes", "B1,T40,H1,K16,V8", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())
    assert (row["op"], row["shape"], row["device"]) == ("gated_delta_rule", "B1 T40 H1 K16 V8", "cpu")
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p.png"
    result = runner.invoke(app, ["--kernels", "--ops", "moe", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG")
