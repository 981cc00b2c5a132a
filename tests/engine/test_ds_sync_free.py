"""engine/train/ds_sync_free.py: DeepSpeed's ZeRO stage 1/2 norm and clip helpers without host round trips give
DeepSpeed's values bit for bit, valid and invalid norms alike. (That a step then waits for the GPU nowhere in
them is checked on the GPU: tests/gpu/test_host_syncs_gpu.py.)"""

import types

import deepspeed
import pytest
import torch

from moe_tune.engine.train import ds_sync_free

ds_sync_free.install()
ORIGINAL_MASK = ds_sync_free.ORIGINALS["mask_nan_or_inf_with_val_inplace"]
ORIGINAL_CLIP = ds_sync_free.ORIGINALS["unscale_and_clip_grads"]


def test_install_replaced_deepspeeds_helpers():
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    assert stage_1_and_2.mask_nan_or_inf_with_val_inplace is ds_sync_free.mask_nan_or_inf_with_val_inplace
    assert stage3.mask_nan_or_inf_with_val_inplace is ds_sync_free.mask_nan_or_inf_with_val_inplace
    assert stage_1_and_2.DeepSpeedZeroOptimizer.unscale_and_clip_grads is ds_sync_free.unscale_and_clip_grads
    assert ORIGINAL_CLIP is not ds_sync_free.unscale_and_clip_grads


def test_mask_matches_deepspeed():
    values = torch.tensor([2.5, float("inf"), float("nan"), -float("inf"), 0.0, -3.0])
    ours, theirs = values.clone(), values.clone()
    ds_sync_free.mask_nan_or_inf_with_val_inplace(ours, device="cpu")
    ORIGINAL_MASK(theirs, device="cpu")
    assert torch.equal(ours, theirs) and ours.tolist() == [2.5, -1.0, -1.0, -1.0, 0.0, -3.0]


@pytest.mark.parametrize("norm", [3.75, 0.5, 1.0, 1e-12, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("clip_grad, loss_scale", [(1.0, 1.0), (0.3, 1.0), (1.0, 1024.0), (0.0, 8.0)])
def test_clip_matches_deepspeed_bitwise(norm, clip_grad, loss_scale):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, generator=gen), [torch.randn(5, generator=gen), torch.randn(11, generator=gen)]]
    flat = lambda gs: [g.clone() if torch.is_tensor(g) else [p.clone() for p in g] for g in gs]  # noqa: E731
    ours, theirs = flat(grads), flat(grads)
    optimizer = types.SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device=torch.device("cpu"))
    ds_sync_free.unscale_and_clip_grads(optimizer, ours, torch.tensor(norm))
    ORIGINAL_CLIP(optimizer, theirs, torch.tensor(norm))
    leaves = lambda gs: [t for g in gs for t in ([g] if torch.is_tensor(g) else g)]  # noqa: E731
    for a, b in zip(leaves(ours), leaves(theirs), strict=True):
        assert torch.equal(a, b)
    if clip_grad > 0 and not (norm >= 0 and norm != float("inf")):
        # An invalid norm zeroes the update, as in DeepSpeed.
        assert all(torch.equal(t, torch.zeros_like(t)) for t in leaves(ours))


def test_install_refuses_another_deepspeed(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match=r"^deepspeed 0\.20\.0: .* checked against 0\.19\.8 only"):
        ds_sync_free.install()
