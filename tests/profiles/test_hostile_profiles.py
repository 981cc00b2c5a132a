"""Hostile and careless profiles: duplicate keys, alias bombs and recursion, deep nesting, huge files, numbers that
overflow, control characters in what is echoed, and sizes that cannot be allocated. Each is one bounded line per
problem, every problem at once, within seconds; the CLI exits 2 without a traceback."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.cli._common import MAX_PRINTED_PROBLEMS, fail
from moe_tune.profiles import (
    MAX_PROBLEM_CHARS,
    MAX_PROFILE_BYTES,
    MAX_PROFILE_CHARS,
    MAX_PROFILE_DEPTH,
    MAX_PROFILE_NODES,
    ProfileError,
    escape_controls,
    load_profile,
    resolve_profile_path,
)
from moe_tune.profiles.schema import MAX_SEED, MAX_SIZE, MAX_TIMEOUT_S

runner = CliRunner()
TINY = resolve_profile_path("tiny")
# What a refusal may cost at most, in seconds (the loader's caps make every case linear; CI machines are slow).
QUICK_S = 10


def write(tmp_path: Path, text: str, name: str = "profile.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path, overrides=()) -> list[str]:
    started = time.monotonic()
    with pytest.raises(ProfileError) as info:
        load_profile(path, list(overrides))
    assert time.monotonic() - started < QUICK_S
    return info.value.problems


# --- duplicate keys -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, key, first",
    [
        ("name: a\nname: b\n", 2, "name", 1),  # top level
        ("train:\n  lr: 1\n  steps: 3\n  lr: 2\n", 4, "train.lr", 2),  # in a section
        ('train:\n  lr: 1\n  "lr": 2\n', 3, "train.lr", 2),  # quoted and plain are one key
        ("train:\n  lr: 1\ntrain:\n  steps: 3\n", 3, "train", 1),  # a whole section twice
        ("model:\n  layers:\n    - {attention: full, attention: linear}\n", 3, "model.layers.0.attention", 3),
        ("model:\n  moe:\n    top_k: 1\n    num_experts: 2\n    top_k: 2\n", 5, "model.moe.top_k", 3),
        ("train: {lr: 1, steps: 2, lr: 3}\n", 1, "train.lr", 1),  # flow mapping
    ],
    ids=["top-level", "in-section", "quoted", "section-twice", "in-list-item", "nested", "flow"],
)
def test_duplicate_key_is_an_error_naming_file_line_and_key(tmp_path, text, line, key, first):
    path = write(tmp_path, text)
    problems = problems_of(path)
    assert problems[0] == (
        f"{path}:{line}: duplicate key '{key}' (first given at line {first}): a key may appear once in a mapping"
    )
    # The schema's problems come with it, not after a second run.
    assert len(problems) > 1


def test_every_duplicate_is_listed_with_the_schema_problems(tmp_path):
    raw = TINY.read_text()
    text = raw.replace("train:\n", "train:\n  lr: 5\n  lr: 6\n", 1) + "name: again\n"
    path = write(tmp_path, text)
    problems = problems_of(path)
    duplicates = [p for p in problems if "duplicate key" in p]
    assert [p.split(": duplicate key ")[1].split(" ")[0] for p in duplicates] == ["'train.lr'", "'train.lr'", "'name'"]


def test_merge_keys_may_be_overridden(tmp_path):
    # `<<: *base` then a key of the base again is YAML's override, not a duplicate.
    raw = yaml.safe_load(TINY.read_text())
    text = yaml.safe_dump(raw).replace("train:\n", "base: &base {lr: 0.5}\ntrain:\n  <<: *base\n", 1)
    problems = problems_of(write(tmp_path, text))
    assert not any("duplicate key" in p for p in problems), problems
    assert any(p.startswith("base (") and "unknown key" in p for p in problems), problems


def test_later_set_wins_but_a_duplicate_inside_a_set_value_is_an_error():
    assert load_profile(TINY, ["train.lr=1e-3", "train.lr=2e-3"]).train.lr == 2e-3
    (line, *rest) = problems_of(TINY, ["train={lr: 1, lr: 2, steps: 3}"])
    assert line.startswith("--set 'train={lr: 1, lr: 2, steps: 3}':1: duplicate key 'lr'")


# --- aliases ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a [1, [2, [3, *a]]]\n", "a: &a\n  b:\n    c: *a\n"],
    ids=["list", "mapping", "deep-list", "block"],
)
def test_recursive_alias_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:") and "alias *a is inside the node it names (a recursive structure)" in line


def laughs(width: int, levels: int) -> str:
    """The billion laughs: level i lists `width` aliases of level i - 1, so the last expands to width**levels."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("width, levels", [(10, 9), (100, 3), (2, 30), (1000, 2)], ids=["1e9", "1e6", "2^30", "1e6-wide"])
def test_alias_bomb_is_refused_before_it_is_built(tmp_path, width, levels):
    path = write(tmp_path, laughs(width, levels))
    assert path.stat().st_size < 20_000
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:")
    assert line.endswith(f"expands to more than {MAX_PROFILE_NODES} YAML nodes (aliases repeat what they name): refused")


def test_alias_of_long_text_counts_its_characters(tmp_path):
    # Few nodes, many characters: a 100 KB string named 50 times.
    text = "a: &a '" + "x" * 100_000 + "'\nb: [" + ", ".join(["*a"] * 50) + "]\n"
    (line,) = problems_of(write(tmp_path, text))
    assert f"expands to more than {MAX_PROFILE_CHARS} characters of values" in line


def test_aliases_within_the_caps_load(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    text = yaml.safe_dump(raw) + laughs(10, 3)
    problems = problems_of(write(tmp_path, text))
    assert sorted(p.split(" ")[0] for p in problems) == ["l0", "l1", "l2"]


# --- nesting and size -----------------------------------------------------------------------------------------------


def nested(levels: int, kind: str) -> str:
    # The top-level mapping is one level; `a:`'s value adds `levels` more.
    if kind == "list":
        return "a: " + "[" * levels + "]" * levels + "\n"
    return "a: " + "{b: " * (levels - 1) + "{}" + "}" * (levels - 1) + "\n"


@pytest.mark.parametrize("kind", ["list", "mapping"])
def test_nesting_just_under_the_limit_loads(tmp_path, kind):
    problems = problems_of(write(tmp_path, nested(MAX_PROFILE_DEPTH - 1, kind)))
    assert problems[-1].startswith("a (") and "unknown key" in problems[-1]


@pytest.mark.parametrize("levels", [MAX_PROFILE_DEPTH, 2 * MAX_PROFILE_DEPTH, 100_000], ids=["limit", "twice", "100k"])
@pytest.mark.parametrize("kind", ["list", "mapping"])
def test_nesting_over_the_limit_is_one_line(tmp_path, kind, levels):
    path = write(tmp_path, nested(levels, kind))
    # Within the size cap: the depth, not the size, is what refuses it.
    assert path.stat().st_size <= MAX_PROFILE_BYTES
    (line,) = problems_of(path)
    # libyaml refuses past its own depth (1000) before the composer sees it.
    assert line.startswith(f"{path}:")
    assert f"nested deeper than {MAX_PROFILE_DEPTH} levels: refused" in line or "maximum nesting depth" in line


def test_profile_at_the_size_cap_is_read(tmp_path):
    text = "name: x\n#"
    path = write(tmp_path, text + "c" * (MAX_PROFILE_BYTES - len(text) - 1) + "\n")
    assert path.stat().st_size == MAX_PROFILE_BYTES
    assert problems_of(path)[0] == "model: required field is missing"


@pytest.mark.parametrize("size", [MAX_PROFILE_BYTES + 1, 50 * 2**20], ids=["one-over", "50MB"])
def test_profile_over_the_size_cap_is_refused_unread(tmp_path, size):
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(size)  # sparse: costs no disk
    (line,) = problems_of(path)
    assert line == f"{path}: the profile is {size} bytes, more than the {MAX_PROFILE_BYTES} bytes a profile may be"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_profile_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    (line,) = problems_of(path)
    assert line == f"{path}: cannot read the profile (not a regular file)"


def test_huge_set_value_and_deep_set_path_are_refused():
    (line,) = problems_of(TINY, ["name=" + "x" * (MAX_PROFILE_BYTES + 1)])
    assert line.endswith(f"the value has {MAX_PROFILE_BYTES + 1} characters, more than {MAX_PROFILE_BYTES}")
    (line,) = problems_of(TINY, [".".join(["a"] * (MAX_PROFILE_DEPTH + 1)) + "=1"])
    assert line.endswith(f"the path has more than {MAX_PROFILE_DEPTH} parts")
    (line,) = problems_of(TINY, ["train=" + laughs(10, 9).replace("\n", ", ").join("{}")])
    assert "expands to more than" in line


# --- numbers that overflow ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.seed=1234567890123456789012345", f"input should be less than or equal to {MAX_SEED}"),
        (f"model.seed={MAX_SEED + 1}", f"input should be less than or equal to {MAX_SEED}"),
        ("data.seed=-1", "input should be greater than or equal to 0"),
        ("parallel.timeout_s=1e300", f"input should be less than or equal to {int(MAX_TIMEOUT_S)}"),
        ("parallel.timeout_s=.inf", "input should be a finite number"),
        ("train.lr=.inf", "input should be a finite number"),
        ("train.lr=.nan", "input should be a finite number"),
        ("train.lr=-.inf", "input should be a finite number"),
        ("train.weight_decay=.nan", "input should be a finite number"),
        ("train.grad_clip=.inf", "input should be a finite number"),
        ("train.betas=[.nan, 0.9]", "input should be a finite number"),
        ("model.init_std=.inf", "input should be a finite number"),
        ("model.moe.capacity_factor=.inf", "input should be a finite number"),
        ("memory.gpu_budget_gb=.inf", "input should be a finite number"),
        ("train.micro_batch_size=-1", "input should be greater than or equal to 1"),
        (f"train.micro_batch_size={MAX_SIZE + 1}", f"input should be less than or equal to {MAX_SIZE}"),
        ("train.steps=99999999999999999999", f"input should be less than or equal to {MAX_SIZE}"),
        (f"model.vocab_size={2**31}", f"input should be less than or equal to {MAX_SIZE}"),
        ("model.hidden_size=1e30", "input should be a valid integer"),
        (f"model.moe.num_experts={2**40}", f"input should be less than or equal to {MAX_SIZE}"),
        (f"data.seq_len={2**64}", f"input should be less than or equal to {MAX_SIZE}"),
        (f"model.layers=[{', '.join(['{attention: linear}'] * 1025)}]", "list should have at most 1024 items"),
    ],
    ids=lambda v: v if len(v) < 40 else v[:40],
)
def test_numbers_out_of_range_are_one_line_each(override, expected):
    field = override.split("=")[0]
    problems = problems_of(TINY, [override])
    # A tuple's element is named by its index (train.betas.0).
    assert any(p.startswith(field) and expected in p for p in problems), problems


@pytest.mark.parametrize(
    "override", [f"train.seed={MAX_SEED}", f"parallel.timeout_s={MAX_TIMEOUT_S}", f"model.seed={MAX_SEED}"]
)
def test_numbers_at_the_bound_are_accepted(override):
    load_profile(TINY, [override])


def test_integers_too_long_to_print_are_named_not_printed(tmp_path):
    # Python prints no int of more than 4300 digits; hex has no such limit when parsed.
    (line,) = problems_of(TINY, ["train.seed=0x" + "f" * 20_000])
    assert line.startswith("train.seed (<an integer of 80000 bits>): input should be less than or equal to")


@pytest.mark.parametrize(
    "value, reason",
    [("9" * 5000, "Exceeds the limit (4300 digits)"), ("2020-13-45", "month must be in 1..12"),
     ("!!int x", "invalid literal for int()"), ("!!float abc", "could not convert string to float"),
     ("2020-01-01T99:00:00", "hour must be in 0..23")],
    ids=["5000-digits", "13th-month", "int-tag", "float-tag", "25th-hour"],
)  # fmt: skip
def test_values_yaml_cannot_build_are_one_line(tmp_path, value, reason):
    path = write(tmp_path, TINY.read_text() + f"extra: {value}\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:") and ": YAML value error: cannot read " in line and reason in line


@pytest.mark.parametrize("override, expected", [
    (".train=1", "--set '.train=1': the path has an empty part; must read path.to.field=value"),
    ("train..lr=1", "--set 'train..lr=1': the path has an empty part; must read path.to.field=value"),
    ("train.=1", "--set 'train.=1': the path has an empty part; must read path.to.field=value"),
    ("train. .lr=1", "--set 'train. .lr=1': the path has an empty part; must read path.to.field=value"),
    ("lora.target_modules=[q_proj", "--set 'lora.target_modules=[q_proj': the value is not valid YAML (did not find "
                                    "expected ',' or ']')"),
    ("model={checkpoint: x", "--set 'model={checkpoint: x': the value is not valid YAML (did not find expected ',' "
                             "or '}')"),
    ("lora.target_modules= [q_proj, ", "--set 'lora.target_modules= [q_proj, ': the value is not valid YAML ("),
], ids=["leading-dot", "double-dot", "trailing-dot", "blank-part", "open-list", "open-mapping", "open-after-space"])
def test_malformed_set_is_its_own_line(override, expected):
    """A --set path with an empty part, or a value begun as a YAML list or mapping that does not parse, is refused as
    --set syntax (not as an unknown key '' or a string the schema then refuses)."""
    (line,) = problems_of(TINY, [override])
    assert line.startswith(expected)


@pytest.mark.parametrize("override, where", [
    ("name=caf\udce9", "the command line's byte 0xe9 at character 9"),
    ("data.path=d/\udcff.jsonl", "the command line's byte 0xff at character 13"),
    ("output.dir=\udc80", "the command line's byte 0x80 at character 12"),
    ("na\udce9=1", "the command line's byte 0xe9 at character 3"),
    ("name=\ud800x", "a lone surrogate U+D800 at character 6"),
])  # fmt: skip
def test_a_set_that_is_not_utf8_is_one_line_naming_the_byte(override, where):
    # Bytes of the command line that are not UTF-8 reach Python as lone surrogates, which YAML cannot take.
    (line,) = problems_of(TINY, [override])
    assert line == f"--set {override!r}: not UTF-8 text ({where})"


def test_set_values_that_are_not_yaml_collections_stay_strings():
    """Text that is not YAML and not begun as a collection stays the string it reads as."""
    profile = load_profile(TINY, ["output.dir=runs/a: b: c]", "name=x: y: z"])
    assert str(profile.output.dir) == "runs/a: b: c]" and profile.name == "x: y: z"


@pytest.mark.parametrize("override, expected", [
    ("model.hidden_size=true", "model.hidden_size (true) must be an integer, not a boolean"),
    ("train.steps=yes", "train.steps (true) must be an integer, not a boolean"),
    ("train.seed=false", "train.seed (false) must be an integer, not a boolean"),
    ("lora.r=on", "lora.r (true) must be an integer, not a boolean"),
    ("train.lr=true", "train.lr (true) must be a number, not a boolean"),
    ("model.moe.top_k=true", "model.moe.top_k (true) must be an integer, not a boolean"),
    ("data.eval_fraction=false", "data.eval_fraction (false) must be a number, not a boolean"),
    ("model.layers=[{attention: full, sliding_window: true}]",
     "model.layers.0.sliding_window (true) must be an integer, not a boolean"),
], ids=["int", "int-yes", "seed-false", "int-on", "float", "nested-section", "optional-float", "list-item"])
def test_booleans_are_not_numbers(override, expected):
    """YAML's true/false (yes/no, on/off) passed as 1/0 into a number field: hidden_size true trained a model of
    width 1."""
    assert expected in problems_of(TINY, [override])


def test_boolean_fields_still_take_booleans():
    profile = load_profile(TINY, ["lora.enabled=false", "memory.activation_checkpointing=true"])
    assert profile.lora.enabled is False and profile.memory.activation_checkpointing is True


# --- everything at once ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.lr_typo=1", "model.hidden_size=x"],
         ["train.lr_typo (1): unknown key", "model.hidden_size ('x'): input should be a valid integer"]),
        # A check_<rule> of a section and a field error of another section.
        (["model.moe.top_k=99", "train.lr=-1"],
         ["model.moe.top_k (99) must be <= model.moe.num_experts (8)", "train.lr (-1): input should be greater"]),
        # A check_<rule> of a section whose own field is broken: pydantic skips the rule; the loader runs it.
        (["model.moe.top_k=99", "model.moe.aux_loss_coef=-1"],
         ["model.moe.top_k (99) must be <= model.moe.num_experts (8)", "model.moe.aux_loss_coef (-1): input"]),
        (["model.num_key_value_heads=3", "model.not_a_field=1"],
         ["model.num_attention_heads (4) must be a multiple of model.num_key_value_heads (3)", "model.not_a_field"]),
        # A rule across sections and a broken field elsewhere.
        (["model.vocab_size=100", "train.lr=-1"],
         ["model.vocab_size (100) must be >= 259 for data.tokenizer 'byte'", "train.lr (-1)"]),
        # A --set that cannot apply and a schema problem.
        (["train.lr.x=1", "bad", "train.steps=0"],
         ["--set 'train.lr.x=1': train.lr is not a section", "--set 'bad': must read path.to.field=value",
          "train.steps (0): input should be greater than or equal to 1"]),
    ],
    ids=["two-sections", "rule-and-field", "rule-behind-field", "rule-behind-unknown-key", "cross-section",
         "set-and-schema"],
)  # fmt: skip
def test_independent_problems_are_reported_together(overrides, expected):
    problems = problems_of(TINY, overrides)
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)


# --- what is echoed -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "char, escape",
    [("\x1b", "\\x1b"), ("\x07", "\\x07"), ("\n", "\\x0a"), ("\r", "\\x0d"), ("\x00", "\\x00"), ("\x7f", "\\x7f"),
     ("\x9b", "\\x9b"), ("\u202e", "\\u202e"), ("\u202a", "\\u202a"), ("\u2066", "\\u2066"), ("\u2069", "\\u2069"),
     ("\u200e", "\\u200e"), ("\u200f", "\\u200f"), ("\u061c", "\\u061c"), ("\u2028", "\\u2028")],
    ids=lambda v: repr(v),
)  # fmt: skip
def test_controls_are_escaped_in_key_names_and_values(char, escape):
    assert escape_controls(f"a{char}b") == f"a{escape}b" == escape_controls(f"a{escape}b")
    # The key raw in the --set path; the value through YAML's escapes (JSON is YAML).
    problems = problems_of(TINY, [f"train.ke{char}y=1", f"train.lr={json.dumps('v' + char)}"])
    assert not any(char in line for line in problems)
    assert f"train.ke{escape}y (1): unknown key (not in the schema: moe-tune schema)" in problems
    assert any(line.startswith(f"train.lr ({escape_controls(repr('v' + char))}): input should be") for line in problems)


def test_cli_prints_escapes_and_bounded_lines(tmp_path):
    path = write(tmp_path, TINY.read_text() + '"k\\u202eey\\e[2J": 1\n')
    long_path = "/" + "p" * 5000
    result = runner.invoke(app, ["validate", str(path), "--set", "train.lr=\u202eevil\x07", "--set", f"data.path={long_path}"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert not any(c in result.stderr for c in "\u202e\x1b\x07")
    assert "error: k\\u202eey\\x1b[2J (1): unknown key (not in the schema: moe-tune schema)" in lines
    assert any(line.startswith("error: train.lr ('\\u202eevil\\x07'): input should be") for line in lines), lines
    assert all(len(line) < MAX_PROBLEM_CHARS + 100 for line in lines)
    assert any(line.endswith(" more characters)") for line in lines)


def test_fail_escapes_bounds_and_counts(capsys):
    problems = ["raw \u202eline\x1b[31m", "y" * 100_000] + [f"p{i}" for i in range(MAX_PRINTED_PROBLEMS + 5)]
    with pytest.raises(typer.Exit) as info:
        fail(problems)
    assert info.value.exit_code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: raw \\u202eline\\x1b[31m"
    assert lines[1] == f"error: {'y' * MAX_PROBLEM_CHARS}... ({100_000 - MAX_PROBLEM_CHARS} more characters)"
    assert len(lines) == MAX_PRINTED_PROBLEMS + 1
    assert lines[-1] == "error: ... and 7 more problems"


# --- sizes that cannot be allocated ---------------------------------------------------------------------------------


def test_model_larger_than_the_memory_available_is_refused(monkeypatch):
    from moe_tune.engine.train import resources

    profile = load_profile(TINY)
    resources.check_memory_fits(profile, 1, torch.device("cpu"))
    monkeypatch.setattr(resources, "available_memory", lambda device: (10**6, "host memory available"))
    with pytest.raises(ProfileError) as info:
        resources.check_memory_fits(profile, 1, torch.device("cpu"))
    (line,) = info.value.problems
    assert line.startswith("model (vocab_size 259, hidden_size 64, 4 layers) needs ~0.0 GB on this rank for weights")
    assert line.endswith("more than the 0.0 GB host memory available (moe-tune plan shows the layouts that fit)")


@pytest.mark.parametrize("overrides, rows, seq_len", [
    (["train.micro_batch_size=2147483647", "data.seq_len=64"], 2147483647, 64),
    (["train.micro_batch_size=2", "data.seq_len=2147483647"], 2, 2147483647),
    (["train.micro_batch_size=65536", "data.seq_len=65536"], 65536, 65536),
], ids=["rows", "seq_len", "both"])  # fmt: skip
def test_micro_batch_larger_than_the_memory_available_is_refused(overrides, rows, seq_len):
    """Rows x seq_len tokens whose ids, labels and one hidden state alone exceed the memory: one line, before any
    row is built (a micro-batch of 2**31 rows was built row by row for hours)."""
    from moe_tune.engine.train import resources

    profile = load_profile(TINY, overrides)
    assert resources.micro_batch_bytes(profile) == rows * seq_len * (16 + 64 * 4)  # tiny: hidden 64, fp32
    with pytest.raises(ProfileError) as info:
        resources.check_memory_fits(profile, 1, torch.device("cpu"))
    (line,) = info.value.problems
    assert line.startswith(f"train.micro_batch_size ({rows}) rows of data.seq_len ({seq_len}) tokens need at least ")
    assert line.endswith("host memory available: lower train.micro_batch_size or data.seq_len")
    # Rows taking half of what is available still pass: the bound is the micro-batch's own.
    available, _ = resources.available_memory(torch.device("cpu"))
    half = load_profile(TINY, ["data.seq_len=64", f"train.micro_batch_size={available // 2 // (64 * (16 + 64 * 4))}"])
    resources.check_memory_fits(half, 1, torch.device("cpu"))


def test_available_memory_on_the_host_is_positive():
    from moe_tune.engine.train.resources import available_memory, host_available_memory

    assert host_available_memory() > 0
    assert available_memory(torch.device("cpu"))[0] > 0


def test_finetune_of_a_vocabulary_too_large_to_allocate_exits_2_at_once(tmp_path, child_env):
    # 2e9 rows x 64 x fp32, twice (embedding and head): ~1 TB of weights, refused before any is allocated.
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--quiet", "--set", "model.vocab_size=2000000000",
         "--set", f"output.dir={out}"],
        capture_output=True, text=True, timeout=300, env=child_env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: model (vocab_size 2000000000, hidden_size 64, 4 layers) needs ~3072.0 GB")
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("err, plain, line", [
    (ValueError("bad value\nmore"), (BaseException,), "bad value"),
    (ZeroDivisionError("division by zero"), (ValueError,), "ZeroDivisionError: division by zero"),
    (KeyError(), (ValueError,), "KeyError"),
    (OSError("  \n"), (), "OSError"),
    (RuntimeError("out of resource"), (), "RuntimeError: out of resource"),
])  # fmt: skip
def test_error_line_is_the_first_line_led_by_the_kind_unless_plain(err, plain, line):
    from moe_tune.profiles import error_line

    assert error_line(err, plain) == line


# --- YAML's merge keys, YAML 1.1 numbers, empty --set values, invisible characters ------------------------------


# (the mapping given under train:, the line holding the duplicate, the line of the first, the refusal's rule). Two
# `<<:` in one mapping: PyYAML lets the second win over the first, the opposite of `<<: [*a, *b]`.
MERGE_DUPLICATES = {
    "merge-key-twice": ("  <<: {lr: 1.0e-3}\n  <<: {lr: 2.0e-3}\n", "  <<: {lr: 2.0e-3}", -1,
                        "duplicate key 'train.<<' (first given at line {first}): one merge key per mapping: merge "
                        "several with <<: [*a, *b]"),
    "inside-a-merge": ("  <<: {seed: 1, seed: 2}\n", "  <<: {seed: 1, seed: 2}", 0,
                       "duplicate key 'train.seed' (first given at line {first}): a key may appear once in a mapping"),
}


@pytest.mark.parametrize("case", list(MERGE_DUPLICATES))
def test_duplicates_through_merge_keys_are_refused(tmp_path, case):
    mapping, at, first, rule = MERGE_DUPLICATES[case]
    text = TINY.read_text().replace("train:\n", "train:\n" + mapping, 1)
    path = write(tmp_path, text)
    line = text.splitlines().index(at) + 1
    assert problems_of(path) == [f"{path}:{line}: " + rule.format(first=line + first)]


@pytest.mark.parametrize("value, problem", [
    ("010", "010 is 8 in YAML 1.1 (octal) but 10 in YAML 1.2 and JSON: write it without the leading zero, or quote "
            "it for text"),
    ("-0_10", "-0_10 is -8 in YAML 1.1 (octal) but -10 in YAML 1.2 and JSON: write it without the leading zero, or "
              "quote it for text"),
    ("5:00", "5:00 is 300 in YAML 1.1 (base 60) but text in YAML 1.2: write the number, or quote it for text"),
    ("1:30.5", "1:30.5 is 90.5 in YAML 1.1 (base 60) but text in YAML 1.2: write the number, or quote it for text"),
    ("0b100101100", "0b100101100 is 300 in YAML 1.1 (binary) but text in YAML 1.2 and JSON: write the number in "
                    "decimal, or quote it for text"),
    ("+0b1_0", "+0b1_0 is 2 in YAML 1.1 (binary) but text in YAML 1.2 and JSON: write the number in decimal, or quote "
               "it for text"),
], ids=["octal", "negative-octal", "base-60", "base-60-float", "binary", "signed-binary"])  # fmt: skip
def test_numbers_yaml_1_1_and_1_2_read_differently_are_refused(tmp_path, value, problem):
    """PyYAML reads YAML 1.1: `steps: 0300` trained 192 steps, `steps: 5:00` 300. JSON and YAML 1.2 read 300 and
    text: neither is guessed."""
    path = write(tmp_path, TINY.read_text().replace("  steps: 300\n", f"  steps: {value}\n"))
    assert problems_of(path) == [f"{path}:43:10: YAML value error: {problem}"]
    assert problems_of(TINY, [f"train.steps={value}"]) == [f"--set 'train.steps={value}': {problem}"]


@pytest.mark.parametrize("value, steps", [("07", 7), ("00100", None), ("'010'", 10), ("0x10", 16), ("1_000", 1000)],
                         ids=["octal-equal", "octal-other", "quoted", "hex", "underscores"])
def test_numbers_that_read_alike_or_are_quoted_load(value, steps):
    if steps is None:
        assert problems_of(TINY, [f"train.steps={value}"])[0].startswith("--set 'train.steps=00100': 00100 is 64 in")
        return
    assert load_profile(TINY, [f"train.steps={value}", "train.warmup_steps=0"]).train.steps == steps


@pytest.mark.parametrize("override", ["data.path=", "data.path=  ", "data.path=# a comment", "train="])
def test_a_set_value_that_reads_as_nothing_is_refused(override):
    """`--set data.path=$DATA` with DATA unset trained on the built-in corpus."""
    assert problems_of(TINY, [override]) == [f"--set {override!r}: the value reads as null (it is empty or a YAML "
                                             "comment): write null to unset the field"]


@pytest.mark.parametrize("null", ["null", "~", "Null", "NULL"])
def test_a_set_value_of_null_unsets(null):
    assert load_profile(TINY, [f"data.eval_fraction={null}"]).data.eval_fraction is None


def test_a_set_path_through_a_list_says_set_it_whole():
    assert problems_of(TINY, ["model.layers.0.attention=full"]) == [
        "--set 'model.layers.0.attention=full': model.layers is a list: set it whole"]


@pytest.mark.parametrize("char, escape", [("\u200b", "\\u200b"), ("\u200c", "\\u200c"), ("\u200d", "\\u200d"),
                                          ("\u2060", "\\u2060"), ("\ufeff", "\\ufeff"), ("\xad", "\\xad")],
                         ids=["zwsp", "zwnj", "zwj", "word-joiner", "bom", "soft-hyphen"])
def test_invisible_characters_are_escaped_in_problem_lines(char, escape):
    """A key pasted with a zero-width space printed as `train.lr (1): unknown key`: the key looked right."""
    assert problems_of(TINY, [f"train.lr{char}=1"]) == [f"train.lr{escape} (1): unknown key (not in the schema: "
                                                        "moe-tune schema)"]
    # Generated text keeps them: joiners belong to emoji and scripts.
    assert escape_controls(f"a{char}b") == f"a{char}b"


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16 (little-endian)"), ("utf-16-be", "UTF-16 (big-endian)"),
                                            ("utf-32", "UTF-32 (little-endian)")])
def test_a_profile_in_another_encoding_is_named(tmp_path, encoding, name):
    path = tmp_path / "profile.yaml"
    mark = "\ufeff" if encoding.endswith("-be") else ""
    path.write_bytes((mark + TINY.read_text()).encode(encoding))
    assert problems_of(path) == [f"{path}: not UTF-8 ({name} text: it opens with that byte-order mark); a profile is "
                                 "UTF-8 text"]


def test_a_profile_with_a_byte_that_is_not_utf8_names_it(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    assert problems_of(path) == [f"{path}: not UTF-8 (invalid continuation byte: byte 0xe9 at byte offset 9); a "
                                 "profile is UTF-8 text"]


# --- paths ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, line", [
    ("output.dir=''", "output.dir ('') is empty: name the file or folder ('.' for the working directory)"),
    ("data.path=' '", "data.path (' ') is empty: name the file or folder ('.' for the working directory)"),
    ("output.dir=~/runs/x", "output.dir ('~/runs/x') starts with '~', which is not expanded (it would name a folder "
                            "'~' in the working directory): write the path out"),
    ("data.sources=[{path: ~/d.jsonl}]", "data.sources.0.path ('~/d.jsonl') starts with '~', which is not expanded "
                                         "(it would name a folder '~' in the working directory): write the path out"),
    ("model={checkpoint: '~'}", "model.checkpoint ('~') starts with '~', which is not expanded (it would name a "
                                "folder '~' in the working directory): write the path out"),
], ids=["empty-dir", "blank-path", "tilde-dir", "tilde-source", "tilde-checkpoint"])  # fmt: skip
def test_paths_that_are_empty_or_start_with_a_tilde_are_refused(override, line):
    """`output.dir: ~/runs` wrote into ./~/runs; `output.dir: ''` into the working directory."""
    assert problems_of(TINY, [override])[0] == line


def test_a_value_rule_does_not_hide_the_sections_other_problems():
    """A boolean in a number field (or a path rule) stops only its field: the section's other fields are still
    checked, and a rule reading the broken field is not run on the boolean read as 1."""
    assert problems_of(TINY, ["train.steps=true", "train.lr=-1"]) == [
        "train.steps (true) must be an integer, not a boolean", "train.lr (-1): input should be greater than 0"]
    assert problems_of(TINY, ["output.dir=~/x", "output.save_every=0"]) == [
        "output.dir ('~/x') starts with '~', which is not expanded (it would name a folder '~' in the working "
        "directory): write the path out", "output.save_every (0): input should be greater than or equal to 1"]


def test_a_wildcard_data_path_says_it_is_not_expanded(tmp_path):
    assert problems_of(TINY, [f"data.path={tmp_path}/*.jsonl"]) == [
        f"data.path ('{tmp_path}/*.jsonl') must be an existing file (wildcards are not expanded: name each file in "
        "data.sources)"]


def test_a_data_file_named_twice_is_refused(tmp_path):
    """A file listed twice in data.sources (also through a link) doubled its weight unseen; data.eval_path naming a
    training file left nothing to train on, reported as an empty training set."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    (tmp_path / "link.jsonl").symlink_to(data)
    sources = f"data.sources=[{{path: {data}}}, {{path: {tmp_path}/link.jsonl}}]"
    assert problems_of(TINY, [sources, f"data.eval_path={data}"]) == [
        f"data.sources.1.path ('{tmp_path}/link.jsonl') is the file data.sources.0.path ('{data}') names: name each "
        "file once (a weight of 2 takes its documents twice)",
        f"data.eval_path ('{data}') is the file data.sources.0.path ('{data}') names: evaluation records must not be "
        "training records (data.eval_fraction holds some of them out instead)"]
    assert problems_of(TINY, [f"data.path={data}", f"data.eval_path={tmp_path}/link.jsonl"]) == [
        f"data.eval_path ('{tmp_path}/link.jsonl') is the file data.path ('{data}') names: evaluation records must "
        "not be training records (data.eval_fraction holds some of them out instead)"]


def test_text_and_messages_fields_must_differ():
    assert problems_of(TINY, ["data.messages_field=text"]) == [
        "data.text_field and data.messages_field both name the key 'text': a record's key says whether it is text or "
        "a chat, so they must differ"]


ROTATED = ": full, sparse and qsa attention rotate by it"


@pytest.mark.parametrize("factor, expected", [
    (0.05, f"must give a rotary dim of at least 2 (head_dim 16 x factor = 0){ROTATED}"),
    (1e-300, f"must give a rotary dim of at least 2 (head_dim 16 x factor = 0){ROTATED}"),
    (0.0625, "must give an even rotary dim (head_dim 16 x factor = 1)"),
])  # fmt: skip
def test_a_partial_rotary_factor_leaving_no_even_rotary_dim_is_one_line(factor, expected):
    # The tiny profile's heads are 16 wide and its last layer is sparse attention (rotated by the rotary dims).
    assert problems_of(TINY, [f"model.partial_rotary_factor={factor}"]) == [
        f"model.partial_rotary_factor ({factor}) {expected}"]


def test_a_rotary_dim_of_0_is_accepted_without_rotated_attention():
    load_profile(TINY, ["model.partial_rotary_factor=0.05", "model.layers=[{attention: linear}, {attention: kda}]",
                        "model.kda_attention={num_heads: 2, head_dim: 16}"])
    load_profile(TINY, ["model.partial_rotary_factor=0.125"])  # 16 x 0.125 = 2
