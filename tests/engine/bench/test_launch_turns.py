"""engine/bench/launch_turns.py: a profile's steps under several kernel launches in turns, in one process."""

import os
import statistics
from collections.abc import Callable

import pytest
import torch

from moe_tune.engine.bench import launch_turns
from moe_tune.engine.launch import LAUNCH_ENV
from moe_tune.profiles import load_profile

TINY = ["data.seq_len=32", "train.micro_batch_size=1", "data.corpus_documents=50"]


class FakeRunner:
    """A StepRunner that records, for each step it launches, the launch in force and whether the MoE blocks' graphs
    were let go since the step before (a step's time is its number)."""

    is_cuda = False
    # (runner) -> the error its next launch raises, or None: set by a test.
    fails: Callable[["FakeRunner"], BaseException | None] = staticmethod(lambda runner: None)

    def __init__(self, profile):
        self.launched: list[tuple[str | None, bool]] = []
        self.released = False
        self.closed = False

    def release_graphs(self):
        self.released = True

    def launch(self, behind=None):
        if error := self.fails(self):
            raise error
        self.launched.append((os.environ.get(LAUNCH_ENV), self.released))
        self.released = False
        return len(self.launched)

    def finish(self, number):
        return dict(step_time_s=float(number), tokens_per_s=1.0 / number, loss=float(-number))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_runner(monkeypatch):
    made = []
    monkeypatch.setattr(launch_turns, "StepRunner", lambda profile: made.append(FakeRunner(profile)) or made[-1])
    return made


@pytest.mark.parametrize("before", [None, "causal_conv.block_t=64"])
def test_launches_run_in_turns_forward_then_backward(fake_runner, monkeypatch, before):
    if before is None:
        monkeypatch.delenv(LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(LAUNCH_ENV, before)
    a, b = "causal_conv.block_t=32", "moe_gate_up_fwd.one_dot=true"
    timed = []
    result = launch_turns.compare_launches(load_profile("tiny", TINY), [a, b], rounds=3, steps_per_turn=2, warmup=1,
                                           on_step=lambda launch, record: timed.append(launch))  # fmt: skip
    runner = fake_runner[0]
    # Warm-up: one step under each; then each turn lets go of the graphs, runs one untimed step and two timed ones.
    turns = [None, a, b, b, a, None, None, a, b]
    expected = [(None, True), (a, True), (b, True)]
    for launch in turns:
        expected += [(launch, True), (launch, False), (launch, False)]
    assert runner.launched == expected and runner.closed
    assert timed == [launch for launch in turns for _ in range(2)]
    # Each row holds its own timed steps (the step numbers as times), the defaults first; the variable as before.
    numbers = {None: [], a: [], b: []}
    for position, (launch, _) in enumerate(expected, start=1):
        numbers[launch].append(position)
    rows = result["launches"]
    assert [row["launch"] for row in rows] == [None, a, b]
    for row in rows:
        assert tuple(row) == launch_turns.LAUNCH_KEYS
        turn_steps = [n for n in numbers[row["launch"]][1:] if (n - 4) % 3 != 0]
        assert row["step_times_s"] == [float(n) for n in turn_steps]
        assert row["step_time_s"] == statistics.median(row["step_times_s"]) and len(row["step_times_s"]) == 6
        assert row["losses"] == [-t for t in row["step_times_s"]]
        assert row["device_busy_s"] is None and row["kernels"] is None
    assert os.environ.get(LAUNCH_ENV) == before
    assert list(result) == list(launch_turns.RESULT_KEYS) and result["launch"] == before and result["complete"]


@pytest.mark.parametrize("stop_at, timed_steps", [
    (6, {None: [5, 6], "a": [], "b": []}),  # in the second step of the first turn's timed ones
    (12, {None: [5, 6], "a": [8, 9], "b": [11, 12]}),  # in the last step of the first round
])  # fmt: skip
def test_a_stop_after_the_warm_up_keeps_the_steps_timed(fake_runner, monkeypatch, stop_at, timed_steps):
    # SIGINT (a time limit) while the step numbered stop_at + 1 is launched: the steps read until then are kept.
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    monkeypatch.setattr(FakeRunner, "fails", staticmethod(
        lambda runner: KeyboardInterrupt() if len(runner.launched) == stop_at else None))  # fmt: skip
    with pytest.raises(launch_turns.TurnsStopped) as stopped:
        launch_turns.compare_launches(load_profile("tiny", TINY), ["a", "b"], rounds=2, steps_per_turn=2, warmup=1)
    result = stopped.value.result
    assert result["complete"] is False and list(result) == list(launch_turns.RESULT_KEYS)
    for row in result["launches"]:
        steps = [float(n) for n in timed_steps[row["launch"]]]
        assert row["step_times_s"] == steps
        assert row["step_time_s"] == (statistics.median(steps) if steps else None)
    assert LAUNCH_ENV not in os.environ and fake_runner[0].closed


def test_a_stop_in_the_warm_up_keeps_nothing(fake_runner, monkeypatch):
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    monkeypatch.setattr(FakeRunner, "fails", staticmethod(lambda runner: KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt) as stopped:
        launch_turns.compare_launches(load_profile("tiny", TINY), ["a"], rounds=1, warmup=1)
    assert not isinstance(stopped.value, launch_turns.TurnsStopped) and fake_runner[0].closed


def test_a_kernel_that_cannot_run_under_a_launch_names_it(fake_runner, monkeypatch):
    from triton.runtime.errors import OutOfResources

    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    launch = "moe_down_fwd.block_n=512"
    monkeypatch.setattr(FakeRunner, "fails", staticmethod(
        lambda runner: OutOfResources(300000, 232448, "shared memory") if os.environ.get(LAUNCH_ENV) == launch
        else None))  # fmt: skip
    with pytest.raises(launch_turns.LaunchFailed) as failed:
        launch_turns.compare_launches(load_profile("tiny", TINY), [launch], rounds=1, warmup=1)
    assert failed.value.launch == launch and isinstance(failed.value.error, OutOfResources)
    assert LAUNCH_ENV not in os.environ and fake_runner[0].closed


def test_kernel_changes_rank_by_the_largest_change():
    defaults = dict(kernels=[dict(kernel="a", time_s=1.0), dict(kernel="b", time_s=2.0), dict(kernel="c", time_s=0.5)])
    other = dict(kernels=[dict(kernel="a", time_s=1.5), dict(kernel="b", time_s=1.0), dict(kernel="d", time_s=0.2)])
    changes = launch_turns.kernel_changes(defaults, other, count=3)
    assert [(c["kernel"], c["change_s"]) for c in changes] == [("b", -1.0), ("a", 0.5), ("c", -0.5)]
    assert launch_turns.kernel_changes(dict(kernels=None), other) == []


@pytest.mark.parametrize("copy, memset", [("memcpy128", "memset32"), ("memcpy32", "memset8")])
def test_kernel_changes_count_a_graphs_copies_and_memsets_as_one_kind(copy, memset):
    # One instantiation of a graph ran its copies and memsets on the copy engine, the other as the driver's kernels:
    # only the copies' real change (+0.1) is reported, beside a kernel whose name merely contains "memcpy".
    engine_copy, engine_memset = "Memcpy DtoD (Device -> Device)", "Memset (Device)"
    defaults = dict(kernels=[dict(kernel=engine_copy, time_s=0.4), dict(kernel=copy, time_s=0.2),
                             dict(kernel=engine_memset, time_s=0.3), dict(kernel="my_memcpy128_kernel", time_s=1.0)])
    other = dict(kernels=[dict(kernel=engine_copy, time_s=0.7), dict(kernel=memset, time_s=0.3),
                          dict(kernel="my_memcpy128_kernel", time_s=0.5)])  # fmt: skip
    changes = launch_turns.kernel_changes(defaults, other)
    assert [(c["kernel"], round(c["change_s"], 9)) for c in changes] == [
        ("my_memcpy128_kernel", -0.5), ("device-to-device copies", 0.1), ("memsets", 0.0)
    ]


def test_real_steps_of_the_tiny_profile_under_two_launches(monkeypatch):
    # The StepRunner itself: one untimed and one timed step a launch, no warm-up (the CPU runs the references).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    result = launch_turns.compare_launches(load_profile("tiny", TINY), ["causal_conv.block_t=32"], rounds=1,
                                           steps_per_turn=1, warmup=0)  # fmt: skip
    rows = result["launches"]
    assert [row["launch"] for row in rows] == [None, "causal_conv.block_t=32"]
    assert all(len(row["step_times_s"]) == 1 and row["step_time_s"] > 0 and row["tokens_per_s"] > 0 for row in rows)
    assert result["device"] == "cpu" and LAUNCH_ENV not in os.environ
