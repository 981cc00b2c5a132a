"""Tokenizers: the built-in byte-level one (the tiny default) and any tokenizer directory transformers can read."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from moe_tune.profiles import ProfileError, error_line

from .chat import (
    DEFAULT_CHAT_OPTIONS,
    ChatOptions,
    Pieces,
    has_generation_blocks,
    refuse_tools_without_template,
    render_conversation,
)

CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
# The longest one rendering of a conversation by a chat template may take (a template looping for ever is refused
# then; a legitimate rendering of a 64 MiB record takes seconds at most).
RENDER_LIMIT_S = 60.0
# The most text a template may render beyond RENDERED_PER_CONTENT_CHAR characters per character of the messages'
# contents (headers, a default system prompt, tool descriptions fit; '{{ "x" * 10**8 }}' does not).
RENDERED_EXTRA_CHARS = 2**20
RENDERED_PER_CONTENT_CHAR = 4


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    special_ids: frozenset[int]  # tokens a chat template may close a turn with

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def is_blank(self, token: int) -> bool:
        """Whether the token decodes to whitespace only."""
        ...

    def render_chat(self, messages: list[dict], where: str = "", options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                    tools: list[dict] | None = None) -> Pieces:
        """Token pieces of a conversation of canonical roles, each with whether it is trained on (as `options`
        say: the assistant's tokens, with their headers, or all), the record's `tools` (function definitions) given
        to the template as transformers gives them; ProfileError naming `where` (the record) when the chat template
        cannot render it faithfully."""
        ...

    def render_ids(self, messages: list[dict], options: ChatOptions, add_generation_prompt: bool,
                   where: str) -> list[int] | None:
        """The ids of a conversation rendered by the chat template rendering uses (options.template, else the
        tokenizer's own), with the generation prompt when asked; None when there is none (the built-in format)."""
        ...

    def document_start(self, options: ChatOptions | None) -> list[int]:
        """The tokens a document starts with before its text (`options` None) or its rendered conversation (chat
        `options`): what the tokenizer itself puts before a text, as `tokenizer(text)` gives it; nothing before a
        chat template's rendering, which renders what comes first itself."""
        ...


def render_plain_chat(encode, messages: list[dict], options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                      where: str = "", tools: list[dict] | None = None) -> Pieces:
    """Messages in CHAT_TEMPLATE, for tokenizers without a chat template: the assistant's content and the newline
    closing it trained, its header '<|assistant|>\\n' only with options.train_header (every token with train_on all).
    Each message is encoded whole; where its header's tokens do not open it, the header is trained with the turn.
    ProfileError naming the record (`where`) for tool calls or tool definitions, which the format has no way to
    write."""
    refuse_tools_without_template(messages, tools, where)
    header_format = CHAT_TEMPLATE.split("{content}")[0]
    pieces: Pieces = []
    for m in messages:
        is_trained = options.trains_all or m["role"] == "assistant"
        ids = encode(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]))
        header = encode(header_format.format(role=m["role"]))
        cut = len(header) if ids[: len(header)] == header else 0
        pieces += [(ids[:cut], is_trained and (options.trains_all or options.train_header)), (ids[cut:], is_trained)]
    return [piece for piece in pieces if piece[0]]


def render_template_text(template: str, messages: list[dict], add_generation_prompt: bool, with_mask: bool, where: str,
                         tools: list[dict] | None = None, **special_tokens) -> tuple[str, list[bool] | None]:
    """A conversation (and its `tools`) rendered to text by data.chat_template in transformers' sandboxed Jinja
    environment, and with `with_mask` which characters its {% generation %} blocks mark; ProfileError naming the
    record and the field."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with template_errors(where, "data.chat_template", template):
        (text,), indices = render_jinja_template(
            [messages], tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=with_mask, **special_tokens,
        )
    # The record's own text: contents, tool calls' arguments, the tool definitions.
    content_chars = sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages)
    content_chars += sum(len(json.dumps(m["tool_calls"], default=str)) for m in messages if m.get("tool_calls"))
    content_chars += len(json.dumps(tools, default=str)) if tools else 0
    if len(text) > (most := RENDERED_EXTRA_CHARS + RENDERED_PER_CONTENT_CHAR * content_chars):
        raise ProfileError([f"{where}: data.chat_template renders {len(text)} characters from messages of "
                            f"{content_chars}, more than {most}: a template renders the conversation, not more"])
    if not with_mask:
        return text, None
    mask = [False] * len(text)
    for start, end in indices[0]:
        mask[start:end] = [True] * (end - start)
    return text, mask


@contextmanager
def template_errors(where: str, source: str, template: str | None) -> Iterator[None]:
    """Errors of a chat template's rendering (its own raise_exception, a sandbox refusal, a bad value, any error it
    raises, RENDER_LIMIT_S run past) as one ProfileError line naming the record and the template. A template that ran
    past the limit once is refused at once on every later record (`template` None: the tokenizer's own)."""
    import jinja2

    key = (source, template)
    if key in _TIMED_OUT:
        raise ProfileError([f"{where}: {source} cannot render the conversation: it ran past {RENDER_LIMIT_S:g} s on "
                            f"{_TIMED_OUT[key]}"])  # fmt: skip
    try:
        with _time_limit(RENDER_LIMIT_S):
            yield
    except Exception as err:  # noqa: BLE001 - the template is the user's code: whatever it raises is its problem
        if isinstance(err, RenderTimeout):
            _TIMED_OUT[key] = where
        first_line = error_line(err, (jinja2.TemplateError, ValueError, TypeError, KeyError, RenderTimeout))
        raise ProfileError([f"{where}: {source} cannot render the conversation: {first_line!r:.200}"]) from None


# (source, template) of the templates that ran past RENDER_LIMIT_S in this process -> the record where they did.
_TIMED_OUT: dict[tuple[str, str | None], str] = {}


class RenderTimeout(Exception):
    """A chat template's rendering ran past RENDER_LIMIT_S."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """RenderTimeout in the block once it has run `seconds` (SIGALRM: the main thread of a Unix process only; an
    interval timer set outside is put back, less the time spent)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise RenderTimeout(f"rendering took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (seconds - left), 1e-3))


class ByteTokenizer:
    """UTF-8 bytes 0..255, then <bos> 256, <eos> 257, <pad> 258."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    special_ids = frozenset((256, 257, 258))

    def __init__(self):
        # The token each chat template closes its assistant turns with (chat.render_conversation).
        self._turn_closes: dict[str | None, int | None] = {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def is_blank(self, token: int) -> bool:
        return token < 256 and chr(token).isspace()

    def render_chat(self, messages: list[dict], where: str = "", options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                    tools: list[dict] | None = None) -> Pieces:
        if options.template is None:
            return render_plain_chat(self.encode, messages, options, where, tools)
        template = options.template

        def render(prefix: list[dict], add_generation_prompt: bool, with_mask: bool):
            # Special tokens are ids, not text, here: the template renders them empty; <bos> and a closing <eos>
            # are added around the rendering (chat_tokens).
            text, char_mask = render_template_text(template, prefix, add_generation_prompt, with_mask, where, tools,
                                                   bos_token="", eos_token="")
            ids = self.encode(text)
            if char_mask is None:
                return ids, None
            return ids, [int(m) for ch, m in zip(text, char_mask) for _ in range(len(ch.encode("utf-8")))]

        return render_conversation(render, messages, where, options, has_generation_blocks(template),
                                   lambda t: t in self.special_ids, self.is_blank, self._turn_closes)

    def render_ids(self, messages: list[dict], options: ChatOptions, add_generation_prompt: bool,
                   where: str) -> list[int] | None:
        if options.template is None:
            return None
        # Special tokens are ids, not text, here: the template renders them empty.
        text, _ = render_template_text(options.template, messages, add_generation_prompt, False, where,
                                       bos_token="", eos_token="")
        return self.encode(text)

    def document_start(self, options: ChatOptions | None) -> list[int]:
        # Its templates render <bos> empty (it is an id, not text): every document starts with it.
        return [self.bos_id]


class HFTokenizer:
    """A tokenizer directory read by transformers (local files only, no remote code)."""

    def __init__(self, directory: Path):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ProfileError([f"data.tokenizer ('{directory}') needs transformers: pip install transformers"]) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except Exception as err:  # noqa: BLE001 - files of the user's folder: a KeyError of a malformed tokenizer.json too
            reason = error_line(err, (OSError, ValueError))
            raise ProfileError([f"data.tokenizer ('{directory}') cannot be loaded: {reason}"]) from None
        self.vocab_size = len(self._tok)
        # The token each chat template closes its assistant turns with (chat.render_conversation).
        self._turn_closes: dict[str | None, int | None] = {}
        self.bos_id = self._tok.bos_token_id
        # None: the tokenizer defines none, and no document can be ended (dataset.load_splits refuses it).
        self.eos_id = self._tok.eos_token_id
        # Padding is neither predicted nor attended to: any id does where the tokenizer names none.
        pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.pad_id = pad if pad is not None else 0
        added = self._tok.added_tokens_decoder
        # <unk> stands for text the vocabulary lacks: it never closes a turn.
        special = set(self._tok.all_special_ids) | {i for i, t in added.items() if t.special}
        self.special_ids = frozenset(special - {self._tok.unk_token_id})
        self._text_start = self._leading_special_ids()

    def _leading_special_ids(self) -> list[int]:
        """The ids the tokenizer's own post-processing puts before a text (Llama's <s>; none for Qwen's or
        gpt-oss's), found by encoding a text with and without its special tokens."""
        plain = self._tok.encode("a", add_special_tokens=False)
        full = self._tok.encode("a", add_special_tokens=True)
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        return full[:at]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def is_blank(self, token: int) -> bool:
        return token not in self.special_ids and not self._tok.decode([token]).strip()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict], where: str = "", options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                    tools: list[dict] | None = None) -> Pieces:
        if options.template is None and not self.has_chat_template:
            return render_plain_chat(self.encode, messages, options, where, tools)
        source = "data.chat_template" if options.template is not None else "the chat template of data.tokenizer"
        try:
            template = self._tok.get_chat_template(options.template)
        except ValueError as err:
            raise ProfileError([f"data.tokenizer: no usable chat template ({str(err).strip()[:200]!r})"]) from None

        def render(prefix: list[dict], add_generation_prompt: bool, with_mask: bool):
            with template_errors(where, source, options.template):
                out = self._tok.apply_chat_template(
                    prefix, tools=tools, chat_template=options.template, tokenize=True, return_dict=True,
                    add_generation_prompt=add_generation_prompt, return_assistant_tokens_mask=with_mask,
                )
            return list(out["input_ids"]), list(out["assistant_masks"]) if with_mask else None

        return render_conversation(render, messages, where, options, has_generation_blocks(template),
                                   lambda t: t in self.special_ids, self.is_blank, self._turn_closes)

    def render_ids(self, messages: list[dict], options: ChatOptions, add_generation_prompt: bool,
                   where: str) -> list[int] | None:
        if options.template is None and not self.has_chat_template:
            return None
        source = "data.chat_template" if options.template is not None else "the chat template of data.tokenizer"
        with template_errors(where, source, options.template):
            out = self._tok.apply_chat_template(messages, chat_template=options.template, tokenize=True,
                                                return_dict=True, add_generation_prompt=add_generation_prompt)
        return list(out["input_ids"])

    def document_start(self, options: ChatOptions | None) -> list[int]:
        # As transformers' apply_chat_template (and a server) tokenizes a rendering: without special tokens added.
        if options is not None and (options.template is not None or self.has_chat_template):
            return []
        return list(self._text_start)


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec))
