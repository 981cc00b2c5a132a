"""The trainer queues step n + 1 before it reads step n's values (engine/train/trainer.py, engine/train/step_values.py):
the order of launches and reads, the steps that are read before the next is queued (the run's first, those before an
eval, a checkpoint or the end, a signal), a stop saving the step in flight, the values read as they were made, and
each step's time its own; the benchmark's steps queued the same way (engine/bench/timing.run_steps)."""

import itertools
import json
import signal

import pytest
import torch

from moe_tune.engine.bench.timing import QueuedStep, run_steps
from moe_tune.engine.train import step_values, trainer
from moe_tune.engine.train.step_values import StepValues, launch_clock
from moe_tune.engine.train.trainer import finetune
from moe_tune.profiles import load_profile

SMALL = ["data.seq_len=32", "train.micro_batch_size=1", "train.warmup_steps=1", "data.corpus_documents=60",
         "parallel.zero_stage=0"]  # fmt: skip


def small_profile(out, *extra):
    return load_profile("tiny", [*SMALL, f"output.dir={out}", *extra])


def record_order(monkeypatch, on_launch=None):
    """Wrap the loop's launch and its read of each step's values; returns the list of ("launch"|"read", step)."""
    events = []
    launch = trainer.launch_step

    def launching(run, step, watched, is_signalled, behind):
        if on_launch is not None:
            on_launch(step)
        launched = launch(run, step, watched, is_signalled, behind)
        events.append(("launch", step + 1))
        read = launched.values.read

        def reading():
            events.append(("read", step + 1))
            return read()

        launched.values.read = reading
        return launched

    monkeypatch.setattr(trainer, "launch_step", launching)
    return events


def expected_order(total, waits_after):
    """Launches and reads of steps 1..total when the steps in `waits_after` (and the first and last) are read before
    the next launch and every other step is read after it."""
    events, pending = [], None
    for step in range(1, total + 1):
        events.append(("launch", step))
        if pending is not None:
            events.append(("read", pending))
            pending = None
        if step == 1 or step == total or step in waits_after:
            events.append(("read", step))
        else:
            pending = step
    return events


@pytest.mark.parametrize("extra, waits_after", [
    ((), set()),  # checkpoints at the end only: every middle step is read after the next is queued
    (("output.save_every=3",), {3, 6}),  # a checkpoint after steps 3 and 6: nothing queued past them
])  # fmt: skip
def test_each_step_is_read_after_the_next_is_queued_except_before_a_checkpoint(tmp_path, monkeypatch, extra,
                                                                               waits_after):
    events = record_order(monkeypatch)
    result = finetune(small_profile(tmp_path, "train.steps=7", *extra), show_progress=False)
    assert events == expected_order(7, waits_after)
    records = [json.loads(line) for line in result.metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert all(r["step_time_s"] > 0 and r["tokens"] > 0 for r in records)


def test_evals_are_waited_for(tmp_path, monkeypatch):
    events = record_order(monkeypatch)
    finetune(small_profile(tmp_path / "out", "train.steps=5", "train.eval_every=2", "data.eval_fraction=0.2"),
             show_progress=False)  # fmt: skip
    assert events == expected_order(5, {2, 4})


def test_queued_losses_equal_the_ones_read_at_once(tmp_path, monkeypatch):
    # The same run with every step read before the next is queued: the same losses, gradient norms and loads.
    queued = finetune(small_profile(tmp_path / "queued", "train.steps=4"), show_progress=False)
    monkeypatch.setattr(trainer, "_queues_the_next_step", lambda *args: False)
    at_once = finetune(small_profile(tmp_path / "at_once", "train.steps=4"), show_progress=False)
    keys = ("loss", "aux_loss", "grad_norm", "expert_load_max_over_mean", "dropped_token_slots", "tokens")
    rows = [[{k: json.loads(line)[k] for k in keys} for line in r.metrics.read_text().splitlines()]
            for r in (queued, at_once)]  # fmt: skip
    assert rows[0] == rows[1]


@pytest.mark.parametrize("signal_at", [2, 3])
def test_a_signal_saves_the_step_in_flight_and_stops(tmp_path, monkeypatch, signal_at):
    # SIGINT as step `signal_at` is launched: that step is read (after the step before it, when that one was still
    # queued), saved, and the run stops; the checkpoint is the last step in metrics.jsonl.
    def on_launch(step):
        if step + 1 == signal_at:
            signal.raise_signal(signal.SIGINT)

    events = record_order(monkeypatch, on_launch)
    result = finetune(small_profile(tmp_path, "train.steps=8"), show_progress=False)
    assert result.interrupted_by == "SIGINT"
    last = result.last_step
    assert last == signal_at and events[-1] == ("read", last) and ("launch", last + 1) not in events
    records = [json.loads(line) for line in result.metrics.read_text().splitlines()]
    assert records[-1]["step"] == last == json.loads((result.checkpoint / "trainer_state.json").read_text())["step"]


def test_step_values_read_as_made():
    cpu = torch.device("cpu")
    values = StepValues({"loss": torch.tensor(2.5), "loads": torch.arange(6.0).view(2, 3), "count": 7,
                         "empty": torch.zeros(0, 3), "index": torch.tensor(3, dtype=torch.long)},
                        launch_clock(cpu))  # fmt: skip
    assert values.read() == {"loss": 2.5, "loads": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "count": 7.0, "empty": [],
                             "index": 3.0}  # fmt: skip
    # float64 on the way: counts beyond float32's exact integers stay exact.
    assert StepValues({"tokens": torch.tensor(2**24 + 1)}, launch_clock(cpu)).read()["tokens"] == 2**24 + 1


class FakeClock:
    """step_values' `time`: perf_counter returns `now`, which a test moves."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_a_cpu_step_is_timed_from_its_launch_to_its_launch_end(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_values, "time", clock)
    cpu = torch.device("cpu")
    first = StepValues({"loss": 1.0}, launch_clock(cpu))
    # Queued behind `first` or not: on the CPU `first` ended before this launch began.
    alone, queued = launch_clock(cpu), launch_clock(cpu, first)
    clock.now += 2.5  # the step's work, which the CPU runs as it is launched
    seconds = [StepValues({"loss": 1.0}, start) for start in (alone, queued)]
    clock.now += 7.0  # the host's later work (the next launch, the read) is not the step's
    for second in seconds:
        second.read()
        assert second.seconds() == second.launch_seconds() == 2.5


@pytest.mark.parametrize("extra", [(), ("output.save_every=3",)])
def test_each_record_times_its_own_step(tmp_path, monkeypatch, extra):
    # Step n's work takes n seconds of a fake clock (its one micro-step): each record says n, queued or not; a record
    # timed from the host's reads would hold the next step's launch instead.
    clock = FakeClock()
    monkeypatch.setattr(step_values, "time", clock)
    micro_step = trainer.micro_step
    seconds = itertools.count(1)

    def timed_micro_step(*args, **kwargs):
        out = micro_step(*args, **kwargs)
        clock.now += next(seconds)
        return out

    monkeypatch.setattr(trainer, "micro_step", timed_micro_step)
    result = finetune(small_profile(tmp_path, "train.steps=6", *extra), show_progress=False)
    records = [json.loads(line) for line in result.metrics.read_text().splitlines()]
    assert [r["step_time_s"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [r["tokens_per_s"] for r in records] == [r["tokens"] / r["step_time_s"] for r in records]


class RecordingRunner:
    """A runner for timing.run_steps: logs each launch (with the step it was queued behind) and each finish."""

    def __init__(self):
        self.events = []

    def launch(self, behind=None):
        index = sum(1 for e in self.events if e[0] == "launch")
        values = StepValues({"loss": float(index)}, launch_clock(torch.device("cpu")))
        queued = QueuedStep(tokens=10, pieces=[10], values=values, memory_metrics=None)
        self.events.append(("launch", index, behind))
        return queued

    def finish(self, queued):
        loss = queued.values.read()["loss"]
        self.events.append(("finish", int(loss), None))
        return {"loss": loss}


@pytest.mark.parametrize("count", [1, 2, 5])
def test_benchmark_steps_are_queued_as_the_trainer_queues_them(count):
    runner, records, launches = RecordingRunner(), [], []
    run_steps(runner, count, lambda i, record: records.append((i, record["loss"])), before_launch=launches.append)
    assert records == [(i, float(i)) for i in range(count)]
    assert launches == list(range(count))
    order = [(kind, index) for kind, index, _ in runner.events]
    # The first launched alone, each next one before the step ahead of it is read, the last read at the end.
    expected = [("launch", 0)]
    for i in range(1, count):
        expected += [("launch", i), ("finish", i - 1)]
    assert order == expected + [("finish", count - 1)]
    behinds = [behind for kind, _, behind in runner.events if kind == "launch"]
    assert behinds[0] is None
    for i in range(1, count):
        # Queued behind the step launched just before it, which its time then runs from.
        assert behinds[i] is not None and behinds[i].values.read()["loss"] == float(i - 1)


def test_a_failed_launch_keeps_the_step_ahead_of_it():
    # Out of memory in step 3's launch: step 2, queued and run, is still read and recorded before the error goes on.
    runner, records = RecordingRunner(), []
    launch = runner.launch

    def failing(behind=None):
        if len([e for e in runner.events if e[0] == "launch"]) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return launch(behind)

    runner.launch = failing
    with pytest.raises(torch.OutOfMemoryError):
        run_steps(runner, 5, lambda i, record: records.append((i, record["loss"])))
    assert records == [(0, 0.0), (1, 1.0)]


class FakeDevice:
    """A device timeline for step_values' CUDA path on the CPU: events take the timeline's time when recorded."""

    def __init__(self):
        self.now = 0.0
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                self.enable_timing, self.t = enable_timing, None

            def record(self):
                self.t = device.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                assert self.enable_timing and end.enable_timing
                return (end.t - self.t) * 1e3

        self.Event = Event


def test_a_cuda_step_runs_from_the_end_of_the_step_it_is_queued_behind(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(step_values.torch.cuda, "Event", device.Event)
    cuda = torch.device("cuda")
    start = launch_clock(cuda)  # at 0
    device.now = 3.0
    first = StepValues({"loss": 1.0}, start)  # the first step's work ends at 3
    device.now = 5.0  # the device waits for the host until 5, when the second step's launch begins
    queued, alone = launch_clock(cuda, first), launch_clock(cuda)
    device.now = 8.0
    # Both end at 8. Queued behind the first: from its end, the wait for the host included; launched after it was
    # read: from its own start.
    seconds = [StepValues({"loss": 2.0}, start).seconds() for start in (queued, alone)]
    assert first.seconds() == 3.0 and seconds == [5.0, 3.0]
