"""Training data: JSONL records -> token documents -> packed rows -> per-step batches.

A document becomes (inputs, labels) with labels shifted by one inside the document. Documents are packed into rows
of seq_len tokens; a row records where each piece starts, so every attention type keeps pieces apart (a document
longer than the row room is cut, and its rest starts a new piece). Rows are a pure function of (data, seed, epoch),
and the batch of step s is a pure function of s: resuming at step s replays exactly the same data.

Shapes: R rows per micro-batch, L = seq_len, T = R * L packed tokens, N pieces.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_tune.ops.common.host_copy import remember, to_device
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile, ModelProfile, file_kind

from .chat import canonical_messages, chat_tokens
from .corpus import generate_corpus
from .images import ImageError, ImageSettings, image_patches, image_token_count, load_image
from .multimodal import ImageRef, VisionTokens, render_multimodal_chat, render_templated_multimodal_chat
from .shapes import write_shapes_corpus
from .tokenizer import CHAT_TEMPLATE, Tokenizer

IGNORE_INDEX = -100
UTF8_BOM = b"\xef\xbb\xbf"
# Block size for reading past a record longer than data.max_record_bytes.
SKIP_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Document:
    input_ids: list[int]
    labels: list[int]
    images: tuple[ImageRef, ...] = ()  # in the order of their placeholders; such a document is never cut


@dataclass(frozen=True)
class Row:
    input_ids: list[int]  # [L]
    labels: list[int]  # [L]
    starts: list[int]  # piece starts inside the row, starts[0] == 0
    images: tuple[ImageRef, ...] = ()


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
        except (ImageError, TypeError, ValueError) as err:
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
    return VisionInput(dataclasses.replace(settings, **updates), tokens)


def _is_multimodal(record: dict, profile: DataProfile) -> bool:
    messages = record.get(profile.messages_field)
    return bool(record.get("images")) or (
        isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)
    )


def _image_document(record: dict, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None):
    if vision is None:
        raise ProfileError([f"{where}: the record has images but the model has no vision tower (model.vision)"])
    if vision.settings is None:
        raise ProfileError([f"{where}: {vision.problem}"])
    messages = record.get(profile.messages_field)
    images = record.get("images", [])
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    ):
        raise ProfileError([f"{where}: '{profile.messages_field}' must be a list of {{\"role\": str, \"content\": ...}}"])
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ProfileError([f"{where}: 'images' must be a list of image paths"])
    _check_image_count(messages, images, where, profile.seq_len)
    messages = canonical_messages(messages, profile.roles, where)
    if getattr(tok, "has_chat_template", False):
        # The checkpoint's own template, as its text chats: a model trained on it sees images in its format.
        pieces, refs = render_templated_multimodal_chat(
            messages, images, tok.render_chat, vision.settings, vision.tokens, profile.path.parent, where,
            allow_outside=profile.allow_paths_outside,
        )
    else:
        pieces, refs = render_multimodal_chat(
            messages, images, tok.encode, CHAT_TEMPLATE, vision.settings, vision.tokens, profile.path.parent, where,
            allow_outside=profile.allow_paths_outside,
        )
    ids, trained = chat_tokens(pieces, tok, bool(messages) and messages[-1]["role"] == "assistant")
    if len(ids) - 1 > profile.seq_len:
        raise ProfileError([f"{where}: needs {len(ids) - 1} tokens with its images, more than data.seq_len "
                            f"({profile.seq_len}); a document with images is never cut"])
    return _chat_document(ids, trained, tuple(refs))


def _chat_document(ids: list[int], trained: list[bool], images: tuple[ImageRef, ...] = ()) -> Document:
    """Label t is token t + 1 where that token is trained."""
    return Document(ids[:-1], [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])], images)


def _record_document(
    record: object, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None = None
) -> Document:
    if not isinstance(record, dict):
        raise ProfileError([f"{where}: a record must be a JSON object, got {type(record).__name__}"])
    if _is_multimodal(record, profile):
        return _image_document(record, where, profile, tok, vision)  # ImageError: the caller skips or reports
    if profile.messages_field in record:
        messages = record[profile.messages_field]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ProfileError(
                [f"{where}: '{profile.messages_field}' must be a list of {{\"role\": str, \"content\": str}}"]
            )
        messages = canonical_messages(messages, profile.roles, where)
        ends_with_assistant = bool(messages) and messages[-1]["role"] == "assistant"
        return _chat_document(*chat_tokens(tok.render_chat(messages, where), tok, ends_with_assistant))
    if profile.text_field in record:
        text = record[profile.text_field]
        if not isinstance(text, str):
            raise ProfileError([f"{where}: '{profile.text_field}' must be a string, got {type(text).__name__}"])
        return text_document(text, tok)
    raise ProfileError(
        [f"{where}: a record needs a '{profile.text_field}' or a '{profile.messages_field}' key (has: {sorted(record)})"]
    )


def text_document(text: str, tok: Tokenizer) -> Document:
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text) + [tok.eos_id]
    return Document(ids[:-1], ids[1:])


def load_documents(
    profile: DataProfile,
    tok: Tokenizer,
    vision: VisionInput | None = None,
    skipped: list[str] | None = None,
    generated_dir: Path | None = None,
) -> list[Document]:
    """Every document of the profile's data; ProfileError naming the file and line for a bad record (not UTF-8,
    longer than data.max_record_bytes, not JSON or nested too deeply, malformed, an image path outside). With
    data.bad_images 'skip', a record whose image is missing or broken is left out and its problem appended to
    `skipped` instead. The built-in shapes corpus is written to `generated_dir` first."""
    path = profile.path
    if path is None and profile.corpus == "shapes":
        if generated_dir is None:
            raise ProfileError(["data.corpus ('shapes') is written to disk: give the loader a directory for it"])
        path = write_shapes_corpus(generated_dir, profile.corpus_documents, profile.seed)
        profile = profile.model_copy(update={"path": path})
    elif path is None:
        return [text_document(text, tok) for text in generate_corpus(profile.corpus_documents, profile.seed)]
    documents, problems = [], []
    with _open_data_file(profile.path) as f:
        for line_no, line, problem in jsonl_lines(f, profile.max_record_bytes):
            where = f"{profile.path}:{line_no}"
            try:
                if problem is not None:
                    raise ProfileError([f"{where}: {problem}"])
                if line.strip():
                    documents.append(_line_document(line, where, profile, tok, vision))
            except ProfileError as err:
                problems.extend(err.problems)
            except ImageError as err:
                if profile.bad_images == "skip" and skipped is not None:
                    skipped.append(str(err))
                else:
                    problems.append(str(err))
            if len(problems) >= 20:
                problems.append(f"{profile.path}: stopping after 20 bad records")
                break
    if problems:
        raise ProfileError(problems)
    if not any(any(label != IGNORE_INDEX for label in d.labels) for d in documents):
        raise ProfileError([f"data.path ('{profile.path}') must hold at least one token to train on"])
    return documents


def _check_image_count(messages: list[dict], images: list, where: str, seq_len: int) -> None:
    """Refuse a record with more images than its document could fit before any is decoded (a line of a million
    "<image>" would decode for hours): each takes at least 3 tokens (start, one image token, end)."""
    parts = sum(isinstance(part, dict) and part.get("type") == "image"
                for m in messages if isinstance(m["content"], list) for part in m["content"])  # fmt: skip
    count = len(images) + parts
    if 3 * count > seq_len:
        raise ProfileError([f"{where}: {count} images need at least {3 * count} tokens, more than data.seq_len "
                            f"({seq_len}); a document with images is never cut"])


def _line_document(line: str, where: str, profile: DataProfile, tok: Tokenizer, vision: VisionInput | None):
    try:
        document = _record_document(parse_record(line, where), where, profile, tok, vision)
    except RecursionError:
        # Parsed, yet too deep for what reads it next (a repr in a message, a template).
        raise ProfileError([f"{where}: {_too_deep()}"]) from None
    except UnicodeEncodeError as err:
        # JSON escapes can spell lone surrogates ("\ud800"), which no tokenizer encodes.
        raise ProfileError([f"{where}: the record holds {err.object[err.start:err.end]!r}, not a Unicode character "
                            f"({err.reason})"]) from None
    if vision is not None:
        _check_vision_tokens(document, vision, where)
    return document


def _open_data_file(path: Path):
    """The data file, opened for reading in binary. Without blocking: a FIFO swapped in after the profile was
    checked would wait for a writer; it is refused instead."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as err:
        raise ProfileError([f"data.path ('{path}') cannot be read ({getattr(err, 'strerror', None) or err})"]) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ProfileError([f"data.path ('{path}') must be a regular file, not {file_kind(mode)}"])
    return os.fdopen(fd, "rb")


def jsonl_lines(f, max_record_bytes: int) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, None) for each line of a binary JSONL file, or (line number, None, problem) for a line
    longer than max_record_bytes (read past in blocks, never held whole) or not UTF-8 (the problem names the byte
    and its offset in the line and in the file). A UTF-8 byte-order mark opening the file is dropped."""
    offset = 0
    for line_no in itertools.count(1):
        # Two more bytes than a record may hold: the record is too long exactly when its line without "\r\n" is.
        raw = f.readline(max_record_bytes + 2)
        if not raw:
            return
        start, offset = offset, offset + len(raw)
        if line_no == 1 and raw.startswith(UTF8_BOM):
            raw, start = raw[len(UTF8_BOM):], start + len(UTF8_BOM)
        record = raw.removesuffix(b"\n").removesuffix(b"\r")
        if len(record) > max_record_bytes:
            size, tail = len(raw), raw[-2:]
            while not tail.endswith(b"\n") and (chunk := f.readline(SKIP_BLOCK_BYTES)):
                offset, size, tail = offset + len(chunk), size + len(chunk), (tail + chunk)[-2:]
            size -= len(tail) - len(tail.removesuffix(b"\n").removesuffix(b"\r"))
            yield line_no, None, (f"the record ({size} bytes) is larger than data.max_record_bytes "
                                  f"({max_record_bytes})")
            continue
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as err:
            yield line_no, None, (f"not UTF-8 ({err.reason}: byte 0x{record[err.start]:02x} at byte offset "
                                  f"{err.start} of the line, {start + err.start} of the file)")
            continue
        yield line_no, text, None


def parse_record(line: str, where: str) -> object:
    """One JSONL line parsed; ProfileError naming the record when it is not JSON or nested too deeply."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ProfileError([f"{where}: invalid JSON ({err.msg} at column {err.colno})"]) from None
    except RecursionError:
        raise ProfileError([f"{where}: {_too_deep()}"]) from None
    except ValueError as err:
        # An integer literal longer than Python converts (sys.set_int_max_str_digits).
        raise ProfileError([f"{where}: invalid JSON ({err})"]) from None


def _too_deep() -> str:
    return f"JSON nested too deeply (deeper than Python's recursion limit, {sys.getrecursionlimit()} levels)"


def _check_vision_tokens(doc: Document, vision: VisionInput, where: str) -> None:
    """The image token ids may appear only where images put them: a text that tokenises into them (a literal
    `<|image_pad|>`) would meet no image, or the wrong one."""
    t = vision.tokens
    expected = sum(image_token_count(ref.grid, vision.settings) for ref in doc.images) if doc.images else 0
    found = doc.input_ids.count(t.image)
    starts, ends = doc.input_ids.count(t.start), doc.input_ids.count(t.end)
    if found != expected or starts != len(doc.images) or ends != len(doc.images):
        raise ProfileError([f"{where}: the text holds the image token ids ({t.image}, {t.start} or {t.end}) outside "
                            f"its images ({found} image tokens for {len(doc.images)} images); remove them from the text"])


def pack_rows(documents: list[Document], seq_len: int, pad_id: int) -> list[Row]:
    """Greedy packing in the given order; the last row is padded with an unlabelled piece. A document with images
    is never cut: when it does not fit the room left, the row is padded and it starts the next one."""
    rows: list[Row] = []
    ids: list[int] = []
    labels: list[int] = []
    starts: list[int] = []
    images: list[ImageRef] = []

    def pad_row():
        starts.append(len(ids))
        room = seq_len - len(ids)
        rows.append(Row(ids + [pad_id] * room, labels + [IGNORE_INDEX] * room, list(starts), tuple(images)))

    for doc in documents:
        if doc.images and len(doc.input_ids) > seq_len - len(ids) and ids:
            pad_row()
            ids, labels, starts, images = [], [], [], []
        images += doc.images
        pos = 0
        while pos < len(doc.input_ids):
            take = min(seq_len - len(ids), len(doc.input_ids) - pos)
            starts.append(len(ids))
            ids += doc.input_ids[pos : pos + take]
            labels += doc.labels[pos : pos + take]
            pos += take
            if len(ids) == seq_len:
                rows.append(Row(ids, labels, starts, tuple(images)))
                ids, labels, starts, images = [], [], [], []
    if ids:
        pad_row()
    return rows


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
        patches, grid = image_patches(load_image(ref.path), settings)
    except ImageError as err:
        raise ProfileError([f"{record}{err}, after the dataset was read; {retry}"]) from None
    if grid != ref.grid:
        raise ProfileError([f"{record}{ref.path}: changed after the dataset was read (a {grid[1]} x {grid[2]} patch "
                            f"grid, was {ref.grid[1]} x {ref.grid[2]}); {retry}"])
    return patches, grid


class PackedDataset:
    """Epoch e shuffles the documents with seed + e and packs them; micro-batch i of the run is rows
    [i * R * W, (i + 1) * R * W) of the endless row stream, of which rank r takes its R rows."""

    def __init__(
        self, documents: list[Document], seq_len: int, pad_id: int, seed: int, image_settings: ImageSettings | None = None
    ):
        if not documents:
            raise ProfileError(["data: the dataset has no documents"])
        self.documents, self.seq_len, self.pad_id, self.seed = documents, seq_len, pad_id, seed
        self.image_settings = image_settings
        self._epoch_lengths: list[int] = []
        self._cached: tuple[int, list[Row]] = (-1, [])

    def rows_of_epoch(self, epoch: int) -> list[Row]:
        if self._cached[0] != epoch:
            order = list(range(len(self.documents)))
            random.Random(self.seed + epoch).shuffle(order)
            self._cached = (epoch, pack_rows([self.documents[i] for i in order], self.seq_len, self.pad_id))
        return self._cached[1]

    def _epoch_length(self, epoch: int) -> int:
        # Epochs pack to slightly different row counts (the order changes the padding); learn each once.
        while len(self._epoch_lengths) <= epoch:
            self._epoch_lengths.append(len(self.rows_of_epoch(len(self._epoch_lengths))))
        return self._epoch_lengths[epoch]

    def row(self, index: int) -> Row:
        epoch = 0
        while index >= self._epoch_length(epoch):
            index -= self._epoch_length(epoch)
            epoch += 1
        return self.rows_of_epoch(epoch)[index]

    def micro_batch(self, micro_step: int, rows_per_rank: int, rank: int = 0, world_size: int = 1) -> Batch:
        first = (micro_step * world_size + rank) * rows_per_rank
        return collate([self.row(first + i) for i in range(rows_per_rank)], self.image_settings)
