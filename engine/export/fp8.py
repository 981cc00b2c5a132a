"""Exporting runs trained on FP8 frozen base weights (`model.base_precision: fp8`).

Such a run's model holds each FP8 base weight as two tensors (engine/model/fp8.py): `<name>` (the bits of
float8_e4m3fn) and `<name>_scale_inv` (the bits of its fp32 128 x 128 block scales; routed experts' w_gate_up with
row segments (F, F)). An export sees the run as the same model with `base_precision: bf16`: every FP8 weight
dequantized to fp32, so the writer, the merge (W + alpha / r * B @ A in fp32) and the hub layout are those of a bf16
run, and the keys are written in the checkpoint's float dtype, unquantized, without quantization_config.

The base a merged export adds the adapters to is the one the run trained against:
- an FP8 hub checkpoint (float8_e4m3fn keys with `<key>_scale_inv`): the stored bits and scales where the run's
  loader takes them as stored (engine/families: a recipe's `quantized`), dequantized; where it could not (our rows
  split a stored 128-row block) the recipe's dequantized tensor, quantized again as the loader does, dequantized;
- a bf16 checkpoint the run quantized at load, or the seeded init of a profile-built model: quantized as the run
  quantized it (ops.fp8.quantize_weight), then dequantized;
- a checkpoint step or the trainer's own state: the run's FP8 tensors dequantized (sources.DequantizedSource).

A merged export is never quantized back to FP8: rounding W + delta to e4m3 in 128 x 128 blocks loses most of the
LoRA delta (requantization_error measures it; `--precision fp8` is refused with the figure).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_tune.ops.fp8 import FP8_DTYPE, dequantize_weight, num_blocks, quantize_weight
from moe_tune.profiles.schema import ModelProfile

SCALE_SUFFIX = "_scale_inv"
# The routed experts' fused gate/up weight: its gate and up halves have their own scale rows (segments (F, F)).
GATE_UP = "w_gate_up"


def is_fp8_base(cfg: ModelProfile) -> bool:
    return getattr(cfg, "base_precision", "bf16") == "fp8"


def bf16_base(cfg: ModelProfile) -> ModelProfile:
    """The same model with its base weights unquantized: the model an FP8-base run is exported as."""
    return cfg.model_copy(update={"base_precision": "bf16"}) if is_fp8_base(cfg) else cfg


@dataclass(frozen=True)
class Fp8BaseWeight:
    """An FP8 base weight of the run's model: its scale's name and the row segments of its blocks."""

    scale_name: str
    row_segments: tuple[int, ...] | None


def fp8_weights(cfg: ModelProfile) -> dict[str, Fp8BaseWeight]:
    """Our name of every weight the run's model holds in FP8 -> its scale and row segments; {} for a bf16 base.
    Read off the model itself (a weight with a `<name>_scale_inv` beside it), so it is the model's own rule."""
    if not is_fp8_base(cfg):
        return {}
    from moe_tune.engine.model.model import MoECausalLM

    with torch.device("meta"):
        state = MoECausalLM(cfg).state_dict()
    found = {}
    for scale_name in state:
        if not scale_name.endswith(SCALE_SUFFIX):
            continue
        name = scale_name.removesuffix(SCALE_SUFFIX)
        weight = state[name]
        segments = None
        if name.rpartition(".")[2] == GATE_UP:
            half = weight.shape[-2] // 2
            segments = (half, half)
        found[name] = Fp8BaseWeight(scale_name, segments)
    return found


def as_fp8(bits: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q float8_e4m3fn, scale_inv fp32) from a model's stored tensors: the bits (uint8 / int32, as the FP8 modules
    hold them) or already float8 / fp32."""
    w_q = bits.view(FP8_DTYPE) if bits.dtype == torch.uint8 else bits
    scale = scale_bits.view(torch.float32) if scale_bits.dtype == torch.int32 else scale_bits.float()
    if w_q.dtype != FP8_DTYPE:
        raise ValueError(f"an FP8 base weight of dtype {bits.dtype}: must be uint8 bits or float8_e4m3fn")
    return w_q, scale


def dequantized(bits: torch.Tensor, scale_bits: torch.Tensor, weight: Fp8BaseWeight) -> torch.Tensor:
    """The fp32 weight an FP8 base weight stands for."""
    w_q, scale = as_fp8(bits, scale_bits)
    return dequantize_weight(w_q, scale, weight.row_segments)


def quantized_roundtrip(w: torch.Tensor, row_segments: tuple[int, ...] | None) -> torch.Tensor:
    """w quantized to FP8 in 128 x 128 blocks (as a run quantizes a bf16 base at load) and dequantized, fp32."""
    return dequantize_weight(*quantize_weight(w.float(), row_segments), row_segments)


def checkpoint_base(reader, recipe, weight: Fp8BaseWeight | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Our tensor `shape` from the checkpoint as the run's loader (engine/families load_checkpoint_weights) made it,
    read through the loader's getter (`reader`: engine/families/checkpoint.py WeightGetter):
    an FP8 weight the recipe takes as stored (bits and scales in our block layout) dequantized; any other FP8
    weight (a bf16 checkpoint's, or FP8 blocks our rows split) from the recipe's floating tensor, quantized as the
    loader quantizes it and dequantized."""
    value = None
    if weight is not None and hasattr(recipe, "quantized"):
        stored = recipe.quantized(reader)
        expected = (*shape[:-2], num_blocks(shape[-2], weight.row_segments), num_blocks(shape[-1]))
        if stored is not None and tuple(stored[1].shape) == expected:
            value = dequantize_weight(*stored, weight.row_segments)
    if value is None:
        value = recipe(reader)
        if weight is not None:
            value = quantized_roundtrip(value, weight.row_segments)
    return value


def requantization_error(base: torch.Tensor, delta: torch.Tensor,
                         row_segments: tuple[int, ...] | None) -> tuple[float, float]:
    """(||kept - delta||^2, ||delta||^2) where kept = deq(quant(base + delta)) - base: what an FP8 requantization of a
    merged weight keeps of the LoRA delta (base: the dequantized FP8 weight, fp32)."""
    kept = quantized_roundtrip(base + delta, row_segments) - base
    return float((kept - delta).double().square().sum()), float(delta.double().square().sum())


def merged_precision_note(dtype_name: str) -> str:
    """The line an FP8-base merged export prints and writes into its README.md."""
    return (f"merged weights are {dtype_name} from an FP8 base (model.base_precision: fp8): each base weight "
            "dequantized from its 128x128 blocks and the LoRA delta added in fp32, not re-quantized (no "
            "quantization_config)")


def fp8_model_card(cfg: ModelProfile, note: str) -> str:
    """README.md of an FP8-base merged export: what the weights are."""
    base = f"`{cfg.checkpoint}`" if cfg.checkpoint is not None else "the profile's architecture (seeded init)"
    return (f"# Merged LoRA fine-tune (moe-tune)\n\n- base model: {base}, trained on in FP8 "
            f"(model.base_precision: fp8)\n- {note}\n")


PRECISIONS = ("auto", "fp8")
# Why no export is re-quantized to FP8: rounding W + delta to e4m3 rounds away a delta small beside W. The figure is
# the relative Frobenius error of a LoRA delta of 1% of |W| after requantization, measured on a tiny FP8 run
# (tests/engine/test_export_fp8.py test_requantization_loses_the_delta, which checks it).
DELTA_LOST = "91%"
FP8_EXPORT_REFUSAL = (
    "--precision fp8 is refused: an export is never re-quantized to FP8, since rounding W + delta to e4m3 in 128x128 "
    "blocks rounds the fine-tune's change away (on a tiny run {lost} of a LoRA delta of 1% of |W| is lost); serve the "
    "adapter (export without --merge) on the FP8 base checkpoint, or export unquantized (--precision auto)"
)


def precision_problems(precision: str) -> list[str]:
    """export's --precision: one line when it is not auto."""
    if precision == "fp8":
        return [FP8_EXPORT_REFUSAL.format(lost=DELTA_LOST)]
    if precision not in PRECISIONS:
        return [f"--precision ({precision!r}) must be auto (the base checkpoint's dtypes, FP8 weights dequantized; "
                "fp8 is refused)"]
    return []
