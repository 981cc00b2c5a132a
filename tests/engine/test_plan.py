"""The layout planner: analytic parameter counts equal the built model's, the seed case plans as the design says,
and the per-device formulas hold their invariants."""

from dataclasses import replace

import pytest

from moe_tune.engine.plan import (
    LINEAR_ATTENTION_CHUNK,
    activation_bytes,
    count_parameters,
    lora_parameters,
    model_parameters,
    plan_layouts,
    trainable_parameters,
)
from moe_tune.profiles import ProfileError, apply_overrides, load_profile, validate_profile

GB = 10**9

# Small variants of the tiny profile, each reaching a different parameter layout.
VARIANTS = {
    "tiny": [],
    "dense-mlp": [
        "model.intermediate_size=96",
        "model.layers=[{attention: linear, mlp: dense}, {attention: sparse, mlp: moe}]",
    ],
    "full-attention": ["model.layers=[{attention: full, mlp: moe}, {attention: linear, mlp: moe}]"],
    "per-channel-decay": ["model.linear_attention.decay=per_channel"],
    "block-sparse": ["model.sparse_attention.block_size=8", "model.sparse_attention.topk=32"],
    # No shared expert gate: the shared expert's SwiGLU alone.
    "ungated-shared-expert": ["model.moe.shared_expert_gate=false"],
    # DeepSeek's MLA: a query latent and the DSA indexer, then a plain q_proj.
    "mla": [
        "model.mla={q_lora_rank: 24, kv_lora_rank: 16, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10}",
        "model.layers=[{attention: mla_sparse, mlp: moe}, {attention: mla, mlp: moe}]",
    ],
    "mla-q-proj": [
        "model.mla={kv_lora_rank: 16, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10, rope: none}",
        "model.layers=[{attention: mla, mlp: moe}, {attention: linear, mlp: moe}]",
    ],
}
# LoRA settings, each changing what PEFT adds.
LORA_VARIANTS = {
    "tiny": [],
    "no-expert-adapters": ["lora.experts=false", "lora.modules_to_save=[]"],
    # PEFT matches modules_to_save by plain suffix: `gate` also wraps every shared_expert_gate.
    "save-routers": ["lora.modules_to_save=[gate]", "lora.r=4"],
    # The MLPs (routed experts included) trained in full, the attention adapted.
    "save-mlp": ["lora.modules_to_save=[mlp]", "lora.experts=false", "lora.target_modules=[q_proj, o_proj, z_proj]"],
    "odd-targets": [
        "lora.target_modules=[gate, lm_head, index_q_proj, a_proj, shared_expert_gate]",
        "lora.modules_to_save=[norm]",
    ],
}


def _numel(params) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_model_parameters_match_the_built_model(overrides):
    from moe_tune.engine.model.model import build_model

    cfg = load_profile("tiny", overrides).model
    model = build_model(cfg)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {p.name: p.shape for p in model_parameters(cfg)} == built
    counts = count_parameters(cfg, load_profile("tiny", ["lora.enabled=false"]).lora)
    expert_numel = _numel(p for name, p in model.named_parameters() if ".experts." in name)
    assert counts.total == _numel(model.parameters())
    assert counts.experts == expert_numel
    assert counts.dense == counts.total - expert_numel
    # Full fine-tuning: no adapters, every parameter trainable.
    assert (counts.lora_dense, counts.lora_experts, counts.trainable) == (0, 0, counts.total)


@pytest.mark.parametrize(
    "overrides",
    [VARIANTS["tiny"], VARIANTS["dense-mlp"], *list(LORA_VARIANTS.values())[1:]],
    ids=["tiny", "dense-mlp", *list(LORA_VARIANTS)[1:]],
)
def test_lora_counts_match_the_peft_model(overrides):
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model

    job = load_profile("tiny", overrides)
    model = inject_lora(build_model(job.model), job.lora)
    counts = count_parameters(job.model, job.lora)
    assert counts.total + counts.lora_dense + counts.lora_experts == _numel(model.parameters())
    trainable = {
        name.removeprefix("base_model.model."): tuple(p.shape)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    added = lora_parameters(model_parameters(job.model), job.lora)
    assert {p.name: p.shape for p in added} == trainable
    assert counts.trainable == sum(map(_numel_of_shape, trainable.values()))
    # Expert adapters, and full copies of saved modules that hold routed experts (save-mlp).
    expert_trainable = sum(_numel_of_shape(s) for name, s in trainable.items() if ".experts." in name)
    assert counts.lora_experts == expert_trainable


def _numel_of_shape(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


# lora.vision_tower x lora.vision_merger: every way tiny-vl's tower and merger can train.
VISION_CHOICES = [(tower, merger) for tower in ("frozen", "lora", "trained")
                  for merger in ("frozen", "lora", "trained")]  # fmt: skip


def _trainable_shapes(model) -> dict[str, tuple[int, ...]]:
    return {name.removeprefix("base_model.model."): tuple(p.shape) for name, p in model.named_parameters()
            if p.requires_grad}  # fmt: skip


def _assert_state_bytes_follow(job, trainable: dict[str, tuple[int, ...]]):
    """Every layout's gradients and AdamW state are the trainable parameters' (fp32: 4 and 8 bytes each) / N."""
    numel = sum(map(_numel_of_shape, trainable.values()))
    for lay in plan_layouts(job, 2, 80 * GB).layouts:
        assert (lay.gradients, lay.optimizer) == (-(-numel * 4 // 2), -(-numel * 8 // 2))


@pytest.mark.parametrize("tower, merger", VISION_CHOICES)
def test_vision_lora_counts_match_the_peft_model(tower, merger):
    # Adapters on the tower's or merger's linears (lora), trainable copies of its parts (trained), or neither.
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model

    job = load_profile("tiny-vl", [f"lora.vision_tower={tower}", f"lora.vision_merger={merger}"])
    model = inject_lora(build_model(job.model), job.lora)
    trainable = _trainable_shapes(model)
    added = lora_parameters(model_parameters(job.model), job.lora)
    assert {p.name: p.shape for p in added} == trainable
    assert {p.name: p.shape for p in trainable_parameters(model_parameters(job.model), job.lora)} == trainable
    counts = count_parameters(job.model, job.lora)
    assert counts.total + counts.lora_dense + counts.lora_experts == _numel(model.parameters())
    assert counts.trainable == sum(map(_numel_of_shape, trainable.values()))
    assert counts.trainable_dense == sum(_numel_of_shape(s) for name, s in trainable.items() if ".experts." not in name)
    _assert_state_bytes_follow(job, trainable)


@pytest.mark.parametrize("tower, merger", VISION_CHOICES)
def test_full_fine_tuning_counts_leave_out_the_frozen_vision_parts(tower, merger):
    from moe_tune.engine.lora import freeze_vision_parts
    from moe_tune.engine.model.model import build_model

    job = load_profile("tiny-vl", ["lora.enabled=false", f"lora.vision_tower={tower}", f"lora.vision_merger={merger}"])
    model = build_model(job.model)
    freeze_vision_parts(model, job.lora)
    trainable = _trainable_shapes(model)
    assert {p.name: p.shape for p in trainable_parameters(model_parameters(job.model), job.lora)} == trainable
    counts = count_parameters(job.model, job.lora)
    assert (counts.lora_dense, counts.lora_experts) == (0, 0)
    assert counts.trainable == sum(map(_numel_of_shape, trainable.values())) <= counts.total
    assert counts.trainable_experts == counts.experts
    _assert_state_bytes_follow(job, trainable)


def test_active_parameters_count_top_k_experts_per_moe_layer():
    cfg = load_profile("tiny").model
    counts = count_parameters(cfg, load_profile("tiny").lora)
    moe = cfg.moe
    per_expert = 3 * cfg.hidden_size * moe.expert_intermediate_size
    assert counts.experts == len(cfg.layers) * moe.num_experts * per_expert
    assert counts.active_per_token == counts.dense + len(cfg.layers) * moe.top_k * per_expert


def test_lora_target_that_names_no_linear_is_a_profile_error():
    job = load_profile("tiny", ["lora.target_modules=[q_proj, qq_proj]"])
    with pytest.raises(ProfileError, match=r"lora.target_modules \('qq_proj'\) must name a linear layer of the model"):
        plan_layouts(job, 8, 80 * GB)


def test_seed_profile_plans_to_the_design_case():
    # Trillions of parameters: the planner builds nothing (its model lives on the meta device; 5.6 TB of weights
    # built for real would not fit this machine).
    job = load_profile("seed-2p8t")
    plan = plan_layouts(job, 128, 141 * GB)
    counts = plan.parameters
    assert counts.total == pytest.approx(2.8e12, rel=0.02)
    assert plan.weight_bytes == 2 * counts.total
    assert plan.weight_bytes == pytest.approx(5.6e12, rel=0.02)
    assert (plan.num_experts, plan.top_k, plan.precision) == (896, 16, "bf16")
    # LoRA with the backbone frozen: only adapters train.
    assert plan.lora_enabled and plan.modules_to_save == []
    assert counts.trainable == counts.lora_dense + counts.lora_experts < counts.total / 100
    (seed_layout,) = [lay for lay in plan.layouts if (lay.data_parallel, lay.expert_parallel) == (2, 64)]
    assert seed_layout.is_profile_layout
    assert seed_layout.experts_per_device == 14
    # About 80 GB per device (43.2 GB of experts, 31.6 GB of activations at 16384 tokens with checkpointing; the
    # chunked loss keeps d hidden [T, D] and one chunk of logits, not the [T, V] logits).
    assert seed_layout.fits
    assert 75 * GB < seed_layout.total < 85 * GB
    # Layouts: every ep dividing both 896 and 128, fitting ones first.
    assert sorted(lay.expert_parallel for lay in plan.layouts) == [1, 2, 4, 8, 16, 32, 64, 128]
    fits = [lay.fits for lay in plan.layouts]
    assert fits == sorted(fits, reverse=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_per_device_state_shards_over_all_devices(precision):
    job = load_profile("tiny", [f"train.precision={precision}", "lora.enabled=false"])
    counts = count_parameters(job.model, job.lora)
    wb = {"fp32": 4, "bf16": 2}[precision]
    # AdamW: two fp32 moments, plus an fp32 master copy of bf16 weights.
    optimizer_bytes = {"fp32": 8, "bf16": 12}[precision]
    plan = plan_layouts(job, 8, 80 * GB)
    assert sorted(lay.expert_parallel for lay in plan.layouts) == [1, 2, 4, 8]
    for lay in plan.layouts:
        assert lay.dense_weights == -(-counts.dense * wb // 8)
        # E / ep experts ZeRO-sharded over dp = 8 / ep ranks: E / 8 experts' worth on every layout.
        assert lay.expert_weights == -(-counts.experts * wb // 8)
        assert lay.gradients == -(-counts.total * wb // 8)
        assert lay.optimizer == -(-counts.total * optimizer_bytes // 8)
        assert lay.experts_per_device == 8 // lay.expert_parallel


def test_all_to_all_bytes_follow_the_formula():
    job = load_profile("tiny", ["train.gradient_accumulation_steps=3"])
    plan = plan_layouts(job, 8, 80 * GB)
    cfg, train = job.model, job.train
    tokens = train.micro_batch_size * job.data.seq_len
    for lay in plan.layouts:
        ep = lay.expert_parallel
        # tokens x top_k x hidden x 4 bytes x share leaving the rank x (dispatch + combine, forward + backward)
        expected = 3 * len(cfg.layers) * tokens * cfg.moe.top_k * cfg.hidden_size * 4 * (ep - 1) / ep * 4
        assert lay.all_to_all_per_step == round(expected)
    recomputed = plan_layouts(load_profile("tiny", ["memory.activation_checkpointing=true"]), 8, 80 * GB)
    by_ep = {lay.expert_parallel: lay.all_to_all_per_step for lay in recomputed.layouts}
    # The recomputed forward dispatches and combines once more.
    assert by_ep[2] == round(len(cfg.layers) * tokens * cfg.moe.top_k * cfg.hidden_size * 4 * 0.5 * 6)


def test_activations_scale_with_tokens_and_shrink_with_checkpointing():
    # seq_len a multiple of the linear-attention chunk, so every term doubles exactly with the tokens.
    short = activation_bytes(load_profile("tiny", ["data.seq_len=256"]))
    long = activation_bytes(load_profile("tiny", ["data.seq_len=512"]))
    assert long.total == 2 * short.total
    checkpointed = activation_bytes(load_profile("tiny", ["data.seq_len=256", "memory.activation_checkpointing=true"]))
    assert checkpointed.layers < short.layers
    assert checkpointed.head == short.head


def test_layouts_that_do_not_fit_come_last():
    job = load_profile("tiny")
    plan = plan_layouts(job, 8, 1)
    assert not any(lay.fits for lay in plan.layouts)
    generous = plan_layouts(job, 8, 80 * GB)
    assert all(lay.fits for lay in generous.layouts)
    traffic = [lay.traffic_per_step for lay in generous.layouts]
    assert traffic == sorted(traffic)


def test_chunk_constant_matches_the_kernel():
    from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE

    assert LINEAR_ATTENTION_CHUNK == DEFAULT_CHUNK_SIZE


@pytest.mark.parametrize("builder", ["tiny_qwen4_exp", "tiny_deepseek_v32", "tiny_qwen3_5_moe"])
def test_model_parameters_match_models_read_from_checkpoints(builder, tmp_path):
    # Hyper-connections, n-gram tables, QSA and DSA indexers, MLA, the vision tower: every block kind counts exactly.
    import hf_tiny

    from moe_tune.engine.families import model_profile_from_checkpoint
    from moe_tune.engine.model.model import build_model

    checkpoint = hf_tiny.save_tiny_checkpoint(getattr(hf_tiny, builder)(), tmp_path / builder)
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    built = {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}
    assert {p.name: p.shape for p in model_parameters(cfg)} == built


def test_head_keeps_no_logits_unless_the_head_has_lora():
    # A 2^20 vocabulary caps the chunked loss at its minimum 128-row chunk, so one more token adds only what the loss
    # keeps per token (d hidden) and the final norm's input and output, 3 D b bytes; with LoRA on lm_head the model
    # builds all the logits and each token adds V (b + 4) on top.
    def head(seq_len: int, *lora) -> int:
        job = load_profile("tiny", ["model.vocab_size=1048576", f"data.seq_len={seq_len}", "train.precision=bf16",
                                    "train.micro_batch_size=1", *lora])  # fmt: skip
        return activation_bytes(job).head

    hidden, vocab = load_profile("tiny").model.hidden_size, 1048576
    assert head(2048) - head(1024) == 1024 * 3 * hidden * 2
    with_lora = ["lora.target_modules=[q_proj, lm_head]", "lora.modules_to_save=[]"]
    assert head(2048, *with_lora) - head(1024, *with_lora) == 1024 * (2 * hidden * 2 + vocab * (2 + 4))


def _blocks(size: int) -> int:
    return -(-size // 128)


def _fp8_linear(out_features: int, in_features: int) -> tuple[int, int]:
    """(FP8 elements, fp32 scales) of a frozen linear under base_precision fp8: both dims >= 128, else none."""
    if min(out_features, in_features) < 128:
        return 0, 0
    return out_features * in_features, _blocks(out_features) * _blocks(in_features)


def _fp8_job(d, f, fs, dense, experts, *overrides):
    """Three layers: full attention + MoE, full attention + dense MLP, gated delta net + MoE."""
    return validate_profile(apply_overrides({
        "name": "fp8-count",
        "model": dict(
            vocab_size=300, hidden_size=d, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            attention_output_gate=False, intermediate_size=dense, base_precision="fp8",
            layers=[{"attention": "full"}, {"attention": "full", "mlp": "dense"}, {"attention": "linear"}],
            linear_attention=dict(num_key_heads=1, num_value_heads=2, key_head_dim=128, value_head_dim=128),
            moe=dict(num_experts=experts, top_k=2, expert_intermediate_size=f, shared_expert_intermediate_size=fs),
        ),
        "data": {"seq_len": 32},
        "lora": {"r": 4},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3, "precision": "bf16"},
        "output": {"dir": "out"},
    }, list(overrides)))  # fmt: skip


def _hand_count(d, f, fs, dense, experts, shared_in_fp8=True) -> tuple[int, int, int, int]:
    """(dense FP8 elements, dense scales, expert FP8 elements, expert scales) of _fp8_job, by the rule."""
    full = [_fp8_linear(2 * 128, d), _fp8_linear(128, d), _fp8_linear(128, d), _fp8_linear(d, 2 * 128)]
    # q, k [1 x 128, D]; v, z [2 x 128, D]; o [D, 256]; b_proj and a_proj [2, D] are too narrow.
    linear = [_fp8_linear(128, d)] * 2 + [_fp8_linear(256, d)] * 2 + [_fp8_linear(d, 256), _fp8_linear(2, d)] * 1
    shared = [_fp8_linear(fs, d), _fp8_linear(fs, d), _fp8_linear(d, fs)] if fs and shared_in_fp8 else []
    mlp = [_fp8_linear(dense, d), _fp8_linear(dense, d), _fp8_linear(d, dense)]
    # Routers [E, D] and the shared expert gate [1, D] stay bf16 whatever their size.
    parts = full * 2 + linear + shared * 2 + mlp
    # Two MoE layers: w_gate_up [E, 2F, D] with gate and up rows scaled apart, w_down [E, D, F].
    expert_elements = 2 * experts * (2 * f * d + d * f)
    expert_scales = 2 * experts * (2 * _blocks(f) * _blocks(d) + _blocks(d) * _blocks(f))
    return sum(e for e, _ in parts), sum(s for _, s in parts), expert_elements, expert_scales


FP8_SHAPES = {
    "multiples-of-128": (256, 256, 128, 384, 4),
    "odd-dims": (200, 130, 300, 129, 3),
    # Experts are FP8 at any width; linears with a dim below 128 are not.
    "narrow-mlps": (256, 64, 100, 96, 4),
    "no-shared-expert": (256, 256, 0, 384, 4),
    # A router of 128 experts has both dims >= 128 and still stays bf16.
    "128-experts": (256, 64, 128, 128, 128),
    # Every projection touches D = 96: only the experts are FP8.
    "narrow-model": (96, 130, 300, 200, 3),
}


@pytest.mark.parametrize("shape", FP8_SHAPES.values(), ids=FP8_SHAPES.keys())
def test_fp8_base_counts_one_byte_per_weight_and_its_block_scales(shape):
    job = _fp8_job(*shape)
    dense_fp8, dense_scales, expert_fp8, expert_scales = _hand_count(*shape)
    counts = count_parameters(job.model, job.lora)
    plan = plan_layouts(job, 2, 80 * GB)
    weights = plan.weights
    assert plan.base_precision == "fp8"
    assert weights.fp8_parameters == dense_fp8 + expert_fp8
    assert weights.fp8_scales == 4 * (dense_scales + expert_scales)
    assert weights.experts == expert_fp8 + 4 * expert_scales + 2 * (counts.experts - expert_fp8)
    assert weights.dense == dense_fp8 + 4 * dense_scales + 2 * (counts.dense - dense_fp8)
    assert plan.weight_bytes == weights.dense + weights.experts
    bf16 = plan_layouts(_fp8_job(*shape, "model.base_precision=bf16"), 2, 80 * GB)
    assert bf16.weight_bytes == 2 * counts.total and bf16.weights.fp8_parameters == 0
    for lay, ref in zip(plan.layouts, bf16.layouts):
        # Per device: the base weights shard over both devices; LoRA, gradients, optimizer, activations unchanged.
        assert (lay.dense_weights, lay.expert_weights) == (-(-weights.dense // 2), -(-weights.experts // 2))
        assert (lay.lora_weights, lay.gradients, lay.optimizer, lay.activations) == (
            ref.lora_weights, ref.gradients, ref.optimizer, ref.activations)


@pytest.mark.parametrize("shape", list(FP8_SHAPES.values())[:3], ids=list(FP8_SHAPES)[:3])
def test_fp8_plan_equals_the_built_fp8_model(shape):
    # The FP8 model holds uint8 weights and int32 scales (their bits); everything else is counted at bf16.
    import torch

    from moe_tune.engine.model.model import build_model

    job = _fp8_job(*shape)
    model = build_model(job.model)
    stored = {torch.uint8: 1, torch.int32: 4}
    built = sum(p.numel() * stored.get(p.dtype, 2) for p in model.parameters())
    assert plan_layouts(job, 1, 80 * GB).weight_bytes == built


def test_modules_trained_in_full_stay_in_the_training_dtype():
    shape = FP8_SHAPES["multiples-of-128"]
    dense_fp8, dense_scales, expert_fp8, _ = _hand_count(*shape, shared_in_fp8=False)
    weights = plan_layouts(_fp8_job(*shape, "lora.modules_to_save=[shared_expert]"), 1, 80 * GB).weights
    assert weights.fp8_parameters == dense_fp8 + expert_fp8


def test_seed_profile_fits_64_devices_with_an_fp8_base():
    bf16 = plan_layouts(load_profile("seed-2p8t"), 64, 141 * GB)
    fp8 = plan_layouts(load_profile("seed-2p8t", ["model.base_precision=fp8"]), 64, 141 * GB)
    # Every routed expert and projection in FP8: about half the bytes (embeddings, head, norms, routers stay bf16).
    assert fp8.weights.fp8_parameters > 0.99 * fp8.parameters.total
    assert fp8.weight_bytes == pytest.approx(bf16.weight_bytes / 2, rel=0.01)
    (layout,) = [lay for lay in fp8.layouts if lay.is_profile_layout]
    (reference,) = [lay for lay in bf16.layouts if lay.is_profile_layout]
    assert layout.fits and layout.total < reference.total - 40 * GB
    assert layout.expert_weights == pytest.approx(reference.expert_weights / 2, rel=0.01)


# tiny's linear layers: Hv 4 value heads, K = V = 16, conv channels 2 x 2 x 16 + 4 x 16 = 128, reach 3; its sparse
# layer: G 2 key/value heads of hd 16, indexer keys DI 16. fp32: 4 bytes.
TINY_STATE_SUMMARY = 4 * 16 * (16 + 16) * 4  # [Hv, K, K + V] fp32, one a device
TINY_HALO = 3 * 128 * 4  # reach x conv channels, one a device


def tiny_gathers(c: int, row_tokens: int) -> tuple[int, int, int]:
    """(one linear layer's gathered pieces, the sparse layer's span buffer on the group's last device, the row's
    indexer keys) in bytes, counted by hand."""
    return c * (TINY_STATE_SUMMARY + TINY_HALO), row_tokens * 2 * 2 * 16 * 4, row_tokens * 16 * 4


def tiny_fetched(c: int, row_tokens: int) -> tuple[int, float]:
    """tiny's sparse layer (token level, S 32 slots of 16-row pages: never fewer rows than the earlier keys) fetches
    r T_row / c rows on device r: (the last device's rows, the mean over the c devices)."""
    share = row_tokens // c
    return (c - 1) * share, sum(r * share for r in range(c)) / c


@pytest.mark.parametrize("c", [2, 4])
def test_context_parallel_activations_are_a_shares_plus_the_gathers(c):
    row = 4 * 256
    shared = activation_bytes(load_profile("tiny", ["data.seq_len=256", f"parallel.context_parallel={c}"]))
    # One device's share of the row: the single-device figure at T_row / c tokens (rows of 256 / c, 4 a micro-batch).
    alone = activation_bytes(load_profile("tiny", [f"data.seq_len={256 // c}"]))
    assert (shared.layers, shared.head, shared.transient) == (alone.layers, alone.head, alone.transient)
    linear, span_buffer, _ = tiny_gathers(c, row)
    # The sparse layer keeps its span buffer and the fetched rows' int64 ids, not the indexer's keys.
    last_rows, _ = tiny_fetched(c, row)
    assert shared.context == 3 * linear + span_buffer + last_rows * 8
    assert shared.total == alone.total + shared.context
    # Whole layers recomputed: one layer's gathers at a time, the sparse layer's being the largest.
    checkpointed = activation_bytes(load_profile("tiny", ["data.seq_len=256", f"parallel.context_parallel={c}",
                                                          "memory.activation_checkpointing=true"]))  # fmt: skip
    assert checkpointed.context == span_buffer + last_rows * 8


@pytest.mark.parametrize("checkpointing", [False, True])
def test_context_traffic_follows_a_hand_count(checkpointing):
    c, accumulation = 4, 3
    job = load_profile("tiny", ["data.seq_len=256", f"parallel.context_parallel={c}",
                                f"train.gradient_accumulation_steps={accumulation}",
                                f"memory.activation_checkpointing={str(checkpointing).lower()}"])  # fmt: skip
    linear, _, index_keys = tiny_gathers(c, 4 * 256)
    last_rows, mean_rows = tiny_fetched(c, 4 * 256)
    row_bytes = 2 * 2 * 16 * 4
    forward = 2 if checkpointing else 1
    # Forward gathers (again in the recomputed forward), the gradients of those with one in backward; a device
    # receives 3/4 of each gathered tensor. The sparse layer fetches its rows in each forward and sends their
    # gradients back.
    gathered = (3 * (forward * linear + linear) + forward * index_keys) * (c - 1) / c
    expected = round(accumulation * (gathered + (forward + 1) * last_rows * row_bytes))
    mean = round(accumulation * (gathered + (forward + 1) * mean_rows * row_bytes))
    plan = plan_layouts(job, 8, 80 * GB)
    assert {(lay.context_per_step, lay.context_mean_per_step) for lay in plan.layouts} == {(expected, mean)}
    for lay in plan.layouts:
        assert lay.traffic_per_step == lay.all_to_all_per_step + lay.zero3_per_step + expected
    assert plan.tokens_per_micro_batch == 256 and plan.row_tokens == 1024 and plan.context_parallel == c


def test_context_parallel_must_divide_the_devices():
    with pytest.raises(ProfileError, match=r"^parallel.context_parallel \(4\) must divide the devices \(6\)"):
        plan_layouts(load_profile("tiny", ["parallel.context_parallel=4"]), 6, 80 * GB)


# One top-k or softmax layer on tiny's 1024-token row (fp32, 4 rows of 256): R bytes a key row, G 2 x 2 hd 16 x 4 = 256
# (mla: Rkv 16 + Dr 8 = 24 numbers, 96 bytes), an indexer key DI 16 x 4 = 64 bytes. A top-k layer on device r of c
# (share q = 1024 / c) fetches F_r = min(r q, q S U) rows: the earlier keys of a document over the row, or the units
# its queries can select (S slots, U rows a unit: block_size, 16-row pages at token level). Per micro-batch, without
# recomputation: the indexer keys (c - 1) / c x 1024 x 64 (qsa twice) + F R in forward + F R of gradients sent back;
# kept: the last device's span buffer 1024 x R + its F x 8 bytes of row ids. (name, overrides, c, F_r over the ranks,
# R, indexer gathers); F_r None: a full or mla layer's gather.
ROW, MLA_LATENT = 4 * 256, VARIANTS["mla"][0]
CONTEXT_KINDS = [
    # Block level, S 1, U 4: F_r = min(128 r, 512).
    ("sparse-block", ["model.sparse_attention.block_size=4", "model.sparse_attention.topk=4"], 8,
     [0, 128, 256, 384, 512, 512, 512, 512], 256, 1),
    # Token level, S 1, U 16 (a page, not a token): F_r = min(32 r, 512).
    ("sparse-token", ["model.sparse_attention.topk=1"], 32, [32 * r for r in range(17)] + [512] * 15, 256, 1),
    # Token level, S 32: the earlier keys bound it, F_r = 256 r.
    ("sparse-token-all", [], 4, [0, 256, 512, 768], 256, 1),
    # QSA's S = topk / block_size + 1 = 2 slots (the incomplete block on top), U 4: F_r = min(64 r, 512).
    ("qsa", ["model.sparse_attention.block_size=4", "model.sparse_attention.topk=4"], 16,
     [64 * r for r in range(9)] + [512] * 7, 256, 2),
    # mla_sparse fetches its kv latent and rope key; S 1, U 4: F_r = min(64 r, 256).
    ("mla_sparse", [MLA_LATENT, "model.sparse_attention.block_size=4", "model.sparse_attention.topk=4"], 16,
     [64 * r for r in range(5)] + [256] * 11, 96, 1),
    ("full", [], 8, None, 256, 0),
    ("mla", [MLA_LATENT], 8, None, 96, 0),
]


@pytest.mark.parametrize("kind, overrides, c, fetched, row_bytes, num_index_gathers", CONTEXT_KINDS,
                         ids=[case[0] for case in CONTEXT_KINDS])  # fmt: skip
def test_context_exchanges_of_each_attention_kind_follow_a_hand_count(
    kind, overrides, c, fetched, row_bytes, num_index_gathers
):  # fmt: skip
    attention = kind.split("-")[0]
    job = load_profile("tiny", ["data.seq_len=256", f"parallel.context_parallel={c}", "model.moe.aux_loss_coef=0",
                                f"model.layers=[{{attention: {attention}, mlp: moe}}]", "lora.target_modules=[o_proj]",
                                *overrides])  # fmt: skip
    index_keys = num_index_gathers * (c - 1) / c * ROW * 64
    if fetched is None:
        # The whole row gathered, kept, and its gradients reduce-scattered back.
        kept, last, mean = ROW * row_bytes, 2 * (c - 1) / c * ROW * row_bytes, 2 * (c - 1) / c * ROW * row_bytes
    else:
        assert len(fetched) == c
        kept = ROW * row_bytes + fetched[-1] * 8
        last = index_keys + 2 * fetched[-1] * row_bytes
        mean = index_keys + 2 * sum(fetched) / c * row_bytes
    assert activation_bytes(job).context == kept
    plan = plan_layouts(job, c, 80 * GB)
    assert {(lay.context_per_step, lay.context_mean_per_step) for lay in plan.layouts} == {(round(last), round(mean))}


def test_the_plans_token_page_is_the_fetchs():
    from moe_tune.engine.model import attention_context
    from moe_tune.engine import plan

    assert plan.FETCH_TOKEN_PAGE == attention_context.TOKEN_PAGE


def test_seed_million_token_rows_on_128_devices():
    # The seed's 1M-token row on 64 devices each: every device holds the 16384 tokens it holds without context
    # parallelism, plus one layer's exchanges under activation checkpointing: a sparse layer's span buffer on the
    # group's last device, 1M x 8 x 2 x 128 bf16, and the int64 ids of the 63 x 16384 rows it fetched.
    seed = plan_layouts(load_profile("seed-2p8t"), 128, 141 * GB)
    million = plan_layouts(load_profile("seed-2p8t", ["data.seq_len=1048576", "parallel.context_parallel=64"]), 128,
                           141 * GB)  # fmt: skip
    assert million.tokens_per_micro_batch == seed.tokens_per_micro_batch == 16384
    assert million.activations.context == 2**20 * 8 * 2 * 128 * 2 + 63 * 16384 * 8
    assert million.activations.total == seed.activations.total + million.activations.context
    by_ep = {lay.expert_parallel: lay for lay in seed.layouts}
    for lay in million.layouts:
        assert lay.all_to_all_per_step == by_ep[lay.expert_parallel].all_to_all_per_step
        assert lay.fits == (lay.total <= 141 * GB)
    assert million.layouts[0].fits and million.layouts[0].context_per_step > 0


def test_plan_command_shows_the_context_groups_and_their_traffic():
    from typer.testing import CliRunner

    from moe_tune.cli import app

    args = ["plan", "seed-2p8t", "--devices", "128", "--set", "data.seq_len=1048576", "--set",
            "parallel.context_parallel=64"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "context parallel 64: each row of 1048576 tokens shared by 64 devices, 2 rows a micro-batch" in lines
    assert any(line.startswith("activations 36.8 GB = ")
               and line.endswith("gathered or fetched by the token mixers 4.3 GB") for line in lines), result.output
    assert ("context/step 252 GB on a group's last device (at most: one document over the row, every key "
            "selectable), 164 GB on average over its devices") in lines
    assert "context/step" in result.output
    # Without context parallelism the table has no such column.
    assert "context/step" not in CliRunner().invoke(app, ["plan", "tiny", "--devices", "2"]).output


def _chunked_job(layers: str, seq_len: int, chunk: int, *overrides: str):
    return load_profile("tiny", [f"model.layers={layers}", f"data.seq_len={seq_len}",
                                 f"memory.sequence_chunk_tokens={chunk}", *overrides])  # fmt: skip


def test_chunked_token_mixers_grow_only_by_what_they_keep_a_token():
    # In sequence chunks a linear, kda or full layer keeps its input rows (the two norms' inputs and the first's
    # output, 3 D), a [H, K, V] fp32 state a slab (linear Hv 4, K = V 16; kda 2 heads of 16) or the row's keys and
    # values (G 2, hd 16); what backward recomputes a chunk at a time does not grow with the row.
    layers = "[{attention: linear, mlp: moe}, {attention: kda, mlp: moe}, {attention: full, mlp: moe}]"
    kda = "model.kda_attention={num_heads: 2, head_dim: 16}"
    chunk = 128
    short, long = (activation_bytes(_chunked_job(layers, seq_len, chunk, kda)) for seq_len in (256, 512))
    more_tokens = 4 * 256  # micro_batch_size 4
    per_token = 3 * 3 * 64 + 2 * 2 * 16
    more_slabs = more_tokens // chunk
    assert long.layers - short.layers == 4 * (more_tokens * per_token + more_slabs * (4 + 2) * 16 * 16)
    assert long.transient == short.transient


def test_plan_mirrors_the_sparse_kernels_tiling():
    from moe_tune.engine import plan
    from moe_tune.ops.sparse_attention import kernels_fwd, kernels_select

    assert (plan.DKV_TOKEN_KEY_TILE, plan.BLOCK_KEY_TILE, plan.DKV_CHUNK_PAIRS, plan.DKV_TOKEN_CHUNKS) == (
        kernels_fwd.GPU_DKV_KEY_TILE, kernels_fwd.GPU_BLOCK_KEY_TILE, kernels_fwd.GPU_DKV_CHUNK_PAIRS,
        kernels_fwd.GPU_DKV_TOKEN_CHUNKS,
    )  # fmt: skip
    assert (plan.MIN_DOT_SIZE, plan.BITS_PER_WORD) == (kernels_select.MIN_DOT_SIZE, kernels_select.BITS_PER_WORD)


@pytest.mark.parametrize(
    "num_queries, num_keys, block_size, slots",
    [
        (100, 2048, 1, 32),  # token level: every key tile visited by every query
        (999, 4000, 1, 32),  # the last tiles visited by fewer queries, the last one partial
        (32768, 1048576, 1, 2048),  # past DKV_TOKEN_CHUNKS chunks of DKV_CHUNK_PAIRS pairs: longer chunks
        (64, 300, 4, 8),  # block level, blocks narrower than a dot
        (10, 1000, 100, 3),  # blocks of two key tiles
        (32768, 1048576, 64, 32),  # bench-hybrid-1m's chunk
    ],
)
def test_sparse_chunk_partials_are_what_the_kernels_allocate(num_queries, num_keys, block_size, slots):
    # The fp32 dk/dv partials of kernels_bwd.sparse_attention_bwd on the GPU configuration (pick_config of a CUDA
    # tensor), for C queries that are the last of one document's M keys: [H, NC, num_sub, key_tile, K] with NC the
    # key slots (token level: key tiles; block level: block_slots) plus ceil(pairs / pairs a chunk) (pair_chunks).
    from types import SimpleNamespace

    import torch
    import triton

    from moe_tune.engine.plan import _dkv_partial_rows
    from moe_tune.ops.sparse_attention.kernels_bwd import key_tiles, token_chunking
    from moe_tune.ops.sparse_attention.kernels_fwd import pick_config
    from moe_tune.ops.sparse_attention.kernels_select import block_slots, sequence_layout

    config = pick_config(SimpleNamespace(is_cuda=True), block_size)
    key_tile = config.dkv_key_tile
    if block_size == 1:
        first, _ = key_tiles(num_keys, num_keys, key_tile, "cpu")
        num_sub = 1
        pairs, chunk_pairs = token_chunking(num_keys, num_keys, key_tile, config.dkv_chunk_pairs,
                                            config.dkv_token_chunks, num_queries)  # fmt: skip
    else:
        layout = sequence_layout(torch.tensor([0, num_keys]), 1, num_keys, "cpu", num_queries=num_queries)
        first = block_slots(layout, block_size).first
        num_sub = triton.cdiv(block_size, key_tile)
        pairs, chunk_pairs = num_queries * slots, config.dkv_chunk_pairs
    num_chunks = first.numel() + triton.cdiv(pairs, chunk_pairs)
    assert _dkv_partial_rows(num_queries, num_keys, slots, block_size) == num_chunks * num_sub * key_tile


def test_mla_sparse_and_qsa_chunks_add_what_the_sparse_op_makes():
    # A chunk of C = 100 queries over a span of t = 2048 keys (fp32, token level, S 32): mla_sparse holds what mla
    # does plus its indices [C, S] int32, the op's contiguous copy of the span's values [t, H, V] and what
    # ops/sparse_attention makes (H 4 heads of Dn + Dr = 20 and V = 10, the keys expanded per head, no gate): the bitmap
    # [C, ceil(t / 32)] and the layout 3t int32, dq [C, H, 20], delta [C, H], dk and dv [t, H, 20 + 10], and their fp32
    # partials [H, NC, 1, 128, 32 + 16] (dims padded to powers of two; NC from token_chunking and pair_chunks). QSA's
    # chunk differs from a sparse one's by its one more slot of indices.
    from moe_tune.engine.plan import LayerRanks, _mixer_chunk_elems
    from moe_tune.ops.sparse_attention.kernels_bwd import token_chunking
    from moe_tune.ops.sparse_attention.kernels_fwd import GPU_DKV_CHUNK_PAIRS, GPU_DKV_KEY_TILE, GPU_DKV_TOKEN_CHUNKS

    cfg = load_profile("tiny", [*VARIANTS["mla"][:1], "model.layers=[{attention: mla_sparse, mlp: moe}, {attention: "
                                "mla, mlp: moe}, {attention: qsa, mlp: moe}, {attention: sparse, mlp: moe}]"]).model
    t, c, no_lora = 2048, 100, LayerRanks(0, 0, 0)
    mla_sparse, mla, qsa, sparse = (4 * sum(_mixer_chunk_elems(cfg, spec, t, c, no_lora)) for spec in cfg.layers)
    pairs, chunk_pairs = token_chunking(t, t, GPU_DKV_KEY_TILE, GPU_DKV_CHUNK_PAIRS, GPU_DKV_TOKEN_CHUNKS, c)
    rows = (-(-t // GPU_DKV_KEY_TILE) + -(-pairs // chunk_pairs)) * GPU_DKV_KEY_TILE
    op = c * -(-t // 32) + 3 * t + c * 4 * 20 + c * 4 + t * 4 * 30 + 4 * rows * (32 + 16)
    assert mla_sparse - mla == 4 * (c * 32 + t * 4 * 10 + op)
    assert qsa - sparse == 4 * c


def test_bench_hybrid_million_token_step_plans_within_one_h200():
    # bench-hybrid-1m at 1048576 tokens with its token mixers in chunks of 32768: with whole-layer checkpointing one
    # H200 holds the step (the target: under 130 GB); unchunked token mixers alone would not fit.
    overrides = ["data.seq_len=1048576", "memory.preset=none", "memory.gpu_budget_gb=null",
                 "memory.activation_checkpointing=true"]  # fmt: skip
    plan = plan_layouts(load_profile("bench-hybrid-1m", overrides), 1, 141 * GB)
    assert plan.layouts[0].fits and plan.layouts[0].total < 130 * GB
    # A linear layer's tensors over the row, unchunked, exceed the whole chunked step's activations.
    whole = activation_bytes(load_profile("bench-hybrid-1m", [*overrides, "memory.sequence_chunk_tokens=1048576"]))
    assert whole.layers > plan.activations.total


@pytest.mark.parametrize("checkpointing", [False, True])
def test_context_parallel_shares_are_the_token_mixers_one_chunk(checkpointing):
    # With sequence chunks (shorter than a device's share of 512 tokens, or not) each token mixer runs its share
    # whole under activation checkpoint, so one layer's gathers exist at a time and backward gathers once more.
    c, accumulation = 4, 3
    base = ["data.seq_len=512", f"parallel.context_parallel={c}", "model.moe.aux_loss_coef=0",
            f"train.gradient_accumulation_steps={accumulation}",
            f"memory.activation_checkpointing={str(checkpointing).lower()}"]  # fmt: skip
    linear, span_buffer, index_keys = tiny_gathers(c, 4 * 512)
    last_rows, mean_rows = tiny_fetched(c, 4 * 512)
    sparse_kept, row_bytes = span_buffer + last_rows * 8, 2 * 2 * 16 * 4
    forward = 3 if checkpointing else 2
    gathered = (3 * (forward * linear + linear) + forward * index_keys) * (c - 1) / c
    per_micro_batch = gathered + (forward + 1) * last_rows * row_bytes
    for chunk in (100, 512):
        job = load_profile("tiny", [*base, f"memory.sequence_chunk_tokens={chunk}"])
        assert activation_bytes(job).context == sparse_kept
        plan = plan_layouts(job, 8, 80 * GB)
        assert {lay.context_per_step for lay in plan.layouts} == {round(accumulation * per_micro_batch)}
    unset = activation_bytes(load_profile("tiny", base))
    assert unset.context == (sparse_kept if checkpointing else 3 * linear + sparse_kept)


# The memory policy (engine/memory) on the tiny model: T = 4 x 128 tokens, D 64, fp32, LoRA r 16 on the attention
# and MLP linears and the routed experts. Its tensors are all under 1 MB, so min_offload_mb=0 lets every one move.
TINY_TOKENS = 4 * 128
MOVE_ALL = "memory.min_offload_mb=0"
THREE_FULL_LAYERS = ("model.layers=[{attention: full, mlp: moe}, {attention: full, mlp: moe}, {attention: full, mlp: "
                     "moe}]", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]")
# One full-attention mixer's saved bytes (fp32): q_proj's output (query and gate) 2 H hd, k and v 2 G hd, q and k
# after norm and RoPE (H + G) hd, the output and the gated output 2 H hd, the log-sum-exp H, and x A of q, k, v, o.
TINY_FULL_MIXER = TINY_TOKENS * ((2 * 4 * 16 + 2 * 2 * 16) + (4 + 2) * 16 + 2 * 4 * 16 + 4 + 4 * 16) * 4
# One MoE layer's routed experts (fp32): the T k dispatched rows and outputs 2 D, gate_up 2 F, the SwiGLU product F,
# x A of both projections 2 r.
TINY_EXPERTS = TINY_TOKENS * 2 * (2 * 64 + 3 * 32 + 2 * 16) * 4


def test_preset_none_plans_what_every_saved_tensor_takes():
    # A budget never reached keeps every tensor on the GPU: the policy's tensor-by-tensor count is the plain one, for
    # every layer kind and with sequence chunks of the per-token part and of the token mixers.
    targets = "lora.target_modules=[o_proj, up_proj]"
    chunked = ["data.seq_len=512", "memory.sequence_chunk_tokens=300"]
    cases = [[*v, targets] for v in VARIANTS.values()] + list(LORA_VARIANTS.values())
    cases += [chunked, [*VARIANTS["mla"], targets, *chunked], ["memory.sequence_chunk_tokens=512"]]
    for overrides in cases:
        plain = activation_bytes(load_profile("tiny", overrides))
        budget = activation_bytes(load_profile("tiny", [*overrides, MOVE_ALL, "memory.gpu_budget_gb=1000"]))
        assert (plain.host, plain.prefetch, plain.recompute, plain.host_by_class) == (0, 0, 0, {})
        # Under a policy the recompute term (here the sequence chunks' alone) is reported apart; it is in both.
        assert replace(budget, recompute=0) == plain, overrides
        # No budget, and every tiny tensor under the 1 MB min_offload_mb: nothing moves.
        unmoved = activation_bytes(load_profile("tiny", [*overrides, "memory.experts=offload"]))
        assert replace(unmoved, recompute=0) == plain, overrides


@pytest.mark.parametrize("depth", [0, 1])
def test_offloaded_classes_move_their_bytes_to_host(depth):
    plain = activation_bytes(load_profile("tiny"))
    job = load_profile("tiny", ["memory.experts=offload", MOVE_ALL, f"memory.prefetch_layers={depth}"])
    offloaded = activation_bytes(job)
    assert offloaded.host == 4 * TINY_EXPERTS and offloaded.host_by_class == {"experts": 4 * TINY_EXPERTS}
    # Backward at the top layer holds every layer's GPU tensors and swaps in its own and depth more layers' experts.
    assert offloaded.prefetch == (depth + 1) * TINY_EXPERTS
    assert offloaded.layers == plain.layers - offloaded.host + offloaded.prefetch
    assert (offloaded.head, offloaded.transient, offloaded.recompute) == (plain.head, plain.transient, 0)
    # Tensors under min_offload_mb stay: every tiny tensor is under the default 1 MB.
    assert activation_bytes(load_profile("tiny", ["memory.experts=offload"])) == plain


def test_recomputed_classes_leave_their_largest_module_for_backward():
    plain = activation_bytes(load_profile("tiny", [*THREE_FULL_LAYERS]))
    recomputed = activation_bytes(load_profile("tiny", [*THREE_FULL_LAYERS, "memory.attention=recompute"]))
    # The three mixers' tensors are dropped (their input stays, saved for the recompute), one is rebuilt at a time.
    assert recomputed.recompute == TINY_FULL_MIXER
    assert recomputed.layers == plain.layers - 3 * TINY_FULL_MIXER + TINY_FULL_MIXER
    assert recomputed.host == 0


def test_gpu_budget_caps_what_stays_and_moves_the_lowest_layers_first():
    plain = activation_bytes(load_profile("tiny"))
    budget = plain.layers // 2
    job = load_profile("tiny", [MOVE_ALL, "memory.prefetch_layers=0", f"memory.gpu_budget_gb={budget / GB}"])
    capped = activation_bytes(job)
    kept = int(budget / GB * GB)
    assert capped.host == plain.layers - kept and capped.host_by_class == {"budget": capped.host}
    # Half the bytes stay: the top layers', whole; backward at the top holds them all and swaps in nothing.
    assert (capped.layers, capped.prefetch) == (kept, 0)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_max_context_keeps_only_the_prefetch_window_and_one_recompute(depth):
    plain = activation_bytes(load_profile("tiny", [*THREE_FULL_LAYERS]))
    job = load_profile("tiny", [*THREE_FULL_LAYERS, "memory.preset=max-context", MOVE_ALL,
                                f"memory.prefetch_layers={depth}"])  # fmt: skip
    acts = activation_bytes(job)
    # Budget 0: every saved tensor the policy keeps is in host memory; the mixers (attention) and the shared experts'
    # SwiGLU (activation: gate, up and their product, 3 T Fs) are recomputed instead.
    shared_swiglu = 3 * TINY_TOKENS * 64 * 4
    assert acts.host == plain.layers - 3 * (TINY_FULL_MIXER + shared_swiglu)
    assert acts.prefetch == min(depth + 1, 3) * acts.host // 3
    assert acts.layers == acts.prefetch + TINY_FULL_MIXER and acts.recompute == TINY_FULL_MIXER
    assert set(acts.host_by_class) == {"budget", "linear", "experts", "router"}


def test_plan_reports_the_host_pool_and_the_swaps():
    from moe_tune.engine.memory.store import HOST_CHUNK_BYTES
    from moe_tune.engine.plan import PINNED_D2H_BYTES_PER_S, PINNED_H2D_BYTES_PER_S

    job = load_profile("tiny", ["memory.preset=max-context", MOVE_ALL, "train.gradient_accumulation_steps=3"])
    plan = plan_layouts(job, 2, 80 * GB)
    host = plan.activations.host
    assert 0 < host < HOST_CHUNK_BYTES
    for lay in plan.layouts:
        # One pool of whole chunks for every micro-batch; each micro-batch copies its bytes out and back.
        assert (lay.host_memory, lay.swap_per_step) == (HOST_CHUNK_BYTES, 3 * host)
        assert (lay.swap_out_s, lay.swap_in_s) == (3 * host / PINNED_D2H_BYTES_PER_S, 3 * host / PINNED_H2D_BYTES_PER_S)
    assert PINNED_D2H_BYTES_PER_S == 55e9 and PINNED_H2D_BYTES_PER_S == 52e9
    plain = plan_layouts(load_profile("tiny"), 2, 80 * GB)
    assert {(lay.host_memory, lay.swap_per_step) for lay in plain.layouts} == {(0, 0)}


@pytest.mark.parametrize("bounds", [[0, 64, 128, 192, 256], [0, 256], [0, 100, 256]], ids=["at-chunks", "one", "across"])
def test_plan_host_bytes_are_what_engine_memory_moves_in_sequence_chunks(bounds):
    # max-context with every tensor movable, chunks of 64 on one 256-token row: the store's host bytes after a real
    # forward and backward are the plan's, but for the carried states the plan counts (one a linear slab: the store
    # keeps one per slab that continues a document) and what it leaves out (the slabs' conv halo rows, positions, [E]
    # counts), under 2 %. Documents that start at chunk bounds, one over the row, one across chunks: the sparse
    # layer's chunks take the row's input and keys whole, whatever span they see, so each is stored once a layer.
    import torch

    from moe_tune.engine.memory import find_activation_memory
    from moe_tune.engine.train.trainer import build_trainable_model

    job = load_profile("tiny", ["data.seq_len=256", "train.micro_batch_size=1", "parallel.zero_stage=0", MOVE_ALL,
                                "memory.preset=max-context", "memory.sequence_chunk_tokens=64"])  # fmt: skip
    continued = sum(start not in bounds for start in (64, 128, 192))
    planned = activation_bytes(job).host - 3 * (4 - continued) * (4 * 16 * 16 * 4)
    torch.manual_seed(0)
    model, _ = build_trainable_model(job)
    ids = torch.randint(0, job.model.vocab_size, (1, 256))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    model.train()(input_ids=ids, cu_seqlens=cu_seqlens, labels=ids).loss.backward()
    moved = find_activation_memory(model).step_metrics()["memory_host_saved_bytes"]
    assert planned <= moved < 1.02 * planned


# Every way tiny-vl's vision parts train: LoRA on (VISION_CHOICES), and in full fine-tuning, where a part set to lora
# trains in full.
VISION_TRAINING = [(tower, merger, True) for tower, merger in VISION_CHOICES] + [
    ("lora", "lora", False), ("frozen", "lora", False), ("trained", "frozen", False)]  # fmt: skip


@pytest.mark.parametrize("tower, merger, lora", VISION_TRAINING)
def test_vision_activations_are_what_the_tower_saves(tower, merger, lora):
    """The plan's vision term against the distinct storages the tiny-vl tower saves in a real forward (fp32, a
    micro-batch of 2 rows of 80 tokens, all image tokens: 640 patches in 3 images), the model built as the trainer
    builds it; its attention on SDPA's fused CPU kernel, which keeps what CUDA's flash kernel keeps (q, k, v, the
    output, the log-sum-exp per head). Equal to the byte."""
    import torch
    from vision_saved import image_grids, image_row, measure_saved_vision

    from moe_tune.engine.plan import vision_patches
    from moe_tune.engine.train.trainer import build_trainable_model

    job = load_profile("tiny-vl", [f"lora.vision_tower={tower}", f"lora.vision_merger={merger}",
                                   f"lora.enabled={str(lora).lower()}", "data.seq_len=80", "train.micro_batch_size=2"])
    assert vision_patches(job) == 640 and image_grids(160, 2).tolist() == [[1, 16, 16], [1, 16, 16], [1, 2, 64]]
    torch.manual_seed(0)
    model, _ = build_trainable_model(job)
    measured = measure_saved_vision(model, image_row(job)).total
    planned = activation_bytes(job).vision
    assert planned == measured
    assert (planned == 0) == (tower == merger == "frozen")


def test_vision_activations_follow_a_hand_count():
    # tiny-vl: T = 4 x 128 tokens, m 2: P = 2048 patches; Dv 32, I 64, 2 heads of hd 16, r 16, fp32. A lora block keeps
    # 11 Dv + 2 I + 4 r = 544 numbers and 4 + 2 fp32 a patch, block 0 Dv and 2 fp32 less; cos and sin 2 hd fp32; the
    # trained merger 4 Dv and 2 fp32.
    job = load_profile("tiny-vl")
    per_patch = 2 * (544 * 4 + 6 * 4) - (32 * 4 + 2 * 4) + 2 * 16 * 4 + 4 * 32 * 4 + 2 * 4
    acts = activation_bytes(job)
    assert acts.vision == 2048 * per_patch == 10_059_776
    text_only = activation_bytes(load_profile("tiny-vl", ["lora.vision_tower=frozen", "lora.vision_merger=frozen"]))
    assert text_only.vision == 0 and acts.total == text_only.total + acts.vision
    # Linear in the tokens of a micro-batch, and in the dtype's bytes but for the fp32 statistics and rotary tables.
    double = activation_bytes(load_profile("tiny-vl", ["train.micro_batch_size=8"]))
    assert double.vision == 2 * acts.vision
    bf16 = activation_bytes(load_profile("tiny-vl", ["train.precision=bf16"]))
    wide = 2 * 6 * 4 - 2 * 4 + 2 * 16 * 4 + 2 * 4
    assert bf16.vision == 2048 * ((per_patch - wide) // 2 + wide)
    assert plan_layouts(job, 2, 80 * GB).layouts[0].activations == acts.total
