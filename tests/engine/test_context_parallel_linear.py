"""Context parallelism of the linear-attention layers (engine/model/linear_context): N gloo ranks sharing one
packed row give one process's outputs, input gradients and parameter gradients (summed over ranks)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_tune.engine.model.attention import GatedDeltaNet
from moe_tune.engine.model.batch import PackedBatch
from moe_tune.engine.model.blocks import ShortConv, document_ids, document_positions
from moe_tune.engine.model.kda import KimiDeltaAttention
from moe_tune.engine.parallel.context import ContextShard
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import ModelProfile

from context_ranks import run_ranks

pytestmark = pytest.mark.dist

# fp64 layers, whose gates and output norm compute in fp32: the ranks cut the row where one process does not, so
# gradients through those parts differ from one process's by fp32 rounding (up to ~1e-7 relative).
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
ROW_TOKENS = 32
# Document lengths of a row of ROW_TOKENS tokens; rank shares are 16 tokens (CP 2) or 8 (CP 4).
LAYOUTS = {
    "one-document": [32],  # every rank continues it: the entering state composes over all earlier ranks
    "crossing": [5, 22, 5],  # the middle one crosses every boundary of CP 2 and 4
    "at-boundaries": [8, 8, 16],  # documents start exactly where a rank starts
    # short ones within a rank, one starting a token before the CP 2 boundary (a halo across two documents)
    "within-and-short": [3, 3, 9, 2, 15],
}
LINEAR = load_profile("tiny").model.linear_attention.model_dump()
LAYERS = {
    "linear-scalar": ([{"attention": "linear"}], {}),
    "linear-per-channel": ([{"attention": "linear"}], {"linear_attention": {**LINEAR, "decay": "per_channel"}}),
    "kda": ([{"attention": "kda"}], {"kda_attention": {"num_heads": 2, "head_dim": 16}}),
}


def layer_of(kind: str) -> torch.nn.Module:
    """A small fp64 layer with every parameter perturbed and slow decays, so states carry across ranks."""
    torch.manual_seed(0)
    layers, overrides = LAYERS[kind]
    base = load_profile("tiny").model.model_dump()
    cfg = ModelProfile.model_validate({**base, "layers": layers, **overrides})
    layer = (KimiDeltaAttention if kind == "kda" else GatedDeltaNet)(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.2)
        # Decay rates exp(A_log) near 0.1: the state entering a rank still weighs on its outputs.
        layer.A_log.uniform_(-2.5, -2)
    return layer


def row_batch(lengths: list[int]) -> PackedBatch:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    return PackedBatch(cu, document_positions(cu, total), document_ids(cu, total))


def shard_batch(row: PackedBatch, rank: int, size: int) -> PackedBatch:
    """This rank's part of the row, as the model builds it under context parallelism."""
    shard = ContextShard.of_row(row.cu_seqlens, torch.distributed.group.WORLD, rank, size)
    return PackedBatch(
        shard.local_cu_seqlens(), shard.local(row.positions), shard.local(row.doc_ids), context=shard
    )


def inputs(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, T, width] and the loss weights on the output."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, ROW_TOKENS, width, generator=gen, dtype=torch.float64)
    return x, torch.randn(1, ROW_TOKENS, width, generator=gen, dtype=torch.float64)


def forward_backward(
    layer: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor, batch: PackedBatch, is_recomputed: bool = False
):
    """Output, input gradient and every parameter gradient of the loss sum(layer(x) * weights); `is_recomputed`:
    the layer under activation checkpoint, as model.py runs it (backward reruns its collectives)."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    if isinstance(layer, ShortConv):
        y = layer(x, batch.positions, batch.context)
    elif is_recomputed:
        y = checkpoint(layer, x, batch, use_reentrant=False)
    else:
        y = layer(x, batch)
    (y * weights).sum().backward()
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}


def _ranks(rank: int, size: int, layer: torch.nn.Module, width: int, is_recomputed: bool) -> list:
    results = []
    x, weights = inputs(width)
    for lengths in LAYOUTS.values():
        batch = shard_batch(row_batch(lengths), rank, size)
        shard = batch.context
        y, x_grad, grads = forward_backward(layer, shard.local(x, 1), shard.local(weights, 1), batch, is_recomputed)
        # As numpy arrays: a tensor would reach the parent through shared memory its rank frees on exit.
        results.append((y.numpy(), x_grad.numpy(), {name: grad.numpy() for name, grad in grads.items()}))
    return results


def check_against_one_process(layer: torch.nn.Module, width: int, size: int, is_recomputed: bool = False) -> None:
    x, weights = inputs(width)
    per_rank = run_ranks(_ranks, size, layer, width, is_recomputed)
    for index, (name, lengths) in enumerate(LAYOUTS.items()):
        y, x_grad, grads = forward_backward(layer, x, weights, row_batch(lengths))
        parts = [results[index] for results in per_rank]
        joined = torch.cat([torch.from_numpy(p[0]) for p in parts], 1)
        torch.testing.assert_close(joined, y, **TOLERANCE, msg=lambda m: f"{name}: {m}")
        joined_grad = torch.cat([torch.from_numpy(p[1]) for p in parts], 1)
        torch.testing.assert_close(joined_grad, x_grad, **TOLERANCE, msg=lambda m: f"{name} dx: {m}")
        for param, grad in grads.items():
            summed = sum(torch.from_numpy(p[2][param]) for p in parts)
            torch.testing.assert_close(summed, grad, **TOLERANCE, msg=lambda m: f"{name} d{param}: {m}")


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_on_ranks_equals_one_process(kind, size):
    layer = layer_of(kind)
    check_against_one_process(layer, layer.q_proj.in_features, size)


def test_recomputed_layer_on_ranks_equals_one_process():
    """Under activation checkpoint every rank reruns the layer's collectives in backward, in the same order."""
    layer = layer_of("kda")
    check_against_one_process(layer, layer.q_proj.in_features, 4, is_recomputed=True)


@pytest.mark.parametrize("size", [2, 4])
def test_dilated_short_conv_halo(size):
    """Reach 6 ((width 3 - 1) x dilation 3) of an 8-token share: the halo alone, with documents crossing it."""
    torch.manual_seed(0)
    conv = ShortConv(5, width=3, dilation=3).double()
    torch.nn.init.normal_(conv.weight)
    check_against_one_process(conv, 5, size)
