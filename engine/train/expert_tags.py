"""Which parameters are routed experts: tagged for ZeRO-3's expert-data-parallel group
(engine/parallel/expert_parallel.py). It walks a built model, so it sits with the trainer, above engine/model and
engine/parallel."""

from __future__ import annotations

from torch import nn

from moe_tune.engine.model.moe import GroupedExperts

from moe_tune.engine.parallel.expert_parallel import EXPERT_FAMILY, ExpertLayout


def tag_expert_parameters(model: nn.Module, layout: ExpertLayout) -> int:
    """Tag routed-expert parameters (and their per-expert adapters) for the expert-data-parallel group, as
    deepspeed 0.19.8's AutoEP does. Returns how many parameters were tagged."""
    from deepspeed.utils import groups

    # ZeRO-3 partitions each parameter over this group when deepspeed.initialize converts it.
    expert_data_group = groups._get_expert_data_parallel_group(layout.group_name)
    tagged = 0
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        holder = _expert_holder(model, module)
        for param in holder.parameters():
            param.allreduce = False
            param.group_name = layout.group_name
            param.ds_zero_placement_family = EXPERT_FAMILY
            param.ds_zero_partition_group_name = layout.group_name
            param.ds_zero_partition_process_group = expert_data_group
            tagged += 1
    return tagged


def _expert_holder(model: nn.Module, experts: nn.Module) -> nn.Module:
    """The experts module itself, or the LoRA layer wrapping it (whose adapters live with the experts)."""
    for module in model.modules():
        if getattr(module, "base_layer", None) is experts:
            return module
    return experts
