"""Inputs and a forward + backward runner for the rms_norm, causal_conv and rotary tests, in the interpreter (CPU)
and on the GPU: one builder each, so both test the same cases the same way; the fp64 reference inputs and the
comparison against the reference that the swiglu tests share with them."""

import dataclasses

import pytest
import torch

from moe_tune.engine.model.blocks import document_positions
from moe_tune.ops.causal_conv import autograd as causal_conv_autograd
from moe_tune.ops.causal_conv.kernels import ConvLaunch


def as_fp64(*tensors):
    """fp64 leaf copies of tensors (None kept), each requiring a gradient where its original does: the inputs of a
    reference run."""
    return [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]


def rms_norm_case(shape, dtype, has_gate, device="cpu", seed=0, weight_requires_grad=True):
    """x [..., N] (scaled by 3), weight [N], gate (or None), grad_y."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype).requires_grad_()
    weight = (torch.randn(shape[-1], generator=gen, device=device) * 0.5).to(dtype)
    weight.requires_grad_(weight_requires_grad)
    gate = torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_() if has_gate else None
    grad_y = torch.randn(shape, generator=gen, device=device).to(dtype)
    return x, weight, gate, grad_y


def run_rms_norm(op, x, weight, gate, grad_y, **options):
    """y and the gradients of the inputs that require one (x, weight, gate order)."""
    leaves = [t for t in (x, weight, gate) if t is not None and t.requires_grad]
    y = op(x, weight, gate=gate, **options)
    return y, torch.autograd.grad(y, leaves, grad_y)


def causal_conv_case(batch, lengths, channels, width, dtype, device="cpu", seed=0):
    """x [batch, sum(lengths), channels], weight [channels, width], positions of documents of `lengths`, grad_y."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    positions = document_positions(cu_seqlens, tokens)
    x = torch.randn(batch, tokens, channels, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(channels, width, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()
    grad_y = torch.randn(batch, tokens, channels, generator=gen, device=device).to(dtype)
    return x, weight, positions, grad_y


# The causal conv kernels' launches the tests run (interpreter and GPU): the default (two-pass backward), the one-pass
# backward at the default tile, and both with small tiles (32 x 32 backward, 32 x 64 forward) that cut every test
# case into several tiles of tokens and channels, documents and heads straddling their edges.
CONV_LAUNCHES = {
    "default": ConvLaunch(),
    "one_pass": ConvLaunch(one_pass_backward=True),
    "small_tiles": ConvLaunch(block_t=32, block_c=64, grad_block_t=32, grad_block_c=32),
    "one_pass_small_tiles": ConvLaunch(block_t=32, block_c=64, grad_block_t=32, grad_block_c=32,
                                       one_pass_backward=True),  # fmt: skip
}


@pytest.fixture(params=CONV_LAUNCHES.values(), ids=CONV_LAUNCHES.keys())
def conv_launch(request, monkeypatch) -> ConvLaunch:
    """Each of CONV_LAUNCHES in turn, as the causal conv autograd functions pick it."""
    use_conv_launch(monkeypatch, request.param)
    return request.param


def use_conv_launch(monkeypatch, launch: ConvLaunch) -> None:
    monkeypatch.setattr(causal_conv_autograd, "pick_launch", lambda _x: launch)


def conv_sweep_launches() -> dict[str, ConvLaunch]:
    """The causal conv sweep's candidates past pick_launch's own (engine/bench/causal_conv_sweep.py), by an id that
    names their fields: the GPU tests run each, so that the one the sweep finds fastest is tested before it becomes
    the default."""
    from moe_tune.engine.bench.causal_conv_sweep import sweep_candidates
    from moe_tune.ops.causal_conv.kernels import DEFAULT_LAUNCH

    return {"-".join(f"{k}{int(v)}" for k, v in overrides.items()): dataclasses.replace(DEFAULT_LAUNCH, **overrides)
            for overrides in sweep_candidates()[1:]}  # fmt: skip


def run_causal_conv(op, x, weight, positions, grad_y, dilation):
    """y and the gradients of x and weight (those that require one)."""
    leaves = [t for t in (x, weight) if t.requires_grad]
    y = op(x, weight, positions, dilation)
    return y, torch.autograd.grad(y, leaves, grad_y)


def rotary_case(shape, rotary_dim, dtype, equal_halves=True, device="cpu", seed=0):
    """x [B, T, H, D] needing a gradient, cos/sin [T, R] fp32 from positions restarting at a document start, and
    dy. equal_halves False: the second half of each table row gets other angles and a 1.5 scale."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = shape[1]
    x = torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_()
    positions = torch.cat([torch.arange(tokens // 3), torch.arange(tokens - tokens // 3)]).double().to(device)
    half = rotary_dim // 2
    angles = positions[:, None] * 10000.0 ** (-torch.arange(half, device=device).double() / half)
    second, scale = (angles, 1.0) if equal_halves else (angles * 0.7 + 0.3, 1.5)
    cos = torch.cat([angles.cos(), second.cos() * scale], -1).float()
    sin = torch.cat([angles.sin(), second.sin() * scale], -1).float()
    grad_y = torch.randn(shape, generator=gen, device=device).to(dtype)
    return x, cos, sin, grad_y


def run_rotary(op, x, cos, sin, grad_y):
    """y and the gradient of x."""
    y = op(x, cos, sin)
    (dx,) = torch.autograd.grad(y, (x,), grad_y)
    return y, dx


# The GPU tests of these ops (tests/gpu/test_{rms_norm,causal_conv,rotary}_gpu.py): outputs against the reference on
# fp64 copies of the inputs, relative to each tensor's largest entry (weight gradients sum every row). bf16: one
# rounding of each output (2^-9 relative); fp32: summation order and fma contraction only.
GPU_TOLERANCES = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}
# Guard elements past the end of every output buffer the GPU kernels write (tests/kernel_fixtures.py).
GPU_GUARD_ELEMENTS = 1 << 16
# The causal conv kernels in the interpreter (tests/ops/test_causal_conv*.py), against the reference on fp64 copies,
# relative to each tensor's largest entry (dw sums every token). fp32: summation order only (measured at most 7e-7).
# fp16: one rounding of y and dx (measured 9e-4 absolute on outputs of magnitude 3, 3.6e-4 relative on gradients).
CONV_TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


def assert_close_to_reference(names, outputs, references, dtype, tolerance):
    """Each output has dtype `dtype`, its reference's shape, and is within `tolerance` of it relative to the
    reference's largest entry (weight gradients sum every row, so element-relative bounds fail on near-zero sums)."""
    for name, out, ref in zip(names, outputs, references, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape, name
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.double() / scale, ref / scale, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
