"""The `moe-tune` command line: one Typer app per command group (cli/<group>.py), joined in cli/commands.py. No
logic lives in cli/.

This module imports nothing, so that `main`, the installed command, holds a Ctrl-C pressed while the commands import
(torch alone takes a second): the shell's code for SIGINT, no traceback.
"""

# The shell's exit code for a command stopped by SIGINT (Ctrl-C): 128 + 2.
INTERRUPTED_EXIT = 130


def main() -> None:
    """The `moe-tune` command (commands.run_command_line). A Ctrl-C before a command's own handling of it (while
    the commands import, while the command line is parsed) exits 130, silently as a shell's own commands do."""
    import signal

    interrupted = []

    def note_interrupt(signum, frame):
        # Noted as well as raised: an import's C code may clear the KeyboardInterrupt it is handed (PyErr_Clear).
        interrupted.append(signum)
        raise KeyboardInterrupt

    # A SIGINT the shell made this process ignore (a background job, nohup) stays ignored.
    is_default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        if is_default:
            signal.signal(signal.SIGINT, note_interrupt)
        try:
            from .commands import run_command_line
        finally:
            if is_default:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if interrupted:
            raise KeyboardInterrupt
        run_command_line()
    except KeyboardInterrupt:
        _end_at_interrupt(INTERRUPTED_EXIT, is_default)
        raise SystemExit(INTERRUPTED_EXIT) from None
    except SystemExit as done:
        _end_at_interrupt(done.code if isinstance(done.code, int) else 0 if done.code is None else 1, is_default)
        raise


def _end_at_interrupt(code: int, is_default: bool) -> None:
    """From the command's end to the process's (atexit handlers, libraries' __del__ at shutdown: a tracker's upload, a
    process group's teardown), a Ctrl-C ends the process at once with the command's exit `code`, its output flushed,
    where Python would print a KeyboardInterrupt traceback from the teardown and go on with it. A SIGINT the shell
    made this process ignore (`is_default` False) stays ignored."""
    import os
    import signal
    import sys

    def end(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    if is_default:
        signal.signal(signal.SIGINT, end)


def __getattr__(name: str):
    """`from moe_tune.cli import app` (or version_lines): the joined app, imported on first use."""
    if name in ("app", "version_lines"):
        from . import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
