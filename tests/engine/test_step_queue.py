"""The trainer queues step n + 1 before it reads step n's values (engine/train/trainer.py, engine/train/step_values.py):
the order of launches and reads, the steps that are read before the next is queued (the run's first, those before an
eval, a checkpoint or the end, a signal), a stop saving the step in flight, and the values read as they were made."""

import json
import signal

import pytest
import torch

from moe_tune.engine.train import trainer
from moe_tune.engine.train.step_values import StepValues
from moe_tune.engine.train.trainer import finetune
from moe_tune.profiles import load_profile

SMALL = ["data.seq_len=32", "train.micro_batch_size=1", "train.warmup_steps=1", "data.corpus_documents=60",
         "parallel.zero_stage=0"]  # fmt: skip


def small_profile(out, *extra):
    return load_profile("tiny", [*SMALL, f"output.dir={out}", *extra])


def record_order(monkeypatch, on_launch=None):
    """Wrap the loop's launch and its read of each step's values; returns the list of ("launch"|"read", step)."""
    events = []
    launch = trainer._launch_step

    def launching(run, step, watched, is_signalled):
        if on_launch is not None:
            on_launch(step)
        launched = launch(run, step, watched, is_signalled)
        events.append(("launch", step + 1))
        read = launched.values.read

        def reading():
            events.append(("read", step + 1))
            return read()

        launched.values.read = reading
        return launched

    monkeypatch.setattr(trainer, "_launch_step", launching)
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
    values = StepValues({"loss": torch.tensor(2.5), "loads": torch.arange(6.0).view(2, 3), "count": 7,
                         "empty": torch.zeros(0, 3), "index": torch.tensor(3, dtype=torch.long)})  # fmt: skip
    assert values.read() == {"loss": 2.5, "loads": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "count": 7.0, "empty": [],
                             "index": 3.0}  # fmt: skip
    # float64 on the way: counts beyond float32's exact integers stay exact.
    assert StepValues({"tokens": torch.tensor(2**24 + 1)}).read()["tokens"] == 2**24 + 1
