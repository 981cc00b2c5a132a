"""`moe-tune align --batch` with images: the reference reads the record's image files with transformers' own image
processor, so a bug in our preprocessing (EXIF orientation, image order, normalisation) fails align as a bug in the
vision tower or the image positions does; bad image records are one line each, exit 2."""

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.align import align_checkpoint, read_batch
from moe_tune.engine.data import images as image_data
from moe_tune.engine.data import multimodal
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.model import model, vision

from hf_tiny import save_tiny_checkpoint, tiny_qwen3_5_moe, tiny_qwen3_moe

PIL = pytest.importorskip("PIL.Image")
runner = CliRunner()


def save_char_tokenizer(directory):
    """A character-level tokenizer: ids 1-96 for the printable characters, 0 unknown."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    core = Tokenizer(models.WordLevel({"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>").save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny qwen3_5_moe with its vision tower (patch 4, merge 2), a tokenizer and transformers' Qwen2-VL image
    processor settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = save_tiny_checkpoint(tiny_qwen3_5_moe(), tmp_path_factory.mktemp("align-images") / "qwen3_5_moe")
    save_char_tokenizer(directory)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                             max_pixels=32 * 32).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Images of odd sizes and modes: RGB, two of one size, greyscale, RGBA, and a JPEG whose EXIF orientation (6)
    turns it upright by swapping its sides."""
    folder = tmp_path_factory.mktemp("batch")
    rng = np.random.default_rng(0)

    def pixels(height, width, channels=3):
        return rng.integers(0, 255, (height, width, channels), dtype=np.uint8)

    PIL.fromarray(pixels(24, 40)).save(folder / "wide.png")
    PIL.fromarray(pixels(37, 19)).save(folder / "tall.png")
    PIL.fromarray(pixels(26, 26)).save(folder / "same1.png")
    PIL.fromarray(pixels(26, 26)).save(folder / "same2.png")
    PIL.fromarray(pixels(30, 30)[..., 0], "L").save(folder / "grey.png")
    PIL.fromarray(pixels(20, 44, 4), "RGBA").save(folder / "rgba.png")
    exif = PIL.Exif()
    exif[0x0112] = 6
    PIL.fromarray(pixels(16, 40)).save(folder / "rotated.jpg", exif=exif.tobytes(), quality=95)
    return folder


def write_batch(folder, records, name="batch.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


RECORDS = [
    {"text": "plain text"},
    {"text": "see <image> and <image> here", "images": ["wide.png", "tall.png"]},
    {"text": "<image> <image>, <image>", "images": ["grey.png", "rgba.png", "rotated.jpg"]},
    {"text": "two alike: <image><image>", "images": ["same1.png", "same2.png"]},
]


def align_batch(checkpoint, batch):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    return align_checkpoint(checkpoint, read_batch(batch, cfg, checkpoint))


def test_an_image_batch_aligns_on_transformers_own_pixels(checkpoint, folder):
    report = align_batch(checkpoint, write_batch(folder, RECORDS))
    assert report.passed, report.failures
    assert report.images == [0, 2, 3, 2]
    assert [row.name for row in report.layers[:3]] == ["pixel values", "vision features", "merged embeddings"]
    # Our preprocessing is transformers' Qwen2-VL processor's, to the bit, on every mode and orientation here.
    assert report.layers[0].max_abs == 0.0
    assert report.logits.max_abs < 1e-5


def without_exif_transpose(path, links=True):
    return PIL.open(path).convert("RGB")


def swapping_the_first_two_images(content, images, where, message_parts=multimodal.message_parts):
    images[:2] = images[1::-1]
    return message_parts(content, images, where)


def normalised_around_half(image, settings, image_patches=image_data.image_patches):
    import dataclasses

    return image_patches(image, dataclasses.replace(settings, image_mean=(0.5, 0.5, 0.5)))


@pytest.mark.parametrize("module, name, bug, records, failure", [
    (image_data, "load_image", without_exif_transpose, [RECORDS[2]],
     "document 0 image 2 ({folder}/rotated.jpg): grid [1, 4, 10], transformers' image processor gives [1, 10, 4]"),
    (multimodal, "message_parts", swapping_the_first_two_images, [RECORDS[3]], "pixel values rel "),
    (image_data, "image_patches", normalised_around_half, [RECORDS[1]], "pixel values rel "),
], ids=["exif-dropped", "images-swapped", "normalisation"])
def test_a_bug_in_our_image_preprocessing_fails_align(checkpoint, folder, monkeypatch, module, name, bug, records,
                                                      failure):
    """The reference reads the record's files with transformers' image processor, so pixels, grids (so token counts)
    and the images' order are compared, not only what the model makes of our pixels."""
    with monkeypatch.context() as patch:
        patch.setattr(module, name, bug)
        _, _, cfg = model_profile_from_checkpoint(checkpoint)
        docs = read_batch(write_batch(folder, records, "bug.jsonl"), cfg, checkpoint)
    report = align_checkpoint(checkpoint, docs)
    assert not report.passed
    assert any(line.startswith(failure.format(folder=folder)) for line in report.failures), report.failures


def image_positions_one_later(input_ids, cu_seqlens, grids, image_token_id, merge):
    positions = vision.mrope_positions(input_ids, cu_seqlens, grids, image_token_id, merge)
    positions[:, input_ids.reshape(-1) == image_token_id] += 1
    return positions


@pytest.mark.parametrize("bug", ["vision output", "image positions"])
def test_a_bug_in_our_vision_tower_or_image_positions_fails_align(checkpoint, folder, monkeypatch, bug):
    if bug == "vision output":
        forward = vision.VisionTower.forward
        monkeypatch.setattr(vision.VisionTower, "forward", lambda self, *args: forward(self, *args) * 1.001)
    else:
        monkeypatch.setattr(model, "mrope_positions", image_positions_one_later)
    report = align_batch(checkpoint, write_batch(folder, RECORDS[:2]))
    assert not report.passed
    rows = {row.name: row.judged_rel for row in report.layers}
    assert rows["pixel values"] == 0.0
    if bug == "vision output":
        assert rows["vision features"] == pytest.approx(1e-3, rel=1e-2)
    else:
        assert rows["vision features"] < 1e-5 and report.logits.max_abs > 1e-2


def test_bad_image_records_are_one_line_each_exit_2(checkpoint, folder, tmp_path):
    PIL.new("RGB", (8, 8)).save(folder.parent / "outside.png")
    PIL.new("RGB", (4000, 10)).save(folder / "thin.png")
    PIL.new("1", (10000, 9000)).save(folder / "bomb.png")
    (folder / "notes.png").write_text("not an image")
    records = [
        {"text": "a <image>", "images": "wide.png"},
        {"text": "a <image>", "images": [3]},
        {"input_ids": [1, 2], "images": ["wide.png"]},
        {"text": "a <image>", "images": ["wide.png", "tall.png"]},
        {"text": "a <image> <image>", "images": ["wide.png"]},
        {"input_ids": [1, 317, 2]},
        {"text": "a <image>", "images": ["missing.png"]},
        {"text": "a <image>", "images": ["../outside.png"]},
        {"text": "a <image>", "images": ["thin.png"]},
        {"text": "a <image>", "images": ["notes.png"]},
        {"text": "a <image>", "images": ["bomb.png"]},
        {"text": "fine <image>", "images": ["wide.png"]},
    ]
    batch = write_batch(folder, records, "bad.jsonl")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [f"error: --batch {batch}:{number}: {line}" for number, line in [
        (1, "images ('wide.png') must be a list of image paths"),
        (2, "images ([3]) must be a list of image paths"),
        (3, "images fill a text record's <image> placeholders: an input_ids record takes none"),
        (4, "1 entries of 'images' have no <image> placeholder"),
        (5, "more <image> placeholders than entries in 'images'"),
        (6, "input_ids hold the image token ids (317, 318 or 319) outside images (1 image, 0 start and 0 end tokens "
            "for 0 images, which put 0, 0 and 0); a record of input_ids carries no images (give them to a text "
            "record)"),
        (7, f"{folder}/missing.png: no such image file"),
        (8, f"image '../outside.png' resolves outside the data folder {folder} (set data.allow_paths_outside: true "
            "to allow)"),
        (9, f"{folder}/thin.png: aspect ratio 400 must be <= 200"),
        (10, f"{folder}/notes.png: not a readable image (UnidentifiedImageError)"),
        (11, f"{folder}/bomb.png: 10000 x 9000 pixels, more than the 89478485 an image may have (a decompression "
             "bomb?)"),
    ]]  # fmt: skip


def test_image_records_need_the_checkpoints_image_processor_settings(checkpoint, folder, tmp_path):
    """As a fine-tune: without preprocessor_config.json the normalisation and pixel bounds would be guessed (and
    the default patch size, 14, is not this tower's 4)."""
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "preprocessor_config.json").unlink()
    batch = write_batch(folder, [RECORDS[0], RECORDS[1]], "settings.jsonl")
    result = runner.invoke(app, ["align", "--reference", str(bare), "--batch", str(batch)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: --batch {batch}:2: {bare}/preprocessor_config.json: missing; image "
                                     "records need the checkpoint's image processor settings")


def test_images_for_a_text_only_model_are_one_line(folder, tmp_path):
    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "qwen3_moe")
    save_char_tokenizer(checkpoint)
    batch = write_batch(folder, [RECORDS[1]], "text_only.jsonl")
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    from moe_tune.engine.families import UnsupportedModel

    with pytest.raises(UnsupportedModel) as err:
        read_batch(batch, cfg, checkpoint)
    assert err.value.problems == [f"--batch {batch}:1: has images but the model has no vision tower"]


def test_text_giving_image_token_ids_outside_its_images_is_refused(checkpoint, folder, monkeypatch):
    """A tokenizer can give the image token id from text (a literal <|image_pad|>): it would meet another image's
    features, or none; here "#" stands for it."""
    from moe_tune.engine.data.tokenizer import HFTokenizer
    from moe_tune.engine.families import UnsupportedModel

    encode = HFTokenizer.encode
    monkeypatch.setattr(HFTokenizer, "encode", lambda self, text: [317 if t == 4 else t for t in encode(self, text)])
    batch = write_batch(folder, [{"text": "a # <image>", "images": ["wide.png"]}], "literal.jsonl")
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    with pytest.raises(UnsupportedModel) as err:
        read_batch(batch, cfg, checkpoint)
    assert err.value.problems == [
        f"--batch {batch}:1: text ('a # <image>') gives the image token ids (317, 318 or 319) outside its images (16 "
        "image, 1 start and 1 end tokens for 1 images, which put 15, 1 and 1); remove them from the text"
    ]
