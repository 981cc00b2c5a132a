"""deepseek_v32 (DeepSeek-V3.2-Exp) from a transformers checkpoint: deepseek_v3 with DSA on every layer, the
lightning indexer choosing 6 keys per query (fewer than the documents hold, so sparsity shapes every later token).
Alignment with the reference on one document and on a packed batch, the indexer shown to matter, wrong mappings
caught, unsupported configs reported, and a short fine-tune whose first loss is the reference's.

With 3 indexer heads and index_topk 12 (below the 23- and 14-token documents) many index scores are exactly 0 after
the ReLU and the 12th and 13th best tie in some query rows, where torch.topk and our rule (the lower key index wins)
pick different keys: align reports those rows, and --pin-routing (the reference's selection fed to our indexers)
aligns exactly."""

import json

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.align.compare import load_ours, load_reference
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families.deepseek_v32 import DeepseekV32
from moe_tune.engine.model import mla

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v32

MLA_LORA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint(tiny_deepseek_v32())


@pytest.fixture(scope="module")
def few_heads(tmp_path_factory):
    """3 indexer heads, 12 keys per query: ties between the 12th and 13th best keys occur."""
    directory = tmp_path_factory.mktemp("dsv32") / "few_heads"
    return save_tiny_checkpoint(tiny_deepseek_v32(index_n_heads=3, index_topk=12), directory)


@pytest.fixture(scope="module")
def few_heads_reports(few_heads):
    return {pin: align_checkpoint(few_heads, pin_routing=pin, lora_targets=MLA_LORA_TARGETS) for pin in (False, True)}


def test_profile_read_from_config(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [
        ("mla_sparse", "dense"), ("mla_sparse", "moe"), ("mla_sparse", "moe")
    ]
    sparse = cfg.sparse_attention
    assert (sparse.index_heads, sparse.index_head_dim, sparse.topk, sparse.block_size) == (8, 16, 6, 1)
    assert cfg.mla.rope == "interleaved" and cfg.mla.q_lora_rank == 24
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.has_selection_bias) == (3, 2, True)


@pytest.mark.parametrize("pin", [False, True], ids=["own_routing", "pinned_routing"])
def test_packed_batch_aligned_with_transformers(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin, lora_targets=MLA_LORA_TARGETS)
    assert report.passed, report.failures
    assert len(report.layers) == 3 and max(row.max_abs for row in report.layers) < 1e-5
    assert report.logits.max_abs <= 1e-4 and report.kl <= 1e-6
    # q_a, q_b, kv_a, kv_b and o of every layer, A and B each; align adds the MoE layers' expert adapters.
    assert len([row for row in report.lora_grads if ".self_attn." in row.name]) == 3 * 5 * 2
    assert any(".experts." in row.name for row in report.lora_grads)


def test_tied_selections_reported_then_pinned_to_alignment(few_heads_reports):
    own, pinned = few_heads_reports[False], few_heads_reports[True]
    assert [s.layer for s in own.selections] == [s.layer for s in pinned.selections] == [0, 1, 2]
    assert all(s.rows == 46 for s in own.selections + pinned.selections)
    # Layer 0 sees the same input in both runs, so the same rows differ before pinning; a tie is there to break.
    assert own.selections[0].differed == pinned.selections[0].differed >= 1
    assert not own.passed
    assert pinned.pinned_selection and pinned.passed, pinned.failures
    assert max(row.rel for row in pinned.layers) < 1e-5 and pinned.kl <= 1e-6
    assert any(".experts." in row.name for row in pinned.lora_grads)


def test_pinned_selection_is_in_the_json(few_heads_reports, tmp_path):
    few_heads_reports[True].write_json(tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["pinned_selection"] is True
    assert [row["layer"] for row in data["selections"]] == [0, 1, 2]
    assert data["selections"][0]["differed"] == few_heads_reports[True].selections[0].differed
    assert data["reference_paths"].startswith("transformers' PyTorch paths")


def swap_one_key(topk_indexer, row: int):
    """topk_indexer whose selection for query `row` (of the packed batch) has its first key replaced by the most
    recent causal key it did not select: the attention math stays right, the selection does not."""

    def perturbed(*args, **kwargs):
        indices = topk_indexer(*args, **kwargs).clone()
        chosen = set(indices[0, row].tolist())
        indices[0, row, 0] = max(s for s in range(row + 1) if s not in chosen)
        return indices.sort(dim=-1).values

    return perturbed


@pytest.mark.parametrize("perturb", [False, True], ids=["references_selection", "one_key_swapped"])
def test_a_perturbed_selection_fails_alignment(checkpoint, monkeypatch, perturb):
    # 8 heads, 6 keys: no ties, so our own selection is the reference's; query row 20 of the first (23-token)
    # document has 21 causal keys. Experts pinned, the selection ours.
    if perturb:
        monkeypatch.setattr(mla, "topk_indexer", swap_one_key(mla.topk_indexer, row=20))
    report = align_checkpoint(checkpoint, pin_routing=True, pin_selection=False)
    assert report.selections[0].differed == (1 if perturb else 0)
    assert report.passed is not perturb, report.failures
    if perturb:
        assert report.layers[0].rel > 1e-4


def test_pinning_replaces_a_perturbed_selection_and_names_it(checkpoint, monkeypatch):
    """A choice our indexer's own scores do not make (one key of row 20 swapped for one that is no near tie) is
    replaced by the reference's when pinned, so every number aligns, and it is the one failure of each layer."""
    monkeypatch.setattr(mla, "topk_indexer", swap_one_key(mla.topk_indexer, row=20))
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert [(s.differed, s.beyond_tie) for s in report.selections] == [(1, 1)] * len(report.selections)
    assert len(report.selections) == 3
    assert report.failures == [f"layer {s.layer} sparse attention: 1 of {s.rows} query rows chose other keys than "
                               "the reference beyond a tie" for s in report.selections]


def test_one_document_aligned_with_transformers(checkpoint):
    document = torch.randint(0, 300, (31,), generator=torch.Generator().manual_seed(3))
    report = align_checkpoint(checkpoint, documents=[document], lora_targets=MLA_LORA_TARGETS)
    assert report.passed, report.failures
    assert report.logits.max_abs <= 1e-4 and report.kl <= 1e-6


def test_yarn_rope_aligned_with_transformers(tiny_checkpoint):
    # The indexer ropes its keys with the same YaRN-scaled cos and sin as the attention.
    yarn = {
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 8, "beta_slow": 1,
    }
    report = align_checkpoint(tiny_checkpoint(tiny_deepseek_v32(rope_parameters=yarn)), pin_routing=True)
    assert report.passed, report.failures


def test_indexer_selection_is_the_references(checkpoint):
    # The keys our indexer picks are the reference's, query by query (the reference scores causal keys only when a
    # query has more than index_topk of them; with fewer, every causal key is picked).
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    reference, ours = load_reference(checkpoint, family), load_ours(cfg)
    document = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(5))
    picked = {}
    handles = [
        reference.model.layers[1].self_attn.indexer.register_forward_hook(lambda _m, _i, out: picked.update(ref=out)),
        ours.layers[1].self_attn.indexer.register_forward_hook(lambda _m, _i, out: picked.update(ours=out)),
    ]
    with torch.no_grad():
        reference(input_ids=document[None])
        ours(document[None], torch.tensor([0, 20], dtype=torch.int32))
    for h in handles:
        h.remove()
    for t in range(20):
        ours_t = {s for s in picked["ours"][0, t].tolist() if s >= 0}
        ref_t = {s for s in picked["ref"][0, t].tolist() if s <= t}
        assert ours_t == ref_t and len(ours_t) == min(t + 1, 6), t


def test_dense_attention_in_place_of_the_indexer_is_caught(checkpoint, monkeypatch):
    # Guards the alignment test: with every causal key selected, the model is measurably not the reference.
    original = DeepseekV32.sparse_fields
    monkeypatch.setattr(DeepseekV32, "sparse_fields", lambda self, c: original(self, c) | {"topk": 64})
    report = align_checkpoint(checkpoint, pin_routing=True, pin_selection=False)
    assert not report.passed and report.layers[0].max_abs > 1e-4


def test_indexer_rope_on_the_wrong_dims_is_caught(checkpoint, monkeypatch):
    # The indexer ropes its first qk_rope_head_dim dims; roping the last ones instead picks other keys.
    original = DeepseekV32.recipe

    def flipped(self, name, module, cfg):
        recipe = original(self, name, module, cfg)
        if name.endswith("indexer.wq_b.weight"):
            heads, dim = cfg.sparse_attention.index_heads, cfg.sparse_attention.index_head_dim
            return lambda get: recipe(get).view(heads, dim, -1).flip(1).reshape(heads * dim, -1)
        if name.endswith("indexer.wk.weight") or name.endswith("indexer.k_norm.weight") or name.endswith(
            "indexer.k_norm.bias"
        ):
            return lambda get: recipe(get).flip(0)
        return recipe

    monkeypatch.setattr(DeepseekV32, "recipe", flipped)
    report = align_checkpoint(checkpoint, pin_routing=True, pin_selection=False)
    assert not report.passed and report.layers[0].max_abs > 1e-4
    assert report.selections[0].differed > 5


def test_unsupported_config_names_the_field(checkpoint):
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    config.update(mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "full_attention", "x"],
                  num_key_value_heads=2)
    path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(checkpoint)
    problems = "\n".join(err.value.problems)
    assert "mlp_layer_types (['dense', 'sparse']) is not mapped" in problems
    assert "layer_types[1] ('full_attention') is not mapped" in problems
    assert "num_key_value_heads (2) is not mapped" in problems


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(
        checkpoint, lora={"target_modules": ["q_b_proj", "kv_b_proj", "o_proj"]}
    )
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
