"""`--nproc N`: start N local ranks of a command and watch them.

Each rank is the same command with the standard rendezvous variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), exactly what torchrun or the deepspeed launcher would set, so a profile runs the same under any of
them. As torchrun's agent does, the launcher hosts the rendezvous store itself, on a port the system gave it while
binding, and every rank joins it as a client: no other process can take the port between its choice and its use.
When a rank exits non-zero, the others get SIGTERM (then SIGKILL after a grace period) and the launcher
returns that rank's code with a line naming it: no job waits forever on a dead peer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Seconds the surviving ranks get to write their checkpoint and exit after a peer failed or a signal came.
GRACE_S = 30.0
POLL_S = 0.2


@contextmanager
def rendezvous() -> Iterator[int]:
    """The port of a rendezvous store this process hosts on this machine until the block ends: ranks started with
    rank_env(..., port) join it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    failed_rank: int | None
    message: str


def rank_env(rank: int, world_size: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank `rank`, which joins the store rendezvous() hosts on `port` as a client (torch's
    agent store, as under torchrun)."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return env


# What one rank takes of the host's memory at the least (the interpreter, torch and DeepSpeed imported, before any
# model): more ranks than the memory holds this many of are refused before one starts.
RANK_HOST_BYTES = 512 * 2**20


def nproc_problems(nproc: int, cuda_devices: int, host_bytes: int | None) -> list[str]:
    """Why `--nproc nproc` cannot run here, in one line, or nothing: on a machine with CUDA devices each rank takes
    one of its own; every rank takes RANK_HOST_BYTES of the host's memory (host_bytes None: unknown, not checked)."""
    if cuda_devices and nproc > cuda_devices:
        return [f"--nproc ({nproc}) must be at most the {cuda_devices} CUDA devices here: each rank takes one"]
    if host_bytes is not None and nproc * RANK_HOST_BYTES > host_bytes:
        most = host_bytes // RANK_HOST_BYTES
        return [f"--nproc ({nproc}) must be at most {most} here: each rank takes at least "
                f"{RANK_HOST_BYTES / 2**30:.1f} GiB of the host's {host_bytes / 2**30:.1f} GiB"]  # fmt: skip
    return []


def host_memory_bytes() -> int | None:
    """The host's physical memory, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def launch_local(nproc: int, argv: list[str], env: dict[str, str] | None = None) -> LaunchResult:
    """Run `python -m moe_tune *argv` as ranks 0..nproc-1 on this machine; return when all ended."""
    with rendezvous() as port:
        procs = [
            # -P: every rank imports the moe_tune this process runs, never a checkout in the working directory.
            subprocess.Popen([sys.executable, "-P", "-m", "moe_tune", *argv], env=rank_env(rank, nproc, port, env))
            for rank in range(nproc)
        ]
        return _watch(procs)


def _watch(procs: list[subprocess.Popen]) -> LaunchResult:
    """Wait for the ranks; the first that exits non-zero stops the others."""
    nproc = len(procs)

    def forward_signal(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed: int | None = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if failed is None and p.poll() not in (None, 0):
                    failed = rank
                    _stop_all(procs)
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    if failed is None:
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    if failed is None:
        return LaunchResult(0, None, f"all {nproc} ranks finished")
    code = codes[failed]
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return LaunchResult(code if code > 0 else 1, failed, f"rank {failed} {how}; the other ranks were stopped")


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + GRACE_S
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
