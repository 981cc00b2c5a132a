"""Chat records: role names mapped onto the canonical roles, conversations rendered through a chat template into
token pieces that say which tokens are trained (the assistant's, optionally their headers, or all: data.train_on),
and the document's closing end-of-sequence.

A template with `{% generation %}` blocks marks the assistant's tokens itself: the conversation is rendered once and
the marked spans are trained. A template without them is rendered by growing prefixes (each message owns the tokens
it adds), which holds only when rendering more turns never changes the earlier ones; that is checked, and a
conversation whose earlier turns the template rewrites (Qwen3 drops the think blocks of all but the last assistant
turn) is refused rather than trained on the wrong tokens. With data.train_on: all the conversation is rendered once and
every token is trained.

A template given in the profile (data.chat_template) replaces the tokenizer's; either is rendered once per rendering
by transformers' sandboxed Jinja environment, so a template cannot reach Python objects beyond the data it is given,
under one limit on its time and on what it renders (tokenizer.render_template).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from itertools import groupby

from moe_tune.profiles import ProfileError, json_shown, shortened
from moe_tune.profiles.schema import DataProfile, is_chat_template_path, read_chat_template

# A tool's result (OpenAI's and transformers' "tool" role) goes to the template as it is, never trained.
CANONICAL_ROLES = ("system", "user", "assistant", "tool")
# A rendering's last tokens searched for the special token that closes a turn (closing_token).
TURN_END_WINDOW = 8
# transformers' own test for a template that can return the assistant tokens mask.
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")

Pieces = list[tuple[list[int], bool]]
# render(messages, add_generation_prompt, with_mask) -> (token ids, the template's assistant mask or None)
Render = Callable[[list[dict], bool, bool], tuple[list[int], list[int] | None]]


@dataclass(frozen=True)
class ChatOptions:
    """How chat records are rendered and which of their tokens are trained (data.train_on,
    data.train_on_assistant_header, data.chat_template)."""

    train_on: str = "assistant"  # "assistant" | "all"
    train_header: bool = False
    template: str | None = None  # the template's text; None: the tokenizer's own (or the built-in format)

    @property
    def trains_all(self) -> bool:
        return self.train_on == "all"


DEFAULT_CHAT_OPTIONS = ChatOptions()


def chat_options(data: DataProfile) -> ChatOptions:
    """The chat options of a DataProfile, its template read (ProfileError naming data.chat_template when the file
    changed since the profile was checked)."""
    template = data.chat_template
    if template is not None:
        template = _template_text(template, *_file_stamp(template))
    return ChatOptions(data.train_on, data.train_on_assistant_header, template)


def _file_stamp(value: str) -> tuple:
    # A template file is read again when it changes; inline text needs no stamp.
    if not is_chat_template_path(value):
        return ()
    try:
        st = os.stat(value)
    except (OSError, ValueError):
        return ()
    return st.st_mtime_ns, st.st_size, st.st_ino


@lru_cache(maxsize=8)
def _template_text(value: str, *stamp) -> str:
    text, problems = read_chat_template(value, "data.chat_template")
    if problems:
        raise ProfileError(problems)
    return text


# The most characters of a record's role a message line shows: a long one (a record's text put in its role) would push
# the rule past the line's end.
ROLE_CHARS = 60


def canonical_messages(messages: list[dict], roles: Mapping[str, str], where: str) -> list[dict]:
    """The messages with their roles mapped through `roles` (data.roles); ProfileError naming the record and every
    role that is not system, user, assistant or tool after the mapping, or a `weight` (turn_trains) other than 0 or 1
    or on a message other than the assistant's."""
    mapped = [m if m["role"] not in roles else {**m, "role": roles[m["role"]]} for m in messages]
    unknown = list(dict.fromkeys(m["role"] for m in mapped if m["role"] not in CANONICAL_ROLES))
    if unknown:
        named = ", ".join(shortened(repr(role), ROLE_CHARS) for role in unknown)
        example = ", ".join(f"{shortened(_yaml_key(role), ROLE_CHARS)}: {_likely_role(role)}" for role in unknown)
        noun = "role" if len(unknown) == 1 else "roles"
        raise ProfileError([f"{where}: message {noun} {named} must be one of {', '.join(CANONICAL_ROLES)}; map record "
                            f"roles onto them with data.roles, e.g. --set 'data.roles={{{example}}}'"])
    for turn, message in enumerate(mapped, 1):
        if message.get("weight") is None:  # a table's messages without one hold null
            continue
        weight, role = message["weight"], message["role"]
        shown = json_shown(weight, 40)
        if role != "assistant":
            raise ProfileError([f"{where}: turn {turn} ({role}) has a weight ({shown}): only an assistant turn's "
                                "weight says whether it is trained (0: not, 1: as any)"])
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
            raise ProfileError([f"{where}: turn {turn} (assistant): weight ({shown}) must be 0 (the turn is not "
                                "trained) or 1 (it is)"])
    return mapped


def turn_trains(message: dict, writes_reasoning: bool = True) -> bool:
    """Whether an assistant message is trained with train_on: assistant: all but those whose `weight` is 0 (OpenAI's
    chat fine-tuning format, axolotl's ShareGPT) and those that say nothing (blank content, no tool call, no
    reasoning that is not blank, none at all where the rendering writes none: the built-in format; its closing token
    alone would teach the model to stop at once, as a blank text would), which stay in the conversation as context."""
    reasoning = message.get("reasoning_content") if writes_reasoning else None
    says = _has_content(message) or message.get("tool_calls") or (isinstance(reasoning, str) and reasoning.strip())
    return message.get("weight") != 0 and bool(says)


def _likely_role(role: str) -> str:
    lowered = role.strip().lower()
    if lowered in CANONICAL_ROLES:
        return lowered
    return _LIKELY_ROLES.get(lowered, "user")


# Roles other tools' records use, and the canonical role each means: OpenAI's `developer` instructions are a system
# prompt; assistants by the names datasets give them; tool calls and their results.
_LIKELY_ROLES = {
    "human": "user", "person": "user", "customer": "user", "question": "user", "prompt": "user", "instruction": "user",
    "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "claude": "assistant", "gemini": "assistant", "llm": "assistant", "agent": "assistant",
    "response": "assistant", "answer": "assistant", "output": "assistant", "function_call": "assistant",
    "developer": "system", "context": "system",
    "function": "tool", "ipython": "tool", "observation": "tool", "tool_result": "tool", "function_response": "tool",
}  # fmt: skip


def check_tool_calls(messages: list[dict], where: str) -> None:
    """ProfileError naming the record when a message's tool_calls is not a list of calls (objects whose 'function'
    names it), or sits on a message other than the assistant's."""
    for turn, message in enumerate(messages, 1):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if message["role"] != "assistant":
            raise ProfileError([f"{where}: turn {turn} ({message['role']}) has 'tool_calls'; only an assistant "
                                "message calls tools"])
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls
        ):  # fmt: skip
            raise ProfileError([f"{where}: turn {turn}'s 'tool_calls' must be a list of calls, each an object whose "
                                "'function' object has a 'name' string"])


def refuse_tools_without_template(messages: list[dict], tools: list[dict] | None, where: str) -> None:
    """ProfileError naming the record for tool calls or tool definitions where no chat template writes them (the
    built-in <|role|> format has no way to)."""
    if any(m.get("tool_calls") for m in messages):
        raise ProfileError([f"{where}: a message with tool_calls needs a chat template that writes them "
                            "(data.chat_template, or the tokenizer's); the built-in <|role|> format has none"])
    if tools:
        raise ProfileError([f"{where}: 'tools' needs a chat template that writes them (data.chat_template, or the "
                            "tokenizer's); the built-in <|role|> format has none"])


def check_tools_written(messages: list[dict], ids: list[int], trained: list[bool], decode, where: str) -> None:
    """ProfileError naming the record when the chat template left out a tool call (its function's name in no
    trained token) or a tool result (its text nowhere in the rendering): a template without a branch for them
    would train an empty turn, or an answer to a result the model never saw."""
    calls = [(turn, call["function"]["name"], turn_trains(m))
             for turn, m in enumerate(messages, 1) for call in m.get("tool_calls") or []]  # fmt: skip
    results = [(turn, m["content"].strip()) for turn, m in enumerate(messages, 1)
               if m["role"] == "tool" and isinstance(m.get("content"), str) and m["content"].strip()]  # fmt: skip
    if not calls and not results:
        return
    # Compared without whitespace: a tokenizer's decoding may clean the spaces around punctuation.
    trained_text = "".join(decode([t for t, keep in zip(ids, trained) if keep]).split())
    text = "".join(decode(ids).split())
    for turn, name, is_trained in calls:
        # A turn of weight 0 is context: its call must be written, not trained.
        if "".join(name.split()) not in (trained_text if is_trained else text):
            written = "no trained token of" if is_trained else "nothing of"
            raise ProfileError([f"{where}: the chat template writes {written} turn {turn}'s call of {name!r}: a "
                                "template must write an assistant's tool_calls (data.chat_template, or the "
                                "tokenizer's)"])
    for turn, result in results:
        if "".join(result.split()) not in text:
            raise ProfileError([f"{where}: the chat template does not write turn {turn} (tool)'s result: a template "
                                "must write tool messages (data.chat_template, or the tokenizer's)"])



def _yaml_key(role: str) -> str:
    # A YAML double-quoted string is JSON's: it writes any role, controls escaped, inside the hint's shell quotes.
    return role if re.fullmatch(r"[A-Za-z_][\w-]*", role) else json.dumps(role)


@lru_cache(maxsize=8)
def has_generation_blocks(template: str) -> bool:
    return bool(GENERATION_BLOCK.search(template))


def pieces_from_mask(ids: list[int], mask: list[int]) -> Pieces:
    """Runs of equal mask values as pieces (token ids, trained?)."""
    pieces: Pieces = []
    start = 0
    for is_trained, run in groupby(mask, key=bool):
        end = start + sum(1 for _ in run)
        pieces.append((ids[start:end], is_trained))
        start = end
    return pieces


def render_conversation(
    render: Render,
    messages: list[dict],
    where: str,
    options: ChatOptions,
    template: str,
    closes_turn: Callable[[int], bool],
    is_blank: Callable[[int], bool],
    probes: TemplateProbes,
) -> Pieces:
    """Pieces of a conversation rendered by the chat template `template` (its text), trained as `options` say:
    train_on all renders it once and trains every token; a template with {% generation %} blocks is rendered once
    and its marked spans trained (with their headers: mark_headers; with the turn's closing token where the template
    renders it after the span); any other is rendered by growing prefixes (render_by_prefixes). `probes` keeps what
    the template renders for the probe conversation (its closing token, its generation prompt) for the next
    conversation."""
    if options.trains_all:
        ids, _ = render(messages, False, False)
        return [(ids, True)] if ids else []

    def prefix_render(prefix: list[dict], add_generation_prompt: bool) -> list[int]:
        return render(prefix, add_generation_prompt, False)[0]

    def prompt() -> list[int]:
        return probes.generation_prompt(template, prefix_render)

    if has_generation_blocks(template):
        ids, mask = render(messages, False, True)
        if not any(mask) and (turn := next((i for i, m in enumerate(messages, 1)
                                             if m["role"] == "assistant" and _has_content(m)), None)):  # fmt: skip
            raise ProfileError([_DROPPED.format(where=where, turn=turn)])
        close = _template_close(lambda prefix: prefix_render(prefix, False), messages, template, probes, closes_turn,
                                is_blank)  # fmt: skip
        if close is not None:
            mask = _with_closing_tokens(ids, mask, close, is_blank)
        if options.train_header:
            mask = mark_headers(render, messages, ids, mask, where, prompt)
        bounded = _within_budget(prefix_render, messages, where)
        for turn, message in enumerate(messages, 1):
            if message["role"] == "assistant" and not turn_trains(message):
                start, end = _turn_span(bounded, messages, turn, ids, where)
                mask[start:end] = [0] * (end - start)
        return pieces_from_mask(ids, mask)
    return render_by_prefixes(prefix_render, messages, where, closes_turn, is_blank, options.train_header, prompt)


# The longest the renderings of one record by growing prefixes (render_by_prefixes, _turn_span) may take in all:
# each is bounded by the tokenizer's own limit, but a conversation of thousands of turns is rendered once per turn.
PREFIX_RENDER_LIMIT_S = 60.0


def _within_budget(render: Callable[[list[dict], bool], list[int]], messages: list[dict],
                   where: str) -> Callable[[list[dict], bool], list[int]]:  # fmt: skip
    """`render`, refusing the record (ProfileError) once its renderings have taken PREFIX_RENDER_LIMIT_S in all."""
    started = time.monotonic()

    def bounded(prefix: list[dict], add_generation_prompt: bool) -> list[int]:
        if time.monotonic() - started > PREFIX_RENDER_LIMIT_S:
            raise ProfileError([
                f"{where}: rendering the conversation ({len(messages)} messages) turn by turn took more than "
                f"{PREFIX_RENDER_LIMIT_S:g} s: a chat template without {{% generation %}} markers is rendered once per "
                "assistant turn; split the record, or give data.chat_template a template that marks the assistant's "
                "tokens"
            ])  # fmt: skip
        return render(prefix, add_generation_prompt)

    return bounded


def _turn_span(render: Callable[[list[dict], bool], list[int]], messages: list[dict], turn: int, ids: list[int],
               where: str) -> tuple[int, int]:
    """The tokens of `ids` (the whole conversation's rendering) that turn `turn` adds: from the end of the rendering
    of the turns before it to the end of the rendering that ends with it (its header, content and closing tokens).
    ProfileError naming the turn when either is not a prefix of `ids` (a template that renders a turn differently
    once later turns follow)."""
    before, through = render(messages[: turn - 1], False), render(messages[:turn], False)
    for prefix, last in ((before, turn - 1), (through, turn)):
        if prefix != ids[: len(prefix)]:
            at = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
            why, fix = ("has weight 0", "drop its weight") if messages[turn - 1].get("weight") == 0 else (
                "says nothing (blank content)", "give it content")
            raise ProfileError([
                f"{where}: turn {turn} (assistant) {why}, but the chat template renders the turns up to turn {last} "
                f"differently once later turns follow (token {at} changes): the turn's tokens cannot be told apart to "
                f"leave them untrained; {fix}, or drop the turns after it"
            ])  # fmt: skip
    return len(before), len(through)


# An assistant message with content of which the chat template renders no trained token: the record would train its
# closing <eos> alone.
_DROPPED = ("{where}: the chat template renders no token of turn {turn} (assistant) to train: a template must render "
            "every message's content (data.chat_template, or the tokenizer's)")


def _template_close(render: Callable[[list[dict]], list[int]], messages: list[dict], template: str,
                    probes: TemplateProbes, closes_turn: Callable[[int], bool],
                    is_blank: Callable[[int], bool]) -> int | None:
    """The token the template closes an assistant turn with (<|im_end|>), found from the probe conversation (kept in
    `probes`); where the template refuses that probe (one that wants a system turn first), from the record's own
    conversation up to its first assistant turn (None when it has none)."""
    close = probes.closing_token(template, render, closes_turn, is_blank)
    if close is not Probe.REFUSED:
        return close
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    try:
        return None if first is None else _last_closer(render(messages[: first + 1]), closes_turn, is_blank)
    except ProfileError:
        return None


_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class Probe(Enum):
    """A probe's outcome that is no token: REFUSED, the template raised on the probe conversation."""

    REFUSED = "refused"


@dataclass
class TemplateProbes:
    """What each chat template (keyed by its text) renders for the probe conversation (_PROBE), found on its first
    record and kept for every later one, a refusal of the probe too: a template that wants a system turn first is not
    rendered once more, to fail, on each record."""

    closing_tokens: dict[str, int | None | Probe] = field(default_factory=dict)
    generation_prompts: dict[str, list[int]] = field(default_factory=dict)

    def closing_token(self, template: str, render: Callable[[list[dict]], list[int]],
                      closes_turn: Callable[[int], bool], is_blank: Callable[[int], bool]) -> int | None | Probe:
        """The token the template closes the probe's assistant turn with (None: none), Probe.REFUSED where the
        template refuses the probe."""
        if template not in self.closing_tokens:
            try:
                self.closing_tokens[template] = _last_closer(render(_PROBE), closes_turn, is_blank)
            except ProfileError:
                self.closing_tokens[template] = Probe.REFUSED
        return self.closing_tokens[template]

    def generation_prompt(self, template: str, render: Callable[[list[dict], bool], list[int]]) -> list[int]:
        """The ids the template's generation prompt adds after a user turn ([] when it adds none, or refuses the
        probe)."""
        if template not in self.generation_prompts:
            self.generation_prompts[template] = generation_prompt(render)
        return self.generation_prompts[template]


def _last_closer(ids: list[int], closes_turn: Callable[[int], bool], is_blank: Callable[[int], bool]) -> int | None:
    """The last token of `ids` that is not blank, when it closes a turn (`closes_turn`); None otherwise."""
    for token in reversed(ids):
        if closes_turn(token):
            return token
        if not is_blank(token):
            return None
    return None


def _with_closing_tokens(ids: list[int], mask: list[int], close: int, is_blank: Callable[[int], bool]) -> list[int]:
    """The mask with each marked span's closing token marked too, where the template renders it after the span
    (`{% generation %}{{ content }}{% endgeneration %}<|im_end|>`), blank tokens between them with it: the turn's end is
    what teaches the model to stop."""
    marked = list(mask)
    for end in (i for i in range(1, len(mask)) if mask[i - 1] and not mask[i]):
        after = end
        while after < len(ids) and is_blank(ids[after]) and not mask[after]:
            after += 1
        if after < len(ids) and ids[after] == close and not mask[after]:
            marked[end : after + 1] = [1] * (after + 1 - end)
    return marked


def _has_content(message: dict) -> bool:
    """Whether a message's content says something: a string that is not blank, or parts of which one is an image
    or a text that is not blank."""
    content = message.get("content")
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(not isinstance(part, dict) or part.get("type") != "text" or str(part.get("text", "")).strip()
                   for part in content)  # fmt: skip
    return bool(content)


def mark_headers(render: Render, messages: list[dict], ids: list[int], mask: list[int], where: str,
                 prompt: Callable[[], list[int]]) -> list[int]:
    """The template's assistant mask with each marked span's header marked too: the tokens the generation prompt adds
    to the conversation before an assistant turn (render(prefix, True) past render(prefix, False)), where they are
    rendered right before the span. A turn the assistant opens has no prefix to render (transformers renders no empty
    conversation): its header is the generation prompt after a user turn (`prompt()`), or the longest start of it
    rendered right before the first span (opening_turn's rule). ProfileError naming the record when no span has
    one."""
    headers = set()
    opening: list[int] = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn == 0:
            opening = prompt()
            headers.update([tuple(opening)] if opening else [])
            continue
        try:
            plain, prompted = render(messages[:turn], False, False)[0], render(messages[:turn], True, False)[0]
        except ProfileError:
            # A template that cannot render this prefix alone gives no header from it; other turns may.
            continue
        if len(prompted) > len(plain) and prompted[: len(plain)] == plain:
            headers.add(tuple(prompted[len(plain) :]))
    marked = list(mask)
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    found = False
    longest_first = sorted(headers, key=len, reverse=True)
    for index, start in enumerate(starts):
        candidates = longest_first
        if index == 0:
            candidates = longest_first + [tuple(opening[:n]) for n in range(len(opening) - 1, 0, -1)]
        for header in candidates:
            if start >= len(header) and tuple(ids[start - len(header) : start]) == header:
                marked[start - len(header) : start] = [1] * len(header)
                found = True
                break
    if starts and not found:
        raise ProfileError([f"{where}: data.train_on_assistant_header (true) needs the assistant header before the "
                            "tokens the chat template marks with {% generation %}, but its generation prompt is not "
                            "rendered there; set data.train_on_assistant_header: false"])
    return marked


def render_by_prefixes(
    render: Callable[[list[dict], bool], list[int]],
    messages: list[dict],
    where: str,
    closes_turn: Callable[[int], bool],
    is_blank: Callable[[int], bool],
    train_header: bool = False,
    prompt: Callable[[], list[int]] | None = None,
) -> Pieces:
    """Pieces of a conversation rendered by growing prefixes (`render(messages, add_generation_prompt)` -> ids): each
    message owns the tokens its prefix adds; an assistant message's tokens are trained from the end of the generation
    prompt (when that renders as a prefix; from its start with `train_header`, and always when it does not) to its
    closing token (`closes_turn`), blank tokens after it not. In a conversation the assistant opens, what the template
    renders before the turn (a default system prompt, <bos>) is never trained, nor its header but with `train_header`
    (opening_turn; `prompt()`: the generation prompt after a user turn, generation_prompt by default). The prefixes
    that end at an assistant turn or right before one must render as prefixes of the whole conversation, else
    ProfileError naming the turn; other turns are not rendered alone (Qwen's templates write consecutive tool results
    into one block, closed after the last)."""
    render = _within_budget(render, messages, where)
    full = render(messages, False)
    pieces: Pieces = []
    previous: list[int] = []

    def prefix(turn: int) -> list[int]:
        ids = full if turn == len(messages) else render(messages[:turn], False)
        if ids != full[: len(ids)] or len(ids) < len(previous):
            at = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
            raise ProfileError([
                f"{where}: the chat template renders turn {turn} ({messages[turn - 1]['role']}) differently once later "
                f"turns follow (token {at} changes): the assistant's tokens cannot be found by rendering growing "
                "prefixes; use a tokenizer whose chat template marks them with {% generation %} ... {% endgeneration %}"
            ])
        return ids

    for turn, message in enumerate(messages, 1):
        if message["role"] != "assistant" or not turn_trains(message):
            # Untrained, up to the next prefix rendered: the one before an assistant turn, or the whole.
            if turn == len(messages) or messages[turn]["role"] == "assistant" or message["role"] == "assistant":
                ids = prefix(turn)
                pieces.append((ids[len(previous) :], False))
                previous = ids
            continue
        ids = prefix(turn)
        if turn == 1:
            header = prompt() if prompt is not None else generation_prompt(render)
            before, start = opening_turn(render, message, ids, header, where, train_header)
        else:
            before = start = len(previous)
            prompted = render(messages[: turn - 1], True)
            if start <= len(prompted) <= len(ids) and prompted == ids[: len(prompted)]:
                start = len(prompted)
        end = len(ids)
        while end > start and is_blank(ids[end - 1]):
            end -= 1
        if not (end > start and closes_turn(ids[end - 1])):
            end = len(ids)
        if end == start and _has_content(message):
            raise ProfileError([_DROPPED.format(where=where, turn=turn)])
        pieces += [(ids[len(previous) : before], False), (ids[before:start], train_header), (ids[start:end], True),
                   (ids[end:], False)]
        previous = ids
    return [piece for piece in pieces if piece[0]]


def generation_prompt(render: Callable[[list[dict], bool], list[int]]) -> list[int]:
    """The ids the template's generation prompt adds after a user turn ([] when it adds none, or cannot render one)."""
    probe = _PROBE[:1]
    try:
        plain, prompted = render(probe, False), render(probe, True)
    except ProfileError:
        return []
    return prompted[len(plain) :] if prompted[: len(plain)] == plain else []


# Two contents that differ in their first character: renderings of a turn with each part where its content starts.
_CONTENT_PROBES = ("x", "y")


def opening_turn(render: Callable[[list[dict], bool], list[int]], message: dict, ids: list[int], header: list[int],
                 where: str, train_header: bool) -> tuple[int, int]:
    """(where the header starts, where the trained tokens start) in `ids`, the rendering of a conversation's first
    turn, the assistant's `message`; what comes before the header (a default system prompt, <bos>) is not the turn's.
    transformers renders no empty conversation, so the header is `header`, the generation prompt after a user turn,
    found at its first place in `ids`. Where the template renders the turn otherwise (a generation prompt with an
    empty think block the turn lacks, as Qwen3's without thinking; a turn opened by other tokens; no generation
    prompt), the trained tokens start where renderings of the turn with other contents part from `ids`, and the
    header is the longest start of `header` rendered right before them. ProfileError naming the record when those
    renderings fail, or, with `train_header`, when no header is rendered there."""
    for at in range(len(ids) - len(header) + 1) if header else ():
        if ids[at : at + len(header)] == header:
            return at, at + len(header)
    try:
        probes = [render([{**message, "content": content}], False) for content in _CONTENT_PROBES]
    except ProfileError:
        raise ProfileError([
            f"{where}: turn 1 (assistant) opens the conversation, and the chat template renders neither its "
            "generation prompt before it nor the turn with another content: what it renders before the turn cannot be "
            "told from the turn; use a chat template that marks the assistant's tokens with {% generation %} ... "
            "{% endgeneration %}"
        ]) from None
    start = _common_prefix_length(ids, *probes)
    length = next((n for n in range(min(len(header), start), 0, -1) if ids[start - n : start] == header[:n]), 0)
    if train_header and not length:
        raise ProfileError([
            f"{where}: data.train_on_assistant_header (true) needs the assistant header before turn 1 (assistant), "
            "which opens the conversation, but the chat template renders no part of its generation prompt there; set "
            "data.train_on_assistant_header: false"
        ])
    return start - length, start


def _common_prefix_length(*sequences: list[int]) -> int:
    return next((i for i, column in enumerate(zip(*sequences)) if len(set(column)) > 1), min(map(len, sequences)))


def ends_trained(messages: list[dict], options: ChatOptions, writes_reasoning: bool = True) -> bool:
    """Whether a conversation ends with a trained assistant turn (chat_tokens' `ends_with_assistant`): the last
    message is the assistant's, trained by train_on: all or by turn_trains (its weight, its content; its reasoning
    only where the rendering writes reasoning: a chat template, not the built-in format)."""
    if not messages or messages[-1]["role"] != "assistant":
        return False
    return options.trains_all or turn_trains(messages[-1], writes_reasoning)


def chat_tokens(pieces: Pieces, tok, ends_with_assistant: bool, options: ChatOptions) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation and whether each is trained: the tokenizer's document start first (none
    before a chat template's rendering: tok.document_start); a last assistant turn gets a trained <eos> unless the
    template closed it with a special token itself, so the end of a turn is never trained twice."""
    ids = tok.document_start(options)
    trained = [False] * len(ids)
    for piece, is_trained in pieces:
        ids += piece
        trained += [is_trained] * len(piece)
    if ends_with_assistant and not template_closes_turn(ids, tok):
        ids.append(tok.eos_id)
        trained.append(True)
    return ids, trained


def template_closes_turn(ids: list[int], tok) -> bool:
    """Whether the last token of the rendering that is not blank is a special token that can end a turn."""
    return closing_token(ids, tok) is not None


def closing_token(ids: list[int], tok) -> int | None:
    """The special token that ends the rendering, blank tokens after it aside, when it can end a turn (such as
    <|im_end|> or the tokenizer's <eos>; not a <bos> or <pad> other than the <eos>: GPT-2's <|endoftext|> is all
    three); None otherwise."""
    token = _last_closer(ids[-TURN_END_WINDOW:], lambda t: t in tok.special_ids, tok.is_blank)
    if token is None or (token in (tok.bos_id, tok.pad_id) and token != tok.eos_id):
        return None
    return token
