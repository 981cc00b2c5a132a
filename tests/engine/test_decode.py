"""Cached decoding (engine/generate): a prefill then token-by-token steps give the rows of the full forward over the
whole sequence, for each recurrent mixer and for whole models; generate_ids is the argmax chain of full re-runs;
sampling is seeded; stop ids end it; bad options are refused."""

import pytest
import torch

from moe_tune.engine.generate import DecodeCache, DecodeStep, forward_cached, generate_ids
from moe_tune.engine.generate.decode import PromptImages
from moe_tune.engine.lora import inject_lora
from moe_tune.engine.model.attention import GatedDeltaNet, PackedBatch
from moe_tune.engine.model.blocks import ShortConv, document_ids, document_positions
from moe_tune.engine.model.kda import KimiDeltaAttention
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import MoEBlock
from moe_tune.engine.model.ngram import NGramInjection
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import ModelProfile

# fp32 on the CPU: the cached rows differ from the full forward's by summation order only.
MIXER_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
MODEL_TOLERANCE = {"atol": 2e-5, "rtol": 1e-5}

NGRAM = {
    "embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "vocab_size_base": 50, "vocab_size_multiple": 8,
    "hash_seed": 7, "conv_kernel_size": 3, "boundary_token_id": 258,
}  # fmt: skip
HYPER = {"norm_one_plus": True, "hyper_connections": {"num_streams": 3, "mix_rank": 8}, "ngram_embedding": NGRAM}
KDA = {"kda_attention": {"num_heads": 2, "head_dim": 16}}
SMALL_BLOCKS = {"sparse_attention": {"index_heads": 2, "index_head_dim": 8, "topk": 8, "block_size": 4}}
PER_CHANNEL = {**load_profile("tiny").model.linear_attention.model_dump(), "decay": "per_channel"}

PROFILES = {
    "tiny": ([], {}),  # the shipped tiny profile as it is (linear x 3, sparse)
    "qwen3_next": ([{"attention": "linear"}, {"attention": "full"}, {"attention": "linear", "mlp": "dense"}],
                   {"norm_one_plus": True, "intermediate_size": 48}),
    "kimi_linear": ([{"attention": "kda"}, {"attention": "full", "mlp": "dense"}, {"attention": "kda"}],
                    {**KDA, "intermediate_size": 48}),
    "linear-per-channel": ([{"attention": "linear"}], {"linear_attention": PER_CHANNEL}),
    "hyper-ngram-recurrent": ([{"attention": "linear", "has_ngram_embedding": True}, {"attention": "kda"},
                               {"attention": "kda", "has_ngram_embedding": True}], {**HYPER, **KDA}),
    "qwen4_exp": ([{"attention": "linear", "has_ngram_embedding": True}, {"attention": "qsa"},
                   {"attention": "linear", "has_ngram_embedding": True}], {**HYPER, **SMALL_BLOCKS}),
}  # fmt: skip


def model_cfg(layers, **overrides) -> ModelProfile:
    base = load_profile("tiny").model.model_dump()
    if layers:
        base["layers"] = layers
    base.update(overrides)
    return ModelProfile.model_validate(base)


def perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its init, so zero-initialised pieces (the n-gram conv, norm offsets) matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return module.eval()


@pytest.fixture(scope="module")
def models():
    return {name: perturbed(build_model(model_cfg(layers, **extra))) for name, (layers, extra) in PROFILES.items()}


def one_document(total: int) -> PackedBatch:
    cu = torch.tensor([0, total], dtype=torch.int32)
    return PackedBatch(cu, document_positions(cu, total), document_ids(cu, total))


def run_cached(call, total: int, split: list[int]) -> torch.Tensor:
    """call(start, stop, step) over the chunks of `split` (the rest one token at a time), outputs joined on dim 1."""
    cache, outputs, start = DecodeCache(), [], 0
    for size in split + [1] * (total - sum(split)):
        step = DecodeStep.next(cache, torch.arange(start, start + size))
        outputs.append(call(start, start + size, step))
        cache.num_tokens += size
        start += size
    return torch.cat(outputs, 1)


# (tokens, prefill lengths; the rest one token at a time). 67 is odd and spans two 64-token chunks of the op.
SPLITS = {
    "tokens-from-the-first": (9, [1]),
    "prefill-5": (9, [5]),
    "chunks-after-tokens": (67, [3, 1, 1, 60]),  # a prefill with T > 1 continuing a state, across a chunk boundary
}


def mixer(kind: str) -> tuple[torch.nn.Module, int]:
    """A recurrent token mixer and its input width."""
    torch.manual_seed(3)
    if kind == "short-conv-dilated":
        conv = ShortConv(12, width=4, dilation=3)
        torch.nn.init.normal_(conv.weight)
        return conv.eval(), 12
    if kind == "kda":
        layer = KimiDeltaAttention(model_cfg([{"attention": "kda"}], **KDA))
    else:
        overrides = {"linear_attention": PER_CHANNEL} if kind == "linear-per-channel" else {}
        layer = GatedDeltaNet(model_cfg([{"attention": "linear"}], **overrides))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.2)
        layer.A_log.uniform_(-1, 1)
    return layer.eval(), 64


@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("kind", ["linear", "linear-per-channel", "kda", "short-conv-dilated"])
def test_mixer_prefill_then_steps_equal_full_forward(kind, split):
    total, split = split
    layer, width = mixer(kind)
    x = torch.randn(1, total, width)
    batch = one_document(total)
    with torch.no_grad():
        if isinstance(layer, ShortConv):
            full = layer(x, batch.positions)
        else:
            full = layer(x, batch)
        cached = run_cached(lambda a, b, step: layer.forward_cached(x[:, a:b], step), total, split)
    torch.testing.assert_close(cached, full, **MIXER_TOLERANCE)


@pytest.mark.parametrize("split", [[1], [9], [2, 3, 1, 5]], ids=["prefill-1", "prefill-9", "chunks"])
def test_ngram_injection_cached_equals_full_forward(split):
    cfg = model_cfg([{"attention": "linear", "has_ngram_embedding": True}], **HYPER)
    layer = NGramInjection(cfg, 0).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.2)
    total = 23
    ids = torch.randint(0, cfg.vocab_size, (total,))
    ids[[6, 7, 15]] = NGRAM["boundary_token_id"]  # boundaries cut the n-grams, also right after each other
    x = torch.randn(1, total, 3 * cfg.hidden_size)
    cu = torch.tensor([0, total], dtype=torch.int32)
    batch = PackedBatch(cu, document_positions(cu, total), document_ids(cu, total), ids)
    with torch.no_grad():
        full = layer(x, batch)

        def call(a, b, step):
            step.token_ids = ids[a:b]
            return layer.forward_cached(x[:, a:b], step)

        cached = run_cached(call, total, split)
    torch.testing.assert_close(cached, full, **MIXER_TOLERANCE)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.tensor([0, ids.shape[1]], dtype=torch.int32)).logits.float()


def cached_logits(model, ids: torch.Tensor, split: list[int]) -> torch.Tensor:
    cache, outputs, start = DecodeCache(), [], 0
    for size in split + [1] * (ids.shape[1] - sum(split)):
        outputs.append(forward_cached(model, ids[:, start : start + size], cache))
        start += size
    assert cache.num_tokens == ids.shape[1]
    return torch.cat(outputs, 1)


@pytest.mark.parametrize("name", list(PROFILES))
def test_model_cached_logits_equal_full_forward(models, name):
    model = models[name]
    torch.manual_seed(5)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 11))
    if model.cfg.ngram_embedding is not None:
        ids[0, 4] = NGRAM["boundary_token_id"]
    # A prefill, a continuation of 3 tokens, then single tokens (single-token prefills: the mixer tests).
    torch.testing.assert_close(cached_logits(model, ids, [5, 3]), full_logits(model, ids), **MODEL_TOLERANCE)


def test_peft_model_decodes_with_adapters_merged_or_not():
    profile = load_profile("tiny")
    model = inject_lora(build_model(profile.model), profile.lora)
    torch.manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.normal_(std=0.05)
    model.eval()
    ids = torch.randint(0, profile.model.vocab_size, (1, 7))
    with torch.no_grad():
        adapted = model(input_ids=ids, cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)).logits
        with model.disable_adapter():
            plain = cached_logits(model, ids, [4])
    assert (adapted - plain).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(cached_logits(model, ids, [4]), adapted, **MODEL_TOLERANCE)
    merged = model.merge_and_unload()
    torch.testing.assert_close(cached_logits(merged, ids, [4]), adapted, **MODEL_TOLERANCE)


def test_moe_decodes_without_capacity_limits_and_leaves_training_statistics():
    layers = [{"attention": "linear"}, {"attention": "linear"}]
    moe = {**load_profile("tiny").model.moe.model_dump(), "capacity_factor": 0.5, "bias_update_rate": 0.1}
    limited = perturbed(build_model(model_cfg(layers, moe=moe)))
    unlimited = build_model(model_cfg(layers, moe={**moe, "capacity_factor": 0.0})).eval()
    unlimited.load_state_dict(limited.state_dict())
    blocks = [m for m in limited.modules() if isinstance(m, MoEBlock)]
    with torch.no_grad():
        for block in blocks:
            block.selection_bias.normal_()  # the biased choice is part of inference
    unlimited.load_state_dict(limited.state_dict())
    ids = torch.randint(0, 259, (1, 12))
    # A factor of 0.5 drops slots in the full forward: what decoding must not do.
    assert (full_logits(limited, ids) - full_logits(unlimited, ids)).abs().max() > 1e-3
    limited.train()  # decoding a model left in training mode still counts nothing
    biases = [b.selection_bias.clone() for b in blocks]
    torch.testing.assert_close(cached_logits(limited, ids, [7]), full_logits(unlimited, ids), **MODEL_TOLERANCE)
    for block, bias in zip(blocks, biases):
        assert block.load_counts.sum() == 0 and block.dropped_slots == 0
        torch.testing.assert_close(block.selection_bias, bias, atol=0, rtol=0)


def argmax_chain(model, prompt: list[int], num_tokens: int) -> list[int]:
    """The slow reference: the full forward re-run over the whole sequence for every new token."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(full_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPT = [5, 17, 200, 3, 99]


@pytest.fixture(scope="module")
def greedy(models):
    """Greedy generation of 5 tokens after PROMPT on the tiny model, and the tokens streamed."""
    streamed = []
    return generate_ids(models["tiny"], PROMPT, 5, on_token=streamed.append), streamed


def test_greedy_generation_is_the_argmax_chain(models, greedy):
    got, streamed = greedy
    assert got == argmax_chain(models["tiny"], PROMPT, 5)
    assert streamed == got


def test_sampling_is_reproducible_under_its_seed(models, greedy):
    model = models["tiny"]
    first = generate_ids(model, PROMPT, 5, temperature=1.0, seed=11)
    assert generate_ids(model, PROMPT, 5, temperature=1.0, seed=11) == first
    assert generate_ids(model, PROMPT, 5, temperature=1.0, seed=12) != first
    # A nucleus holding only the likeliest token is greedy decoding.
    assert generate_ids(model, PROMPT, 5, temperature=1.0, top_p=1e-6, seed=11) == greedy[0]


def test_a_long_prompt_runs_in_bounded_calls_and_decodes_the_same(models, monkeypatch):
    """A prompt longer than PREFILL_CHUNK_TOKENS runs in calls of at most that many tokens (a call's logits and
    attention scores grow with its tokens), and greedy decoding still follows the full forward's argmax chain."""
    import moe_tune.engine.generate.decode as decode

    monkeypatch.setattr(decode, "PREFILL_CHUNK_TOKENS", 4)
    calls = []
    run_call = decode.forward_cached
    monkeypatch.setattr(decode, "forward_cached", lambda m, ids, cache, *images: calls.append(ids.shape[1]) or run_call(
        m, ids, cache, *images))
    prompt = PROMPT * 2  # 10 tokens: calls of 4, 4 and 2
    got = generate_ids(models["tiny"], prompt, 3)
    assert calls == [4, 4, 2, 1, 1]
    assert got == argmax_chain(models["tiny"], prompt, 3)


def test_generation_ends_after_a_stop_id_which_it_keeps(models, greedy):
    chain = greedy[0]
    stop = chain[2]
    streamed = []
    got = generate_ids(models["tiny"], PROMPT, 5, stop_ids=(stop, 258), on_token=streamed.append)
    assert got == chain[: chain.index(stop) + 1] and streamed == got
    assert generate_ids(models["tiny"], PROMPT, 0) == []


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ([], {}, r"prompt: empty"),
        ([3, 259], {}, r"prompt: token id 259 must be in \[0, 259\)"),
        ([3, -1], {}, r"prompt: token id -1 must be in"),
        ([3], {"max_new_tokens": -1}, r"max_new_tokens \(-1\) must be >= 0"),
        ([3], {"temperature": -0.5}, r"temperature \(-0.5\) must be a finite number >= 0"),
        ([3], {"temperature": float("nan")}, r"temperature \(nan\) must be"),
        ([3], {"top_p": 0.0}, r"top_p \(0.0\) must be a number in \(0, 1\] \(1: no nucleus filter\)$"),
        ([3], {"top_p": 1.5}, r"top_p \(1.5\) must be a number in \(0, 1\] \(1: no nucleus filter\)$"),
    ],
)
def test_bad_options_are_refused(models, prompt, options, message):
    options = {"max_new_tokens": 3, **options}
    with pytest.raises(ProfileError, match=message):
        generate_ids(models["tiny"], prompt, **options)


def test_bad_options_are_reported_together(models):
    with pytest.raises(ProfileError) as error:
        generate_ids(models["tiny"], [], -1, temperature=-1.0, top_p=2.0)
    assert len(error.value.problems) == 4


@pytest.fixture(scope="module")
def vision_model():
    return perturbed(build_model(load_profile("tiny-vl").model))


def image_prompt(cfg, layout: list) -> tuple[list[int], PromptImages]:
    """A prompt of text runs (an int: that many text tokens) and images (a (h, w) patch grid: its start token, its
    h w / merge^2 image tokens and its end token), with random pixels."""
    spec, generator = cfg.vision, torch.Generator().manual_seed(len(layout))
    ids, grids = [], []
    for piece in layout:
        if isinstance(piece, int):
            ids += torch.randint(0, 259, (piece,), generator=generator).tolist()
            continue
        grids.append([1, *piece])
        tokens = [spec.image_token_id] * (piece[0] * piece[1] // spec.spatial_merge_size**2)
        ids += [spec.vision_start_token_id, *tokens, spec.vision_end_token_id]
    grids = torch.tensor(grids)
    channels = 3 * spec.temporal_patch_size * spec.patch_size**2
    return ids, PromptImages(torch.randn(int(grids.prod(-1).sum()), channels, generator=generator), grids)


def full_logits_with_images(model, ids: list[int], images: PromptImages) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.tensor([0, len(ids)], dtype=torch.int32),
                     pixel_values=images.pixel_values, image_grid_thw=images.grids).logits.float()


def cached_logits_with_images(model, ids: list[int], num_prompt: int, images: PromptImages, chunk: int):
    """The logits of `ids` decoded as generate_ids runs them: the first num_prompt tokens (holding the images) in
    calls of `chunk`, then one token a call."""
    import moe_tune.engine.generate.decode as decode

    cache, rows = DecodeCache(), []
    prompt = torch.tensor([ids[:num_prompt]])
    features, positions, cache.rotary_offset = decode.prompt_images(model, prompt, images)
    first_row = [0, *torch.cumsum(prompt[0] == model.cfg.vision.image_token_id, 0).tolist()]
    for start in range(0, num_prompt, chunk):
        end = min(start + chunk, num_prompt)
        rows.append(forward_cached(model, prompt[:, start:end], cache, features[first_row[start] : first_row[end]],
                                   positions[:, start:end]))  # fmt: skip
    rows += [forward_cached(model, torch.tensor([[token]]), cache) for token in ids[num_prompt:]]
    return torch.cat(rows, 1)


# Images first, between texts, two of other shapes side by side, and last (the generation follows an image).
IMAGE_PROMPTS = {"first": [(4, 6), 5], "between": [3, (6, 4), 4], "two": [2, (4, 4), (2, 8), 3], "last": [4, (4, 8)]}


@pytest.mark.parametrize("layout", list(IMAGE_PROMPTS))
@pytest.mark.parametrize("chunk", [1024, 5], ids=["one-call", "calls-of-5"])
def test_a_prompt_with_images_decodes_as_the_full_forward(vision_model, monkeypatch, layout, chunk):
    """Greedy generation after a prompt with images is the full forward's argmax chain (the sequence so far with its
    images, re-run for every token), and each row of the cached logits the full forward's: the prompt in one call
    and in calls of 5 tokens (an image's tokens across calls), the tokens after it on the images' rotary offset. The
    images matter: other pixels change the logits."""
    import moe_tune.engine.generate.decode as decode

    monkeypatch.setattr(decode, "PREFILL_CHUNK_TOKENS", chunk)
    prompt, images = image_prompt(vision_model.cfg, IMAGE_PROMPTS[layout])
    got = generate_ids(vision_model, prompt, 6, images=images)
    expected = list(prompt)
    for _ in range(6):
        expected.append(int(full_logits_with_images(vision_model, expected, images)[0, -1].argmax()))
    assert got == expected[len(prompt) :]
    full = full_logits_with_images(vision_model, expected, images)
    cached = cached_logits_with_images(vision_model, expected, len(prompt), images, chunk)
    torch.testing.assert_close(cached, full, **MODEL_TOLERANCE)
    other = PromptImages(images.pixel_values.flip(0), images.grids)
    assert (full_logits_with_images(vision_model, expected, other) - full).abs().max() > 1e-3


def test_image_tokens_without_their_images_are_refused(vision_model):
    cfg = vision_model.cfg
    ids = torch.randint(0, 259, (1, 7))
    torch.testing.assert_close(cached_logits(vision_model, ids, [5]), full_logits(vision_model, ids), **MODEL_TOLERANCE)
    image = cfg.vision.image_token_id
    with pytest.raises(ProfileError, match=rf"^prompt: token 2 is the image token \({image}\) but no image is given"):
        generate_ids(vision_model, [4, 5, image, 6], 2)
    prompt, images = image_prompt(cfg, [2, (4, 4), 3])
    for ids in (prompt + [image], [t for t in prompt if t != image][:-1] + [image] * 3):
        needed = rf"^prompt: \d+ image tokens \({image}\), the images need 4 \(1 images\)$"
        with pytest.raises(ProfileError, match=needed):
            generate_ids(vision_model, ids, 2, images=images)
    with pytest.raises(ProfileError, match=r"^images: the model has no vision tower"):
        generate_ids(perturbed(build_model(load_profile("tiny").model)), prompt[:2], 2, images=images)


def transformers_distribution(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax of the scores transformers' generate samples from: its warpers in its order (temperature, top_k,
    top_p), fp32."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    return torch.softmax(warpers(None, logits_V[None].clone())[0], -1).double()


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.9), (0.7, 20, 1.0), (0.6, 20, 0.95), (1.3, 5, 0.5), (0.5, 300, 0.3), (2.0, 1, 1.0), (1.0, 0, 0.02)],
    ids=["top-p", "top-k", "qwen3-defaults", "both-cut", "k-above-vocab", "k-1", "p-below-the-top-token"],
)
def test_the_sampling_distribution_is_transformers_warpers(temperature, top_k, top_p):
    """The tokens that can be drawn and their probabilities are those of transformers' TemperatureLogitsWarper,
    TopKLogitsWarper and TopPLogitsWarper applied in generate's order (distinct logits: no ties)."""
    from moe_tune.engine.generate.decode import sampling_probs

    logits_V = torch.randn(259, generator=torch.Generator().manual_seed(7)) * 3
    ours, theirs = sampling_probs(logits_V, temperature, top_k, top_p), transformers_distribution(
        logits_V, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    if top_k:
        assert int((ours > 0).sum()) <= top_k


def test_top_k_is_applied_when_sampling():
    """A top_k of 3 leaves the 3 likeliest tokens to draw from, whatever the temperature."""
    from moe_tune.engine.generate.decode import choose_token

    logits_V = torch.tensor([0.0, 1.0, 0.5, 0.9, 0.2, 0.95, 0.1])
    drawn = {choose_token(logits_V, 50.0, 1.0, torch.Generator().manual_seed(s), top_k=3) for s in range(200)}
    assert drawn == {1, 3, 5}


def test_the_nucleus_edge_among_equal_probabilities_keeps_the_higher_ids():
    """probabilities (0.1, 0.3, 0.3, 0.3) and top_p 0.5: any two of the tied tokens make the smallest set; as in
    TopPLogitsWarper (an ascending sort, the least likely removed first), the lower ids leave first: {2, 3}."""
    from moe_tune.engine.generate.decode import choose_token

    logits_V = torch.tensor([0.1, 0.3, 0.3, 0.3]).log()
    drawn = {choose_token(logits_V, 1.0, 0.5, torch.Generator().manual_seed(s)) for s in range(64)}
    assert drawn == {2, 3}
    assert torch.equal(transformers_distribution(logits_V, 1.0, 0, 0.5) > 0, torch.tensor([False, False, True, True]))


def test_the_repetition_penalty_is_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from moe_tune.engine.generate.decode import penalize_repetition

    logits_V = torch.randn(259, generator=torch.Generator().manual_seed(8))
    seen = torch.tensor([5, 17, 200, 5, 99, 3])
    is_seen_V = torch.zeros(259, dtype=torch.bool)
    is_seen_V[seen] = True
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits_V[None].clone())[0]
    got = penalize_repetition(logits_V, is_seen_V, 1.3)
    assert (got != logits_V).sum() == 5  # the 5 distinct ids, negative logits and positive ones
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def penalized_argmax_chain(model, prompt: list[int], num_tokens: int, penalty: float) -> list[int]:
    """The slow reference with transformers' repetition penalty: full re-runs, every token so far penalized."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits_V = full_logits(model, torch.tensor([ids]))[0, -1]
        seen = torch.tensor(sorted(set(ids)))
        logits_V[seen] = torch.where(logits_V[seen] < 0, logits_V[seen] * penalty, logits_V[seen] / penalty)
        ids.append(int(logits_V.argmax()))
    return ids[len(prompt) :]


def test_greedy_generation_with_a_repetition_penalty_is_the_penalized_argmax_chain(models):
    got = generate_ids(models["tiny"], PROMPT, 10, repetition_penalty=1.5)
    assert got == penalized_argmax_chain(models["tiny"], PROMPT, 10, 1.5)
    # Unpenalized, token 8 repeats token 2.
    plain = generate_ids(models["tiny"], PROMPT, 10)
    assert plain[8] == plain[2] and got[:8] == plain[:8] and got[8] != plain[8]


@pytest.mark.parametrize(
    "options, message",
    [({"top_k": -1}, r"top_k \(-1\) must be an integer >= 0 \(0: no top-k filter\)$"), ({"repetition_penalty": 0.0}, r"repetition_penalty \(0.0\) must"),
     ({"repetition_penalty": float("inf")}, r"repetition_penalty \(inf\) must be a finite number > 0")],
    ids=["top-k-negative", "penalty-0", "penalty-inf"],
)
def test_bad_top_k_and_repetition_penalty_are_refused(models, options, message):
    with pytest.raises(ProfileError, match=message):
        generate_ids(models["tiny"], PROMPT, 3, **options)


@pytest.mark.parametrize("with_images", [False, True])
def test_a_generated_image_token_is_fed_back_as_a_token(vision_model, with_images):
    """A model may choose the image token (sampled, or as here its likeliest): as transformers' generate, the next
    step embeds it as any token (no image rows); generation goes on as the full forward's argmax chain."""
    import copy

    model = copy.deepcopy(vision_model)
    image = model.cfg.vision.image_token_id
    with torch.no_grad():
        model.lm_head.weight[image] = model.lm_head.weight[image] * 0 + 5 * model.norm(
            model.embed_tokens.weight[:1]).sign()[0]  # the image token's logit far above the rest
    prompt, images = image_prompt(model.cfg, [3, (4, 4), 2]) if with_images else ([5, 17, 200], None)
    got = generate_ids(model, prompt, 3, images=images)
    assert image in got
    if with_images:
        return  # the training forward takes a row's image tokens for its images' only: no full-forward chain here
    expected = list(prompt)
    for _ in range(3):
        expected.append(int(full_logits(model, torch.tensor([expected]))[0, -1].argmax()))
    assert got == expected[len(prompt) :]
