"""The linear-attention kernels' GPU launch choices that depend on the installed Triton."""

import dataclasses
import types

import pytest
import triton

from moe_tune.ops.linear_attention.kernels_common import (
    GPU_NUM_STAGES_OUTPUT,
    GPU_NUM_WARPS_OUTPUT,
    TRITON_37_OUTPUT_LAUNCH,
    pick_config,
    triton_version,
)

ON_GPU = types.SimpleNamespace(is_cuda=True)
MEASURED_36 = (GPU_NUM_WARPS_OUTPUT, GPU_NUM_STAGES_OUTPUT)


@pytest.mark.parametrize(
    "version, launch",
    [("3.6.0", MEASURED_36), ("3.5.1", MEASURED_36), ("3.7.0", TRITON_37_OUTPUT_LAUNCH),
     ("3.7.1", TRITON_37_OUTPUT_LAUNCH), ("3.10.2", TRITON_37_OUTPUT_LAUNCH), ("4.0.0", TRITON_37_OUTPUT_LAUNCH)],
)  # fmt: skip
def test_per_head_output_launch_follows_the_triton_version(monkeypatch, version, launch):
    """Triton 3.7 and later take the output launch that computes right there; earlier ones keep the measured one;
    nothing else in the launch configuration moves."""
    monkeypatch.setattr(triton, "__version__", version)
    config = pick_config(ON_GPU)
    assert (config.num_warps_output, config.num_stages_output) == launch
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    base = pick_config(ON_GPU)
    moved = dict(num_warps_output=0, num_stages_output=0)
    assert dataclasses.replace(config, **moved) == dataclasses.replace(base, **moved)


def test_version_is_read_as_numbers(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.10.2+git1234")
    assert triton_version() == (3, 10)
    assert TRITON_37_OUTPUT_LAUNCH != MEASURED_36
