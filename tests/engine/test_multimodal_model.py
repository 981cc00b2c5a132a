"""The model with a vision tower (profiles/tiny-vl.yaml): images enter where their tokens are, packing keeps
documents apart (image features, multimodal positions), rows without images still run the tower, and the profile
chooses which vision parts train."""

import json

import pytest
import torch

from moe_tune.engine.data.dataset import collate, load_documents, pack_rows, vision_input
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.engine.model.model import build_model
from moe_tune.profiles import load_profile

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-vl")
    return load_profile("tiny-vl", [f"output.dir={out}", "data.corpus_documents=6", "data.seq_len=96"])


@pytest.fixture(scope="module")
def documents(profile):
    vision = vision_input(profile.model, profile.data)
    return load_documents(profile.data, ByteTokenizer(), vision, generated_dir=profile.output.dir / "data"), vision


def test_packed_images_equal_documents_alone(profile, documents):
    docs, vision = documents
    model = build_model(profile.model).eval()
    packed = collate(pack_rows(docs[:1], 96, 258) + pack_rows(docs[1:2], 96, 258), vision.settings)
    assert packed.image_grid_thw.shape[0] == 2
    # Two documents side by side in one row, each with its own image.
    cu = torch.tensor([0, len(docs[0].input_ids), 96, 96 + len(docs[1].input_ids), 192], dtype=torch.int32)
    with torch.no_grad():
        together = model(packed.input_ids, cu, pixel_values=packed.pixel_values,
                         image_grid_thw=packed.image_grid_thw).logits[0]
        for i, (doc, start) in enumerate(zip(docs[:2], (0, 96))):
            alone = collate(pack_rows([doc], 96, 258), vision.settings)
            n = len(doc.input_ids)
            logits = model(alone.input_ids[:, :n], torch.tensor([0, n], dtype=torch.int32),
                           pixel_values=alone.pixel_values, image_grid_thw=alone.image_grid_thw).logits[0]
            torch.testing.assert_close(together[start : start + n], logits, rtol=0, atol=2e-5)


def test_the_image_changes_the_prediction(profile, documents):
    docs, vision = documents
    model = build_model(profile.model).eval()
    batch = collate(pack_rows(docs[:1], 96, 258), vision.settings)
    with torch.no_grad():
        seen = model(**batch.model_inputs("cpu")).logits
        blank = model(**{**batch.model_inputs("cpu"), "pixel_values": torch.zeros_like(batch.pixel_values)}).logits
    first_image = int((batch.input_ids[0] == profile.model.vision.image_token_id).nonzero()[0])
    assert torch.equal(seen[0, :first_image], blank[0, :first_image])  # causal: nothing before the image changes
    assert (seen[0, first_image:] - blank[0, first_image:]).abs().max() > 1e-4


def test_rows_without_images_still_run_the_tower(profile):
    model = build_model(profile.model)
    ids = torch.randint(0, 256, (1, 20))
    out = model(ids, torch.tensor([0, 20], dtype=torch.int32), labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.vision.parameters()]
    assert all(g is not None for g in grads) and all(float(g.abs().max()) == 0.0 for g in grads)


@pytest.mark.parametrize("tower, merger", [("frozen", "trained"), ("lora", "frozen"), ("trained", "lora")])
def test_the_profile_chooses_what_trains_in_the_vision_tower(tower, merger):
    from moe_tune.engine.train.trainer import build_trainable_model

    job = load_profile("tiny-vl", [f"lora.vision_tower={tower}", f"lora.vision_merger={merger}"])
    model, _ = build_trainable_model(job)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    block = {n for n in trainable if ".vision.blocks.0." in n}
    merger_names = {n for n in trainable if ".vision.merger_fc1." in n}
    lora = lambda names: bool(names) and all(".lora_" in n for n in names)  # noqa: E731
    full = lambda names: bool(names) and any("modules_to_save" in n for n in names)  # noqa: E731
    assert {"frozen": not block, "lora": lora(block), "trained": full(block)}[tower]
    assert {"frozen": not merger_names, "lora": lora(merger_names), "trained": full(merger_names)}[merger]


def test_full_finetune_freezes_the_frozen_parts():
    from moe_tune.engine.train.trainer import build_trainable_model

    job = load_profile("tiny-vl", ["lora.enabled=false", "lora.vision_tower=frozen", "lora.vision_merger=trained"])
    model, _ = build_trainable_model(job)
    assert not any(p.requires_grad for p in model.vision.blocks.parameters())
    assert all(p.requires_grad for p in model.vision.merger_fc1.parameters())
    assert model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("side", [16, 9], ids=["square", "odd"])
def test_the_towers_attention_keeps_no_probability_matrix(side):
    """The tower's attention runs on SDPA's fused kernels (4D inputs): what backward keeps of it is per patch, never
    the [heads, L, L] probabilities of an image of L patches (the math path that 3D inputs take keeps them)."""
    from moe_tune.engine.model.vision import VisionTower

    cfg = load_profile("tiny-vl").model
    spec = cfg.vision
    tower = VisionTower(spec, cfg.hidden_size)
    m = spec.spatial_merge_size
    grid = torch.tensor([[1, side * m, 16 * m]])
    patches = int(grid.prod())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        tower(torch.randn(patches, tower.patch_embed.in_features, requires_grad=True), grid).sum().backward()
    assert max(saved) < patches * patches
