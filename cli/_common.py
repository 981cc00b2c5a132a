"""What every command shares: loading a profile with --set overrides, and turning user errors into exit code 2."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator

import typer
from rich.console import Console

from moe_tune.engine.atomic_write import file_refused, folder_refused
from moe_tune.profiles import JobProfile, ProfileError, bounded_line, load_profile

USER_ERROR_EXIT = 2

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="override a profile field: --set train.lr=1e-3 (repeatable; values parse as YAML)"),
]
ProfileArg = Annotated[str, typer.Argument(help="profile YAML path, or the name of a shipped profile (e.g. tiny)")]


# Problems printed at most: past them one line counts the rest (a hostile profile can hold 100k unknown keys).
MAX_PRINTED_PROBLEMS = 200


def print_error(line: str) -> None:
    """Print `error: line` on stderr: control and bidirectional characters as escapes, never raw, the line bounded
    in length (profiles.bounded_line), no rich markup or emoji codes."""
    err_console.print(f"error: {bounded_line(str(line))}", markup=False, highlight=False, emoji=False)


def fail(problems: list[str]) -> None:
    """Print one line per problem (print_error) and exit with code 2, no traceback."""
    for line in problems[:MAX_PRINTED_PROBLEMS]:
        print_error(line)
    if len(problems) > MAX_PRINTED_PROBLEMS:
        print_error(f"... and {len(problems) - MAX_PRINTED_PROBLEMS} more problems")
    raise typer.Exit(code=USER_ERROR_EXIT)


@contextmanager
def user_errors() -> Iterator[None]:
    """Catch user-input errors at the edge: ProfileError, and files the user named that cannot be read."""
    from moe_tune.engine.families import UnsupportedModel

    try:
        yield
    except (ProfileError, UnsupportedModel) as err:
        fail(err.problems)


def read_profile(path: str, overrides: list[str] | None) -> JobProfile:
    """Load and validate a profile; `model: {checkpoint: DIR}` comes back with the architecture read from DIR."""
    from moe_tune.engine.families import resolve_job

    with user_errors():
        return resolve_job(load_profile(path, overrides or []))


def output_problems(json_out: Path | None, plot: Path | None, baseline: Path | None, profile_file: Path | None = None,
                    inputs: Iterable[tuple[str, Path | None]] = ()) -> list[str]:  # fmt: skip
    """One line per output file that cannot be written where it is named, checked before anything runs: the file
    another option or the PROFILE names (it would be overwritten), a folder, a folder that does not exist, no write
    permission, a --plot format matplotlib cannot write (or no matplotlib). `inputs`: (name, path) of the files other
    options read (`("--batch", path)`), which no output may overwrite either."""
    problems = []
    seen: dict[Path, str] = {}
    read = [("PROFILE", profile_file), ("--baseline", baseline), *inputs]
    for name, path in [*read, ("--json", json_out), ("--plot", plot)]:
        if path is None:
            continue
        where = f"{name} ({str(path)!r})"
        resolved = path.resolve()
        if resolved in seen:
            problems.append(f"{where} is the {seen[resolved]} file: the run would overwrite it; name another file")
            continue
        seen[resolved] = name
        if name not in ("--json", "--plot"):
            continue
        if path.is_dir():
            problems.append(f"{where} is a folder: name a file to write")
        elif not path.parent.is_dir():
            problems.append(f"{where}: its folder {str(path.parent)!r} does not exist")
        elif not os.access(path if path.exists() else path.parent, os.W_OK):
            problems.append(f"{where}: no permission to write {'it' if path.exists() else 'into its folder'}")
        elif (refused := _write_refused(path)) is not None:
            problems.append(f"{where}: {refused}")
        elif name == "--plot":
            problems += _plot_format_problems(path)
    return problems


def input_file_problems(inputs: Iterable[tuple[str, Path | None]]) -> list[str]:
    """One line per file an option reads (`inputs`: (option, path)) that exists but is neither a regular file nor a
    folder: a FIFO would block the read for ever, a device (/dev/zero) never end it. A folder, or a missing file, is
    left to the reader's own message."""
    from moe_tune.profiles.schema import file_kind

    problems = []
    for name, path in inputs:
        try:
            mode = path.stat().st_mode if path is not None else None
        except OSError:
            continue
        if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            problems.append(f"{name} ({str(path)!r}) is not a regular file ({file_kind(mode)}); name a file")
    return problems


def report_file_problems(name: str, path: Path) -> list[str]:
    """A line when the report file `path` (its missing folders created as it is written) cannot be written, checked
    before anything runs: its nearest existing folder is a file, or the OS refuses a file there or a folder in it (a
    read-only mount, /proc), tried with an empty one created and removed at once."""
    where = f"{name} ({str(path)!r})"
    parent = path.absolute().parent
    if not os.path.lexists(parent):
        refused = folder_refused(parent)
    elif not parent.is_dir():
        refused = f"{str(parent)!r} is not a folder"
    else:
        refused = _write_refused(path)
    return [f"{where}: {refused}"] if refused is not None else []


def _write_refused(path: Path) -> str | None:
    """Why the OS refuses to write `path` (a read-only mount, /proc, where permissions say yes to root), tried
    without changing anything: an existing file opened for writing and closed untouched, or a new file created beside
    it and removed; a FIFO no process reads (writing it would wait for a reader for ever, after the run; one that a
    process reads is held open for writing until the report is written); None when it can be written (or is another
    kind of file: a device, /dev/stdout, is written as it comes)."""
    if path.is_fifo():
        from moe_tune.engine.atomic_write import fifo_has_reader

        try:
            if not fifo_has_reader(path):
                return "a FIFO that no process reads: writing it would wait for a reader for ever"
        except OSError as err:
            return f"it cannot be opened for writing ({err.strerror or err})"
    elif path.is_file():
        try:
            with path.open("r+b"):
                pass
        except OSError as err:
            return f"it cannot be opened for writing ({err.strerror or err})"
    elif not path.exists():
        return file_refused(path.parent)
    return None


def _plot_format_problems(plot: Path) -> list[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [f"--plot ({str(plot)!r}) needs matplotlib, which is not installed"]
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if plot.suffix[1:].lower() in formats:
        return []
    return [f"--plot ({str(plot)!r}) must end in a format matplotlib writes: {', '.join('.' + f for f in formats)}"]
