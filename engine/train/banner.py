"""The lines `moe-tune finetune` prints once, on rank 0, before its first step: where the run writes, on what
devices, in what layout, on what data, for how long, and to which trackers it logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from moe_tune.profiles.schema import JobProfile


def device_line(device: torch.device, world_size: int) -> str:
    """`2 x cuda (NVIDIA H200)`: the ranks, the device kind and this rank's device name (the CPU's architecture and
    threads on a CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        name = f"{platform.machine() or 'unknown'}, {torch.get_num_threads()} threads"
    return f"{world_size} x {device.type} ({name})"


def data_lines(summary: Any, train_documents: int | None = None) -> list[str]:
    """The data summary's lines (engine.data.dataset.DataSummary.lines: a line per source with its format, records
    and refusals, then the train and eval totals of documents, tokens and trained tokens), or the number of
    training documents when there is no summary."""
    if summary is not None and callable(getattr(summary, "lines", None)):
        return list(summary.lines())
    return [f"{train_documents:,} training documents"] if train_documents is not None else ["-"]


def start_banner(
    profile: JobProfile,
    out: Path,
    device: torch.device,
    world_size: int,
    total_steps: int,
    start_step: int = 0,
    summary: Any = None,
    train_documents: int | None = None,
    epochs: int | None = None,
    eval_rows: int | None = None,
    trackers: Sequence[str] = (),
) -> list[str]:
    """The banner's lines. Facts not known to the caller (no data summary, no epochs, no eval set) are left out."""
    parallel, train = profile.parallel, profile.train
    ep, cp = parallel.expert_parallel, parallel.context_parallel
    # Rows are split over the context groups: world size / context_parallel data-parallel ranks.
    data_parallel = world_size // cp
    context = f", context-parallel {cp} (each row's tokens over {cp} ranks)" if cp > 1 else ""
    lines = [
        f"output:   {out}",
        f"devices:  {device_line(device, world_size)}",
        f"layout:   world size {world_size}, data-parallel {data_parallel}{context}, expert-parallel {ep} "
        f"(expert-data-parallel {world_size // ep}), ZeRO stage {parallel.zero_stage}, precision {train.precision}"
        + (", FP8 base weights" if profile.model.base_precision == "fp8" else ""),
    ]
    data = data_lines(summary, train_documents)
    lines += [f"data:     {data[0]}", *(f"          {line}" for line in data[1:])]
    if eval_rows is not None:
        lines.append(f"eval:     {eval_rows:,} row{'s' if eval_rows != 1 else ''} of {profile.data.seq_len} tokens")
    rows_per_step = train.micro_batch_size * train.gradient_accumulation_steps * data_parallel
    steps = f"steps:    {total_steps:,}" + (f" ({epochs} epochs)" if epochs is not None else "")
    steps += f", {rows_per_step:,} row{'s' if rows_per_step != 1 else ''} of {profile.data.seq_len} tokens a step"
    if start_step:
        steps += f", resuming after step {start_step:,}"
    lines.append(steps)
    lines.append("logging:  " + ", ".join([str(out / "metrics.jsonl"), *trackers]))
    return lines
