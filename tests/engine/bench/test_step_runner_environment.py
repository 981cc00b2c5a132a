"""`moe-tune profile` and onboard's timed steps (StepRunner) set the single-process environment before DeepSpeed is
imported, as finetune does: DeepSpeed picks its accelerator at import and, unset on a machine without CUDA, says so
on stderr in a warning a user cannot act on."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_a_step_runner_imports_deepspeed_with_its_accelerator_set(child_env):
    code = ("import os\n"
            "from moe_tune.engine.bench.steps import StepRunner\n"
            "from moe_tune.profiles import load_profile\n"
            "StepRunner(load_profile('tiny'))\n"
            "print(os.environ['DS_ACCELERATOR'])\n")  # fmt: skip
    env = {key: value for key, value in child_env.items() if key != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cpu"]
    assert "Setting accelerator" not in proc.stderr, proc.stderr[-3000:]
