"""The README's first command, as a user runs it: `moe-tune finetune profiles/tiny.yaml`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The first losses of profiles/tiny.yaml on the CI machine kind (x86-64 CPU, torch 2.13.0+cpu, fp32), recorded
# 2026-11-30 after the linear attention's conv init became transformers' (engine/model/attention.py,
# init_token_mixer). Other CPUs may round differently; the tolerance allows for that, not for a change in the math.
TINY_FIRST_LOSSES = [5.581572, 5.564034, 5.520739, 5.450155, 5.380165, 5.287124, 5.135157, 4.989759, 4.824519, 4.631061]


# Steps of the shipped profile's run here: its 300 take minutes on CI's 2 cores, and the first losses do not depend
# on the step count (they fall in the linear warm-up, whose length is the profile's).
TINY_STEPS = 60


@pytest.mark.slow
def test_tiny_profile_learns_and_writes_everything(tmp_path, child_env):
    out = tmp_path / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", str(REPO / "profiles" / "tiny.yaml"), "--set", f"output.dir={out}",
         "--set", f"train.steps={TINY_STEPS}"],
        capture_output=True, text=True, timeout=600, env=child_env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, TINY_STEPS + 1))
    assert losses[:10] == pytest.approx(TINY_FIRST_LOSSES, rel=1e-4)
    assert losses[-1] <= losses[0] / 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == losses[-1] and summary["last_step"] == TINY_STEPS
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoints" / f"step-{TINY_STEPS:07d}" / "trainer_state.json").is_file()
    # The command tells the user where everything went.
    for label in ("metrics:", "checkpoint:", "adapter:", "ds config:"):
        assert label in proc.stdout


@pytest.mark.slow
def test_tiny_vl_profile_learns_from_pictures(tmp_path, child_env):
    """profiles/tiny-vl.yaml as shipped: generated pictures of coloured shapes; the loss drops visibly."""
    out = tmp_path / "tiny-vl"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", str(REPO / "profiles" / "tiny-vl.yaml"), "--quiet",
         "--set", f"output.dir={out}"],
        capture_output=True, text=True, timeout=900, env=child_env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 200
    assert sum(losses[-10:]) / 10 <= sum(losses[:10]) / 10 / 4
    pictures = sorted((out / "generated-data").glob("*.png"))
    assert len(pictures) == 600
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert any("merger_fc1" in m for m in adapter["modules_to_save"])
