"""Where the host waits for the GPU in a training step (docs/bench.md, "Host waits").

Reading a device value on the host (`.item()`, `float(t)`, `.cpu()`, `.tolist()`, `nonzero`, a non-blocking copy
into pageable memory) makes the host wait until the GPU has run everything queued before it; the GPU then idles
while the host issues what follows. The breakdown's `gpu_waits` says where the GPU waited; this says why the host
fell behind. One more step runs under `torch.cuda.set_sync_debug_mode("warn")`: torch then warns at the
synchronizing CUDA operations it checks (its copies to the host, stream waits; not torch.distributed's: torch
documents the mode as covering not all of them). Each warning is recorded with the Python frames that led to it,
outside torch and the warnings machinery, innermost first; the same frames are one site, counted. Inside backward
the frames are what Python sees there: a Python autograd Function's own, or else where backward was called.

Nothing here runs a step: `recorded_host_waits()` wraps whatever the caller runs; `host_wait_sites` summarises.
"""

from __future__ import annotations

import functools
import re
import sysconfig
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# torch's warning text (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"
# Frames kept per site: enough to tell a helper's callers apart.
SITE_FRAMES = 4
# Sites listed (most waits first).
TOP_SITES = 15
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()
_TORCH_ROOT = Path(torch.__file__).resolve().parent
_WARNINGS_FILE = Path(warnings.__file__).resolve()


@functools.lru_cache(maxsize=None)
def resolved(filename: str) -> Path:
    """A frame's file, resolved once per name (sites are read for every op of a step: engine/bench/launch_sites.py)."""
    return Path(filename).resolve()


@functools.lru_cache(maxsize=None)
def _is_own_frame(filename: str) -> bool:
    """Frames that say nothing about the caller: torch's own, the warnings module's, this module's."""
    path = resolved(filename)
    return path == _WARNINGS_FILE or path == resolved(__file__) or path.is_relative_to(_TORCH_ROOT)


def frame_text(frame: traceback.FrameSummary) -> str:
    """`path:line (function)`, the path relative to the moe_tune package or to site-packages where under them."""
    path = resolved(frame.filename)
    # The deepest of the two that holds it (a virtual environment may live inside the checkout).
    roots = [root for root in (_PACKAGE_ROOT, _SITE_PACKAGES) if path.is_relative_to(root)]
    if roots:
        path = path.relative_to(max(roots, key=lambda root: len(root.parts)))
    return f"{path.as_posix()}:{frame.lineno} ({frame.name})"


def caller_frames(stack: list[traceback.FrameSummary]) -> tuple[str, ...]:
    """The innermost SITE_FRAMES frames of `stack` (outermost first, as traceback.extract_stack gives it) that are
    not torch's, the warnings module's or this module's, innermost first."""
    kept = [frame_text(frame) for frame in reversed(stack) if not _is_own_frame(frame.filename)]
    return tuple(kept[:SITE_FRAMES])


@contextmanager
def recorded_host_waits() -> Iterator[list[tuple[str, ...]]]:
    """Within the block, torch warns at each synchronizing CUDA operation (CUDA only; elsewhere nothing is
    recorded) and the yielded list gets each one's caller_frames instead of a printed warning; other warnings go
    to the warnings module's display. On exit the debug mode and the warnings filters and display are the caller's."""
    waits: list[tuple[str, ...]] = []
    is_cuda = torch.cuda.is_available()
    previous_mode = torch.cuda.get_sync_debug_mode() if is_cuda else None
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            # torch may append where it warned: "(Triggered internally at ...)".
            if str(message).startswith(SYNC_WARNING):
                waits.append(caller_frames(traceback.extract_stack()))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))
        warnings.showwarning = show
        if is_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            if is_cuda:
                torch.cuda.set_sync_debug_mode(previous_mode)


def host_wait_sites(waits: list[tuple[str, ...]]) -> list[dict]:
    """[{count, frames}] per distinct site, most waits first (first seen first among equals), at most TOP_SITES;
    frames innermost first."""
    # most_common keeps the first seen first among equal counts.
    return [dict(count=count, frames=list(frames)) for frames, count in Counter(waits).most_common(TOP_SITES)]


def site_text(frames: list[str]) -> str:
    """One line for a site: its frames innermost first, joined by ' < ' (called from)."""
    return " < ".join(frames) if frames else "(no Python frame outside torch)"
