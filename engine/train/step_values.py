"""A training step's device values, read on the host after the next step is queued.

A step ends with values the host needs (the loss, the gradient norm, the expert loads, whether a weight went
non-finite; on several ranks the token counts and the stop vote). Read where they are made, the host waits at
every step's end until the GPU has run all it was given, and the next step starts on an idle device whose first
kernels then run at the host's launch pace. Here they are gathered into one float64 vector and copied to page-locked
host memory without waiting; `read()` waits for that copy alone (its event), which the trainer calls once the
next step's work is queued (engine/train/trainer.py's loop).
"""

from __future__ import annotations

import math
import time

import torch


class StepValues:
    """Named values of one step (tensors of any shape, or Python numbers), the device's on their way to the host.

    values: name -> tensor or number. CUDA tensors are flattened into one float64 vector (integer counts stay exact
    up to 2**53) copied to the host without waiting; CPU tensors and numbers are host values already, read at once."""

    def __init__(self, values: dict[str, torch.Tensor | float | int]):
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._ready: dict = {}
        parts = []
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                self._shapes[name] = tuple(value.shape)
                parts.append(value.detach().reshape(-1).to(torch.float64))
            elif isinstance(value, torch.Tensor):
                self._ready[name] = _nested(value.detach().reshape(-1).double().tolist(), tuple(value.shape))
            else:
                self._ready[name] = float(value)
        self._event = None
        self._host = None
        if parts:
            flat = torch.cat(parts)
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> dict:
        """Every value as a Python number (scalars) or nested lists (tensors), after waiting for its copy alone."""
        out = dict(self._ready)
        if self._host is None:
            return out
        self._event.synchronize()
        flat = self._host.tolist()
        start = 0
        for name, shape in self._shapes.items():
            size = math.prod(shape)
            out[name] = _nested(flat[start : start + size], shape)
            start += size
        return out


def _nested(values: list[float], shape: tuple[int, ...]):
    """A flat row-major list as a number (shape ()) or nested lists of `shape`."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    inner = math.prod(shape[1:])
    return [_nested(values[i * inner : (i + 1) * inner], shape[1:]) for i in range(shape[0])]


def launch_clock() -> float:
    """The moment a step's launch begins (time.perf_counter), for step_time."""
    return time.perf_counter()


def step_time(started: float, previous_ready: float | None) -> tuple[float, float]:
    """(the step's time, now) for a step whose values were just read: from its launch (`started`), or from the step
    before's values reaching the host (`previous_ready`) when it was queued before them, the steps then running back
    to back. The trainer's records and the benchmark's steps (engine/bench) are timed by it."""
    ready = time.perf_counter()
    return ready - max(started, previous_ready or 0.0), ready
