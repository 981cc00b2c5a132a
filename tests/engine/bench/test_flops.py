"""Model FLOPs behind MFU (engine/bench/flops.py): an exact hand count on a small hybrid profile, and properties on
the tiny default."""

import pytest

from moe_tune.engine.bench.flops import (
    PARTS,
    FlopModel,
    _capped_keys,
    _qsa_keys,
    _visible_blocks,
)
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import LoraProfile, ModelProfile

# D 16; a linear layer (1 key head and 2 value heads of 4) and a gated full-attention layer (2 query heads, 1 kv head
# of 4), both MoE (4 experts top-2 of width 8, gated shared expert of width 6); vocabulary 300.
HAND_MODEL = dict(
    vocab_size=300, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    partial_rotary_factor=0.5, layers=[{"attention": "linear"}, {"attention": "full"}],
    linear_attention=dict(num_key_heads=1, num_value_heads=2, key_head_dim=4, value_head_dim=4),
    moe=dict(num_experts=4, top_k=2, expert_intermediate_size=8, shared_expert_intermediate_size=6),
)  # fmt: skip
HAND_LORA = dict(r=2, alpha=4, target_modules=["q_proj", "o_proj"], experts=True)
# Two documents of 3 and 5 tokens: 8 tokens, 6 + 15 causal (query, key) pairs.
HAND_PIECES = [3, 5]
TOKENS = 8
# Per token, forward, 2 * in * out per linear:
#   linear layer: q 16->4 128, k 16->4 128, v 16->8 256, z 16->8 256, b 16->2 64, a 16->2 64, o 8->16 256 = 1152
#   full layer: q 16->16 (query and gate) 512, k 16->4 128, v 16->4 128, o 8->16 256 = 1024
#   per MoE layer: router 16->4 128; shared expert gate/up 16->6 192 + 192, down 6->16 192, its gate 16->1 32 = 608;
#   experts 2 of them x (gate_up 16->16 512 + down 8->16 256) = 1536
#   lm_head 16->300 9600
#   adapters (r 2): q linear 2*(2*16 + 4*2) 80, q full 2*(2*16 + 16*2) 128, o linear and full 2*(2*8 + 16*2) 96 each
#   = 400; per-expert adapters 2 experts x 2*(2*16 + 16*2 + 2*8 + 16*2) = 448 per layer
# Cores: linear attention, 2 heads x (6*64*4 + 4*64*4 + 6*4*4) = 5312 per token; full attention 21 pairs x
#   2 * 2 heads * (4 + 4) = 672.
HAND_FORWARD = {
    "attention projections": (1152 + 1024) * TOKENS,
    "attention core": 672,
    "linear attention core": 5312 * TOKENS,
    "indexers": 0,
    "routed experts": 2 * 1536 * TOKENS,
    "shared expert / dense MLP": 2 * 608 * TOKENS,
    "router": 2 * 128 * TOKENS,
    "lm_head": 9600 * TOKENS,
    "other linear": 0,
    "adapters": (400 + 2 * 448) * TOKENS,
}
# Frozen weights: forward + input gradient; attention cores and adapters: forward + both gradients.
HAND_PASSES = {"attention core": 3, "linear attention core": 3, "adapters": 3}


def test_hand_count_of_a_small_hybrid_profile():
    count = FlopModel(ModelProfile(**HAND_MODEL), LoraProfile(**HAND_LORA)).step(HAND_PIECES)
    assert count.forward == HAND_FORWARD
    assert count.training == {part: flops * HAND_PASSES.get(part, 2) for part, flops in HAND_FORWARD.items()}
    assert count.total == sum(count.training.values())


def tiny(*overrides):
    job = load_profile("tiny", list(overrides))
    return job.model, job.lora


def test_doubling_the_layers_doubles_every_part_but_the_head():
    cfg, lora = tiny()
    doubled = cfg.model_copy(update={"layers": cfg.layers + cfg.layers})
    pieces = [40, 88]
    once, twice = FlopModel(cfg, lora).step(pieces), FlopModel(doubled, lora).step(pieces)
    for part in PARTS:
        # lm_head and its adapters are one per model (tiny trains lm_head in full: no adapter there).
        expected = once.training[part] if part == "lm_head" else 2 * once.training[part]
        assert twice.training[part] == pytest.approx(expected), part


def test_full_fine_tuning_is_three_passes_and_lora_two_on_frozen_weights():
    cfg, _ = tiny()
    pieces = [128]
    full = FlopModel(cfg, LoraProfile(enabled=False)).step(pieces)
    for part in PARTS:
        # The sparse layer's indexer runs under no_grad: forward only, whatever trains.
        passes = 1 if part == "indexers" else 3
        assert full.training[part] == pytest.approx(passes * full.forward[part]), part
    assert full.forward["adapters"] == 0 and full.forward["indexers"] > 0
    lora = FlopModel(cfg, LoraProfile(target_modules=["q_proj"], experts=False)).step(pieces)
    for part in ("attention projections", "routed experts", "router", "lm_head"):
        assert lora.forward[part] == full.forward[part]
        assert lora.training[part] == pytest.approx(2 * lora.forward[part]), part
    assert lora.training["adapters"] == pytest.approx(3 * lora.forward["adapters"]) and lora.forward["adapters"] > 0


def test_modules_to_save_train_in_full():
    cfg, lora = tiny()
    count = FlopModel(cfg, lora).step([64])
    # tiny.yaml: lora.modules_to_save [lm_head]
    assert count.training["lm_head"] == pytest.approx(3 * count.forward["lm_head"])


def test_documents_are_counted_apart():
    """Attention pairs stay inside documents; everything per token depends on the token count alone."""
    cfg, lora = tiny()
    model = FlopModel(cfg, lora)
    one, two = model.step([128]), model.step([64, 64])
    for part in ("attention projections", "routed experts", "lm_head", "linear attention core", "adapters"):
        assert one.forward[part] == two.forward[part]
    assert two.forward["attention core"] < one.forward["attention core"]


@pytest.mark.parametrize("n", [1, 5, 32, 33, 100])
def test_closed_forms_match_counting_each_query(n):
    topk, block = 32, 4
    assert _capped_keys(n, topk) == sum(min(topk, j) for j in range(1, n + 1))
    assert _visible_blocks(n, block) == sum(-(-j // block) for j in range(1, n + 1))
    assert _visible_blocks(n, 1) == n * (n + 1) // 2
    # QSA: the best complete blocks within the budget, plus the incomplete block the query sits in.
    assert _qsa_keys(n, topk, block) == sum(min(topk, block * (j // block)) + j % block for j in range(1, n + 1))
    assert _qsa_keys(n, topk, block) <= n * (n + 1) // 2
