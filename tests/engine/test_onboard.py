"""`moe-tune onboard`'s engine (engine/onboard.py) on tiny checkpoints of every supported family: every layer mapped
to ops with their paths, the plan, align's verdict; unsupported checkpoints listed line by line (exit 2), a broken
mapping failing alignment (exit 1). The profile stage runs in tests/cli/test_onboard_cli.py (one training step)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_tiny
from moe_tune.engine.align.compare import default_documents
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.onboard import PATHS, check_supported, kernel_reason, onboard, run_plan


# Every supported family's tiny checkpoint: (id, builder). Families added later append their builder here.
FAMILIES = [
    ("qwen3_moe", hf_tiny.tiny_qwen3_moe),
    ("qwen3_next", hf_tiny.tiny_qwen3_next),
    ("qwen3_5_moe", hf_tiny.tiny_qwen3_5_moe),
    ("deepseek_v3", hf_tiny.tiny_deepseek_v3),
    ("deepseek_v32", hf_tiny.tiny_deepseek_v32),
    ("kimi_linear", hf_tiny.tiny_kimi_linear),
    ("qwen4_exp", hf_tiny.tiny_qwen4_exp),
    ("mixtral", hf_tiny.tiny_mixtral),
    ("glm4_moe", hf_tiny.tiny_glm4_moe),
    ("gpt_oss", hf_tiny.tiny_gpt_oss),
]
NO_KERNEL = "no kernel for these inputs (dtype, size or options)"
# Short documents keep align quick; vision families still get their images in the second and third.
DOCUMENT_LENGTHS = (13, 7, 9)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`checkpoints(name, builder)` -> the saved, perturbed tiny checkpoint (built once per module)."""
    root, built = tmp_path_factory.mktemp("onboard"), {}

    def get(name, builder):
        if name not in built:
            built[name] = hf_tiny.save_tiny_checkpoint(builder(), root / name)
        return built[name]

    return get


def short_documents(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    return default_documents(cfg, DOCUMENT_LENGTHS)


@pytest.mark.parametrize("name, builder", FAMILIES, ids=[name for name, _ in FAMILIES])
def test_every_family_maps_plans_and_aligns(name, builder, checkpoints):
    checkpoint = checkpoints(name, builder)
    report = onboard(checkpoint, profile_steps=0, documents=short_documents(checkpoint))
    data = json.loads(json.dumps(report.to_json()))
    assert data["exit_code"] == 0, (data["unsupported"], data["mapping"], data["align"]["problems"])
    assert data["unsupported"] == [] and data["model_type"] == json.loads((checkpoint / "config.json").read_text())[
        "model_type"]
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    # Every decoder layer: its blocks, and every block reached by at least one op with a path and a reason.
    assert [layer["index"] for layer in data["layers"]] == list(range(len(cfg.layers)))
    for layer, spec in zip(data["layers"], cfg.layers):
        assert layer["attention"] == spec.attention and layer["mlp"] == spec.mlp
        assert layer["token_mixer"] and layer["channel_mixer"]
        for block in ("self_attn", "mlp"):
            assert any(op["module"].startswith(f"layers.{layer['index']}.{block}") for op in layer["ops"]), block
        assert all(op["path"] in PATHS and op["reason"] for op in layer["ops"])
    # On the CPU the fused ops take their reference, and say why (gpt_oss's biased, clamped experts have no kernel).
    reasons = {op["reason"] for layer in data["layers"] for op in layer["ops"] if op["path"] == "reference"}
    assert "no CUDA device" in reasons and reasons <= {"no CUDA device", NO_KERNEL}
    assert any(op["op"] == "linear_cross_entropy" for op in data["model_ops"])
    assert data["mapping"]["status"] == "ok"
    assert data["plan"]["status"] == "ok" and data["plan"]["result"]["suggested"]["expert_parallel"] >= 1
    assert data["profile"]["status"] == "skipped"
    assert data["align"]["status"] == "ok" and data["align"]["result"]["passed"]
    assert data["align"]["result"]["documents"] == [len(d) for d in short_documents(checkpoint)]


@pytest.mark.parametrize(
    "mode, choice, has_kernel, on_cuda, expected",
    [
        ("auto", False, True, False, "no CUDA device"),
        ("auto", True, True, True, "CUDA"),
        ("auto", False, False, True, NO_KERNEL),
        ("auto", False, False, False, NO_KERNEL),
        ("reference", False, True, True, "MOE_TUNE_KERNELS=reference"),
        ("triton", True, True, True, "MOE_TUNE_KERNELS=triton"),
        ("triton", True, True, False, "MOE_TUNE_KERNELS=triton (Triton interpreter)"),
    ],
)
def test_kernel_reason_says_why(mode, choice, has_kernel, on_cuda, expected):
    assert kernel_reason(choice, has_kernel, on_cuda, mode) == expected


def test_forced_reference_path_is_reported(checkpoints, monkeypatch):
    from moe_tune.engine.onboard import map_layers, training_device

    monkeypatch.setenv("MOE_TUNE_KERNELS", "reference")
    checkpoint = checkpoints("qwen3_moe", hf_tiny.tiny_qwen3_moe)
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    layers, model_ops = map_layers(cfg, family, *training_device(), documents=short_documents(checkpoint))
    dispatched = [op for layer in layers for op in layer.ops if op.path != "torch"] + model_ops
    assert dispatched and {op.reason for op in dispatched} == {"MOE_TUNE_KERNELS=reference"}
    assert {op.path for op in dispatched} == {"reference"}


def test_plan_that_fits_nowhere_is_reported_not_raised(checkpoints, tmp_path):
    stage = run_plan(checkpoints("qwen3_moe", hf_tiny.tiny_qwen3_moe), 2, 1000, tmp_path / "out")
    assert stage.status == "ok" and stage.result["suggested"] is None
    assert stage.result["devices"] == 2 and not any(lay["fits"] for lay in stage.result["layouts"])


def _save_llama(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(directory))


def _config_edit(key, value):
    def edit(checkpoint):
        config = json.loads((checkpoint / "config.json").read_text())
        config[key] = value
        (checkpoint / "config.json").write_text(json.dumps(config))

    return edit


def _extra_tensor(checkpoint):
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.adapter_bank.weight"] = torch.zeros(2, 2)
    save_file(tensors, path, metadata={"format": "pt"})


def _copy_of(checkpoint, target):
    import shutil

    shutil.copytree(checkpoint, target)
    return target


@pytest.mark.parametrize(
    "make, expected",
    [
        # A model type no family maps: the type, every key pattern of its weights, its config keys with values.
        ("llama", ["config.json: model_type ('llama') is not mapped: must be one of",
                   "module not mapped: model.layers.*.mlp.gate_proj.weight",
                   "module not mapped: model.norm.weight",
                   "config.json: hidden_size (32) is not mapped",
                   "config.json: num_key_value_heads (2) is not mapped"]),
        # A mapped type with config values its family does not map: each named with its value.
        ("qwen3_moe-config", ["config.json: hidden_act ('gelu') is not mapped",
                              "config.json: use_sliding_window (True) is not mapped"]),
        # A mapped type whose weights hold a tensor nothing maps: found when the weights load.
        ("qwen3_moe-tensor", ["module not mapped: model.layers.*.mlp.adapter_bank.weight"]),
    ],
    ids=["unknown-model-type", "unmapped-config-values", "unmapped-tensor"],
)
def test_unsupported_checkpoint_lists_every_problem_and_exits_2(make, expected, checkpoints, tmp_path):
    if make == "llama":
        checkpoint = tmp_path / "llama"
        _save_llama(checkpoint)
    else:
        checkpoint = _copy_of(checkpoints("qwen3_moe", hf_tiny.tiny_qwen3_moe), tmp_path / "qwen3_moe")
        if make == "qwen3_moe-config":
            _config_edit("hidden_act", "gelu")(checkpoint)
            _config_edit("use_sliding_window", True)(checkpoint)
        else:
            _extra_tensor(checkpoint)
    report = onboard(checkpoint, profile_steps=0)
    assert report.exit_code == 2
    for line in expected:
        assert any(line in problem for problem in report.unsupported), (line, report.unsupported)
    assert all("\n" not in line for line in report.unsupported)
    assert [s.status for s in (report.plan, report.profile, report.align)] == ["skipped"] * 3
    if make != "qwen3_moe-tensor":
        assert check_supported(checkpoint) == report.unsupported


def test_broken_mapping_fails_alignment_and_exits_1(checkpoints, monkeypatch):
    from moe_tune.engine.families.qwen3_moe import Qwen3Moe

    checkpoint = checkpoints("qwen3_moe", hf_tiny.tiny_qwen3_moe)
    mapped = Qwen3Moe.recipe

    # A deliberately wrong mapping: layer 1's attention output projection loaded 1% off.
    def recipe(self, name, module, cfg):
        found = mapped(self, name, module, cfg)
        if name == "layers.1.self_attn.o_proj.weight":
            return lambda get: found(get) * 1.01
        return found

    monkeypatch.setattr(Qwen3Moe, "recipe", recipe)
    report = onboard(checkpoint, profile_steps=0, documents=short_documents(checkpoint))
    assert report.exit_code == 1 and report.unsupported == []
    assert report.mapping.status == "ok" and report.align.status == "failed"
    assert any(line.startswith("layer 1 rel") for line in report.align.problems), report.align.problems


def test_a_forced_path_that_cannot_run_fails_its_stages_not_the_command(checkpoints, monkeypatch):
    # Triton forced on CPU tensors without the interpreter: every op refuses; each stage says so in its section.
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    checkpoint = checkpoints("qwen3_moe", hf_tiny.tiny_qwen3_moe)
    report = onboard(checkpoint, profile_steps=0, documents=short_documents(checkpoint))
    assert report.exit_code == 1 and report.unsupported == []
    assert report.mapping.status == "failed" and report.align.status == "failed"
    for stage in (report.mapping, report.align):
        assert len(stage.problems) == 1 and "MOE_TUNE_KERNELS=triton but" in stage.problems[0], stage.problems
    assert report.plan.status == "ok"
