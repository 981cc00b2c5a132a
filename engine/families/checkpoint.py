"""Reading a Hugging Face checkpoint directory: config.json and safetensors shards, one tensor at a time.

Only safetensors are read (never pickles). Tensors are opened lazily, so a rank reads only what it loads: its
local experts, and each dense tensor as it is copied in. FP8 checkpoints (float8_e4m3fn `<name>` with fp32
`<name>_scale_inv` blocks) are checked from the headers (fp8_tensor_problems) and read through WeightGetter: as
stored for our FP8 tensors, dequantized for our floating ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import safe_open

from moe_tune.profiles import more_alike
from moe_tune.profiles.schema import file_kind

from .base import FP8_RULE, UnsupportedModel, key_pattern, show

# Larger than any real file of its kind by far (configs are KBs; DeepSeek-V3's index, ~91k tensors, is ~9 MB):
# beyond this a file is refused before it is parsed.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_INDEX_BYTES = 256 * 2**20
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# The files of a checkpoint folder besides its weights that moe-tune or transformers' loaders read (the config and
# the index, tokenizer, chat template, generation and processor settings). Like the weights, each must lie inside
# the folder (a hub cache snapshot's links into its blobs count as inside) and be a regular file:
# additional_chat_templates, the one folder among them, must be a folder.
LOADER_FILES = (
    CONFIG_NAME, INDEX_NAME, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
    "spiece.model", "tiktoken.model", "chat_template.jinja", "chat_template.json", "additional_chat_templates",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)  # fmt: skip
LOADER_FOLDERS = ("additional_chat_templates",)
# What the line refusing a loader file that leads outside the folder calls them, by the folder's kind.
CHECKPOINT_FILES = "a checkpoint's files"
LOADER_FILES_OF = {"checkpoint": CHECKPOINT_FILES, "tokenizer": "a tokenizer's files"}
# Weights in pickle formats (torch.save): never opened, since unpickling runs code the file chooses.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: an object, refusing a key given twice (json.loads keeps the last silently)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _header_key_twice(path: Path) -> str | None:
    """A key the JSON header of the safetensors file `path` gives twice (safetensors keeps one of them silently), or
    None. The file has opened as safetensors: its header's length and JSON are valid."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size)
    try:
        json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        return err.args[0]
    return None


def read_json_file(path: Path, max_bytes: int) -> Any:
    """The JSON value in the regular file `path` of at most `max_bytes`, no object repeating a key; UnsupportedModel
    in one line naming it."""
    try:
        info = path.stat()
        size = info.st_size
        if stat.S_ISREG(info.st_mode) and size <= max_bytes:
            with path.open("rb") as f:
                raw = f.read(max_bytes + 1)
            size = len(raw)
    except OSError as err:
        raise UnsupportedModel([f"{path}: cannot read ({err.strerror or err})"]) from None
    if not stat.S_ISREG(info.st_mode):
        raise UnsupportedModel([f"{path}: must be a regular file"])
    if size > max_bytes:
        raise UnsupportedModel([f"{path}: {size} bytes, more than the {max_bytes} this file may hold"])
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise UnsupportedModel([f"{path}: key {show(err.args[0])} appears twice in one object (which one "
                                "counts is not defined)"]) from None
    except UnicodeDecodeError as err:
        raise UnsupportedModel([f"{path}: not UTF-8 (byte offset {err.start})"]) from None
    except json.JSONDecodeError as err:
        raise UnsupportedModel([f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})"]) from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise UnsupportedModel([f"{path}: not valid JSON ({show(str(err))})"]) from None
    except RecursionError:
        raise UnsupportedModel([f"{path}: JSON nested too deeply"]) from None


def read_config(directory: Path) -> dict[str, Any]:
    """The JSON object in `directory`/config.json, which must lie inside the folder (loader_file_problems);
    UnsupportedModel in one line naming it otherwise."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    outside = outside_line(directory, CONFIG_NAME, weight_roots(directory), CHECKPOINT_FILES)
    if outside is not None:
        raise UnsupportedModel([f"{path}: {outside}"])
    data = read_json_file(path, MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise UnsupportedModel([f"{path}: must hold a JSON object, got {type(data).__name__}"])
    return data


def weight_roots(directory: Path) -> list[Path]:
    """Where the checkpoint's files may lie: its folder, and for a Hugging Face hub cache snapshot
    (models--org--name/snapshots/REV, whose files are links into ../../blobs) that repository's blobs folder. The
    folder is resolved (a cache reached through a link, as HF_HOME on another disk, is read where it lies), its
    blobs folder is not: a `blobs` that is itself a link would let the snapshot lead anywhere."""
    root = directory.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def outside_line(directory: Path, name: str, roots: list[Path], what: str, kind: str = "checkpoint") -> str | None:
    """Why `directory`/`name` is refused for leading outside `roots` (by `..` or a symlink; `what`: the files the
    rule is about, as the line names them; `kind`: the folder's), or None where it resolves inside them."""
    path = directory / name
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as err:
        return f"cannot be resolved ({err})"
    if any(resolved.is_relative_to(root) for root in roots):
        return None
    how = f"a symlink to {resolved}" if ".." not in PurePosixPath(name).parts else f"resolves to {resolved}"
    return f"leads outside the {kind} folder {roots[0]} ({how}); {what} must lie inside it"


def confined_file(directory: Path, name: Any, roots: list[Path]) -> tuple[Path | None, str | None]:
    """(the weight file `name` names inside `directory`, None) or (None, why it is refused): not a relative path,
    leading outside the roots (by `..` or a symlink), missing, or not a regular file."""
    if not isinstance(name, str) or not name:
        return None, "must be a file name (a non-empty string)"
    if "\0" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        return None, "must be a path relative to the checkpoint folder"
    outside = outside_line(directory, name, roots, "weight files")
    if outside is not None:
        return None, outside
    resolved = (directory / name).resolve()
    try:
        info = resolved.stat()
    except OSError:
        return None, "names a file that does not exist"
    if not stat.S_ISREG(info.st_mode):
        return None, "must name a regular file"
    return resolved, None


def loader_file_problems(directory: Path, kind: str = "checkpoint") -> list[str]:
    """One line per LOADER_FILES entry of `directory` (and file of its LOADER_FOLDERS) that leads outside the folder
    (a hub cache snapshot's links into its blobs count as inside: weight_roots) or that exists and is not a regular
    file (a FIFO would block a loader for ever), a LOADER_FOLDERS entry not a folder. A missing file is no problem:
    a checkpoint holds the loader files it has. `kind` (LOADER_FILES_OF): the folder's, as the lines name it (a
    tokenizer folder of its own, data.tokenizer, is held to the same rule)."""
    directory = Path(directory)
    roots = weight_roots(directory)
    what = LOADER_FILES_OF[kind]
    problems = []
    for name in LOADER_FILES:
        path = directory / name
        if not os.path.lexists(path):
            continue
        outside = outside_line(directory, name, roots, what, kind)
        if outside is not None:
            problems.append(f"{path}: {outside}")
            continue
        try:
            mode = path.stat().st_mode
        except OSError:
            continue  # a link to nothing inside the folder: the loader that wants it says so
        if name in LOADER_FOLDERS:
            if not stat.S_ISDIR(mode):
                kind = "a regular file" if stat.S_ISREG(mode) else file_kind(mode)
                problems.append(f"{path}: must be a folder, not {kind}")
                continue
            try:
                entries = sorted(path.iterdir())
            except OSError:
                entries = []  # a folder that cannot be listed: the loader that reads it says so
            for entry in entries:
                outside = outside_line(directory, f"{name}/{entry.name}", roots, what, kind)
                if outside is not None:
                    problems.append(f"{entry}: {outside}")
                    continue
                with contextlib.suppress(OSError):  # a link to nothing: the loader that wants it says so
                    mode = entry.stat().st_mode
                    if not stat.S_ISREG(mode):
                        problems.append(f"{entry}: must be a regular file, not {file_kind(mode)}")
        elif not stat.S_ISREG(mode):
            problems.append(f"{path}: must be a regular file, not {file_kind(mode)}")
    return problems


def pickle_weights(directory: Path) -> list[str]:
    """Names of the pickle-format weight files in `directory` (never opened)."""
    try:
        return sorted(p.name for p in directory.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    except OSError:
        return []


class CheckpointReader:
    """Tensors of the checkpoint by key; records which keys were read so unmapped ones can be reported.

    Every file is checked before any is opened: the loader files (LOADER_FILES: config, index, tokenizer, ...) must
    lie inside the checkpoint folder (loader_file_problems), the index's entries (and the *.safetensors files) must
    be regular files inside it, and each opens as safetensors holding the tensors the index puts there. All problems
    are raised together, one line each."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        roots = weight_roots(self.directory)
        index = self.directory / INDEX_NAME
        loader_problems = loader_file_problems(self.directory)
        if any(line.startswith(f"{index}: ") for line in loader_problems):
            raise UnsupportedModel(loader_problems)
        problems: list[str] = []
        # file name as written -> its path; and tensor key -> file name
        files: dict[str, Path] = {}
        weight_map: dict[str, str] = {}
        if index.exists():
            weight_map = self._read_index(index)
            refused: dict[str, tuple[str, int]] = {}
            for key, name in weight_map.items():
                hashable = name if isinstance(name, str) else repr(name)
                if hashable in files:
                    continue
                if hashable in refused:
                    refused[hashable] = (refused[hashable][0], refused[hashable][1] + 1)
                    continue
                path, why = confined_file(self.directory, name, roots)
                if why is None:
                    files[hashable] = path
                else:
                    refused[hashable] = (f"{index}: weight_map[{show(key)}] ({show(name)}) {why}", 0)
            for line, others in refused.values():
                problems.append(line + (f" (and {others} more entries naming it)" if others else ""))
        else:
            for path in sorted(self.directory.glob("*.safetensors")):
                resolved, why = confined_file(self.directory, path.name, roots)
                if why is None:
                    files[path.name] = resolved
                else:
                    problems.append(f"{path}: {why}")
        if not files and not problems:
            pickles = pickle_weights(self.directory)
            if pickles:
                names = ", ".join(pickles[:3]) + (f" and {len(pickles) - 3} more" if len(pickles) > 3 else "")
                problems.append(f"{self.directory / pickles[0]}: weights in a pickle format ({names}) are not read: "
                                "moe-tune reads only *.safetensors (never unpickles); convert the checkpoint")
            else:
                problems.append(f"{self.directory}: no *.safetensors weights")
        if loader_problems or problems:
            raise UnsupportedModel(loader_problems + problems)
        self._paths = files
        self._handles = {}
        for name, path in files.items():
            try:
                self._handles[name] = safe_open(str(path), framework="pt").__enter__()
            except Exception as err:  # safetensors raises its own error types for truncated or foreign files
                problems.append(f"{self.directory / name}: not a readable safetensors file ({show(str(err))})")
                continue
            twice = _header_key_twice(path)
            if twice is not None:
                problems.append(f"{self.directory / name}: the header gives tensor {show(twice)} twice (which one "
                                "counts is not defined)")
        if weight_map and not problems:
            problems += self._check_index(index, weight_map)
        if problems:
            self.close()
            raise UnsupportedModel(problems)
        if not weight_map:
            weight_map = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self._where = weight_map
        self.read: set[str] = set()
        # The keys of each shard not read yet, and the shard read last: a shard whose every key has been read is
        # closed once reading moves on to another, so its mapped pages leave the process's memory (a checkpoint read
        # in order holds about one shard mapped, not all of them).
        self._unread_in: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            self._unread_in.setdefault(name, set()).add(key)
        self._current: str | None = None

    @staticmethod
    def _read_index(index: Path) -> dict[str, Any]:
        data = read_json_file(index, MAX_INDEX_BYTES)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise UnsupportedModel([f"{index}: weight_map ({show(weight_map)}) must be a JSON object of tensor name "
                                    "-> file name"])
        return weight_map

    def _check_index(self, index: Path, weight_map: dict[str, str]) -> list[str]:
        """One line per shard that lacks tensors the index puts in it."""
        held = {name: set(handle.keys()) for name, handle in self._handles.items()}
        missing: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            if key not in held[name]:
                missing.setdefault(name, []).append(key)
        return [f"{index}: {len(keys)} tensors the weight_map puts in {show(name)} are not in that file "
                f"(first: {show(keys[0])})" for name, keys in missing.items()]

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def _handle(self, key: str, is_read: bool = True):
        """The open shard holding `key` (reopened if it was released); with is_read, `key` counts as read."""
        name = self._where[key]
        if name != self._current:
            last = self._current
            if last is not None and not self._unread_in.get(last) and last in self._handles:
                self._handles.pop(last).__exit__(None, None, None)
            self._current = name
        if name not in self._handles:
            self._handles[name] = safe_open(str(self._paths[name]), framework="pt").__enter__()
        if is_read:
            self.read.add(key)
            self._unread_in[name].discard(key)
        return self._handles[name]

    @property
    def open_shards(self) -> list[str]:
        """The shards held open (mapped) now."""
        return sorted(self._handles)

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(key)
        return self._handle(key).get_tensor(key)

    __call__ = get  # the reader is the TensorGetter recipes call

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor's first dim, read without reading the rest (one rank's experts of a
        fused expert tensor)."""
        if key not in self._where:
            raise KeyError(key)
        return self._handle(key).get_slice(key)[start:stop]

    def dtype(self, key: str) -> str:
        """The stored dtype as safetensors names it (BF16, F8_E4M3, ...), read from the header alone."""
        return self._handle(key, is_read=False).get_slice(key).get_dtype()

    def shape(self, key: str) -> list[int]:
        return self._handle(key, is_read=False).get_slice(key).get_shape()

    def file_of(self, key: str) -> Path:
        return self.directory / self._where[key]

    def unread_patterns(self, ignore: tuple[str, ...] = ()) -> list[str]:
        """Key patterns (numbers as *) of tensors nothing read, except keys starting with an `ignore` prefix."""
        left = [k for k in self._where if k not in self.read and not k.startswith(ignore)]
        return sorted({key_pattern(k) for k in left})

    def close(self) -> None:
        while self._handles:
            self._handles.popitem()[1].__exit__(None, None, None)

    def fingerprint(self) -> dict[str, dict[str, Any]]:
        """{weight file name: its bytes and the sha256 of its header and FINGERPRINT_SAMPLES spread samples of its
        data}: what tells a checkpoint's weights from others of the same layout (another training step, a revision
        of the hub's) reading about 1 MiB of each file; a change between the samples goes unseen."""
        return {name: _file_fingerprint(path) for name, path in sorted(self._paths.items())}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Samples of a weight file's data its fingerprint reads (each FINGERPRINT_SAMPLE_BYTES), the last at its end.
FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 64 * 1024


def _file_fingerprint(path: Path) -> dict[str, Any]:
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        header = f.read(8)
        digest.update(header)
        start = 8 + (int.from_bytes(header, "little") if len(header) == 8 else 0)
        digest.update(f.read(start - 8))
        span = max(size - start - FINGERPRINT_SAMPLE_BYTES, 0)
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(start + span * i // (FINGERPRINT_SAMPLES - 1))
            digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return {"bytes": size, "sha256": digest.hexdigest()}


def changes_phrase(changes: list[str]) -> str:
    """The first of fingerprint_changes' phrases, and how many more files changed."""
    more = len(changes) - 1
    return changes[0] + (f" (and {more} more file{'s' if more > 1 else ''})" if more else "")


def fingerprint_changes(saved: Any, now: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between a checkpoint's weights fingerprinted earlier (`saved`, CheckpointReader.fingerprint) and
    now, one phrase per file ('model-00001.safetensors: other contents'); none when they agree, or when `saved` is no
    fingerprint (a run of an earlier version)."""
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        return []
    changes = [f"{name}: no longer there" for name in saved if name not in now]
    changes += [f"{name}: new" for name in now if name not in saved]
    for name in (n for n in saved if n in now):
        was, is_now = saved[name], now[name]
        if was.get("bytes") != is_now["bytes"]:
            changes.append(f"{name}: {was.get('bytes')} bytes then, {is_now['bytes']} now")
        elif was.get("sha256") != is_now["sha256"]:
            changes.append(f"{name}: other contents")
    return changes


def is_floating_dtype(dtype: str) -> bool:
    """Whether the safetensors dtype `dtype` (F32, BF16, F8_E4M3, I64, U8, BOOL, ...) is a floating-point one."""
    return dtype.startswith("F") or dtype == "BF16"


# The hub's FP8 checkpoints: `<name>` float8_e4m3fn with its block scales in `<name>_scale_inv` (fp32).
SCALE_SUFFIX = "_scale_inv"
FP8_STORED = "F8_E4M3"
# safetensors dtypes of the scales: fp32 as the hub writes them; bf16/fp16 scales widen to fp32 exactly.
SCALE_STORED = ("F32", "BF16", "F16")


def fp8_tensor_problems(reader: CheckpointReader, is_fp8: bool) -> list[str]:
    """One line per kind of FP8 tensor the reader cannot take (per key pattern, its first key named): FP8 weights in
    a checkpoint whose config.json declares no FP8 layout, another FP8 format than e4m3, a weight without its scale
    or a scale without its weight, a scale not [..., ceil(O/128), ceil(I/128)] fp32. Reads headers only."""
    from moe_tune.ops.fp8 import num_blocks

    found: dict[tuple[str, str], list] = {}

    def report(key: str, why: str) -> None:
        found.setdefault((key_pattern(key), why), [key, 0])[1] += 1

    for key in reader.keys():
        dtype = reader.dtype(key)
        if key.endswith(SCALE_SUFFIX):
            weight = key.removesuffix(SCALE_SUFFIX)
            if weight not in reader:
                report(key, f"is a block scale without its weight {weight}")
            elif dtype not in SCALE_STORED:
                report(key, f"is {dtype}: block scales must be F32 (or BF16, F16)")
            continue
        if not dtype.startswith("F8") and key + SCALE_SUFFIX not in reader:
            continue
        if not is_fp8:
            report(key, f"is {dtype} but config.json declares no FP8 layout ({FP8_RULE})")
        elif dtype != FP8_STORED:
            report(key, f"is {dtype}: FP8 weights must be {FP8_STORED} (float8_e4m3fn) with fp32 block scales")
        elif key + SCALE_SUFFIX not in reader:
            report(key, f"is {FP8_STORED} without its block scales {key + SCALE_SUFFIX}")
        else:
            shape, scale_shape = reader.shape(key), reader.shape(key + SCALE_SUFFIX)
            expected = [*shape[:-2], num_blocks(shape[-2]), num_blocks(shape[-1])] if len(shape) >= 2 else None
            if expected is None:
                report(key, f"has shape {shape}: FP8 weights must be at least 2-D")
            elif scale_shape != expected:
                report(key, f"has shape {shape} but its scales {key + SCALE_SUFFIX} have {scale_shape}, not "
                       f"{expected} (one per 128 x 128 block)")
    return [f"{reader.file_of(first)}: tensor {first} {why}" + (f" (and {count - 1} more like it)" if count > 1 else "")
            for (_, why), (first, count) in found.items()]


def nonfinite_tensor_problems(reader: CheckpointReader) -> list[str]:
    """One line per key pattern of floating-point tensors holding NaN or an infinity (its first key named, how many
    such values it holds, and how many more tensors alike). Reads every tensor, one at a time."""
    found: dict[str, list] = {}
    for key in reader.keys():
        tensor = reader.get(key)
        if not tensor.is_floating_point():
            continue
        # float8 has no isfinite kernel on every device: its values fit bf16 exactly.
        values = tensor.to(torch.bfloat16) if tensor.element_size() == 1 else tensor
        bad = values.numel() - int(torch.isfinite(values).sum())
        if bad:
            found.setdefault(key_pattern(key), [key, bad, 0])[2] += 1
    return [f"{reader.file_of(first)}: tensor {first} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or "
            f"infinite){more_alike(count - 1)}" for first, bad, count in found.values()]


class WeightGetter:
    """What the loader hands the recipes: the reader's tensors by key, FP8 weights (a key with `<key>_scale_inv`)
    dequantized to fp32 (`get`, `rows`: for our tensors kept in floating point) or as stored (`fp8`, `fp8_rows`: bits
    and scales for our FP8 tensors, never a floating copy)."""

    def __init__(self, reader: CheckpointReader, packed_suffixes: tuple[str, ...] = ()):
        self.reader = reader
        # Keys ending so hold packed bytes a recipe decodes (Family.packed_key_suffixes): stored as integers.
        self.packed_suffixes = packed_suffixes
        # Keys of the FP8 weights read dequantized, in order (the loader notes a requantized one).
        self.dequantized: list[str] = []
        # One line per scale tensor holding a non-finite value (the loader reports them with its own).
        self.problems: list[str] = []
        # Keys read since the loader last emptied it that are stored as integers or booleans, packed bytes aside
        # (the loader refuses them as weights of ours).
        self.integers_read: list[str] = []
        # Every key read since the loader last emptied it (a line about the tensor built from them names them).
        self.keys_read: list[str] = []

    def sources(self) -> str:
        """The file and key of the first key read since keys_read was emptied, and how many more: where a tensor
        built from them came from."""
        keys = list(dict.fromkeys(self.keys_read))
        if not keys:
            return str(self.reader.directory)
        more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
        return f"{self.reader.file_of(keys[0])}: tensor {keys[0]}{more}"

    def is_fp8(self, key: str) -> bool:
        return key + SCALE_SUFFIX in self.reader

    def _note_integers(self, key: str) -> None:
        if not key.endswith(self.packed_suffixes) and not is_floating_dtype(self.reader.dtype(key)):
            self.integers_read.append(key)

    def __contains__(self, key: str) -> bool:
        return key in self.reader

    def __call__(self, key: str) -> torch.Tensor:
        quantized = self.fp8(key)
        if quantized is None:
            self._note_integers(key)
            return self.reader.get(key)
        self.dequantized.append(key)
        return _dequantize(*quantized)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        quantized = self.fp8_rows(key, start, stop)
        if quantized is None:
            self._note_integers(key)
            return self.reader.rows(key, start, stop)
        self.dequantized.append(key)
        return _dequantize(*quantized)

    def fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W_q float8_e4m3fn, scale_inv fp32) of an FP8 weight; None when `key` is stored unquantized."""
        if key not in self.reader:
            raise KeyError(key)
        self.keys_read.append(key)
        if not self.is_fp8(key):
            return None
        return self.reader.get(key), self._checked_scale(key, self.reader.get(key + SCALE_SUFFIX))

    def fp8_rows(self, key: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8() of rows [start, stop) of the first dim (one rank's experts of a fused [E, O, I] tensor)."""
        if key not in self.reader:
            raise KeyError(key)
        self.keys_read.append(key)
        if not self.is_fp8(key):
            return None
        scale = self._checked_scale(key, self.reader.rows(key + SCALE_SUFFIX, start, stop))
        return self.reader.rows(key, start, stop), scale

    def _checked_scale(self, key: str, scale: torch.Tensor) -> torch.Tensor:
        scale = scale.float()
        if not torch.isfinite(scale).all():
            line = (f"{self.reader.file_of(key + SCALE_SUFFIX)}: tensor {key + SCALE_SUFFIX} holds non-finite block "
                    "scales (inf or nan): the weight it scales has no value")
            if line not in self.problems:
                self.problems.append(line)
        return scale


def _dequantize(w_q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    from moe_tune.ops.fp8 import dequantize_weight

    return dequantize_weight(w_q, scale_inv)
