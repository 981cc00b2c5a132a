"""The `moe-tune` app: the command groups (one Typer app each, cli/<group>.py) joined, the root options, and the
command line run with its usage errors in one line (run_command_line; cli/__init__.py's main is the entry point)."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Annotated

import typer

from moe_tune.engine.launch import environment_problems

from . import INTERRUPTED_EXIT, align, export, finetune, plan, profile, profiles
from . import onboard
from . import generate
from ._common import USER_ERROR_EXIT, fail, print_error


class _Commands(typer.core.TyperGroup):
    """The root group: each command listed by the first paragraph of its help as one text, so that the listing wraps
    it to the terminal (Typer's rich listing keeps the docstring's own line breaks)."""

    def format_help(self, ctx, formatter):
        for command in self.commands.values():
            if command.short_help is None and command.help:
                command.short_help = " ".join(command.help.split("\n\n")[0].split())
        super().format_help(ctx, formatter)


app = typer.Typer(
    cls=_Commands,
    name="moe-tune",
    help="Fine-tune huge sparse Mixture-of-Experts models (ZeRO-3 + expert parallelism, LoRA, fused kernels).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(finetune.app)
app.add_typer(profiles.app)
app.add_typer(plan.app)
app.add_typer(profile.app)
app.add_typer(align.app)
app.add_typer(onboard.app)
app.add_typer(export.app)
app.add_typer(generate.app)

# The libraries a bug report needs beside moe-tune's own version (read from their metadata: nothing is imported).
VERSIONED = ("torch", "triton", "deepspeed", "peft", "transformers")


def version_lines() -> list[str]:
    """`moe-tune X.Y.Z`, then the versions of the libraries it runs on (`not installed` for an absent one)."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return [f"moe-tune {version('moe-tune')}", ", ".join(f"{name} {version(name)}" for name in VERSIONED)]


def _print_version(value: bool) -> None:
    if value:
        for line in version_lines():
            typer.echo(line)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="print the versions and exit"),
    ] = False,
) -> None:
    """Fine-tune huge sparse Mixture-of-Experts models (ZeRO-3 + expert parallelism, LoRA, fused kernels)."""
    # A kernel variable that the first kernel call would refuse deep inside a run: refused here, in one line.
    if problems := environment_problems():
        fail(problems)


def _usage_problem(err) -> str:
    """click's message of a usage error; for a value its option cannot take, `--option ('value'): rule` with the value
    as the command line gave it (the last one where the option is given twice: the one click takes)."""
    param = getattr(err, "param", None)
    opts = [opt for opt in getattr(param, "opts", ()) if opt.startswith("-")]
    if type(err).__name__ == "BadParameter" and opts:
        args = sys.argv[1:]
        for index, arg in reversed(list(enumerate(args))):
            for opt in opts:
                if arg == opt and index + 1 < len(args):
                    return f"{opt} ({args[index + 1]!r}): {err.message}"
                if arg.startswith(opt + "="):
                    return f"{opt} ({arg[len(opt) + 1 :]!r}): {err.message}"
    return err.format_message()


def run_command_line() -> None:
    """The `moe-tune` command line. A usage error (an unknown option or command, a value its option cannot parse, a
    missing argument) is one line naming it and where the help is, exit 2, as every other refusal (click's own message
    is a usage block and a box); no arguments print the help, exit 2."""
    # typer raises click's UsageError (its own copy of click in newer typer): found through BadParameter, a subclass.
    usage_error = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")
    try:
        code = app(standalone_mode=False, prog_name="moe-tune")
    except usage_error as err:
        if type(err).__name__ == "NoArgsIsHelpError":
            typer.echo(err.ctx.get_help())
            raise SystemExit(err.exit_code) from None
        where = f" (see {err.ctx.command_path} --help)" if err.ctx is not None else ""
        print_error(f"{_usage_problem(err)}{where}")
        raise SystemExit(USER_ERROR_EXIT) from None
    except typer.Abort:
        # Ctrl-C outside a command's own handling: no traceback, the shell's code for SIGINT.
        raise SystemExit(INTERRUPTED_EXIT) from None
    raise SystemExit(code if isinstance(code, int) else 0)
