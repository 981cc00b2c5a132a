"""The decode loop: a cached forward over the next tokens of one sequence, and generation token by token.

How decoding works. A DecodeCache holds one state dict per module that carries context. The first call (the
prefill) runs the prompt (up to PREFILL_CHUNK_TOKENS of it; the rest follows in calls of that size) and leaves in
each state what later tokens need; every later call runs only its new tokens (one while generating) and extends the
states:
- softmax attention (full, sparse, qsa, mla): the keys and values of every token so far (the indexers' keys too);
- linear attention (gated delta net, KDA): the recurrent state [H, K, V] fp32 after the last token (the prefill runs
  the chunked op with output_final_state; one token runs the recurrence S <- decay S + beta k (v - S^T k)^T itself)
  and the short conv's last (W - 1) inputs;
- n-gram injection (qwen4_exp): the last N - 1 token ids and its dilated conv's last (W - 1) N inputs;
- hyper-connections, norms and channel mixers: nothing (they act on each token alone). The MoE layers route every
  token to its own top-k experts without the training-time capacity limit and count no loads.
Each row of the logits equals the row the full forward (`model(input_ids, cu_seqlens)` over the whole sequence as one
document) gives, up to rounding.

A prompt with images (PromptImages, a model with a vision tower): the tower runs once on all of them before the
prefill, and each call replaces its image tokens' embeddings with their rows (an image's tokens may span two calls).
Multimodal RoPE rotates the prompt's tokens by their (t, h, w) positions (vision.mrope_positions, as the forward does)
and every later token by its position plus the offset the images left (DecodeCache.rotary_offset).

Shapes: T tokens of this call, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from moe_tune.engine.model.model import MoECausalLM
from moe_tune.engine.model.vision import mrope_positions
from moe_tune.profiles import ProfileError

from .cache import DecodeCache, DecodeStep

# torch.Generator.manual_seed takes seeds in [-2**63, 2**64); a negative one is the same generator as seed + 2**64, so
# seeds are asked for in [0, SEED_LIMIT).
SEED_LIMIT = 2**64
# The prompt runs in cached calls of at most this many tokens: a call holds its rows' logits [T, V] and attention
# scores over every token so far [T, M], so one call over a 20,000-token prompt took 22 GB of host memory on the
# tiny profile (CPU reference ops). Each call continues the cache exactly (tests/engine/test_decode.py).
PREFILL_CHUNK_TOKENS = 1024


def find_causal_lm(model: nn.Module) -> MoECausalLM:
    """The MoECausalLM itself, or the one inside a wrapper (PEFT's PeftModel, adapters merged or not: the LoRA layers
    sit inside it, so calling it runs them)."""
    if isinstance(model, MoECausalLM):
        return model
    for module in model.modules():
        if isinstance(module, MoECausalLM):
            return module
    raise TypeError(f"{type(model).__name__} holds no MoECausalLM to decode with")


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, in the order of their runs of image tokens: pixel_values [P, C Tp p^2] and their (t, h, w)
    patch grids [I, 3] (engine/data/images.py image_patches), each image's run t h w / merge^2 tokens long."""

    pixel_values: torch.Tensor
    grids: torch.Tensor

    def token_counts(self, merge_size: int) -> list[int]:
        """Each image's run of image tokens: its t h w patches folded merge_size x merge_size."""
        return [int(t * h * w) // merge_size**2 for t, h, w in self.grids.tolist()]


def forward_cached(model: nn.Module, input_ids: torch.Tensor, cache: DecodeCache,
                   image_features: torch.Tensor | None = None,
                   mrope_positions: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids [1, T] int64, the next T tokens of the sequence whose states `cache` holds (empty: the prefill) ->
    logits [1, T, V] fp32. Advances cache.num_tokens by T. Runs without autograd. image_features [n, D]: the rows of
    the n image tokens among input_ids (ValueError when they are not n), and mrope_positions [3, T] their tokens'
    rotary positions (prompt_images gives both); without them an image token is embedded as any token is (a
    generated one, as transformers' generate feeds it back)."""
    lm = find_causal_lm(model)
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: shape {tuple(input_ids.shape)} must be [1, T] with T >= 1")
    step = DecodeStep.next(cache, input_ids[0], mrope_positions)
    with torch.no_grad():
        logits = lm.forward_cached(input_ids, step, image_features).float()
    cache.num_tokens += input_ids.shape[1]
    return logits


def prompt_images(lm: MoECausalLM, prompt: torch.Tensor, images: PromptImages) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        int]:
    """For a prompt [1, T] holding `images`' runs of image tokens: the vision tower's rows for them [n, D] (run once,
    without autograd), the prompt's (t, h, w) rotary positions [3, T] and the offset that the tokens after it add to
    their position (DecodeCache.rotary_offset). ProfileError when the model has no vision tower or the prompt's image
    tokens are not the images' count."""
    spec = lm.cfg.vision
    if spec is None:
        raise ProfileError(["images: the model has no vision tower (model.vision) to read them"])
    grids = images.grids.to(prompt.device)
    num_tokens = sum(images.token_counts(spec.spatial_merge_size))
    num_placed = int((prompt[0] == spec.image_token_id).sum())
    if num_placed != num_tokens:
        raise ProfileError([f"prompt: {num_placed} image tokens ({spec.image_token_id}), the images need "
                            f"{num_tokens} ({len(grids)} images)"])
    with torch.no_grad():
        features = lm.vision(images.pixel_values.to(prompt.device), grids)
    # One text token past the prompt: its positions are where the tokens after the prompt continue from.
    ids = torch.cat([prompt[0], prompt.new_tensor([-1])])[None]
    cu_seqlens = torch.tensor([0, ids.shape[1]], dtype=torch.int32, device=prompt.device)
    positions = mrope_positions(ids, cu_seqlens, grids, spec.image_token_id, spec.spatial_merge_size)
    return features, positions[:, :-1], int(positions[0, -1]) - prompt.shape[1]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# How each sampling setting may be set (generate_ids's arguments, generate's options, generation_config.json's keys):
# a test of the value, and the rule that a refusal's line ends with.
SAMPLING_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "temperature": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0 (0: greedy)"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1] (1: no nucleus filter)"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "an integer >= 0 (0: no top-k filter)"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a finite number > 0 (1: none)"),
}


def sampling_rule_broken(key: str, value: object) -> str | None:
    """The rule (SAMPLING_RULES) that `value` of the sampling setting `key` breaks, None where it keeps it."""
    is_valid, rule = SAMPLING_RULES[key]
    return None if is_valid(value) else rule


def check_generate_options(
    prompt_ids: list[int], vocab_size: int, max_new_tokens: int, temperature: float, top_p: float, seed: int = 0,
    top_k: int = 0, repetition_penalty: float = 1.0,
) -> list[str]:
    """One line per option that generate_ids refuses: name, value and rule."""
    problems = []
    if not prompt_ids:
        problems.append("prompt: empty (generation needs at least one prompt token)")
    outside = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if outside:
        problems.append(f"prompt: token id {outside[0]} must be in [0, {vocab_size}) (the model's vocabulary)")
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    settings = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
    for key, value in settings.items():
        if (rule := sampling_rule_broken(key, value)) is not None:
            problems.append(f"{key} ({value}) must be {rule}")
    if not 0 <= seed < SEED_LIMIT:
        problems.append(f"seed ({seed}) must be in [0, 2**64) (the sampling generator's seeds)")
    return problems


def penalize_repetition(logits_V: torch.Tensor, is_seen_V: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on one row of logits [V] fp32: the logit of each token already
    in the sequence (is_seen_V [V] bool: the prompt and the tokens generated) divided by `penalty` where it is
    positive and multiplied by it where it is negative, in fp32 as transformers computes it."""
    if penalty == 1.0:
        return logits_V
    penalized_V = torch.where(logits_V < 0, logits_V * penalty, logits_V / penalty)
    return torch.where(is_seen_V, penalized_V, logits_V)


def sampling_probs(logits_V: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution [V] fp64 a token is drawn from at temperature > 0, as transformers' warpers shape it, in
    their order: softmax(logits / temperature) restricted to the top_k likeliest tokens (0: all; every token tied with
    the k-th kept, as TopKLogitsWarper keeps them), then to the nucleus: the tokens left once the least likely ones
    whose probabilities sum to at most 1 - top_p are removed (TopPLogitsWarper's rule: the smallest set holding at
    least top_p, never empty; among tokens of equal probability the lower ids leave first), renormalised."""
    # (logits - max) / temperature in fp64: the largest is 0 and the others < 0, so a tiny temperature (down to
    # fp64's smallest, 5e-324; fp32 holds none below 1.4e-45) sends them to -inf (probability 0), never inf - inf.
    # The zeros stay 0 by `where`: CUDA divides by a Python number as a product with its reciprocal, inf below
    # 5.6e-309, and 0 x inf is nan.
    shifted_V = logits_V.double() - logits_V.double().max()
    scaled_V = torch.where(shifted_V < 0, shifted_V / temperature, 0.0)
    if 0 < top_k < scaled_V.numel():
        scaled_V = scaled_V.masked_fill(scaled_V < scaled_V.topk(top_k).values[-1], -math.inf)
    probs_V = torch.softmax(scaled_V, dim=-1)
    if top_p < 1:
        # Ascending and stable: the cumulative sums are transformers' and ties leave in id order.
        ascending_V, order_V = probs_V.sort(stable=True)
        is_removed_V = ascending_V.cumsum(0) <= 1 - top_p
        is_removed_V[-1] = False
        probs_V = probs_V.scatter(0, order_V[is_removed_V], 0.0)
        probs_V = probs_V / probs_V.sum()
    return probs_V


def choose_token(
    logits_V: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, top_k: int = 0
) -> int:
    """The next token from one row of logits [V] fp32: the argmax at temperature 0 (the lowest id among tied maxima,
    as torch.argmax and transformers' greedy search pick it); else a draw from sampling_probs with `generator`. Any
    temperature > 0 is exact: as it tends to 0 the draw tends to the argmax (a draw among tied maxima)."""
    if temperature == 0:
        return int(logits_V.argmax())
    return int(torch.multinomial(sampling_probs(logits_V, temperature, top_k, top_p), 1, generator=generator))


def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Iterable[int] = (),
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    images: PromptImages | None = None,
) -> list[int]:
    """The tokens generated after prompt_ids (the prompt not included), at most max_new_tokens of them; `images`:
    the prompt's images (prompt_images), one run of image tokens each in prompt_ids.

    Each step's logits pass through transformers' processors in its order: the repetition penalty (every token of
    the prompt and of the reply so far; greedy decoding too), then at temperature > 0 the temperature, top_k and
    top_p (sampling_probs). Greedy at temperature 0; otherwise sampled with a torch.Generator seeded with `seed` on
    the model's device (the same seed, model and device give the same tokens). Generation stops after the first
    token in stop_ids, which is included in the result (as transformers' generate keeps its eos token) and passed
    to on_token like every other token, as it is chosen. The prompt runs as a prefill and its continuations,
    PREFILL_CHUNK_TOKENS tokens a call; each new token is one cached step (no re-run of the sequence). Raises
    ProfileError with one line per refused option (empty prompt, ids outside the vocabulary, negative
    max_new_tokens, temperature or top_k, top_p outside (0, 1], a repetition_penalty <= 0, a seed outside
    [0, 2**64), image tokens in a prompt other than the images' own).
    """
    lm = find_causal_lm(model)
    problems = check_generate_options(list(prompt_ids), lm.cfg.vocab_size, max_new_tokens, temperature, top_p, seed,
                                      top_k, repetition_penalty)
    if problems:
        raise ProfileError(problems)
    device = lm.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    stop = set(stop_ids)
    cache = DecodeCache()
    generated: list[int] = []
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    is_seen_V = torch.zeros(lm.cfg.vocab_size, dtype=torch.bool, device=device)
    is_seen_V[prompt[0]] = True
    features = positions = None
    vision = lm.cfg.vision
    if images is None and vision is not None and (prompt[0] == vision.image_token_id).any():
        position = int((prompt[0] == vision.image_token_id).nonzero()[0])
        raise ProfileError([f"prompt: token {position} is the image token ({vision.image_token_id}) but no image is "
                            "given for it"])
    if images is not None:
        features, positions, cache.rotary_offset = prompt_images(lm, prompt, images)
        # Each call's image rows start after those of the image tokens before it.
        first_row = torch.cumsum(prompt[0] == lm.cfg.vision.image_token_id, 0).tolist()
    while len(generated) < max_new_tokens:
        if generated:
            logits_V = forward_cached(model, torch.tensor([[token]], dtype=torch.long, device=device), cache)[0, -1]
        else:
            for start in range(0, prompt.shape[1], PREFILL_CHUNK_TOKENS):
                end = min(start + PREFILL_CHUNK_TOKENS, prompt.shape[1])
                rows = cols = None
                if images is not None:
                    rows = features[(first_row[start - 1] if start else 0) : first_row[end - 1]]
                    cols = positions[:, start:end]
                logits_V = forward_cached(model, prompt[:, start:end], cache, rows, cols)[0, -1]
        logits_V = penalize_repetition(logits_V, is_seen_V, repetition_penalty)
        token = choose_token(logits_V, temperature, top_p, generator, top_k)
        generated.append(token)
        is_seen_V[token] = True
        if on_token is not None:
            on_token(token)
        if token in stop:
            break
    return generated
