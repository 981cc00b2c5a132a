"""`moe-tune generate` with images against transformers, on the tiny qwen3_5_moe and qwen4_exp checkpoints with
their vision towers: the prompt and pixels are what transformers' Qwen2-VL processor gives for the same chat
(apply_chat_template with image parts), and greedy decoding after them chooses the tokens transformers' own
`generate` chooses (multimodal RoPE over the images, then the images' offset for every later token; QSA blocks
completed during decoding rotated where the forward rotates them), with the images at the front of the user turn as
`--image` places them and between texts with the prompt in several prefill calls (an image's tokens across two)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hf_tiny import image_token_ids, save_tiny_checkpoint, tiny_qwen3_5_moe, tiny_qwen4_exp
from moe_tune.engine.align.reference import pure_torch_paths
from moe_tune.engine.data.multimodal import VisionTokens

PIL = pytest.importorskip("PIL.Image")

FAMILIES = {"qwen3_5_moe": tiny_qwen3_5_moe, "qwen4_exp": tiny_qwen4_exp}
# Past a completed QSA block of the tiny qwen4_exp (block_size 4) after the prompt.
NUM_NEW_TOKENS = 12
IMAGE_GAIN = 100.0
# Qwen-VL's rendering of image parts, in a template small enough to read.
VL_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{- m.content }}{%- else %}{%- for part in m.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def save_vl_tokenizer(directory: Path, vocab_size: int) -> None:
    """A character-level tokenizer whose vision tokens are the checkpoint's ids (the last three of its vocabulary),
    with VL_TEMPLATE, saved beside the checkpoint."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = image_token_ids(vocab_size)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)} | {"<|im_start|>": 100, "<|im_end|>": 101}
    vocab |= {"<|image_pad|>": ids["image_token_id"], "<|vision_start|>": ids["vision_start_token_id"],
              "<|vision_end|>": ids["vision_end_token_id"]}  # fmt: skip
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|image_pad|>", "<|vision_start|>",
                                                          "<|vision_end|>"]})  # fmt: skip
    tok.chat_template = VL_TEMPLATE
    tok.save_pretrained(str(directory))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vl(request, tmp_path_factory):
    """(the family's session on its base model, transformers' model, the Qwen2-VL processor, the image files)."""
    from transformers import AutoTokenizer, ProcessorMixin, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from moe_tune.engine.align.compare import load_reference
    from moe_tune.engine.families import model_profile_from_checkpoint
    from moe_tune.engine.generate.session import load_session

    root = tmp_path_factory.mktemp(request.param)
    model = FAMILIES[request.param]()
    with torch.no_grad():
        # The images' rows well above the text embeddings', so that their pixels change the tokens chosen.
        model.model.visual.merger.linear_fc2.weight.mul_(IMAGE_GAIN)
    checkpoint = save_tiny_checkpoint(model, root / "checkpoint")
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                      max_pixels=32 * 32)  # fmt: skip
    images.save_pretrained(checkpoint)
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    save_vl_tokenizer(checkpoint, cfg.vocab_size)
    rng = np.random.default_rng(0)
    files = []
    for name, size in (("a.png", (24, 32)), ("b.png", (16, 28))):
        PIL.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / name)
        files.append(root / name)
    (root / "data.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    profile = root / "base.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "generate-images", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(root / "data.jsonl"), "tokenizer": str(checkpoint), "seq_len": 64},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-4}, "output": {"dir": str(root / "run")},
    }))
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    # Built without a video processor (torchvision's), whose class lookup the constructor would make.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None)
        processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=VL_TEMPLATE)
    session = load_session(str(profile), device=torch.device("cpu"))
    return session, load_reference(checkpoint, family), processor, files


# The user turn: both images before the text (as --image places them), or text, an image, text, the other image.
LAYOUTS = {"images-first": ["image", "image", "What is in them?"],
           "between-texts": ["Look: ", "image", " and then ", "image", " - which is brighter?"]}  # fmt: skip


def conversation(layout: list[str], files: list[Path], with_paths: bool) -> list[dict]:
    paths = iter(files)
    parts = [({"type": "image"} | ({"image": str(next(paths))} if with_paths else {})) if piece == "image"
             else {"type": "text", "text": piece} for piece in layout]  # fmt: skip
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk", [1024, 16], ids=["one-call", "calls-of-16"])
def test_greedy_generate_with_images_equals_transformers(vl, layout, chunk, monkeypatch):
    import moe_tune.engine.generate.decode as decode
    from moe_tune.engine.generate.session import read_prompt_images

    session, reference, processor, files = vl
    monkeypatch.setattr(decode, "PREFILL_CHUNK_TOKENS", chunk)
    images = read_prompt_images(files, session.profile)
    ids = session.prompt(messages=conversation(LAYOUTS[layout], files, False), images=images)
    expected = processor.apply_chat_template(conversation(LAYOUTS[layout], files, True), add_generation_prompt=True,
                                             tokenize=True, return_dict=True, return_tensors="pt")
    assert ids == expected["input_ids"][0].tolist()
    torch.testing.assert_close(images.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    assert images.grids.tolist() == expected["image_grid_thw"].tolist()
    if chunk == 16:
        image = session.profile.model.vision.image_token_id
        assert any(ids[i - 1] == ids[i] == image for i in range(16, len(ids), 16))  # an image across two calls
    ours = session.generate(ids, NUM_NEW_TOKENS, temperature=0, stop=False, images=images)
    prompt = torch.tensor([ids])
    image_id = session.profile.model.vision.image_token_id
    with pure_torch_paths(), torch.no_grad():
        out = reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 pixel_values=images.pixel_values, image_grid_thw=images.grids,
                                 mm_token_type_ids=(prompt == image_id).int(), max_new_tokens=NUM_NEW_TOKENS,
                                 min_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.ids == out[0, len(ids) :].tolist()
    # The images matter: others (the same grids, other pixels) change the logits of the first token, and with the
    # images first (the last text short) the tokens chosen.
    noise = torch.randn(images.pixel_values.shape, generator=torch.Generator().manual_seed(0))
    other = decode.PromptImages(noise, images.grids)
    assert (last_logits(session, ids, other) - last_logits(session, ids, images)).abs().max() > 1e-3
    if layout == "images-first":
        assert session.generate(ids, NUM_NEW_TOKENS, temperature=0, stop=False, images=other).ids != ours.ids


def last_logits(session, ids: list[int], images) -> torch.Tensor:
    """The prefill's last row of logits [V] after `ids` with `images`."""
    from moe_tune.engine.generate import DecodeCache
    from moe_tune.engine.generate.decode import forward_cached, prompt_images

    cache, prompt = DecodeCache(), torch.tensor([ids])
    features, positions, cache.rotary_offset = prompt_images(session.model, prompt, images)
    return forward_cached(session.model, prompt, cache, features, positions)[0, -1]


def test_a_prompt_the_images_cannot_be_placed_in_is_one_line(vl):
    from moe_tune.engine.data.chat import ChatOptions
    from moe_tune.engine.generate.session import image_prompt_ids
    from moe_tune.profiles import ProfileError

    session, _, _, files = vl
    spec = session.profile.model.vision
    tokens = VisionTokens(spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id)
    image_part = [{"type": "image"}]
    # The image token written in the text, with the images or alone.
    for parts in (image_part + [{"type": "text", "text": "a <|image_pad|> here"}],
                  [{"type": "text", "text": "<|image_pad|>"}]):
        with pytest.raises(ProfileError) as err:
            image_prompt_ids(session.tok, [{"role": "user", "content": parts}], [12], tokens, session.options)
        assert err.value.problems == [f"prompt: the text holds the image token id ({spec.image_token_id}) outside the "
                                      "images; remove it from the text"]
    # A template that writes no image part, or one too many.
    for template, placed in (("{% for m in messages %}{{ m.role }}{% endfor %}", 0),
                             ("{% for m in messages %}<|image_pad|><|image_pad|>{% endfor %}", 2)):
        with pytest.raises(ProfileError) as err:
            image_prompt_ids(session.tok, [{"role": "user", "content": image_part}], [12], tokens,
                             ChatOptions(template=template))
        assert err.value.problems == [f"--image: data.chat_template renders {placed} image tokens "
                                      f"({spec.image_token_id}) for 1 images: it must render each image part as one"]
