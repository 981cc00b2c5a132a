"""The adapter trained on a checkpoint model loads in transformers + PEFT on the checkpoint itself and gives the
logits of our model with the same adapter (attention and expert adapters); layers the checkpoint stores fused
with others are named instead of exported wrongly."""

import json

import pytest
import torch

from moe_tune.engine.align.compare import load_ours, load_reference
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.lora import load_adapter

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v3, tiny_qwen3_5_moe_text, tiny_qwen3_moe, tiny_qwen3_next


MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# KDA and MLA projections, the dense first layer: modules transformers renames on load (block_sparse_moe -> mlp,
# f_a_proj -> forget_gate.f_a_proj).
KIMI = ["q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "kv_b_proj", "gate_proj", "down_proj"]


def tiny_kimi_linear():
    import transformers

    torch.manual_seed(0)
    return transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
        vocab_size=320, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10, linear_num_heads=3, linear_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], q_lora_rank=None, num_local_experts=7,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    ))


@pytest.mark.parametrize(
    "builder, targets",
    [(tiny_qwen3_moe, ["q_proj", "k_proj", "v_proj", "o_proj"]), (tiny_deepseek_v3, MLA), (tiny_kimi_linear, KIMI)],
    ids=["qwen3_moe", "deepseek_v3", "kimi_linear"],
)
def test_adapter_loads_in_transformers_with_equal_logits(builder, targets, tmp_path, short_finetune):
    from peft import PeftModel

    checkpoint = save_tiny_checkpoint(builder(), tmp_path / "checkpoint")
    # A large learning rate so the adapters move far from their no-op start.
    result, _ = short_finetune(checkpoint, train={"steps": 3, "micro_batch_size": 2, "lr": 0.05},
                               lora={"target_modules": targets})
    exported = result.transformers_adapter
    assert exported is not None and result.transformers_adapter_problem is None
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["target_parameters"]  # the experts' adapters, on transformers' fused expert parameters

    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    ours = load_adapter(load_ours(cfg), result.adapter).eval()
    reference = PeftModel.from_pretrained(load_reference(checkpoint, family), str(exported)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
        got = ours(ids, torch.tensor([0, 29], dtype=torch.int32)).logits[0]
        base = load_ours(cfg)(ids, torch.tensor([0, 29], dtype=torch.int32)).logits[0]
    assert (got - base).abs().max() > 1e-2  # the adapter changed the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("builder", [tiny_qwen3_next, tiny_qwen3_5_moe_text], ids=["qwen3_next", "qwen3_5_moe"])
def test_adapters_on_parts_of_fused_projections_merge(builder, tmp_path, short_finetune):
    """Our gated delta net's q/k/v/z/b/a are parts of in_proj_qkvz / in_proj_ba (qwen3_next) or in_proj_qkv
    (qwen3_5_moe): their adapters become one adapter of rank m*r on the stored projection, same logits."""
    from peft import PeftModel

    checkpoint = save_tiny_checkpoint(builder(), tmp_path / "checkpoint")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "z_proj", "b_proj", "a_proj"]
    result, _ = short_finetune(checkpoint, train={"steps": 3, "micro_batch_size": 2, "lr": 0.05},
                               lora={"target_modules": targets, "experts": False})
    assert result.transformers_adapter is not None, result.transformers_adapter_problem
    config = json.loads((result.transformers_adapter / "adapter_config.json").read_text())
    assert any("in_proj_qkv" in name for name in config["rank_pattern"])
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    ours = load_adapter(load_ours(cfg), result.adapter).eval()
    reference = PeftModel.from_pretrained(load_reference(checkpoint, family), str(result.transformers_adapter)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
        got = ours(ids, torch.tensor([0, 29], dtype=torch.int32)).logits[0]
        base = load_ours(cfg)(ids, torch.tensor([0, 29], dtype=torch.int32)).logits[0]
    assert (got - base).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_modules_trained_in_full_are_exported_as_modules_to_save(tmp_path, short_finetune):
    from peft import PeftModel

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "checkpoint")
    result, _ = short_finetune(checkpoint, train={"steps": 3, "micro_batch_size": 2, "lr": 0.05},
                               lora={"modules_to_save": ["lm_head", "norm"], "experts": False})
    assert result.transformers_adapter is not None, result.transformers_adapter_problem
    config = json.loads((result.transformers_adapter / "adapter_config.json").read_text())
    assert "lm_head" in config["modules_to_save"] and "model.norm" in config["modules_to_save"]
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    ours = load_adapter(load_ours(cfg), result.adapter).eval()
    reference = PeftModel.from_pretrained(load_reference(checkpoint, family), str(result.transformers_adapter)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
        got = ours(ids, torch.tensor([0, 29], dtype=torch.int32)).logits[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_vision_parts_export_with_images(tmp_path):
    """A qwen3_5_moe checkpoint with its vision tower: LoRA on the vision blocks, the merger trained in full; the
    exported adapter on transformers' model gives our logits on documents with images."""
    from peft import PeftModel, get_peft_model_state_dict

    from moe_tune.engine.align.compare import _reference_inputs, default_documents, pack_documents
    from moe_tune.engine.families.export import write_reference_adapter
    from moe_tune.engine.lora import inject_lora
    from moe_tune.profiles.schema import LoraProfile

    from hf_tiny import tiny_qwen3_5_moe

    checkpoint = save_tiny_checkpoint(tiny_qwen3_5_moe(), tmp_path / "checkpoint")
    family, _, cfg = model_profile_from_checkpoint(checkpoint)
    lora = LoraProfile(r=4, alpha=8, target_modules=["q_proj", "o_proj"], experts=True, vision_tower="lora",
                       vision_merger="trained")
    torch.manual_seed(0)
    ours = inject_lora(load_ours(cfg), lora)
    with torch.no_grad():  # every adapter and the merger away from their start
        for name, param in ours.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    state = get_peft_model_state_dict(ours)
    exported = write_reference_adapter(ours.base_model.model, state, cfg, family, lora, tmp_path / "hf")
    reference = PeftModel.from_pretrained(load_reference(checkpoint, family), str(exported)).eval()
    docs = default_documents(cfg)
    ids, cu, _, images = pack_documents(docs)
    ours.eval()
    with torch.no_grad():
        got = ours(ids, cu, **images).logits[0]
        expected = torch.cat([reference(**_reference_inputs(doc, cfg)).logits[0] for doc in docs])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
