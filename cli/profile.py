"""`moe-tune profile PROFILE`: a few real training steps of a profile (throughput, latency, peak memory, MFU, the
memory policy's metrics, a per-operator breakdown; `--against transformers` times the same steps of the
transformers + PEFT baseline). `moe-tune profile --kernels`: time every registered op (fwd, fwd+bwd) beside its
baselines; check a saved run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Callable

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ._common import SetOption, fail, read_profile, user_errors

app = typer.Typer()

# Rich falls back to 80 columns when stdout is not a terminal; the profile tables need about this many.
TABLE_WIDTH = 220
# profile --kernels fits a terminal this wide (wrapping cells, notes as footnotes) unless --wide.
KERNELS_WIDTH = 120
# --wide: each row on one line, however long its note.
WIDE_WIDTH = 1000
# Characters between two columns of the narrow kernels table (padding and rule).
COLUMN_GAP = 3
# The columns that say what a kernels row measured.
TEXT_KEYS = ("op", "case", "impl", "shape", "dtype")
REGRESSION_EXIT = 1
DEFAULT_STEPS = 3
BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def _format(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _kernel_columns(rows: list[dict], wide: bool) -> list[tuple[str, Callable[[dict], str]]]:
    """(header, cell of a row) of the kernels table, without the measured columns no row has a value in (on the
    CPU: % of peak and peak memory). Narrow (not `wide`): op and case share a cell, as do shape and dtype, and the
    % of peak follows the TFLOP/s."""
    has_peak = any(row[f"{key}_peak_fraction"] is not None for row in rows for key in ("fwd", "fwd_bwd"))
    if wide:
        columns: list[tuple[str, Callable[[dict], str]]] = [(k, lambda row, k=k: str(row[k])) for k in TEXT_KEYS]
    else:
        columns = [("op\ncase", lambda row: f"{row['op']}\n{row['case']}"), ("impl", lambda row: str(row["impl"])),
                   ("shape\ndtype", lambda row: f"{row['shape']}\n{row['dtype']}")]  # fmt: skip
    for key, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        columns.append((f"{label}\nms", lambda row, key=key: _format(row[f"{key}_ms"], ".3f")))
        if has_peak:
            columns.append((f"{label}\nTFLOP/s\n(% peak)", lambda row, key=key: (
                f"{_format(row[f'{key}_tflops'], '.3g')} ({_format(row[f'{key}_peak_fraction'], '.0%')})")))
        else:
            columns.append((f"{label}\nTFLOP/s", lambda row, key=key: _format(row[f"{key}_tflops"], ".3g")))
    columns.append(("peak mem\nGB", lambda row: _format(row["peak_memory_bytes"], ".2f", scale=1e-9)))
    num_text = 3 if not wide else len(TEXT_KEYS)
    return [column for i, column in enumerate(columns) if i < num_text or any(column[1](row) != "-" for row in rows)]


def _column_widths(cells: list[list[str]], headers: list[str], num_text: int, width: int) -> list[int]:
    """Widths that fit `width` columns of the console: each measured column as wide as its widest line, the text
    columns shrunk in proportion to their widest lines, never below their longest word (a word is never cut)."""
    lines = [[line for text in (header, *(row[i] for row in cells)) for line in text.split("\n")]
             for i, header in enumerate(headers)]  # fmt: skip
    natural = [max(len(line) for line in column) for column in lines]
    least = [max(len(word) for line in column for word in line.split() or [""]) for column in lines]
    room = width - COLUMN_GAP * (len(headers) - 1) - sum(natural[num_text:])
    text_natural = sum(natural[:num_text])
    if text_natural <= room:
        return natural
    shrunk = [max(least[i], natural[i] * room // text_natural) for i in range(num_text)]
    return shrunk + natural[num_text:]


def _table(rows: list[dict], wide: bool = False, width: int = KERNELS_WIDTH) -> tuple[Table, list[str]]:
    """The kernels table and the lines printed below it. Narrow (default): cells wrap between words to fit `width`
    columns, and each note is a numbered footnote below the table (the same note once), its number after the impl;
    wide: a column each for op, case, shape and dtype, every cell on one line, the notes in the last column."""
    machine = rows[0]
    title = (
        f"{machine['machine']} ({machine['device']}), torch {machine['torch']}, triton {machine['triton']}, "
        f"commit {machine['commit']}, {machine['date']}"
    )
    columns = _kernel_columns(rows, wide)
    num_text = len(TEXT_KEYS) if wide else 3
    cells = [[cell(row) for _, cell in columns] for row in rows]
    notes: dict[str, int] = {}
    if wide:
        table = Table(title=title, title_justify="left")
        for index, (header, _) in enumerate(columns):
            table.add_column(header, justify="left" if index < num_text else "right", no_wrap=True)
        if any(row["note"] for row in rows):
            table.add_column("note", justify="left", no_wrap=True)
            cells = [row_cells + [row["note"] or ""] for row_cells, row in zip(cells, rows)]
    else:
        for row_cells, row in zip(cells, rows):
            if row["note"]:
                row_cells[1] += f" [{notes.setdefault(row['note'], len(notes) + 1)}]"
        headers = [header for header, _ in columns]
        widths = _column_widths(cells, headers, num_text, width)
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      collapse_padding=True)  # fmt: skip
        for index, header in enumerate(headers):
            table.add_column(header, justify="left" if index < num_text else "right", width=widths[index])
    for row_cells in cells:
        table.add_row(*row_cells)
    return table, [f"[{number}] {note}" for note, number in notes.items()]


def parse_ops(text: str | None, registered: list[str]) -> list[str] | None:
    """The op names of a comma-separated list; None (all) when not given. Raises ValueError naming the unknown."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in registered]
    if unknown or not names:
        raise ValueError(f"--ops ({text!r}) must name registered ops: {', '.join(registered)}")
    return names


def _read_baseline(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        fail([f"--baseline ({str(path)!r}): cannot read it ({err.strerror})"])
    except json.JSONDecodeError as err:
        fail([f"--baseline ({str(path)!r}): not JSON ({err.msg}, line {err.lineno})"])
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        fail([f"--baseline ({str(path)!r}) must be a list of rows as --json writes them"])
    return data


def _plot(rows: list[dict], path: Path) -> None:
    """Horizontal bars of the fwd and fwd+bwd medians per row, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['op']} / {row['case']} / {row['impl']} / {row['shape']}" for row in rows]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    positions = range(len(rows))
    for offset, key in ((-0.2, "fwd_ms"), (0.2, "fwd_bwd_ms")):
        # A pass not measured draws no bar (NaN), where 0 would break the log scale.
        medians = [float("nan") if row[key] is None else row[key] for row in rows]
        ax.barh([p + offset for p in positions], medians, height=0.4, label=key)
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("median ms")
    first = rows[0]
    ax.set_title(f"{first['machine']}, commit {first['commit']}, {first['date']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in BYTE_UNITS:
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} GB/s"


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
        ("peak memory", _bytes(result["peak_memory_bytes"])),
        ("model FLOPs per step", f"{result['model_flops_per_step']:.3g}"),
        ("achieved", f"{result['achieved_tflops']:.3g} TFLOP/s"),
        (f"MFU (of the measured GEMM peak, {result['peak_tflops']:.3g} TFLOP/s)", f"{result['mfu']:.1%}"),
        ("saved on the GPU", _bytes(memory.get("gpu_saved_bytes"))),
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


def _write_json(path: Path, data) -> None:
    try:
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        fail([f"--json ({str(path)!r}): cannot write the results ({err.strerror})"])


def _breakdown_table(breakdown: dict) -> Table:
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


def _against_table(result: dict) -> Table:
    """moe-tune's row and the baseline's, the same columns."""
    other = result["against"]
    table = Table()
    headers = ("impl", "tokens/s", "step latency", "peak memory", "MFU", "trainable params", "first-step loss")
    for header in headers:
        table.add_column(header, justify="left" if header == "impl" else "right", no_wrap=True)
    for impl, row in (("moe-tune", result), (other["impl"], other)):
        table.add_row(impl, f"{row['tokens_per_s']:,.0f}", f"{row['step_time_s'] * 1e3:,.1f} ms",
                      _bytes(row["peak_memory_bytes"]), f"{row['mfu']:.1%}", f"{row['trainable_parameters']:,}",
                      f"{row['first_step_loss']:.4f}")  # fmt: skip
    return table


def _against_line(result: dict) -> str:
    other = result["against"]
    memory = "" if other["memory_ratio"] is None else f", {other['memory_ratio']:.2f}x the peak memory"
    return f"moe-tune / {other['impl']}: {other['speedup']:.2f}x the tokens/s{memory}"


def _steps_plot(result: dict, path: Path) -> None:
    """The breakdown's shares as horizontal bars; beside them, with --against, tokens/s and peak memory of both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    other = result["against"]
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
        names = ["moe-tune", other["impl"]]
        rates = [result["tokens_per_s"], other["tokens_per_s"]]
        bars = ax.bar(names, rates)
        for bar, row in zip(bars, (result, other)):
            label = f"MFU {row['mfu']:.1%}\npeak {_bytes(row['peak_memory_bytes'])}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)  # fmt: skip
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{other['speedup']:.2f}x the tokens/s of {other['model_type']} in transformers", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{result['machine']}, torch {result['torch']}, commit {result['commit']}, {result['date']}",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _profile_steps(
    profile_arg: str,
    overrides: list[str] | None,
    steps: int,
    json_out: Path | None,
    against: str | None,
    plot: Path | None,
) -> None:
    job = read_profile(profile_arg, overrides)
    from moe_tune.engine.bench.steps import WARMUP_STEPS, profile_steps

    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail([f"--plot ({str(plot)!r}) needs matplotlib, which is not installed"])

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = TABLE_WIDTH

    def on_step(index: int, is_warmup: bool, record: dict) -> None:
        label = "warm-up" if is_warmup else "step"
        console.print(f"{record['impl']} {label} {index + 1}: {record['step_time_s'] * 1e3:,.1f} ms, "
                      f"loss {record['loss']:.4f}", markup=False)  # fmt: skip

    # A baseline that cannot run (check_against) is refused before anything is built.
    with user_errors():
        result = profile_steps(job, steps, WARMUP_STEPS, on_step, against=against,
                               on_line=lambda line: console.print(line, markup=False, soft_wrap=True))  # fmt: skip
    console.print(_steps_table(result))
    breakdown = result["breakdown"]
    console.print(f"per-operator breakdown of one more step ({breakdown['timing']}; shares of "
                  f"{breakdown['basis_s'] * 1e3:,.1f} ms):", markup=False)  # fmt: skip
    console.print(_breakdown_table(breakdown))
    console.print("the heaviest ops of that step:", markup=False)
    console.print(_top_ops_table(breakdown))
    other = result["against"]
    if other is not None:
        console.print(f"against {other['impl']} ({other['model_type']}, attention "
                      f"{other['attention_implementation']}, experts {other['experts_implementation']}) on the same "
                      "micro-batches:", markup=False)  # fmt: skip
        console.print(_against_table(result))
        console.print(_against_line(result), markup=False)
    if json_out is not None:
        _write_json(json_out, result)
        console.print(f"results written to {json_out}", markup=False)
    if plot is not None:
        _steps_plot(result, plot)
        console.print(f"plot written to {plot}", markup=False)


@app.command()
def profile(
    profile_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="[PROFILE]", help="profile YAML path or shipped name: run a few of its training steps"
        ),
    ] = None,
    overrides: SetOption = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="timed training steps (after two warm-up steps)")] = (
        DEFAULT_STEPS
    ),
    against: Annotated[
        str | None,
        typer.Option("--against", metavar="BASELINE", help="also time the same steps of a baseline in this process: "
                     "transformers (the architecture in transformers with PEFT LoRA on the same targets)"),
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
) -> None:
    """Profile a training run (PROFILE) or time each fused op's forward and forward+backward (--kernels)."""
    if kernels == (profile_arg is not None):
        fail(["pass a PROFILE (time its training steps) or --kernels (time the fused ops), not both or neither"])
    # Options of the other mode would be ignored silently (a --baseline that can never fail, say): refuse them.
    other_mode = (
        {"--ops": ops, "--shapes": None if shapes == "small" else shapes, "--baseline": baseline,
         "--wide": wide or None}
        if profile_arg is not None
        else {"--steps": None if steps == DEFAULT_STEPS else steps, "--set": overrides or None, "--against": against}
    )
    mode = "a PROFILE" if profile_arg is not None else "--kernels"
    misplaced = [f"{name} ({value}) does not apply with {mode}" for name, value in other_mode.items() if value is not None]
    if misplaced:
        fail(misplaced)
    if profile_arg is not None:
        _profile_steps(profile_arg, overrides, steps, json_out, against, plot)
        return
    from moe_tune.engine.bench import OPS, REGRESSION_TOLERANCE, find_regressions, parse_shapes, run_kernels

    problems = []
    try:
        op_names = parse_ops(ops, list(OPS))
    except ValueError as err:
        problems.append(str(err))
        op_names = []
    try:
        parse_shapes(shapes, list(OPS) if op_names is None else op_names, label="--shapes")
    except ValueError as err:
        problems.append(str(err))
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problems.append(f"--plot ({str(plot)!r}) needs matplotlib, which is not installed")
    if problems:
        fail(problems)
    saved = _read_baseline(baseline) if baseline is not None else None

    console = Console(highlight=False)
    if wide:
        console.width = WIDE_WIDTH
    elif not console.is_terminal:
        console.width = KERNELS_WIDTH
    # Lines other than the table are never wrapped: a reader greps them, copies paths out of them.
    rows, _, _ = run_kernels(op_names, shapes,
                             on_start=lambda line: console.print(line, markup=False, soft_wrap=True))
    table, footnotes = _table(rows, wide, console.width)
    console.print(table)
    for line in footnotes:
        console.print(line, markup=False)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            fail([f"--json ({str(json_out)!r}): cannot write the rows ({err.strerror})"])
        console.print(f"rows written to {json_out}", markup=False, soft_wrap=True)
    if plot is not None:
        _plot(rows, plot)
        console.print(f"plot written to {plot}", markup=False, soft_wrap=True)
    if saved is not None:
        regressions = find_regressions(rows, saved)
        for line in regressions:
            console.print(f"slower than {baseline}: {line}", markup=False, soft_wrap=True)
        if regressions:
            raise typer.Exit(code=REGRESSION_EXIT)
        console.print(f"no row slower than {baseline} by more than {REGRESSION_TOLERANCE:.0%}", markup=False,
                      soft_wrap=True)
