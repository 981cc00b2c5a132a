"""A token mixer's projections of one input as one autograd node (engine/model/projections.py) on CUDA in bf16: the
node is taken with fused LoRA adapters, and its outputs and every gradient are as close to an fp32 run of the modules
as the bf16 modules' own (cuBLAS's addmm_ accumulation replaces autograd's adds). Run with pytest -m gpu tests/gpu."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from moe_tune.engine.lora.fused import use_fused_lora
from moe_tune.engine.model.projections import shared_input_linears

pytestmark = pytest.mark.gpu

# The gated delta net's widths at D = 256 (q, k, v, b, a, z), the input rows an odd count.
IN_FEATURES, ROWS = 256, 1001
WIDTHS = {"q": 256, "k": 256, "v": 512, "b": 4, "a": 4, "z": 512}
# The node's error against fp32, at most this multiple of the bf16 modules' (plus a floor relative to the largest
# entry): both round each GEMM to bf16; the node adds x's gradient parts in fp32 inside cuBLAS before rounding.
ERROR_RATIO, ERROR_FLOOR = 2.0, 1e-3


class Projections(nn.Module):
    def __init__(self):
        super().__init__()
        for name, width in WIDTHS.items():
            setattr(self, name, nn.Linear(IN_FEATURES, width, bias=False))

    def members(self):
        return [getattr(self, name) for name in WIDTHS]


def build(dtype):
    torch.manual_seed(0)
    group = Projections()
    group = get_peft_model(group, LoraConfig(r=16, lora_alpha=32, target_modules=["q", "k", "v"])).base_model.model
    use_fused_lora(group)
    with torch.no_grad():
        for name, p in group.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return group.to("cuda", dtype)


def run(group, x, use_node):
    x = x.detach().requires_grad_()
    outs = shared_input_linears(x, group.members()) if use_node else tuple(m(x) for m in group.members())
    if use_node:
        assert outs is not None and all(type(o.grad_fn).__name__ == "SharedInputLinearsFunctionBackward" for o in outs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen, device="cuda") for o in outs]
    loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
    params = {n: p for n, p in group.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, [x, *params.values()])
    results = {f"out.{i}": o.float() for i, o in enumerate(outs)}
    return results | dict(zip(["x", *params], (g.float() for g in grads)))


@pytest.mark.parametrize("lead", [(ROWS,), (1, ROWS)], ids=["2d", "3d"])
def test_node_in_bf16_is_as_close_to_fp32_as_the_modules(lead):
    group = build(torch.bfloat16)
    group32 = copy.deepcopy(group).float()
    x = torch.randn(*lead, IN_FEATURES, device="cuda")
    expected = run(group32, x, use_node=False)
    node = run(group, x.bfloat16(), use_node=True)
    modules = run(group, x.bfloat16(), use_node=False)
    for name, reference in expected.items():
        scale = reference.abs().max().item()
        node_error = (node[name] - reference).abs().max().item()
        modules_error = (modules[name] - reference).abs().max().item()
        assert node_error <= ERROR_RATIO * modules_error + ERROR_FLOOR * scale, (name, node_error, modules_error)
