"""Comparison helpers of the hybrid-attention family tests (qwen3_next, qwen3_5_moe), independent of engine/align:
our model on one packed row against transformers' causal LM (AutoModelForCausalLM) run on each document alone,
layer by layer, in fp32, and parameter gradients (align compares LoRA gradients only).

Shapes: T packed tokens, L tokens of one document, D model dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.engine.families import load_checkpoint_weights, model_profile_from_checkpoint
from moe_tune.engine.model.model import build_model

# The alignment tolerances in fp32.
LOGITS_MAX_ABS = 1e-4
KL_MAX = 1e-6
# Gradients: max abs difference relative to the reference's largest entry (align's default for LoRA gradients).
GRAD_REL = 1e-3


def load_reference(directory: Path) -> nn.Module:
    """The checkpoint as transformers' causal LM: fp32, eager attention and experts, on transformers' own PyTorch
    paths (flash-linear-attention, when installed, is not used: align's reference)."""
    from transformers import AutoModelForCausalLM

    from moe_tune.engine.align.compare import hold_pure_torch_paths
    from moe_tune.engine.align.reference import pure_torch_paths

    with pure_torch_paths():
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
    hold_pure_torch_paths(model)
    return model.eval()


def load_ours(directory: Path, **profile_changes) -> nn.Module:
    _, _, cfg = model_profile_from_checkpoint(directory)
    cfg = cfg.model_copy(update=profile_changes)
    model = build_model(cfg)
    load_checkpoint_weights(model, cfg)
    return model.eval()


def documents(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


@dataclass
class Run:
    logits_TV: torch.Tensor
    layers_TD: list[torch.Tensor]  # hidden state after each decoder layer
    loss: torch.Tensor  # mean next-token cross-entropy over every document's labelled tokens


def _labelled(docs: list[torch.Tensor]) -> int:
    return sum(len(d) - 1 for d in docs)


def run_reference(reference: nn.Module, docs: list[torch.Tensor], backward: bool = False) -> Run:
    """Each document alone; logits and layer outputs concatenated in document order."""
    layers = list(reference.model.layers)
    store: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [
        layer.register_forward_hook(lambda _m, _i, out, i=i: store[i].append(out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(layers)
    ]
    logits, loss = [], torch.zeros(())
    try:
        for doc in docs:
            logits_LV = reference(input_ids=doc[None]).logits[0]
            loss = loss + F.cross_entropy(logits_LV[:-1], doc[1:], reduction="sum") / _labelled(docs)
            logits.append(logits_LV)
    finally:
        for h in handles:
            h.remove()
    if backward:
        loss.backward()
    return Run(torch.cat(logits).detach(), [torch.cat([h[0] for h in hs]).detach() for hs in store], loss.detach())


def run_ours(model: nn.Module, docs: list[torch.Tensor], backward: bool = False) -> Run:
    """All documents packed into one row with cu_seqlens."""
    store: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, out: store.append(out[0][0])) for layer in model.layers]
    ids = torch.cat(docs)[None]
    cu_seqlens = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    try:
        out = model(ids, cu_seqlens, labels)
    finally:
        for h in handles:
            h.remove()
    if backward:
        out.lm_loss.backward()
    return Run(out.logits[0].detach(), [h.detach() for h in store], out.lm_loss.detach())


def kl(ref_TV: torch.Tensor, ours_TV: torch.Tensor) -> float:
    """Mean over tokens of KL(reference || ours) of the next-token distributions."""
    ref_logp, our_logp = ref_TV.log_softmax(-1), ours_TV.log_softmax(-1)
    return (ref_logp.exp() * (ref_logp - our_logp)).sum(-1).mean().item()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_matches(ours: Run, ref: Run) -> None:
    """Every layer's hidden state and the logits within the issue's tolerances, KL <= 1e-6."""
    assert len(ours.layers_TD) == len(ref.layers_TD)
    for i, (o, r) in enumerate(zip(ours.layers_TD, ref.layers_TD)):
        assert max_abs(o, r) <= LOGITS_MAX_ABS, f"layer {i}: max abs {max_abs(o, r):.3g}"
    assert max_abs(ours.logits_TV, ref.logits_TV) <= LOGITS_MAX_ABS
    assert kl(ref.logits_TV, ours.logits_TV) <= KL_MAX
    assert abs(ours.loss.item() - ref.loss.item()) <= LOGITS_MAX_ABS


def assert_gradients_match(expected: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Our parameter gradients (by name) against the reference gradients mapped onto them."""
    params = dict(model.named_parameters())
    for name, want in expected.items():
        got = params[name].grad
        scale = want.abs().max().item()
        assert scale > 0, f"{name}: the reference gradient is zero (the check would be empty)"
        assert max_abs(got, want) <= GRAD_REL * scale, f"{name}: max abs {max_abs(got, want):.3g} (scale {scale:.3g})"
