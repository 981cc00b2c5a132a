"""What transformers reads from a checkpoint but no family maps onto our model: config.json's architectures, dtype,
max_position_embeddings and head_dim, an LM head stored beside a tied embedding, the dtype of stored weights.

Each bad value is refused in one line naming the file, the key, the value and the rule. Where the families read a
value, transformers is the reference: a value moe-tune accepts gives the model transformers builds from it, and a
value transformers fails on (or reads as another model) is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_tune.engine.families import (
    UnsupportedModel,
    check_checkpoint,
    family_for,
    load_checkpoint_weights,
    model_profile_from_checkpoint,
)
from moe_tune.engine.families.base import show
from moe_tune.engine.model.model import build_model
from moe_tune.profiles.schema import ModelProfile

import hf_tiny
from hf_tiny import checkpoint_job, mxfp4_checkpoint, save_tiny_checkpoint

FAMILIES = [
    "qwen3_moe", "deepseek_v3", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
    "qwen4_exp_text", "mixtral", "glm4_moe", "gpt_oss", "kimi_linear",
]  # fmt: skip
# Vision-language checkpoints: the language model's keys are under text_config.
NESTED = ("qwen3_5_moe", "qwen4_exp")
DTYPE_RULE = "must name a floating-point torch dtype (float32, bfloat16, float16, ...)"
FLOAT_RULE = "a weight must be stored as floating point (F32, BF16, F16, or F8_E4M3 with its block scales)"
ABSENT = object()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`written(family)` -> the saved tiny checkpoint of that family (built once per module)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            model = getattr(hf_tiny, f"tiny_{family}")()
            cache[family] = save_tiny_checkpoint(model, tmp_path_factory.mktemp(family) / "checkpoint")
        return cache[family]

    return get


def section_of(family: str, key: str) -> str:
    """Where `family`'s config.json holds `key` (the prefix of its lines)."""
    return "text_config." if family in NESTED and key in ("max_position_embeddings", "head_dim") else ""


def config_only(written, directory: Path, family: str, key: str, value) -> Path:
    """A folder holding `family`'s config.json with `key` set to `value` (ABSENT: removed) where the family reads it."""
    config = json.loads((written(family) / "config.json").read_text())
    where = config["text_config"] if section_of(family, key) else config
    where.pop(key, None)
    if value is not ABSENT:
        where[key] = value
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def problems_of(directory: Path) -> list[str]:
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    return err.value.problems


# ---- config.json keys no family maps --------------------------------------------------------------------------

# (key, value, the rule it breaks), each with its neighbours.
BAD_VALUES = [
    ("max_position_embeddings", 0, "must be >= 1"),
    ("max_position_embeddings", -1, "must be >= 1"),
    ("max_position_embeddings", 1.5, "must be an integer"),
    ("max_position_embeddings", 4096.0, "must be an integer"),  # JSON 4096.0 is a float
    ("max_position_embeddings", "4096", "must be an integer"),
    ("max_position_embeddings", True, "must be an integer"),  # JSON true is not 1
    ("max_position_embeddings", 2**31, "must be <= 2147483647"),
    ("dtype", "float17", DTYPE_RULE),
    ("dtype", "int8", DTYPE_RULE),  # a torch dtype, not a floating one
    ("dtype", "bool", DTYPE_RULE),
    ("dtype", "auto", DTYPE_RULE),  # from_pretrained's argument, not a config value: getattr(torch, 'auto') fails
    ("dtype", "Tensor", DTYPE_RULE),  # a torch attribute that is no dtype
    ("dtype", 3, DTYPE_RULE),
    ("dtype", True, DTYPE_RULE),
    ("dtype", ["bfloat16"], DTYPE_RULE),
    ("torch_dtype", "float17", DTYPE_RULE),
    ("torch_dtype", "int64", DTYPE_RULE),
    ("torch_dtype", "", DTYPE_RULE),
    ("architectures", "Qwen3MoeForCausalLM", "must be a list of strings"),
    ("architectures", ["Qwen3MoeForCausalLM", 3], "must be a list of strings: entry [1] (3) must be a string"),
    ("architectures", [None], "must be a list of strings: entry [0] (null) must be a string"),
    ("architectures", {"0": "Qwen3MoeForCausalLM"}, "must be a list of strings"),
    ("head_dim", 0, "must be >= 2"),
    ("head_dim", -8, "must be >= 2"),
    ("head_dim", 1, "must be >= 2"),
    ("head_dim", "8", "must be an integer"),
    ("head_dim", 8.0, "must be an integer"),
]
GOOD_VALUES = [
    ("max_position_embeddings", 1), ("max_position_embeddings", 2**31 - 1), ("max_position_embeddings", None),
    ("max_position_embeddings", ABSENT),
    ("dtype", "float32"), ("dtype", "bfloat16"), ("dtype", "float16"), ("dtype", "float8_e4m3fn"), ("dtype", "half"),
    ("dtype", None), ("dtype", ABSENT), ("torch_dtype", "bfloat16"), ("torch_dtype", None),
    ("architectures", ["Qwen3MoeForCausalLM"]), ("architectures", []), ("architectures", None),
    ("architectures", ABSENT),
]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key, value, rule", BAD_VALUES, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD_VALUES])
def test_bad_value_is_one_line_naming_key_value_and_rule(written, tmp_path, family, key, value, rule):
    directory = config_only(written, tmp_path / "config-only", family, key, value)
    assert problems_of(directory) == [f"config.json: {section_of(family, key)}{key} ({show(value)}) {rule}"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key, value", GOOD_VALUES, ids=[f"{k}={'absent' if v is ABSENT else repr(v)}"[:40]
                                                          for k, v in GOOD_VALUES])
def test_good_value_reads_the_same_model(written, tmp_path, family, key, value):
    directory = config_only(written, tmp_path / "config-only", family, key, value)
    assert model_profile_from_checkpoint(directory)[2].model_copy(update={"checkpoint": None}) == (
        model_profile_from_checkpoint(written(family))[2].model_copy(update={"checkpoint": None})
    )


def test_bad_dtype_in_a_sub_config_names_its_section(written, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    config = json.loads((written("qwen3_5_moe") / "config.json").read_text())
    config["text_config"]["dtype"] = "float17"
    config["vision_config"]["torch_dtype"] = "int8"
    (directory / "config.json").write_text(json.dumps(config))
    assert problems_of(directory) == [f"config.json: text_config.dtype ('float17') {DTYPE_RULE}",
                                      f"config.json: vision_config.torch_dtype ('int8') {DTYPE_RULE}"]


# ---- head_dim against transformers ------------------------------------------------------------------------------

HEAD_DIM_FAMILIES = ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text",
                     "qwen4_exp_text", "deepseek_v3", "deepseek_v32", "kimi_linear"]
HELD, HELD_PLUS_4 = object(), object()  # the head_dim the checkpoint holds; another integer
# Absent, null, out of range, of another type, the checkpoint's own value and another integer.
HEAD_DIM_VALUES = {"absent": ABSENT, "null": None, "-8": -8, "0": 0, "2": 2, "8.0": 8.0, "'8'": "8", "true": True,
                   "held": HELD, "held+4": HELD_PLUS_4}


def transformers_dims(model: torch.nn.Module) -> tuple[set[int], int | None]:
    """(the head dims of transformers' softmax attention modules, the dims its rotary embedding turns or None)."""
    heads = {m.head_dim for m in model.modules()
             if type(m).__name__.endswith("Attention") and hasattr(m, "o_proj") and hasattr(m, "head_dim")}
    rotary = getattr(getattr(model.model, "rotary_emb", None), "inv_freq", None)
    return heads, None if rotary is None else 2 * rotary.numel()


@pytest.mark.parametrize("family", HEAD_DIM_FAMILIES)
@pytest.mark.parametrize("value", list(HEAD_DIM_VALUES.values()), ids=list(HEAD_DIM_VALUES))
def test_head_dim_is_read_as_transformers_reads_it(written, tmp_path, family, value):
    """Ours accepts -> transformers builds and runs the same dims; transformers fails -> ours refuses."""
    import transformers

    transformers.logging.set_verbosity_error()
    held = json.loads((written(family) / "config.json").read_text())["head_dim"]
    value = held if value is HELD else held + 4 if value is HELD_PLUS_4 else value
    directory = config_only(written, tmp_path / "config-only", family, "head_dim", value)
    try:
        ours = model_profile_from_checkpoint(directory)[2]
    except UnsupportedModel as err:
        ours, refusal = None, err.problems
    edited = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, family_for(edited).reference_class)
    try:
        torch.manual_seed(0)
        theirs = cls(cls.config_class.from_dict(edited)).eval()
        with torch.no_grad():
            theirs(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    except Exception as err:  # transformers' own failure: a config error or a traceback in the forward
        assert ours is None, f"transformers fails ({type(err).__name__}: {str(err)[:80]}) where ours reads {value!r}"
        assert len(refusal) == 1 and "head_dim" in refusal[0], refusal
        return
    if ours is None:
        # One of our own rules (an odd rotary dim) or a value transformers reads as another model.
        assert len(refusal) == 1 and "head_dim" in refusal[0], refusal
        return
    heads, rotary = transformers_dims(theirs)
    if ours.mla is not None:
        assert rotary in (None, ours.mla.qk_rope_head_dim), (rotary, ours.mla)
    else:
        assert heads == {ours.head_dim}, (heads, ours.head_dim)


# ---- an LM head stored beside a tied embedding -------------------------------------------------------------------

TIED_FAMILIES = ["qwen3_moe", "deepseek_v3", "qwen3_5_moe"]


def stored_head(kind: str, embed: torch.Tensor) -> torch.Tensor | None:
    """The lm_head.weight stored beside the embedding `embed` (None: none stored)."""
    if kind == "none":
        return None
    if kind in ("copy", "copy-bf16"):
        return embed.clone() if kind == "copy" else embed.to(torch.bfloat16)
    if kind == "one-element":
        head = embed.clone()
        head[3, 5] += 1e-3
        return head
    if kind == "own":
        return torch.randn(embed.shape, generator=torch.Generator().manual_seed(3)) * 0.02
    if kind == "extra-row":
        return torch.cat([embed, embed[:1]])
    raise AssertionError(kind)


def tied_checkpoint(written, directory: Path, family: str, kind: str) -> tuple[Path, str]:
    """`family`'s checkpoint with tie_word_embeddings true and lm_head.weight stored as `kind` says: (the folder,
    the embedding's key). Its embedding holds bf16 values, so a bf16 copy is equal to it."""
    shutil.copytree(written(family), directory)
    config = json.loads((directory / "config.json").read_text())
    for section in (config, config.get("text_config", {})):
        section["tie_word_embeddings"] = True
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    embed_key = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[embed_key] = tensors[embed_key].to(torch.bfloat16).float()
    head = stored_head(kind, tensors[embed_key])
    tensors.pop("lm_head.weight")
    if head is not None:
        tensors["lm_head.weight"] = head
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, embed_key


HEAD_KINDS = ["none", "copy", "copy-bf16", "one-element", "own", "extra-row"]


@pytest.mark.parametrize("family", TIED_FAMILIES)
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_tied_head_stored_anyway_is_tied_only_when_transformers_ties_it(written, tmp_path, family, kind):
    import transformers

    transformers.logging.set_verbosity_error()
    directory, embed_key = tied_checkpoint(written, tmp_path / "ckpt", family, kind)
    refusal = (f"config.json: tie_word_embeddings (True) ties lm_head.weight to {embed_key}, but "
               f"{directory / 'model.safetensors'} holds an lm_head.weight that differs from it (transformers loads "
               "such a checkpoint untied): set tie_word_embeddings to false to load both, or drop lm_head.weight to "
               "tie them")
    family_ = family_for(json.loads((directory / "config.json").read_text()))
    try:
        theirs = getattr(transformers, family_.reference_class).from_pretrained(
            str(directory), dtype=torch.float32, local_files_only=True)
        their_head = theirs.get_output_embeddings().weight
        is_tied_by_transformers = torch.equal(their_head, theirs.get_input_embeddings().weight)
    except Exception:  # a head of another shape than the vocabulary
        is_tied_by_transformers = False
    _, _, cfg = model_profile_from_checkpoint(directory)
    model = build_model(cfg)
    if not is_tied_by_transformers:
        with pytest.raises(UnsupportedModel) as err:
            check_checkpoint(directory)
        assert err.value.problems == [refusal]
        with pytest.raises(UnsupportedModel) as err:
            load_checkpoint_weights(model, cfg)
        assert err.value.problems == [refusal]
        return
    check_checkpoint(directory)
    load_checkpoint_weights(model, cfg)  # nothing reported unread: an equal copy counts as the tied head
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, their_head)


def test_a_tied_head_is_compared_once_per_unchanged_file(written, tmp_path, monkeypatch):
    # check_checkpoint and the load after it read the stored head once; a file changed since is compared again.
    import os

    from moe_tune.engine.families.checkpoint import WeightGetter

    directory, _ = tied_checkpoint(written, tmp_path / "ckpt", "qwen3_moe", "copy")
    head_reads = []
    rows = WeightGetter.rows

    def counted(self, key, start, stop):
        if key == "lm_head.weight":
            head_reads.append(start)
        return rows(self, key, start, stop)

    monkeypatch.setattr(WeightGetter, "rows", counted)
    _, _, cfg = model_profile_from_checkpoint(directory)
    check_checkpoint(directory)
    first = len(head_reads)
    assert first > 0
    load_checkpoint_weights(build_model(cfg), cfg)  # nothing unread: the compared copy counts as read
    assert len(head_reads) == first
    weights = directory / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    check_checkpoint(directory)
    assert len(head_reads) == 2 * first


# ---- weights stored as integers --------------------------------------------------------------------------------

# (family, a stored tensor of it, base precision of our model): a plain weight, a norm, one expert's piece stacked
# with floating pieces, a fused expert tensor, a bias buffer, an expert quantized at load (base fp8).
INTEGER_CASES = [
    ("qwen3_moe", "model.layers.0.self_attn.q_proj.weight", "bf16"),
    ("qwen3_moe", "model.layers.0.input_layernorm.weight", "bf16"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight", "bf16"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight", "fp8"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj", "bf16"),
    ("gpt_oss", "model.layers.0.self_attn.sinks", "bf16"),
    ("deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias", "bf16"),
]
STORED = {torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def stored_as(written, directory: Path, family: str, dtype: torch.dtype, keys: list[str]) -> Path:
    """`family`'s checkpoint with the tensors `keys` stored in `dtype` (integers: the values times 100, rounded)."""
    shutil.copytree(written(family), directory)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for key in keys:
        tensors[key] = (tensors[key] > 0) if dtype == torch.bool else (
            tensors[key] if dtype.is_floating_point else tensors[key] * 100).to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


def load(directory: Path, base: str) -> tuple[torch.nn.Module, ModelProfile]:
    _, _, cfg = model_profile_from_checkpoint(directory)
    cfg = cfg.model_copy(update={"base_precision": base})
    model = build_model(cfg)
    load_checkpoint_weights(model, cfg)
    return model, cfg


@pytest.mark.parametrize("family, key, base", INTEGER_CASES,
                         ids=[f"{f}-{k.split('.', 3)[-1]}-{b}" for f, k, b in INTEGER_CASES])
@pytest.mark.parametrize("dtype", list(STORED), ids=[str(d).removeprefix("torch.") for d in STORED])
def test_weight_stored_as_integers_is_refused_floats_are_read(written, tmp_path, family, key, base, dtype):
    directory = stored_as(written, tmp_path / "ckpt", family, dtype, [key])
    if dtype.is_floating_point:
        model, _ = load(directory, base)
        reference, _ = load(written(family), base)
        # The same model as from the fp32 checkpoint, up to the stored dtype's rounding of that one tensor (FP8
        # bits and scales quantized from a rounded expert may differ: compared only when nothing was rounded).
        ours, theirs = model.state_dict(), reference.state_dict()
        tolerance = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
        for name in theirs:
            if theirs[name].is_floating_point():
                torch.testing.assert_close(ours[name], theirs[name], rtol=tolerance, atol=tolerance,
                                           msg=lambda text, name=name: f"{name}: {text}")
            elif dtype == torch.float32:
                assert torch.equal(ours[name], theirs[name]), name
        return
    with pytest.raises(UnsupportedModel) as err:
        load(directory, base)
    assert err.value.problems == [f"{directory / 'model.safetensors'}: tensor {key} is {STORED[dtype]}: {FLOAT_RULE}"]


def test_every_expert_stored_as_integers_is_one_line(written, tmp_path):
    keys = [f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in (1, 2) for e in range(7)]
    directory = stored_as(written, tmp_path / "ckpt", "qwen3_moe", torch.int32, keys)
    with pytest.raises(UnsupportedModel) as err:
        load(directory, "bf16")
    assert err.value.problems == [f"{directory / 'model.safetensors'}: tensor {min(keys)} is I32 (and 13 more like "
                                  f"it): {FLOAT_RULE}"]


def test_packed_mxfp4_bytes_are_still_read(tmp_path):
    """gpt_oss's MXFP4 experts are uint8 blocks and scales its recipe decodes: not integer weights."""
    from moe_tune.engine.families.gpt_oss import dequantize_mxfp4

    # Expert dims a multiple of the 32-value MXFP4 block.
    plain = save_tiny_checkpoint(hf_tiny.tiny_gpt_oss(intermediate_size=32), tmp_path / "plain")
    directory = mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    model, _ = load(directory, "bf16")
    stored = load_file(str(directory / "model.safetensors"))
    down = dequantize_mxfp4(stored["model.layers.0.mlp.experts.down_proj_blocks"],
                            stored["model.layers.0.mlp.experts.down_proj_scales"])
    assert torch.equal(model.layers[0].mlp.experts.w_down, down)


# ---- through the command line -----------------------------------------------------------------------------------


def test_validate_cli_exits_2_one_line_per_value(written, tmp_path):
    from moe_tune.cli import app

    directory, embed_key = tied_checkpoint(written, tmp_path / "ckpt", "qwen3_moe", "own")
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures="Qwen3MoeForCausalLM", dtype="float17", max_position_embeddings=0)
    (directory / "config.json").write_text(json.dumps(config))
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(checkpoint_job(directory, tmp_path, "values")))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    where = f"error: model.checkpoint ('{directory}'): config.json: "
    assert result.stderr.strip().splitlines() == [
        f"{where}architectures ('Qwen3MoeForCausalLM') must be a list of strings",
        f"{where}dtype ('float17') {DTYPE_RULE}",
        f"{where}max_position_embeddings (0) must be >= 1",
    ]
    assert "Traceback" not in result.output
    # The values fixed, the tied head that differs from the embedding is the one line left.
    config.update(architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16", max_position_embeddings=128)
    (directory / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{where}tie_word_embeddings (True) ties lm_head.weight to "
                                                   f"{embed_key}, but "), lines
    assert "Traceback" not in result.output
