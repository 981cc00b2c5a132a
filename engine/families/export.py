"""A LoRA adapter trained on a checkpoint model, written so transformers + PEFT load it on the checkpoint itself.

Our adapters sit on our module names; transformers' model has the checkpoint's. The family's recipes say where
each of our weights comes from: an adapter on a linear layer whose weight is a checkpoint tensor taken as is
(`take`) belongs on the transformers module holding that tensor; per-expert adapters become PEFT's
`target_parameters` adapters on the fused `mlp.experts.gate_up_proj` / `down_proj` (A [E*r, in] with expert e in
rows e*r.., B [out, r*E] with expert e in columns j*E + e); adapters on parts of one stored projection
(qwen3_next's in_proj_qkvz) merge into one adapter on it. A layer with no such place makes the export name it and
write nothing.

Each target names exactly one module or parameter by its full path (PEFT matches list entries exactly or as a suffix
after a dot), so an adapter reaches its module and no other: attention and other linear layers in target_modules;
modules whose names PEFT would rewrite onto the fused experts (dense MLPs, shared experts, routers: PARAMETER_TARGETS)
and the experts themselves in target_parameters.

Shapes: E experts, r rank, F expert hidden dim, D model dim.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from moe_tune.engine.export import staged_folder
from moe_tune.profiles.schema import ModelProfile

from .base import Family, UnsupportedModel, take

# Our grouped expert tensors and transformers' fused expert parameters, in the order PEFT nests their wrappers.
EXPERT_PARAMS = (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj"))

# Module names that PEFT, loading an adapter on a transformers 5 MoE model (qwen3_moe, qwen3_next, deepseek_v3/v32,
# glm4_moe, mixtral), reads as per-expert projections of transformers 4: a target_modules entry ending in one of them
# is rewritten to the fused experts' parameters (rank doubled for gate_proj + up_proj) and the module named loses its
# adapter (peft.utils.transformers_weight_conversion; a regex target_modules is resolved to leaf names first, so it
# is rewritten too). Adapters on modules of these names (dense MLPs, shared experts, routers) are therefore written
# as target_parameters on the module's weight: PEFT passes those through unchanged and its ParamWrapper on a 2-D
# weight is the same LoRA (A [r, in], B [out, r], W + scale B A).
REWRITTEN_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3"})
# Routers are transformers modules of their own (not nn.Linear), which PEFT adapts only through their weight.
PARAMETER_TARGETS = REWRITTEN_NAMES | {"router"}
# transformers models whose fused gate_up_proj [E, D, 2F] interleaves gate and up (gate 2j, up 2j + 1); the others
# store [E, 2F, D], gate first as ours. PEFT's factors are the same either way (A [E*r, in], B [out, r*E]).
INTERLEAVED_GATE_UP = frozenset({"GptOssForCausalLM"})


def reference_adapter(
    module: nn.Module, state: dict[str, torch.Tensor], cfg: ModelProfile, family: Family
) -> tuple[dict[str, torch.Tensor], list[str], list[str], dict[str, int], list[str]]:
    """The adapter `state` (our PEFT names, as save_pretrained writes them: `base_model.model.<module>.lora_A.weight`,
    experts `...experts.lora_A.w_gate_up`) renamed and reshaped for the checkpoint's transformers model. `module` is
    our model (the PeftModel's base model, any wrapper removed). Adapters on several of our layers that read parts
    of one stored projection (qwen3_next's in_proj_qkvz) become one adapter of rank m*r on it: A stacked, B placed
    at each part's rows (zero elsewhere), alpha m*alpha so the scale alpha / r stays. Returns (state,
    target_modules, target_parameters, {module: rank multiple}, modules_to_save). Modules trained in full
    (modules_to_save) go to the transformers modules their tensors were read from. UnsupportedModel lists every
    adapted layer that has no place in the checkpoint's model."""
    from moe_tune.engine.model.moe import GroupedExperts

    modules = dict(module.named_modules())
    out, targets, parameters, problems = {}, [], [], []
    prefix = "base_model.model."
    linear = {}
    saved_modules = set()
    for key, tensor in state.items():
        name = key.removeprefix(prefix)
        if ".experts.lora_" in name:
            continue
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if name.endswith(marker):
                linear.setdefault(name.removesuffix(marker), {})[part] = tensor
        if name.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        # A module trained in full (modules_to_save): each of its tensors goes to the transformers tensor it was
        # read from as is, and that tensor's module is saved in full there too.
        owner, _, local = name.rpartition(".")
        target = modules.get(owner)
        recipe = family.recipe(name, target, cfg) if target is not None else None
        if not isinstance(recipe, take):
            problems.append(f"adapter tensor {name}: trained in full but not one checkpoint tensor taken as is, so "
                            "a transformers adapter has no module to carry it; `moe-tune export --merge` writes it "
                            "into the model's weights")
            continue
        ref_key = family.reference_name(recipe.key)
        out[f"{prefix}{ref_key}"] = tensor
        saved_modules.add(ref_key.rpartition(".")[0])
    fused: dict[str, list] = {}
    for our_name, factors in sorted(linear.items()):
        base = modules.get(our_name)
        recipe = None if base is None else family.recipe(f"{our_name}.weight", getattr(base, "base_layer", base), cfg)
        if hasattr(recipe, "row_indices") and recipe.key.endswith(".weight"):
            fused.setdefault(recipe.key, []).append((recipe, factors))
            continue
        if not isinstance(recipe, take) or not recipe.key.endswith(".weight"):
            problems.append(f"adapter on {our_name}: its weight is not one checkpoint tensor, so transformers has no "
                            "module to carry it")
            continue
        ref_name = family.reference_name(recipe.key).removesuffix(".weight")
        if ref_name.rpartition(".")[2] in PARAMETER_TARGETS:
            parameters.append(f"{ref_name}.weight")
        else:
            targets.append(ref_name)
        for part, tensor in factors.items():
            out[f"{prefix}{ref_name}.{part}.weight"] = tensor
    multiples = {}
    for key, parts in sorted(fused.items()):
        ref_name = family.reference_name(key).removesuffix(".weight")
        a_parts = [factors["lora_A"] for _, factors in parts]
        rank = a_parts[0].shape[0]
        b = a_parts[0].new_zeros(parts[0][0].total_rows, rank * len(parts))
        for j, (recipe, factors) in enumerate(parts):
            b[recipe.row_indices(), j * rank : (j + 1) * rank] = factors["lora_B"]
        out[f"{prefix}{ref_name}.lora_A.weight"] = torch.cat(a_parts)
        out[f"{prefix}{ref_name}.lora_B.weight"] = b
        targets.append(ref_name)
        if len(parts) > 1:
            multiples[ref_name] = len(parts)
    expert_names = sorted({k.removeprefix(prefix).split(".lora_")[0] for k in state if ".experts.lora_" in k})
    for our_name in expert_names:
        experts = modules.get(our_name)
        experts = getattr(experts, "base_layer", experts)
        if not isinstance(experts, GroupedExperts):
            problems.append(f"adapter on {our_name}: not our grouped experts")
            continue
        ref_name = _reference_experts(family, our_name, experts, cfg)
        if ref_name is None:
            problems.append(f"adapter on {our_name}: the checkpoint's experts are not stored as one fused "
                            "gate_up_proj / down_proj per layer that transformers would wrap")
            continue
        # PEFT nests one wrapper per targeted parameter, the first innermost: gate_up_proj under base_layer.
        for depth, (ours, theirs) in enumerate(EXPERT_PARAMS):
            a = state[f"{prefix}{our_name}.lora_A.{ours}"]  # [E, r, in]
            b = state[f"{prefix}{our_name}.lora_B.{ours}"]  # [E, out, r]
            if ours == "w_gate_up" and family.reference_class in INTERLEAVED_GATE_UP:
                b = torch.stack(b.chunk(2, dim=1), dim=2).flatten(1, 2)  # gate rows j, up rows F + j -> 2j, 2j + 1
            where = f"{prefix}{ref_name}" + (".base_layer" if depth == 0 else "")
            out[f"{where}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            out[f"{where}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
            parameters.append(f"{ref_name}.{theirs}")
    if problems:
        raise UnsupportedModel(problems)
    return out, targets, parameters, multiples, sorted(saved_modules)


def _reference_experts(family: Family, our_name: str, experts: nn.Module, cfg: ModelProfile) -> str | None:
    """The transformers module holding the fused experts of our layer: the checkpoint key prefix of the layer's
    experts (per-expert keys `<prefix>.experts.{e}...` or fused `<prefix>.experts.gate_up_proj`), which
    transformers 5 loads into one experts module with gate_up_proj [E, 2F, D] (gate rows first) and down_proj."""
    probe = {}

    def record(key: str) -> torch.Tensor:
        probe.setdefault("key", key)
        raise KeyError(key)

    try:
        family.recipe(f"{our_name}.w_gate_up", experts, cfg)(record)
    except KeyError:
        pass
    key = probe.get("key")
    if key is None or ".experts." not in key:
        return None
    return family.reference_name(key.split(".experts.")[0] + ".experts.gate_up_proj").removesuffix(".gate_up_proj")


def write_reference_adapter(
    module: nn.Module, state: dict[str, torch.Tensor], cfg: ModelProfile, family: Family, lora, directory: Path,
    add_files: Callable[[Path], None] | None = None, replace: bool = True,
) -> Path:
    """Write the adapter for transformers + PEFT into `directory` (adapter_model.safetensors + adapter_config.json,
    base_model_name_or_path the checkpoint) with what `add_files(folder)` writes beside them, atomically: a temporary
    folder renamed to `directory` at the end, removed on any failure (export.staged_folder). With `replace` the
    folder's files go first (a run's earlier adapter); without, a `directory` holding files when the rename comes
    is kept and this adapter's files are removed (a ProfileError, as staged_folder says)."""
    from moe_tune.engine.atomic_write import save_tensors

    tensors, targets, parameters, multiples, saved_modules = reference_adapter(module, state, cfg, family)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(cfg.checkpoint),
        "r": lora.r,
        "lora_alpha": lora.alpha,
        # PEFT refuses dropout on parameter targets (it cannot be factored out of W + B A); at inference it is a no-op.
        "lora_dropout": 0.0 if parameters else lora.dropout,
        "target_modules": targets,
        "target_parameters": parameters or None,
        "bias": "none",
        "modules_to_save": saved_modules or None,
        # Fused projections carry several of our adapters: rank and alpha scaled alike (PEFT matches the keys as
        # regexes against the end of module names).
        "rank_pattern": {re.escape(name): lora.r * m for name, m in multiples.items()},
        "alpha_pattern": {re.escape(name): lora.alpha * m for name, m in multiples.items()},
    }
    directory = Path(directory)
    with staged_folder(directory) as tmp:
        save_tensors({k: v.contiguous() for k, v in tensors.items()}, tmp / "adapter_model.safetensors",
                     metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if add_files is not None:
            add_files(tmp)
        # The rename replaces an empty folder itself: one holding files (a finished run's earlier adapter) goes
        # first with `replace`, and an empty one stays if the rename fails.
        if replace and directory.is_dir() and any(directory.iterdir()):
            shutil.rmtree(directory)
    return directory
