"""Cached decoding of the softmax-attention token mixers: a prefill of k tokens, then steps of any size, gives the rows
of the full packed forward over the whole document, for every mixer and variant; decoding projects each token once."""

import pytest
import torch
from torch import nn

from moe_tune.engine.generate.cache import DecodeCache, DecodeStep
from moe_tune.engine.model.attention import PackedBatch, build_token_mixer
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import LayerSpec, ModelProfile

# One document of odd length: 5 blocks of 4 and a partial one (3 tokens), 7 blocks of 3 and a partial one (2).
LENGTH = 23
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# Token counts of each cached call: a prefill of 1, of an odd count, of all but one and of everything, each followed
# by single tokens; and calls of several tokens after the prefill (the first ends on a block boundary of 4).
SCHEDULES = {
    "prefill-1": [1] * LENGTH,
    "prefill-11": [11] + [1] * (LENGTH - 11),
    "prefill-22": [22, 1],
    "prefill-all": [LENGTH],
    "chunks": [8, 1, 3, 4, 7],
}

MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
YARN = dict(factor=4.0, original_max_position_embeddings=8, attention_factor=1.3)
# (layer spec, ModelProfile overrides) of each mixer variant.
CASES = {
    "full-gated-qk-norm-partial-rope": ({"attention": "full"}, {}),
    "full-plain-no-qk-norm-bias": (
        {"attention": "full"},
        dict(attention_output_gate=False, attention_qk_norm=False, attention_bias=True, attention_output_bias=True,
             partial_rotary_factor=1.0),
    ),
    "full-yarn": ({"attention": "full"}, dict(rope_yarn=YARN)),
    "full-sinks": ({"attention": "full"}, dict(attention_sinks=True, attention_output_gate=False)),
    "window-5-sinks-yarn": (
        {"attention": "full", "sliding_window": 5},
        dict(attention_sinks=True, attention_output_gate=False, rope_yarn=YARN),
    ),
    "window-4": ({"attention": "full", "sliding_window": 4}, {}),
    "window-1": ({"attention": "full", "sliding_window": 1}, {}),  # each query sees itself only
    "sparse-token": ({"attention": "sparse"}, dict(sparse_attention=dict(index_heads=4, index_head_dim=16, topk=6))),
    "sparse-block": (
        {"attention": "sparse"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=8, block_size=4))
    ),
    "qsa-block-4": (
        {"attention": "qsa"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=8, block_size=4))
    ),
    # block_size 1: the op selects tokens (topk + 1 of them, the query's own among the candidates), no tail slot.
    "qsa-token": ({"attention": "qsa"}, dict(sparse_attention=dict(index_heads=2, index_head_dim=8, topk=6))),
    "qsa-block-3-yarn": (
        {"attention": "qsa"},
        dict(rope_yarn=YARN, sparse_attention=dict(index_heads=2, index_head_dim=8, topk=6, block_size=3)),
    ),
    "mla-interleaved": ({"attention": "mla"}, dict(mla=MLA)),
    "mla-half-yarn-scale": (
        {"attention": "mla"}, dict(mla=dict(MLA, rope="half", softmax_scale=0.3, yarn=YARN))
    ),
    "mla-no-rope-no-q-latent": ({"attention": "mla"}, dict(mla=dict(MLA, q_lora_rank=None, rope="none"))),
    "mla-sparse-token": (
        {"attention": "mla_sparse"}, dict(mla=MLA, sparse_attention=dict(index_heads=4, index_head_dim=16, topk=6))
    ),
    "mla-sparse-block": (
        {"attention": "mla_sparse"},
        dict(mla=MLA, sparse_attention=dict(index_heads=4, index_head_dim=16, topk=6, block_size=2)),
    ),
}
SPARSE_CASES = [
    "sparse-token", "sparse-block", "qsa-block-4", "qsa-token", "qsa-block-3-yarn", "mla-sparse-token", "mla-sparse-block"
]


def build_mixer(name: str) -> nn.Module:
    layer, overrides = CASES[name]
    base = load_profile("tiny").model.model_dump()
    base.update(layers=[layer], **overrides)
    cfg = ModelProfile.model_validate(base)
    torch.manual_seed(0)
    mixer = build_token_mixer(cfg, LayerSpec.model_validate(layer)).eval()
    # Norm weights, sinks and biases away from their init, so that each of them matters.
    with torch.no_grad():
        for p in mixer.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return mixer


def full_forward(mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    cu = torch.tensor([0, x.shape[1]], dtype=torch.int32, device=x.device)
    batch = PackedBatch(cu, document_positions(cu, x.shape[1]), document_ids(cu, x.shape[1]))
    return mixer(x, batch)


def cached_forward(mixer: nn.Module, x: torch.Tensor, schedule: list[int]) -> tuple[torch.Tensor, DecodeCache]:
    """The rows of cached calls of `schedule` tokens each, concatenated."""
    cache, outputs, start = DecodeCache(), [], 0
    for num_tokens in schedule:
        positions = torch.arange(start, start + num_tokens, device=x.device)
        step = DecodeStep(positions, torch.zeros_like(positions), cache)
        outputs.append(mixer.forward_cached(x[:, start : start + num_tokens], step))
        start += num_tokens
        cache.num_tokens = start
    return torch.cat(outputs, 1), cache


@pytest.fixture(scope="module")
def mixers() -> dict[str, nn.Module]:
    return {name: build_mixer(name) for name in CASES}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_cached_calls_equal_the_full_forward(mixers, name, schedule):
    torch.manual_seed(1)
    mixer = mixers[name]
    x = torch.randn(1, LENGTH, mixer.o_proj.out_features)
    expected = full_forward(mixer, x)
    got, _ = cached_forward(mixer, x, SCHEDULES[schedule])
    torch.testing.assert_close(got, expected, **TOLERANCE)


def selection_rows(mixer: nn.Module) -> nn.Linear:
    """The projection rows that make the indexer's queries (zeroed, every index score is 0: all keys tie)."""
    if hasattr(mixer, "index_q_proj"):
        return mixer.index_q_proj.weight
    if hasattr(mixer.indexer, "wq_b"):
        return mixer.indexer.wq_b.weight
    return mixer.indexer.index_qk_proj.weight[: mixer.indexer.num_heads * mixer.indexer.head_dim]


@pytest.mark.parametrize("schedule", ["prefill-1", "chunks"])
@pytest.mark.parametrize("name", SPARSE_CASES)
@torch.no_grad()
def test_ties_in_the_index_scores_go_to_the_lower_keys_as_in_the_full_forward(name, schedule):
    mixer = build_mixer(name)
    selection_rows(mixer).zero_()
    torch.manual_seed(1)
    x = torch.randn(1, LENGTH, mixer.o_proj.out_features)
    got, _ = cached_forward(mixer, x, SCHEDULES[schedule])
    torch.testing.assert_close(got, full_forward(mixer, x), **TOLERANCE)


@pytest.mark.parametrize("schedule", ["prefill-1", "chunks"])
@torch.no_grad()
def test_partial_ties_between_repeated_tokens_are_broken_as_in_the_full_forward(schedule):
    # Dyadic weights and inputs make every index score exact, so repeated tokens tie bitwise in every call's layout.
    mixer = build_mixer("sparse-token")
    for proj in (mixer.index_q_proj, mixer.index_k_proj, mixer.index_weights_proj):
        proj.weight.copy_(torch.randint(-2, 3, proj.weight.shape) / 8)
    torch.manual_seed(1)
    vocabulary = torch.randint(-2, 3, (4, mixer.o_proj.out_features)) / 2.0
    tokens = torch.randint(0, 4, (LENGTH,))
    x = vocabulary[tokens][None]
    got, _ = cached_forward(mixer, x, SCHEDULES[schedule])
    torch.testing.assert_close(got, full_forward(mixer, x), **TOLERANCE)


@pytest.mark.parametrize("name", SPARSE_CASES)
@torch.no_grad()
def test_the_budget_really_selects(name):
    # The budgets above are below the document's length: with every key allowed the decoded rows change.
    mixer = build_mixer(name)
    torch.manual_seed(1)
    x = torch.randn(1, LENGTH, mixer.o_proj.out_features)
    selective, _ = cached_forward(mixer, x, SCHEDULES["chunks"])
    chooser = mixer if hasattr(mixer, "num_selected") else mixer.indexer
    chooser.num_selected = LENGTH + 1
    everything, _ = cached_forward(mixer, x, SCHEDULES["chunks"])
    assert (selective - everything).abs().max() > 1e-3


class RowCounter:
    """Counts the rows (tokens) every nn.Linear of a module is called on."""

    def __init__(self, module: nn.Module):
        self.rows: dict[str, int] = {}
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear):
                sub.register_forward_hook(self.hook(name))

    def hook(self, name):
        def count(module, inputs, output):
            self.rows[name] = self.rows.get(name, 0) + inputs[0].reshape(-1, inputs[0].shape[-1]).shape[0]

        return count


@pytest.mark.parametrize("name", ["full-gated-qk-norm-partial-rope", "window-4", *SPARSE_CASES, "mla-interleaved"])
@torch.no_grad()
def test_decoding_projects_each_token_once(name):
    mixer = build_mixer(name)
    counter = RowCounter(mixer)
    x = torch.randn(1, LENGTH, mixer.o_proj.out_features)
    _, cache = cached_forward(mixer, x, SCHEDULES["chunks"])
    expected = {name: LENGTH for name in counter.rows}
    if "kv_b_proj" in expected:
        # Only the prefill's 8 latents are expanded; decoding absorbs kv_b_proj's weight into the query and output.
        expected["kv_b_proj"] = 8
    assert counter.rows == expected
    (state,) = [s for s in cache.states.values() if "k" in s or "latent" in s]
    if "latent" in state:
        # MLA caches per token the latent and the rope key, not the heads' keys and values.
        assert state["latent"].rows.shape == (LENGTH, mixer.kv_lora_rank)
        assert state["rope_k"].rows.shape == (LENGTH, mixer.rope_dim)
    elif mixer.sliding_window is not None:
        assert state["k"].rows.shape[0] == mixer.sliding_window - 1
    else:
        assert state["k"].rows.shape == (LENGTH, mixer.num_kv_heads, mixer.head_dim)


@pytest.mark.parametrize("name", ["full-gated-qk-norm-partial-rope", "mla-interleaved", "mla-sparse-block"])
@torch.no_grad()
def test_lora_wrapped_projections_decode_as_the_full_forward(name):
    from peft import LoraConfig, get_peft_model

    mixer = build_mixer(name)
    targets = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa")
               if hasattr(mixer, n)]
    peft_model = get_peft_model(mixer, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    wrapped = peft_model.base_model.model
    assert all(hasattr(getattr(wrapped, n), "base_layer") for n in targets)
    torch.manual_seed(1)
    x = torch.randn(1, LENGTH, mixer.o_proj.base_layer.out_features)
    got, _ = cached_forward(wrapped, x, SCHEDULES["chunks"])
    torch.testing.assert_close(got, full_forward(wrapped, x), **TOLERANCE)
