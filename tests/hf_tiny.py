"""Tiny Hugging Face checkpoints built offline with transformers (random weights, nothing downloaded).

Every parameter is perturbed so that conventions hide nothing: (1 + w) norms and correction biases are far from
zero, and router weights are scaled up so the top-k choice has large margins (routing flips would otherwise
dominate any mismatch).
"""

from __future__ import annotations

from pathlib import Path

import torch

ROUTER_SUFFIXES = ("mlp.gate.weight", "router.weight", "gate.weight")


def perturb_(model: torch.nn.Module, seed: int = 0, scale: float = 0.1, router_gain: float = 20.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype)
            if param.dim() == 1:
                param.add_(noise * scale)  # norms, biases, decay parameters: off their neutral init
            else:
                param.add_(noise * scale * param.float().std().clamp_min(0.02).item())
            if name.endswith(ROUTER_SUFFIXES) and param.dim() == 2:
                param.mul_(router_gain)
        for name, buf in model.named_buffers():
            if "correction_bias" in name:
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)


def save_tiny_checkpoint(model: torch.nn.Module, directory: Path, seed: int = 0) -> Path:
    """Perturb `model` (a transformers model in fp32) and save it in the hub layout under `directory`."""
    perturb_(model, seed)
    model.save_pretrained(str(directory))
    return directory


def save_drawn_adapter(peft_model: torch.nn.Module, directory: Path, scale: float) -> None:
    """`peft_model`'s adapter saved in `directory` as the trainer saves it, every lora_B drawn (seed 1) times `scale`
    so that the adapter changes the model (PEFT starts B at zero)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(directory), safe_serialization=True)


def reference_loss(reference: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, labels: torch.Tensor):
    """The reference's mean next-token loss over a packed micro-batch, each document run alone."""
    total, count = 0.0, int((labels != -100).sum())
    with torch.no_grad():
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            logits = reference(input_ids=input_ids[:, a:b]).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits, labels[0, a:b], ignore_index=-100, reduction="sum").item()
    return total / count



def tiny_qwen3_moe(**overrides):
    """A 3-layer qwen3_moe (dense first layer, 7 experts top-2) in transformers, random init."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=7, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    config.update(overrides)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def tiny_deepseek_v3(**overrides):
    """A 3-layer deepseek_v3 (dense first layer; 9 experts in 3 groups, 2 groups kept, top-3; 2 shared experts) with
    MLA (q latent, interleaved RoPE) in transformers, random init."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=9, num_experts_per_tok=3,
        n_group=3, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        rms_norm_eps=1e-5, max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    config.update(overrides)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config))


def tiny_deepseek_v32(**overrides):
    """A 3-layer deepseek_v32: tiny_deepseek_v3's shape with DSA on every layer (8 indexer heads of dim 16, the
    first 8 dims roped; 6 keys per query, fewer than the test documents hold)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=9, num_experts_per_tok=3,
        n_group=3, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        index_n_heads=8, index_head_dim=16, index_topk=6,
        rms_norm_eps=1e-5, max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    config.update(overrides)
    return DeepseekV32ForCausalLM(DeepseekV32Config(**config))


# qwen3_next / qwen3_5_moe: K != V and two value heads per key head (the interleaved qkvz / ba groups matter), 5
# experts top-2 with a gated shared expert, linear and full layers, rotary on half of each 16-dim head.
QWEN_HYBRID_TEXT = dict(
    vocab_size=320, hidden_size=48, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=5, num_experts_per_tok=2,
    moe_intermediate_size=24, shared_expert_intermediate_size=20,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def tiny_qwen3_next(**overrides):
    """A 4-layer qwen3_next (linear, full, linear with a dense MLP, full) in transformers, random init."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = dict(QWEN_HYBRID_TEXT, mlp_only_layers=[2], intermediate_size=40, norm_topk_prob=True)
    config.update(overrides)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**config))


def image_token_ids(vocab_size: int) -> dict[str, int]:
    """The image, vision-start and vision-end token ids inside a tiny vocabulary (the published ones are ~248k)."""
    return dict(image_token_id=vocab_size - 3, vision_start_token_id=vocab_size - 2, vision_end_token_id=vocab_size - 1)


def tiny_qwen3_5_moe(**overrides):
    """A qwen3_5_moe vision-language model (the hub layout: model.language_model.*, model.visual.*) whose
    4-layer language model is QWEN_HYBRID_TEXT with an mrope_section over the 4 rotary frequencies; a 1-block
    vision tower. `overrides` go to the text config."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    rope = dict(QWEN_HYBRID_TEXT["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True)
    text = dict(QWEN_HYBRID_TEXT, rope_parameters=rope)
    text.update(overrides)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, num_position_embeddings=16)
    return Qwen3_5MoeForConditionalGeneration(
        Qwen3_5MoeConfig(text_config=text, vision_config=vision, **image_token_ids(text["vocab_size"]))
    )


def tiny_qwen3_5_moe_text(**overrides):
    """The same language model saved on its own (Qwen3_5MoeForCausalLM: model_type qwen3_5_moe_text, model.*)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    config = dict(QWEN_HYBRID_TEXT)
    config.update(overrides)
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))


# qwen4_exp: linear (with PLE), indexed (spelled full_attention, as real checkpoints do), linear (with PLE), indexed;
# 3 residual streams; K != V with two value heads per key head; QSA keeps 2 blocks of 4 keys plus the tail, its
# 12-dim index heads rotated on the attention's 8 rotary dims; 2-grams and 3-grams, 2 hashed heads each, into small
# prime tables saved in 4 shards; eos (1) ends n-gram contexts; 5 experts top-2 with a gated shared expert.
QWEN4_EXP_TEXT = dict(
    vocab_size=320, hidden_size=32, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "indexed_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=5, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=24, hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 3],
    ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=8,
    indexer_compress_ratio=4, eos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)


def tiny_qwen4_exp(**overrides):
    """A qwen4_exp vision-language model (the hub layout: model.language_model.*, model.visual.*) whose 4-layer
    language model is QWEN4_EXP_TEXT; a 1-block vision tower. `overrides` go to the text config."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(0)
    text = dict(QWEN4_EXP_TEXT)
    text.update(overrides)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, num_position_embeddings=16)
    return Qwen4ExpForConditionalGeneration(
        Qwen4ExpConfig(text_config=text, vision_config=vision, **image_token_ids(text["vocab_size"]))
    )


def tiny_qwen4_exp_text(**overrides):
    """The same language model saved on its own (Qwen4ExpForCausalLM: model_type qwen4_exp_text, model.*)."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(0)
    config = dict(QWEN4_EXP_TEXT)
    config.update(overrides)
    return Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**config))


def tiny_mixtral(**overrides):
    """A 2-layer mixtral (5 experts top-2, softmax renormalised; GQA with 12-dim heads wider than hidden / heads) in
    transformers, random init."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=5, num_experts_per_tok=2, rms_norm_eps=1e-5,
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    config.update(overrides)
    return MixtralForCausalLM(MixtralConfig(**config))


def tiny_glm4_moe(**overrides):
    """A 3-layer glm4_moe (dense first layer; 8 experts in 4 groups, 2 groups kept, top-3, sigmoid scores with the
    correction bias, scaled by 2.5; 2 shared experts) with q/k/v biases, q/k RMSNorm and RoPE on half of each
    16-dim head, in transformers, random init."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
    )
    config.update(overrides)
    return Glm4MoeForCausalLM(Glm4MoeConfig(**config))


def tiny_gpt_oss(**overrides):
    """A 3-layer gpt_oss (sliding, full, sliding; a window of 8 keys, shorter than the align documents; 5 experts
    top-2; GQA with 16-dim heads; YaRN over an original context of 16, so the ramp splits the 8 frequencies) in
    transformers, random init. The SwiGLU limit (0.1) is within the tiny experts' pre-activations, so both clamps
    act; the sinks start at N(0, 1.5), so each takes a real share of its head's softmax."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=300, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rms_norm_eps=1e-5,
        max_position_embeddings=64, swiglu_limit=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 16},
    )
    config.update(overrides)
    model = GptOssForCausalLM(GptOssConfig(**config))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


def mxfp4_checkpoint(checkpoint: Path, directory: Path) -> Path:
    """The checkpoint with its expert weights replaced by random MXFP4 blocks and scales (values 2^-5 .. 6 * 2^-3),
    as the hub's gpt-oss stores them; transformers dequantizes them at load (quantization_config.dequantize)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num_experts, cols, rows = tensors.pop(key).shape  # stored [E, in, out]; the blocks are [E, out, in / 32, 16]
        tensors[f"{key}_blocks"] = torch.randint(0, 256, (num_experts, rows, cols // 32, 16), generator=gen,
                                                 dtype=torch.uint8)
        tensors[f"{key}_scales"] = torch.randint(122, 125, (num_experts, rows, cols // 32), generator=gen,
                                                 dtype=torch.uint8)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def tiny_kimi_linear(**overrides):
    """A 4-layer kimi_linear (KDA on three layers, MLA on the last; a dense first MLP; 7 experts top-2, one shared)
    in transformers, random init."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=320, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, linear_num_heads=3, linear_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], q_lora_rank=None, num_local_experts=7,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    )
    config.update(overrides)
    return KimiLinearForCausalLM(KimiLinearConfig(**config))


# Weights an FP8 release keeps in floating point (transformers' FP8 layers replace only the linear projections):
# embeddings, the LM head, norms, routers and gates by name; any weight with a dim under one 128 block by size.
FP8_KEPT = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def write_fp8_checkpoint(src_dir: Path, dst_dir: Path) -> Path:
    """The checkpoint at `src_dir` in the hub's FP8 layout at `dst_dir`: every 2-D projection weight with both dims
    >= 128 becomes float8_e4m3fn with fp32 `<key>_scale_inv` blocks (ops.fp8.quantize_weight), the rest stays as
    saved; config.json gets quantization_config {quant_method: fp8, weight_block_size: [128, 128]} listing the
    linear modules kept in modules_to_not_convert. Other files are copied as they are."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moe_tune.ops.fp8 import BLOCK, quantize_weight

    shutil.copytree(src_dir, dst_dir)
    kept, scale_keys = [], {}
    for shard in sorted(dst_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for key in list(tensors):
            weight = tensors[key]
            if weight.dim() != 2 or not key.endswith(".weight") or "conv1d" in key:
                continue
            if key.endswith(FP8_KEPT) or min(weight.shape) < BLOCK:
                kept.append(key.removesuffix(".weight"))
                continue
            tensors[key], tensors[f"{key}_scale_inv"] = quantize_weight(weight)
            scale_keys[f"{key}_scale_inv"] = shard.name
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = dst_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update(scale_keys)
        index_path.write_text(json.dumps(index, indent=2))
    config_path = dst_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "modules_to_not_convert": sorted(kept)}
    config_path.write_text(json.dumps(config, indent=2))
    return dst_dir


def checkpoint_job(checkpoint: Path, tmp_path: Path, name: str = "hostile") -> dict:
    """A one-step job profile (as a dict) on `checkpoint` with a one-line byte-tokenized data file in tmp_path."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    return {
        "name": name,
        "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 16},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-4},
        "output": {"dir": str(tmp_path / "out")},
    }


# Qwen3's rule: an assistant turn before the last user turn is rendered without its think block.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_query %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
