"""Whole training steps of one profile under several kernel launches in one process, in turns
(`moe-tune profile PROFILE --compare-launch ENTRIES`): the model, its data and its compiled kernels are built once,
and each launch's steps alternate with the others', so that a slow drift of the card (its clocks, its temperature)
falls on every launch alike.

A turn sets MOE_TUNE_LAUNCH to its launch (the defaults: unset), lets go of the MoE blocks' CUDA graphs, which hold
the previous launch's kernels, runs one step that captures them again (not timed) and then `steps_per_turn` timed
steps. Rounds visit the launches forward and backward in turn (A B C C B A ...). On CUDA each launch ends with one
step whose device work is profiled (breakdown.timeline_step): its kernels' device time, by kernel.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable
from typing import Any

from moe_tune.engine.bench.machine import MACHINE_KEYS, machine_info
from moe_tune.engine.bench.steps import WARMUP_STEPS, StepRunner
from moe_tune.engine.bench.timing import run_steps
from moe_tune.engine.launch import LAUNCH_ENV, use_launch
from moe_tune.profiles.schema import JobProfile

STEPS_PER_TURN = 2

RESULT_KEYS = ("profile", "seq_len", "micro_batch_size", "rounds", "steps_per_turn", "launches", "complete",
               *MACHINE_KEYS)  # fmt: skip
LAUNCH_KEYS = ("launch", "step_times_s", "step_time_s", "tokens_per_s", "losses", "device_busy_s", "kernels")


class LaunchFailed(RuntimeError):
    """A launch under which a kernel cannot run (Triton's error: a tile past the GPU's shared memory, say)."""

    def __init__(self, launch: str | None, error: Exception):
        super().__init__(f"{_name(launch)}: {error}")
        self.launch, self.error = launch, error


class TurnsStopped(KeyboardInterrupt):
    """A run stopped (SIGINT: a time limit) after its warm-up: `result` holds the steps timed until then, complete
    False."""

    def __init__(self, result: dict[str, Any]):
        super().__init__()
        self.result = result


def compare_launches(
    profile: JobProfile,
    launches: list[str],
    rounds: int,
    steps_per_turn: int = STEPS_PER_TURN,
    warmup: int = WARMUP_STEPS,
    on_step: Callable[[str | None, dict], None] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time `profile`'s training steps under the defaults and each of `launches` (texts launch_problems accepts), in
    `rounds` rounds of one turn a launch, after `warmup` steps under each (its kernels compiled).

    Returns RESULT_KEYS, `launches` a row per launch (the defaults first, launch None) with LAUNCH_KEYS: its timed
    steps' times and losses in the order they ran, their medians, and on CUDA the device time of its profiled step
    (device_busy_s) and of each kernel in it (kernels: [{kernel, calls, time_s}]). on_step(launch, record) follows
    every timed step; on_line(text) says what runs next. MOE_TUNE_LAUNCH is as it was afterwards. Raises
    LaunchFailed when a kernel cannot run under a named launch, and TurnsStopped (with the steps timed so far, a
    launch without any having medians of None) when a KeyboardInterrupt comes after the warm-up."""
    from moe_tune.engine.bench.breakdown import timeline_step

    say = on_line or (lambda line: None)
    texts: list[str | None] = [None, *launches]
    timed: dict[int, list[dict]] = {index: [] for index in range(len(texts))}
    timelines: dict[int, dict] = {}
    before = os.environ.get(LAUNCH_ENV)
    runner = StepRunner(profile)
    current: str | None = None
    stopped = False
    try:

        def switch(index: int) -> None:
            nonlocal current
            current = texts[index]
            if texts[index] is None:
                os.environ.pop(LAUNCH_ENV, None)
            else:
                use_launch(texts[index])
            runner.release_graphs()

        for index, text in enumerate(texts):
            say(f"warm-up under {_name(text)}: {warmup} steps")
            switch(index)
            run_steps(runner, warmup, lambda step, record: None)
        try:
            for number in range(rounds):
                order = range(len(texts)) if number % 2 == 0 else reversed(range(len(texts)))
                for index in order:
                    switch(index)
                    records: list[dict] = []
                    # The turn's first step captures the MoE blocks' graphs again: it is not timed.
                    run_steps(runner, 1 + steps_per_turn, lambda step, record: records.append(record))
                    for record in records[1:]:
                        timed[index].append(record)
                        if on_step is not None:
                            on_step(texts[index], record)
            if runner.is_cuda:
                for index, text in enumerate(texts):
                    say(f"one more step under {_name(text)} with only the device's work profiled")
                    switch(index)
                    runner.step()
                    timelines[index] = timeline_step(runner)
        except KeyboardInterrupt:
            stopped = True
        is_cuda = runner.is_cuda
    except Exception as err:
        # The defaults failing is a bug, and keeps its traceback.
        if current is not None and type(err).__module__.startswith("triton"):
            raise LaunchFailed(current, err) from err
        raise
    finally:
        if before is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = before
        runner.close()
    rows = []
    for index, text in enumerate(texts):
        records = timed[index]
        timeline = timelines.get(index)
        rows.append(dict(
            launch=text,
            step_times_s=[r["step_time_s"] for r in records],
            step_time_s=statistics.median(r["step_time_s"] for r in records) if records else None,
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in records) if records else None,
            losses=[r["loss"] for r in records],
            device_busy_s=timeline["busy_s"] if timeline else None,
            kernels=timeline["kernels"] if timeline else None,
        ))  # fmt: skip
    result = dict(
        profile=profile.name,
        seq_len=profile.data.seq_len,
        micro_batch_size=profile.train.micro_batch_size,
        rounds=rounds,
        steps_per_turn=steps_per_turn,
        launches=rows,
        complete=not stopped,
        **machine_info(is_cuda),
    )
    if stopped:
        raise TurnsStopped(result)
    return result


# A CUDA graph's copy and memset nodes run either on the copy engine ("Memcpy DtoD (Device -> Device)", "Memset
# (Device)") or as the driver's kernels ("memcpy128", "memset32"), and two instantiations of one graph may differ:
# kernel_changes counts each kind as one.
_DEVICE_COPY = re.compile(r"Memcpy DtoD \(Device -> Device\)|memcpy\d+")
_DEVICE_MEMSET = re.compile(r"Memset \(Device\)|memset\d+")


def _kernel_kind(name: str) -> str:
    if _DEVICE_COPY.fullmatch(name):
        return "device-to-device copies"
    if _DEVICE_MEMSET.fullmatch(name):
        return "memsets"
    return name


def kernel_changes(defaults: dict, other: dict, count: int = 5) -> list[dict]:
    """The `count` kernels whose device time changed most from the defaults' row to `other`'s (rows of
    compare_launches on CUDA): [{kernel, defaults_s, time_s, change_s}], largest change first; [] without kernels.
    Device-to-device copies and memsets count as one kernel each, as the copy engine or the driver's kernels ran
    them."""
    if not defaults["kernels"] or not other["kernels"]:
        return []
    before, after = _times_by_kind(defaults["kernels"]), _times_by_kind(other["kernels"])
    changes = [
        dict(kernel=name, defaults_s=before.get(name, 0.0), time_s=after.get(name, 0.0),
             change_s=after.get(name, 0.0) - before.get(name, 0.0))
        for name in before.keys() | after.keys()
    ]  # fmt: skip
    return sorted(changes, key=lambda row: (-abs(row["change_s"]), row["kernel"]))[:count]


def _times_by_kind(kernels: list[dict]) -> dict[str, float]:
    times: dict[str, float] = {}
    for row in kernels:
        kind = _kernel_kind(row["kernel"])
        times[kind] = times.get(kind, 0.0) + row["time_s"]
    return times


def _name(text: str | None) -> str:
    return "the defaults" if text is None else text
