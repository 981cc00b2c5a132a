"""Kernel launches named from outside the code (`MOE_TUNE_LAUNCH`): a benchmark times whole training steps, or one op,
under a launch that is not the default, with no edit.

    MOE_TUNE_LAUNCH="linear_attention.grad_dq_norm_in_output=true,causal_conv.one_pass_backward=true"
    MOE_TUNE_LAUNCH="moe_gate_up_fwd.one_dot=true,moe_gate_up_fwd.block_n=128"

Entries are `FAMILY.FIELD=VALUE`, comma-separated: FAMILY one of LAUNCH_FAMILIES, FIELD a field of its launch
dataclass, VALUE read as that field's type: an integer (1 to 65536; block sizes and warps powers of two, warps at
most 32), true
or false, none (a field that may be None), integers joined by / (a tuple), or text (one of the field's
metadata["choices"]). The op's own choice
(`pick_config`, `pick_launch`; the MoE expert MLP's `pick_config` for each of its kernels) goes through
`with_overrides`, which replaces the named fields. `moe-tune profile --launch` checks the entries first (one line, exit 2) and sets the variable; the benchmark JSON records it
(engine/bench/machine.py). Unset or empty: the defaults. A family's dataclass may refuse a combination of fields
(its `overrides_problem`: KDA's products kernel in key tiles at more than 8 warps).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
from typing import Any

LAUNCH_ENV = "MOE_TUNE_LAUNCH"
# Family -> (module, dataclass) of its launch.
_MOE_CONFIG = ("moe_tune.ops.moe.kernel_config", "KernelConfig")
LAUNCH_FAMILIES = {
    "linear_attention": ("moe_tune.ops.linear_attention.kernels_common", "KernelConfig"),
    "causal_conv": ("moe_tune.ops.causal_conv.kernels", "ConvLaunch"),
    # The MoE expert MLP's kernels, one family each (MoEConfig's fields, ops/moe/kernel_config.py).
    **{f"moe_{kernel}": _MOE_CONFIG for kernel in (
        "gate_up_fwd", "down_fwd", "down_bwd", "gate_up_bwd", "expert_grad", "lora_rows", "lora_bwd")},
}  # fmt: skip
# Families whose kernel reads only some fields of its launch dataclass: those it reads (the others are refused).
_MOE_TILE = ("block_n", "block_k", "num_warps", "num_stages", "maxnreg")
FAMILY_FIELDS = {
    "moe_gate_up_fwd": (*_MOE_TILE, "one_dot", "tma"),
    "moe_down_fwd": (*_MOE_TILE, "tma"),
    "moe_down_bwd": (*_MOE_TILE, "swiglu_pass", "tma"),
    "moe_gate_up_bwd": (*_MOE_TILE, "tma"),
    "moe_expert_grad": (*_MOE_TILE, "block_p"),
    # The rank pass's output width is the padded LoRA rank: it has no column tile.
    "moe_lora_rows": ("block_k", "num_warps", "num_stages", "maxnreg"),
    "moe_lora_bwd": _MOE_TILE,
}
# Integer fields whose value Triton needs as a power of two (tile sizes, warps): their names hold one of these.
_POWER_OF_TWO_PARTS = ("block_", "num_warps")
# The largest integer a field takes (tiles, warps, stages, programs), and the most warps a program has.
MAX_INTEGER = 65536
MAX_WARPS = 32


class LaunchError(ValueError):
    """An entry that names no field or gives a value its field cannot take; the message is one line."""


def launch_text() -> str:
    """MOE_TUNE_LAUNCH as set (stripped; empty when unset)."""
    return os.environ.get(LAUNCH_ENV, "").strip()


def with_overrides(family: str, config: Any) -> Any:
    """config with the fields MOE_TUNE_LAUNCH names for `family` replaced (config itself when it names none).
    Raises LaunchError on a bad entry."""
    text = launch_text()
    if not text:
        return config
    fields = parse_launch(text).get(family)
    return dataclasses.replace(config, **fields) if fields else config


@functools.lru_cache(maxsize=8)
def _parse(text: str, source: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    parsed: dict[str, dict[str, Any]] = {}
    for entry in text.split(","):
        entry = entry.strip()
        where = f"{source} entry {entry!r}"
        name, sep, value = entry.partition("=")
        family, dot, field = name.strip().partition(".")
        if not sep or not dot or not field:
            raise LaunchError(f"{where}: must be FAMILY.FIELD=VALUE ({_families()})")
        if family not in LAUNCH_FAMILIES:
            raise LaunchError(f"{where}: family {family!r} must be one of {_families()}")
        types = _field_types(family)
        if field not in types:
            raise LaunchError(f"{where}: {family} has no field {field!r} (its fields: {', '.join(types)})")
        if field in parsed.get(family, {}):
            raise LaunchError(f"{where}: {family}.{field} is named twice")
        parsed.setdefault(family, {})[field] = _value(where, field, *types[field], value.strip())
    for family, fields in parsed.items():
        problem = getattr(_launch_class(family), "overrides_problem", lambda _fields: None)(fields)
        if problem:
            raise LaunchError(f"{source} {family}: {problem}")
    return tuple((family, tuple(fields.items())) for family, fields in parsed.items())


def parse_launch(text: str, source: str = LAUNCH_ENV) -> dict[str, dict[str, Any]]:
    """{family: {field: value}} of a MOE_TUNE_LAUNCH text, checked: LaunchError names `source` (where the text came
    from), the entry and the rule."""
    return {family: dict(fields) for family, fields in _parse(text.strip(), source)}


def _families() -> str:
    return ", ".join(LAUNCH_FAMILIES)


def _launch_class(family: str) -> type:
    module, name = LAUNCH_FAMILIES[family]
    return getattr(importlib.import_module(module), name)


@functools.cache
def _field_types(family: str) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """{field: (its annotation, its metadata's choices or None)} of the family's launch dataclass (FAMILY_FIELDS's
    only, where it names them)."""
    names = FAMILY_FIELDS.get(family)
    return {f.name: (str(f.type), f.metadata.get("choices")) for f in dataclasses.fields(_launch_class(family))
            if names is None or f.name in names}  # fmt: skip


def _value(where: str, field: str, kind: str, choices: tuple[str, ...] | None, text: str) -> Any:
    lowered = text.lower()
    if "None" in kind and lowered == "none":
        return None
    if kind == "bool":
        if lowered not in ("true", "false"):
            raise LaunchError(f"{where}: {field} must be true or false")
        return lowered == "true"
    if kind.startswith("int"):
        return _integer(where, field, text, kind)
    if kind.startswith("tuple"):
        return tuple(_integer(where, field, part, kind) for part in text.split("/"))
    if choices is not None and text not in choices:
        raise LaunchError(f"{where}: {field} must be one of {', '.join(choices)}")
    if not text:
        raise LaunchError(f"{where}: {field} must not be empty")
    return text


def _integer(where: str, field: str, text: str, kind: str) -> int:
    may_be_none = " or none" if "None" in kind else ""
    joined = " (several joined by /)" if kind.startswith("tuple") else ""
    if not re.fullmatch(r"[0-9]{1,9}", text) or not 1 <= int(text) <= MAX_INTEGER:
        raise LaunchError(f"{where}: {field} must be an integer from 1 to {MAX_INTEGER}{joined}{may_be_none}")
    value = int(text)
    if any(part in field for part in _POWER_OF_TWO_PARTS) and value & (value - 1):
        raise LaunchError(f"{where}: {field} must be a power of two")
    if "num_warps" in field and value > MAX_WARPS:
        raise LaunchError(f"{where}: {field} must be at most {MAX_WARPS} (a program's 1024 threads)")
    return value
