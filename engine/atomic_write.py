"""Report files written whole or not at all (plan --json, profile --json / --plot, onboard --json, align --json,
align --golden): each is written into a temporary file beside it, flushed to disk, and renamed over it, so that a
crash, a Ctrl-C or a full disk mid-write leaves the file as it was, never cut short.

The temporary file is named `.NAME.RANDOM.tmp.SUFFIX` (two writers of one file never share it; writers that pick
the format from the suffix, as matplotlib does, see the file's own), and it is removed when the write fails.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

# Folders of devices and of the kernel's files (/dev/stdout, /proc/self/fd/1): a report named there is written in
# place.
SPECIAL_FOLDERS = ("/dev/", "/proc/")


# Write ends of FIFOs that fifo_has_reader opened, by absolute path, held until atomic_path writes the FIFO: a reader
# that opened it meanwhile (`cat`, `jq . <`) would read end of file at the probe's close, and the report's own open
# would then wait for a reader for ever.
_HELD_WRITERS: dict[str, int] = {}


def fifo_has_reader(path: Path) -> bool:
    """Whether a process has the FIFO `path` open for reading, tried with a write end opened without waiting; when one
    has, that write end stays open until atomic_path has written `path` (or the process ends). OSError other than
    "no reader" (ENXIO) as the OS raised it."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENXIO:
            return False
        raise
    key = os.path.abspath(path)
    if key in _HELD_WRITERS:
        os.close(_HELD_WRITERS.pop(key))
    _HELD_WRITERS[key] = handle
    return True


def folder_refused(folder: Path) -> str | None:
    """Why the OS refuses a new folder at `folder` (not there yet), found without changing anything: its nearest
    existing ancestor is not a folder, or a folder made in it (and removed at once) is refused (a read-only mount,
    /proc, permissions); None when it can be made."""
    existing = next(parent for parent in folder.absolute().parents if os.path.lexists(parent))
    if not existing.is_dir():
        return f"{str(existing)!r} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moe-tune-probe-", dir=existing))
    except OSError as err:
        return f"no folder can be created in {str(existing)!r} ({err.strerror or err})"
    return None


def file_refused(folder: Path) -> str | None:
    """Why the OS refuses a new file in the existing `folder` (a read-only mount, /proc, permissions), found by
    creating an empty one and removing it at once; None when it can be made."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".moe-tune-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        return f"no file can be created in {str(folder)!r} ({err.strerror or err})"
    return None


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def writes_in_place(path: Path) -> bool:
    """Whether atomic_path writes `path` itself rather than a file renamed over it: a device, a FIFO, a path in
    SPECIAL_FOLDERS. Such a path takes one write: a reader of a FIFO or of /dev/stdout sees each write after the
    last."""
    try:
        is_special = not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        is_special = False
    return is_special or os.path.abspath(path).startswith(SPECIAL_FOLDERS)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; when the block ends normally, the file is flushed to
    disk, given the mode `path` has (a new file: the mode the umask gives) and renamed over `path`. On any exception
    (KeyboardInterrupt too) it is removed and `path` is as it was. A symlink named as `path` is written through: the
    file it leads to is replaced, the link kept. A `path` that is no regular file (a device, a FIFO) or lies in
    SPECIAL_FOLDERS is itself the path the block writes (a FIFO's write end that fifo_has_reader holds is
    closed after it)."""
    if writes_in_place(path):
        # Written as it comes, through the path as named: renaming over a device or FIFO would replace the node, and
        # over the file /dev/stdout leads to (a shell's `> file`) would leave the shell's output in the unlinked one.
        key = os.path.abspath(path)
        held = _HELD_WRITERS.pop(key, None)
        try:
            if _is_fifo(path):
                # The block's own open would wait for ever once its reader has gone (killed, a `head` that exited):
                # a FIFO no process reads now is an OSError; the write end held through the block (opened before
                # the one held since the check is closed) keeps the reader from an end of file between opens.
                if not fifo_has_reader(path):
                    raise OSError(errno.ENXIO, "no process reads the FIFO (its reader went away)")
                if held is not None:
                    os.close(held)
                held = _HELD_WRITERS.pop(key)
            yield Path(path)
        finally:
            if held is not None:
                os.close(held)
        return
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=target.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    _sync_folder(target.parent)


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` holding `data` (text is written as UTF-8) whole, or as it was (atomic_path). OSError as the OS
    raised it."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _mode_for(target: Path) -> int:
    """The permission bits the file gets: `target`'s own, or for a new file new_file_mode()."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return new_file_mode()


def new_file_mode() -> int:
    """The permission bits open() gives a new file: 0o666 less the umask (mkstemp and safetensors' save_file create
    0o600 files, which another user, a serving process or a shared folder's, cannot read)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def save_tensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file of `tensors` into `path`, the file given new_file_mode() as the run's other files."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, new_file_mode())


def _sync_folder(folder: Path) -> None:
    """Flush the rename to disk (its folder's entry); a file system that cannot is left to its own schedule."""
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
