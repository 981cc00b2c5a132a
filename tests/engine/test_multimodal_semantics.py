"""Image records against transformers: the checkpoint's processor settings read as transformers reads them, patches
of every image size class and pixel mode equal to its processor's, the image tokens of a chat placed and counted
as its processor places them, never trained; hostile files refused in one line naming the file and the rule."""

import json
import struct
import zlib

import numpy as np
import pytest
import torch

from moe_tune.engine.data.dataset import VisionInput, collate, load_documents, pack_rows
from moe_tune.engine.data.images import MAX_IMAGE_PIXELS, ImageError, ImageSettings, image_patches, load_image
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile

from test_images import CHAT_TEMPLATE_WITH_IMAGES, TOKENS, word_tokenizer

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

# patch 16 x merge 2: a factor of 32; bounds of 32 x 32 and 256 x 256 pixels.
PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=256 * 256)
SIZE_CLASSES = [
    (1, 1), (2, 3), (7, 7),  # tiny: scaled up to min_pixels
    (15, 16), (16, 16), (17, 17),  # a side around half the factor
    (31, 32), (32, 32), (33, 33),  # around min_pixels
    (37, 91), (101, 47), (255, 256), (256, 256), (256, 257), (257, 257),  # odd, around max_pixels
    (1, 200), (200, 1), (3, 600), (600, 3), (4000, 25),  # very wide or tall, up to the aspect bound
]


def reference_processor(**overrides):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{**PROCESSOR, **overrides})


def noise(height, width, channels=3, seed=0):
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def assert_same_as(reference, image_for_reference, path, settings):
    expected = reference(images=[image_for_reference], return_tensors="pt")
    patches, grid = image_patches(load_image(path), settings)
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("height, width", SIZE_CLASSES, ids=[f"{h}x{w}" for h, w in SIZE_CLASSES])
def test_patches_equal_the_processors_on_every_size_class(tmp_path, height, width):
    reference = reference_processor()
    reference.save_pretrained(tmp_path)
    path = tmp_path / "x.png"
    PIL.fromarray(noise(height, width, seed=height * 7 + width)).save(path)
    assert_same_as(reference, PIL.open(path), path, ImageSettings.from_checkpoint(tmp_path))


def _paletted(tmp_path):
    image = PIL.fromarray(noise(40, 60)).quantize(16)
    image.save(tmp_path / "x.png", transparency=3)


def _animated_gif(tmp_path):
    frames = [PIL.fromarray(noise(40, 60, seed=s)).quantize(32) for s in range(3)]
    frames[0].save(tmp_path / "x.gif", save_all=True, append_images=frames[1:], transparency=0, duration=50)


def _apng(tmp_path):
    frames = [PIL.fromarray(noise(40, 60, 4, seed=s), "RGBA") for s in range(3)]
    frames[0].save(tmp_path / "x.png", save_all=True, append_images=frames[1:])


def _pages(tmp_path):
    pages = [PIL.fromarray(noise(40, 60, seed=s)) for s in range(3)]
    pages[0].save(tmp_path / "x.tiff", save_all=True, append_images=pages[1:])


MODES = {
    # mode (or kind) -> writer of tmp_path / "x.*"
    "1": lambda d: PIL.fromarray(noise(40, 60)).convert("1").save(d / "x.png"),
    "L": lambda d: PIL.fromarray(noise(40, 60, 1)).save(d / "x.png"),
    "LA": lambda d: PIL.fromarray(noise(40, 60, 4), "RGBA").convert("LA").save(d / "x.png"),
    "RGBA": lambda d: PIL.fromarray(noise(40, 60, 4), "RGBA").save(d / "x.png"),
    "P+transparency": _paletted,
    "RGB+transparency": lambda d: PIL.fromarray(noise(40, 60) // 128 * 255).save(d / "x.png", transparency=(0, 0, 0)),
    "CMYK": lambda d: PIL.fromarray(noise(40, 60)).convert("CMYK").save(d / "x.jpg", quality=95),
    "YCbCr": lambda d: PIL.fromarray(noise(40, 60)).convert("YCbCr").save(d / "x.tiff"),
    "I;16 within 0..255": lambda d: PIL.fromarray(noise(40, 60, 1).astype(np.uint16)).save(d / "x.png"),
    "F within 0..255": lambda d: PIL.fromarray(noise(40, 60, 1).astype(np.float32), "F").save(d / "x.tiff"),
    "animated GIF": _animated_gif,
    "animated PNG": _apng,
    "multi-page TIFF": _pages,
}


@pytest.mark.parametrize("kind", list(MODES))
def test_every_pixel_mode_and_multi_frame_file_equals_the_processor(tmp_path, kind):
    """Any mode is RGB for the tower, transparency over white, as the processor's convert_to_rgb; animated and
    multi-page files give their first frame, as a PIL image does to the processor."""
    reference = reference_processor()
    reference.save_pretrained(tmp_path)
    MODES[kind](tmp_path)
    (path,) = tmp_path.glob("x.*")
    assert_same_as(reference, PIL.open(path), path, ImageSettings.from_checkpoint(tmp_path))


@pytest.mark.parametrize("suffix", ["jpg", "png", "tiff"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_equals_the_reference_loader(tmp_path, orientation, suffix):
    from transformers.image_utils import load_image as reference_load

    reference = reference_processor()
    reference.save_pretrained(tmp_path)
    exif = PIL.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"photo.{suffix}"
    PIL.fromarray(noise(60, 140, seed=orientation)).save(path, exif=exif.tobytes())
    assert_same_as(reference, reference_load(str(path)), path, ImageSettings.from_checkpoint(tmp_path))
    assert (load_image(path).height > load_image(path).width) == (orientation >= 5)


CONFIGS = {
    "size": {"size": {"shortest_edge": 2048, "longest_edge": 40000}},
    "min/max_pixels": {"min_pixels": 2048, "max_pixels": 40000},
    "min/max_pixels over size": {"min_pixels": 2048, "max_pixels": 40000,
                                 "size": {"shortest_edge": 4096, "longest_edge": 90000}},
    "mean/std 0.5": {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "mean/std one number": {"image_mean": 0.5, "image_std": 0.25},
    "rescale_factor": {"rescale_factor": 1 / 127.5},
    "do_rescale false": {"do_rescale": False},
    "do_normalize false": {"do_normalize": False},
    "resample bilinear": {"resample": 2},
    "resample nearest": {"resample": 0},
    "nothing": {},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_preprocessor_config_is_read_as_transformers_reads_it(tmp_path, name):
    """Every setting of a Qwen2-VL preprocessor_config.json that changes the pixels counts, as AutoImageProcessor
    reads the file."""
    from transformers import AutoImageProcessor

    config = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
              "temporal_patch_size": 2, **CONFIGS[name]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    reference = AutoImageProcessor.from_pretrained(tmp_path)
    path = tmp_path / "x.png"
    PIL.fromarray(noise(300, 170)).save(path)
    assert_same_as(reference, PIL.open(path), path, ImageSettings.from_checkpoint(tmp_path))


def test_older_size_keys_give_the_bounds(tmp_path):
    """size {min_pixels, max_pixels} (the older spelling, which transformers 5 no longer reads) gives the bounds
    it names, not the defaults."""
    config = {"patch_size": 16, "merge_size": 2, "size": {"min_pixels": 2048, "max_pixels": 40000}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    settings = ImageSettings.from_checkpoint(tmp_path)
    assert (settings.min_pixels, settings.max_pixels) == (2048, 40000)


@pytest.mark.parametrize("config, rule", [
    ({"do_resize": False}, "do_resize \\(false\\) is not followed"),
    ({"image_mean": [0.5, 0.5]}, "image_mean \\(\\[0.5, 0.5\\]\\) must give one value per RGB channel"),
    ([1, 2], "must hold a JSON object, got list"),
])
def test_preprocessor_settings_that_cannot_be_followed_are_refused(tmp_path, config, rule):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ImageError, match=f"^{tmp_path / 'preprocessor_config.json'}: {rule}"):
        ImageSettings.from_checkpoint(tmp_path)


# Chats: image tokens counted and placed as the processor does, never trained.

SETTINGS = ImageSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=48 * 48)
IMAGE_SIZES = [(24, 40), (7, 90), (50, 50), (3, 5), (90, 7)]


def write_images(folder):
    for i, (h, w) in enumerate(IMAGE_SIZES):
        PIL.fromarray(noise(h, w, seed=i)).save(folder / f"{i}.png")


def image_part(i):
    return {"type": "image", "image": f"{i}.png"}


CHATS = {
    "two images in one turn": [
        {"role": "user", "content": [image_part(0), {"type": "text", "text": "what"}, image_part(1)]},
        {"role": "assistant", "content": "square"}],
    "images in several turns": [
        {"role": "user", "content": [image_part(2), {"type": "text", "text": "what"}]},
        {"role": "assistant", "content": "square"},
        {"role": "user", "content": [{"type": "text", "text": "what"}, image_part(3), image_part(4)]},
        {"role": "assistant", "content": "four sides"}],
    "adjacent images and one in the answer": [
        {"role": "user", "content": [image_part(4), image_part(0), image_part(3)]},
        {"role": "assistant", "content": [{"type": "text", "text": "square"}, image_part(1)]}],
}


def reference_chat(folder, messages):
    """The processor's input_ids, pixel_values and grids of a chat: the template's text, each image token widened by
    Qwen2VLProcessor."""
    from transformers import AutoTokenizer, Qwen2VLProcessor

    class Processor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, *args):  # no video processor (it needs torchvision)
            return None

    tokenizer = AutoTokenizer.from_pretrained(folder / "tok")
    image_processor = reference_processor(patch_size=4, min_pixels=16 * 16, max_pixels=48 * 48)
    processor = Processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                          chat_template=CHAT_TEMPLATE_WITH_IMAGES)
    images = [PIL.open(folder / p["image"]) for m in messages if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    bare = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]
    text = tokenizer.apply_chat_template(bare, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt")


@pytest.mark.parametrize("name", list(CHATS))
def test_image_tokens_are_counted_and_placed_as_the_processor_does(tmp_path, name):
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE_WITH_IMAGES)
    write_images(tmp_path)
    messages = CHATS[name]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    (doc,) = load_documents(DataProfile(path=path, seq_len=2000), tok, VisionInput(SETTINGS, TOKENS))
    expected = reference_chat(tmp_path, messages)
    ids = doc.input_ids + [doc.labels[-1]]
    assert ids == expected["input_ids"][0].tolist()
    batch = collate(pack_rows([doc], 2000, 0), SETTINGS)
    assert batch.image_grid_thw.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(batch.pixel_values, expected["pixel_values"].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("train_on, header", [("assistant", False), ("assistant", True), ("all", False)])
@pytest.mark.parametrize("templated", [False, True], ids=["built-in format", "chat template"])
def test_image_tokens_are_never_trained(tmp_path, train_on, header, templated):
    """Whatever trains, no label is an image, vision-start or vision-end token: nothing predicts the picture."""
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE_WITH_IMAGES) if templated else ByteTokenizer()
    write_images(tmp_path)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS.values()))
    profile = DataProfile(path=path, seq_len=2000, train_on=train_on, train_on_assistant_header=header)
    docs = load_documents(profile, tok, VisionInput(SETTINGS, TOKENS))
    assert len(docs) == len(CHATS)
    for doc in docs:
        assert not {TOKENS.image, TOKENS.start, TOKENS.end} & set(doc.labels)
        assert any(label != -100 for label in doc.labels)


def test_an_image_token_written_in_the_text_is_named_as_such(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE_WITH_IMAGES)
    write_images(tmp_path)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image> what <|image_pad|>"},
                                             {"role": "assistant", "content": "square"}], "images": ["0.png"]}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=2000), tok, VisionInput(SETTINGS, TOKENS))
    assert err.value.problems == [f"{path}:1: the text holds the image token id (300) outside its images (1 of them); "
                                  "remove it from the text"]


# Hostile files: one line naming the file and the rule, whatever Pillow's process-wide switches say.


def header_png(path, width, height):
    """A PNG whose header declares width x height, with a token of pixel data."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("pillows_bound", ["default", None, 1000], ids=["pillow-default", "lifted", "lowered"])
@pytest.mark.parametrize("width, height", [(9500, 9500), (20_000, 20_000), (2 * MAX_IMAGE_PIXELS + 2, 1)])
def test_bombs_are_named_by_their_size_whatever_pillows_bound(tmp_path, monkeypatch, pillows_bound, width, height):
    if pillows_bound != "default":
        monkeypatch.setattr(PIL, "MAX_IMAGE_PIXELS", pillows_bound)
    path = header_png(tmp_path / "bomb.png", width, height)
    with pytest.raises(ImageError) as err:
        load_image(path)
    assert str(err.value) == (f"{path}: {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} an image may have "
                              "(a decompression bomb?)")


@pytest.mark.parametrize("pillows_bound", ["default", None, 1000], ids=["pillow-default", "lifted", "lowered"])
@pytest.mark.parametrize("width, height", [(9459, 9459), (MAX_IMAGE_PIXELS // 4, 4)], ids=["square", "wide"])
def test_images_within_the_bound_are_decoded_whatever_pillows_bound(tmp_path, monkeypatch, pillows_bound, width,
                                                                    height):
    """At the bound or under it, the header passes and the decoder runs: these files end early, so they are refused
    as truncated, not as bombs."""
    if pillows_bound != "default":
        monkeypatch.setattr(PIL, "MAX_IMAGE_PIXELS", pillows_bound)
    assert width * height <= MAX_IMAGE_PIXELS
    path = header_png(tmp_path / "big.png", width, height)
    with pytest.raises(ImageError, match=f"^{path}: not a readable image \\(OSError: image file is truncated"):
        load_image(path)


@pytest.mark.parametrize("suffix", ["png", "jpg", "gif", "bmp", "tiff"])
@pytest.mark.parametrize("load_truncated", [False, True])
def test_truncated_files_are_refused_whatever_pillows_switch(tmp_path, monkeypatch, suffix, load_truncated):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    whole = tmp_path / f"whole.{suffix}"
    PIL.fromarray(noise(64, 80)).save(whole)
    path = tmp_path / f"cut.{suffix}"
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ImageError, match=f"^{path}: not a readable image \\(OSError: image file is truncated"):
        load_image(path)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is load_truncated  # the process's switch is left as it was


def test_postscript_is_never_handed_to_ghostscript(tmp_path, monkeypatch):
    """An EPS file (whatever its name says) would be decoded by running Ghostscript on its program."""
    import subprocess

    def no_program(*args, **kwargs):
        raise AssertionError(f"ran {args[0]!r}")

    monkeypatch.setattr(subprocess, "check_call", no_program)
    monkeypatch.setattr(subprocess, "run", no_program)
    monkeypatch.setattr(subprocess, "Popen", no_program)
    path = tmp_path / "cat.png"
    path.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\n0 0 moveto 10 10 lineto stroke\n"
                    "showpage\n%%EOF\n")
    with pytest.raises(ImageError) as err:
        load_image(path)
    assert str(err.value) == (f"{path}: an EPS file, which Pillow decodes by running Ghostscript on its PostScript: "
                              "not read; save it as PNG or JPEG")


@pytest.mark.parametrize("height, width, ratio", [(2, 401, "200.5"), (401, 2, "200.5"), (1, 250, "250"),
                                                  (3, 700, "233.3")])
def test_an_aspect_ratio_over_200_says_its_value(tmp_path, height, width, ratio):
    path = tmp_path / "strip.png"
    PIL.fromarray(noise(height, width)).save(path)
    with pytest.raises(ImageError, match=f"^aspect ratio {ratio} must be <= 200$"):
        image_patches(load_image(path), SETTINGS)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    bound = tmp_path / "bound.png"
    PIL.fromarray(noise(2, 400)).save(bound)
    h, w = smart_resize(2, 400, SETTINGS.factor, SETTINGS.min_pixels, SETTINGS.max_pixels)  # exactly 200: kept
    assert image_patches(load_image(bound), SETTINGS)[1] == (1, h // 4, w // 4)


def test_each_image_meets_its_own_tokens_as_in_the_reference(tmp_path):
    """Records with two or three pictures (two of one size, one of another, in two turns), in both orders: the
    logits equal transformers' Qwen3.5-MoE on the same tokens and pixels, and swapping two pictures changes them by
    far more than that tolerance (a placement that ignored the order, or put features off their tokens, would
    differ from the reference)."""
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_5_moe

    from moe_tune.engine.align.compare import load_ours, load_reference
    from moe_tune.engine.data.dataset import vision_input
    from moe_tune.engine.families import model_profile_from_checkpoint, resolve_job
    from moe_tune.profiles import validate_profile

    checkpoint = save_tiny_checkpoint(tiny_qwen3_5_moe(), tmp_path / "checkpoint")
    reference_processor(patch_size=4, min_pixels=16 * 16, max_pixels=32 * 32).save_pretrained(checkpoint)
    for name, (h, w) in {"a": (16, 24), "b": (16, 24), "c": (24, 16)}.items():
        PIL.fromarray(noise(h, w, seed=ord(name))).save(tmp_path / f"{name}.png")

    def record(*images):
        return {"messages": [{"role": "user", "content": "<image>what<image>?"}, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": "<image>" * (len(images) - 2) + "and?"},
                             {"role": "assistant", "content": "y"}], "images": [f"{i}.png" for i in images]}

    orders = [("a", "b"), ("b", "a"), ("a", "c", "b"), ("c", "a", "b")]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(record(*order)) + "\n" for order in orders))
    job = resolve_job(validate_profile({"name": "vl", "model": {"checkpoint": str(checkpoint)},
                                        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 256},
                                        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3},
                                        "output": {"dir": str(tmp_path / "out")}}))
    vision = vision_input(job.model, job.data)
    docs = load_documents(job.data, ByteTokenizer(), vision)
    family, _, _ = model_profile_from_checkpoint(checkpoint)
    reference, ours = load_reference(checkpoint, family), load_ours(job.model)
    image_token = job.model.vision.image_token_id
    logits = []
    with torch.no_grad():
        for doc in docs:
            batch = collate(pack_rows([doc], len(doc.input_ids), 0), vision.settings)
            ids = batch.input_ids
            expected = reference(input_ids=ids, pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                                 mm_token_type_ids=(ids == image_token).int()).logits[0]
            got = ours(**batch.model_inputs("cpu")).logits[0]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            logits.append(got)
    for forward, swapped in [(0, 1), (2, 3)]:
        assert (logits[forward] - logits[swapped]).abs().max() > 1e-2  # ~0.1: a thousand times the tolerance
