"""`moe-tune profile --kernels`: time every registered op (fwd, fwd+bwd) beside its baselines, print the table, check
a saved run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ._common import fail, input_file_problems

# profile --kernels fits a terminal this wide (wrapping cells, notes as footnotes) unless --wide.
KERNELS_WIDTH = 120
# --wide: each row on one line, however long its note.
WIDE_WIDTH = 1000
# Characters between two columns of the narrow kernels table (padding and rule).
COLUMN_GAP = 3
# The columns that say what a kernels row measured.
TEXT_KEYS = ("op", "case", "impl", "shape", "dtype")
REGRESSION_EXIT = 1


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


def kernels_table(rows: list[dict], wide: bool = False, width: int = KERNELS_WIDTH) -> tuple[Table, list[str]]:
    """The kernels table and the lines printed below it. Narrow (default): cells wrap between words to fit `width`
    columns, and each note is a numbered footnote below the table (the same note once), its number after the impl;
    wide: a column each for op, case, shape and dtype, every cell on one line, the notes in the last column."""
    machine = rows[0]
    driver = f", driver {machine['driver']}" if machine.get("driver") else ""
    title = (
        f"{machine['machine']} ({machine['device']}{driver}), torch {machine['torch']}, triton {machine['triton']}, "
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
    """The op names of a comma-separated list; None (all) when not given. Raises ValueError naming the value: an
    unknown or empty name (`moe,`), or an op named twice (its rows would be timed and saved twice)."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if "" in names and text.strip():
        raise ValueError(f"--ops ({text!r}) has an empty name (a comma too many): name registered ops, "
                         f"comma-separated: {', '.join(registered)}")  # fmt: skip
    if not all(name in registered for name in names):
        raise ValueError(f"--ops ({text!r}) must name registered ops: {', '.join(registered)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--ops ({text!r}) names {', '.join(twice)} more than once")
    return names


def input_problems(ops: str | None, shapes: str, baseline: Path | None) -> list[str]:
    """One line per --kernels input refused before anything is timed: --ops and --shapes that do not parse
    (parse_ops, engine/bench's parse_shapes and its SPEC rules), a SPEC whose tensors exceed the
    memory of this machine, a --baseline that is not a list of rows as --json writes them or holds no row of the ops
    timed (nothing would be compared)."""
    from moe_tune.engine.bench.kernels import OPS, memory_problems, parse_shapes, read_baseline

    problems = []
    try:
        op_names = parse_ops(ops, list(OPS))
    except ValueError as err:
        problems.append(str(err))
        op_names = []
    names = list(OPS) if op_names is None else op_names
    if names:
        try:
            parsed = parse_shapes(shapes, names, label="--shapes")
        except ValueError as err:
            problems.append(str(err))
        else:
            problems += memory_problems(shapes, parsed, label="--shapes")
    if baseline is not None:
        baseline_problems = input_file_problems([("--baseline", baseline)])
        rows, read_problems = read_baseline(baseline) if not baseline_problems else ([], [])
        baseline_problems += read_problems
        problems += baseline_problems
        if not baseline_problems and names and not any(row["op"] in names for row in rows):
            saved_ops = ", ".join(dict.fromkeys(row["op"] for row in rows)) or "none"
            problems.append(f"--baseline ({str(baseline)!r}): no row of the baseline matches the run's ops "
                            f"({', '.join(names)}; its rows are of {saved_ops}): nothing would be compared")
    return problems


def row_line(row: dict) -> str:
    """One measured row as the run streams it: what was timed, then the fwd and fwd+bwd medians and TFLOP/s (the
    note waits for the table)."""
    passes = []
    for key, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        tflops = f" ({row[f'{key}_tflops']:.3g} TFLOP/s)" if row[f"{key}_tflops"] is not None else ""
        passes.append(f"{label} {_format(row[f'{key}_ms'], '.3f')} ms{tflops}")
    return f"{row['op']} / {row['case']} / {row['impl']} / {row['shape']} {row['dtype']}: {', '.join(passes)}"


def plot_rows(rows: list[dict], path: Path, partial: str | None = None) -> None:
    """Horizontal bars of the fwd and fwd+bwd medians per row, log scale; `partial` (what is missing) joins the
    title. Drawn to a temporary file renamed over `path`, so a run stopped while drawing keeps the last plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_tune.engine.atomic_write import atomic_path

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
    title = f"{first['machine']}, commit {first['commit']}, {first['date']}"
    ax.set_title(title + (f" ({partial})" if partial else ""), fontsize=8)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def run(ops: str | None, shapes: str, json_out: Path | None, baseline: Path | None, plot: Path | None,
        wide: bool) -> None:
    """Time the chosen ops beside their baselines, each row printed (and saved to --json and --plot) as soon as it is
    measured, each op's wall seconds after its rows, then the table; exit 1 when a row is slower than --baseline.
    The caller has refused what input_problems finds."""
    from moe_tune.engine.bench import OPS, REGRESSION_TOLERANCE, find_regressions, is_partial, run_kernels, write_rows
    from moe_tune.engine.atomic_write import writes_in_place
    from moe_tune.engine.bench.kernels import MATCH_KEYS, read_baseline

    op_names = parse_ops(ops, list(OPS))
    saved = read_baseline(baseline)[0] if baseline is not None else None

    console = Console(highlight=False)
    if wide:
        console.width = WIDE_WIDTH
    elif not console.is_terminal:
        console.width = KERNELS_WIDTH

    def say(line: str) -> None:
        # Lines other than the table are never wrapped: a reader greps them, copies paths out of them.
        console.print(line, markup=False, soft_wrap=True)

    if saved is not None and is_partial(saved):
        say(f"--baseline {baseline} holds a run stopped before its end ({len(saved)} rows, complete: false): only "
            "those rows are compared")
    names = list(OPS) if op_names is None else op_names
    # A file written in place (a FIFO, /dev/stdout) is written once, at the end of the run or where it stops: its
    # reader would see each write after the last.
    json_once, plot_once = (path is not None and writes_in_place(path) for path in (json_out, plot))
    # The rows of the ops measured, and those the running op has reported so far (printed already).
    measured: list[dict] = []
    done: list[str] = []
    running: list[dict] = []
    written: list[Path] = []

    def save(is_complete: bool, is_last: bool = False) -> None:
        rows = measured + running
        if json_out is not None and (is_last or not json_once):
            try:
                write_rows(json_out, rows, is_complete)
                written.append(json_out)
            except OSError as err:
                fail([f"--json ({str(json_out)!r}): cannot write the rows ({err.strerror or err}); the file is as "
                      "it was"])
        if plot is not None and rows and (is_last or not plot_once):
            try:
                plot_rows(rows, plot, None if is_complete else f"partial: {len(done)} of {len(names)} ops")
            except (OSError, ValueError, RuntimeError) as err:
                fail([f"--plot ({str(plot)!r}): cannot draw the plot ({err})"])

    def on_progress(name: str, op_rows: list[dict], seconds: float) -> None:
        for row in op_rows[len(running) :]:
            say(row_line(row))
        running[:] = op_rows
        save(is_complete=False)

    def on_op(name: str, op_rows: list[dict], seconds: float) -> None:
        for row in op_rows[len(running) :]:
            say(row_line(row))
        say(f"{name}: {len(op_rows)} row{'s' if len(op_rows) != 1 else ''} in {seconds:.1f} s")
        running.clear()
        measured.extend(op_rows)
        done.append(name)
        save(is_complete=False)

    try:
        rows, _, _ = run_kernels(op_names, shapes, on_start=say, on_op=on_op, on_progress=on_progress)
    except typer.Exit:
        raise
    except (Exception, KeyboardInterrupt) as err:
        where = f"before {names[len(done)]} was measured" if len(done) < len(names) else "after the last op"
        held = [*done, f"{len(running)} of {names[len(done)]}"] if running else done
        if json_once or plot_once:
            save(is_complete=False, is_last=True)
        kept = [f"{json_out} keeps the rows of {', '.join(held)} (complete: false)" if written else
                f"{json_out} is as it was (no row measured)"] if json_out else []  # fmt: skip
        kept += [f"{plot} their plot"] if plot and (measured or running) else []
        say(f"stopped ({type(err).__name__}) {where}" + "".join(f"; {line}" for line in kept))
        raise
    table, footnotes = kernels_table(rows, wide, console.width)
    console.print(table)
    for line in footnotes:
        console.print(line, markup=False)
    save(is_complete=True, is_last=True)
    if json_out is not None:
        say(f"rows written to {json_out}")
    if plot is not None:
        say(f"plot written to {plot}")
    if saved is not None:
        regressions = find_regressions(rows, saved)
        for line in regressions:
            say(f"slower than {baseline}: {line}")
        if regressions:
            raise typer.Exit(code=REGRESSION_EXIT)
        keys = {tuple(row.get(key) for key in MATCH_KEYS) for row in saved}
        if not any(tuple(row.get(key) for key in MATCH_KEYS) in keys for row in rows):
            fail([f"--baseline ({str(baseline)!r}): no row of it matches a row of this run ({', '.join(MATCH_KEYS)}): "
                  "nothing was compared"])  # fmt: skip
        say(f"no row slower than {baseline} by more than {REGRESSION_TOLERANCE:.0%}")
