"""What a user would pick instead, timed in the same process: `moe-tune profile PROFILE --against transformers`.

The profile's architecture is built in transformers (Qwen3MoeForCausalLM or Qwen3NextForCausalLM: the config is
derived from the ModelProfile and mapped back by engine/families, so a profile transformers cannot express is
refused naming the field), with PEFT LoRA on the same layers, and trained with AdamW on the same micro-batches,
dtype and schedule as our run; timed like our steps (warm-up, then the median of the timed steps).

Differences that stay (docs/bench.md, "--against transformers"):
- LoRA targets go to the transformers module that computes the same thing: on qwen3_next's linear-attention layers
  q_proj, k_proj, v_proj and z_proj are one fused in_proj_qkvz there (one adapter of rank r on all four), b_proj and
  a_proj are in_proj_ba and o_proj is out_proj; routed experts get PEFT's `target_parameters` adapters on the fused
  mlp.experts.gate_up_proj / down_proj (lora_A [E*r, in], lora_B [out, E*r]: the same counts as ours).
- Position_ids restart at each packed document (ours come from cu_seqlens) and there is no attention_mask, so
  transformers' softmax attention keeps the documents apart as ours does. Rows are fed as [R, L], unless the model's
  linear-attention layers (qwen3_next) keep documents apart given bounds (linear_attention_bounds: their forward
  reads cu_seq_lens_q, the delta rule they call honours it as cu_seqlens, probed): then the micro-batch is one packed
  row [1, R*L] with the bounds transformers' DataCollatorWithFlattening gives (cu_seq_lens_q/k, max_length_q/k, and
  seq_idx where their short conv honours it: causal-conv1d does, transformers' PyTorch conv does not). The row's
  `documents` says which (documents_text). Labels are ours (next token inside each document), passed as
  transformers' already-shifted `shift_labels`; the loss is their mean either way.
- transformers picks its own defaults (sdpa attention, grouped_mm experts where available), PEFT keeps adapters in
  fp32 over bf16 weights, gradients are clipped with torch's clip_grad_norm_.
- With `model.base_precision: fp8` the baseline's base weights are in the training dtype: transformers + PEFT cannot
  put LoRA on FP8 weights, so a user of an FP8 checkpoint runs it dequantized (base_precision_note says so).
- A baseline that runs out of memory (building the model or in a step) gives a row that says where
  (`out_of_memory`), not an error: ours has been measured by then.

The baseline starts from our weights: a profile read from a checkpoint loads the same checkpoint; a model built from
the profile has its initial weights (LoRA injected, before our first step) written as a transformers checkpoint in a
temporary folder (InitialWeights: the keys `moe-tune export` writes, placed by the family's recipes), which the
baseline loads, every key checked. The row says
which (`initial_weights`), and what the linear-attention layers ran (`linear_attention_implementation`,
`causal_conv_implementation`, `gated_norm_implementation`: read from the built model, `kernel_paths`).
Where a baseline does not keep the documents of a row apart everywhere ours does (qwen3_next's short conv without
causal-conv1d), the first-step losses differ although the weights are equal; `one_document` is the check that does
not depend on it: the longest document of the first micro-batch alone, both models' mean loss on it before any step
(eval mode, no gradients).

Shapes: R rows per micro-batch, L seq_len, E experts, r LoRA rank.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from types import FunctionType
from typing import Any, Callable, NamedTuple

import torch

from moe_tune.engine.align.reference import called_function, describe, pure_torch_paths
from moe_tune.engine.bench.timing import QueuedStep, run_steps, timed_steps
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile, ModelProfile

# The model types the baseline builds: every layer full attention (qwen3_moe), or linear and full attention with a
# gated shared expert (qwen3_next).
MODEL_TYPES = ("qwen3_moe", "qwen3_next")
LAYER_TYPES = {"linear": "linear_attention", "full": "full_attention"}
# Fields that do not change the architecture: the init and where the weights came from. The aux loss weight maps
# to router_aux_loss_coef, which the families do not read back.
IGNORED_FIELDS = {"model.seed", "model.init_std", "model.checkpoint", "model.moe.aux_loss_coef"}
# The base weights' storage is not architecture: the baseline keeps them in the training dtype (base_precision_note).
IGNORED_FIELDS |= {"model.base_precision"}
# Our LoRA target names (module-name suffixes) and the transformers modules computing the same, per model type.
TARGETS = {
    "qwen3_moe": {name: (name,) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")},
    "qwen3_next": {
        "q_proj": ("q_proj", "in_proj_qkvz"), "k_proj": ("k_proj", "in_proj_qkvz"),
        "v_proj": ("v_proj", "in_proj_qkvz"), "o_proj": ("o_proj", "out_proj"), "z_proj": ("in_proj_qkvz",),
        "b_proj": ("in_proj_ba",), "a_proj": ("in_proj_ba",), "shared_expert_gate": ("shared_expert_gate",),
        "lm_head": ("lm_head",),
    },  # fmt: skip
}
# Targets transformers has a linear layer for but PEFT cannot reach: its transformers-5 conversion turns every
# target ending in these names into target_parameters on the fused routed experts, so the shared expert and dense
# MLPs would silently get no adapter (PEFT 0.21; docs/bench.md, "--against transformers") and the experts a second one.
UNREACHABLE_TARGETS = ("gate_proj", "up_proj", "down_proj")
SAVED_MODULES = ("lm_head", "embed_tokens")
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Positions transformers' configs are sized for (default RoPE does not depend on it).
MIN_POSITIONS = 32768
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Longest value a refusal line quotes.
QUOTE_CHARS = 60
# The names a linear-attention layer's forward calls its kernels under (an attribute of the layer in older
# transformers, a function of its modeling module since), per row field; the first its forward names is read.
KERNEL_NAMES = {
    "linear_attention_implementation": ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
    "causal_conv_implementation": ("causal_conv1d_fn",),
}
# The gated output norm of a linear-attention layer (its attribute).
GATED_NORM = "norm"
# How the baseline treats the documents packed in a row (the row's `documents`, documents_text): position_ids that
# restart at each document give transformers' sdpa and eager attention a packed-sequence mask (its flash attention
# reads them only from a batch of one row); linear-attention layers read no bounds from them. A layer whose forward
# hands this FlashAttentionKwargs key to its chunked delta rule as cu_seqlens gets the bounds on one packed row, as
# transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) makes them (int32).
DOCUMENT_BOUNDS = "cu_seq_lens_q"
KEPT_APART = "kept apart (position_ids restart at each document)"
# Two documents of PROBE_TOKENS tokens each; PROBE_DIM channels per head (FLA's tl.dot needs 16); a short conv of
# qwen3_next's width (causal-conv1d takes widths 2 to 4) over PROBE_DIM channels (its channel-last path needs a
# multiple of 8).
PROBE_TOKENS, PROBE_DIM, PROBE_CONV_WIDTH = 8, 16, 4
# check_kernels_train's inputs: one chunk of FLA's (64 tokens) at the layer's own head dims, so that a kernel that
# trains the real layer is not refused for a shape of the probe's.
BACKWARD_PROBE_TOKENS = 64
# A document's output after two different first documents: equal where the bounds are kept (up to a kernel's
# rounding); where they are not, the first document changes it by up to 0.37 (delta rule) and 2.8 (short conv)
# (transformers' PyTorch paths in bf16).
PROBE_TOLERANCE = 1e-2
IMPLEMENTATION_FIELDS = (*KERNEL_NAMES, "gated_norm_implementation")
# Free disk the initial weights' checkpoint leaves, beyond its own size (the safetensors header, what else writes).
DISK_MARGIN = 1.1
# The initial weights' checkpoint: one safetensors file, the name transformers' from_pretrained looks for.
CHECKPOINT_FILE = "model.safetensors"
# PEFT's names around our base tensors: its model prefix, the parts only it has (adapters, trained copies of
# modules_to_save) and the wrappers around a base module (engine/export/zero.py reads saved states the same way).
PEFT_PREFIX = "base_model.model."
PEFT_ONLY_PARTS = (".lora_A.", ".lora_B.", ".lora_dropout.", ".modules_to_save.")
PEFT_WRAPPERS = (".base_layer.", ".original_module.")


def _common_config(cfg: ModelProfile) -> dict[str, Any]:
    """The fields qwen3_moe and qwen3_next configs share."""
    moe = cfg.moe
    config: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=len(cfg.layers),
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.init_std, hidden_act="silu",
        attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, use_cache=False,
        max_position_embeddings=MIN_POSITIONS, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        mlp_only_layers=[i for i, layer in enumerate(cfg.layers) if layer.mlp == "dense"],
    )  # fmt: skip
    if moe is not None:
        config.update(
            num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert_intermediate_size, norm_topk_prob=moe.renormalize,
            router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=moe.aux_loss_coef > 0,
        )  # fmt: skip
    else:
        config.update(num_experts=0)
    return config


def _qwen3_moe_config(cfg: ModelProfile) -> tuple[dict[str, Any], list[str]]:
    return _common_config(cfg), []


def _qwen3_next_config(cfg: ModelProfile) -> tuple[dict[str, Any], list[str]]:
    config = _common_config(cfg)
    config["layer_types"] = [LAYER_TYPES[layer.attention] for layer in cfg.layers]
    config["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    problems = []
    if cfg.linear_attention is not None:
        spec = cfg.linear_attention
        config.update(
            linear_num_key_heads=spec.num_key_heads, linear_num_value_heads=spec.num_value_heads,
            linear_key_head_dim=spec.key_head_dim, linear_value_head_dim=spec.value_head_dim,
            linear_conv_kernel_dim=spec.conv_kernel_size,
        )  # fmt: skip
    if cfg.moe is not None:
        config["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
        if cfg.moe.shared_expert_intermediate_size == 0:
            problems.append("model.moe.shared_expert_intermediate_size (0): transformers' qwen3_next always has a "
                            "gated shared expert; --against transformers cannot build this model")  # fmt: skip
    return config, problems


CONFIGS: dict[str, Callable[[ModelProfile], tuple[dict[str, Any], list[str]]]] = {
    "qwen3_moe": _qwen3_moe_config,
    "qwen3_next": _qwen3_next_config,
}


def _flat(value: Any, path: str) -> dict[str, Any]:
    """A model_dump flattened to dotted paths (lists and None stay leaves)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flat(item, f"{path}.{key}"))
        return out
    return {path: value}


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def _round_trip(model_type: str, config: dict[str, Any], cfg: ModelProfile) -> list[str]:
    """Problems of building `cfg` as `model_type` from `config`: each field the family maps back differently from
    the config transformers builds (so a field transformers drops or overrides is caught too)."""
    import transformers

    from moe_tune.engine.families import UnsupportedModel, family_for

    built = transformers.AutoConfig.for_model(model_type, **config).to_dict()
    try:
        theirs = family_for({"model_type": model_type}).to_profile(built)
    except UnsupportedModel as err:
        return [f"model: transformers' {model_type} cannot express it: {line}" for line in err.problems]
    ours_flat = _flat(cfg.model_dump(mode="json"), "model")
    theirs_flat = _flat(theirs.model_dump(mode="json"), "model")
    ignored = set(IGNORED_FIELDS)
    if not any(layer.mlp == "dense" for layer in cfg.layers):
        # Only dense layers read intermediate_size.
        ignored.add("model.intermediate_size")
    problems = []
    for path in sorted(set(ours_flat) | set(theirs_flat)):
        if path in ignored:
            continue
        ours, other = ours_flat.get(path), theirs_flat.get(path)
        if ours != other:
            problems.append(f"{path} ({_quote(ours)}): transformers' {model_type} builds {_quote(other)}; "
                            "--against transformers cannot build this model")  # fmt: skip
    return problems


def transformers_config(cfg: ModelProfile) -> tuple[str, dict[str, Any]]:
    """(model_type, config kwargs) of the transformers model with `cfg`'s architecture. Raises ProfileError naming
    each field no supported model type expresses (those of the closest candidate)."""
    kinds = {}
    for index, layer in enumerate(cfg.layers):
        kinds.setdefault(layer.attention, index)
    unsupported = [
        f"model.layers[{index}].attention ('{kind}'): --against transformers builds qwen3_moe (full attention) or "
        f"qwen3_next (linear and full attention) models, which have no '{kind}' layers"
        for kind, index in kinds.items() if kind not in LAYER_TYPES
    ]  # fmt: skip
    if unsupported:
        raise ProfileError(unsupported)
    candidates = ["qwen3_next"] if "linear" in kinds else ["qwen3_moe", "qwen3_next"]
    attempts = []
    for model_type in candidates:
        config, problems = CONFIGS[model_type](cfg)
        problems += _round_trip(model_type, config, cfg)
        if not problems:
            return model_type, config
        attempts.append(problems)
    raise ProfileError(min(attempts, key=len))


def lora_targets(job: JobProfile, model_type: str) -> dict[str, Any]:
    """PEFT LoraConfig arguments for the transformers model: our targets mapped to its module names, experts as
    target_parameters. Raises ProfileError for a target transformers has no linear layer for."""
    lora = job.lora
    table = TARGETS[model_type]
    problems = []
    for name in lora.target_modules:
        if name in UNREACHABLE_TARGETS:
            problems.append(f"lora.target_modules ('{name}'): PEFT turns {name} targets of transformers' {model_type} "
                            "into adapters on the routed experts, so its shared expert and dense MLPs cannot be "
                            "adapted; --against transformers cannot match this target")  # fmt: skip
        elif name not in table:
            problems.append(f"lora.target_modules ('{name}'): transformers' {model_type} has no linear layer computing "
                            "it (its router is not an nn.Linear); --against transformers cannot adapt it")  # fmt: skip
    problems += [
        f"lora.modules_to_save ('{name}'): --against transformers saves only {', '.join(SAVED_MODULES)}"
        for name in lora.modules_to_save if name not in SAVED_MODULES
    ]  # fmt: skip
    if problems:
        raise ProfileError(problems)
    modules = sorted({mapped for name in lora.target_modules for mapped in table[name]})
    return dict(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", target_modules=modules,
        target_parameters=list(EXPERT_PARAMETERS) if lora.experts and job.model.moe is not None else None,
        modules_to_save=list(lora.modules_to_save) or None,
    )  # fmt: skip


def _with_lora(model: torch.nn.Module, job: JobProfile, model_type: str) -> torch.nn.Module:
    """`model` wrapped by PEFT with `lora_targets`; PEFT's own refusals (targets it cannot convert) as ProfileError."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(job, model_type)
    try:
        return get_peft_model(model, LoraConfig(**targets))
    except ValueError as err:
        raise ProfileError([f"lora.target_modules ({list(job.lora.target_modules)}): PEFT refuses the transformers "
                            f"targets {targets['target_modules']}: {err}"]) from None  # fmt: skip


def base_precision_note(job: JobProfile) -> str | None:
    """The line that says the baseline's base weights are not ours (None when they are)."""
    if job.model.base_precision != "fp8":
        return None
    return (f"note: model.base_precision fp8: the transformers baseline keeps its base weights in "
            f"{job.train.precision} (transformers + PEFT cannot put LoRA on FP8 weights)")  # fmt: skip


def baseline_device() -> torch.device | None:
    """Where the baseline will run its own kernels: the GPU when there is one (one process: check_against); None on
    a CPU, where it runs transformers' PyTorch paths (run_transformers)."""
    return torch.device("cuda") if torch.cuda.is_available() else None


def check_buildable(job: JobProfile) -> str:
    """Build the baseline on the meta device (shapes only, seconds even for billions of parameters), so that a
    profile transformers or PEFT cannot take is refused before anything runs; on a GPU, also a baseline whose
    linear-attention kernels cannot train there (check_kernels_train). Returns the model type."""
    import transformers

    from moe_tune.engine.families import family_for

    model_type, config = transformers_config(job.model)
    model_class = getattr(transformers, family_for({"model_type": model_type}).reference_class)
    with torch.device("meta"):
        model = model_class(transformers.AutoConfig.for_model(model_type, **config))
        if job.lora.enabled:
            _with_lora(model, job, model_type)
    device = baseline_device()
    if device is not None:
        check_kernels_train(model, model_type, device, DTYPES[job.train.precision])
    return model_type


class _Positions:
    """A getter for the family's recipes whose tensors hold, for each element, its index among the keys the recipe
    reads (in `offsets`' order): a recipe run on it says where each element of our tensor goes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device):
        self.shapes, self.device = shapes, device
        self.offsets: dict[str, int] = {}
        self.total = 0

    def _start(self, key: str) -> int:
        if key not in self.shapes:
            raise KeyError(key)
        if key not in self.offsets:
            self.offsets[key] = self.total
            self.total += math.prod(self.shapes[key])
        return self.offsets[key]

    def __call__(self, key: str) -> torch.Tensor:
        start = self._start(key)
        end = start + math.prod(self.shapes[key])
        return torch.arange(start, end, dtype=torch.int64, device=self.device).view(self.shapes[key])

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the key's first dim (one expert of a fused tensor)."""
        shape = self.shapes[key]
        row = math.prod(shape[1:])
        first = self._start(key) + start * row
        end = first + (stop - start) * row
        return torch.arange(first, end, dtype=torch.int64, device=self.device).view(stop - start, *shape[1:])


def _base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our base tensors by our single-process names (build_model's state_dict keys) from the model as StepRunner
    holds it (PEFT-wrapped under LoRA): adapters and trained copies left out (the adapters start as a no-op)."""
    state = {}
    for name, tensor in model.state_dict().items():
        name = name.removeprefix(PEFT_PREFIX)
        if any(part in name for part in PEFT_ONLY_PARTS):
            continue
        for wrapper in PEFT_WRAPPERS:
            name = name.replace(wrapper, ".")
        state[name] = tensor
    return state


@torch.no_grad()
def checkpoint_tensors(
    model: torch.nn.Module, cfg: ModelProfile, precision: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, {key: tensor on the host}) of `model`'s base weights in the transformers checkpoint layout of its
    architecture (engine/families/hub_config: what `moe-tune export` writes), in `precision`; an FP8 base
    dequantized. Each of our tensors goes where the family's recipe reads it from (recipes are rearrangements: run
    on element indices they say where each element sits, the engine/export/hub.py inversion, scattered here
    without sorting). RuntimeError when a key gets no tensor of ours."""
    from moe_tune.engine.export.fp8 import bf16_base
    from moe_tune.engine.export.hub import KeyInfo, Layout, plan_export
    from moe_tune.engine.export.sources import DequantizedSource, DictSource, meta_model
    from moe_tune.engine.families.base import take
    from moe_tune.engine.families.hub_config import hub_config_for_profile

    source = DequantizedSource(DictSource(_base_state(model)), cfg, False, 1.0)
    plain = bf16_base(cfg)
    family, config, keys = hub_config_for_profile(plain, precision)
    layout = Layout({key: KeyInfo(tuple(shape), dtype) for key, (shape, dtype) in keys.items()})
    plan = plan_export(meta_model(plain), plain, family, layout, source.names())
    shapes = {key: info.shape for key, info in layout.keys.items()}
    out = {key: torch.zeros(info.shape, dtype=info.dtype) for key, info in layout.keys.items()}
    written = set()
    for (name, part), recipe in plan.recipes.items():
        ours = (source.read(name) if part is None else source.read_expert(name, part)).detach()
        if isinstance(recipe, take):
            out[recipe.key].copy_(ours.reshape(shapes[recipe.key]))
            written.add(recipe.key)
            continue
        # The indices are worked out where our tensor is (on the GPU for a model built there).
        positions = _Positions(shapes, ours.device)
        ids = recipe(positions).reshape(-1)
        values = ours.reshape(-1)
        # Most recipes concatenate whole keys in order (an expert's gate and up rows): copied as slices.
        in_order = ids.numel() == positions.total and bool(
            (ids == torch.arange(positions.total, device=ids.device)).all())
        for key, start in positions.offsets.items():
            target = out[key].view(-1)
            if in_order:
                target.copy_(values[start : start + target.numel()])
            else:
                inside = (ids >= start) & (ids < start + target.numel())
                target[(ids[inside] - start).cpu()] = values[inside].to("cpu", target.dtype)
            written.add(key)
    missing = [key for key in out if key not in written]
    if missing:
        raise RuntimeError(f"--against transformers: no tensor of ours goes into {missing[:5]}")
    return config, out


class InitialWeights:
    """Our model's initial weights as a transformers checkpoint in a temporary folder, for the baseline to start
    from: `write(model)` is StepRunner's prepare_model (LoRA injected, before DeepSpeed takes the model and before
    our first step). `folder` is the checkpoint, or None with `problem` saying why it was not written (the disk
    cannot hold it); `close()` removes it."""

    def __init__(self, job: JobProfile):
        self.job = job
        self.folder: Path | None = None
        self.problem: str | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def nbytes(self) -> int:
        """The checkpoint's size: every base parameter in the training dtype."""
        from moe_tune.engine.plan import count_parameters

        return count_parameters(self.job.model, self.job.lora).total * DTYPES[self.job.train.precision].itemsize

    def write(self, model: torch.nn.Module) -> None:
        from safetensors.torch import save_file

        self._tmp = tempfile.TemporaryDirectory(prefix="moe-tune-against-")
        needed, free = self.nbytes(), shutil.disk_usage(self._tmp.name).free
        if needed * DISK_MARGIN > free:
            self.problem = (f"our initial weights ({needed / 1e9:.1f} GB) do not fit the {free / 1e9:.1f} GB free in "
                            f"{tempfile.gettempdir()}")  # fmt: skip
            self.close()
            return
        config, tensors = checkpoint_tensors(model, self.job.model, self.job.train.precision)
        expected, _ = transformers_config(self.job.model)
        if config["model_type"] != expected:
            raise RuntimeError(f"--against transformers: our weights were laid out as {config['model_type']}, the "
                               f"baseline is {expected}")  # fmt: skip
        folder = Path(self._tmp.name) / "initial"
        folder.mkdir()
        save_file(tensors, str(folder / CHECKPOINT_FILE), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.folder = folder

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.folder = None


def initial_weights_text(job: JobProfile, initial: InitialWeights | None) -> str:
    """Where the baseline's weights come from (the row's `initial_weights`)."""
    if job.model.checkpoint is not None:
        return f"the checkpoint {job.model.checkpoint}"
    if initial is not None and initial.folder is not None:
        fp8 = ", the FP8 base dequantized" if job.model.base_precision == "fp8" else ""
        return f"ours (our initial weights written as a transformers checkpoint{fp8})"
    why = initial.problem if initial is not None and initial.problem else "not handed over"
    return f"its own random init ({why})"


def _loaded(model_class, folder: Path, config, dtype: torch.dtype, what: str):
    """`model_class` from the checkpoint `folder` with `config` in `dtype`; RuntimeError naming the keys when
    any weight of the model was not in the checkpoint, or the checkpoint held one the model does not have."""
    model, info = model_class.from_pretrained(
        str(folder), config=config, dtype=dtype, local_files_only=True, trust_remote_code=False,
        use_safetensors=True, output_loading_info=True,
    )  # fmt: skip
    problems = {key: sorted(map(str, info.get(key) or ())) for key in ("missing_keys", "unexpected_keys",
                                                                        "mismatched_keys", "error_msgs")}  # fmt: skip
    problems = {key: names for key, names in problems.items() if names}
    if problems:
        raise RuntimeError(f"--against transformers: {what} does not load into {model_class.__name__}: " + "; ".join(
            f"{key} {names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            for key, names in problems.items()))  # fmt: skip
    return model


def build_transformers_model(job: JobProfile, device: torch.device, initial: Path | None = None):
    """The transformers model of `job` (the checkpoint's weights when the profile was read from one; else the
    checkpoint `initial` of our initial weights (InitialWeights), or random init from job.model without it) with
    PEFT LoRA as `lora_targets` says (or every weight trainable without LoRA), in the training dtype on `device`, in
    training mode. Returns (model, model_type)."""
    import transformers

    from moe_tune.engine.families import family_for

    model_type, config = transformers_config(job.model)
    family = family_for({"model_type": model_type})
    model_class = getattr(transformers, family.reference_class)
    dtype = DTYPES[job.train.precision]
    config["max_position_embeddings"] = max(MIN_POSITIONS, job.data.seq_len)
    torch.manual_seed(job.train.seed)
    if job.model.checkpoint is None and initial is not None:
        built = transformers.AutoConfig.for_model(model_type, **config)
        model = _loaded(model_class, initial, built, dtype, "our initial weights").to(device)
    elif job.model.checkpoint is not None:
        from moe_tune.engine.families.checkpoint import read_config

        saved_type = read_config(job.model.checkpoint).get("model_type")
        if saved_type not in MODEL_TYPES:
            raise ProfileError([f"model.checkpoint ('{job.model.checkpoint}'): --against transformers loads "
                                f"{' or '.join(MODEL_TYPES)} checkpoints, not {saved_type!r}"])  # fmt: skip
        model = model_class.from_pretrained(
            str(job.model.checkpoint), dtype=dtype, use_cache=False, local_files_only=True, trust_remote_code=False,
            use_safetensors=True,
        ).to(device)
    else:
        # Built in the training dtype, as a user would (from_config with a dtype): built in fp32 and cast, a 30B
        # model would need 1.5x its bf16 size on the device.
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(model_type, **config), dtype=dtype
            )
        if type(model) is not model_class:
            raise RuntimeError(f"transformers built {type(model).__name__} for {model_type}, not {model_class.__name__}")
    if job.lora.enabled:
        model = _with_lora(model, job, model_type)
    model.train()
    return model, model_type


def longest_document(batch):
    """The longest document piece of a micro-batch (the first of equal ones) as a micro-batch of its own: one row
    [1, n] with its labels, one cu_seqlens segment."""
    assert batch.pixel_values is None, "check_buildable refuses models with a vision tower"
    bounds = batch.cu_seqlens.tolist()
    start, stop = max(zip(bounds, bounds[1:]), key=lambda piece: piece[1] - piece[0])
    return type(batch)(input_ids=batch.input_ids[:, start:stop], labels=batch.labels[:, start:stop],
                       cu_seqlens=torch.tensor([0, stop - start], dtype=torch.int32))  # fmt: skip


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(base parameters, trainable parameters): adapters and trained copies of saved modules are not base."""
    base = sum(p.numel() for name, p in model.named_parameters()
               if "lora_" not in name and ".modules_to_save." not in name)  # fmt: skip
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return base, trainable


class TransformersRunner:
    """The transformers model of a job with its optimizer and schedule, stepped by hand on our micro-batches."""

    def __init__(self, job: JobProfile, device: torch.device, total_steps: int, initial: Path | None = None):
        from moe_tune.engine.train.trainer import lr_factor

        self.job, self.device = job, device
        self.model, self.model_type = build_transformers_model(job, device, initial)
        train = job.train
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # Torch's fused AdamW on CUDA, as ours (trainer.build_optimizer) and as transformers' Trainer runs by default
        # (TrainingArguments.optim `adamw_torch_fused`, read in transformers 5.25).
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay,
            fused=device.type == "cuda" or None,
        )  # fmt: skip
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, train, total_steps))
        self.is_cuda = device.type == "cuda"
        self.parameters, self.trainable_parameters = _parameter_counts(self.model)
        config = self.model.config
        self.attention_implementation = getattr(config, "_attn_implementation", None)
        self.experts_implementation = getattr(config, "_experts_implementation", None)
        # Read while the paths the steps run are bound (run_transformers builds and steps inside pure_torch_paths).
        self.kernel_paths = kernel_paths(self.model)
        self.bounds = linear_attention_bounds(self.model, device, DTYPES[train.precision])
        self.documents = documents_text(self.bounds)

    def inputs(self, batch) -> dict[str, Any]:
        """The model's inputs for one of our micro-batches: input_ids, labels (label t is the token after t) and
        position_ids (counting from 0 in each document, as ours do: transformers reads a packed row's document bounds
        from where they restart) as [R, L] rows; as one packed row [1, R*L] with DataCollatorWithFlattening's bounds
        where the linear-attention layers keep documents apart given them (`bounds`, DOCUMENT_BOUNDS)."""
        from moe_tune.engine.model.blocks import document_ids, document_positions

        rows, seq_len = self.job.train.micro_batch_size, self.job.data.seq_len
        total = batch.input_ids.numel()
        is_packed = self.bounds is not None and self.bounds.delta_rule
        shape = (1, total) if is_packed else (rows, seq_len)
        positions = document_positions(batch.cu_seqlens, total)
        inputs = {name: x.view(shape).to(self.device) for name, x in
                  (("input_ids", batch.input_ids), ("labels", batch.labels), ("position_ids", positions))}  # fmt: skip
        if not is_packed:
            return inputs
        cu_seqlens = batch.cu_seqlens.to(self.device, torch.int32)
        longest = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
        inputs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest)
        if self.bounds.short_conv:
            inputs["seq_idx"] = document_ids(batch.cu_seqlens, total).view(shape).to(self.device, torch.int32)
        return inputs

    def lm_loss(self, inputs: dict[str, Any]):
        """(loss backward runs on, mean next-token loss) of one micro-batch's `inputs`. Our labels are already
        shifted: they go in as transformers' `shift_labels` too (`labels` alone would be shifted again, losing each
        row's last label). No attention_mask: with position_ids alone transformers keeps the packed documents apart
        in attention."""
        out = self.model(**inputs, shift_labels=inputs["labels"], use_cache=False)
        aux = getattr(out, "aux_loss", None)
        lm = out.loss if aux is None else out.loss - self.model.config.router_aux_loss_coef * aux
        return out.loss, lm

    def document_loss(self, document) -> float:
        """Mean next-token loss on `document` (longest_document's micro-batch: one row of one document), in eval mode
        without gradients; the training mode is restored."""
        n = document.input_ids.shape[1]
        inputs = {"input_ids": document.input_ids.to(self.device), "labels": document.labels.to(self.device),
                  "position_ids": torch.arange(n, device=self.device)[None]}  # fmt: skip
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                _, lm = self.lm_loss(inputs)
        finally:
            self.model.train(was_training)
        return float(lm)

    def launch(self, batches: list, behind=None) -> QueuedStep:
        """Queue one optimizer step over `batches` (the micro-batches of one of our steps) and the copy of its loss
        to the host; nothing waits for the device. behind: the unread QueuedStep it is queued behind."""
        from moe_tune.engine.train.step_values import StepValues, launch_clock

        train = self.job.train
        started = launch_clock(self.device, behind.values if behind else None)
        losses, tokens = [], 0
        # As ours (trainer.loss_denominator): the step's mean over all its micro-batches' labelled tokens, each
        # micro-batch's mean weighed by its tokens; the aux loss averaged over the micro-batches.
        step_tokens = max(sum(batch.num_label_tokens for batch in batches), 1)
        for batch in batches:
            loss, lm = self.lm_loss(self.inputs(batch))
            weight = batch.num_label_tokens / step_tokens
            (lm * weight + (loss - lm) / len(batches)).backward()
            losses.append(lm.detach().float() * weight)
            tokens += batch.num_label_tokens
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return QueuedStep(tokens, [], StepValues({"loss": torch.stack(losses).sum()}, started), None)

    def finish(self, queued: QueuedStep) -> dict[str, Any]:
        """StepRunner.finish's record (loss, tokens, step time) of a queued step, once its loss is on the host."""
        loss = queued.values.read()["loss"]
        seconds = queued.values.seconds()
        return {"loss": loss, "tokens": queued.tokens, "step_time_s": seconds, "tokens_per_s": queued.tokens / seconds}


class _StepBatches:
    """The baseline's runner with each step's micro-batches bound in order: launch(behind) / finish() as run_steps
    takes them."""

    def __init__(self, runner, step_batches: list[list]):
        self._runner, self._batches, self._next = runner, step_batches, 0

    def launch(self, behind=None) -> QueuedStep:
        batches = self._batches[self._next]
        self._next += 1
        return self._runner.launch(batches, behind)

    def finish(self, queued: QueuedStep):
        return self._runner.finish(queued)


def _function_name(value: Any) -> str:
    """module.qualname of what calling `value` runs (called_function: through a kernels function module and
    transformers' fallback wrapper to the implementation it chose when its modeling module was imported)."""
    value = called_function(value)
    return f"{getattr(value, '__module__', None) or '?'}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _forward(module: torch.nn.Module) -> Callable:
    """The module's own forward, under its decorators (transformers wraps some for accelerate hooks and renames)."""
    return inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))


def _called_names(module: torch.nn.Module) -> set[str]:
    """The global names the module's forward calls, and those its modeling module's own helpers that it calls call
    in turn (transformers >= 5.25 reaches causal_conv1d_fn through causal_conv1d_forward)."""
    called = set(getattr(getattr(_forward(module), "__code__", None), "co_names", ()))
    namespace = vars(sys.modules[type(module).__module__])
    kernel_names = {name for names in KERNEL_NAMES.values() for name in names}
    for name in called - kernel_names:
        helper = called_function(namespace.get(name))
        if isinstance(helper, FunctionType) and helper.__module__ == type(module).__module__:
            called |= set(helper.__code__.co_names)
    return called


def _called_kernels(module: torch.nn.Module) -> dict[str, tuple[str, Any, bool]]:
    """{field: (name, function, is_held)} of each KERNEL_NAMES function the module's forward calls (_called_names;
    the first name it calls of the field's): as the layer holds it (older transformers, is_held; None for its
    PyTorch path) or as its modeling module binds it now (None when it binds none)."""
    called = _called_names(module)
    found = {}
    for field, names in KERNEL_NAMES.items():
        name = next((n for n in names if n in called), None)
        if name is None:
            continue
        if name in vars(module):
            found[field] = (name, vars(module)[name], True)
        else:
            found[field] = (name, vars(sys.modules[type(module).__module__]).get(name), False)
    return found


def kernel_paths(model: torch.nn.Module) -> dict[str, str | None]:
    """What the model's linear-attention layers run (IMPLEMENTATION_FIELDS), read from the built model: each
    KERNEL_NAMES function its layers' forward calls (_called_kernels), and the class (or replaced forward) of its
    gated output norm. None for a field no layer has (no linear attention); several distinct values are joined by
    ', '."""
    found: dict[str, list[str]] = {field: [] for field in IMPLEMENTATION_FIELDS}
    for module in model.modules():
        calls = _called_kernels(module)
        for field, (name, value, is_held) in calls.items():
            if is_held and value is None:
                text = (f"{type(module).__module__}.{type(module).__qualname__}.forward (its PyTorch path: "
                        f"{name} is None)")  # fmt: skip
            else:
                text = "?" if value is None else _function_name(value)
            if text not in found[field]:
                found[field].append(text)
        norm = getattr(module, GATED_NORM, None) if calls else None
        if isinstance(norm, torch.nn.Module):
            norm_forward = getattr(norm.forward, "__func__", norm.forward)
            text = _function_name(norm_forward).removesuffix(".forward")
            if text not in found["gated_norm_implementation"]:
                found["gated_norm_implementation"].append(text)
    return {field: ", ".join(texts) if texts else None for field, texts in found.items()}


class LinearBounds(NamedTuple):
    """What the linear-attention layers of a model keep apart of the documents packed in one row: whether their
    forward reads DOCUMENT_BOUNDS, whether the delta rule they call keeps documents apart given them (as cu_seqlens)
    and whether their short conv does given `seq_idx`."""

    reads_bounds: bool
    delta_rule: bool
    short_conv: bool


def _second_document_kept_apart(call: Callable, inputs: list, changed: list, dim: int, bounds: dict) -> bool:
    """Whether `call(*inputs, **bounds)`, each input two documents of PROBE_TOKENS tokens along `dim`, gives the
    second document the same output as `call(*changed, **bounds)`, whose first document differs (False when the
    function refuses the bounds)."""
    try:
        outputs = [call(*x, **bounds).narrow(dim, PROBE_TOKENS, PROBE_TOKENS).float() for x in (inputs, changed)]
    except torch.OutOfMemoryError:
        raise
    except (TypeError, ValueError, RuntimeError):
        # transformers' PyTorch fallback raises ValueError for bounds it cannot keep, a function without the argument
        # TypeError, a kernel that cannot take them on these inputs RuntimeError.
        return False
    return torch.allclose(*outputs, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE)


def _first_redrawn(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` [1, T, ...] with its first document (PROBE_TOKENS tokens) drawn again."""
    first = torch.randn(x[:, :PROBE_TOKENS].shape, generator=generator).to(x.device, x.dtype)
    return torch.cat([first, x[:, PROBE_TOKENS:]], dim=1)


@torch.no_grad()
def _delta_rule_keeps_documents(chunk: Callable | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `chunk` (a chunk_gated_delta_rule, called as qwen3_next's layer calls it) keeps two documents apart
    given cu_seqlens."""
    if chunk is None:
        return False
    generator = torch.Generator().manual_seed(0)
    tokens = 2 * PROBE_TOKENS
    qkv = [torch.randn(1, tokens, 1, PROBE_DIM, generator=generator).to(device, dtype) for _ in range(3)]
    # No decay (g = 0 in log space): the first document's state would reach the second whole.
    g = torch.zeros(1, tokens, 1, device=device)
    beta = torch.full((1, tokens, 1), 0.5, device=device, dtype=dtype)
    cu_seqlens = torch.tensor([0, PROBE_TOKENS, tokens], dtype=torch.int32, device=device)

    def call(q, k, v, **bounds):
        return chunk(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=True, **bounds)[0]  # fmt: skip

    changed = [_first_redrawn(x, generator) for x in qkv]
    return _second_document_kept_apart(call, qkv, changed, 1, {"cu_seqlens": cu_seqlens})


@torch.no_grad()
def _short_conv_keeps_documents(conv: Callable | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `conv` (a causal_conv1d_fn, called as qwen3_next's layer calls it) keeps two documents apart given
    seq_idx."""
    if conv is None:
        return False
    generator = torch.Generator().manual_seed(0)
    tokens = 2 * PROBE_TOKENS
    x = torch.randn(1, tokens, PROBE_DIM, generator=generator).to(device, dtype)
    weight = torch.randn(PROBE_DIM, PROBE_CONV_WIDTH, generator=generator).to(device, dtype)
    seq_idx = torch.arange(2, dtype=torch.int32, device=device).repeat_interleave(PROBE_TOKENS)[None]

    def call(x, **bounds):
        return conv(x, weight, None, activation="silu", **bounds)

    # [1, C, T] with channels last in memory, as the layer hands it over (its [1, T, C] projection transposed).
    inputs, changed = ([y.transpose(1, 2)] for y in (x, _first_redrawn(x, generator)))
    return _second_document_kept_apart(call, inputs, changed, 2, {"seq_idx": seq_idx})


def _short_conv_backward_error(conv: Callable, device: torch.device, dtype: torch.dtype, *_) -> str | None:
    """The error `conv` (a causal_conv1d_fn, called as qwen3_next's layer calls it) raises on a small input's forward
    and backward on `device`, or None when it runs."""
    generator = torch.Generator().manual_seed(0)
    # [1, C, T] with channels last in memory, as the layer hands it over.
    x = torch.randn(1, BACKWARD_PROBE_TOKENS, PROBE_DIM, generator=generator).to(device, dtype).requires_grad_()
    weight = torch.randn(PROBE_DIM, PROBE_CONV_WIDTH, generator=generator).to(device, dtype).requires_grad_()
    return _backward_error(lambda: conv(x.transpose(1, 2), weight, None, activation="silu"))


def _delta_rule_backward_error(chunk: Callable, device: torch.device, dtype: torch.dtype, key_dim: int,
                               value_dim: int) -> str | None:  # fmt: skip
    """The error `chunk` (a chunk_gated_delta_rule, called as qwen3_next's layer calls it) raises on one head of
    BACKWARD_PROBE_TOKENS tokens at the layer's head dims, forward and backward on `device` (every input a gradient),
    or None when it runs."""
    generator = torch.Generator().manual_seed(0)
    tokens = BACKWARD_PROBE_TOKENS
    q, k = (torch.randn(1, tokens, 1, key_dim, generator=generator).to(device, dtype).requires_grad_()
            for _ in range(2))  # fmt: skip
    v = torch.randn(1, tokens, 1, value_dim, generator=generator).to(device, dtype).requires_grad_()
    g = (-torch.rand(1, tokens, 1, generator=generator)).to(device).requires_grad_()
    beta = torch.full((1, tokens, 1), 0.5, device=device, dtype=dtype).requires_grad_()
    return _backward_error(lambda: chunk(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=True)[0])  # fmt: skip


def _backward_error(forward: Callable[[], torch.Tensor]) -> str | None:
    """The error (type and first line) `forward()` or the backward of its summed output raises, or None."""
    try:
        forward().float().sum().backward()
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the peer's kernel raises is what the refusal quotes
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[0] if lines else ''}"
    return None


def check_kernels_train(model: torch.nn.Module, model_type: str, device: torch.device, dtype: torch.dtype) -> None:
    """ProfileError, before anything runs, when a chunked delta rule or short conv the model's linear-attention layers
    call (kernel_paths' functions; not their own PyTorch path) fails a tiny forward and backward on `device`: the
    baseline could not train a step there (FLA 0.6's gated backward refuses Hopper GPUs on Triton 3.4 to 3.7.0)."""
    layers = [calls for module in model.modules()
              if "linear_attention_implementation" in (calls := _called_kernels(module))]  # fmt: skip
    probes = {"linear_attention_implementation": _delta_rule_backward_error,
              "causal_conv_implementation": _short_conv_backward_error}  # fmt: skip
    config = model.config
    head_dims = (config.linear_key_head_dim, config.linear_value_head_dim) if layers else ()
    for field, probe in probes.items():
        functions = {id(f): f for f in (calls.get(field, (None, None))[1] for calls in layers) if f is not None}
        for function in functions.values():
            error = probe(function, device, dtype, *head_dims)
            if error is not None:
                raise ProfileError([
                    f"--against transformers: transformers' {model_type} trains its linear-attention layers with "
                    f"{_function_name(function)}, which fails a backward on this machine ({error[:200]}); the "
                    "baseline cannot train here (docs/bench.md, \"What the baseline runs\")"])  # fmt: skip


def linear_attention_bounds(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> LinearBounds | None:
    """What the model's linear-attention layers keep apart of packed documents (None without such layers), decided
    from the layers: their forward's code names DOCUMENT_BOUNDS, and the delta rule and short conv they call (as
    kernel_paths finds them) are probed on two tiny documents on `device` in `dtype`. Each holds for every layer."""
    layers = [(module, calls) for module in model.modules()
              if "linear_attention_implementation" in (calls := _called_kernels(module))]  # fmt: skip
    if not layers:
        return None
    reads_bounds = all(DOCUMENT_BOUNDS in _forward(module).__code__.co_consts for module, _ in layers)
    # Each distinct function the layers call, probed once (a layer calling no short conv counts as None).
    chunks = {id(f): f for f in (calls["linear_attention_implementation"][1] for _, calls in layers)}
    convs = {id(f): f for f in (calls.get("causal_conv_implementation", (None, None))[1] for _, calls in layers)}
    delta_rule = reads_bounds and all(_delta_rule_keeps_documents(chunk, device, dtype) for chunk in chunks.values())
    short_conv = delta_rule and all(_short_conv_keeps_documents(conv, device, dtype) for conv in convs.values())
    return LinearBounds(reads_bounds, delta_rule, short_conv)


def documents_text(bounds: LinearBounds | None) -> str:
    """How the baseline treats the documents packed in a row (the row's `documents`), its linear-attention layers
    keeping what `bounds` says."""
    if bounds is None:
        return KEPT_APART
    if not bounds.delta_rule:
        why = ("their forward reads no cu_seq_lens_q" if not bounds.reads_bounds
               else "their chunk_gated_delta_rule does not keep them apart given cu_seqlens")  # fmt: skip
        return (f"kept apart in full attention (position_ids restart at each document); its linear-attention layers "
                f"carry their state and short conv across the documents of a row ({why})")  # fmt: skip
    packed = "one packed row [1, R*L]: position_ids restart at each document, cu_seq_lens_q bounds the"
    if bounds.short_conv:
        return f"kept apart ({packed} linear-attention layers' delta rule, seq_idx their short conv)"
    return (f"kept apart in full attention and the linear-attention layers' delta rule ({packed} delta rule); their "
            "short conv runs across the documents of the packed row (their causal_conv1d_fn does not keep them apart "
            "given seq_idx)")


def run_transformers(job: JobProfile, step_batches: list[list], warmup: int, device: torch.device, total_steps: int,
                     on_step=None, initial: InitialWeights | None = None, document=None) -> dict[str, Any]:  # fmt: skip
    """Build the transformers baseline (from our initial weights where `initial` holds them) and run one step per
    entry of `step_batches` (the first `warmup` untimed), its lr schedule over `total_steps` as ours.
    Returns its row: medians over the timed steps, peak memory (CUDA), parameter counts, where its weights came
    from and what transformers chose to run; with `document` (longest_document's), its loss on it before the first
    step (`document_loss`)."""
    gc.collect()
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.empty_cache()
    # Whatever our run left allocated would count into the baseline's peak: shown next to it.
    allocated_before = torch.cuda.memory_allocated() if is_cuda else None
    # On a GPU transformers runs what it picks (flash-linear-attention's kernels where installed: its best); on a
    # CPU those Triton kernels cannot run, so it runs its own PyTorch paths, as align's reference does.
    paths = contextlib.nullcontext({}) if is_cuda else pure_torch_paths()
    with paths as replaced:
        try:
            runner = TransformersRunner(job, device, total_steps, initial.folder if initial is not None else None)
        except Exception as err:  # noqa: BLE001 - only running out of memory becomes a row; anything else re-raises
            if not is_out_of_memory(err):
                raise
            if is_cuda:
                # What the partly built model held goes back to the device.
                gc.collect()
                torch.cuda.empty_cache()
            return _out_of_memory_row(job, "building the model", 0, allocated_before, initial)
        return _run_steps(runner, step_batches, warmup, is_cuda, on_step, allocated_before, replaced, initial,
                          document)  # fmt: skip


def timed_baseline_steps(runner, count: int, warmup: int, is_cuda: bool, on_record) -> str | None:
    """A baseline's `count` steps timed as ours (timing.run_steps: queued as the trainer queues them), the peak
    memory counted from the first timed one (index `warmup`); on_record(index, record) follows each. A step that runs
    out of memory ends them: returns where ("warm-up step 2", "timed step 1"), else None; other errors raise."""
    launching = [0]

    def before_launch(index: int) -> None:
        launching[0] = index
        if index == warmup and is_cuda:
            torch.cuda.reset_peak_memory_stats()

    try:
        run_steps(runner, count, on_record, before_launch)
    except Exception as err:  # noqa: BLE001 - only running out of memory becomes a row
        if not is_out_of_memory(err):
            raise
        index = launching[0]
        return f"warm-up step {index + 1}" if index < warmup else f"timed step {index - warmup + 1}"
    return None


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is the device running out of memory (torch's error, or a library's own message)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _impl_name(own: dict | None = None) -> str:
    import peft
    import transformers

    return f"transformers {transformers.__version__} + peft {peft.__version__}" + (f", {describe(own)}" if own else "")


def _out_of_memory_row(job: JobProfile, where: str, steps_done: int, allocated_before: int | None,
                       initial: InitialWeights | None = None, documents: str | None = None,
                       document_loss: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The baseline's row when it ran out of memory `where`: no timings, the steps it finished (and how it fed their
    documents and its one-document loss, when it had built the model and got that far)."""
    model_type, _ = transformers_config(job.model)
    return dict(
        impl=_impl_name(), model_type=model_type, attention_implementation=None, experts_implementation=None,
        **dict.fromkeys(IMPLEMENTATION_FIELDS), initial_weights=initial_weights_text(job, initial),
        documents=documents,
        lora=lora_targets(job, model_type) if job.lora.enabled else None, steps=steps_done, losses=[],
        first_step_loss=None, tokens_per_s=None, step_time_s=None, step_times_s=[], peak_memory_bytes=None,
        allocated_before_bytes=allocated_before, parameters=None, trainable_parameters=None,
        document_loss=document_loss, out_of_memory=where,
    )  # fmt: skip


def _run_steps(runner, step_batches, warmup, is_cuda, on_step, allocated_before, replaced, initial,
               document) -> dict[str, Any]:  # fmt: skip
    job = runner.job
    # The functions pure_torch_paths rebound in the model's own modeling module (named in `impl`).
    model_module = type(getattr(runner.model, "get_base_model", lambda: runner.model)()).__module__
    own = {key: origin for key, origin in replaced.items() if key[0] == model_module}
    all_records = []
    out_of_memory = None
    document_loss = None
    try:
        if document is not None:
            try:
                document_loss = runner.document_loss(document)
            except Exception as err:  # noqa: BLE001 - only running out of memory becomes a row
                if not is_out_of_memory(err):
                    raise
                out_of_memory = "the one-document loss before the first step"
        def keep(index: int, record: dict) -> None:
            if on_step is not None:
                on_step(index, index < warmup, record)
            all_records.append(record)

        if out_of_memory is None:
            batches = _StepBatches(runner, step_batches)
            out_of_memory = timed_baseline_steps(batches, len(step_batches), warmup, is_cuda, keep)
        peak = torch.cuda.max_memory_allocated() if is_cuda else None
    finally:
        runner.model = runner.optimizer = runner.scheduler = runner.trainable = None
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
    if out_of_memory is not None:
        return _out_of_memory_row(job, out_of_memory, max(len(all_records) - warmup, 0), allocated_before, initial,
                                  runner.documents, document_loss)
    return dict(
        impl=_impl_name(own),
        model_type=runner.model_type,
        attention_implementation=runner.attention_implementation,
        experts_implementation=runner.experts_implementation,
        **runner.kernel_paths,
        initial_weights=initial_weights_text(job, initial),
        documents=runner.documents,
        lora=lora_targets(job, runner.model_type) if job.lora.enabled else None,
        **timed_steps(all_records, warmup, peak),
        allocated_before_bytes=allocated_before,
        parameters=runner.parameters,
        trainable_parameters=runner.trainable_parameters,
        document_loss=document_loss,
        out_of_memory=None,
    )
