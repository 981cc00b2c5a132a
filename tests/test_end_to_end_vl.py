"""The multimodal profile as a user runs it: `moe-tune finetune profiles/tiny-vl.yaml` (a file of its own beside
test_end_to_end.py, so that `--dist loadfile` may run the two on both workers)."""

import json
import re
import subprocess
import sys

import pytest
from test_end_to_end import REPO, one_thread


@pytest.mark.slow
def test_tiny_vl_profile_learns_from_pictures(tmp_path, child_env):
    """profiles/tiny-vl.yaml as shipped: generated pictures of coloured shapes; the loss drops visibly."""
    out = tmp_path / "tiny-vl"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", str(REPO / "profiles" / "tiny-vl.yaml"), "--quiet",
         "--set", f"output.dir={out}"],
        capture_output=True, text=True, timeout=900, env=one_thread(child_env), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 200
    assert sum(losses[-10:]) / 10 <= sum(losses[:10]) / 10 / 4
    pictures = sorted((out / "generated-data").glob("*.png"))
    assert len(pictures) == 600
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert any("merger_fc1" in m for m in adapter["modules_to_save"])
    # Asked about a picture as the corpus asks, the trained run answers in the corpus's form.
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "generate", str(out), "--image", str(pictures[0]), "--prompt",
         "What is in the picture?", "--max-new-tokens", "24"],
        capture_output=True, text=True, timeout=300, env=one_thread(child_env), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"A (red|green|blue|yellow) (circle|square|triangle)\.\n+", proc.stdout), proc.stdout
    assert re.search(r"^images: 1 \(\d+ image tokens\)$", proc.stderr, re.MULTILINE), proc.stderr
