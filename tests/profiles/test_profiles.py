"""Profile loading: every kind of bad input gives one line naming the field, the value and the rule."""

import json
from pathlib import Path

import pytest
import yaml

from moe_tune.profiles import JobProfile, ProfileError, json_schema, load_profile, resolve_profile_path
from moe_tune.profiles import schema
from moe_tune.profiles.schema import Strict

TINY = resolve_profile_path("tiny")


def tiny_raw() -> dict:
    return yaml.safe_load(TINY.read_text())


def write(tmp_path: Path, raw: dict | str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def problems_of(path, overrides=()) -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile(path, list(overrides))
    return info.value.problems


def test_shipped_tiny_is_valid_and_hybrid():
    profile = load_profile("tiny")
    kinds = [layer.attention for layer in profile.model.layers]
    assert kinds.count("linear") == 3 and kinds.count("sparse") == 1
    assert profile.lora.enabled and profile.lora.experts
    assert profile.data.path is None


def test_shipped_name_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_profile_path("profiles/tiny.yaml") == TINY
    assert load_profile("tiny").name == "tiny"


@pytest.mark.parametrize("given", ["tiny.yml", "tiny.json", "tiny/", "./tiny.yaml", "profiles/tiny", "/nowhere/tiny",
                                   "/nonexistent/profiles/tiny.yaml", "x/profiles/tiny.yaml", "x/profiles/tiny.txt"])
def test_a_missing_path_is_no_shipped_profile(tmp_path, monkeypatch, given):
    """Only a name (`tiny`, `tiny.yaml`) or the repository's `profiles/NAME.yaml` means a shipped profile: a user's
    own file that is missing (another suffix, another folder) is refused, never replaced by the installed one."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError) as err:
        resolve_profile_path(given)
    assert err.value.problems[0].startswith(f"{given}: no such file, nor a shipped profile (shipped: ")
    assert resolve_profile_path("tiny.yaml") == resolve_profile_path("tiny") == TINY


def test_unreadable_file():
    (line,) = problems_of("/nonexistent/dir/p.yaml")
    assert line.startswith("/nonexistent/dir/p.yaml: no such file")


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\nmodel: [unclosed\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:3:1: YAML syntax error")


def test_not_a_mapping(tmp_path):
    (line,) = problems_of(write(tmp_path, "- a\n- b\n"))
    assert "must be a YAML mapping" in line and "list" in line


def test_every_error_listed_at_once(tmp_path):
    raw = tiny_raw()
    raw["model"]["hiden_size"] = 3  # unknown key
    raw["train"]["lr"] = "fast"  # wrong type
    raw["train"]["steps"] = 0  # out of range
    raw["model"]["moe"]["top_k"] = 9  # inconsistent with num_experts 8
    raw["data"]["path"] = str(tmp_path / "missing.jsonl")
    problems = problems_of(write(tmp_path, raw))
    assert problems == [
        "model.moe.top_k (9) must be <= model.moe.num_experts (8)",
        "model.hiden_size (3): unknown key (not in the schema: moe-tune schema)",
        f"data.path ('{tmp_path / 'missing.jsonl'}') must be an existing file",
        "train.steps (0): input should be greater than or equal to 1",
        "train.lr ('fast'): input should be a valid number, unable to parse string as a number",
    ]


@pytest.mark.parametrize("content, what", [("", "the file is empty"), ("\n  \n", "the file holds only whitespace"),
                                           ("\ufeff\r\n", "the file holds only whitespace")])  # fmt: skip
def test_empty_dataset(tmp_path, content, what):
    data = tmp_path / "empty.jsonl"
    data.write_text(content)
    (line,) = problems_of(TINY, [f"data.path={data}"])
    assert line == f"data.path ('{data}') must hold at least one record ({what})"


def test_missing_required_field(tmp_path):
    raw = tiny_raw()
    del raw["train"]["lr"]
    assert problems_of(write(tmp_path, raw)) == ["train.lr: required field is missing"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.linear_attention.num_value_heads=3", "model.linear_attention.num_value_heads (3) must be a multiple"),
        ("model.num_key_value_heads=3", "model.num_attention_heads (4) must be a multiple of model.num_key_value_heads"),
        ("model.sparse_attention.block_size=5", "model.sparse_attention.topk (32) must be a multiple of"),
        ("train.warmup_steps=300", "train.warmup_steps (300) must be < train.steps (300)"),
        ("model.vocab_size=100", "model.vocab_size (100) must be >= 259 for data.tokenizer 'byte'"),
        ("model.layers=[{attention: full, mlp: dense}]", "model.intermediate_size (0) must be > 0"),
        ("lora.r=0", "lora.r (0): input should be greater than or equal to 1"),
        ("parallel={zero_stage: 1, expert_parallel: 2}",
         "parallel.zero_stage (1) must be 3 when parallel.expert_parallel (2) > 1 (stages 0-2 do not reduce sharded "
         "experts' gradients)"),
        ("parallel={zero_stage: 0, offload_optimizer: true}",
         "parallel.offload_optimizer (True) needs parallel.zero_stage >= 1 (got 0): stage 0 has no ZeRO optimizer"),
    ],
    ids=["value-heads", "gqa", "block-budget", "warmup", "vocab", "dense-needs-size", "lora-rank", "ep-needs-zero3",
         "offload-needs-zero"],
)
def test_rule_messages(override, expected):
    problems = problems_of(TINY, [override])
    assert any(p.startswith(expected) for p in problems), problems


def test_layer_kind_in_yaml(tmp_path):
    raw = tiny_raw()
    raw["model"]["layers"][0]["attention"] = "conv"
    (line,) = problems_of(write(tmp_path, raw))
    # The list of kinds grows with the model families; its start is stable.
    assert line.startswith("model.layers.0.attention ('conv'): input should be 'linear', 'sparse', 'full'")


def test_overrides_parse_yaml_values():
    profile = load_profile(TINY, ["train.lr=1e-3", "lora.target_modules=[q_proj]", "train.precision=bf16"])
    assert profile.train.lr == 1e-3
    assert profile.lora.target_modules == ["q_proj"]
    assert profile.train.precision == "bf16"


def test_override_into_a_scalar_is_refused():
    (line,) = problems_of(TINY, ["train.lr.x=1"])
    assert line == "--set 'train.lr.x=1': train.lr is not a section"


def test_override_without_equals():
    (line,) = problems_of(TINY, ["train.lr"])
    assert line == "--set 'train.lr': must read path.to.field=value"


def _models(model: type[Strict]):
    yield model
    for field in model.model_fields.values():
        for candidate in getattr(field.annotation, "__args__", (field.annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, Strict):
                yield from _models(candidate)
            for inner in getattr(candidate, "__args__", ()):
                if isinstance(inner, type) and issubclass(inner, Strict):
                    yield from _models(inner)


def test_every_field_is_described_and_extra_forbidden():
    seen = set(_models(JobProfile))
    assert len(seen) >= 10
    for model in seen:
        assert model.model_config["extra"] == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_json_schema_is_serialisable_and_complete():
    schema = json_schema()
    text = json.dumps(schema)
    assert set(schema["required"]) == {"name", "model", "data", "train", "output"}
    assert "expert_intermediate_size" in text


def test_checkpoint_model_section(tmp_path):
    from moe_tune.profiles import ProfileError, load_profile

    missing = tmp_path / "nowhere"
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"model={{checkpoint: {missing}}}", f"data.path={tmp_path / 'd.jsonl'}"])
    assert f"model.checkpoint ('{missing}') must be an existing directory" in err.value.problems
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"model={{checkpoint: {tmp_path / 'ckpt'}}}"])
    assert f"model.checkpoint ('{tmp_path / 'ckpt'}') must hold a config.json" in err.value.problems
    # With the built-in corpus (byte-level) a checkpoint's vocabulary cannot be assumed to fit.
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"model={{checkpoint: {tmp_path / 'ckpt'}}}"])
    assert err.value.problems == ["data.path (None) must be set with model.checkpoint (the built-in corpus is byte-level)"]


# tiny with two linear-attention layers: the context-parallel rules below do not depend on the token mixers.
CP_LAYERS = "model.layers=[{attention: linear, mlp: moe}, {attention: linear, mlp: moe}]"


def test_context_parallel_defaults_to_one_and_takes_a_shareable_profile():
    assert load_profile(TINY).parallel.context_parallel == 1
    assert load_profile(TINY, [CP_LAYERS, "parallel.context_parallel=4"]).parallel.context_parallel == 4


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.context_parallel=0"], "parallel.context_parallel (0): input should be greater than or equal to 1"),
        ([CP_LAYERS, "parallel.context_parallel=3"],
         "data.seq_len (128) must be a multiple of parallel.context_parallel (3): each rank holds an equal share"),
        ([CP_LAYERS, "parallel.context_parallel=4", "data.seq_len=8", "train.micro_batch_size=1"],
         "parallel.context_parallel (4) leaves 2 tokens a rank (train.micro_batch_size x data.seq_len / 4): fewer "
         "than the short convolution's reach (3)"),
        ([CP_LAYERS, "parallel.context_parallel=2", "model.moe.capacity_factor=1.25"],
         "model.moe.capacity_factor (1.25) must be 0 with parallel.context_parallel (2): capacity positions"),
        ([CP_LAYERS, "parallel.context_parallel=2", "memory.sequence_chunk_tokens=32"],
         "memory.sequence_chunk_tokens (32) must be unset with parallel.context_parallel (2) and "
         "model.moe.aux_loss_coef (0.01) > 0"),
    ],
    ids=["zero", "seq-len", "conv-reach", "capacity", "chunks-with-aux"],
)
def test_context_parallel_rules(overrides, expected):
    (line,) = problems_of(TINY, overrides)
    assert line.startswith(expected), line


def test_context_parallel_takes_every_token_mixer():
    from moe_tune.profiles.schema import LayerSpec

    kinds = LayerSpec.model_fields["attention"].annotation.__args__
    assert load_profile(TINY, ["parallel.context_parallel=2"]).parallel.context_parallel == 2
    assert set(kinds) == set(schema.CONTEXT_PARALLEL_MIXERS)


def test_context_parallel_refuses_a_token_mixer_that_does_not_exchange(monkeypatch):
    monkeypatch.setattr(schema, "CONTEXT_PARALLEL_MIXERS", ("linear",))
    (line,) = problems_of(TINY, ["parallel.context_parallel=2"])
    assert line.startswith("model.layers[3].attention ('sparse') must be one of linear with "
                           "parallel.context_parallel (2): those exchange what crosses the cut between ranks")


def test_context_parallel_takes_sequence_chunks_without_aux_loss():
    profile = load_profile(TINY, [CP_LAYERS, "parallel.context_parallel=2", "memory.sequence_chunk_tokens=32",
                                  "model.moe.aux_loss_coef=0"])  # fmt: skip
    assert profile.memory.sequence_chunk_tokens == 32


def test_context_parallel_refuses_images():
    problems = problems_of("tiny-vl", ["parallel.context_parallel=2"])
    assert any(p.startswith("parallel.context_parallel (2) needs a text-only model: model.vision") for p in problems)


@pytest.mark.parametrize("lora, field, name", [
    (["lora.modules_to_save=[lm_head]"], "modules_to_save", "lm_head"),
    (["lora.modules_to_save=[embed_tokens]"], "modules_to_save", "embed_tokens"),
    (["lora.target_modules=[q_proj, lm_head]"], "target_modules", "lm_head"),
    (["lora.modules_to_save=[model.embed_tokens]"], "modules_to_save", "embed_tokens"),  # PEFT matches name ends
])  # fmt: skip
def test_a_tied_head_trained_apart_from_its_embedding_is_refused(lora, field, name):
    """PEFT trains a modules_to_save copy, or an adapter, on one of the two names of a tied weight: the head would
    part from the embedding, which the exported model (one matrix for both) cannot hold."""
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", ["model.tie_word_embeddings=true", *lora])
    line = next(line for line in err.value.problems if line.startswith(f"lora.{field} ("))
    assert f"): {name} shares its weight with " in line
    assert line.endswith(f"which a model of tied weights cannot hold; leave {name} out")
    # Untied, or with full fine-tuning (one weight trained for both), the same settings load.
    load_profile("tiny", lora)
    load_profile("tiny", ["model.tie_word_embeddings=true", "lora.enabled=false", *lora])


def test_a_checkpoint_that_ties_its_head_is_refused_with_lm_head_trained_apart(tmp_path):
    import hf_tiny
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_moe(tie_word_embeddings=True), tmp_path / "ck")
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    raw = {"name": "tied", "model": {"checkpoint": str(checkpoint)},
           "data": {"path": str(tmp_path / "data.jsonl"), "tokenizer": "byte", "seq_len": 32},
           "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "output": {"dir": str(tmp_path / "run")},
           "lora": {"modules_to_save": ["lm_head"]}}  # fmt: skip
    with pytest.raises(ProfileError) as err:
        resolve_job(validate_profile(raw))
    assert err.value.problems[0].startswith("lora.modules_to_save (['lm_head']): lm_head shares its weight with")


@pytest.mark.parametrize("name", ["tiny", "tiny-vl", "bench-qwen3-next", "bench-qwen3-moe", "seed-2p8t"])
def test_shipped_profiles_name_no_ignored_setting(name):
    from moe_tune.profiles.schema import ignored_setting_notes

    assert ignored_setting_notes(load_profile(name)) == []


NO_VISION = "the model has no vision tower (model.vision)"


@pytest.mark.parametrize("profile, overrides, expected", [
    ("tiny", ["data.corpus_documents=50"], []),
    ("tiny", ["data.path={data}", "data.corpus_documents=50"],
     ["note: data.corpus_documents is ignored: data.path is set (the built-in corpus is made only without it)"]),
    ("tiny-vl", ["data.sources=[{{path: {data}}}]"],
     ["note: data.corpus, data.corpus_documents are ignored: data.sources is set (the built-in corpus is made only "
      "without it)"]),
    ("tiny", ["data.image_min_pixels=64", "data.image_max_pixels=4096", "data.bad_images=skip"],
     [f"note: data.image_min_pixels, data.image_max_pixels, data.bad_images are ignored: {NO_VISION}"]),
    ("tiny", ["lora.vision_tower=lora"], [f"note: lora.vision_tower is ignored: {NO_VISION}"]),
    ("tiny", ["lora.vision_merger=frozen", "lora.enabled=false"],
     [f"note: lora.vision_merger is ignored: {NO_VISION}",
      "note: lora.r, lora.alpha, lora.target_modules, lora.experts, lora.modules_to_save are ignored: lora.enabled is "
      "false (full fine-tuning)"]),
    ("tiny-vl", ["lora.vision_tower=trained", "data.image_max_pixels=4096", "lora.enabled=false"],
     ["note: lora.r, lora.alpha, lora.target_modules, lora.experts, lora.modules_to_save are ignored: lora.enabled is "
      "false (full fine-tuning)"]),
])  # fmt: skip
def test_settings_that_do_nothing_in_the_run_are_noted(tmp_path, profile, overrides, expected):
    from moe_tune.profiles.schema import ignored_setting_notes

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one document"}\n')
    job = load_profile(profile, [o.format(data=data) for o in overrides])
    assert ignored_setting_notes(job) == expected


def test_full_fine_tuning_of_a_profile_naming_no_lora_setting_notes_nothing(tmp_path):
    from moe_tune.profiles import validate_profile
    from moe_tune.profiles.schema import ignored_setting_notes

    raw = yaml.safe_load(TINY.read_text())
    raw["lora"] = {"enabled": False}
    assert ignored_setting_notes(validate_profile(raw)) == []
