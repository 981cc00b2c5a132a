"""Reading a Hugging Face checkpoint directory: config.json and safetensors shards, one tensor at a time.

Only safetensors are read (never pickles). Tensors are opened lazily, so a rank reads only what it loads: its
local experts, and each dense tensor as it is copied in.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from .base import UnsupportedModel, key_pattern


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UnsupportedModel([f"{path}: cannot read ({err})"]) from None
    except json.JSONDecodeError as err:
        raise UnsupportedModel([f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})"]) from None
    if not isinstance(data, dict):
        raise UnsupportedModel([f"{path}: must hold a JSON object, got {type(data).__name__}"])
    return data


class CheckpointReader:
    """Tensors of the checkpoint by key; records which keys were read so unmapped ones can be reported."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise UnsupportedModel([f"{self.directory}: no *.safetensors weights"])
        self._stack = ExitStack()
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = self._stack.enter_context(safe_open(str(self.directory / name), framework="pt"))
            except Exception as err:  # safetensors raises its own error types for truncated or foreign files
                self._stack.close()
                raise UnsupportedModel([f"{self.directory / name}: not a readable safetensors file ({err})"]) from None
        if not weight_map:
            weight_map = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self._where = weight_map
        self.read: set[str] = set()

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
