"""Small models for the tests that compute one model two ways (the shared projection nodes against the modules'
calls, the kernels against the references): LoRA injected and every parameter perturbed, so that every path (the
adapters' B included) carries signal, and one packed row's loss and gradients."""

import torch


def perturbed_lora_model(raw: dict, target_modules: list[str], experts: bool, dtype: torch.dtype):
    """The model `raw` (a ModelProfile's fields) with LoRA r4 on `target_modules` (and every expert when `experts`),
    in `dtype`, its parameters moved by N(0, 0.05^2) draws; in training mode."""
    from moe_tune.engine.lora import inject_lora
    from moe_tune.engine.model.model import build_model
    from moe_tune.profiles.schema import LoraProfile, ModelProfile

    torch.manual_seed(0)
    lora = LoraProfile(r=4, alpha=8, target_modules=target_modules, experts=experts)
    model = inject_lora(build_model(ModelProfile.model_validate(raw)), lora).to(dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.05)
    return model.train()


def loss_and_grads(model, cu_seqlens: list[int], vocab_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The language-model loss of one packed row of random tokens (documents ending at `cu_seqlens`) and the
    gradient of every trainable parameter; the model's gradients are cleared after."""
    ids = torch.randint(0, vocab_size, (1, cu_seqlens[-1]), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32), labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads
