"""LoRA through PEFT: linear and per-expert adapters train alone, merge exactly, and round-trip through files."""

import pytest
import torch

from moe_tune.engine.lora import inject_lora, load_adapter
from moe_tune.engine.lora.experts import GroupedExpertsLoRA
from moe_tune.engine.model.model import build_model
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import LoraProfile


def tiny():
    profile = load_profile("tiny")
    return profile.model, profile.lora


def batch(vocab, lengths=(9, 14, 5)):
    torch.manual_seed(1)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (1, total))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu, torch.roll(ids, -1, 1)


def lora_model(randomise=True):
    cfg, lora = tiny()
    model = inject_lora(build_model(cfg), lora)
    if randomise:
        # Fresh adapters are a no-op (B = 0); give every adapter weight a value so the checks mean something.
        torch.manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(std=0.05)
    return cfg, model


def test_only_adapters_and_saved_modules_get_gradients():
    cfg, model = lora_model()
    ids, cu, labels = batch(cfg.vocab_size)
    model(input_ids=ids, cu_seqlens=cu, labels=labels).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    # Per-expert adapters are there, for both projections, and they all received a gradient.
    expert_params = [n for n in trainable if ".experts.lora_" in n]
    assert len(expert_params) == 4 * 4  # 4 MoE layers x (A, B) x (gate_up, down)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_merged_weights_give_the_same_logits():
    cfg, model = lora_model()
    ids, cu, _ = batch(cfg.vocab_size)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, cu_seqlens=cu).logits
        base = model.get_base_model()
        with model.disable_adapter():
            plain = model(input_ids=ids, cu_seqlens=cu).logits
        merged_model = model.merge_and_unload()
        merged = merged_model(ids, cu).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(m, GroupedExpertsLoRA) for m in base.modules())


def test_adapter_round_trips_through_peft_files(tmp_path):
    cfg, model = lora_model()
    ids, cu, _ = batch(cfg.vocab_size)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, cu_seqlens=cu).logits
    model.save_pretrained(tmp_path / "adapter")
    loaded = load_adapter(build_model(cfg), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, cu_seqlens=cu).logits, expected)


def test_unknown_target_is_a_profile_error():
    cfg, _ = tiny()
    with pytest.raises(ProfileError, match=r"lora.target_modules \('qq_proj'\) must name a linear layer"):
        inject_lora(build_model(cfg), LoraProfile(target_modules=["qq_proj"]))
