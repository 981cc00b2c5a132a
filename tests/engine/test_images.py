"""Images in: preprocessing equal to the checkpoint's reference processor, image-text records rendered with
placeholders, broken images reported or skipped, documents with images never cut by packing."""

import json

import numpy as np
import pytest
import torch

from moe_tune.engine.data.dataset import VisionInput, collate, load_documents, pack_rows
from moe_tune.engine.data.images import ImageError, ImageSettings, image_patches, load_image
from moe_tune.engine.data.multimodal import VisionTokens
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile

PIL = pytest.importorskip("PIL.Image")
SIZES = [(37, 91), (200, 120), (64, 64), (500, 333)]
# A side under half the factor (32 here) rounds to 0 and the image is scaled up to min_pixels; one just over half does
# not; a side of exactly one factor; the 200 aspect ratio at its bound.
THIN = [(10, 1000), (15, 700), (17, 700), (700, 12), (32, 900), (5, 1000)]
TOKENS = VisionTokens(image=300, start=301, end=302)


def write_image(path, height, width, seed=0):
    rng = np.random.default_rng(seed)
    PIL.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def reference_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                    max_pixels=256 * 256)


def test_patches_equal_the_reference_processor(tmp_path, reference_processor):
    reference_processor.save_pretrained(tmp_path)
    settings = ImageSettings.from_checkpoint(tmp_path)
    assert (settings.patch_size, settings.merge_size, settings.max_pixels) == (16, 2, 256 * 256)
    for i, (h, w) in enumerate(SIZES):
        image = load_image(write_image(tmp_path / f"{i}.png", h, w, seed=i))
        expected = reference_processor(images=[image], return_tensors="pt")
        patches, grid = image_patches(image, settings)
        assert [list(grid)] == expected["image_grid_thw"].tolist()
        torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("height, width", THIN)
def test_thin_images_get_the_reference_processors_grid(tmp_path, reference_processor, height, width):
    """The grid (so the image's token count) of images with a side under the factor, as transformers' processor
    gives it: that is the count inference sees."""
    reference_processor.save_pretrained(tmp_path)
    image = load_image(write_image(tmp_path / "thin.png", height, width))
    expected = reference_processor(images=[image], return_tensors="pt")
    patches, grid = image_patches(image, ImageSettings.from_checkpoint(tmp_path))
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied_like_the_reference_loader(tmp_path, reference_processor, orientation):
    """A photo whose EXIF says it is rotated (a phone's portrait shot) is trained upright: patches and grid equal
    transformers' load_image then its processor. Orientations 6 and 8 swap the sides."""
    from transformers.image_utils import load_image as reference_load

    reference_processor.save_pretrained(tmp_path)
    exif = PIL.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.jpg"
    rng = np.random.default_rng(orientation)
    PIL.fromarray(rng.integers(0, 255, (60, 140, 3), dtype=np.uint8)).save(path, exif=exif.tobytes(), quality=95)
    expected = reference_processor(images=[reference_load(str(path))], return_tensors="pt")
    patches, grid = image_patches(load_image(path), ImageSettings.from_checkpoint(tmp_path))
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    assert (grid[1] > grid[2]) == (orientation in (6, 8))
    torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)


def test_an_aspect_ratio_over_the_bound_names_the_image(tmp_path):
    path = write_image(tmp_path / "strip.png", 2, 500)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>what?"},
                                             {"role": "assistant", "content": "a strip"}], "images": ["strip.png"]})
                    + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(data), ByteTokenizer(), vision())
    assert err.value.problems == [f"{data}:1: {path}: aspect ratio 250 must be <= 200"]


def vision(settings=None):
    return VisionInput(settings or ImageSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32),
                       TOKENS)


def data_profile(path, **extra):
    return DataProfile(path=path, seq_len=512, **extra)


def test_image_records_render_placeholders(tmp_path):
    write_image(tmp_path / "a.png", 24, 40)
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": "a square"},
    ]}
    placeholder = {"messages": [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "a square"}],
                   "images": ["a.png"]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(parts) + "\n" + json.dumps(placeholder) + "\n")
    first, second = load_documents(data_profile(path), ByteTokenizer(), vision())
    assert first == second
    (ref,) = first.images
    # 24 x 40 pixels -> 24 x 40 (multiples of 8) -> a 6 x 10 patch grid -> 15 tokens after 2 x 2 merging.
    assert ref.grid == (1, 6, 10)
    ids = first.input_ids
    start = ids.index(TOKENS.start)
    assert ids[start + 1 : start + 16] == [TOKENS.image] * 15 and ids[start + 16] == TOKENS.end
    # Nothing of the image is trained on, the assistant's answer is.
    image_positions = [i for i, t in enumerate(ids) if t in (TOKENS.start, TOKENS.image, TOKENS.end)]
    assert all(first.labels[i - 1] == -100 for i in image_positions)
    trained = [t for t, label in zip(ids[1:], first.labels) if label != -100]
    assert ByteTokenizer().decode(trained) == "a square\n"


def test_missing_and_broken_images_are_named_or_skipped(tmp_path):
    write_image(tmp_path / "good.png", 16, 16)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    rows = [
        {"messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "ok"}], "images": [n]}
        for n in ("good.png", "missing.png", "broken.png")
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path), ByteTokenizer(), vision())
    assert err.value.problems == [
        f"{path}:2: {tmp_path / 'missing.png'}: no such image file",
        f"{path}:3: {tmp_path / 'broken.png'}: not a readable image (UnidentifiedImageError)",
    ]
    skipped = []
    docs = load_documents(data_profile(path, bad_images="skip"), ByteTokenizer(), vision(), skipped)
    assert len(docs) == 1 and len(skipped) == 2 and "missing.png" in skipped[0]


def test_malformed_image_records(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [
        {"messages": [{"role": "user", "content": "<image><image>"}], "images": ["a.png"]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x/y.png"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path, bad_images="skip"), ByteTokenizer(), vision(), [])
    assert err.value.problems == [
        f"{path}:1: more <image> placeholders than entries in 'images'",
        f"{path}:2: image 'https://x/y.png' must be a local file (nothing is downloaded)",
        f"{path}:3: a content part must be {{'type': 'text', 'text': str}} or {{'type': 'image', 'image': path}}, "
        "got {'type': 'video'}",
    ]
    with pytest.raises(ProfileError, match="the record has images but the model has no vision tower"):
        load_documents(data_profile(path), ByteTokenizer(), None)


def test_content_parts_for_a_model_without_vision_name_what_is_wrong(tmp_path):
    """A text model given content parts: a malformed part is named as such, parts of text alone are told to be
    strings, and only a record with an image is refused for the missing vision tower."""
    path = tmp_path / "data.jsonl"
    reply = {"role": "assistant", "content": "y"}
    records = [
        {"messages": [{"role": "user", "content": [{"type": "text"}]}, reply]},
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}, reply]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": 5}]}, reply]},
        {"messages": [{"role": "user", "content": [5]}, reply]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, reply]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}, reply]},
        {"messages": [{"role": "user", "content": "<image>"}, reply], "images": ["a.png"]},
    ]
    part_rule = "a content part must be {'type': 'text', 'text': str} or {'type': 'image', 'image': path}, got"
    expected = [f"{part_rule} {{'type': 'text'}}", f"{part_rule} {{'type': 'audio', 'audio': 'x.wav'}}",
                "an image part needs an 'image' path string", f"{part_rule} 5",
                "content given as a list of parts is for images, which this model (no model.vision) does not take: "
                "write each message's text content as a string"] + [
                "the record has images but the model has no vision tower (model.vision)"] * 2  # fmt: skip
    for index, (record, line) in enumerate(zip(records, expected)):
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(ProfileError) as err:
            load_documents(data_profile(path), ByteTokenizer(), None)
        assert err.value.problems == [f"{path}:1: {line}"], index


def test_documents_with_images_are_never_cut(tmp_path):
    write_image(tmp_path / "a.png", 32, 32)
    records = [{"text": "x" * 30}] + [
        {"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "yes"}],
         "images": ["a.png"]}
    ] * 3
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = ImageSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32)
    docs = load_documents(DataProfile(path=path, seq_len=64), ByteTokenizer(), vision(settings))
    image_doc_len = len(docs[1].input_ids)
    assert 32 < image_doc_len <= 64  # one image document fits a row, two do not
    rows = pack_rows(docs, 64, ByteTokenizer.pad_id)
    for row in rows:
        # Every image's placeholders are whole inside its row: starts, image tokens and ends pair up.
        assert row.input_ids.count(TOKENS.start) == row.input_ids.count(TOKENS.end) == len(row.images)
        assert row.input_ids.count(TOKENS.image) == 16 * len(row.images)
    assert sum(len(r.images) for r in rows) == 3
    batch = collate(rows, settings)
    assert batch.image_grid_thw.tolist() == [[1, 8, 8]] * 3
    assert batch.pixel_values.shape == (3 * 64, 3 * 2 * 4 * 4)
    assert int((batch.input_ids == TOKENS.image).sum()) * 4 == batch.pixel_values.shape[0]


def test_unreadable_preprocessor_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ImageError, match="preprocessor_config.json: cannot read the image processor settings"):
        ImageSettings.from_checkpoint(tmp_path)


@pytest.mark.parametrize("settings, problem", [
    ({"resample": 99}, "resample (99) must be one of Pillow's filters, 0 to 5"),
    ({"resample": -1}, "resample (-1) must be one of Pillow's filters, 0 to 5"),
    ({"size": {"shortest_edge": 0, "longest_edge": 0}}, "max_pixels (0) must be in [1, 89478485] (Pillow's bound on "
                                                        "an image)"),
    ({"max_pixels": 89478486}, "max_pixels (89478486) must be in [1, 89478485] (Pillow's bound on an image)"),
    ({"min_pixels": 5000, "max_pixels": 2304}, "min_pixels (5000) must be >= 0 and <= max_pixels (2304)"),
    ({"min_pixels": -5}, "min_pixels (-5) must be >= 0 and <= max_pixels (1003520)"),
    ({"image_std": [0, 0, 0]}, "image_std ([0.0, 0.0, 0.0]) must be finite and nonzero for each channel"),
    ({"image_std": 0.5, "image_mean": [0.5, "Infinity", 0.5]}, None),
    ({"patch_size": 0}, "patch_size (0) must be >= 1"),
    ({"merge_size": -2}, "merge_size (-2) must be >= 1"),
])  # fmt: skip
def test_preprocessor_settings_images_cannot_be_read_with_are_one_line(tmp_path, settings, problem):
    """Each was a traceback (resample 99: ValueError; a longest edge of 0: ZeroDivisionError) or silently broken
    pixels (a std of 0: inf and nan fed to the model); the bound on max_pixels keeps a resize from making gigabytes."""
    text = json.dumps(settings).replace('"Infinity"', "Infinity")
    (tmp_path / "preprocessor_config.json").write_text(text)
    if problem is None:
        problem = "image_mean ([0.5, inf, 0.5]) and rescale_factor (0.00392156862745098) must be finite"
    with pytest.raises(ImageError) as err:
        ImageSettings.from_checkpoint(tmp_path)
    assert str(err.value) == f"{tmp_path / 'preprocessor_config.json'}: {problem}"


def test_the_profiles_pixel_bounds_are_checked_with_the_checkpoints(tmp_path):
    from moe_tune.engine.data.dataset import vision_input
    from moe_tune.profiles import load_profile

    job = load_profile("tiny-vl", ["data.image_min_pixels=5000"])  # tiny-vl's image_max_pixels: 2304
    with pytest.raises(ProfileError) as err:
        vision_input(job.model, job.data)
    assert err.value.problems == ["data.image_min_pixels (5000) must be >= 0 and <= data.image_max_pixels (2304)"]
    job = load_profile("tiny-vl", ["data.image_max_pixels=100000000"])
    with pytest.raises(ProfileError) as err:
        vision_input(job.model, job.data)
    assert err.value.problems == ["data.image_max_pixels (100000000) must be in [1, 89478485] (Pillow's bound on an "
                                  "image)"]
    job = load_profile("tiny-vl", ["data.image_max_pixels=200"])  # below tiny-vl's image_min_pixels (256)
    with pytest.raises(ProfileError) as err:
        vision_input(job.model, job.data)
    assert err.value.problems == ["data.image_min_pixels (256) must be >= 0 and <= data.image_max_pixels (200)"]


def test_transparent_images_are_composited_on_white_like_the_reference(tmp_path, reference_processor):
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 255, (40, 56, 4), dtype=np.uint8)
    PIL.fromarray(rgba, mode="RGBA").save(tmp_path / "t.png")
    reference_processor.save_pretrained(tmp_path)
    image = load_image(tmp_path / "t.png")
    expected = reference_processor(images=[PIL.open(tmp_path / "t.png")], return_tensors="pt")
    patches, _ = image_patches(image, ImageSettings.from_checkpoint(tmp_path))
    torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)


def test_empty_images_list_is_a_text_record(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                "images": []}) + "\n")
    (doc,) = load_documents(data_profile(path), ByteTokenizer(), None)
    assert doc.images == ()


@pytest.mark.parametrize("literal, counts", [("image", "1 image, 0 start and 0 end"),
                                             ("start", "0 image, 1 start and 0 end"),
                                             ("end", "0 image, 0 start and 1 end")])
def test_image_token_ids_in_text_are_refused(tmp_path, literal, counts):
    # The byte tokenizer cannot produce ids 300-302; a tokenizer can (a literal <|image_pad|> or <|vision_start|>):
    # simulated by a record of ids through a text tokenizer whose encode returns them. The line counts each kind.
    class Tokens(ByteTokenizer):
        def encode(self, text):
            return super().encode(text.replace("PAD", "")) + ([getattr(TOKENS, literal)] if "PAD" in text else [])

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "PAD"}, {"role": "assistant", "content": "x"}]})
                    + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path), Tokens(), vision())
    assert err.value.problems == [f"{path}:1: the text holds the image token ids (300, 301 or 302) outside its images "
                                  f"({counts} tokens for 0 images, which put 0, 0 and 0); remove them from the text"]


CHAT_TEMPLATE_WITH_IMAGES = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %} {{ p['text'] }} {% endif %}"
    "{% endfor %}{% endif %} <|im_end|> {% endfor %}"
)


def word_tokenizer(folder, chat_template: str):
    """A word-level tokenizer with the vision tokens at TOKENS' ids (300-302) and `chat_template`, saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.data.tokenizer import load_tokenizer

    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"]
    vocab = {f"w{i}": i for i in range(300)} | {t: 300 + i for i, t in enumerate(specials)}
    vocab |= {"<unk>": 305, "user": 306, "assistant": 307, "what": 308, "square": 309, "<s>": 310, "</s>": 311}
    vocab |= {"<think>": 312, "four": 313, "sides": 314}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=specials)
    tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return load_tokenizer(str(folder))


def test_image_chats_use_the_checkpoints_chat_template(tmp_path):
    """A tokenizer with a chat template renders image records through it (as the checkpoint's model was trained);
    each image's single placeholder token is widened to the image's token count (15 here)."""
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE_WITH_IMAGES)
    write_image(tmp_path / "a.png", 24, 40)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image> what"},
                                             {"role": "assistant", "content": "square"}], "images": ["a.png"]}) + "\n")
    (doc,) = load_documents(data_profile(path), tok, vision())
    # <|im_start|> user <|vision_start|> <|image_pad|> x 15 <|vision_end|> what <|im_end|> <|im_start|> ... (no <s>:
    # the template renders none)
    assert doc.input_ids[:3] == [303, 306, TOKENS.start]
    assert doc.input_ids[3:18] == [TOKENS.image] * 15 and doc.input_ids[18] == TOKENS.end
    assert doc.input_ids[19:21] == [308, 304]
    trained = [t for t, label in zip(doc.input_ids[1:] + [311], doc.labels) if label != -100]
    assert 309 in trained and TOKENS.image not in trained


@pytest.mark.parametrize("field, value", [("reasoning_content", "four sides"), ("name", "w7")])
def test_an_image_chat_keeps_the_messages_other_fields(tmp_path, field, value):
    """A message's other fields (reasoning, a speaker's name) reach the template with images as without: the record
    with an image trains the same tokens as the same record without it."""
    template = CHAT_TEMPLATE_WITH_IMAGES.replace(
        "{% if m['content'] is string %}",
        "{% if m.reasoning_content %}<think> {{ m.reasoning_content }} {% endif %}{% if m.name %}{{ m.name }} "
        "{% endif %}{% if m['content'] is string %}")
    tok = word_tokenizer(tmp_path / "tok", template)
    write_image(tmp_path / "a.png", 24, 40)
    trained = {}
    for case, user, images in [("text", "what", {}), ("image", "<image> what", {"images": ["a.png"]})]:
        path = tmp_path / f"{case}.jsonl"
        path.write_text(json.dumps({"messages": [{"role": "user", "content": user},
                                                 {"role": "assistant", "content": "square", field: value}], **images})
                        + "\n")
        (doc,) = load_documents(data_profile(path), tok, vision())
        trained[case] = [label for label in doc.labels if label != -100]
    assert trained["image"] == trained["text"]
    assert {313, 314} <= set(trained["text"]) if field == "reasoning_content" else 7 in trained["text"]


def test_a_chat_template_that_drops_images_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.data.tokenizer import load_tokenizer

    core = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "</s>": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}hi {% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    write_image(tmp_path / "a.png", 16, 16)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>"}], "images": ["a.png"]}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path), load_tokenizer(str(tmp_path / "tok")), vision())
    assert err.value.problems == [f"{path}:1: the tokenizer's chat template renders 0 image tokens (300) for 1 images: "
                                  "it must render each image part as one"]


def test_an_image_chat_with_a_tool_call_needs_a_template_and_takes_one(tmp_path):
    """The built-in format cannot write a tool call: refused, as for a text record; through a chat template an
    assistant message with tool_calls and no content is rendered (its calls are the template's to write)."""
    write_image(tmp_path / "a.png", 24, 40)
    call = {"type": "function", "function": {"name": "w7", "arguments": {}}}
    messages = [{"role": "user", "content": "<image> what"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "w8"}, {"role": "assistant", "content": "square"}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages, "images": ["a.png"]}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(data_profile(path), ByteTokenizer(), vision())
    assert err.value.problems == [f"{path}:1: a message with tool_calls needs a chat template that writes them "
                                  "(data.chat_template, or the tokenizer's); the built-in <|role|> format has none"]
    template = CHAT_TEMPLATE_WITH_IMAGES.replace(
        "{% if m['content'] is string %}",
        "{% for c in m.tool_calls or [] %}{{ c.function.name }} {% endfor %}{% if m['content'] is string %}")
    (doc,) = load_documents(data_profile(path), word_tokenizer(tmp_path / "tok", template), vision())
    trained = [label for label in doc.labels if label != -100]
    assert 7 in trained and 8 not in trained and 309 in trained
