"""Writing a state source (engine/export/__init__.py) as a Hugging Face checkpoint folder in the hub's key layout.

The family's recipes say how each of our tensors is built from checkpoint tensors, by pure rearrangement (take,
concat, stacked_experts, grouped_rows, slices, reshapes). They are inverted without knowing them: run on a getter
whose tensors hold the flat index of each of their elements (int64), a recipe returns, for each element of our
tensor, where it sits among the checkpoint keys it read; our values are scattered there (grouped experts one
expert at a time, so the index tensors stay the size of one expert). Every key of the base
checkpoint is written, in its dtype and under its name (a key no recipe reads, such as mtp.*, as it is), in
shards of at most --max-shard-size with model.safetensors.index.json; one shard is held in memory at a time.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moe_tune.engine.atomic_write import folder_refused
from moe_tune.engine.families.checkpoint import CONFIG_NAME, INDEX_NAME, LOADER_FILES, LOADER_FOLDERS
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import ModelProfile

from . import StateSource, other_writers, staged_folder, write_errors_named, writing_problem

INDEX_NAME = "model.safetensors.index.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Loader files whose "chat_template" entry a transformers 5 processor prefers to chat_template.jinja (and an older
# tokenizer, to nothing else): the entry is removed where the run's own template is written.
TEMPLATE_CONFIGS = ("tokenizer_config.json", "processor_config.json")
# The legacy processor template, read before chat_template.jinja: left out where the run's own template is written.
LEGACY_TEMPLATE_FILE = "chat_template.json"
DEFAULT_SHARD_SIZE = "5GB"
# The folders an export writes in its run's folder by default (--out unset): of the names a run keeps there
# (run_dir.is_owned_name), the only ones --out may name.
EXPORT_NAMES = ("export", "export-merged")
# The files of a checkpoint folder besides its weights that a loader reads (the checkpoint reader's LOADER_FILES but
# the index, which the export writes): the model's settings, then the tokenizer's and processor's, copied as they are;
# and its folders of them (transformers 5 reads the named chat templates of additional_chat_templates/*.jinja).
MODEL_FILES = (CONFIG_NAME, "generation_config.json")
TOKENIZER_FILES = tuple(name for name in LOADER_FILES if name not in (*MODEL_FILES, INDEX_NAME, *LOADER_FOLDERS))
COPIED_FILES = MODEL_FILES + TOKENIZER_FILES
COPIED_FOLDERS = LOADER_FOLDERS
# A copied JSON file's `auto_map` names the checkpoint's own code ("module.Class", or a list of them for a tokenizer's
# slow and fast classes) that AutoConfig / AutoModel / AutoTokenizer run with trust_remote_code: `module.py` is copied
# with the modules it imports relatively, found as transformers finds them (dynamic_module_utils.get_relative_imports).
# A reference to another repository ("org/repo--module.Class") names no file of the checkpoint.
_RELATIVE_IMPORTS = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                     re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """"500MB" / "5GB" / "2GiB" / "1000" (bytes) -> bytes; ProfileError naming `what` otherwise."""
    match = _SIZE.match(str(text))
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]) if match else 0
    if size < 1:
        raise ProfileError([f"{what} ({str(text)!r}) must be a positive size such as 500MB or 5GB"])
    return size


@dataclass
class KeyInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Layout:
    """The keys to write: name -> shape and dtype, in the base checkpoint's order; `base(key)` its stored value
    (None for a model that has no base checkpoint: every element must then come from our state)."""

    keys: dict[str, KeyInfo]
    reader: object | None = None

    def base(self, key: str) -> torch.Tensor | None:
        return None if self.reader is None else self.reader.get(key)


def checkpoint_layout(reader) -> Layout:
    keys = {}
    for key in reader.keys():
        view = reader._handles[reader._where[key]].get_slice(key)
        keys[key] = KeyInfo(tuple(view.get_shape()), _DTYPES[view.get_dtype()])
    return Layout(keys, reader)


class DequantizedLayout(Layout):
    """A checkpoint layout whose MXFP4 expert tensors (`<key>_blocks` + `<key>_scales`, uint8) are written as the
    plain tensor `<key>` transformers loads unquantized: [E, in, out] (the blocks hold [E, out, in]), in the dtype of
    the key's bias (the checkpoint's float dtype), bf16 without one. Its base value is the dequantized blocks."""

    def __init__(self, layout: Layout, quantized: dict[str, KeyInfo]):
        keys = {}
        for key, info in layout.keys.items():
            plain = key.removesuffix("_blocks")
            if plain in quantized:
                keys[plain] = quantized[plain]
            elif key.removesuffix("_scales") not in quantized:
                keys[key] = info
        super().__init__(keys, layout.reader)
        self.quantized = quantized

    def base(self, key: str) -> torch.Tensor | None:
        if key not in self.quantized:
            return super().base(key)
        from moe_tune.engine.families.gpt_oss import dequantize_mxfp4

        blocks, scales = self.reader.get(key + "_blocks"), self.reader.get(key + "_scales")
        dtype = self.quantized[key].dtype
        return torch.stack([dequantize_mxfp4(b, s, dtype).transpose(0, 1) for b, s in zip(blocks, scales)])


class Fp8DequantizedLayout(Layout):
    """A checkpoint layout whose FP8 tensors (float8_e4m3fn `<key>` with fp32 `<key>_scale_inv`, the hub's 128 x 128
    blocks) are written as the plain tensor `<key>` in `dtype` (the checkpoint's float dtype), with no scale: a model
    transformers loads unquantized. Its base value is the key dequantized."""

    def __init__(self, layout: Layout, quantized: set[str], dtype: torch.dtype):
        from .fp8 import SCALE_SUFFIX

        scales = {key + SCALE_SUFFIX for key in quantized}
        keys = {key: (KeyInfo(info.shape, dtype) if key in quantized else info)
                for key, info in layout.keys.items() if key not in scales}
        super().__init__(keys, layout.reader)
        self.quantized = quantized

    def base(self, key: str) -> torch.Tensor | None:
        if key not in self.quantized:
            return super().base(key)
        from moe_tune.ops.fp8 import dequantize_weight

        from .fp8 import SCALE_SUFFIX

        scale = self.reader.get(key + SCALE_SUFFIX).float()
        return dequantize_weight(self.reader.get(key), scale, dtype=self.keys[key].dtype)


def fp8_keys(layout: Layout) -> set[str]:
    """The layout's FP8 weights: float8_e4m3fn keys with a `<key>_scale_inv` beside them."""
    from .fp8 import SCALE_SUFFIX

    return {key for key, info in layout.keys.items()
            if info.dtype == torch.float8_e4m3fn and key + SCALE_SUFFIX in layout.keys}


def float_dtype(layout: Layout, skip: set[str] = frozenset()) -> torch.dtype:
    """The dtype most of the layout's floating tensors (but `skip` and FP8 block scales) are stored in; bf16 when
    there are none."""
    from .fp8 import SCALE_SUFFIX

    counts: dict[torch.dtype, int] = {}
    for key, info in layout.keys.items():
        if key in skip or key.endswith(SCALE_SUFFIX) or not info.dtype.is_floating_point or info.dtype.itemsize < 2:
            continue
        counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    return max(counts, key=counts.get) if counts else torch.bfloat16


def mxfp4_keys(layout: Layout) -> dict[str, KeyInfo]:
    """The plain keys of the layout's MXFP4 pairs (`<key>_blocks` [E, out, in / 32, 16] and `<key>_scales`
    [E, out, in / 32], both uint8, and no `<key>`): their unquantized shape [E, in, out] and dtype."""
    found = {}
    for key, info in layout.keys.items():
        plain = key.removesuffix("_blocks")
        scales = layout.keys.get(plain + "_scales")
        if plain == key or plain in layout.keys or scales is None or len(info.shape) != 4:
            continue
        if info.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != info.shape[:3]:
            continue
        bias = layout.keys.get(plain + "_bias")
        dtype = bias.dtype if bias is not None and bias.dtype.is_floating_point else torch.bfloat16
        experts, out, groups, pairs = info.shape
        found[plain] = KeyInfo((experts, groups * pairs * 2, out), dtype)
    return found


class _Tracer:
    """A getter for recipes: tensors of the layout's shapes (meta tensors, or each element's global index)."""

    def __init__(self, layout: Layout, indices: bool, offsets: dict[str, int] | None = None):
        self.layout, self.indices, self.offsets = layout, indices, offsets
        self.read: list[str] = []

    def __call__(self, key: str) -> torch.Tensor:
        info = self.layout.keys.get(key)
        if info is None:
            raise KeyError(key)
        if key not in self.read:
            self.read.append(key)
        if not self.indices:
            return torch.empty(info.shape, dtype=torch.float32, device="meta")
        start = self.offsets[key]
        return torch.arange(start, start + info.numel, dtype=torch.int64).view(info.shape)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the key's first dim, without building the rest (one expert of a fused tensor)."""
        info = self.layout.keys.get(key)
        if info is None:
            raise KeyError(key)
        if key not in self.read:
            self.read.append(key)
        start, stop = min(start, info.shape[0]), min(max(start, stop), info.shape[0])
        shape = (stop - start, *info.shape[1:])
        if not self.indices:
            return torch.empty(shape, dtype=torch.float32, device="meta")
        row = info.numel // max(info.shape[0], 1)
        first = self.offsets[key] + start * row
        return torch.arange(first, first + (stop - start) * row, dtype=torch.int64).view(shape)


@dataclass
class _Plan:
    """Per key, the parts of our tensors written into it; each part's recipe and the keys it reads; our tensors that
    have no key (ours alone). A part is (name, None), or (name, e) for expert e of a grouped expert tensor, so that
    the index tensors of one part stay the size of one expert."""

    writers: dict[str, list[tuple[str, int | None]]] = field(default_factory=dict)
    recipes: dict[tuple[str, int | None], object] = field(default_factory=dict)
    reads: dict[tuple[str, int | None], list[str]] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)


def _parts(module: nn.Module, name: str) -> list[tuple[int | None, nn.Module]]:
    """(part, the module its recipe is asked with): each expert of grouped experts alone, as an expert-parallel
    rank holding one expert would load it; anything else whole."""
    from moe_tune.engine.model.moe import GroupedExperts

    if not isinstance(module, GroupedExperts):
        return [(None, module)]
    parts = []
    for e in range(module.num_experts):
        one = copy.copy(module)
        one.first_expert, one.num_experts = module.first_expert + e, 1
        parts.append((e, one))
    return parts


def plan_export(model: nn.Module, cfg: ModelProfile, family, layout: Layout, names: list[str]) -> _Plan:
    """Which keys each part of our tensors is built from (traced on meta tensors). A name whose recipe is None has
    no place in the checkpoint (ours alone); a tied name whose recipe reads a key the checkpoint lacks is skipped."""
    from moe_tune.engine.families.base import take

    plan = _Plan()
    params = dict(model.named_parameters(remove_duplicate=False))
    problems = []
    for name in names:
        module = model.get_submodule(name.rpartition(".")[0])
        if family.recipe(name, module, cfg) is None:
            plan.unplaced.append(name)
            continue
        shape = tuple(params[name].shape) if name in params else tuple(model.get_buffer(name).shape)
        for part, asked in _parts(module, name):
            recipe = family.recipe(name, asked, cfg)
            expected = shape if part is None else (1, *shape[1:])
            tracer = _Tracer(layout, indices=False)
            try:
                out = recipe(tracer)
            except KeyError as err:
                tied = name in params and any(o != name and p is params[name] for o, p in params.items())
                if not tied:
                    problems.append(f"{name}: the checkpoint has no tensor {err.args[0]} to write it into")
                break
            if tuple(out.shape) != expected:
                problems.append(f"{name}: its recipe builds {tuple(out.shape)} from {tracer.read}, ours is {expected}")
                break
            if isinstance(recipe, take) and layout.keys[recipe.key].shape != expected:
                problems.append(f"{name}: {recipe.key} has shape {layout.keys[recipe.key].shape}, ours {expected}")
                break
            plan.recipes[(name, part)] = recipe
            plan.reads[(name, part)] = tracer.read
            for key in tracer.read:
                plan.writers.setdefault(key, []).append((name, part))
    if problems:
        raise ProfileError(problems)
    return plan


class _Positions:
    """Where each element of a part of our tensor sits in the keys its recipe reads (computed once per part)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.part = None
        self.offsets: dict[str, int] = {}

    def of(self, part, recipe, keys: list[str]) -> None:
        if part != self.part:
            offsets, total = {}, 0
            for key in keys:
                offsets[key] = total
                total += self.layout.keys[key].numel
            self.offsets = offsets
            ids = recipe(_Tracer(self.layout, indices=True, offsets=offsets)).reshape(-1)
            self.sorted, self.order = torch.sort(ids)
            self.part = part

    def within(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `key`'s flat tensor, the elements of the part that go there)."""
        start = self.offsets[key]
        bounds = torch.tensor([start, start + self.layout.keys[key].numel])
        lo, hi = torch.searchsorted(self.sorted, bounds).tolist()
        return self.sorted[lo:hi] - start, self.order[lo:hi]


def write_hub_checkpoint(
    source: StateSource,
    cfg: ModelProfile,
    family,
    layout: Layout,
    out: Path,
    max_shard_bytes: int,
    config: dict | None = None,
    copy_from: Path | None = None,
    chat_template: str | None = None,
    readme: str | None = None,
    copy_names: tuple[str, ...] = COPIED_FILES,
) -> Path:
    """Write `source` into the folder `out` (through a temporary sibling, removed on any failure: staged_folder):
    the keys of `layout` in shards of at most `max_shard_bytes` (a tensor larger than that gets a shard of its own),
    the index, config.json (`config`, or copied), the loader files of `copy_from` (`copy_names`), `chat_template`
    (write_chat_template) and `readme` as README.md (the model card)."""
    from moe_tune.engine.atomic_write import save_tensors
    from moe_tune.engine.families.base import take

    from .sources import meta_model

    model = meta_model(cfg)
    plan = plan_export(model, cfg, family, layout, source.names())
    # Tensors of ours alone (a routing bias the checkpoint type has no key for) must be at their neutral zero, or
    # the exported model would compute something else.
    trained = [name for name in plan.unplaced if source.read(name).any()]
    if trained:
        raise ProfileError([f"{name}: trained (non-zero), but {family.model_types[0]} checkpoints have no tensor for "
                            "it (a routing bias updated by model.moe.bias_update_rate); the exported model would route "
                            "differently" for name in trained])
    if layout.reader is None:
        missing = [k for k in layout.keys if k not in plan.writers]
        if missing:
            raise ProfileError([f"key {k}: no tensor of ours is written into it" for k in missing[:5]])
    shards: list[list[str]] = [[]]
    size = 0
    for key, info in layout.keys.items():
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += info.nbytes
    out = Path(out)
    with staged_folder(out) as tmp:
        positions = _Positions(layout)
        cached: tuple[str | None, torch.Tensor | None] = (None, None)
        experts: dict[tuple[str, int], torch.Tensor] = {}  # the few experts last read alone (their keys are adjacent)
        weight_map, total = {}, 0
        count = len(shards)
        for i, keys in enumerate(shards):
            file_name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            tensors = {}
            for key in keys:
                info = layout.keys[key]
                value = layout.base(key)
                writers = plan.writers.get(key, [])
                if value is None:
                    value = torch.zeros(info.shape, dtype=info.dtype)
                flat = None
                for name, part in writers:
                    if part is not None and hasattr(source, "read_expert"):
                        if (name, part) not in experts:
                            if len(experts) >= 4:
                                experts.pop(next(iter(experts)))
                            experts[(name, part)] = source.read_expert(name, part).detach().to("cpu")
                        ours = experts[(name, part)]
                    else:
                        if cached[0] != name:
                            cached = (name, source.read(name).detach().to("cpu"))
                        ours = cached[1] if part is None else cached[1][part : part + 1]
                    recipe = plan.recipes[(name, part)]
                    if isinstance(recipe, take):
                        value = ours.to(info.dtype).reshape(info.shape).clone()
                        flat = None
                        continue
                    if flat is None:
                        value = value.contiguous().clone()
                        flat = value.view(-1)
                    positions.of((name, part), recipe, plan.reads[(name, part)])
                    where, which = positions.within(key)
                    flat[where] = ours.reshape(-1)[which].to(info.dtype)
                tensors[key] = value.contiguous()
                weight_map[key] = file_name
                total += info.nbytes
            save_tensors(tensors, tmp / file_name, metadata={"format": "pt"})
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if copy_from is not None:
            copy_loader_files(Path(copy_from), tmp, copy_names)
        if chat_template is not None:
            write_chat_template(tmp, chat_template)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if readme is not None:
            (tmp / "README.md").write_text(readme, encoding="utf-8")
    return out


def copy_loader_files(base: Path, dest: Path, names: tuple[str, ...] = COPIED_FILES) -> list[str]:
    """Copy `names` that exist in `base` into `dest`, the files of its COPIED_FOLDERS, and the code modules the
    copied JSON files' `auto_map` names (with their relative imports): regular files inside `base` only (a hub cache
    snapshot's links into its blobs folder count as inside). Returns the names copied (folder/file for a folder's)."""
    from moe_tune.engine.families.checkpoint import CHECKPOINT_FILES, confined_file, outside_line, weight_roots

    roots = weight_roots(base)
    copied = []

    def copy(name: str) -> bool:
        if not (base / name).exists() and not (base / name).is_symlink():
            return False
        path, _ = confined_file(base, name, roots)
        if path is None or not stat.S_ISREG(path.stat().st_mode):
            return False
        (dest / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(path, dest / name)
        copied.append(name)
        return True

    for name in names:
        copy(name)
    for folder in COPIED_FOLDERS:
        if (base / folder).is_dir() and outside_line(base, folder, roots, CHECKPOINT_FILES) is None:
            for entry in sorted((base / folder).iterdir()):
                copy(f"{folder}/{entry.name}")
    modules = [module for name in copied if name.endswith(".json") for module in _auto_map_modules(dest / name)]
    while modules:
        module = modules.pop(0)
        name = f"{module}.py"
        if name not in copied and copy(name):
            text = (dest / name).read_text(encoding="utf-8", errors="replace")
            modules += [m for pattern in _RELATIVE_IMPORTS for m in pattern.findall(text) if _MODULE_NAME.match(m)]
    return copied


def _auto_map_modules(path: Path) -> list[str]:
    """The module names of the code that the JSON file `path`'s `auto_map` names in this folder ("module.Class"
    entries; lists of them, None for a class the folder has not), in order; none when the file is no JSON object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict):
        return []
    references = []
    for value in auto_map.values():
        references += value if isinstance(value, (list, tuple)) else [value]
    modules = []
    for reference in references:
        if isinstance(reference, str) and "--" not in reference and reference.count(".") == 1:
            module = reference.partition(".")[0]
            if _MODULE_NAME.match(module) and module not in modules:
                modules.append(module)
    return modules


def write_chat_template(folder: Path, template: str) -> None:
    """`template` (the text of the run's data.chat_template) as the template transformers 5 renders from `folder`:
    chat_template.jinja, which AutoTokenizer prefers to tokenizer_config.json's entry; that entry, the processor's
    (processor_config.json) and the legacy chat_template.json, which AutoProcessor prefers to the .jinja file, are
    removed."""
    folder = Path(folder)
    (folder / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    (folder / LEGACY_TEMPLATE_FILE).unlink(missing_ok=True)
    for name in TEMPLATE_CONFIGS:
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(config, dict) and "chat_template" in config:
            del config["chat_template"]
            path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def run_chat_template(profile) -> str | None:
    """The text of the run's data.chat_template (its .jinja file read), None without one."""
    from moe_tune.engine.data.chat import chat_options

    return chat_options(profile.data).template


def export_hub(source: StateSource, cfg: ModelProfile, out: Path, max_shard_bytes: int, precision: str = "fp32",
               chat_template: str | None = None, notes: list[str] | None = None, tokenizer: str | None = None) -> Path:
    """The checkpoint folder of `source` (a model read from a checkpoint, or built from a profile that a
    transformers model type expresses, its tensors in `precision`) in `out`, with `chat_template` (the run's
    data.chat_template) in place of the checkpoint's. A profile-built model's folder carries the run's tokenizer
    (`tokenizer`, its data.tokenizer: a folder's files copied; the built-in byte tokenizer has none) and its bos and
    eos ids in config.json, so that transformers' generate stops where moe-tune's does. An FP8-base run's source reads as its bf16-base model
    (engine/export/fp8.py): it is written unquantized, and `notes` gets the line saying so (also the folder's
    README.md)."""
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.families import UnsupportedModel, family_for
    from moe_tune.engine.families.checkpoint import CheckpointReader, read_config

    from .fp8 import bf16_base, fp8_model_card, is_fp8_base, merged_precision_note

    fp8_run, cfg = is_fp8_base(cfg), bf16_base(cfg)

    def card(dtype: torch.dtype) -> str | None:
        if not fp8_run:
            return None
        note = merged_precision_note(str(dtype).removeprefix("torch."))
        if notes is not None:
            notes.append(note)
        return fp8_model_card(cfg, note)

    if cfg.checkpoint is not None:
        family = family_for(read_config(cfg.checkpoint), cfg.checkpoint)
        with CheckpointReader(cfg.checkpoint) as reader:
            layout, config = checkpoint_layout(reader), None
            quantized = mxfp4_keys(layout)
            fp8 = fp8_keys(layout)
            dtype = float_dtype(layout, fp8)
            if quantized:
                # MXFP4 experts were dequantized at load and trained so: written unquantized, and the config no
                # longer says they are quantized.
                layout = DequantizedLayout(layout, quantized)
                config = {k: v for k, v in read_config(cfg.checkpoint).items() if k != "quantization_config"}
            elif fp8:
                # FP8 weights: written dequantized (with the adapters merged) in the checkpoint's float dtype.
                layout = Fp8DequantizedLayout(layout, fp8, dtype)
                config = {k: v for k, v in read_config(cfg.checkpoint).items() if k != "quantization_config"}
            return write_hub_checkpoint(source, cfg, family, layout, out, max_shard_bytes, config=config,
                                        copy_from=cfg.checkpoint, chat_template=chat_template, readme=card(dtype))
    try:
        from moe_tune.engine.families.hub_config import hub_config_for_profile
    except ImportError:
        raise ProfileError(["model: built from a profile, and this moe-tune has no transformers config for "
                            "profile-built models; export needs a run from a checkpoint"]) from None
    try:
        family, config, keys = hub_config_for_profile(cfg, precision)
    except UnsupportedModel as err:
        lines = [f"model: not exportable as a transformers model: {line}" for line in err.problems]
        raise ProfileError(lines) from None
    layout = Layout({k: KeyInfo(tuple(shape), dtype) for k, (shape, dtype) in keys.items()})
    spec = tokenizer or "byte"
    tok = load_tokenizer(spec)
    config.update({key: value for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id))
                   if value is not None})
    return write_hub_checkpoint(source, cfg, family, layout, out, max_shard_bytes, config=config,
                                copy_from=None if spec == "byte" else Path(spec), copy_names=TOKENIZER_FILES,
                                chat_template=chat_template, readme=card(float_dtype(layout)))


def export_run(run_dir: Path, merge: bool, out: Path | None, max_shard_size: str = DEFAULT_SHARD_SIZE,
               step: int | None = None, precision: str = "auto", notes: list[str] | None = None) -> Path:
    """`moe-tune export`: the run in `run_dir` (its final state, or checkpoints/step-`step`) written into `out`
    (default run_dir/export, or export-merged): a checkpoint folder in the hub's layout (full fine-tuning, or
    LoRA with `merge`), or the PEFT adapter on the checkpoint's module names (LoRA without `merge`). `precision`
    auto: the base checkpoint's dtypes, FP8 weights dequantized (fp8 is refused: engine/export/fp8.py). Lines worth
    printing go to `notes`. ProfileError, one line per problem, before anything is written; ExportWriteError naming
    `out` and the OS error when the OS refuses a read or a write of the export (a full disk, no permission)."""
    from moe_tune.engine.train.run_dir import reading_run

    from .fp8 import precision_problems
    from .sources import read_run

    run_dir = Path(run_dir)
    problems = precision_problems(precision)
    max_shard_bytes = 0
    try:
        max_shard_bytes = parse_size(max_shard_size)
    except ProfileError as err:
        problems += err.problems
    if step is not None and step < 1:
        problems.append(f"--step ({step}) must be >= 1")
    # The run folder is marked as read until the export ends: a finetune into it (--overwrite, --resume) is refused
    # meanwhile, and the export is refused while one holds it (run_dir.reading_run).
    with ExitStack() as stack:
        try:
            stack.enter_context(reading_run(run_dir, "export"))
            run = read_run(run_dir, need_final=step is None)
        except ProfileError as err:
            raise ProfileError(problems + err.problems) from None
        return _write_export(run, merge, out, max_shard_bytes, step, notes, problems)


def _write_export(run, merge: bool, out: Path | None, max_shard_bytes: int, step: int | None,
                  notes: list[str] | None, problems: list[str]) -> Path:
    """export_run's work once the run is read (and marked as read): `out` checked (ProfileError with `problems` and
    its own lines), then written."""
    from moe_tune.engine.train.run_dir import enclosing_run_problem, owned_place

    from .sources import ROUTING_BIASES_IN_NO_ADAPTER, FinalState

    run_dir = run.run_dir
    lora = run.profile.lora.enabled
    if out is None:
        out = run_dir / ("export-merged" if merge and lora else "export")
    out = Path(out)
    # Reading OUT's folder, writing and renaming: the OS refusing any of them names OUT (a full disk, no
    # permission), with OUT left as it was.
    with write_errors_named(out):
        if out.name in ("", ".."):
            # `.`, `..`, `/`: the folder they lead to, whose name the temporary sibling is named after.
            out = out.resolve()
        resolved = out.resolve()
        owned = owned_place(resolved, run_dir.resolve())
        if resolved.is_relative_to((run_dir / "checkpoints").resolve()):
            problems.append(f"--out ({str(out)!r}) lies inside the run's checkpoints folder; choose another folder")
        elif owned is not None and not (owned == resolved and owned.name in EXPORT_NAMES):
            where = "is" if owned == resolved else "lies inside"
            problems.append(f"--out ({str(out)!r}) {where} {owned.name!r}, a name the run keeps in its folder (a later "
                            "finetune --resume or --overwrite reads or replaces it); write into a new folder such as "
                            f"{str(run_dir / 'export')!r} or one outside the run")
        elif (other := enclosing_run_problem(out, f"--out ({str(out)!r})", "the export", run_dir)) is not None:
            problems.append(other)
        if out.is_symlink():
            problems.append(f"--out ({str(out)!r}) is a symbolic link (to {os.readlink(out)!r}); export writes a new "
                            "or empty folder under its own name, not through a link: name the folder itself")
        elif out.exists() and not out.is_dir():
            problems.append(f"--out ({str(out)!r}) exists and is not a folder")
        elif out.is_dir() and any(out.iterdir()):
            problems.append(f"--out ({str(out)!r}) exists and is not empty; export writes into a new or empty folder")
        elif out.is_dir() and resolved == Path.cwd().resolve():
            problems.append(f"--out ({str(out)!r}) is the current folder: export renames a new folder into its place, "
                            "which a shell in it would not see; name a new folder")
        elif not out.exists():
            problems += _creatable_problems(out)
        if live := other_writers(out)[0]:
            problems.append(writing_problem(out, live[0]))
        if lora and not merge and run.cfg.moe is not None and run.cfg.moe.bias_update_rate > 0:
            problems.append(ROUTING_BIASES_IN_NO_ADAPTER)
        if lora and not merge and run.cfg.checkpoint is None:
            problems.append("the run's model is built from a profile: its adapter has no checkpoint module names to go "
                            "on; export it with --merge")
        try:
            chat_template = run_chat_template(run.profile)
        except ProfileError as err:
            problems += err.problems
        if step is not None and step >= 1:
            from .zero import step_folder_problems

            problems += step_folder_problems(run, step)
        if problems:
            raise ProfileError(problems)
        if step is not None:
            from .zero import open_step

            source = open_step(run, step, merge or not lora)
        else:
            source = FinalState(run, merged=merge or not lora)
        with source:
            if lora and not merge:
                return write_adapter(run, source.adapter_state(), out, chat_template)
            return export_hub(source, run.cfg, out, max_shard_bytes, run.profile.train.precision, chat_template, notes,
                              run.profile.data.tokenizer)


def _creatable_problems(out: Path) -> list[str]:
    """A line when the folder `out` (not there yet) cannot be created (folder_refused)."""
    refused = folder_refused(out)
    return [f"--out ({str(out)!r}): {refused}"] if refused is not None else []


def write_adapter(run, adapter: dict[str, torch.Tensor], out: Path, chat_template: str | None = None) -> Path:
    """The PEFT adapter on the checkpoint's module names (engine/families/export.py), the base's loader files and
    `chat_template` (the run's data.chat_template)."""
    from moe_tune.engine.families import family_for
    from moe_tune.engine.families.checkpoint import read_config
    from moe_tune.engine.families.export import write_reference_adapter

    from .sources import meta_model

    cfg = run.cfg
    family = family_for(read_config(cfg.checkpoint), cfg.checkpoint)

    def add_loader_files(folder: Path) -> None:
        # The tokenizer and processor files, not the model's config: the folder is an adapter, not a model.
        copy_loader_files(Path(cfg.checkpoint), folder, TOKENIZER_FILES)
        if chat_template is not None:
            write_chat_template(folder, chat_template)

    # `out` was checked empty: files found there when the adapter is renamed into place are someone else's, kept.
    return write_reference_adapter(meta_model(cfg), adapter, cfg, family, run.profile.lora, out, add_loader_files,
                                   replace=False)
