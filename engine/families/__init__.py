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

from .base import (
    Family,
    UnsupportedModel,
    declared_key_problems,
    is_fp8_checkpoint,
    key_pattern,
    quantization_problems,
    show,
)
from .checkpoint import (
    SCALE_SUFFIX, CheckpointReader, WeightGetter, fp8_tensor_problems, loader_file_problems, nonfinite_tensor_problems,
    read_config,
)

__all__ = [
    "Family",
    "UnsupportedModel",
    "family_for",
    "supported_model_types",
    "resolve_job",
    "model_profile_from_checkpoint",
    "check_checkpoint",
    "check_finite_weights",
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
    """(family, config.json, our model profile). An FP8 checkpoint's profile has base_precision fp8: its weights
    stay in their own precision (a profile may still ask for bf16, see resolve_job)."""
    config = read_config(directory)
    family = family_for(config, directory)
    problems = declared_key_problems(config)
    problems += [] if family.reads_own_quantization else quantization_problems(config)
    try:
        cfg = family.to_profile(config)
    except UnsupportedModel as err:
        raise UnsupportedModel(problems + [line for line in err.problems if line not in problems]) from None
    if problems:
        raise UnsupportedModel(problems)
    update: dict[str, Any] = {"checkpoint": Path(directory)}
    if is_fp8_checkpoint(config) and "base_precision" in ModelProfile.model_fields:
        update["base_precision"] = "fp8"
    return family, config, cfg.model_copy(update=update)


def check_checkpoint(directory: Path) -> None:
    """Read config.json and check the weight files (inside the folder, safetensors only, readable, holding what the
    index says; FP8 weights with their block scales: fp8_tensor_problems) before anything loads them:
    UnsupportedModel listing the problems of both at once."""
    problems: list[str] = []
    config = mapped = None
    try:
        config = read_config(directory)
        mapped = model_profile_from_checkpoint(directory)
    except UnsupportedModel as err:
        problems += err.problems
    try:
        with CheckpointReader(directory) as reader:
            # A quantization_config refused above says why the tensors are not read; no line per tensor.
            if config is not None and not quantization_problems(config):
                problems += fp8_tensor_problems(reader, is_fp8_checkpoint(config))
            if mapped is not None and not problems:
                family, _, cfg = mapped
                problems += tied_head_problems(WeightGetter(reader, family.packed_key_suffixes), family, cfg)
    except UnsupportedModel as err:
        problems += [line for line in err.problems if line not in problems]
    if problems:
        raise UnsupportedModel(problems)


def check_finite_weights(directory: Path) -> None:
    """UnsupportedModel when a floating-point tensor of the checkpoint holds NaN or an infinity (one line per key
    pattern): nothing computed from it can be compared. Reads every tensor."""
    with CheckpointReader(directory) as reader:
        problems = nonfinite_tensor_problems(reader)
    if problems:
        raise UnsupportedModel(problems)


def resolve_job(job: JobProfile) -> JobProfile:
    """The job with `model: {checkpoint: DIR}` replaced by the architecture read from DIR (re-validated, so the
    profile's cross-section rules see it). Jobs with an architecture spec come back unchanged; where the spec names
    its checkpoint (a run's profile.yaml), that folder's loader files are checked (loader_file_problems: its
    tokenizer and generation config are read before its weights). A tokenizer folder of its own (data.tokenizer) is
    checked the same way in both."""
    tokenizer = job.data.tokenizer
    if tokenizer not in (None, "byte"):
        problems = loader_file_problems(Path(tokenizer), "tokenizer")
        if problems:
            raise ProfileError([f"data.tokenizer ({tokenizer!r}): {line}" for line in problems])
    if not isinstance(job.model, CheckpointModel):
        checkpoint = job.model.checkpoint
        problems = loader_file_problems(checkpoint) if checkpoint is not None else []
        if problems:
            raise ProfileError([f"model.checkpoint ({str(checkpoint)!r}): {line}" for line in problems])
        return job
    try:
        check_checkpoint(job.model.checkpoint)
        _, _, cfg = model_profile_from_checkpoint(job.model.checkpoint)
    except UnsupportedModel as err:
        # repr: control and bidirectional characters escaped; a path is never cut.
        where = f"model.checkpoint ({str(job.model.checkpoint)!r})"
        raise ProfileError([f"{where}: {line}" for line in err.problems]) from None
    from moe_tune.profiles import validate_profile

    # The sections as the profile gave them (exclude_unset): the resolved job knows which settings the profile named.
    raw = job.model_dump(mode="json", exclude_unset=True)
    raw["model"] = cfg.model_dump(mode="json")
    # The profile's own base_precision wins over the checkpoint's (a bf16 run from an FP8 checkpoint dequantizes).
    if "base_precision" in job.model.model_fields_set:
        raw["model"]["base_precision"] = job.model.base_precision
    try:
        return validate_profile(raw)
    except ProfileError as err:
        if raw["model"].get("base_precision") != "fp8" or "base_precision" in job.model.model_fields_set:
            raise
        # The profile never said fp8: name where it came from.
        came = "model.base_precision ('fp8', from the checkpoint's FP8 quantization_config)"
        raise ProfileError([line.replace("model.base_precision ('fp8')", came, 1) for line in err.problems]) from None


def load_checkpoint_weights(model: nn.Module, cfg: ModelProfile, check_unread: bool = True) -> None:
    """Copy the checkpoint's weights into `model` (built from `cfg`, before LoRA), one tensor at a time.

    Each routed-expert tensor holds only this rank's experts, so only those are read. Parameters already
    partitioned by ZeRO-3 are gathered one at a time while they are written. `check_unread`: report checkpoint
    tensors nothing mapped (only meaningful when this rank reads every expert, i.e. without expert parallelism).

    FP8 (our uint8 `X` with its int32 `X_scale_inv`, the bits of float8_e4m3fn weights and fp32 block scales): an
    FP8 checkpoint's bits and scales are copied as stored, never through a floating copy; a tensor the checkpoint
    keeps in floating point is quantized here (ops.fp8.quantize_weight, one expert at a time). Our floating tensors
    read an FP8 checkpoint's weights dequantized. Where our rows of a stored FP8 tensor split its 128-row blocks
    (a part of a fused projection not aligned to 128 rows), that tensor is dequantized and quantized again, and a
    warning says which.
    """
    import warnings

    assert cfg.checkpoint is not None, "load_checkpoint_weights needs a model profile read from a checkpoint"
    config = read_config(cfg.checkpoint)
    family = family_for(config, cfg.checkpoint)
    persistent = set(model.state_dict(keep_vars=True))
    problems: list[str] = []
    requantized: list[str] = []
    loaded: set[int] = set()
    with CheckpointReader(cfg.checkpoint) as reader:
        problems += fp8_tensor_problems(reader, is_fp8_checkpoint(config))
        if problems:
            raise UnsupportedModel(problems)
        get = WeightGetter(reader, family.packed_key_suffixes)
        problems += tied_head_problems(get, family, cfg)
        if problems:
            raise UnsupportedModel(problems)
        # (key pattern, stored dtype) -> the integer (or boolean) tensors our floating tensors would be built from.
        not_floating: dict[tuple[str, str], set[str]] = {}
        for module_name, module in model.named_modules():
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b) for n, b in module.named_buffers(recurse=False) if f"{module_name}.{n}".lstrip(".") in persistent
            ]
            owned = dict(tensors)
            for local_name, target in tensors:
                if id(target) in loaded:
                    continue  # a tied tensor (the LM head sharing the embedding) is loaded once, under its first name
                loaded.add(id(target))
                if _fp8_partner(local_name.removesuffix(SCALE_SUFFIX), owned) is target:
                    continue  # an FP8 weight's scales: written with the weight
                name = f"{module_name}.{local_name}".lstrip(".")
                recipe = family.recipe(name, module, cfg)
                if recipe is None:
                    continue
                scale_target = _fp8_partner(local_name, owned)
                get.integers_read, get.keys_read = [], []
                try:
                    if scale_target is None:
                        value = recipe(get)
                        _copy_into(target, _floating(value, get) if target.is_floating_point() else value,
                                   name, problems, get)
                        continue
                    loaded.add(id(scale_target))
                    shape = tuple(getattr(target, "ds_shape", target.shape))
                    w_q, scale = _fp8_value(recipe, get, shape, _row_segments(local_name, shape), name, requantized)
                except KeyError as err:
                    problems.append(f"{cfg.checkpoint}: tensor {err.args[0]} is missing (needed for {name})")
                    continue
                except _NotFloating as err:
                    for key in err.keys:
                        not_floating.setdefault((key_pattern(key), reader.dtype(key)), set()).add(key)
                    if not err.keys:
                        problems.append(f"checkpoint tensor for {name} is {err.dtype}: {FLOAT_RULE}")
                    continue
                _copy_into(target, w_q, name, problems, get)
                _copy_into(scale_target, scale, name + SCALE_SUFFIX, problems, get)
        problems += get.problems
        for (_, dtype), keys in not_floating.items():
            first = min(keys)
            more = f" (and {len(keys) - 1} more like it)" if len(keys) > 1 else ""
            problems.append(f"{reader.file_of(first)}: tensor {first} is {dtype}{more}: {FLOAT_RULE}")
        if check_unread:
            # A tied head stored anyway was read by tied_head_problems (an equal copy) or refused there.
            ignore = tuple(getattr(family, "ignored_key_prefixes", ()))
            problems += [f"{cfg.checkpoint}: module not mapped: {p}" for p in reader.unread_patterns(ignore)]
    if problems:
        raise UnsupportedModel(problems)
    if requantized:
        more = f" and {len(requantized) - 1} more" if len(requantized) > 1 else ""
        warnings.warn(f"{cfg.checkpoint}: {requantized[0]}{more}: FP8 weights whose 128-row blocks our rows split, "
                      "dequantized and quantized again at load (within one FP8 rounding of the stored values)",
                      stacklevel=2)


# The LM head's key in every family's hub layout (transformers keeps it outside the base model).
HEAD_KEY = "lm_head.weight"
# Rows of a stored tied LM head compared with the embedding at a time (bounded memory on a 150k-token vocabulary).
COMPARED_ROWS = 4096
# The comparisons made in this process, by the two files' (path, size, mtime): check_checkpoint and the load that
# follows it compare a tied head once (two reads of a [vocabulary, hidden] pair each, seconds on a large model).
_TIED_HEAD_RESULTS: dict[tuple, list[str]] = {}


def _file_identity(path: Path) -> tuple:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def tied_head_problems(get: WeightGetter, family: Family, cfg: ModelProfile) -> list[str]:
    """One line when config.json ties the LM head to the embedding while the weights hold an lm_head.weight that
    differs from it: transformers loads such a checkpoint untied (each from its own tensor, whatever config.json
    says), so tying them would be another model. A copy equal to the embedding is tied, as transformers ties it, and
    counts as read. Reads both tensors, COMPARED_ROWS rows at a time, once for the same two files unchanged."""
    reader = get.reader
    if not cfg.tie_word_embeddings or HEAD_KEY not in reader:
        return []
    embed_key = getattr(family.recipe("embed_tokens.weight", None, cfg), "key", None)
    if embed_key is None or embed_key not in reader:
        return []  # the loader names the missing embedding
    identity = (_file_identity(reader.file_of(HEAD_KEY)), _file_identity(reader.file_of(embed_key)), HEAD_KEY,
                embed_key)  # fmt: skip
    if identity not in _TIED_HEAD_RESULTS:
        _TIED_HEAD_RESULTS[identity] = _compare_tied_head(get, embed_key)
    reader.read.update((HEAD_KEY, embed_key))
    return list(_TIED_HEAD_RESULTS[identity])


def _compare_tied_head(get: WeightGetter, embed_key: str) -> list[str]:
    reader = get.reader
    shape = reader.shape(HEAD_KEY)
    is_equal = shape == reader.shape(embed_key) and len(shape) == 2
    for start in range(0, shape[0] if is_equal else 0, COMPARED_ROWS):
        stop = min(start + COMPARED_ROWS, shape[0])
        # In fp32, as transformers compares the two once loaded (align's reference loads in fp32).
        if not torch.equal(get.rows(HEAD_KEY, start, stop).float(), get.rows(embed_key, start, stop).float()):
            is_equal = False
            break
    if is_equal:
        return []
    return [f"config.json: tie_word_embeddings (True) ties {HEAD_KEY} to {embed_key}, but {reader.file_of(HEAD_KEY)} "
            f"holds an {HEAD_KEY} that differs from it (transformers loads such a checkpoint untied): set "
            f"tie_word_embeddings to false to load both, or drop {HEAD_KEY} to tie them"]


# What a stored tensor our floating tensor is built from must be: integers would be cast into weights silently.
FLOAT_RULE = "a weight must be stored as floating point (F32, BF16, F16, or F8_E4M3 with its block scales)"


class _NotFloating(Exception):
    """A value built for one of our floating tensors is not floating point: `keys`, the stored tensors it came from
    that are not floating (empty when none is), and the value's dtype."""

    def __init__(self, keys: list[str], dtype: torch.dtype):
        super().__init__(keys)
        self.keys, self.dtype = keys, dtype


def _floating(value: torch.Tensor, get: WeightGetter) -> torch.Tensor:
    """`value`, built for one of our floating tensors, when it and the stored tensors it was read from are floating
    point; else _NotFloating naming the stored ones that hold integers or booleans (get.integers_read: one piece of a
    concatenation is promoted to the others' float dtype silently, so the value's dtype alone does not tell)."""
    if get.integers_read or not value.is_floating_point():
        raise _NotFloating(list(dict.fromkeys(get.integers_read)), value.dtype)
    return value


def _fp8_partner(local_name: str, owned: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The int32 block scales `<local_name>_scale_inv` of our FP8 tensor `local_name` (uint8), or None."""
    weight, scale = owned.get(local_name), owned.get(local_name + SCALE_SUFFIX)
    if weight is None or scale is None or weight.dtype != torch.uint8 or scale.dtype != torch.int32:
        return None
    return scale


def _row_segments(local_name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    # The fused routed experts' w_gate_up [E, 2F, D]: the gate and up halves keep their own scale rows.
    return (shape[-2] // 2, shape[-2] // 2) if local_name == "w_gate_up" else None


def _fp8_value(recipe, get: WeightGetter, shape: tuple[int, ...], segments, name: str,
               requantized: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q float8_e4m3fn, scale_inv fp32) of our FP8 tensor `name`: the checkpoint's bits when the recipe can take
    them as stored with scales in our block layout, else the recipe's floating tensor quantized (one expert at a
    time for grouped experts), noted in `requantized` when that tensor was FP8 in the checkpoint."""
    from moe_tune.ops.fp8 import num_blocks, quantize_weight

    scale_shape = (*shape[:-2], num_blocks(shape[-2], segments), num_blocks(shape[-1]))
    stored = recipe.quantized(get) if hasattr(recipe, "quantized") else None
    if stored is not None and tuple(stored[0].shape) != shape:
        return stored  # the loader reports the shape against ours
    if stored is not None and tuple(stored[1].shape) == scale_shape:
        return stored
    get.dequantized = []
    if hasattr(recipe, "expert"):
        parts, refused = [], None
        for i in range(recipe.count):
            expert = recipe.expert(get, i)
            # Past an expert read from integers the rest are still read, so that it alone is reported.
            if refused is None and (get.integers_read or not expert.is_floating_point()):
                refused = expert
            if refused is None:
                parts.append(quantize_weight(expert, segments))
        if refused is not None:
            _floating(refused, get)
        value = torch.stack([w for w, _ in parts]), torch.stack([s for _, s in parts])
    else:
        value = quantize_weight(_floating(recipe(get), get), segments)
    if get.dequantized:
        requantized.append(f"{name} (from {get.dequantized[0]})")
    return value


def _copy_into(target: torch.Tensor, value: torch.Tensor, name: str, problems: list[str], get: WeightGetter) -> None:
    """`value` (built from the keys `get` read for it) into our tensor `name`."""
    shape = tuple(getattr(target, "ds_shape", target.shape))
    if tuple(value.shape) != shape:
        problems.append(f"{get.sources()}: makes {name} of shape {tuple(value.shape)}, the model expects {shape}")
        return
    # Our FP8 tensors hold bits: float8_e4m3fn weights as uint8, fp32 scales as int32.
    if target.dtype == torch.uint8 and value.dtype == torch.float8_e4m3fn:
        value = value.view(torch.uint8)
    elif target.dtype == torch.int32 and value.dtype == torch.float32:
        value = value.view(torch.int32)
    gathered = contextlib.nullcontext()
    if hasattr(target, "ds_id"):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([target], modifier_rank=0)
    with gathered, torch.no_grad():
        target.data.copy_(value.to(dtype=target.dtype, device=target.device))
