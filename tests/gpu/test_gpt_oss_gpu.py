"""gpt_oss attention on a CUDA device: sinks and the sliding window in packed attention (engine/model/varlen.py), bf16
through the variable-length flash call with the log-sum-exp sink correction and through the masked SDPA buckets,
against the fp64 dense reference (tests/sink_attention.py), forward and every gradient. The CPU tests of the same
attention are tests/engine/families/test_gpt_oss.py's. Run on the GPU machine: pytest -m gpu tests/gpu
"""

import pytest
import torch
from sink_attention import dense_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_tune.engine.model.varlen import DocumentBuckets, packed_causal_attention

pytestmark = pytest.mark.gpu

# bf16 q, k, v (fp32 sinks) against fp64 on the same inputs: the largest error relative to the largest entry.
BF16_REL_TOL = 2e-2


@pytest.mark.parametrize("window", [None, 1, 128], ids=["sinks", "window 1 sinks", "window 128 sinks"])
@pytest.mark.parametrize("path", ["flash", "buckets"])
def test_packed_attention_with_sinks_on_cuda(window, path):
    """bf16 on the GPU (the flash call with the log-sum-exp sink correction, or the masked SDPA buckets) against the
    fp64 dense reference: within bf16 rounding, forward and every gradient."""
    gen = torch.Generator().manual_seed(5)
    lengths = [300, 45, 700, 129, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, heads, kv_heads, dim = int(cu[-1]), 8, 2, 64
    q, k, v = (torch.randn(1, total, h, dim, generator=gen, dtype=torch.float64).cuda()
               for h in (heads, kv_heads, kv_heads))
    sinks = (torch.randn(heads, generator=gen, dtype=torch.float64) * 2).cuda()
    grad = torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64).cuda()
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    expected = dense_attention(*leaves64[:3], cu, leaves64[3], window)
    expected_grads = torch.autograd.grad(expected, leaves64, grad)
    leaves = [t.to(torch.bfloat16 if i < 3 else torch.float32).requires_grad_() for i, t in enumerate((q, k, v, sinks))]
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if path == "buckets" else [SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(backends):
        ours = packed_causal_attention(*leaves[:3], DocumentBuckets.from_cu_seqlens(cu), sinks=leaves[3], window=window)
        ours_grads = torch.autograd.grad(ours, leaves, grad.to(torch.bfloat16))
    for got, want in zip((ours, *ours_grads), (expected, *expected_grads)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < BF16_REL_TOL
