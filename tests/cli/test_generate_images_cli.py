"""`moe-tune generate --image`: the images are read as training reads them and placed before the text of the first
user turn, the prompt is the training rendering of that conversation up to the assistant's reply, a chat keeps them
in its first turn, and bad input is one line naming the option and the file, exit 2, no traceback. (Tokens against
transformers' generate: tests/engine/families/test_generate_images.py; against the full forward:
tests/engine/test_decode.py.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.profiles import load_profile, validate_profile

PIL = pytest.importorskip("PIL.Image")

runner = CliRunner()
CPU = torch.device("cpu")
# tiny-vl's pictures of 32-48 pixels a side stay as they are (patch 4, merge 2): 40 x 32 pixels give 5 x 4 = 20
# image tokens, 24 x 48 give 3 x 6 = 18.
SIZES = {"a.png": (40, 32), "b.png": (24, 48)}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(the tiny-vl profile whose output.dir holds no run: its base model, the image folder)."""
    root = tmp_path_factory.mktemp("generate-images")
    rng = np.random.default_rng(0)
    for name, size in SIZES.items():
        PIL.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / name)
    profile = root / "vl.yaml"
    job = load_profile("tiny-vl", [f"output.dir={root / 'run'}"])
    profile.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    return profile, root


def captured_prompts(monkeypatch) -> list[tuple[list[int], object]]:
    """The (prompt ids, images) of every reply generate gives, recorded as Session.generate is called."""
    from moe_tune.engine.generate.session import Session

    calls, original = [], Session.generate
    monkeypatch.setattr(Session, "generate", lambda self, ids, *args, **kwargs: calls.append(
        (list(ids), kwargs.get("images"))) or original(self, ids, *args, **kwargs))  # fmt: skip
    return calls


def test_images_come_before_the_text_as_training_renders_them(vl, monkeypatch, tmp_path):
    from moe_tune.engine.data.dataset import load_documents, vision_input
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.generate.session import load_session, read_prompt_images

    profile, root = vl
    calls = captured_prompts(monkeypatch)
    result = runner.invoke(app, ["generate", str(profile), "--prompt", "What is it?", "--image", str(root / "a.png"),
                                 "--image", str(root / "b.png"), "--max-new-tokens", "5"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "images: 2 (20, 18 image tokens)" in result.stderr.splitlines()
    (ids, images), = calls
    # The record training reads for this turn and an answer: the prompt is its tokens up to the answer.
    data = tmp_path / "data.jsonl"
    for name in SIZES:
        shutil.copy(root / name, tmp_path / name)
    data.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "image", "image": "b.png"},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A test."}]}) + "\n")  # fmt: skip
    raw = yaml.safe_load(profile.read_text())
    raw["data"] = {key: value for key, value in raw["data"].items() if not key.startswith("corpus")} | {
        "path": str(data)}
    job = validate_profile(raw)
    document, = load_documents(job.data, load_tokenizer("byte"), vision_input(job.model, job.data))
    answer = list(b"A test.")
    start = next(i for i in range(len(document.input_ids)) if document.input_ids[i : i + len(answer)] == answer)
    assert ids == document.input_ids[:start]
    # The reply is the engine's for those images; the pixels are training's.
    session = load_session(str(profile), device=CPU)
    expected = read_prompt_images([root / "a.png", root / "b.png"], session.profile)
    assert expected.token_counts(2) == [20, 18] and torch.equal(images.pixel_values, expected.pixel_values)
    assert result.stdout == session.generate(ids, 5, images=expected).text + "\n"


def test_a_chat_keeps_the_images_in_its_first_turn(vl, monkeypatch):
    profile, root = vl
    calls = captured_prompts(monkeypatch)
    result = runner.invoke(app, ["generate", str(profile), "--chat", "--image", str(root / "a.png"),
                                 "--max-new-tokens", "3"], input="first\nsecond\n\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    image = load_profile(str(profile)).model.vision.image_token_id
    assert [ids.count(image) for ids, _ in calls] == [20, 20]
    (first, images), (second, again) = calls
    assert second[: len(first)] == first and again is images


@pytest.mark.parametrize("case", ["missing", "folder", "not-an-image", "too-narrow", "raw", "text-model"])
def test_bad_images_are_one_line(vl, tmp_path, case):
    profile, root = vl
    target, image = str(profile), root / "a.png"
    extra = []
    if case == "missing":
        image = tmp_path / "gone.png"
        line = f"error: --image: {image}: no such image file"
    elif case == "folder":
        image = tmp_path
        line = f"error: --image: {image}: not a regular file (a directory); an image must be one"
    elif case == "not-an-image":
        image = tmp_path / "notes.png"
        image.write_text("not pixels")
        line = f"error: --image: {image}: not a readable image (UnidentifiedImageError)"
    elif case == "too-narrow":
        image = tmp_path / "strip.png"
        PIL.new("RGB", (800, 2)).save(image)
        line = f"error: --image: {image}: aspect ratio 400 must be <= 200"
    elif case == "raw":
        extra = ["--raw"]
        line = ("error: --image places images in a user message of the chat template; --raw sends the prompt as it "
                "is: give one")
    else:
        text = tmp_path / "text.yaml"
        text.write_text(yaml.safe_dump(load_profile("tiny", [f"output.dir={tmp_path / 'run'}"]).model_dump(
            mode="json"), sort_keys=False))  # fmt: skip
        target, line = str(text), "error: --image: the model has no vision tower (model.vision) to read images with"
    result = runner.invoke(app, ["generate", target, "--prompt", "x", "--image", str(image), *extra])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    errors = [entry for entry in result.stderr.splitlines() if entry.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), result.stderr
