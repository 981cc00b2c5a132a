"""Frozen FP8 base weights (`model.base_precision: fp8`): the linear layer, the rule of which modules become FP8,
and the conversion of a model's layers as they are built.

An FP8 weight is stored as the bits of float8_e4m3fn (uint8) and its 128 x 128 block scales as the bits of fp32
(int32): mixed-precision casts (DeepSpeed's bf16 cast of parameters, zero.Init's tensor constructors,
module.to(dtype)) touch floating tensors only, and ZeRO-3 partitions and gathers them like any other parameter.
The layouts and the rounding are ops/fp8/reference.py's.

Shapes: O out_features, I in_features, R = ceil(O/128) scale rows, C = ceil(I/128) scale columns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from moe_tune.ops.fp8 import FP8_DTYPE, dequantize_weight, fp8_linear, num_blocks

from .attention import TOKEN_MIXERS
from .blocks import FP32_ONE_BITS, SwiGLU, quantize_blocks, saved_as_parameters
from .moe import GroupedExperts

# Storage dtypes of the FP8 weight's bits and of its fp32 scales' bits (never cast by mixed precision).
WEIGHT_BITS_DTYPE = torch.uint8
SCALE_BITS_DTYPE = torch.int32
# A linear layer with a dim below this stays in the run's dtype: tiny gates (qwen3_next's b_proj/a_proj, routers)
# would lose more to one 128-block's shared scale than their bytes are worth.
MIN_FP8_DIM = 128


def weight_bits(w_q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> its uint8 bits [...] (a view, no copy)."""
    return w_q.view(WEIGHT_BITS_DTYPE)


def scale_bits(scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 [...] -> its int32 bits [...] (a view, no copy)."""
    return scale_inv.view(SCALE_BITS_DTYPE)


class Fp8Linear(nn.Linear):
    """A frozen linear layer y = x deq(W)^T + b whose weight is FP8 e4m3 in 128 x 128 blocks.

    `weight`: nn.Parameter uint8 [O, I] (the bits of float8_e4m3fn), `weight_scale_inv`: nn.Parameter int32 [R, C]
    (the bits of the fp32 scales), both requires_grad False; `bias` [O] in the run's dtype as nn.Linear's (frozen
    too unless something trains it). Forward is ops.fp8.fp8_linear: differentiable w.r.t. the input and the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        # nn.Module's init, not nn.Linear's: it would allocate (and init) a float weight of the full size.
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        rows, cols = num_blocks(out_features), num_blocks(in_features)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=WEIGHT_BITS_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.full((rows, cols), FP32_ONE_BITS, dtype=SCALE_BITS_DTYPE, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An Fp8Linear of `linear`'s shape (zero bits, unit scales; its bias zero), on its device."""
        has_bias = linear.bias is not None
        dtype = linear.bias.dtype if has_bias else None
        return cls(linear.in_features, linear.out_features, has_bias, device=linear.weight.device, dtype=dtype)

    def reset_parameters(self) -> None:
        """No-op: the model's init draws the weight in floats and quantizes it (quantize_from)."""

    def fp8_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight float8_e4m3fn [O, I], scale_inv fp32 [R, C]): views of the parameters' bits."""
        return self.weight.view(FP8_DTYPE), self.weight_scale_inv.view(torch.float32)

    @torch.no_grad()
    def set_quantized(self, w_q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Store W_q float8_e4m3fn [O, I] and its scale_inv fp32 [R, C] (the hub's `weight` / `weight_scale_inv`)."""
        shape = (self.out_features, self.in_features)
        scale_shape = (num_blocks(self.out_features), num_blocks(self.in_features))
        if w_q.dtype != FP8_DTYPE or tuple(w_q.shape) != shape:
            raise ValueError(f"w_q: shape {tuple(w_q.shape)} dtype {w_q.dtype} must be {list(shape)} {FP8_DTYPE}")
        if tuple(scale_inv.shape) != scale_shape:
            raise ValueError(f"scale_inv: shape {tuple(scale_inv.shape)} must be {list(scale_shape)} for a weight "
                             f"of shape {list(shape)} in 128 x 128 blocks")  # fmt: skip
        self.weight.copy_(weight_bits(w_q))
        self.weight_scale_inv.copy_(scale_bits(scale_inv.float().contiguous()))

    @torch.no_grad()
    def quantize_from(self, w: torch.Tensor) -> None:
        """Store a float weight w [O, I] quantized in 128 x 128 blocks (ops.fp8.quantize_weight's rule)."""
        self.set_quantized(*quantize_blocks(w))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight W [O, I] the FP8 bits stand for, in `dtype`."""
        return dequantize_weight(*self.fp8_tensors(), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp8_linear saves its weight and scale views: kept as the parameters (ZeRO-3 regathers them for backward).
        with saved_as_parameters(self.weight, self.weight_scale_inv):
            return fp8_linear(x, *self.fp8_tensors(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def matches_module_name(name: str, keys: Sequence[str]) -> bool:
    """PEFT's rule for modules_to_save and target_modules names: the full name or a suffix after a dot."""
    return any(name == key or name.endswith(f".{key}") for key in keys)


def fp8_base_modules(root: nn.Module, prefix: str = "", modules_to_save: Sequence[str] = ()) -> dict[str, nn.Module]:
    """The modules under `root` whose frozen weights become FP8 with model.base_precision fp8, by full name.

    The rule: routed experts (GroupedExperts) and every plain nn.Linear inside a token mixer (attention
    projections, indexers) or a SwiGLU (dense MLPs, shared experts) whose in and out features are both >= 128.
    Never: embeddings, the LM head, norms, routers (MoEBlock.gate, shared_expert_gate), hyper-connection mixers,
    n-gram embedding parts, the vision tower (none of them sits in a token mixer or a SwiGLU), and nothing named by
    modules_to_save (trained in full). `prefix` is root's own name in the model ("layers.3." for a layer)."""
    mixers = tuple(TOKEN_MIXERS.values()) + (SwiGLU,)
    chosen: dict[str, nn.Module] = {}

    def visit(module: nn.Module, name: str, inside_mixer: bool) -> None:
        if name and matches_module_name(name, modules_to_save):
            return
        if isinstance(module, GroupedExperts):
            chosen[name] = module
            return
        if type(module) in (nn.Linear, Fp8Linear):
            if inside_mixer and min(module.in_features, module.out_features) >= MIN_FP8_DIM:
                chosen[name] = module
            return
        inside = inside_mixer or isinstance(module, mixers)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, inside)

    visit(root, prefix.rstrip("."), False)
    return chosen


def convert_to_fp8(root: nn.Module, prefix: str = "", modules_to_save: Sequence[str] = ()) -> int:
    """Replace every plain nn.Linear that fp8_base_modules chooses under `root` by an Fp8Linear of its shape (zero
    bits, unit scales: the caller's init or checkpoint fills them); routed experts must already be built with fp8
    (GroupedExperts(fp8=True)). Returns how many linears were replaced. The float weights are released as each
    layer is replaced, so converting the layers one by one as they are built never holds more than one layer's."""
    replaced = 0
    for name, module in fp8_base_modules(root, prefix, modules_to_save).items():
        if isinstance(module, GroupedExperts):
            if not module.fp8:
                raise ValueError(f"{name}: routed experts must be built with fp8=True for model.base_precision fp8")
            continue
        if type(module) is nn.Linear:
            parent_name, _, child_name = name[len(prefix.rstrip(".")) :].lstrip(".").rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, child_name, Fp8Linear.like(module))
            replaced += 1
    return replaced


def dequantize_modules(root: nn.Module, names: Sequence[str]) -> list[str]:
    """Replace each Fp8Linear (and FP8 GroupedExperts) named by `names` (PEFT's name matching) by its float twin
    holding the dequantized weight in fp32: modules trained in full (lora.modules_to_save) are never FP8. Returns the
    full names replaced."""
    replaced = []
    for name, module in list(root.named_modules()):
        if not name or not matches_module_name(name, names):
            continue
        parent_name, _, child_name = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        with _gathered(module):
            twin = _float_twin(module)
        if twin is not None:
            setattr(parent, child_name, twin)
            replaced.append(name)
    return replaced


def _gathered(module: nn.Module):
    """The module's own parameters gathered while in the block when ZeRO-3 has partitioned them."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _float_twin(module: nn.Module) -> nn.Module | None:
    """An fp32 module computing what an FP8 one does with its dequantized weights; None for any other module."""
    if isinstance(module, Fp8Linear):
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           device=module.weight.device)  # fmt: skip
        with torch.no_grad():
            linear.weight.copy_(module.dequantized())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        return linear
    if isinstance(module, GroupedExperts) and module.fp8:
        return module.dequantized_twin()
    return None
