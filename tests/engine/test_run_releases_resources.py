"""A fine-tune run in-process leaves nothing of itself behind when it ends: no DeepSpeed engine, no process group, no
gloo thread, torch.nn.functional.linear as it found it. A pytest worker runs many fine-tunes; were each to keep its model and its 6 gloo threads alive, a late
os.fork() in the worker could fail for memory."""

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

from moe_tune.engine.train.trainer import finetune
from moe_tune.profiles import ProfileError, load_profile

# Thread names (/proc/self/task/*/comm) of the gloo backend and of the TCP store its rendezvous uses.
RUN_THREAD_PREFIXES = ("gloo", "pt_gloo", "pt_tcpstore")


def native_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except FileNotFoundError:  # the thread ended while listing
            pass
    return names


def run_threads() -> int:
    return sum(name.startswith(RUN_THREAD_PREFIXES) for name in native_threads())


def tiny_profile(out: Path, stage: int = 3):
    return load_profile("tiny", [f"output.dir={out}", "train.steps=2", "train.warmup_steps=0", "data.seq_len=64",
                                 "data.corpus_documents=50", f"parallel.zero_stage={stage}"])  # fmt: skip


def watch_runs(monkeypatch) -> tuple[list[weakref.ref], list[weakref.ref]]:
    """Weak references to every engine deepspeed.initialize builds from now on, and to the process groups alive
    when it returns (the world and the groups DeepSpeed derives from it)."""
    import deepspeed

    engines, groups = [], []
    initialize = deepspeed.initialize

    def watched_initialize(*args, **kwargs):
        built = initialize(*args, **kwargs)
        engines.append(weakref.ref(built[0]))
        groups.extend(weakref.ref(g) for g in torch.distributed.distributed_c10d._world.pg_map)
        return built

    monkeypatch.setattr(deepspeed, "initialize", watched_initialize)
    return engines, groups


def alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("stage", [3, 2])
def test_finished_run_leaves_no_engine_group_or_thread(tmp_path, monkeypatch, stage):
    functional_linear = torch.nn.functional.linear
    # A first run starts what lives once a process (torch's intra-op thread, the allocator's background thread).
    finetune(tiny_profile(tmp_path / "first", stage), show_progress=False)
    # ZeRO-3 replaced torch.nn.functional.linear during the run; the process has torch's own back.
    assert torch.nn.functional.linear is functional_linear
    gc.collect()
    threads_before, run_threads_before = len(native_threads()), run_threads()
    engines, groups = watch_runs(monkeypatch)
    # Two steps: the second runs on ZeRO-3's recorded trace, which caches per module.
    assert finetune(tiny_profile(tmp_path / "second", stage), show_progress=False).last_step == 2
    assert len(engines) == 1 and groups
    assert alive(engines) == 0, "the run's DeepSpeedEngine is still alive"
    assert alive(groups) == 0, "process groups of the run are still alive"
    assert run_threads() <= run_threads_before, native_threads()
    assert len(native_threads()) <= threads_before


@pytest.mark.parametrize("stage", [3, 1])
def test_closed_step_runner_leaves_no_engine(tmp_path, monkeypatch, stage):
    """`moe-tune profile` builds a StepRunner per run (its --against and memory sweeps several a process): once closed
    its engine, with the gradient buckets ZeRO allocates (2 GB at DeepSpeed's default bucket of 5e8 fp32), is freed."""
    from moe_tune.engine.bench.steps import StepRunner

    functional_linear = torch.nn.functional.linear
    engines, groups = watch_runs(monkeypatch)
    runner = StepRunner(tiny_profile(tmp_path, stage))
    runner.step()
    runner.close()
    del runner
    assert len(engines) == 1
    assert alive(engines) == 0, "the closed runner's DeepSpeedEngine is still alive"
    assert alive(groups) == 0, "process groups of the closed runner are still alive"
    assert torch.nn.functional.linear is functional_linear


def test_run_refused_after_its_engine_is_built_releases_it(tmp_path, monkeypatch):
    run_threads_before = run_threads()
    engines, groups = watch_runs(monkeypatch)
    # --resume with no checkpoint is refused in the set-up, after DeepSpeed has built the engine.
    with pytest.raises(ProfileError, match=r"^--resume: no checkpoint under "):
        finetune(tiny_profile(tmp_path), resume=True, show_progress=False)
    assert len(engines) == 1
    assert alive(engines) == 0, "the refused run's DeepSpeedEngine is still alive"
    assert alive(groups) == 0, "process groups of the refused run are still alive"
    assert run_threads() <= run_threads_before, native_threads()


@pytest.mark.parametrize("launcher", [False, True], ids=["bare", "launcher-of-one"])
def test_a_world_of_one_takes_no_port(tmp_path, monkeypatch, launcher):
    # Its store lives in the process: a port another process listens on (here, a stale MASTER_PORT), or one it takes
    # between a choice and its binding, cannot fail the run with EADDRINUSE.
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1])}
        rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"} if launcher else {}
        for name, value in {**taken, **rank}.items():
            monkeypatch.setenv(name, value)
        if not launcher:
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"):
                monkeypatch.delenv(name, raising=False)
        for run in ("first", "second"):
            assert finetune(tiny_profile(tmp_path / run), show_progress=False).last_step == 2
    assert os.environ["MASTER_PORT"] == taken["MASTER_PORT"]


def test_a_launchers_variables_are_kept(monkeypatch):
    # Rendezvous variables a launcher set are the launcher's: left as they are.
    from moe_tune.engine.train import distributed

    launcher = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511"}  # fmt: skip
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    distributed.prepare_environment()
    assert {name: os.environ[name] for name in launcher} == launcher
