"""Full attention over packed documents without a [T, T] mask: the bucketed path gives the dense-mask path's outputs
and gradients, and no document sees another."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_tune.engine.model import varlen
from moe_tune.engine.model.attention import GatedAttention, PackedBatch
from moe_tune.engine.model.varlen import (
    PAD_BUCKET_BITS,
    DocumentBuckets,
    flash_varlen_applies,
    packed_causal_attention,
    padded_length,
)
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import ModelProfile

TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.float32: dict(atol=2e-6, rtol=1e-5),
}

# Document lengths of each row; every row of a layout has the same number of tokens.
LAYOUTS = {
    "one-document": [[37]],
    "uneven-with-length-1": [[7, 1, 21, 1, 35]],
    "all-length-1": [[1] * 9],
    # one bucket, already in order: no gather, no padding
    "equal-lengths": [[8, 8, 8, 8]],
    # 9 and 10 share the padded bucket 10, 33 pads to 40, and the row is out of bucket order
    "padded-out-of-order": [[33, 9, 2, 10, 5]],
    "rows-one-document-each": [[24], [24], [24]],
    "rows-with-different-layouts": [[5, 19], [1, 1, 22], [24], [12, 12]],
}
HEADS = {"mha": (4, 4), "gqa-2": (4, 2), "mqa-6": (6, 1)}


def packed_cu_seqlens(rows: list[list[int]]) -> torch.Tensor:
    """cu_seqlens of the rows one after the other, [N + 1] int32."""
    lengths = [n for row in rows for n in row]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def row_batch(lengths: list[int]) -> PackedBatch:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    return PackedBatch(cu, document_positions(cu, total), document_ids(cu, total))


def masked_attention(q, k, v, rows, scale=None):
    """The path before: SDPA with each row's dense block-diagonal causal mask."""
    mask = torch.stack([row_batch(row).causal_mask() for row in rows])[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)


def random_qkv(rows, heads, dtype, head_dim=8, value_dim=8):
    num_heads, num_kv_heads = heads
    b, t = len(rows), sum(rows[0])
    q = torch.randn(b, t, num_heads, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(b, t, num_kv_heads, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(b, t, num_kv_heads, value_dim, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_causal_attention_matches_masked_sdpa(layout, heads, dtype):
    torch.manual_seed(0)
    rows = LAYOUTS[layout]
    q, k, v = random_qkv(rows, heads, dtype)
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows), row_length=sum(rows[0]))
    out = packed_causal_attention(q, k, v, buckets)
    expected = masked_attention(q, k, v, rows)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype], msg=lambda m: f"d{name}: {m}")


def test_scale_and_value_dim_pass_through():
    # MLA's layout: a logit scale of its own and a value dim unlike the query/key dim.
    torch.manual_seed(0)
    rows = [[6, 13, 1, 4]]
    q, k, v = random_qkv(rows, (4, 4), torch.float64, head_dim=12, value_dim=5)
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows))
    out = packed_causal_attention(q, k, v, buckets, scale=0.37)
    expected = masked_attention(q, k, v, rows, scale=0.37)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64])


# Documents 0-2 share the bucket 6 (one SDPA call, no padding); document 3 (11 tokens) pads to 12.
LEAK_LENGTHS = [6, 6, 6, 11, 1]


@pytest.mark.parametrize("perturbed", range(len(LEAK_LENGTHS)))
def test_perturbing_one_document_leaves_the_others_bitwise_unchanged(perturbed):
    torch.manual_seed(0)
    rows = [LEAK_LENGTHS]
    q, k, v = random_qkv(rows, (4, 2), torch.float32)
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows))
    bounds = packed_cu_seqlens(rows).tolist()
    own = slice(bounds[perturbed], bounds[perturbed + 1])
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, own] = torch.randn_like(x[:, own])
    out = packed_causal_attention(q, k, v, buckets)
    out2 = packed_causal_attention(q2, k2, v2, buckets)
    others = torch.ones(out.shape[1], dtype=torch.bool)
    others[own] = False
    assert torch.equal(out[:, others], out2[:, others])
    # The property can fail: the perturbed document's own outputs moved.
    assert not torch.equal(out[:, own], out2[:, own])
    # And no gradient crosses: a loss on the other documents gives the perturbed one exactly zero.
    grads = torch.autograd.grad(out[:, others].square().sum(), (q, k, v))
    for grad in grads:
        assert torch.count_nonzero(grad[:, own]) == 0


def test_every_call_is_causal_without_a_mask(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((tuple(q.shape), attn_mask, kwargs["is_causal"]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    rows = LAYOUTS["padded-out-of-order"]
    q, k, v = random_qkv(rows, (4, 2), torch.float32)
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows))
    packed_causal_attention(q, k, v, buckets)
    # [documents, heads, padded length, dim] per bucket: 2, 5, 9 + 10, 33 -> 2, 5, 10 (two documents), 40
    assert [shape[:3] for shape, _, _ in calls] == [(1, 4, 2), (1, 4, 5), (2, 4, 10), (1, 4, 40)]
    assert all(mask is None and is_causal for _, mask, is_causal in calls)


def test_calls_leave_out_cudnn_and_keep_the_callers_other_choices(monkeypatch):
    # cuDNN's SDPA plans every new shape on the host (the buckets' shapes change every batch): off inside our calls,
    # back on after them; a caller's restriction (math only here) still holds inside.
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((cuda_sdp.cudnn_sdp_enabled(), cuda_sdp.flash_sdp_enabled(), cuda_sdp.math_sdp_enabled()))
        return real(q, k, v, **kwargs)

    cuda_sdp = torch.backends.cuda
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    rows = LAYOUTS["padded-out-of-order"]
    q, k, v = random_qkv(rows, (4, 2), torch.float32)
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows))
    assert cuda_sdp.cudnn_sdp_enabled() and cuda_sdp.flash_sdp_enabled()
    packed_causal_attention(q, k, v, buckets)
    assert seen and all(flags == (False, True, True) for flags in seen), seen
    assert cuda_sdp.cudnn_sdp_enabled()
    seen.clear()
    with sdpa_kernel([SDPBackend.MATH]):
        packed_causal_attention(q, k, v, buckets)
    assert seen and all(flags == (False, False, True) for flags in seen), seen


@pytest.mark.parametrize(
    "rows",
    [[[64]], [[16, 16, 16, 16]], [[32], [32]], [[4, 5, 6, 7]]],
    ids=["one-document", "equal-lengths", "rows-one-document-each", "unpadded-in-bucket-order"],
)
def test_rows_in_bucket_order_need_no_gather(rows):
    buckets = DocumentBuckets.from_cu_seqlens(packed_cu_seqlens(rows), row_length=sum(rows[0]))
    assert buckets.gather is None and buckets.scatter is None


def test_padded_length_is_within_a_quarter_and_few_buckets():
    step_fraction = 2.0**-PAD_BUCKET_BITS
    for n in range(1, 70_000):
        padded = padded_length(n)
        assert n <= padded < n * (1 + step_fraction)
    num_tokens = 32768
    # Every length 1..255 once (32640 tokens) and ones to fill the row: the most distinct lengths a row can hold.
    lengths = list(range(1, 256)) + [1] * (num_tokens - 255 * 256 // 2)
    buckets = DocumentBuckets.from_cu_seqlens(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    assert len(buckets.lengths) <= (2**PAD_BUCKET_BITS) * math.log2(num_tokens)
    assert len(buckets.gather) < num_tokens * (1 + step_fraction)
    assert sum(buckets.counts) == len(lengths)


def test_empty_documents_are_skipped():
    torch.manual_seed(0)
    q, k, v = random_qkv([[3, 4]], (2, 2), torch.float64)
    with_empty = DocumentBuckets.from_cu_seqlens(torch.tensor([0, 0, 3, 3, 7], dtype=torch.int32))
    plain = DocumentBuckets.from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32))
    assert torch.equal(packed_causal_attention(q, k, v, with_empty), packed_causal_attention(q, k, v, plain))


def test_flash_bounds_leave_out_empty_documents():
    # The flash path reads the non-empty documents' bounds and the longest document; int32 bounds without empty
    # documents are the caller's own tensor (no copy), and the buckets are planned only when asked for.
    with_empty = DocumentBuckets.from_cu_seqlens(torch.tensor([0, 0, 3, 3, 7, 12, 12], dtype=torch.int32))
    assert with_empty.bounds.dtype == torch.int32 and with_empty.bounds.tolist() == [0, 3, 7, 12]
    assert with_empty.max_length == 5
    plain_cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    plain = DocumentBuckets.from_cu_seqlens(plain_cu)
    assert plain.bounds is plain_cu and plain.max_length == 4
    assert "_plan" not in vars(plain)
    assert plain.counts == (1, 1) and "_plan" in vars(plain)
    assert DocumentBuckets.from_cu_seqlens(torch.tensor([0, 5, 9])).bounds.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_path_is_for_cuda_only(dtype, monkeypatch):
    # On the CPU every call takes the buckets, even in the flash kernel's dtypes and head dims and with a device
    # that could run it (the GPU side of the rule: tests/gpu/test_attention_gpu.py).
    monkeypatch.setattr(varlen, "_flash_capable", lambda device: True)
    q, k, v = (torch.zeros(1, 8, h, 16, dtype=dtype) for h in (4, 2, 2))
    assert torch.backends.cuda.flash_sdp_enabled()
    assert flash_varlen_applies(q, k, v) is False


def test_errors_name_the_rule():
    q, k, v = random_qkv([[4, 4]], (4, 2), torch.float32)
    with pytest.raises(ValueError, match=r"must end a document at every row end \(rows of 8 tokens\)"):
        DocumentBuckets.from_cu_seqlens(torch.tensor([0, 6, 16], dtype=torch.int32), row_length=8)
    with pytest.raises(ValueError, match="must start at 0 and never decrease"):
        DocumentBuckets.from_cu_seqlens(torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"buckets cover 9 tokens, q \(1, 8, 4, 8\) has 8"):
        packed_causal_attention(q, k, v, DocumentBuckets.from_cu_seqlens(torch.tensor([0, 9])))
    with pytest.raises(ValueError, match="G heads dividing q's H"):
        packed_causal_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1),
                                DocumentBuckets.from_cu_seqlens(torch.tensor([0, 8])))


class MaskedGatedAttention(GatedAttention):
    """GatedAttention as it was: SDPA over the row with the dense causal mask."""

    def attend(self, x, q, k, v, gate, batch: PackedBatch) -> torch.Tensor:
        o = masked_attention(q, k, v, [batch.cu_seqlens.diff().tolist()])
        return o if gate is None else o * torch.sigmoid(gate)


@pytest.mark.parametrize("is_gated", [True, False], ids=["output-gate", "plain"])
def test_gated_attention_matches_the_masked_layer(is_gated):
    torch.manual_seed(0)
    base = load_profile("tiny").model.model_dump()
    base.update(layers=[{"attention": "full", "mlp": "dense"}], attention_output_gate=is_gated, intermediate_size=48)
    cfg = ModelProfile.model_validate(base)
    assert cfg.num_attention_heads > cfg.num_key_value_heads, "the tiny profile should exercise GQA"
    layer = GatedAttention(cfg).double()
    reference = MaskedGatedAttention(cfg).double()
    reference.load_state_dict(layer.state_dict())
    batch = row_batch([7, 1, 21, 1, 35])
    x = torch.randn(1, 65, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    out, expected = layer(x, batch), reference(x, batch)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, *layer.parameters()), grad_out)
    expected_grads = torch.autograd.grad(expected, (x, *reference.parameters()), grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64])
