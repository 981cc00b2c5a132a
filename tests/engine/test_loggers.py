"""output.report_to: every tracker offline gets the records of metrics.jsonl, the profile, a finished run and the
same run on resume; a tracker not installed is refused in one line naming its extra. Also the start banner,
processed vs trained tokens, and the adapter's model card; a tracker that cannot write stops the run in one line."""

import glob
import json
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.data.dataset import IGNORE_INDEX, Document, collate, pack_rows
from moe_tune.engine.train.banner import start_banner
from moe_tune.engine.train.loggers import RUN_IDS_NAME, check_report_to, open_trackers, scalars
from moe_tune.engine.train.metrics import MetricsWriter, processed_tokens, token_rates
from moe_tune.engine.train.model_card import model_card
from moe_tune.profiles import ProfileError, load_profile

# Two train records (a list per MoE layer, a None grad norm) and an eval record at the second step, as the trainer
# writes them; then the step a resumed run redoes.
RECORDS = [
    {"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": None, "tokens": 512, "tokens_per_s": 100.0,
     "processed_tokens": 600, "processed_tokens_per_s": 117.5, "expert_load_max_over_mean": [1.5, 2.25]},
    {"step": 2, "loss": 5.25, "lr": 2e-3, "grad_norm": 1.5, "tokens": 500, "tokens_per_s": 90.0,
     "processed_tokens": 640, "processed_tokens_per_s": 110.0, "expert_load_max_over_mean": [1.25, 1.75]},
    {"step": 2, "eval_loss": 5.75, "eval_perplexity": 314.2, "eval_tokens": 128},
]  # fmt: skip
# How long the test waits for W&B's service to finish writing an offline run's file.
WANDB_FLUSH_S = 20
RESUMED = {"step": 2, "loss": 5.0, "lr": 2e-3, "grad_norm": 1.0, "tokens": 500, "tokens_per_s": 95.0}


def _profile(tmp_path: Path, *report_to: str, extra: tuple[str, ...] = ()):
    return load_profile("tiny", [f"output.dir={tmp_path / 'run'}", f"output.report_to=[{','.join(report_to)}]",
                                 *extra])  # fmt: skip


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """key -> step -> value, as metrics.jsonl holds them (the last write of a step wins)."""
    series: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in scalars(record).items():
            series.setdefault(key, {})[record["step"]] = value
    return series


def _write(profile, records, resume_step=0, status="finished") -> MetricsWriter:
    profile.output.dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(profile.output.dir / "metrics.jsonl", resume_step, open_trackers(profile, resume_step))
    for record in records:
        writer.write(record)
    writer.close(status)
    return writer


def _jsonl(profile) -> list[dict]:
    return [json.loads(line) for line in (profile.output.dir / "metrics.jsonl").read_text().splitlines()]


def test_scalars_are_the_numbers_of_a_record_lists_by_index():
    values = scalars({"step": 3, "loss": 1.5, "grad_norm": None, "flag": True, "name": "x", "load": [1, 2.5]})
    assert values == {"loss": 1.5, "load/0": 1.0, "load/1": 2.5}


def test_tensorboard_events_equal_metrics_jsonl_and_resume_drops_the_redone_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    profile = _profile(tmp_path, "tensorboard")
    _write(profile, RECORDS)
    _write(profile, [RESUMED], resume_step=1)
    events = EventAccumulator(str(profile.output.dir / "tensorboard"))
    events.Reload()
    expected = _expected(_jsonl(profile))
    assert {tag for tag in events.Tags()["scalars"] if events.Scalars(tag)} == set(expected)
    for key, by_step in expected.items():
        # TensorBoard keeps float32; purge_step dropped the first run's step 2.
        read = {event.step: event.value for event in events.Scalars(key)}
        assert read == pytest.approx(by_step, rel=1e-6), key
    assert _jsonl(profile)[-1] == RESUMED


def _wandb_records(directory: Path) -> list:
    """The records of W&B offline runs under `directory`, each run's in write order."""
    return [record for run in _wandb_runs(directory) for record in run]


def _wandb_runs(directory: Path) -> list[list]:
    """The records of each W&B offline run under `directory` (LevelDB-log framing of .wandb files, read by hand: the
    SDK has no reader), in write order; the runs in their folders' name order, which two starts in one second of
    one run id do not keep."""
    from wandb.proto import wandb_internal_pb2 as pb

    block, header = 32768, 7
    runs = []
    # latest-run is a link to the newest run's folder: each file once.
    found = {str(Path(name).resolve()) for name in glob.glob(str(directory / "**" / "run-*.wandb"), recursive=True)}
    for path in sorted(found):
        records = []
        runs.append(records)
        raw, pos, chunk = Path(path).read_bytes(), header, b""
        while pos + header <= len(raw):
            left = block - pos % block
            if left < header:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos:pos + header])
            pos += header
            if kind == 0 and length == 0:
                pos += left - header
                continue
            chunk += raw[pos:pos + length]
            pos += length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(chunk)
                records.append(record)
                chunk = b""
    return runs


def test_wandb_offline_run_holds_the_records_the_profile_and_continues_on_resume(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    profile = _profile(tmp_path, "wandb", extra=("output.run_name=my-run", "output.wandb_project=proj"))
    first = _write(profile, RECORDS)
    run_id = json.loads((profile.output.dir / RUN_IDS_NAME).read_text())["wandb"]
    assert first.trackers[0].run_id == run_id
    resumed = _write(profile, [{"step": 3, "loss": 4.5}], resume_step=2, status="failed")
    assert resumed.trackers[0].run_id == run_id and "continuing run" in resumed.notes[0]
    records = _wandb_records(tmp_path / "wandb_dir")
    # wandb-core may still be writing the last run's file when finish() returns: its exit record comes last.
    deadline = time.monotonic() + WANDB_FLUSH_S
    while sum(r.WhichOneof("record_type") == "exit" for r in records) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _wandb_records(tmp_path / "wandb_dir")
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    # One offline run folder per start, both with the one run id (`wandb sync` uploads them as one run).
    assert len(glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*"))) == 2
    assert {(r.run_id, r.project, r.display_name) for r in runs} == {(run_id, "proj", "my-run")}
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["train"] == json.loads(json.dumps(profile.model_dump(mode="json")["train"]))
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[r.history.step.num] = value
    assert history == _expected(RECORDS + [{"step": 3, "loss": 4.5}])
    # The first start ended well, the resumed one (the run that logged step 3) as failed.
    ends = sorted(
        (max(r.history.step.num for r in run if r.WhichOneof("record_type") == "history"),
         [r.exit.exit_code for r in run if r.WhichOneof("record_type") == "exit"])
        for run in _wandb_runs(tmp_path / "wandb_dir")
    )  # fmt: skip
    assert [codes for _, codes in ends] == [[0], [1]] and ends[1][0] == 3


def test_mlflow_file_store_holds_the_records_the_params_and_continues_on_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    profile = _profile(tmp_path, "mlflow", extra=("output.mlflow_experiment=exp",))
    _write(profile, RECORDS, status="interrupted")
    run_id = json.loads((profile.output.dir / RUN_IDS_NAME).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(profile.output.dir / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params["train.lr"] == str(profile.train.lr)
    assert json.loads(run.data.params["lora.target_modules"]) == profile.lora.target_modules
    for key, by_step in _expected(RECORDS).items():
        read = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert read == pytest.approx(by_step), key
    resumed = _write(profile, [{"step": 3, "loss": 4.5}], resume_step=2)
    assert resumed.trackers[0].run_id == run_id and "continuing run" in resumed.notes[0]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]


def test_a_resume_without_a_stored_run_id_says_a_new_run_starts(tmp_path):
    profile = _profile(tmp_path, "mlflow")
    writer = _write(profile, [RESUMED], resume_step=1)
    assert writer.notes == [f"mlflow: no run id in {profile.output.dir / RUN_IDS_NAME}; a new run starts "
                            f"({writer.trackers[0].run_id})"]  # fmt: skip


# The module each tracker imports first: None in sys.modules makes importing it raise ImportError.
BLOCKED = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


@pytest.mark.parametrize("missing", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_not_installed_is_one_line_naming_its_extra(missing, monkeypatch):
    monkeypatch.setitem(sys.modules, BLOCKED[missing], None)
    with pytest.raises(ProfileError) as err:
        check_report_to(["tensorboard", "wandb", "mlflow"])
    assert err.value.problems == [
        f"output.report_to ({missing}): {missing} is not installed; install it with pip install "
        f"'moe-tune[{missing}]' or remove {missing} from output.report_to"
    ]
    check_report_to([name for name in BLOCKED if name != missing])


def test_finetune_with_a_missing_tracker_exits_2_before_writing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "tiny", "--set", f"output.dir={out}",
                                      "--set", "output.report_to=[wandb]"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: output.report_to (wandb): wandb is not installed; install it with pip install 'moe-tune[wandb]' or "
        "remove wandb from output.report_to"
    ]
    assert not out.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("output.tensorboard=true", "output.tensorboard (true) was replaced by output.report_to: add tensorboard to "
                                    "output.report_to"),
        ("output.tensorboard=false", "output.tensorboard (false) was replaced by output.report_to: delete it "
                                     "(output.report_to defaults to [])"),
        ("output.report_to=[mlflow,wandb,mlflow]", "output.report_to (mlflow) must name each tracker once"),
        ("output.report_to=[neptune]", "output.report_to.0 ('neptune'): input should be 'tensorboard', 'wandb' or "
                                       "'mlflow'"),
    ],
    ids=["tensorboard-true", "tensorboard-false", "twice", "unknown"],
)
def test_report_to_refusals(override, message):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [override])
    assert err.value.problems == [message]


def test_processed_tokens_count_every_row_position_but_the_padding():
    pad = 2
    # The pad id appears inside documents too (an eos used as padding): only the row's trailing piece is padding.
    docs = [Document([5, 2, 7, 8, 9], [2, 7, IGNORE_INDEX, 9, 2]), Document([4, 2, 6], [2, 6, 2])]
    rows = pack_rows(docs, seq_len=6, pad_id=pad)
    batch = collate(rows)
    # Row 0: document 0 (5 tokens) and the first token of document 1; row 1: its last 2 tokens, then 4 of padding.
    assert batch.input_ids.tolist() == [[5, 2, 7, 8, 9, 4, 2, 6, pad, pad, pad, pad]]
    assert processed_tokens(batch, 6, pad) == 8
    assert batch.num_label_tokens == 7
    full = collate(pack_rows(docs + [Document([3] * 4, [3] * 4)], seq_len=6, pad_id=pad))
    assert processed_tokens(full, 6, pad) == 12


def test_token_rates_show_trained_and_processed():
    assert token_rates({"tokens_per_s": 1234.4, "processed_tokens_per_s": 2345.6}) == "1,234 trained / 2,346 processed"
    assert token_rates({"tokens_per_s": 99.0}) == "99 trained"


class _Summary:
    """Stands in for engine.data.dataset.DataSummary: the banner and the card read its lines()."""

    def lines(self):
        return ["train chat.jsonl: JSONL, sharegpt (first record has conversations): 40 records -> 40 documents",
                "train: 40 documents, 4712 tokens, 1200 trained (25%)"]  # fmt: skip


def test_start_banner_names_folder_devices_layout_data_steps_and_trackers(tmp_path):
    profile = load_profile("tiny", [f"output.dir={tmp_path}", "parallel.expert_parallel=2", "train.precision=bf16"])
    lines = start_banner(profile, tmp_path, torch.device("cpu"), 4, 120, 0, _Summary(), 40, epochs=3,
                         eval_rows=5, trackers=["tensorboard --logdir x"])  # fmt: skip
    text = "\n".join(lines)
    assert lines[0] == f"output:   {tmp_path}"
    assert lines[1].startswith("devices:  4 x cpu (")
    assert lines[2] == ("layout:   world size 4, data-parallel 4, expert-parallel 2 (expert-data-parallel 2), "
                        "ZeRO stage 3, precision bf16")  # fmt: skip
    assert "data:     train chat.jsonl: JSONL, sharegpt" in text and "1200 trained (25%)" in text
    assert "eval:     5 rows of 128 tokens" in text
    assert "steps:    120 (3 epochs), 16 rows of 128 tokens a step" in text
    assert lines[-1] == f"logging:  {tmp_path / 'metrics.jsonl'}, tensorboard --logdir x"
    bare = start_banner(profile.model_copy(update={"train": profile.train.model_copy(update={"micro_batch_size": 1})}),
                        tmp_path, torch.device("cpu"), 1, 10, 4, None, 40, eval_rows=1)
    assert "data:     40 training documents" in bare and "eval:     1 row of 128 tokens" in bare
    assert "steps:    10, 1 row of 128 tokens a step, resuming after step 4" in bare
    without_eval = start_banner(profile, tmp_path, torch.device("cpu"), 1, 10)
    assert not any(line.startswith("eval:") for line in without_eval) and "data:     -" in without_eval


def test_model_card_says_what_was_trained_on_what(tmp_path):
    profile = load_profile("tiny", ["lora.experts=false"])
    result = SimpleNamespace(last_step=30, total_steps=30, epochs=2, losses=[5.0, 2.5], interrupted_by=None,
                             eval_loss=2.75, eval_step=30, best_eval_loss=2.5, best_eval_step=20)  # fmt: skip
    card = model_card(profile, result, _Summary(), date="2026-01-02 03:04 UTC")
    assert card.startswith("---\nlibrary_name: peft\n")
    for line in [
        "Trained with moe-tune 0.1.0 on 2026-01-02 03:04 UTC.",
        "- built from the profile's architecture (random initialisation): 4 layers (linear/moe, sparse/moe), "
        "hidden size 64, vocabulary 259",
        "- rank 16, alpha 32 (scale 2), dropout 0",
        "- routed experts: not adapted (frozen)",
        "- train chat.jsonl: JSONL, sharegpt (first record has conversations): 40 records -> 40 documents",
        "- steps: 30 of 30 (2 epochs)",
        "- batch per rank: 4 rows x 1 accumulation step",
        "- precision: fp32; ZeRO stage 3, expert-parallel 1",
        "- final train loss: 2.5000 (perplexity 12.18)",
        "- eval loss (step 30): 2.7500 (perplexity 15.64)",
        "- best eval loss (step 20): 2.5000 (perplexity 12.18)",
    ]:
        assert line in card.splitlines(), line


def test_model_card_of_a_checkpoint_names_it_and_its_model_type(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    profile = load_profile("tiny", [])
    profile = profile.model_copy(update={"model": profile.model.model_copy(update={"checkpoint": checkpoint})})
    card = model_card(profile, SimpleNamespace(last_step=3, losses=[], interrupted_by="SIGTERM"))
    assert f"base_model: \"{checkpoint}\"" in card.splitlines()
    assert f"- checkpoint: `{checkpoint}` (model_type `qwen3_moe`)" in card.splitlines()
    assert "- steps: 3 of 300, stopped by SIGTERM" in card.splitlines()
    assert "- final train loss: -" in card.splitlines() and "eval loss" not in card


def test_a_tracker_that_cannot_write_stops_the_run_in_one_line_before_metrics_change(tmp_path):
    # TensorBoard's folder taken by a file: the first record stops the run with one line naming the tracker and the
    # folder; a new run leaves no metrics.jsonl, a resumed one its file byte for byte.
    from moe_tune.engine.train.checkpoint import CheckpointWriteError

    profile = _profile(tmp_path, "tensorboard")
    out = profile.output.dir
    out.mkdir(parents=True)
    (out / "tensorboard").write_text("not a folder")
    for resume_step, before in [(0, None), (1, json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n")]:
        if before is not None:
            (out / "metrics.jsonl").write_text(before)
        writer = MetricsWriter(out / "metrics.jsonl", resume_step, open_trackers(profile, resume_step))
        with pytest.raises(CheckpointWriteError) as caught:
            writer.write(RECORDS[0] if resume_step == 0 else RESUMED)
        writer.close("failed")
        message = str(caught.value)
        assert len(message.splitlines()) == 1
        assert message.startswith(f"output.report_to (tensorboard): cannot write its files in {out}: ")
        assert message.endswith("; the checkpoints already written are kept")
        if before is None:
            assert not (out / "metrics.jsonl").exists()
        else:
            assert (out / "metrics.jsonl").read_text() == before


def test_loggers_json_that_cannot_be_written_is_one_line(tmp_path):
    from moe_tune.engine.train.checkpoint import CheckpointWriteError

    profile = _profile(tmp_path, "mlflow")
    out = profile.output.dir
    (out / RUN_IDS_NAME).mkdir(parents=True)  # a folder where loggers.json goes: the rename onto it fails
    writer = MetricsWriter(out / "metrics.jsonl", 0, open_trackers(profile, 0))
    with pytest.raises(CheckpointWriteError) as caught:
        writer.write(RECORDS[0])
    writer.close("failed")
    assert str(caught.value).startswith(f"{out / RUN_IDS_NAME}: cannot write it: ")
    assert len(str(caught.value).splitlines()) == 1
    assert not (out / "metrics.jsonl").exists()


def test_finetune_whose_tracker_cannot_write_exits_2_in_one_line(tmp_path, monkeypatch):
    # The disk filling as TensorBoard's writer starts, at the first step's record.
    import errno

    from moe_tune.engine.train import loggers

    def no_space(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loggers.TensorBoardTracker, "start", no_space)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "tiny", "--set", f"output.dir={out}", "--set",
                                      "output.report_to=[tensorboard]", "--set", "train.steps=2", "--set",
                                      "train.warmup_steps=1"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: output.report_to (tensorboard): cannot write its files in {out}: OSError: [Errno 28] No space left "
        "on device; the checkpoints already written are kept"
    ]
    assert not (out / "metrics.jsonl").exists()
