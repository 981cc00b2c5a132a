"""Atomic, verified checkpoints: written under a temporary name, completed by one rename.

A checkpoint directory `step-NNNNNNN` appears only once everything in it is written: DeepSpeed's files, then
`trainer_state.json`, then `manifest.json` (every file's size and sha256), then the rename. Resume verifies the
manifest before loading and falls back to the newest checkpoint that verifies and loads, naming each one it skipped
and why; stale temporaries are swept on the next save. A checkpoint without a manifest whose state does not claim
one (written before manifests existed) is loaded unverified, with a note.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_tune.profiles import json_shown
from moe_tune.profiles.schema import dump_with_absolute_paths

from .distributed import any_rank

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
PREFIX = "step-"
TMP_PREFIX = ".incomplete-"
# trainer_state.json's "format": 2 and above always come with a manifest.
STATE_FORMAT = 2
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
# Hashing reads files in 8 MiB blocks; several files are hashed at once (hashlib releases the GIL).
_BLOCK = 8 << 20
_HASH_THREADS = 8
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Below this many free bytes a write failure without an errno (torch's zip writer) is a full disk.
_NEARLY_FULL = 1 << 20


class CheckpointWriteError(RuntimeError):
    """A checkpoint (or the metrics) could not be written, a full disk or a failed write: its temporary folder is
    removed, the previous checkpoints are kept, and the run stops with one line naming the last intact checkpoint."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a folder named as checkpoint_name names it, else None (`step-3` beside `step-0000003` is no
    checkpoint of this tool's: resuming, pruning and export pass it by)."""
    match = _NAME.match(path.name)
    step = int(match.group(1)) if match else None
    return step if step is not None and checkpoint_name(step) == path.name else None


def misnamed_checkpoints(root: Path) -> dict[str, int]:
    """{name: step} of the folders under root named `step-<digits>` otherwise than checkpoint_name (step-3): no
    checkpoint of this tool's, which a message about a missing one names."""
    if not root.is_dir():
        return {}
    found = {p.name: int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()}
    return {name: step for name, step in sorted(found.items()) if checkpoint_name(step) != name}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole or keeps what it held: written through `.NAME.tmp` beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def checkpoint_dirs(root: Path) -> list[Path]:
    """Every `step-N` directory under root (complete or not), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints under root that have a trainer state (not yet verified: see verify_checkpoint), oldest first."""
    return [p for p in checkpoint_dirs(root) if (p / STATE_FILE).is_file()]


def _hash_file(path: Path, sync: bool) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
        if sync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _hash_files(folder: Path, names: list[str], sync: bool) -> dict[str, tuple[int, str]]:
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: _hash_file(folder / name, sync), names)))


def write_manifest(folder: Path) -> None:
    """manifest.json: relative path, size and sha256 of every file in folder, each file synced to disk first."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    hashed = _hash_files(folder, names, sync=True)
    files = [{"path": name, "size": size, "sha256": sha} for name, (size, sha) in hashed.items()]
    write_json_atomic(folder / MANIFEST_FILE, {"format": STATE_FORMAT, "files": files})


def _describe_write_error(err: BaseException, root: Path, name: str, last_intact: Path | None) -> str:
    kept = f"the last intact checkpoint is {last_intact}" if last_intact else "no checkpoint was written before"
    no_space = isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS
    if not no_space:
        try:
            no_space = shutil.disk_usage(root).free < _NEARLY_FULL
        except OSError:
            pass
    if no_space:
        return f"no space left on {root} while saving checkpoint {name}; {kept}"
    return f"could not write checkpoint {name} under {root}: {_one_line(err)}; {kept}"


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(engine, root: Path, step: int, state: dict[str, Any], keep_last: int, is_main: bool) -> Path:
    """Save the DeepSpeed engine (weights, optimizer, scheduler), the trainer state and the manifest for `step`.

    Raises CheckpointWriteError on every rank when any write fails; the temporary folder is removed and the
    checkpoints already there are kept. Pruning to keep_last runs only after the new checkpoint is complete and
    counts the checkpoints up to `step` (newer ones, left by a resume from an older checkpoint, are replaced when
    their step is saved again); the one with the lowest eval loss (best_checkpoint) is kept besides them."""
    name = checkpoint_name(step)
    tmp_root = root / f"{TMP_PREFIX}{name}"
    final = root / name
    device = getattr(engine, "device", "cpu")
    intact = [p for p in complete_checkpoints(root) if checkpoint_step(p) < step]
    last_intact = intact[-1] if intact else None
    failure: BaseException | None = None
    renamed = False
    if is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp_root.mkdir()
        except OSError as err:
            failure = err
    if not any_rank(failure is not None, device):
        try:
            engine.save_checkpoint(str(tmp_root), tag=name, save_latest=False)
        except (OSError, RuntimeError) as err:
            failure = err
    if not any_rank(failure is not None, device) and is_main:
        try:
            write_json_atomic(tmp_root / name / STATE_FILE, {"format": STATE_FORMAT, **state})
            write_manifest(tmp_root / name)
            if final.exists():
                # The same step saved again (a resume from an older checkpoint): set the old one aside first, so a
                # crash between the two renames leaves only a temporary to sweep.
                os.replace(final, root / f"{TMP_PREFIX}replaced-{name}")
            os.replace(tmp_root / name, final)
            renamed = True
            _fsync_dir(root)
        except OSError as err:
            failure = err
    if any_rank(failure is not None, device):
        if is_main:
            shutil.rmtree(tmp_root, ignore_errors=True)
            if renamed:
                # Renamed but not synced: not known to be on disk, so not left to look intact.
                shutil.rmtree(final, ignore_errors=True)
        message = (_describe_write_error(failure, root, name, last_intact) if failure is not None
                   else f"could not write checkpoint {name} under {root}: another rank's write failed")  # fmt: skip
        raise CheckpointWriteError(message)
    if is_main:
        for stale in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        # keep_last counts the checkpoints whose files have their manifest's sizes: a damaged one (a resume skipped
        # it) is neither counted nor deleted, so a good older one is not pruned in its stead.
        # A link in a step's name is not the run's to delete.
        lineage = [p for p in complete_checkpoints(root)
                   if checkpoint_step(p) <= step and not p.is_symlink() and not _sizes_differ(p)]  # fmt: skip
        # Older step folders without a trainer state are leftovers no resume can load.
        leftovers = [p for p in checkpoint_dirs(root)
                     if checkpoint_step(p) < step and not p.is_symlink() and not (p / STATE_FILE).exists()]
        best = best_checkpoint(root, step)
        for old in [p for p in lineage[:-keep_last] if best is None or p != best[0]] + leftovers:
            # Renamed first: a crash mid-delete leaves a temporary to sweep, not a half-deleted checkpoint.
            doomed = root / f"{TMP_PREFIX}pruned-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    _barrier()
    return final


def checkpoint_eval_loss(path: Path) -> float | None:
    """The eval loss a checkpoint's trainer state records for its step (None: no eval then, or unreadable)."""
    state, problem = _read_json(path / STATE_FILE)
    loss = state.get("eval_loss") if problem is None and isinstance(state, dict) else None
    return float(loss) if _is_number(loss) and math.isfinite(loss) else None


def best_checkpoint(root: Path, up_to_step: int) -> tuple[Path, float] | None:
    """The complete checkpoint up to `up_to_step` with the lowest eval loss (the earliest of equals) and that loss;
    None when none records one. Read from the checkpoints themselves, so a resumed run knows it too."""
    best = None
    for path in complete_checkpoints(root):
        loss = checkpoint_eval_loss(path) if checkpoint_step(path) <= up_to_step else None
        if loss is not None and (best is None or loss < best[1]):
            best = (path, loss)
    return best


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_line(err: BaseException) -> str:
    """The exception's type and the first informative line of its message, shortened."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if isinstance(err, pickle.UnpicklingError):
        # torch's weights_only refusal names the blocked global deep in a long message.
        named = [line for line in lines if "GLOBAL" in line or "global" in line.split(" ", 1)[0].lower()]
        text = named[0] if named else text
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass
class Verdict:
    """What verification found for one checkpoint: `problem` is None when it may be loaded."""

    path: Path
    problem: str | None = None
    state: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path.name} cannot be read ({_one_line(err)})"
    except json.JSONDecodeError as err:
        return None, f"{path.name} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg})"


def _check_state(state: Any, step: int) -> str | None:
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds a {type(state).__name__}, not an object"
    problems = []
    if not (isinstance(state.get("step"), int) and not isinstance(state.get("step"), bool)):
        problems.append(f"'step' is {state.get('step')!r}, not an integer")
    elif state["step"] != step:
        problems.append(f"'step' is {state['step']}, the folder's name says {step}")
    rng = state.get("torch_rng")
    if not (isinstance(rng, list) and rng and all(isinstance(v, int) and 0 <= v < 256 for v in rng)):
        problems.append("'torch_rng' is missing or not a list of bytes")
    elif len(rng) != torch.get_rng_state().numel():
        problems.append(f"'torch_rng' holds {len(rng)} bytes, torch's CPU generator state has "
                        f"{torch.get_rng_state().numel()}")  # fmt: skip
    bias = state.get("selection_bias", [])
    if not (isinstance(bias, list) and all(
        isinstance(b, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b) for b in bias
    )):  # fmt: skip
        problems.append("'selection_bias' is not a list of lists of numbers")
    if state.get("eval_loss") is not None and not _is_number(state["eval_loss"]):
        problems.append(f"'eval_loss' is {state['eval_loss']!r}, not a number")
    return f"{STATE_FILE}: {'; '.join(problems)}" if problems else None


def _check_manifest(path: Path, manifest: Any, hashes: bool = True) -> str | None:
    """The first problem of the checkpoint's files against its manifest: its form, a file outside the folder, missing
    or of another size, then (with `hashes`) of another sha256; None when they match."""
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(entries, list) and entries and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
        and isinstance(e.get("sha256"), str) for e in entries
    )):  # fmt: skip
        return f"{MANIFEST_FILE} does not list files as {{path, size, sha256}}"
    root = path.resolve()
    for entry in entries:
        target = (path / entry["path"]).resolve()
        if root not in target.parents:
            return f"{MANIFEST_FILE} names {entry['path']!r}, outside the checkpoint"
        if not target.is_file():
            return f"{entry['path']} is missing"
        size = target.stat().st_size
        if size != entry["size"]:
            return f"{entry['path']} is {size} bytes, the manifest says {entry['size']}"
    if not hashes:
        return None
    hashed = _hash_files(path, [e["path"] for e in entries], sync=False)
    for entry in entries:
        if hashed[entry["path"]][1] != entry["sha256"]:
            return f"{entry['path']} does not match its sha256 in the manifest"
    return None


def _sizes_differ(path: Path) -> bool:
    """Whether the checkpoint's files fail its manifest short of hashing (cheap at every save); False without a
    readable manifest (a checkpoint written before manifests)."""
    manifest, problem = _read_json(path / MANIFEST_FILE)
    return problem is None and _check_manifest(path, manifest, hashes=False) is not None


def verify_checkpoint(path: Path) -> Verdict:
    """Check a checkpoint without loading it: the manifest's files (sizes, then hashes) and the trainer state."""
    step = checkpoint_step(path)
    verdict = Verdict(path)
    if path.is_symlink():
        # Its files would be read from wherever it points: another run's checkpoint, or anything else.
        verdict.problem = f"a link to {os.readlink(path)!r}, not a folder the run wrote"
        return verdict
    has_manifest = (path / MANIFEST_FILE).exists()
    if has_manifest:
        manifest, problem = _read_json(path / MANIFEST_FILE)
        verdict.problem = problem or _check_manifest(path, manifest)
        if verdict.problem:
            return verdict
    state, problem = _read_json(path / STATE_FILE)
    if problem is None:
        problem = _check_state(state, step)
    if problem is None and not has_manifest:
        if state.get("format", 1) >= STATE_FORMAT:
            problem = f"{MANIFEST_FILE} is missing"
        else:
            verdict.notes.append(f"{path} has no {MANIFEST_FILE} (written before manifests): loaded unverified")
    if problem is None and state.get("format", 1) >= STATE_FORMAT and has_manifest:
        listed = {e["path"] for e in json.loads((path / MANIFEST_FILE).read_text())["files"]}
        if STATE_FILE not in listed:
            problem = f"{MANIFEST_FILE} does not cover {STATE_FILE}"
    verdict.problem, verdict.state = problem, state if problem is None else None
    return verdict


def weights_only_load(path: str, map_location=None, mmap: bool = False):
    """DeepSpeed's checkpoint files through torch.load(weights_only=True): tensors, containers and the DeepSpeed
    classes its optimizer state holds (the ZeRO stage, the loss scalers, and ZeRO-1/2's parameter slice mappings, a
    dataclass of two ints), nothing else is unpickled. `mmap`: tensors stay in the file until read."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def load_checkpoint(engine, path: Path) -> dict[str, Any]:
    """Restore engine and return the trainer state of a checkpoint (verify it first: verify_checkpoint).

    Raises ValueError with one line when DeepSpeed cannot load it: a file holding anything but tensor data (a
    pickled object is refused, never executed), a truncated archive, missing keys."""
    # DeepSpeed's own loader unpickles arbitrary objects (weights_only=False).
    engine.checkpoint_engine.load = weights_only_load
    try:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    except pickle.UnpicklingError as err:
        raise ValueError(f"refused: a file holds pickled objects other than tensor data ({_one_line(err)})") from None
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, EOFError, OSError, IndexError) as err:
        raise ValueError(f"DeepSpeed could not load it ({_one_line(err)})") from None
    if load_path is None:
        raise ValueError("DeepSpeed found no loadable checkpoint there")
    return json.loads((path / STATE_FILE).read_text())


def run_signature(profile, world_size: int) -> dict[str, dict[str, Any]]:
    """What a checkpoint must share with the profile that resumes it (`fixed`: model, LoRA, parallel layout), and
    what may change but is worth a note (`noted`: train and data settings; train.steps, train.epochs and output.*
    change freely)."""
    model = profile.model.model_dump(mode="json", exclude={"checkpoint"})
    layout = {"expert_parallel": profile.parallel.expert_parallel, "zero_stage": profile.parallel.zero_stage}
    # The rows a step reads depend on it (world size / context_parallel groups); named only above 1, so a run without
    # it has the signature of a profile that does not name it.
    if profile.parallel.context_parallel > 1:
        layout["context_parallel"] = profile.parallel.context_parallel
    train = profile.train.model_dump(mode="json", exclude={"steps", "epochs"})
    return {
        "fixed": {"model": model, "lora": profile.lora.model_dump(mode="json"), "parallel": layout,
                  "world_size": world_size},
        # Data paths absolute: one file named relative and absolute is one file.
        "noted": {"train": train, "data": dump_with_absolute_paths(profile)["data"]},
    }  # fmt: skip


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    """Dotted paths to values; lists of dicts are indexed (`model.layers[2].attention`), other lists are values."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_leaves(inner, f"{prefix}.{key}" if prefix else key))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {f"{prefix}.length": len(value)}
        for i, inner in enumerate(value):
            out.update(_leaves(inner, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def signature_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, saved value, current value) for every field that differs, in a stable order."""
    old, new = _leaves(saved, ""), _leaves(current, "")
    missing = object()
    keys = list(old) + [k for k in new if k not in old]
    return [
        (key.replace("world_size", "the world size"), json_shown(old.get(key)) if key in old else "(not set)",
         json_shown(new.get(key)) if key in new else "(not set)")
        for key in keys
        if old.get(key, missing) != new.get(key, missing)
    ]  # fmt: skip


def _broadcast(value: Any) -> Any:
    """Rank 0's value on every rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def resume_checkpoint(
    engine, root: Path, signature: dict[str, Any], device, bias_sizes: list[int] | None = None
) -> tuple[Path, dict[str, Any], list[str]]:
    """Load the newest checkpoint under root that verifies and loads; return it, its trainer state, and one line per
    checkpoint skipped (and why) or note. `bias_sizes`: the length of each MoE layer's selection bias in the model,
    which the state's must match.

    ProfileError (one line per field) when that checkpoint was trained with another model, LoRA or parallel layout
    than `signature` says; ProfileError listing every checkpoint and why when none can be loaded."""
    from moe_tune.profiles import ProfileError

    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    candidates = checkpoint_dirs(root)
    if not candidates:
        why = ""
        if misnamed := misnamed_checkpoints(root):
            name, step = next(iter(misnamed.items()))
            why = (f" ({', '.join(misnamed)}: not named as the trainer names checkpoints, {checkpoint_name(step)} "
                   f"for {name})")
        raise ProfileError([f"--resume: no checkpoint under {root}{why}"])
    lines: list[str] = []
    reasons: list[str] = []
    for path in reversed(candidates):
        verdict = _broadcast(verify_checkpoint(path) if is_main else None)
        if verdict.problem is not None:
            lines.append(f"skipped {path}: {verdict.problem}")
            reasons.append(f"--resume: {path}: {verdict.problem}")
            continue
        saved = verdict.state.get("signature")
        if saved is not None:
            differences = signature_differences(saved.get("fixed", {}), signature["fixed"])
            if differences:
                raise ProfileError([
                    f"--resume: {path} was trained with {key} {was}, the profile says {now}"
                    for key, was, now in differences
                ])  # fmt: skip
        saved_sizes = [len(b) for b in verdict.state.get("selection_bias", [])]
        if bias_sizes is not None and saved_sizes != bias_sizes:
            problem = f"{STATE_FILE}: 'selection_bias' has sizes {saved_sizes}, the model's MoE layers {bias_sizes}"
            lines.append(f"skipped {path}: {problem}")
            reasons.append(f"--resume: {path}: {problem}")
            continue
        try:
            state = load_checkpoint(engine, path)
            problem = None
        except ValueError as err:
            problem = str(err)
        if any_rank(problem is not None, device):
            problem = problem or "another rank could not load it"
            lines.append(f"skipped {path}: {problem}")
            reasons.append(f"--resume: {path}: {problem}")
            continue
        noted = signature_differences(saved.get("noted", {}), signature["noted"]) if saved is not None else []
        lines += [f"note: {path} was trained with {key} {was}, the profile says {now}" for key, was, now in noted]
        return path, state, lines + verdict.notes
    raise ProfileError([f"--resume: no checkpoint under {root} verifies and loads", *reasons])
