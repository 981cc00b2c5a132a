"""Export carries the chat template the run trained with: a run whose profile sets data.chat_template (inline, or a
.jinja file) is exported (merged, adapter, and output.save_merged's merged/) with that template, and the exported
folder's AutoTokenizer renders a conversation as moe-tune rendered it for training (text and ids), whatever the
checkpoint's tokenizer_config.json, processor_config.json or chat_template.json said; without data.chat_template
the checkpoint's own template is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hf_tiny
from moe_tune.engine.data.chat import chat_options
from moe_tune.engine.data.tokenizer import load_tokenizer
from moe_tune.engine.export.hub import export_run
from test_chat import QWEN3, save_tokenizer

# A template of the checkpoint's tokens that renders differently from its own (qwen3's): roles in brackets.
PROFILE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>[' + m.role + '] ' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>[assistant] ' }}{%- endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"}]  # fmt: skip
# A legacy processor template and a processor config entry, both read by AutoProcessor before chat_template.jinja.
STALE = "{{ 'the checkpoint processor template' }}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny qwen3_moe checkpoint with a character-level tokenizer whose template is qwen3's, also written as a
    tokenizer_config.json entry, a chat_template.json and a processor_config.json entry."""
    directory = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_moe(), tmp_path_factory.mktemp("ckpt") / "checkpoint")
    save_tokenizer(directory, "qwen3", False)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": STALE}))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": STALE}))
    (directory / "processor_config.json").write_text(json.dumps({"chat_template": STALE}))
    return directory


def write_run(root: Path, checkpoint: Path, chat_template: str | None) -> Path:
    """A finished LoRA run's folder (profile.yaml, summary.json, a no-op adapter), written without training."""
    import yaml

    from moe_tune.engine.align.compare import load_ours
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.lora import inject_lora
    from moe_tune.profiles import validate_profile

    (root / "data.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    data = {"path": str(root / "data.jsonl"), "tokenizer": str(checkpoint), "seq_len": 64}
    if chat_template is not None:
        data["chat_template"] = chat_template
    job = resolve_job(validate_profile({
        "name": "template", "model": {"checkpoint": str(checkpoint)}, "data": data,
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "lora": {"target_modules": ["q_proj"]},
        "output": {"dir": str(root / "run")},
    }))
    run = root / "run"
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text(json.dumps({"last_step": 1}) + "\n")
    inject_lora(load_ours(job.model), job.lora).save_pretrained(str(run / "adapter"), safe_serialization=True)
    return run


def training_ids(run: Path, messages: list[dict] = MESSAGES) -> list[int]:
    """The conversation's ids as moe-tune renders it for training with the run's profile (its <bos> aside)."""
    import yaml

    from moe_tune.profiles.schema import DataProfile

    data = DataProfile(**yaml.safe_load((run / "profile.yaml").read_text())["data"])
    pieces = load_tokenizer(data.tokenizer).render_chat(messages, "data.jsonl:1", chat_options(data))
    return [t for ids, _ in pieces for t in ids]


def exported_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    """how -> the run's folder: the template inline, from a .jinja file, or none (the checkpoint's)."""
    made = {}
    for how in ("inline", "file", "none"):
        root = tmp_path_factory.mktemp(how)
        value = {"inline": PROFILE_TEMPLATE, "none": None}.get(how)
        if how == "file":
            (root / "chat.jinja").write_text(PROFILE_TEMPLATE)
            value = str(root / "chat.jinja")
        made[how] = write_run(root, checkpoint, value)
    return made


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
@pytest.mark.parametrize("how", ["inline", "file"])
def test_export_renders_the_profiles_template(runs, checkpoint, how, merge, tmp_path):
    out = export_run(runs[how], merge=merge, out=tmp_path / "out")
    tok = exported_tokenizer(out)
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == "".join(f"<|im_start|>[{m['role']}] {m['content']}<|im_end|>\n" for m in MESSAGES)
    assert list(tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]) == training_ids(
        runs[how])
    assert (out / "chat_template.jinja").read_text() == PROFILE_TEMPLATE
    # Nothing a processor or an older loader would read before chat_template.jinja is left.
    assert not (out / "chat_template.json").exists()
    for name in ("tokenizer_config.json", "processor_config.json"):
        assert "chat_template" not in json.loads((out / name).read_text())
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_without_data_chat_template_the_checkpoints_template_is_kept(runs, checkpoint, merge, tmp_path):
    out = export_run(runs["none"], merge=merge, out=tmp_path / "out")
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json", "processor_config.json"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes()
    tok = exported_tokenizer(out)
    assert tok.chat_template == QWEN3.replace("@GEN", "").replace("@END", "")
    # qwen3's template renders one assistant turn by growing prefixes (it rewrites earlier turns of longer chats).
    one_turn = MESSAGES[:3]
    assert list(tok.apply_chat_template(one_turn, tokenize=True, return_dict=True)["input_ids"]) == training_ids(
        runs["none"], one_turn)


def test_a_template_file_gone_since_training_is_refused_before_writing(runs, tmp_path):
    from moe_tune.profiles import ProfileError

    template = runs["file"].parent / "chat.jinja"
    moved = template.with_suffix(".bak")
    template.rename(moved)
    try:
        with pytest.raises(ProfileError, match=r"data\.chat_template \('.*chat\.jinja'\) must name an existing"):
            export_run(runs["file"], merge=True, out=tmp_path / "out")
    finally:
        moved.rename(template)
    assert not (tmp_path / "out").exists()


def test_save_merged_writes_the_profiles_template(checkpoint, tmp_path):
    """output.save_merged's merged/ goes through the same writer: a 1-step run with an inline template."""
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import validate_profile

    (tmp_path / "data.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    finetune(resolve_job(validate_profile({
        "name": "template", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(tmp_path / "data.jsonl"), "tokenizer": str(checkpoint), "seq_len": 64,
                 "chat_template": PROFILE_TEMPLATE},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "lora": {"target_modules": ["q_proj"]},
        "output": {"dir": str(tmp_path / "run"), "save_merged": True},
    })), show_progress=False)
    tok = exported_tokenizer(tmp_path / "run" / "merged")
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == tok.apply_chat_template(
        MESSAGES, tokenize=False, chat_template=PROFILE_TEMPLATE)
    assert (tmp_path / "run" / "merged" / "chat_template.jinja").read_text() == PROFILE_TEMPLATE


def test_the_runs_profile_yaml_holds_the_template_text(tmp_path):
    """A run's profile.yaml carries the text of a .jinja data.chat_template (export and generate need no file); an
    inline template, or none, is written as given."""
    from moe_tune.engine.train.trainer import resolved_profile_dump
    from moe_tune.profiles import load_profile, validate_profile

    template = tmp_path / "chat.jinja"
    template.write_text(PROFILE_TEMPLATE)
    with_file = load_profile("tiny", [f"data.chat_template={template}"])
    dumped = resolved_profile_dump(with_file)
    assert dumped["data"]["chat_template"] == PROFILE_TEMPLATE
    # What profile.yaml holds reads back as the same template, inline.
    assert validate_profile(dumped).data.chat_template == PROFILE_TEMPLATE
    inline = load_profile("tiny", [f"data.chat_template={json.dumps(PROFILE_TEMPLATE)}"])
    assert resolved_profile_dump(inline)["data"]["chat_template"] == PROFILE_TEMPLATE
    assert resolved_profile_dump(load_profile("tiny"))["data"]["chat_template"] is None
