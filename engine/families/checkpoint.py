"""Reading a Hugging Face checkpoint directory: config.json and safetensors shards, one tensor at a time.

Only safetensors are read (never pickles). Tensors are opened lazily, so a rank reads only what it loads: its
local experts, and each dense tensor as it is copied in.
"""

from __future__ import annotations

import json
import stat
from contextlib import ExitStack
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .base import UnsupportedModel, key_pattern, show

# Larger than any real file of its kind by far (configs are KBs; DeepSeek-V3's index, ~91k tensors, is ~9 MB):
# beyond this a file is refused before it is parsed.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_INDEX_BYTES = 256 * 2**20
INDEX_NAME = "model.safetensors.index.json"
# Weights in pickle formats (torch.save): never opened, since unpickling runs code the file chooses.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def read_json_file(path: Path, max_bytes: int) -> Any:
    """The JSON value in the regular file `path` of at most `max_bytes`; UnsupportedModel in one line naming it."""
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
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UnsupportedModel([f"{path}: not UTF-8 (byte offset {err.start})"]) from None
    except json.JSONDecodeError as err:
        raise UnsupportedModel([f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})"]) from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise UnsupportedModel([f"{path}: not valid JSON ({show(str(err))})"]) from None
    except RecursionError:
        raise UnsupportedModel([f"{path}: JSON nested too deeply"]) from None


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    data = read_json_file(path, MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise UnsupportedModel([f"{path}: must hold a JSON object, got {type(data).__name__}"])
    return data


def weight_roots(directory: Path) -> list[Path]:
    """Where the checkpoint's weight files may lie: its folder, and for a Hugging Face hub cache snapshot
    (models--org--name/snapshots/REV, whose files are links into ../../blobs) that repository's blobs folder."""
    root = directory.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def confined_file(directory: Path, name: Any, roots: list[Path]) -> tuple[Path | None, str | None]:
    """(the weight file `name` names inside `directory`, None) or (None, why it is refused): not a relative path,
    leading outside the roots (by `..` or a symlink), missing, or not a regular file."""
    if not isinstance(name, str) or not name:
        return None, "must be a file name (a non-empty string)"
    if "\0" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        return None, "must be a path relative to the checkpoint folder"
    path = directory / name
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as err:
        return None, f"cannot be resolved ({err})"
    if not any(resolved.is_relative_to(root) for root in roots):
        how = f"a symlink to {resolved}" if ".." not in PurePosixPath(name).parts else f"resolves to {resolved}"
        return None, f"leads outside the checkpoint folder {roots[0]} ({how}); weight files must lie inside it"
    try:
        info = resolved.stat()
    except OSError:
        return None, "names a file that does not exist"
    if not stat.S_ISREG(info.st_mode):
        return None, "must name a regular file"
    return resolved, None


def pickle_weights(directory: Path) -> list[str]:
    """Names of the pickle-format weight files in `directory` (never opened)."""
    try:
        return sorted(p.name for p in directory.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    except OSError:
        return []


class CheckpointReader:
    """Tensors of the checkpoint by key; records which keys were read so unmapped ones can be reported.

    Every weight file is checked before any is opened: the index's entries (and the *.safetensors files) must be
    regular files inside the checkpoint folder, and each opens as safetensors holding the tensors the index puts
    there. All problems are raised together, one line each."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        roots = weight_roots(self.directory)
        index = self.directory / INDEX_NAME
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
        if problems:
            raise UnsupportedModel(problems)
        self._stack = ExitStack()
        self._handles = {}
        for name, path in files.items():
            try:
                self._handles[name] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as err:  # safetensors raises its own error types for truncated or foreign files
                problems.append(f"{self.directory / name}: not a readable safetensors file ({show(str(err))})")
        if weight_map and not problems:
            problems += self._check_index(index, weight_map)
        if problems:
            self._stack.close()
            raise UnsupportedModel(problems)
        if not weight_map:
            weight_map = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self._where = weight_map
        self.read: set[str] = set()

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

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(key)
        self.read.add(key)
        return self._handles[self._where[key]].get_tensor(key)

    __call__ = get  # the reader is the TensorGetter recipes call

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor's first dim, read without reading the rest (one rank's experts of a
        fused expert tensor)."""
        if key not in self._where:
            raise KeyError(key)
        self.read.add(key)
        return self._handles[self._where[key]].get_slice(key)[start:stop]

    def unread_patterns(self, ignore: tuple[str, ...] = ()) -> list[str]:
        """Key patterns (numbers as *) of tensors nothing read, except keys starting with an `ignore` prefix."""
        left = [k for k in self._where if k not in self.read and not k.startswith(ignore)]
        return sorted({key_pattern(k) for k in left})

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
