"""The transformers + PEFT baseline of `moe-tune profile --against transformers` (engine/bench/against.py): the
architecture it builds, its adapters, its first loss against ours from the same checkpoint, and its refusals."""

import importlib.util
import json
import random

import pytest
import torch

from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe, tiny_qwen3_next
from moe_tune.engine.bench.against import lora_targets, transformers_config
from moe_tune.engine.plan import count_parameters
from moe_tune.profiles import ProfileError, load_profile, validate_profile

# Rows of one document each (the byte tokenizer's <bos> and SEQ_LEN - 1 bytes): transformers attends over whole
# rows, we over documents, so only such rows give both the same attention.
SEQ_LEN = 24


def built_in_transformers(job, model_type):
    """The PEFT-wrapped transformers model of `job`, on the meta device (shapes only)."""
    import transformers

    from moe_tune.engine.bench.against import _with_lora
    from moe_tune.engine.families import family_for

    _, config = transformers_config(job.model)
    model_class = getattr(transformers, family_for({"model_type": model_type}).reference_class)
    with torch.device("meta"):
        return _with_lora(model_class(transformers.AutoConfig.for_model(model_type, **config)), job, model_type)


@pytest.mark.parametrize(
    "name, model_type, billions",
    [("bench-qwen3-next", "qwen3_next", 2.82), ("bench-qwen3-moe", "qwen3_moe", 2.63)],
)
def test_bench_profiles_build_the_anchor_models_in_transformers(name, model_type, billions):
    """The benchmark models (2.82B and 2.63B parameters) with the same trainable adapters in both."""
    from moe_tune.engine.bench.against import _parameter_counts

    job = load_profile(name)
    assert transformers_config(job.model)[0] == model_type
    ours = count_parameters(job.model, job.lora)
    base, trainable = _parameter_counts(built_in_transformers(job, model_type))
    assert round(ours.total / 1e9, 2) == billions
    assert base == ours.total
    # qwen3_next's fused in_proj_qkvz adapter (A [r, D], B [2K+2V, r]) has as many weights as our q, k and v
    # adapters here (3 [r, D] and [2K+V, r]): z is as wide as 2 * D.
    assert trainable == ours.trainable


def next_like(**lora):
    """A tiny qwen3_next-like profile (K != V, two value heads per key head)."""
    return validate_profile({
        "name": "next-like",
        "model": dict(
            vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            partial_rotary_factor=0.5, norm_one_plus=True,
            layers=[{"attention": "linear"}, {"attention": "full"}, {"attention": "linear", "mlp": "dense"}],
            intermediate_size=40,
            linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12),
            moe=dict(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16),
        ),
        "data": {"seq_len": 32},
        "lora": dict(r=4, alpha=8, **lora),
        "train": {"steps": 4, "micro_batch_size": 1, "lr": 1e-3},
        "output": {"dir": "out"},
    })  # fmt: skip


def test_linear_layers_adapters_go_to_the_fused_projections():
    from moe_tune.engine.bench.against import _parameter_counts

    job = next_like(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert_gate"])
    assert lora_targets(job, "qwen3_next")["target_modules"] == [
        "in_proj_qkvz", "k_proj", "o_proj", "out_proj", "q_proj", "shared_expert_gate", "v_proj"]  # fmt: skip
    ours = count_parameters(job.model, job.lora)
    base, trainable = _parameter_counts(built_in_transformers(job, "qwen3_next"))
    assert base == ours.total
    # Per linear layer (D 32, r 4, K 2x8, V 4x12): ours q, k, v: A 3 x 4*32, B 4*(16 + 16 + 48); theirs one
    # in_proj_qkvz: A 4*32, B 4*(16 + 16 + 48 + 48).
    ours_qkv, theirs_qkvz = 3 * 4 * 32 + 4 * (16 + 16 + 48), 4 * 32 + 4 * (16 + 16 + 48 + 48)
    assert trainable == ours.trainable + 2 * (theirs_qkvz - ours_qkv)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"partial_rotary_factor": 0.5, "norm_one_plus": False, "attention_output_gate": False,
          "moe": dict(num_experts=4, top_k=2, expert_intermediate_size=16)},
         "model.partial_rotary_factor (0.5): transformers' qwen3_moe builds 1.0; --against transformers cannot build "
         "this model"),
        ({"moe": dict(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16,
                      score_func="sigmoid")},
         "model.moe.score_func ('sigmoid'): transformers' qwen3_next builds 'softmax'; --against transformers cannot "
         "build this model"),
        ({"moe": dict(num_experts=4, top_k=2, expert_intermediate_size=16)},
         "model.moe.shared_expert_intermediate_size (0): transformers' qwen3_next always has a gated shared expert; "
         "--against transformers cannot build this model"),
    ],
    ids=["qwen3_moe-partial-rope", "sigmoid-router", "no-shared-expert"],
)  # fmt: skip
def test_models_transformers_cannot_express_are_refused_naming_the_field(change, message):
    raw = next_like(target_modules=["q_proj"]).model_dump(mode="json")
    raw["model"].update(change)
    if change.get("attention_output_gate") is False:
        raw["model"].update(layers=[{"attention": "full"}] * 2, linear_attention=None, intermediate_size=0)
    with pytest.raises(ProfileError) as err:
        transformers_config(validate_profile(raw).model)
    assert err.value.problems == [message]


def test_sparse_layers_router_targets_and_what_peft_refuses_are_refused():
    from moe_tune.engine.bench.against import check_buildable

    with pytest.raises(ProfileError, match=r"^model.layers\[3\].attention \('sparse'\): --against transformers "):
        transformers_config(load_profile("tiny").model)
    with pytest.raises(ProfileError, match=r"^lora.target_modules \('gate'\): transformers' qwen3_next has no linear"):
        lora_targets(next_like(target_modules=["gate"]), "qwen3_next")
    # PEFT would move these onto the routed experts (and skip the shared expert) without a word.
    with pytest.raises(ProfileError, match=r"^lora.target_modules \('up_proj'\): PEFT turns up_proj targets of "
                       r"transformers' qwen3_next into adapters on the routed experts"):
        check_buildable(next_like(target_modules=["q_proj", "up_proj"]))


def one_document_rows(path, count=12):
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh .") for _ in range(SEQ_LEN - 1))}) + "\n"
                            for _ in range(count)))  # fmt: skip
    return path


@pytest.mark.parametrize("make", [tiny_qwen3_next, tiny_qwen3_moe], ids=["qwen3_next", "qwen3_moe"])
def test_first_step_loss_equals_ours_from_the_same_checkpoint(tmp_path, monkeypatch, make):
    """Adapters start as a no-op on both sides, so the first step's loss is the checkpoint's on the same rows."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from moe_tune.engine.bench.steps import profile_steps
    from moe_tune.engine.families import resolve_job

    checkpoint = save_tiny_checkpoint(make(), tmp_path / "checkpoint")
    job = resolve_job(validate_profile({
        "name": "from-checkpoint",
        "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(one_document_rows(tmp_path / "rows.jsonl")), "tokenizer": "byte", "seq_len": SEQ_LEN},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "experts": True},
        "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-3},
        "output": {"dir": str(tmp_path / "out")},
    }))  # fmt: skip
    result = profile_steps(job, steps=1, warmup=1, against="transformers")
    other = result["against"]
    assert other["first_step_loss"] == pytest.approx(result["first_step_loss"], rel=1e-5)
    assert other["parameters"] == result["parameters"]
    assert other["speedup"] == pytest.approx(result["tokens_per_s"] / other["tokens_per_s"])
    assert other["lora"]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    # On a CPU flash-linear-attention's Triton kernels cannot run: transformers' PyTorch paths run, and say so.
    fla_in_use = make is tiny_qwen3_next and importlib.util.find_spec("fla") is not None
    assert ("flash-linear-attention importable, not used" in other["impl"]) is fla_in_use


def test_accumulated_micro_batches_weigh_their_tokens_alike_on_both_sides(tmp_path, monkeypatch):
    """Two micro-batches a step whose rows train unequal numbers of tokens: the step's loss is the mean over all its
    tokens on both sides (trainer.loss_denominator; the baseline weighs each micro-batch's mean by its tokens)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from moe_tune.engine.bench.steps import profile_steps
    from moe_tune.engine.families import resolve_job

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "checkpoint")
    # Chats of one length, one row each: a long question with a short answer trains few tokens, the other many.
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question},
                                                     {"role": "assistant", "content": answer}]}) + "\n"
                            for question, answer in [("abcdefgh ab", "ok"), ("hi", "abcdefg hab")] * 2))  # fmt: skip
    job = resolve_job(validate_profile({
        "name": "accumulation", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(rows), "tokenizer": "byte", "seq_len": 64},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"], "experts": True},
        "train": {"steps": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 2, "lr": 1e-3},
        "output": {"dir": str(tmp_path / "out")},
    }))  # fmt: skip
    result = profile_steps(job, steps=1, warmup=1, against="transformers")
    assert result["against"]["first_step_loss"] == pytest.approx(result["first_step_loss"], rel=1e-5)
