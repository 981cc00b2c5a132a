"""The benchmarks' timers. Ops on CUDA: the median of triton.testing.do_bench over a forward (recording autograd, as
in training) or a forward and its backward, and the extra peak memory of one more call on its own (time_pass).
Training steps: wall time with the device synchronized at both ends (StepClock)."""

from __future__ import annotations

import time
from typing import Callable

import torch


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


def time_pass(
    fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], with_backward: bool
) -> tuple[float, int, torch.Tensor]:
    """(median ms, extra peak bytes, forward output) of fn(), or of fn() and a backward from a random output
    gradient; the output is that of one untimed forward under no_grad."""
    from triton.testing import do_bench

    with torch.no_grad():
        out = fn()
    grad_out = torch.randn_like(out)

    def step() -> None:
        y = fn()
        if with_backward:
            y.backward(grad_out)

    ms = do_bench(step, grad_to_none=leaves, return_mode="median")
    return ms, extra_peak_bytes(step, leaves), out


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
