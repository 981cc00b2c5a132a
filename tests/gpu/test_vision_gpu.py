"""The vision model on CUDA: the tower (patch embedding, 2D rotary, attention within each image on SDPA's fused
kernels, merger) gives the CPU's features and gradients in fp32 for images of several grids, odd sides among them;
tiny-vl trains a step on rows of image tokens in bf16 with the CPU's fp32 loss (within bf16's rounding) and finite
gradients on every trainable part of the tower. Run on the GPU machine: pytest -m gpu tests/gpu/test_vision_gpu.py
"""

import copy

import pytest
import torch
from vision_saved import image_row, vision_tower

from moe_tune.engine.model.vision import VisionTower
from moe_tune.engine.train.trainer import build_trainable_model
from moe_tune.profiles import load_profile

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# (t, h, w) patch grids: square, odd sides (an image of 3 x 5 merged tokens), one row of tokens, and a large one.
GRIDS = [[1, 8, 8], [1, 6, 10], [1, 2, 34], [1, 32, 48]]


def test_the_tower_on_cuda_gives_the_cpus_features_and_gradients():
    cfg = load_profile("tiny-vl").model
    torch.manual_seed(0)
    tower = VisionTower(cfg.vision, cfg.hidden_size)
    with torch.no_grad():
        for p in tower.parameters():  # off the init, so that the zero-initialised biases matter
            p.add_(torch.randn_like(p) * 0.05)
    grids = torch.tensor(GRIDS)
    patches = int(grids.prod(1).sum())
    pixels = torch.randn(patches, tower.patch_embed.in_features, generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn(patches // cfg.vision.spatial_merge_size**2, cfg.hidden_size,
                            generator=torch.Generator().manual_seed(2))  # fmt: skip

    def run(module, device):
        module.zero_grad(set_to_none=True)
        out = module(pixels.to(device), grids.to(device))
        (out * cotangent.to(device)).sum().backward()
        return out.detach().cpu(), {name: p.grad.cpu() for name, p in module.named_parameters()}

    expected, expected_grads = run(tower, "cpu")
    got, grads = run(copy.deepcopy(tower).to(DEVICE), DEVICE)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max()
        assert (grad - expected_grads[name]).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize("tower, merger", [("lora", "trained"), ("trained", "lora")])
def test_a_bf16_training_step_on_image_rows(tower, merger):
    job = load_profile("tiny-vl", [f"lora.vision_tower={tower}", f"lora.vision_merger={merger}", "data.seq_len=96",
                                   "train.micro_batch_size=2"])  # fmt: skip
    torch.manual_seed(0)
    model, _ = build_trainable_model(job)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA's B included: every adapter carries signal
                p.add_(torch.randn_like(p) * 0.05)
    expected = model(**image_row(job)).loss.item()
    model = model.to(DEVICE)
    for p in model.parameters():  # as the bf16 engine holds them: parameters in bf16, buffers (rotary) in fp32
        p.data = p.data.to(torch.bfloat16)
    loss = model(**image_row(job, DEVICE, torch.bfloat16)).loss
    loss.backward()
    assert abs(loss.item() - expected) <= 1e-2 * abs(expected)
    trained = {name: p.grad for name, p in vision_tower(model).named_parameters() if p.requires_grad}
    assert trained and all(g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in trained.values())
