"""Export and generate of runs trained on FP8 base weights (`model.base_precision: fp8`, engine/export/fp8.py).

Three bases, each a tiny qwen3_moe-shaped model with dims of 128 so FP8 applies (attention q/o, the dense MLP,
the routed experts; k/v of 64 rows stay floating): an FP8 hub checkpoint, a bf16 (here fp32) checkpoint quantized at
load, and the seeded init of a profile-built model (trained through the trainer: output.save_merged and a ZeRO
checkpoint step). The merged export is dequantize(run's FP8 base) + alpha / r * B @ A, computed here from the run's
own model; transformers gives the logits of our bf16-base model on the dequantized weights with the adapters
(1e-4, fp32) and of the trained FP8 model within the FP8 activation tolerance; the adapter export loads on the FP8
checkpoint in transformers + PEFT and again on our FP8 model; generate keeps the base FP8 and decodes what the
trained model's forward gives; an FP8 re-quantized merged export is refused with the delta loss measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_tiny
from moe_tune.engine.export.hub import export_run
from moe_tune.engine.export.sources import read_run
from moe_tune.ops.fp8 import FP8_DTYPE, dequantize_weight
from moe_tune.profiles import ProfileError

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Two layers: a dense MLP (128 wide) under the first, four routed experts under the second, of width 160 (not a
# multiple of 128: the gate and up halves of w_gate_up get scale rows of their own).
SHAPE = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=160, head_dim=32, num_hidden_layers=2,
             num_experts=4)
IDS = torch.randint(0, 259, (1, 21), generator=torch.Generator().manual_seed(0))
# Our FP8 model (GEMM inputs quantized in 1 x 128 groups) against the same weights with unquantized inputs, fp32:
# the logits' relative Frobenius error (measured 0.039-0.041 on the checkpoint runs, 0.011 on the profile run; one
# e4m3 rounding is up to 6% of a value).
FP8_ACTIVATION_TOL = 0.08
# The requantized merge's delta is measured at |delta| = 1% of |W| (in real fine-tunes it is smaller still).
DELTA_SHARE = 0.01


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(path)).items()}


def job_for(root: Path, model: dict, **extra):
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    (root / "data.jsonl").write_text("".join(json.dumps({"text": f"document {i}: fp8 weights {i * 7}"}) + "\n"
                                             for i in range(8)))
    return resolve_job(validate_profile({
        "name": "export-fp8", "model": model,
        "data": {"path": str(root / "data.jsonl"), "tokenizer": "byte", "seq_len": 32},
        "train": {"steps": 2, "micro_batch_size": 1, "lr": 0.05},
        "lora": {"target_modules": ATTENTION + ["gate_proj", "up_proj", "down_proj"]},
        "output": {"dir": str(root / "run")}, **extra,
    }))


def base_model(cfg):
    """Our model of `cfg` with its base as a run loads it (FP8 weights as the run holds them)."""
    from moe_tune.engine.model.model import build_model

    model = build_model(cfg)
    if cfg.checkpoint is not None:
        from moe_tune.engine.families import load_checkpoint_weights

        load_checkpoint_weights(model, cfg)
    return model


def written_run(root: Path, job):
    """A finished LoRA run written without training (profile.yaml, summary.json, adapter/ as the trainer saves it),
    its adapters' B factors random; and that PeftModel."""
    import yaml

    from moe_tune.engine.lora import inject_lora

    run = root / "run"
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text(json.dumps({"last_step": 2}) + "\n")
    peft_model = inject_lora(base_model(job.model), job.lora)
    hf_tiny.save_drawn_adapter(peft_model, run / "adapter", 0.05)
    return run, peft_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    plain = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_moe(**SHAPE), root / "plain")
    (plain / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return plain, hf_tiny.write_fp8_checkpoint(plain, root / "fp8")


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """{kind: (run_dir, the trained PeftModel or None)}: an FP8 checkpoint's run and a bf16 checkpoint's quantized at
    load (written), and a profile-built FP8 run through the trainer (2 steps, save_merged, a checkpoint per step)."""
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import load_profile

    plain, fp8 = checkpoints
    found = {}
    for kind, model in (("fp8-checkpoint", {"checkpoint": str(fp8)}),
                        ("quantized-at-load", {"checkpoint": str(plain), "base_precision": "fp8"})):
        root = tmp_path_factory.mktemp(kind)
        found[kind] = written_run(root, job_for(root, model))
    out = tmp_path_factory.mktemp("profile") / "run"
    finetune(load_profile("tiny", [
        "model.hidden_size=128", "model.layers=[{attention: full, mlp: dense}, {attention: full, mlp: moe}]",
        "model.intermediate_size=128", "model.head_dim=32", "model.partial_rotary_factor=1.0",
        "model.attention_output_gate=false", "model.moe.num_experts=4", "model.moe.expert_intermediate_size=160",
        "model.moe.shared_expert_intermediate_size=0", "model.base_precision=fp8", "train.steps=2", "train.lr=0.02",
        "train.warmup_steps=0", "train.micro_batch_size=1", "data.seq_len=64", "data.corpus_documents=40",
        "lora.modules_to_save=[]", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj]",
        "output.save_merged=true", "output.save_every=2", f"output.dir={out}"]),
        show_progress=False)
    found["profile"] = (out, None)
    return found


KINDS = ["fp8-checkpoint", "quantized-at-load", "profile"]


def trained(run_dir: Path):
    """The run's trained model rebuilt: its FP8 base as loaded for training, adapter/ on it (unmerged)."""
    from moe_tune.engine.lora import load_adapter

    return load_adapter(base_model(read_run(run_dir).cfg), run_dir / "adapter").eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.tensor([0, IDS.shape[1]], dtype=torch.int32)).logits[0]


def expected_merged(peft_model, scaling: float) -> dict[str, torch.Tensor]:
    """Our names -> dequantize(FP8 base bits) + scaling * B @ A in fp32, from the model's own tensors."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(peft_model)
    expected = {}
    for name, tensor in peft_model.base_model.model.state_dict().items():
        if not name.endswith("_scale_inv"):
            continue
        weight_name = name.removesuffix("_scale_inv").replace(".base_layer", "")
        bits = peft_model.base_model.model.state_dict()[name.removesuffix("_scale_inv")]
        segments = (bits.shape[-2] // 2,) * 2 if weight_name.endswith("w_gate_up") else None
        w = dequantize_weight(bits.view(FP8_DTYPE), tensor.view(torch.float32), segments)
        module, _, param = weight_name.rpartition(".")
        part = "weight" if param == "weight" else param
        a = adapter.get(f"base_model.model.{module}.lora_A.{part}")
        b = adapter.get(f"base_model.model.{module}.lora_B.{part}")
        if a is not None:
            w = w + torch.matmul(b.float(), a.float()) * scaling
        expected[weight_name] = w
    return expected


def hub_keys(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """qwen3_moe's keys of our tensor `name` (per-expert keys for the routed experts)."""
    if ".experts.w_gate_up" in name:
        prefix, half = "model." + name.removesuffix("w_gate_up"), value.shape[1] // 2
        return {**{f"{prefix}{e}.gate_proj.weight": value[e, :half] for e in range(value.shape[0])},
                **{f"{prefix}{e}.up_proj.weight": value[e, half:] for e in range(value.shape[0])}}
    if ".experts.w_down" in name:
        prefix = "model." + name.removesuffix("w_down")
        return {f"{prefix}{e}.down_proj.weight": value[e] for e in range(value.shape[0])}
    return {"model." + name: value}


@pytest.fixture(scope="module")
def merged(runs):
    """{kind: (export-merged folder, printed notes)}."""
    found = {}
    for kind, (run_dir, _) in runs.items():
        notes: list[str] = []
        found[kind] = (export_run(run_dir, merge=True, out=None, max_shard_size="200KB", notes=notes), notes)
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_merged_export_is_the_dequantized_base_plus_the_delta(kind, runs, merged):
    run_dir, written = runs[kind]
    out, notes = merged[kind]
    run = read_run(run_dir)
    model = written if written is not None else trained(run_dir)
    expected = expected_merged(model, run.profile.lora.alpha / run.profile.lora.r)
    assert any(".experts.w_gate_up" in n for n in expected) and any("q_proj" in n for n in expected)
    stored = tensors_of(out)
    checked = 0
    for name, value in expected.items():
        for key, want in hub_keys(name, value).items():
            torch.testing.assert_close(stored[key].float(), want, rtol=0, atol=1e-6, msg=key)
            checked += 1
    assert checked > 2 * len(expected)
    assert not [k for k in stored if k.endswith("_scale_inv")] and FP8_DTYPE not in {t.dtype for t in stored.values()}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert notes == [line for line in notes if "from an FP8 base" in line] and len(notes) == 1
    assert notes[0].startswith("merged weights are float32 from an FP8 base")
    assert notes[0] in (out / "README.md").read_text()
    if (run_dir / "merged").exists():
        # The trainer's output.save_merged (from the gathered FP8 bits and adapters) wrote the same tensors.
        again = tensors_of(run_dir / "merged")
        assert again.keys() == stored.keys()
        for key, value in stored.items():
            torch.testing.assert_close(again[key], value, rtol=0, atol=1e-6, msg=key)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def with_headroom(checkpoint: Path) -> Path:
    """The FP8 checkpoint's weights quantized again with scales 1.5x ours (largest |W_q| ~299, not 448, as a
    quantizer keeping headroom writes them): quantizing its dequantized blocks once more changes them, so only a
    reader that keeps the stored bits gets them back."""
    from safetensors.torch import save_file

    from moe_tune.ops.fp8 import BLOCK

    for path in checkpoint.glob("*.safetensors"):
        tensors = tensors_of_file(path)
        for key in [k for k in tensors if k + "_scale_inv" in tensors]:
            scale = tensors[key + "_scale_inv"] * 1.5
            full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: tensors[key].shape[0],
                                                                                   : tensors[key].shape[1]]
            w = dequantize_weight(tensors[key], tensors[key + "_scale_inv"])
            tensors[key], tensors[key + "_scale_inv"] = (w / full).to(FP8_DTYPE), scale
        save_file(tensors, str(path), metadata={"format": "pt"})
    return checkpoint


def test_the_export_reads_the_base_the_run_loaded(tmp_path):
    """qwen3_next whose in_proj_qkvz rows split its 128-row blocks (the loader quantizes q and k again from the
    dequantized rows, keeps v and z and the rest as stored), from a checkpoint whose blocks change when quantized
    again: the export's base of every FP8 weight is the loaded model's FP8 tensors dequantized, bit for bit."""
    import warnings

    from moe_tune.engine.export.sources import FinalState

    plain = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_next(
        hidden_size=128, num_hidden_layers=1, mlp_only_layers=[], layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=4, moe_intermediate_size=128, shared_expert_intermediate_size=128), tmp_path / "plain")
    fp8 = with_headroom(hf_tiny.write_fp8_checkpoint(plain, tmp_path / "fp8"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_dir, written = written_run(tmp_path, job_for(tmp_path, {"checkpoint": str(fp8)}))
    loaded = expected_merged(written, 0.0)
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.self_attn.v_proj.weight"} <= set(loaded)
    with FinalState(read_run(run_dir), merged=False) as source:
        for name, value in loaded.items():
            assert torch.equal(source.read(name), value), name


def transformers_logits(directory: Path, adapter: Path | None = None) -> torch.Tensor:
    import transformers

    from moe_tune.engine.align.reference import pure_torch_paths

    transformers.logging.set_verbosity_error()
    with pure_torch_paths():
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            local_files_only=True)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            return model.eval()(input_ids=IDS).logits[0]


def dequantized_twin(run_dir: Path):
    """Our model of the run with base_precision bf16 (fp32 here) holding the run's FP8 base dequantized, and the
    run's adapter on it unmerged."""
    from moe_tune.engine.export.fp8 import bf16_base
    from moe_tune.engine.lora import load_adapter
    from moe_tune.engine.model.model import build_model

    cfg = read_run(run_dir).cfg
    fp8_state = base_model(cfg).state_dict()
    twin = build_model(bf16_base(cfg))
    with torch.no_grad():
        for name, target in twin.state_dict().items():
            scale = fp8_state.get(name + "_scale_inv")
            if scale is None:
                target.copy_(fp8_state[name])
                continue
            segments = (target.shape[-2] // 2,) * 2 if name.endswith("w_gate_up") else None
            target.copy_(dequantize_weight(fp8_state[name].view(FP8_DTYPE), scale.view(torch.float32), segments))
    return load_adapter(twin, run_dir / "adapter").eval()


@pytest.mark.parametrize("kind", KINDS)
def test_exported_model_in_transformers_gives_our_logits(kind, runs, merged):
    run_dir, _ = runs[kind]
    got = transformers_logits(merged[kind][0])
    torch.testing.assert_close(got, logits(dequantized_twin(run_dir)), rtol=0, atol=1e-4)
    ours = logits(trained(run_dir))
    base = logits(base_model(read_run(run_dir).cfg).eval())
    assert relative(base, ours) > 3 * FP8_ACTIVATION_TOL  # the adapters moved the model
    assert relative(got, ours) <= FP8_ACTIVATION_TOL


def dequantized_checkpoint(checkpoint: Path, out: Path) -> Path:
    """The FP8 checkpoint with every FP8 weight dequantized (ops.fp8's rule, fp32) and no scales or
    quantization_config. transformers' own CPU dequantization (5.24, 5.25) infers the block height from the scale grid
    (160 rows over 2 scale rows: blocks of 80), which is wrong for dims that are not multiples of 128."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(checkpoint, out)
    for path in out.glob("*.safetensors"):
        tensors = tensors_of_file(path)
        for key in [k for k in tensors if k + "_scale_inv" in tensors]:
            tensors[key] = dequantize_weight(tensors[key], tensors.pop(key + "_scale_inv"))
        save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def tensors_of_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("kind", ["fp8-checkpoint", "quantized-at-load"])
def test_adapter_export_round_trip(kind, runs, merged, checkpoints, tmp_path):
    """The adapter export names the run's checkpoint as its base; on it in transformers + PEFT (an FP8 checkpoint
    dequantized) it gives the merged export's logits; adapter/ loads on our FP8 model again as the model that wrote
    it."""
    run_dir, written = runs[kind]
    checkpoint = read_run(run_dir).cfg.checkpoint
    adapter = export_run(run_dir, merge=False, out=run_dir.parent / "adapter-export")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint)
    assert checkpoint == checkpoints[0 if kind == "quantized-at-load" else 1]
    exported = transformers_logits(merged[kind][0])
    if kind == "fp8-checkpoint":
        on_checkpoint = transformers_logits(dequantized_checkpoint(checkpoint, tmp_path / "dequantized"), adapter)
        torch.testing.assert_close(on_checkpoint, exported, rtol=0, atol=1e-4)
    else:
        # The checkpoint is stored unquantized: transformers + PEFT on it is our bf16-base model with the adapter.
        from moe_tune.engine.export.fp8 import bf16_base
        from moe_tune.engine.lora import load_adapter

        unquantized = load_adapter(base_model(bf16_base(read_run(run_dir).cfg)), run_dir / "adapter").eval()
        torch.testing.assert_close(transformers_logits(checkpoint, adapter), logits(unquantized), rtol=0, atol=1e-4)
    torch.testing.assert_close(logits(trained(run_dir)), logits(written), rtol=0, atol=0)


def test_step_export_equals_the_final_export(runs, merged, tmp_path):
    """checkpoints/step-2 of the profile run (ZeRO-3, FP8 bits among the frozen parameters) exports as its final
    state does."""
    run_dir, _ = runs["profile"]
    from_step = export_run(run_dir, merge=True, out=tmp_path / "step", max_shard_size="200KB", step=2)
    final = tensors_of(merged["profile"][0])
    got = tensors_of(from_step)
    assert got.keys() == final.keys()
    for key, value in final.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_generate_keeps_the_fp8_base_and_decodes_the_trained_forward(runs):
    from moe_tune.engine.generate.session import load_session
    from moe_tune.engine.model.fp8 import Fp8Linear

    run_dir, _ = runs["profile"]
    session = load_session(str(run_dir), torch.device("cpu"))
    assert "FP8 base with its LoRA adapters beside it, unmerged" in session.note
    assert any(isinstance(m, Fp8Linear) for m in session.model.modules())
    prompt = IDS[0, :9].tolist()
    got = session.generate(prompt, 6, stop=False).ids
    model, ids = trained(run_dir), list(prompt)
    with torch.no_grad():
        for _ in range(6):
            step = torch.tensor([ids])
            ids.append(int(model(step, torch.tensor([0, len(ids)], dtype=torch.int32)).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_requantization_loses_the_delta(runs, capsys):
    """Why a merged export is never re-quantized to FP8: at |delta| = 1% of |W| the requantized weight keeps
    almost nothing of the delta (relative error near 1), and less than all of it even at the run's own delta."""
    from moe_tune.engine.export.fp8 import DELTA_LOST, requantization_error

    run_dir, written = runs["fp8-checkpoint"]
    base = expected_merged(written, 0.0)
    full = expected_merged(written, written.peft_config["default"].lora_alpha / written.peft_config["default"].r)
    small = own = total_small = total_own = 0.0
    for name, w in base.items():
        segments = (w.shape[-2] // 2,) * 2 if name.endswith("w_gate_up") else None
        delta = full[name] - w
        if not delta.any():
            continue
        e, d = requantization_error(w, delta, segments)
        own, total_own = own + e, total_own + d
        e, d = requantization_error(w, delta * (DELTA_SHARE * w.norm() / delta.norm()), segments)
        small, total_small = small + e, total_small + d
    at_one_percent, at_own = (small / total_small) ** 0.5, (own / total_own) ** 0.5
    with capsys.disabled():
        print(f"\nFP8 requantized merge: delta relative error {at_one_percent:.3f} at 1% of |W|, {at_own:.3f} at the "
              "run's delta")
    assert at_one_percent > 0.8 and at_own > 0.01
    # The figure the refusal quotes is this measurement.
    assert abs(float(DELTA_LOST.rstrip("%")) / 100 - at_one_percent) < 0.02


@pytest.mark.parametrize("precision, match", [
    ("fp8", r"^--precision fp8 is refused: an export is never re-quantized to FP8, since rounding W \+ delta to e4m3 "
            r"in 128x128 blocks rounds the fine-tune's change away \(on a tiny run 91% of a LoRA delta of 1% of \|W\| "
            r"is lost\); serve the adapter \(export without --merge\) on the FP8 base checkpoint"),
    ("FP8", r"^--precision \('FP8'\) must be auto"),
    ("bf16", r"^--precision \('bf16'\) must be auto"),
])
@pytest.mark.parametrize("merge", [True, False])
def test_other_precisions_are_refused_before_writing(precision, match, merge, runs, tmp_path):
    run_dir, _ = runs["fp8-checkpoint"]
    with pytest.raises(ProfileError, match=match) as caught:
        export_run(run_dir, merge=merge, out=tmp_path / "out", precision=precision)
    assert len(caught.value.problems) == 1 and not (tmp_path / "out").exists()


def test_cli_prints_the_precision_line_and_refuses_fp8_in_one_line(runs, tmp_path):
    from typer.testing import CliRunner

    from moe_tune.cli import app

    run_dir, _ = runs["quantized-at-load"]
    result = CliRunner().invoke(app, ["export", str(run_dir), "--merge", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "merged weights are float32 from an FP8 base" in result.output and "exported to" in result.output
    result = CliRunner().invoke(app, ["export", str(run_dir), "--merge", "--precision", "fp8",
                                      "--out", str(tmp_path / "other")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        line for line in result.output.splitlines() if line.startswith("error: --precision fp8 is refused")]
    assert not (tmp_path / "other").exists()
