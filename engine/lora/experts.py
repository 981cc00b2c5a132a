"""Per-expert LoRA on grouped experts, registered with PEFT's custom-module mechanism.

PEFT then saves, loads, merges and unloads these adapters like its own. For each adapter the layer holds, per
expert e, A and B factors of both projections:
  lora_A[adapter].w_gate_up [E, r, D]   lora_B[adapter].w_gate_up [E, 2F, r]
  lora_A[adapter].w_down    [E, r, F]   lora_B[adapter].w_down    [E, D, r]
and the expert weights become W_e + scaling * B_e A_e. The fused op (ops.moe.moe_mlp) takes them as an ExpertLoRA,
so the gathered token tile is reused for the adapter's thin GEMMs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from moe_tune.engine.model.fp8 import Fp8Linear
from moe_tune.engine.model.moe import GroupedExperts, expert_generator
from moe_tune.ops.moe import AddTo, ExpertLoRA


def check_not_fp8(base: nn.Module, what: str) -> None:
    """Refuse to merge adapters into (or out of) frozen FP8 weights: the sum would round to FP8's 3 mantissa bits
    and overwrite the base's exact bits. Merged exports dequantize the base first (engine/export)."""
    if isinstance(base, Fp8Linear) or (isinstance(base, GroupedExperts) and base.fp8):
        raise ValueError(
            f"cannot {what} LoRA adapters into FP8 base weights (model.base_precision fp8) in place: it would round "
            "the update to FP8 and change the frozen base; merge into dequantized weights instead (moe-tune export "
            "--merge does)"
        )


class ExpertFactors(nn.Module):
    """One side (A or B) of one adapter: a factor per projection, stacked over experts."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        self.w_gate_up = nn.Parameter(w_gate_up)
        self.w_down = nn.Parameter(w_down)


class GroupedExpertsLoRA(nn.Module, LoraLayer):
    adapter_layer_names = ("lora_A", "lora_B")

    def __init__(self, base_layer: GroupedExperts, adapter_name: str, config, r: int = 0, lora_alpha: float = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha, config)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config, **kwargs: Any) -> None:
        if r <= 0:
            raise ValueError(f"lora.r ({r}) must be a positive integer")
        if config.lora_dropout > 0:
            warnings.warn(
                f"lora.dropout ({config.lora_dropout}) is not applied to expert adapters (their input is shared with "
                "the fused expert GEMM); linear adapters still use it",
                stacklevel=2,
            )
        base: GroupedExperts = self.get_base_layer()
        num_experts, hidden, inter = base.num_experts, base.hidden, base.intermediate
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if config.use_rslora else lora_alpha / r
        self.lora_bias[adapter_name] = False
        self.use_dora[adapter_name] = False
        self.lora_dropout[adapter_name] = nn.Identity()
        # FP8 experts hold bits (uint8): their factors take the run's floating dtype, as PEFT's linear adapters on an
        # Fp8Linear do (PEFT moves adapters to a base weight's dtype only when it is floating).
        dtype = torch.get_default_dtype() if base.fp8 else base.w_gate_up.dtype
        factory = {"device": base.w_gate_up.device, "dtype": dtype}
        # A starts like PEFT's Linear A (kaiming-uniform, a=sqrt(5) -> bound 1/sqrt(fan_in)); B starts at zero so
        # the adapter is a no-op, unless init_lora_weights is False (PEFT's convention for tests). One draw from the
        # global generator, then one generator per global expert: every expert-parallel layout gets the same init.
        base_seed = int(torch.randint(0, 2**31 - 1, ()))
        random_b = config.init_lora_weights is False
        factors = {"a_gate_up": [], "a_down": [], "b_gate_up": [], "b_down": []}
        for i in range(num_experts):
            gen = expert_generator(base_seed, base.first_expert + i)
            factors["a_gate_up"].append((torch.rand(r, hidden, generator=gen) * 2 - 1) / math.sqrt(hidden))
            factors["a_down"].append((torch.rand(r, inter, generator=gen) * 2 - 1) / math.sqrt(inter))
            b_gate_up, b_down = torch.zeros(2 * inter, r), torch.zeros(hidden, r)
            if random_b:
                b_gate_up, b_down = torch.randn(2 * inter, r, generator=gen) / r, torch.randn(hidden, r, generator=gen) / r
            factors["b_gate_up"].append(b_gate_up)
            factors["b_down"].append(b_down)
        a_gate_up, a_down, b_gate_up, b_down = (
            torch.stack(factors[name]).to(**factory) for name in ("a_gate_up", "a_down", "b_gate_up", "b_down")
        )
        self.lora_A[adapter_name] = ExpertFactors(a_gate_up, a_down)
        self.lora_B[adapter_name] = ExpertFactors(b_gate_up, b_down)
        self.set_adapter(self.active_adapters)

    def expert_lora(self, adapter_names: list[str]) -> ExpertLoRA:
        """The adapters as one ExpertLoRA: ranks concatenated, each adapter's scaling folded into its B."""
        a_side = [self.lora_A[name] for name in adapter_names]
        b_side = [self.lora_B[name] for name in adapter_names]
        scales = [self.scaling[name] for name in adapter_names]
        if len(adapter_names) == 1:
            return ExpertLoRA(
                a_gate_up=a_side[0].w_gate_up,
                b_gate_up=b_side[0].w_gate_up,
                a_down=a_side[0].w_down,
                b_down=b_side[0].w_down,
                scaling=scales[0],
            )
        return ExpertLoRA(
            a_gate_up=torch.cat([a.w_gate_up for a in a_side], dim=1),
            b_gate_up=torch.cat([b.w_gate_up * s for b, s in zip(b_side, scales)], dim=2),
            a_down=torch.cat([a.w_down for a in a_side], dim=1),
            b_down=torch.cat([b.w_down * s for b, s in zip(b_side, scales)], dim=2),
            scaling=1.0,
        )

    def get_delta_weight(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta of w_gate_up [E, 2F, D], delta of w_down [E, D, F]) = scaling * B @ A per expert."""
        a, b, s = self.lora_A[adapter], self.lora_B[adapter], self.scaling[adapter]
        delta_gate_up = torch.bmm(b.w_gate_up.float(), a.w_gate_up.float()) * s
        delta_down = torch.bmm(b.w_down.float(), a.w_down.float()) * s
        return delta_gate_up, delta_down

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        from peft.tuners.tuners_utils import check_adapters_to_merge

        base: GroupedExperts = self.get_base_layer()
        check_not_fp8(base, "merge")
        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A:
                continue
            delta_gate_up, delta_down = self.get_delta_weight(adapter)
            new_gate_up = base.w_gate_up.data.float() + delta_gate_up
            new_down = base.w_down.data.float() + delta_down
            if safe_merge and not (torch.isfinite(new_gate_up).all() and torch.isfinite(new_down).all()):
                raise ValueError(f"NaNs detected in the merged expert weights: adapter {adapter} seems broken")
            base.w_gate_up.data.copy_(new_gate_up)
            base.w_down.data.copy_(new_down)
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        base: GroupedExperts = self.get_base_layer()
        check_not_fp8(base, "unmerge")
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            delta_gate_up, delta_down = self.get_delta_weight(adapter)
            base.w_gate_up.data.copy_(base.w_gate_up.data.float() - delta_gate_up)
            base.w_down.data.copy_(base.w_down.data.float() - delta_down)

    def forward(
        self, x_TD: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, add_to: AddTo = None
    ) -> torch.Tensor:
        base: GroupedExperts = self.get_base_layer()
        active = [name for name in self.active_adapters if name in self.lora_A]
        if self.disable_adapters or self.merged or not active:
            return base(x_TD, topk_ids, topk_weights, add_to=add_to)
        return base(x_TD, topk_ids, topk_weights, lora=self.expert_lora(active), add_to=add_to)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()
