"""The `moe-tune` command line: one Typer app per command group, joined here. No logic lives in cli/."""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer

from moe_tune.engine.launch import environment_problems

from . import align, export, finetune, plan, profile, profiles
from . import onboard
from . import generate
from ._common import fail

app = typer.Typer(
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
    # A kernel-launch variable that the first kernel call would refuse deep inside a run: refused here, in one line.
    if problems := environment_problems():
        fail(problems)


def main() -> None:
    app()
