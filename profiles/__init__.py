"""Job profiles: the pydantic schema, the loader, and the shipped YAML (tiny.yaml is the embedded default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .schema import JobProfile

__all__ = ["JobProfile", "ProfileError", "load_profile", "resolve_profile_path", "shipped_profiles", "json_schema"]

SHIPPED_DIR = Path(__file__).resolve().parent


class ProfileError(ValueError):
    """Bad user input in a profile. `problems` holds one line per broken rule: field path, value and rule."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """A path as given, or the name of a shipped profile (`tiny` -> the installed tiny.yaml)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = SHIPPED_DIR / f"{path.stem}.yaml"
    if path.parent == Path(".") or path.parent.name == "profiles":
        if shipped.is_file():
            return shipped
    raise ProfileError(
        [f"{name_or_path}: no such file, nor a shipped profile (shipped: {', '.join(shipped_profiles())})"]
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError([f"{path}: cannot read the profile ({err})"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ProfileError([f"{where}: YAML syntax error: {problem}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProfileError([f"{path}: the profile must be a YAML mapping of sections, got {type(raw).__name__}"])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides; values are parsed as YAML (`train.lr=1e-3`, `lora.target_modules=[q_proj]`)."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: must read path.to.field=value")
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        node = raw
        parts = key.strip().split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = parsed
    if problems:
        raise ProfileError(problems)
    return raw


def _format_value(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_errors(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        loc = list(e["loc"])
        if len(loc) > 1 and loc[0] == "model" and loc[1] in ("spec", "checkpoint"):
            del loc[1]  # the tag of the `model:` union, not a field
        path = ".".join(str(p) for p in loc)
        if e["type"] == "value_error":
            # Our check_<rule> validators: one line per broken rule, fields marked with '@'.
            message = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            prefix = f"{path}." if path else ""
            lines.extend(line.replace("@", prefix) for line in message.splitlines())
        elif e["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{path} ({_format_value(e['input'])}): unknown key (not in the schema: moe-tune schema)")
        else:
            lines.append(f"{path} ({_format_value(e['input'])}): {e['msg'][0].lower()}{e['msg'][1:]}")
    return lines


def validate_profile(raw: dict[str, Any]) -> JobProfile:
    try:
        return JobProfile.model_validate(raw)
    except ValidationError as err:
        raise ProfileError(_format_errors(err)) from None


def load_profile(name_or_path: str | Path, overrides: list[str] | None = None) -> JobProfile:
    """Read, override and validate a profile; raise ProfileError listing every problem at once."""
    path = resolve_profile_path(name_or_path)
    raw = apply_overrides(_read_yaml(path), overrides or [])
    return validate_profile(raw)


def json_schema() -> dict[str, Any]:
    return JobProfile.model_json_schema()
