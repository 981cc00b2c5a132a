"""The gated delta rule's Triton passes one by one on a CUDA device, bf16 (tests/linear_attention_stages.py): each
kernel against a torch fp32 recomputation from the previous kernel's outputs, and a second run bit-equal. This is
the check that located the H200 miscompiles of docs/PERF.md (a wrong, run-to-run varying reverse state pass; NaN W
and U at small K). Run on the GPU machine: pytest -m gpu tests/gpu/test_linear_attention_stages_gpu.py

Shapes: T tokens, H heads, K key dim, V value dim.
"""

import pytest
import torch
from linear_attention_stages import stage_errors

pytestmark = pytest.mark.gpu

# bf16 W, U, states, v_new and dot operands against an fp32 recomputation: measured on the H200 at most 4.9e-3 for
# the forward passes, 7.3e-3 for the gradients; the broken reverse pass was 0.3-0.48 off.
TOLERANCE = 2e-2


@pytest.mark.parametrize(
    "T, H, K, V, num_docs",
    [
        pytest.param(2048, 2, 128, 128, 8, id="T2048-H2-8docs"),
        pytest.param(16384, 32, 128, 128, 110, id="T16384-H32-110docs"),
        pytest.param(32768, 16, 128, 128, 4, id="T32768-H16-4docs"),
        pytest.param(300, 4, 16, 16, 3, id="T300-K16-V16"),
        pytest.param(300, 4, 32, 64, 3, id="T300-K32-V64"),
    ],
)
def test_every_pass_matches_its_recomputation_bf16(T, H, K, V, num_docs):
    gen = torch.Generator().manual_seed(1)
    cuts = sorted(torch.randperm(T - 1, generator=gen)[: num_docs - 1].add(1).tolist())
    cu_seqlens = torch.tensor([0, *cuts, T], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = dict(
        q=randn(T, H, K).bfloat16(),
        k=randn(T, H, K).bfloat16(),
        v=randn(T, H, V).bfloat16(),
        g=-0.5 * torch.rand(T, H, generator=gen, device="cuda"),
        beta=torch.rand(T, H, generator=gen, device="cuda").sigmoid(),
        do=randn(T, H, V).bfloat16(),
    )
    errors, repeat_equal = stage_errors(**inputs, cu_seqlens=cu_seqlens)
    assert all(max(errs.values()) <= TOLERANCE for errs in errors.values()), errors
    assert repeat_equal
