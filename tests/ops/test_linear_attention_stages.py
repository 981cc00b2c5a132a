"""The gated delta rule's Triton passes one by one in the interpreter (tests/linear_attention_stages.py): each
kernel's outputs against a torch recomputation from the previous kernel's outputs, and a second run bit-equal.
tests/gpu/test_linear_attention_stages_gpu.py runs the same check in bf16 on the device.

Shapes: T tokens, H heads, K key dim, V value dim.
"""

import pytest
from triton_interpreter_mode import interpreted_kernels

with interpreted_kernels():
    from linear_attention_stages import stage_errors
    import torch
    from moe_tune.ops.linear_attention import kernels_bwd

# Documents of 1, 63, 65 and 171 tokens: inside one chunk, across a boundary, several chunks.
BOUNDS = [0, 1, 64, 129, 300]
# fp32: the interpreter's products are fp32, only the summation order differs from torch (measured <= 1.1e-6).
# fp16: W, U, states and v_new are rounded to fp16 between kernels (measured <= 6.8e-4 at T4096).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, interpreter_scalar_index):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_inputs(T, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(T, H, K, generator=gen).to(dtype),
        k=torch.randn(T, H, K, generator=gen).to(dtype),
        v=torch.randn(T, H, V, generator=gen).to(dtype),
        g=-0.5 * torch.rand(T, H, generator=gen),
        beta=torch.rand(T, H, generator=gen).sigmoid(),
        do=torch.randn(T, H, V, generator=gen).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_pass_matches_its_recomputation(dtype):
    inputs = make_inputs(BOUNDS[-1], 2, 32, 16, dtype)
    errors, repeat_equal = stage_errors(**inputs, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32))
    worst = {stage: max(errs.values()) for stage, errs in errors.items()}
    assert all(value <= TOLERANCE[dtype] for value in worst.values()), errors
    assert repeat_equal


def test_a_wrong_pass_is_named(monkeypatch):
    # A 1% error in the state gradients: the check fails, and its first failing stage is state_bwd.
    chunk_state_bwd = kernels_bwd.chunk_state_bwd

    def off_by_one_percent(*args, **kwargs):
        state_grads, dv_new, initial_grad = chunk_state_bwd(*args, **kwargs)
        state_grads *= 1.01
        return state_grads, dv_new, initial_grad

    monkeypatch.setattr(kernels_bwd, "chunk_state_bwd", off_by_one_percent)
    inputs = make_inputs(BOUNDS[-1], 2, 32, 16, torch.float32)
    errors, _ = stage_errors(**inputs, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32))
    failing = [stage for stage, errs in errors.items() if max(errs.values()) > TOLERANCE[torch.float32]]
    # Later stages take the broken one's outputs as inputs, so the first failing stage is the one to look at.
    assert failing[0] == "state_bwd" and "wy" not in failing and "state_fwd" not in failing, errors
