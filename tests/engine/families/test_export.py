"""The adapter trained on a checkpoint model loads in transformers + PEFT on the checkpoint itself and gives the
logits of our model with the same adapter (attention and expert adapters); layers the checkpoint stores fused
with others are named instead of exported wrongly."""

import json

import pytest
import torch

from moe_tune.engine.align.compare import load_ours, load_reference
from moe_tune.engine.families import model_profile_from_checkpoint
from moe_tune.engine.lora import load_adapter

from hf_tiny import (
    save_tiny_checkpoint, tiny_deepseek_v3, tiny_deepseek_v32, tiny_glm4_moe, tiny_gpt_oss, tiny_kimi_linear,
    tiny_mixtral, tiny_qwen3_5_moe, tiny_qwen3_5_moe_text, tiny_qwen3_moe, tiny_qwen3_next, tiny_qwen4_exp,
)


MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# KDA and MLA projections, the dense first layer: modules transformers renames on load (block_sparse_moe -> mlp,
# f_a_proj -> forget_gate.f_a_proj).
KIMI = ["q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "kv_b_proj", "gate_proj", "down_proj"]


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


# Every family's tiny checkpoint: dense MLP layers (qwen3_moe, qwen3_next, deepseek_v3/v32, kimi_linear, glm4_moe),
# shared experts (deepseek, kimi, glm4_moe, the qwen hybrids), vision-language hub layouts (qwen3_5_moe, qwen4_exp),
# experts only with w1/w2/w3 in transformers 4 (mixtral), interleaved transposed experts and a router module (gpt_oss).
TARGET_FAMILIES = {
    "qwen3_moe": tiny_qwen3_moe, "qwen3_next": tiny_qwen3_next, "qwen3_5_moe": tiny_qwen3_5_moe,
    "deepseek_v3": tiny_deepseek_v3, "deepseek_v32": tiny_deepseek_v32, "kimi_linear": tiny_kimi_linear,
    "qwen4_exp": tiny_qwen4_exp, "mixtral": tiny_mixtral, "glm4_moe": tiny_glm4_moe, "gpt_oss": tiny_gpt_oss,
}
MLP = ["gate_proj", "up_proj", "down_proj"]
NOT_ATTENTION = {*MLP, "gate", "shared_expert_gate", "lm_head"}
# lora.target_modules takes any linear layer name of our model, lora.experts adds the routed experts: the attention
# (and every other non-MLP linear), the MLP names with and without the experts, one MLP name alone (PEFT's own
# conversion refuses gate_proj without up_proj), every linear layer with the experts (routers and lm_head included).
# Families without MLP-named linear layers (mixtral, gpt_oss: experts only) take the sets that name experts alone
# once ("mlp+experts"); "mlp" and "gate_proj+experts" would adapt nothing of theirs or repeat it.
TARGET_SETS = {
    "attention": (lambda names: sorted(set(names) - NOT_ATTENTION), False),
    "mlp": (lambda names: [n for n in MLP if n in names], False),
    "mlp+experts": (lambda names: [n for n in MLP if n in names], True),
    "gate_proj+experts": (lambda names: ["gate_proj"] if "gate_proj" in names else None, True),
    "all+experts": (lambda names: names, True),
}


EXPERTS_ONLY = {"mixtral", "gpt_oss"}
FAMILY_SETS = [(f, t) for f in sorted(TARGET_FAMILIES) for t in sorted(TARGET_SETS)
               if not (f in EXPERTS_ONLY and t in ("mlp", "gate_proj+experts"))]


@pytest.fixture(scope="module")
def family_pair(request, tmp_path_factory):
    """(checkpoint, family, cfg, our model, transformers' model, ids, our base logits) of one family, built once."""
    from moe_tune.engine.align.reference import pure_torch_paths

    directory = tmp_path_factory.mktemp(request.param) / "checkpoint"
    with pure_torch_paths(), torch.no_grad():
        checkpoint = save_tiny_checkpoint(TARGET_FAMILIES[request.param](), directory)
        family, _, cfg = model_profile_from_checkpoint(checkpoint)
        ours, reference = load_ours(cfg), load_reference(checkpoint, family)
        ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        base = ours(ids, torch.tensor([0, 16], dtype=torch.int32)).logits[0]
    return checkpoint, family, cfg, ours, reference, ids, base


def _adapted(model: torch.nn.Module) -> list[str]:
    """Names of the modules carrying a LoRA adapter, wrappers that PEFT nests for several parameters counted once."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer) and not name.endswith(".base_layer")]


@pytest.mark.parametrize("family_pair, target_set", FAMILY_SETS, indirect=["family_pair"],
                         ids=[f"{f}-{t}" for f, t in FAMILY_SETS])
def test_adapter_targets_reach_exactly_their_modules(family_pair, target_set, tmp_path):
    """Whatever lora.target_modules / lora.experts name, the exported adapter loads with PeftModel.from_pretrained on
    transformers' model with every tensor in place (no missing, unexpected or resized key: PEFT's rewrite of MLP
    names onto the fused experts does not apply), each of our adapted MLP modules and expert blocks has its
    counterpart and nothing else is adapted, and the logits (fp32) equal our model's with the same adapter."""
    import copy

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.families.export import write_reference_adapter
    from moe_tune.engine.lora import inject_lora, is_vision_module
    from moe_tune.profiles.schema import LoraProfile

    checkpoint, family, cfg, base_ours, base_reference, ids, base = family_pair
    # The text model's linear layers: the vision tower's take adapters by lora.vision_tower / vision_merger alone.
    names = sorted({n.rpartition(".")[2] for n, m in base_ours.named_modules()
                    if isinstance(m, torch.nn.Linear) and not is_vision_module(n)})
    pick, experts = TARGET_SETS[target_set]
    assert pick(names) is not None and (pick(names) or experts), f"{target_set} adapts nothing of {names}"
    # dropout is a no-op at inference; PEFT refuses it on parameter targets, so the export writes it as 0 there
    # (expert adapters take none: lora.dropout must be 0 with them).
    lora = LoraProfile(r=2, alpha=6, dropout=0.0 if experts else 0.1, target_modules=pick(names), experts=experts)
    ours = inject_lora(copy.deepcopy(base_ours), lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every adapter factor random, B included, so each adapter changes the output
        for param in ours.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    state = get_peft_model_state_dict(ours, save_embedding_layers=False)
    exported = write_reference_adapter(ours.base_model.model, state, cfg, family, lora,
                                       tmp_path / "adapter")
    written = load_file(str(exported / "adapter_model.safetensors"))
    with pure_torch_paths(), torch.no_grad():
        reference = PeftModel.from_pretrained(copy.deepcopy(base_reference), str(exported)).eval()
        expected = reference(input_ids=ids).logits[0]
        got = ours.eval()(ids, torch.tensor([0, ids.shape[1]], dtype=torch.int32)).logits[0]

    loaded = get_peft_model_state_dict(reference, save_embedding_layers=False)  # lm_head adapted: not its weight
    assert sorted(loaded) == sorted(written)
    for key, tensor in written.items():
        assert loaded[key].shape == tensor.shape, key
        torch.testing.assert_close(loaded[key], tensor, rtol=0, atol=0, msg=key)
    theirs = _adapted(reference)
    mine = _adapted(ours)
    for leaf, their_leaves in [*((n, (n,)) for n in MLP), ("gate", ("gate", "router")), ("experts", ("experts",))]:
        count = sum(n.endswith(tuple(f".{t}" for t in their_leaves)) for n in theirs)
        assert count == sum(n.endswith(f".{leaf}") for n in mine), leaf
    assert (got - base).abs().max() > 1e-2  # the adapter changes our model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_rewritten_names_cover_peft_conversion():
    """PEFT's transformers-5 conversion rewrites these module names of target_modules onto fused experts; the export
    writes adapters on modules so named as parameter targets, so the set must cover every name PEFT rewrites."""
    from moe_tune.engine.families.export import REWRITTEN_NAMES

    conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")
    mapping = getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {})
    assert {name for names in mapping.values() for name in names} <= REWRITTEN_NAMES
