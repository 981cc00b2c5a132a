"""The `moe-tune` command line: one Typer app per command group, joined here. No logic lives in cli/."""

from __future__ import annotations

import typer

from . import align, export, finetune, plan, profile, profiles
from . import onboard

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


def main() -> None:
    app()
