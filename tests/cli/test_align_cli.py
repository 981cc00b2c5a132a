"""`moe-tune align`: exit 0 within tolerance, 1 outside it, 2 on bad input; the JSON report; golden traces."""

import json

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_tune.cli import app

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v32, tiny_qwen3_moe

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path_factory.mktemp("align") / "qwen3_moe")


def test_aligned_checkpoint_exits_0_and_writes_json(checkpoint, tmp_path):
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "aligned: within tolerance" in result.stdout
    assert "reference: transformers' PyTorch paths\n" in result.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and report["pinned_routing"] and report["model_type"] == "qwen3_moe"
    assert report["selections"] == [] and report["pinned_selection"] is False
    assert [row["name"] for row in report["layers"]] == ["layer 0", "layer 1", "layer 2"]
    assert report["logits"]["max_abs"] <= 1e-4 and report["kl"] <= 1e-6


def test_outside_tolerance_exits_1(checkpoint):
    # fp32 against fp32 still differs by rounding (~1e-7): a zero tolerance must fail.
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--logits-atol", "0"])
    assert result.exit_code == 1
    assert "NOT aligned: logits max abs" in result.stdout


def test_batch_file(checkpoint, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"input_ids": [5, 17, 299, 3, 8]}) + "\n" + json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch), "--json",
                                 str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["documents"] == [5, 3]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "error: --reference DIR or --golden FILE is required"),
        (["--reference", "/nonexistent"], "error: --reference ('/nonexistent') must be a checkpoint directory"),
        (["--golden", "g.safetensors", "--pin-routing"], "error: --pin-routing compares with the reference"),
        (["--golden", "g.safetensors", "--kl", "-1"], "error: --kl (-1.0) must be >= 0"),
    ],
)
def test_bad_input_exits_2(args, message, tmp_path):
    result = runner.invoke(app, ["align", *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(message)
    assert "Traceback" not in result.output


def test_bad_batch_record_exits_2(checkpoint, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"input_ids": [5, 300]}) + "\n")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch)])
    assert result.exit_code == 2
    assert f"--batch {batch}:1: input_ids must be >= 2 ints in [0, 300) (got 300)" in result.stderr


def test_golden_records_then_checks_then_catches_a_change(tmp_path):
    golden = tmp_path / "tiny.golden.safetensors"
    first = runner.invoke(app, ["align", "--golden", str(golden)])
    assert first.exit_code == 0 and "recorded golden trace" in first.stdout
    again = runner.invoke(app, ["align", "--golden", str(golden)])
    assert again.exit_code == 0, again.output
    assert "max abs" in again.stdout
    # A different model (another init seed) against the recorded trace must fail.
    other_profile = tmp_path / "other.yaml"
    import yaml

    from moe_tune.profiles import load_profile

    raw = load_profile("tiny").model_dump(mode="json")
    raw["model"]["seed"] = 1
    other_profile.write_text(yaml.safe_dump(raw))
    changed = runner.invoke(app, ["align", "--golden", str(golden), "--profile", str(other_profile)])
    assert changed.exit_code == 1
    assert "NOT aligned" in changed.stdout
    # A trace whose logits were altered is caught too.
    tensors = load_file(str(golden))
    meta = {"moe_tune_golden": json.dumps({"model": "profile"})}
    tensors["logits"] = tensors["logits"] + 1e-3
    save_file(tensors, str(golden), metadata=meta)
    assert runner.invoke(app, ["align", "--golden", str(golden)]).exit_code == 1


def test_not_a_golden_trace_exits_2(tmp_path):
    bogus = tmp_path / "bogus.safetensors"
    bogus.write_bytes(b"not safetensors")
    result = runner.invoke(app, ["align", "--golden", str(bogus)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --golden {bogus}: not a golden trace")


def test_sparse_attention_selections_pinned_and_counted(tmp_path):
    # 3 indexer heads, 12 keys per query below the 23-token document: tied selections differ before pinning.
    checkpoint = save_tiny_checkpoint(tiny_deepseek_v32(index_n_heads=3, index_topk=12), tmp_path / "dsv32")
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "routing and sparse attention selections pinned to the reference's" in result.stdout
    report = json.loads(out.read_text())
    for row in report["selections"]:
        line = (f"layer {row['layer']} sparse attention: {row['differed']} of 46 query rows chose other keys than "
                "the reference before pinning")
        assert line in result.stdout
    assert sum(row["differed"] for row in report["selections"]) >= 1
