"""`moe-tune export RUN_DIR`: exit 0 and the folder named; bad input one line per problem, exit 2, no traceback,
nothing written. (The export's content is tested in tests/engine/test_export_hub.py.)"""

import json

import pytest
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from moe_tune.cli import app

from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

runner = CliRunner()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished full fine-tune's folder, written without training: profile.yaml, summary.json and the weights
    (the checkpoint's own, in our names)."""
    from moe_tune.engine.align.compare import load_ours
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    root = tmp_path_factory.mktemp("export-cli")
    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), root / "checkpoint")
    (root / "data.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    job = resolve_job(validate_profile({
        "name": "export-cli", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(root / "data.jsonl"), "tokenizer": "byte", "seq_len": 32},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "lora": {"enabled": False}, "output": {"dir": str(root / "run")},
    }))
    run = root / "run"
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    model = load_ours(job.model)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(run / "model.safetensors"))
    (run / "summary.json").write_text("{}\n")
    return run


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
        (["{tmp}"], "error: {tmp}: no run here (no profile.yaml; RUN_DIR must be a finetune output.dir)"),
        (["{run}", "--out", "{run}/checkpoints/x"], "error: --out ('{run}/checkpoints/x') lies inside the run's "
         "checkpoints folder"),
        (["{run}", "--out", "{tmp}/busy"], "error: --out ('{tmp}/busy') exists and is not empty"),
        (["{run}", "--max-shard-size", "5XB"], "error: --max-shard-size ('5XB') must be a positive size"),
        (["{run}", "--step", "0"], "error: --step (0) must be >= 1"),
        (["{run}", "--step", "7"], "error: --step 7: no checkpoint {run}/checkpoints/step-"),
    ],
    ids=["no-folder", "no-run", "out-in-checkpoints", "out-not-empty", "shard-size", "step-0", "no-step"],
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
