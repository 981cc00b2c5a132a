"""`moe-tune profile --kernels`: argument errors, the CPU run's JSON rows, --baseline and --plot, and each op's rows
printed and saved as soon as it is measured (a stopped run keeps them, complete: false)."""

import importlib.util
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli.profile import app
from moe_tune.engine.bench import COMPLETE_KEY, OPS, ROW_KEYS
from moe_tune.engine.bench.kernels import make_row

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
    assert list(row) == [*ROW_KEYS, COMPLETE_KEY]
    assert row[COMPLETE_KEY] is True
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


def _fake_op(name: str, num_rows: int, calls: list, out=None, error: BaseException | None = None,
             is_reporting: bool = False):
    """A registry entry that returns fixed rows at once, or raises `error` after its first row; it logs its call and
    what `out` holds then (None: no file yet). is_reporting: it reports each row as it makes it (RunContext.report),
    as the entries that time several shapes do, and returns them with a note the reported ones lack (as the MoE
    entry adds its LoRA ratios at the end)."""

    def bench(shapes, run):
        calls.append((name, json.loads(out.read_text()) if out is not None and out.exists() else None))
        rows = []
        for i in range(num_rows):
            if error is not None and i == 1:
                raise error
            rows.append(make_row(name, f"case {i}", "impl", "S1", torch.float32, run, fwd_ms=1.0 + i,
                                 fwd_bwd_ms=2.0 + i))  # fmt: skip
            if is_reporting:
                run.report(list(rows))
        if error is not None:
            raise error
        return [dict(row, note="final") for row in rows] if is_reporting else rows

    return bench


def _rows_of(bench) -> list[dict]:
    from moe_tune.engine.bench.kernels import Peaks, RunContext
    from moe_tune.engine.bench.machine import machine_info

    return bench("small", RunContext(is_cuda=False, peaks=Peaks(), machine=machine_info(False)))


def _without_date(rows: list[dict]) -> list[dict]:
    # The date is taken when the run starts, a second apart between two runs.
    return [{key: value for key, value in row.items() if key != "date"} for row in rows]


def test_each_op_is_printed_and_saved_as_soon_as_it_is_measured(monkeypatch, tmp_path):
    out, calls = tmp_path / "run.json", []
    # Given out of registry order (rms_norm comes before rotary there): the run keeps the order given.
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 2, calls, out))
    monkeypatch.setitem(OPS, "rms_norm", _fake_op("rms_norm", 1, calls, out))
    result = runner.invoke(app, ["--kernels", "--ops", "rotary,rms_norm", "--json", str(out)])
    assert result.exit_code == 0, result.output
    expected = _rows_of(_fake_op("rotary", 2, [])) + _rows_of(_fake_op("rms_norm", 1, []))
    # While rms_norm ran, the file held rotary's rows, marked incomplete; at the end every row, marked complete.
    assert [name for name, _ in calls] == ["rotary", "rms_norm"]
    assert calls[0][1] is None  # nothing written before the first row
    assert _without_date(calls[1][1]) == _without_date([dict(row, complete=False) for row in expected[:2]])
    assert _without_date(json.loads(out.read_text())) == _without_date([dict(row, complete=True) for row in expected])
    lines = result.stdout.splitlines()
    first = lines.index("rotary / case 0 / impl / S1 float32: fwd 1.000 ms, fwd+bwd 2.000 ms")
    assert lines[first + 1] == "rotary / case 1 / impl / S1 float32: fwd 2.000 ms, fwd+bwd 3.000 ms"
    assert lines[first + 2].startswith("rotary: 2 rows in ") and lines[first + 2].endswith(" s")
    assert lines[first + 3] == "rms_norm / case 0 / impl / S1 float32: fwd 1.000 ms, fwd+bwd 2.000 ms"
    assert lines[first + 4].startswith("rms_norm: 1 row in ")
    # The table comes after: its title is the next line.
    assert ", torch " in lines[first + 5]


@pytest.mark.parametrize("error", [RuntimeError("kernel failed"), KeyboardInterrupt()], ids=["raises", "interrupted"])
def test_a_run_stopped_in_its_second_op_keeps_the_first_ops_rows(monkeypatch, tmp_path, error):
    out, plot, calls = tmp_path / "run.json", tmp_path / "run.png", []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 2, calls))
    monkeypatch.setitem(OPS, "rms_norm", _fake_op("rms_norm", 1, calls, error=error))
    args = ["--kernels", "--ops", "rotary,rms_norm", "--json", str(out)]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if has_matplotlib:
        args += ["--plot", str(plot)]
    # Click turns an interrupt into "Aborted!" and exit 1, as in a terminal.
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    plotted = f"; {plot} their plot" if has_matplotlib else ""
    assert f"stopped ({type(error).__name__}) before rms_norm was measured; {out} keeps the rows of rotary " \
           f"(complete: false){plotted}" in result.stdout.splitlines()  # fmt: skip
    assert "rms_norm: " not in result.stdout
    saved = json.loads(out.read_text())
    expected = _rows_of(_fake_op("rotary", 2, []))
    assert _without_date(saved) == _without_date([dict(row, complete=False) for row in expected])
    if has_matplotlib:
        # The plot of the rows measured so far.
        assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("error", [RuntimeError("kernel failed"), KeyboardInterrupt()], ids=["raises", "interrupted"])
@pytest.mark.parametrize("before", [None, b'[{"op": "rotary", "earlier": true}]\n'], ids=["no-file", "a-previous-run"])
def test_a_run_stopped_before_its_first_row_leaves_the_json_as_it_was(monkeypatch, tmp_path, error, before):
    out = tmp_path / "run.json"
    if before is not None:
        out.write_bytes(before)
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 0, [], error=error))
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--json", str(out)])
    assert result.exit_code != 0
    assert (f"stopped ({type(error).__name__}) before rotary was measured; {out} is as it was (no row measured)"
            in result.stdout.splitlines())  # fmt: skip
    assert (out.read_bytes() if out.exists() else None) == before
    assert [p.name for p in tmp_path.iterdir()] == ([out.name] if before is not None else [])


def test_an_op_stopped_after_its_first_case_keeps_that_case(monkeypatch, tmp_path):
    # An op timing several shapes reports each: stopped in its second, the first is printed and saved.
    out = tmp_path / "run.json"
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, []))
    monkeypatch.setitem(OPS, "rms_norm", _fake_op("rms_norm", 3, [], error=RuntimeError("oom"), is_reporting=True))
    result = runner.invoke(app, ["--kernels", "--ops", "rotary,rms_norm", "--json", str(out)])
    assert isinstance(result.exception, RuntimeError)
    lines = result.stdout.splitlines()
    first = lines.index("rms_norm / case 0 / impl / S1 float32: fwd 1.000 ms, fwd+bwd 2.000 ms")
    assert lines[first + 1] == (
        f"stopped (RuntimeError) before rms_norm was measured; {out} keeps the rows of rotary, 1 of rms_norm "
        "(complete: false)"
    )
    expected = _rows_of(_fake_op("rotary", 1, [])) + _rows_of(_fake_op("rms_norm", 1, []))
    assert _without_date(json.loads(out.read_text())) == _without_date([dict(r, complete=False) for r in expected])


def test_reported_rows_are_printed_once_and_replaced_by_the_final_ones(monkeypatch, tmp_path):
    out = tmp_path / "run.json"
    monkeypatch.setitem(OPS, "rms_norm", _fake_op("rms_norm", 3, [], is_reporting=True))
    result = runner.invoke(app, ["--kernels", "--ops", "rms_norm", "--json", str(out)])
    assert result.exit_code == 0, result.output
    streamed = [line for line in result.stdout.splitlines() if line.startswith(("rms_norm / ", "rms_norm: "))]
    assert [line.split(":")[0] for line in streamed] == [
        "rms_norm / case 0 / impl / S1 float32", "rms_norm / case 1 / impl / S1 float32",
        "rms_norm / case 2 / impl / S1 float32", "rms_norm",
    ]  # fmt: skip
    expected = _rows_of(_fake_op("rms_norm", 3, [], is_reporting=True))
    assert [row["note"] for row in expected] == ["final"] * 3
    assert _without_date(json.loads(out.read_text())) == _without_date([dict(r, complete=True) for r in expected])


def test_a_partial_baseline_is_compared_and_said_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 2, []))
    baseline = tmp_path / "partial.json"
    # A run stopped after its first row: 100x slower, so nothing regresses.
    (row, _) = _rows_of(_fake_op("rotary", 2, []))
    baseline.write_text(json.dumps([dict(row, fwd_ms=100.0, fwd_bwd_ms=200.0, complete=False)]))
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    assert f"--baseline {baseline} holds a run stopped before its end (1 rows, complete: false): only those rows are " \
           "compared" in result.stdout.splitlines()  # fmt: skip
    assert f"no row slower than {baseline} by more than 10%" in result.stdout


def test_a_json_path_that_cannot_be_written_is_refused_before_timing(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, calls))
    out = tmp_path / "missing" / "run.json"
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--json", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --json ('{out}'): its folder '{out.parent}' does not exist"
    ]
    assert calls == []


@pytest.mark.parametrize(
    "ops, line",
    [
        ("rotary,rotary", "error: --ops ('rotary,rotary') names rotary more than once"),
        ("rotary,", "error: --ops ('rotary,') has an empty name (a comma too many): name registered ops, "
                    f"comma-separated: {', '.join(OPS)}"),
        (",rotary", "error: --ops (',rotary') has an empty name (a comma too many): name registered ops, "
                    f"comma-separated: {', '.join(OPS)}"),
        ("rotary,,moe", "error: --ops ('rotary,,moe') has an empty name (a comma too many): name registered ops, "
                        f"comma-separated: {', '.join(OPS)}"),
    ],
    ids=["twice", "trailing-comma", "leading-comma", "double-comma"],
)  # fmt: skip
def test_ops_named_twice_or_empty_are_one_line_exit_2(monkeypatch, ops, line):
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, calls))
    result = runner.invoke(app, ["--kernels", "--ops", ops])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line]
    assert calls == []


@pytest.mark.parametrize(
    "args, line",
    [
        (["--json", "{tmp}"], "error: --json ('{tmp}') is a folder: name a file to write"),
        # The formats listed after the colon are those of the installed matplotlib.
        (["--plot", "{tmp}/p.xyz"], "error: --plot ('{tmp}/p.xyz') must end in a format matplotlib writes: "),
        (["--plot", "{tmp}/old.json"], "error: --plot ('{tmp}/old.json') is the --json file: the run would overwrite "
         "it; name another file"),
        (["--baseline", "{tmp}/old.json"], "error: --json ('{tmp}/old.json') is the --baseline file: the run would "
         "overwrite it; name another file"),
    ],
    ids=["json-folder", "plot-format", "plot-is-json", "baseline-is-json"],
)  # fmt: skip
def test_bad_output_paths_are_one_line_exit_2_and_keep_the_json(monkeypatch, tmp_path, args, line):
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, calls))
    # A saved run of rotary: as a --baseline it is a good one, so the only problem is where it is named.
    old = tmp_path / "old.json"
    saved = json.dumps(_rows_of(_fake_op("rotary", 1, [])))
    old.write_text(saved)
    json_args = [] if args[0] == "--json" else ["--json", str(old)]
    args = [arg.format(tmp=tmp_path) for arg in args]
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", *json_args, *args])
    assert result.exit_code == 2, result.output
    (printed,) = result.stderr.strip().splitlines()
    assert printed.startswith(line.format(tmp=tmp_path)) and "Traceback" not in result.output
    assert calls == [] and old.read_text() == saved


def test_a_plot_that_cannot_be_drawn_is_one_line_exit_2(monkeypatch, tmp_path):
    import errno

    from moe_tune.cli import profile_kernels

    def disk_full(rows, path, partial=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, []))
    monkeypatch.setattr(profile_kernels, "plot_rows", disk_full)
    plot = tmp_path / "p.png"
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--plot", str(plot)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --plot ('{plot}'): cannot draw the plot ([Errno 28] No space left on device)"
    ]


# One SPEC per rule across an op's dimensions, each breaking it by the least step, with the line that refuses it.
BROKEN_SPECS = [
    ("moe", "N16,D16,F16,E4,k5", "k (5) must be <= E (4): each token picks k distinct experts"),
    ("moe", "N16,D16,F16,E1,k8", "k (8) must be <= E (1): each token picks k distinct experts"),
    ("gated_delta_rule", "B1,T64,H2,K257,V8", "K (257) must be <= 256: the widest key dim the linear attention "
     "kernels take (wider ones run the reference)"),
    ("kda", "B1,T64,H2,K257,V8", "K (257) must be <= 256: the widest key dim the linear attention kernels take "
     "(wider ones run the reference)"),
    ("gated_delta_rule", "B1,T7,H2,K16,V8", "B*T (7) must be >= 8: the varlen rows pack the B*T tokens as 8 "
     "documents"),
    ("rms_norm", "M4,N16385", "N (16385) must be <= 16384: the widest row the RMSNorm kernel takes in one tile"),
    ("causal_conv", "T8,C4,W9", "W (9) must be <= 8: the most taps the causal conv kernels unroll"),
    ("rotary", "T8,H2,D8,R5", "R must be even and <= D (R5, D8): the rotary dims are pairs within the head dim"),
    ("rotary", "T8,H2,D8,R10", "R must be even and <= D (R10, D8): the rotary dims are pairs within the head dim"),
]  # fmt: skip


@pytest.mark.parametrize("op, spec, rule", BROKEN_SPECS, ids=[f"{op}-{spec}" for op, spec, _ in BROKEN_SPECS])
def test_a_spec_breaking_a_rule_across_its_dimensions_is_one_line_exit_2_before_timing(monkeypatch, op, spec, rule):
    calls = []
    monkeypatch.setitem(OPS, op, _fake_op(op, 1, calls))
    result = runner.invoke(app, ["--kernels", "--ops", op, "--shapes", spec])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: --shapes ('{spec}'): {rule}"]
    assert calls == [] and "Traceback" not in result.output


def test_ops_sharing_a_spec_say_a_rule_they_share_once_and_each_other_rule():
    result = runner.invoke(app, ["--kernels", "--ops", "gated_delta_rule,kda", "--shapes", "B1,T4,H1,K300,V8"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --shapes ('B1,T4,H1,K300,V8'): K (300) must be <= 256: the widest key dim the linear attention kernels "
        "take (wider ones run the reference); B*T (4) must be >= 8: the varlen rows pack the B*T tokens as 8 documents"
    ]


@pytest.mark.parametrize(
    "ops, spec",
    [
        ("moe", "N16,D16,F16,E4,k4"),
        ("gated_delta_rule,kda", "B2,T4,H2,K256,V8"),
        ("rms_norm", "M4,N16384"),
        ("causal_conv", "T8,C4,W8"),
        ("rotary", "T8,H2,D8,R8"),
        ("rotary", "T8,H2,D8,R2"),
    ],
)
def test_a_spec_at_each_rules_limit_is_accepted(ops, spec):
    from moe_tune.engine.bench import parse_shapes

    names = ops.split(",")
    # Every dimension name here is one letter.
    dims = {item[0]: int(item[1:]) for item in spec.split(",")}
    assert parse_shapes(spec, names, label="--shapes") == {name: dims for name in names}


def test_mixed_doc_lengths_make_valid_documents_from_eight_tokens_on():
    # The varlen rows' documents (the rule B*T >= 8): lengths of at least 1 summing to the tokens, unchanged where the
    # geometric split already leaves every document a token (the anchor's 32768).
    from moe_tune.engine.bench.linear_attention_op import NUM_DOCS, mixed_doc_lengths

    for num_tokens in range(NUM_DOCS, 600):
        lengths = mixed_doc_lengths(num_tokens, NUM_DOCS)
        assert len(lengths) == NUM_DOCS and min(lengths) >= 1 and sum(lengths) == num_tokens, num_tokens
    assert mixed_doc_lengths(32768, 8) == [469, 749, 1199, 1919, 3071, 4915, 7863, 12583]
    with pytest.raises(ValueError, match=r"num_tokens \(7\) must be >= num_docs \(8\)"):
        mixed_doc_lengths(7, 8)


# Every op that takes a SPEC, at dimensions that keep its rules but need far more than any machine's memory.
HUGE_SPECS = {
    "moe": "N100000000,D4096,F4096,E64,k8",
    "gated_delta_rule": "B1,T100000000,H16,K128,V128",
    "kda": "B1,T100000000,H16,K128,V128",
    "cross_entropy": "N100000000,D4096,V151936",
    "rms_norm": "M100000000000,N8192",
    "causal_conv": "T100000000000,C8192,W4",
    "rotary": "T100000000000,H16,D128,R128",
    "swiglu": "M100000000000,F8192",
    "fp8_linear": "M100000000000,I4096,O4096",
}


def test_every_op_taking_a_spec_is_sized():
    from moe_tune.engine.bench import SHAPE_DIMS
    from moe_tune.engine.bench.kernels import SPEC_TENSORS

    assert set(HUGE_SPECS) == set(SHAPE_DIMS) == set(SPEC_TENSORS)


@pytest.mark.parametrize("op", list(HUGE_SPECS))
def test_a_spec_larger_than_the_memory_is_one_line_exit_2_before_allocating(monkeypatch, op):
    calls = []
    monkeypatch.setitem(OPS, op, _fake_op(op, 1, calls))
    spec = HUGE_SPECS[op]
    result = runner.invoke(app, ["--kernels", "--ops", op, "--shapes", spec])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --shapes ('{spec}'): {op} needs at least ")
    assert line.endswith(" GB) host memory available") and "Traceback" not in result.output
    assert calls == []


def test_the_memory_needed_is_the_ops_tensors_and_gradients_and_refused_one_byte_past_the_memory(monkeypatch):
    from moe_tune.engine.bench import kernels

    # rms_norm M4 N8 in fp32: x, gate and y [4, 8] and weight [8], each with a gradient of its size.
    need = 2 * 4 * (3 * 4 * 8 + 8)
    calls = []
    monkeypatch.setitem(OPS, "rms_norm", _fake_op("rms_norm", 1, calls))
    for available, exit_code in ((need, 0), (need - 1, 2)):
        monkeypatch.setattr(kernels, "available_memory", lambda device, available=available: (available, "in test"))
        result = runner.invoke(app, ["--kernels", "--ops", "rms_norm", "--shapes", "M4,N8"])
        assert result.exit_code == exit_code, result.output
    assert len(calls) == 1
    assert result.stderr.strip().splitlines() == [
        f"error: --shapes ('M4,N8'): rms_norm needs at least {need:,} bytes (0.0 GB) for its inputs, outputs and their "
        f"gradients, more than the {need - 1:,} bytes (0.0 GB) in test"
    ]


def _baseline_file(tmp_path, rows):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(rows))
    return path


# Bad medians, each with how JSON spells it and how the line prints it.
BAD_MEDIANS = [("\"fast\"", "'fast'"), ("0", "0"), ("-1.5", "-1.5"), ("NaN", "nan"), ("Infinity", "inf"),
               ("-Infinity", "-inf"), ("true", "True"), ("[1]", "[1]"), ("{}", "{}")]  # fmt: skip


@pytest.mark.parametrize("key", ["fwd_ms", "fwd_bwd_ms"])
@pytest.mark.parametrize("spelled, printed", BAD_MEDIANS, ids=[spelled for spelled, _ in BAD_MEDIANS])
def test_a_baseline_median_that_is_not_a_positive_number_is_one_line_naming_file_row_and_field(
    monkeypatch, tmp_path, key, spelled, printed
):
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 2, calls))
    rows = _rows_of(_fake_op("rotary", 2, []))
    text = json.dumps([rows[0], dict(rows[1], **{key: "BAD"})]).replace('"BAD"', spelled)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(text)
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --baseline ('{baseline}') row 2: {key} ({printed}) must be a finite number of milliseconds > 0, or "
        "null (not measured)"
    ]
    assert calls == [] and "Traceback" not in result.output


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_baseline_that_is_no_regular_file_is_refused_not_read(tmp_path, kind):
    """A FIFO would block the read for ever, a device such as /dev/zero never end it."""
    import os

    path = tmp_path / "pipe" if kind == "fifo" else "/dev/null"
    if kind == "fifo":
        os.mkfifo(path)
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(path)])
    assert result.exit_code == 2, result.output
    shown = "a FIFO" if kind == "fifo" else "a character device"
    assert result.stderr.splitlines() == [f"error: --baseline ({str(path)!r}) is not a regular file ({shown}); name "
                                          "a file"]  # fmt: skip


def test_every_bad_baseline_row_and_field_is_said(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, calls))
    (row,) = _rows_of(_fake_op("rotary", 1, []))
    no_case = {key: value for key, value in row.items() if key != "case"}
    baseline = _baseline_file(tmp_path, [row, no_case, dict(row, shape=7, fwd_ms=0, fwd_bwd_ms=-1)])
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    where = f"error: --baseline ('{baseline}')"
    assert result.stderr.strip().splitlines() == [
        f"{where} row 2: no case (a row names its op, case, impl, shape)",
        f"{where} row 3: shape (7) must be text, as --json writes it",
        f"{where} row 3: fwd_ms (0) must be a finite number of milliseconds > 0, or null (not measured)",
        f"{where} row 3: fwd_bwd_ms (-1) must be a finite number of milliseconds > 0, or null (not measured)",
    ]
    assert calls == []


@pytest.mark.parametrize("saved_op", ["moe", None], ids=["other-op", "no-rows"])
def test_a_baseline_with_no_row_of_the_ops_timed_is_refused_not_passed(monkeypatch, tmp_path, saved_op):
    calls = []
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 1, calls))
    rows = [dict(row, op=saved_op) for row in _rows_of(_fake_op("rotary", 1, []))] if saved_op else []
    baseline = _baseline_file(tmp_path, rows)
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --baseline ('{baseline}'): no row of the baseline matches the run's ops (rotary; its rows are of "
        f"{saved_op or 'none'}): nothing would be compared"
    ]
    assert calls == []


@pytest.mark.parametrize("differs", ["case", "impl", "shape"])
def test_a_baseline_of_the_op_whose_rows_match_none_of_the_run_fails_after_it(monkeypatch, tmp_path, differs):
    """The same op, but no row with this run's case, impl and shape: nothing was compared, which is no pass."""
    monkeypatch.setitem(OPS, "rotary", _fake_op("rotary", 2, []))
    rows = [dict(row, **{differs: "other"}) for row in _rows_of(_fake_op("rotary", 2, []))]
    baseline = _baseline_file(tmp_path, rows)
    result = runner.invoke(app, ["--kernels", "--ops", "rotary", "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --baseline ('{baseline}'): no row of it matches a row of this run (op, case, impl, shape): nothing "
        "was compared"]  # fmt: skip
    assert "no row slower than" not in result.stdout


@pytest.mark.parametrize("median", [float("nan"), float("inf"), 0.0, -1.0, True], ids=str)
def test_a_median_without_a_ratio_is_no_regression_on_either_side(median):
    from moe_tune.engine.bench import find_regressions

    row = dict(op="moe", case="uniform", impl="reference", shape="N128", fwd_ms=1.0, fwd_bwd_ms=3.0)
    assert find_regressions([dict(row, fwd_ms=median)], [row]) == []
    assert find_regressions([row], [dict(row, fwd_ms=median)]) == []
    # The other pass still compares.
    (line,) = find_regressions([dict(row, fwd_ms=median, fwd_bwd_ms=9.0)], [row])
    assert line.startswith("moe / uniform / reference / N128: fwd_bwd_ms 9.000 > 3.000")


def test_kernels_json_into_a_fifo_is_written_once_whole(tmp_path, child_env):
    """A FIFO that `cat` reads takes the rows once, at the end (each op's rows rewrite a regular file as they come:
    a FIFO's reader would read one array after another, and end at the first)."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "rows.json"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "moe_tune", "profile", "--kernels", "--ops", "moe,rotary", "--shapes", "small",
               "--json", str(fifo)]  # fmt: skip
    with subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True) as taker:
        # In a process of its own: a write that waits for ever fails the test at the timeout instead of holding it.
        written = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                 env=dict(child_env, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
        out, _ = taker.communicate(timeout=60)
    assert written.returncode == 0, written.stderr
    rows = json.loads(out)
    assert {row["op"] for row in rows} == {"moe", "rotary"} and all(row["complete"] for row in rows)
