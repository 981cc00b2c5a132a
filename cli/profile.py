"""`moe-tune profile`: two commands behind one name. `moe-tune profile PROFILE` times a few training steps of a
profile (profile_steps.py); `moe-tune profile --kernels` times every registered op beside its baselines
(profile_kernels.py). This module holds the command's options and sends each to its path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moe_tune.engine.launch import LAUNCH_ENV, launch_problems, launch_text, use_launch
from moe_tune.profiles import error_line

from . import profile_kernels, profile_steps
from ._common import SetOption, fail, output_problems, read_profile

__all__ = ["app", "profile"]

app = typer.Typer()

DEFAULT_STEPS = 3


@app.command()
def profile(
    profile_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="PROFILE", help="profile YAML path or shipped name: run a few of its training steps"
        ),
    ] = None,
    overrides: SetOption = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="timed training steps (after two warm-up steps)")] = (
        DEFAULT_STEPS
    ),
    against: Annotated[
        str | None,
        typer.Option("--against", metavar="BASELINE", help="also time the same steps of a baseline in this process: "
                     "transformers (the architecture in transformers with PEFT LoRA on the same targets) or bf16-base "
                     "(a model.base_precision fp8 profile against the same model with its FP8 weights dequantized "
                     "into a bf16 base; the per-step loss gap)"),
    ] = None,
    kernels: Annotated[bool, typer.Option("--kernels", help="time the fused ops instead of a profile")] = False,
    ops: Annotated[
        str | None, typer.Option("--ops", help="comma-separated ops to time (default: every registered op)")
    ] = None,
    shapes: Annotated[
        str,
        typer.Option(
            "--shapes",
            metavar="PRESET|SPEC",
            help="small, anchor (docs/PERF.md's), or a SPEC naming every dimension of the chosen ops, e.g. "
            "B4,T8192,H16,K128,V128 for gated_delta_rule,kda or N16384,D2048,F1024,E64,k8 for moe (docs/bench.md)",
        ),
    ] = "small",
    json_out: Annotated[Path | None, typer.Option("--json", help="write the rows as JSON to this file")] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="a saved --json run: exit 1 when a row got >10% slower")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="draw the medians (--kernels) or the breakdown and the comparison (PROFILE) into "
                     "this PNG (needs matplotlib)"),
    ] = None,
    wide: Annotated[
        bool, typer.Option("--wide", help="--kernels: one line per row with its note, wider than 120 columns")
    ] = False,
    launch: Annotated[
        str | None,
        typer.Option("--launch", metavar="ENTRIES",
                     help="kernel launches other than the defaults for this run, FAMILY.FIELD=VALUE comma-separated, "
                     "e.g. causal_conv.one_pass_backward=true (sets MOE_TUNE_LAUNCH; the JSON records it; "
                     "docs/bench.md)"),
    ] = None,
    compare_launch: Annotated[
        list[str] | None,
        typer.Option("--compare-launch", metavar="ENTRIES",
                     help="with a PROFILE: time its steps under the defaults and under this launch (repeat the option "
                     "for more), in turns in one process; --steps gives the rounds (docs/bench.md)"),
    ] = None,
    load_checkpoint: Annotated[
        Path | None,
        typer.Option("--load-checkpoint", metavar="DIR",
                     help="with a PROFILE: instead of training steps, write a synthetic checkpoint of its model in "
                     "the hub's FP8 layout into DIR (unless DIR holds it already) and time loading it: GB/s, peak "
                     "host memory against the shard size"),
    ] = None,
) -> None:
    """Profile a training run (PROFILE) or time each fused op's forward and forward+backward (--kernels)."""
    if kernels == (profile_arg is not None):
        fail(["pass a PROFILE (time its training steps) or --kernels (time the fused ops), not both or neither"])
    # Options of the other mode would be ignored silently (a --baseline that can never fail, say): refuse them.
    other_mode = (
        {"--ops": ops, "--shapes": None if shapes == "small" else shapes, "--baseline": baseline,
         "--wide": wide or None}
        if profile_arg is not None
        else {"--steps": None if steps == DEFAULT_STEPS else steps, "--set": overrides or None, "--against": against,
              "--load-checkpoint": load_checkpoint}
    )
    mode = "a PROFILE" if profile_arg is not None else "--kernels"
    misplaced = [f"{name} ({value}) does not apply with {mode}" for name, value in other_mode.items()
                 if value is not None]
    if load_checkpoint is not None and profile_arg is not None:
        # The load benchmark runs no training step: options of the steps would be ignored.
        misplaced += [f"{name} ({value}) does not apply with --load-checkpoint" for name, value in
                      {"--steps": None if steps == DEFAULT_STEPS else steps, "--against": against,
                       "--plot": plot, "--launch": launch}.items() if value is not None]  # fmt: skip
    if compare_launch and profile_arg is not None:
        # The turns time steps of the profile alone, under launches of their own.
        misplaced += [f"{name} ({value}) does not apply with --compare-launch" for name, value in
                      {"--against": against, "--plot": plot, "--launch": launch,
                       "--load-checkpoint": load_checkpoint}.items() if value is not None]  # fmt: skip
    if compare_launch and kernels:
        misplaced.append("--compare-launch does not apply with --kernels (it times a PROFILE's steps)")
    if misplaced:
        fail(misplaced)
    # Before anything runs: a run of minutes must not end on a file it cannot write, nor overwrite an input.
    profile_file = Path(profile_arg) if profile_arg is not None and Path(profile_arg).is_file() else None
    problems = output_problems(json_out, plot, baseline, profile_file)
    if kernels:
        problems += profile_kernels.input_problems(ops, shapes, baseline)
    if launch is not None:
        problems += launch_problems(launch)
    for text in compare_launch or []:
        problems += launch_problems(text, "--compare-launch")
    if problems:
        fail(problems)
    job = None
    if profile_arg is not None:
        from moe_tune.engine.train.run_dir import outputs_over_run

        job = read_profile(profile_arg, overrides)
        # An output file must not replace what the profile's run reads or keeps, nor the --load-checkpoint folder's.
        problems = outputs_over_run({"--json": json_out, "--plot": plot}, job, {"--load-checkpoint": load_checkpoint})
        if problems:
            fail(problems)
    if launch is not None:
        use_launch(launch)
    if load_checkpoint is not None and job is not None:
        profile_steps.run_load(job, load_checkpoint, json_out)
        return
    try:
        if compare_launch and job is not None:
            profile_steps.run_launches(job, steps, compare_launch, json_out)
        elif job is not None:
            profile_steps.run(job, steps, json_out, against, plot)
        else:
            profile_kernels.run(ops, shapes, json_out, baseline, plot, wide)
    except Exception as err:
        # A launch named from outside that a kernel cannot take (a tile past the GPU's shared memory): the launch's
        # problem, in one line; any other error is a bug and keeps its traceback.
        if (text := launch_text()) and type(err).__module__.startswith("triton"):
            fail([f"{LAUNCH_ENV} ({text}): a kernel cannot run under it: {error_line(err, plain=())}"])
        raise

