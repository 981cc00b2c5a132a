"""The streaming load benchmark behind `moe-tune profile PROFILE --load-checkpoint DIR`: a synthetic checkpoint of
the profile's model in the hub's FP8 layout, loaded into the built FP8 model by the project's loader, timed.

The writer: config.json (the transformers config that expresses the model, engine/families/hub_config, with
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`) and safetensors shards of at most
`shard_bytes` with model.safetensors.index.json. The weights moe-tune keeps in FP8 (engine/plan's
fp8_parameters; every piece of a hub tensor must be one) are random float8_e4m3fn bytes (no NaN encodings) with
valid fp32 block scales `<key>_scale_inv` [ceil(O/128), ceil(I/128)]; the rest random bf16. Each shard is written
header first, then one tensor at a time, so the writer holds one tensor in memory, never a shard.

The load: the model profile read back from DIR (base_precision fp8, as an FP8 checkpoint gives), built on the GPU
(CPU without one), then engine.families.load_checkpoint_weights timed alone: GB/s of the checkpoint's bytes, and the
process's peak resident host memory during the load (VmHWM, reset before it where the kernel allows, and RssAnon /
RssFile sampled: the file part is pages of the shards the reader maps) against the largest shard. The shards' pages
are dropped from the page cache before the load (posix_fadvise), so the disk is read, not what the writer left.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any

import torch

from moe_tune.engine.bench.machine import MACHINE_KEYS, machine_info
from moe_tune.engine.bench.timing import StepClock
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile, ModelProfile

# save_pretrained's default max_shard_size, the size of the hub's shards.
SHARD_BYTES = 5 * 10**9
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# The index metadata entry that marks a folder this benchmark wrote, with the fingerprint of the model it holds.
SYNTHETIC_MARK = "moe_tune_synthetic_model"
SCALE_SUFFIX = "_scale_inv"
FP8_QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                    "fmt": "e4m3"}  # fmt: skip
# safetensors' dtype names of what the writer stores.
SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32"}
# float8_e4m3fn encodes NaN as S.1111.111 (0x7F, 0xFF): bytes are drawn from 254 values and those from 0x7F up
# shifted by one, skipping both.
FP8_NAN_BITS = 0x7F
FP8_NUMBER_CODES = 254
# Random scales in [SCALE_LOW, 2 * SCALE_LOW): |W| <= 448 * 2e-4 ~ 0.09, the size of an initialised projection.
SCALE_LOW = 1e-4
BF16_STD = 0.02
# safetensors aligns the data section to 8 bytes (the header is padded with spaces).
HEADER_ALIGN = 8
# How often the sampler reads the process's resident memory during the load.
RSS_SAMPLE_S = 0.02
# Rows of random bytes drawn at a time for one large tensor: bounds the writer's memory per draw.
DRAW_BYTES = 256 * 2**20
RESULT_KEYS = (
    "profile", "checkpoint", "checkpoint_bytes", "num_tensors", "num_fp8_tensors", "num_shards", "max_shard_bytes",
    "write_s", "write_gb_per_s", "load_s", "load_gb_per_s", "rss_before_bytes", "peak_rss_bytes",
    "peak_rss_growth_bytes", "peak_rss_growth_over_max_shard", "rss_anon_before_bytes", "peak_rss_anon_bytes",
    "peak_rss_file_bytes",
    "peak_rss_reset", "page_cache_dropped", *MACHINE_KEYS,
)  # fmt: skip


def _bf16_model(cfg: ModelProfile) -> ModelProfile:
    # The hub layout and the parameter shapes are those of the model in floating point.
    return cfg.model_copy(update={"base_precision": "bf16", "checkpoint": None})


def model_fingerprint(cfg: ModelProfile) -> str:
    """A short hash of the architecture (init seed and base precision excluded): which model a folder holds."""
    arch = _bf16_model(cfg).model_dump(mode="json", exclude={"seed", "init_std"})
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


class _ShapeGetter:
    """A getter for the family's recipes: meta tensors of the layout's shapes, recording the keys read."""

    def __init__(self, keys: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.keys = keys
        self.read: list[str] = []

    def _shape(self, key: str) -> tuple[int, ...]:
        if key not in self.keys:
            raise KeyError(key)
        self.read.append(key)
        return self.keys[key][0]

    def __call__(self, key: str) -> torch.Tensor:
        return torch.empty(self._shape(key), device="meta")

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        shape = self._shape(key)
        start, stop = min(start, shape[0]), min(max(start, stop), shape[0])
        return torch.empty((stop - start, *shape[1:]), device="meta")


def hub_fp8_layout(cfg: ModelProfile) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """(config.json, key -> (shape, dtype)) of the hub's FP8 checkpoint of `cfg`'s model: the keys transformers
    saves, those that only moe-tune's FP8 weights read stored float8_e4m3fn with `<key>_scale_inv` fp32 beside
    them, the rest bf16. ProfileError when no transformers type expresses the model."""
    from moe_tune.engine.families import UnsupportedModel
    from moe_tune.engine.families.hub_config import hub_config_for_profile
    from moe_tune.engine.model.model import MoECausalLM
    from moe_tune.engine.plan import fp8_parameters, model_parameters
    from moe_tune.ops.fp8 import num_blocks
    from moe_tune.profiles.schema import LoraProfile

    plain = _bf16_model(cfg)
    try:
        family, config, keys = hub_config_for_profile(plain, "bf16")
    except UnsupportedModel as err:
        raise ProfileError([f"model: no transformers type expresses it, so no hub checkpoint: {line}"
                            for line in err.problems]) from None  # fmt: skip
    # The weights moe-tune stores in FP8 (no modules_to_save: a checkpoint does not know what a run trains).
    params = model_parameters(cfg.model_copy(update={"base_precision": "fp8"}))
    fp8_names = {p.name for p in fp8_parameters(params, cfg.model_copy(update={"base_precision": "fp8"}),
                                                LoraProfile(modules_to_save=[]))}  # fmt: skip
    with torch.device("meta"):
        model = MoECausalLM(plain)
    readers: dict[str, list[bool]] = {}
    for name, _ in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        recipe = family.recipe(name, module, plain)
        if recipe is None:
            continue
        getter = _ShapeGetter(keys)
        recipe(getter)
        for key in getter.read:
            readers.setdefault(key, []).append(name in fp8_names)
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, (shape, _) in keys.items():
        if len(shape) >= 2 and readers.get(key) and all(readers[key]):
            layout[key] = (shape, torch.float8_e4m3fn)
            layout[key + SCALE_SUFFIX] = ((*shape[:-2], num_blocks(shape[-2]), num_blocks(shape[-1])), torch.float32)
        else:
            layout[key] = (shape, torch.bfloat16)
    config = dict(config, quantization_config=dict(FP8_QUANTIZATION))
    return config, layout


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def shard_plan(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards of at most `shard_bytes` in order (a larger tensor gets a shard of its own), an FP8
    weight always in the shard of its scales."""
    shards: list[list[str]] = [[]]
    size = 0
    keys = [k for k in layout if not k.endswith(SCALE_SUFFIX) or k.removesuffix(SCALE_SUFFIX) not in layout]
    for key in keys:
        group = [key] + ([key + SCALE_SUFFIX] if key + SCALE_SUFFIX in layout else [])
        group_bytes = sum(_nbytes(*layout[k]) for k in group)
        if shards[-1] and size + group_bytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    return shards


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values of `dtype` on the generator's device: FP8 bytes that are numbers, positive scales, bf16."""
    device = generator.device
    if dtype == torch.float8_e4m3fn:
        bits = torch.randint(0, FP8_NUMBER_CODES, shape, dtype=torch.uint8, generator=generator, device=device)
        bits += bits >= FP8_NAN_BITS
        return bits.view(torch.float8_e4m3fn)
    if dtype == torch.float32:
        return SCALE_LOW * (1 + torch.rand(shape, generator=generator, device=device))
    return (torch.randn(shape, generator=generator, device=device) * BF16_STD).to(dtype)


def _write_tensor(f, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> None:
    """Draw and write one tensor's bytes, a block of rows at a time (a vocabulary-sized tensor is the largest)."""
    row_bytes = max(_nbytes(shape[1:], dtype), 1)
    rows_per_draw = max(1, DRAW_BYTES // row_bytes)
    for start in range(0, max(shape[0], 1) if shape else 1, rows_per_draw):
        part_shape = (min(rows_per_draw, shape[0] - start), *shape[1:]) if shape else ()
        part = _random_tensor(part_shape, dtype, generator).cpu().contiguous()
        f.write(part.reshape(-1).view(torch.uint8).numpy().data)


def _write_shard(path: Path, keys: list[str], layout, generator: torch.Generator) -> int:
    """One safetensors file: the header (every key's dtype, shape and offsets), then each tensor's bytes in turn."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        shape, dtype = layout[key]
        size = _nbytes(shape, dtype)
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key in keys:
            _write_tensor(f, *layout[key], generator)
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_synthetic_checkpoint(cfg: ModelProfile, out: Path, shard_bytes: int = SHARD_BYTES, seed: int = 0,
                               device: torch.device | None = None, hub_layout=None) -> dict[str, Any]:  # fmt: skip
    """Write the hub FP8 checkpoint of `cfg`'s model (random values drawn on `device`, the GPU when there is one:
    tens of GB of random bytes are its work) into the folder `out` (created; must be empty or new; when writing
    fails, the files written and the folders created are removed again). `hub_layout`:
    hub_fp8_layout(cfg) when the caller has it. Returns the checkpoint's bytes, tensor counts, shards and the
    seconds it took."""
    out = Path(out)
    config, layout = hub_fp8_layout(cfg) if hub_layout is None else hub_layout
    shards = shard_plan(layout, shard_bytes)
    # The folders this call creates, outermost first: removed again, with the files written, when writing fails.
    created = [folder for folder in (*reversed(out.parents), out) if not folder.exists()]
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(seed)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        with StepClock(device.type == "cuda") as clock:
            tensor_bytes = 0
            weight_map = {}
            for name, keys in zip(names, shards):
                written.append(out / name)
                tensor_bytes += _write_shard(out / name, keys, layout, generator)
                weight_map.update(dict.fromkeys(keys, name))
            written.append(out / CONFIG_NAME)
            (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            # total_size counts the tensors' bytes, as save_pretrained's index does; the files add their headers.
            metadata = {"total_size": tensor_bytes, SYNTHETIC_MARK: model_fingerprint(cfg)}
            index = {"metadata": metadata, "weight_map": weight_map}
            written.append(out / INDEX_NAME)
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        # A half-written folder would be refused by the next run (files but no index): leave none.
        for path in written:
            path.unlink(missing_ok=True)
        for folder in reversed(created):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    seconds = clock.seconds
    sizes = [(out / name).stat().st_size for name in names]
    return dict(checkpoint_bytes=sum(sizes), num_tensors=len(layout),
                num_fp8_tensors=sum(dtype == torch.float8_e4m3fn for _, dtype in layout.values()),
                num_shards=len(shards), max_shard_bytes=max(sizes), write_s=seconds)  # fmt: skip


def synthetic_checkpoint_problems(cfg: ModelProfile, folder: Path) -> tuple[bool, list[str]]:
    """(whether `folder` already holds this benchmark's checkpoint of `cfg`'s model, problems): a folder to write
    into must be new or empty; one holding a checkpoint of another model, or anything else, is refused."""
    folder = Path(folder)
    where = f"--load-checkpoint ({str(folder)!r})"
    if not folder.exists():
        return False, []
    if not folder.is_dir():
        return False, [f"{where} exists and is not a folder"]
    index = folder / INDEX_NAME
    if not index.is_file():
        if any(folder.iterdir()):
            return False, [f"{where} holds files but no {INDEX_NAME} written by this benchmark: name a new or empty "
                           "folder (the synthetic checkpoint is written there), or one it wrote"]  # fmt: skip
        return False, []
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except OSError as err:
        return False, [f"{where}: cannot read {INDEX_NAME} ({err.strerror})"]
    except ValueError as err:
        return False, [f"{where}: {INDEX_NAME} is not JSON ({err}): name a new or empty folder"]
    metadata = data.get("metadata") if isinstance(data, dict) else None
    mark = metadata.get(SYNTHETIC_MARK) if isinstance(metadata, dict) else None
    if mark is None:
        return False, [f"{where} holds a checkpoint this benchmark did not write: name a new or empty folder"]
    if mark != model_fingerprint(cfg):
        return False, [f"{where} holds the synthetic checkpoint of another model ({mark}, this profile's is "
                       f"{model_fingerprint(cfg)}): name a new or empty folder"]  # fmt: skip
    return True, stored_checkpoint_problems(cfg, folder)


def stored_checkpoint_problems(cfg: ModelProfile, folder: Path) -> list[str]:
    """Problems of a folder whose index says it holds this benchmark's checkpoint of `cfg`'s model, before any
    weight is read: config.json must describe that model, and the shards (inside the folder, readable, holding what
    the index says) every tensor of hub_fp8_layout(cfg) with its shape and dtype. One line for the tensors, naming
    the first that differs."""
    from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
    from moe_tune.engine.families.checkpoint import CheckpointReader

    where = f"--load-checkpoint ({str(folder)!r})"
    redo = "name a new or empty folder (or empty this one to write it again)"
    try:
        _, _, stored = model_profile_from_checkpoint(folder)
    except UnsupportedModel as err:
        return [f"{where}: {line}" for line in err.problems]
    if model_fingerprint(stored) != model_fingerprint(cfg):
        return [f"{where}: {CONFIG_NAME} describes another model ({model_fingerprint(stored)}) than its index and "
                f"this profile ({model_fingerprint(cfg)}): {redo}"]  # fmt: skip
    _, layout = hub_fp8_layout(cfg)
    try:
        with CheckpointReader(folder) as reader:
            held = set(reader.keys())
            wrong = [f"{key} is missing" for key in layout if key not in held]
            wrong += [f"{key} is not in this model's checkpoint" for key in sorted(held - set(layout))]
            for key, (shape, dtype) in layout.items():
                if key not in held:
                    continue
                stored_shape, stored_dtype = tuple(reader.shape(key)), reader.dtype(key)
                if (stored_shape, stored_dtype) != (shape, SAFETENSORS_DTYPES[dtype]):
                    wrong.append(f"{key} is {stored_dtype} {list(stored_shape)} in {reader.file_of(key).name}, "
                                 f"this model's is {SAFETENSORS_DTYPES[dtype]} {list(shape)}")  # fmt: skip
    except UnsupportedModel as err:
        return [f"{where}: {line}" for line in err.problems]
    if wrong:
        count = f"{len(wrong)} tensors differ" if len(wrong) > 1 else "1 tensor differs"
        return [f"{where}: {count} from this model's checkpoint (first: {wrong[0]}): {redo}"]
    return []


def _status_bytes(fields: tuple[str, ...]) -> dict[str, int | None]:
    """The named fields of /proc/self/status in bytes (None where the system has no such file or field)."""
    found: dict[str, int | None] = dict.fromkeys(fields)
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in found:
                    found[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux); elsewhere the peak covers the whole process.
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _RssSampler(threading.Thread):
    """Samples RssAnon and RssFile every RSS_SAMPLE_S until stopped; keeps their maxima."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict[str, int | None] = {"RssAnon": None, "RssFile": None}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            for name, value in _status_bytes(("RssAnon", "RssFile")).items():
                if value is not None:
                    self.peaks[name] = max(value, self.peaks[name] or 0)
            if self._stop_event.wait(RSS_SAMPLE_S):
                return

    def stop(self) -> dict[str, int | None]:
        self._stop_event.set()
        self.join()
        return self.peaks


def _drop_page_cache(folder: Path) -> bool:
    """Ask the kernel to drop the cached pages of the shards the index names (clean after the writer's fsync); False
    where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    index = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    for name in sorted(set(index["weight_map"].values())):
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def load_synthetic_checkpoint(folder: Path, device: torch.device) -> dict[str, Any]:
    """Build the FP8 model of the checkpoint in `folder` on `device` and time load_checkpoint_weights alone, with
    the host memory it takes."""
    from moe_tune.engine.families import load_checkpoint_weights, model_profile_from_checkpoint
    from moe_tune.engine.model.model import build_model

    folder = Path(folder)
    _, _, cfg = model_profile_from_checkpoint(folder)
    with torch.device(device):
        model = build_model(cfg)
    dropped = _drop_page_cache(folder)
    before = _status_bytes(("VmRSS", "RssAnon"))
    is_reset = _reset_peak_rss()
    sampler = _RssSampler()
    sampler.start()
    try:
        with StepClock(device.type == "cuda") as clock:
            load_checkpoint_weights(model, cfg)
    finally:
        peaks = sampler.stop()
    seconds = clock.seconds
    peak = _status_bytes(("VmHWM",))["VmHWM"]
    del model
    return dict(load_s=seconds, rss_before_bytes=before["VmRSS"], rss_anon_before_bytes=before["RssAnon"],
                peak_rss_bytes=peak,
                peak_rss_anon_bytes=peaks["RssAnon"], peak_rss_file_bytes=peaks["RssFile"], peak_rss_reset=is_reset,
                page_cache_dropped=dropped)  # fmt: skip


def _folder_sizes(folder: Path) -> dict[str, Any]:
    index = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    shards = sorted(set(index["weight_map"].values()))
    sizes = [(folder / name).stat().st_size for name in shards]
    num_fp8 = sum(key.endswith(SCALE_SUFFIX) for key in index["weight_map"])
    return dict(checkpoint_bytes=sum(sizes), num_tensors=len(index["weight_map"]), num_fp8_tensors=num_fp8,
                num_shards=len(shards), max_shard_bytes=max(sizes))  # fmt: skip


def run_load_benchmark(job: JobProfile, folder: Path, shard_bytes: int = SHARD_BYTES,
                       device: torch.device | None = None, on_line=lambda line: None) -> dict[str, Any]:  # fmt: skip
    """Write the synthetic FP8 checkpoint of `job`'s model into `folder` (unless it already holds it), then load it
    (RESULT_KEYS). ProfileError, before anything is written, for a folder that holds something else (or this
    benchmark's checkpoint with a config.json or tensors another model's: stored_checkpoint_problems) or a model no
    transformers type expresses; ProfileError when the folder cannot be written."""
    folder = Path(folder)
    has_checkpoint, problems = synthetic_checkpoint_problems(job.model, folder)
    if problems:
        raise ProfileError(problems)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    write_s = None
    if has_checkpoint:
        on_line(f"{folder} holds the synthetic FP8 checkpoint of this model: loading it")
    else:
        # A model no transformers type expresses is refused here, before anything is written.
        hub_layout = hub_fp8_layout(job.model)
        on_line(f"writing the synthetic FP8 checkpoint of {job.name} into {folder}")
        try:
            write_s = write_synthetic_checkpoint(job.model, folder, shard_bytes, device=device,
                                                 hub_layout=hub_layout)["write_s"]  # fmt: skip
        except OSError as err:
            raise ProfileError([f"--load-checkpoint ({str(folder)!r}): cannot write the synthetic checkpoint "
                                f"({err.strerror or err}); nothing of it was kept"]) from None  # fmt: skip
    sizes = _folder_sizes(folder)
    on_line(f"loading {sizes['checkpoint_bytes'] / 1e9:.2f} GB in {sizes['num_shards']} shards on {device.type}")
    loaded = load_synthetic_checkpoint(folder, device)
    growth = None
    if loaded["peak_rss_bytes"] is not None and loaded["rss_before_bytes"] is not None:
        growth = max(loaded["peak_rss_bytes"] - loaded["rss_before_bytes"], 0)
    result = dict(
        profile=job.name,
        checkpoint=str(folder),
        **sizes,
        write_s=write_s,
        write_gb_per_s=None if write_s is None else sizes["checkpoint_bytes"] / write_s / 1e9,
        load_s=loaded["load_s"],
        load_gb_per_s=sizes["checkpoint_bytes"] / loaded["load_s"] / 1e9,
        rss_before_bytes=loaded["rss_before_bytes"],
        peak_rss_bytes=loaded["peak_rss_bytes"],
        peak_rss_growth_bytes=growth,
        peak_rss_growth_over_max_shard=None if growth is None else growth / sizes["max_shard_bytes"],
        rss_anon_before_bytes=loaded["rss_anon_before_bytes"],
        peak_rss_anon_bytes=loaded["peak_rss_anon_bytes"],
        peak_rss_file_bytes=loaded["peak_rss_file_bytes"],
        peak_rss_reset=loaded["peak_rss_reset"],
        page_cache_dropped=loaded["page_cache_dropped"],
        **machine_info(device.type == "cuda"),
    )
    return {key: result[key] for key in RESULT_KEYS}
