"""Processes of this host for the lock and writer tests: the pid of one that has ended, and one that lives."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@contextmanager
def live_pid() -> Iterator[int]:
    """The pid of a process of this host that lives until the block ends (another run or export, as a test names
    it)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
