"""The `moe-tune` command line: one Typer app per command group, joined here. No logic lives in cli/."""

from __future__ import annotations

import typer

from . import align, finetune, plan, profile, profiles

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


def main() -> None:
    app()
