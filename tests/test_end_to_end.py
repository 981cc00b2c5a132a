"""The README's first command, as a user runs it: `moe-tune finetune profiles/tiny.yaml`.

Its multimodal sibling is in test_end_to_end_vl.py: `--dist loadfile` runs one file on one worker, and these two
minutes-long runs are the last files it hands out (it orders files by their number of tests)."""

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
# on the step count (they fall in the linear warm-up, whose length is the profile's). The loss halves by step 21
# (5.58 -> 2.47 in a run of 60).
TINY_STEPS = 30


def one_thread(env: dict[str, str]) -> dict[str, str]:
    """One intra-op thread: the tests run on two workers on CI's two cores, and a second thread waiting for a busy
    core slows each step of a tiny model many times over."""
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_tiny_profile_learns_and_writes_everything(tmp_path, child_env):
    out = tmp_path / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", str(REPO / "profiles" / "tiny.yaml"), "--set", f"output.dir={out}",
         "--set", f"train.steps={TINY_STEPS}"],
        capture_output=True, text=True, timeout=600, env=one_thread(child_env), cwd=tmp_path,
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
    # The adapter's weights readable as the run's other files (safetensors' save_file alone creates 0o600).
    mode = (out / "summary.json").stat().st_mode & 0o777
    assert {path.name: path.stat().st_mode & 0o777 for path in (out / "adapter").iterdir()} == dict.fromkeys(
        [path.name for path in (out / "adapter").iterdir()], mode)
    assert (out / "checkpoints" / f"step-{TINY_STEPS:07d}" / "trainer_state.json").is_file()
    # The command tells the user where everything went.
    for label in ("metrics:", "checkpoint:", "adapter:", "ds config:"):
        assert label in proc.stdout
