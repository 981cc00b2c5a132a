"""`moe-tune export`: a fine-tuned run written in the hub's layout loads in transformers with no missing or
unexpected keys and gives our fine-tuned model's logits (fp32, 1e-4); the adapter export on transformers + PEFT
gives the same; full fine-tunes too; shards respect --max-shard-size; bad input is refused before writing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_tiny
from moe_tune.engine.align.compare import load_ours
from moe_tune.engine.align.reference import pure_torch_paths
from moe_tune.engine.export.hub import INDEX_NAME, export_run, parse_size
from moe_tune.engine.export.sources import FinalState, read_run
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.lora import load_adapter
from moe_tune.profiles import ProfileError


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# The experts' adapters are on (lora.experts); dense MLP and shared-expert names (MLP) where a family has both.
FAMILIES = {
    "qwen3_moe": (hf_tiny.tiny_qwen3_moe, ATTENTION + MLP),
    "qwen3_next": (hf_tiny.tiny_qwen3_next, ATTENTION + ["z_proj", "b_proj", "a_proj"]),
    "qwen3_5_moe": (hf_tiny.tiny_qwen3_5_moe, ATTENTION + ["z_proj"]),
    "deepseek_v3": (hf_tiny.tiny_deepseek_v3, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                               *MLP]),
    "kimi_linear": (hf_tiny.tiny_kimi_linear, ATTENTION + ["f_a_proj", "kv_b_proj", "gate_proj", "down_proj"]),
    "qwen4_exp": (hf_tiny.tiny_qwen4_exp, ATTENTION),
    # Experts stored transposed with gate/up interleaved, biases, sinks: the recipes invert through transposes.
    "gpt_oss": (hf_tiny.tiny_gpt_oss, ATTENTION),
    "mixtral": (hf_tiny.tiny_mixtral, ATTENTION),
    "glm4_moe": (hf_tiny.tiny_glm4_moe, ATTENTION),
}


def job_for(root: Path, builder, lora: dict, checkpoint: Path | None = None):
    """The resolved profile of a 2-step run from `builder`'s tiny checkpoint (saved under root/checkpoint, with a
    tokenizer_config.json that export must copy), or from `checkpoint` when given."""
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    if checkpoint is None:
        checkpoint = hf_tiny.save_tiny_checkpoint(builder(), root / "checkpoint")
    (checkpoint / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: moe-tune packs and trains {i * 7}"}) + "\n"
                            for i in range(8)))
    raw = {
        "name": "export",
        "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 32},
        # A large learning rate so the adapters move far from their no-op start.
        "train": {"steps": 2, "micro_batch_size": 1, "lr": 0.05},
        "output": {"dir": str(root / "run"), "save_merged": lora.get("enabled", True)},
        "lora": lora,
    }
    return resolve_job(validate_profile(raw))


def finetune_run(root: Path, builder, lora: dict) -> Path:
    """A 2-step fine-tune of `builder`'s tiny checkpoint; its output.dir."""
    from moe_tune.engine.train.trainer import finetune

    finetune(job_for(root, builder, lora), show_progress=False)
    return root / "run"


def trained_run(root: Path, builder, lora: dict, checkpoint: Path | None = None) -> Path:
    """The output.dir of a finished run, written without training (the trainer costs ~10 s a family): the
    checkpoint's model with LoRA adapters whose B factors are random (linear and per-expert), saved as the trainer
    saves them, or every weight perturbed for full fine-tuning; profile.yaml and summary.json."""
    import yaml
    from safetensors.torch import save_file

    from moe_tune.engine.lora import inject_lora

    job = job_for(root, builder, lora, checkpoint)
    run = root / "run"
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text("{}\n")
    model = load_ours(job.model)
    gen = torch.Generator().manual_seed(1)
    if not job.lora.enabled:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(run / "model.safetensors"))
        return run
    peft_model = inject_lora(model, job.lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            elif "modules_to_save" in name:  # the vision merger, trained in full
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(str(run / "adapter"), safe_serialization=True)
    return run


@pytest.fixture(scope="module", params=list(FAMILIES))
def lora_run(request, tmp_path_factory):
    builder, targets = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    # One family through the trainer (its adapter files and output.save_merged), the others written directly.
    make = finetune_run if request.param == "qwen3_moe" else trained_run
    return make(root, builder, {"target_modules": targets})


IDS = torch.randint(0, 290, (1, 23), generator=torch.Generator().manual_seed(0))
# Logits of each run's merged export in transformers, computed once.
MERGED_LOGITS: dict[Path, torch.Tensor] = {}


def ours_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.tensor([0, IDS.shape[1]], dtype=torch.int32)).logits[0]


def transformers_logits(directory: Path, checkpoint: Path, adapter: Path | None = None) -> tuple[torch.Tensor, dict]:
    """Logits of `directory` loaded by transformers (the family's class, fp32, eager), with `adapter` on it."""
    import transformers

    family, _, _ = model_profile_from_checkpoint(checkpoint)
    with pure_torch_paths():
        model, info = getattr(transformers, family.reference_class).from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            local_files_only=True, output_loading_info=True, **family.reference_kwargs())
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            return model.eval()(input_ids=IDS).logits[0], info


def assert_loads_cleanly(info: dict) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_merged_export_loads_in_transformers_with_our_logits(lora_run):
    run = read_run(lora_run)
    out = export_run(lora_run, merge=True, out=None, max_shard_size="40KB")
    assert out == lora_run / "export-merged"
    checkpoint = run.cfg.checkpoint
    got, info = transformers_logits(out, checkpoint)
    MERGED_LOGITS[lora_run] = got
    assert_loads_cleanly(info)
    ours = load_adapter(load_ours(run.cfg), lora_run / "adapter").eval()
    expected = ours_logits(ours)
    base = ours_logits(load_ours(run.cfg))
    assert (expected - base).abs().max() > 1e-2  # the adapters moved the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # The base's loader files came along; the weights are the base's keys, dtypes and shapes, in several shards.
    assert (out / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    assert_shards_match_base(out, checkpoint, parse_size("40KB"))
    if (lora_run / "merged").exists():
        # finetune's output.save_merged wrote the same model (in one 5GB shard).
        assert_same_tensors(lora_run / "merged", out)


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(path)).items()}


def assert_same_tensors(one: Path, other: Path) -> None:
    a, b = tensors_of(one), tensors_of(other)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def assert_shards_match_base(out: Path, checkpoint: Path, limit: int) -> None:
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("*.safetensors"))
    base = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            base.update({k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()})
    held, total = {}, 0
    for name in files:
        size = 0
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                held[key] = (view.get_shape(), view.get_dtype())
                assert index["weight_map"][key] == name
                size += f.get_tensor(key).nbytes
            alone = len(f.keys()) == 1
        total += size
        assert size <= limit or alone  # a tensor above the limit alone in its shard
    assert held == base
    assert index["metadata"]["total_size"] == total


def test_adapter_export_on_transformers_equals_the_merged_export(lora_run):
    """Without --merge: the PEFT adapter on the checkpoint's module names, on the base checkpoint in transformers +
    PEFT, gives the merged export's logits."""
    checkpoint = read_run(lora_run).cfg.checkpoint
    adapter = export_run(lora_run, merge=False, out=lora_run.parent / "adapter-export")
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= {
        p.name for p in adapter.iterdir()}
    assert not (adapter / "config.json").exists()
    if lora_run not in MERGED_LOGITS:
        MERGED_LOGITS[lora_run] = transformers_logits(export_run(lora_run, merge=True, out=None), checkpoint)[0]
    expected = MERGED_LOGITS[lora_run]
    got, info = transformers_logits(checkpoint, checkpoint, adapter)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_merge_equals_peft_merge_and_unload(lora_run):
    """Our per-tensor merge (W + alpha / r * B A, per linear and per expert) is PEFT's merge_and_unload."""
    run = read_run(lora_run)
    peft_model = load_adapter(load_ours(run.cfg), lora_run / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    with FinalState(run, merged=True) as source:
        assert sorted(source.names()) == sorted(expected)
        changed = 0
        for name in source.names():
            got = source.read(name)
            torch.testing.assert_close(got, expected[name], rtol=0, atol=1e-6, msg=name)
            changed += not torch.equal(got, source.base(name))
    assert changed > 0


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("full"), hf_tiny.tiny_qwen3_next, {"enabled": False})


def test_full_finetune_export_loads_with_our_logits(full_run):
    from safetensors.torch import load_file

    run = read_run(full_run)
    out = export_run(full_run, merge=False, out=None, max_shard_size="100KB")
    assert out == full_run / "export"
    got, info = transformers_logits(out, run.cfg.checkpoint)
    assert_loads_cleanly(info)
    ours = load_ours(run.cfg)
    # model.safetensors holds every parameter; the buffers (selection biases) stay the checkpoint's.
    missing, unexpected = ours.load_state_dict(load_file(str(full_run / "model.safetensors")), strict=False)
    assert not unexpected and all(name.endswith("selection_bias") for name in missing)
    expected = ours_logits(ours)
    assert (expected - ours_logits(load_ours(run.cfg))).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert_shards_match_base(out, run.cfg.checkpoint, parse_size("100KB"))


@pytest.mark.parametrize("text, size", [("500MB", 500 * 10**6), ("5GB", 5 * 10**9), ("2GiB", 2 * 2**30),
                                        ("1000", 1000), ("1.5kb", 1500), (" 7 MB ", 7 * 10**6)])
def test_shard_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "0MB", "-5GB", "5XB", "GB", "5 G B", "1e9", "0.1B"])
def test_bad_shard_sizes_are_refused(text):
    with pytest.raises(ProfileError, match=r"--max-shard-size \(.*\) must be a positive size such as 500MB or 5GB"):
        parse_size(text)


def test_bad_input_is_refused_before_writing(full_run, tmp_path):
    def refused(match, *args, **kwargs):
        with pytest.raises(ProfileError, match=match):
            export_run(*args, **kwargs)

    refused(r"no such folder", tmp_path / "nothing", True, None)
    refused(r"no run here \(no profile.yaml", tmp_path, True, None)
    (full_run / "checkpoints" / "x").mkdir(parents=True, exist_ok=True)
    refused(r"lies inside the run's checkpoints folder", full_run, False, full_run / "checkpoints" / "x" / "out")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    refused(r"exists and is not empty", full_run, False, busy)
    assert (busy / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("mine")
    refused(r"exists and is not a folder", full_run, False, tmp_path / "file")
    refused(r"--step \(0\) must be >= 1", full_run, False, tmp_path / "o", step=0)
    # All independent problems at once.
    with pytest.raises(ProfileError) as err:
        export_run(full_run, False, busy, max_shard_size="huge")
    assert len(err.value.problems) == 2
    # A run that has not written its final state.
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "profile.yaml").write_text((full_run / "profile.yaml").read_text())
    refused(r"the run has not finished \(no summary.json or no model.safetensors\)", unfinished, False, None)
    shutil.copyfile(full_run / "model.safetensors", unfinished / "model.safetensors")
    (unfinished / "summary.json").write_text(json.dumps({"last_step": 1}))
    refused(r"the run stopped at step 1 of its 2 steps; export that state with --step 1", unfinished, False, None)
    # A train.epochs run: its step count is summary.json's total_steps, not train.steps.
    (unfinished / "summary.json").write_text(json.dumps({"last_step": 2, "total_steps": 3}))
    refused(r"the run stopped at step 2 of its 3 steps; export that state with --step 2", unfinished, False, None)
    (unfinished / "summary.json").write_text(json.dumps({"last_step": 1}))
    (unfinished / ".lock").write_text("{}")
    refused(r"a run holds this folder \(.lock\); export it once the run has ended", unfinished, False, None)
    # The lock is looked at before the profile is read: a run holding the folder may be rewriting it.
    (unfinished / "profile.yaml").write_text("train: {lr: -1}\n")
    refused(r"a run holds this folder \(.lock\); export it once the run has ended", unfinished, False, None)
    (unfinished / ".lock").unlink()
    refused(r"profile.yaml: ", unfinished, False, None)
    assert sorted(p.name for p in unfinished.iterdir()) == ["model.safetensors", "profile.yaml", "summary.json"]
    assert not (unfinished / "export").exists() and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A qwen3_moe checkpoint stored in bf16, with an extra key no recipe reads (an MTP head's, as DeepSeek's)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("bf16") / "checkpoint"
    model = hf_tiny.tiny_qwen3_moe()
    hf_tiny.perturb_(model)
    model.to(torch.bfloat16).save_pretrained(str(directory))
    (path,) = directory.glob("*.safetensors")
    tensors = load_file(str(path))
    tensors["mtp.0.proj.weight"] = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


def test_keys_keep_the_checkpoint_dtype_and_unread_keys_are_copied(bf16_checkpoint, tmp_path):
    from moe_tune.engine.export.hub import export_hub
    from moe_tune.engine.export.sources import DictSource
    from moe_tune.engine.families.base import UnsupportedModel

    _, _, cfg = model_profile_from_checkpoint(bf16_checkpoint)
    with pytest.raises(UnsupportedModel, match="module not mapped: mtp"):
        load_ours(cfg)  # the extra key is not ours to load
    from moe_tune.engine.families import load_checkpoint_weights
    from moe_tune.engine.model.model import build_model

    ours = build_model(cfg)
    load_checkpoint_weights(ours, cfg, check_unread=False)
    state = {name: t.float() * 1.5 for name, t in ours.state_dict().items()}
    out = export_hub(DictSource(state), cfg, tmp_path / "out", 10**9)
    written, base = tensors_of(out), tensors_of(bf16_checkpoint)
    assert written.keys() == base.keys()
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert torch.equal(written["mtp.0.proj.weight"], base["mtp.0.proj.weight"])
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    if key in base:  # per-expert keys: expert 3's up rows of our w_gate_up
        torch.testing.assert_close(written[key], (state["layers.1.mlp.experts.w_gate_up"][3, 16:]).bfloat16())
    torch.testing.assert_close(written["model.norm.weight"], base["model.norm.weight"] * 1.5, rtol=1e-2, atol=0)


def test_a_trained_tensor_the_checkpoint_has_no_key_for_is_refused(bf16_checkpoint, tmp_path):
    """A routing bias updated in training (qwen3_moe checkpoints have no tensor for it) would be silently dropped:
    refused by name, nothing written."""
    from moe_tune.engine.export.hub import export_hub
    from moe_tune.engine.export.sources import DictSource, meta_model

    _, _, cfg = model_profile_from_checkpoint(bf16_checkpoint)
    state = {name: torch.zeros(t.shape) for name, t in meta_model(cfg).state_dict().items()}
    state["layers.2.mlp.selection_bias"] = torch.full_like(state["layers.2.mlp.selection_bias"], 0.25)
    with pytest.raises(ProfileError, match=r"^layers\.2\.mlp\.selection_bias: trained \(non-zero\), but qwen3_moe "
                       r"checkpoints have no tensor for it"):
        export_hub(DictSource(state), cfg, tmp_path / "out", 10**9)
    assert not (tmp_path / "out").exists() and not any(tmp_path.glob(".out*"))


def test_only_regular_files_inside_the_checkpoint_are_copied(tmp_path):
    from moe_tune.engine.export.hub import copy_loader_files

    base, dest = tmp_path / "base", tmp_path / "dest"
    base.mkdir()
    dest.mkdir()
    (tmp_path / "secret").write_text("outside")
    (base / "tokenizer.json").symlink_to(tmp_path / "secret")  # leads outside the checkpoint
    (base / "chat_template.jinja").mkdir()  # not a regular file
    (base / "vocab.json").symlink_to(base / "missing")  # dangling
    (base / "tokenizer_config.json").write_text("{}")
    (base / "merges.txt").symlink_to(base / "tokenizer_config.json")  # a link inside the folder
    (base / "notes.txt").write_text("not a loader file")
    assert copy_loader_files(base, dest) == ["tokenizer_config.json", "merges.txt"]
    assert sorted(p.name for p in dest.iterdir()) == ["merges.txt", "tokenizer_config.json"]
    assert not (dest / "merges.txt").is_symlink()


def test_fused_expert_layout_round_trips(tmp_path):
    """A checkpoint storing each layer's experts fused (gate_up_proj [E, 2F, D], down_proj [E, D, F], as the
    published Qwen3.5 MoE checkpoints do) is written back fused, each expert's rows where the loader reads them:
    the exported folder loads back as exactly our state."""
    import re

    from safetensors.torch import load_file, save_file

    from moe_tune.engine.export.hub import export_hub
    from moe_tune.engine.export.sources import DictSource
    from moe_tune.engine.families import load_checkpoint_weights
    from moe_tune.engine.model.model import build_model

    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_5_moe_text(), tmp_path / "checkpoint")
    tensors = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
        path.unlink()
    (checkpoint / INDEX_NAME).unlink(missing_ok=True)
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in [k for k in tensors if per_expert.match(k)]:
        prefix, e, proj = per_expert.match(key).groups()
        experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = tensors.pop(key)
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]])
                                                         for e in order])
        tensors[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    assert experts
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    gen = torch.Generator().manual_seed(3)
    state = {name: t + torch.randn(t.shape, generator=gen) for name, t in load_ours(cfg).state_dict().items()}
    state = {name: (t if not name.endswith("selection_bias") else torch.zeros_like(t)) for name, t in state.items()}
    out = export_hub(DictSource(state), cfg, tmp_path / "out", 10**9)
    assert tensors_of(out).keys() == tensors.keys()
    back = build_model(cfg.model_copy(update={"checkpoint": out}))
    load_checkpoint_weights(back, cfg.model_copy(update={"checkpoint": out}))
    for name, value in back.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_mxfp4_base_exports_dequantized_experts(tmp_path):
    """A gpt_oss run from an MXFP4 checkpoint (experts dequantized at load, trained so) exports its experts
    unquantized, [E, in, out] in the checkpoint's float dtype, and drops quantization_config: transformers loads it
    with no missing or unexpected keys and gives our logits."""
    plain = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_gpt_oss(intermediate_size=32, num_hidden_layers=2,
                                                              layer_types=["sliding_attention", "full_attention"]),
                                         tmp_path / "plain")
    base = hf_tiny.mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    (base / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    lora_run = trained_run(tmp_path, None, {"target_modules": ATTENTION, "experts": True}, checkpoint=base)
    cfg = read_run(lora_run).cfg
    out = export_run(lora_run, merge=True, out=None)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config == {k: v for k, v in json.loads((base / "config.json").read_text()).items()
                      if k != "quantization_config"}
    stored = tensors_of(out)
    assert not [k for k in stored if k.endswith(("_blocks", "_scales"))]
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert stored[key].dtype == stored[key + "_bias"].dtype == torch.float32
    got, info = transformers_logits(out, base)
    assert_loads_cleanly(info)
    ours = load_adapter(load_ours(cfg), lora_run / "adapter").eval()
    expected = ours_logits(ours)
    assert (expected - ours_logits(load_ours(cfg))).abs().max() > 1e-2  # the expert adapters moved the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_final_state_export_reads_one_expert_at_a_time(tmp_path, monkeypatch):
    """The writer asks the final state for each routed expert alone (read_expert), never for a layer's [E, ...]:
    host memory holds one shard and a few experts, whatever the expert count."""
    lora_run = trained_run(tmp_path, hf_tiny.tiny_qwen3_moe, {"target_modules": ATTENTION})
    whole, alone = [], []
    original_read, original_expert = FinalState.read, FinalState.read_expert
    monkeypatch.setattr(FinalState, "read", lambda self, name: whole.append(name) or original_read(self, name))
    monkeypatch.setattr(FinalState, "read_expert",
                        lambda self, name, e: alone.append((name, e)) or original_expert(self, name, e))
    out = export_run(lora_run, merge=True, out=None, max_shard_size="40KB")
    assert whole and not [n for n in whole if ".experts." in n]
    assert {e for name, e in alone if name.endswith("layers.1.mlp.experts.w_gate_up")} == set(range(7))
    got, info = transformers_logits(out, read_run(lora_run).cfg.checkpoint)
    assert_loads_cleanly(info)
    expected = ours_logits(load_adapter(load_ours(read_run(lora_run).cfg), lora_run / "adapter").eval())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


# A profile-built DeepSeek-V3-like model whose routing biases train (aux-loss-free balancing); export writes it as
# deepseek_v3, whose e_score_correction_bias holds them.
DEEPSEEK_LIKE = {
    "vocab_size": 300, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 20,
    "intermediate_size": 64, "layers": [{"attention": "mla", "mlp": "dense"}, {"attention": "mla"}],
    "rope_theta": 5000.0, "rms_norm_eps": 1e-5, "attention_output_gate": False,
    "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10},
    "moe": {"num_experts": 9, "top_k": 3, "expert_intermediate_size": 16, "score_func": "sigmoid",
            "routed_scaling": 2.5, "shared_expert_intermediate_size": 32, "shared_expert_gate": False, "n_group": 3,
            "topk_group": 2, "bias_update_rate": 0.05},
}  # fmt: skip


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_routing_biases_the_run_trained_are_exported_and_generated_with(tmp_path, lora):
    """model.moe.bias_update_rate trains the selection biases (buffers): a LoRA run keeps them beside its adapter, a
    full fine-tune in model.safetensors; `export --merge` (and generate's model) hold the trained values, equal to
    what the run held in memory (its merged/ folder, and the last checkpoint's trainer state); an unmerged adapter
    export, which cannot hold them, is refused in one line."""
    from safetensors.torch import load_file

    from moe_tune.engine.export.sources import ROUTING_BIASES_IN_NO_ADAPTER, meta_model

    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import validate_profile

    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"document {i}: routed {i * 7}"}) + "\n"
                                                 for i in range(8)))
    finetune(resolve_job(validate_profile({
        "name": "biases", "model": DEEPSEEK_LIKE, "data": {"path": str(tmp_path / "data.jsonl"), "seq_len": 32},
        "lora": {"target_modules": ["q_b_proj", "o_proj"], "experts": True} if lora else {"enabled": False},
        "train": {"steps": 3, "micro_batch_size": 2, "lr": 0.02, "warmup_steps": 0},
        "output": {"dir": str(tmp_path / "run"), "save_merged": lora},
    })), show_progress=False)
    run = tmp_path / "run"
    # The last checkpoint's trainer state: the biases of the MoE blocks in order, as the run held them.
    state = json.loads(max((run / "checkpoints").glob("step-*")).joinpath("trainer_state.json").read_text())
    names = [n for n, _ in meta_model(read_run(run).cfg).named_buffers() if n.endswith(".selection_bias")]
    trained = {name: torch.tensor(bias) for name, bias in zip(names, state["selection_bias"], strict=True)}
    assert trained and all(bias.abs().max() > 0 for bias in trained.values())
    with FinalState(read_run(run), merged=True) as source:
        for name, bias in trained.items():
            torch.testing.assert_close(source.read(name), bias.to(source.read(name).dtype), rtol=0, atol=0)
    out = export_run(run, merge=True, out=tmp_path / "hub", max_shard_size="5GB")
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    biases = {k: v for k, v in exported.items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == len(trained) and all(v.abs().max() > 0 for v in biases.values())
    if lora:
        merged = {k: v for f in (run / "merged").glob("*.safetensors") for k, v in load_file(str(f)).items()}
        assert merged.keys() == exported.keys()
        for key, tensor in merged.items():
            torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0)
        with pytest.raises(ProfileError) as refusal:
            export_run(run, merge=False, out=tmp_path / "adapter", max_shard_size="5GB")
        assert refusal.value.problems[0] == ROUTING_BIASES_IN_NO_ADAPTER
    # The biases damaged (a NaN, a layer's left out) or gone: refused, not routed with the base's.
    from safetensors.torch import save_file

    from moe_tune.engine.export.sources import SELECTION_BIASES_FILE

    path = run / (SELECTION_BIASES_FILE if lora else "model.safetensors")
    kept, first = load_file(str(path)), names[0]
    damages = [({k: v for k, v in kept.items() if k != first}, f"no tensor {first}")]
    if lora:
        damages.append(({**kept, first: kept[first] * float("nan")}, f"tensor {first} holds non-finite values (NaN or inf)"))
    for damaged, line in damages:
        save_file(damaged, str(path))
        with pytest.raises(ProfileError) as refusal:
            export_run(run, merge=True, out=tmp_path / "damaged", max_shard_size="5GB")
        assert refusal.value.problems == [f"{path}: {line}"]
    if lora:
        path.unlink()
        with pytest.raises(ProfileError) as refusal:
            export_run(run, merge=True, out=tmp_path / "damaged", max_shard_size="5GB")
        assert refusal.value.problems[0].startswith(f"{path}: missing; the run trains its routing biases")


def test_generate_on_an_fp8_base_lora_run_routes_with_the_trained_biases(tmp_path):
    """An FP8-base LoRA run loads for generate with its adapter unmerged (not through FinalState): the routing biases
    the run trained are its too."""
    from moe_tune.engine.generate.session import load_model, resolve_target
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import load_profile

    out = tmp_path / "run"
    finetune(load_profile("tiny", [
        "model.hidden_size=128", "model.layers=[{attention: full, mlp: moe}]", "model.head_dim=32",
        "model.partial_rotary_factor=1.0", "model.attention_output_gate=false", "model.moe.num_experts=4",
        "model.moe.expert_intermediate_size=128", "model.moe.shared_expert_intermediate_size=0",
        "model.moe.bias_update_rate=0.05", "model.base_precision=fp8", "train.steps=2", "train.lr=0.02",
        "train.warmup_steps=0", "train.micro_batch_size=1", "data.seq_len=64", "data.corpus_documents=20",
        "lora.modules_to_save=[]", "lora.target_modules=[q_proj, o_proj]", "output.save_every=2", f"output.dir={out}",
    ]), show_progress=False)  # fmt: skip
    state = json.loads((out / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
    model = load_model(resolve_target(str(out)), torch.device("cpu"))
    biases = [buffer for name, buffer in model.named_buffers() if name.endswith(".selection_bias")]
    assert len(biases) == len(state["selection_bias"]) == 1
    assert biases[0].abs().max() > 0
    torch.testing.assert_close(biases[0], torch.tensor(state["selection_bias"][0]), rtol=0, atol=0)


def test_a_merge_into_base_weights_other_than_the_trained_ones_is_refused(tmp_path):
    """The run keeps a fingerprint of the checkpoint's weight files (summary.json, each checkpoint's state): a merge
    of the final adapter into a base changed since (another revision, an export written again) is refused in one
    line, where it wrote a model the run never trained; the adapter alone, and a checkpoint of the run (which holds
    the weights it trained on), still export. --resume says so and carries the trained-on fingerprint."""
    from moe_tune.engine.families.checkpoint import CheckpointReader
    from moe_tune.engine.train.checkpoint import STATE_FILE
    from moe_tune.engine.train.trainer import base_fingerprint, finetune

    builder, targets = FAMILIES["qwen3_moe"]
    run = finetune_run(tmp_path, builder, {"target_modules": targets})
    checkpoint = tmp_path / "checkpoint"
    trained_on = base_fingerprint(checkpoint)
    with CheckpointReader(checkpoint) as reader:
        assert set(trained_on["files"]) == set(reader._paths)
    assert json.loads((run / "summary.json").read_text())["base_checkpoint"] == trained_on
    state = json.loads((run / "checkpoints" / "step-0000002" / STATE_FILE).read_text())
    assert state["base"] == trained_on
    before = export_run(run, merge=True, out=tmp_path / "before")

    weights = sorted(checkpoint.glob("*.safetensors"))[-1]
    original = weights.read_bytes()
    changed = bytearray(original)
    changed[-3] ^= 0x01  # one bit of the last tensor: its data's end is always read
    weights.write_bytes(bytes(changed))
    line = (f"model.checkpoint ({checkpoint}) has changed since the run trained on it ({weights.name}: other contents): "
            "the adapter merged into these weights is not the model the run trained; put back the weights it trained "
            "on, or export a checkpoint of the run with --step N (it holds them)")
    with pytest.raises(ProfileError) as err:
        export_run(run, merge=True, out=tmp_path / "after")
    assert err.value.problems == [line] and not (tmp_path / "after").exists()
    with pytest.raises(ProfileError) as err:
        FinalState(read_run(run), merged=True)
    assert err.value.problems == [line]
    export_run(run, merge=False, out=tmp_path / "adapter")
    from_step = export_run(run, merge=True, out=tmp_path / "step", step=2)
    assert_same_tensors(from_step, before)

    job = job_for(tmp_path, builder, {"target_modules": targets}, checkpoint)
    result = finetune(job.model_copy(update={"train": job.train.model_copy(update={"steps": 3})}), resume=True,
                      show_progress=False)  # fmt: skip
    assert any(note.startswith(f"note: model.checkpoint ({checkpoint}) has changed since ") and
               f"({weights.name}: other contents)" in note for note in result.resume_notes), result.resume_notes
    assert json.loads((run / "summary.json").read_text())["base_checkpoint"] == trained_on
    weights.write_bytes(original)
    export_run(run, merge=True, out=tmp_path / "restored")


A = {"bytes": 10, "sha256": "z"}


@pytest.mark.parametrize("now, expected", [
    ({"a.safetensors": A}, []),
    ({"a.safetensors": {"bytes": 10, "sha256": "x"}}, ["a.safetensors: other contents"]),
    ({"a.safetensors": {"bytes": 11, "sha256": "x"}, "b.safetensors": A},
     ["b.safetensors: new", "a.safetensors: 10 bytes then, 11 now"]),
    ({"b.safetensors": A}, ["a.safetensors: no longer there", "b.safetensors: new"]),
], ids=["same", "other-contents", "other-size-and-new", "gone"])  # fmt: skip
def test_fingerprint_changes_name_each_file(now, expected):
    from moe_tune.engine.families.checkpoint import changes_phrase, fingerprint_changes

    changes = fingerprint_changes({"a.safetensors": A}, now)
    assert changes == expected
    if len(changes) > 1:
        assert changes_phrase(changes) == f"{changes[0]} (and 1 more file)"
    # A run of an earlier version (no fingerprint, or another shape of it) is not compared.
    assert fingerprint_changes(None, now) == fingerprint_changes({"a": "not a record"}, now) == []
