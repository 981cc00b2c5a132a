"""Atomic checkpoints: written under a temporary name, completed by one rename.

A checkpoint directory `step-NNNNNNN` exists only once everything in it is written, `trainer_state.json` last, so
a crash mid-write never leaves a checkpoint that looks loadable; stale temporaries are swept on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
TMP_PREFIX = ".incomplete-"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(root: Path) -> list[Path]:
    """Loadable checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def save_checkpoint(engine, root: Path, step: int, state: dict[str, Any], keep_last: int, is_main: bool) -> Path:
    """Save the DeepSpeed engine (weights, optimizer, scheduler) and the trainer state for `step`."""
    name = checkpoint_name(step)
    tmp_root = root / f"{TMP_PREFIX}{name}"
    final = root / name
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp_root.mkdir()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    engine.save_checkpoint(str(tmp_root), tag=name, save_latest=False)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if is_main:
        write_json_atomic(tmp_root / name / STATE_FILE, state)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_root / name, final)
        shutil.rmtree(tmp_root, ignore_errors=True)
        _fsync_dir(root)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return final


def _weights_only_load(path: str, map_location=None):
    """DeepSpeed's checkpoint files through torch.load(weights_only=True): tensors, containers and the DeepSpeed
    classes its optimizer state holds (the ZeRO stage, the loss scalers, and ZeRO-1/2's parameter slice mappings, a
    dataclass of two ints), nothing else is unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


def load_checkpoint(engine, path: Path) -> dict[str, Any]:
    """Restore engine and return the trainer state of a complete checkpoint."""
    # DeepSpeed's own loader unpickles arbitrary objects (weights_only=False).
    engine.checkpoint_engine.load = _weights_only_load
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise FileNotFoundError(f"{path}: DeepSpeed found no loadable checkpoint there")
    return json.loads((path / STATE_FILE).read_text())
