"""`moe-tune export RUN_DIR`: exit 0 and the folder named; bad input one line per problem, exit 2, no traceback,
nothing written. (The export's content is tested in tests/engine/test_export_hub.py.)"""

import errno
import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.profiles import ProfileError

from hf_tiny import save_drawn_adapter, save_tiny_checkpoint, tiny_qwen3_moe
from processes import dead_pid

runner = CliRunner()
PREFIX = "base_model.model."
LORA = {"enabled": True, "r": 4, "alpha": 8.0, "target_modules": ["q_proj", "o_proj"], "experts": True,
        "modules_to_save": ["lm_head"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-cli-checkpoint")
    (root / "data.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    return save_tiny_checkpoint(tiny_qwen3_moe(), root / "checkpoint")


def write_run(run, checkpoint, lora: dict):
    """A finished run of the tiny checkpoint in `run`, written without training: profile.yaml, summary.json and the
    weights, the checkpoint's own in our names (full fine-tune), or the adapter as the trainer saves it, B factors
    random (LoRA, lm_head trained in full)."""
    from moe_tune.engine.align.compare import load_ours
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.lora import inject_lora
    from moe_tune.profiles import validate_profile

    job = resolve_job(validate_profile({
        "name": "export-cli", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(checkpoint.parent / "data.jsonl"), "tokenizer": "byte", "seq_len": 32},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "lora": lora, "output": {"dir": str(run)},
    }))
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text("{}\n")
    model = load_ours(job.model)
    if not job.lora.enabled:
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(run / "model.safetensors"))
        return run
    save_drawn_adapter(inject_lora(model, job.lora), run / "adapter", 0.3)
    return run


@pytest.fixture(scope="module")
def run_dir(checkpoint, tmp_path_factory):
    """A finished full fine-tune's folder."""
    return write_run(tmp_path_factory.mktemp("export-cli") / "run", checkpoint, {"enabled": False})


@pytest.fixture(scope="module")
def lora_run_dir(checkpoint, tmp_path_factory):
    """A finished LoRA run's folder: adapters on q_proj, o_proj and the experts, lm_head trained in full."""
    return write_run(tmp_path_factory.mktemp("export-cli-lora") / "run", checkpoint, LORA)


def test_export_exits_0_and_names_the_folder(run_dir, tmp_path):
    out = tmp_path / "hub"
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(out), "--max-shard-size", "20KB"])
    assert result.exit_code == 0, result.output
    assert f"exported to {out}" in result.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/none"], "error: {tmp}/none: no such folder (RUN_DIR must be a finetune output.dir)"),
        (["{tmp}/busy/keep"], "error: {tmp}/busy/keep: not a folder (RUN_DIR must be a finetune output.dir)"),
        (["{tmp}"], "error: {tmp}: no run here (no profile.yaml; RUN_DIR must be a finetune output.dir)"),
        (["{run}", "--out", "{run}/checkpoints/x"], "error: --out ('{run}/checkpoints/x') lies inside the run's "
         "checkpoints folder"),
        (["{run}", "--out", "{tmp}/busy"], "error: --out ('{tmp}/busy') exists and is not empty"),
        (["{run}", "--out", "{tmp}/busy/keep/new"], "error: --out ('{tmp}/busy/keep/new'): '{tmp}/busy/keep' is not a "
         "folder"),
        (["{run}", "--out", "{tmp}/busy/keep/a/b"], "error: --out ('{tmp}/busy/keep/a/b'): '{tmp}/busy/keep' is not a "
         "folder"),
        (["{run}", "--out", "/proc/moe-tune-export"], "error: --out ('/proc/moe-tune-export'): no folder can be "
         "created in '/proc' ("),
        (["{run}", "--max-shard-size", "5XB"], "error: --max-shard-size ('5XB') must be a positive size"),
        (["{run}", "--step", "0"], "error: --step (0) must be >= 1"),
        (["{run}", "--step", "7"], "error: --step 7: no checkpoint {run}/checkpoints/step-"),
    ],
    ids=["no-folder", "a-file", "no-run", "out-in-checkpoints", "out-not-empty", "out-under-a-file",
         "out-deeper-under-a-file", "out-in-proc", "shard-size", "step-0", "no-step"],  # fmt: skip
)
def test_bad_input_exits_2_in_one_line(run_dir, tmp_path, args, message):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("mine")
    fill = {"tmp": tmp_path, "run": run_dir}
    result = runner.invoke(app, ["export", *(a.format(**fill) for a in args)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(**fill)), lines
    assert "Traceback" not in result.output
    assert not (run_dir / "export").exists() and (tmp_path / "busy" / "keep").read_text() == "mine"


def test_a_missing_step_is_named_beside_an_out_problem(run_dir, tmp_path):
    """Both problems at once, a line each: the user mends both before the next try."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("mine")
    result = runner.invoke(app, ["export", str(run_dir), "--step", "7", "--out", str(tmp_path / "busy")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: --out ('{tmp_path}/busy') exists and is not empty")
    assert lines[1].startswith(f"error: --step 7: no checkpoint {run_dir}/checkpoints/step-"), lines


def test_a_checkpoints_folder_leading_out_of_the_run_is_refused(run_dir, tmp_path):
    """`--step` reads the run's own checkpoints: its checkpoints folder a link to another run's is one line."""
    run, elsewhere = tmp_path / "run", tmp_path / "other-run" / "checkpoints"
    shutil.copytree(run_dir, run)
    (elsewhere / "step-0000001").mkdir(parents=True)
    (run / "checkpoints").symlink_to(elsewhere)
    result = runner.invoke(app, ["export", str(run), "--step", "1", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --step 1: {run / 'checkpoints'}: leads to {str(elsewhere)!r}, outside the run folder; a run's files "
        "are read and written only inside it"]
    assert not (tmp_path / "out").exists()


def assert_refused_in_one_line(args: list[str], out, message: str) -> None:
    """`moe-tune export ARGS --out OUT`: exit 2, one line starting with `message`, no traceback, nothing written
    (neither OUT nor the temporary folder beside it)."""
    result = runner.invoke(app, ["export", *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert "Traceback" not in result.output and result.stdout == ""
    assert not out.exists() and not any(out.parent.glob(f".{out.name}*")), list(out.parent.iterdir())


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_the_intact_lora_run_exports(lora_run_dir, tmp_path, merge):
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(lora_run_dir), "--out", str(out), *(["--merge"] if merge else [])])
    assert result.exit_code == 0, result.output
    assert (out / ("model.safetensors.index.json" if merge else "adapter_model.safetensors")).is_file()


def damaged_copy(run: Path, tmp_path: Path, damage) -> Path:
    """A copy of `run` in tmp_path/run whose adapter (LoRA) or model.safetensors is rewritten by `damage(path)`."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    damage(copy / ("adapter/adapter_model.safetensors" if (copy / "adapter").is_dir() else "model.safetensors"))
    return copy


def cut(keep):
    """A damage: the file cut to `keep(size, header_end)` bytes (header_end: where the tensor data starts)."""
    def damage(path):
        data = path.read_bytes()
        header_end = 8 + int.from_bytes(data[:8], "little")
        path.write_bytes(data[: keep(len(data), header_end)])
    return damage


TRUNCATIONS = {
    "empty": cut(lambda size, header: 0),
    "in-length-field": cut(lambda size, header: 4),
    "in-header": cut(lambda size, header: header // 2),
    "at-data-start": cut(lambda size, header: header),
    "in-data": cut(lambda size, header: (header + size) // 2),
    "last-byte": cut(lambda size, header: size - 1),
}


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_a_truncated_adapter_is_named_in_one_line(lora_run_dir, tmp_path, truncation, merge):
    run = damaged_copy(lora_run_dir, tmp_path, TRUNCATIONS[truncation])
    assert_refused_in_one_line([str(run), *(["--merge"] if merge else [])], tmp_path / "out",
                               f"{run}/adapter/adapter_model.safetensors: not a readable safetensors file (")


@pytest.mark.parametrize("truncation", ["in-length-field", "in-header", "in-data", "last-byte"])
def test_truncated_full_finetune_weights_are_named_in_one_line(run_dir, tmp_path, truncation):
    run = damaged_copy(run_dir, tmp_path, TRUNCATIONS[truncation])
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run}/model.safetensors: not a readable safetensors "
                               "file (")


def test_junk_bytes_are_not_a_safetensors_file(lora_run_dir, tmp_path):
    run = damaged_copy(lora_run_dir, tmp_path, lambda path: path.write_bytes(b"\xff" * 64))
    assert_refused_in_one_line([str(run), "--merge"], tmp_path / "out",
                               f"{run}/adapter/adapter_model.safetensors: not a readable safetensors file (")


def rewrite(edit):
    """A damage: the adapter's tensors passed through `edit(tensors)` and saved again."""
    def damage(path):
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path))
    return damage


# One tensor of each kind: a linear layer's factors, the grouped experts' factors, a tensor trained in full.
LINEAR_A = f"{PREFIX}layers.1.self_attn.q_proj.lora_A.weight"
LINEAR_B = f"{PREFIX}layers.2.self_attn.o_proj.lora_B.weight"
EXPERTS_A = f"{PREFIX}layers.1.mlp.experts.lora_A.w_gate_up"
EXPERTS_B = f"{PREFIX}layers.2.mlp.experts.lora_B.w_down"
FULL = f"{PREFIX}lm_head.weight"


def grown(tensor, dim):
    """`tensor` with one more row along `dim` (zeros)."""
    dim %= tensor.ndim
    extra = torch.zeros(*tensor.shape[:dim], 1, *tensor.shape[dim + 1 :], dtype=tensor.dtype)
    return torch.cat([tensor, extra], dim=dim)


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
@pytest.mark.parametrize(
    "key, dim",
    [
        (LINEAR_A, -1),  # A's in_features
        (LINEAR_A, 0),  # A's rank
        (LINEAR_B, 0),  # B's out_features
        (LINEAR_B, -1),  # B's rank
        (EXPERTS_A, -1),
        (EXPERTS_B, 1),
        (EXPERTS_B, 0),  # one expert more
        (FULL, 0),
    ],
    ids=["linear-A-in", "linear-A-rank", "linear-B-out", "linear-B-rank", "experts-A-in", "experts-B-out",
         "experts-count", "trained-in-full"],
)
def test_an_adapter_tensor_of_the_wrong_shape_is_named_with_both_shapes(lora_run_dir, tmp_path, key, dim, merge):
    expected = tuple(load_file(str(lora_run_dir / "adapter/adapter_model.safetensors"))[key].shape)
    run = damaged_copy(lora_run_dir, tmp_path, rewrite(lambda t: t.update({key: grown(t[key], dim)})))
    bad = list(expected)
    bad[dim] += 1
    assert_refused_in_one_line([str(run), *(["--merge"] if merge else [])], tmp_path / "out",
                               f"{run}/adapter/adapter_model.safetensors: tensor {key} has shape {tuple(bad)}, "
                               f"expected {expected} (")


def test_an_adapter_saved_at_another_rank_is_refused(lora_run_dir, tmp_path):
    # Both factors at rank 2 (lora.r is 4): they multiply, but the run's alpha / r would scale them wrongly.
    def halve(tensors):
        tensors[LINEAR_A] = tensors[LINEAR_A][:2].clone()
        tensors[LINEAR_A.replace("lora_A", "lora_B")] = tensors[LINEAR_A.replace("lora_A", "lora_B")][:, :2].clone()

    run = damaged_copy(lora_run_dir, tmp_path, rewrite(halve))
    result = runner.invoke(app, ["export", str(run), "--merge", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    # The pair broken alike: one line, the first tensor and how many more.
    (line,) = result.stderr.strip().splitlines()
    assert "lora.r 4, layers.1.self_attn.q_proj.weight" in line and line.endswith(" (and 1 more tensor alike)"), line
    assert not (tmp_path / "out").exists()


def test_an_adapter_every_factor_of_which_another_rank_breaks_is_one_line(lora_run_dir, tmp_path):
    # profile.yaml edited to another lora.r: every factor's shape is wrong alike.
    def edit_rank(adapter_file):
        profile = adapter_file.parent.parent / "profile.yaml"
        text = profile.read_text()
        assert "\n  r: 4\n" in text
        profile.write_text(text.replace("\n  r: 4\n", "\n  r: 8\n", 1))

    run = damaged_copy(lora_run_dir, tmp_path, edit_rank)
    result = runner.invoke(app, ["export", str(run), "--merge", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "has shape" in line and "(lora.r 8, " in line and re.search(r" \(and \d+ more tensors alike\)$", line), line


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", [LINEAR_A, EXPERTS_B, FULL], ids=["linear-A", "experts-B", "trained-in-full"])
def test_an_adapter_tensor_with_non_finite_values_is_named(lora_run_dir, tmp_path, key, value, merge):
    def poison(tensors):
        tensors[key].view(-1)[-1] = value  # one element, the last

    run = damaged_copy(lora_run_dir, tmp_path, rewrite(poison))
    assert_refused_in_one_line([str(run), *(["--merge"] if merge else [])], tmp_path / "out",
                               f"{run}/adapter/adapter_model.safetensors: tensor {key} holds non-finite values")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update({f"{PREFIX}layers.1.self_attn.nope.lora_A.weight": torch.zeros(4, 32)}),
         f"tensor {PREFIX}layers.1.self_attn.nope.lora_A.weight matches no tensor of the run's model"),
        (lambda t: t.update({"layers.1.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}),
         "tensor layers.1.self_attn.q_proj.lora_A.weight matches no tensor of the run's model"),
        (lambda t: t.pop(LINEAR_B), f"tensor {LINEAR_B.replace('lora_B', 'lora_A')} has no lora_B beside it"),
        (lambda t: t.pop(EXPERTS_A), f"tensor {EXPERTS_A.replace('lora_A', 'lora_B')} has no lora_A beside it"),
        (lambda t: t.update({LINEAR_A: t[LINEAR_A].to(torch.int32)}), f"tensor {LINEAR_A} has dtype int32"),
    ],
    ids=["unknown-module", "no-prefix", "no-lora-B", "no-lora-A", "integer-dtype"],
)
def test_adapter_tensors_the_model_cannot_take_are_named(lora_run_dir, tmp_path, edit, message):
    run = damaged_copy(lora_run_dir, tmp_path, rewrite(edit))
    assert_refused_in_one_line([str(run), "--merge"], tmp_path / "out",
                               f"{run}/adapter/adapter_model.safetensors: {message}")


def test_full_finetune_weights_of_the_wrong_shape_are_named(run_dir, tmp_path):
    key = "layers.1.self_attn.q_proj.weight"
    expected = tuple(load_file(str(run_dir / "model.safetensors"))[key].shape)
    run = damaged_copy(run_dir, tmp_path, rewrite(lambda t: t.update({key: grown(t[key], 0)})))
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run}/model.safetensors: tensor {key} has shape "
                               f"{(expected[0] + 1, *expected[1:])}, expected {expected} (")


@pytest.mark.parametrize("dtype, stored", [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.uint8, "U8"),
                                           (torch.float8_e4m3fn, "F8_E4M3")])  # fmt: skip
def test_full_finetune_weights_of_a_dtype_not_floating_point_are_named(run_dir, tmp_path, dtype, stored):
    """A weight stored as integers (or FP8 bits a full fine-tune never writes) was read as zeros into the export."""
    key = "layers.1.self_attn.q_proj.weight"
    run = damaged_copy(run_dir, tmp_path, rewrite(lambda t: t.update({key: t[key].to(dtype)})))
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run}/model.safetensors: tensor {key} has dtype "
                               f"{stored}, must be a floating-point dtype (F32, BF16, F16, F64)")


@pytest.mark.parametrize("extra", [["model.layers.1.self_attn.q_proj.weight"], ["mtp.0.proj.weight", "unknown.bias"]],
                         ids=["hub-name", "two-unknown"])
def test_full_finetune_weights_holding_tensors_of_no_model_tensor_are_named(run_dir, tmp_path, extra):
    """A model.safetensors tensor named as none of the model's (a hub checkpoint's key, another model's tensor):
    the file is not this run's weights, refused with the first such tensor and how many more."""
    run = damaged_copy(run_dir, tmp_path, rewrite(lambda t: t.update({key: torch.zeros(2, 3) for key in extra})))
    more = " (and 1 more tensor alike)" if len(extra) > 1 else ""
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run}/model.safetensors: tensor {sorted(extra)[0]} "
                               "matches no tensor of the run's model (a full fine-tune's weights are the model's "
                               f"tensors under its names){more}")


# The run kinds whose export goes through each writer: the hub checkpoint (full fine-tune, LoRA merged) and the PEFT
# adapter (LoRA).
EXPORT_KINDS = {"full": ("run_dir", []), "merged": ("lora_run_dir", ["--merge"]), "adapter": ("lora_run_dir", [])}


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_every_exported_file_is_readable_as_the_umask_says(request, tmp_path, kind, umask):
    """safetensors' save_file creates 0o600 files; the shards and the adapter get what open() gives a new file
    (0o666 less the umask), as the config and tokenizer files beside them, so a serving process of another user or
    group reads them."""
    fixture, flags = EXPORT_KINDS[kind]
    out = tmp_path / "out"
    previous = os.umask(umask)
    try:
        result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in out.rglob("*") if path.is_file()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def delivered_sigterm() -> BaseException:
    """What SIGTERM does to the export at this point: its handler called as the signal would call it (sending the
    signal itself would stop the test process where the export left it to the default action)."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler):
        return AssertionError(f"SIGTERM is not handled during the export ({handler})")
    handler(signal.SIGTERM, None)
    return AssertionError("the SIGTERM handler returned")


# How an export can fail once its temporary folder holds files, and the exit code: a refusal (exit 2, one line), an
# error while writing, an interrupt (Click exits 130), SIGTERM (143).
FAILURES = {
    "refusal": (lambda: ProfileError(["model.safetensors: tensor x holds non-finite values (NaN or inf)"]), 2),
    "disk-full": (lambda: OSError(errno.ENOSPC, "No space left on device"), 1),
    "interrupt": (lambda: KeyboardInterrupt(), 130),
    "sigterm": (delivered_sigterm, 143),
}


def fail_after(function, error):
    """`function` that does its work, then raises `error()`: the failure comes with files in the folder."""
    def failing(*args, **kwargs):
        function(*args, **kwargs)
        raise error()
    return failing


@pytest.mark.parametrize("before", ["absent", "empty"])
@pytest.mark.parametrize("where", ["weights", "loader-files"])
@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_a_failed_export_leaves_no_temporary_folder_and_out_as_it_was(request, tmp_path, monkeypatch, kind, failure,
                                                                      where, before):
    import safetensors.torch

    import moe_tune.engine.export.hub as hub

    fixture, flags = EXPORT_KINDS[kind]
    # Built before the writers fail (a module fixture).
    run = request.getfixturevalue(fixture)
    error, code = FAILURES[failure]
    if where == "weights":
        monkeypatch.setattr(safetensors.torch, "save_file", fail_after(safetensors.torch.save_file, error))
    else:
        monkeypatch.setattr(hub, "copy_loader_files", fail_after(hub.copy_loader_files, error))
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    result = runner.invoke(app, ["export", str(run), *flags, "--out", str(out)])
    assert result.exit_code == code, result.output
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if failure == "refusal":
        assert result.stderr.strip().splitlines() == [f"error: {error().problems[0]}"]
    assert not any(tmp_path.glob(".out*")), list(tmp_path.iterdir())
    assert (sorted(out.iterdir()) == [] if before == "empty" else not out.exists()), list(out.parent.iterdir())
    assert not any(run.glob(".lock*")), list(run.iterdir())


# Where the OS refuses an export, and the errno: the temporary folder beside OUT (no permission on OUT's parent, no
# room for a folder), OUT's parent not searchable, a full disk or quota in a shard or a loader file, the rename onto
# OUT refused. Each raises the OSError the OS would, file names included.
OS_FAILURES = {
    "parent-not-writable": ("folder", errno.EACCES),
    "no-room-for-the-folder": ("folder", errno.ENOSPC),
    "parent-not-searchable": ("look-at-out", errno.EACCES),
    "disk-full-in-weights": ("weights", errno.ENOSPC),
    "quota-in-loader-files": ("loader-files", errno.EDQUOT),
    "rename-refused": ("rename", errno.EACCES),
    # safetensors raises its own SafetensorError (no OSError) for a shard the OS refuses, the errno in its message.
    "disk-full-in-safetensors": ("safetensors", errno.ENOSPC),
}


def refused_by_the_os(patch, where: str, code: int, out: Path) -> OSError:
    """Make the export's `where` fail with `code` (through `patch`, a monkeypatch context); returns the error raised
    (the first one, for a failure that may be hit more than once)."""
    import pathlib

    import safetensors.torch

    from safetensors import SafetensorError

    import moe_tune.engine.export.hub as hub
    from moe_tune.engine.export import staging_folder

    tmp = staging_folder(out)
    error = {"folder": OSError(code, os.strerror(code), str(tmp)),
             "look-at-out": OSError(code, os.strerror(code), str(out)),
             "rename": OSError(code, os.strerror(code), str(tmp), str(out)),
             "safetensors": SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} "
                                            f"(os error {code})"),
             }.get(where, OSError(code, os.strerror(code)))  # fmt: skip

    def failing_on(method, path):
        def failing(self, *args, **kwargs):
            if self == path:
                raise error
            return method(self, *args, **kwargs)
        return failing

    if where == "folder":
        patch.setattr(pathlib.Path, "mkdir", failing_on(pathlib.Path.mkdir, tmp))
    elif where == "look-at-out":
        patch.setattr(pathlib.Path, "lstat", failing_on(pathlib.Path.lstat, out))
        patch.setattr(pathlib.Path, "stat", failing_on(pathlib.Path.stat, out))
    elif where in ("weights", "safetensors"):
        patch.setattr(safetensors.torch, "save_file", fail_after(safetensors.torch.save_file, lambda: error))
    elif where == "loader-files":
        patch.setattr(hub, "copy_loader_files", fail_after(hub.copy_loader_files, lambda: error))
    else:
        patch.setattr(pathlib.Path, "replace", failing_on(pathlib.Path.replace, tmp))
    return error


@pytest.mark.parametrize("before", ["absent", "empty"])
@pytest.mark.parametrize("failure", list(OS_FAILURES))
@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_an_os_error_while_exporting_is_one_line_naming_out_and_exit_1(request, tmp_path, monkeypatch, kind, failure,
                                                                       before):
    """Not bad input (exit 2) and no traceback: `error: export to OUT failed: OS ERROR`, exit 1, no temporary folder,
    OUT as it was."""
    fixture, flags = EXPORT_KINDS[kind]
    run = request.getfixturevalue(fixture)
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    with monkeypatch.context() as patch:
        error = refused_by_the_os(patch, *OS_FAILURES[failure], out)
        result = runner.invoke(app, ["export", str(run), *flags, "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stderr.splitlines() == [f"error: export to {out} failed: {error}"]
    assert result.stdout == ""
    assert not any(tmp_path.glob(".out*")), list(tmp_path.iterdir())
    assert (sorted(out.iterdir()) == [] if before == "empty" else not out.exists()), list(tmp_path.iterdir())


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_an_out_folder_holding_files_is_refused_and_kept(request, tmp_path, kind):
    fixture, flags = EXPORT_KINDS[kind]
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: --out ({str(out)!r}) exists and is not empty; export "
                                                  "writes into a new or empty folder"]  # fmt: skip
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "mine"
    assert not any(out.parent.glob(f".{out.name}*"))


@pytest.mark.parametrize("writer", ["none", "dead"], ids=["no-writer-named", "writer-gone"])
@pytest.mark.parametrize("before", ["absent", "empty"])
@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_a_temporary_folder_left_by_a_killed_export_is_not_exported(request, tmp_path, kind, before, writer):
    fixture, flags = EXPORT_KINDS[kind]
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    left = tmp_path / (".out.tmp" if writer == "none" else f".out.tmp-{socket.gethostname()}-{dead_pid()}")
    left.mkdir()
    (left / "left-over.safetensors").write_bytes(b"\0" * 8)
    result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "left-over.safetensors").exists() and not left.exists()
    assert (out / ("adapter_model.safetensors" if kind == "adapter" else "model.safetensors.index.json")).is_file()


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_a_second_export_into_one_folder_is_refused_while_the_first_writes(request, tmp_path, kind, sleeper):
    """Two exports into one --out would write one temporary folder (the second removing the first's as a killed
    writer's), and the folder renamed into place would mix them: each writer stages into its own, and a live one
    is named."""
    fixture, flags = EXPORT_KINDS[kind]
    out, theirs = tmp_path / "out", tmp_path / f".out.tmp-{socket.gethostname()}-{sleeper}"
    theirs.mkdir()
    (theirs / "model-00001-of-00002.safetensors").write_text("theirs")
    result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {out}: another export is writing it (into {theirs.name}); one "
                                          "writer per folder: wait for it to end, or write into another folder"]
    assert (theirs / "model-00001-of-00002.safetensors").read_text() == "theirs" and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]


def assert_theirs_kept(result, out, tmp_path):
    """The export refused in one line, OUT left holding only the file put there while it wrote, as it was."""
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {out}: filled while this export ran (by another export, or by "
                                          "hand); it is kept as it is, and this export's files are removed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["theirs.safetensors"]
    assert (out / "theirs.safetensors").read_text() == "theirs"


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_an_out_filled_while_the_export_ran_is_kept(request, tmp_path, monkeypatch, kind):
    """Another export (on another host, whose writer cannot be seen from here) that renamed its folder into place
    first keeps it; this export's files go."""
    import pathlib

    from moe_tune.engine.export import staging_folder

    fixture, flags = EXPORT_KINDS[kind]
    out = tmp_path / "out"
    rename = pathlib.Path.replace

    def filled_first(self, target):
        if self == staging_folder(out):
            out.mkdir()
            (out / "theirs.safetensors").write_text("theirs")
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "replace", filled_first)
    result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    assert_theirs_kept(result, out, tmp_path)


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_an_out_filled_while_the_export_writes_is_kept(request, tmp_path, monkeypatch, kind):
    """Files put into OUT while the export writes its own (after OUT was checked empty, before the rename) are
    someone else's: kept, and this export's files removed, whatever the export writes."""
    import moe_tune.engine.export.hub as hub

    fixture, flags = EXPORT_KINDS[kind]
    out = tmp_path / "out"
    copy_loader_files = hub.copy_loader_files

    def filled_meanwhile(*args, **kwargs):
        out.mkdir(exist_ok=True)
        (out / "theirs.safetensors").write_text("theirs")
        return copy_loader_files(*args, **kwargs)

    monkeypatch.setattr(hub, "copy_loader_files", filled_meanwhile)
    result = runner.invoke(app, ["export", str(request.getfixturevalue(fixture)), *flags, "--out", str(out)])
    assert_theirs_kept(result, out, tmp_path)


@pytest.mark.parametrize("target", ["empty-folder", "nothing"])
def test_an_out_that_is_a_symbolic_link_is_refused_as_one(lora_run_dir, tmp_path, target):
    """A link is not written through (the export renames its folder into OUT's own name): the line says it is a
    link and where it leads; the link and what it leads to stay."""
    out, where = tmp_path / "out", tmp_path / "elsewhere"
    if target == "empty-folder":
        where.mkdir()
    out.symlink_to(where)
    result = runner.invoke(app, ["export", str(lora_run_dir), "--merge", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: --out ({str(out)!r}) is a symbolic link (to {str(where)!r}); "
                                          "export writes a new or empty folder under its own name, not through a "
                                          "link: name the folder itself"]  # fmt: skip
    assert out.is_symlink() and os.readlink(out) == str(where)
    assert (list(where.iterdir()) == [] if target == "empty-folder" else not os.path.lexists(where))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(["elsewhere"] if where.exists() else [])])


@pytest.mark.parametrize("out", [".", "../here"])
def test_an_out_that_is_the_current_folder_is_refused(lora_run_dir, tmp_path, monkeypatch, out):
    """An empty current folder replaced by the export's would leave the shell in a removed folder (and `.` has no
    name to stage a sibling after)."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = runner.invoke(app, ["export", str(lora_run_dir), "--out", out])
    assert result.exit_code == 2, result.output
    shown = out if out == "../here" else str(here)
    assert result.stderr.splitlines() == [f"error: --out ({shown!r}) is the current folder: export renames a new "
                                          "folder into its place, which a shell in it would not see; name a new "
                                          "folder"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"] and list(here.iterdir()) == []


@pytest.mark.parametrize("holder", ["gone", "live"])
def test_a_run_killed_on_this_host_exports_and_a_live_one_is_refused(lora_run_dir, tmp_path, holder, sleeper):
    """A run killed with SIGKILL leaves its lock: its holder gone, the folder is the run's to read (--step of a
    killed run is what export is for); a live holder keeps it."""
    run = tmp_path / "run"
    shutil.copytree(lora_run_dir, run)
    pid = dead_pid() if holder == "gone" else sleeper
    (run / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2026-01-01"}))
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "out")])
    if holder == "gone":
        assert result.exit_code == 0, result.output
        assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    else:
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"error: {run}: a run holds this folder (.lock); export it once the "
                                              "run has ended"]


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_safetensors_path_that_is_no_regular_file_is_refused_not_waited_on(tmp_path, kind):
    """Every safetensors file a run holds is opened only when regular (the selection biases' among them, which no
    earlier check looks at): a FIFO in its place would block the read for ever."""
    from moe_tune.engine.export.sources import open_safetensors
    from moe_tune.profiles import ProfileError

    path = tmp_path / "selection_biases.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(ProfileError) as refusal:
        open_safetensors(path)
    shown = "a FIFO" if kind == "fifo" else "a directory"
    assert refusal.value.problems == [f"{path}: not a regular file ({shown}); a safetensors file must be one"]


def test_full_finetune_weights_missing_a_parameter_are_refused(run_dir, tmp_path):
    """A model.safetensors without one of the model's parameters: named, not filled in from the base."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    weights = load_file(str(run / "model.safetensors"))
    dropped = sorted(weights)[3]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(run / "model.safetensors"))
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run / 'model.safetensors'}: no tensor {dropped}")


def test_full_finetune_weights_holding_nan_are_refused_and_nothing_written(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    weights = load_file(str(run / "model.safetensors"))
    poisoned = sorted(weights)[-1]
    weights[poisoned] = weights[poisoned].clone().view(-1).index_fill(0, torch.tensor([0]), float("nan")).view_as(
        weights[poisoned])
    save_file(weights, str(run / "model.safetensors"))
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run / 'model.safetensors'}: tensor {poisoned} holds "
                                                             "non-finite values (NaN or inf)")


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finetunes_start_before(call, run, reader: str, refusals: list, expected: list):
    """`call`, first starting a finetune --overwrite and a --resume into `run` while the `reader` command (export,
    generate) holds its mark there: the refusals go to `refusals`, the lines naming that reader to `expected`."""
    from moe_tune.engine.train.run_dir import check_output_dir

    def starts(*args, **kwargs):
        (mark,) = run.glob(".lock.reader-*")
        started = json.loads(mark.read_text())["started"]
        expected.append([f"output.dir ({run}) is being read by moe-tune {reader}: pid {os.getpid()} on host "
                         f"{socket.gethostname()}, started {started} ({mark}); a run would replace what it reads: "
                         "start the run once it has ended"])  # fmt: skip
        for resume, overwrite in ((False, True), (True, False)):
            with pytest.raises(ProfileError) as refusal:
                check_output_dir(run, resume=resume, overwrite=overwrite)
            refusals.append(refusal.value.problems)
        return call(*args, **kwargs)

    return starts


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_a_finetune_into_the_run_is_refused_while_an_export_reads_it(request, tmp_path, monkeypatch, kind):
    """A finetune --overwrite (or --resume) of the run's folder that starts while an export reads it would remove (or
    replace) what the export reads: the export marks the folder, the finetune's claim of it is refused, and the export
    ends with the run as it was."""
    import moe_tune.engine.export.hub as hub

    fixture, flags = EXPORT_KINDS[kind]
    run = tmp_path / "run"
    shutil.copytree(request.getfixturevalue(fixture), run)
    before = files_of(run)
    refusals, expected = [], []
    # The export has read the run's profile and is writing: here a finetune of the same output.dir starts.
    monkeypatch.setattr(hub, "copy_loader_files",
                        finetunes_start_before(hub.copy_loader_files, run, "export", refusals, expected))
    result = runner.invoke(app, ["export", str(run), *flags, "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert refusals == expected * 2 and len(refusals) == 2
    assert files_of(run) == before


OWNED_OUT = [
    (".lock", "is '.lock'"), ("mlruns", "is 'mlruns'"), ("wandb/x", "lies inside 'wandb'"),
    ("metrics.jsonl", "is 'metrics.jsonl'"), ("tensorboard", "is 'tensorboard'"), ("adapter", "is 'adapter'"),
    (".export.tmp-host-12", "is '.export.tmp-host-12'"), ("export/inner", "lies inside 'export'"),
    (".lock.reader-x", "is '.lock.reader-x'"),
]  # fmt: skip


@pytest.mark.parametrize("name, where", OWNED_OUT, ids=[name for name, _ in OWNED_OUT])
@pytest.mark.parametrize("through", ["run", "link"])
def test_an_out_the_run_keeps_in_its_folder_is_refused(run_dir, tmp_path, name, where, through):
    """The lock, the trackers' stores, the metrics, the adapter, a writer's staged folder: a later finetune --resume
    or --overwrite of the run reads or replaces them (or, for the lock, would find a folder no run wrote). A link to
    the run folder leads there as well."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = files_of(run)
    if through == "link":
        (tmp_path / "alias").symlink_to(run)
    out = (tmp_path / "alias" if through == "link" else run) / name
    result = runner.invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: --out ({str(out)!r}) {where}, a name the run keeps in its folder (a later finetune --resume or "
        f"--overwrite reads or replaces it); write into a new folder such as {str(run / 'export')!r} or one outside "
        "the run"]
    assert files_of(run) == before and sorted(p.name for p in run.iterdir()) == sorted(before)


OTHER_RUN_OUT = [("checkpoints/step-0000099", "lies inside 'checkpoints'"), ("merged", "is 'merged'"),
                 ("adapter-transformers", "is 'adapter-transformers'"), ("tensorboard", "is 'tensorboard'"),
                 ("export", "is 'export'"), ("export-merged/x", "lies inside 'export-merged'")]  # fmt: skip


@pytest.mark.parametrize("name, where", OTHER_RUN_OUT, ids=[name for name, _ in OTHER_RUN_OUT])
def test_an_out_another_run_keeps_in_its_folder_is_refused(run_dir, tmp_path, name, where):
    """Another run's --overwrite, pruning or --resume would delete or read the export, as for finetune's
    output.dir; a folder of that other run that it keeps no name of is written."""
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    before = files_of(other)
    out = other / name
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: --out ({str(out)!r}) {where}, a name the run in {other} keeps in its folder (its pruning, --resume or "
        "--overwrite would delete or read the export); choose another folder"]
    assert files_of(other) == before
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(other / "my-export")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["export", "my-export"])
def test_an_out_of_the_run_folder_that_no_run_keeps_is_written(run_dir, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    result = runner.invoke(app, ["export", str(run), "--out", str(run / name)])
    assert result.exit_code == 0, result.output
    assert (run / name / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_a_base_checkpoint_file_linked_outside_its_folder_is_not_exported(run_dir, checkpoint, tmp_path, name):
    """The export copies the base checkpoint's loader files (and generate reads them, through the same run's
    profile): one leading out of that folder (a link to a file of another) is refused in one line, before anything is
    written."""
    base, run = tmp_path / "checkpoint", tmp_path / "run"
    shutil.copytree(checkpoint, base)
    shutil.copytree(run_dir, run)
    profile = yaml.safe_load((run / "profile.yaml").read_text())
    profile["model"]["checkpoint"] = str(base)
    (run / "profile.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    secret = tmp_path / "secret.json"
    secret.write_text((base / name).read_text() if (base / name).exists() else "{}")
    (base / name).unlink(missing_ok=True)
    (base / name).symlink_to(secret)
    assert_refused_in_one_line([str(run)], tmp_path / "out", f"{run / 'profile.yaml'}: model.checkpoint "
                               f"({str(base)!r}): {base / name}: leads outside the checkpoint folder {base} (a "
                               f"symlink to {secret}); a checkpoint's files must lie inside it")


@pytest.mark.parametrize("summary, line", [
    (None, "{run}: the run has not finished (no summary.json or no adapter/adapter_model.safetensors)"),
    ("{", "{run}/summary.json: not readable as the run's summary ("),
    ("[1, 2]", "{run}/summary.json: not readable as the run's summary (a JSON list, not an object)"),
    ("\udcff", "{run}/summary.json: not readable as the run's summary ("),
], ids=["missing", "cut-short", "a-list", "not-utf8"])  # fmt: skip
@pytest.mark.parametrize("command", ["export", "generate"])
def test_export_and_generate_take_one_rule_for_summary_json(lora_run_dir, tmp_path, summary, line, command):
    """A run without summary.json did not finish (it is written last, also when a signal stops a run); a damaged one
    is named, where it was read as empty (export went on; generate said 'its final step')."""
    run = tmp_path / "run"
    shutil.copytree(lora_run_dir, run)
    (run / "summary.json").unlink()
    if summary is not None:
        (run / "summary.json").write_bytes(summary.encode("utf-8", "surrogateescape"))
    args = ["--merge", "--out", str(tmp_path / "out")] if command == "export" else ["--prompt", "x"]
    result = runner.invoke(app, [command, str(run), *args])
    assert result.exit_code == 2, result.output
    expected = line.format(run=run)
    if summary is None and command == "generate":
        expected = f"{run}: no summary.json: the run did not finish"
    (got,) = result.stderr.splitlines()
    assert got.startswith(f"error: {expected}"), got
    assert not (tmp_path / "out").exists()
