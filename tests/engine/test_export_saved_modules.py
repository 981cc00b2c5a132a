"""The commands that read a finished run, on runs whose modules_to_save PEFT's rule alone would nest (qwen4_exp's
`norm`, the hyper-connection mixer holding `norm.norm`): load_adapter gives the model the merged export gives in
transformers and the adapter export gives in transformers + PEFT (fp32, 1e-4), and `moe-tune generate` loads the
adapter of an FP8-base run. A part trained in full that a transformers adapter cannot carry (the vision tower's patch
embedding, stored reshaped) is refused by the adapter export in one line that names --merge, which exports it."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

import hf_tiny
from moe_tune.cli import app
from moe_tune.engine.align.compare import load_ours
from moe_tune.engine.export.sources import read_run
from moe_tune.engine.lora import load_adapter
from test_export_hub import ours_logits, trained_run, transformers_logits


@pytest.fixture(scope="module")
def norm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_norm")
    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen4_exp_text(), root / "checkpoint")
    return trained_run(root, None, {"target_modules": ["q_proj", "o_proj"], "modules_to_save": ["norm"]},
                       checkpoint=checkpoint)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_nested_matches_reload_and_export_with_equal_logits(norm_run, tmp_path, merge):
    cfg = read_run(norm_run).cfg
    expected = ours_logits(load_adapter(load_ours(cfg), norm_run / "adapter").eval())
    assert (expected - ours_logits(load_ours(cfg))).abs().max() > 1e-2
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(norm_run), "--out", str(out), *(["--merge"] if merge else [])])
    assert result.exit_code == 0, result.output
    checkpoint = cfg.checkpoint
    got, _ = transformers_logits(out, checkpoint) if merge else transformers_logits(checkpoint, checkpoint, out)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_generate_loads_the_adapter_of_an_fp8_base_run(norm_run, tmp_path):
    """An FP8-base run generates with its adapter unmerged (load_adapter). The tiny model has no layer wide enough
    for FP8, so its weights are those the run saved with the bf16 base."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(norm_run, run)
    profile = yaml.safe_load((run / "profile.yaml").read_text())
    profile["model"]["base_precision"] = "fp8"
    (run / "profile.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    result = CliRunner().invoke(app, ["generate", str(run), "--prompt", "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "FP8 base with its LoRA adapters beside it, unmerged" in result.output


def test_the_adapter_export_of_a_trained_patch_embedding_names_merge(tmp_path):
    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_5_moe(), tmp_path / "checkpoint")
    run = trained_run(tmp_path, None, {"target_modules": ["q_proj"], "vision_tower": "trained"}, checkpoint=checkpoint)
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "adapter")])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: adapter tensor vision.patch_embed.weight: trained in full but not one checkpoint tensor taken as is, "
        "so a transformers adapter has no module to carry it; `moe-tune export --merge` writes it into the model's "
        "weights"
    ]
    assert not (tmp_path / "adapter").exists()
    result = CliRunner().invoke(app, ["export", str(run), "--merge", "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
