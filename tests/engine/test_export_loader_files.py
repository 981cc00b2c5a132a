"""`moe-tune export` carries every loader file of the base checkpoint: each tokenizer file the checkpoint's loader
reads (checkpoint.LOADER_FILES: vocab.txt, spiece.model, tiktoken.model among them), the named chat templates of
additional_chat_templates/, and the code its `auto_map` entries name with what that code imports relatively (found
by transformers' own get_relative_import_files), so that the exported folder loads as the base does."""

from __future__ import annotations

import json

import pytest

import hf_tiny
from moe_tune.engine.export.hub import export_run
from moe_tune.engine.families.checkpoint import INDEX_NAME, LOADER_FILES, LOADER_FOLDERS
from test_export_hub import trained_run

# Files a checkpoint may ship beside its weights, each with its own bytes.
TOKENIZER_BYTES = {
    "tokenizer.json": b'{"version": "1.0"}\n', "vocab.txt": b"[PAD]\n[UNK]\nhello\n", "spiece.model": b"\x0a\x05spiece",
    "tiktoken.model": b"aGVsbG8= 0\nd29ybGQ= 1\n", "tokenizer.model": b"\x0a\x05sentencepiece",
    "additional_chat_templates/tool_use.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
}  # fmt: skip
# The checkpoint's own code: a config class importing a helper relatively, a tokenizer class.
CODE = {
    "configuration_tiny.py": "from .tiny_helpers import MARKER\n\nclass TinyConfig:\n    marker = MARKER\n",
    "tiny_helpers.py": "MARKER = 'tiny'\n",
    "tokenization_tiny.py": "from .tiny_helpers import MARKER\n\nclass TinyTokenizer:\n    pass\n",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished LoRA run whose base checkpoint ships the files above, auto_map entries naming its code (one of
    them in another repository, which names no file here) and a Python file nothing names."""
    root = tmp_path_factory.mktemp("loader-files")
    run = trained_run(root, hf_tiny.tiny_qwen3_moe, {"target_modules": ["q_proj"], "experts": False})
    checkpoint = root / "checkpoint"
    (checkpoint / "additional_chat_templates").mkdir()
    for name, data in TOKENIZER_BYTES.items():
        (checkpoint / name).write_bytes(data)
    for name, text in CODE.items():
        (checkpoint / name).write_text(text)
    (checkpoint / "notes.py").write_text("raise SystemExit('not loader code')\n")
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig",
                          "AutoModelForCausalLM": "other/repo--modeling_tiny.TinyForCausalLM"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return run


def loader_files(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.suffix != ".safetensors"}


def test_every_loader_file_of_the_checkpoint_is_exported(run, tmp_path):
    from transformers.dynamic_module_utils import get_relative_import_files

    checkpoint = run.parent / "checkpoint"
    out = export_run(run, merge=True, out=tmp_path / "merged")
    names = [n for n in LOADER_FILES if n != INDEX_NAME and n not in LOADER_FOLDERS and (checkpoint / n).is_file()]
    assert {"vocab.txt", "spiece.model", "tiktoken.model"} <= set(names)
    for name in [*names, *TOKENIZER_BYTES, *CODE]:
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
    # transformers' own search for the code the exported configuration module imports finds it in the folder.
    assert [p.rpartition("/")[2] for p in get_relative_import_files(out / "configuration_tiny.py")] == [
        "tiny_helpers.py"]
    assert loader_files(out) == {*names, *TOKENIZER_BYTES, *CODE, INDEX_NAME}


def test_the_adapter_carries_the_tokenizers_files_and_code_only(run, tmp_path):
    checkpoint = run.parent / "checkpoint"
    out = export_run(run, merge=False, out=tmp_path / "adapter")
    for name in ["vocab.txt", "tiktoken.model", "spiece.model", *TOKENIZER_BYTES, "tokenization_tiny.py",
                 "tiny_helpers.py"]:
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
    # The adapter is no model: neither config.json nor the configuration code it names.
    assert not (out / "config.json").exists() and not (out / "configuration_tiny.py").exists()
    assert not (out / "notes.py").exists()
