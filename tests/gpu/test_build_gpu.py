"""A model built on the GPU in the training dtype (what `moe-tune profile` does for checkpoint-less profiles): its
parameters on CUDA in bf16, buffers in fp32, FP8 experts the quantized draws of each expert's CUDA generator, and
a forward's loss finite; a bf16 base holds the same fp32 draws rounded. Run with pytest -m gpu tests/gpu."""

import pytest
import torch

from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import GroupedExperts, expert_generator
from moe_tune.ops.fp8 import dequantize_weight, quantize_weight
from moe_tune.profiles import load_profile

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("base_precision", ["bf16", "fp8"])
def test_built_on_the_gpu_in_bf16(base_precision):
    cfg = load_profile("profiles/tiny.yaml").model.model_copy(update={"base_precision": base_precision})
    device = torch.device("cuda")
    model = build_model(cfg, device=device, param_dtype=torch.bfloat16)
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    gen = expert_generator(cfg.seed, experts.layer_index, experts.first_expert, device=device)
    draw = torch.randn(experts.w_gate_up.shape[1:], generator=gen, device=device).mul_(cfg.init_std)
    if base_precision == "fp8":
        w_q, scale, _, _ = experts.fp8_tensors()
        expected_q, expected_scale = quantize_weight(draw, experts.gate_up_segments)
        torch.testing.assert_close(dequantize_weight(w_q[0], scale[0], experts.gate_up_segments),
                                   dequantize_weight(expected_q, expected_scale, experts.gate_up_segments),
                                   rtol=0, atol=0)  # fmt: skip
    else:
        torch.testing.assert_close(experts.w_gate_up[0], draw.to(torch.bfloat16), rtol=0, atol=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device=device)
    cu_seqlens = torch.tensor([0, 100, 128], dtype=torch.int32, device=device)
    loss = model(ids, cu_seqlens, labels=ids).loss
    assert torch.isfinite(loss)
