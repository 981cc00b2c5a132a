"""The FP8 base against its bf16 twin: `moe-tune profile PROFILE --against bf16-base`.

A user of an FP8 checkpoint who would rather not train in FP8 trains the same checkpoint dequantized. The twin is
the profile with model.base_precision bf16 (its frozen base in the training dtype) whose FP8-rule weights are the
FP8 base's dequantized weights rounded to the training dtype, deq(W) = W_q * scale_inv; everything else is equal by
construction (the same seed draws the same floating parameters and LoRA init, the same data seed packs the same
micro-batches) and checked at run time: the twin's FP8-rule modules are exactly the FP8 model's, its micro-batches
ours. The FP8 weights are copied to the host before DeepSpeed takes our model (they are frozen: what trains is
LoRA) and dequantized into the twin module by module as it is built.

The loss gap of step s is |loss_fp8(s) - loss_bf16(s)| / |loss_bf16(s)|, every step (warm-up included).
"""

from __future__ import annotations

import contextlib
import os
import statistics

import torch
from torch import nn

from moe_tune.engine.model.fp8 import Fp8Linear
from moe_tune.engine.model.moe import GroupedExperts
from moe_tune.ops.fp8 import dequantize_weight
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

BASELINE = "bf16-base"


def check_bf16_base(profile: JobProfile) -> None:
    """Refuse a profile whose base is not FP8: there is nothing to dequantize."""
    precision = profile.model.base_precision
    if precision != "fp8":
        raise ProfileError([f"model.base_precision ({precision!r}): --against {BASELINE} needs 'fp8' (it trains the "
                            "FP8 base against the same weights dequantized into a bf16 base)"])  # fmt: skip


def bf16_base_profile(profile: JobProfile) -> JobProfile:
    """The profile of the twin: model.base_precision bf16, nothing else changed."""
    return profile.model_copy(update={"model": profile.model.model_copy(update={"base_precision": "bf16"})})


def impl_name(profile: JobProfile) -> str:
    """The twin's row name: its base is held in the training dtype."""
    return f"moe-tune, {profile.train.precision} base"


def twin_fit_problem(twin: JobProfile) -> str | None:
    """Why the twin cannot fit this process's device (check_memory_fits' line), or None. Asked before our run is
    built, when the device is empty: a twin that cannot fit is not worth a host copy of the FP8 base."""
    from moe_tune.engine.train.resources import check_memory_fits

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        check_memory_fits(twin, 1, device)
    except ProfileError as err:
        return "; ".join(err.problems)
    return None


def _gathered(params: list[torch.Tensor], modifier_rank: int | None):
    """The parameters whole inside the block when ZeRO-3 has partitioned them (a checkpoint model built under
    zero.Init); written back from `modifier_rank` on exit."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def fp8_base_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every FP8 module of `model` by name with host copies of its fp8_tensors(): (W_q float8_e4m3fn, scale_inv
    fp32) for an Fp8Linear, (w_gate_up, its scale_inv, w_down, its scale_inv) for FP8 routed experts."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) or (isinstance(module, GroupedExperts) and module.fp8):
            with _gathered(list(module.parameters(recurse=False)), None):
                weights[name] = tuple(t.detach().to("cpu", copy=True) for t in module.fp8_tensors())
    return weights


@torch.no_grad()
def load_dequantized(model: nn.Module, weights: dict[str, tuple[torch.Tensor, ...]]) -> int:
    """Write each of `weights` (fp8_base_weights of the FP8 model) dequantized into the same-named float module of
    `model` (its twin, before DeepSpeed casts it), in that module's dtype; entries are dropped as they are written.
    Returns how many modules were written. Raises RuntimeError when a name is not the float twin of an FP8 module."""
    written = 0
    for name in list(weights):
        tensors = weights.pop(name)
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if type(module) is nn.Linear and len(tensors) == 2:
            targets = [(module.weight, tensors, None)]
        elif isinstance(module, GroupedExperts) and not module.fp8 and len(tensors) == 4:
            targets = [(module.w_gate_up, tensors[:2], module.gate_up_segments), (module.w_down, tensors[2:], None)]
        else:
            raise RuntimeError(f"{name}: the bf16-base twin holds {type(module).__name__} where the FP8 model holds "
                               "an FP8 module")  # fmt: skip
        with _gathered([param for param, _, _ in targets], 0):
            for param, (w_q, scale_inv), segments in targets:
                if param.shape != w_q.shape:
                    raise RuntimeError(f"{name}: the twin's weight {tuple(param.shape)} is not the FP8 weight's "
                                       f"{tuple(w_q.shape)}")  # fmt: skip
                # One expert (or the whole linear) at a time: the fp32 temporaries stay that size.
                for index in range(param.shape[0]) if param.dim() == 3 else [slice(None)]:
                    device = param.device
                    param[index].copy_(dequantize_weight(w_q[index].to(device), scale_inv[index].to(device), segments,
                                                         dtype=param.dtype))  # fmt: skip
        written += 1
    return written


def same_batches(ours: list, theirs: list) -> bool:
    """Whether two steps' micro-batches hold the same tokens, labels, pieces and pictures."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        for key in ("input_ids", "labels", "cu_seqlens", "pixel_values", "image_grid_thw"):
            x, y = getattr(a, key), getattr(b, key)
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return False
    return True


def loss_gap(fp8_losses: list[float], bf16_losses: list[float]) -> dict:
    """Every step's loss on both bases and the relative gap |fp8 - bf16| / |bf16|, its max and mean."""
    relative = [abs(a - b) / abs(b) for a, b in zip(fp8_losses, bf16_losses)]
    return dict(steps=len(relative), fp8_losses=list(fp8_losses), bf16_losses=list(bf16_losses), relative=relative,
                max=max(relative), mean=statistics.fmean(relative))  # fmt: skip
