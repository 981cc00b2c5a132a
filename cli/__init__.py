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
        raise SystemExit(INTERRUPTED_EXIT) from None


def __getattr__(name: str):
    """`from moe_tune.cli import app` (or version_lines): the joined app, imported on first use."""
    if name in ("app", "version_lines"):
        from . import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
