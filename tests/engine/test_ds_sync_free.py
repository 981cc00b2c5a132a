"""engine/train/ds_sync_free.py: DeepSpeed's ZeRO stage 1/2 norm and clip helpers without host round trips give
DeepSpeed's values bit for bit, valid and invalid norms alike; the gradient norm in one foreach call gives DeepSpeed's
to fp64 rounding; the gradients' reduction over one rank is skipped only where it is the identity, with DeepSpeed's
values bit for bit, in a whole training step too. (That a step then waits for the GPU nowhere in
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
    assert stage_1_and_2.DeepSpeedZeroOptimizer.allreduce_no_retain is ds_sync_free.allreduce_no_retain
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


ORIGINAL_ALLREDUCE = ds_sync_free.ORIGINALS["allreduce_no_retain"]


class _Collectives:
    """stage_1_and_2's dist over a group of `world_size` ranks, this one `rank`: the all-reduce counted and left
    as the identity (one rank's all-reduce; over more, a stand-in whose count says DeepSpeed's code ran)."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank, self.all_reduces = world_size, rank, 0

    def install(self, monkeypatch) -> None:
        from deepspeed.runtime.zero import stage_1_and_2

        monkeypatch.setattr(stage_1_and_2.dist, "get_world_size", lambda group=None: self.world_size)
        monkeypatch.setattr(stage_1_and_2.dist, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(stage_1_and_2.dist, "get_global_rank", lambda group, rank: rank)
        monkeypatch.setattr(stage_1_and_2.dist, "all_reduce", lambda *args, **kwargs: self._count())
        monkeypatch.setattr(stage_1_and_2.dist, "reduce", lambda *args, **kwargs: self._count())

    def _count(self) -> None:
        self.all_reduces += 1


def _reduce_optimizer(overlap_comm: bool = False, sequence_parallel_size: int = 1):
    """What DeepSpeedZeroOptimizer.allreduce_no_retain reads of its optimizer, its own methods bound to it."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    optimizer = types.SimpleNamespace(
        dp_process_group=None, overlap_comm=overlap_comm, sequence_parallel_size=sequence_parallel_size,
        gradient_average=True, flatten=_flatten_dense_tensors, unflatten=_unflatten_dense_tensors,
        _add_to_grad_partition_buffer=DeepSpeedZeroOptimizer._add_to_grad_partition_buffer,
    )  # fmt: skip
    for name in ("allreduce_and_copy", "allreduce_bucket"):
        setattr(optimizer, name, types.MethodType(getattr(DeepSpeedZeroOptimizer, name), optimizer))
    return optimizer


def _bucket(dtype: torch.dtype, with_outputs: bool):
    """Gradients of odd sizes in `dtype` (one of them a non-contiguous view), and fp32 partition outputs holding
    earlier sums when `with_outputs`."""
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(n, generator=gen) * 3 ** i).to(dtype) for i, n in enumerate((37, 1, 513))]
    grads.append((torch.randn(6, 5, generator=gen) / 7).to(dtype).t())
    outputs = [torch.randn(g.shape, generator=gen) for g in grads] if with_outputs else None
    return grads, outputs


def _reduce(fn, dtype, communication_dtype, with_outputs, collectives, monkeypatch, **kwargs):
    collectives.install(monkeypatch)
    grads, outputs = _bucket(dtype, with_outputs)
    pointers = [g.data_ptr() for g in grads]
    fn(_reduce_optimizer(**kwargs.pop("optimizer", {})), grads, communication_dtype, output_bucket=outputs, **kwargs)
    return grads, outputs, pointers


@pytest.mark.parametrize("dtype, communication_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.float32, torch.float32), (torch.float32, torch.float64),
])  # fmt: skip
@pytest.mark.parametrize("with_outputs", [False, True])
@pytest.mark.parametrize("divide, rank", [(True, None), (False, 0)])
def test_one_rank_reduction_skipped_with_deepspeeds_values(monkeypatch, dtype, communication_dtype, with_outputs,
                                                            divide, rank):  # fmt: skip
    """One rank: no all-reduce and every gradient left where backward put it, with DeepSpeed's values bit for bit
    (the gradients and the partition outputs they are added to)."""
    ours, theirs = _Collectives(1), _Collectives(1)
    args = (dtype, communication_dtype, with_outputs)
    grads, outputs, pointers = _reduce(ds_sync_free.allreduce_no_retain, *args, ours, monkeypatch, divide=divide,
                                       rank=rank)  # fmt: skip
    expected_grads, expected_outputs, _ = _reduce(ORIGINAL_ALLREDUCE, *args, theirs, monkeypatch, divide=divide,
                                                  rank=rank)  # fmt: skip
    assert (ours.all_reduces, theirs.all_reduces) == (0, 1)
    assert [g.data_ptr() for g in grads] == pointers
    for a, b in zip(grads, expected_grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(outputs or [], expected_outputs or [], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["two ranks", "narrower communication dtype", "fp16 through bf16",
                                  "overlapped communication", "sequence parallel"])  # fmt: skip
def test_reduction_that_is_not_the_identity_is_deepspeeds(monkeypatch, case):
    """Wherever the all-reduce could change a value (more ranks, rounding through the communication dtype, a
    sequence-parallel average) or runs on its own stream, DeepSpeed's code runs and gives its values."""
    dtype, communication_dtype, world_size, optimizer = torch.float32, torch.float32, 1, {}
    if case == "two ranks":
        world_size = 2
    elif case == "narrower communication dtype":
        communication_dtype = torch.bfloat16
    elif case == "fp16 through bf16":
        dtype, communication_dtype = torch.float16, torch.bfloat16
    elif case == "overlapped communication":
        optimizer = dict(overlap_comm=True)
    else:
        optimizer = dict(sequence_parallel_size=2)
    ours, theirs = _Collectives(world_size), _Collectives(world_size)
    if case == "overlapped communication":
        # The overlapped path waits on DeepSpeed's reduction stream and clears earlier grads: DeepSpeed's own
        # code is asked for, which is all this case checks.
        calls = []
        monkeypatch.setitem(ds_sync_free.ORIGINALS, "allreduce_no_retain", lambda *args, **kwargs: calls.append(1))
        _reduce(ds_sync_free.allreduce_no_retain, dtype, communication_dtype, True, ours, monkeypatch,
                optimizer=optimizer)  # fmt: skip
        assert calls == [1]
        return
    args = (dtype, communication_dtype, True)
    grads, outputs, _ = _reduce(ds_sync_free.allreduce_no_retain, *args, ours, monkeypatch, optimizer=optimizer)
    expected_grads, expected_outputs, _ = _reduce(ORIGINAL_ALLREDUCE, *args, theirs, monkeypatch, optimizer=optimizer)
    assert ours.all_reduces == theirs.all_reduces == 1
    for a, b in zip([*grads, *outputs], [*expected_grads, *expected_outputs], strict=True):
        assert torch.equal(a, b)
    if case in ("narrower communication dtype", "fp16 through bf16", "sequence parallel"):
        # The values do change there: skipping would have been wrong.
        fresh, _ = _bucket(dtype, True)
        assert any(not torch.equal(a, b) for a, b in zip(grads, fresh, strict=True))


def test_reduce_to_another_rank_leaves_this_ranks_tensors(monkeypatch):
    """A reduce whose destination is not this rank copies nothing back and adds nothing, as DeepSpeed's."""
    collectives = _Collectives(1)
    grads, outputs, _ = _reduce(ds_sync_free.allreduce_no_retain, torch.float32, torch.float32, True, collectives,
                                monkeypatch, rank=1)  # fmt: skip
    expected_grads, expected_outputs, _ = _reduce(ORIGINAL_ALLREDUCE, torch.float32, torch.float32, True,
                                                  _Collectives(1), monkeypatch, rank=1)  # fmt: skip
    fresh_grads, fresh_outputs = _bucket(torch.float32, True)
    assert collectives.all_reduces == 0
    for a, b, c in zip([*grads, *outputs], [*expected_grads, *expected_outputs], [*fresh_grads, *fresh_outputs],
                       strict=True):  # fmt: skip
        assert torch.equal(a, b) and torch.equal(a, c)


def _two_steps(tmp_path, name: str):
    """Two ZeRO-1 steps of the tiny profile in one process: the losses and the trainable weights after them."""
    from moe_tune.engine.bench.steps import StepRunner
    from moe_tune.profiles import load_profile

    overrides = [f"output.dir={tmp_path / name}", "train.steps=2", "train.warmup_steps=0", "data.seq_len=64",
                 "data.corpus_documents=50", "parallel.zero_stage=1"]
    profile = load_profile("tiny", overrides)
    runner = StepRunner(profile)
    try:
        losses = [runner.step()["loss"] for _ in range(2)]
        weights = {n: p.detach().clone() for n, p in runner.engine.module.named_parameters() if p.requires_grad}
    finally:
        runner.close()
    return losses, weights


def test_one_rank_training_steps_equal_deepspeeds_reduction(tmp_path, monkeypatch):
    """A whole ZeRO-1 step on one rank (the path every single-GPU run takes) without the reduction trains exactly as
    with DeepSpeed's: the same losses and the same weights bit for bit, and DeepSpeed's reduction was skipped."""
    from deepspeed.runtime.zero import stage_1_and_2

    # Each run's set-up installs ds_sync_free's helpers (engine/train/distributed.py): the module's name is what
    # it installs.
    original, replacement = ds_sync_free.ORIGINALS["allreduce_no_retain"], ds_sync_free.allreduce_no_retain
    ours_calls, theirs_calls = [], []
    # Put back after the test, whatever the runs' set-ups install.
    monkeypatch.setattr(stage_1_and_2.DeepSpeedZeroOptimizer, "allreduce_no_retain", replacement)
    monkeypatch.setitem(ds_sync_free.ORIGINALS, "allreduce_no_retain",
                        lambda *args, **kwargs: theirs_calls.append(1) or original(*args, **kwargs))  # fmt: skip
    monkeypatch.setattr(ds_sync_free, "allreduce_no_retain",
                        lambda *args, **kwargs: ours_calls.append(1) or replacement(*args, **kwargs))  # fmt: skip
    ours = _two_steps(tmp_path, "ours")
    assert ours_calls and not theirs_calls
    monkeypatch.setattr(ds_sync_free, "allreduce_no_retain", ds_sync_free.ORIGINALS["allreduce_no_retain"])
    theirs = _two_steps(tmp_path, "theirs")
    assert len(theirs_calls) == len(ours_calls)
    assert ours[0] == theirs[0]
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name, weight in ours[1].items():
        assert torch.equal(weight, theirs[1][name]), name
