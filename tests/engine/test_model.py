"""The decoder: no information crosses a document boundary in a packed row, for every layer kind."""

import pytest
import torch
import torch.nn.functional as F

from moe_tune.engine.model.blocks import RMSNorm, RotaryEmbedding, ShortConv, document_positions
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import MoEBlock
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import ModelProfile, MoESpec


def model_cfg(layers, **overrides) -> ModelProfile:
    base = load_profile("tiny").model.model_dump()
    base["layers"] = layers
    base.update(overrides)
    return ModelProfile.model_validate(base)


LAYER_SETS = {
    "linear-scalar": [{"attention": "linear", "mlp": "moe"}],
    "linear-kda": [{"attention": "linear", "mlp": "dense"}],
    "sparse-token": [{"attention": "sparse", "mlp": "moe"}],
    "sparse-block": [{"attention": "sparse", "mlp": "moe"}],
    "full": [{"attention": "full", "mlp": "dense"}],
    "hybrid": [{"attention": "linear"}, {"attention": "sparse"}, {"attention": "full"}],
    # qwen4_exp's blocks: residual streams, n-gram injection (contexts and the dilated conv restart per document),
    # QSA's block choice.
    "hyper-ngram-qsa": [{"attention": "linear", "has_ngram_embedding": True}, {"attention": "qsa"}],
}
EXTRA = {
    "linear-kda": {"intermediate_size": 48, "linear_attention": {**load_profile("tiny").model.linear_attention.model_dump(), "decay": "per_channel"}},
    "sparse-block": {"sparse_attention": {"index_heads": 2, "index_head_dim": 8, "topk": 8, "block_size": 4}},
    "full": {"intermediate_size": 48},
    "hyper-ngram-qsa": {
        "norm_one_plus": True,
        "hyper_connections": {"num_streams": 3, "mix_rank": 8},
        "ngram_embedding": {
            "embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "vocab_size_base": 50, "vocab_size_multiple": 8,
            "hash_seed": 7, "conv_kernel_size": 3, "boundary_token_id": 258,
        },
        "sparse_attention": {"index_heads": 2, "index_head_dim": 8, "topk": 8, "block_size": 4},
    },
}


@pytest.mark.parametrize("kind", list(LAYER_SETS))
def test_packed_row_equals_documents_run_alone(kind):
    torch.manual_seed(0)
    cfg = model_cfg(LAYER_SETS[kind], **EXTRA.get(kind, {}))
    model = build_model(cfg).eval()
    # Perturb every parameter so that zero-initialised pieces (norm offsets, LoRA-free paths) still matter.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lengths = [7, 21, 1, 35]  # a 1-token document and one crossing no boundary of anything
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
    cu = torch.tensor([0, 7, 28, 29, 64], dtype=torch.int32)
    packed = model(ids, cu).logits
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n], torch.tensor([0, n], dtype=torch.int32)).logits
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=2e-5, rtol=2e-5)
        start += n


def test_packed_row_differs_when_documents_merge():
    # The property above must be able to fail: merging two documents changes the second one's logits.
    cfg = model_cfg(LAYER_SETS["hybrid"])
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    split = model(ids, torch.tensor([0, 10, 20], dtype=torch.int32)).logits
    merged = model(ids, torch.tensor([0, 20], dtype=torch.int32)).logits
    torch.testing.assert_close(split[:, :10], merged[:, :10])
    assert (split[:, 10:] - merged[:, 10:]).abs().max() > 1e-4


def test_short_conv_equals_per_document_conv1d():
    torch.manual_seed(0)
    conv = ShortConv(channels=6, width=4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(1, 12, 6)
    cu = torch.tensor([0, 2, 9, 12])
    out = conv(x, document_positions(cu, 12))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = x[:, a:b].transpose(1, 2)  # [1, C, L]
        ref = F.conv1d(F.pad(seg, (3, 0)), conv.weight[:, None, :], groups=6)
        torch.testing.assert_close(out[:, a:b], F.silu(ref).transpose(1, 2))


def test_rms_norm_one_plus_matches_plain():
    x = torch.randn(3, 8)
    plain, one_plus = RMSNorm(8), RMSNorm(8, one_plus=True)
    with torch.no_grad():
        plain.weight.copy_(torch.linspace(0.5, 1.5, 8))
        one_plus.weight.copy_(torch.linspace(0.5, 1.5, 8) - 1)
    torch.testing.assert_close(plain(x), one_plus(x))
    torch.testing.assert_close(plain(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * plain.weight)


def test_rotary_is_relative_and_partial():
    rope = RotaryEmbedding(head_dim=8, partial_rotary_factor=0.5, theta=100.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    at = lambda x, p: rope(x, torch.tensor([p]))  # noqa: E731
    # Only the first 4 dims rotate.
    torch.testing.assert_close(at(q, 5)[..., 4:], q[..., 4:])
    # q.k depends on the position difference only.
    dot = lambda a, b: (at(q, a) * at(k, b)).sum()  # noqa: E731
    torch.testing.assert_close(dot(7, 3), dot(14, 10))
    assert not torch.allclose(dot(7, 3), dot(7, 4))


def test_moe_selection_bias_moves_choice_not_weight_and_update_rule():
    spec = MoESpec(num_experts=4, top_k=1, expert_intermediate_size=8, bias_update_rate=0.5)
    block = MoEBlock(hidden=8, spec=spec).train()
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[0].fill_(1.0)  # every token prefers expert 0
    x = torch.ones(1, 5, 8)
    block(x)
    assert block.load_counts.tolist() == [5.0, 0.0, 0.0, 0.0]
    block.update_selection_bias()
    # Overloaded expert 0 goes down, the idle ones go up; counts reset.
    assert block.selection_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert block.load_counts.sum() == 0


def test_capacity_factor_drops_latest_slots_and_counts_them():
    spec = MoESpec(num_experts=4, top_k=1, expert_intermediate_size=8, capacity_factor=1.0)
    block = MoEBlock(hidden=8, spec=spec).train()
    unlimited = MoEBlock(hidden=8, spec=spec.model_copy(update={"capacity_factor": 0.0})).train()
    unlimited.load_state_dict(block.state_dict())
    with torch.no_grad():
        for b in (block, unlimited):
            torch.nn.init.normal_(b.experts.w_gate_up)
            torch.nn.init.normal_(b.experts.w_down)
            b.gate.weight.zero_()
            b.gate.weight[2].fill_(1.0)  # every token prefers expert 2
        unlimited.load_state_dict(block.state_dict())
    x = torch.rand(1, 8, 8) + 0.1
    y, _ = block(x)
    y_all, _ = unlimited(x)
    # Capacity = 1.0 * 8 slots / 4 experts = 2: the first two tokens keep their expert, the other six are dropped.
    assert block.dropped_slots.item() == 6
    torch.testing.assert_close(y[0, :2], y_all[0, :2])
    torch.testing.assert_close(y[0, 2:], torch.zeros_like(y[0, 2:]))


@pytest.mark.parametrize("base_precision", ["bf16", "fp8"])
def test_build_in_the_training_dtype_casts_parameters_not_buffers(base_precision):
    # moe-tune profile builds 30B-80B models in bf16 layer by layer; buffers (rotary frequencies, expert loads) keep
    # their fp32 as DeepSpeed's cast keeps them, and FP8 bits stay integers.
    cfg = load_profile("profiles/tiny.yaml").model.model_copy(update={"base_precision": base_precision})
    reference = build_model(cfg)
    model = build_model(cfg, param_dtype=torch.bfloat16)
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        expected = torch.bfloat16 if ref.is_floating_point() else ref.dtype
        assert param.dtype == expected, name
    assert [b.dtype for b in model.buffers()] == [b.dtype for b in reference.buffers()]
    assert any(b.dtype == torch.float32 for b in model.buffers())
    batch = torch.randint(0, cfg.vocab_size, (1, 64))
    cu_seqlens = torch.tensor([0, 40, 64], dtype=torch.int32)
    with torch.no_grad():
        loss = model(batch, cu_seqlens, labels=batch).loss
    assert torch.isfinite(loss)


def test_bf16_and_fp8_builds_hold_the_same_draws():
    # The fp8-vs-bf16 base comparisons on real shapes start from one set of numbers: the bf16 base holds the fp32
    # draws rounded, the FP8 base quantizes them.
    from moe_tune.engine.model.fp8 import Fp8Linear
    from moe_tune.engine.model.moe import GroupedExperts

    cfg = load_profile("profiles/tiny.yaml").model.model_copy(update={"hidden_size": 128, "base_precision": "fp8"})
    fp32 = build_model(cfg.model_copy(update={"base_precision": "bf16"}))
    bf16 = build_model(cfg.model_copy(update={"base_precision": "bf16"}), param_dtype=torch.bfloat16)
    fp8 = build_model(cfg, param_dtype=torch.bfloat16)
    modules32, modules16 = dict(fp32.named_modules()), dict(bf16.named_modules())
    for name, module in bf16.named_modules():
        if isinstance(module, (torch.nn.Linear, GroupedExperts)):
            for pname, param in module.named_parameters(recurse=False):
                assert torch.equal(getattr(modules32[name], pname).to(torch.bfloat16), param), f"{name}.{pname}"
    params16 = dict(bf16.named_parameters())
    for name, param in fp8.named_parameters():
        if param.is_floating_point():
            assert torch.equal(param, params16[name]), name
    checked = 0
    for name, module in fp8.named_modules():
        if isinstance(module, Fp8Linear):
            assert torch.equal(module.dequantized(), _requantized(modules32[name].weight)), name
            checked += 1
        elif isinstance(module, GroupedExperts) and module.fp8:
            twin = module.dequantized_twin()
            ref = modules32[name]
            expected = _requantized(ref.w_gate_up.detach(), module.gate_up_segments)
            assert torch.equal(twin.w_gate_up, expected), name
            checked += 1
    assert checked > 0


def _requantized(weight, row_segments=None):
    from moe_tune.ops.fp8 import dequantize_weight, quantize_weight

    return dequantize_weight(*quantize_weight(weight.detach().float(), row_segments), row_segments)
