"""Where a training step's work is issued from (docs/bench.md, "Launch sites").

The breakdown says how long each class of op ran; this says which lines of Python asked for the ops. One more step
runs under a TorchDispatchMode that sees every aten op as it is dispatched, with the Python frames outside torch
that led to it, innermost first (host_waits.caller_frames): the same op from the same frames is one site, counted.
Ops that only make tensor metadata (views, empty allocations) launch nothing on a device and are left out. Ops
autograd runs from its own backward formulas have no frame of their own (on CUDA backward runs on a thread without
Python frames; on the CPU the frames are only where backward was called): they are one site with no frames. A CUDA
graph's replay is one op (its kernels are the graph's). A site that issues many small ops a step (a per-tensor loop)
is what this finds: DeepSpeed's one-rank gradient reduction was 96 copies a step (engine/train/ds_sync_free.py).

`recorded_ops()` wraps whatever the caller runs and `launch_sites` summarises; `launch_sites_step` is the benchmark's
step of them (engine/bench/steps.py).
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_tune.engine.bench.host_waits import caller_frames, resolved

# Sites listed (most ops first).
TOP_SITES = 20
# aten ops that make tensor metadata or uninitialised memory only: no device work.
METADATA_OPS = frozenset({
    "alias", "as_strided", "detach", "empty", "empty_strided", "expand", "lift_fresh", "narrow", "permute",
    "_reshape_alias", "reshape", "select", "slice", "split", "split_with_sizes", "squeeze", "t", "transpose",
    "unbind", "unsqueeze", "view", "_unsafe_view", "view_as_real", "view_as_complex",
    "_has_compatible_shallow_copy_type", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "set_", "resize_",
})  # fmt: skip
# Where backward runs autograd's own formulas on the CPU: frames past it are only where backward was called.
_BACKWARD_ENGINE = (Path(torch.__file__).resolve().parent / "autograd" / "graph.py", "_engine_run_backward")


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[tuple[str, tuple[str, ...]]]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in METADATA_OPS:
            self.ops.append((name, _frames()))
        return func(*args, **(kwargs or {}))


def _frames() -> tuple[str, ...]:
    # From the frame that dispatched the op: this function's and __torch_dispatch__'s left out.
    stack = traceback.extract_stack(sys._getframe(2))
    # Inside backward the frames outside autograd's engine only say where backward was called: those inside it count
    # (a Python Function's backward), and none means one of autograd's own formulas.
    for index in range(len(stack) - 1, -1, -1):
        frame = stack[index]
        if frame.name == _BACKWARD_ENGINE[1] and resolved(frame.filename) == _BACKWARD_ENGINE[0]:
            return caller_frames(stack[index + 1 :])
    return caller_frames(stack)


@contextmanager
def recorded_ops() -> Iterator[list[tuple[str, tuple[str, ...]]]]:
    """Within the block, every dispatched aten op that is not METADATA_OPS is appended to the yielded list as (op
    name, its caller_frames), in dispatch order."""
    ops: list[tuple[str, tuple[str, ...]]] = []
    with _Recorder(ops):
        yield ops


def launch_sites(ops: list[tuple[str, tuple[str, ...]]]) -> list[dict]:
    """[{count, op, frames}] per distinct (op, frames), most first (first dispatched first among equals), at most
    TOP_SITES; frames innermost first, empty for autograd's own backward formulas."""
    ranked = Counter(ops).most_common(TOP_SITES)
    return [dict(count=count, op=op, frames=list(frames)) for (op, frames), count in ranked]


def launch_sites_step(runner) -> list[dict]:
    """One more training step of `runner` (a steps.StepRunner) with its ops recorded: their launch_sites."""
    with recorded_ops() as ops:
        runner.step()
    return launch_sites(ops)
