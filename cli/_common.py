"""What every command shares: loading a profile with --set overrides, and turning user errors into exit code 2."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Annotated, Iterator

import typer
from rich.console import Console

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


