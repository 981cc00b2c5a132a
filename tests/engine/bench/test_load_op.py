"""The streaming load benchmark (engine/bench/load_op.py, `moe-tune profile PROFILE --load-checkpoint DIR`) at a few
MB: the synthetic checkpoint is the hub's FP8 layout (shards, index, config, FP8 bytes with valid block scales), the
project's loader takes it as stored, and the result carries the load's numbers."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.bench.load_op import (
    INDEX_NAME,
    RESULT_KEYS,
    SCALE_SUFFIX,
    hub_fp8_layout,
    run_load_benchmark,
    write_synthetic_checkpoint,
)
from moe_tune.profiles import ProfileError, load_profile

runner = CliRunner()
# bench-qwen3-30b-a3b's architecture at widths that straddle 128 (D 256, F 130: partial blocks) in 2 layers.
SHRUNK = [
    "model.hidden_size=256", "model.vocab_size=500", "model.layers=[{attention: full}, {attention: full}]",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.moe.num_experts=4", "model.moe.top_k=2",
    "model.moe.expert_intermediate_size=130",
]  # fmt: skip
SHARD_BYTES = 400_000


@pytest.fixture(scope="module")
def job():
    return load_profile("bench-qwen3-30b-a3b", SHRUNK)


@pytest.fixture(scope="module")
def written(job, tmp_path_factory):
    folder = tmp_path_factory.mktemp("load") / "checkpoint"
    info = write_synthetic_checkpoint(job.model, folder, SHARD_BYTES)
    return folder, info


def _headers(folder):
    index = json.loads((folder / INDEX_NAME).read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for key in f.keys():
                tensors[key] = (shard, f.get_tensor(key))
    return index, tensors


def test_checkpoint_is_the_hub_fp8_layout(job, written):
    from moe_tune.engine.families.base import is_fp8_checkpoint
    from moe_tune.engine.families.checkpoint import CheckpointReader, fp8_tensor_problems

    folder, info = written
    index, tensors = _headers(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and is_fp8_checkpoint(config)
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    # Every key in the shard the index names, shards no larger than asked (no single tensor here is larger).
    assert {key: shard for key, (shard, _) in tensors.items()} == index["weight_map"]
    sizes = [(folder / name).stat().st_size for name in set(index["weight_map"].values())]
    assert info["num_shards"] == len(sizes) > 2 and max(sizes) <= SHARD_BYTES + 10_000
    assert sum(sizes) == info["checkpoint_bytes"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors.values())
    fp8 = {key for key, (_, t) in tensors.items() if t.dtype == torch.float8_e4m3fn}
    # Attention projections and every expert's gate, up and down in FP8; embeddings, head, norms and router bf16.
    assert {key.split(".", 3)[-1].rsplit(".", 1)[0].split(".", 1)[-1] for key in fp8} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "experts.0.gate_proj", "experts.1.gate_proj", "experts.2.gate_proj",
        "experts.3.gate_proj", "experts.0.up_proj", "experts.1.up_proj", "experts.2.up_proj", "experts.3.up_proj",
        "experts.0.down_proj", "experts.1.down_proj", "experts.2.down_proj", "experts.3.down_proj"}  # fmt: skip
    for key in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"):  # fmt: skip
        assert tensors[key][1].dtype == torch.bfloat16, key
    for key in fp8:
        weight, scale = tensors[key][1], tensors[key + SCALE_SUFFIX][1]
        # One fp32 scale per 128 x 128 block, positive and finite; no NaN encodings among the FP8 bytes.
        assert scale.dtype == torch.float32 and scale.shape == (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert not weight.float().isnan().any()
    assert len(fp8) == info["num_fp8_tensors"] and len(tensors) == info["num_tensors"]
    with CheckpointReader(folder) as reader:
        assert fp8_tensor_problems(reader, True) == []


def test_layout_matches_the_written_shapes(job, written):
    folder, _ = written
    _, layout = hub_fp8_layout(job.model)
    _, tensors = _headers(folder)
    assert {key: (tuple(t.shape), t.dtype) for key, (_, t) in tensors.items()} == layout


def test_loader_takes_the_stored_fp8_bits(written):
    from moe_tune.engine.families import load_checkpoint_weights, model_profile_from_checkpoint
    from moe_tune.engine.model.model import build_model

    folder, _ = written
    _, _, cfg = model_profile_from_checkpoint(folder)
    assert cfg.base_precision == "fp8"
    model = build_model(cfg)
    load_checkpoint_weights(model, cfg)
    _, tensors = _headers(folder)
    experts = model.layers[1].mlp.experts
    stored = [tensors[f"model.layers.1.mlp.experts.2.{name}.weight"][1] for name in ("gate_proj", "up_proj")]
    assert torch.equal(experts.w_gate_up[2], torch.cat(stored).view(torch.uint8))
    scales = [tensors[f"model.layers.1.mlp.experts.2.{name}.weight{SCALE_SUFFIX}"][1]
              for name in ("gate_proj", "up_proj")]
    assert torch.equal(experts.w_gate_up_scale_inv[2], torch.cat(scales).view(torch.int32))
    q = model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight, tensors["model.layers.0.self_attn.q_proj.weight"][1].view(torch.uint8))


def test_load_benchmark_reports_speed_and_host_memory(job, written):
    folder, info = written
    said = []
    result = run_load_benchmark(job, folder, SHARD_BYTES, on_line=said.append)
    assert tuple(result) == RESULT_KEYS
    # The folder already holds this model's checkpoint: loaded, not written again.
    assert said[0].endswith("holds the synthetic FP8 checkpoint of this model: loading it")
    assert result["write_s"] is None and result["write_gb_per_s"] is None
    assert result["checkpoint_bytes"] == info["checkpoint_bytes"] and result["num_shards"] == info["num_shards"]
    assert result["load_s"] > 0
    assert result["load_gb_per_s"] == pytest.approx(result["checkpoint_bytes"] / result["load_s"] / 1e9)
    assert result["peak_rss_bytes"] >= result["peak_rss_growth_bytes"] >= 0
    assert result["peak_rss_growth_over_max_shard"] == pytest.approx(
        result["peak_rss_growth_bytes"] / result["max_shard_bytes"])
    assert result["device"] == "cpu" and json.dumps(result)


def test_folder_holding_something_else_is_refused_before_writing(job, written, tmp_path):
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(ProfileError, match=r"--load-checkpoint \('.*stray'\) holds files but no model.safetensors"):
        run_load_benchmark(job, stray)
    assert [p.name for p in stray.iterdir()] == ["notes.txt"]
    other = load_profile("bench-qwen3-30b-a3b", SHRUNK + ["model.moe.num_experts=8"])
    with pytest.raises(ProfileError, match=r"holds the synthetic checkpoint of another model \(\w{16}, this"):
        run_load_benchmark(other, written[0])


def test_cli_writes_loads_and_prints_the_result(tmp_path):
    folder, out = tmp_path / "ck", tmp_path / "load.json"
    sets = [arg for item in SHRUNK for arg in ("--set", item)]
    result = runner.invoke(app, ["profile", "bench-qwen3-30b-a3b", *sets, "--load-checkpoint", str(folder),
                                 "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"writing the synthetic FP8 checkpoint of bench-qwen3-30b-a3b into {folder}" in result.stdout
    for row in ("checkpoint", "written", "load", "peak host memory in the load", "growth / largest shard"):
        assert row in result.stdout, row
    data = json.loads(out.read_text())
    assert tuple(data) == RESULT_KEYS and data["write_s"] > 0 and data["num_shards"] == 1


@pytest.mark.parametrize(
    "args, line",
    [
        (["--against", "transformers"], "error: --against (transformers) does not apply with --load-checkpoint"),
        (["--steps", "4"], "error: --steps (4) does not apply with --load-checkpoint"),
    ],
    ids=["against", "steps"],
)
def test_step_options_with_load_checkpoint_are_one_line_exit_2(tmp_path, args, line):
    result = runner.invoke(app, ["profile", "tiny", "--load-checkpoint", str(tmp_path / "ck"), *args])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "ck").exists()


def test_load_checkpoint_with_kernels_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["profile", "--kernels", "--load-checkpoint", str(tmp_path)])
    assert result.exit_code == 2
    line = f"error: --load-checkpoint ({tmp_path}) does not apply with --kernels"
    assert result.stderr.strip().splitlines() == [line]


def test_model_without_a_hub_layout_is_refused_before_writing(tmp_path):
    # tiny has sparse-attention layers: no transformers type expresses it, so there is no hub checkpoint to write.
    result = runner.invoke(app, ["profile", "tiny", "--load-checkpoint", str(tmp_path / "ck")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == ("error: model: no transformers type expresses it, so no hub checkpoint: model.layers[3]"
                        ".attention ('sparse'): qwen3_next has no 'sparse' attention layers")  # fmt: skip
    assert "writing" not in result.stdout and not (tmp_path / "ck").exists()


def _index_names_a_missing_shard(folder):
    index = json.loads((folder / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00099-of-00099.safetensors"
    (folder / INDEX_NAME).write_text(json.dumps(index))


def _truncated_shard(folder):
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])


def _rewritten_tensor(key, change):
    def damage(folder):
        from safetensors.torch import load_file, save_file

        index = json.loads((folder / INDEX_NAME).read_text())
        shard = folder / index["weight_map"][key]
        tensors = load_file(str(shard))
        tensors[key] = change(tensors[key])
        save_file(tensors, str(shard), metadata={"format": "pt"})

    return damage


def _shard_linked_outside(folder):
    shard = sorted(folder.glob("*.safetensors"))[0]
    outside = folder.parent / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)


def _config_of_another_model(folder):
    config = json.loads((folder / "config.json").read_text())
    config["num_experts"] = 8
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, says",
    [
        (_index_names_a_missing_shard,
         "/model.safetensors.index.json: weight_map['lm_head.weight'] ('model-00099-of-00099.safetensors') names a "
         "file that does not exist"),
        (_truncated_shard, ".safetensors: not a readable safetensors file"),
        (_shard_linked_outside, "leads outside the checkpoint folder"),
        (_rewritten_tensor("model.norm.weight", lambda t: t.float()),
         "1 tensor differs from this model's checkpoint (first: model.norm.weight is F32 [256] in model-"),
        (_rewritten_tensor("model.layers.0.mlp.gate.weight", lambda t: t[:3].clone()),
         "1 tensor differs from this model's checkpoint (first: model.layers.0.mlp.gate.weight is BF16 [3, 256] in "
         "model-"),
        (lambda folder: (folder / INDEX_NAME).write_text("{not json"), "model.safetensors.index.json is not JSON ("),
        (_config_of_another_model, "config.json describes another model ("),
        (lambda folder: (folder / "config.json").write_text("[1,"), "/config.json:1:4: not valid JSON"),
        (lambda folder: (folder / "config.json").unlink(), "/config.json: cannot read (No such file or directory)"),
    ],
    ids=["missing-shard", "truncated-shard", "shard-outside-the-folder", "wrong-dtype", "wrong-shape", "index-not-json",
         "config-of-another-model", "config-not-json", "no-config"],
)  # fmt: skip
def test_a_damaged_checkpoint_of_this_model_is_one_line_exit_2(written, tmp_path, damage, says):
    folder = tmp_path / "ck"
    shutil.copytree(written[0], folder)
    damage(folder)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    sets = [arg for item in SHRUNK for arg in ("--set", item)]
    result = runner.invoke(app, ["profile", "bench-qwen3-30b-a3b", *sets, "--load-checkpoint", str(folder)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --load-checkpoint ('{folder}'): ") and says in line, line
    assert "Traceback" not in result.output and "loading" not in result.stdout
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == files


@pytest.mark.parametrize("under", ["a-file", "new/folders"], ids=["parent-is-a-file", "write-fails-midway"])
def test_a_folder_that_cannot_be_written_is_one_line_exit_2_and_nothing_kept(monkeypatch, tmp_path, under):
    import errno

    from moe_tune.engine.bench import load_op

    (tmp_path / "a-file").write_text("mine")
    folder = tmp_path / under / "ck"
    if under == "new/folders":
        write_shard = load_op._write_shard

        def disk_full_after_the_shard(path, *args):
            write_shard(path, *args)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(load_op, "_write_shard", disk_full_after_the_shard)
    sets = [arg for item in SHRUNK for arg in ("--set", item)]
    result = runner.invoke(app, ["profile", "bench-qwen3-30b-a3b", *sets, "--load-checkpoint", str(folder)])
    assert result.exit_code == 2, result.output
    why = "Not a directory" if under == "a-file" else "No space left on device"
    assert result.stderr.strip().splitlines() == [
        f"error: --load-checkpoint ('{folder}'): cannot write the synthetic checkpoint ({why}); nothing of it was kept"
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


def test_a_json_folder_is_refused_before_the_checkpoint_is_written(tmp_path):
    sets = [arg for item in SHRUNK for arg in ("--set", item)]
    result = runner.invoke(app, ["profile", "bench-qwen3-30b-a3b", *sets, "--load-checkpoint", str(tmp_path / "ck"),
                                 "--json", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: --json ('{tmp_path}') is a folder: name a file to write"]
    assert not (tmp_path / "ck").exists()
