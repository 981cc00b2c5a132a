"""`moe-tune profile PROFILE` with MFU, the breakdown, --against transformers, --json and --plot; one-line refusals."""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moe_tune.cli.profile import app
from moe_tune.engine.bench.steps import RESULT_KEYS

runner = CliRunner()

# A qwen3_next-like model transformers can build: a linear and a full layer, routed experts and a shared expert.
NEXT_LIKE = {
    "name": "next-like",
    "model": dict(
        vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        partial_rotary_factor=0.5, norm_one_plus=True, layers=[{"attention": "linear"}, {"attention": "full"}],
        linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8),
        moe=dict(num_experts=4, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=16),
    ),
    "data": {"seq_len": 32, "corpus_documents": 50},
    "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "experts": True},
    "train": {"steps": 8, "micro_batch_size": 2, "lr": 1.0e-3},
    "output": {"dir": "out"},
}  # fmt: skip
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_profile_against_transformers_reports_both_rows_the_breakdown_and_mfu(tmp_path):
    profile = tmp_path / "next-like.yaml"
    profile.write_text(yaml.safe_dump(dict(NEXT_LIKE, output={"dir": str(tmp_path / "out")})))
    out, png = tmp_path / "steps.json", tmp_path / "steps.png"
    result = runner.invoke(app, [str(profile), "--steps", "1", "--against", "transformers", "--json", str(out),
                                 "--plot", str(png)])  # fmt: skip
    assert result.exit_code == 0, result.output
    for text in ("MFU (of the measured GEMM peak", "per-operator breakdown of one more step", "linear attention",
                 "transformers warm-up 1", "moe-tune / transformers"):  # fmt: skip
        assert text in result.stdout, text
    data = json.loads(out.read_text())
    assert list(data) == list(RESULT_KEYS)
    assert data["warmup_steps"] == 2 and data["steps"] == 1
    assert data["mfu"] == pytest.approx(data["achieved_tflops"] / data["peak_tflops"])
    assert data["achieved_tflops"] == pytest.approx(data["model_flops_per_step"] / data["step_time_s"] * 1e-12)
    assert data["model_flops_per_step"] == pytest.approx(sum(data["model_flops_parts"].values()))
    shares = [row["share"] for row in data["breakdown"]["classes"]]
    assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0
    other = data["against"]
    assert other["model_type"] == "qwen3_next" and other["steps"] == 1
    assert other["speedup"] == pytest.approx(data["tokens_per_s"] / other["tokens_per_s"])
    assert other["parameters"] == data["parameters"]
    # The same micro-batches on both sides: the same labelled tokens per step.
    assert other["tokens_per_s"] * other["step_time_s"] == pytest.approx(data["tokens_per_s"] * data["step_time_s"])
    probe = other["one_document"]
    assert (f"the longest document of the first micro-batch alone ({probe['tokens']:,} tokens), before any step: loss "
            f"{probe['moe_tune_loss']:.4f} (moe-tune) / {probe['baseline_loss']:.4f} ({other['impl']})") in result.stdout
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert not (tmp_path / "out").exists()


def test_profile_says_when_the_zero_stage_costs_a_single_gpu_time(tmp_path, monkeypatch):
    # The note finetune prints for ZeRO-2 or -3 in one GPU process, from the same rule (ds_config.zero_stage_note);
    # the machine here has no GPU, so the rule is asked as if the process ran on one.
    from moe_tune.engine.train import ds_config

    asked = []
    rule = ds_config.zero_stage_note
    monkeypatch.setattr(ds_config, "zero_stage_note",
                        lambda job, world_size, device_type: asked.append((world_size, device_type))
                        or rule(job, world_size, "cuda"))  # fmt: skip
    profile = tmp_path / "next-like.yaml"
    profile.write_text(yaml.safe_dump(dict(NEXT_LIKE, output={"dir": str(tmp_path / "out")})))
    result = runner.invoke(app, [str(profile), "--steps", "1", "--set", "parallel.zero_stage=2"])
    assert result.exit_code == 0, result.output
    assert asked == [(1, "cpu")]
    note = next(line for line in result.stdout.splitlines() if line.startswith("note: "))
    assert note.startswith("note: parallel.zero_stage 2 on one GPU partitions the gradients over a single rank")
    assert note.endswith("on one GPU set parallel.zero_stage: 1")


@pytest.mark.parametrize(
    "args, message",
    [
        (["tiny", "--against", "transformers"],
         "error: model.layers[3].attention ('sparse'): --against transformers builds qwen3_moe (full attention) or "
         "qwen3_next (linear and full attention) models, which have no 'sparse' layers"),
        (["tiny", "--against", "torchtitan"],
         "error: --against ('torchtitan') must be one of: transformers, bf16-base"),
        (["--kernels", "--against", "transformers"], "error: --against (transformers) does not apply with --kernels"),
    ],
    ids=["model-transformers-cannot-build", "unknown-baseline", "kernels-mode"],
)  # fmt: skip
def test_bad_against_is_one_line_exit_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [message]


def test_a_baseline_kernel_that_cannot_train_here_is_one_line_exit_2(tmp_path, monkeypatch):
    """The refusal of check_kernels_train (tests/engine/bench/test_against_baseline.py) through the CLI: one line,
    exit 2, before our steps (nothing printed of them, no output folder)."""
    import inspect

    import transformers.models.qwen3_next.modeling_qwen3_next as modeling
    from test_against_baseline import refusing_chunk

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.bench import against

    monkeypatch.setattr(against, "baseline_device", lambda: torch.device("cpu"))
    profile = tmp_path / "next-like.yaml"
    profile.write_text(yaml.safe_dump(dict(NEXT_LIKE, output={"dir": str(tmp_path / "out")})))
    with pure_torch_paths(), monkeypatch.context() as patch:
        torch_chunk = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
        patch.setattr(modeling, "torch_chunk_gated_delta_rule", refusing_chunk(torch_chunk))
        result = runner.invoke(app, [str(profile), "--steps", "1", "--against", "transformers"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --against transformers: transformers' qwen3_next trains its linear-attention "
                           "layers with fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule, which fails a backward")
    assert "moe-tune warm-up" not in result.stdout and not (tmp_path / "out").exists()
