"""Checkpoints under faults: a manifest verified on resume (the newest checkpoint that verifies and loads is taken,
each skipped one named with its reason), a checkpoint of another architecture or layout refused naming the fields,
pickled objects refused and never run, a full disk that keeps the previous checkpoint, a torn metrics line; and the
fault test: kill -9 during checkpoint writes and truncated files, then --resume, against an uninterrupted run."""

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.train import checkpoint as ckpt
from moe_tune.engine.train.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointWriteError,
    checkpoint_dirs,
    checkpoint_name,
    resume_checkpoint,
    run_signature,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from moe_tune.engine.train.metrics import MetricsWriter, kept_metrics_lines
from moe_tune.profiles import ProfileError, load_profile

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
TINY_SIGNATURE = run_signature(load_profile("tiny", []), 1)


class FakeEngine:
    """DeepSpeed's engine as save_checkpoint and resume_checkpoint use it, writing files named as ZeRO does; loading
    goes through `checkpoint_engine.load` as DeepSpeed's does."""

    device = "cpu"

    def __init__(self, load_error: BaseException | None = None):
        self.checkpoint_engine = SimpleNamespace(load=None)
        self.loaded: list[str] = []
        self.load_error = load_error
        self.attempts = 0

    def save_checkpoint(self, save_dir, tag, save_latest):
        folder = Path(save_dir) / tag
        folder.mkdir()
        torch.save({"module": torch.arange(64.0)}, folder / MODEL_FILE)
        torch.save({"optimizer_state_dict": torch.ones(32)}, folder / OPTIM_FILE)

    def load_checkpoint(self, load_dir, tag):
        self.attempts += 1
        if self.load_error is not None and self.attempts == 1:
            raise self.load_error
        for path in sorted((Path(load_dir) / tag).glob("*.pt")):
            self.checkpoint_engine.load(str(path))
        self.loaded.append(tag)
        return str(Path(load_dir) / tag), {}


def trainer_state(step: int, signature=TINY_SIGNATURE) -> dict:
    return {"step": step, "torch_rng": torch.get_rng_state().tolist(), "selection_bias": [[0.0, 0.1]],
            "signature": signature}  # fmt: skip


def save_steps(root: Path, steps, engine=None, keep_last: int = 10, signature=TINY_SIGNATURE) -> FakeEngine:
    engine = engine or FakeEngine()
    for step in steps:
        save_checkpoint(engine, root, step, trainer_state(step, signature), keep_last, is_main=True)
    return engine


def rewrite_manifest(folder: Path) -> None:
    """A damaged file made to verify: what a careless copy (or an attacker) would leave."""
    (folder / MANIFEST_FILE).unlink()
    write_manifest(folder)


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_state(change):
    def damage(folder: Path) -> None:
        state = json.loads((folder / STATE_FILE).read_text())
        (folder / STATE_FILE).write_text(json.dumps(change(state)))
        rewrite_manifest(folder)

    return damage


def replace_state_text(text: str):
    def damage(folder: Path) -> None:
        (folder / STATE_FILE).write_text(text)
        rewrite_manifest(folder)

    return damage


def manifest_text(text: str):
    return lambda folder: (folder / MANIFEST_FILE).write_text(text)


def test_save_writes_a_manifest_of_every_file_and_leaves_no_temporary(tmp_path):
    save_steps(tmp_path, [1])
    folder = tmp_path / checkpoint_name(1)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert set(listed) == {MODEL_FILE, OPTIM_FILE, STATE_FILE}
    for name, entry in listed.items():
        assert entry["size"] == (folder / name).stat().st_size and len(entry["sha256"]) == 64
    assert json.loads((folder / STATE_FILE).read_text())["format"] == ckpt.STATE_FORMAT
    assert verify_checkpoint(folder).problem is None
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint_name(1)]


SIZE_RULE = r"is \d+ bytes, the manifest says \d+"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: truncate(f / MODEL_FILE), rf"{MODEL_FILE} {SIZE_RULE}"),
        (lambda f: truncate(f / OPTIM_FILE), rf"{OPTIM_FILE} {SIZE_RULE}"),
        (lambda f: truncate(f / STATE_FILE), rf"{STATE_FILE} {SIZE_RULE}"),
        (lambda f: truncate(f / MANIFEST_FILE), rf"{MANIFEST_FILE} is not valid JSON \(line \d+ column \d+: .*\)"),
        (lambda f: (f / MODEL_FILE).write_bytes(b""), rf"{MODEL_FILE} {SIZE_RULE}"),  # emptied
        (lambda f: (f / OPTIM_FILE).unlink(), rf"{OPTIM_FILE} is missing"),  # a missing shard
        (lambda f: flip_a_byte(f / MODEL_FILE), rf"{MODEL_FILE} does not match its sha256 in the manifest"),
        (lambda f: flip_a_byte(f / STATE_FILE), rf"{STATE_FILE} does not match its sha256 in the manifest"),
        (lambda f: (f / MANIFEST_FILE).unlink(), rf"{MANIFEST_FILE} is missing"),  # its state says it had one
        (lambda f: [(f / n).unlink() for n in (MANIFEST_FILE, STATE_FILE)], rf"{STATE_FILE} is missing"),
        (lambda f: [p.unlink() for p in f.iterdir()], rf"{STATE_FILE} is missing"),  # an empty step folder
        (manifest_text('{"files": "all of them"}'),
         rf"{MANIFEST_FILE} does not list files as \{{path, size, sha256\}}"),
        (manifest_text('{"files": []}'), rf"{MANIFEST_FILE} does not list files"),
        (manifest_text("[1, 2]"), rf"{MANIFEST_FILE} does not list files"),
        (manifest_text('{"files": [{"path": "../../x", "size": 1, "sha256": "0"}]}'),
         rf"{MANIFEST_FILE} names '../../x', outside the checkpoint"),
        (manifest_text('{"files": [{"path": "/etc/passwd", "size": 1, "sha256": "0"}]}'),
         rf"{MANIFEST_FILE} names '/etc/passwd', outside the checkpoint"),
        (replace_state_text("{not json"), rf"{STATE_FILE} is not valid JSON \(line 1 column 2: .*\)"),
        (replace_state_text("[]"), rf"{STATE_FILE} holds a list, not an object"),
        (edit_state(lambda s: {k: v for k, v in s.items() if k != "step"}), rf"{STATE_FILE}: 'step' is None, not an"),
        (edit_state(lambda s: {**s, "step": "2"}), rf"{STATE_FILE}: 'step' is '2', not an integer"),
        (edit_state(lambda s: {**s, "step": 7}), rf"{STATE_FILE}: 'step' is 7, the folder's name says 2"),
        (edit_state(lambda s: {**s, "torch_rng": "abc"}), rf"{STATE_FILE}: 'torch_rng' is missing or not a list"),
        (edit_state(lambda s: {**s, "torch_rng": [300]}), rf"{STATE_FILE}: 'torch_rng' is missing or not a list"),
        (edit_state(lambda s: {**s, "torch_rng": [1, 2]}),
         rf"{STATE_FILE}: 'torch_rng' holds 2 bytes, torch's CPU generator state has \d+"),
        (edit_state(lambda s: {**s, "selection_bias": [["a"]]}), rf"{STATE_FILE}: 'selection_bias' is not a list"),
        (edit_state(lambda s: {**s, "selection_bias": {"a": 1}}), rf"{STATE_FILE}: 'selection_bias' is not a list"),
    ],
    ids=["trunc-model", "trunc-optim", "trunc-state", "trunc-manifest", "empty-model", "missing-shard",
         "flipped-model", "flipped-state", "no-manifest", "no-state", "empty-dir", "manifest-files-str",
         "manifest-empty", "manifest-list", "manifest-escape", "manifest-absolute", "state-not-json",
         "state-list", "state-no-step", "state-step-str", "state-step-other", "state-rng-str", "state-rng-range",
         "state-rng-length", "state-bias-str", "state-bias-dict"],  # fmt: skip
)
def test_resume_skips_a_damaged_newest_checkpoint_naming_why(tmp_path, damage, reason):
    engine = save_steps(tmp_path, [1, 2])
    newest = tmp_path / checkpoint_name(2)
    damage(newest)
    path, state, lines = resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert path == tmp_path / checkpoint_name(1) and state["step"] == 1
    assert engine.loaded == [checkpoint_name(1)]
    assert len(lines) == 1
    assert re.fullmatch(rf"skipped {re.escape(str(newest))}: {reason}.*", lines[0]), lines[0]


def test_selection_biases_that_do_not_fit_the_model_are_skipped(tmp_path):
    engine = save_steps(tmp_path, [1])
    save_checkpoint(engine, tmp_path, 2, {**trainer_state(2), "selection_bias": [[0.0] * 3]}, 10, is_main=True)
    path, _, lines = resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu", bias_sizes=[2])
    assert path.name == checkpoint_name(1)
    assert lines == [f"skipped {tmp_path / checkpoint_name(2)}: {STATE_FILE}: 'selection_bias' has sizes [3], the "
                     "model's MoE layers [2]"]  # fmt: skip


def test_when_no_checkpoint_verifies_each_is_listed_with_its_reason(tmp_path):
    engine = save_steps(tmp_path, [1, 2])
    truncate(tmp_path / checkpoint_name(2) / MODEL_FILE)
    (tmp_path / checkpoint_name(1) / OPTIM_FILE).unlink()
    with pytest.raises(ProfileError) as err:
        resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert err.value.problems == [
        f"--resume: no checkpoint under {tmp_path} verifies and loads",
        f"--resume: {tmp_path / checkpoint_name(2)}: {MODEL_FILE} is "
        f"{(tmp_path / checkpoint_name(2) / MODEL_FILE).stat().st_size} bytes, the manifest says "
        f"{(tmp_path / checkpoint_name(1) / MODEL_FILE).stat().st_size}",
        f"--resume: {tmp_path / checkpoint_name(1)}: {OPTIM_FILE} is missing",
    ]
    assert engine.loaded == []


@pytest.mark.parametrize("content", ["nothing", "temporaries only", "other names"])
def test_resume_without_any_checkpoint_is_one_line(tmp_path, content):
    root = tmp_path / "checkpoints"
    if content == "temporaries only":
        (root / ".incomplete-step-0000001").mkdir(parents=True)
    elif content == "other names":
        for name in ("step-x", "step-", "notes"):
            (root / name).mkdir(parents=True)
    with pytest.raises(ProfileError, match=rf"^--resume: no checkpoint under {re.escape(str(root))}$"):
        resume_checkpoint(FakeEngine(), root, TINY_SIGNATURE, "cpu")


def test_a_checkpoint_from_before_manifests_loads_unverified_with_a_note(tmp_path):
    folder = tmp_path / checkpoint_name(3)
    folder.mkdir()
    torch.save({"module": torch.zeros(2)}, folder / MODEL_FILE)
    (folder / STATE_FILE).write_text(json.dumps({k: v for k, v in trainer_state(3).items() if k != "signature"}))
    engine = FakeEngine()
    path, state, lines = resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert path == folder and state["step"] == 3
    assert lines == [f"{folder} has no {MANIFEST_FILE} (written before manifests): loaded unverified"]


@pytest.mark.parametrize(
    "error, reason",
    [
        (RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory\nmore"),
         r"DeepSpeed could not load it \(RuntimeError: PytorchStreamReader failed reading zip archive: failed "
         r"finding central directory\)"),
        (KeyError("optimizer"), r"DeepSpeed could not load it \(KeyError: 'optimizer'\)"),
        (EOFError("Ran out of input"), r"DeepSpeed could not load it \(EOFError: Ran out of input\)"),
        (pickle.UnpicklingError("Weights only load failed. In PyTorch 2.6 ...\n\nTrying to load unsupported GLOBAL "
                                "posix.system whose module posix is blocked.\n\nCheck the documentation"),
         r"refused: a file holds pickled objects other than tensor data \(UnpicklingError: Trying to load "
         r"unsupported GLOBAL posix.system whose module posix is blocked.\)"),
        (ValueError("x" * 500), r"DeepSpeed could not load it \(ValueError: x{197}\.\.\.\)"),
    ],
    ids=["truncated-zip", "missing-key", "eof", "pickle", "long"],
)
def test_a_load_error_becomes_one_line_and_the_previous_checkpoint_is_taken(tmp_path, error, reason):
    engine = save_steps(tmp_path, [1, 2], engine=FakeEngine(load_error=error))
    path, _, lines = resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert path.name == checkpoint_name(1)
    assert len(lines) == 1 and re.fullmatch(rf"skipped {re.escape(str(tmp_path / checkpoint_name(2)))}: {reason}",
                                            lines[0]), lines  # fmt: skip


class Payload:
    """Creates a marker file when unpickled: code execution, if it ever runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("file", [MODEL_FILE, OPTIM_FILE])
@pytest.mark.parametrize("where", ["top level", "nested in the state"])
def test_a_pickle_payload_in_a_checkpoint_is_refused_and_never_run(tmp_path, file, where):
    root, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    engine = save_steps(root, [1, 2])
    newest = root / checkpoint_name(2)
    payload = Payload(marker) if where == "top level" else {"module": {"w": torch.ones(2), "x": [Payload(marker)]}}
    torch.save(payload, newest / file)
    rewrite_manifest(newest)  # the manifest is no defence against someone who can write the folder
    path, _, lines = resume_checkpoint(engine, root, TINY_SIGNATURE, "cpu")
    assert not marker.exists()
    assert path.name == checkpoint_name(1)
    assert re.fullmatch(r"skipped .*step-0000002: refused: a file holds pickled objects other than tensor data "
                        r"\(UnpicklingError: .*GLOBAL.*\)", lines[0]), lines  # fmt: skip
    # With nothing to fall back to, the refusal is the error.
    shutil.rmtree(root / checkpoint_name(1))
    with pytest.raises(ProfileError, match=r"step-0000002: refused: a file holds pickled objects"):
        resume_checkpoint(FakeEngine(), root, TINY_SIGNATURE, "cpu")
    assert not marker.exists()


@pytest.mark.parametrize(
    "overrides, world_size, lines",
    [
        (["model.hidden_size=32"], 1, ["model.hidden_size 64, the profile says 32"]),
        (["model.moe.num_experts=4", "model.moe.top_k=1"], 1,
         ["model.moe.num_experts 8, the profile says 4", "model.moe.top_k 2, the profile says 1"]),
        (["model.layers=[{attention: linear, mlp: moe}]"], 1,
         ["model.layers.length 4, the profile says 1", "model.layers[1].attention \"linear\", the profile says "
          "(not set)"]),
        (["model.layers=[{attention: linear, mlp: moe}, {attention: linear, mlp: moe}, {attention: linear, mlp: "
          "moe}, {attention: full, mlp: moe}]"], 1,
         ['model.layers[3].attention "sparse", the profile says "full"']),
        (["lora.r=8"], 1, ["lora.r 16, the profile says 8"]),
        # Long values are shortened to 80 characters.
        (["lora.target_modules=[q_proj]"], 1, ['lora.target_modules ["q_proj", "k_proj", "v_proj", "o_proj", '
                                               '"z_proj", "gate_proj", "up_proj", "d..., the profile says '
                                               '["q_proj"]']),
        (["lora.enabled=false"], 1, ["lora.enabled true, the profile says false"]),
        (["parallel.zero_stage=1"], 1, ["parallel.zero_stage 3, the profile says 1"]),
        (["parallel.expert_parallel=2"], 2, ["parallel.expert_parallel 1, the profile says 2",
                                             "the world size 1, the profile says 2"]),
        ([], 4, ["the world size 1, the profile says 4"]),
    ],
    ids=["hidden", "experts-and-topk", "fewer-layers", "layer-kind", "lora-r", "lora-targets", "lora-off", "zero",
         "expert-parallel", "world"],  # fmt: skip
)
def test_a_checkpoint_of_another_architecture_or_layout_is_refused_naming_the_fields(
    tmp_path, overrides, world_size, lines
):
    engine = save_steps(tmp_path, [1, 2])
    current = run_signature(load_profile("tiny", overrides), world_size)
    with pytest.raises(ProfileError) as err:
        resume_checkpoint(engine, tmp_path, current, "cpu")
    newest = tmp_path / checkpoint_name(2)
    expected = [f"--resume: {newest} was trained with {line}" for line in lines]
    assert err.value.problems[: len(expected)] == expected
    assert engine.loaded == []


def test_what_may_change_on_resume_does_and_train_settings_get_a_note(tmp_path):
    engine = save_steps(tmp_path, [1])
    same = run_signature(load_profile("tiny", ["train.steps=900", "output.save_every=3", "output.keep_last=1",
                                               f"output.dir={tmp_path}"]), 1)  # fmt: skip
    assert resume_checkpoint(engine, tmp_path, same, "cpu")[2] == []
    changed = run_signature(load_profile("tiny", ["train.lr=0.001", "data.seed=5"]), 1)
    lines = resume_checkpoint(engine, tmp_path, changed, "cpu")[2]
    folder = tmp_path / checkpoint_name(1)
    assert lines == [f"note: {folder} was trained with train.lr 0.005, the profile says 0.001",
                     f"note: {folder} was trained with data.seed 0, the profile says 5"]  # fmt: skip


def test_field_values_are_echoed_escaped(tmp_path):
    engine = save_steps(tmp_path, [1])
    hostile = run_signature(load_profile("tiny", ["lora.target_modules=[\"q\\u202e\\x1b[31m\"]"]), 1)
    with pytest.raises(ProfileError) as err:
        resume_checkpoint(engine, tmp_path, hostile, "cpu")
    assert err.value.problems[0].endswith('the profile says ["q\\u202e\\u001b[31m"]')
    assert "\x1b" not in str(err.value) and "\u202e" not in str(err.value)


def fail_with(error: BaseException):
    def raiser(*args, **kwargs):
        raise error

    return raiser


NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    "where", ["deepspeed", "trainer state", "manifest", "rename", "quota", "torch writer on a full disk"]
)
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, where):
    root = tmp_path / "checkpoints"
    engine = save_steps(root, [1], keep_last=1)
    if where == "deepspeed":
        monkeypatch.setattr(engine, "save_checkpoint", fail_with(NO_SPACE))
    elif where == "trainer state":
        monkeypatch.setattr(ckpt, "write_json_atomic", fail_with(NO_SPACE))
    elif where == "manifest":
        monkeypatch.setattr(ckpt, "_hash_file", fail_with(NO_SPACE))
    elif where == "rename":
        monkeypatch.setattr(ckpt, "_fsync_dir", fail_with(NO_SPACE))
    elif where == "quota":
        monkeypatch.setattr(engine, "save_checkpoint", fail_with(OSError(errno.EDQUOT, "Disk quota exceeded")))
    else:
        # torch's zip writer says only "file write failed"; the free space tells.
        monkeypatch.setattr(engine, "save_checkpoint", fail_with(RuntimeError("[enforce fail] file write failed")))
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(engine, root, 2, trainer_state(2), keep_last=1, is_main=True)
    assert str(err.value) == (f"no space left on {root} while saving checkpoint step-0000002; the last intact "
                              f"checkpoint is {root / checkpoint_name(1)}")  # fmt: skip
    monkeypatch.undo()
    assert [p.name for p in root.iterdir()] == [checkpoint_name(1)]
    assert verify_checkpoint(root / checkpoint_name(1)).problem is None


def test_other_write_failures_are_one_line_too(tmp_path, monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(engine, "save_checkpoint", fail_with(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(engine, tmp_path, 1, trainer_state(1), keep_last=1, is_main=True)
    assert str(err.value) == (f"could not write checkpoint step-0000001 under {tmp_path}: OSError: [Errno 5] "
                              "Input/output error; no checkpoint was written before")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_the_cli_prints_a_write_failure_in_one_line_and_exits_2(monkeypatch, tmp_path):
    from moe_tune.engine.train import trainer

    message = f"no space left on {tmp_path} while saving checkpoint step-0000002; the last intact checkpoint is x"
    monkeypatch.setattr(trainer, "finetune", fail_with(CheckpointWriteError(message)))
    result = CliRunner().invoke(app, ["finetune", "tiny", "--set", f"output.dir={tmp_path}"])
    assert result.exit_code == 2
    assert result.stderr == f"error: {message}\n"
    assert "Traceback" not in result.output


def test_pruning_keeps_the_newest_and_never_runs_before_a_save_completes(tmp_path, monkeypatch):
    engine = save_steps(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(4), checkpoint_name(5)]
    monkeypatch.setattr(engine, "save_checkpoint", fail_with(NO_SPACE))
    with pytest.raises(CheckpointWriteError):
        save_checkpoint(engine, tmp_path, 6, trainer_state(6), keep_last=1, is_main=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(4), checkpoint_name(5)]


@pytest.mark.parametrize("other", ["step-3", "step-00000003", "step-03", "step-3a", "step-"])
def test_only_folders_named_as_the_trainer_names_them_are_checkpoints(tmp_path, other):
    # A folder beside step-0000003 that names step 3 (or no step) another way: resuming, pruning and export's list of
    # steps pass it by, and pruning never deletes it.
    engine = save_steps(tmp_path, [3])
    shutil.copytree(tmp_path / checkpoint_name(3), tmp_path / other)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(3)]
    assert ckpt.checkpoint_step(tmp_path / other) is None
    assert [ckpt.checkpoint_step(tmp_path / checkpoint_name(s)) for s in (0, 3, 12_345_678)] == [0, 3, 12_345_678]
    save_checkpoint(engine, tmp_path, 4, trainer_state(4), keep_last=1, is_main=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint_name(4), other])
    assert resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")[0].name == checkpoint_name(4)


def test_resume_with_only_misnamed_checkpoints_names_them(tmp_path):
    engine = save_steps(tmp_path, [3, 12])
    for step, other in ((3, "step-3"), (12, "step-012")):
        (tmp_path / checkpoint_name(step)).rename(tmp_path / other)
    (tmp_path / "step-x").mkdir()
    with pytest.raises(ProfileError) as caught:
        resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert caught.value.problems == [f"--resume: no checkpoint under {tmp_path} (step-012, step-3: not named as the "
                                     "trainer names checkpoints, step-0000012 for step-012)"]  # fmt: skip


def test_resaving_after_a_resume_from_an_older_checkpoint_keeps_the_resumed_one(tmp_path):
    # Steps 4 and 5 are damaged; a run resumed from 3 saves 4 again with keep_last 1: the damaged 5 (newer) must not
    # count, or pruning would delete the new 4 and leave nothing that verifies.
    engine = save_steps(tmp_path, [3, 4, 5])
    for step in (4, 5):
        truncate(tmp_path / checkpoint_name(step) / MODEL_FILE)
    assert resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")[0].name == checkpoint_name(3)
    save_checkpoint(engine, tmp_path, 4, trainer_state(4), keep_last=1, is_main=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(4), checkpoint_name(5)]
    path, _, lines = resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")
    assert path.name == checkpoint_name(4) and lines[0].startswith(f"skipped {tmp_path / checkpoint_name(5)}: ")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("damaged", ["truncated", "missing"])
def test_a_damaged_checkpoint_is_not_counted_by_pruning_so_the_good_one_before_it_stays(tmp_path, damaged):
    # Steps 1 and 2 saved, 2 then damaged; a run resumed from 1 that saves 3 alone (keep_last 2): step 1, the last
    # checkpoint that verifies before 3, must stay; the damaged 2 is neither counted nor deleted.
    engine = save_steps(tmp_path, [1, 2])
    weights = tmp_path / checkpoint_name(2) / MODEL_FILE
    truncate(weights) if damaged == "truncated" else weights.unlink()
    assert resume_checkpoint(engine, tmp_path, TINY_SIGNATURE, "cpu")[0].name == checkpoint_name(1)
    save_checkpoint(engine, tmp_path, 3, trainer_state(3), keep_last=2, is_main=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(s) for s in (1, 2, 3)]
    # A later save prunes among the good ones: 1 goes once 3 and 4 are kept.
    save_checkpoint(engine, tmp_path, 4, trainer_state(4), keep_last=2, is_main=True)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [checkpoint_name(s) for s in (2, 3, 4)]


RECORDS = [json.dumps({"step": step, "loss": 5.0 - step / 10}) for step in (1, 2, 3)]


@pytest.mark.parametrize("cut", [1, 5, 12, -1])
def test_a_torn_last_metrics_line_is_dropped_with_a_note(cut):
    text = "\n".join(RECORDS[:2]) + "\n" + RECORDS[2][:cut]
    kept, notes = kept_metrics_lines(text, resume_step=2)
    assert kept == RECORDS[:2]
    assert notes == ["note: metrics.jsonl: dropped its last line, cut short by a crash, which is not a JSON record "
                     "with an integer step"]  # fmt: skip


@pytest.mark.parametrize(
    "bad", ["garbage", "[1, 2]", '{"step": "2"}', '{"step": true}', '{"loss": 1.0}', "\x00\x00\x00", '"text"']
)
def test_a_damaged_metrics_line_is_dropped_naming_its_line(bad):
    text = "\n".join([RECORDS[0], bad, RECORDS[1], "", RECORDS[2]]) + "\n"
    kept, notes = kept_metrics_lines(text, resume_step=3)
    assert kept == RECORDS
    assert notes == ["note: metrics.jsonl: dropped line 2, which is not a JSON record with an integer step"]


def test_metrics_writer_resumes_over_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(("\n".join(RECORDS) + "\n" + '{"step": 4, "lo').encode() + b"\xff")
    writer = MetricsWriter(path, resume_step=2)
    writer.write({"step": 3, "loss": 1.0})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert len(writer.notes) == 1 and "its last line" in writer.notes[0]


FAULT_DRIVER = Path(__file__).resolve().parents[1] / "checkpoint_fault_driver.py"


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_and_truncated_files_resume_like_an_uninterrupted_run(tmp_path, child_env):
    proc = subprocess.run([sys.executable, str(FAULT_DRIVER), str(tmp_path), "--kills", "10", "--seed", "0"],
                          capture_output=True, text=True, timeout=900, env=child_env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    kills = report["kills"]
    assert len(kills) == 10 and all(k["killed"] for k in kills), [k.get("log") for k in kills if not k["killed"]]
    for k in kills:
        # A kill at any moment leaves every step folder verifiable (the rename is the commit), and the next run
        # resumes from the newest.
        assert all(problem is None for problem in k["after"].values()), k
        assert "Traceback" not in k["log"] and "skipped" not in k["log"], k["log"]
        if k["expected"] is not None:
            assert k["resumed"] == k["expected"], k["log"]
    # Every part of a write is aimed at, and most kills land mid-write (a temporary left behind).
    assert {k["aimed_at"] for k in kills} == {"folder", "model states", "optimizer states", "trainer state",
                                              "manifest", "renamed"}  # fmt: skip
    assert sum(bool(k["left"]) for k in kills) >= 5, kills
    for t in report["truncations"]:
        assert t["rc"] == 0 and "Traceback" not in t["log"], t["log"]
        newest = t["truncated"].split("/")[0]
        assert f"skipped {tmp_path / 'faulty' / 'checkpoints' / newest}: " in t["log"], t["log"]
        assert t["resumed"] == t["expected"] and t["resumed"] != newest, t
    assert [t["kind"] for t in report["truncations"]][-1] == "pickle payload" and not report["payload_ran"]
    assert "refused: a file holds pickled objects" in report["truncations"][-1]["log"]
    # Through the command line: exit 2, one line per problem, no traceback.
    lora, none = report["refusals"]
    checkpoints = tmp_path / "faulty" / "checkpoints"
    assert lora["rc"] == 2 and "Traceback" not in lora["log"], lora["log"]
    assert (f"error: --resume: {checkpoints / lora['newest']} was trained with lora.r 16, the profile says 8\n"
            in lora["log"]), lora["log"]  # fmt: skip
    errors = [line for line in none["log"].splitlines() if line.startswith("error: ")]
    assert none["rc"] == 2 and "Traceback" not in none["log"], none["log"]
    assert errors[0] == f"error: --resume: no checkpoint under {checkpoints} verifies and loads"
    assert [line.split(": ")[2] for line in errors[1:]] == [str(checkpoints / d) for d in reversed(none["damaged"])]
    assert all(re.search(r"model_states.pt is \d+ bytes, the manifest says \d+$", line) for line in errors[1:])
    assert report["reference_rc"] == 0, report["reference_log"]
    faulty, reference = report["faulty_losses"], report["reference_losses"]
    assert list(faulty) == list(reference) == [str(step) for step in range(1, len(reference) + 1)]
    assert faulty == reference


class FullDisk:
    """A file whose writes fail as on a full disk (or over quota)."""

    def __init__(self, code: int):
        self.code = code

    def write(self, text):
        raise OSError(self.code, os.strerror(self.code))

    flush = close = lambda self: None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path, code):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", resume_step=0)
    writer.write({"step": 1, "loss": 1.0})
    writer._file.close()
    writer._file = FullDisk(code)
    with pytest.raises(CheckpointWriteError) as err:
        writer.write({"step": 2, "loss": 1.0})
    assert str(err.value) == (f"no space left on {tmp_path} while writing the metrics of step 2 (metrics.jsonl); "
                              "the checkpoints already written are kept")  # fmt: skip
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


@pytest.mark.parametrize("points_to", ["another run's checkpoint", "a folder of this run"])
def test_a_step_folder_that_is_a_link_is_skipped_naming_it_and_never_pruned(tmp_path, points_to):
    """A link named as a checkpoint would be read from where it points (the manifest's paths check against the
    resolved folder); resuming skips it with its target, pruning neither counts nor deletes it."""
    root = tmp_path / "run"
    engine = save_steps(root, [1])
    save_steps(tmp_path / "other", [3])
    other = tmp_path / "other" / checkpoint_name(3)
    target = other if points_to == "another run's checkpoint" else root / checkpoint_name(1)
    link = root / checkpoint_name(3)
    link.symlink_to(target, target_is_directory=True)
    path, state, lines = resume_checkpoint(engine, root, TINY_SIGNATURE, "cpu")
    assert path == root / checkpoint_name(1) and state["step"] == 1 and engine.loaded == [checkpoint_name(1)]
    assert lines == [f"skipped {link}: a link to {str(target)!r}, not a folder the run wrote"]
    for step in (4, 5):
        save_checkpoint(engine, root, step, trainer_state(step), keep_last=1, is_main=True)
    assert sorted(p.name for p in root.iterdir()) == [checkpoint_name(3), checkpoint_name(5)]
    assert link.is_symlink() and (other / MODEL_FILE).is_file()
