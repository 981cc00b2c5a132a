"""Kernel launches other than the defaults for one run (ops/common/launch.py, `MOE_TUNE_LAUNCH`): the command line's
check of `--launch` and of the kernel variables (with MOE_TUNE_KERNELS, ops/common/dispatch.py), and setting the
launch for the run and its child processes."""

from __future__ import annotations

import os

from moe_tune.ops.common.dispatch import kernel_mode
from moe_tune.ops.common.launch import LAUNCH_ENV, LaunchError, launch_text, parse_launch

__all__ = ["LAUNCH_ENV", "environment_problems", "launch_problems", "launch_text", "use_launch"]


def launch_problems(text: str, source: str = "--launch") -> list[str]:
    """The one-line problem of a launch text named by `source`, or none."""
    if not text.strip():
        return [f"{source}: empty: name at least one FAMILY.FIELD=VALUE (docs/bench.md)"]
    try:
        parse_launch(text, source)
    except LaunchError as err:
        return [str(err)]
    return []


def environment_problems() -> list[str]:
    """The problems of the kernel variables as set, MOE_TUNE_KERNELS (reference, triton or auto) and MOE_TUNE_LAUNCH
    (none when unset or empty): values the first kernel call would refuse deep inside a run."""
    problems = []
    try:
        kernel_mode()
    except ValueError as err:
        problems.append(str(err))
    text = launch_text()
    return problems + (launch_problems(text, LAUNCH_ENV) if text else [])


def use_launch(text: str) -> None:
    """Run this process, and the processes it starts, under the launch `text` (checked by launch_problems)."""
    os.environ[LAUNCH_ENV] = text.strip()
