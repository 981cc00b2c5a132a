"""engine/train/ds_sync_free.py: DeepSpeed's ZeRO stage 1/2 norm and clip helpers without host round trips give
DeepSpeed's values bit for bit, valid and invalid norms alike; the gradient norm in one foreach call gives DeepSpeed's
to fp64 rounding. (That a step then waits for the GPU nowhere in
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
    assert stage_1_and_2.DeepSpeedZeroOptimizer.get_grad_norm_direct is ds_sync_free.get_grad_norm_direct
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


ORIGINAL_NORM = ds_sync_free.ORIGINALS["get_grad_norm_direct"]


def _norm_optimizer(model_parallel_rank: int = 0):
    return types.SimpleNamespace(
        model_parallel_rank=model_parallel_rank,
        device=torch.device("cpu"),
        dp_process_group=None,
        _model_parallel_all_reduce=lambda tensor, op: None,
    )


def _grads_and_params(dtype: torch.dtype, poison: float | None = None):
    """Gradients of odd sizes (one DeepSpeed alignment padding, one pipeline-replicated and one model-parallel
    parameter among them) and their parameters."""
    gen = torch.Generator().manual_seed(1)
    sizes = [37, 1, 4096, 5, 768, 3]
    grads = [(torch.randn(n, generator=gen) * 10 ** (i - 2)).to(dtype) for i, n in enumerate(sizes)]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    params[1].ds_pipe_replicated = True
    params[2].model_parallel = True
    padding = torch.zeros(8, dtype=dtype)
    padding._zero_padding = True
    if poison is not None:
        grads[3][2] = poison
    # DeepSpeed's loop zips the gradients without padding against the parameters.
    return grads[:3] + [padding] + grads[3:], params


@pytest.fixture
def no_collectives(monkeypatch):
    from deepspeed.runtime.zero import stage_1_and_2

    monkeypatch.setattr(stage_1_and_2.dist, "all_reduce", lambda *args, **kwargs: None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model_parallel_rank", [0, 1])
def test_grad_norm_matches_deepspeed(no_collectives, dtype, model_parallel_rank):
    grads, params = _grads_and_params(dtype)
    optimizer = _norm_optimizer(model_parallel_rank)
    ours = ds_sync_free.get_grad_norm_direct(optimizer, grads, params)
    theirs = ORIGINAL_NORM(optimizer, grads, params)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=0)
    # What the norm counts, independently: no padding, no pipeline-replicated parameter, the model-parallel one on
    # every model-parallel rank and the rest on rank 0 only.
    counted = [grads[0], grads[2], grads[4], grads[5], grads[6]] if model_parallel_rank == 0 else [grads[2]]
    expected = torch.sqrt(sum(g.double().pow(2).sum() for g in counted)).float()
    torch.testing.assert_close(ours, expected, rtol=1e-7, atol=0)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_grad_norm_invalid_is_minus_one_as_deepspeed(no_collectives, poison):
    grads, params = _grads_and_params(torch.bfloat16, poison)
    optimizer = _norm_optimizer()
    ours = ds_sync_free.get_grad_norm_direct(optimizer, grads, params)
    assert ours.item() == ORIGINAL_NORM(optimizer, grads, params).item() == -1.0


def test_grad_norm_of_nothing_and_other_norm_types(no_collectives):
    optimizer = _norm_optimizer()
    assert ds_sync_free.get_grad_norm_direct(optimizer, [], []).item() == 0.0
    grads, params = _grads_and_params(torch.float32)
    # The infinity norm is DeepSpeed's own code path.
    assert torch.equal(
        ds_sync_free.get_grad_norm_direct(optimizer, grads, params, norm_type=float("inf")),
        ORIGINAL_NORM(optimizer, grads, params, norm_type=float("inf")),
    )
