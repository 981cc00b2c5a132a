"""Image input from Hugging Face checkpoints (qwen3_5_moe and qwen4_exp with their vision towers): align on image +
text documents (vision features, merged embeddings, every layer, logits), a wrong vision mapping caught, and a
fine-tune on image-text records whose first loss is the reference's."""

import json

import numpy as np
import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.families import qwen3_5_moe, qwen4_exp

from hf_tiny import save_tiny_checkpoint, tiny_qwen3_5_moe, tiny_qwen4_exp

PIL = pytest.importorskip("PIL.Image")


FAMILIES = {"qwen3_5_moe": (tiny_qwen3_5_moe, qwen3_5_moe), "qwen4_exp": (tiny_qwen4_exp, qwen4_exp)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    build, module = FAMILIES[request.param]
    return save_tiny_checkpoint(build(), tmp_path_factory.mktemp("vl") / request.param), module


@pytest.fixture
def checkpoint(family):
    return family[0]


def test_vision_tower_is_mapped(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert cfg.vision is not None and cfg.vision.depth == 1 and cfg.vision.mrope_section == (2, 1, 1)
    assert (cfg.vision.image_token_id, cfg.vision.vision_start_token_id) == (cfg.vocab_size - 3, cfg.vocab_size - 2)


@pytest.mark.parametrize("pin", [False, True])
def test_aligned_on_images_and_text(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin)
    assert report.passed, report.failures
    assert report.images == [0, 1, 2]  # a text-only document packed with image documents
    names = [row.name for row in report.layers]
    assert names[:2] == ["vision features", "merged embeddings"]
    assert report.layers[0].rel < 1e-5 and report.layers[1].rel < 1e-5
    assert report.logits.max_abs < 1e-5


def test_wrong_vision_mapping_is_caught(family, monkeypatch):
    checkpoint, family_module = family
    original = family_module.vision_recipe

    def channels_after_time(name, prefix):
        # A classic bug: flattening the Conv3d patch kernel [D, C, T, p, p] as [D, T, C, p, p].
        if name == "patch_embed.weight":
            key = prefix + "patch_embed.proj.weight"
            return lambda get: get(key).transpose(1, 2).reshape(get(key).shape[0], -1)
        return original(name, prefix)

    monkeypatch.setattr(family_module, "vision_recipe", channels_after_time)
    report = align_checkpoint(checkpoint)
    assert not report.passed
    assert report.layers[0].name == "vision features" and report.layers[0].rel > 1e-2
    assert report.logits.max_abs > report.tolerances.logits_max_abs


def write_image_records(directory, count):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        size = (16 + 8 * (i % 3), 24)
        PIL.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(directory / f"{i}.png")
        lines.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": f"picture {i}"},
        ]})
        lines.append({"text": f"plain text {i}"})
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def reference_loss_with_images(reference, batch, image_token_id):
    """The reference's mean loss over a packed micro-batch, each document run alone with its own images."""
    total, count = 0.0, int((batch.labels != -100).sum())
    grids = batch.image_grid_thw if batch.image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    first_patch = [0] + grids.prod(-1).cumsum(0).tolist()
    image = 0
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            ids = batch.input_ids[:, a:b]
            inputs = {"input_ids": ids}
            runs = int(((ids[0, 1:] == image_token_id) & (ids[0, :-1] != image_token_id)).sum()) + int(
                ids[0, 0] == image_token_id
            )
            if runs:
                inputs.update(pixel_values=batch.pixel_values[first_patch[image] : first_patch[image + runs]],
                              image_grid_thw=grids[image : image + runs],
                              mm_token_type_ids=(ids == image_token_id).int())
                image += runs
            logits = reference(**inputs).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits, batch.labels[0, a:b], ignore_index=-100,
                                                       reduction="sum").item()
    return total / count


def test_finetune_on_images_starts_at_the_reference_loss(checkpoint, tmp_path):
    from moe_tune.engine.align.compare import load_reference
    from moe_tune.engine.data.dataset import PackedDataset, load_documents, vision_input
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import ProfileError, validate_profile

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = write_image_records(tmp_path, 6)
    raw = {
        "name": "vl", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 96},
        "train": {"steps": 3, "micro_batch_size": 2, "lr": 1e-3},
        "output": {"dir": str(tmp_path / "out")},
    }
    # Without the checkpoint's image processor settings, image records are refused, naming the file.
    (checkpoint / "preprocessor_config.json").unlink(missing_ok=True)
    job = resolve_job(validate_profile(raw))
    with pytest.raises(ProfileError) as err:
        load_documents(job.data, load_tokenizer("byte"), vision_input(job.model, job.data))
    assert err.value.problems[0] == (f"{data}:1: {checkpoint / 'preprocessor_config.json'}: missing; image records "
                                     "need the checkpoint's image processor settings")
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                             max_pixels=32 * 32).save_pretrained(checkpoint)
    job = resolve_job(validate_profile({
        "name": "vl", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 96},
        "train": {"steps": 3, "micro_batch_size": 2, "lr": 1e-3},
        "output": {"dir": str(tmp_path / "out")},
        "lora": {"vision_tower": "lora", "vision_merger": "trained"},
    }))
    vision = vision_input(job.model, job.data)
    docs = load_documents(job.data, load_tokenizer("byte"), vision)
    batch = PackedDataset(docs, 96, 258, job.data.seed, vision.settings).micro_batch(0, 2)
    assert batch.pixel_values is not None
    family, _, _ = model_profile_from_checkpoint(checkpoint)
    expected = reference_loss_with_images(load_reference(checkpoint, family), batch, job.model.vision.image_token_id)
    result = finetune(job, show_progress=False)
    assert result.losses[0] == pytest.approx(expected, rel=1e-5)
    adapter = json.loads((result.output_dir / "adapter" / "adapter_config.json").read_text())
    assert any("vision.blocks.0.qkv" in t for t in adapter["target_modules"])
    assert any("merger_fc1" in m for m in adapter["modules_to_save"])


@pytest.mark.parametrize(
    "image",
    [
        "../outside.png",  # a parent-folder escape
        "sub/../../outside.png",  # an escape through a subfolder
        "link.png",  # a symlink inside pointing outside
        "ABSOLUTE",  # an absolute path
    ],
)
def test_align_batch_images_stay_in_the_batch_folder(checkpoint, tmp_path, image):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import shutil

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.align.compare import read_batch
    from moe_tune.engine.families import UnsupportedModel

    # Text records need the checkpoint's tokenizer (a folder without one is refused): one token a character.
    checkpoint = shutil.copytree(checkpoint, tmp_path / "checkpoint")
    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "</s>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(checkpoint)
    # The image processor settings images are read with.
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                             max_pixels=32 * 32).save_pretrained(checkpoint)  # fmt: skip
    folder = tmp_path / "batch"
    folder.mkdir()
    outside = tmp_path / "outside.png"
    PIL.new("RGB", (32, 32), (200, 10, 10)).save(outside)
    (folder / "link.png").symlink_to(outside)
    value = str(outside) if image == "ABSOLUTE" else image
    batch = folder / "batch.jsonl"
    batch.write_text(json.dumps({"text": "a picture: <image>", "images": [value]}) + "\n")
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    with pytest.raises(UnsupportedModel, match=r"batch\.jsonl:1: image .* (resolves outside|is an absolute path)"):
        read_batch(batch, cfg, checkpoint)
    # The same picture inside the folder is read.
    PIL.new("RGB", (32, 32), (200, 10, 10)).save(folder / "inside.png")
    batch.write_text(json.dumps({"text": "a picture: <image>", "images": ["inside.png"]}) + "\n")
    (document,) = read_batch(batch, cfg, checkpoint)
    assert document.pixel_values is not None


def test_qsa_with_one_indexer_head_aligns_pinned_on_images_and_text(tmp_path):
    # One QSA indexer head, 2 blocks of 4 kept: many blocks score exactly 0 after the ReLU and the 2nd and 3rd best
    # tie, where torch.topk and our rule (the lower block wins) may differ; the reference's choice, pinned, aligns.
    checkpoint = save_tiny_checkpoint(tiny_qwen4_exp(indexer_n_heads=1), tmp_path / "qwen4_exp")
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert report.pinned_selection and report.passed, report.failures
    assert [s.layer for s in report.selections] == [1, 3]
    assert sum(s.differed for s in report.selections) > 0  # ties were there to break
    assert report.images == [0, 1, 2] and report.logits.max_abs < 1e-5


@pytest.mark.parametrize("settings, line", [
    ({"do_resize": False}, "do_resize (false) is not followed: images are always resized to the patch grid"),
    ({"image_mean": [0.5, 0.5]}, "image_mean ([0.5, 0.5]) must give one value per RGB channel (3)"),
    ({"size": [16, 32]}, "size ([16, 32]) must be an object with shortest_edge and longest_edge"),
], ids=["do_resize", "mean", "size"])
def test_image_settings_the_loader_cannot_follow_are_named_once(checkpoint, tmp_path, settings, line):
    """A checkpoint's preprocessor_config.json that image records cannot follow: the line names the file once, then
    the rule."""
    import shutil

    from moe_tune.engine.data.dataset import vision_input
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import validate_profile

    folder = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, folder)
    config = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, **settings}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    job = resolve_job(validate_profile({
        "name": "vl", "model": {"checkpoint": str(folder)}, "data": {"path": str(tmp_path / "d.jsonl"),
                                                                      "tokenizer": "byte", "seq_len": 96},
        "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3}, "output": {"dir": str(tmp_path / "out")},
    }))
    vision = vision_input(job.model, job.data)
    assert vision.settings is None and vision.problem == f"{folder / 'preprocessor_config.json'}: {line}"
