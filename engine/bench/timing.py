"""The benchmarks' timers. Anything on CUDA: median_ms, the median of triton.testing.do_bench, or of a few calls for a
step too slow for do_bench's repetitions (every GPU time a benchmark reports goes through it). Ops: median_ms over a
forward (recording autograd, as in training) or a forward and its backward, and the extra peak memory of one more
call on its own (time_pass); on the CPU time.perf_counter medians (time_ms). Training steps (run_steps): queued as
the trainer queues them, each timed on the device's timeline from the end of the step before it
(engine/train/step_values); a block timed alone: wall time with the device synchronized at both ends (StepClock)."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

# CPU timing: one warm-up call, then repeats until this much time is spent (at least MIN, at most MAX repeats), so
# that `--shapes small` stays within a few seconds in all on 2 busy cores.
CPU_WARMUP_CALLS = 1
CPU_TIME_BUDGET_S = 0.1
CPU_MIN_REPEATS = 3
CPU_MAX_REPEATS = 20
# CUDA: a step at least this slow (one call after a warm-up call) is timed by SLOW_STEP_CALLS calls in all instead of
# do_bench, whose estimate alone runs it 5 times: the references and naive baselines at the anchor shapes take
# 0.1-4 s a call, and their do_bench repetitions took most of `moe-tune profile --kernels --shapes anchor`'s time.
SLOW_STEP_MS = 50.0
SLOW_STEP_CALLS = 3


def median_ms(step: Callable[[], object], leaves: list[torch.Tensor] | None = None, rep_ms: int | None = None) -> float:
    """The median ms of step() on CUDA after a warm-up call: triton.testing.do_bench's (L2 flushed before each call;
    rep_ms: how long to repeat, do_bench's default when None), or for a step of SLOW_STEP_MS or more the median of
    SLOW_STEP_CALLS calls (no flush: the L2 is nothing at that length). The leaves' gradients are cleared before each
    timed call."""
    from triton.testing import do_bench

    step()
    first_ms = call_ms(step, leaves)
    if first_ms >= SLOW_STEP_MS:
        return statistics.median([first_ms, *(call_ms(step, leaves) for _ in range(SLOW_STEP_CALLS - 1))])
    options = {} if rep_ms is None else {"rep": rep_ms}
    return do_bench(step, grad_to_none=leaves, return_mode="median", **options)


def call_ms(step: Callable[[], object], leaves: list[torch.Tensor] | None = None) -> float:
    """ms of one call of step() on CUDA (events around it, the device idle before), the leaves' gradients cleared
    first."""
    for leaf in leaves or ():
        leaf.grad = None
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def extra_peak_bytes(step: Callable[[], object], leaves: list[torch.Tensor]) -> int:
    """The most one call of step() allocates above what was allocated before it (the leaves' gradients cleared
    first): neither the inputs nor do_bench's 256 MB cache-flush buffer count."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for leaf in leaves:
        leaf.grad = None
    return peak


def pass_step(fn: Callable[[], torch.Tensor], with_backward: bool) -> tuple[torch.Tensor, Callable[[], None]]:
    """(the output of one untimed forward under no_grad, the pass to time): fn() recording autograd, as in training,
    and with_backward a backward from a random output gradient drawn once."""
    with torch.no_grad():
        out = fn()
    grad_out = torch.randn_like(out)

    def step() -> None:
        y = fn()
        if with_backward:
            y.backward(grad_out)

    return out, step


def time_pass(
    fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], with_backward: bool
) -> tuple[float, int, torch.Tensor]:
    """(median ms, extra peak bytes, forward output) of fn(), or of fn() and a backward from a random output
    gradient; the output is that of one untimed forward under no_grad."""
    out, step = pass_step(fn, with_backward)
    ms = median_ms(step, leaves)
    return ms, extra_peak_bytes(step, leaves), out


def time_ms(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], with_backward: bool, is_cuda: bool):
    """(median ms, peak bytes or None) of fn() (autograd recording), or of fn() and a backward from a random grad:
    on CUDA time_pass (do_bench, and the extra peak of one call); on the CPU time.perf_counter medians."""
    if is_cuda:
        ms, peak, _ = time_pass(fn, leaves, with_backward)
        return ms, peak
    _, step = pass_step(fn, with_backward)
    for _ in range(CPU_WARMUP_CALLS):
        step()
    times, spent = [], 0.0
    while len(times) < CPU_MIN_REPEATS or (spent < CPU_TIME_BUDGET_S and len(times) < CPU_MAX_REPEATS):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        spent += times[-1] * 1e-3
    return statistics.median(times), None


class StepClock:
    """`with StepClock(is_cuda) as clock: ...` then clock.seconds: the block's wall time, the device synchronized
    before the start and before the stop so that it holds every kernel the block launched."""

    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda
        self.seconds: float | None = None

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> StepClock:
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # A failed block has no time (and a synchronize could raise over its error).
        if exc_type is None:
            self._sync()
            self.seconds = time.perf_counter() - self._start


def timed_steps(all_records: list[dict], warmup: int, peak_memory_bytes: int | None) -> dict:
    """The row fields of a run's timed steps (the records after `warmup`): their count and losses, the first
    step's loss (warm-up included), tokens/s and step time as medians, every step time, and the peak given."""
    records = all_records[warmup:]
    return dict(
        steps=len(records),
        losses=[r["loss"] for r in records],
        first_step_loss=all_records[0]["loss"],
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
        step_time_s=statistics.median(r["step_time_s"] for r in records),
        step_times_s=[r["step_time_s"] for r in records],
        peak_memory_bytes=peak_memory_bytes,
    )


@dataclass
class QueuedStep:
    """A step StepRunner.launch queued: its label tokens and document pieces (host), its loss on its way to the host
    (StepValues, which times it) and the memory policy's metrics."""

    tokens: int
    pieces: list[int]
    values: Any
    memory_metrics: dict | None


def run_steps(runner, count: int, on_record: Callable[[int, dict], None], before_launch=None) -> None:
    """`count` steps of `runner` (StepRunner or the --against baseline's runner: launch(behind) / finish()) queued as
    the trainer queues them: the first launched on an idle device, each next one before the step ahead of it is read.
    A step's time runs on the device's timeline from the end of the step before it (from its launch for the first:
    StepValues.seconds), so it holds the step's work and any wait for the host's launches, and none of the host's
    reads. on_record(i, record) follows each step's read; before_launch(i) precedes each launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ahead = None
    for index in range(count):
        if before_launch is not None:
            before_launch(index)
        try:
            queued = runner.launch(behind=ahead)
        except BaseException:
            # The step ahead has run: it is read and kept before the launch's error (out of memory, a stop) goes on.
            if ahead is not None:
                with contextlib.suppress(Exception):
                    on_record(index - 1, runner.finish(ahead))
            raise
        if ahead is not None:
            on_record(index - 1, runner.finish(ahead))
        ahead = queued
    if ahead is not None:
        on_record(count - 1, runner.finish(ahead))
