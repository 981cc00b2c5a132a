"""model.base_precision fp8: which modules become FP8, the random init (the bf16 init quantized), LoRA on FP8 bases,
the refusals, training that tracks the bf16 base, and the FP8 bits through DeepSpeed (bf16 engine, ZeRO-3 over two
gloo ranks) against one process.

Run as a script, this file is one rank of the ZeRO-3 test (see zero3_rank)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moe_tune.engine.lora import inject_lora, load_adapter
from moe_tune.engine.lora.experts import GroupedExpertsLoRA
from moe_tune.engine.memory import attach_activation_memory
from moe_tune.engine.model.attention import TOKEN_MIXERS
from moe_tune.engine.model.blocks import SwiGLU, quantize_blocks, saved_as_parameters
from moe_tune.engine.model.fp8 import Fp8Linear, fp8_base_modules
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import GroupedExperts, expert_generator
from moe_tune.ops.fp8 import FP8_DTYPE, quantize_weight
from moe_tune.profiles import ProfileError, load_profile, validate_profile
from moe_tune.profiles.schema import LoraProfile, MemoryProfile, ModelProfile

# A small model whose projections reach 128 wide (the rule's smallest FP8 dim) and whose narrower ones do not.
WIDE = {
    "vocab_size": 259, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 128,
    "linear_attention": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 32, "value_head_dim": 32},
    "moe": {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 160, "shared_expert_intermediate_size": 128,
            "aux_loss_coef": 0.0},
}  # fmt: skip
NGRAM = {
    "embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "vocab_size_base": 50, "vocab_size_multiple": 8,
    "hash_seed": 7, "conv_kernel_size": 3, "boundary_token_id": 258,
}  # fmt: skip
SPARSE = {"sparse_attention": {"index_heads": 2, "index_head_dim": 32, "topk": 8, "block_size": 4}}
MLA = {"mla": {"q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
               "v_head_dim": 32}}  # fmt: skip
# One model per kind of token mixer and channel mixer the families map onto.
KINDS = {
    "linear-moe": ([{"attention": "linear", "mlp": "moe"}], {}),
    "full-dense": ([{"attention": "full", "mlp": "dense"}], {}),
    "sparse": ([{"attention": "sparse"}], SPARSE),
    "kda": ([{"attention": "kda"}], {"kda_attention": {"num_heads": 4, "head_dim": 32}}),
    "mla": ([{"attention": "mla"}], MLA),
    "mla_sparse": ([{"attention": "mla_sparse"}], {**MLA, **SPARSE}),
    "qsa-hyper-ngram": ([{"attention": "qsa", "has_ngram_embedding": True}],
                        {**SPARSE, "norm_one_plus": True, "ngram_embedding": NGRAM,
                         "hyper_connections": {"num_streams": 2, "mix_rank": 8}}),
    "gpt_oss-biases": ([{"attention": "full"}], {"attention_bias": True, "attention_output_bias": True,
                                                 "attention_output_gate": False}),
}  # fmt: skip


def wide_cfg(layers, precision="fp8", **extra) -> ModelProfile:
    return ModelProfile.model_validate({**WIDE, "layers": layers, "base_precision": precision, **extra})


def mixer_kind(model: nn.Module, name: str) -> bool:
    """Whether module `name` sits in a token mixer or a SwiGLU (walked by name, apart from the rule's own walk)."""
    parts = name.split(".")
    mixers = tuple(TOKEN_MIXERS.values()) + (SwiGLU,)
    return any(isinstance(model.get_submodule(".".join(parts[:i])), mixers) for i in range(1, len(parts)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_fp8_modules_follow_the_rule(kind):
    layers, extra = KINDS[kind]
    model = build_model(wide_cfg(layers, **extra))
    fp8 = {name for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {name for name, m in linears.items()
                if mixer_kind(model, name) and min(m.in_features, m.out_features) >= 128}  # fmt: skip
    assert fp8 == expected and fp8, sorted(fp8 ^ expected)
    # Never FP8: embeddings, LM head, norms, routers, hyper-connection mixers, n-gram parts.
    never = {"embed_tokens", "lm_head", "gate", "shared_expert_gate", "mix_down", "mix_up", "inject_proj"}
    assert not [name for name in fp8 if name.rsplit(".", 1)[-1] in never or "ngram" in name]
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            assert module.fp8 and module.w_gate_up.dtype == torch.uint8, name
    # The rule function names exactly what was converted (and the experts).
    chosen = fp8_base_modules(model)
    assert {n for n, m in chosen.items() if not isinstance(m, GroupedExperts)} == fp8
    # Every FP8 parameter is frozen bits; every float parameter keeps the bf16 model's name and shape.
    bf16 = dict(build_model(wide_cfg(layers, "bf16", **extra)).named_parameters())
    for name, param in model.named_parameters():
        if param.dtype in (torch.uint8, torch.int32):
            assert not param.requires_grad and (name.endswith("_scale_inv") or name in bf16), name
        else:
            assert bf16[name].shape == param.shape, name


def test_vision_tower_stays_float():
    profile = load_profile("tiny-vl", ["model.base_precision=fp8"])
    model = build_model(profile.model)
    assert not [n for n, m in model.named_modules() if n.startswith("vision") and isinstance(m, Fp8Linear)]
    assert all(p.is_floating_point() for p in model.vision.parameters())


def test_modules_to_save_are_trained_as_floats():
    cfg = wide_cfg([{"attention": "full", "mlp": "moe"}])
    lora = LoraProfile(r=4, target_modules=["q_proj"], modules_to_save=["o_proj", "experts"], experts=False)
    base = build_model(cfg)
    o_proj = base.layers[0].self_attn.o_proj.dequantized()
    model = inject_lora(base, lora)
    saved = model.base_model.model.layers[0].self_attn.o_proj.modules_to_save["default"]
    assert type(saved) is nn.Linear and saved.weight.requires_grad
    torch.testing.assert_close(saved.weight, o_proj, rtol=0, atol=0)
    experts = model.base_model.model.layers[0].mlp.experts.modules_to_save["default"]
    assert not experts.fp8 and experts.w_gate_up.requires_grad


@pytest.mark.parametrize("overrides, refused", [
    (["model.base_precision=fp8", "lora.enabled=false"], True),
    (["model.base_precision=bf16", "lora.enabled=false"], False),
    (["lora.enabled=false"], False),  # the default is bf16
    (["model.base_precision=fp8"], False),
    (["model.base_precision=fp8", "lora.experts=false"], False),
])  # fmt: skip
def test_full_fine_tuning_of_an_fp8_base_is_refused(overrides, refused):
    if not refused:
        assert load_profile("tiny", overrides).model.base_precision in ("bf16", "fp8")
        return
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", overrides)
    assert err.value.problems == [
        "model.base_precision ('fp8') needs lora.enabled (true): FP8 base weights are frozen and take no gradient, "
        "so full fine-tuning (lora.enabled false) needs model.base_precision 'bf16'"
    ]


@pytest.mark.parametrize("value", ["fp4", "FP8", "float8", "''"])
def test_base_precision_takes_bf16_or_fp8(value):
    with pytest.raises(ProfileError, match=r"model.base_precision .*'bf16' or 'fp8'"):
        load_profile("tiny", [f"model.base_precision={value}"])


def test_checkpoint_model_takes_base_precision(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    raw = load_profile("tiny").model_dump(mode="json")
    raw["model"] = {"checkpoint": str(tmp_path), "base_precision": "fp8"}
    raw["data"]["path"] = str(tmp_path / "data.jsonl")
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    assert validate_profile(raw).model.base_precision == "fp8"
    raw["lora"]["enabled"] = False
    with pytest.raises(ProfileError, match=r"model.base_precision \('fp8'\) needs lora.enabled"):
        validate_profile(raw)


def test_init_is_the_bf16_init_quantized():
    layers = [{"attention": "full", "mlp": "moe"}, {"attention": "linear", "mlp": "dense"}]
    bf16, fp8 = build_model(wide_cfg(layers, "bf16")), build_model(wide_cfg(layers, "fp8"))
    float_state = dict(bf16.named_parameters())
    num_linears = 0
    for name, module in fp8.named_modules():
        if isinstance(module, Fp8Linear):
            w_q, scale = quantize_weight(float_state[f"{name}.weight"])
            assert torch.equal(module.fp8_tensors()[0].view(torch.uint8), w_q.view(torch.uint8)), name
            assert torch.equal(module.fp8_tensors()[1], scale), name
            num_linears += 1
        elif isinstance(module, GroupedExperts):
            gate_up, gate_up_scale, down, down_scale = module.fp8_tensors()
            ref_gu, ref_gu_scale = quantize_weight(float_state[f"{name}.w_gate_up"], module.gate_up_segments)
            ref_down, ref_down_scale = quantize_weight(float_state[f"{name}.w_down"])
            assert torch.equal(gate_up.view(torch.uint8), ref_gu.view(torch.uint8))
            assert torch.equal(down.view(torch.uint8), ref_down.view(torch.uint8))
            assert torch.equal(gate_up_scale, ref_gu_scale) and torch.equal(down_scale, ref_down_scale)
            # Gate and up halves scaled apart: 160 rows each -> 2 + 2 scale rows.
            assert gate_up_scale.shape == (4, 4, 1)
    assert num_linears >= 8
    # Everything that stays float is the same numbers.
    for name, param in fp8.named_parameters():
        if param.is_floating_point():
            assert torch.equal(param, float_state[name]), name


@pytest.mark.parametrize("shape, segments", [
    ((256, 384), None),
    ((2, 512, 256), (256, 256)),  # experts' w_gate_up: gate and up scaled apart
    ((256, 200), None),  # columns not a multiple of 128: the reference path
    ((2, 320, 128), (160, 160)),  # segments not multiples of 128
    ((130, 128), None),
])  # fmt: skip
def test_quantize_blocks_is_quantize_weight_bit_for_bit(shape, segments):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 0.02
    w[..., :128, :128] = 0.0  # an all-zero block: the floor scale
    w[..., -1, -1] = 1000.0  # beyond e4m3's range once scaled: the clamp
    fast_q, fast_scale = quantize_blocks(w, segments)
    ref_q, ref_scale = quantize_weight(w, segments)
    assert torch.equal(fast_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(fast_scale, ref_scale)


def test_expert_init_on_any_layout():
    # Local experts 2..3 of a layer draw what experts 2..3 of the whole layer draw.
    whole = GroupedExperts(4, 128, 64, layer_index=1, fp8=True)
    part = GroupedExperts(2, 128, 64, first_expert=2, layer_index=1, fp8=True)
    whole.reset_parameters(0.02, 7)
    part.reset_parameters(0.02, 7)
    assert torch.equal(whole.w_gate_up[2:], part.w_gate_up) and torch.equal(whole.w_down_scale_inv[2:],
                                                                             part.w_down_scale_inv)
    gen = expert_generator(7, 1, 3)
    ref = quantize_weight(torch.randn(128, 128, generator=gen).mul_(0.02), (64, 64))[0]  # [2F, D]
    assert torch.equal(part.w_gate_up[1], ref.view(torch.uint8))
    rebuilt = part.rebuilt()
    assert rebuilt.fp8 and rebuilt.w_down.dtype == torch.uint8


def test_fp8_linear_stores_bits_and_computes_through_them():
    layer = Fp8Linear(200, 130, bias=True)
    w = torch.randn(130, 200)
    layer.quantize_from(w)
    w_q, scale = quantize_weight(w)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale_inv.dtype == torch.int32
    assert not layer.weight.requires_grad and not layer.weight_scale_inv.requires_grad
    assert layer.weight_scale_inv.shape == (2, 2)
    # Casts of the module touch the bias only.
    layer = layer.to(torch.bfloat16).float()
    assert torch.equal(layer.fp8_tensors()[0].view(torch.uint8), w_q.view(torch.uint8))
    assert torch.equal(layer.fp8_tensors()[1], scale)
    x = torch.randn(3, 200, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (3, 130) and x.grad is not None and layer.weight.grad is None
    with pytest.raises(ValueError, match="w_q: shape"):
        layer.set_quantized(w_q.t(), scale)
    with pytest.raises(ValueError, match="scale_inv: shape"):
        layer.set_quantized(w_q, scale[:1])


# Relative error (norm) of an FP8 module's output against its dequantized float twin's (a 10% error in a scale gives
# 10% and 21%): both compute with the dequantized weights, so the summation order only (measured 0 on these shapes).
TWIN_TOLERANCE = {"linear": 1e-6, "experts": 1e-6}


def test_fp8_modules_compute_their_dequantized_weights():
    model = build_model(wide_cfg([{"attention": "full", "mlp": "moe"}]))
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q_proj = model.layers[0].self_attn.q_proj
    y = q_proj(x)
    # The FP8 linear's definition: x deq(W)^T in fp32, x not quantized.
    torch.testing.assert_close(y, x @ q_proj.dequantized().t(), rtol=1e-5, atol=1e-6)
    twin = nn.functional.linear(x, q_proj.dequantized())
    assert (y - twin).norm() / twin.norm() < TWIN_TOLERANCE["linear"]
    experts = model.layers[0].mlp.experts
    ids = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(64, 2, generator=torch.Generator().manual_seed(2))
    y, twin = experts(x, ids, weights), experts.dequantized_twin()(x, ids, weights)
    assert (y - twin).norm() / twin.norm() < TWIN_TOLERANCE["experts"]


def test_fp8_linear_backward_reads_the_parameters_as_they_are_then():
    # ZeRO-3 releases a weight after forward and gathers it into new storage for backward: backward must read the
    # parameter then (a backward that reads forward's storage kept it alive all along).
    layer = Fp8Linear(256, 128, bias=False)
    layer.quantize_from(torch.randn(128, 256))
    x = torch.randn(4, 256, requires_grad=True)
    y = layer(x)
    bits, scale = layer.weight.data.clone(), layer.weight_scale_inv.data.clone()
    layer.weight.data = torch.empty(0, dtype=torch.uint8)
    layer.weight_scale_inv.data = torch.empty(0, dtype=torch.int32)
    layer.weight.data, layer.weight_scale_inv.data = bits.flip(0), scale.flip(0)  # other bits in new storage
    dy = torch.randn(4, 128)
    y.backward(dy)
    expected = dy @ layer.dequantized()
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


class _ScaleByBits(torch.autograd.Function):
    """y = x * w (w an FP8 view): saves w and x, as the FP8 kernels save their weight views and inputs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w.float()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * w.float(), None


def test_saved_as_parameters_keeps_weights_and_hands_the_rest_on():
    bits = nn.Parameter(torch.full((4, 128), 0.5).to(FP8_DTYPE).view(torch.uint8), requires_grad=False)
    x = torch.randn(4, 128, requires_grad=True)
    seen = []

    def outer_pack(t):
        seen.append(t)
        return ("outer", t)

    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda packed: packed[1]):
        with saved_as_parameters(bits):
            y = _ScaleByBits.apply(x, bits.view(FP8_DTYPE))
    # The activation reached the hooks around the block (engine/memory, checkpointing); the weight view did not.
    assert len(seen) == 1 and seen[0] is x
    bits.data = torch.full((4, 128), 2.0).to(FP8_DTYPE).view(torch.uint8)  # regathered into new storage
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 128), 2.0))


def memory_run(memory: MemoryProfile):
    layers = [{"attention": "full", "mlp": "moe"}, {"attention": "linear", "mlp": "dense"}]
    torch.manual_seed(0)
    lora = LoraProfile(r=4, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"])
    model = inject_lora(build_model(wide_cfg(layers), memory.activation_checkpointing), lora)
    attach_activation_memory(model, memory)
    ids = torch.randint(0, 259, (1, 32), generator=torch.Generator().manual_seed(1))
    out = model.train()(input_ids=ids, cu_seqlens=torch.tensor([0, 32], dtype=torch.int32), labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("memory", [{"preset": "balanced"}, {"preset": "max-context"},
                                    {"activation_checkpointing": True}], ids=str)  # fmt: skip
def test_memory_policies_give_the_same_gradients_on_fp8(memory):
    # Recomputed and offloaded layers over FP8 weights (whose saved weights are kept as parameters).
    loss, grads = memory_run(MemoryProfile(**memory))
    plain_loss, plain_grads = memory_run(MemoryProfile(preset="none"))
    assert loss == plain_loss and grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


def test_lora_on_fp8_base_adapters_in_the_run_dtype(tmp_path):
    layers = [{"attention": "full", "mlp": "moe"}]
    lora = LoraProfile(r=4, target_modules=["q_proj", "o_proj", "gate_proj"], experts=True)
    model = inject_lora(build_model(wide_cfg(layers)), lora)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    assert all("lora_" in n for n in adapters)
    q_proj = model.base_model.model.layers[0].self_attn.q_proj
    # The fused fast path serves LoRA over an FP8 base.
    assert type(q_proj).__name__ == "FusedLoraLinear" and isinstance(q_proj.base_layer, Fp8Linear)
    assert q_proj._fast_path_weights(torch.zeros(1, 128)) is not None
    ids = torch.randint(0, 259, (1, 16))
    args = {"input_ids": ids, "cu_seqlens": torch.tensor([0, 16], dtype=torch.int32)}
    # Saved and loaded back onto a fresh FP8 model: the same outputs (adapters moved off their zero B first).
    with torch.no_grad():
        for p in adapters.values():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(tmp_path / "adapter"))
    loaded = load_adapter(build_model(wide_cfg(layers)), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**args).logits, model.eval()(**args).logits)
    assert not torch.equal(loaded(**args).logits, build_model(wide_cfg(layers)).eval()(**args).logits)
    # A bf16 model (DeepSpeed's cast): the adapters follow, the FP8 bits do not move.
    bits = q_proj.base_layer.weight.clone()
    model = model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if p.requires_grad)
    assert torch.equal(q_proj.base_layer.weight, bits)
    experts = model.base_model.model.layers[0].mlp.experts
    assert isinstance(experts, GroupedExpertsLoRA)
    out = model.train()(**args, labels=ids)
    out.loss.backward()
    assert experts.lora_A["default"].w_gate_up.grad.dtype == torch.bfloat16
    assert q_proj.lora_A["default"].weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("merge", ["merge_and_unload", "merge_adapter"])
def test_merge_into_fp8_bits_is_refused(merge):
    lora = LoraProfile(r=4, target_modules=["q_proj"], experts=True)
    model = inject_lora(build_model(wide_cfg([{"attention": "full", "mlp": "moe"}])), lora)
    q_proj = model.base_model.model.layers[0].self_attn.q_proj.base_layer
    bits = q_proj.weight.clone()
    with pytest.raises(ValueError, match=r"cannot merge LoRA adapters into FP8 base weights"):
        getattr(model, merge)()
    assert torch.equal(q_proj.weight, bits)


def test_expert_merge_into_fp8_bits_is_refused():
    lora = LoraProfile(r=4, target_modules=[], experts=True)
    model = inject_lora(build_model(wide_cfg([{"attention": "full", "mlp": "moe"}])), lora)
    experts = model.base_model.model.layers[0].mlp.experts
    bits = experts.base_layer.w_gate_up.clone()
    for call in (experts.merge, experts.unmerge):
        with pytest.raises(ValueError, match=r"cannot (un)?merge LoRA adapters into FP8 base weights"):
            call()
    assert torch.equal(experts.base_layer.w_gate_up, bits)


# The tiny profile at a learning rate where a step's loss is a function of the weights: at the profile's own 5e-3
# any perturbation of the expert weights (1e-5 relative included) moves the losses by up to 5% after step 20.
TRACKING = ["train.lr=1e-3", "data.seq_len=64", "train.micro_batch_size=1", "data.corpus_documents=200"]


def plain_losses(profile, steps):
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.train.trainer import build_trainable_model, lr_factor

    tok = load_tokenizer(profile.tokenizer)
    data = PackedDataset(load_documents(profile.data, tok), profile.data.seq_len, tok.pad_id, profile.data.seed)
    torch.manual_seed(profile.train.seed)
    model, trainable = build_trainable_model(profile)
    opt = torch.optim.AdamW(trainable, lr=profile.train.lr, betas=profile.train.betas,
                            weight_decay=profile.train.weight_decay, foreach=False)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, profile.train, steps))
    losses = []
    for step in range(steps):
        batch = data.micro_batch(step, profile.train.micro_batch_size)
        out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, profile.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    return losses


def test_fp8_base_tracks_bf16_base_on_tiny_for_50_steps():
    steps = 50
    bf16 = plain_losses(load_profile("tiny", [*TRACKING, f"train.steps={steps}"]), steps)
    fp8 = plain_losses(load_profile("tiny", [*TRACKING, f"train.steps={steps}", "model.base_precision=fp8"]), steps)
    assert bf16[-1] < 0.8 * bf16[0]  # it trains
    worst = max(abs(a - b) / abs(a) for a, b in zip(bf16, fp8))
    assert worst < 0.01, [round(abs(a - b) / abs(a), 4) for a, b in zip(bf16, fp8)]
    assert fp8 != bf16  # the FP8 experts were used


def test_start_banner_says_fp8_base(tmp_path):
    from moe_tune.engine.train.banner import start_banner

    for precision, shown in (("fp8", True), ("bf16", False)):
        profile = load_profile("tiny", [f"output.dir={tmp_path}", f"model.base_precision={precision}"])
        layout = start_banner(profile, tmp_path, torch.device("cpu"), 1, 10)[2]
        assert ("FP8 base weights" in layout) is shown, layout


# ---- DeepSpeed: the bits through a bf16 engine (one rank) and ZeRO-3 over two gloo ranks ----

ZERO_LAYERS = [{"attention": "full", "mlp": "moe"}, {"attention": "linear", "mlp": "dense"}]
ZERO_LORA = {"r": 4, "target_modules": ["q_proj", "o_proj", "v_proj", "gate_proj"], "experts": True}
ROW = 48


def zero_profile(precision: str, stage: int, out: str):
    raw = load_profile("tiny").model_dump(mode="json")
    raw["model"] = wide_cfg(ZERO_LAYERS).model_dump(mode="json")
    raw["lora"] = {**raw["lora"], **ZERO_LORA, "modules_to_save": []}
    raw["train"]["precision"] = precision
    raw["parallel"]["zero_stage"] = stage
    raw["output"]["dir"] = out
    return validate_profile(raw)


def zero_rows(world: int):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 259, (1, ROW), generator=gen) for _ in range(world)]


def reference_state() -> dict[str, torch.Tensor]:
    return build_model(wide_cfg(ZERO_LAYERS)).state_dict()


def fp8_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("base_model.model.", "").replace(".base_layer", ""): p.detach().clone()
            for n, p in model.named_parameters() if p.dtype in (torch.uint8, torch.int32)}  # fmt: skip


def lora_grads(model: nn.Module, full_grad) -> dict[str, torch.Tensor]:
    return {n: full_grad(p).float().clone() for n, p in model.named_parameters() if p.requires_grad}


def zero3_engine(precision: str, world_size: int, out: str):
    """A ZeRO-3 engine over the model built partitioned under zero.Init (as checkpoint runs build it), its weights
    written as a checkpoint loader writes them (reference_state), LoRA seeded alike on every rank; and the names of
    the dense FP8 weights zero.Init partitioned."""
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    from moe_tune.engine.parallel.expert_parallel import create_expert_layout
    from moe_tune.engine.train.ds_config import deepspeed_config
    from moe_tune.engine.train.trainer import build_partitioned

    profile = zero_profile(precision, 3, out)
    ds_config = deepspeed_config(profile, world_size)
    model = build_partitioned(profile.model, ds_config, False, create_expert_layout(1, world_size))
    partitioned = [n for n, p in model.named_parameters() if p.dtype == torch.uint8 and hasattr(p, "ds_id")]
    state = reference_state()
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if torch.distributed.get_rank() == 0 or not hasattr(param, "ds_id"):
                param.data.copy_(state[name])
    torch.manual_seed(11)
    model = inject_lora(model, LoraProfile(**ZERO_LORA))
    set_z3_leaf_modules(model, [GroupedExpertsLoRA])
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=0.0), config=ds_config,
                                      dist_init_required=False)  # fmt: skip
    return engine, partitioned


def gathered_bits(module: nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    bits = {}
    for name, param in module.named_parameters():
        if param.dtype in (torch.uint8, torch.int32):
            with deepspeed.zero.GatheredParameters([param]):
                bits[name.replace("base_model.model.", "").replace(".base_layer", "")] = param.detach().clone()
    return bits


def zero3_rank(result: str) -> None:
    """One rank: a ZeRO-3 engine in fp32, then one in bf16 (zero3_engine); one forward and backward on this rank's
    row in each; on rank 0 the fp32 loss and full LoRA gradients, and the gathered FP8 bits of both."""
    from deepspeed.utils import safe_get_full_grad

    from moe_tune.engine.train.distributed import init_distributed

    torch.set_num_threads(1)
    dist = init_distributed("gloo", 120)
    row = zero_rows(dist.world_size)[dist.rank]
    saved = {}
    for precision in ("fp32", "bf16"):
        engine, partitioned = zero3_engine(precision, dist.world_size, os.path.dirname(result))
        out = engine(input_ids=row, cu_seqlens=torch.tensor([0, ROW], dtype=torch.int32), labels=row,
                     loss_denominator=float(ROW))  # fmt: skip
        engine.backward(out.loss)
        grads = lora_grads(engine.module, safe_get_full_grad)
        loss = out.lm_loss.detach().float().clone()
        torch.distributed.all_reduce(loss)
        saved[precision] = {"loss": loss, "grads": grads, "bits": gathered_bits(engine.module),
                            "partitioned": partitioned}  # fmt: skip
    if dist.rank == 0:
        torch.save(saved, result)


def test_zero3_two_ranks_keep_the_bits_and_equal_one_process(tmp_path):
    from moe_tune.engine.parallel.launch import rendezvous

    result = tmp_path / "rank0.pt"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with rendezvous() as port:
        proc = subprocess.run([sys.executable, __file__, str(result), str(port)], env=env, capture_output=True,
                              text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    both = torch.load(result, weights_only=True)
    got = both["fp32"]
    # The dense FP8 linears were partitioned by zero.Init (experts are rebuilt outside it, as in training).
    assert any("q_proj" in n for n in got["partitioned"])

    # One process on both rows.
    state = reference_state()
    model = build_model(wide_cfg(ZERO_LAYERS))
    torch.manual_seed(11)
    model = inject_lora(model, LoraProfile(**ZERO_LORA))
    loss = 0.0
    for row in zero_rows(2):
        out = model(input_ids=row, cu_seqlens=torch.tensor([0, ROW], dtype=torch.int32), labels=row,
                    loss_denominator=float(2 * ROW))  # fmt: skip
        out.loss.backward()
        loss += out.lm_loss.item()
    assert got["loss"].item() / 2 == pytest.approx(loss, rel=1e-5)
    expected = lora_grads(model, lambda p: p.grad)
    assert expected.keys() == got["grads"].keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["bits"].keys() == {n for n, t in state.items() if t.dtype in (torch.uint8, torch.int32)}
    for name, bits in got["bits"].items():
        assert bits.dtype == state[name].dtype and torch.equal(bits, state[name]), name
    # The bf16 engine: adapters and their gradients in bf16, the FP8 bits through zero.Init, the cast and a gather
    # unchanged.
    bf16 = both["bf16"]
    assert torch.isfinite(bf16["loss"]) and bf16["grads"].keys() == expected.keys()
    assert bf16["bits"].keys() == got["bits"].keys() and bf16["partitioned"] == got["partitioned"]
    assert all(torch.equal(bits, state[name]) for name, bits in bf16["bits"].items())


def test_bf16_engine_keeps_the_bits(tmp_path):
    import deepspeed

    from moe_tune.engine.train.distributed import init_distributed, shutdown_distributed
    from moe_tune.engine.train.ds_config import deepspeed_config
    from moe_tune.engine.train.trainer import build_trainable_model

    profile = zero_profile("bf16", 1, str(tmp_path))
    dist = init_distributed("gloo", 60)
    try:
        model, trainable = build_trainable_model(profile)
        before = fp8_bits(model)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2),
                                          config=deepspeed_config(profile, 1), dist_init_required=False)  # fmt: skip
        row = zero_rows(1)[0]
        for _ in range(2):
            out = engine(input_ids=row, cu_seqlens=torch.tensor([0, ROW], dtype=torch.int32), labels=row)
            engine.backward(out.loss)
            engine.step()
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters() if p.requires_grad)
        after = fp8_bits(engine.module)
        assert before.keys() == after.keys() and before
        assert all(torch.equal(before[n], after[n]) and after[n].dtype == before[n].dtype for n in before)
        assert torch.isfinite(out.loss)
    finally:
        shutdown_distributed()


def fork_ranks(result: str, world: int, port: int) -> int:
    """Fork the ranks from this process, which imported torch, DeepSpeed and moe-tune once and ran no torch op (as
    tests/engine/dist_forks.py does): each rank would otherwise spend seconds of CI's two cores importing them."""
    import importlib
    import traceback

    from moe_tune.engine.parallel.launch import rank_env

    for module in ("deepspeed", "peft", "moe_tune.engine.train.trainer", "moe_tune.engine.lora.experts"):
        importlib.import_module(module)
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(rank_env(rank, world, port, dict(os.environ)))
                zero3_rank(result)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    return max(abs(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])) for pid in pids)


if __name__ == "__main__":
    sys.exit(fork_ranks(sys.argv[1], 2, int(sys.argv[2])))
