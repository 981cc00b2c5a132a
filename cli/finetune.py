"""`moe-tune finetune PROFILE`: train the profile's model, print where the outputs are."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer
from rich.console import Console

from moe_tune.profiles import resolve_profile_path

from ._common import USER_ERROR_EXIT, ProfileArg, SetOption, fail, print_error, read_profile, user_errors

app = typer.Typer()

SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}
# A non-finite loss or gradient norm stopped training (not a user-input error: those exit 2).
DIVERGED_EXIT = 1


@app.command()
def finetune(
    profile: ProfileArg,
    overrides: SetOption = None,
    resume: Annotated[bool, typer.Option(help="continue from the newest complete checkpoint in output.dir")] = False,
    overwrite: Annotated[
        bool, typer.Option(help="replace a previous run's outputs in output.dir (other files there are kept)")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
    nproc: Annotated[
        int, typer.Option(min=1, help="start this many local ranks (as torchrun would); 1 runs in this process")
    ] = 1,
    local_rank: Annotated[
        int | None, typer.Option("--local_rank", "--local-rank", hidden=True, help="set by the deepspeed launcher")
    ] = None,
) -> None:
    """Fine-tune with DeepSpeed ZeRO and LoRA (or full fine-tuning) as the profile says."""
    if resume and overwrite:
        fail(["--resume and --overwrite contradict each other: --resume continues the run in output.dir, "
              "--overwrite deletes it; give one"])  # fmt: skip
    job = read_profile(profile, overrides)
    if not any(o.partition("=")[0].strip() == "output.dir" for o in overrides or []):
        from moe_tune.engine.train.run_dir import moved_run_profile_problem

        remedy = "give --set output.dir={folder} to use this run, or another output.dir with --set"
        if (moved := moved_run_profile_problem(resolve_profile_path(profile), job.output.dir, remedy)) is not None:
            fail([moved])
    if not resume:
        # A fresh run writes its resolved profile.yaml (and its other settings) into output.dir: the PROFILE kept there
        # would be replaced.
        from moe_tune.engine.train.run_dir import check_reads_apart

        with user_errors():
            check_reads_apart(job.output.dir, {"PROFILE": resolve_profile_path(profile)})
    console = Console(highlight=False)
    if nproc > 1:
        import torch

        from moe_tune.engine.parallel.launch import host_memory_bytes, launch_local, nproc_problems

        if problems := nproc_problems(nproc, torch.cuda.device_count(), host_memory_bytes()):
            fail(problems)
        argv = ["finetune", profile, *[a for o in overrides or [] for a in ("--set", o)]]
        argv += ["--resume"] * resume + ["--overwrite"] * overwrite + ["--quiet"] * quiet
        outcome = launch_local(nproc, argv)
        if outcome.returncode:
            # The ranks printed their own errors; exit as the failed rank did (2: bad input, 1: diverged or crashed).
            print_error(outcome.message)
            raise typer.Exit(code=outcome.returncode)
        return
    from moe_tune.engine.train.checkpoint import CheckpointWriteError
    from moe_tune.engine.train.trainer import TrainingDiverged
    from moe_tune.engine.train.trainer import finetune as run

    try:
        with user_errors():
            result = run(job, resume=resume, show_progress=not quiet, console=console, overwrite=overwrite)
    except TrainingDiverged as err:
        print_error(str(err))
        raise typer.Exit(code=DIVERGED_EXIT) from None
    except CheckpointWriteError as err:
        # A full disk or a failed write: the checkpoints already there are kept; exit 2 as for any refusal.
        print_error(str(err))
        raise typer.Exit(code=USER_ERROR_EXIT) from None
    except KeyboardInterrupt as err:
        # A second SIGINT/SIGTERM during a step (the first asks for a checkpoint after it), or one before the steps.
        from moe_tune.engine.train.run_dir import kept_after_interrupt

        how = f" ({err})" if str(err) else ""
        print_error(f"interrupted{how}: stopped without saving the step in progress; "
                    f"{kept_after_interrupt(job.output.dir)}")  # fmt: skip
        raise typer.Exit(code=SIGNAL_EXIT["SIGINT"]) from None
    if not result.is_main:
        return
    console.print(
        f"trained steps {result.start_step + 1}-{result.last_step} in {result.elapsed_s:.1f}s: "
        f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
    )
    if result.eval_loss is not None:
        best = f"; best {result.best_eval_loss:.4f} at step {result.best_eval_step}" if result.best_eval_step else ""
        console.print(f"eval loss:   {result.eval_loss:.4f} at step {result.eval_step}{best}")
    console.print(f"metrics:     {result.metrics}")
    console.print(f"checkpoint:  {result.checkpoint}")
    if result.best_checkpoint and result.best_checkpoint != result.checkpoint:
        console.print(f"best:        {result.best_checkpoint} (lowest eval loss)")
    if result.adapter:
        console.print(f"adapter:     {result.adapter}")
    if result.transformers_adapter:
        console.print(f"for transformers + PEFT on the checkpoint: {result.transformers_adapter}")
    elif result.transformers_adapter_problem:
        console.print(f"no adapter for transformers: {result.transformers_adapter_problem}")
    if result.merged:
        console.print(f"merged:      {result.merged} (for transformers: AutoModelForCausalLM.from_pretrained)")
    elif result.merged_problem:
        console.print(f"no merged model: {result.merged_problem}")
    if result.weights:
        console.print(f"weights:     {result.weights} (moe-tune's names; `moe-tune export` writes the hub's layout)")
    console.print(f"ds config:   {result.deepspeed_config}")
    if result.interrupted_by:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        hint = resume_command(profile, overrides, quiet, world_size)
        # soft_wrap: one line however long, so that it can be copied as printed.
        console.print(f"stopped by {result.interrupted_by}; resume with: {hint}", markup=False, soft_wrap=True)
        raise typer.Exit(code=SIGNAL_EXIT.get(result.interrupted_by, 1))


def resume_command(profile: str, overrides: list[str] | None, quiet: bool, world_size: int) -> str:
    """The command that resumes this run: the same profile and every --set override (shell-quoted), run from the
    same directory; `--nproc` with the run's world size when it had several ranks."""
    words = ["moe-tune", "finetune", profile, *[w for o in overrides or [] for w in ("--set", o)], "--resume"]
    words += ["--quiet"] * quiet + (["--nproc", str(world_size)] if world_size > 1 else [])
    return shlex.join(words)
