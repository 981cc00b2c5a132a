"""`moe-tune plan`: the data x expert layouts of a profile's model on N devices, with per-device memory and traffic."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from ._common import ProfileArg, SetOption, fail, output_problems, read_profile, user_errors

if TYPE_CHECKING:
    from moe_tune.engine.plan import Plan

app = typer.Typer()

MEMORY_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
MEMORY_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*", re.IGNORECASE)
# Rich falls back to 80 columns when stdout is not a terminal; the table needs about this many, the
# context-parallel column (parallel.context_parallel > 1) about CONTEXT_COLUMN_WIDTH more, and the host tier's two
# (a memory policy that offloads) about HOST_COLUMNS_WIDTH.
TABLE_WIDTH = 160
CONTEXT_COLUMN_WIDTH = 16
HOST_COLUMNS_WIDTH = 24


def parse_memory(text: str) -> int | None:
    """Bytes of '141GB', '80GiB', '1.5TB' (decimal GB/TB, binary GiB/TiB); None when it reads otherwise."""
    match = MEMORY_PATTERN.fullmatch(text)
    if match is None or match.group(2).lower() not in MEMORY_UNITS:
        return None
    size = round(float(match.group(1)) * MEMORY_UNITS[match.group(2).lower()])
    return size if size > 0 else None


# More devices than any cluster has; past it the count is a typo (and its digits could outgrow int()).
MAX_DEVICES = 2**24


def parse_devices(text: str) -> int | None:
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > len(str(MAX_DEVICES)):
        return None
    return int(text) if 0 < int(text) <= MAX_DEVICES else None


def format_bytes(size: float) -> str:
    """Decimal units, three significant digits: 43.2 GB, 302 MB, 1.25 TB."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def format_count(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.0f}"


def _summary(result: Plan) -> list[str]:
    counts = result.parameters
    head = f"{result.profile}: {format_count(counts.total)} parameters"
    if result.num_experts:
        head += (
            f" = dense {format_count(counts.dense)} + routed experts {format_count(counts.experts)} "
            f"({result.num_moe_layers} MoE layers x {result.num_experts} experts, {result.top_k} per token); "
            f"{format_count(counts.active_per_token)} active per token"
        )
    lines = [head]
    weights = f"{result.precision} weights {format_bytes(result.weight_bytes)}"
    if result.base_precision == "fp8":
        stored = result.weights
        lines.append(
            f"fp8 base weights {format_bytes(result.weight_bytes)}: {format_count(stored.fp8_parameters)} parameters "
            f"in FP8 e4m3 with {format_bytes(stored.fp8_scales)} of 128x128 block scales, "
            f"{format_count(counts.total - stored.fp8_parameters)} in {result.precision}"
        )
        weights = ""
    parts = dict(zip(("vision tower", "vision merger"), result.vision_training or ()))
    if result.lora_enabled:
        frozen = "backbone frozen"
        copies = result.modules_to_save + [f"the {part}" for part, how in parts.items() if how == "trained"]
        if copies:
            frozen += f" but for full copies of {', '.join(copies)}"
        lines.append(
            f"{weights + '; ' if weights else ''}LoRA: {format_count(counts.trainable)} trainable parameters (dense "
            f"{format_count(counts.lora_dense)}, experts {format_count(counts.lora_experts)}), {frozen}"
        )
    elif frozen_parts := [part for part, how in parts.items() if how == "frozen"]:
        lines.append(f"{weights}; full fine-tuning: {format_count(counts.trainable)} trainable parameters, all but "
                     f"the {' and '.join(frozen_parts)} (frozen)")
    else:
        lines.append(f"{weights}; full fine-tuning: every parameter trainable")
    steps = result.gradient_accumulation_steps
    lines.append(
        f"{result.devices} devices of {format_bytes(result.device_memory)}; per device "
        f"{result.tokens_per_micro_batch} tokens per micro-batch, {steps} micro-batch{'es' if steps > 1 else ''} "
        "per step"
    )
    acts = result.activations
    if result.context_parallel > 1:
        c = result.context_parallel
        lines.append(
            f"context parallel {c}: each row of {result.row_tokens} tokens shared by {c} devices, "
            f"{result.devices // c} row{'s' if result.devices // c > 1 else ''} a micro-batch"
        )
        lay = result.layouts[0]
        lines.append(
            f"context/step {format_bytes(lay.context_per_step)} on a group's last device (at most: one document over "
            f"the row, every key selectable), {format_bytes(lay.context_mean_per_step)} on average over its devices"
        )
    context = f" + gathered or fetched by the token mixers {format_bytes(acts.context)}" if acts.context else ""
    vision = f" + vision tower {format_bytes(acts.vision)}" if acts.vision else ""
    lines.append(
        f"activations {format_bytes(acts.total)} = layers {format_bytes(acts.layers)} + head "
        f"{format_bytes(acts.head)} + linear-attention backward {format_bytes(acts.transient)}{context}{vision}"
    )
    if acts.vision:
        tokens = result.tokens_per_micro_batch
        lines.append(
            f"vision tower {format_bytes(acts.vision)}: what backward keeps of it over {result.vision_patches} image "
            f"patches, the most a micro-batch holds (all {tokens} tokens image tokens, "
            f"{result.vision_patches // tokens} patches each)"
        )
    if acts.host:
        lines += _host_lines(result)
    return lines


def _host_lines(result: Plan) -> list[str]:
    """The memory policy's host tier: what it holds, and the swaps' bytes and time per step."""
    from moe_tune.engine.plan import PINNED_D2H_BYTES_PER_S, PINNED_H2D_BYTES_PER_S

    acts, lay = result.activations, result.layouts[0]
    classes = ", ".join(f"{'past the GPU budget' if name == 'budget' else name} {format_bytes(size)}"
                        for name, size in acts.host_by_class.items())  # fmt: skip
    return [
        f"host memory {format_bytes(lay.host_memory)} per device: a pinned pool for {format_bytes(acts.host)} of the "
        f"layers' saved tensors ({classes})",
        f"on the GPU the layers hold at most {format_bytes(acts.layers)}: {format_bytes(acts.prefetch)} swapped in, "
        f"{format_bytes(acts.recompute)} recomputed at a time",
        f"swap per step {format_bytes(lay.swap_per_step)} each way: {lay.swap_out_s:.2f} s out at "
        f"{format_bytes(PINNED_D2H_BYTES_PER_S)}/s, {lay.swap_in_s:.2f} s back at "
        f"{format_bytes(PINNED_H2D_BYTES_PER_S)}/s (the H200's pinned-copy bandwidth)",
    ]


def _table(result: Plan) -> Table:
    table = Table(title="per device, best layout first", title_justify="left")
    has_context = result.context_parallel > 1
    has_host = result.activations.host > 0
    for header in ("data x expert", "experts/dev", "dense", "experts", "LoRA", "grads", "optimizer", "activations",
                   "gathered", "total", "fits", "all-to-all/step", "ZeRO-3/step"):  # fmt: skip
        table.add_column(header, justify="left" if header == "data x expert" else "right", no_wrap=True)
    if has_context:
        table.add_column("context/step", justify="right", no_wrap=True)
    if has_host:
        table.add_column("host", justify="right", no_wrap=True)
        table.add_column("swap/step", justify="right", no_wrap=True)
    for lay in result.layouts:
        name = f"{lay.data_parallel} x {lay.expert_parallel}" + (" *" if lay.is_profile_layout else "")
        sizes = (lay.dense_weights, lay.expert_weights, lay.lora_weights, lay.gradients, lay.optimizer,
                 lay.activations, lay.gathered, lay.total)  # fmt: skip
        fits = "[green]yes[/green]" if lay.fits else "[red]no[/red]"
        traffic = (format_bytes(lay.all_to_all_per_step), format_bytes(lay.zero3_per_step))
        if has_context:
            traffic += (format_bytes(lay.context_per_step),)
        if has_host:
            traffic += (format_bytes(lay.host_memory), format_bytes(lay.swap_per_step))
        table.add_row(name, str(lay.experts_per_device), *map(format_bytes, sizes), fits, *traffic)
    return table


def _no_fit_line(result: Plan) -> str:
    smallest = min(result.layouts, key=lambda lay: lay.total)
    devices = f"{result.devices} device{'s' if result.devices > 1 else ''}"
    base = "fp8" if result.base_precision == "fp8" else result.precision
    return (
        f"does not fit: no layout fits {devices} of {format_bytes(result.device_memory)}; the smallest "
        f"({smallest.data_parallel} x {smallest.expert_parallel}) needs {format_bytes(smallest.total)} per device, "
        f"{format_bytes(smallest.dense_weights + smallest.expert_weights)} of them {base} base weights"
    )


@app.command()
def plan(
    profile: ProfileArg,
    devices: Annotated[str, typer.Option("--devices", help="number of devices (GPUs) to lay the model out on")],
    device_memory: Annotated[
        str, typer.Option("--device-memory", help="memory of one device: 141GB, 80GiB, 1.5TB (GB/TB decimal)")
    ] = "141GB",
    overrides: SetOption = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the plan as JSON to this file")] = None,
) -> None:
    """Plan the data x expert layouts of the profile's model on N devices: per-device memory, traffic, fit."""
    num_devices, memory = parse_devices(devices), parse_memory(device_memory)
    problems = []
    if num_devices is None:
        problems.append(f"--devices ({devices[:60]!r}) must be an integer from 1 to {MAX_DEVICES}")
    if memory is None:
        problems.append(f"--device-memory ({device_memory!r}) must look like 141GB, 80GiB or 1.5TB")
    if json_out is not None:
        problems += output_problems(json_out, None, None, Path(profile) if Path(profile).is_file() else None)
    if problems:
        fail(problems)
    job = read_profile(profile, overrides)
    from moe_tune.engine.plan import plan_layouts
    from moe_tune.engine.train.run_dir import outputs_over_run

    problems = outputs_over_run({"--json": json_out}, job)
    if problems:
        fail(problems)

    with user_errors():
        result = plan_layouts(job, num_devices, memory)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = (TABLE_WIDTH + (CONTEXT_COLUMN_WIDTH if result.context_parallel > 1 else 0)
                         + (HOST_COLUMNS_WIDTH if result.activations.host else 0))  # fmt: skip
    for line in _summary(result):
        console.print(line, markup=False)
    console.print(_table(result))
    if not any(lay.fits for lay in result.layouts):
        console.print(_no_fit_line(result), markup=False)
    ep = result.profile_expert_parallel
    if any(lay.is_profile_layout for lay in result.layouts):
        console.print(f"* the profile's layout (parallel.expert_parallel {ep})", markup=False)
    else:
        console.print(
            f"note: the profile's parallel.expert_parallel ({ep}) does not divide --devices ({num_devices}): "
            "not among these layouts",
            markup=False,
        )
    if json_out is not None:
        from moe_tune.engine.atomic_write import write_atomically

        try:
            write_atomically(json_out, json.dumps(result.as_dict(), indent=2) + "\n")
        except OSError as err:
            fail([f"--json ({str(json_out)!r}): cannot write the plan ({err.strerror or err}); the file is as it was"])
        console.print(f"plan written to {json_out}", markup=False)
