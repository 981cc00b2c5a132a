"""The causal conv launch sweep (engine/bench/causal_conv_sweep.py): its candidates, the combination of the best
forward and backward, that a candidate reaches the forward and the backward keeps it, its whole loop on the
interpreter (the check against the fp64 reference, a wrong launch caught, timings summarised), and its command line.
The timings themselves need a CUDA device."""

import dataclasses
import itertools

import pytest
from kernel_fixtures import forced_kernel_path, record_launches
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    import torch
    from moe_tune.engine.bench import causal_conv_sweep as sweep
    from moe_tune.ops.causal_conv import autograd, kernels, kernels_heads
    from moe_tune.ops.causal_conv.kernels import DEFAULT_LAUNCH, ConvLaunch
    from moe_tune.ops.common.launch import LAUNCH_ENV

pytestmark = pytest.mark.usefixtures("interpreter_scalar_index")

kernel_path = forced_kernel_path(kernels_heads, "_conv_heads_fwd_kernel", on_gpu=False)

# Two key heads of 16, four value heads of 8: 96 channels; rows of 40 and (check) 30 tokens.
SMALL_SHAPE = dict(tokens=40, document=15, key_heads=2, value_heads=4, key_dim=16, value_dim=8, width=4)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(sweep, "SHAPE", SMALL_SHAPE)
    monkeypatch.setattr(sweep, "CHECK_LENGTHS", (1, 9, 20))
    # pick_launch's own launch, whatever the environment names.
    monkeypatch.setenv(LAUNCH_ENV, "")


def test_candidates_start_with_pick_launch_and_each_changes_a_launch():
    candidates = sweep.sweep_candidates()
    assert candidates[0] == {}
    launches = [dataclasses.replace(DEFAULT_LAUNCH, **overrides) for overrides in candidates]
    assert all(launch != DEFAULT_LAUNCH for launch in launches[1:])
    assert len(set(launches)) == len(launches)
    for launch in launches:
        for size in (launch.block_t, launch.block_c, launch.grad_block_t, launch.grad_block_c):
            assert size >= 16 and size & (size - 1) == 0, launch


def test_combination_takes_the_forward_fields_of_one_and_the_backward_fields_of_the_other():
    forward = {"block_t": 128, "num_warps": 8, "grad_block_t": 32}
    backward = {"block_c": 64, "one_pass_backward": True, "grad_block_c": 64}
    assert sweep.combine(forward, backward) == {"block_t": 128, "num_warps": 8, "one_pass_backward": True,
                                                "grad_block_c": 64}  # fmt: skip
    # Every ConvLaunch field is the forward's or the backward's.
    fields = {f.name for f in dataclasses.fields(ConvLaunch)}
    assert set(sweep.FORWARD_FIELDS) < fields
    everything = dict.fromkeys(fields, 1)
    assert sweep.combine(everything, {}) == dict.fromkeys(sweep.FORWARD_FIELDS, 1)
    assert sweep.combine({}, everything) == dict.fromkeys(fields - set(sweep.FORWARD_FIELDS), 1)


def test_best_rows_are_the_shortest_forward_and_backward_of_the_timed_rows():
    rows = [{"config": {}, "fwd_ms": 2.0, "bwd_ms": 5.0}, {"config": {"a": 1}, "error": "x"},
            {"config": {"b": 1}, "fwd_ms": 1.0, "bwd_ms": 6.0}, {"config": {"c": 1}, "fwd_ms": 3.0, "bwd_ms": 4.0}]
    assert sweep.best_rows(rows) == (rows[2], rows[3])
    assert sweep.best_rows([{"config": {}, "error": "x"}]) == (None, None)


def test_the_forwards_launch_reaches_the_backward(kernel_path, small, monkeypatch):
    inputs, positions, grads = sweep.make_inputs([5, 12], torch.float32, "cpu")
    launched = record_launches(monkeypatch, kernels_heads, (
        "_conv_heads_fwd_kernel", "_conv_heads_bwd_kernel", "_conv_heads_bwd_one_pass_kernel"))  # fmt: skip
    chosen = autograd.pick_launch
    with sweep.launched_with(ConvLaunch(one_pass_backward=True)):
        out = sweep._conv(inputs, positions)
    assert autograd.pick_launch is chosen

    def refuse(_x):
        raise AssertionError("the backward picked a launch of its own")

    monkeypatch.setattr(autograd, "pick_launch", refuse)
    torch.autograd.backward(out, grads)
    assert launched == ["_conv_heads_fwd_kernel", "_conv_heads_bwd_one_pass_kernel"]


def _fake_timer(monkeypatch):
    """median_ms that runs the step once and answers 1, 2, 3, ... ms in turn."""
    counter = itertools.count(1)

    def median_ms(step, leaves=None, rep_ms=None):
        step()
        return float(next(counter))

    monkeypatch.setattr(sweep, "median_ms", median_ms)


def test_sweep_checks_times_and_compares_every_candidate(kernel_path, small, monkeypatch):
    _fake_timer(monkeypatch)
    candidates = [{}, {"one_pass_backward": True, "grad_block_t": 16}, {"block_c": 32}]
    seen = []
    rows = sweep.sweep(candidates, rounds=2, device="cpu", progress=lambda rows: seen.append(
        [dict(row) for row in rows]))  # fmt: skip
    assert [row["config"] for row in rows] == candidates
    # What a run stopped midway has written: each check, then each turn's timings so far.
    assert [len(snapshot) for snapshot in seen] == [1, 2, 3, 3, 3]
    assert "fwd_ms" not in seen[2][0] and seen[4] == rows
    assert [(row["fwd_ms"], row["fwd_bwd_ms"], row["vs_default"]) for row in seen[3]] == [
        (1, 2, 1.0), (3, 4, 2.0), (5, 6, 3.0)]  # fmt: skip
    for row in rows:
        assert row["wrong"] == [] and set(row["errors"]) == set(sweep.NAMES)
        # bf16 inputs against fp64: one rounding of each output.
        assert max(row["errors"].values()) < 1e-2, row
    # Turn 1 times candidates 1..3 as (1, 2), (3, 4), (5, 6); turn 2 as (7, 8), (9, 10), (11, 12).
    assert [(row["fwd_ms"], row["fwd_bwd_ms"], row["bwd_ms"]) for row in rows] == [(4, 5, 1), (6, 7, 1), (8, 9, 1)]
    assert [row["fwd_spread_ms"] for row in rows] == [6, 6, 6]
    assert [row["vs_default"] for row in rows] == [1.0, round(7 / 5, 4), round(9 / 5, 4)]


def test_sweep_marks_a_wrong_launch_and_does_not_time_it(kernel_path, small, monkeypatch):
    _fake_timer(monkeypatch)
    monkeypatch.setattr(kernels_heads, "_conv_heads_bwd_one_pass_kernel", _dx_doubled_kernel())
    rows = sweep.sweep([{}, {"one_pass_backward": True}], rounds=1, device="cpu")
    assert rows[0]["wrong"] == [] and "fwd_ms" in rows[0]
    assert set(rows[1]["wrong"]) == {"dq", "dk", "dv"} and "fwd_ms" not in rows[1] and "vs_default" not in rows[1]


def _dx_doubled_kernel():
    """The one-pass backward kernel, then dx doubled in place: a wrong launch the check must catch."""
    kernel = kernels_heads._conv_heads_bwd_one_pass_kernel

    class Doubled:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kernel[grid](*args, **kwargs)
                for dx in args[8:11]:
                    dx.mul_(2)

            return launch

    return Doubled()


@pytest.mark.parametrize(
    "argv, message",
    [(["o.json", "--rounds", "0"], "argument --rounds: '0': must be positive"),
     (["o.json", "--rounds", "two"], "argument --rounds: 'two': must be an integer"),
     ([], "the following arguments are required: out")],
)  # fmt: skip
def test_bad_options_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def test_a_missing_output_folder_or_no_cuda_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "absent" / "o.json"
    with pytest.raises(SystemExit) as exc:
        sweep.main([str(missing)])
    assert exc.value.code == 2 and capsys.readouterr().err == f"{missing}: its folder does not exist\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        sweep.main([str(tmp_path / "o.json")])
    assert exc.value.code == 2 and capsys.readouterr().err == "needs a CUDA device: it times kernels\n"
    assert not (tmp_path / "o.json").exists()
