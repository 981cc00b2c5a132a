"""Fault injection for checkpoints, driven from one process: `moe-tune finetune` runs killed with SIGKILL at random
moments while they write a checkpoint, then the newest checkpoint's files truncated one kind at a time, each followed
by `--resume`; finally an uninterrupted run of as many steps. Writes WORKDIR/report.json for
tests/engine/test_checkpoint_faults.py to check.

    python tests/checkpoint_fault_driver.py WORKDIR [--kills 10] [--seed 0]

The driver imports torch, DeepSpeed and moe-tune once and forks one child per run (each run would otherwise spend
seconds importing them); it runs no torch op itself, so the children start clean.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per run: the model is tiny, and two-thread parallel regions crawl on a busy two-core machine.
os.environ["OMP_NUM_THREADS"] = "1"
for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(var, None)

import importlib  # noqa: E402

# Imported once here, shared by every forked run: what a run would otherwise import on its way (seconds each).
for module in ("deepspeed", "peft", "torch._dynamo", "torch._inductor.compile_fx",
               "deepspeed.runtime.zero.muon.original_muon", "moe_tune.engine.lora", "moe_tune.engine.lora.experts",
               "moe_tune.engine.model.model", "moe_tune.engine.data.dataset", "moe_tune.engine.memory"):  # fmt: skip
    importlib.import_module(module)

from moe_tune.cli import app  # noqa: E402
from moe_tune.engine.train import trainer  # noqa: E402,F401
from moe_tune.engine.train.checkpoint import (  # noqa: E402
    MANIFEST_FILE,
    TMP_PREFIX,
    checkpoint_dirs,
    checkpoint_step,
    verify_checkpoint,
    write_manifest,
)

# The smallest run that still has every part: 2 layers (linear and sparse attention, both MoE), short rows, a
# constant lr so that a run's train.steps does not change its losses.
SETTINGS = [
    "model.layers=[{attention: linear, mlp: moe}, {attention: sparse, mlp: moe}]",
    "data.seq_len=32", "data.corpus_documents=40", "train.micro_batch_size=1", "train.warmup_steps=1",
    "train.lr_schedule=constant", "output.save_every=1", "output.keep_last=2",
]  # fmt: skip
# The newest checkpoint's files, one kind at a time: (kind, glob).
KINDS = [("model states", "*model_states.pt"), ("optimizer states", "*optim_states.pt"),
         ("trainer state", "trainer_state.json"), ("manifest", "manifest.json"),
         ("pickle payload", "*model_states.pt")]  # fmt: skip
POLL_S = 0.001


def command(out: Path, steps: int, resume: bool) -> list[str]:
    args = ["finetune", "tiny"]
    for setting in [*SETTINGS, f"output.dir={out}", f"train.steps={steps}"]:
        args += ["--set", setting]
    return args + ["--resume"] * resume


def start(args: list[str], log: Path) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    code = 1
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        app(args, prog_name="moe-tune")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


# The moments of a checkpoint write a kill aims at, each seen on disk: the temporary folder made, DeepSpeed's model
# and optimizer files begun, the trainer state, the manifest, the rename (then the sweep and the pruning).
PHASES = ["folder", "model states", "optimizer states", "trainer state", "manifest", "renamed"]
PHASE_FILES = ["", "*model_states.pt", "*optim_states.pt", "*trainer_state.json*", "*manifest.json*"]
# After the aimed-at moment is seen, the kill waits up to this long: a random moment within that part of the write.
JITTER_S = 0.005


def write_in_progress(root: Path, since_ns: int) -> str | None:
    """The checkpoint whose temporary folder was made after since_ns (not one a killed run left behind)."""
    temps = []
    for path in sorted(root.glob(f"{TMP_PREFIX}step-*")) if root.is_dir() else []:
        try:
            if path.stat().st_ctime_ns > since_ns:
                temps.append(path)
        except FileNotFoundError:
            pass
    return temps[0].name[len(TMP_PREFIX):] if temps else None


def phase_of(root: Path, name: str) -> int:
    """How far the write of checkpoint `name` has come (an index into PHASES)."""
    inner = root / f"{TMP_PREFIX}{name}" / name
    if not inner.is_dir():
        return len(PHASES) - 1 if (root / name).is_dir() else 0
    reached = 0
    try:
        for index, pattern in enumerate(PHASE_FILES[1:], start=1):
            if any(inner.glob(pattern)):
                reached = index
    except FileNotFoundError:
        # The child renamed (or removed) the folder between the checks: look again.
        return phase_of(root, name)
    return reached


def run(args: list[str], log: Path, root: Path, kill_at_save: int | None = None, phase: int = 0,
        rng: random.Random | None = None) -> dict:
    """Run one child; with kill_at_save, SIGKILL it once its kill_at_save-th checkpoint write has reached PHASES[phase]
    (or completed), after a random delay of up to JITTER_S. Reports the child's CPU seconds too."""
    started_ns = time.time_ns()
    pid = start(args, log)
    began = time.monotonic()
    seen: list[str] = []
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return {"killed": False, "rc": exit_code(status), "s": time.monotonic() - began,
                    "cpu_s": usage.ru_utime + usage.ru_stime}  # fmt: skip
        name = write_in_progress(root, started_ns)
        if name is not None and name not in seen:
            seen.append(name)
        if kill_at_save is not None and len(seen) >= kill_at_save:
            target = seen[kill_at_save - 1]
            reached = phase_of(root, target)
            if reached >= phase:
                time.sleep(rng.uniform(0.0, JITTER_S))
                os.kill(pid, signal.SIGKILL)
                _, _, usage = os.wait4(pid, 0)
                left = sorted(p.name for p in root.glob(f"{TMP_PREFIX}*"))
                return {"killed": True, "during": target, "aimed_at": PHASES[phase], "seen": PHASES[reached],
                        "left": left, "s": time.monotonic() - began,
                        "cpu_s": usage.ru_utime + usage.ru_stime}  # fmt: skip
        time.sleep(POLL_S)


class Payload:
    """Creates a marker file when unpickled: code execution, if it ever runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def damage(kind: str, target: Path, marker: Path) -> None:
    if kind == "pickle payload":
        import torch

        torch.save({"module": Payload(marker)}, target)
        # A manifest that matches: whoever can write the folder can write it too.
        (target.parent / MANIFEST_FILE).unlink()
        write_manifest(target.parent)
        return
    with target.open("r+b") as f:
        f.truncate(target.stat().st_size // 2)


def verdicts(root: Path) -> dict[str, str | None]:
    return {p.name: verify_checkpoint(p).problem for p in checkpoint_dirs(root)}


def newest_verified(root: Path) -> str | None:
    good = [name for name, problem in verdicts(root).items() if problem is None]
    return good[-1] if good else None


def resumed_from(log: Path) -> str | None:
    lines = [line for line in log.read_text().splitlines() if line.startswith("resumed from ")]
    return Path(lines[-1].split()[2]).name if lines else None


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    work = opts.workdir
    out, root, logs = work / "faulty", work / "faulty" / "checkpoints", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Enough steps that no killed child finishes: each trains at most one step past its checkpoint.
    steps_cap = opts.kills + len(KINDS) + 4
    report: dict = {"kills": [], "truncations": [], "settings": SETTINGS}

    # Kills: every run dies during a checkpoint write, each part of a write aimed at (in a random order), at a random
    # moment within it.
    aims = [i % len(PHASES) for i in range(opts.kills)]
    rng.shuffle(aims)
    for i in range(opts.kills):
        expected = newest_verified(root)
        log = logs / f"kill-{i:02d}.log"
        # The first run dies in its second write (so that a checkpoint exists to resume), every other in its first.
        record = run(command(out, steps_cap, resume=i > 0), log, root, kill_at_save=1 if i else 2,
                     phase=aims[i], rng=rng)  # fmt: skip
        record.update(expected=expected, resumed=resumed_from(log) if i > 0 else None,
                      after=verdicts(root), log=log.read_text()[-2000:])  # fmt: skip
        report["kills"].append(record)

    # Truncations: the newest checkpoint's files one kind at a time, then a pickle payload; each resume must skip
    # it and say why.
    marker = work / "payload-ran"
    for kind, pattern in KINDS:
        newest = checkpoint_dirs(root)[-1]
        (target,) = sorted(newest.glob(pattern))
        damage(kind, target, marker)
        expected = newest_verified(root) if kind != "pickle payload" else checkpoint_dirs(root)[-2].name
        log = logs / f"truncate-{kind.replace(' ', '-')}.log"
        step = checkpoint_step(newest)
        record = run(command(out, min(step + 1, steps_cap), resume=True), log, root)
        record.update(kind=kind, truncated=f"{newest.name}/{target.name}", expected=expected,
                      resumed=resumed_from(log), log=log.read_text()[-3000:])  # fmt: skip
        report["truncations"].append(record)

    # Refusals through the command line (exit 2, one line each): another LoRA rank; then no checkpoint that verifies.
    report["refusals"] = []
    log = logs / "refuse-lora-r.log"
    record = run([*command(out, steps_cap, resume=True), "--set", "lora.r=8"], log, root)
    report["refusals"].append({"what": "lora.r", "rc": record["rc"], "cpu_s": record["cpu_s"],
                               "log": log.read_text()[-3000:], "newest": checkpoint_dirs(root)[-1].name})  # fmt: skip
    damaged = checkpoint_dirs(root)
    for folder in damaged:
        damage("model states", next(folder.glob("*model_states.pt")), marker)
    log = logs / "refuse-none-verifies.log"
    record = run(command(out, steps_cap, resume=True), log, root)
    report["refusals"].append({"what": "none verifies", "rc": record["rc"], "cpu_s": record["cpu_s"],
                               "log": log.read_text()[-3000:],
                               "damaged": [folder.name for folder in damaged]})  # fmt: skip

    # An uninterrupted run of as many steps: the reference for every loss.
    final_step = max(losses(out))
    ref = work / "reference"
    record = run(command(ref, final_step, resume=False), logs / "reference.log", ref / "checkpoints")
    report["reference_rc"] = record["rc"]
    report["reference_log"] = (logs / "reference.log").read_text()[-2000:]
    report["payload_ran"] = marker.exists()
    children = report["kills"] + report["truncations"] + report["refusals"] + [record]
    report["children_cpu_s"] = round(sum(r["cpu_s"] for r in children), 1)
    report["faulty_losses"] = losses(out)
    report["reference_losses"] = losses(ref)
    (work / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
