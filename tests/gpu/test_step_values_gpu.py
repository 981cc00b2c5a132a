"""A step's values on their way to the host (engine/train/step_values.py) on CUDA: read as the device tensors hold
them when they were taken, and read without waiting for the work queued after them; steps queued back to back timed
on the device's timeline, each holding its own work. Run with pytest -m gpu tests/gpu."""

import time

import pytest
import torch

from moe_tune.engine.train.step_values import StepValues, launch_clock

pytestmark = pytest.mark.gpu


def test_values_are_read_as_taken_without_waiting_for_later_work():
    x = torch.randn(4096, 4096, device="cuda")
    loss = x[0, 0] * 2
    loads = x[:2, :3].clone()
    expected = {"loss": loss.item(), "loads": loads.double().tolist(), "count": 5.0, "host": [1.0, 2.0]}
    values = StepValues({"loss": loss, "loads": loads, "count": 5, "host": torch.tensor([1, 2])},
                        launch_clock(torch.device("cuda")))
    # Changed after they were taken: the read sees the values of that moment.
    loads.add_(1.0)
    # Far more work queued behind the copy than a read takes (fp32 GEMMs of 137 GFLOP each).
    for _ in range(100):
        x = x @ x / 64.0
    queued = torch.cuda.Event()
    queued.record()
    read = values.read()
    assert not queued.query(), "the read waited for the work queued after the values"
    assert read == expected
    torch.cuda.synchronize()


def cycles_per_ms() -> float:
    """The clock cycles torch.cuda._sleep spins in a millisecond, counted once by timing a spin with events (called
    before a test's timed part: it waits for the device)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = 50_000_000 / start.elapsed_time(end)
    return _CYCLES_PER_MS


def device_work(ms: float, per_ms: float) -> None:
    """About `ms` of device time in one kernel (torch.cuda._sleep spins for `per_ms` cycles a millisecond)."""
    torch.cuda._sleep(int(ms * per_ms))


_CYCLES_PER_MS = None


def test_queued_steps_are_timed_by_their_own_device_work():
    cuda = torch.device("cuda")
    work_ms = [30.0, 60.0, 15.0, 45.0]
    per_ms = cycles_per_ms()
    torch.cuda.synchronize()
    began = time.perf_counter()
    ahead, seconds = None, []
    for ms in work_ms:
        start = launch_clock(cuda, ahead)
        device_work(ms, per_ms)
        values = StepValues({"loss": torch.ones((), device=cuda)}, start)
        # As the trainer: the step ahead is read once this one is queued.
        if ahead is not None:
            ahead.read()
            seconds.append(ahead.seconds())
        ahead = values
    ahead.read()
    seconds.append(ahead.seconds())
    wall = time.perf_counter() - began
    # Each step's time is its own work (the host queued ahead, so no step waited for a launch), not the interval
    # between the host's reads; together they are the window's wall time, less the first launch's host time.
    for got, ms in zip(seconds, work_ms):
        assert got == pytest.approx(ms * 1e-3, rel=0.2), (seconds, work_ms)
    assert sum(seconds) <= wall and sum(seconds) == pytest.approx(wall, abs=5e-3)


def test_a_step_launched_on_an_idle_device_holds_its_launch():
    cuda = torch.device("cuda")
    per_ms = cycles_per_ms()
    torch.cuda.synchronize()
    start = launch_clock(cuda)
    time.sleep(0.05)  # the host's launch: the device idles
    device_work(20.0, per_ms)
    values = StepValues({"loss": torch.ones((), device=cuda)}, start)
    values.read()
    assert values.seconds() == pytest.approx(0.07, abs=0.01)


def test_the_host_launch_is_told_apart_from_the_device_work():
    # A step whose device work outlasts its launch: launch_seconds is the host's part, seconds the device's.
    cuda = torch.device("cuda")
    per_ms = cycles_per_ms()
    torch.cuda.synchronize()
    start = launch_clock(cuda)
    device_work(40.0, per_ms)
    values = StepValues({"loss": torch.ones((), device=cuda)}, start)
    launched = values.launch_seconds()
    values.read()
    assert launched < 0.01 and values.seconds() == pytest.approx(0.04, rel=0.2)
