"""The memory sweep: its command line, and the ladder on the CPU (peak memory and the real numbers need a GPU:
docs/PERF.md), with out-of-memory made to happen at a chosen length."""

import copy

import pytest
import torch

from moe_tune.engine.bench.memory_sweep import LENGTHS, PROFILE, TIMED_LENGTH, parse_args
from moe_tune.engine.bench.steps import StepRunner, sweep_lengths
from moe_tune.profiles import load_profile


def test_defaults_and_options_in_any_order():
    args = parse_args(["out.json"])
    assert (args.preset, args.lengths, args.overrides) == ("none", list(LENGTHS), [])
    assert (args.profile, args.timed_length, args.rung_steps, args.plot) == (PROFILE, TIMED_LENGTH, 1, None)
    args = parse_args(["out.json", "--set", "a.b=1", "max-context", "--lengths", "131072,196608", "--profile",
                       "bench-hybrid-1m", "--timed-length", "32768", "--rung-steps", "2", "--plot", "p.png"])
    assert (args.preset, args.lengths, args.overrides) == ("max-context", [131072, 196608], ["a.b=1"])
    assert (args.profile, args.timed_length, args.rung_steps, str(args.plot)) == ("bench-hybrid-1m", 32768, 2, "p.png")


@pytest.mark.parametrize("option, value, rule", [("--timed-length", "0", "must be positive"),
                                                 ("--rung-steps", "-1", "must be positive"),
                                                 ("--rung-steps", "two", "must be an integer")])  # fmt: skip
def test_bad_counts_one_line_exit_2(option, value, rule, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["out.json", option, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and f"argument {option}: '{value}': {rule}" in err


@pytest.mark.parametrize(
    "lengths, rule",
    [("4096,x", "must be comma-separated integers"), ("8192,4096", "must be positive and strictly ascending"),
     ("0,4096", "must be positive and strictly ascending"), ("4096,4096", "must be positive and strictly ascending")],
)  # fmt: skip
def test_bad_lengths_one_line_exit_2(lengths, rule, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["out.json", "--lengths", lengths])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert f"argument --lengths: '{lengths}': {rule}" in err


def fail_from(monkeypatch, seq_len: int, error: Exception) -> None:
    """Steps on rows of seq_len tokens or more raise `error`."""
    step = StepRunner.step

    def failing(self):
        if self.dataset.seq_len >= seq_len:
            raise error
        return step(self)

    monkeypatch.setattr(StepRunner, "step", failing)


def test_ladder_stops_at_the_first_out_of_memory_and_reports_each_rung(monkeypatch):
    fail_from(monkeypatch, 128, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    profile = load_profile("tiny", ["data.corpus_documents=100", "train.micro_batch_size=1"])
    lines, snapshots = [], []
    result = sweep_lengths(profile, [96, 128, 160], timed_length=64, timed_steps=1, on_line=lines.append,
                           on_result=lambda r: snapshots.append(copy.deepcopy(r)))  # fmt: skip
    assert result["max_trained_length"] == 96
    assert [(rung["seq_len"], rung["outcome"]) for rung in result["ladder"]] == [(96, "trained"), (128, "out of memory")]
    # Rows of 64 tokens were timed (one step after the warm-ups); 160 was never tried.
    assert result["timed"]["step_times_s"] and result["timed"]["peak_memory_bytes"] is None
    # The process's peak resident host memory so far: never falling along the ladder, at most the peak after it.
    from moe_tune.engine.bench.machine import peak_host_memory

    assert 0 < result["timed"]["peak_host_bytes"] <= result["ladder"][0]["peak_host_bytes"] <= peak_host_memory()
    assert [len(s["ladder"]) for s in snapshots] == [0, 1, 2]
    assert lines[-1] == "none @ 128: out of memory"


def test_ladder_does_not_hide_other_errors(monkeypatch):
    fail_from(monkeypatch, 96, RuntimeError("an illegal memory access was encountered"))
    profile = load_profile("tiny", ["data.corpus_documents=100", "train.micro_batch_size=1"])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sweep_lengths(profile, [96, 128], timed_length=64, timed_steps=1, on_line=lambda line: None)


def test_refuses_without_cuda_and_bad_overrides_in_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from moe_tune.engine.bench import memory_sweep

    monkeypatch.setattr(memory_sweep, "_has_cuda", lambda: False)
    for argv, message in (
        ([str(tmp_path / "out.json")], "needs a CUDA device: it measures peak GPU memory and pinned copies"),
        ([str(tmp_path / "out.json"), "--set", "train.lr=-1"], "train.lr"),
    ):
        with pytest.raises(SystemExit) as exc:
            memory_sweep.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err
        assert err.startswith("python -m moe_tune.engine.bench.memory_sweep: ")
    assert not (tmp_path / "out.json").exists()


# bench-qwen3-next's layer kinds at a width the CPU trains in well under a second a step.
SMALL_BENCH = ["model.hidden_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=1",
               "model.head_dim=32", "model.linear_attention.num_key_heads=2",
               "model.linear_attention.num_value_heads=2", "model.linear_attention.key_head_dim=16",
               "model.linear_attention.value_head_dim=16", "model.moe.num_experts=8", "model.moe.top_k=2",
               "model.moe.expert_intermediate_size=16", "model.moe.shared_expert_intermediate_size=16",
               "model.vocab_size=512", "train.precision=fp32", "data.corpus_documents=100"]  # fmt: skip


def test_json_is_written_after_each_measurement_and_marked_complete_at_the_end(tmp_path, monkeypatch):
    import json

    from moe_tune.engine.bench import memory_sweep

    out = tmp_path / "none.json"
    seen = []
    write_json_atomic = memory_sweep.write_json_atomic

    def recording(path, data):
        write_json_atomic(path, data)
        seen.append(json.loads(path.read_text()))

    monkeypatch.setattr(memory_sweep, "_has_cuda", lambda: True)
    monkeypatch.setattr(memory_sweep, "pinned_copy_bandwidth", lambda: (50.0, 49.0))
    monkeypatch.setattr(memory_sweep, "write_json_atomic", recording)
    monkeypatch.setattr(memory_sweep, "TIMED_LENGTH", 64)
    monkeypatch.setattr(memory_sweep, "TIMED_STEPS", 1)
    fail_from(monkeypatch, 160, torch.OutOfMemoryError("CUDA out of memory"))
    overrides = [arg for item in SMALL_BENCH for arg in ("--set", item)]
    memory_sweep.main([str(out), "none", "--lengths", "96,160", *overrides])
    assert [(s["complete"], len(s["ladder"])) for s in seen] == [(False, 0), (False, 1), (False, 2), (True, 2)]
    final = json.loads(out.read_text())
    assert final == seen[-1] and final["max_trained_length"] == 96
    assert (final["pinned_h2d_gb_per_s"], final["pinned_d2h_gb_per_s"]) == (50.0, 49.0)
    assert final["overrides"] == SMALL_BENCH and final["memory_policy"] == "none"


def test_rung_steps_time_after_the_first(monkeypatch):
    """A rung of several steps reports the median of those after the first; every step's time and loss are kept."""
    times = iter([9.0, 9.0, 9.0, 5.0, 1.0, 2.0, 4.0])  # warm-ups (2) and the timed step, then one rung of 4
    step = StepRunner.step

    def timed(self):
        record = step(self)
        record["step_time_s"] = next(times)
        record["tokens_per_s"] = record["tokens"] / record["step_time_s"]
        return record

    monkeypatch.setattr(StepRunner, "step", timed)
    profile = load_profile("tiny", ["data.corpus_documents=100", "train.micro_batch_size=1"])
    result = sweep_lengths(profile, [96], timed_length=64, timed_steps=1, on_line=lambda line: None, rung_steps=4)
    (rung,) = result["ladder"]
    assert rung["step_times_s"] == [5.0, 1.0, 2.0, 4.0] and len(rung["losses"]) == 4
    assert rung["step_time_s"] == 2.0  # median of 1, 2, 4: the first step's 5 s left out


LADDER = dict(profile="bench-hybrid-1m", memory_policy="max-context", timed_length=32768,
                  timed=dict(tokens_per_s=1000.0, peak_memory_bytes=10**10, peak_host_bytes=3 * 10**10),
                  ladder=[dict(seq_len=65536, outcome="trained", tokens_per_s=900.0, peak_memory_bytes=2 * 10**10,
                               peak_host_bytes=4 * 10**10),
                          dict(seq_len=131072, outcome="out of memory")],
                  machine="NVIDIA H200", commit="abc1234", date="2026-12-02")  # fmt: skip


def test_plot_draws_the_ladder(tmp_path):
    from moe_tune.engine.bench.memory_sweep import plot_ladder

    path = tmp_path / "ladder.png"
    plot_ladder(LADDER, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_failing_mid_write_leaves_the_earlier_one(tmp_path, monkeypatch):
    """The plot is written beside its path and renamed over it: a failure while saving leaves the earlier plot whole
    and no temporary file."""
    from matplotlib.figure import Figure

    from moe_tune.engine.bench.memory_sweep import plot_ladder

    path = tmp_path / "ladder.png"
    path.write_bytes(b"earlier plot")
    savefig = Figure.savefig

    def fails_mid_write(fig, target, **kwargs):
        savefig(fig, target, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", fails_mid_write)
    with pytest.raises(OSError):
        plot_ladder(LADDER, path)
    assert path.read_bytes() == b"earlier plot" and [p.name for p in tmp_path.iterdir()] == ["ladder.png"]


def test_plot_without_matplotlib_is_refused_before_running(tmp_path, capsys, monkeypatch):
    import importlib.util

    from moe_tune.engine.bench import memory_sweep

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name))
    with pytest.raises(SystemExit) as exc:
        memory_sweep.main([str(tmp_path / "out.json"), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--plot" in err and "needs matplotlib" in err
    assert not (tmp_path / "out.json").exists()
