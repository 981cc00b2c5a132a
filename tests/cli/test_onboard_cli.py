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


@pytest.mark.parametrize("channels, worst", [((2e-6, 9e-5, 3e-6), "layer 1"), ((None, None, None), "layer 2")],
                         ids=["per-channel", "older-report"])
def test_the_worst_layer_is_the_one_the_alignment_judges_worst(channels, worst):
    """The align stage's line names the layer with the largest figure the alignment judges: per channel where the
    report has it (a massive activation keeps the whole-tensor figure low), the whole-tensor one otherwise."""
    from rich.console import Console

    from moe_tune.cli.onboard import _print_align
    from moe_tune.engine.onboard import Stage

    rels = (1e-6, 2e-6, 5e-6)
    layers = [{"name": f"layer {i}", "rel": rel, "channel_rel": channel}
              for i, (rel, channel) in enumerate(zip(rels, channels))]
    result = {"layers": layers, "documents": 2, "logits": {"max_abs": 1e-6}, "logits_cosine": 1.0, "kl": 0.0,
              "loss_ours": 1.0, "loss_reference": 1.0, "passed": True}
    console = Console(record=True, width=400)
    _print_align(console, Stage(status="ok", result=result))
    row = next(row for row in layers if row["name"] == worst)
    expected = f"; worst layer {worst} rel {row['rel']:.3e}"
    if row["channel_rel"] is not None:
        expected += f", per channel {row['channel_rel']:.3e}"
    assert console.export_text().splitlines()[0].endswith(expected)
