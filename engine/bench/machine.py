"""The facts every benchmark result carries: the device, the machine, the GPU driver, torch, triton, the commit and
the UTC date, from `machine_info`, so that the kernel rows, the training-step results and the load benchmark's
results name the run the same way."""

from __future__ import annotations

import datetime
import os
import platform
import re
import resource
import subprocess
import sys
from pathlib import Path

import torch

from moe_tune.ops.common.launch import launch_text

# The keys machine_info returns, in order: the last keys of every result row.
MACHINE_KEYS = ("device", "machine", "driver", "torch", "triton", "commit", "date", "launch")
# The commit results name, when set: for code outside a git checkout (installed from a wheel) or in a copy whose git
# metadata is not the tree's (a working tree copied onto a GPU machine), e.g. MOE_TUNE_COMMIT=$(git rev-parse --short
# HEAD) where the tree came from. Unset: git's own answer for this file's checkout.
COMMIT_ENV = "MOE_TUNE_COMMIT"
# The NVIDIA kernel module names its version here on Linux ("... Kernel Module  550.54.15  ...").
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")
NVIDIA_DRIVER_VERSION = re.compile(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)")


def commit() -> str:
    """MOE_TUNE_COMMIT when set; else `git rev-parse --short HEAD` of this checkout, `+dirty` for local edits; else
    "unknown"."""
    if named := os.environ.get(COMMIT_ENV, "").strip():
        return named
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        is_dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if is_dirty.strip() else "")


def driver_version(is_cuda: bool) -> str | None:
    """The NVIDIA driver's version (`550.54.15`), or None without CUDA or where the machine does not say."""
    if not is_cuda:
        return None
    try:
        match = NVIDIA_DRIVER_VERSION.search(NVIDIA_DRIVER_FILE.read_text())
    except OSError:
        match = None
    if match:
        return match.group(1)
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return answer[0] if answer else None


def machine_info(is_cuda: bool) -> dict:
    """{MACHINE_KEYS}: the device kind, the GPU's name (or the CPU and its threads), driver, versions, commit, UTC
    date and the kernel launches other than the defaults; a fact the machine does not give is None."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if is_cuda:
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    return dict(
        device="cuda" if is_cuda else "cpu",
        machine=machine,
        driver=driver_version(is_cuda),
        torch=torch.__version__,
        triton=triton_version,
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The kernel launches named by MOE_TUNE_LAUNCH (`profile --launch`), None for the defaults.
        launch=launch_text() or None,
    )


def peak_host_memory() -> int:
    """This process's peak resident memory in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
