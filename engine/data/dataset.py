"""Training data: records of data files (engine/data/readers.py) in a format (engine/data/formats.py) -> token
documents, split into training and evaluation -> packed rows -> per-step batches.

A document becomes (inputs, labels) with labels shifted by one inside the document. Documents are packed into rows
of seq_len tokens; a row records where each piece starts, so every attention type keeps pieces apart (a document
longer than the row room is cut, and its rest starts a new piece). Rows are a pure function of (data, seed, epoch),
and the batch of step s is a pure function of s: resuming at step s replays exactly the same data.

Shapes: R rows per micro-batch, L = seq_len, T = R * L packed tokens, N pieces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from moe_tune.ops.common.host_copy import remember, to_device
from moe_tune.profiles import ProfileError, json_shown, shortened
from moe_tune.profiles.schema import DataProfile, ModelProfile

from .chat import (
    ROLE_CHARS, canonical_messages, chat_options, chat_tokens, check_tool_calls, check_tools_written, ends_trained,
    refuse_tools_without_template,
)
from .corpus import generate_corpus
from .formats import FormatChoice, column_problems, detect_format, format_keys, no_format, same_family, to_record
from .formats import unread_keys
from .images import ImageError, ImageSettings, image_token_count, read_image_patches, settings_problem
from .multimodal import ImageRef, VisionTokens, render_multimodal_chat, render_templated_multimodal_chat
from .readers import SKIP_BLOCK_BYTES, UTF8_BOM, Refused, jsonl_lines, open_records, too_deep  # noqa: F401
from .shapes import write_shapes_corpus
from .tokenizer import CHAT_TEMPLATE, Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Document:
    input_ids: list[int]
    labels: list[int]
    images: tuple[ImageRef, ...] = ()  # in the order of their placeholders; such a document is never cut
    # Packed into one row when it fits one (pack_rows): a chat, whose answers are trained on their question.
    whole: bool = False

    @property
    def keeps_whole(self) -> bool:
        return self.whole or bool(self.images)


@dataclass(frozen=True)
class Row:
    input_ids: list[int]  # [L]
    labels: list[int]  # [L]
    starts: list[int]  # piece starts inside the row, starts[0] == 0
    images: tuple[ImageRef, ...] = ()

    @cached_property
    def num_label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64, -100 where nothing is predicted
    cu_seqlens: torch.Tensor  # [N + 1] int32
    pixel_values: torch.Tensor | None = None  # [P, C*Tp*p*p] fp32 patches of every image, in token order
    image_grid_thw: torch.Tensor | None = None  # [I, 3] int64 (t, h, w) in patches

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def model_inputs(self, device) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for this batch, on `device`."""
        inputs = {"input_ids": self.input_ids, "cu_seqlens": self.cu_seqlens, "labels": self.labels}
        if self.pixel_values is not None:
            inputs.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        on_device = {k: to_device(v, device) for k, v in inputs.items()}
        # The ops that plan on the host read the document bounds from here instead of from the GPU.
        remember(on_device["cu_seqlens"], self.cu_seqlens)
        return on_device


@dataclass(frozen=True)
class VisionInput:
    """What image records need from the model: its image processor settings and image token ids."""

    settings: ImageSettings | None  # None: `problem` says why images cannot be read (text records still can)
    tokens: VisionTokens
    problem: str | None = None


def vision_input(model: ModelProfile, data: DataProfile) -> VisionInput | None:
    """The image settings and token ids of a model with a vision tower: the checkpoint's image processor settings
    (preprocessor_config.json), else the tower's patch sizes with default pixel bounds; data.image_min/max_pixels
    on top. None for a text-only model."""
    spec = model.vision
    if spec is None:
        return None
    tokens = VisionTokens(spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id)
    if model.checkpoint is not None:
        config = model.checkpoint / "preprocessor_config.json"
        # Normalisation and pixel bounds differ between checkpoints (CLIP's or 0.5 / 0.5): never guess them.
        if not config.is_file():
            return VisionInput(None, tokens, f"{config}: missing; image records need the checkpoint's image processor "
                                             "settings")
        try:
            settings = ImageSettings.from_checkpoint(model.checkpoint)
        except ImageError as err:  # its line names the file and the rule
            return VisionInput(None, tokens, str(err))
        except (TypeError, ValueError) as err:
            return VisionInput(None, tokens, f"{config}: unusable image processor settings ({err})")
    else:
        settings = ImageSettings(spec.patch_size, spec.temporal_patch_size, spec.spatial_merge_size)
    if (settings.patch_size, settings.temporal_patch_size, settings.merge_size) != (
        spec.patch_size, spec.temporal_patch_size, spec.spatial_merge_size
    ):
        raise ProfileError([f"{model.checkpoint}/preprocessor_config.json: patch_size/temporal_patch_size/merge_size "
                            f"({settings.patch_size}/{settings.temporal_patch_size}/{settings.merge_size}) must equal "
                            f"the vision tower's ({spec.patch_size}/{spec.temporal_patch_size}/"
                            f"{spec.spatial_merge_size})"])
    updates = {}
    if data.image_min_pixels is not None:
        updates["min_pixels"] = data.image_min_pixels
    if data.image_max_pixels is not None:
        updates["max_pixels"] = data.image_max_pixels
    settings = dataclasses.replace(settings, **updates)
    # The profile's bounds with the checkpoint's (or the defaults), named as the profile's fields.
    if updates and (problem := settings_problem(settings, {key: f"data.image_{key}" for key in updates})) is not None:
        raise ProfileError([problem])
    return VisionInput(settings, tokens)


def _check_parts_without_vision(record: dict, where: str, profile: DataProfile) -> None:
    """For a model without a vision tower, a record whose content parts hold no image: ProfileError naming a
    malformed part (message_parts' line), or saying that content parts are for images (text is a string here)."""
    from .multimodal import message_parts

    messages = record.get(profile.messages_field)
    if record.get("images") or not isinstance(messages, list):
        return
    kinds = set()
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            kinds |= {kind for kind, _ in message_parts(m["content"], [], where)}
    if "image" not in kinds:
        raise ProfileError([f"{where}: content given as a list of parts is for images, which this model (no "
                            "model.vision) does not take: write each message's text content as a string"])


def _is_multimodal(record: dict, profile: DataProfile) -> bool:
    messages = record.get(profile.messages_field)
    return bool(record.get("images")) or (
        isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)
    )


def _image_document(record: dict, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None):
    if vision is None:
        _check_parts_without_vision(record, where, profile)
        raise ProfileError([f"{where}: the record has images but the model has no vision tower (model.vision)"])
    if vision.settings is None:
        raise ProfileError([f"{where}: {vision.problem}"])
    messages = record.get(profile.messages_field)
    images = record.get("images", [])
    if (problem := message_shape_problem(messages, profile.messages_field, parts=True)) is not None:
        raise ProfileError([f"{where}: {problem}"])
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ProfileError([f"{where}: 'images' must be a list of image paths"])
    _check_image_count(messages, images, where, profile.seq_len)
    messages = canonical_messages(messages, profile.roles, where)
    check_tool_calls(messages, where)
    options = chat_options(profile)
    if options.template is not None and not hasattr(tok, "has_chat_template"):
        raise ProfileError([f"{where}: data.chat_template cannot place image tokens with the byte tokenizer (its "
                            "tokens are bytes); image records with data.tokenizer 'byte' use the built-in format: "
                            "unset data.chat_template"])
    if options.template is not None or getattr(tok, "has_chat_template", False):
        # The checkpoint's own template (or the profile's), as its text chats: the model sees images in its format.
        pieces, refs = render_templated_multimodal_chat(
            messages, images, tok.render_chat, vision.settings, vision.tokens, profile.path.parent, where,
            allow_outside=profile.allow_paths_outside, options=options, tools=_record_tools(record, where),
        )
    else:
        refuse_tools_without_template(messages, _record_tools(record, where), where)
        pieces, refs = render_multimodal_chat(
            messages, images, tok.encode, CHAT_TEMPLATE, vision.settings, vision.tokens, profile.path.parent, where,
            allow_outside=profile.allow_paths_outside, options=options,
        )
    ids, trained = chat_tokens(pieces, tok, ends_trained(messages, options, _has_template(tok, options)), options)
    check_tools_written(messages, ids, trained, tok.decode, where)
    if len(ids) - 1 > profile.seq_len:
        raise ProfileError([f"{where}: needs {len(ids) - 1} tokens with its images, more than data.seq_len "
                            f"({profile.seq_len}); a document with images is never cut"])
    return _chat_document(ids, trained, tuple(refs))


def _has_template(tok: Tokenizer, options) -> bool:
    """Whether chats are rendered by a chat template (the profile's or the tokenizer's), not the built-in format."""
    return options.template is not None or bool(getattr(tok, "has_chat_template", False))


def _special_text(record: dict, profile: DataProfile, specials: re.Pattern) -> str | None:
    """The first special token's text (`specials` matches each: '<|im_end|>') in the record's own text, a text or
    its messages' contents: the tokenizer encodes it into the token itself (an <eos> mid-answer, a forged turn), as
    transformers does; None when there is none."""
    texts = [record.get(profile.text_field)]
    messages = record.get(profile.messages_field)
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        texts += content if isinstance(content, list) else [content]
    for text in texts:
        text = text.get("text") if isinstance(text, dict) else text
        if isinstance(text, str) and (found := specials.search(text)) is not None:
            return found.group()
    return None


def message_shape_problem(messages: object, field_name: str, parts: bool) -> str | None:
    """What is wrong with a record's messages, naming the turn and the value (None when every message is an object
    with a string role and content: a string, or with `parts` a list of text and image parts, read further on; null or
    left out only beside tool_calls)."""
    rule = '{"role": str, "content": str}'
    if not isinstance(messages, list):
        return f"'{field_name}' ({json_shown(messages, 40)}) must be a list of messages {rule}"
    for turn, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"'{field_name}' turn {turn} ({json_shown(message, 40)}) must be a message {rule}"
        role = message.get("role")
        if not isinstance(role, str):
            return f"turn {turn}: 'role' ({json_shown(role, 40) if 'role' in message else 'left out'}) must be a string"
        content = message.get("content")
        is_text = isinstance(content, str) or (parts and isinstance(content, list))
        if is_text or (content is None and message.get("tool_calls")):
            continue
        shown = json_shown(content, 40) if "content" in message else "left out"
        kinds = "a string or a list of text and image parts" if parts else "a string"
        return (f"turn {turn} ({shortened(role, 40)}): 'content' ({shown}) must be {kinds} (null or left out only "
                "beside tool_calls)")
    return None


def _record_tools(record: dict, where: str) -> list[dict] | None:
    """A chat record's `tools` (the function definitions a chat template writes, as transformers takes them)."""
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ProfileError([f"{where}: 'tools' must be a list of tool definitions (JSON objects), got "
                            f"{type(tools).__name__}"])
    return tools or None


def _chat_document(ids: list[int], trained: list[bool], images: tuple[ImageRef, ...] = ()) -> Document:
    """Label t is token t + 1 where that token is trained."""
    return Document(ids[:-1], [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])], images,
                    whole=True)


def _record_document(
    record: object, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None = None
) -> Document:
    if not isinstance(record, dict):
        raise ProfileError([f"{where}: a record must be a JSON object, got {type(record).__name__}"])
    if _is_multimodal(record, profile):
        return _image_document(record, where, profile, tok, vision)  # ImageError: the caller skips or reports
    if profile.messages_field in record:
        messages = record[profile.messages_field]
        if (problem := message_shape_problem(messages, profile.messages_field, parts=False)) is not None:
            raise ProfileError([f"{where}: {problem}"])
        messages = canonical_messages(messages, profile.roles, where)
        check_tool_calls(messages, where)
        options = chat_options(profile)
        pieces = tok.render_chat(messages, where, options, _record_tools(record, where))
        ids, trained = chat_tokens(pieces, tok, ends_trained(messages, options, _has_template(tok, options)), options)
        check_tools_written(messages, ids, trained, tok.decode, where)
        return _chat_document(ids, trained)
    if profile.text_field in record:
        text = record[profile.text_field]
        if not isinstance(text, str):
            raise ProfileError([f"{where}: '{profile.text_field}' must be a string, got {type(text).__name__}"])
        return text_document(text, tok)
    raise ProfileError(
        [f"{where}: a record needs a '{profile.text_field}' or a '{profile.messages_field}' key (has: {sorted(record)})"]
    )


def text_document(text: str, tok: Tokenizer) -> Document:
    """The text's tokens after what the tokenizer puts before a text (Llama's <s>; tok.document_start) and before
    <eos>, every next token trained; a blank text (empty or whitespace) trains nothing: its <eos> alone would teach
    the model to end at once."""
    ids = tok.document_start(None) + tok.encode(text) + [tok.eos_id]
    if not text.strip():
        return Document(ids[:-1], [IGNORE_INDEX] * (len(ids) - 1))
    return Document(ids[:-1], ids[1:])


@dataclass(frozen=True)
class SplitCounts:
    documents: int = 0
    tokens: int = 0  # input tokens
    trained_tokens: int = 0  # of them labelled: trained on (train) or scored (eval)
    # Documents with no labelled token (a chat without an assistant turn, a blank text): rows spent on nothing.
    untrained_documents: int = 0
    # Chats longer than data.seq_len, cut across rows (pack_rows): later turns trained without the conversation's
    # start.
    cut_chats: int = 0

    def __add__(self, other: SplitCounts) -> SplitCounts:
        return SplitCounts(self.documents + other.documents, self.tokens + other.tokens,
                           self.trained_tokens + other.trained_tokens,
                           self.untrained_documents + other.untrained_documents,
                           self.cut_chats + other.cut_chats)  # fmt: skip

    @staticmethod
    def of(documents: list[Document], seq_len: int) -> SplitCounts:
        trained = [sum(label != IGNORE_INDEX for label in d.labels) for d in documents]
        cut = sum(d.keeps_whole and len(d.input_ids) > seq_len for d in documents)
        return SplitCounts(len(documents), sum(len(d.input_ids) for d in documents), sum(trained),
                           trained.count(0), cut)  # fmt: skip

    def __str__(self) -> str:
        share = f" ({100 * self.trained_tokens / self.tokens:.0f}%)" if self.tokens else ""
        notes = [f"{self.untrained_documents} with no trained token"] if self.untrained_documents else []
        if self.cut_chats:
            notes.append(f"{self.cut_chats} chat{'' if self.cut_chats == 1 else 's'} longer than data.seq_len, cut")
        shown = f" ({', '.join(notes)})" if notes else ""
        return f"{self.documents} documents{shown}, {self.tokens} tokens, {self.trained_tokens} trained{share}"


@dataclass(frozen=True)
class SourceSummary:
    """One data source as read: what was chosen and counted."""

    path: str  # the file or folder; "built-in corpus (stories)" for the generated one
    role: str  # "train" (data.path, data.sources, the built-in corpus) or "eval" (data.eval_path)
    kind: str  # JSONL, JSON array, Parquet, saved dataset or generated
    format: FormatChoice | None  # None: no record was read
    weight: float
    records: int  # records read, the refused ones (data.bad_images: skip) included
    refused: tuple[str, ...]  # "file:where: why" of the records left out (data.bad_images: skip)
    train: SplitCounts  # weights applied
    eval: SplitCounts  # held out (data.eval_fraction) or read (data.eval_path)
    held_out: int = 0  # distinct documents held out by data.eval_fraction
    dropped: int = 0  # documents left out of training: equal to an evaluation document
    unread: tuple[tuple[str, int], ...] = ()  # (key, records holding it) of another format's keys left unread
    special_text: tuple[int, str] = (0, "")  # records whose text holds a special token's text, the first
    chats: int = 0  # records read as chats; the others of the source are texts

    def line(self) -> str:
        what = f"{self.kind}, {self.format}" if self.format else self.kind
        notes = [f"weight {self.weight:g}"] if self.weight != 1 else []
        # Text and messages records may share a source (the format names its first record's): both counted.
        texts = self.records - len(self.refused) - self.chats
        if self.chats and texts:
            notes.append(f"{texts} text, {self.chats} chat")
        notes += [f"{len(self.refused)} refused"] if self.refused else []
        notes += [f"{self.held_out} held out"] if self.held_out else []
        notes += [f"{self.dropped} left out as equal to an eval document"] if self.dropped else []
        notes += [f"{count} also hold{'s' if count == 1 else ''} '{key}', unread" for key, count in self.unread]
        if self.special_text[0]:
            notes.append(f"{self.special_text[0]} with a special token's text, encoded as the token: "
                         f"{self.special_text[1]}")
        counts = self.eval if self.role == "eval" else self.train
        extra = f" ({', '.join(notes)})" if notes else ""
        return f"{self.role} {self.path}: {what}: {self.records} records{extra} -> {counts}"


@dataclass(frozen=True)
class DataSummary:
    sources: tuple[SourceSummary, ...]
    eval_from: str | None  # "data.eval_path ('...')", "data.eval_fraction (0.1)" or None
    # What a checkpoint records of the documents it trained on (data_fingerprint), which --resume compares.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # data.roles' keys that no chat's role is (a misspelt 'humna'): the mapping does nothing for them.
    unused_roles: tuple[str, ...] = ()

    @property
    def train(self) -> SplitCounts:
        return sum((s.train for s in self.sources), SplitCounts())

    @property
    def eval(self) -> SplitCounts:
        return sum((s.eval for s in self.sources), SplitCounts())

    @property
    def records(self) -> int:
        return sum(s.records for s in self.sources)

    @property
    def refused(self) -> tuple[str, ...]:
        return tuple(line for s in self.sources for line in s.refused)

    def lines(self) -> list[str]:
        """The summary for a terminal: a line per source, then the totals."""
        lines = [source.line() for source in self.sources]
        lines.append(f"train: {self.train}")
        if self.eval_from is not None:
            lines.append(f"eval: {self.eval} ({self.eval_from})")
        if self.unused_roles:
            names = ", ".join(shortened(repr(role), ROLE_CHARS) for role in self.unused_roles)
            lines.append(f"note: data.roles maps {names}, which no record's role is")
        return lines


@dataclass(frozen=True)
class DataSplits:
    train: list[Document]  # weights applied, in source order
    eval: list[Document]  # each held-out or evaluation record once; [] without data.eval_path / eval_fraction
    summary: DataSummary


@dataclass(frozen=True)
class _Source:
    path: Path | None  # None: the built-in stories corpus
    field: str  # the profile field naming it, for messages (data.path, data.sources.0.path, data.eval_path)
    role: str  # "train" or "eval"
    format: str  # data.format or the source's own
    format_field: str
    weight: float = 1.0
    weight_field: str = ""


@dataclass
class _Read:
    source: _Source
    kind: str
    format: FormatChoice | None
    documents: list[Document]
    refused: list[str]
    # Keys of another format than the record was read as (formats.unread_keys): how many records held each.
    unread: dict[str, int] = field(default_factory=dict)
    # Records whose text holds a special token's text (_special_text), and the first: "'<|im_end|>' at FILE:LINE".
    special_text: tuple[int, str] = (0, "")
    chats: int = 0  # records read as chats (messages, alpaca, sharegpt), the rest texts
    roles: set[str] = field(default_factory=set)  # the roles its chats give, before data.roles (when it maps any)


def load_documents(
    profile: DataProfile,
    tok: Tokenizer,
    vision: VisionInput | None = None,
    skipped: list[str] | None = None,
    generated_dir: Path | None = None,
) -> list[Document]:
    """The training documents of the profile's data (load_splits(...).train)."""
    return load_splits(profile, tok, vision, skipped, generated_dir).train


def load_splits(
    profile: DataProfile,
    tok: Tokenizer,
    vision: VisionInput | None = None,
    skipped: list[str] | None = None,
    generated_dir: Path | None = None,
    max_problems: int = 20,
) -> DataSplits:
    """Every document of the profile's data, split into training and evaluation documents, and what was read.

    ProfileError lists every bad record (up to `max_problems`, then a line saying it stopped), each naming the file
    and record: not UTF-8, larger than data.max_record_bytes, not JSON or nested too deeply, not of the source's
    format, malformed, an image path outside its folder. With data.bad_images 'skip', a record whose image is missing
    or broken is left out, counted in the summary and appended to `skipped`. The built-in shapes corpus is written to
    `generated_dir` first.

    Evaluation documents: data.eval_path's, or data.eval_fraction of each training source's distinct documents
    (round half up; chosen with data.seed before weights; every copy of a chosen document goes). Training never holds
    a document equal to an evaluation document (same tokens and labels). Then each training source's weight w gives
    floor(w) copies of each of its n documents plus round((w - floor(w)) * n) of them chosen with data.seed."""
    if tok.eos_id is None:
        where = f"data.tokenizer ({profile.tokenizer!r})" if profile.tokenizer else "the checkpoint's tokenizer"
        raise ProfileError([f"{where} defines no end-of-sequence token (eos_token): it ends every text document and "
                            "every chat a template does not close itself; set eos_token in its tokenizer_config.json"])
    sources = _sources(profile, generated_dir)
    problems: list[str] = []
    reads = []
    for source in sources:
        reads.append(_read_source(source, profile, tok, vision, problems, max_problems))
        if len(problems) > max_problems:
            break
    if problems:
        raise ProfileError(problems)
    if skipped is not None:
        skipped += [line for read in reads for line in read.refused]
    split = _split(reads, profile)
    summaries, train, evaluation = [], [], []
    for read, (kept, held_out, dropped) in zip(reads, split):
        if read.source.role == "eval":
            evaluation += read.documents
            summaries.append(_summary(read, [], read.documents, profile.seq_len))
            continue
        documents = _weighted(kept, read.source, profile.seed, len(summaries))
        if kept and not documents:
            problems.append(f"{read.source.weight_field} ({read.source.weight:g}) leaves none of the {len(kept)} "
                            f"documents of {read.source.path}: raise it (round((weight - floor(weight)) * n) are kept)")
        train += documents
        evaluation += held_out
        summaries.append(_summary(read, documents, held_out, profile.seq_len, len(held_out), dropped))
    problems += _split_problems(profile, split, train, evaluation)
    if problems:
        raise ProfileError(problems)
    seen = set().union(*(read.roles for read in reads))
    unused = tuple(role for role in profile.roles if role not in seen) if any(read.chats for read in reads) else ()
    summary = DataSummary(tuple(summaries), _eval_from(profile), data_fingerprint(train, evaluation), unused)
    return DataSplits(train, evaluation, summary)


def data_fingerprint(train: list[Document], evaluation: list[Document]) -> dict[str, Any]:
    """The training and evaluation documents' counts, tokens and a digest of their tokens, labels and images in
    order: a regenerated data file, an edited tokenizer or chat template changes it."""
    digest = hashlib.blake2b(digest_size=8)
    for documents in (train, evaluation):
        digest.update(len(documents).to_bytes(8, "little"))
        for doc in documents:
            digest.update(_document_key(doc))
    return {"documents": len(train), "tokens": sum(len(d.input_ids) for d in train),
            "eval_documents": len(evaluation), "digest": digest.hexdigest()}  # fmt: skip


def _sources(profile: DataProfile, generated_dir: Path | None) -> list[_Source]:
    fmt = profile.format
    if profile.sources is not None:
        sources = [_Source(s.path, f"data.sources.{i}.path", "train", s.format or fmt,
                           f"data.sources.{i}.format" if s.format else "data.format", s.weight,
                           f"data.sources.{i}.weight") for i, s in enumerate(profile.sources)]  # fmt: skip
    elif profile.path is not None:
        sources = [_Source(profile.path, "data.path", "train", fmt, "data.format")]
    elif profile.corpus == "shapes":
        if generated_dir is None:
            raise ProfileError(["data.corpus ('shapes') is written to disk: give the loader a directory for it"])
        path = write_shapes_corpus(generated_dir, profile.corpus_documents, profile.seed)
        sources = [_Source(path, "data.corpus", "train", "messages", "data.corpus")]
    else:
        sources = [_Source(None, "data.corpus", "train", "text", "data.corpus")]
    if profile.eval_path is not None:
        sources.append(_Source(profile.eval_path, "data.eval_path", "eval", fmt, "data.format"))
    return sources


def _read_source(source: _Source, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None,
                 problems: list[str], max_problems: int) -> _Read:  # fmt: skip
    """The documents of one source; its bad records are appended to `problems` (at most max_problems in all)."""
    if source.path is None:
        texts = generate_corpus(profile.corpus_documents, profile.seed)
        return _Read(source, "generated", FormatChoice("text", "built-in corpus"),
                     [text_document(text, tok) for text in texts], [])  # fmt: skip
    read = _Read(source, "", None, [], [])
    try:
        records = open_records(source.path, source.field, profile.max_record_bytes, profile.allow_paths_outside)
    except ProfileError as err:
        problems += err.problems
        return read
    read.kind = records.kind
    # Image paths in records resolve against their own source's folder.
    source_profile = profile.model_copy(update={"path": source.path})
    is_auto = source.format == "auto"
    if not is_auto:
        read.format = FormatChoice(source.format, source.format_field)
        column = column_problems(source.format, profile, records.columns, source.path)
        if column:
            problems += column
            return read
    first_where = ""
    num_records = 0
    specials = re.compile("|".join(map(re.escape, tok.special_texts))) if tok.special_texts else None
    pairs = iter(records)
    try:
        for where, record in pairs:
            num_records += 1
            try:
                if isinstance(record, Refused):
                    raise ProfileError([f"{where}: {record.reason}"])
                if is_auto:
                    detected = detect_format(record, profile)
                    if detected is None:
                        raise ProfileError([f"{where}: {no_format(record, profile)}"])
                    if read.format is None:
                        read.format, first_where = FormatChoice(detected, f"first record has "
                                                                f"{format_keys(detected, profile)}"), where
                        column = column_problems(detected, profile, records.columns, source.path)
                        if column:
                            problems += column
                            return read
                    elif not same_family(detected, read.format.name):
                        raise ProfileError([
                            f"{where}: {'an' if detected == 'alpaca' else 'a'} {detected} record (has "
                            f"{format_keys(detected, profile)}) in a source of "
                            f"{read.format.name} records (as {first_where}); a source holds one format: put each "
                            "format in its own data.sources entry"
                        ])
                    for key in unread_keys(record, detected, profile):
                        read.unread[key] = read.unread.get(key, 0) + 1
                record = to_record(record, detected if is_auto else read.format.name, profile, where)
                if specials is not None and (found := _special_text(record, profile, specials)) is not None:
                    read.special_text = (read.special_text[0] + 1, read.special_text[1] or f"{found!r} at {where}")
                read.documents.append(_checked_document(record, where, source_profile, tok, vision))
                read.chats += profile.messages_field in record
                if profile.roles and profile.messages_field in record:
                    read.roles.update(m["role"] for m in record[profile.messages_field])
            except ProfileError as err:
                problems += err.problems
            except ImageError as err:
                if profile.bad_images == "skip":
                    read.refused.append(str(err))
                else:
                    problems.append(str(err))
            if len(problems) >= max_problems:
                problems.append(f"{source.path}: stopping after {max_problems} bad records")
                return read
    finally:
        if hasattr(pairs, "close"):
            pairs.close()
    if num_records == 0:
        empty = {"JSON array": "an empty JSON array", "JSONL": "only blank lines"}.get(records.kind, "no rows")
        problems.append(f"{source.field} ('{source.path}') holds no records ({empty})")
    return read


def _document_key(doc: Document) -> bytes:
    """Equal documents (tokens, labels and images) have equal keys."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(array("q", doc.input_ids).tobytes())
    digest.update(b"|")
    digest.update(array("q", doc.labels).tobytes())
    for ref in doc.images:
        digest.update(b"|" + str(ref.path).encode("utf-8", "surrogateescape"))
    return digest.digest()


def _split(reads: list[_Read], profile: DataProfile) -> list[tuple[list[Document], list[Document], int]]:
    """Per source: (documents kept for training, documents it holds out for evaluation, each once; documents left out
    of training as equal to another source's evaluation document)."""
    eval_keys = {_document_key(d) for read in reads if read.source.role == "eval" for d in read.documents}
    keys = [[_document_key(d) for d in read.documents] if eval_keys or profile.eval_fraction is not None else []
            for read in reads]  # fmt: skip
    held: list[dict[bytes, Document]] = [{} for _ in reads]
    if profile.eval_fraction is not None:
        for index, read in enumerate(reads):
            distinct = list(dict.fromkeys(keys[index]))
            count = math.floor(profile.eval_fraction * len(distinct) + 0.5)
            chosen = set(random.Random(f"{profile.seed}:eval:{index}").sample(distinct, count))
            # A document another source already holds out is evaluated once.
            held[index] = {k: d for k, d in zip(keys[index], read.documents) if k in chosen and k not in eval_keys}
            eval_keys |= chosen
    split = []
    for index, read in enumerate(reads):
        if read.source.role == "eval" or not eval_keys:
            split.append((read.documents, [], 0))
            continue
        kept = [d for k, d in zip(keys[index], read.documents) if k not in eval_keys]
        own = sum(k in held[index] for k in keys[index])
        split.append((kept, list(held[index].values()), len(read.documents) - len(kept) - own))
    return split


def _weighted(documents: list[Document], source: _Source, seed: int, index: int) -> list[Document]:
    whole = math.floor(source.weight)
    extra = math.floor((source.weight - whole) * len(documents) + 0.5)
    picked = sorted(random.Random(f"{seed}:weight:{index}").sample(range(len(documents)), extra))
    return documents * whole + [documents[i] for i in picked]


def _split_problems(profile: DataProfile, split: list[tuple[list[Document], list[Document], int]],
                    train: list[Document], evaluation: list[Document]) -> list[str]:  # fmt: skip
    has_label = lambda docs: any(any(label != IGNORE_INDEX for label in d.labels) for d in docs)  # noqa: E731
    if profile.eval_fraction is not None:
        held = len(evaluation)
        kept = sum(len(set(map(_document_key, documents))) for documents, _, _ in split)
        if held == 0 or kept == 0:
            side = "evaluation" if held == 0 else "training"
            return [f"data.eval_fraction ({profile.eval_fraction:g}) holds out {held} of {held + kept} distinct "
                    f"documents: {side} needs at least one (each source holds out fraction x its distinct documents, "
                    "rounded half up)"]
    problems = []
    if not has_label(train):
        named = f"data.path ('{profile.path}')" if profile.path is not None else "data.sources"
        dropped = sum(count for _, _, count in split)
        why = (f" (its {dropped} documents equal to evaluation documents are left out of training)" if dropped else
               f" (its {len(train)} documents train nothing: a chat trains its assistant turns but those of weight 0 "
               "or that say nothing, a text all but a blank one)" if train else "")
        problems.append(f"{named} must hold at least one token to train on{why}")
    if evaluation and not has_label(evaluation):
        named = f"data.eval_path ('{profile.eval_path}')" if profile.eval_path is not None else \
            f"data.eval_fraction ({profile.eval_fraction:g})'s held-out documents"
        problems.append(f"{named} must hold at least one token to evaluate on")
    return problems


def _eval_from(profile: DataProfile) -> str | None:
    if profile.eval_path is not None:
        return f"data.eval_path ('{profile.eval_path}')"
    if profile.eval_fraction is not None:
        return f"data.eval_fraction ({profile.eval_fraction:g}) of each source, chosen with data.seed"
    return None


def _summary(read: _Read, train: list[Document], held_out: list[Document], seq_len: int, distinct_held: int = 0,
             dropped: int = 0) -> SourceSummary:  # fmt: skip
    source = read.source
    path = str(source.path) if source.path is not None else "built-in corpus (stories)"
    return SourceSummary(path, source.role, read.kind, read.format, source.weight,
                         len(read.documents) + len(read.refused), tuple(read.refused),
                         SplitCounts.of(train, seq_len), SplitCounts.of(held_out, seq_len), distinct_held, dropped,
                         tuple(read.unread.items()), read.special_text, read.chats)  # fmt: skip


def _check_image_count(messages: list[dict], images: list, where: str, seq_len: int) -> None:
    """Refuse a record with more images than its document could fit before any is decoded (a line of a million
    "<image>" would decode for hours): each takes at least 3 tokens (start, one image token, end)."""
    parts = sum(isinstance(part, dict) and part.get("type") == "image"
                for m in messages if isinstance(m.get("content"), list) for part in m["content"])  # fmt: skip
    count = len(images) + parts
    if 3 * count > seq_len:
        raise ProfileError([f"{where}: {count} images need at least {3 * count} tokens, more than data.seq_len "
                            f"({seq_len}); a document with images is never cut"])


def _checked_document(record: dict, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None):
    try:
        document = _record_document(record, where, profile, tok, vision)
    except RecursionError:
        # Parsed, yet too deep for what reads it next (a repr in a message, a template).
        raise ProfileError([f"{where}: {too_deep()}"]) from None
    except UnicodeEncodeError as err:
        # JSON escapes can spell lone surrogates ("\ud800"), which no tokenizer encodes.
        raise ProfileError([f"{where}: the record holds {err.object[err.start:err.end]!r}, not a Unicode character "
                            f"({err.reason})"]) from None
    if vision is not None:
        _check_vision_tokens(document, vision, where)
    return document


def _check_vision_tokens(doc: Document, vision: VisionInput, where: str) -> None:
    """The image token ids may appear only where images put them: a text that tokenises into them (a literal
    `<|image_pad|>`) would meet no image, or the wrong one."""
    t = vision.tokens
    expected = sum(image_token_count(ref.grid, vision.settings) for ref in doc.images) if doc.images else 0
    found = doc.input_ids.count(t.image)
    starts, ends = doc.input_ids.count(t.start), doc.input_ids.count(t.end)
    if found != expected or starts != len(doc.images) or ends != len(doc.images):
        counts = (f"{found} image, {starts} start and {ends} end tokens for {len(doc.images)} images, which put "
                  f"{expected}, {len(doc.images)} and {len(doc.images)}")
        raise ProfileError([f"{where}: the text holds the image token ids ({t.image}, {t.start} or {t.end}) outside "
                            f"its images ({counts}); remove them from the text"])


def pack_rows(documents: list[Document], seq_len: int, pad_id: int) -> list[Row]:
    """Rows of `seq_len` tokens holding the documents in the given order, first fit over the last OPEN_ROWS rows
    opened and not yet full. A document kept whole (Document.keeps_whole: a chat, whose answers are trained on their
    question; one with images) that fits a row goes into the first open row with room for it, else opens a row. A text
    fills the newest open row's room, then new rows, cut where each is full; a chat longer than a row does the same
    from a row of its own: a document is cut only where rows end. A row is closed when full or when an OPEN_ROWS-th
    newer one opens; one closed with room is padded with an unlabelled piece. Rows come in the order they were opened.
    A text-only dataset packs as greedy packing does: one open row, each document cut where it is full."""
    rows: list[_RowBuilder] = []
    open_rows: list[_RowBuilder] = []

    def open_row() -> _RowBuilder:
        if len(open_rows) == OPEN_ROWS:
            open_rows.pop(0)
        row = _RowBuilder()
        rows.append(row)
        open_rows.append(row)
        return row

    def place(row: _RowBuilder, doc: Document, start: int, end: int) -> None:
        row.add(doc, start, end)
        if len(row.ids) == seq_len:
            open_rows.remove(row)

    for doc in documents:
        length = len(doc.input_ids)
        if not length:  # an empty text of a tokenizer that puts nothing before it: no piece, no empty segment
            continue
        if doc.keeps_whole and length <= seq_len:
            row = next((r for r in open_rows if seq_len - len(r.ids) >= length), None) or open_row()
            place(row, doc, 0, length)
            continue
        # Cut only where rows end: a text goes on from the newest row's room into new rows (the room of older rows
        # is left to chats that fit it), a chat longer than a row starts one of its own.
        pos = 0
        row = open_rows[-1] if open_rows and not doc.keeps_whole else open_row()
        while True:
            take = min(seq_len - len(row.ids), length - pos)
            place(row, doc, pos, pos + take)
            pos += take
            if pos == length:
                break
            row = open_row()
    return [row.padded(seq_len, pad_id) for row in rows]


# The rows pack_rows keeps open for a document kept whole that does not fit the newest: few enough that documents stay
# near their order, enough that rows close nearly full.
OPEN_ROWS = 32


@dataclass
class _RowBuilder:
    ids: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)

    def add(self, doc: Document, start: int, end: int) -> None:
        """Tokens [start, end) of `doc` as a piece of their own; its images with its first piece."""
        self.starts.append(len(self.ids))
        self.ids += doc.input_ids[start:end]
        self.labels += doc.labels[start:end]
        if start == 0:
            self.images += doc.images

    def padded(self, seq_len: int, pad_id: int) -> Row:
        room = seq_len - len(self.ids)
        if not room:
            return Row(self.ids, self.labels, self.starts, tuple(self.images))
        return Row(self.ids + [pad_id] * room, self.labels + [IGNORE_INDEX] * room, [*self.starts, len(self.ids)],
                   tuple(self.images))


def collate(rows: list[Row], settings: ImageSettings | None = None) -> Batch:
    """Rows side by side in one packed row [1, R * L]; every piece becomes a cu_seqlens segment. The rows' images
    are read and cut into patches here (settings: the model's image processor)."""
    seq_len = len(rows[0].input_ids)
    cu = [start + r * seq_len for r, row in enumerate(rows) for start in row.starts] + [len(rows) * seq_len]
    batch = Batch(
        input_ids=torch.tensor([sum((row.input_ids for row in rows), [])], dtype=torch.long),
        labels=torch.tensor([sum((row.labels for row in rows), [])], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
    )
    refs = [ref for row in rows for ref in row.images]
    if refs:
        assert settings is not None, "rows with images need the image settings"
        patches = [_read_image_again(ref, settings) for ref in refs]
        batch.pixel_values = torch.cat([p for p, _ in patches])
        batch.image_grid_thw = torch.tensor([grid for _, grid in patches], dtype=torch.long)
    return batch


def _read_image_again(ref: ImageRef, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image measured when the dataset was read, read again for its batch. Gone or changed, it stops the run
    (ProfileError), even under data.bad_images: skip: the rows were packed around its tokens."""
    record = f"{ref.where}: " if ref.where else ""
    retry = "restore it and resume with --resume (the checkpoints written so far are kept)"
    try:
        patches, grid = read_image_patches(ref.path, settings, links=False)
    except ImageError as err:
        raise ProfileError([f"{record}{err}, after the dataset was read; {retry}"]) from None
    if grid != ref.grid:
        raise ProfileError([f"{record}{ref.path}: changed after the dataset was read (a {grid[1]} x {grid[2]} patch "
                            f"grid, was {ref.grid[1]} x {ref.grid[2]}); {retry}"])
    return patches, grid


class PackedDataset:
    """Epoch e shuffles the documents with seed + e and packs them (shuffle=False: every epoch keeps the given
    order, as the eval rows do); micro-batch i of the run is rows [i * R * W, (i + 1) * R * W) of the endless row
    stream, of which rank r takes its R rows. A micro-batch may span two epochs."""

    def __init__(
        self, documents: list[Document], seq_len: int, pad_id: int, seed: int,
        image_settings: ImageSettings | None = None, shuffle: bool = True,
    ):  # fmt: skip
        if not documents:
            raise ProfileError(["data: the dataset has no documents"])
        self.documents, self.seq_len, self.pad_id, self.seed = documents, seq_len, pad_id, seed
        self.image_settings = image_settings
        self.shuffle = shuffle
        self._epoch_lengths: list[int] = []
        self._cached: tuple[int, list[Row]] = (-1, [])

    def rows_of_epoch(self, epoch: int) -> list[Row]:
        if self._cached[0] != epoch:
            order = list(range(len(self.documents)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._cached = (epoch, pack_rows([self.documents[i] for i in order], self.seq_len, self.pad_id))
        return self._cached[1]

    def epoch_length(self, epoch: int) -> int:
        """Rows of epoch `epoch` (0-based). Epochs pack to slightly different row counts (the order changes the
        padding); each is packed once to learn it."""
        while len(self._epoch_lengths) <= epoch:
            self._epoch_lengths.append(len(self.rows_of_epoch(len(self._epoch_lengths))))
        return self._epoch_lengths[epoch]

    def rows_in_epochs(self, num_epochs: int) -> int:
        """Rows of the first `num_epochs` epochs together."""
        return sum(self.epoch_length(e) for e in range(num_epochs))

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, row within that epoch) of row `index` of the endless stream."""
        epoch = 0
        while index >= self.epoch_length(epoch):
            index -= self.epoch_length(epoch)
            epoch += 1
        return epoch, index

    def epoch_progress(self, rows_done: int) -> float:
        """Epochs completed after the first `rows_done` rows of the stream: 1.5 is half-way through the second."""
        epoch, offset = self.locate(rows_done)
        return epoch + offset / self.epoch_length(epoch)

    def row(self, index: int) -> Row:
        epoch, offset = self.locate(index)
        return self.rows_of_epoch(epoch)[offset]

    def micro_batch(self, micro_step: int, rows_per_rank: int, rank: int = 0, world_size: int = 1) -> Batch:
        first = (micro_step * world_size + rank) * rows_per_rank
        return collate([self.row(first + i) for i in range(rows_per_rank)], self.image_settings)

    def eval_micro_batch(self, micro_step: int, rows_per_rank: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Like micro_batch over the first epoch only, each row once: a row past its end is an empty row (padding,
        no label), so every rank runs the same micro-batches whatever the eval set's size."""
        rows = self.rows_of_epoch(0)
        first = (micro_step * world_size + rank) * rows_per_rank
        empty = Row([self.pad_id] * self.seq_len, [IGNORE_INDEX] * self.seq_len, [0])
        return collate([rows[i] if i < len(rows) else empty for i in range(first, first + rows_per_rank)],
                       self.image_settings)  # fmt: skip


class MicroBatchesAhead:
    """A rank's training micro-batches in order, each collated one ahead: `prepare(i)` builds micro-batch i (the host
    work of `dataset.micro_batch`) while the device still runs the previous one's forward and backward, and `get(i)`
    hands it over, or builds it then when it was not prepared. A failure while preparing is raised by `get(i)`,
    where building it would have raised. Micro-batches from `end` on are never prepared (the row past a run's last
    step may start an epoch, which packs every document)."""

    def __init__(self, dataset: PackedDataset, rows_per_rank: int, rank: int, world_size: int, end: int):
        self.dataset = dataset
        self.rows_per_rank, self.rank, self.world_size = rows_per_rank, rank, world_size
        self.end = end
        self._ahead: tuple[int, Batch | Exception] | None = None

    def _build(self, index: int) -> Batch:
        return self.dataset.micro_batch(index, self.rows_per_rank, self.rank, self.world_size)

    def label_tokens(self, first: int, count: int) -> int:
        """The labelled tokens of this rank's rows in micro-batches `first` .. `first + count - 1`, read from the
        packed rows (nothing collated)."""
        rows = self.rows_per_rank
        return sum(self.dataset.row((index * self.world_size + self.rank) * rows + i).num_label_tokens
                   for index in range(first, first + count) for i in range(rows))  # fmt: skip

    def prepare(self, index: int) -> None:
        if index >= self.end or (self._ahead is not None and self._ahead[0] == index):
            return
        try:
            self._ahead = (index, self._build(index))
        except Exception as err:  # noqa: BLE001 - raised by get(index), in its own step
            self._ahead = (index, err)

    def get(self, index: int) -> Batch:
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != index:
            return self._build(index)
        if isinstance(ahead[1], Exception):
            raise ahead[1]
        return ahead[1]
