"""`moe-tune profile PROFILE`: a few real training steps of a profile (throughput, latency, peak memory, MFU, the
memory policy's metrics, a per-operator breakdown; `--against transformers` times the same steps of the
transformers + PEFT baseline, `--against bf16-base` those of an FP8-base profile's dequantized bf16 twin)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_tune.profiles import JobProfile

from ._common import fail, user_errors

# Rich falls back to 80 columns when stdout is not a terminal; the profile tables need about this many.
TABLE_WIDTH = 220
BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in BYTE_UNITS:
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} GB/s"


# The bound a `gpu_clocks` field's cell names: (its key, its label, which of the parts' values).
_CLOCKS_BOUND = {"sm_mhz": ("max_sm_mhz", "the card's maximum", max), "power_w": ("power_limit_w", "limit", min)}


def clocks_cell(clocks: dict | None, field: str, unit: str) -> str:
    """The median of one `gpu_clocks` field over the timed steps and over the GEMM peak: "a / b UNIT" ("-" for a
    part without it); the SM clock adds the card's maximum, the power its limit."""
    parts = [] if clocks is None else [clocks["steps"], clocks["gemm_peak"]]
    values = [None if part is None else part[field] for part in parts]
    if all(value is None for value in values):
        return "-"
    text = " / ".join("-" if value is None else f"{value:,.0f}" for value in values) + f" {unit}"
    if field in _CLOCKS_BOUND:
        key, label, pick = _CLOCKS_BOUND[field]
        # .get: a result written before the bound was sampled has no such key.
        if bounds := [part.get(key) for part in parts if part and part.get(key)]:
            text += f" ({label} {pick(bounds):,.0f})"
    return text


def _steps_table(result: dict) -> Table:
    """Two columns, one metric a row: the run first, then the memory policy's metrics."""
    title = (
        f"{result['profile']}: seq_len {result['seq_len']} x {result['micro_batch_size']}, {result['precision']}, "
        f"{result['warmup_steps']} warm-up + {result['steps']} timed steps; {result['machine']} ({result['device']}), "
        f"torch {result['torch']}, "
        f"commit {result['commit']}, {result['date']}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("metric", justify="left", no_wrap=True)
    table.add_column("median", justify="right")
    memory = result["memory"]
    hit_rate = memory.get("cache_hit_rate")
    swap_fraction = result["swap_fraction_of_pinned"]
    rows = [
        ("memory policy", result["memory_policy"]),
        ("MoE blocks in CUDA graphs", str(result["graphed_moe_blocks"])),
        ("parameters (trainable)", f"{result['parameters']:,} ({result['trainable_parameters']:,})"),
        ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
        ("step latency", f"{result['step_time_s'] * 1e3:,.1f} ms"),
        ("host's launch of a step", f"{result['host_launch_s'] * 1e3:,.1f} ms"),
        ("peak memory", _bytes(result["peak_memory_bytes"])),
        ("model FLOPs per step", f"{result['model_flops_per_step']:.3g}"),
        ("achieved", f"{result['achieved_tflops']:.3g} TFLOP/s"),
        (f"MFU (of the measured GEMM peak, {result['peak_tflops']:.3g} TFLOP/s)", f"{result['mfu']:.1%}"),
        ("SM clock: steps / GEMM peak", clocks_cell(result["gpu_clocks"], "sm_mhz", "MHz")),
        ("power: steps / GEMM peak", clocks_cell(result["gpu_clocks"], "power_w", "W")),
        ("saved on the GPU", _bytes(memory.get("gpu_saved_bytes"))),
        ("  device memory they hold", _bytes(memory.get("gpu_storage_bytes"))),
        ("saved in host memory", _bytes(memory.get("host_saved_bytes"))),
        ("  of which moved by the budget", _bytes(memory.get("evicted_bytes"))),
        ("recomputed", _bytes(memory.get("recomputed_bytes"))),
        ("modules recomputed", "-" if memory.get("recomputations") is None else f"{memory['recomputations']:.0f}"),
        ("cache hit rate", "-" if hit_rate is None else f"{hit_rate:.1%}"),
        ("swap GPU -> host", _rate(memory.get("d2h_gb_per_s"))),
        ("swap host -> GPU", _rate(memory.get("h2d_gb_per_s"))),
        ("pinned copy host -> GPU / GPU -> host",
         f"{_rate(result['pinned_h2d_gb_per_s'])} / {_rate(result['pinned_d2h_gb_per_s'])}"),
        ("swap / pinned copy bandwidth", "-" if swap_fraction is None else f"{swap_fraction:.0%}"),
        ("backward waited for swap-in",
         "-" if memory.get("swap_wait_s") is None else f"{memory['swap_wait_s'] * 1e3:.1f} ms"),
        ("host pool", _bytes(memory.get("host_pool_bytes"))),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    return table


def _console() -> Console:
    """The commands' console: TABLE_WIDTH wide when it is not a terminal (a log, a pipe)."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = TABLE_WIDTH
    return console


def write_json(path: Path, data) -> None:
    """Write `data` to --json's `path` through a temporary file renamed over it: a write that fails (a full disk)
    leaves the file as it was, and says so in one line."""
    from moe_tune.engine.atomic_write import write_atomically

    try:
        write_atomically(path, json.dumps(data, indent=2) + "\n")
    except OSError as err:
        fail([f"--json ({str(path)!r}): cannot write the results ({err.strerror or err}); the file is as it was"])


def breakdown_table(breakdown: dict) -> Table:
    """One op class a row: time in the profiled step and share of the step; on CUDA also the device work its ops
    launched, their host time and the GPU's idle time right before that work, in the profiled step (on the CPU the
    time is the host time)."""
    from moe_tune.engine.bench.breakdown import CUDA_TIMING

    on_cuda = breakdown["timing"] == CUDA_TIMING
    headers = ("op class", "ms", "share", *(("launches", "host ms", "GPU idle before ms") if on_cuda else ()))
    table = Table()
    for header in headers:
        table.add_column(header, justify="left" if header == "op class" else "right", no_wrap=True)
    for row in breakdown["classes"]:
        idle = row.get("gpu_idle_before_s")
        host = (
            (f"{row['launches']:,}", f"{row['host_s'] * 1e3:,.1f}", "" if idle is None else f"{idle * 1e3:,.1f}")
            if on_cuda
            else ()
        )
        table.add_row(row["op_class"], f"{row['time_s'] * 1e3:,.1f}", f"{row['share']:.1%}", *host)
    return table


def _top_ops_table(breakdown: dict) -> Table:
    table = Table()
    for header in ("op", "op class", "calls", "ms"):
        table.add_column(header, justify="left" if header in ("op", "op class") else "right", no_wrap=True)
    for row in breakdown["top_ops"]:
        table.add_row(row["op"], row["op_class"], str(row["calls"]), f"{row['time_s'] * 1e3:,.1f}")
    return table


def gpu_waits_table(breakdown: dict) -> Table:
    """The ops whose device work the GPU waited for longest in the profiled step (breakdown.gpu_waits)."""
    table = Table()
    for header in ("op", "op class", "gaps", "GPU idle before ms", "longest ms"):
        table.add_column(header, justify="left" if header in ("op", "op class") else "right", no_wrap=True)
    for row in breakdown["gpu_waits"]:
        table.add_row(row["op"], row["op_class"], f"{row['gaps']:,}", f"{row['idle_s'] * 1e3:,.2f}",
                      f"{row['longest_s'] * 1e3:,.2f}")  # fmt: skip
    return table


def device_timeline_line(timeline: dict) -> str:
    """What one more step with only the device's work profiled says of the device's time (breakdown.device_timeline)."""
    return (f"one more step with only the device's work profiled: {timeline['step_s'] * 1e3:,.1f} ms, the device busy "
            f"{timeline['busy_s'] * 1e3:,.1f} ms ({timeline['launches']:,} kernels, copies and memsets), idle "
            f"{timeline['idle_s'] * 1e3:,.1f} ms between them and {timeline['outside_s'] * 1e3:,.1f} ms before the "
            "first and after the last")  # fmt: skip


def _device_work_columns(*numbers: str) -> Table:
    """A table whose first column names device work (wrapping: kernel names run long), then right-aligned numbers."""
    table = Table()
    table.add_column("device work", justify="left")
    for header in numbers:
        table.add_column(header, justify="right", no_wrap=True)
    return table


def device_gaps_table(timeline: dict) -> Table:
    """The device work the GPU waited for longest in that step (breakdown.device_timeline.gaps)."""
    table = _device_work_columns("gaps", "GPU idle before ms", "longest ms")
    for row in timeline["gaps"]:
        table.add_row(row["kernel"], f"{row['gaps']:,}", f"{row['idle_s'] * 1e3:,.2f}",
                      f"{row['longest_s'] * 1e3:,.2f}")  # fmt: skip
    return table


def device_work_table(timeline: dict) -> Table:
    """The device work that took longest in that step, by name: the TOP_OPS heaviest of
    breakdown.device_timeline.kernels (the JSON keeps them all)."""
    from moe_tune.engine.bench.breakdown import TOP_OPS

    table = _device_work_columns("calls", "ms")
    for row in timeline["kernels"][:TOP_OPS]:
        table.add_row(row["kernel"], f"{row['calls']:,}", f"{row['time_s'] * 1e3:,.2f}")
    return table


def host_waits_table(breakdown: dict) -> Table:
    """Where the host waited for the GPU in one more step (breakdown.host_waits): each site's waits and frames."""
    from moe_tune.engine.bench.host_waits import site_text

    table = Table()
    table.add_column("waits", justify="right", no_wrap=True)
    table.add_column("where (innermost first, < called from)", justify="left")
    for row in breakdown["host_waits"]:
        table.add_row(f"{row['count']:,}", site_text(row["frames"]))
    return table


def launch_sites_table(breakdown: dict) -> Table:
    """The sites that dispatched the most ops in one more step (breakdown.launch_sites): ops, op and frames."""
    from moe_tune.engine.bench.host_waits import site_text

    table = Table()
    table.add_column("ops", justify="right", no_wrap=True)
    table.add_column("op", justify="left", no_wrap=True)
    table.add_column("where (innermost first, < called from)", justify="left")
    for row in breakdown["launch_sites"]:
        where = site_text(row["frames"]) if row["frames"] else "(autograd's own backward formulas)"
        table.add_row(f"{row['count']:,}", row["op"], where)
    return table


def _ours_name(result: dict) -> str:
    """Our row's name: against the bf16 twin, which base it has."""
    return "moe-tune, fp8 base" if result["against"]["baseline"] == "bf16-base" else "moe-tune"


def _against_table(result: dict) -> Table:
    """moe-tune's row and the baseline's, the same columns."""
    other = result["against"]
    table = Table()
    headers = ("impl", "tokens/s", "step latency", "peak memory", "MFU", "trainable params", "first-step loss")
    for header in headers:
        table.add_column(header, justify="left" if header == "impl" else "right", no_wrap=True)
    for impl, row in ((_ours_name(result), result), (other["impl"], other)):
        table.add_row(impl, f"{row['tokens_per_s']:,.0f}", f"{row['step_time_s'] * 1e3:,.1f} ms",
                      _bytes(row["peak_memory_bytes"]), f"{row['mfu']:.1%}", f"{row['trainable_parameters']:,}",
                      f"{row['first_step_loss']:.4f}")  # fmt: skip
    return table


def out_of_memory_line(result: dict) -> str:
    """The line that stands for the baseline's row when it ran out of memory."""
    other = result["against"]
    model_type = f" ({other['model_type']})" if other.get("model_type") else ""
    return (f"against {other['impl']}{model_type}: out of memory ({other['out_of_memory']}) on "
            f"{result['machine']}; no row to compare")


def against_header(other: dict) -> str:
    """What the baseline's row is, above the table."""
    if other["baseline"] == "bf16-base":
        return (f"against {other['impl']} (model.base_precision bf16 holding the FP8 base's "
                f"{other['dequantized_modules']} FP8 modules dequantized; the same draws, LoRA init and "
                "micro-batches):")
    return (f"against {other['impl']} ({other['model_type']}, attention {other['attention_implementation']}, experts "
            f"{other['experts_implementation']}) on the same micro-batches:")


# The transformers baseline's row fields that say what its linear-attention layers ran, as the line names them.
KERNEL_FIELDS = (("linear attention", "linear_attention_implementation"), ("short conv", "causal_conv_implementation"),
                 ("gated norm", "gated_norm_implementation"))  # fmt: skip


def baseline_runs_line(other: dict) -> str | None:
    """The transformers baseline's weights, its packed documents and what its linear-attention layers ran (None for
    another baseline)."""
    if other["baseline"] != "transformers":
        return None
    paths = "; ".join(f"{name} {other[field]}" for name, field in KERNEL_FIELDS if other.get(field))
    documents = f"; documents {other['documents']}" if other.get("documents") else ""
    return f"  weights: {other['initial_weights']}{documents}" + (f"; {paths}" if paths else "")


def against_line(result: dict) -> str:
    """The comparison in one line; against the bf16 twin, also how far the losses were apart."""
    other = result["against"]
    memory = "" if other["memory_ratio"] is None else f", {other['memory_ratio']:.2f}x the peak memory"
    line = f"{_ours_name(result)} / {other['impl']}: {other['speedup']:.2f}x the tokens/s{memory}"
    gap = other.get("loss_gap")
    if gap is not None:
        line += (f"; losses {gap['max']:.2%} (max), {gap['mean']:.2%} (mean) from the {other['impl']}'s over "
                 f"{gap['steps']} steps")
    return line


def one_document_line(result: dict) -> str | None:
    """Both models' loss on one document before any step (the transformers baseline's `one_document`): where they
    agree, the weights are the same whatever the first-step losses say. None without it."""
    other = result["against"]
    probe = other.get("one_document")
    if probe is None or probe["baseline_loss"] is None:
        return None
    ours, theirs = probe["moe_tune_loss"], probe["baseline_loss"]
    apart = abs(ours - theirs) / abs(theirs) if theirs else math.inf
    return (f"the longest document of the first micro-batch alone ({probe['tokens']:,} tokens), before any step: loss "
            f"{ours:.4f} ({_ours_name(result)}) / {theirs:.4f} ({other['impl']}), {apart:.3%} apart")


def steps_plot(result: dict, path: Path) -> None:
    """The breakdown's shares as horizontal bars; beside them, with --against, tokens/s and peak memory of both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_tune.engine.atomic_write import atomic_path

    other = result["against"]
    if other is not None and other["out_of_memory"] is not None:
        other = None
    fig, axes = plt.subplots(1, 2 if other else 1, figsize=(13 if other else 8, 5), squeeze=False)
    classes = result["breakdown"]["classes"]
    ax = axes[0][0]
    ax.barh(range(len(classes)), [row["share"] * 100 for row in classes])
    ax.set_yticks(range(len(classes)), [row["op_class"] for row in classes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the step")
    ax.set_title(f"{result['profile']}: one step ({result['breakdown']['timing']})", fontsize=9)
    if other:
        ax = axes[0][1]
        names = [_ours_name(result), other["impl"]]
        rates = [result["tokens_per_s"], other["tokens_per_s"]]
        bars = ax.bar(names, rates)
        for bar, row in zip(bars, (result, other)):
            label = f"MFU {row['mfu']:.1%}\npeak {_bytes(row['peak_memory_bytes'])}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)  # fmt: skip
        ax.set_ylabel("tokens/s")
        # Head room above the taller bar for its two-line label.
        ax.set_ylim(0, max(rates) * 1.15)
        baseline_name = (other["impl"] if other["baseline"] == "bf16-base"
                         else f"{other['model_type']} in transformers")  # fmt: skip
        ax.set_title(f"{other['speedup']:.2f}x the tokens/s of {baseline_name}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{result['machine']}, torch {result['torch']}, commit {result['commit']}, {result['date']}",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def run(
    job: JobProfile,
    steps: int,
    json_out: Path | None,
    against: str | None,
    plot: Path | None,
) -> None:
    """Run a few training steps of the profile and print (and write) what they measured."""
    from moe_tune.engine.bench.steps import WARMUP_STEPS, profile_steps

    console = _console()

    def on_step(index: int, is_warmup: bool, record: dict) -> None:
        label = "warm-up" if is_warmup else "step"
        console.print(f"{record['impl']} {label} {index + 1}: {record['step_time_s'] * 1e3:,.1f} ms, "
                      f"loss {record['loss']:.4f}", markup=False)  # fmt: skip

    ours: list[dict] = []

    def print_ours(result: dict) -> None:
        ours.append(result)
        console.print(_steps_table(result))
        breakdown = result["breakdown"]
        console.print(f"per-operator breakdown of one more step ({breakdown['timing']}; shares of "
                      f"{breakdown['basis_s'] * 1e3:,.1f} ms):", markup=False)  # fmt: skip
        console.print(breakdown_table(breakdown))
        console.print("the heaviest ops of that step:", markup=False)
        console.print(_top_ops_table(breakdown))
        if breakdown.get("gpu_waits"):
            console.print("the ops the GPU waited for longest in that step (idle right before their work):",
                          markup=False)  # fmt: skip
            console.print(gpu_waits_table(breakdown))
        if breakdown.get("host_waits") is not None:
            if breakdown["host_waits"]:
                console.print("where the host waited for the GPU in one more step (reading a device value):",
                              markup=False)  # fmt: skip
                console.print(host_waits_table(breakdown))
            else:
                console.print("the host never waited for the GPU in one more step (no synchronizing CUDA operation "
                              "torch reports)", markup=False)  # fmt: skip
        if breakdown.get("launch_sites"):
            console.print("where one more step's ops were dispatched from, most first (views and allocations left "
                          "out):", markup=False)  # fmt: skip
            console.print(launch_sites_table(breakdown))
        if breakdown.get("device_timeline") is not None:
            console.print(device_timeline_line(breakdown["device_timeline"]), markup=False, soft_wrap=True)
            if breakdown["device_timeline"]["gaps"]:
                console.print("the device work it waited for longest there (idle right before it):", markup=False)
                console.print(device_gaps_table(breakdown["device_timeline"]))
            console.print("the device work that took longest there (CUDA graphs' kernels too):", markup=False)
            console.print(device_work_table(breakdown["device_timeline"]))
        if json_out is not None and not result["complete"]:
            write_json(json_out, result)
            console.print(f"our steps written to {json_out} (complete: false until the {against} baseline's are "
                          "in)", markup=False)  # fmt: skip

    # Ours is printed (and written) before a baseline runs: a run stopped in the baseline keeps it.
    # A baseline that cannot run (check_against) is refused before anything is built.
    try:
        with user_errors():
            result = profile_steps(job, steps, WARMUP_STEPS, on_step, against=against,
                                   on_line=lambda line: console.print(line, markup=False, soft_wrap=True),
                                   on_ours=print_ours)  # fmt: skip
    except KeyboardInterrupt:
        if ours and against is not None:
            kept = [f"{json_out} keeps our steps (complete: false)"] if json_out is not None else []
            if plot is not None:
                try:
                    steps_plot(ours[0], plot)
                    kept.append(f"{plot} their plot")
                except (OSError, ValueError, RuntimeError) as err:
                    kept.append(f"no plot ({err})")
            console.print(f"stopped (KeyboardInterrupt) before the {against} baseline finished"
                          + "".join(f"; {line}" for line in kept), markup=False)  # fmt: skip
        raise
    other = result["against"]
    if other is not None and other["out_of_memory"] is not None:
        console.print(out_of_memory_line(result), markup=False)
    elif other is not None:
        console.print(against_header(other), markup=False)
        if line := baseline_runs_line(other):
            console.print(line, markup=False, soft_wrap=True)
        console.print(_against_table(result))
        console.print(against_line(result), markup=False)
    if other is not None and (line := one_document_line(result)):
        console.print(line, markup=False, soft_wrap=True)
    if json_out is not None:
        write_json(json_out, result)
        console.print(f"results written to {json_out}", markup=False)
    if plot is not None:
        try:
            steps_plot(result, plot)
        except (OSError, ValueError, RuntimeError) as err:
            fail([f"--plot ({str(plot)!r}): cannot draw the plot ({err})"])
        console.print(f"plot written to {plot}", markup=False)


def run_load(job: JobProfile, folder: Path, json_out: Path | None) -> None:
    """`--load-checkpoint DIR`: write (unless there) and load the profile model's synthetic FP8 checkpoint; print
    and write what the load measured."""
    from moe_tune.engine.bench.load_op import run_load_benchmark

    console = _console()
    with user_errors():
        result = run_load_benchmark(job, folder, on_line=lambda line: console.print(line, markup=False))
    title = (f"{result['profile']}: loading {result['checkpoint']}; {result['machine']} ({result['device']}), "
             f"torch {result['torch']}, commit {result['commit']}, {result['date']}")
    table = Table(title=title, title_justify="left")
    table.add_column("metric", justify="left", no_wrap=True)
    table.add_column("value", justify="right")
    growth = result["peak_rss_growth_over_max_shard"]
    rows = [
        ("checkpoint", f"{_bytes(result['checkpoint_bytes'])} in {result['num_shards']} shards (largest "
                       f"{_bytes(result['max_shard_bytes'])}), {result['num_tensors']:,} tensors, "
                       f"{result['num_fp8_tensors']:,} FP8"),
        ("written", "-" if result["write_s"] is None else f"{result['write_s']:,.1f} s, "
                                                          f"{_rate(result['write_gb_per_s'])}"),
        ("load", f"{result['load_s']:,.1f} s, {_rate(result['load_gb_per_s'])}"),
        ("host memory before the load", _bytes(result["rss_before_bytes"])),
        ("peak host memory in the load" + ("" if result["peak_rss_reset"] else " (whole process)"),
         _bytes(result["peak_rss_bytes"])),
        ("  growth / largest shard", "-" if growth is None else f"{_bytes(result['peak_rss_growth_bytes'])} = "
                                                                 f"{growth:.2f} shards"),
        ("  anonymous before / peak", f"{_bytes(result['rss_anon_before_bytes'])} / "
                                      f"{_bytes(result['peak_rss_anon_bytes'])}"),
        ("  file-backed peak (mapped shard pages)", _bytes(result["peak_rss_file_bytes"])),
        ("page cache dropped before the load", "yes" if result["page_cache_dropped"] else "no"),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if json_out is not None:
        write_json(json_out, result)
        console.print(f"results written to {json_out}", markup=False)


def launches_table(result: dict) -> Table:
    """One row per launch of compare_launches' result: its timed steps, their median, against the defaults'."""
    table = Table("launch", "steps (ms)", "median ms", "vs the defaults", "device busy ms")
    defaults = result["launches"][0]["step_time_s"]
    for row in result["launches"]:
        median, busy = row["step_time_s"], row["device_busy_s"]
        ratio = "-" if median is None or defaults is None else f"{median / defaults:.3f}x"
        table.add_row(row["launch"] or "the defaults", ", ".join(f"{t * 1e3:,.2f}" for t in row["step_times_s"]),
                      "-" if median is None else f"{median * 1e3:,.2f}", ratio,
                      "-" if busy is None else f"{busy * 1e3:,.2f}")  # fmt: skip
    return table


def run_launches(job: JobProfile, rounds: int, launches: list[str], json_out: Path | None) -> None:
    """Time the profile's steps under the defaults and each launch in turns; print (and write) what they measured."""
    from moe_tune.engine.bench.launch_turns import LaunchFailed, TurnsStopped, compare_launches, kernel_changes
    from moe_tune.profiles import error_line

    console = _console()

    def on_step(launch: str | None, record: dict) -> None:
        console.print(f"{launch or 'the defaults'}: {record['step_time_s'] * 1e3:,.1f} ms, loss {record['loss']:.4f}",
                      markup=False)  # fmt: skip

    try:
        with user_errors():
            result = compare_launches(job, launches, rounds, on_step=on_step,
                                      on_line=lambda line: console.print(line, markup=False))  # fmt: skip
    except LaunchFailed as err:
        fail([f"--compare-launch {err.launch}: a kernel cannot run under it: {error_line(err.error, plain=())}"])
    except TurnsStopped as stop:
        # A time limit's SIGINT after the warm-up: the steps timed until then are printed and written.
        console.print(launches_table(stop.result))
        kept = ""
        if json_out is not None:
            write_json(json_out, stop.result)
            kept = f"; {json_out} keeps them (complete: false)"
        console.print(f"stopped (KeyboardInterrupt) before the {rounds} rounds finished: the steps timed until then"
                      f"{kept}", markup=False)  # fmt: skip
        raise
    console.print(f"{job.name}: {rounds} rounds of {result['steps_per_turn']} timed steps a launch, in turns; "
                  f"{result['machine']}, commit {result['commit']}, {result['date']}", markup=False)  # fmt: skip
    console.print(launches_table(result))
    defaults = result["launches"][0]
    for row in result["launches"][1:]:
        changes = kernel_changes(defaults, row)
        if changes:
            console.print(f"the kernels whose device time changed most under {row['launch']} (ms, the defaults -> "
                          "this launch):", markup=False)  # fmt: skip
            for change in changes:
                line = (f"  {change['kernel'][:100]}: {change['defaults_s'] * 1e3:,.3f} -> "
                        f"{change['time_s'] * 1e3:,.3f} ({change['change_s'] * 1e3:+,.3f})")  # fmt: skip
                console.print(line, markup=False)
    if json_out is not None:
        write_json(json_out, result)
        console.print(f"results written to {json_out}", markup=False)
