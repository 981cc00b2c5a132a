"""Experiment trackers beside metrics.jsonl (output.report_to): TensorBoard, Weights & Biases, MLflow.

One small class per tracker behind one interface (Tracker): `start()` makes its files in output.dir with the run's
first metrics record (start_trackers), `log(step, values)` gets the scalars of every metrics record as metrics.jsonl
gets the record (train and eval alike, under the record's own keys), `close(status)` finishes the tracker's run
however the training run ends. Only rank 0 opens trackers (MetricsWriter lives there).
Each tracker is an optional extra; one that is not installed is refused before anything is written
(check_report_to), never skipped.

A resumed run continues the same W&B and MLflow runs: their ids are kept in output.dir/loggers.json. TensorBoard
appends to output.dir/tensorboard and drops the events past the resumed step. The W&B and MLflow stores in
output.dir (wandb/, mlruns/) may hold several runs: --overwrite keeps them (run_dir.TRACKER_STORES).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

# output.report_to name -> the module it needs (its pip extra has the name of the tracker).
TRACKER_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# The trackers' run ids, so that --resume continues their runs.
RUN_IDS_NAME = "loggers.json"
# The folders the trackers' stores take in output.dir (run_dir.TRACKER_STORES): the one wandb.init(dir=output.dir)
# makes, and MLflow's default file store.
WANDB_STORE = "wandb"
MLFLOW_STORE = "mlruns"
STATUSES = ("finished", "failed", "interrupted")


def check_report_to(report_to: list[str]) -> None:
    """ProfileError with one line per tracker of output.report_to whose package cannot be imported, naming the pip
    extra that installs it."""
    problems = []
    for name in report_to:
        try:
            importlib.import_module(TRACKER_MODULES[name])
        except ImportError:
            problems.append(
                f"output.report_to ({name}): {name} is not installed; install it with pip install 'moe-tune[{name}]' "
                f"or remove {name} from output.report_to"
            )
    if problems:
        raise ProfileError(problems)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The values a tracker plots from a metrics record: every number but `step` under its own key, and each number
    of a list (one per MoE layer) as `key/index`; None, text and booleans are left out."""

    def is_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    values = {}
    for key, value in record.items():
        if key == "step":
            continue
        if is_number(value):
            values[key] = float(value)
        elif isinstance(value, list):
            values.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if is_number(v)})
    return values


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested profile as `section.field` -> text (lists as JSON), for trackers whose parameters are flat."""
    params = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            params.update(flat_params(value, f"{name}."))
        else:
            params[name] = value if isinstance(value, str) else json.dumps(value)
    return params


class Tracker(ABC):
    """One experiment tracker's run. `where` says where it logs (for the start banner), `note` what a resume did."""

    name = ""
    where = ""
    note: str | None = None
    run_id: str | None = None

    def start(self) -> None:
        """Make the tracker's files in output.dir (none by default); called once, before the first log()."""

    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def close(self, status: str) -> None: ...


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, out: Path, resume_step: int):
        self._directory = out / "tensorboard"
        self._resume_step = resume_step
        self._writer = None
        self.where = f"tensorboard --logdir {self._directory}"

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events past the resumed step (written before a crash) are dropped from the plots.
        purge_step = self._resume_step + 1 if self._resume_step else None
        self._writer = SummaryWriter(str(self._directory), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, out: Path, profile: JobProfile, run_name: str, config: dict, run_id: str | None):
        import wandb

        output = profile.output
        self._run = wandb.init(
            project=output.wandb_project,
            name=run_name,
            config=config,
            # WANDB_DIR, when set, wins; else the run's files go to output.dir/wandb.
            dir=None if os.environ.get("WANDB_DIR") else str(out),
            id=run_id,
            resume="allow" if run_id else None,
            # The progress bar's redraws would fill the run's output log.
            settings=wandb.Settings(console="off"),
        )
        self.run_id = self._run.id
        mode = self._run.settings.mode
        self.where = f"W&B project {output.wandb_project}, run {run_name} ({self.run_id}, {mode})"
        if run_id is not None:
            # W&B keeps a step once logged: the steps redone after the checkpoint are dropped with a warning.
            self.note = f"W&B: continuing run {run_id} (steps it already has are not logged again)"

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "finished" else 1)


class MlflowTracker(Tracker):
    name = "mlflow"
    _STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(self, out: Path, profile: JobProfile, run_name: str, config: dict, run_id: str | None):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        output = profile.output
        uri = output.mlflow_tracking_uri or (out / MLFLOW_STORE).resolve().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless asked for; a local store is what report_to: [mlflow] means here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        self.run_id = None
        if run_id is not None:
            try:
                self.run_id = client.get_run(run_id).info.run_id
                client.update_run(run_id, status="RUNNING")
                self.note = f"MLflow: continuing run {run_id} in experiment {output.mlflow_experiment}"
            except MlflowException:
                self.note = f"MLflow: run {run_id} is not in {uri}; a new run starts"
        if self.run_id is None:
            experiment = client.get_experiment_by_name(output.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(output.mlflow_experiment)
            )
            self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            self._log_params(config)
        self.where = f"MLflow {uri}, experiment {output.mlflow_experiment}, run {run_name} ({self.run_id})"

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_params(config).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow stores no inf; a diverged step's loss is kept as NaN (metrics.jsonl has the exact value).
        metrics = [Metric(k, v if math.isfinite(v) else math.nan, now, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, self._STATUS[status])


def open_trackers(profile: JobProfile, resume_step: int) -> list[Tracker]:
    """The trackers of profile.output.report_to, each with a run named output.run_name (default: the profile's
    name) holding the profile as its config. `resume_step` > 0 continues the runs whose ids output.dir/loggers.json
    keeps (a tracker without one starts a new run, with a note). A tracker that cannot start is a ProfileError; the
    ones already started are closed first. Their files in output.dir wait for the first record (start_trackers)."""
    output = profile.output
    out = output.dir
    run_name = output.run_name or profile.name
    config = profile.model_dump(mode="json")
    ids_path = out / RUN_IDS_NAME
    stored = _stored_ids(ids_path) if resume_step > 0 else {}
    trackers: list[Tracker] = []
    try:
        for name in output.report_to:
            if name == "tensorboard":
                tracker: Tracker = TensorBoardTracker(out, resume_step)
            else:
                kind = WandbTracker if name == "wandb" else MlflowTracker
                tracker = kind(out, profile, run_name, config, stored.get(name))
                if resume_step > 0 and name not in stored:
                    tracker.note = f"{name}: no run id in {ids_path}; a new run starts ({tracker.run_id})"
            trackers.append(tracker)
    except Exception as err:
        close_trackers(trackers, "failed")
        if isinstance(err, ProfileError):
            raise
        raise ProfileError(
            [f"output.report_to ({name}): cannot start its run: {type(err).__name__}: {_first_line(err)}"]
        ) from None
    return trackers


def start_trackers(out: Path, trackers: Sequence[Tracker]) -> None:
    """The trackers' files in `out`, made with the run's first metrics record as metrics.jsonl is: each tracker's own
    (TensorBoard's events) and loggers.json with the W&B and MLflow run ids (the ids it holds for other trackers
    kept). A run stopped before its first step leaves none of them (its folder is no previous run:
    run_dir.RUN_RESULTS), and a resumed run stopped there leaves them as it found them. A tracker that cannot start,
    or loggers.json that cannot be written, is a CheckpointWriteError naming it (one line; the run stops)."""
    from .checkpoint import CheckpointWriteError, write_json_atomic

    for tracker in trackers:
        try:
            tracker.start()
        except Exception as err:
            raise CheckpointWriteError(
                f"output.report_to ({tracker.name}): cannot write its files in {out}: {type(err).__name__}: "
                f"{_first_line(err)}; the checkpoints already written are kept"
            ) from None
    ids = {t.name: t.run_id for t in trackers if t.run_id is not None}
    if ids:
        ids_path = out / RUN_IDS_NAME
        try:
            write_json_atomic(ids_path, {**_stored_ids(ids_path), **ids})
        except OSError as err:
            raise CheckpointWriteError(
                f"{ids_path}: cannot write it: {err.strerror or _first_line(err)}; the checkpoints already written "
                "are kept"
            ) from None


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0]


def _stored_ids(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def close_trackers(trackers: list[Tracker], status: str) -> None:
    """Finish every tracker's run (status: finished, failed or interrupted). One that fails to close is a warning:
    it neither keeps the others open nor hides the run's own outcome."""
    assert status in STATUSES, status
    for tracker in trackers:
        try:
            tracker.close(status)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"{tracker.name}: closing its run failed: {type(err).__name__}: {_first_line(err)}")
