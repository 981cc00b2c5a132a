"""FP8 checkpoints in the hub's layout (float8_e4m3fn weights with fp32 128 x 128 block scales `*_scale_inv`):
read as bits into FP8 targets, quantized at load from floating checkpoints, dequantized for floating targets, the
refused neighbours of the layout, and `moe-tune align` on FP8 checkpoints with the FP8 tolerances.

The tiny FP8 checkpoints are wide enough (hidden 128, experts 160 or 128 wide) that attention projections, dense and
shared MLPs and routed experts are FP8; expert widths of 160 give the gate and up halves two scale rows each, the
second one partial. The experts' gate projections are scaled up (EXPERT_GATE_GAIN), so a scale row applied to the
wrong half is never within FP8 rounding.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.align.compare import FP8_TOLERANCES
from moe_tune.engine.families import (
    UnsupportedModel,
    check_checkpoint,
    load_checkpoint_weights,
    model_profile_from_checkpoint,
)
from moe_tune.engine.families import base as family_base
from moe_tune.engine.model.model import build_model
from moe_tune.engine.parallel.expert_parallel import ExpertLayout
from moe_tune.ops.fp8 import dequantize_weight, quantize_weight

from hf_tiny import (
    save_tiny_checkpoint,
    tiny_deepseek_v3,
    tiny_qwen3_5_moe,
    tiny_qwen3_moe,
    tiny_qwen3_next,
    write_fp8_checkpoint,
)

# The experts' gate projections x8: their SwiGLU runs in silu's curved range (pre-activations of order 1) and the
# gate and up scale rows differ about 8x, so swapping them changes the expert outputs by far more than FP8 rounding
# (with equal gains, or in silu's linear range, a swap would cancel in silu(g) * u).
EXPERT_GATE_GAIN = 8.0

WIDE = {
    # Gate/up 160 rows each (scale rows 2 + 2, the second of each partial), a dense first layer 192 wide.
    "qwen3_moe": lambda: tiny_qwen3_moe(hidden_size=128, head_dim=32, intermediate_size=192, moe_intermediate_size=160,
                                        num_experts=4, num_hidden_layers=2),
    # in_proj_qkvz's groups are [q 128 | k 128 | v 2 x 64 | z 2 x 64] rows: every part 128-aligned, read as bits.
    "qwen3_next": lambda: tiny_qwen3_next(hidden_size=128, num_hidden_layers=2, mlp_only_layers=[],
                                          layer_types=["linear_attention", "full_attention"], head_dim=32,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                          linear_value_head_dim=64, num_experts=4, moe_intermediate_size=128,
                                          shared_expert_intermediate_size=160),
    # MLA with q_a / q_b / o FP8 (kv_a and kv_b have a dim < 128 and stay floating), a dense first layer.
    "deepseek_v3": lambda: tiny_deepseek_v3(hidden_size=128, intermediate_size=256, moe_intermediate_size=160,
                                            num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1,
                                            num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=128,
                                            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    # The vision-language layout (model.language_model.*, a floating 1-block vision tower), text as qwen3_next's.
    "qwen3_5_moe": lambda: tiny_qwen3_5_moe(hidden_size=128, num_hidden_layers=2, head_dim=32,
                                            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                            linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=64,
                                            num_experts=4, moe_intermediate_size=128,
                                            shared_expert_intermediate_size=160,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                                             "mrope_interleaved": True}),
    # in_proj_qkvz's groups are [q 64 | k 64 | v 128 | z 128] rows: our q and k rows split its 128-row blocks.
    "qwen3_next_split": lambda: tiny_qwen3_next(hidden_size=128, num_hidden_layers=1, mlp_only_layers=[],
                                                layer_types=["linear_attention"], linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=64,
                                                linear_value_head_dim=64, num_experts=4, moe_intermediate_size=128,
                                                shared_expert_intermediate_size=128),
}


def _is_expert_gate(key: str) -> bool:
    return ".experts." in key and key.endswith(".gate_proj.weight")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """`pairs(name)` -> (floating checkpoint, its FP8 twin), built once per module."""
    built: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            floating = save_tiny_checkpoint(WIDE[name](), root / "floating")
            path = floating / "model.safetensors"
            tensors = load_file(str(path))
            for key in [k for k in tensors if _is_expert_gate(k)]:
                tensors[key] = tensors[key] * EXPERT_GATE_GAIN
            save_file(tensors, str(path), metadata={"format": "pt"})
            built[name] = floating, write_fp8_checkpoint(floating, root / "fp8")
        return built[name]

    return make


def _file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def _load(directory: Path, base: str, layout: ExpertLayout | None = None, check_unread: bool = True):
    _, _, cfg = model_profile_from_checkpoint(directory)
    cfg = cfg.model_copy(update={"base_precision": base})
    model = build_model(cfg, expert_layout=layout)
    load_checkpoint_weights(model, cfg, check_unread=check_unread)
    return model, cfg


def test_profile_of_an_fp8_checkpoint_is_fp8(pairs):
    floating, fp8 = pairs("qwen3_moe")
    assert model_profile_from_checkpoint(fp8)[2].base_precision == "fp8"
    assert model_profile_from_checkpoint(floating)[2].base_precision == "bf16"


@pytest.mark.parametrize("asked, expected", [(None, "fp8"), ("bf16", "bf16"), ("fp8", "fp8")])
def test_the_profiles_base_precision_wins(pairs, tmp_path, asked, expected):
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    _, fp8 = pairs("qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    model = {"checkpoint": str(fp8)} | ({"base_precision": asked} if asked else {})
    job = resolve_job(validate_profile({
        "name": "x", "model": model, "data": {"path": str(data), "tokenizer": "byte", "seq_len": 16},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "output": {"dir": str(tmp_path / "out")},
    }))
    assert job.model.base_precision == expected and job.model.hidden_size == 128


def test_full_finetuning_from_an_fp8_checkpoint_needs_bf16(pairs, tmp_path):
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import ProfileError, validate_profile

    _, fp8 = pairs("qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')

    def job(model):
        return resolve_job(validate_profile({
            "name": "x", "model": model, "data": {"path": str(data), "tokenizer": "byte", "seq_len": 16},
            "lora": {"enabled": False}, "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3},
            "output": {"dir": str(tmp_path / "out")},
        }))

    with pytest.raises(ProfileError) as err:
        job({"checkpoint": str(fp8)})
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith("model.base_precision ('fp8', from the checkpoint's FP8 "
                                            "quantization_config) needs lora.enabled"), err.value.problems
    assert job({"checkpoint": str(fp8), "base_precision": "bf16"}).model.base_precision == "bf16"


def test_fp8_bits_in_equal_the_files_bits(pairs):
    """Every FP8 tensor of ours holds the file's bits; the experts' gate and up scale rows in order (row_segments
    (F, F): 2 + 2 rows for F = 160); tensors the file keeps floating stay floating and equal."""
    _, fp8 = pairs("qwen3_moe")
    model, _ = _load(fp8, "fp8")
    stored = _file_tensors(fp8)
    params = dict(model.named_parameters())
    fp8_names = [n for n, p in params.items() if p.dtype == torch.uint8]
    assert len(fp8_names) == 9  # q and o of both layers, the dense MLP's three, the experts' two
    for name in fp8_names:
        if ".experts." in name:
            continue
        key = "model." + name
        assert torch.equal(params[name], _bits(stored[key])), name
        assert torch.equal(params[name + "_scale_inv"], _bits(stored[key + "_scale_inv"])), name
    experts = "model.layers.1.mlp.experts."
    gate_up, gate_up_scale = params["layers.1.mlp.experts.w_gate_up"], params["layers.1.mlp.experts.w_gate_up_scale_inv"]
    assert gate_up_scale.shape == (4, 4, 1)
    for e in range(4):
        gate, up = f"{experts}{e}.gate_proj.weight", f"{experts}{e}.up_proj.weight"
        assert torch.equal(gate_up[e], _bits(torch.cat([stored[gate], stored[up]])))
        assert torch.equal(gate_up_scale[e], _bits(torch.cat([stored[gate + "_scale_inv"], stored[up + "_scale_inv"]])))
        down = f"{experts}{e}.down_proj.weight"
        assert torch.equal(params["layers.1.mlp.experts.w_down"][e], _bits(stored[down]))
    assert params["layers.0.self_attn.k_proj.weight"].dtype == torch.float32  # 64 rows: floating in both
    assert torch.equal(params["layers.0.self_attn.k_proj.weight"], stored["model.layers.0.self_attn.k_proj.weight"])


def test_a_rank_reads_its_experts_only(pairs, monkeypatch):
    from moe_tune.engine.families.checkpoint import CheckpointReader

    _, fp8 = pairs("qwen3_moe")
    read: list[str] = []
    original_get, original_rows = CheckpointReader.get, CheckpointReader.rows
    monkeypatch.setattr(CheckpointReader, "get", lambda self, key: read.append(key) or original_get(self, key))
    monkeypatch.setattr(CheckpointReader, "rows", lambda self, key, a, b: read.append(key) or original_rows(self, key, a, b))
    model, _ = _load(fp8, "fp8", ExpertLayout(expert_parallel=2, expert_parallel_rank=1), check_unread=False)
    expert_ids = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert expert_ids == {2, 3}
    assert sum(k.endswith("_scale_inv") and ".experts." in k for k in read) == 2 * 3  # gate, up, down of 2 experts
    stored = _file_tensors(fp8)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(model.layers[1].mlp.experts.w_gate_up[1, 160:], _bits(stored[up]))
    assert torch.equal(model.layers[1].mlp.experts.w_gate_up_scale_inv[1, 2:], _bits(stored[up + "_scale_inv"]))


def test_quantize_at_load_equals_quantize_weight(pairs):
    """A floating checkpoint with base_precision fp8: each FP8 tensor is ops.fp8.quantize_weight of the stored one
    (the experts' gate/up with row_segments (F, F), one expert at a time)."""
    floating, _ = pairs("qwen3_moe")
    model, _ = _load(floating, "fp8")
    stored = _file_tensors(floating)
    q_proj = model.layers[0].self_attn.q_proj
    w_q, scale = quantize_weight(stored["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q_proj.weight, _bits(w_q)) and torch.equal(q_proj.weight_scale_inv, _bits(scale))
    experts = model.layers[1].mlp.experts
    base = "model.layers.1.mlp.experts.2."
    w_q, scale = quantize_weight(torch.cat([stored[base + "gate_proj.weight"], stored[base + "up_proj.weight"]]),
                                 (160, 160))
    assert torch.equal(experts.w_gate_up[2], _bits(w_q)) and torch.equal(experts.w_gate_up_scale_inv[2], _bits(scale))


def test_dequantize_at_load(pairs, tmp_path):
    """Floating targets of an FP8 checkpoint hold the dequantized weights: all of them with base_precision bf16,
    and with fp8 those our rule keeps floating (k_proj, 64 rows, stored FP8 here)."""
    _, fp8 = pairs("qwen3_moe")
    model, _ = _load(fp8, "bf16")
    stored = _file_tensors(fp8)
    key = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(model.layers[1].self_attn.o_proj.weight, dequantize_weight(stored[key], stored[key + "_scale_inv"]))
    base = "model.layers.1.mlp.experts.0."
    gate_up = torch.cat([dequantize_weight(stored[base + p], stored[base + p + "_scale_inv"])
                         for p in ("gate_proj.weight", "up_proj.weight")])
    assert torch.equal(model.layers[1].mlp.experts.w_gate_up[0], gate_up)

    directory = shutil.copytree(fp8, tmp_path / "k_fp8")
    tensors = load_file(str(directory / "model.safetensors"))
    key = "model.layers.0.self_attn.k_proj.weight"
    tensors[key], tensors[key + "_scale_inv"] = quantize_weight(tensors[key])
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model, _ = _load(directory, "fp8")
    k_proj = model.layers[0].self_attn.k_proj
    assert k_proj.weight.dtype == torch.float32
    assert torch.equal(k_proj.weight, dequantize_weight(tensors[key], tensors[key + "_scale_inv"]))


def test_rows_splitting_fp8_blocks_are_requantized_with_a_warning(pairs):
    """qwen3_next's q and k rows of in_proj_qkvz (64 per group) split its 128-row blocks: dequantized and quantized
    again, one warning; v and z (128-aligned) keep the stored bits and scale rows."""
    _, fp8 = pairs("qwen3_next_split")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = _load(fp8, "fp8")
    lines = [str(w.message) for w in caught if "quantized again" in str(w.message)]
    assert len(lines) == 1 and "layers.0.self_attn.q_proj.weight" in lines[0] and "1 more" in lines[0], lines
    stored = _file_tensors(fp8)
    key = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    w, scale = stored[key], stored[key + "_scale_inv"]  # [2 x 384, 128], scale rows [6, 1]
    attn = model.layers[0].self_attn
    v_rows = torch.cat([torch.arange(128, 256), torch.arange(512, 640)])
    assert torch.equal(attn.v_proj.weight, _bits(w[v_rows])) and torch.equal(attn.v_proj.weight_scale_inv, _bits(scale[[1, 4]]))
    q_rows = torch.cat([torch.arange(0, 64), torch.arange(384, 448)])
    w_q, q_scale = quantize_weight(dequantize_weight(w, scale)[q_rows])
    assert torch.equal(attn.q_proj.weight, _bits(w_q)) and torch.equal(attn.q_proj.weight_scale_inv, _bits(q_scale))


def _edited(fp8: Path, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    directory = shutil.copytree(fp8, tmp_path / "edited")
    if config is not None:
        data = json.loads((directory / "config.json").read_text())
        data.update(config)
        (directory / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        stored = load_file(str(directory / "model.safetensors"))
        tensors(stored)
        save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
RULE = r"moe-tune reads quant_method fp8 with weight_block_size \[128, 128\]"
REFUSED_CONFIGS = {
    "awq": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quantization_config\.quant_method \('awq'\)"),
    "fbgemm_fp8": ({"quantization_config": {"quant_method": "fbgemm_fp8"}},
                   r"quantization_config\.quant_method \('fbgemm_fp8'\)"),
    "block_64": ({"quantization_config": {**FP8, "weight_block_size": [64, 64]}},
                 r"quantization_config\.weight_block_size \(\[64, 64\]\)"),
    "block_128_64": ({"quantization_config": {**FP8, "weight_block_size": [128, 64]}},
                     r"weight_block_size \(\[128, 64\]\)"),
    "block_per_tensor": ({"quantization_config": {**FP8, "weight_block_size": None}}, r"weight_block_size \(null\)"),
    "block_floats": ({"quantization_config": {**FP8, "weight_block_size": [128.0, 128.0]}},
                     r"weight_block_size \(\[128\.0, 128\.0\]\)"),
    "static_activations": ({"quantization_config": {**FP8, "activation_scheme": "static"}},
                           r"activation_scheme \('static'\) is not read: must be 'dynamic'"),
    "ue8m0_scales": ({"quantization_config": {**FP8, "scale_fmt": "ue8m0"}}, r"scale_fmt \('ue8m0'\)"),
    "fp4_experts": ({"quantization_config": {**FP8, "expert_dtype": "fp4"}}, r"expert_dtype \('fp4'\)"),
    "e5m2_format": ({"quantization_config": {**FP8, "fmt": "e5m2"}}, r"fmt \('e5m2'\) is not read: must be 'e4m3'"),
    "no_method": ({"quantization_config": {"weight_block_size": [128, 128]}}, r"quant_method \(null\)"),
    "not_an_object": ({"quantization_config": "fp8"}, r"quantization_config \('fp8'\) is not read: must be a JSON"),
    "under_text_config": ({"text_config": {"quantization_config": {**FP8, "weight_block_size": [64, 64]}}},
                          r"text_config\.quantization_config\.weight_block_size \(\[64, 64\]\)"),
}


@pytest.mark.parametrize("quantization_config", [
    # DeepSeek-V3's and Qwen3's FP8 releases, as their config.json spell it.
    {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    {"activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate"],
     "quant_method": "fp8", "weight_block_size": [128, 128]},
], ids=["deepseek_v3", "qwen3"])
def test_published_fp8_configs_are_read(pairs, tmp_path, quantization_config):
    _, fp8 = pairs("qwen3_moe")
    directory = _edited(fp8, tmp_path, config={"quantization_config": quantization_config})
    check_checkpoint(directory)
    assert model_profile_from_checkpoint(directory)[2].base_precision == "fp8"


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_other_quantization_configs_are_refused(pairs, tmp_path, case):
    change, what = REFUSED_CONFIGS[case]
    _, fp8 = pairs("qwen3_moe")
    directory = _edited(fp8, tmp_path, config={"quantization_config": None, **change})
    with pytest.raises(UnsupportedModel) as err:
        check_checkpoint(directory)
    assert len(err.value.problems) == 1, err.value.problems
    line = err.value.problems[0]
    assert line.startswith("config.json: ") and re.search(what, line) and re.search(RULE, line), line


Q = "model.layers.0.self_attn.q_proj.weight"
REFUSED_TENSORS = {
    "missing_scale": (lambda t: t.pop(Q + "_scale_inv"), rf"tensor {Q} is F8_E4M3 without its block scales"),
    "scale_of_wrong_shape": (lambda t: t.update({Q + "_scale_inv": torch.ones(2, 1)}),
                             rf"tensor {Q} has shape \[128, 128\] but its scales .* have \[2, 1\], not \[1, 1\]"),
    "e5m2_weights": (lambda t: t.update({Q: t[Q].float().to(torch.float8_e5m2)}), rf"tensor {Q} is F8_E5M2: FP8 weights "
                     "must be F8_E4M3"),
    "bf16_weight_with_a_scale": (lambda t: t.update({Q: t[Q].float().bfloat16()}), rf"tensor {Q} is BF16: FP8 "),
    "scale_without_weight": (lambda t: t.update({"model.layers.0.self_attn.x_proj.weight_scale_inv": torch.ones(1, 1)}),
                             r"x_proj\.weight_scale_inv is a block scale without its weight"),
    "integer_scale": (lambda t: t.update({Q + "_scale_inv": torch.ones(1, 1, dtype=torch.int32)}),
                      r"is I32: block scales must be F32 \(or BF16, F16\)"),
    "e8m0_scale": (lambda t: t.update({Q + "_scale_inv": torch.ones(1, 1).to(torch.float8_e8m0fnu)}),
                   r"is F8_E8M0: block scales must be F32"),
}


@pytest.mark.parametrize("case", list(REFUSED_TENSORS))
def test_broken_fp8_tensors_are_refused_before_loading(pairs, tmp_path, case):
    edit, line = REFUSED_TENSORS[case]
    _, fp8 = pairs("qwen3_moe")
    directory = _edited(fp8, tmp_path, tensors=edit)
    for check in (lambda: check_checkpoint(directory), lambda: _load(directory, "fp8")):
        with pytest.raises(UnsupportedModel) as err:
            check()
        assert len(err.value.problems) == 1, err.value.problems
        assert str(directory / "model.safetensors") in err.value.problems[0]
        assert re.search(line, err.value.problems[0]), err.value.problems[0]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("base", ["fp8", "bf16"])
def test_non_finite_scales_are_refused_at_load(pairs, tmp_path, value, base):
    key = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    _, fp8 = pairs("qwen3_moe")
    directory = _edited(fp8, tmp_path, tensors=lambda t: t[key].view(-1).__setitem__(1, value))
    with pytest.raises(UnsupportedModel) as err:
        _load(directory, base)
    assert err.value.problems == [f"{directory / 'model.safetensors'}: tensor {key} holds non-finite block scales "
                                  "(inf or nan): the weight it scales has no value"]


def test_fp8_tensors_without_an_fp8_config_are_refused(pairs, tmp_path):
    _, fp8 = pairs("qwen3_moe")
    directory = _edited(fp8, tmp_path, config={"quantization_config": None})
    with pytest.raises(UnsupportedModel) as err:
        check_checkpoint(directory)
    assert all("but config.json declares no FP8 layout" in line for line in err.value.problems)
    assert any(f"tensor {Q} is F8_E4M3" in line and "more like it" in line for line in err.value.problems)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
def test_align_on_fp8_checkpoints_passes_with_the_fp8_tolerances(pairs, name):
    _, fp8 = pairs(name)
    report = align_checkpoint(fp8, pin_routing=True)
    assert report.tolerances == FP8_TOLERANCES
    assert report.passed, report.failures
    assert report.lora_grads


def test_vision_language_fp8_checkpoint_with_the_config_under_text_config(pairs, tmp_path):
    """qwen3_5_moe with quantization_config under text_config: an FP8 checkpoint all the same; the vision tower
    stays floating (its rows exact), the language model FP8 within the FP8 tolerances."""
    _, fp8 = pairs("qwen3_5_moe")
    config = json.loads((fp8 / "config.json").read_text())
    directory = _edited(fp8, tmp_path, config={"quantization_config": None,
                                               "text_config": {**config["text_config"],
                                                               "quantization_config": config["quantization_config"]}})
    assert model_profile_from_checkpoint(directory)[2].base_precision == "fp8"
    report = align_checkpoint(directory, pin_routing=True)
    assert report.passed, report.failures
    rows = {row.name: row.rel for row in report.layers}
    assert rows["vision features"] < 1e-5 and rows["merged embeddings"] < 1e-5, rows


def test_align_with_bf16_base_on_fp8_checkpoint_is_exact(pairs, monkeypatch):
    """The dequantized reference and our dequantize-at-load read the same weights: fp32 tolerances hold."""
    import moe_tune.engine.align.compare as compare

    _, fp8 = pairs("qwen3_next")
    profile = compare.model_profile_from_checkpoint
    monkeypatch.setattr(compare, "model_profile_from_checkpoint", lambda d: (
        lambda f, c, cfg: (f, c, cfg.model_copy(update={"base_precision": "bf16"})))(*profile(d)))
    report = align_checkpoint(fp8, pin_routing=True)
    assert report.passed and max(row.rel for row in report.layers) < 1e-5, report.failures


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3"])
def test_align_catches_swapped_gate_up_scale_rows(pairs, monkeypatch, name):
    """The experts' bits read right but the up half's scale rows applied to the gate half and back."""
    _, fp8 = pairs(name)
    quantized = family_base.stacked_experts.quantized

    def swapped(self, get):
        value = quantized(self, get)
        half = value[1].shape[-2] // 2
        return value[0], torch.cat([value[1][:, half:], value[1][:, :half]], dim=1)

    monkeypatch.setattr(family_base.stacked_experts, "quantized", swapped)
    report = align_checkpoint(fp8, pin_routing=True)
    assert not report.passed
    assert max(row.rel for row in report.layers) > 2 * FP8_TOLERANCES.hidden_rel, report.layers


def test_align_catches_a_perturbed_norm(pairs, monkeypatch):
    from moe_tune.engine.families import qwen3_moe

    _, fp8 = pairs("qwen3_moe")
    recipe = qwen3_moe.qwen_recipe

    def perturbed(name, module, prefix="model."):
        found = recipe(name, module, prefix)
        if name == "layers.1.post_attention_layernorm.weight":
            return lambda get: found(get) * 1.2
        return found

    monkeypatch.setattr(qwen3_moe, "qwen_recipe", perturbed)
    report = align_checkpoint(fp8, pin_routing=True)
    assert not report.passed and report.layers[1].rel > FP8_TOLERANCES.hidden_rel, report.layers


def test_finetune_from_an_fp8_checkpoint_under_zero3(pairs, short_finetune):
    """ZeRO-3 (in this process) builds the model partitioned and the FP8 bits stream into the partitioned tensors:
    the run has an FP8 base, its first loss is the dequantized reference's within the FP8 loss tolerance, and the
    adapters train."""
    import yaml

    _, fp8 = pairs("qwen3_moe")
    result, reference_first_loss = short_finetune(fp8)
    assert len(result.losses) == 3
    assert abs(result.losses[0] - reference_first_loss) <= FP8_TOLERANCES.loss_abs, (result.losses, reference_first_loss)
    # The FP8 base computes with its dequantized weights, as the reference does: the run says it had an FP8 base.
    assert yaml.safe_load((result.output_dir / "profile.yaml").read_text())["model"]["base_precision"] == "fp8"


@pytest.mark.parametrize("layout", [None, ExpertLayout(expert_parallel=2, expert_parallel_rank=1)],
                         ids=["one_rank", "rank_1_of_2"])
def test_fused_fp8_experts_read_as_stored(pairs, tmp_path, layout):
    """qwen3_next's experts stored fused (mlp.experts.gate_up_proj [E, 2F, D] float8 with gate_up_proj_scale_inv
    [E, 2F/128, D/128], down_proj likewise): our experts hold those bits and scale rows, this rank's rows only, the
    same as from the per-expert layout."""
    _, fp8 = pairs("qwen3_next")
    base = "model.layers.{}.mlp.experts."

    def fuse(tensors):
        for layer in range(2):
            prefix = base.format(layer)
            for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                for suffix in ("", "_scale_inv"):
                    experts = [torch.cat([tensors.pop(f"{prefix}{e}.{p}.weight{suffix}") for p in parts]) for e in range(4)]
                    tensors[f"{prefix}{fused}{suffix}"] = torch.stack(experts)

    directory = _edited(fp8, tmp_path, tensors=fuse)
    fused, _ = _load(directory, "fp8", layout, check_unread=layout is None)
    per_expert, _ = _load(fp8, "fp8", layout, check_unread=layout is None)
    stored = _file_tensors(directory)
    first = 0 if layout is None else 2
    for layer in range(2):
        experts = fused.layers[layer].mlp.experts
        key = base.format(layer) + "gate_up_proj"
        assert torch.equal(experts.w_gate_up, _bits(stored[key][first : first + experts.num_experts]))
        assert torch.equal(experts.w_gate_up_scale_inv, _bits(stored[key + "_scale_inv"][first : first + experts.num_experts]))
        for name, tensor in experts.named_parameters():
            assert torch.equal(tensor, dict(per_expert.layers[layer].mlp.experts.named_parameters())[name]), name


def test_an_fp8_base_is_not_architecture_for_the_hub_config(pairs):
    """A profile with base_precision fp8 writes the same config.json as its bf16 twin (its FP8 layout is stated
    by quantization_config, not by the architecture)."""
    from moe_tune.engine.families.hub_config import hub_config_for_profile

    _, fp8 = pairs("qwen3_moe")
    cfg = model_profile_from_checkpoint(fp8)[2]
    family, config, _ = hub_config_for_profile(cfg)
    assert family.model_types == ("qwen3_moe",)
    assert config == hub_config_for_profile(cfg.model_copy(update={"base_precision": "bf16"}))[1]


def test_align_catches_one_wrong_scale_block(pairs, monkeypatch):
    """One 128 x 128 block of an attention projection read with twice its scale (the block's bits right)."""
    _, fp8 = pairs("qwen3_moe")
    quantized = family_base.take.quantized

    def doubled(self, get):
        value = quantized(self, get)
        if value is not None and self.key == "model.layers.1.self_attn.o_proj.weight":
            scale = value[1].clone()
            scale[0, 0] *= 2
            return value[0], scale
        return value

    monkeypatch.setattr(family_base.take, "quantized", doubled)
    report = align_checkpoint(fp8, pin_routing=True)
    assert not report.passed
    assert report.layers[0].rel <= FP8_TOLERANCES.hidden_rel
    assert report.layers[1].rel > 2 * FP8_TOLERANCES.hidden_rel, report.layers


def test_align_cli_on_fp8_checkpoints(pairs, tmp_path):
    """`moe-tune align` on an FP8 checkpoint: exit 0 under the FP8 tolerances (in the JSON report); a refused
    quantization config: exit 2, one error line naming the field, no traceback."""
    from typer.testing import CliRunner

    from moe_tune.cli import app

    _, fp8 = pairs("qwen3_moe")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["align", "--reference", str(fp8), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["tolerances"] == vars(FP8_TOLERANCES)
    directory = _edited(fp8, tmp_path, config={"quantization_config": {**FP8, "weight_block_size": [64, 64]}})
    result = CliRunner().invoke(app, ["align", "--reference", str(directory)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "quantization_config.weight_block_size ([64, 64]) is not read" in lines[0], lines


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "deepseek_v3", "qwen3_5_moe"])
def test_fp8_tensors_stand_for_the_weights_read_dequantized(pairs, name):
    """Every FP8 tensor of ours (bits and scale rows, whatever recipe took it: whole, grouped rows, stacked experts)
    dequantizes to exactly what the same checkpoint loads as with base_precision bf16."""
    from moe_tune.engine.model.fp8 import Fp8Linear
    from moe_tune.engine.model.moe import GroupedExperts

    _, fp8 = pairs(name)
    ours, _ = _load(fp8, "fp8")
    floating = dict(_load(fp8, "bf16")[0].named_parameters())
    checked = 0
    for module_name, module in ours.named_modules():
        if isinstance(module, Fp8Linear):
            assert torch.equal(module.dequantized(), floating[f"{module_name}.weight"]), module_name
            checked += 1
        elif isinstance(module, GroupedExperts) and module.fp8:
            twin = module.dequantized_twin()
            for param in ("w_gate_up", "w_down"):
                assert torch.equal(getattr(twin, param), floating[f"{module_name}.{param}"]), (module_name, param)
            checked += 1
    assert checked >= 8


def test_onboard_aligns_fp8_checkpoints_with_pinned_experts(pairs):
    # onboard's align stage pins the experts of an FP8 checkpoint to the reference's, and passes.
    from moe_tune.engine.onboard import run_align

    _, fp8 = pairs("qwen3_next")
    stage = run_align(fp8)
    assert stage.status == "ok", stage.lines


def test_a_shard_read_whole_is_released_when_reading_moves_on(tmp_path):
    # Streaming a large checkpoint: the reader keeps about one shard mapped, not every shard it has opened.
    from safetensors.torch import save_file

    from moe_tune.engine.families.checkpoint import CheckpointReader

    shards = {"a.safetensors": ["x", "y"], "b.safetensors": ["z"], "c.safetensors": ["w"]}
    weight_map = {}
    for name, keys in shards.items():
        save_file({k: torch.full((4,), float(len(k))) for k in keys}, str(tmp_path / name))
        weight_map.update({k: name for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with CheckpointReader(tmp_path) as reader:
        reader.get("x")
        reader.get("z")
        assert "a.safetensors" in reader.open_shards  # y not read yet: kept
        reader.get("y")
        reader.get("w")
        assert "a.safetensors" not in reader.open_shards and "c.safetensors" in reader.open_shards
        assert reader.dtype("x") == "F32" and torch.equal(reader.get("x"), torch.full((4,), 1.0))  # reopened on demand
        assert reader.unread_patterns() == []
    assert reader.open_shards == []
