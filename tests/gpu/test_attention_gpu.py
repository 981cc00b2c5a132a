"""Full attention over packed documents (engine/model/varlen.py) and the chunked LM loss (ops/cross_entropy) on a CUDA
device, bf16 against fp32 references: both paths of the packed attention (one variable-length flash call; the
buckets) must equal the dense-mask path; the chunked loss must equal the full-logits loss. Run on the GPU machine:
pytest -m gpu tests/gpu/test_attention_gpu.py

Shapes: T tokens, H query heads, G key/value heads, hd head dim, N tokens of the loss, D model dim, V vocabulary.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_tune.engine.model.blocks import document_ids
from moe_tune.engine.model import varlen
from moe_tune.engine.model.varlen import DocumentBuckets, flash_varlen_applies, packed_causal_attention
from moe_tune.ops.cross_entropy import linear_cross_entropy
from moe_tune.ops.cross_entropy.reference import linear_cross_entropy_ref

pytestmark = pytest.mark.gpu

# bf16 inputs and output against fp32 on the same rounded inputs: relative to the largest entry.
ATTENTION_REL_TOL = 2e-2
# bf16 logits products against the fp32 reference's: the loss is a mean over many tokens.
LOSS_REL_TOL = 5e-3
GRAD_REL_TOL = 3e-2


def _rel(actual, expected):
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


# The paths of packed_causal_attention and the SDPA backends that pick them: one variable-length flash call (flash
# enabled); the buckets with flash off (SDPA's memory-efficient kernel takes no GQA on dense inputs in torch 2.11,
# so its math kernel runs them).
PATHS = {
    "varlen-flash": [SDPBackend.FLASH_ATTENTION],
    "buckets": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "lengths",
    [[4096], [1, 63, 700, 1500, 1832], [128] * 32, [0, 5, 0, 4091, 0]],
    ids=["one", "mixed", "many", "with-empty"],
)
def test_packed_attention_equals_the_masked_path(lengths, path, monkeypatch):
    flash_calls = []
    real_flash = varlen._FlashVarlenCausal.apply
    monkeypatch.setattr(varlen._FlashVarlenCausal, "apply", lambda *a: flash_calls.append(1) or real_flash(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T, H, G, hd = sum(lengths), 16, 4, 128
    q, k, v = (torch.randn(1, T, h, hd, generator=gen, device="cuda").bfloat16().requires_grad_() for h in (H, G, G))
    do = torch.randn(1, T, H, hd, generator=gen, device="cuda").bfloat16()
    with sdpa_kernel(PATHS[path]):
        assert flash_varlen_applies(q, k, v) is (path == "varlen-flash")
        o = packed_causal_attention(q, k, v, DocumentBuckets.from_cu_seqlens(cu))
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert len(flash_calls) == (path == "varlen-flash")

    doc = document_ids(cu, T)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    o_ref = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in ref), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    grads_ref = torch.autograd.grad(o_ref, ref, do.float())
    errors = {name: _rel(a, e) for name, a, e in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref))}
    assert all(err <= ATTENTION_REL_TOL for err in errors.values()), errors


def test_flash_path_rule_on_the_gpu():
    # The flash kernel's limits send other calls to the buckets: fp32, MLA's unequal q and v head dims, head dims
    # not a multiple of 8.
    def qkv(dtype=torch.bfloat16, hd=128, hdv=128):
        return (torch.zeros(1, 8, h, d, dtype=dtype, device="cuda") for h, d in ((4, hd), (2, hd), (2, hdv)))

    assert flash_varlen_applies(*qkv())
    assert flash_varlen_applies(*qkv(torch.float16))
    assert not flash_varlen_applies(*qkv(torch.float32))
    assert not flash_varlen_applies(*qkv(hd=192))
    assert not flash_varlen_applies(*qkv(hd=100, hdv=100))


def test_chunked_loss_equals_the_full_logits_loss_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, D, V = 8192, 2048, 151936
    hidden = torch.randn(N, D, generator=gen, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(V, D, generator=gen, device="cuda") * D**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen, device="cuda")
    labels[::7] = -100
    loss = linear_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = [x.detach().float().requires_grad_() for x in (hidden, weight)]
    loss_ref = linear_cross_entropy_ref(*ref, labels)
    grads_ref = torch.autograd.grad(loss_ref, ref)
    assert abs(float(loss) - float(loss_ref)) <= LOSS_REL_TOL * float(loss_ref)
    errors = {name: _rel(a, e) for name, a, e in zip(("dhidden", "dweight"), grads, grads_ref)}
    assert all(err <= GRAD_REL_TOL for err in errors.values()), errors
