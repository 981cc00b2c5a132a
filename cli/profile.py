"""`moe-tune profile --kernels`: time every registered op (fwd, fwd+bwd) beside its baselines; check a saved run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ._common import fail

app = typer.Typer()

# Rich falls back to 80 columns when stdout is not a terminal; the table needs about this many.
TABLE_WIDTH = 220
# Notes wrap; this keeps them readable when the other columns are wide.
NOTE_MIN_WIDTH = 40
REGRESSION_EXIT = 1


def _format(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _table(rows: list[dict]) -> Table:
    machine = rows[0]
    title = (
        f"{machine['machine']} ({machine['device']}), torch {machine['torch']}, triton {machine['triton']}, "
        f"commit {machine['commit']}, {machine['date']}"
    )
    table = Table(title=title, title_justify="left")
    headers = ("op", "case", "impl", "shape", "dtype", "fwd ms", "TFLOP/s (% peak)", "fwd+bwd ms",
               "TFLOP/s (% peak)", "peak mem GB", "note")  # fmt: skip
    for header in headers:
        is_text = header in ("op", "case", "impl", "shape", "dtype", "note")
        table.add_column(header, justify="left" if is_text else "right", no_wrap=header != "note",
                         min_width=NOTE_MIN_WIDTH if header == "note" else None)  # fmt: skip
    for row in rows:
        timings = []
        for key in ("fwd", "fwd_bwd"):
            throughput = f"{_format(row[f'{key}_tflops'], '.3g')} ({_format(row[f'{key}_peak_fraction'], '.0%')})"
            timings += [_format(row[f"{key}_ms"], ".3f"), throughput]
        table.add_row(row["op"], row["case"], row["impl"], row["shape"], row["dtype"], *timings,
                      _format(row["peak_memory_bytes"], ".2f", scale=1e-9), row["note"] or "")  # fmt: skip
    return table


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

    labels = [f"{row['op']} / {row['case']} / {row['impl']}" for row in rows]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    positions = range(len(rows))
    for offset, key in ((-0.2, "fwd_ms"), (0.2, "fwd_bwd_ms")):
        ax.barh([p + offset for p in positions], [row[key] or 0 for row in rows], height=0.4, label=key)
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("median ms")
    first = rows[0]
    ax.set_title(f"{first['machine']}, commit {first['commit']}, {first['date']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@app.command()
def profile(
    kernels: Annotated[bool, typer.Option("--kernels", help="time the fused ops (the only mode for now)")] = False,
    ops: Annotated[
        str | None, typer.Option("--ops", help="comma-separated ops to time (default: every registered op)")
    ] = None,
    shapes: Annotated[str, typer.Option("--shapes", help="shape preset: small, or anchor (docs/PERF.md's)")] = "small",
    json_out: Annotated[Path | None, typer.Option("--json", help="write the rows as JSON to this file")] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="a saved --json run: exit 1 when a row got >10% slower")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="draw the medians into this PNG (needs matplotlib)")
    ] = None,
) -> None:
    """Time each op's forward and forward+backward, with TFLOP/s, fraction of the measured peak and peak memory."""
    if not kernels:
        fail(["end-to-end profiling of a PROFILE is not built yet: pass --kernels to time the fused ops"])
    from moe_tune.engine.bench import OPS, PRESETS, REGRESSION_TOLERANCE, find_regressions, run_kernels

    problems = []
    try:
        op_names = parse_ops(ops, list(OPS))
    except ValueError as err:
        problems.append(str(err))
    if shapes not in PRESETS:
        problems.append(f"--shapes ({shapes!r}) must be one of {', '.join(PRESETS)}")
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problems.append(f"--plot ({str(plot)!r}) needs matplotlib, which is not installed")
    if problems:
        fail(problems)
    saved = _read_baseline(baseline) if baseline is not None else None

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = TABLE_WIDTH
    rows, _, _ = run_kernels(op_names, shapes, on_start=lambda line: console.print(line, markup=False))
    console.print(_table(rows))
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            fail([f"--json ({str(json_out)!r}): cannot write the rows ({err.strerror})"])
        console.print(f"rows written to {json_out}", markup=False)
    if plot is not None:
        _plot(rows, plot)
        console.print(f"plot written to {plot}", markup=False)
    if saved is not None:
        regressions = find_regressions(rows, saved)
        for line in regressions:
            console.print(f"slower than {baseline}: {line}", markup=False)
        if regressions:
            raise typer.Exit(code=REGRESSION_EXIT)
        console.print(f"no row slower than {baseline} by more than {REGRESSION_TOLERANCE:.0%}", markup=False)
