"""Record formats (data.format): text, messages, alpaca and ShareGPT records, the last two mapped onto messages so
every chat goes through one path (chat.canonical_messages, the tokenizer's chat template, chat.chat_tokens).

  text      {"text": "..."}                                     (key: data.text_field)
  messages  {"messages": [{"role", "content"}], "images"?: [...]}  (key: data.messages_field)
  alpaca    {"instruction", "input"?, "output", "system"?, "history"?: [[query, response], ...]}
            -> system?, (user query, assistant response) per history pair, user instruction + "\n" + input (input
            only when not empty, as LLaMA-Factory joins them), assistant output
  sharegpt  {"conversations": [{"from", "value"}], "system"?}
            -> roles through data.roles, else ShareGPT's own names (human: user, gpt: assistant, system: system)

auto picks the format of a source from its first record (the first key found of: messages, conversations,
instruction + output, text); every later record of the source must have the same format, except that text and
messages records may share a source (each read by its own keys, as JSONL data always was). A record that holds the keys
of two formats is read as the first, and the source's summary line counts the records whose other keys went unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile

FORMATS = ("text", "messages", "alpaca", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class FormatChoice:
    name: str  # one of FORMATS
    why: str  # e.g. "first record has instruction/output" or "data.format"

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


def detect_format(record: object, profile: DataProfile) -> str | None:
    """The format a record's keys say, None when no format's keys are there."""
    if not isinstance(record, dict):
        return None
    if profile.messages_field in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if profile.text_field in record:
        return "text"
    return None


def unread_keys(record: dict, name: str, profile: DataProfile) -> tuple[str, ...]:
    """The keys (format_keys) by which `record` is also a record of another format than `name`, which reading it as
    `name` leaves unread (tatsu-lab/alpaca's rendered 'text' beside its 'instruction' and 'output'); keys holding
    null, "" or [] say nothing."""
    return tuple(format_keys(other, profile) for other in FORMATS
                 if other != name and all(record.get(key) not in (None, "", [])
                                          for key in format_keys(other, profile).split("/")))  # fmt: skip


def same_family(a: str, b: str) -> bool:
    """Whether records of formats a and b may share a source under auto: text and messages may."""
    native = ("text", "messages")
    return a == b or (a in native and b in native)


def format_keys(name: str, profile: DataProfile) -> str:
    """The keys that say a format, as messages show them."""
    return {"messages": profile.messages_field, "sharegpt": "conversations", "alpaca": "instruction/output",
            "text": profile.text_field}[name]


def no_format(record: object, profile: DataProfile) -> str:
    """Why no format matches a record (the line after `where: `)."""
    if not isinstance(record, dict):
        return f"a record must be a JSON object, got {type(record).__name__}"
    return (f"a record needs a '{profile.text_field}' or a '{profile.messages_field}' key, or alpaca's "
            f"'instruction' and 'output', or sharegpt's 'conversations' (has: {_keys(record)})")


def column_problems(name: str, profile: DataProfile, columns: dict[str, str] | None, path) -> list[str]:
    """A table's (Parquet, saved dataset) columns against what `name` records read: one line per missing or
    mistyped column, so a bad column is one problem, not one per row."""
    if columns is None:
        return []
    required, optional = _columns(name, profile)
    problems = [f"{path}: has no column '{column}', which {name} records need (columns: {', '.join(columns)})"
                for column in required if column not in columns]
    for column, kind in {**required, **optional}.items():
        if column in columns and columns[column] not in (kind, "null"):
            problems.append(f"{path}: column '{column}' holds {columns[column]} values; {name} records read it as a "
                            f"{kind}")
    return problems


def _columns(name: str, profile: DataProfile) -> tuple[dict[str, str], dict[str, str]]:
    """(required, optional) columns of a format and their kinds."""
    images = {"images": "list"}
    return {
        "text": ({profile.text_field: "string"}, {}),
        "messages": ({profile.messages_field: "list"}, images),
        "alpaca": ({"instruction": "string", "output": "string"},
                   {"input": "string", "system": "string", "history": "list", **images}),
        "sharegpt": ({"conversations": "list"}, {"system": "string", **images}),
    }[name]


def to_record(record: object, name: str, profile: DataProfile, where: str) -> dict:
    """A record of format `name` as the record the text and chat paths read ({text_field} or {messages_field}, with
    its images, and a chat its tool definitions); ProfileError naming the record when it is not a record of that
    format."""
    if not isinstance(record, dict):
        raise ProfileError([f"{where}: {no_format(record, profile)}"])
    images = {"images": record["images"]} if "images" in record else {}
    # Tool definitions go with a chat whatever its format.
    carried = {**images, **({"tools": record["tools"]} if "tools" in record else {})}
    if name == "text":
        if profile.text_field not in record:
            raise ProfileError([f"{where}: a text record needs a '{profile.text_field}' key (has: {_keys(record)})"])
        return {profile.text_field: record[profile.text_field], **images}
    if name == "messages":
        if profile.messages_field not in record:
            raise ProfileError([f"{where}: a messages record needs a '{profile.messages_field}' key (has: "
                                f"{_keys(record)})"])
        return record
    if name == "alpaca":
        return {profile.messages_field: _alpaca_messages(record, where), **carried}
    if name == "sharegpt":
        return {profile.messages_field: _sharegpt_messages(record, profile, where), **carried}
    raise AssertionError(f"unknown data format {name!r}")


def _alpaca_messages(record: dict, where: str) -> list[dict]:
    missing = [key for key in ("instruction", "output") if key not in record]
    if missing:
        raise ProfileError([f"{where}: an alpaca record needs 'instruction' and 'output' keys (has: {_keys(record)})"])
    for key, is_optional in (("instruction", False), ("output", False), ("input", True), ("system", True)):
        value = record.get(key)
        if not (isinstance(value, str) or (is_optional and value is None)):
            also = " or null" if is_optional else ""
            raise ProfileError([f"{where}: alpaca '{key}' must be a string{also}, got {type(value).__name__}"])
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history
    ):
        raise ProfileError([f"{where}: alpaca 'history' must be a list of [query, response] string pairs"])
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for query, response in history:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
    prompt = record["instruction"] + ("\n" + record["input"] if record.get("input") else "")
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def _sharegpt_messages(record: dict, profile: DataProfile, where: str) -> list[dict]:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns
    ):
        raise ProfileError([f"{where}: sharegpt 'conversations' must be a list of {{\"from\": str, \"value\": str}}"])
    system = record.get("system")
    if not (system is None or isinstance(system, str)):
        raise ProfileError([f"{where}: sharegpt 'system' must be a string or null, got {type(system).__name__}"])
    # data.roles maps a name itself (in chat.canonical_messages); ShareGPT's own names map here.
    messages = [{"role": "system", "content": system}] if system else []
    # A turn's `weight` (axolotl's ShareGPT, as OpenAI's messages) goes with it: chat.turn_trains reads it.
    return messages + [
        {"role": t["from"] if t["from"] in profile.roles else SHAREGPT_ROLES.get(t["from"], t["from"]),
         "content": t["value"], **({"weight": t["weight"]} if "weight" in t else {})}
        for t in turns
    ]


def _keys(record: dict) -> str:
    """The record's keys as a sorted list, at most 12 shown (a record may have a million)."""
    names = sorted(str(k) for k in record)
    return str(names) if len(names) <= 12 else str(names[:12])[:-1] + f", ... {len(names) - 12} more]"
