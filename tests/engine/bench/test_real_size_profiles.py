"""The real-size benchmark profiles (bench-qwen3-30b-a3b, bench-qwen3-next-80b-a3b): the published architectures,
what `moe-tune plan` says of them on one H200, and the transformers + PEFT baseline `--against transformers` builds
for them (its config at full size; the model itself at shrunk widths, on the CPU), including when it runs out of
memory."""

import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.bench.against import base_precision_note, transformers_config
from moe_tune.engine.plan import count_parameters, plan_layouts
from moe_tune.profiles import load_profile

GB = 10**9
H200 = 141 * GB
runner = CliRunner()
# The 80B shape cut to 12 layers: the --set the profile's header gives.
TWELVE_LAYERS = "model.layers=[&l {attention: linear}, *l, *l, &f {attention: full}, *l, *l, *l, *f, *l, *l, *l, *f]"
# Tiny widths and 2 layers of each profile's architecture: the baseline builds in a moment on the CPU.
SHRUNK = {
    "bench-qwen3-30b-a3b": [
        "model.hidden_size=64", "model.vocab_size=300", "model.layers=[{attention: full}, {attention: full}]",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16", "model.moe.num_experts=4",
        "model.moe.top_k=2", "model.moe.expert_intermediate_size=32", "data.seq_len=32",
    ],
    "bench-qwen3-next-80b-a3b": [
        "model.hidden_size=64", "model.vocab_size=300", "model.layers=[{attention: linear}, {attention: full}]",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
        # z (value heads x V) twice the width, as in the 80B: transformers' fused in_proj_qkvz adapter then has as
        # many weights as our q, k and v adapters.
        "model.linear_attention.num_key_heads=2", "model.linear_attention.num_value_heads=8",
        "model.linear_attention.key_head_dim=16", "model.linear_attention.value_head_dim=16",
        "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_intermediate_size=32",
        "model.moe.shared_expert_intermediate_size=32", "data.seq_len=32",
    ],
}  # fmt: skip


def test_qwen3_30b_a3b_profile_is_the_published_architecture():
    job = load_profile("bench-qwen3-30b-a3b")
    model = job.model
    assert (model.vocab_size, model.hidden_size, len(model.layers)) == (151936, 2048, 48)
    assert {(layer.attention, layer.mlp) for layer in model.layers} == {("full", "moe")}
    assert (model.num_attention_heads, model.num_key_value_heads, model.head_dim) == (32, 4, 128)
    assert (model.rope_theta, model.attention_qk_norm, model.attention_output_gate) == (1e6, True, False)
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.renormalize) == (128, 8, 768, True)
    assert moe.shared_expert_intermediate_size == 0 and model.base_precision == "bf16"
    assert (job.train.micro_batch_size, job.data.seq_len, job.train.precision) == (1, 8192, "bf16")
    assert (job.lora.r, job.lora.experts) == (16, True)
    assert job.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    counts = count_parameters(model, job.lora)
    assert round(counts.total / 1e9, 1) == 30.5 and round(counts.active_per_token / 1e9, 2) == 3.35


def test_qwen3_next_80b_a3b_profile_is_the_published_architecture():
    job = load_profile("bench-qwen3-next-80b-a3b")
    model = job.model
    assert (model.vocab_size, model.hidden_size, len(model.layers)) == (151936, 2048, 48)
    assert [layer.attention for layer in model.layers] == ["linear", "linear", "linear", "full"] * 12
    la = model.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel_size) == (
        16, 32, 128, 128, 4)
    assert (model.num_attention_heads, model.num_key_value_heads, model.head_dim) == (16, 2, 256)
    assert (model.partial_rotary_factor, model.rope_theta, model.norm_one_plus) == (0.25, 1e7, True)
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (512, 10, 512)
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (512, True)
    assert model.base_precision == "fp8" and job.lora.experts
    assert (job.train.micro_batch_size, job.data.seq_len) == (1, 4096)
    assert round(count_parameters(model, job.lora).total / 1e9, 1) == 79.7


def _best(name: str, *overrides: str):
    plan = plan_layouts(load_profile(name, list(overrides)), 1, H200)
    (layout,) = plan.layouts
    return plan, layout


def test_one_h200_holds_the_80b_with_an_fp8_base_not_a_bf16_one():
    fp8, fp8_layout = _best("bench-qwen3-next-80b-a3b")
    bf16, bf16_layout = _best("bench-qwen3-next-80b-a3b", "model.base_precision=bf16")
    assert fp8_layout.fits and 115 * GB < fp8_layout.total < 125 * GB
    assert 79 * GB < fp8.weight_bytes < 82 * GB
    assert not bf16_layout.fits and bf16.weight_bytes > 158 * GB
    # The 12-layer cut fits with either base, so the two can be trained side by side.
    _, cut = _best("bench-qwen3-next-80b-a3b", TWELVE_LAYERS, "model.base_precision=bf16")
    assert cut.fits and cut.total < 60 * GB


def test_one_h200_holds_the_30b_in_bf16():
    plan, layout = _best("bench-qwen3-30b-a3b")
    assert layout.fits and 130 * GB < layout.total < H200
    assert plan.weight_bytes == 2 * plan.parameters.total


def test_plan_says_when_no_layout_fits():
    result = runner.invoke(app, ["plan", "bench-qwen3-next-80b-a3b", "--devices", "1", "--set",
                                 "model.base_precision=bf16"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert ("bf16 weights 159 GB; LoRA: 2.23B trainable parameters (dense 15.9M, experts 2.21B), backbone "
            "frozen") in lines
    assert ("does not fit: no layout fits 1 device of 141 GB; the smallest (1 x 1) needs 201 GB per device, 159 GB of "
            "them bf16 base weights") in lines  # fmt: skip
    fits = runner.invoke(app, ["plan", "bench-qwen3-next-80b-a3b", "--devices", "1"])
    assert fits.exit_code == 0, fits.output
    assert ("fp8 base weights 80.4 GB: 79B parameters in FP8 e4m3 with 19.3 MB of 128x128 block scales, 679M in "
            "bf16") in fits.stdout.splitlines()  # fmt: skip
    assert "does not fit" not in fits.stdout


@pytest.mark.parametrize(
    "name, model_type, published",
    [
        ("bench-qwen3-30b-a3b", "qwen3_moe", dict(
            num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, mlp_only_layers=[])),
        ("bench-qwen3-next-80b-a3b", "qwen3_next", dict(
            num_hidden_layers=48, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, vocab_size=151936, norm_topk_prob=True,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})),
    ],
    ids=["qwen3_moe", "qwen3_next"],
)  # fmt: skip
def test_baseline_config_is_the_published_one(name, model_type, published):
    job = load_profile(name)
    built_type, config = transformers_config(job.model)
    assert built_type == model_type
    if "layer_types" in published:
        assert config["layer_types"] == published.pop("layer_types") * 12
    assert {key: config[key] for key in published} == published


@pytest.mark.parametrize("name", list(SHRUNK))
def test_shrunk_baseline_builds_on_the_cpu_with_our_parameters(name):
    from moe_tune.engine.bench.against import _parameter_counts, build_transformers_model, check_buildable

    job = load_profile(name, SHRUNK[name])
    model_type = check_buildable(job)
    model, built_type = build_transformers_model(job, torch.device("cpu"))
    assert built_type == model_type == transformers_config(job.model)[0]
    ours = count_parameters(job.model, job.lora)
    assert _parameter_counts(model) == (ours.total, ours.trainable)
    # transformers + PEFT cannot adapt FP8 weights: an FP8-base profile's baseline runs its base in bf16, and says so.
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert dtypes == {torch.bfloat16}
    note = base_precision_note(job)
    if job.model.base_precision == "fp8":
        assert note == ("note: model.base_precision fp8: the transformers baseline keeps its base weights in bf16 "
                        "(transformers + PEFT cannot put LoRA on FP8 weights)")  # fmt: skip
    else:
        assert note is None


def _fail_at_call(calls: int, real):
    count = {"n": 0}

    def launch(self, batches, behind=None):
        count["n"] += 1
        if count["n"] == calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, batches, behind)

    return launch


def _one_row_batch(seq_len: int):
    from moe_tune.engine.data.dataset import Document, PackedDataset

    ids = list(range(1, seq_len + 2))
    return PackedDataset([Document(ids[:-1], ids[1:])], seq_len, 0, seed=0).micro_batch(0, rows_per_rank=1)


@pytest.mark.parametrize("where", ["building the model", "warm-up step 2", "timed step 1"])
def test_baseline_out_of_memory_is_a_row_and_one_line(monkeypatch, where):
    """The 30B's bf16 baseline may not fit beside what transformers keeps, the 80B's never does: our run has been
    measured by then, so the baseline's row says where it ran out of memory instead of ending the command."""
    from moe_tune.cli.profile_steps import out_of_memory_line
    from moe_tune.engine.bench import against

    job = load_profile("bench-qwen3-30b-a3b", SHRUNK["bench-qwen3-30b-a3b"])
    if where == "building the model":
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 150.00 GiB")

        monkeypatch.setattr(against.TransformersRunner, "__init__", out_of_memory)
    else:
        calls = {"warm-up step 2": 2, "timed step 1": 3}[where]
        failing = _fail_at_call(calls, against.TransformersRunner.launch)
        monkeypatch.setattr(against.TransformersRunner, "launch", failing)
    row = against.run_transformers(job, [[_one_row_batch(job.data.seq_len)]] * 4, 2, torch.device("cpu"), 4)
    assert row["out_of_memory"] == where and row["model_type"] == "qwen3_moe"
    assert (row["steps"], row["losses"], row["tokens_per_s"], row["peak_memory_bytes"]) == (0, [], None, None)
    line = out_of_memory_line({"against": row, "machine": "NVIDIA H200"})
    assert line.startswith("against transformers ") and "\n" not in line
    assert line.endswith(f"(qwen3_moe): out of memory ({where}) on NVIDIA H200; no row to compare")


def test_other_errors_of_the_baseline_still_raise(monkeypatch):
    from moe_tune.engine.bench import against

    job = load_profile("bench-qwen3-30b-a3b", SHRUNK["bench-qwen3-30b-a3b"])
    monkeypatch.setattr(against.TransformersRunner, "launch", _raise_value)
    with pytest.raises(ValueError, match="not a memory error"):
        against.run_transformers(job, [[_one_row_batch(job.data.seq_len)]], 0, torch.device("cpu"), 1)


def _raise_value(self, batches, behind=None):
    raise ValueError("not a memory error")
