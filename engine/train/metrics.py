"""Per-step metrics: a live progress bar (or log lines off a terminal), JSONL, and TensorBoard when installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .checkpoint import NO_SPACE_ERRNOS, CheckpointWriteError


def _record_step(line: str) -> int | None:
    """The step of a metrics line, or None when the line is not a record (torn by a crash mid-write, or garbage)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def kept_metrics_lines(text: str, resume_step: int) -> tuple[list[str], list[str]]:
    """The lines of metrics.jsonl a run resumed at `resume_step` keeps (records up to that step), and one note per
    line dropped that is not a record: a torn last line (a crash mid-write) or a damaged line elsewhere."""
    lines = text.split("\n")
    torn_last = not text.endswith("\n")
    kept, notes = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        step = _record_step(line)
        if step is None:
            where = "its last line, cut short by a crash" if torn_last and number == len(lines) else f"line {number}"
            notes.append(f"note: metrics.jsonl: dropped {where}, which is not a JSON record with an integer step")
        elif step <= resume_step:
            kept.append(line)
    return kept, notes


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl; on resume, drops lines past the resumed step first (and
    lines that are not records, each with a note in `notes`)."""

    def __init__(self, path: Path, resume_step: int, tensorboard_dir: Path | None):
        self.path = path
        self.notes: list[str] = []
        if resume_step > 0 and path.exists():
            kept, self.notes = kept_metrics_lines(path.read_text(errors="replace"), resume_step)
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
            except OSError as err:
                tmp.unlink(missing_ok=True)
                self._refuse_full_disk(err, "rewriting it for the resume")
                raise
            tmp.replace(path)
        elif path.exists():
            path.unlink()
        self._file = path.open("a")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                self._tb = None

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None

    def _refuse_full_disk(self, err: OSError, doing: str) -> None:
        if err.errno in NO_SPACE_ERRNOS:
            raise CheckpointWriteError(
                f"no space left on {self.path.parent} while {doing} ({self.path.name}); the checkpoints already "
                "written are kept"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            self._refuse_full_disk(err, f"writing the metrics of step {record['step']}")
            raise
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as err:
            # A full disk was reported by write(); the buffered rest of a torn line is dropped on resume.
            if err.errno not in NO_SPACE_ERRNOS:
                raise
        if self._tb is not None:
            self._tb.close()


class ProgressReporter:
    """Rich progress bar with step, loss, tokens/s and ETA; plain log lines when stdout is not a terminal."""

    def __init__(self, total_steps: int, start_step: int, log_every: int, enabled: bool, console: Console | None = None):
        self.console = console or Console()
        self.enabled = enabled
        self.log_every = log_every
        self.total = total_steps
        self._live = enabled and self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self._live,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-")

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._progress.__exit__(*exc)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        self._progress.update(
            self._task, completed=step, loss=f"{record['loss']:.4f}", tps=f"{record['tokens_per_s']:,.0f}"
        )
        if not self._live and (step % self.log_every == 0 or step == self.total or step == 1):
            remaining = (self.total - step) * record["step_time_s"]
            self.console.print(
                f"step {step}/{self.total}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"{record['tokens_per_s']:,.0f} tok/s  ETA {remaining:.0f}s",
                highlight=False,
            )

    def print(self, message: str) -> None:
        if self.enabled:
            # One line per message, however long (a path, a reason): wrapping would split what a reader greps for.
            self.console.print(message, highlight=False, soft_wrap=True, markup=False)
