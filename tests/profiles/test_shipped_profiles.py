"""Every shipped profile validates and starts with the command that runs it; bench-hybrid-1m, the million-token
benchmark, is the benchmark width with the seed's layer mix and plans on one device."""

import pytest
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.plan import plan_layouts
from moe_tune.profiles import load_profile, resolve_profile_path, shipped_profiles

runner = CliRunner()
GB = 10**9


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_validates_and_names_its_command(name):
    job = load_profile(name)
    assert job.name == name
    first = resolve_profile_path(name).read_text().splitlines()[0]
    assert first.startswith("# moe-tune ") and name in first, first


def test_bench_hybrid_1m_is_the_bench_width_with_the_seed_mix():
    job = load_profile("bench-hybrid-1m")
    model, seed = job.model, load_profile("seed-2p8t").model
    assert (model.vocab_size, model.hidden_size, len(model.layers)) == (32000, 2048, 8)
    # The seed's pattern: 3 gated delta net layers to 1 top-k sparse attention layer, every layer MoE.
    assert [layer.attention for layer in model.layers] == [layer.attention for layer in seed.layers[:8]]
    assert [layer.attention for layer in model.layers] == ["linear", "linear", "linear", "sparse"] * 2
    assert all(layer.mlp == "moe" for layer in model.layers)
    assert (model.moe.num_experts, model.moe.top_k, model.moe.expert_intermediate_size) == (64, 8, 768)
    assert model.moe.shared_expert_intermediate_size == 768
    assert model.linear_attention == load_profile("bench-qwen3-next").model.linear_attention
    spec = model.sparse_attention
    assert (spec.topk, spec.block_size) == (2048, 64)
    assert (job.lora.r, job.lora.alpha, job.lora.experts) == (16, 32, True)
    assert job.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (job.train.precision, job.train.micro_batch_size, job.data.seq_len) == ("bf16", 1, 32768)
    # At the profile's length a row is one chunk; the million-token row runs in 32.
    assert (job.memory.preset, job.memory.sequence_chunk_tokens, job.memory.gpu_budget_gb) == ("max-context", 32768, 40)
    assert "--set data.seq_len=1048576" in resolve_profile_path("bench-hybrid-1m").read_text().splitlines()[0]


@pytest.mark.parametrize("overrides", [[], ["--set", "data.seq_len=1048576"]], ids=["32k", "1m"])
def test_bench_hybrid_1m_plans_on_one_device(overrides):
    result = runner.invoke(app, ["plan", "bench-hybrid-1m", "--devices", "1", *overrides])
    assert result.exit_code == 0, result.output
    assert "2.83B parameters" in result.stdout and "1 x 1 *" in result.stdout
    # The memory policy's host tier: at 32768 tokens the offloaded classes' tensors, at 1M those past the budget too.
    assert "host memory " in result.stdout and "swap per step " in result.stdout


def test_bench_hybrid_1m_plans_within_the_million_token_targets_on_one_h200():
    # The targets for one 1,048,576-token row on one H200 (141 GB): under 130 GB on the GPU and 100 GB of
    # host memory, with the profile's memory settings as shipped (max-context, GPU budget 40 GB, chunks of 32768).
    plan = plan_layouts(load_profile("bench-hybrid-1m", ["data.seq_len=1048576"]), 1, 141 * GB)
    (layout,) = plan.layouts
    assert layout.fits and layout.total < 130 * GB
    assert 0 < layout.host_memory < 100 * GB
    # The budget keeps 40 GB of the layers' saved tensors on the GPU; the rest is swapped out and back once a step.
    assert layout.swap_per_step == plan.activations.host == plan.activations.host_by_class["budget"]
