"""`moe-tune onboard DIR`: the whole report (mapping, plan, one training step, align) and its JSON, exit 0; an
unsupported checkpoint listed line by line, exit 2 and no traceback; bad options, exit 2."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app

from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path_factory.mktemp("onboard") / "qwen3_moe")


def test_supported_checkpoint_onboards_with_every_section_and_exits_0(checkpoint, tmp_path):
    out = tmp_path / "reports" / "onboard.json"
    result = runner.invoke(app, ["onboard", str(checkpoint), "--steps", "1", "--devices", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for line in ("mapping  ok", "plan  ok", "profile  ok", "align  ok", "reference: no CUDA device",
                 "suggested: parallel.expert_parallel", "aligned: within tolerance",
                 "onboarded: every layer maps, runs and aligns"):
        assert line in text, line
    report = json.loads(out.read_text())
    assert [p.name for p in out.parent.iterdir()] == ["onboard.json"]  # written atomically: no temporary left
    assert report["exit_code"] == 0 and report["model_type"] == "qwen3_moe"
    assert [layer["index"] for layer in report["layers"]] == [0, 1, 2]
    assert [layer["mlp"] for layer in report["layers"]] == ["dense", "moe", "moe"]
    assert all(op["path"] in ("kernel", "reference", "torch") for layer in report["layers"] for op in layer["ops"])
    assert report["plan"]["result"]["devices"] == 4
    profile = report["profile"]["result"]
    assert profile["steps"] == 1 and profile["warmup_steps"] == 1 and profile["device"] == "cpu"
    assert profile["step_times_s"][0] > 0 and profile["peak_memory_bytes"] > 0
    assert profile["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert report["align"]["result"]["passed"]


def test_unsupported_checkpoint_exits_2_listing_it_without_traceback(tmp_path, child_env):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(llama))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "moe_tune", "onboard", str(llama), "--json", str(out)],
                          capture_output=True, text=True, env=child_env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"error: {llama}: 30 things moe-tune does not map" in proc.stderr
    for line in ("config.json: model_type ('llama') is not mapped", "config.json: intermediate_size (48) is not mapped",
                 "module not mapped: model.layers.*.mlp.up_proj.weight", "not supported:"):
        assert line in proc.stdout, line
    report = json.loads(out.read_text())
    assert report["exit_code"] == 2 and len(report["unsupported"]) == 30
    assert report["align"]["status"] == "skipped"


def test_json_on_a_file_of_the_checkpoint_is_refused_before_anything_runs(checkpoint):
    config = (checkpoint / "config.json").read_bytes()
    result = runner.invoke(app, ["onboard", str(checkpoint), "--json", str(checkpoint / "config.json")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --json ({str(checkpoint / 'config.json')!r}) is a file of the checkpoint folder DIR: the report would "
        "overwrite it; name another file"]  # fmt: skip
    assert (checkpoint / "config.json").read_bytes() == config and "mapping" not in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "error: --devices ('0') must be an integer from 1 to"),
        (["--devices", "two"], "error: --devices ('two') must be an integer from 1 to"),
        (["--device-memory", "lots"], "error: --device-memory ('lots') must look like 141GB"),
        (["--json", "/"], "error: --json ('/') is a folder: name a file to write"),
    ],
)
def test_bad_options_exit_2(args, message, checkpoint):
    result = runner.invoke(app, ["onboard", str(checkpoint), *args])
    assert result.exit_code == 2
    assert message in result.stderr


@pytest.mark.parametrize("where, reason", [
    ("/proc/report.json", "no file can be created in '/proc' (No such file or directory)"),
    ("/proc/reports/report.json", "no folder can be created in '/proc' (No such file or directory)"),
    ("{tmp}/file/report.json", "'{tmp}/file' is not a folder"),
], ids=["in-proc", "new-folder-in-proc", "under-a-file"])  # fmt: skip
def test_a_json_that_cannot_be_written_is_refused_before_anything_runs(checkpoint, tmp_path, where, reason):
    """The report is written at the end of a run of minutes (a real checkpoint's steps and alignment): a --json the
    OS refuses is said first."""
    (tmp_path / "file").write_text("mine")
    json_out = where.format(tmp=tmp_path)
    result = runner.invoke(app, ["onboard", str(checkpoint), "--json", json_out])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: --json ({json_out!r}): {reason.format(tmp=tmp_path)}"]
    assert result.stdout == "" and (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("make", ["missing", "file", "no-config"])
def test_not_a_checkpoint_folder_exits_2(make, tmp_path):
    target = tmp_path / "target"
    if make == "file":
        target.write_text("x")
    elif make == "no-config":
        target.mkdir()
    result = runner.invoke(app, ["onboard", str(target)])
    assert result.exit_code == 2
    assert f"error: DIR ('{target}') must be a checkpoint folder with a config.json" in result.stderr
