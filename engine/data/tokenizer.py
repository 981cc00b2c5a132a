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
    TemplateProbes,
    refuse_tools_without_template,
    render_conversation,
    turn_trains,
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
    # The text of each special token that text encodes into it ('<|im_end|>'); none for the byte tokenizer.
    special_texts: tuple[str, ...]

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
    closing it trained (a turn of weight 0 not: chat.turn_trains), its header '<|assistant|>\\n' only with
    options.train_header (every token with train_on all).
    Each message is encoded whole; where its header's tokens do not open it, the header is trained with the turn.
    ProfileError naming the record (`where`) for tool calls or tool definitions, which the format has no way to
    write."""
    refuse_tools_without_template(messages, tools, where)
    header_format = CHAT_TEMPLATE.split("{content}")[0]
    pieces: Pieces = []
    for m in messages:
        # The format writes no reasoning: a turn of reasoning alone says nothing here.
        is_trained = options.trains_all or (m["role"] == "assistant" and turn_trains(m, writes_reasoning=False))
        ids = encode(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]))
        header = encode(header_format.format(role=m["role"]))
        cut = len(header) if ids[: len(header)] == header else 0
        pieces += [(ids[:cut], is_trained and (options.trains_all or options.train_header)), (ids[cut:], is_trained)]
    return [piece for piece in pieces if piece[0]]


def render_template(template: str, messages: list[dict], add_generation_prompt: bool, with_mask: bool, where: str,
                    source: str, tools: list[dict] | None = None,
                    **special_tokens) -> tuple[str, list[tuple[int, int]]]:
    """A conversation (and its `tools`) rendered to text by a chat template in transformers' sandboxed Jinja
    environment as apply_chat_template renders it (keys whose value is None left out), and with `with_mask` the
    (start, end) character spans its {% generation %} blocks mark; ProfileError naming the record and the template
    (`source`: data.chat_template, or the tokenizer's) when it fails, runs past RENDER_LIMIT_S, or renders more than
    RENDERED_EXTRA_CHARS beyond RENDERED_PER_CONTENT_CHAR characters per character of the record's own text
    (_own_chars, and the tool definitions)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
    with template_errors(where, source, template):
        (text,), indices = render_jinja_template(
            [messages], tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=with_mask, **special_tokens,
        )
    content_chars = sum(map(_own_chars, messages)) + (len(json.dumps(tools, default=str)) if tools else 0)
    if len(text) > (most := RENDERED_EXTRA_CHARS + RENDERED_PER_CONTENT_CHAR * content_chars):
        raise ProfileError([f"{where}: {source} renders {len(text)} characters from messages of {content_chars}, more "
                            f"than {most}: a template renders the conversation, not more"])
    return text, list(indices[0]) if with_mask else []


def _own_chars(message: dict) -> int:
    """The characters of a message's own text that a template may write out: its string fields but the role
    (content, reasoning_content, name), the text parts of a list content (a multimodal message) and its tool calls as
    JSON."""
    count = 0
    for key, value in message.items():
        if key == "role":
            continue
        if key == "tool_calls":
            count += len(json.dumps(value, default=str))
        elif isinstance(value, str):
            count += len(value)
        elif isinstance(value, list):
            count += sum(len(part["text"]) for part in value
                         if isinstance(part, dict) and isinstance(part.get("text"), str))  # fmt: skip
    return count


def render_template_text(template: str, messages: list[dict], add_generation_prompt: bool, with_mask: bool, where: str,
                         tools: list[dict] | None = None, **special_tokens) -> tuple[str, list[bool] | None]:
    """data.chat_template's rendering (render_template): its text, and with `with_mask` which of its characters the
    {% generation %} blocks mark."""
    text, spans = render_template(template, messages, add_generation_prompt, with_mask, where, "data.chat_template",
                                  tools, **special_tokens)
    if not with_mask:
        return text, None
    mask = [False] * len(text)
    for start, end in spans:
        mask[start:end] = [True] * (end - start)
    return text, mask


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (its (start, end) characters) that overlaps a marked span, as apply_chat_template's
    return_assistant_tokens_mask marks them: a token of no characters inside a span too."""
    mask = [0] * len(offsets)
    at = 0
    for token, (start, end) in enumerate(offsets):
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        if at == len(spans):
            break
        if end > spans[at][0]:
            mask[token] = 1
    return mask


@contextmanager
def template_errors(where: str, source: str, template: str) -> Iterator[None]:
    """Errors of a chat template's rendering (its own raise_exception, a sandbox refusal, a bad value, any error it
    raises, RENDER_LIMIT_S run past) as one ProfileError line naming the record and the template (`source`, its
    text `template`). A template that ran past the limit once is refused at once on every later record."""
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
_TIMED_OUT: dict[tuple[str, str], str] = {}


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
    special_texts = ()

    def __init__(self):
        # What each chat template renders for the probe conversation (chat.render_conversation).
        self._probes = TemplateProbes()

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

        return render_conversation(render, messages, where, options, template, lambda t: t in self.special_ids,
                                   self.is_blank, self._probes)

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


# A text every tokenizer of a language model encodes to some tokens.
PROBE_TEXT = "Ada has three red cats."


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
        if not self._tok.encode(PROBE_TEXT, add_special_tokens=False):
            # transformers builds a tokenizer of its model type's class with an empty vocabulary for a folder without
            # tokenizer files (a checkpoint exported without them).
            raise ProfileError([f"data.tokenizer ('{directory}') encodes no text (a vocabulary of {self.vocab_size} "
                                f"token{'s' if self.vocab_size != 1 else ''}: no tokenizer files there, "
                                "tokenizer.json or tokenizer_config.json with its vocabulary): name the folder of "
                                "the model's tokenizer in data.tokenizer, or copy its files there"])
        # What each chat template renders for the probe conversation (chat.render_conversation).
        self._probes = TemplateProbes()
        self.bos_id = self._tok.bos_token_id
        # None: the tokenizer defines none, and no document can be ended (dataset.load_splits refuses it).
        self.eos_id = self._tok.eos_token_id
        unknown = self._unknown_text_id()
        if self.eos_id is not None and self.eos_id == unknown:
            raise ProfileError([f"data.tokenizer ('{directory}') has eos_token {self._tok.eos_token!r}, the token its "
                                "vocabulary gives text it lacks (unk_token): it cannot end a document (the model would "
                                "learn to end with it, and generation would not stop); set eos_token in its "
                                "tokenizer_config.json to the token that ends a text"])
        # Padding is neither predicted nor attended to: any id does where the tokenizer names none.
        pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.pad_id = pad if pad is not None else 0
        added = self._tok.added_tokens_decoder
        # The token of text the vocabulary lacks never closes a turn.
        special = set(self._tok.all_special_ids) | {i for i, t in added.items() if t.special}
        self.special_ids = frozenset(special - {unknown})
        names = self._tok.convert_ids_to_tokens(sorted(self.special_ids))
        self.special_texts = tuple(name for name in names if isinstance(name, str) and name)
        self._text_start = self._leading_special_ids()

    def _unknown_text_id(self) -> int | None:
        """The id the tokenizer gives text its vocabulary lacks (<unk>): the one its vocabulary model (BPE, WordPiece,
        WordLevel) names, None where it names none (a byte-level BPE, as GPT-2's, whose unk_token is only another name
        for <|endoftext|>); else (Unigram, SentencePiece) its unk_token."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        model = getattr(backend, "model", None)
        if model is None or not hasattr(model, "unk_token"):
            return self._tok.unk_token_id
        return None if model.unk_token is None else backend.token_to_id(model.unk_token)

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

    def _template(self, options: ChatOptions, tools: list[dict] | None) -> tuple[str, str]:
        """(the template's text, the field that names it): options.template, else the tokenizer's own (the one for
        tools where the tokenizer has several, as transformers picks it)."""
        source = "data.chat_template" if options.template is not None else "the chat template of data.tokenizer"
        try:
            return self._tok.get_chat_template(options.template, tools), source
        except ValueError as err:
            raise ProfileError([f"data.tokenizer: no usable chat template ({str(err).strip()[:200]!r})"]) from None

    def _render(self, template: str, source: str, messages: list[dict], add_generation_prompt: bool, with_mask: bool,
                where: str, tools: list[dict] | None) -> tuple[list[int], list[int] | None]:
        """Token ids of a conversation as apply_chat_template(..., tokenize=True) gives them, and with `with_mask` its
        return_assistant_tokens_mask; rendered once, by render_template, under the same limits as data.chat_template."""
        text, spans = render_template(template, messages, add_generation_prompt, with_mask, where, source, tools,
                                      **self._tok.special_tokens_map)
        out = self._tok(text, add_special_tokens=False)
        ids = list(out["input_ids"])
        if not with_mask:
            return ids, None
        if not out.encodings:
            raise ProfileError([f"{where}: {source} marks the assistant's tokens with {{% generation %}}, which "
                                "needs a fast tokenizer (tokenizer.json) to find their tokens"])
        return ids, token_mask(out.encodings[0].offsets, spans)

    def render_chat(self, messages: list[dict], where: str = "", options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                    tools: list[dict] | None = None) -> Pieces:
        if options.template is None and not self.has_chat_template:
            return render_plain_chat(self.encode, messages, options, where, tools)
        template, source = self._template(options, tools)

        def render(prefix: list[dict], add_generation_prompt: bool, with_mask: bool):
            return self._render(template, source, prefix, add_generation_prompt, with_mask, where, tools)

        return render_conversation(render, messages, where, options, template, lambda t: t in self.special_ids,
                                   self.is_blank, self._probes)

    def render_ids(self, messages: list[dict], options: ChatOptions, add_generation_prompt: bool,
                   where: str) -> list[int] | None:
        if options.template is None and not self.has_chat_template:
            return None
        template, source = self._template(options, None)
        return self._render(template, source, messages, add_generation_prompt, False, where, None)[0]

    def document_start(self, options: ChatOptions | None) -> list[int]:
        # As transformers' apply_chat_template (and a server) tokenizes a rendering: without special tokens added.
        if options is not None and (options.template is not None or self.has_chat_template):
            return []
        return list(self._text_start)


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec))
