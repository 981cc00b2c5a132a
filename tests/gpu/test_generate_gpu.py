"""Cached decoding on CUDA: the prefill runs the training forward's Triton kernels, the steps the cached paths; in fp32
the rows equal the full forward's and greedy generation is the argmax chain of full re-runs (a prompt longer than
one prefill call too); in bf16 the cached rows are as close to the fp32 forward as the bf16 full forward is; sampling
draws from the CPU's fp64 distribution with a generator on the GPU; `moe-tune generate` runs a LoRA run on the GPU in
its train.precision; a prompt with images decodes as the full forward with them.

Run on the H200 on its own: pytest -m gpu tests/gpu
"""

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml

from moe_tune.engine.generate import DecodeCache, forward_cached, generate_ids
from moe_tune.engine.model.model import build_model
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import ModelProfile

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
KDA = {"kda_attention": {"num_heads": 2, "head_dim": 16}}
NGRAM = {
    "embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "vocab_size_base": 50, "vocab_size_multiple": 8,
    "hash_seed": 7, "conv_kernel_size": 3, "boundary_token_id": 258,
}  # fmt: skip
# Layer mixes of the families' kinds on the tiny profile's widths.
MODELS = {
    "tiny": ([], {}),  # linear x 3, then top-k sparse attention with a budget below the prompt
    "qwen3_next": ([{"attention": "linear"}, {"attention": "full"}, {"attention": "linear", "mlp": "dense"}],
                   {"norm_one_plus": True, "intermediate_size": 48}),
    "kimi_linear": ([{"attention": "kda"}, {"attention": "full", "mlp": "dense"}, {"attention": "kda"}],
                    {**KDA, "intermediate_size": 48}),
    "qwen4_exp": ([{"attention": "linear", "has_ngram_embedding": True}, {"attention": "qsa"}],
                  {"norm_one_plus": True, "hyper_connections": {"num_streams": 3, "mix_rank": 8},
                   "ngram_embedding": NGRAM}),
}  # fmt: skip
# Longer than linear attention's 64-token chunks and the sparse budgets; decoded past a chunk boundary.
PROMPT, STEPS = 150, 40


def model_of(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    layers, extra = MODELS[name]
    base = load_profile("tiny").model.model_dump()
    if layers:
        base["layers"] = layers
    base.update(extra)
    model = build_model(ModelProfile.model_validate(base))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # off the init, so zero-initialised pieces matter
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(DEVICE, dtype).eval()


def tokens(count: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, count), generator=torch.Generator().manual_seed(3)).to(DEVICE)


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32, device=DEVICE)
    return model(ids, cu).logits[0].float()


@torch.no_grad()
def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = DecodeCache()
    rows = [forward_cached(model, ids[:, :PROMPT], cache)[0]]
    rows += [forward_cached(model, ids[:, t : t + 1], cache)[0] for t in range(PROMPT, ids.shape[1])]
    return torch.cat(rows).float()


@pytest.mark.parametrize("name", list(MODELS))
def test_fp32_cached_rows_equal_the_full_forward(name):
    model, ids = model_of(name), tokens(PROMPT + STEPS)
    full, cached = full_logits(model, ids), cached_logits(model, ids)
    torch.testing.assert_close(cached, full, atol=1e-4 * full.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_cached_rows_are_as_close_as_the_bf16_forward(name):
    ids = tokens(PROMPT + STEPS)
    truth = full_logits(model_of(name), ids)
    model = model_of(name, torch.bfloat16)
    full_error = (full_logits(model, ids) - truth).abs().mean().item()
    cached_error = (cached_logits(model, ids) - truth).abs().mean().item()
    assert cached_error <= 1.5 * full_error + 1e-4, (cached_error, full_error)


@pytest.mark.parametrize("name", ["tiny", "qwen3_next"])
def test_greedy_generation_is_the_argmax_chain(name):
    model, prompt = model_of(name), tokens(PROMPT)[0].tolist()
    chain = list(prompt)
    for _ in range(16):
        chain.append(int(full_logits(model, torch.tensor([chain], device=DEVICE))[-1].argmax()))
    assert generate_ids(model, prompt, 16) == chain[len(prompt) :]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_prompt_past_one_prefill_call_generates_the_argmax_chain(name):
    """A prompt longer than PREFILL_CHUNK_TOKENS is prefilled in calls of that many tokens (the linear-attention
    state, the key/value caches and the sparse indexers' keys carried between them): greedy generation still gives
    the argmax chain of full re-runs."""
    from moe_tune.engine.generate.decode import PREFILL_CHUNK_TOKENS

    model, prompt = model_of(name), tokens(PREFILL_CHUNK_TOKENS + 77)[0].tolist()
    chain = list(prompt)
    for _ in range(8):
        chain.append(int(full_logits(model, torch.tensor([chain], device=DEVICE))[-1].argmax()))
    assert generate_ids(model, prompt, 8) == chain[len(prompt) :]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.9), (0.6, 20, 0.95), (1.3, 5, 0.5), (1e-300, 0, 1.0), (5e-324, 3, 0.2)],
    ids=["top-p", "qwen3-defaults", "both-cut", "tiny-temperature", "smallest-temperature"],
)
def test_the_sampling_distribution_on_cuda_is_the_cpus(temperature, top_k, top_p):
    """sampling_probs in fp64 on CUDA: the CPU's distribution (the same tokens kept, the probabilities within fp64
    rounding), tied logits included; at temperatures down to fp64's smallest, one token keeps everything."""
    from moe_tune.engine.generate.decode import sampling_probs

    logits_V = torch.randn(259, generator=torch.Generator().manual_seed(7)) * 3
    logits_V[[10, 11, 12]] = logits_V.max() - 0.25  # three tied runners-up
    cpu, cuda = sampling_probs(logits_V, temperature, top_k, top_p), sampling_probs(logits_V.to(DEVICE), temperature,
                                                                                    top_k, top_p).cpu()
    assert cuda.dtype == torch.float64
    assert torch.equal(cuda > 0, cpu > 0)
    torch.testing.assert_close(cuda, cpu, rtol=1e-12, atol=1e-15)
    if temperature < 1e-100:
        assert torch.equal(cuda, torch.nn.functional.one_hot(logits_V.argmax(), 259).double())


@pytest.mark.parametrize("name", ["tiny", "kimi_linear"])
def test_sampled_generation_on_cuda_follows_its_seed_and_its_filters(name):
    """generate_ids at temperature > 0 draws with a generator on the model's device: one seed gives one reply, and
    a draw that the filters leave one token for (top_k 1; the smallest temperature) is the argmax chain."""
    model, prompt = model_of(name), tokens(PROMPT)[0].tolist()
    greedy = generate_ids(model, prompt, 12)
    first = generate_ids(model, prompt, 12, temperature=1.5, seed=11)
    assert generate_ids(model, prompt, 12, temperature=1.5, seed=11) == first
    assert generate_ids(model, prompt, 12, temperature=1.5, top_k=1, seed=11) == greedy
    assert generate_ids(model, prompt, 12, temperature=5e-324, seed=12) == greedy


def test_cli_generates_from_a_bf16_lora_run_on_the_gpu(tmp_path):
    from moe_tune.engine.lora import inject_lora

    run = tmp_path / "run"
    job = load_profile("tiny", ["train.steps=2", "train.warmup_steps=1", "train.precision=bf16", f"output.dir={run}"])
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text(json.dumps({"last_step": 2}) + "\n")
    model = inject_lora(build_model(job.model), job.lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    model.save_pretrained(str(run / "adapter"), safe_serialization=True)
    result = subprocess.run(
        [sys.executable, "-m", "moe_tune", "generate", str(run), "--prompt", "Once upon a time",
         "--max-new-tokens", "24"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"model: the run in {run} (LoRA adapters merged, step 2); on cuda, bfloat16" in result.stderr
    assert re.search(r"^\d+ tokens in \d+\.\d\d s .*; ended by ", result.stderr, re.MULTILINE), result.stderr


def vision_model_of(name: str) -> torch.nn.Module:
    """tiny-vl's model (its layers: tiny's), or qwen4_exp's layer mix with tiny-vl's vision tower."""
    base = load_profile("tiny-vl").model.model_dump()
    if name == "qwen4_exp":
        layers, extra = MODELS[name]
        base.update(extra, layers=layers)
    model = build_model(ModelProfile.model_validate(base))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(DEVICE).eval()


@pytest.mark.parametrize("name", ["tiny-vl", "qwen4_exp"])
def test_a_prompt_with_images_decodes_as_the_full_forward(name):
    """On CUDA (the prefill on the training forward's kernels), in fp32: text, an image of 8 x 12 patches, text, an
    image of 16 x 8, text, in prefill calls of 64 tokens (both images across calls); the cached rows of the prompt
    and of 24 decoded tokens equal the full forward's with the images, and greedy generation is its argmax chain."""
    import moe_tune.engine.generate.decode as decode

    model = vision_model_of(name)
    spec = model.cfg.vision
    generator = torch.Generator().manual_seed(4)
    grids = torch.tensor([[1, 8, 12], [1, 16, 8]])
    text = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (40, 30, 20)]
    prompt = text[0]
    for grid, after in zip(grids.tolist(), text[1:]):
        prompt += [spec.vision_start_token_id, *[spec.image_token_id] * (grid[1] * grid[2] // 4),
                   spec.vision_end_token_id, *after]  # fmt: skip
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * spec.temporal_patch_size * spec.patch_size**2,
                         generator=generator)  # fmt: skip
    images = decode.PromptImages(pixels.to(DEVICE), grids.to(DEVICE))

    @torch.no_grad()
    def full(ids: list[int]) -> torch.Tensor:
        cu = torch.tensor([0, len(ids)], dtype=torch.int32, device=DEVICE)
        return model(torch.tensor([ids], device=DEVICE), cu, pixel_values=images.pixel_values,
                     image_grid_thw=images.grids).logits[0].float()

    chain = list(prompt)
    for _ in range(24):
        chain.append(int(full(chain)[-1].argmax()))
    original = decode.PREFILL_CHUNK_TOKENS
    decode.PREFILL_CHUNK_TOKENS = 64
    try:
        assert generate_ids(model, prompt, 24, images=images) == chain[len(prompt) :]
    finally:
        decode.PREFILL_CHUNK_TOKENS = original
    cache, ids = DecodeCache(), torch.tensor([chain], device=DEVICE)
    features, positions, cache.rotary_offset = decode.prompt_images(model, ids[:, : len(prompt)], images)
    with torch.no_grad():
        rows = [forward_cached(model, ids[:, : len(prompt)], cache, features, positions)[0]]
        rows += [forward_cached(model, ids[:, t : t + 1], cache)[0] for t in range(len(prompt), len(chain))]
    expected = full(chain)
    torch.testing.assert_close(torch.cat(rows).float(), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
