"""The merged export of runs test_export_hub.py does not build: a vision model whose tower and merger carry LoRA
adapters (or train in full), compared on documents with images; deepseek_v32 (the DSA indexer) with an adapter on
every linear layer and the experts. transformers loads each with no missing, unexpected or mismatched key and gives
our fine-tuned model's logits (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

import hf_tiny
from moe_tune.engine.align.compare import _reference_inputs, default_documents, load_ours, pack_documents
from moe_tune.engine.align.reference import pure_torch_paths
from moe_tune.engine.export.hub import export_run
from moe_tune.engine.export.sources import read_run
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.lora import load_adapter
from test_export_hub import assert_loads_cleanly, ours_logits, trained_run, transformers_logits


def reference_model(directory, family):
    import transformers

    model, info = getattr(transformers, family.reference_class).from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        local_files_only=True, output_loading_info=True, **family.reference_kwargs())
    return model.eval(), info


@pytest.mark.parametrize("tower, merger", [("lora", "lora"), ("trained", "trained")])
def test_vision_adapters_merge_into_the_tower(tmp_path, tower, merger):
    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_qwen3_5_moe(), tmp_path / "checkpoint")
    run = trained_run(tmp_path, None, {"target_modules": ["q_proj", "o_proj"], "vision_tower": tower,
                                       "vision_merger": merger}, checkpoint=checkpoint)
    cfg = read_run(run).cfg
    family, _, _ = model_profile_from_checkpoint(checkpoint)
    out = export_run(run, merge=True, out=None)
    docs = default_documents(cfg)
    ids, cu, _, images = pack_documents(docs)
    assert images
    with pure_torch_paths(), torch.no_grad():
        reference, info = reference_model(out, family)
        got = torch.cat([reference(**_reference_inputs(doc, cfg)).logits[0] for doc in docs])
        expected = load_adapter(load_ours(cfg), run / "adapter").eval()(ids, cu, **images).logits[0]
        base = load_ours(cfg).eval()(ids, cu, **images).logits[0]
    assert_loads_cleanly(info)
    assert (expected - base).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_deepseek_v32_every_linear_layer_and_the_experts(tmp_path):
    checkpoint = hf_tiny.save_tiny_checkpoint(hf_tiny.tiny_deepseek_v32(), tmp_path / "checkpoint")
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    names = sorted({n.rpartition(".")[2] for n, m in load_ours(cfg).named_modules()
                    if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")})
    run = trained_run(tmp_path, None, {"target_modules": names, "experts": True, "modules_to_save": ["lm_head"]},
                      checkpoint=checkpoint)
    out = export_run(run, merge=True, out=None)
    got, info = transformers_logits(out, checkpoint)
    assert_loads_cleanly(info)
    ours = load_adapter(load_ours(cfg), run / "adapter").eval()
    expected = ours_logits(ours)
    assert (expected - ours_logits(load_ours(cfg))).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
