"""Job profiles: the pydantic schema, the loader, and the shipped YAML (tiny.yaml is the embedded default)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, get_args

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from .schema import VALUE_RULE, CheckpointModel, JobProfile, ModelProfile, model_kind, value_problem

__all__ = [
    "JobProfile",
    "ProfileError",
    "bounded_line",
    "error_line",
    "escape_controls",
    "escape_unprintable",
    "json_shown",
    "shortened",
    "foreign_encoding",
    "format_errors",
    "load_profile",
    "more_alike",
    "not_utf8",
    "resolve_profile_path",
    "shipped_profiles",
    "json_schema",
]

SHIPPED_DIR = Path(__file__).resolve().parent

# A profile is a page of settings (the largest shipped one is ~5 KB): larger files are refused unread.
MAX_PROFILE_BYTES = 1 << 20
# Nodes and scalar characters after YAML aliases are expanded: a small file must not expand into gigabytes.
MAX_PROFILE_NODES = 100_000
MAX_PROFILE_CHARS = 4 << 20
# Nesting of mappings and lists (profiles use fewer than 10 levels; the YAML composer recurses once per level).
MAX_PROFILE_DEPTH = 64
# One problem line: a key or value echoed in it cannot make it longer than this.
MAX_PROBLEM_CHARS = 1000

# C0 and C1 controls (newlines and tabs included: a problem is one line), DEL, and the Unicode line separators and
# bidirectional controls, which would let an echoed key or value rewrite how the rest of the line reads.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# Characters that print as nothing (soft hyphen, zero-width space and joiners, word joiner, byte-order mark): escaped in
# problem lines, where one pasted into a key (`lr\u200b`) would hide why the key is unknown; kept in generated text,
# where joiners belong to emoji and scripts.
_INVISIBLE = re.compile(r"[\xad\u180e\u200b-\u200d\u2060-\u2064\ufeff]")


def _escape(match: re.Match) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with control and bidirectional characters written as escapes (`\\x1b`, `\\u202e`); idempotent."""
    return _CONTROLS.sub(_escape, text)


def shortened(text: str, most: int) -> str:
    """`text` in at most `most` characters, the last three '...' when it is cut."""
    return text if len(text) <= most else text[: most - 3] + "..."


def json_shown(value: Any, most: int = 80) -> str:
    """A value as a message line echoes it: JSON with ASCII escapes (control and bidirectional characters cannot
    rewrite the line; what JSON cannot write, as its repr), shortened to `most` characters."""
    return shortened(json.dumps(value, ensure_ascii=True, default=repr), most)


def escape_unprintable(text: str) -> str:
    """`text` with control, bidirectional and invisible (zero-width) characters written as escapes."""
    return _INVISIBLE.sub(_escape, escape_controls(text))


def bounded_line(line: str) -> str:
    """`line` as it may be printed: controls and invisible characters escaped, at most MAX_PROBLEM_CHARS characters
    and a count of the rest."""
    line = escape_unprintable(line)
    if len(line) <= MAX_PROBLEM_CHARS:
        return line
    return f"{line[:MAX_PROBLEM_CHARS]}... ({len(line) - MAX_PROBLEM_CHARS} more characters)"


def error_line(err: BaseException, plain: tuple[type[BaseException], ...] = (BaseException,)) -> str:
    """The first line of err's message, led by its kind (ZeroDivisionError, KeyError, ...: what the message alone does
    not say) unless it is one of `plain` (by default every kind); the kind alone when there is no message."""
    text = str(err).strip()
    first_line = text.splitlines()[0] if text else ""
    if not first_line:
        return type(err).__name__
    return first_line if isinstance(err, plain) else f"{type(err).__name__}: {first_line}"


def more_alike(count: int) -> str:
    """The end of a line naming one tensor for `count` more with the same problem: ' (and 2 more tensors alike)'."""
    return f" (and {count} more tensor{'s' if count > 1 else ''} alike)" if count else ""


class ProfileError(ValueError):
    """Bad user input in a profile. `problems` holds one line per broken rule: field path, value and rule (control
    characters escaped, each line bounded in length)."""

    def __init__(self, problems: list[str]):
        self.problems = [bounded_line(str(line)) for line in problems]
        super().__init__("\n".join(self.problems))


# Byte-order marks of the Unicode encodings other than UTF-8, UTF-32's first (they begin with UTF-16's).
_FOREIGN_MARKS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
                  (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)"))


def foreign_encoding(head: bytes) -> str | None:
    """The encoding other than UTF-8 whose byte-order mark opens `head` ('UTF-16 (little-endian)'), else None."""
    return next((name for mark, name in _FOREIGN_MARKS if head.startswith(mark)), None)


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """A path as given, or the name of a shipped profile: `tiny`, `tiny.yaml` or the repository's relative
    `profiles/tiny.yaml` (the README's commands, run from any folder) -> the installed tiny.yaml. A missing path of
    any other form (another suffix, another folder, a trailing slash) is no shipped profile: a user's own file that is
    missing must not be replaced by the installed one of the same name."""
    path = Path(name_or_path)
    if path.exists():
        return path
    text = str(name_or_path)
    is_name = "/" not in text and path.suffix in ("", ".yaml")
    if is_name or (text == f"profiles/{path.name}" and path.suffix == ".yaml"):
        shipped = SHIPPED_DIR / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    raise ProfileError(
        [f"{name_or_path}: no such file, nor a shipped profile (shipped: {', '.join(shipped_profiles())})"]
    )


class _Refused(Exception):
    """A profile the loader will not build (too large, too deep, recursive); the message is the problem line."""


class _YamlVersionError(yaml.constructor.ConstructorError):
    """A number YAML 1.1 (PyYAML's reading) and YAML 1.2 (and JSON) read differently: `010` is 8 or 10, `1:30` is 90
    or text. Refused rather than read either way."""


# YAML 1.1's octal integers: a leading zero, then octal digits.
_OCTAL = re.compile(r"[-+]?0[0-7]+")


try:
    # libyaml's scanner and parser read a dense 1 MB profile ~5x faster than PyYAML's own; the composer below stays
    # PyYAML's Python one, which counts.
    from yaml._yaml import CParser as _EventParser
except ImportError:

    class _EventParser(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):
        def __init__(self, text: str):
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


class _ProfileLoader(yaml.composer.Composer, _EventParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """The safe loader (yaml.SafeLoader's constructor and resolver) with a composer that counts while it composes:
    nesting depth, and the nodes and scalar characters the document would have with every alias expanded (an alias
    costs what it names, so a bomb is refused before it is built); an alias inside what it names (a recursive
    structure) is refused."""

    def __init__(self, text: str, source: str):
        _EventParser.__init__(self, text)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self.source = source
        self.depth = 0
        self.num_nodes = 0
        self.num_chars = 0
        # id(node) -> (nodes, chars) of the node expanded; absent while the node is being composed.
        self.expanded: dict[int, tuple[int, int]] = {}

    def _where(self, mark) -> str:
        return f"{self.source}:{mark.line + 1}" if mark is not None else self.source

    def _grow(self, num_nodes: int, num_chars: int, mark) -> None:
        self.num_nodes += num_nodes
        self.num_chars += num_chars
        if self.num_nodes > MAX_PROFILE_NODES:
            raise _Refused(
                f"{self._where(mark)}: the profile expands to more than {MAX_PROFILE_NODES} YAML nodes (aliases "
                "repeat what they name): refused"
            )
        if self.num_chars > MAX_PROFILE_CHARS:
            raise _Refused(
                f"{self._where(mark)}: the profile expands to more than {MAX_PROFILE_CHARS} characters of values "
                "(aliases repeat what they name): refused"
            )

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                size = self.expanded.get(id(node))
                if size is None:
                    raise _Refused(
                        f"{self._where(event.start_mark)}: alias *{event.anchor} is inside the node it names "
                        "(a recursive structure): refused"
                    )
                self._grow(*size, event.start_mark)
            return super().compose_node(parent, index)
        if self.depth >= MAX_PROFILE_DEPTH:
            raise _Refused(
                f"{self._where(self.peek_event().start_mark)}: nested deeper than {MAX_PROFILE_DEPTH} levels: refused"
            )
        self.depth += 1
        before = (self.num_nodes, self.num_chars)
        node = super().compose_node(parent, index)
        self.depth -= 1
        self._grow(1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0, node.start_mark)
        self.expanded[id(node)] = (self.num_nodes - before[0], self.num_chars - before[1])
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as err:
            # A scalar its tag cannot hold: a decimal integer of more than 4300 digits, a 13th month, `!!int x`.
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r:.60} ({err})", node.start_mark
            ) from None

    def construct_yaml_int(self, node):
        number = super().construct_yaml_int(node)
        _refuse_binary(node, number)
        text = node.value.replace("_", "")
        if ":" in text:
            raise _YamlVersionError(None, None, f"{node.value:.60} is {number} in YAML 1.1 (base 60) but text in YAML "
                                    "1.2: write the number, or quote it for text", node.start_mark)
        if _OCTAL.fullmatch(text) and number != int(text, 10):
            raise _YamlVersionError(None, None, f"{node.value:.60} is {number} in YAML 1.1 (octal) but {int(text, 10)} "
                                    "in YAML 1.2 and JSON: write it without the leading zero, or quote it for text",
                                    node.start_mark)
        return number

    def construct_yaml_float(self, node):
        number = super().construct_yaml_float(node)
        if ":" in node.value:
            raise _YamlVersionError(None, None, f"{node.value:.60} is {number} in YAML 1.1 (base 60) but text in YAML "
                                    "1.2: write the number, or quote it for text", node.start_mark)
        return number


def _refuse_binary(node, number) -> None:
    """_YamlVersionError for a binary number (`0b10`): YAML 1.1 reads 2, YAML 1.2 the text `0b10`, which no number
    field takes. (Digits grouped by `_`, `1_000`, are the same number read either way: YAML 1.2's text `1_000` is
    read as 1000 by the schema, as by Python.)"""
    if node.value.lstrip("+-").startswith("0b"):
        raise _YamlVersionError(None, None, f"{node.value:.60} is {number} in YAML 1.1 (binary) but text in YAML 1.2 "
                                "and JSON: write the number in decimal, or quote it for text", node.start_mark)


_ProfileLoader.add_constructor("tag:yaml.org,2002:int", _ProfileLoader.construct_yaml_int)
_ProfileLoader.add_constructor("tag:yaml.org,2002:float", _ProfileLoader.construct_yaml_float)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _duplicate_keys(root: yaml.Node, source: str) -> list[str]:
    """One line per key given twice in one mapping, at any depth; a key a merge (`<<:`) brings may be given again
    (YAML's override), but `<<` itself only once (a second would silently win over the first: merge several with
    `<<: [*a, *b]`). Each node is visited once, so aliases cost nothing more."""
    problems: list[tuple[int, str]] = []
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[str, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, (*path, str(i))) for i, child in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            children = []
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else f"<{key.id}>"
                line = key.start_mark.line + 1
                identity = (key.tag, name)
                if isinstance(key, yaml.ScalarNode) and identity in first_line:
                    dotted = _format_key(".".join((*path, name)))
                    rule = ("one merge key per mapping: merge several with <<: [*a, *b]" if key.tag == _MERGE_TAG
                            else "a key may appear once in a mapping")
                    problems.append((line, f"{source}:{line}: duplicate key '{dotted}' (first given at line "
                                     f"{first_line[identity]}): {rule}"))
                elif isinstance(key, yaml.ScalarNode):
                    first_line[identity] = line
                # The keys a merge brings belong to this mapping.
                children.append((value, path if key.tag == _MERGE_TAG else (*path, name)))
            stack.extend(reversed(children))
    return [line for _, line in sorted(problems)]


def _load_yaml(text: str, source: str) -> tuple[Any, list[str]]:
    """Parse one YAML document with the safe loader under the caps; returns the data and the duplicate-key problems.
    Raises _Refused or yaml.YAMLError."""
    loader = _ProfileLoader(text, source)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, []
        duplicates = _duplicate_keys(root, source)
        return loader.construct_document(root), duplicates
    finally:
        loader.dispose()


def _format_key(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _read_yaml(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The profile's top-level mapping, and the problems that do not stop validation (duplicate keys)."""
    try:
        # Anything but a regular file (a FIFO, a device) could block or never end: checked before opening, and on what
        # was opened (without blocking) in case it was swapped meanwhile.
        if not path.is_file():
            raise ProfileError([f"{path}: cannot read the profile (not a regular file)"])
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise ProfileError([f"{path}: cannot read the profile (not a regular file)"])
            if status.st_size > MAX_PROFILE_BYTES:
                raise ProfileError([f"{path}: the profile is {status.st_size} bytes, more than the {MAX_PROFILE_BYTES} "
                                    "bytes a profile may be"])
            data = f.read(MAX_PROFILE_BYTES + 1)
        if len(data) > MAX_PROFILE_BYTES:
            raise ProfileError([f"{path}: the profile grew past {MAX_PROFILE_BYTES} bytes while it was read"])
    except OSError as err:
        raise ProfileError([f"{path}: cannot read the profile ({err})"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        encoding = foreign_encoding(data)
        why = (f"{encoding} text: it opens with that byte-order mark" if encoding is not None else
               f"{err.reason}: byte 0x{data[err.start]:02x} at byte offset {err.start}")
        raise ProfileError([f"{path}: not UTF-8 ({why}); a profile is UTF-8 text"]) from None
    try:
        raw, problems = _load_yaml(text, str(path))
    except _Refused as err:
        raise ProfileError([str(err)]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        kind = "value" if isinstance(err, yaml.constructor.ConstructorError) else "syntax"
        raise ProfileError([f"{where}: YAML {kind} error: {_yaml_problem(err)}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProfileError([f"{path}: the profile must be a YAML mapping of sections, got {type(raw).__name__}"])
    return raw, problems


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What a YAML error says is wrong, without its position and context lines."""
    return getattr(err, "problem", None) or str(err).splitlines()[0]


# How YAML spells null: an override that reads as null without one of them is empty (or a comment).
_NULLS = ("null", "Null", "NULL", "~")


def _override_problems(raw: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply `a.b=value` overrides in place (a later one wins); returns one problem per override that cannot apply.
    Values parse as YAML through the profile loader and its caps; text that is not YAML stays a string."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        label = f"--set {_format_value(item)}"
        if (what := not_utf8(item)) is not None:
            problems.append(f"{label}: not UTF-8 text ({what})")
            continue
        if not sep or not key.strip():
            problems.append(f"{label}: must read path.to.field=value")
            continue
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            problems.append(f"{label}: the path has an empty part; must read path.to.field=value")
            continue
        if len(parts) > MAX_PROFILE_DEPTH:
            problems.append(f"{label}: the path has more than {MAX_PROFILE_DEPTH} parts")
            continue
        if len(value) > MAX_PROFILE_BYTES:
            problems.append(f"{label}: the value has {len(value)} characters, more than {MAX_PROFILE_BYTES}")
            continue
        try:
            parsed, duplicates = _load_yaml(value, label)
        except _Refused as err:
            problems.append(str(err))
            continue
        except _YamlVersionError as err:
            problems.append(f"{label}: {err.problem}")
            continue
        except yaml.YAMLError as err:
            if value.lstrip().startswith(("[", "{")):
                # Meant as a YAML list or mapping: its syntax error, not a string the schema then refuses.
                problems.append(f"{label}: the value is not valid YAML ({_yaml_problem(err)})")
                continue
            parsed, duplicates = value, []
        if duplicates:
            problems.extend(duplicates)
            continue
        if parsed is None and value.strip() not in _NULLS:
            # `--set data.path=$DATA` with DATA unset would train on the built-in corpus.
            problems.append(f"{label}: the value reads as null (it is empty or a YAML comment): write null to unset "
                            "the field")
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                what = "a list: set it whole" if isinstance(child, list) else "not a section"
                problems.append(f"{label}: {'.'.join(parts[: depth + 1])} is {what}")
                break
            node = child
        else:
            node[parts[-1]] = parsed
    return problems


def not_utf8(text: str) -> str | None:
    """Where text is not UTF-8: the first command-line byte that was not (Python keeps one as a lone surrogate,
    U+DC80-U+DCFF) or another lone surrogate; None when it is UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"the command line's byte 0x{code - 0xDC00:02x} at character {err.start + 1}"
        return f"a lone surrogate U+{code:04X} at character {err.start + 1}"
    return None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides; values are parsed as YAML (`train.lr=1e-3`, `lora.target_modules=[q_proj]`)."""
    problems = _override_problems(raw, overrides)
    if problems:
        raise ProfileError(problems)
    return raw


def _format_value(value: Any) -> str:
    # An int of more bits than any field takes: Python will not print one of more than 4300 digits.
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    except (ValueError, RecursionError):
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def format_errors(err: ValidationError) -> list[str]:
    """One line per problem of a pydantic validation: the field's dotted path, the value and the rule."""
    lines = []
    for e in err.errors(include_url=False):
        loc = list(e["loc"])
        if len(loc) > 1 and loc[0] == "model" and loc[1] in ("spec", "checkpoint"):
            del loc[1]  # the tag of the `model:` union, not a field
        path = _format_key(".".join(str(p) for p in loc))
        if e["type"] == "value_error":
            # Our check_<rule> validators: one line per broken rule, fields marked with '@'.
            message = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            prefix = f"{path}." if path else ""
            lines.extend(line.replace("@", prefix) for line in message.splitlines())
        elif e["type"] == VALUE_RULE:
            lines.append(f"{path} ({_format_value(e['input'])}) {e['msg']}")
        elif e["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{path} ({_format_value(e['input'])}): unknown key (not in the schema: moe-tune schema)")
        else:
            lines.append(f"{path} ({_format_value(e['input'])}): {e['msg'][0].lower()}{e['msg'][1:]}")
    return lines


def _section_class(annotation: Any, raw: Any) -> type[BaseModel] | None:
    """The pydantic model a field's raw value is validated as: the field's model, the model of an optional one, or
    for `model:` the kind its tag picks."""
    candidates = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
    for arg in get_args(annotation):
        candidates += [a for a in get_args(arg) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) > 1 and CheckpointModel in candidates:
        return CheckpointModel if model_kind(raw) == "checkpoint" else ModelProfile
    return candidates[0] if len(candidates) == 1 else None


def _hidden_rule_problems(cls: type[BaseModel], raw: Any, prefix: str = "") -> list[str]:
    """The check_<rule> validators of `cls` (and of its sections, depth first) that pydantic skipped because a field
    is invalid, run on the fields that are valid; a rule that reads an invalid field is skipped (that field's own
    problem is reported). Without this one bad field would hide every rule of the sections around it."""
    if not isinstance(raw, dict):
        return []
    values: dict[str, Any] = {}
    problems = []
    for name, field in cls.model_fields.items():
        if name not in raw:
            if not field.is_required():
                values[name] = field.get_default(call_default_factory=True)
            continue
        if value_problem(field.annotation, raw[name]) is not None:
            # Reported by the field's own check (Strict.check_value_rules); a rule reading it is skipped.
            continue
        try:
            values[name] = TypeAdapter(Annotated[field.annotation, field]).validate_python(raw[name])
        except ValidationError:
            section = _section_class(field.annotation, raw[name])
            if section is not None:
                problems += _hidden_rule_problems(section, raw[name], f"{prefix}{name}.")
    if len(values) == len(cls.model_fields) and raw.keys() <= cls.model_fields.keys():
        # Every field is valid and none is unknown: pydantic has run this model's rules.
        return problems
    partial = cls.model_construct(**values)
    # model_construct fills an invalid field with its default: remove it, so a rule reading it is skipped.
    for name in cls.model_fields.keys() - values.keys():
        partial.__dict__.pop(name, None)
    for decorator in cls.__pydantic_decorators__.model_validators.values():
        if decorator.info.mode != "after":
            continue
        try:
            decorator.func(partial)
        except ValueError as err:
            problems += [line.replace("@", prefix) for line in str(err).splitlines()]
        except (AttributeError, TypeError):
            continue
    return problems


def validate_profile(raw: dict[str, Any]) -> JobProfile:
    try:
        return JobProfile.model_validate(raw)
    except ValidationError as err:
        problems = format_errors(err)
        problems += [line for line in _hidden_rule_problems(JobProfile, raw) if line not in problems]
        raise ProfileError(problems) from None


def load_profile(name_or_path: str | Path, overrides: list[str] | None = None) -> JobProfile:
    """Read, override and validate a profile; raise ProfileError listing every problem at once: duplicate keys,
    overrides that cannot apply and the schema's problems together."""
    path = resolve_profile_path(name_or_path)
    raw, problems = _read_yaml(path)
    problems += _override_problems(raw, overrides or [])
    try:
        profile = validate_profile(raw)
    except ProfileError as err:
        problems += err.problems
    if problems:
        raise ProfileError(problems)
    return profile


def json_schema() -> dict[str, Any]:
    return JobProfile.model_json_schema()
