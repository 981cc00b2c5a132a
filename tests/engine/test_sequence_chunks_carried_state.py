"""The state a chunked linear-attention layer carries from slab to slab (engine/model/mixer_chunks.py) owns its
memory: every tensor the layer saves for backward, other than views of its inputs, holds no storage beyond its own
bytes, so a row of many short documents keeps no [documents, H, K, V] of final states alive until backward (the
memory policy counts a saved tensor's own bytes; a view of the op's final states would keep all of them)."""

import pytest
import torch

from moe_tune.engine.model.attention import build_token_mixer
from moe_tune.engine.model.batch import PackedBatch
from moe_tune.engine.model.blocks import document_ids, document_positions
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import LayerSpec, ModelProfile

ROW_TOKENS, CHUNK = 96, 24
# Documents of 5 tokens: no slab starts a document (24, 48, 72 are not multiples of 5), so every slab after the first
# carries a state in, and each slab holds 5 or 6 document pieces.
DOCUMENT_TOKENS = 5
LINEAR = load_profile("tiny").model.linear_attention.model_dump()
CASES = {
    "linear-scalar": ({"attention": "linear"}, {}),
    "linear-per-channel": ({"attention": "linear"}, {"linear_attention": {**LINEAR, "decay": "per_channel"}}),
    "kda": ({"attention": "kda"}, {"kda_attention": {"num_heads": 2, "head_dim": 16}}),
}


def build_mixer(name: str):
    layer, overrides = CASES[name]
    base = load_profile("tiny").model.model_dump()
    base.update(layers=[layer], **overrides)
    torch.manual_seed(0)
    mixer = build_token_mixer(ModelProfile.model_validate(base), LayerSpec.model_validate(layer))
    mixer.sequence_chunk_tokens = CHUNK
    return mixer


def saved_storages(mixer, document_tokens: int) -> tuple[list[tuple[tuple[int, ...], int, int]], torch.Tensor]:
    """(shape, own bytes, bytes of the storage it holds) of every tensor the chunked layer saves for backward that is
    not a view of its inputs x and positions, and the input gradient."""
    starts = list(range(0, ROW_TOKENS, document_tokens)) + [ROW_TOKENS]
    cu = torch.tensor(starts, dtype=torch.int32)
    batch = PackedBatch(cu, document_positions(cu, ROW_TOKENS), document_ids(cu, ROW_TOKENS))
    x = torch.randn(1, ROW_TOKENS, mixer.o_proj.out_features, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    inputs = {x.untyped_storage().data_ptr(), batch.positions.untyped_storage().data_ptr()}
    saved = []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved.append((tuple(t.shape), t.numel() * t.element_size(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mixer(x, batch)
    out.sum().backward()
    return saved, x.grad


@pytest.mark.parametrize("name", list(CASES))
def test_carried_states_hold_no_other_documents_states(name):
    mixer = build_mixer(name)
    saved, _ = saved_storages(mixer, DOCUMENT_TOKENS)
    num_slabs = ROW_TOKENS // CHUNK
    # What the slabs' checkpoints save besides their input rows: the state each continued slab starts from.
    assert len(saved) == num_slabs - 1, saved
    for shape, own_bytes, storage_bytes in saved:
        assert storage_bytes == own_bytes, f"a saved {shape} state holds {storage_bytes} bytes, {own_bytes} its own"


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_do_not_grow_with_the_documents(name):
    mixer = build_mixer(name)
    one_document, _ = saved_storages(mixer, ROW_TOKENS)
    short_documents, _ = saved_storages(mixer, DOCUMENT_TOKENS)
    # One document crosses every slab: each continued slab saves the same one [H, K, V] state either way.
    assert sorted(one_document) == sorted(short_documents)
