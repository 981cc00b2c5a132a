"""`moe-tune finetune` guards its output.dir (one run at a time, no mixing with a previous run), stops on non-finite
weights with exit 1, and prints a resume command that resumes the same run."""

import json
import math
import os
import shlex
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moe_tune.engine.train.trainer as trainer
from moe_tune.cli import app
from moe_tune.cli.finetune import resume_command
from moe_tune.engine.train.checkpoint import complete_checkpoints
from moe_tune.engine.train.run_dir import LOCK_NAME, previous_run_outputs

runner = CliRunner()
SMALL = ["data.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=0", "data.corpus_documents=200"]


def finetune_args(out, *extra):
    return ["finetune", "tiny", "--quiet", *[a for o in [*SMALL, f"output.dir={out}", *extra] for a in ("--set", o)]]


def errors(result):
    assert "Traceback" not in result.output
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def test_resume_with_overwrite_is_refused(tmp_path):
    result = runner.invoke(app, [*finetune_args(tmp_path / "out"), "--resume", "--overwrite"])
    assert result.exit_code == 2
    assert errors(result) == ["error: --resume and --overwrite contradict each other: --resume continues the run in "
                              "output.dir, --overwrite deletes it; give one"]  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("data", ['{"text": "a"}\n{"text": "b"\n', '{"text": ""}\n'], ids=["broken", "no-token"])
def test_overwrite_refused_for_its_data_leaves_the_previous_run(tmp_path, data):
    """--overwrite removes the previous run only once the new one has read its data and built its model: a data
    file refused (a broken line, nothing to train on) is one line, exit 2, and the previous run is left byte for byte."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step-0000002").mkdir(parents=True)
    (out / "checkpoints" / "step-0000002" / "model_states.pt").write_bytes(b"weights")
    for name in ("metrics.jsonl", "summary.json", "profile.yaml", "deepspeed_config.json"):
        (out / name).write_text(f"old {name}")
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    (tmp_path / "data.jsonl").write_text(data)
    result = runner.invoke(app, [*finetune_args(out, f"data.path={tmp_path / 'data.jsonl'}"), "--overwrite"])
    assert result.exit_code == 2, result.output
    assert len(errors(result)) == 1
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(["checkpoints", "metrics.jsonl", "summary.json",
                                                            "profile.yaml", "deepspeed_config.json"])


@pytest.mark.parametrize("name", ["profile.yaml", "deepspeed_config.json", "checkpoints/p.yaml", "adapter/p.yaml"])
def test_a_profile_kept_where_a_fresh_run_writes_is_refused_and_kept(tmp_path, name):
    # The run writes its resolved profile.yaml and its settings into output.dir: a PROFILE there would be replaced.
    out = tmp_path / "run"
    profile = out / name
    profile.parent.mkdir(parents=True)
    text = "# my notes\n" + (Path(__file__).parents[2] / "profiles" / "tiny.yaml").read_text()
    profile.write_text(text)
    args = ["finetune", str(profile), "--quiet", *[a for o in [*SMALL, f"output.dir={out}"] for a in ("--set", o)]]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert errors(result) == [f"error: PROFILE ({str(profile)!r}) lies where the run writes "
                              f"({str(out.resolve() / name.split('/')[0])!r}, in output.dir): its outputs and "
                              "--overwrite would replace what it reads; set output.dir to another folder"]  # fmt: skip
    assert profile.read_text() == text and sorted(p.name for p in out.iterdir()) == [name.split("/")[0]]
    validated = runner.invoke(app, ["validate", str(profile), "--no-data", "--set", f"output.dir={out}"])
    assert validated.exit_code == 2 and "PROFILE (" in validated.stderr


def test_a_profile_beside_the_run_files_is_read_and_left_alone(tmp_path):
    # Another name in output.dir: nothing the run writes.
    out = tmp_path / "run"
    out.mkdir()
    profile = out / "my-profile.yaml"
    profile.write_text((Path(__file__).parents[2] / "profiles" / "tiny.yaml").read_text())
    result = runner.invoke(app, ["validate", str(profile), "--no-data", "--set", f"output.dir={out}"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("case", ["a file", "locked by a live run", "a previous run", "read by an export"])
def test_an_unusable_output_dir_is_one_line_exit_2_before_anything_is_written(tmp_path, case):
    out = tmp_path / "out"
    if case == "read by an export":
        # An export of the previous run reads it: --overwrite would delete what it reads.
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        mark = out / f"{LOCK_NAME}.reader-{socket.gethostname()}-{os.getpid()}-0123"
        mark.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "t",
                                    "reader": "export"}))  # fmt: skip
        expected = (f"error: output.dir ({out}) is being read by moe-tune export: pid {os.getpid()} on host "
                    f"{socket.gethostname()}, started t ({mark}); a run would replace what it reads: start the run "
                    "once it has ended")  # fmt: skip
    elif case == "a file":
        out.write_text("keep")
        expected = f"error: output.dir ({out}) is a file: output.dir must be a directory (or a path to create)"
    elif case == "locked by a live run":
        out.mkdir()
        (out / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "t"}))
        expected = (f"error: output.dir ({out}) is in use by another run: pid {os.getpid()} on host "
                    f"{socket.gethostname()}, started t ({out / LOCK_NAME}); one run per output.dir")  # fmt: skip
    else:
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        (out / "checkpoints").mkdir()
        expected = (f"error: output.dir ({out}) holds a previous run (metrics.jsonl, checkpoints): continue it with "
                    "--resume, replace its outputs with --overwrite, or choose another output.dir")  # fmt: skip
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    # One step: a refusal that failed would train it and fail this test quickly.
    overwrite = ["--overwrite"] if case == "read by an export" else []
    result = runner.invoke(app, [*finetune_args(out, "train.steps=1"), *overwrite])
    assert result.exit_code == 2, result.output
    assert errors(result) == [expected]
    # Nothing was written: no generated corpus, no profile, the lock and the previous run untouched.
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_output_dir_on_the_base_checkpoint_is_refused_and_its_weights_stay(tmp_path, overwrite):
    """output.dir naming model.checkpoint's folder: one line naming the checkpoint, exit 2, its weights untouched
    (--overwrite would delete its model.safetensors as a previous run's)."""
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "checkpoint")
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} about tiny checkpoints"}) + "\n" for i in range(8)))
    sets = [f"model={{checkpoint: {checkpoint}}}", "data.tokenizer=byte", f"data.path={data}", "data.seq_len=32",
            "train.steps=1", "train.warmup_steps=0", "lora.modules_to_save=[]", "lora.target_modules=[q_proj, k_proj]",
            f"output.dir={checkpoint}"]  # fmt: skip
    args = ["finetune", "tiny", "--quiet", *[a for o in sets for a in ("--set", o)], *["--overwrite"] * overwrite]
    expected = [f"error: model.checkpoint ({str(checkpoint)!r}) lies where the run writes ({str(checkpoint)!r}, in "
                "output.dir): its outputs and --overwrite would replace what it reads; set output.dir to another "
                "folder"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert errors(result) == expected
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    # validate says what finetune would refuse.
    result = runner.invoke(app, ["validate", *[a for a in args[1:] if a not in ("--quiet", "--overwrite")]])
    assert result.exit_code == 2 and errors(result) == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("stage", [3, 1])
def test_a_checkpoint_with_non_finite_weights_is_named_not_the_learning_rate(tmp_path, monkeypatch, bad, stage):
    """A checkpoint tensor holding NaN or inf makes the first step's loss non-finite: the line names the weight and
    the checkpoint (exit 2), where it said 'lower train.lr'; under ZeRO-3 each rank looks at its partition."""
    import io
    import logging

    import deepspeed  # noqa: F401 - its logger exists from here on
    import torch
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

    # DeepSpeed's overflow warning goes to the stream its handler took at import (an earlier CliRunner's, closed).
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", io.StringIO())

    model = tiny_qwen3_moe()
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = bad
    checkpoint = save_tiny_checkpoint(model, tmp_path / "checkpoint")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} about tiny checkpoints"}) + "\n" for i in range(8)))
    result = runner.invoke(app, ["finetune", "tiny", "--quiet", *[a for o in [
        f"model={{checkpoint: {checkpoint}}}", "data.tokenizer=byte", f"data.path={data}", "data.seq_len=32",
        "train.steps=2", "train.warmup_steps=0", "lora.modules_to_save=[]", "lora.target_modules=[q_proj, k_proj]",
        f"parallel.zero_stage={stage}",
        f"output.dir={tmp_path / 'out'}"] for a in ("--set", o)]])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert errors(result) == [f"error: model.checkpoint ({str(checkpoint)!r}): weight layers.1.self_attn.k_proj.weight "
                              "holds NaN or inf values before the first step: training stopped, nothing saved"]
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_start_weights_look_at_frozen_weights_only():
    """A NaN in a trained weight after the first step is the step's doing (its update), not the checkpoint's."""
    import types

    import torch
    from torch import nn

    from moe_tune.profiles import ProfileError, load_profile

    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[0].weight.requires_grad_(False)
    with torch.no_grad():
        module[1].weight[0, 0] = float("nan")
    profile, dist = load_profile("tiny"), types.SimpleNamespace(device=torch.device("cpu"))
    trainer.check_start_weights(module, profile, dist)
    with torch.no_grad():
        module[0].weight[1, 1] = float("-inf")
    with pytest.raises(ProfileError) as refusal:
        trainer.check_start_weights(module, profile, dist)
    assert refusal.value.problems == ["the initial weights: weight 0.weight holds NaN or inf values before the first "
                                      "step: training stopped, nothing saved"]  # fmt: skip


def test_a_second_signal_stops_at_once_without_saving(monkeypatch):
    """The first SIGINT/SIGTERM asks for a checkpoint after the step; a second one does not wait for the step
    (a step that never ends, say): KeyboardInterrupt from StopSignal, handlers restored."""
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    with trainer.StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match=r"^SIGTERM, then SIGINT$"):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGTERM) is previous


def write_step(out, step: int, complete: bool) -> None:
    """checkpoints/step-N in `out`: complete (its trainer state written), or a folder a crash left without one."""
    folder = out / "checkpoints" / f"step-{step:07d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))


KEPT = "the complete checkpoints in {out} are kept (--resume continues from the newest)"
# What the folder holds when the interrupt comes, and what the line says the next run finds there.
INTERRUPTED_FOLDERS = {
    "nothing": ([], "no checkpoint was written in {out}, so the next run starts over"),
    "metrics-and-a-torn-checkpoint": ([("metrics", 3), ("step", 2, False)], "{out} holds no complete checkpoint, so "
                                      "the next run starts over, with --overwrite (which replaces metrics.jsonl, "
                                      "checkpoints)"),
    "a-complete-checkpoint": ([("metrics", 3), ("step", 2, True)], KEPT),
    "a-complete-and-a-newer-torn-one": ([("metrics", 5), ("step", 2, True), ("step", 4, False)], KEPT),
}


@pytest.mark.parametrize("folder", list(INTERRUPTED_FOLDERS))
def test_an_interrupted_run_is_one_line_and_exit_130(tmp_path, monkeypatch, folder):
    out = tmp_path / "out"
    written, expected = INTERRUPTED_FOLDERS[folder]

    def interrupted(*args, **kwargs):
        # What the run wrote before the interrupt.
        for kind, step, *complete in written:
            out.mkdir(exist_ok=True)
            if kind == "metrics":
                (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1)))
            else:
                write_step(out, step, *complete)
        raise KeyboardInterrupt("SIGINT, then SIGINT")

    monkeypatch.setattr(trainer, "finetune", interrupted)
    result = runner.invoke(app, finetune_args(out))
    assert result.exit_code == 130
    assert errors(result) == ["error: interrupted (SIGINT, then SIGINT): stopped without saving the step in progress; "
                              + expected.format(out=out)]  # fmt: skip


# How a run can end in its first step, before any record: a second signal (the first waits for the step), an error.
FIRST_STEP_ENDINGS = {"second-signal": (KeyboardInterrupt("SIGINT, then SIGINT"), 130),
                      "error": (RuntimeError("the step failed"), 1)}


@pytest.mark.parametrize("resume", [False, True], ids=["new-run", "resumed-run"])
@pytest.mark.parametrize("ending", list(FIRST_STEP_ENDINGS))
def test_a_run_that_ends_before_its_first_step_is_not_a_previous_run(tmp_path, monkeypatch, ending, resume):
    """A new run stopped in its first step leaves no metrics.jsonl, so the folder takes the next run without --resume
    or --overwrite; a resumed run stopped there leaves the metrics it found byte for byte (a torn last line
    included, which the next --resume drops)."""
    out = tmp_path / "out"
    if resume:
        assert runner.invoke(app, finetune_args(out, "train.steps=1")).exit_code == 0
        with (out / "metrics.jsonl").open("a") as metrics:
            metrics.write('{"step": 2, "lo')
    found = (out / "metrics.jsonl").read_bytes() if resume else None
    error, code = FIRST_STEP_ENDINGS[ending]

    def first_step(*args, **kwargs):
        raise error

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "launch_step", first_step)
        stopped = runner.invoke(app, [*finetune_args(out, "train.steps=2"), *["--resume"] * resume])
    assert stopped.exit_code == code, stopped.output
    if ending == "second-signal":
        said = KEPT if resume else INTERRUPTED_FOLDERS["nothing"][1]
        assert errors(stopped) == ["error: interrupted (SIGINT, then SIGINT): stopped without saving the step in "
                                   f"progress; {said.format(out=out)}"]  # fmt: skip
    assert not (out / LOCK_NAME).exists()
    if resume:
        assert (out / "metrics.jsonl").read_bytes() == found
    else:
        assert not (out / "metrics.jsonl").exists() and previous_run_outputs(out) == []
    again = runner.invoke(app, [*finetune_args(out, "train.steps=2"), *["--resume"] * resume])
    assert again.exit_code == 0, again.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


# Each tracker's result in output.dir (run_dir.RUN_RESULTS): TensorBoard's events folder; the run ids W&B and MLflow
# keep for --resume.
TRACKER_RESULTS = {"tensorboard": "tensorboard", "mlflow": "loggers.json"}


def tracker_files(out) -> dict[str, bytes]:
    """Every file of the trackers' results in `out`, by path, with its bytes."""
    files = {}
    for name in TRACKER_RESULTS.values():
        for path in [out / name, *((out / name).rglob("*") if (out / name).is_dir() else [])]:
            if path.is_file():
                files[str(path.relative_to(out))] = path.read_bytes()
    return files


@pytest.mark.parametrize("resume", [False, True], ids=["new-run", "resumed-run"])
@pytest.mark.parametrize("tracker", list(TRACKER_RESULTS))
def test_a_run_with_trackers_that_ends_before_its_first_step_is_not_a_previous_run(tmp_path, monkeypatch, tracker,
                                                                                   resume):
    """output.report_to's files start with the first record, as metrics.jsonl does: a new run stopped in its first
    step leaves none (the folder takes the next run without --resume or --overwrite), a resumed one leaves them as
    it found them; a run that trained leaves them, and its folder is a previous run."""
    out = tmp_path / "out"
    report_to = f"output.report_to=[{tracker}]"
    if resume:
        assert runner.invoke(app, finetune_args(out, "train.steps=1", report_to)).exit_code == 0
        assert TRACKER_RESULTS[tracker] in previous_run_outputs(out)
    found = tracker_files(out)

    def first_step(*args, **kwargs):
        raise RuntimeError("the step failed")

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "launch_step", first_step)
        stopped = runner.invoke(app, [*finetune_args(out, "train.steps=2", report_to), *["--resume"] * resume])
    assert stopped.exit_code == 1, stopped.output
    assert tracker_files(out) == found
    if not resume:
        assert found == {} and previous_run_outputs(out) == []
    again = runner.invoke(app, [*finetune_args(out, "train.steps=2", report_to), *["--resume"] * resume])
    assert again.exit_code == 0, again.output
    assert {"metrics.jsonl", TRACKER_RESULTS[tracker]} <= set(previous_run_outputs(out))
    results = ", ".join(previous_run_outputs(out))
    refused = runner.invoke(app, finetune_args(out, "train.steps=2", report_to))
    assert refused.exit_code == 2, refused.output
    assert errors(refused) == [f"error: output.dir ({out}) holds a previous run ({results}): continue it with "
                               "--resume, replace its outputs with --overwrite, or choose another output.dir"]


def test_overwrite_replaces_the_previous_run_and_lr_inf_exits_1_before_saving(tmp_path, monkeypatch):
    # lr=inf gives a finite loss and gradient norm at step 1 and non-finite weights after it. It is set past the
    # schema (whose bounds on train.lr are not what this tests) where the command reads the profile.
    import moe_tune.cli.finetune as command

    read_profile = command.read_profile

    def with_lr_inf(path, overrides):
        job = read_profile(path, overrides)
        return job.model_copy(update={"train": job.train.model_copy(update={"lr": float("inf")})})

    monkeypatch.setattr(command, "read_profile", with_lr_inf)
    out = tmp_path / "out"
    (out / "checkpoints" / "step-0000009").mkdir(parents=True)
    (out / "checkpoints" / "step-0000009" / "trainer_state.json").write_text('{"step": 9}')
    (out / "metrics.jsonl").write_text('{"step": 9}\n')
    (out / "my-notes.txt").write_text("mine")
    result = runner.invoke(app, [*finetune_args(out, "train.steps=2", "output.save_every=1"), "--overwrite"])
    assert result.exit_code == 1, result.output
    # The old run's step 9 is gone, and is not named as intact.
    (line,) = errors(result)
    assert line.startswith("error: step 1: parameter ")
    assert line.endswith("is not finite after the optimizer step (loss and gradient norm were): training stopped "
                         "before saving it (no checkpoint was written); lower train.lr")  # fmt: skip
    assert complete_checkpoints(out / "checkpoints") == []
    (record,) = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
    assert (out / "my-notes.txt").read_text() == "mine" and not (out / LOCK_NAME).exists()


OVERRIDES = ["train.lr=2e-3", "lora.target_modules=[q_proj, v_proj]", "name=it's a \"run\"", "data.seed=$HOME"]


@pytest.mark.parametrize("world_size", [1, 4])
def test_resume_command_quotes_every_override(world_size):
    command = resume_command("my profile.yaml", OVERRIDES, quiet=True, world_size=world_size)
    words = ["moe-tune", "finetune", "my profile.yaml", *[w for o in OVERRIDES for w in ("--set", o)], "--resume",
             "--quiet", *(["--nproc", "4"] if world_size > 1 else [])]  # fmt: skip
    assert shlex.split(command) == words
    assert resume_command("tiny", None, quiet=False, world_size=1) == "moe-tune finetune tiny --resume"


def test_the_printed_resume_command_resumes_the_same_run(tmp_path, monkeypatch):
    overrides = [*OVERRIDES[:3], f"output.dir={tmp_path / 'a run'}"]
    runs = []

    def fake_finetune(job, resume=False, overwrite=False, **kwargs):
        runs.append((job, resume))
        return trainer.RunResult(output_dir=job.output.dir, start_step=0, last_step=2, losses=[2.0, 1.5],
                                 interrupted_by="SIGINT")  # fmt: skip

    monkeypatch.setattr(trainer, "finetune", fake_finetune)
    monkeypatch.setenv("WORLD_SIZE", "1")
    first = runner.invoke(app, ["finetune", "tiny", *[a for o in overrides for a in ("--set", o)]])
    assert first.exit_code == 130, first.output
    (hint,) = [line.split("resume with: ", 1)[1] for line in first.stdout.splitlines() if "resume with: " in line]
    words = shlex.split(hint)
    assert words[:2] == ["moe-tune", "finetune"]
    second = runner.invoke(app, words[1:])
    assert second.exit_code == 130, second.output
    (job, resume), (again, resumed) = runs
    assert (resume, resumed) == (False, True)
    assert again == job and again.name == "it's a \"run\"" and again.lora.target_modules == ["q_proj", "v_proj"]
