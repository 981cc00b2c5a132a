"""What the vision tower (engine/model/vision.py) keeps for backward, measured: shared by tests/engine/test_plan.py (on
the CPU) and tests/gpu/test_plan_vision_gpu.py (on a CUDA device), which compare it with engine/plan.py's
vision_activation_bytes.

A row of image tokens only (the plan's worst case: P = T m^2 patches for T tokens), the model built as the trainer
builds it (LoRA injected, or the frozen vision parts frozen), one forward and backward; the tensors autograd saves while
the tower's forward runs, each storage once, parameters and buffers left out.

The tower's attention runs on SDPA's fused kernels (flash, or memory-efficient), on the CPU as on CUDA: they keep q,
k, v, the output and the log-sum-exp per head, which the plan counts.

Shapes: T tokens, P patches, m spatial merge size, L patches of one image, hv heads of dim hd.
"""

from __future__ import annotations

import torch

from moe_tune.engine.model.vision import VisionTower
from moe_tune.engine.plan import vision_patches

# Merged tokens a side of each whole image in the row: images of 8 x 8 text tokens (8m x 8m patches).
IMAGE_SIDE_TOKENS = 8


def image_grids(num_tokens: int, merge: int) -> torch.Tensor:
    """(t, h, w) patch grids [I, 3] of images whose merged tokens number num_tokens: whole images of
    IMAGE_SIDE_TOKENS x IMAGE_SIDE_TOKENS tokens, and one narrower image for the rest."""
    side = IMAGE_SIDE_TOKENS
    whole, rest = divmod(num_tokens, side * side)
    grids = [[1, side * merge, side * merge]] * whole + ([[1, merge, rest * merge]] if rest else [])
    return torch.tensor(grids)


def image_row(job, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Model inputs of one micro-batch whose T tokens are all image tokens: input_ids, labels [1, T], cu_seqlens,
    pixel_values [P, C Tp p^2] and image_grid_thw [I, 3], P = vision_patches(job)."""
    spec = job.model.vision
    num_tokens = vision_patches(job) // spec.spatial_merge_size**2
    grids = image_grids(num_tokens, spec.spatial_merge_size)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grids.prod(1).sum()), spec.in_channels * spec.temporal_patch_size * spec.patch_size**2,
                         generator=generator)  # fmt: skip
    ids = torch.full((1, num_tokens), spec.image_token_id, device=device)
    return {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, num_tokens], dtype=torch.int32,
            device=device), "pixel_values": pixels.to(device, dtype), "image_grid_thw": grids.to(device)}  # fmt: skip


def vision_tower(model) -> VisionTower:
    (tower,) = [m for m in model.modules() if isinstance(m, VisionTower)]
    return tower


class SavedStorages:
    """The distinct storages autograd saves while the vision tower's forward runs (parameters, buffers and storages
    on another device than the tower's left out): bytes by storage."""

    def __init__(self, model):
        self.tower = vision_tower(model)
        device = next(self.tower.parameters()).device
        self.device = device
        self.excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.by_storage: dict[int, int] = {}
        self.inside = False
        self.handles = [self.tower.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)),
                        self.tower.register_forward_hook(lambda *_: setattr(self, "inside", False))]  # fmt: skip

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if self.inside and tensor.device == self.device and storage.data_ptr() not in self.excluded:
            self.by_storage[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    @property
    def total(self) -> int:
        return sum(self.by_storage.values())


def measure_saved_vision(model, inputs: dict) -> SavedStorages:
    """The distinct storages the vision tower saves for backward in one forward of `inputs` (.total: their bytes);
    the backward then runs, so the saved tensors are the ones a training step uses."""
    saved = SavedStorages(model)
    with saved.hooks():
        out = model(**inputs)
    for handle in saved.handles:
        handle.remove()
    out.loss.backward()
    return saved
