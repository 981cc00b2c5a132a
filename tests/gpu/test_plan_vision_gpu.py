"""engine/plan.py's vision-tower activations against what the tower keeps on a CUDA device, where SDPA's flash
kernel runs its attention (no [heads, L, L] probabilities kept): tiny-vl in bf16, a micro-batch of 2 rows of 80
tokens, all image tokens (640 patches in 3 images), the model built as the trainer builds it and cast as DeepSpeed
casts it. Run on the GPU machine:
pytest -m gpu tests/gpu/test_plan_vision_gpu.py
"""

import pytest
import torch
from vision_saved import image_row, measure_saved_vision, vision_tower

from moe_tune.engine.plan import activation_bytes, vision_patches
from moe_tune.engine.train.trainer import build_trainable_model
from moe_tune.profiles import load_profile

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# The caching allocator rounds every block up to a multiple of this many bytes.
ALLOCATION_ROUNDING = 512


def _job(tower: str, merger: str):
    return load_profile("tiny-vl", [f"lora.vision_tower={tower}", f"lora.vision_merger={merger}", "data.seq_len=80",
                                    "train.micro_batch_size=2", "train.precision=bf16"])  # fmt: skip


@pytest.mark.parametrize("tower, merger", [("lora", "trained"), ("trained", "lora"), ("frozen", "trained"),
                                           ("lora", "frozen")])  # fmt: skip
def test_planned_vision_activations_are_what_the_tower_keeps_on_the_gpu(tower, merger):
    """The distinct CUDA storages autograd saves in the tower's forward equal the plan's figure to the byte (flash
    keeps q, k, v, the output and the log-sum-exp [heads, L] fp32; LayerNorm's statistics are fp32), and the memory
    the tower's forward leaves allocated, less its output, is that figure up to the allocator's rounding of each saved
    storage."""
    job = _job(tower, merger)
    assert vision_patches(job) == 640
    torch.manual_seed(0)
    model, _ = build_trainable_model(job, init_device=DEVICE)
    # As DeepSpeed's engine does under bf16: every parameter in the training dtype, the adapters PEFT made fp32 too
    # (fp32 adapters would keep an fp32 copy of each adapted linear's input).
    model.to(torch.bfloat16)
    inputs = image_row(job, DEVICE)
    planned = activation_bytes(job).vision
    saved = measure_saved_vision(model, inputs)
    assert saved.total == planned

    # Memory: what the tower's forward leaves allocated once it returns, less its output [P / m^2, D].
    allocated: dict[str, int] = {}
    tower_module = vision_tower(model)
    hooks = [tower_module.register_forward_pre_hook(lambda *_: allocated.update(before=_allocated())),
             tower_module.register_forward_hook(lambda m, args, output: allocated.update(
                 after=_allocated(), output=output.untyped_storage().nbytes()))]  # fmt: skip
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    for handle in hooks:
        handle.remove()
    kept = allocated["after"] - allocated["before"] - _rounded(allocated["output"])
    out.loss.backward()
    assert planned <= kept <= planned + ALLOCATION_ROUNDING * len(saved.by_storage), (kept, planned)


def _allocated() -> int:
    torch.cuda.synchronize(DEVICE)
    return torch.cuda.memory_allocated(DEVICE)


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING
