"""`moe-tune onboard DIR`: map, plan, profile and align a checkpoint folder in one report (engine/onboard.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ._common import fail, print_error, report_file_problems
from .plan import MAX_DEVICES, TABLE_WIDTH, format_bytes, parse_devices, parse_memory

app = typer.Typer()

# Layouts shown in the plan section (the JSON holds them all).
SHOWN_LAYOUTS = 4
PATH_STYLE = {"kernel": "green", "reference": "yellow", "torch": "cyan"}


@app.command()
def onboard(
    directory: Annotated[Path, typer.Argument(help="Hugging Face checkpoint folder (config.json + safetensors)")],
    devices: Annotated[
        str | None, typer.Option("--devices", help="devices to plan the layout for (default: the GPUs present, 1 "
                                 "without)")
    ] = None,
    device_memory: Annotated[
        str | None, typer.Option("--device-memory", help="memory of one device for the plan: 141GB, 80GiB "
                                 "(default: the GPU's, else 141GB)")
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", min=0, help="timed LoRA training steps after one warm-up step (0: no profile)")
    ] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report as JSON here")] = None,
) -> None:
    """Map every layer of the checkpoint to moe-tune's blocks and ops (kernel or reference path, and why), list
    what is not mapped, plan the layouts for N devices, time a few LoRA training steps here and align against
    transformers. Exit 0 when everything maps and aligns, 1 when alignment (or a stage that runs the model) fails,
    2 when something is not supported."""
    problems = []
    num_devices = memory = None
    if devices is not None and (num_devices := parse_devices(devices)) is None:
        problems.append(f"--devices ({devices[:60]!r}) must be an integer from 1 to {MAX_DEVICES}")
    if device_memory is not None and (memory := parse_memory(device_memory)) is None:
        problems.append(f"--device-memory ({device_memory!r}) must look like 141GB, 80GiB or 1.5TB")
    if not (directory / "config.json").is_file():
        problems.append(f"DIR ({str(directory)!r}) must be a checkpoint folder with a config.json")
    if json_out is not None:
        # The report's folder is created when missing.
        if json_out.is_dir():
            problems.append(f"--json ({str(json_out)!r}) is a folder: name a file to write")
        elif json_out.is_file() and directory.resolve() in json_out.resolve().parents:
            problems.append(f"--json ({str(json_out)!r}) is a file of the checkpoint folder DIR: the report would "
                            "overwrite it; name another file")  # fmt: skip
        else:
            # Refused before a run of minutes, not when the report is written at its end.
            problems += report_file_problems("--json", json_out)
    if problems:
        fail(problems)
    from moe_tune.engine.onboard import onboard as run_onboard

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = TABLE_WIDTH
    report = run_onboard(directory, num_devices, memory, profile_steps=steps,
                         on_stage=lambda name: console.print(f"[dim]... {name}[/dim]"))
    print_report(console, report)
    if json_out is not None:
        try:
            report.write_json(json_out)
        except OSError as err:
            print_error(f"--json ({str(json_out)!r}): cannot write the report ({err.strerror or err}); the file is "
                        "as it was")
            raise typer.Exit(code=2) from None
        console.print(f"report written to {json_out}", markup=False)
    if report.unsupported:
        count = len(report.unsupported)
        print_error(f"{directory}: {count} {'thing' if count == 1 else 'things'} moe-tune does not map (listed under "
                    "'not mapped')")  # fmt: skip
    raise typer.Exit(code=report.exit_code)


def _section(console: Console, title: str, status: str) -> None:
    style = {"ok": "green", "failed": "red", "skipped": "dim"}.get(status, "")
    console.print()
    console.print(f"[bold]{title}[/bold]  [{style}]{status}[/{style}]")


def _ops_text(uses) -> str:
    parts = []
    for use in uses:
        style = PATH_STYLE.get(use.path, "")
        parts.append(f"{use.op} [{style}]{use.path}[/{style}]")
    # One entry per op and path: a layer calls rms_norm several times.
    return ", ".join(dict.fromkeys(parts))


def print_report(console: Console, report) -> None:
    from moe_tune.engine.onboard import path_summary

    what = f"{report.model_type} ({report.family})" if report.family else str(report.model_type)
    console.print(f"onboarding {report.checkpoint}: {what}, running on {report.device}", markup=False)

    _section(console, "mapping", report.mapping.status)
    if report.layers:
        table = Table(show_edge=False)
        for col in ("layer", "token mixer", "channel mixer", "ops and paths"):
            table.add_column(col)
        for layer in report.layers:
            table.add_row(str(layer.index), f"{layer.attention}: {layer.token_mixer}", f"{layer.mlp}: "
                          f"{layer.channel_mixer}", _ops_text(layer.ops))
        if report.model_ops:
            table.add_row("model", "", "", _ops_text(report.model_ops))
        console.print(table)
        reasons = {}
        for use in [u for layer in report.layers for u in layer.ops] + report.model_ops:
            reasons.setdefault((use.path, use.reason), []).append(use.op)
        for (path, reason), ops in sorted(reasons.items()):
            console.print(f"  {path}: {reason} ({', '.join(dict.fromkeys(ops))})", markup=False)
        counts = path_summary(report)
        console.print("  " + ", ".join(f"{n} {path}" for path, n in counts.items()) + " op calls", markup=False)
    if report.unsupported:
        console.print(f"not mapped ({len(report.unsupported)}):", markup=False)
        for line in report.unsupported:
            console.print(f"  {line}", markup=False)
    elif report.mapping.problems:
        for line in report.mapping.problems:
            console.print(f"  {line}", markup=False)

    _section(console, "plan", report.plan.status)
    _print_plan(console, report.plan)
    _section(console, "profile", report.profile.status)
    _print_profile(console, report.profile)
    _section(console, "align", report.align.status)
    _print_align(console, report.align)

    console.print()
    verdict = {0: "[green]onboarded: every layer maps, runs and aligns[/green]",
               1: "[red]not onboarded: see the failed sections[/red]",
               2: "[red]not supported: the lines under 'not mapped' name what moe-tune does not map[/red]"}
    console.print(verdict[report.exit_code])


def _print_problems(console: Console, stage) -> None:
    for line in stage.problems:
        console.print(f"  {line}", markup=False)


def _print_plan(console: Console, stage) -> None:
    _print_problems(console, stage)
    plan = stage.result
    if not plan:
        return
    count = plan["devices"]
    console.print(f"  {count} device{'s' if count > 1 else ''} of {format_bytes(plan['device_memory'])}, bf16, LoRA "
                  f"defaults, rows of {plan['seq_len']} tokens", markup=False)
    table = Table(show_edge=False)
    for col in ("data x expert", "experts/dev", "total/dev", "fits", "traffic/step"):
        table.add_column(col, justify="left" if col == "data x expert" else "right")
    for lay in plan["layouts"][:SHOWN_LAYOUTS]:
        fits = "[green]yes[/green]" if lay["fits"] else "[red]no[/red]"
        table.add_row(f"{lay['data_parallel']} x {lay['expert_parallel']}", str(lay["experts_per_device"]),
                      format_bytes(lay["total"]), fits, format_bytes(lay["traffic_per_step"]))
    console.print(table)
    best = plan["suggested"]
    if best is None:
        console.print("  no layout fits: more devices, more memory per device, or a memory preset "
                      "(moe-tune plan and docs/memory.md)", markup=False)
    else:
        console.print(f"  suggested: parallel.expert_parallel {best['expert_parallel']} (data parallel "
                      f"{best['data_parallel']}, {best['experts_per_device']} experts per device, "
                      f"{format_bytes(best['total_bytes'])} per device)", markup=False)


def _print_profile(console: Console, stage) -> None:
    _print_problems(console, stage)
    prof = stage.result
    if not prof:
        return
    times = ", ".join(f"{t * 1e3:,.1f} ms" for t in prof["step_times_s"])
    rates = ", ".join(f"{r:,.0f}" for r in prof["tokens_per_s"])
    console.print(f"  {prof['steps']} LoRA steps (r {prof['lora']['r']}, after {prof['warmup_steps']} warm-up) on "
                  f"{prof['device']}, {prof['precision']}, rows of {prof['seq_len']} tokens: {times}; tokens/s "
                  f"{rates}; peak memory {format_bytes(prof['peak_memory_bytes'])} ({prof['peak_memory_kind']})",
                  markup=False)


def _judged_rel(row: dict) -> float:
    """The figure the alignment judges a layer row by: per channel where it was computed (AlignReport.failures)."""
    return row["rel"] if row.get("channel_rel") is None else row["channel_rel"]


def _print_align(console: Console, stage) -> None:
    data = stage.result
    if data:
        worst = max(data["layers"], key=_judged_rel, default=None)
        line = (f"  documents {data['documents']}: logits max abs {data['logits']['max_abs']:.3e}, cosine "
                f"{data['logits_cosine']:.8f}, KL {data['kl']:.3e}, loss {data['loss_ours']:.6f} (reference "
                f"{data['loss_reference']:.6f})")
        if worst is not None:
            line += f"; worst layer {worst['name']} rel {worst['rel']:.3e}"
            if worst.get("channel_rel") is not None:
                line += f", per channel {worst['channel_rel']:.3e}"
        console.print(line, markup=False)
        console.print("  aligned: within tolerance" if data["passed"] else "  NOT aligned:", markup=False)
    _print_problems(console, stage)
