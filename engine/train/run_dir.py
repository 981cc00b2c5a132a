"""One run per output.dir: checked and locked before anything is read or written.

`output.dir/.lock` is created atomically (O_CREAT | O_EXCL) by the main rank and names its holder (pid, host, start
time); a second run into the directory is refused while the holder lives. A lock whose pid is dead on this host is
taken over (with a note); a lock from another host is respected, as its pid cannot be checked from here. Under the
lock, a directory holding a previous run's results is refused unless the run resumes it (`--resume`) or replaces
them (`--overwrite`, which deletes moe-tune's own outputs only, never other files), so checkpoints of one run are
never mixed with metrics of another.

A command that reads a finished run (`moe-tune export`, `generate` while it loads the model) marks the folder for
as long as it reads it (`.lock.reader-HOST-PID-TOKEN`, naming its holder as the lock does; reading_run): a run into
the folder, whose --overwrite or --resume would remove or replace what it reads, is refused while a reader lives,
and a reader is refused while a run holds the folder. Each side writes its own file before it looks for the other's,
so of a reader and a run that start together at least one is refused.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import socket
import stat
import uuid
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import yaml

from moe_tune.engine.atomic_write import file_refused, folder_refused
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

from .checkpoint import complete_checkpoints
from .distributed import DistInfo
from .loggers import MLFLOW_STORE, WANDB_STORE

LOCK_NAME = ".lock"
# Results of a run: their presence means the directory holds a run that a new one would mix with.
RUN_RESULTS = (
    "metrics.jsonl", "summary.json", "checkpoints", "adapter", "adapter-transformers", "model.safetensors",
    "merged", "merged.safetensors", "export", "export-merged", "tensorboard", "loggers.json",
)  # fmt: skip
# Written by every run before its first step (the run's settings and its generated corpus): replaced, not mixed.
RUN_SETTINGS = ("profile.yaml", "deepspeed_config.json", "generated-data")
# The trackers' stores in output.dir (W&B's local files, MLflow's file store): one store holds every run logged into
# it, the runs of the folder before an --overwrite among them, so --overwrite keeps them (the new run is logged beside
# the earlier ones) and their presence alone is no previous run. A run writes into them: a link leading outside
# output.dir is refused, on every run.
TRACKER_STORES = (WANDB_STORE, MLFLOW_STORE)
# Files written atomically through `.NAME.tmp` (checkpoint.write_text_atomic, trainer._save_atomic).
TMP_FORMAT = ".{}.tmp"
# The previous run's outputs while an --overwrite run sets up (reads its data, builds its model): removed once it is
# set up, moved back when it is refused or stopped before. SET_ASIDE_DONE, a file inside, says every output was moved;
# DROPPED is the folder renamed for its removal (a removal cut short leaves it, removed by the next claim).
OVERWRITTEN = f"{LOCK_NAME}.overwritten"
SET_ASIDE_DONE = ".done"
DROPPED = f"{LOCK_NAME}.dropped"
# Every name a run writes (or --overwrite deletes) in its output.dir, the temporaries of its atomic writes included.
OWNED_NAMES = (*RUN_RESULTS, *RUN_SETTINGS, *(TMP_FORMAT.format(n) for n in (*RUN_RESULTS, *RUN_SETTINGS)),
               *TRACKER_STORES, LOCK_NAME)
# A reader's mark in the folder it reads: READER_PREFIX + HOST-PID-TOKEN (reading_run).
READER_PREFIX = f"{LOCK_NAME}.reader-"
# A lock holds about 150 bytes of JSON; a larger file is none.
MAX_LOCK_BYTES = 4096
# pids are positive and fit pid_t (32-bit signed); os.kill takes no larger number, and 0 or -1 signal groups.
PID_LIMIT = 2**31


def _reason(err: OSError) -> str:
    return err.strerror.lower() if err.strerror else str(err)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # The pid exists under another user.
        return True
    return True


def _read_lock(path: Path) -> dict | None:
    """The holder recorded in a lock file, or None when the file cannot be read as one: not a regular file (a FIFO
    would block the read for ever, a device never end it), larger than any lock, or a pid no process can have
    (outside [1, PID_LIMIT)) among them."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            holder = json.loads(f.read(MAX_LOCK_BYTES + 1))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("host"), str):
        return None
    pid = holder.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < PID_LIMIT:
        return holder
    return None


def holder_of_this_process(**fields) -> dict:
    """What a lock (or a reader's mark) records of its holder: pid, host, start time, a token of its own, `fields`."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex, **fields}  # fmt: skip


class RunDirLock:
    """`output.dir/.lock`, held by this process from acquire() to release()."""

    def __init__(self, out: Path, created_dir: bool = False):
        self.out = out
        # This run created the directory: release() removes it again if nothing was written into it.
        self.created_dir = created_dir
        self.path = out / LOCK_NAME
        self.holder = holder_of_this_process()
        self.note: str | None = None
        # The run outputs the claim found in the folder once any previous run was set aside (check_output_dir).
        self.found_outputs: frozenset[str] = frozenset()

    def _create(self) -> bool:
        """Create the lock file with our holder; False when one exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.holder, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def acquire(self) -> None:
        """Take the lock or raise ProfileError naming its holder; a dead holder on this host is replaced."""
        where = f"output.dir ({self.out})"
        try:
            if self._create():
                return
            holder = _read_lock(self.path)
            if holder is None:
                raise ProfileError([
                    f"{where} is locked by {self.path}, which does not name a holder (pid and host): if no run uses "
                    "this directory, delete that file"
                ])  # fmt: skip
            who = f"pid {holder['pid']} on host {holder['host']}, started {holder.get('started', '?')}"
            here = socket.gethostname()
            if holder["host"] != here:
                raise ProfileError([
                    f"{where} is in use by another run: {who} ({self.path}); a lock from another host is respected, "
                    "as its pid cannot be checked from here: if that run is gone, delete the lock"
                ])  # fmt: skip
            if pid_alive(holder["pid"]):
                raise ProfileError([f"{where} is in use by another run: {who} ({self.path}); one run per output.dir"])
            self._take_over(holder)
            self.note = f"note: took over the lock of a run that is gone ({who}) in {self.out}"
        except OSError as err:
            raise ProfileError([f"{where} is not writable: cannot create {self.path} ({_reason(err)})"]) from None

    def _take_over(self, stale: dict) -> None:
        """Replace a stale lock; a run that replaced it first keeps it (the renamed file is checked and put back)."""
        moved = self.out / f"{LOCK_NAME}.stale-{self.holder['token']}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            moved = None
        if moved is not None and _read_lock(moved) != stale:
            # Another run took the stale lock over between our read and our rename: its lock goes back.
            try:
                os.link(moved, self.path)
            finally:
                moved.unlink()
            self.acquire()
            return
        if moved is not None:
            moved.unlink()
        if not self._create():
            # Another run created its lock after ours was removed: acquire() now names it.
            self.acquire()

    def release(self) -> None:
        """Remove the lock if it is still ours, and the directory if this run created it and left it empty."""
        if _read_lock(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
        if self.created_dir:
            try:
                self.out.rmdir()
            except OSError:
                pass


def is_held(out: Path) -> bool:
    """Whether a run holds `out`: its lock names a live process on this host, a process on another host (whose pid
    cannot be checked from here), or no holder at all. A lock left by a run that died on this host holds nothing."""
    path = out / LOCK_NAME
    if not os.path.lexists(path):
        return False
    holder = _read_lock(path)
    return holder is None or holder["host"] != socket.gethostname() or pid_alive(holder["pid"])


def held_problem(run_dir: Path, reader: str) -> str | None:
    """The line refusing `reader` (the command: export, generate) the folder `run_dir` while a run holds it
    (is_held), None when none does."""
    if not is_held(run_dir):
        return None
    return f"{run_dir}: a run holds this folder ({LOCK_NAME}); {reader} it once the run has ended"


@contextmanager
def reading_run(run_dir: Path, reader: str, command: str | None = None) -> Iterator[None]:
    """Mark `run_dir` as read by this process for the block (`command`, default `reader`: the command, as a refused
    run names it; `reader`: what the line refusing this reader says it may do once a run holding the folder has
    ended, held_problem), so that no run starts into it meanwhile (reader_problems). The mark is written whole (a
    temporary file renamed into place) before the folder's lock is looked at: ProfileError when a run holds the
    folder. The mark goes when the block ends, however it ends. A folder that is no run's (no profile.yaml) is not
    marked: the reader refuses it. A folder this process cannot write into (a read-only mount, another user's run) is
    read unmarked: a run into it by this user cannot start either."""
    run_dir = Path(run_dir)
    mark = None
    if (run_dir / "profile.yaml").is_file():
        holder = holder_of_this_process(reader=command or reader)
        mark = run_dir / f"{READER_PREFIX}{holder['host']}-{holder['pid']}-{holder['token']}"
        tmp = mark.with_name(mark.name + ".tmp")
        try:
            tmp.write_text(json.dumps(holder))
            tmp.replace(mark)
        except OSError:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            mark = None
    try:
        if (held := held_problem(run_dir, reader)) is not None:
            raise ProfileError([held])
        yield
    finally:
        if mark is not None:
            mark.unlink(missing_ok=True)


def reader_problems(out: Path) -> list[str]:
    """One line per reader of `out` (reading_run) that a run into it would pull the files from under: its mark names
    a live process on this host, a process on another host (whose pid cannot be checked from here), or no holder.
    The marks of readers gone on this host are removed."""
    where = f"output.dir ({out})"
    problems = []
    for mark in sorted(out.glob(glob.escape(READER_PREFIX) + "*")):
        if mark.name.endswith(".tmp"):
            continue  # a mark being written: its reader looks for the lock once it is in place
        holder = _read_lock(mark)
        if holder is None:
            problems.append(f"{where} is marked as read by {mark}, which does not name a reader (pid and host): if "
                            "nothing reads this folder, delete that file")
            continue
        who = (f"{reader_name(holder)}: pid {holder['pid']} on host {holder['host']}, started "
               f"{holder.get('started', '?')} ({mark})")
        if holder["host"] != socket.gethostname():
            problems.append(f"{where} is being read by {who}; a reader on another host is respected, as its pid cannot "
                            "be checked from here: if it is gone, delete that file")
        elif pid_alive(holder["pid"]):
            problems.append(f"{where} is being read by {who}; a run would replace what it reads: start the run once "
                            "it has ended")
        else:
            mark.unlink(missing_ok=True)
    return problems


def reader_name(holder: dict) -> str:
    """What a reader's mark names: `moe-tune export`; `a reader` where it names no command."""
    reader = holder.get("reader")
    return f"moe-tune {reader}" if isinstance(reader, str) and reader else "a reader"


def previous_run_outputs(out: Path) -> list[str]:
    """Results of an earlier run in `out` (RUN_RESULTS present), in a stable order."""
    return [name for name in RUN_RESULTS if os.path.lexists(out / name)]


def stray_settings(out: Path) -> list[str]:
    """The names of RUN_SETTINGS in `out` that no run wrote: any of them when `out` holds no profile.yaml a run
    wrote (a resolved profile: every top-level section of the schema present), as a user's own deepspeed_config.json;
    a fresh run would replace them."""
    present = [name for name in RUN_SETTINGS if os.path.lexists(out / name)]
    return [] if not present or holds_run_profile(out) else present


def moved_run_profile_problem(profile_path: Path, out: Path, remedy: str) -> str | None:
    """A line when `profile_path` is the profile.yaml a run wrote into its folder (beside the run's results) and its
    output.dir `out` names another folder: the run folder was copied or moved (or the file's output.dir is relative
    to another working directory), and a command reading output.dir would continue, replace or read that other
    folder's run. `remedy` ends the line, `{folder}` in it the run's folder."""
    folder = profile_path.parent.absolute()
    if profile_path.name != "profile.yaml" or not (holds_run_profile(folder) and previous_run_outputs(folder)):
        return None
    if out.expanduser().resolve() == folder.resolve():
        return None
    return (f"PROFILE ({profile_path}) is the profile.yaml of the run in {folder}, but its output.dir is {out}: the "
            f"run was copied or moved, so output.dir names another folder; {remedy.format(folder=folder)}")


def holds_run_profile(folder: Path) -> bool:
    """Whether `folder` holds a profile.yaml a run wrote (a resolved profile: every top-level section of the schema
    present), as every run writes before its first step."""
    try:
        written = yaml.safe_load((folder / "profile.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(written, dict) and set(JobProfile.model_fields) <= set(written)


def kept_after_interrupt(out: Path) -> str:
    """What an interrupted run leaves the next one in `out`, as the end of the line that reports the interrupt:
    complete checkpoints to resume from, or none, so that the next run starts over (with --overwrite where the
    folder holds the interrupted run's results)."""
    if complete_checkpoints(out / "checkpoints"):
        return f"the complete checkpoints in {out} are kept (--resume continues from the newest)"
    found = previous_run_outputs(out)
    if found:
        return (f"{out} holds no complete checkpoint, so the next run starts over, with --overwrite (which replaces "
                f"{', '.join(found)})")  # fmt: skip
    return f"no checkpoint was written in {out}, so the next run starts over"


def run_output_entries(out: Path) -> list[Path]:
    """What moe-tune writes into `out` and finds there (results, settings and their temporaries, in a stable order);
    not the tracker stores (TRACKER_STORES) or other files."""
    entries = []
    for name in (*RUN_RESULTS, *RUN_SETTINGS):
        # Folders written through a writer's own temporary sibling (export.staging_folder: `.NAME.tmp-HOST-PID`).
        staged = sorted(out.glob(glob.escape(TMP_FORMAT.format(name)) + "-*"))
        entries += [entry for entry in (out / name, out / TMP_FORMAT.format(name), *staged) if os.path.lexists(entry)]
    return entries


def remove_run_outputs(out: Path, keep: frozenset[str] = frozenset()) -> list[str]:
    """Delete what moe-tune writes into `out` (run_output_entries) but the names in `keep`; other files, and the
    tracker stores, stay. A symlink is removed, never followed. Returns the names removed."""
    removed = []
    for entry in run_output_entries(out):
        if entry.name not in keep:
            _remove(entry)
            removed.append(entry.name)
    return removed


def _remove(entry: Path) -> None:
    """A file, a link (never followed) or a folder with what it holds."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def set_aside_run_outputs(out: Path) -> list[str]:
    """Move what moe-tune wrote into `out` (run_output_entries) into out/OVERWRITTEN, where an --overwrite run keeps
    the previous run until it is set up (drop_set_aside) or refused (restore_set_aside); SET_ASIDE_DONE marks the
    move complete. Returns the names moved."""
    aside = out / OVERWRITTEN
    aside.mkdir()
    moved = []
    for entry in run_output_entries(out):
        entry.rename(aside / entry.name)
        moved.append(entry.name)
    (aside / SET_ASIDE_DONE).touch()
    return moved


def restore_set_aside(out: Path) -> bool:
    """The previous run set aside in out/OVERWRITTEN back in place; whether there was one. Once the move was complete
    (SET_ASIDE_DONE) the run outputs in `out` are the new run's and are removed; a move cut short (a signal, a kill)
    left the rest of the previous run in place, and only what was moved comes back."""
    aside = out / OVERWRITTEN
    if not aside.is_dir() or aside.is_symlink():
        return False
    names = sorted(entry.name for entry in aside.iterdir() if entry.name != SET_ASIDE_DONE)
    if (aside / SET_ASIDE_DONE).exists():
        for entry in run_output_entries(out):
            _remove(entry)
    for name in names:
        (aside / name).rename(out / name)
    (aside / SET_ASIDE_DONE).unlink(missing_ok=True)
    aside.rmdir()
    return True


def drop_set_aside(out: Path) -> None:
    """Remove the previous run an --overwrite run set aside, once that run is set up: renamed first (DROPPED), so
    a removal cut short is never taken for a previous run to put back."""
    aside = out / OVERWRITTEN
    if aside.is_dir() and not aside.is_symlink():
        aside.rename(out / DROPPED)
        shutil.rmtree(out / DROPPED)


def runs_inside(out: Path) -> list[Path]:
    """Run folders (holds_run_profile) at or below the names a run keeps in `out` (`out/adapter` used as another
    run's output.dir): a previous run's outputs they are not, and --overwrite must not remove them."""
    found = []
    for entry in run_output_entries(out):
        if entry.is_dir() and not entry.is_symlink():
            inner = (p for p in (entry, *entry.rglob("*")) if p.is_dir() and (p / "profile.yaml").is_file())
            found += [p for p in inner if holds_run_profile(p)][:1]
    return found


def links_out_of(run_dir: Path, names: tuple[str, ...]) -> list[str]:
    """One line per name in `run_dir` that resolves outside it (a link, or a link above it; the names under one
    named already are not named again): a run's files are read and written only inside its folder."""
    root = run_dir.resolve()
    problems, outside = [], []
    for name in names:
        path = run_dir / name
        if any(above in path.parents for above in outside):
            continue
        if os.path.lexists(path) and root not in path.resolve().parents:
            outside.append(path)
            problems.append(f"{path}: leads to {str(path.resolve())!r}, outside the run folder; a run's files are read "
                            "and written only inside it")
    return problems


def is_owned_name(name: str) -> bool:
    """Whether a run owns the name `name` in its output.dir: OWNED_NAMES, its writers' staged folders
    (`.NAME.tmp-HOST-PID`, which --overwrite removes) and the lock's companions (`.lock.*`: a reader's mark, a stale
    lock being replaced)."""
    staged = tuple(TMP_FORMAT.format(n) + "-" for n in (*RUN_RESULTS, *RUN_SETTINGS))
    return name in OWNED_NAMES or name.startswith((f"{LOCK_NAME}.", *staged))


def owned_place(path: Path, out: Path) -> Path | None:
    """The name a run owns in `out` (is_owned_name) that `path` is or lies inside (both resolved), or None."""
    if path == out or out not in path.parents:
        return None
    first = out / path.relative_to(out).parts[0]
    return first if is_owned_name(first.name) else None


def enclosing_run_problem(out: Path, subject: str | None = None, written: str = "this run's files",
                          own_run: Path | None = None) -> str | None:  # fmt: skip
    """The line refusing output.dir `out` (or the folder `subject` names, holding what `written` says) when it is, or
    lies inside, a name that a run in a folder above it owns (`run/checkpoints/step-N`, `run/adapter`, `run/export`):
    that run's pruning, --resume or --overwrite would delete or read it. A folder above is a run's when it holds the
    profile.yaml a run writes (holds_run_profile; a user's own profile and folders named `checkpoints` beside it are
    no run); `own_run`, the run a command writes for, is left to its own rules. None elsewhere. Paths compare
    resolved (symlinks followed)."""
    resolved = out.expanduser().resolve()
    skipped = own_run.expanduser().resolve() if own_run is not None else None
    for folder in resolved.parents:
        place = owned_place(resolved, folder)
        if place is not None and folder != skipped and holds_run_profile(folder):
            where = "is" if place == resolved else "lies inside"
            return (f"{subject or f'output.dir ({out})'} {where} {place.name!r}, a name the run in {folder} keeps in "
                    f"its folder (its pruning, --resume or --overwrite would delete or read {written}); choose another "
                    "folder")
    return None


def _written_place(read: Path, out: Path) -> str | None:
    """Where in `out` a run writes over `read` (a path the run reads): `out` itself (a run writes its outputs
    there), or one of the names it writes or --overwrite deletes, `read` being it or inside it; None elsewhere."""
    if read == out:
        return str(out)
    place = owned_place(read, out)
    return None if place is None else str(place)


def check_reads_apart(out: Path, reads: dict[str, Path | None]) -> None:
    """ProfileError naming each of `reads` ({profile field: path the run reads}) that lies where the run writes into
    `out` (output.dir): a checkpoint's own folder as output.dir would have its model.safetensors replaced by the
    run's and deleted by --overwrite. Paths compare resolved (symlinks followed)."""
    out = out.expanduser().resolve()
    problems = []
    for field, path in reads.items():
        if path is None:
            continue
        place = _written_place(path.expanduser().resolve(), out)
        if place is not None:
            problems.append(f"{field} ({str(path)!r}) lies where the run writes ({place!r}, in output.dir): its "
                            "outputs and --overwrite would replace what it reads; set output.dir to another folder")
    if problems:
        raise ProfileError(problems)


def run_reads(profile: JobProfile) -> dict[str, Path | None]:
    """{profile field: path} of what a run reads that a run's outputs could land on (run_dir.check_reads_apart)."""
    data = profile.data
    reads: dict[str, Path | None] = {"model.checkpoint": profile.model.checkpoint, "data.path": data.path,
                                     "data.eval_path": data.eval_path}  # fmt: skip
    for index, source in enumerate(data.sources or []):
        reads[f"data.sources[{index}].path"] = source.path
    if data.tokenizer not in (None, "byte"):
        reads["data.tokenizer"] = Path(data.tokenizer)
    return reads


def outputs_over_run(outputs: dict[str, Path | None], profile: JobProfile,
                     other_reads: dict[str, Path | None] | None = None) -> list[str]:  # fmt: skip
    """One line per file a command writes (`outputs`: {option: path}, e.g. plan's --json) that would replace what the
    profile's run reads (run_reads: a checkpoint folder's files, the data, the tokenizer; and `other_reads`, the
    command's own) or what a run keeps in its output.dir (a checkpoint's manifest, profile.yaml). Paths compare
    resolved."""
    reads = {**run_reads(profile), **(other_reads or {})}
    out = profile.output.dir.expanduser().resolve()
    problems = []
    for option, path in outputs.items():
        if path is None:
            continue
        target = path.expanduser().resolve()
        where = f"{option} ({str(path)!r})"
        for field, read in reads.items():
            source = read.expanduser().resolve() if read is not None else None
            if source is not None and (target == source or source in target.parents):
                problems.append(f"{where} would overwrite what {field} ({str(read)!r}) reads; name a file elsewhere")
                break
        else:
            place = _written_place(target, out)
            if place is not None:
                problems.append(f"{where} lies in the run's {place!r} (output.dir): it would replace what a run "
                                "keeps there; name a file elsewhere")
    return problems


def output_dir_problems(out: Path) -> list[str]:
    """What check_output_dir refuses of the path itself, found without changing anything (for validate): not a
    directory, a directory that cannot be created, or one in which no file can be."""
    where = f"output.dir ({out})"
    if os.path.lexists(out) and not out.is_dir():
        return [_not_a_directory(out)]
    if not out.exists():
        refused = folder_refused(out)
        return [f"{where} cannot be created: {refused}"] if refused is not None else []
    refused = file_refused(out)
    return [f"{where} is not writable: {refused}"] if refused is not None else []


def _not_a_directory(out: Path) -> str:
    kind = "a file" if out.is_file() else "not a directory"
    return f"output.dir ({out}) is {kind}: output.dir must be a directory (or a path to create)"


def check_output_dir(out: Path, resume: bool, overwrite: bool,
                     reads: dict[str, Path | None] | None = None) -> tuple[RunDirLock, list[str]]:  # fmt: skip
    """Create `out` if needed and lock it; refuse (ProfileError) a path that is not a writable directory, one where
    the run would write over what it reads (`reads`, check_reads_apart), a directory in use by another run, one
    holding a previous run's results without resume or overwrite, one whose tracker stores (or, on resume, results
    and settings) lead outside it. With overwrite, the previous run's outputs are set aside (set_aside_run_outputs)
    for claim_output_dir to remove once the run is set up; a previous run an --overwrite run killed during its set-up
    had set aside is put back first. Returns the held lock and notes to print (a lock taken over, the outputs
    --overwrite replaces and the tracker stores it keeps)."""
    where = f"output.dir ({out})"
    if resume and overwrite:
        raise ProfileError(["--resume and --overwrite contradict each other: --resume continues the run in "
                            f"{out}, --overwrite deletes it; give one"])  # fmt: skip
    check_reads_apart(out, reads or {})
    if (enclosed := enclosing_run_problem(out)) is not None:
        raise ProfileError([enclosed])
    if os.path.lexists(out) and not out.is_dir():
        raise ProfileError([_not_a_directory(out)])
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ProfileError([f"{where} cannot be created: {_reason(err)}"]) from None
    lock = RunDirLock(out, created_dir=created)
    try:
        lock.acquire()
    except ProfileError:
        lock.release()
        raise
    notes = [lock.note] if lock.note else []
    try:
        # Looked for under the lock: a reader that marks the folder after this finds the lock and stops.
        readers = reader_problems(out)
        if readers:
            raise ProfileError(readers)
        if os.path.lexists(out / DROPPED) and not os.path.islink(out / DROPPED):
            shutil.rmtree(out / DROPPED)  # a removal a killed run began
        if restore_set_aside(out):
            notes.append(f"note: the previous run's outputs that an --overwrite run killed while it set up had set "
                         f"aside are back in {out}")
        if inner := runs_inside(out):
            raise ProfileError([f"{where} holds another run in {', '.join(str(p) for p in inner)}: a run's output.dir "
                                "inside a name this folder's runs keep; a run here would replace or remove it: move "
                                "it, or choose another output.dir"])  # fmt: skip
        if resume:
            # --resume reads the run's checkpoints and appends to its metrics: through a link, another folder's.
            escaping = links_out_of(out, (*RUN_RESULTS, *RUN_SETTINGS, *TRACKER_STORES))
            if escaping:
                raise ProfileError(escaping)
        else:
            problems = []
            found = previous_run_outputs(out)
            if found and not overwrite:
                problems.append(f"{where} holds a previous run ({', '.join(found)}): continue it with --resume, "
                                "replace its outputs with --overwrite, or choose another output.dir")  # fmt: skip
            strays = [] if found or overwrite else stray_settings(out)
            if strays:
                problems.append(f"{where} holds {', '.join(strays)}, which no run wrote (no run's profile.yaml beside "
                                "it): the run writes its own there; move it, choose another output.dir, or replace it "
                                "with --overwrite")  # fmt: skip
            # A fresh run logs into the stores kept there (the results' links go with --overwrite).
            problems += links_out_of(out, TRACKER_STORES)
            if problems:
                raise ProfileError(problems)
            if found:
                moved = set_aside_run_outputs(out)
                notes.append(f"note: --overwrite replaces the previous run's {', '.join(moved)} in {out}: removed once "
                             "this run has read its data and built its model, left in place if it is refused before")
            kept = [name for name in TRACKER_STORES if os.path.lexists(out / name)]
            if overwrite and kept:
                notes.append(f"note: --overwrite kept {', '.join(kept)} in {out}: tracker stores that may hold other "
                             "runs; the new run is logged beside the earlier ones")
        # What the run finds of its own names (a user's settings --overwrite may replace): a run refused before its
        # set-up removes only what it wrote itself.
        lock.found_outputs = frozenset(entry.name for entry in run_output_entries(out))
    except ProfileError:
        lock.release()
        raise
    except OSError as err:
        with suppress(OSError):  # a move cut short: what was moved comes back
            restore_set_aside(out)
        lock.release()
        raise ProfileError([f"{where}: cannot set the previous run's outputs aside ({_reason(err)})"]) from None
    except BaseException:
        # A signal while the previous run was being set aside: what was moved comes back before the lock goes.
        with suppress(OSError):
            restore_set_aside(out)
        lock.release()
        raise
    return lock, notes


@dataclass
class OutputClaim:
    """output.dir held for a run (claim_output_dir): the notes to print, and the lock the main rank holds."""

    notes: list[str]
    lock: RunDirLock | None
    is_set_up: bool = False

    def set_up(self) -> None:
        """The run has read its data and built its model: the previous run an --overwrite set aside is removed."""
        if self.lock is not None:
            drop_set_aside(self.lock.out)
        self.is_set_up = True


@contextmanager
def claim_output_dir(out: Path, dist: DistInfo, resume: bool, overwrite: bool,
                     reads: dict[str, Path | None] | None = None) -> Iterator[OutputClaim]:  # fmt: skip
    """check_output_dir on the main rank, which alone holds the lock until the block exits (however it exits);
    every rank raises the same ProfileError when the main rank refuses. Yields the claim; a block left by an error
    or a signal before OutputClaim.set_up puts back the previous run an --overwrite set aside (what the run wrote
    removed)."""
    lock, notes, problems = None, [], []
    if dist.is_main:
        try:
            lock, notes = check_output_dir(out, resume, overwrite, reads)
        except ProfileError as err:
            problems = err.problems
    if dist.world_size > 1:
        shared = [problems]
        torch.distributed.broadcast_object_list(shared, src=0, device=dist.device)
        problems = shared[0]
    if problems:
        if lock is not None:
            lock.release()
        raise ProfileError(problems)
    claim = OutputClaim(notes, lock)
    try:
        yield claim
    except BaseException:
        if lock is not None and not claim.is_set_up:
            # Refused or stopped in its set-up: the previous run an --overwrite set aside comes back, what the run
            # wrote (its settings, its generated corpus) goes; left set aside, the next run's claim puts it back.
            with suppress(OSError):
                if not restore_set_aside(out):
                    remove_run_outputs(out, keep=lock.found_outputs)
        raise
    finally:
        if lock is not None:
            lock.release()
