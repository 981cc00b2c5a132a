"""State sources of a finished run (the interface: engine/export/__init__.py): its final state on disk, or a state
held in memory (the trainer's `output.save_merged`).

A LoRA run's final state is the base checkpoint (read through the family's recipes, one tensor at a time) with
`adapter/` merged in tensor by tensor; a full fine-tune's is `model.safetensors` (our names already).
"""

from __future__ import annotations

import copy
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from moe_tune.profiles import ProfileError, error_line, more_alike
from moe_tune.profiles.schema import JobProfile, ModelProfile, file_kind

from . import merge_lora

ADAPTER_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter/adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter/adapter_config.json"
WEIGHTS_FILE = "model.safetensors"
# A LoRA run's MoE selection biases where model.moe.bias_update_rate trains them (buffers the adapter cannot hold;
# a full fine-tune's model.safetensors holds them with the parameters).
SELECTION_BIASES_FILE = "adapter/selection_biases.safetensors"
ROUTING_BIASES_IN_NO_ADAPTER = ("the run trained its routing biases (model.moe.bias_update_rate), which a PEFT adapter "
                                "cannot hold: the base model with the adapter would route otherwise; export with "
                                "--merge, which writes them into the model")
# The dtypes the trainer saves trained tensors in (and fp16 / fp64, which a merge reads as well).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Their names in a safetensors header.
STORED_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# An adapter factor's name after the prefix: `<module>.lora_A.<param>` (linear: param `weight`; grouped experts:
# `w_gate_up` / `w_down`), the factor of our tensor `<module>.<param>`.
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<side>lora_A|lora_B)\.(?P<param>[^.]+)$")


@dataclass
class RunInfo:
    """A finished run's folder and its resolved profile (profile.yaml: the model as the run built it)."""

    run_dir: Path
    profile: JobProfile

    @property
    def cfg(self) -> ModelProfile:
        return self.profile.model


def read_run(run_dir: Path, need_final: bool = True) -> RunInfo:
    """The run in `run_dir`; ProfileError (one line each) when there is no run there or, with `need_final`, it has
    not written its final state (summary.json and the adapter / weights). The commands read it inside
    run_dir.reading_run, which refuses a folder a run holds before anything is read."""
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.train.run_dir import links_out_of
    from moe_tune.profiles import validate_profile
    from moe_tune.profiles.schema import data_files_unchecked

    run_dir = Path(run_dir)
    profile_file = run_dir / "profile.yaml"
    if not run_dir.is_dir():
        what = "not a folder" if run_dir.exists() else "no such folder"
        raise ProfileError([f"{run_dir}: {what} (RUN_DIR must be a finetune output.dir)"])
    if not profile_file.is_file():
        from moe_tune.engine.train.run_dir import OVERWRITTEN

        if (run_dir / OVERWRITTEN / "profile.yaml").is_file():
            raise ProfileError([f"{run_dir}: its run is set aside in {OVERWRITTEN} by a finetune --overwrite that "
                                "stopped while it set up (killed?); a finetune --resume into the folder puts it back"])
        raise ProfileError([f"{run_dir}: no run here (no profile.yaml; RUN_DIR must be a finetune output.dir)"])
    escaping = links_out_of(run_dir, ("profile.yaml", "summary.json", "adapter", ADAPTER_FILE, ADAPTER_CONFIG_FILE,
                                      SELECTION_BIASES_FILE, WEIGHTS_FILE))  # fmt: skip
    if escaping:
        raise ProfileError(escaping)
    try:
        raw = yaml.safe_load(profile_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = str(err).splitlines()[0]
        raise ProfileError([f"{profile_file}: not readable as the run's profile ({reason})"]) from None
    try:
        # Its data files are not read (they may have moved since, or been named relative to another folder).
        with data_files_unchecked():
            profile = resolve_job(validate_profile(raw))
    except ProfileError as err:
        raise ProfileError([f"{profile_file}: {line}" for line in err.problems]) from None
    run = RunInfo(run_dir, profile)
    if need_final:
        final = run_dir / (ADAPTER_FILE if profile.lora.enabled else WEIGHTS_FILE)
        summary = read_summary(run_dir / "summary.json")
        if summary is None or not final.is_file():
            missing = final.relative_to(run_dir)
            raise ProfileError([f"{run_dir}: the run has not finished (no summary.json or no {missing}); "
                                "export a checkpoint with --step N, or finish it with finetune --resume"])
        last, total = _summary_steps(summary)
        total = total if total is not None else profile.train.steps
        if last is not None and total is not None and last < total:
            raise ProfileError([f"{run_dir}: the run stopped at step {last} of its {total} steps; "
                                f"export that state with --step {last}, or finish it with finetune --resume"])
    return run


def _summary_steps(summary: dict) -> tuple[int | None, int | None]:
    """summary.json's last_step and total_steps (the run's steps, train.epochs' included); None where it does not
    say."""
    last, total = (summary.get(key) for key in ("last_step", "total_steps"))
    last = last if isinstance(last, int) and not isinstance(last, bool) and last >= 0 else None
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    return last, total


def open_safetensors(path: Path):
    """A safetensors handle on `path` (safe_open, header and sizes checked); ProfileError `<path>: not a readable
    safetensors file (<reason>)` for a truncated, damaged or unreadable file."""
    from safetensors import SafetensorError, safe_open

    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ProfileError([f"{path}: not a readable safetensors file ({error_line(err)})"]) from None
    if not stat.S_ISREG(mode):
        # A FIFO would block the read for ever, a device act on it.
        raise ProfileError([f"{path}: not a regular file ({file_kind(mode)}); a safetensors file must be one"])
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ProfileError([f"{path}: not a readable safetensors file ({error_line(err)})"]) from None


def adapter_factor_of(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[str, str, str] | None:
    """(module, "lora_A" or "lora_B", param) when `name` (without ADAPTER_PREFIX) is a factor of our tensor
    W = <module>.<param> [..., out, in] of a model whose tensors have `shapes`; None otherwise."""
    match = _FACTOR.match(name)
    if match is None or len(shapes.get(f"{match['module']}.{match['param']}", ())) < 2:
        return None
    return match["module"], match["side"], match["param"]


def adapter_problems(path: Path, adapter: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                     r: int) -> list[str]:
    """One line per adapter tensor (read from `path`) that the run's model (its tensors' `shapes`) at rank `r`
    cannot take: a name that is neither a factor of one of its tensors nor one of its tensors trained in full
    (modules_to_save), a factor without its other half, a non-floating dtype, a shape other than the factor's
    (W [..., out, in]: A [..., r, in], B [..., out, r]; a linear layer's [out, in], grouped experts' [E, out, in])
    or our tensor's, non-finite values (one isfinite pass per tensor). Tensors with the same kind of problem are one
    line, the first of them with how many more (a profile.yaml edited to another lora.r breaks every factor alike)."""
    kinds: dict[str, list[str]] = {}

    def add(kind: str, line: str) -> None:
        kinds.setdefault(kind, []).append(line)

    for key, tensor in adapter.items():
        name = key.removeprefix(ADAPTER_PREFIX)
        factor = adapter_factor_of(name, shapes) if name != key else None
        if factor is not None:
            module, side, param = factor
            weight = f"{module}.{param}"
            *lead, out_features, in_features = shapes[weight]
            expected = (*lead, r, in_features) if side == "lora_A" else (*lead, out_features, r)
            rule = f"lora.r {r}, {weight} {shapes[weight]}"
            other = "lora_B" if side == "lora_A" else "lora_A"
            if f"{ADAPTER_PREFIX}{module}.{other}.{param}" not in adapter:
                add("unpaired", f"{path}: tensor {key} has no {other} beside it (an adapter is the pair lora_A, "
                                "lora_B)")
                continue
        elif name != key and name in shapes:
            expected, rule = shapes[name], f"{name} trained in full"
        else:
            add("unmatched", f"{path}: tensor {key} matches no tensor of the run's model (adapter names are "
                            f"{ADAPTER_PREFIX}<module>.lora_A|lora_B.<param>, or {ADAPTER_PREFIX}<tensor> trained in "
                            "full)")
            continue
        if tensor.dtype not in FLOAT_DTYPES:
            dtype = str(tensor.dtype).removeprefix("torch.")
            add("dtype", f"{path}: tensor {key} has dtype {dtype}, must be a floating-point dtype (float32, "
                            "bfloat16, float16, float64)")
        elif tuple(tensor.shape) != expected:
            add("shape", f"{path}: tensor {key} has shape {tuple(tensor.shape)}, expected {expected} ({rule})")
        elif not bool(torch.isfinite(tensor).all()):
            add("non-finite", f"{path}: tensor {key} holds non-finite values (NaN or inf)")
    return [lines[0] + more_alike(len(lines) - 1) for lines in kinds.values()]


def read_adapter(run: RunInfo, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """The run's adapter/adapter_model.safetensors, checked against its model (`shapes`: our tensors' shapes, by
    default those of the run's model, an FP8 base read as its bf16-base model); ProfileError, one line per problem
    (adapter_problems), or one naming the file when it is not a readable safetensors file."""
    from safetensors import SafetensorError

    from .fp8 import bf16_base

    path = run.run_dir / ADAPTER_FILE
    if shapes is None:
        shapes = {name: tuple(t.shape) for name, t in meta_model(bf16_base(run.cfg)).state_dict().items()}
    handle = open_safetensors(path)
    try:
        with handle as f:
            adapter = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ProfileError([f"{path}: not a readable safetensors file ({error_line(err)})"]) from None
    problems = adapter_problems(path, adapter, shapes, run.profile.lora.r)
    if problems:
        raise ProfileError(problems)
    return adapter


def read_selection_biases(run: RunInfo, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The selection biases a LoRA run trained (SELECTION_BIASES_FILE; {} when the run trained none), each an MoE
    block's bias of its shape; ProfileError naming the file and the tensor otherwise."""
    from safetensors import SafetensorError

    path = run.run_dir / SELECTION_BIASES_FILE
    moe = run.profile.model.moe
    if moe is None or moe.bias_update_rate <= 0:
        return {}
    if not os.path.lexists(path):
        raise ProfileError([f"{path}: missing; the run trains its routing biases (model.moe.bias_update_rate) and "
                            "keeps them there (a run that ended before it did holds them in its checkpoints: export "
                            "--step N --merge)"])
    try:
        with open_safetensors(path) as f:
            biases = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ProfileError([f"{path}: not a readable safetensors file ({error_line(err)})"]) from None
    for key, tensor in biases.items():
        if not key.endswith(".selection_bias") or key not in shapes:
            raise ProfileError([f"{path}: tensor {key} is not a selection bias of the run's model"])
        if tuple(tensor.shape) != shapes[key] or not tensor.dtype.is_floating_point:
            raise ProfileError([f"{path}: tensor {key} is {tensor.dtype} {tuple(tensor.shape)}, the run's model holds "
                                f"a float {shapes[key]}"])
        if not torch.isfinite(tensor).all():
            raise ProfileError([f"{path}: tensor {key} holds non-finite values (NaN or inf)"])
    missing = [key for key in shapes if key.endswith(".selection_bias") and key not in biases]
    if missing:
        raise ProfileError([f"{path}: no tensor {missing[0]}" + more_alike(len(missing) - 1)])
    return biases


def weights_problems(path: Path, handle, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """A full fine-tune's model.safetensors (`handle`, open on `path`) against our tensors' `shapes`, read from the
    header only: the first tensor whose stored shape is not ours, the first whose name is none of ours (the file of
    another model) and the first of a dtype other than a floating-point one, each with how many more, one line each;
    none when all fit."""
    problems: dict[str, list[str]] = {"shape": [], "unknown": [], "dtype": []}
    for key in sorted(handle.keys()):
        expected = shapes.get(key)
        stored = tuple(handle.get_slice(key).get_shape())
        dtype = handle.get_slice(key).get_dtype()
        if expected is None:
            problems["unknown"].append(f"{path}: tensor {key} matches no tensor of the run's model (a full "
                                       "fine-tune's weights are the model's tensors under its names)")
        elif dtype not in STORED_FLOAT_DTYPES:
            problems["dtype"].append(f"{path}: tensor {key} has dtype {dtype}, must be a floating-point dtype (F32, "
                                     "BF16, F16, F64)")
        elif stored != expected:
            problems["shape"].append(f"{path}: tensor {key} has shape {stored}, expected {expected} (the run's model)")
    return [lines[0] + more_alike(len(lines) - 1) for lines in problems.values() if lines]


def meta_model(cfg: ModelProfile) -> nn.Module:
    """Our model's module tree without storage: the recipes need its modules (expert ranges), never its values."""
    from moe_tune.engine.model.model import MoECausalLM

    with torch.device("meta"):
        return MoECausalLM(cfg)


def owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def lora_scaling(profile: JobProfile) -> float:
    return profile.lora.alpha / profile.lora.r


class DictSource:
    """A state already in memory, in our names (the trainer's merged state)."""

    def __init__(self, state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor] | None = None):
        self.state, self.adapter = state, adapter

    def names(self) -> list[str]:
        return list(self.state)

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]

    def read_expert(self, name: str, expert: int) -> torch.Tensor:
        return self.state[name][expert : expert + 1]

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        return self.adapter

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_summary(summary: Path) -> dict | None:
    """A run's summary.json, None where there is none; ProfileError naming it where it is not a JSON object (cut
    short, edited)."""
    import json

    if not summary.is_file():
        return None
    try:
        data = json.loads(summary.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ProfileError([f"{summary}: not readable as the run's summary ({error_line(err)})"]) from None
    if not isinstance(data, dict):
        raise ProfileError([f"{summary}: not readable as the run's summary (a JSON {type(data).__name__}, not an "
                            "object)"])
    return data


class FinalState:
    """A finished run's final state. LoRA: base weights from the checkpoint (or, for a profile-built model, our
    seeded init) and, with `merged`, adapter/ merged in per tensor. Full fine-tuning: model.safetensors. An FP8-base
    run reads as its bf16-base model: its names, each FP8 weight as the run held it, dequantized to fp32."""

    def __init__(self, run: RunInfo, merged: bool):
        from .fp8 import bf16_base, fp8_weights

        self.run, self.merged = run, merged
        # An FP8-base run reads as its bf16-base model, each FP8 weight dequantized (engine/export/fp8.py).
        self.fp8 = fp8_weights(run.cfg)
        self.cfg = bf16_base(run.cfg)
        self.model = meta_model(self.cfg)
        # Base weights are read in the dtype our model holds them in (a bf16 checkpoint, or MXFP4 experts dequantized
        # to bf16, trained in fp32), so a merge rounds once, when the writer stores the key's dtype.
        self._dtypes = {name: t.dtype for name, t in self.model.state_dict().items()}
        self._shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self._names = list(self._dtypes)
        self._reader = None
        self._adapter = None
        self._biases: dict[str, torch.Tensor] = {}
        self._init_state = None
        self._weights = None
        if self.cfg.checkpoint is not None:
            from moe_tune.engine.families import family_for
            from moe_tune.engine.families.checkpoint import CheckpointReader, WeightGetter, read_config

            self.family = family_for(read_config(self.cfg.checkpoint), self.cfg.checkpoint)
            self._reader = CheckpointReader(self.cfg.checkpoint)
            # The loader's getter: FP8 keys dequantized for recipes, or as stored for the FP8 weights it copies.
            self._getter = WeightGetter(self._reader)
            if merged and run.profile.lora.enabled and (changed := self._base_changes()) is not None:
                self.close()
                raise ProfileError([changed])
        if not run.profile.lora.enabled:
            path = run.run_dir / WEIGHTS_FILE
            self._weights = open_safetensors(path)
            problems = weights_problems(path, self._weights, self._shapes)
            if problems:
                self.close()
                raise ProfileError(problems)
            self._weight_names = set(self._weights.keys())
            # Every parameter, and the routing biases the run trained; other buffers keep the base's values.
            required = [name for name, _ in self.model.named_parameters()]
            if run.cfg.moe is not None and run.cfg.moe.bias_update_rate > 0:
                required += [name for name, _ in self.model.named_buffers() if name.endswith(".selection_bias")]
            missing = [name for name in required if name not in self._weight_names]
            if missing:
                self.close()
                raise ProfileError([f"{path}: no tensor {missing[0]}" + more_alike(len(missing) - 1)])
            return
        try:
            self._adapter = read_adapter(run, self._shapes)
            self._biases = read_selection_biases(run, self._shapes)
        except ProfileError:
            self.close()
            raise

    def names(self) -> list[str]:
        return list(self._names)

    def base(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Our tensor `name` before training (LoRA runs: the frozen weight); with `expert`, only that expert of a
        grouped expert tensor ([1, ...]), read alone from the checkpoint."""
        if self._reader is None:
            if self._init_state is None:
                # A profile-built model's base weights are its seeded init (the whole model, built once), FP8
                # weights quantized as the run's build quantized them.
                from moe_tune.engine.model.model import build_model

                self._init_state = build_model(self.run.cfg).state_dict()
            weight = self.fp8.get(name)
            if weight is None:
                value = self._init_state[name]
            else:
                from .fp8 import dequantized

                value = dequantized(self._init_state[name], self._init_state[weight.scale_name], weight)
            return value if expert is None else value[expert : expert + 1]
        module = owner(self.model, name)
        if expert is not None:
            # The recipe asked as by an expert-parallel rank that holds this one expert.
            module = copy.copy(module)
            module.first_expert, module.num_experts = module.first_expert + expert, 1
        recipe = self.family.recipe(name, module, self.cfg)
        if recipe is None:
            return torch.zeros_like(self.model.state_dict()[name], device="cpu")
        try:
            from .fp8 import checkpoint_base

            shape = (1, *self._shapes[name][1:]) if expert is not None else self._shapes[name]
            return checkpoint_base(self._getter, recipe, self.fp8.get(name), shape).to(self._dtypes[name])
        except KeyError:
            # A tied head the checkpoint stores only once: the embedding, read under its own name.
            tied = self._tied_name(name)
            if tied is None:
                raise
            return self.base(tied, expert)

    def _tied_name(self, name: str) -> str | None:
        target = self.model.get_parameter(name) if name in dict(self.model.named_parameters()) else None
        for other, param in self.model.named_parameters(remove_duplicate=False):
            if other != name and param is target:
                return other
        return None

    def read(self, name: str) -> torch.Tensor:
        if self._weights is not None:
            if name not in self._weight_names:
                return self.base(name)  # a buffer model.safetensors does not hold (it holds the parameters)
            return self._finite(name, self._weights.get_tensor(name))
        saved = self._adapter.get(ADAPTER_PREFIX + name)
        if saved is not None:
            return saved  # a module trained in full (modules_to_save)
        if name in self._biases:
            return self._biases[name]
        weight = self.base(name)
        if not self.merged:
            return weight
        return merged_weight(name, weight, self._adapter, lora_scaling(self.run.profile))

    def _finite(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of model.safetensors as read, refused when it holds NaN or inf: read one at a time as an export
        writes, before the export's folder is renamed into place."""
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ProfileError([f"{self.run.run_dir / WEIGHTS_FILE}: tensor {name} holds non-finite values (NaN or "
                                "inf)"])
        return tensor

    def read_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert `expert` of the grouped expert tensor `name`, [1, ...], without reading the others."""
        if self._weights is not None and name in self._weight_names:
            return self._finite(name, self._weights.get_slice(name)[expert : expert + 1])
        saved = self._adapter.get(ADAPTER_PREFIX + name) if self._adapter is not None else None
        if saved is not None:
            return saved[expert : expert + 1]  # grouped experts trained in full (modules_to_save)
        weight = self.base(name, expert)
        if not self.merged:
            return weight
        return merged_weight(name, weight, self._adapter, lora_scaling(self.run.profile), expert)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        return self._adapter

    def _base_changes(self) -> str | None:
        """The line refusing a merge into base weights other than those the run trained on (summary.json's
        base_checkpoint; a run of an earlier version has none, and is not checked)."""
        from moe_tune.engine.families.checkpoint import changes_phrase, fingerprint_changes

        saved = (read_summary(self.run.run_dir / "summary.json") or {}).get("base_checkpoint")
        if not isinstance(saved, dict):
            return None
        changes = fingerprint_changes(saved.get("files"), self._reader.fingerprint())
        if not changes:
            return None
        return (f"model.checkpoint ({self.cfg.checkpoint}) has changed since the run trained on it "
                f"({changes_phrase(changes)}): the adapter merged into these weights is not the model the run "
                "trained; put back the weights it trained on, or export a checkpoint of the run with --step N (it "
                "holds them)")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._weights = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def merged_weight(name: str, weight: torch.Tensor, adapter: dict[str, torch.Tensor], scaling: float,
                  expert: int | None = None) -> torch.Tensor:
    """Our tensor `name` with its adapter (if any) merged: linear `<m>.weight` from `<m>.lora_A.weight` /
    `.lora_B.weight`, grouped experts `<m>.w_gate_up` / `w_down` from `<m>.lora_A.w_gate_up` ... per expert
    (`expert`: `weight` is that one expert, [1, ...])."""
    module, _, param = name.rpartition(".")
    if param == "weight":
        a, b = (adapter.get(f"{ADAPTER_PREFIX}{module}.{part}.weight") for part in ("lora_A", "lora_B"))
    else:
        a, b = (adapter.get(f"{ADAPTER_PREFIX}{module}.{part}.{param}") for part in ("lora_A", "lora_B"))
    if a is None or b is None:
        return weight
    if expert is not None:
        a, b = a[expert : expert + 1], b[expert : expert + 1]
    return merge_lora(weight, a, b, scaling)


class DequantizedSource:
    """A state source over the FP8 model's names (FP8 weights as bits) seen as the bf16-base model: its FP8 weights
    dequantized to fp32 and, with `merged`, the adapter merged in fp32 (engine/export/__init__.py's interface)."""

    def __init__(self, inner, cfg: ModelProfile, merged: bool, scaling: float):
        from .fp8 import bf16_base, fp8_weights

        self.inner, self.merged, self.scaling = inner, merged, scaling
        self.fp8 = fp8_weights(cfg)
        self._names = list(meta_model(bf16_base(cfg)).state_dict())

    def names(self) -> list[str]:
        return list(self._names)

    def _base(self, name: str, expert: int | None) -> torch.Tensor:
        from .fp8 import dequantized

        read = self.inner.read if expert is None else (lambda n: self.inner.read_expert(n, expert))
        weight = self.fp8.get(name)
        if weight is None:
            return read(name)
        return dequantized(read(name), read(weight.scale_name), weight)

    def read(self, name: str) -> torch.Tensor:
        value = self._base(name, None)
        adapter = self.inner.adapter_state()
        if not self.merged or adapter is None:
            return value
        return merged_weight(name, value, adapter, self.scaling)

    def read_expert(self, name: str, expert: int) -> torch.Tensor:
        value = self._base(name, expert)
        adapter = self.inner.adapter_state()
        if not self.merged or adapter is None:
            return value
        return merged_weight(name, value, adapter, self.scaling, expert)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        return self.inner.adapter_state()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
