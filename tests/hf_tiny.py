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
