"""Checkpoint families: one module per Hugging Face model_type, mapping config.json and the hub's key layout onto
moe-tune's model (engine/model), and the loader that streams the weights in.

`resolve_job(job)` turns `model: {checkpoint: DIR}` into the architecture read from DIR/config.json;
`load_checkpoint_weights(model, job)` fills a freshly built model from DIR's safetensors.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import CheckpointModel, JobProfile, ModelProfile

from .base import Family, UnsupportedModel, key_pattern, show
from .checkpoint import CheckpointReader, read_config

__all__ = [
    "Family",
    "UnsupportedModel",
    "family_for",
    "supported_model_types",
    "resolve_job",
    "model_profile_from_checkpoint",
    "check_checkpoint",
    "load_checkpoint_weights",
]


def _registry() -> dict[str, Family]:
    from . import qwen3_moe
    from . import qwen3_5_moe, qwen3_next

    families: list[Family] = [qwen3_moe.Qwen3Moe()]
    families += [qwen3_next.Qwen3Next(), qwen3_5_moe.Qwen3_5Moe(), qwen3_5_moe.Qwen3_5MoeText()]
    from . import kimi_linear
    families += [kimi_linear.KimiLinear()]
    from . import qwen4_exp
    families += [qwen4_exp.Qwen4Exp(), qwen4_exp.Qwen4ExpText()]
    from . import deepseek_v3, deepseek_v32
    families += [deepseek_v3.DeepseekV3(), deepseek_v32.DeepseekV32()]
    from . import gpt_oss
    families += [gpt_oss.GptOss()]
    from . import glm4_moe, mixtral
    families += [mixtral.Mixtral(), glm4_moe.Glm4Moe()]
    return {t: f for f in families for t in f.model_types}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def family_for(config: dict[str, Any], directory: Path | None = None) -> Family:
    model_type = config.get("model_type")
    family = _registry().get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    problems = [
        f"config.json: model_type ({show(model_type)}) is not mapped: must be one of {supported_model_types()}"
    ]
    if directory is not None:
        with contextlib.suppress(UnsupportedModel), CheckpointReader(directory) as reader:
            patterns = sorted({key_pattern(k) for k in reader.keys()})
            shown = patterns[:40]
            problems += [f"{directory}: module not mapped: {p}" for p in shown]
            if len(patterns) > len(shown):
                problems.append(f"{directory}: ... and {len(patterns) - len(shown)} more key patterns")
    raise UnsupportedModel(problems)


def model_profile_from_checkpoint(directory: Path) -> tuple[Family, dict[str, Any], ModelProfile]:
    config = read_config(directory)
    family = family_for(config, directory)
    cfg = family.to_profile(config)
    return family, config, cfg.model_copy(update={"checkpoint": Path(directory)})


def check_checkpoint(directory: Path) -> None:
    """Read config.json and check the weight files (inside the folder, safetensors only, readable, holding what the
    index says) before anything loads them: UnsupportedModel listing the problems of both at once."""
    problems: list[str] = []
    try:
        model_profile_from_checkpoint(directory)
    except UnsupportedModel as err:
        problems += err.problems
    try:
        CheckpointReader(directory).close()
    except UnsupportedModel as err:
        problems += [line for line in err.problems if line not in problems]
    if problems:
        raise UnsupportedModel(problems)


def resolve_job(job: JobProfile) -> JobProfile:
    """The job with `model: {checkpoint: DIR}` replaced by the architecture read from DIR (re-validated, so the
    profile's cross-section rules see it). Jobs with an architecture spec come back unchanged."""
    if not isinstance(job.model, CheckpointModel):
        return job
    try:
        check_checkpoint(job.model.checkpoint)
        _, _, cfg = model_profile_from_checkpoint(job.model.checkpoint)
    except UnsupportedModel as err:
        # repr: control and bidirectional characters escaped; a path is never cut.
        where = f"model.checkpoint ({str(job.model.checkpoint)!r})"
        raise ProfileError([f"{where}: {line}" for line in err.problems]) from None
    from moe_tune.profiles import validate_profile

    raw = job.model_dump(mode="json")
    raw["model"] = cfg.model_dump(mode="json")
    return validate_profile(raw)


def load_checkpoint_weights(model: nn.Module, cfg: ModelProfile, check_unread: bool = True) -> None:
    """Copy the checkpoint's weights into `model` (built from `cfg`, before LoRA), one tensor at a time.

    Each routed-expert tensor holds only this rank's experts, so only those are read. Parameters already
    partitioned by ZeRO-3 are gathered one at a time while they are written. `check_unread`: report checkpoint
    tensors nothing mapped (only meaningful when this rank reads every expert, i.e. without expert parallelism).
    """
    assert cfg.checkpoint is not None, "load_checkpoint_weights needs a model profile read from a checkpoint"
    config = read_config(cfg.checkpoint)
    family = family_for(config, cfg.checkpoint)
    persistent = set(model.state_dict(keep_vars=True))
    problems: list[str] = []
    loaded: set[int] = set()
    with CheckpointReader(cfg.checkpoint) as reader:
        for module_name, module in model.named_modules():
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b) for n, b in module.named_buffers(recurse=False) if f"{module_name}.{n}".lstrip(".") in persistent
            ]
            for local_name, target in tensors:
                if id(target) in loaded:
                    continue  # a tied tensor (the LM head sharing the embedding) is loaded once, under its first name
                loaded.add(id(target))
                name = f"{module_name}.{local_name}".lstrip(".")
                recipe = family.recipe(name, module, cfg)
                if recipe is None:
                    continue
                try:
                    value = recipe(reader)
                except KeyError as err:
                    problems.append(f"{cfg.checkpoint}: tensor {err.args[0]} is missing (needed for {name})")
                    continue
                _copy_into(target, value, name, problems)
        if check_unread:
            ignore = tuple(getattr(family, "ignored_key_prefixes", ()))
            if cfg.tie_word_embeddings:
                ignore += ("lm_head.weight",)  # a tied head some checkpoints store anyway: transformers ignores it too
            problems += [f"{cfg.checkpoint}: module not mapped: {p}" for p in reader.unread_patterns(ignore)]
    if problems:
        raise UnsupportedModel(problems)


def _copy_into(target: torch.Tensor, value: torch.Tensor, name: str, problems: list[str]) -> None:
    shape = tuple(getattr(target, "ds_shape", target.shape))
    if tuple(value.shape) != shape:
        problems.append(f"checkpoint tensor for {name} has shape {tuple(value.shape)}, the model expects {shape}")
        return
    gathered = contextlib.nullcontext()
    if hasattr(target, "ds_id"):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([target], modifier_rank=0)
    with gathered, torch.no_grad():
        target.data.copy_(value.to(dtype=target.dtype, device=target.device))
