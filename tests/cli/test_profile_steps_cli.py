"""`moe-tune profile PROFILE`: real training steps of a profile on the CPU, the memory metrics, one-line errors."""

import json

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli.profile import app
from moe_tune.engine.bench.steps import RESULT_KEYS

runner = CliRunner()

# A few seconds on 2 cores: one packed row of 32 tokens, one warm-up step and one timed step.
TINY_STEPS = ["--steps", "1", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=1",
              "--set", "data.corpus_documents=50"]  # fmt: skip


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_profile_runs_steps_and_reports_the_memory_metrics(tmp_path):
    out = tmp_path / "steps.json"
    memory = ["--set", "memory.preset=max-context", "--set", "memory.min_offload_mb=0"]
    result = runner.invoke(app, ["tiny", *TINY_STEPS, *memory, "--set", f"output.dir={tmp_path}", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for label in ("tokens/s", "step latency", "peak memory", "saved in host memory", "recomputed", "cache hit rate",
                  "swap host -> GPU", "backward waited for swap-in"):  # fmt: skip
        assert label in result.stdout
    data = json.loads(out.read_text())
    assert list(data) == list(RESULT_KEYS)
    assert data["steps"] == 1 and data["tokens_per_s"] > 0 and data["step_time_s"] > 0
    assert data["memory_policy"].startswith("max-context: linear=offload")
    memory_metrics = data["memory"]
    assert memory_metrics["host_saved_bytes"] > 0 and memory_metrics["recomputations"] > 0
    assert memory_metrics["cache_hit_rate"] == 1.0 and memory_metrics["h2d_gb_per_s"] > 0
    # Nothing of a training run is written: the profile command only measures.
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_bad_memory_setting_is_one_line_exit_2():
    result = runner.invoke(app, ["tiny", "--set", "memory.norm=drop"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: memory.norm ('drop'): input should be 'save', 'recompute' or 'offload'"
    ]
