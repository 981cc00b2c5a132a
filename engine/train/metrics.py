"""Per-step metrics: a live progress bar (or log lines off a terminal), JSONL, and the trackers of
output.report_to (loggers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .checkpoint import NO_SPACE_ERRNOS, CheckpointWriteError
from .loggers import Tracker, close_trackers, scalars, start_trackers


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
    """Appends one JSON object per record to metrics.jsonl and hands it to each tracker (loggers.Tracker); on
    resume, drops lines past the resumed step (and lines that are not records, each with a note in `notes`).
    close(status) finishes the trackers' runs.

    The file, and the trackers' files (loggers.start_trackers), are started with the first record: a run that ends
    before its first step leaves no metrics.jsonl (a new run) or the resumed run's file as it was, so its folder
    does not count as a previous run that trained (run_dir.RUN_RESULTS)."""

    def __init__(self, path: Path, resume_step: int, trackers: Sequence[Tracker] = ()):
        self.path = path
        self.trackers = list(trackers)
        self.notes: list[str] = [t.note for t in self.trackers if t.note]
        # The lines the file starts with: the records of the resumed run up to resume_step (none for a new run).
        self._kept: list[str] = []
        self._file = None
        try:
            if resume_step > 0 and path.exists():
                self._kept, dropped = kept_metrics_lines(path.read_text(errors="replace"), resume_step)
                self.notes += dropped
        except BaseException:
            close_trackers(self.trackers, "failed")
            raise

    def _start_file(self) -> None:
        """The trackers' files; then metrics.jsonl holding the kept lines alone (replaced atomically), open for
        appending. A tracker that cannot start stops the run before metrics.jsonl changes."""
        path = self.path
        start_trackers(path.parent, self.trackers)
        if self._kept:
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in self._kept))
            except OSError as err:
                tmp.unlink(missing_ok=True)
                self._refuse_full_disk(err, "rewriting it for the resume")
                raise
            tmp.replace(path)
        else:
            path.unlink(missing_ok=True)
        self._file = path.open("a")

    def _refuse_full_disk(self, err: OSError, doing: str) -> None:
        if err.errno in NO_SPACE_ERRNOS:
            raise CheckpointWriteError(
                f"no space left on {self.path.parent} while {doing} ({self.path.name}); the checkpoints already "
                "written are kept"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._start_file()
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            self._refuse_full_disk(err, f"writing the metrics of step {record['step']}")
            raise
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(record["step"], values)

    def close(self, status: str = "finished") -> None:
        try:
            if self._file is not None:
                self._file.close()
        except OSError as err:
            # A full disk was reported by write(); the buffered rest of a torn line is dropped on resume.
            if err.errno not in NO_SPACE_ERRNOS:
                raise
        finally:
            close_trackers(self.trackers, status)


def processed_tokens(batch, seq_len: int, pad_id: int) -> int:
    """The tokens of a micro-batch that the model runs forward and backward for a document: every position of its
    rows but the padding that fills the end of a row (the row's last piece, when it is all pad ids and unlabelled:
    engine.data.dataset.pack_rows). `batch`: a dataset Batch of rows of `seq_len` packed side by side."""
    from moe_tune.engine.data.dataset import IGNORE_INDEX

    ids_RL = batch.input_ids.view(-1, seq_len)
    labels_RL = batch.labels.view(-1, seq_len)
    starts = batch.cu_seqlens[:-1].tolist()
    total = ids_RL.numel()
    for row in range(ids_RL.shape[0]):
        last = max(start for start in starts if start < (row + 1) * seq_len) - row * seq_len
        is_padding = bool((ids_RL[row, last:] == pad_id).all() and (labels_RL[row, last:] == IGNORE_INDEX).all())
        total -= (seq_len - last) if is_padding else 0
    return total


def token_rates(record: dict[str, Any]) -> str:
    """`1,234 trained / 2,345 processed` (tokens/s) of a metrics record; the trained rate alone in older records."""
    trained = f"{record['tokens_per_s']:,.0f} trained"
    processed = record.get("processed_tokens_per_s")
    return trained + (f" / {processed:,.0f} processed" if processed is not None else "")


class ProgressReporter:
    """Rich progress bar with step, loss, tokens/s and ETA; plain log lines when stdout is not a terminal."""

    def __init__(self, total_steps: int, start_step: int, log_every: int, enabled: bool, console: Console | None = None):
        self.console = console or Console()
        self.enabled = enabled
        self.log_every = log_every
        self.total = total_steps
        # The time of the steps this process ran, the first (compilation, warm-up) apart: the ETA's mean step time.
        self._first_step_time: float | None = None
        self._later_step_time, self._later_steps = 0.0, 0
        self._live = enabled and self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("epoch {task.fields[epoch]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[eval]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self._live,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tps="-", eval="", epoch="-"
        )

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._progress.__exit__(*exc)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self._first_step_time is None:
            self._first_step_time = record["step_time_s"]
        else:
            self._later_step_time += record["step_time_s"]
            self._later_steps += 1
        self._progress.update(
            self._task, completed=step, loss=f"{record['loss']:.4f}", tps=token_rates(record),
            epoch=f"{record['epoch']:.2f}" if "epoch" in record else "-",
        )
        if not self._live and (step % self.log_every == 0 or step == self.total or step == 1):
            remaining = (self.total - step) * self.mean_step_time
            epoch = f"  epoch {record['epoch']:.2f}" if "epoch" in record else ""
            self.console.print(
                f"step {step}/{self.total}{epoch}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"{token_rates(record)} tok/s  ETA {remaining:.0f}s",
                highlight=False,
                soft_wrap=True,
            )

    @property
    def mean_step_time(self) -> float:
        """Seconds a step takes, as the ETA counts them: the mean over the steps after the first this process ran (one
        slow step moves it by its share, not to its own time), or the first step's time while it is the only one."""
        if self._later_steps:
            return self._later_step_time / self._later_steps
        return self._first_step_time or 0.0

    def report_eval(self, record: dict[str, Any]) -> None:
        """An evaluation (a metrics record with eval_loss): one log line, and its loss beside the bar."""
        if not self.enabled:
            return
        self._progress.update(self._task, eval=f"eval {record['eval_loss']:.4f}")
        self.print(
            f"eval at step {record['step']}: loss {record['eval_loss']:.4f}  perplexity "
            f"{record['eval_perplexity']:.4g}  ({record['eval_tokens']:,} tokens, {record['eval_time_s']:.1f}s)"
        )

    def print(self, message: str) -> None:
        if self.enabled:
            # One line per message, however long (a path, a reason): wrapping would split what a reader greps for.
            self.console.print(message, highlight=False, soft_wrap=True, markup=False)
