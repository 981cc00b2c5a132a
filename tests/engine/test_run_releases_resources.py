"""A finished in-process fine-tune leaves nothing of itself behind: no DeepSpeed engine, no process group, no gloo
thread. Tests run many fine-tunes in one worker; what each left alive (about 6 threads and the model a run) made a
late os.fork() in the worker fail for memory."""

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

from moe_tune.engine.train import trainer
from moe_tune.engine.train.trainer import finetune
from moe_tune.profiles import load_profile

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


def finetune_watched(out: Path, stage: int, monkeypatch) -> tuple[list[weakref.ref], list[weakref.ref]]:
    """Two steps of the tiny profile (the second runs on ZeRO-3's recorded trace); weak references to the run's
    engine and to the process groups alive at its finish."""
    engines, groups = [], []
    finish = trainer._finish

    def watched_finish(run):
        engines.append(weakref.ref(run.engine))
        groups.extend(weakref.ref(g) for g in torch.distributed.distributed_c10d._world.pg_map)
        return finish(run)

    monkeypatch.setattr(trainer, "_finish", watched_finish)
    profile = load_profile("tiny", [f"output.dir={out}", "train.steps=2", "train.warmup_steps=0",
                                    "data.seq_len=64", "data.corpus_documents=50", f"parallel.zero_stage={stage}"])  # fmt: skip
    result = finetune(profile, show_progress=False)
    assert result.last_step == 2
    gc.collect()
    return engines, groups


@pytest.mark.parametrize("stage", [3, 2])
def test_finished_run_leaves_no_engine_group_or_thread(tmp_path, monkeypatch, stage):
    # A first run starts what lives once a process (torch's intra-op thread, the allocator's background thread).
    finetune_watched(tmp_path / "first", stage, monkeypatch)
    threads_before, run_threads_before = len(native_threads()), run_threads()
    engines, groups = finetune_watched(tmp_path / "second", stage, monkeypatch)
    assert len(engines) == 1 and groups
    assert sum(e() is not None for e in engines) == 0, "the run's DeepSpeedEngine is still alive"
    assert sum(g() is not None for g in groups) == 0, "process groups of the run are still alive"
    assert run_threads() <= run_threads_before, native_threads()
    assert len(native_threads()) <= threads_before
