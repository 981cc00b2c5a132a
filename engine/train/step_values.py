"""A training step's device values, read on the host after the next step is queued, and the step's time.

A step ends with values the host needs (the loss, the gradient norm, the expert loads, whether a weight went
non-finite; on several ranks the token counts and the stop vote). Read where they are made, the host waits at
every step's end until the GPU has run all it was given, and the next step starts on an idle device whose first
kernels then run at the host's launch pace. Here they are gathered into one float64 vector and copied to page-locked
host memory without waiting; `read()` waits for that copy alone (its event), which the trainer calls once the
next step's work is queued (engine/train/trainer.py's loop).

A step's time is measured where its work runs. On CUDA, events mark its launch's start and its end (the values'
copy) on the device's timeline; a step queued behind the one before it runs from that step's end to its own, so
that the steps' times add up to the run's and each holds its own work and any wait for the host's launches, not the
moment the host happened to read it. On the CPU the work runs as the host launches it: from the launch's start to its
end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepStart:
    """Where a step's launch began: the host clock (time.perf_counter) and, on CUDA, an event recorded on the
    current stream there; `after`, on CUDA, the end of the unread step it is queued behind (its time runs from
    there)."""

    host_s: float
    event: torch.cuda.Event | None
    after: torch.cuda.Event | None = None


class StepValues:
    """Named values of one step (tensors of any shape, or Python numbers), the device's on their way to the host, and
    the step's end.

    values: name -> tensor or number. CUDA tensors are flattened into one float64 vector (integer counts stay exact
    up to 2**53) copied to the host without waiting; CPU tensors and numbers are host values already, read at once.
    start: the step's launch_clock(); made at the end of the step's launch, these values mark the step's end."""

    def __init__(self, values: dict[str, torch.Tensor | float | int], start: StepStart):
        self.start = start
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
        self._host = None
        if parts:
            flat = torch.cat(parts)
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
        # The step's end: on the device after the copy (read() waits for it), on the host now.
        self._event = None
        if parts or start.event is not None:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        self._ended_s = time.perf_counter()

    def read(self) -> dict:
        """Every value as a Python number (scalars) or nested lists (tensors), after waiting for its copy alone."""
        out = dict(self._ready)
        if self._event is not None:
            self._event.synchronize()
        if self._host is None:
            return out
        flat = self._host.tolist()
        start = 0
        for name, shape in self._shapes.items():
            size = math.prod(shape)
            out[name] = _nested(flat[start : start + size], shape)
            start += size
        return out

    def launch_seconds(self) -> float:
        """The host's time launching the step, from its launch's start to these values. It includes the host's waits
        for room in the device's launch queue, so it can reach the step's time (seconds()) on a device-bound run as
        well. On the CPU the two are equal."""
        return self._ended_s - self.start.host_s

    def seconds(self) -> float:
        """The step's time, once it has ended (read() waits for that): on the device's timeline from the end of the
        step it was queued behind (launch_clock's `behind`), else from its own launch; on the CPU from its launch to
        its launch's end."""
        if self._event is None or self.start.event is None:
            return self.launch_seconds()
        self._event.synchronize()
        begin = self.start.after if self.start.after is not None else self.start.event
        return begin.elapsed_time(self._event) / 1e3


def _nested(values: list[float], shape: tuple[int, ...]):
    """A flat row-major list as a number (shape ()) or nested lists of `shape`."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    inner = math.prod(shape[1:])
    return [_nested(values[i * inner : (i + 1) * inner], shape[1:]) for i in range(shape[0])]


def launch_clock(device: torch.device, behind: StepValues | None = None) -> StepStart:
    """Mark the start of a step's launch on `device` (StepValues.seconds measures from it). behind: the values of
    the step still unread, which this one is queued behind (only its end is kept)."""
    event = None
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return StepStart(time.perf_counter(), event, behind._event if behind is not None else None)
