"""Tokenizers: the built-in byte-level one (the tiny default) and any tokenizer directory transformers can read."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from moe_tune.profiles import ProfileError

from .chat import has_generation_blocks, pieces_from_mask, render_by_prefixes

CHAT_TEMPLATE = "<|{role}|>\n{content}\n"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    special_ids: frozenset[int]  # tokens a chat template may close a turn with

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def is_blank(self, token: int) -> bool:
        """Whether the token decodes to whitespace only."""
        ...

    def render_chat(self, messages: list[dict], where: str = "") -> list[tuple[list[int], bool]]:
        """Token pieces of a conversation of canonical roles, each with whether it is trained on (the assistant's
        tokens); ProfileError naming `where` (the record) when the chat template cannot render it faithfully."""
        ...


def render_plain_chat(encode, messages: list[dict]) -> list[tuple[list[int], bool]]:
    """Messages in CHAT_TEMPLATE, for tokenizers without a chat template of their own; assistant turns trained on."""
    return [
        (encode(CHAT_TEMPLATE.format(role=m["role"], content=m["content"])), m["role"] == "assistant")
        for m in messages
    ]


class ByteTokenizer:
    """UTF-8 bytes 0..255, then <bos> 256, <eos> 257, <pad> 258."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    special_ids = frozenset((256, 257, 258))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def is_blank(self, token: int) -> bool:
        return token < 256 and chr(token).isspace()

    def render_chat(self, messages: list[dict], where: str = "") -> list[tuple[list[int], bool]]:
        return render_plain_chat(self.encode, messages)


class HFTokenizer:
    """A tokenizer directory read by transformers (local files only, no remote code)."""

    def __init__(self, directory: Path):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ProfileError([f"data.tokenizer ('{directory}') needs transformers: pip install transformers"]) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ProfileError([f"data.tokenizer ('{directory}') cannot be loaded: {first_line}"]) from None
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id if self._tok.eos_token_id is not None else 0
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        added = self._tok.added_tokens_decoder
        # <unk> stands for text the vocabulary lacks: it never closes a turn.
        special = set(self._tok.all_special_ids) | {i for i, t in added.items() if t.special}
        self.special_ids = frozenset(special - {self._tok.unk_token_id})

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def is_blank(self, token: int) -> bool:
        return token not in self.special_ids and not self._tok.decode([token]).strip()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def _apply_template(self, messages: list[dict], where: str, **options) -> dict:
        import jinja2

        try:
            return self._tok.apply_chat_template(messages, tokenize=True, return_dict=True, **options)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ProfileError([f"{where}: the chat template of data.tokenizer cannot render the conversation: "
                                f"{first_line!r:.200}"]) from None

    def render_chat(self, messages: list[dict], where: str = "") -> list[tuple[list[int], bool]]:
        if not self.has_chat_template:
            return render_plain_chat(self.encode, messages)
        try:
            template = self._tok.get_chat_template()
        except ValueError as err:
            raise ProfileError([f"data.tokenizer: no usable chat template ({str(err).strip()[:200]!r})"]) from None
        if has_generation_blocks(template):
            # The template marks the assistant's tokens: one rendering of the whole conversation.
            out = self._apply_template(messages, where, return_assistant_tokens_mask=True)
            pieces = pieces_from_mask(list(out["input_ids"]), list(out["assistant_masks"]))
        else:

            def render(prefix: list[dict], add_generation_prompt: bool) -> list[int]:
                out = self._apply_template(prefix, where, add_generation_prompt=add_generation_prompt)
                return list(out["input_ids"])

            pieces = render_by_prefixes(render, messages, where, lambda t: t in self.special_ids, self.is_blank)
        # The document already starts with <bos>: drop the one a template renders itself.
        if pieces and self.bos_id is not None and pieces[0][0][:1] == [self.bos_id]:
            pieces[0] = (pieces[0][0][1:], pieces[0][1])
        return pieces


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec))
