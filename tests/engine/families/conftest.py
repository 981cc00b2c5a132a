"""Tiny Hugging Face checkpoints built offline with transformers (random weights, nothing downloaded).

Every parameter is perturbed so that conventions hide nothing: (1 + w) norms and correction biases are far from
zero, and router weights are scaled up so the top-k choice has large margins (routing flips would otherwise
dominate any mismatch).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROUTER_SUFFIXES = ("mlp.gate.weight", "router.weight", "gate.weight")


def perturb_(model: torch.nn.Module, seed: int = 0, scale: float = 0.1, router_gain: float = 20.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype)
            if param.dim() == 1:
                param.add_(noise * scale)  # norms, biases, decay parameters: off their neutral init
            else:
                param.add_(noise * scale * param.float().std().clamp_min(0.02).item())
            if name.endswith(ROUTER_SUFFIXES) and param.dim() == 2:
                param.mul_(router_gain)
        for name, buf in model.named_buffers():
            if "correction_bias" in name:
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)


def save_tiny_checkpoint(model: torch.nn.Module, directory: Path, seed: int = 0) -> Path:
    """Perturb `model` (a transformers model in fp32) and save it in the hub layout under `directory`."""
    perturb_(model, seed)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """`tiny_checkpoint(model)` -> directory of the saved, perturbed checkpoint."""

    def make(model: torch.nn.Module, seed: int = 0) -> Path:
        return save_tiny_checkpoint(model, tmp_path / "checkpoint", seed)

    return make
