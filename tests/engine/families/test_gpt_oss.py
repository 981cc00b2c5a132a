"""gpt_oss from a transformers checkpoint: alignment with the reference over packed documents longer than the sliding
window (sinks, window, clamped SwiGLU experts with biases, router bias, YaRN), wrong mappings caught, unsupported
configs named, MXFP4 experts dequantized as transformers does, a short fine-tune from the checkpoint starting at the
reference's loss; and the two model features it needs as ops: sinks + sliding window in packed attention, biases +
the clamped activation in the MoE op."""

import json

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families import gpt_oss as family_module
from moe_tune.engine.families.gpt_oss import GptOss, dequantize_mxfp4
from moe_tune.engine.model.varlen import DocumentBuckets, packed_causal_attention
from moe_tune.ops.moe import ClampedSwiGLU, moe_mlp
from moe_tune.ops.moe.reference import moe_mlp_loop_ref

from hf_tiny import mxfp4_checkpoint, save_tiny_checkpoint, tiny_gpt_oss
from sink_attention import dense_attention

WINDOW = 8  # tiny_gpt_oss's sliding window; align's default documents are 23, 9 and 14 tokens
# One document of 20 tokens, past the window, for the aligns that only need to see a mapping break (or hold).
ONE_DOCUMENT = [torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(11))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_gpt_oss(), tmp_path_factory.mktemp("gpt_oss") / "checkpoint")


@pytest.fixture(scope="module")
def config(checkpoint):
    return json.loads((checkpoint / "config.json").read_text())


def test_profile_read_from_config(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert [(layer.attention, layer.sliding_window) for layer in cfg.layers] == [("full", 8), ("full", None), ("full", 8)]
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_output_bias and not cfg.attention_qk_norm
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router_bias, cfg.moe.expert_bias) == (5, 2, True, True)
    assert (cfg.moe.expert_activation, cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == ("clamped_swiglu", 1.702, 0.1)
    assert (cfg.rope_yarn.factor, cfg.rope_yarn.original_max_position_embeddings, cfg.rope_yarn.truncate) == (4.0, 16, False)
    assert cfg.rope_yarn.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


@pytest.mark.parametrize("pin", [False, True])
def test_aligned_with_transformers(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin)
    assert report.passed, report.failures
    assert max(report.documents) > WINDOW
    assert len(report.layers) == 3 and max(row.rel for row in report.layers) < 1e-5
    assert report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # A and B of q, k, v, o in every layer; the experts are stored transposed and interleaved, so not paired.
    assert len(report.lora_grads) == 3 * 4 * 2
    assert max(row.rel for row in report.lora_grads) < 1e-5


def _shift_window(delta):
    original = GptOss.to_profile

    def shifted(self, config):
        cfg = original(self, config)
        layers = [layer.model_copy(update={"sliding_window": layer.sliding_window + delta})
                  if layer.sliding_window else layer for layer in cfg.layers]
        return cfg.model_copy(update={"layers": layers})

    return shifted


def _sinks_dropped():
    original = GptOss.recipe

    def dropped(self, name, module, cfg):
        recipe = original(self, name, module, cfg)
        if name.endswith("self_attn.sinks"):
            # Read (so the loader sees the tensor used) and pushed to a logit no key ever loses to.
            return lambda get: torch.full_like(recipe(get), -1e4)
        return recipe

    return dropped


@pytest.mark.parametrize("wrong", ["sinks dropped", "window - 1", "window + 1", "gate/up interleaved"])
def test_wrong_mapping_is_caught(checkpoint, monkeypatch, wrong):
    if wrong == "sinks dropped":
        monkeypatch.setattr(GptOss, "recipe", _sinks_dropped())
    elif wrong.startswith("window"):
        monkeypatch.setattr(GptOss, "to_profile", _shift_window(-1 if "-" in wrong else 1))
    else:
        monkeypatch.setattr(family_module, "deinterleave", lambda gate_up, dim=1: gate_up)
    # No LoRA adapters: the hidden states and logits are what a wrong mapping breaks.
    report = align_checkpoint(checkpoint, ONE_DOCUMENT, pin_routing=True, lora_targets=())
    assert not report.passed
    assert report.logits.max_abs > report.tolerances.logits_max_abs
    # Layer 0 is a sliding layer with sinks and MoE: every wrong mapping shows there already.
    assert report.layers[0].rel > 1e-4


@pytest.mark.parametrize("change, line", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types[1] ('chunked_attention') is not mapped"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries, num_hidden_layers is 3"),
    ({"attention_dropout": 0.1}, "attention_dropout (0.1) is not mapped"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method ('fp8') is not mapped"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}},
     "rope_parameters.rope_type ('linear') is not mapped"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor (0.5) is not mapped"),
    ({"swiglu_limit": -1.0}, "swiglu_limit (-1.0) must be > 0"),
    ({"swiglu_alpha": "1.7"}, "swiglu_alpha ('1.7') must be a number"),
    ({"sliding_window": 0}, "sliding_window (0) must be >= 1"),
    ({"sliding_window": 8.5}, "sliding_window (8.5) must be an integer"),
    ({"num_experts_per_tok": 6}, "num_experts_per_tok (6) must be <= num_local_experts (5)"),
])
def test_unsupported_config_names_the_field(config, change, line):
    with pytest.raises(UnsupportedModel) as err:
        GptOss().to_profile({**config, **change})
    assert any(line in problem for problem in err.value.problems), err.value.problems


def test_default_rope_is_transformers_yarn(config):
    """No RoPE in config.json: transformers' GptOssConfig default (YaRN x32 over 4096, theta 150000)."""
    cfg = GptOss().to_profile({k: v for k, v in config.items() if k != "rope_parameters"})
    assert cfg.rope_theta == 150000.0
    assert (cfg.rope_yarn.factor, cfg.rope_yarn.original_max_position_embeddings, cfg.rope_yarn.truncate) == (32.0, 4096,
                                                                                                              False)


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()


# MXFP4


@pytest.mark.parametrize("shape", [(3, 5, 2), (1, 1, 1), (2, 7, 3)], ids=["E3R5G2", "one group", "odd rows"])
def test_dequantize_mxfp4_equals_transformers(shape):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    # Every scale byte, the extremes (2^-127 subnormal, 2^128 overflowing 4 and 6 to inf) included.
    scales = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    scales.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)[: scales.numel()]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), theirs)


def test_mxfp4_checkpoint_loads_dequantized_and_aligns(tmp_path):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moe_tune.engine.align.compare import load_ours

    # MXFP4 packs 32 input values a group: the expert hidden size must be a multiple of 32 for down_proj.
    plain = save_tiny_checkpoint(tiny_gpt_oss(intermediate_size=32, num_hidden_layers=2,
                                              layer_types=["sliding_attention", "full_attention"]), tmp_path / "plain")
    directory = mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    _, _, cfg = model_profile_from_checkpoint(directory)
    ours = load_ours(cfg)
    stored = load_file(str(directory / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts.gate_up_proj"
    theirs = convert_moe_packed_tensors(stored[prefix + "_blocks"], stored[prefix + "_scales"], dtype=torch.float32)
    theirs = theirs.transpose(1, 2)  # [E, 2F, D], gate and up rows interleaved
    ours_w = ours.layers[1].mlp.experts.w_gate_up.detach()
    assert torch.equal(ours_w, torch.cat([theirs[:, 0::2], theirs[:, 1::2]], 1))
    report = align_checkpoint(directory, ONE_DOCUMENT, pin_routing=True, lora_targets=())
    assert report.passed, report.failures


# The ops: sinks + sliding window in packed attention, biases + clamped SwiGLU in the MoE op.


@pytest.mark.parametrize("lengths", [(23, 9, 14), (1, 5, 0, 17), (8,)], ids=["three docs", "one-token and empty", "one doc"])
# Plain causal attention (no window, no sinks) is tests/engine/test_attention_varlen.py's.
@pytest.mark.parametrize("window, has_sinks", [(None, True), (1, True), (4, True), (8, True), (1, False), (4, False)],
                         ids=["sinks", "window 1 sinks", "window 4 sinks", "window 8 sinks", "window 1", "window 4"])
def test_packed_attention_with_sinks_and_window(lengths, window, has_sinks):
    gen = torch.Generator().manual_seed(len(lengths) + (window or 0))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, heads, kv_heads, dim = int(cu[-1]), 6, 2, 12  # GQA 3, a head dim not a multiple of 8
    q, k, v = (torch.randn(1, total, h, dim, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    sinks = (torch.randn(heads, generator=gen, dtype=torch.float64) * 2).requires_grad_() if has_sinks else None
    ours = packed_causal_attention(q, k, v, DocumentBuckets.from_cu_seqlens(cu), sinks=sinks, window=window)
    expected = dense_attention(q, k, v, cu, sinks, window)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    ours_grads = torch.autograd.grad(ours, leaves, grad)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    for got, want in zip(ours_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad, match", [
    ({"window": 0}, r"window \(0\) must be >= 1"),
    ({"sinks": torch.zeros(5)}, r"sinks: shape \(5,\) must be \[H\] = \[6\]"),
])
def test_packed_attention_refuses_bad_sinks_and_window(bad, match):
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        packed_causal_attention(q, k, k, DocumentBuckets.from_cu_seqlens(torch.tensor([0, 4], dtype=torch.int32)),
                                **bad)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, model_dim, hidden", [
    (13, 5, 2, 12, 7),  # odd sizes everywhere
    (1, 3, 3, 8, 4),  # one token sent to every expert
    (9, 6, 1, 5, 3),  # top-1, some experts empty
])
@pytest.mark.parametrize("part", ["biases", "clamp", "both"])
def test_moe_mlp_biases_and_clamp_match_the_oracle(num_tokens, num_experts, top_k, model_dim, hidden, part):
    gen = torch.Generator().manual_seed(num_tokens * 31 + top_k)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    x = leaf(num_tokens, model_dim)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = leaf(num_tokens, top_k)
    w_gate_up, w_down = leaf(num_experts, 2 * hidden, model_dim), leaf(num_experts, model_dim, hidden)
    extras = {}
    if part in ("biases", "both"):
        extras.update(b_gate_up=leaf(num_experts, 2 * hidden), b_down=leaf(num_experts, model_dim))
    if part in ("clamp", "both"):
        # A limit inside the pre-activations' spread (std ~ sqrt(D)), so both clamps cut.
        extras["clamped_swiglu"] = ClampedSwiGLU(alpha=1.702, limit=1.5)
    ours = moe_mlp(x, ids, weights, w_gate_up, w_down, **extras)
    expected = moe_mlp_loop_ref(x, ids, weights, w_gate_up, w_down, **extras)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    leaves = [x, weights, w_gate_up, w_down] + [t for t in extras.values() if isinstance(t, torch.Tensor)]
    grad = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(ours, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_moe_mlp_clamped_swiglu_is_gpt_oss_activation():
    """The op's expert equals transformers' GptOssExperts (interleaved gate/up, biases, clamp) on one expert."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gen = torch.Generator().manual_seed(3)
    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=1.0))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 8, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    weights = torch.rand(5, 2, generator=gen)
    expected = experts(x, ids, weights)
    w_gate_up = family_module.deinterleave(experts.gate_up_proj.detach().transpose(1, 2))
    ours = moe_mlp(x, ids, weights, w_gate_up, experts.down_proj.detach().transpose(1, 2),
                   b_gate_up=family_module.deinterleave(experts.gate_up_proj_bias.detach()),
                   b_down=experts.down_proj_bias.detach(), clamped_swiglu=ClampedSwiGLU(1.702, 1.0))
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", ["b_gate_up", "b_down", "clamped_swiglu"])
def test_moe_mlp_triton_refused_for_gpt_oss_experts(monkeypatch, extra):
    """The Triton kernels take neither biases nor the clamp: auto takes the reference, an explicit triton raises."""
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    x, ids, weights = torch.randn(3, 4), torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    value = {"b_gate_up": torch.zeros(2, 6), "b_down": torch.zeros(2, 4), "clamped_swiglu": ClampedSwiGLU()}[extra]
    with pytest.raises(RuntimeError, match="moe_mlp has no Triton kernel for these inputs"):
        moe_mlp(x, ids, weights, torch.randn(2, 6, 4), torch.randn(2, 4, 3), **{extra: value})


@pytest.mark.parametrize("bad, match", [
    ({"b_gate_up": torch.zeros(2, 5)}, r"b_gate_up: shape \(2, 5\) dtype torch.float32 must be a float \[2, 6\]"),
    ({"b_down": torch.zeros(3, 4)}, r"b_down: shape \(3, 4\) dtype torch.float32 must be a float \[2, 4\]"),
    ({"b_down": torch.zeros(2, 4, dtype=torch.int64)}, r"b_down: shape \(2, 4\) dtype torch.int64 must be a float"),
    ({"clamped_swiglu": (1.702, 7.0)}, r"clamped_swiglu: tuple must be a ClampedSwiGLU or None"),
])
def test_moe_mlp_refuses_bad_biases(bad, match):
    x, ids, weights = torch.randn(3, 4), torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    with pytest.raises(ValueError, match=match):
        moe_mlp(x, ids, weights, torch.randn(2, 6, 4), torch.randn(2, 4, 3), **bad)


def test_lora_keeps_biases_and_sinks_frozen(checkpoint):
    """LoRA runs adapt the experts' weights (per-expert adapters) and the targeted projections; the expert, router
    and attention biases and the sinks are base parameters, frozen (PEFT bias: none)."""
    from moe_tune.engine.align.compare import load_ours
    from moe_tune.engine.lora import inject_lora
    from moe_tune.profiles.schema import LoraProfile

    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    model = inject_lora(load_ours(cfg), LoraProfile(target_modules=["q_proj", "o_proj"]))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    assert any("experts.lora_A" in name for name in trainable)
    frozen = {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if not p.requires_grad}
    assert {"b_gate_up", "b_down", "bias", "sinks"} <= frozen


@pytest.mark.parametrize("change, line", [
    ({"layers": [{"attention": "linear", "sliding_window": 8}]},
     "model.layers.0.sliding_window (8) needs model.layers.0.attention: full (got 'linear')"),
    ({"layers": [{"attention": "qsa", "sliding_window": 4}]},
     "model.layers.0.sliding_window (4) needs model.layers.0.attention: full (got 'qsa')"),
    ({"layers": [{"attention": "full", "sliding_window": 0}]}, "model.layers.0.sliding_window"),
    ({"layers": [{"attention": "sparse"}], "sparse_attention": {"index_heads": 1, "index_head_dim": 8, "topk": 4}},
     "model.attention_sinks (True) needs no sparse or qsa layer: a layer has attention: sparse"),
])
def test_profile_refuses_windows_and_sinks_where_they_do_not_apply(checkpoint, change, line):
    """The schema's rules for the new fields, as `moe-tune validate` reports them (one line, the field's path)."""
    from moe_tune.profiles import ProfileError, validate_profile

    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    model = {**cfg.model_dump(mode="json", exclude={"checkpoint"}), **change}
    raw = {"name": "rules", "model": model, "data": {"seq_len": 32}, "train": {"steps": 1}}
    with pytest.raises(ProfileError) as err:
        validate_profile(raw)
    assert any(line in problem for problem in err.value.problems), err.value.problems


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int64], ids=["stored bytes", "float", "int64"])
def test_mxfp4_recipe_reads_bytes_and_refuses_anything_else(dtype):
    """The MXFP4 recipe dequantizes uint8 blocks and scales; any other getter (export's tracer of where each value
    goes, a checkpoint storing them in another dtype) gets a KeyError naming the key and why, which the loader and
    `moe-tune export` turn into one line each (dequantization cannot be written back)."""
    from types import SimpleNamespace

    base = "model.layers.0.mlp.experts."
    stored = {base + "gate_up_proj_blocks": torch.full((2, 6, 1, 16), 0x21, dtype=dtype),
              base + "gate_up_proj_scales": torch.full((2, 6, 1), 127, dtype=dtype)}

    def get(key):
        return stored[key]

    recipe = family_module.expert_weight(base, "gate_up_proj", SimpleNamespace(first_expert=1, num_experts=1))
    if dtype == torch.uint8:
        # Code 1 (0.5) in each low nibble, code 2 (1.0) in each high one, scale 2^0; gate rows (even) first.
        assert torch.equal(recipe(get).float(), torch.tensor([0.5, 1.0] * 16).expand(1, 6, 32))
    else:
        with pytest.raises(KeyError, match=r"gate_up_proj \(the checkpoint stores it as MXFP4 .*_blocks and _scales"):
            recipe(get)
