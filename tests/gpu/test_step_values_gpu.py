"""A step's values on their way to the host (engine/train/step_values.py) on CUDA: read as the device tensors hold
them when they were taken, and read without waiting for the work queued after them. Run with pytest -m gpu tests/gpu."""

import pytest
import torch

from moe_tune.engine.train.step_values import StepValues

pytestmark = pytest.mark.gpu


def test_values_are_read_as_taken_without_waiting_for_later_work():
    x = torch.randn(4096, 4096, device="cuda")
    loss = x[0, 0] * 2
    loads = x[:2, :3].clone()
    expected = {"loss": loss.item(), "loads": loads.double().tolist(), "count": 5.0, "host": [1.0, 2.0]}
    values = StepValues({"loss": loss, "loads": loads, "count": 5, "host": torch.tensor([1, 2])})
    # Changed after they were taken: the read sees the values of that moment.
    loads.add_(1.0)
    # Far more work queued behind the copy than a read takes (fp32 GEMMs of 137 GFLOP each).
    for _ in range(100):
        x = x @ x / 64.0
    queued = torch.cuda.Event()
    queued.record()
    read = values.read()
    assert not queued.query(), "the read waited for the work queued after the values"
    assert read == expected
    torch.cuda.synchronize()
