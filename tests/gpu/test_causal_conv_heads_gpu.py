"""causal_conv_heads' Triton kernels on CUDA: bf16 and fp32 outputs and every gradient against the reference at the
benchmark model's shapes, NaN-filled buffers with guarded ends, and bit for bit the plain conv kernel's output.

Shapes: q, k [B, T, Hk K], v [B, T, Hv V]; bench-qwen3-next's gated delta nets: Hk 16, Hv 32, K = V = 128 over a
packed row of 8192 tokens, width 4. Run on the H200 on its own (tests/ops imports the kernels in interpreter mode).
"""

import pytest
import torch
from kernel_fixtures import forced_kernel_path, guarded_outputs
from norm_conv_cases import (
    GPU_GUARD_ELEMENTS, GPU_TOLERANCES, assert_close_to_reference, causal_conv_case, conv_launch, conv_sweep_launches,
    use_conv_launch,
)  # fmt: skip

from moe_tune.ops.causal_conv import causal_conv, causal_conv_heads, kernels, kernels_heads
from moe_tune.ops.causal_conv.reference import causal_conv_heads_ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

kernel_path = forced_kernel_path(kernels_heads, "_conv_heads_fwd_kernel", on_gpu=True)
guarded = guarded_outputs(kernels, GPU_GUARD_ELEMENTS, "alloc")
SWEEP_LAUNCHES = conv_sweep_launches()

# (batch, document lengths, key heads, K, value heads, V, width)
CASES = {
    "bench_row": (1, [150] * 54 + [92], 16, 128, 32, 128, 4),
    # KDA: as many value heads as key heads.
    "kda_one_doc": (1, [4096], 16, 128, 16, 128, 4),
    # Head dims that cut the 128-channel tiles, three value heads per key head, two rows.
    "odd": (2, [1, 63, 700, 5], 3, 72, 9, 40, 4),
}


def heads_case(batch, lengths, num_key_heads, key_dim, num_value_heads, value_dim, width, dtype):
    channels = 2 * num_key_heads * key_dim + num_value_heads * value_dim
    x, weight, positions, _ = causal_conv_case(batch, lengths, channels, width, dtype, device=DEVICE)
    q, k, v = (t.detach().contiguous().requires_grad_() for t in x.split(
        [num_key_heads * key_dim, num_key_heads * key_dim, num_value_heads * value_dim], -1))  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    grads = [torch.randn(batch, sum(lengths), num_value_heads, dim, generator=gen, device=DEVICE).to(dtype)
             for dim in (key_dim, key_dim, value_dim)]  # fmt: skip
    return (q, k, v, weight), positions, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference(guarded, conv_launch, case, dtype):
    assert_matches_reference(guarded, case, dtype)


@pytest.mark.parametrize("launch", SWEEP_LAUNCHES.values(), ids=SWEEP_LAUNCHES.keys())
@pytest.mark.parametrize("case, dtype", [(CASES["bench_row"], torch.bfloat16), (CASES["odd"], torch.float32)],
                         ids=["bench_row-bf16", "odd-fp32"])  # fmt: skip
def test_sweep_launch_matches_reference(guarded, monkeypatch, launch, case, dtype):
    use_conv_launch(monkeypatch, launch)
    assert_matches_reference(guarded, case, dtype)


def assert_matches_reference(guarded, case, dtype):
    batch, lengths, num_key_heads, key_dim, num_value_heads, value_dim, width = case
    inputs, positions, grads = heads_case(*case, dtype)
    out = causal_conv_heads(*inputs, positions, key_dim, value_dim)
    input_grads = torch.autograd.grad(out, inputs, grads)
    as_fp64 = [t.detach().double().requires_grad_() for t in inputs]
    out_ref = causal_conv_heads_ref(*as_fp64, positions, key_dim, value_dim)
    grads_ref = torch.autograd.grad(out_ref, as_fp64, [g.double() for g in grads])
    torch.cuda.synchronize()
    guarded.check()
    names = ("q", "k", "v", "dq", "dk", "dv", "dweight")
    assert_close_to_reference(names, (*out, *input_grads), (*out_ref, *grads_ref), dtype, GPU_TOLERANCES[dtype])


def test_kernel_is_the_plain_conv_kernel_on_the_concatenation(kernel_path):
    (q, k, v, weight), positions, _ = heads_case(*CASES["bench_row"], torch.bfloat16)
    with torch.no_grad():
        yq, yk, yv = causal_conv_heads(q, k, v, weight, positions, 128, 128)
        yq_ref, yk_ref, yv_ref = causal_conv(torch.cat([q, k, v], -1), weight, positions).split([2048, 2048, 4096], -1)
    torch.testing.assert_close(yq, yq_ref.reshape(1, -1, 16, 128).repeat_interleave(2, dim=2), rtol=0, atol=0)
    torch.testing.assert_close(yk, yk_ref.reshape(1, -1, 16, 128).repeat_interleave(2, dim=2), rtol=0, atol=0)
    torch.testing.assert_close(yv, yv_ref.reshape(1, -1, 32, 128), rtol=0, atol=0)
