"""Training data: JSONL records -> token documents -> packed rows -> per-step batches.

A document becomes (inputs, labels) with labels shifted by one inside the document. Documents are packed into rows
of seq_len tokens; a row records where each piece starts, so every attention type keeps pieces apart (a document
longer than the row room is cut, and its rest starts a new piece). Rows are a pure function of (data, seed, epoch),
and the batch of step s is a pure function of s: resuming at step s replays exactly the same data.

Shapes: R rows per micro-batch, L = seq_len, T = R * L packed tokens, N pieces.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_tune.ops.common.host_copy import remember, to_device
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile, ModelProfile

from .corpus import generate_corpus
from .images import ImageError, ImageSettings, image_patches, image_token_count, load_image
from .multimodal import ImageRef, VisionTokens, render_multimodal_chat, render_templated_multimodal_chat
from .shapes import write_shapes_corpus
from .tokenizer import CHAT_TEMPLATE, Tokenizer

IGNORE_INDEX = -100


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
    if getattr(tok, "has_chat_template", False):
        # The checkpoint's own template, as its text chats: a model trained on it sees images in its format.
        pieces, refs = render_templated_multimodal_chat(
            messages, images, tok.render_chat, vision.settings, vision.tokens, profile.path.parent, where
        )
    else:
        pieces, refs = render_multimodal_chat(
            messages, images, tok.encode, CHAT_TEMPLATE, vision.settings, vision.tokens, profile.path.parent, where
        )
    ids = [tok.bos_id] if tok.bos_id is not None else []
    trained = [False] * len(ids)
    for piece, is_trained in pieces:
        ids += piece
        trained += [is_trained] * len(piece)
    ids.append(tok.eos_id)
    trained.append(True)
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
    if len(ids) - 1 > profile.seq_len:
        raise ProfileError([f"{where}: needs {len(ids) - 1} tokens with its images, more than data.seq_len "
                            f"({profile.seq_len}); a document with images is never cut"])
    return Document(ids[:-1], labels, tuple(refs))


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
        ids, trained = ([tok.bos_id] if tok.bos_id is not None else []), []
        trained = [False] * len(ids)
        for piece, is_trained in tok.render_chat(messages):
            ids += piece
            trained += [is_trained] * len(piece)
        ids.append(tok.eos_id)
        trained.append(True)
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
        return Document(ids[:-1], labels)
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
    """Every document of the profile's data; ProfileError naming the file and line for a bad record. With
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
    with profile.path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{profile.path}:{line_no}"
            try:
                document = _record_document(json.loads(line), where, profile, tok, vision)
                if vision is not None:
                    _check_vision_tokens(document, vision, where)
                documents.append(document)
            except json.JSONDecodeError as err:
                problems.append(f"{where}: invalid JSON ({err.msg} at column {err.colno})")
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
        patches = [image_patches(load_image(ref.path), settings) for ref in refs]
        batch.pixel_values = torch.cat([p for p, _ in patches])
        batch.image_grid_thw = torch.tensor([grid for _, grid in patches], dtype=torch.long)
    return batch


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
