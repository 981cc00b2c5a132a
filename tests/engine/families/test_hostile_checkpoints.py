"""Untrusted Hugging Face checkpoint folders: every bad config.json value is one line naming its key, weight files
stay inside the checkpoint folder, pickles are never opened, damaged files are named; no traceback, all at once.

The tiny checkpoints are written once per module; each case edits a copy of config.json or of the weight index."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moe_tune.engine.families import UnsupportedModel, check_checkpoint, model_profile_from_checkpoint, resolve_job
from moe_tune.engine.families import checkpoint as checkpoint_module
from moe_tune.engine.families.base import MAX_LAYERS, MAX_SIZE
from moe_tune.engine.families.checkpoint import CheckpointReader, read_config
from moe_tune.profiles import ProfileError, validate_profile

from hf_tiny import (
    checkpoint_job,
    save_tiny_checkpoint,
    tiny_deepseek_v3,
    tiny_qwen3_5_moe,
    tiny_qwen3_moe,
    tiny_qwen3_next,
)

BUILDERS = {
    "qwen3_moe": tiny_qwen3_moe,
    "deepseek_v3": tiny_deepseek_v3,
    "qwen3_next": tiny_qwen3_next,
    "qwen3_5_moe": tiny_qwen3_5_moe,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`written(family)` -> the saved tiny checkpoint of that family (built once per module)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_tiny_checkpoint(BUILDERS[family](), tmp_path_factory.mktemp(family) / "checkpoint")
        return cache[family]

    return get


def config_of(written, family: str) -> dict:
    return json.loads((written(family) / "config.json").read_text())


def problems_of(directory: Path) -> list[str]:
    with pytest.raises(UnsupportedModel) as err:
        check_checkpoint(directory)
    return err.value.problems


def edited_config(written, tmp_path: Path, family: str, edit) -> list[str]:
    """The problems of a copy of `family`'s checkpoint whose config.json went through `edit` (a function of the
    dict)."""
    directory = shutil.copytree(written(family), tmp_path / "edited")
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    return problems_of(directory)


# ---- config.json values ----------------------------------------------------------------------------------------

# (family, key) of integers every family reads; the least value each takes.
INT_KEYS = [
    ("qwen3_moe", "hidden_size", 1),
    ("qwen3_moe", "num_attention_heads", 1),
    ("qwen3_moe", "num_hidden_layers", 1),
    ("qwen3_moe", "num_experts_per_tok", 1),
    ("qwen3_moe", "moe_intermediate_size", 1),
    ("qwen3_moe", "vocab_size", 2),
    ("deepseek_v3", "n_routed_experts", 1),
    ("deepseek_v3", "kv_lora_rank", 1),
    ("qwen3_next", "num_experts_per_tok", 1),
    ("qwen3_next", "linear_num_key_heads", 1),
]
# Hostile values and the rule each breaks (None: the least value of the key).
INT_VALUES = [
    ("8", "must be an integer"),  # a string that looks like one
    (None, "must be an integer"),
    (0, None),
    (-1, None),
    (1.5, "must be an integer"),
    (True, "must be an integer"),  # JSON true is not 1
    (8.0, "must be an integer"),
    (1e30, "must be an integer"),  # JSON 1e30 is a float
    (10**25, "too large"),  # an integer past int32
    ([8], "must be an integer"),
    ({"value": 8}, "must be an integer"),
]


@pytest.mark.parametrize("family, key, least", INT_KEYS, ids=[f"{f}-{k}" for f, k, _ in INT_KEYS])
@pytest.mark.parametrize("value, rule", INT_VALUES, ids=[repr(v)[:12] for v, _ in INT_VALUES])
def test_bad_integer_is_one_line_naming_the_key(written, tmp_path, family, key, least, value, rule):
    directory = tmp_path / "config-only"
    directory.mkdir()
    config = config_of(written, family)
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    if rule is None:
        rule = f"must be >= {least}"
    elif rule == "too large":
        rule = f"must be <= {MAX_LAYERS if key == 'num_hidden_layers' else MAX_SIZE}"
    lines = [line for line in err.value.problems if line.startswith(f"config.json: {key} (")]
    assert len(lines) == 1, err.value.problems
    assert lines[0].endswith(rule), lines[0]
    # Nothing else is reported about it under our own profile's names.
    assert not any("model." in line for line in err.value.problems), err.value.problems


def test_values_are_shown_escaped_and_cut(written, tmp_path):
    def edit(config):
        config["hidden_size"] = "\u202e8\x1b[2J" + "x" * 200
        config["num_attention_heads"] = 10**100

    problems = edited_config(written, tmp_path, "qwen3_moe", edit)
    hidden = next(line for line in problems if "hidden_size" in line)
    assert "\\u202e8\\x1b[2J" in hidden and "\x1b" not in hidden and "\u202e" not in hidden
    assert re.fullmatch(r"config\.json: hidden_size \('.{50,56}\.\.\.\) must be an integer", hidden), hidden
    assert "config.json: num_attention_heads (<an integer of 333 bits>) must be <= 2147483647" in problems
    # An integer of more digits than Python converts: the file is refused in one line.
    directory = tmp_path / "digits"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(UnsupportedModel, match=r"config\.json: not valid JSON \('Exceeds the limit"):
        read_config(directory)


@pytest.mark.parametrize(
    "family, edit, expected",
    [
        ("qwen3_moe", {"num_experts_per_tok": 8}, "config.json: num_experts_per_tok (8) must be <= num_experts (7)"),
        ("deepseek_v3", {"num_experts_per_tok": 10},
         "config.json: num_experts_per_tok (10) must be <= n_routed_experts (9)"),
        ("deepseek_v3", {"topk_group": 4}, "config.json: topk_group (4) must be <= n_group (3)"),
        ("deepseek_v3", {"n_group": 2}, "config.json: n_routed_experts (9) must be a multiple of n_group (2)"),
        ("qwen3_moe", {"num_key_value_heads": 3},
         "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        ("qwen3_next", {"linear_num_value_heads": 3},
         "config.json: linear_num_value_heads (3) must be a multiple of linear_num_key_heads (2)"),
        ("qwen3_next", {"num_experts_per_tok": 6}, "config.json: num_experts_per_tok (6) must be <= num_experts (5)"),
        ("qwen3_moe", {"mlp_only_layers": [1, 99]},
         "config.json: mlp_only_layers ([1, 99]) must name layers below num_hidden_layers (3)"),
        ("qwen3_next", {"mlp_only_layers": [4]},
         "config.json: mlp_only_layers ([4]) must name layers below num_hidden_layers (4)"),
    ],
    ids=["qwen3_moe-top_k", "deepseek_v3-top_k", "deepseek_v3-topk_group", "deepseek_v3-n_group", "qwen3_moe-kv_heads",
         "qwen3_next-linear_heads", "qwen3_next-top_k", "qwen3_moe-dense-layer-past-the-end",
         "qwen3_next-dense-layer-past-the-end"],
)
def test_rules_across_keys_name_the_config_keys(written, tmp_path, family, edit, expected):
    assert expected in edited_config(written, tmp_path, family, lambda c: c.update(edit))


def test_several_bad_keys_are_all_reported(written, tmp_path):
    def edit(config):
        config.update(hidden_size="32", num_attention_heads=0, vocab_size=None, rms_norm_eps="x",
                      tie_word_embeddings="false", mlp_only_layers=[0, "1"], rope_parameters="default")

    problems = edited_config(written, tmp_path, "qwen3_moe", edit)
    assert problems == [
        "config.json: mlp_only_layers ([0, '1']) must be a list of integers: entry [1] ('1') must be an integer",
        "config.json: rope_parameters ('default') must be a JSON object",
        "config.json: vocab_size (null) must be an integer",
        "config.json: hidden_size ('32') must be an integer",
        "config.json: num_attention_heads (0) must be >= 1",
        "config.json: rms_norm_eps ('x') must be a number",
        "config.json: tie_word_embeddings ('false') must be true or false",
    ]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c.update(text_config="qwen"), "config.json: text_config ('qwen') must be a JSON object"),
        (lambda c: c.update(vision_config=[1]), "config.json: vision_config ([1]) must be a JSON object"),
        (lambda c: c["text_config"].update(num_attention_heads="4"),
         "config.json: text_config.num_attention_heads ('4') must be an integer"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_theta=float("nan")),
         "config.json: text_config.rope_parameters.rope_theta (nan) must be a finite number"),
        (lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=2),
         "config.json: text_config.rope_parameters.partial_rotary_factor (2) must be <= 1"),
        (lambda c: c["vision_config"].update(depth=-3), "config.json: vision_config.depth (-3) must be >= 1"),
        (lambda c: c.update(image_token_id="319"), "config.json: image_token_id ('319') must be an integer"),
    ],
    ids=["text_config", "vision_config", "nested-int", "nan", "range", "vision-int", "top-level-of-nested"],
)
def test_nested_sections_name_their_path(written, tmp_path, edit, expected):
    assert expected in edited_config(written, tmp_path, "qwen3_5_moe", edit)


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"{not json", r"config\.json:1:2: not valid JSON"),
        (b"[1, 2]", r"config\.json: must hold a JSON object, got list"),
        (b'"model"', r"config\.json: must hold a JSON object, got str"),
        (b"\xff\xfe{}", r"config\.json: not UTF-8 \(byte offset 0\)"),
        (b"[" * 200_000 + b"]" * 200_000, r"config\.json: JSON nested too deeply"),
        (b'{"model_type": ["qwen3_moe"]}', r"config\.json: model_type \(\['qwen3_moe'\]\) is not mapped"),
        (b'{"model_type": "qwen3_moe", "hidden_size": 32, "hidden_size": 64}',
         r"config\.json: key 'hidden_size' appears twice in one object \(which one counts is not defined\)"),
        (b'{"model_type": "qwen3_moe", "rope_scaling": {"type": "yarn", "type": "linear"}}',
         r"config\.json: key 'type' appears twice in one object"),
    ],
    ids=["not-json", "list", "string", "not-utf8", "deep", "model_type-list", "duplicate-key", "duplicate-nested-key"],
)
def test_config_file_that_is_no_config(tmp_path, content, expected):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(tmp_path)
    assert len(err.value.problems) == 1 and re.search(expected, err.value.problems[0]), err.value.problems


def test_config_file_too_large_or_not_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "MAX_CONFIG_BYTES", 1000)
    (tmp_path / "config.json").write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(UnsupportedModel, match=r"config\.json: 2\d{3} bytes, more than the 1000"):
        read_config(tmp_path)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # opening it for reading would wait for a writer forever
    with pytest.raises(UnsupportedModel, match=r"config\.json: must be a regular file"):
        read_config(fifo)


# ---- weight files ------------------------------------------------------------------------------------------------


class Sharded:
    """A checkpoint folder whose weights are listed in model.safetensors.index.json."""

    def __init__(self, directory: Path):
        self.dir = directory
        with CheckpointReader(directory) as reader:
            self.keys = reader.keys()
        self.write({key: "model.safetensors" for key in self.keys})

    def write(self, weight_map) -> None:
        """Rewrite the index's weight_map."""
        index = {"metadata": {}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture
def sharded(written, tmp_path):
    """A copy of the qwen3_moe checkpoint with an index."""
    return Sharded(shutil.copytree(written("qwen3_moe"), tmp_path / "ckpt"))


OUTSIDE = [
    ("../x.safetensors", "leads outside the checkpoint folder"),  # an existing safetensors file one folder up
    ("sub/../../x.safetensors", "leads outside the checkpoint folder"),
    ("/etc/passwd", "must be a path relative to the checkpoint folder"),
    ("C:\\weights\\x.safetensors", "must be a path relative to the checkpoint folder"),
    ("..", "leads outside the checkpoint folder"),
]


@pytest.mark.parametrize("entry, rule", OUTSIDE, ids=[e for e, _ in OUTSIDE])
def test_weight_map_entry_outside_the_folder_is_refused(sharded, entry, rule):
    shutil.copy(sharded.dir / "model.safetensors", sharded.dir.parent / "x.safetensors")
    key = sharded.keys[0]
    sharded.write({**{k: "model.safetensors" for k in sharded.keys}, key: entry})
    problems = problems_of(sharded.dir)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{sharded.dir / 'model.safetensors.index.json'}: weight_map['{key}'] ({entry!r}) ")
    assert rule in problems[0]


def test_all_entries_naming_one_outside_file_are_one_line(sharded):
    shutil.copy(sharded.dir / "model.safetensors", sharded.dir.parent / "x.safetensors")
    sharded.write({k: "../x.safetensors" for k in sharded.keys})
    problems = problems_of(sharded.dir)
    assert len(problems) == 1 and problems[0].endswith(f"(and {len(sharded.keys) - 1} more entries naming it)")


def test_symlinks_inside_to_outside_refused_inside_to_inside_allowed(sharded):
    shutil.copy(sharded.dir / "model.safetensors", sharded.dir.parent / "x.safetensors")
    (sharded.dir / "escape.safetensors").symlink_to(sharded.dir.parent / "x.safetensors")
    (sharded.dir / "sub").mkdir()
    (sharded.dir / "sub" / "inner.safetensors").symlink_to(sharded.dir / "model.safetensors")
    sharded.write({k: "escape.safetensors" for k in sharded.keys})
    problems = problems_of(sharded.dir)
    assert len(problems) == 1 and "('escape.safetensors') leads outside the checkpoint folder" in problems[0]
    assert f"a symlink to {(sharded.dir.parent / 'x.safetensors').resolve()}" in problems[0]
    sharded.write({k: "sub/inner.safetensors" for k in sharded.keys})
    check_checkpoint(sharded.dir)
    # Without an index the *.safetensors files are confined the same way.
    (sharded.dir / "model.safetensors.index.json").unlink()
    (sharded.dir / "model.safetensors").unlink()
    problems = problems_of(sharded.dir)
    target = (sharded.dir.parent / "x.safetensors").resolve()
    assert problems == [f"{sharded.dir / 'escape.safetensors'}: leads outside the checkpoint folder "
                        f"{sharded.dir.resolve()} (a symlink to {target}); weight files must lie inside it"]


def test_hub_cache_snapshot_links_into_its_blobs(written, tmp_path):
    """A hub cache snapshot (models--org--name/snapshots/REV/*, links into ../../blobs) is read in place."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(written("qwen3_moe") / name, repo / "blobs" / f"sha-{name}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    check_checkpoint(snapshot)


# The checkpoint folder's files besides the weights that moe-tune or transformers' loaders open.
LOADER_LINKS = ["config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json",
                "preprocessor_config.json", "chat_template.jinja", "additional_chat_templates/tools.jinja"]


@pytest.mark.parametrize("name", LOADER_LINKS)
def test_a_loader_file_linked_outside_the_folder_is_refused(sharded, tmp_path, name):
    """Like the weights, config.json, the index and the tokenizer, generation and processor files are read only
    inside the checkpoint folder: a link leading out of it is one line, and nothing behind it is read."""
    secret = tmp_path / "secret.json"
    secret.write_text((sharded.dir / name).read_text() if (sharded.dir / name).exists() else "{}")
    link = sharded.dir / name
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    line = (f"{link}: leads outside the checkpoint folder {sharded.dir.resolve()} (a symlink to {secret.resolve()}); "
            "a checkpoint's files must lie inside it")
    assert problems_of(sharded.dir) == [line]
    with pytest.raises(UnsupportedModel) as err:
        CheckpointReader(sharded.dir)
    assert err.value.problems == [line]
    if name == "config.json":
        with pytest.raises(UnsupportedModel) as err:
            read_config(sharded.dir)
        assert err.value.problems == [line]


def test_a_resolved_profile_naming_its_checkpoint_checks_the_loader_files(sharded, tmp_path):
    """A run's profile.yaml holds the architecture and names the checkpoint: its tokenizer and generation config are
    read (generate, export) before any weight, so they are checked when the profile is resolved."""
    job = resolve_job(validate_profile(checkpoint_job(sharded.dir, tmp_path)))
    (tmp_path / "elsewhere.json").write_text("{}")
    (sharded.dir / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ProfileError) as err:
        resolve_job(job)
    assert err.value.problems == [
        f"model.checkpoint ('{sharded.dir}'): {sharded.dir / 'tokenizer_config.json'}: leads outside the checkpoint "
        f"folder {sharded.dir.resolve()} (a symlink to {(tmp_path / 'elsewhere.json').resolve()}); a checkpoint's "
        "files must lie inside it"]


@pytest.mark.parametrize("spec", [False, True], ids=["checkpoint", "architecture"])
@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja", "additional_chat_templates/tools.jinja"])
def test_a_tokenizer_folder_of_its_own_is_held_to_the_loader_file_rule(sharded, tmp_path, name, spec):
    """data.tokenizer names a folder the tokenizer loader reads: a file of it linked out of it is refused in one
    line naming the field, for a job on a checkpoint and for one with the architecture (a run's profile.yaml) alike;
    links inside it are read."""
    job = validate_profile(checkpoint_job(sharded.dir, tmp_path))
    if spec:
        job = resolve_job(job)
    tokenizer = tmp_path / "tokenizer"
    (tokenizer / "originals").mkdir(parents=True)
    (tokenizer / "originals" / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").symlink_to(Path("originals") / "tokenizer.json")
    job = job.model_copy(update={"data": job.data.model_copy(update={"tokenizer": str(tokenizer)})})
    assert resolve_job(job).data.tokenizer == str(tokenizer)
    (tmp_path / "elsewhere").write_text("{}")
    link = tokenizer / name
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ProfileError) as err:
        resolve_job(job)
    assert err.value.problems == [
        f"data.tokenizer ('{tokenizer}'): {link}: leads outside the tokenizer folder {tokenizer.resolve()} (a symlink "
        f"to {(tmp_path / 'elsewhere').resolve()}); a tokenizer's files must lie inside it"]
    link.unlink()
    os.mkfifo(link)  # the tokenizer loader opening it would wait for a writer for ever
    with pytest.raises(ProfileError) as err:
        resolve_job(job)
    assert err.value.problems == [f"data.tokenizer ('{tokenizer}'): {link}: must be a regular file, not a FIFO"]


def test_loader_files_linked_inside_the_folder_are_read(sharded):
    (sharded.dir / "originals").mkdir()
    for name in ("config.json", "model.safetensors.index.json", "generation_config.json"):
        (sharded.dir / name).rename(sharded.dir / "originals" / name)
        (sharded.dir / name).symlink_to(Path("originals") / name)
    check_checkpoint(sharded.dir)
    assert read_config(sharded.dir)["model_type"] == "qwen3_moe"


@pytest.mark.parametrize("name", ["tokenizer.json", "additional_chat_templates"])
def test_a_loader_file_of_the_wrong_kind_is_refused_not_waited_on(sharded, name):
    path = sharded.dir / name
    if name == "tokenizer.json":
        os.mkfifo(path)  # a tokenizer loader opening it would wait for a writer for ever
        line = f"{path}: must be a regular file, not a FIFO"
    else:
        path.write_text("{}")
        line = f"{path}: must be a folder, not a regular file"
    assert problems_of(sharded.dir) == [line]


def test_hub_cache_snapshot_loader_files_link_into_its_blobs(written, tmp_path):
    """Every file of a hub cache snapshot is a link into ../../blobs, the tokenizer's and the index too, read where
    the cache lies when it is reached through a link (HF_HOME on another disk)."""
    real = tmp_path / "other-disk" / "hub"
    disk = real / "models--org--tiny" / "blobs"
    disk.mkdir(parents=True)
    (real / "models--org--tiny" / "snapshots" / "0123abc").mkdir(parents=True)
    (tmp_path / "hub").symlink_to(real)
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abc"
    with CheckpointReader(written("qwen3_moe")) as reader:
        keys = reader.keys()
    files = {"config.json": (written("qwen3_moe") / "config.json").read_text(),
             "model.safetensors.index.json": json.dumps({"weight_map": {k: "model.safetensors" for k in keys}}),
             "tokenizer_config.json": "{}"}
    for name, text in files.items():
        (disk / f"sha-{name}").write_text(text)
    shutil.copy(written("qwen3_moe") / "model.safetensors", disk / "sha-model.safetensors")
    for name in (*files, "model.safetensors"):
        (snapshot / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    check_checkpoint(snapshot)
    assert read_config(snapshot)["model_type"] == "qwen3_moe"


def test_a_snapshot_whose_blobs_folder_is_a_link_leads_nowhere_outside(written, tmp_path):
    """A hub-cache-shaped folder whose `blobs` is a link (to /, say) lends its snapshot no way out."""
    repo = tmp_path / "models--evil--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").symlink_to(tmp_path.anchor)
    shutil.copy(written("qwen3_moe") / "model.safetensors", snapshot)
    secret = tmp_path / "secret" / "config.json"
    secret.parent.mkdir()
    shutil.copy(written("qwen3_moe") / "config.json", secret)
    relative = os.path.relpath(secret, tmp_path.anchor)
    (snapshot / "config.json").symlink_to(Path("../../blobs") / relative)
    line = (f"{snapshot / 'config.json'}: leads outside the checkpoint folder {snapshot.resolve()} (a symlink to "
            f"{secret.resolve()}); a checkpoint's files must lie inside it")
    assert problems_of(snapshot) == [line]


@pytest.mark.parametrize("entry", [5, None, ["model.safetensors"], {"file": "model.safetensors"}, ""],
                         ids=["int", "null", "list", "object", "empty"])
def test_weight_map_entry_not_a_file_name(sharded, entry):
    key = sharded.keys[-1]
    sharded.write({**{k: "model.safetensors" for k in sharded.keys}, key: entry})
    problems = problems_of(sharded.dir)
    assert problems == [f"{sharded.dir / 'model.safetensors.index.json'}: weight_map['{key}'] "
                        f"({'null' if entry is None else repr(entry)}) must be a file name (a non-empty string)"]


@pytest.mark.parametrize(
    "index, expected",
    [
        ("{", "model.safetensors.index.json:1:2: not valid JSON"),
        ("[]", "model.safetensors.index.json: weight_map (null) must be a JSON object"),
        ('{"weight_map": ["model.safetensors"]}', "weight_map (['model.safetensors']) must be a JSON object"),
        ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "key 'a' appears twice in one object"),
    ],
    ids=["not-json", "no-weight_map", "weight_map-list", "duplicate-tensor"],
)
def test_index_that_is_no_index(sharded, index, expected):
    (sharded.dir / "model.safetensors.index.json").write_text(index)
    problems = problems_of(sharded.dir)
    assert len(problems) == 1 and expected in problems[0], problems


def test_index_naming_a_missing_shard_or_tensor(sharded):
    sharded.write({**{k: "model.safetensors" for k in sharded.keys}, sharded.keys[0]: "model-00002.safetensors",
                   "model.layers.9.extra.weight": "model.safetensors"})
    problems = problems_of(sharded.dir)
    assert problems == [f"{sharded.dir / 'model.safetensors.index.json'}: weight_map['{sharded.keys[0]}'] "
                        "('model-00002.safetensors') names a file that does not exist"]
    extra = "model.layers.9.extra.weight"
    sharded.write({**{k: "model.safetensors" for k in sharded.keys}, extra: "model.safetensors"})
    problems = problems_of(sharded.dir)
    assert problems == [f"{sharded.dir / 'model.safetensors.index.json'}: 1 tensors the weight_map puts in "
                        "'model.safetensors' are not in that file (first: 'model.layers.9.extra.weight')"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated in the tensor data
        lambda data: data[:20],  # truncated in the header
        lambda data: b"\x00" * 8 + data[8:],  # header length zero
        lambda data: (2**62).to_bytes(8, "little") + data[8:],  # header length past the file
        lambda data: data[:8] + b"<" * 16 + data[24:],  # header not JSON
        lambda data: b"",
    ],
    ids=["half", "header-cut", "zero-header", "huge-header", "garbage-header", "empty"],
)
def test_damaged_safetensors_is_one_line_naming_the_file(sharded, damage):
    path = sharded.dir / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    problems = problems_of(sharded.dir)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: not a readable safetensors file"), problems


class Payload:
    """Unpickling this creates `marker`: what a hostile pytorch_model.bin could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.00.pth"])
def test_pickle_weights_are_never_opened(written, tmp_path, name):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(written("qwen3_moe") / "config.json", directory)
    marker = tmp_path / "pwned"
    # torch.save's format: torch.load(weights_only=False) would run the payload.
    torch.save({"model.embed_tokens.weight": Payload(marker)}, directory / name)
    problems = problems_of(directory)
    assert problems == [f"{directory / name}: weights in a pickle format ({name}) are not read: moe-tune reads only "
                        "*.safetensors (never unpickles); convert the checkpoint"]
    with pytest.raises(ProfileError) as err:
        validate_profile(checkpoint_job(directory, tmp_path))
    assert err.value.problems == [f"model.checkpoint ('{directory}') must hold *.safetensors weights (found {name}: "
                                  "moe-tune reads only safetensors, never pickles)"]
    assert not marker.exists()


# ---- through the profile and the command line --------------------------------------------------------------------


def test_resolve_job_reports_config_and_weights_together(sharded, tmp_path):
    config = json.loads((sharded.dir / "config.json").read_text())
    config.update(num_attention_heads=0, num_experts_per_tok=70)
    (sharded.dir / "config.json").write_text(json.dumps(config))
    sharded.write({k: "../x.safetensors" for k in sharded.keys})
    with pytest.raises(ProfileError) as err:
        resolve_job(validate_profile(checkpoint_job(sharded.dir, tmp_path)))
    where = f"model.checkpoint ('{sharded.dir}'): "
    assert [line.removeprefix(where).split(" (")[0] for line in err.value.problems] == [
        "config.json: num_experts_per_tok",
        "config.json: num_attention_heads",
        f"{sharded.dir / 'model.safetensors.index.json'}: weight_map['{sharded.keys[0]}']",
    ]
    assert all(line.startswith(where) for line in err.value.problems)


def test_validate_cli_exits_2_one_line_per_problem(written, tmp_path):
    from moe_tune.cli import app

    directory = shutil.copytree(written("deepseek_v3"), tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    config.update(hidden_size="48", num_attention_heads=None, n_routed_experts=0, num_experts_per_tok=True)
    (directory / "config.json").write_text(json.dumps(config))
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(checkpoint_job(directory, tmp_path)))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    where = f"error: model.checkpoint ('{directory}'): config.json: "
    assert result.stderr.strip().splitlines() == [
        f"{where}num_attention_heads (null) must be an integer",
        f"{where}n_routed_experts (0) must be >= 1",
        f"{where}num_experts_per_tok (True) must be an integer",
        f"{where}hidden_size ('48') must be an integer",
    ]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("hostile", ["pickle", "escape"])
def test_align_refuses_before_the_reference_opens_anything(written, tmp_path, monkeypatch, hostile):
    """`moe-tune align --reference DIR` checks the folder before transformers reads it (it would follow the index
    out of the folder, or unpickle a .bin where no safetensors are)."""
    from moe_tune.cli import app
    from moe_tune.engine.align import compare

    opened = []
    monkeypatch.setattr(compare, "load_reference", lambda directory, family: opened.append(directory))

    directory = tmp_path / "ckpt"
    marker = tmp_path / "pwned"
    if hostile == "pickle":
        directory.mkdir()
        shutil.copy(written("qwen3_moe") / "config.json", directory)
        torch.save({"model.embed_tokens.weight": Payload(marker)}, directory / "pytorch_model.bin")
        expected = f"error: {directory / 'pytorch_model.bin'}: weights in a pickle format"
    else:
        shutil.copytree(written("qwen3_moe"), directory)
        shutil.move(directory / "model.safetensors", tmp_path / "x.safetensors")
        Sharded.write(type("At", (), {"dir": directory})(), {"model.embed_tokens.weight": "../x.safetensors"})
        expected = f"error: {directory / 'model.safetensors.index.json'}: weight_map['model.embed_tokens.weight']"
    result = CliRunner().invoke(app, ["align", "--reference", str(directory)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert "Traceback" not in result.output and not marker.exists() and not opened


def test_non_finite_values_are_found_in_every_floating_dtype_and_integers_pass(tmp_path):
    # float8 (read through bf16), bf16, fp16 and fp32 tensors with NaN or infinities, one line each (first key,
    # count); finite ones and integer tensors (packed bytes, indices) are no problem.
    from safetensors.torch import save_file

    from moe_tune.engine.families.checkpoint import nonfinite_tensor_problems

    nan8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)
    tensors = {
        "a.float8": nan8, "b.bf16": torch.tensor([float("inf"), 0.0, float("-inf")], dtype=torch.bfloat16),
        "c.fp16": torch.tensor([float("nan")] * 4, dtype=torch.float16), "d.fp32": torch.ones(5),
        "e.int": torch.tensor([-1, 2**31 - 1], dtype=torch.int32), "f.uint8": torch.tensor([255], dtype=torch.uint8),
    }  # fmt: skip
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        problems = nonfinite_tensor_problems(reader)
    file = tmp_path / "model.safetensors"
    assert problems == [
        f"{file}: tensor a.float8 holds 1 non-finite value (NaN or infinite)",
        f"{file}: tensor b.bf16 holds 2 non-finite values (NaN or infinite)",
        f"{file}: tensor c.fp16 holds 4 non-finite values (NaN or infinite)",
    ]


def test_a_safetensors_header_giving_a_tensor_twice_is_one_line_naming_it(sharded):
    """safetensors keeps one of two entries of a name silently (as json.loads keeps the last): refused, as a key
    twice in config.json is. (A second __metadata__ safetensors refuses itself.)"""
    path = sharded.dir / "model.safetensors"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    key = sharded.keys[0]
    entry = json.dumps({key: header[key]})[1:-1]
    doubled = ("{" + entry + ", " + json.dumps(header)[1:]).encode()
    doubled += b" " * (-len(doubled) % 8)
    path.write_bytes(len(doubled).to_bytes(8, "little") + doubled + data[8 + size :])
    assert problems_of(sharded.dir) == [f"{path}: the header gives tensor {key!r} twice (which one counts is not "
                                        "defined)"]
