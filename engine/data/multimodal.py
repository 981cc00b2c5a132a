"""Image-text records: chat messages whose content mixes text and images, rendered into tokens with image
placeholders, plus the images each document carries.

Accepted forms of a message's content:
  "a string"                                   plain text; each "<image>" in it takes the record's next image
                                               from its "images" list
  [{"type": "text", "text": "..."},            parts (OpenAI / transformers style); an image part names a local
   {"type": "image", "image": "path.png"}]     file ("image", "path" or "url" key; paths relative to the JSONL file)
An image becomes <vision_start> <image_token> x n <vision_end>, n = its patches / merge^2 (the vision tower's
output rows for it); those tokens are never trained on.

Shapes: P patches of an image; n its tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from moe_tune.profiles import ProfileError

from .chat import DEFAULT_CHAT_OPTIONS, ChatOptions, turn_trains
from .images import ImageError, ImageSettings, image_token_count, load_image, target_size

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageRef:
    path: Path
    grid: tuple[int, int, int]  # (t, h, w) in patches
    # The record that names it (file:line), for errors when it is read again mid-run; not part of its identity.
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class VisionTokens:
    image: int
    start: int
    end: int


def image_ref(path: Path, settings: ImageSettings, where: str = "") -> ImageRef:
    """Open and fully decode the image once (a broken file fails here, at load time, not mid-epoch); its grid is
    the one image_patches cuts."""
    image = load_image(path, links=False)
    try:
        height, width = target_size(image.height, image.width, settings)
    except ImageError as err:
        raise ImageError(f"{path}: {err}") from None
    return ImageRef(path, (1, height // settings.patch_size, width // settings.patch_size), where)


def resolve_image_path(value: str, base_dir: Path, where: str, allow_outside: bool = False) -> Path:
    """The file a record's image path names, symlinks followed: relative paths against `base_dir` (the data file's
    folder). Unless `allow_outside` (data.allow_paths_outside), it must lie inside base_dir: an absolute path, a
    `..` escape or a symlink leading out is refused with a ProfileError naming the record (file:line)."""
    allow = "(set data.allow_paths_outside: true to allow)"
    if "\0" in value:
        raise ProfileError([f"{where}: image {value!r} holds a NUL character"])
    path = Path(value)
    if path.is_absolute() and not allow_outside:
        raise ProfileError([f"{where}: image '{value}' is an absolute path; image paths are relative to the data "
                            f"folder {base_dir} {allow}"])
    resolved = Path(os.path.realpath(base_dir / path))
    root = Path(os.path.realpath(base_dir))
    if not allow_outside and not resolved.is_relative_to(root):
        raise ProfileError([f"{where}: image '{value}' resolves outside the data folder {root} {allow}"])
    return resolved


def refuse_unplaced_images(left: list, where: str) -> None:
    """ProfileError when entries of a record's 'images' are `left` once its placeholders took theirs."""
    if left:
        raise ProfileError([f"{where}: {len(left)} entries of 'images' have no {IMAGE_PLACEHOLDER} placeholder"])


def message_parts(content, images: list, where: str) -> list[tuple[str, object]]:
    """A message's content as [("text", str) | ("image", path-like)], images taken in order from `images` for
    "<image>" placeholders in string content."""
    if isinstance(content, str):
        parts: list[tuple[str, object]] = []
        pieces = content.split(IMAGE_PLACEHOLDER)
        for i, piece in enumerate(pieces):
            if piece:
                parts.append(("text", piece))
            if i < len(pieces) - 1:
                if not images:
                    raise ProfileError([f"{where}: more {IMAGE_PLACEHOLDER} placeholders than entries in 'images'"])
                parts.append(("image", images.pop(0)))
        return parts
    if not isinstance(content, list):
        raise ProfileError([f"{where}: content must be a string or a list of parts, got {type(content).__name__}"])
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        elif kind == "image":
            source = part.get("image", part.get("path", part.get("url")))
            if not isinstance(source, str):
                raise ProfileError([f"{where}: an image part needs an 'image' path string"])
            if source.startswith(("http://", "https://")):
                raise ProfileError([f"{where}: image '{source}' must be a local file (nothing is downloaded)"])
            parts.append(("image", source))
        else:
            raise ProfileError([f"{where}: a content part must be {{'type': 'text', 'text': str}} or "
                                f"{{'type': 'image', 'image': path}}, got {part!r:.80}"])
    return parts


def render_multimodal_chat(
    messages: list[dict],
    record_images: list,
    encode,
    chat_format: str,
    settings: ImageSettings,
    tokens: VisionTokens,
    base_dir: Path,
    where: str,
    allow_outside: bool = False,
    options: ChatOptions = DEFAULT_CHAT_OPTIONS,
) -> tuple[list[tuple[list[int], bool]], list[ImageRef]]:
    """Pieces (token ids, trained?) of a chat with images, in the plain chat format `chat_format` (with {role}
    and {content}), trained as `options` say (as render_plain_chat: the assistant's text, its header with
    train_header, all text with train_on all); images resolved by resolve_image_path and measured. A missing or
    broken image raises ImageError, a malformed record ProfileError; both name the record (and the file)."""
    pieces: list[tuple[list[int], bool]] = []
    refs: list[ImageRef] = []
    queue = list(record_images)
    for message in messages:
        # The format writes no reasoning: a turn of reasoning alone says nothing here.
        trained = options.trains_all or (message["role"] == "assistant" and turn_trains(message, False))
        prefix, suffix = chat_format.split("{content}")
        pieces.append((encode(prefix.format(role=message["role"])), trained and (options.trains_all or
                                                                               options.train_header)))
        for kind, value in message_parts(message["content"], queue, where):
            if kind == "text":
                pieces.append((encode(value), trained))
                continue
            path = resolve_image_path(value, base_dir, where, allow_outside)
            try:
                ref = image_ref(path, settings, where)
            except ImageError as err:
                raise ImageError(f"{where}: {err}") from None
            refs.append(ref)
            count = image_token_count(ref.grid, settings)
            pieces.append(([tokens.start] + [tokens.image] * count + [tokens.end], False))
        pieces.append((encode(suffix.format(role=message["role"])), trained))
    refuse_unplaced_images(queue, where)
    return pieces, refs


def render_templated_multimodal_chat(
    messages: list[dict],
    record_images: list,
    render_chat,
    settings: ImageSettings,
    tokens: VisionTokens,
    base_dir: Path,
    where: str,
    allow_outside: bool = False,
    options: ChatOptions = DEFAULT_CHAT_OPTIONS,
    tools: list[dict] | None = None,
) -> tuple[list[tuple[list[int], bool]], list[ImageRef]]:
    """Pieces of a chat with images (and the record's `tools`) rendered by a chat template (`render_chat` with
    `options`: data.chat_template, else the checkpoint's; it writes each image part as its vision-start, one image
    token and vision-end), each image token then widened to the image's own count (image_token_count). The template
    must render one image token per image, else the record is refused."""
    queue = list(record_images)
    templated, refs = [], []
    for message in messages:
        # An assistant's tool call may come without content (null or left out).
        tool_call_alone = message.get("content") is None and message.get("tool_calls")
        parts = [] if tool_call_alone else message_parts(message["content"], queue, where)
        content = []
        for kind, value in parts:
            if kind == "text":
                content.append({"type": "text", "text": value})
                continue
            path = resolve_image_path(value, base_dir, where, allow_outside)
            try:
                refs.append(image_ref(path, settings, where))
            except ImageError as err:
                raise ImageError(f"{where}: {err}") from None
            content.append({"type": "image"})
        # The message's other fields (reasoning_content, tool_calls, name) reach the template as in a text record.
        templated.append({**message, "content": content})
    refuse_unplaced_images(queue, where)
    pieces = render_chat(templated, where, options, tools)
    placed = sum(piece.count(tokens.image) for piece, _ in pieces)
    if placed != len(refs):
        text_only = [{**m, "content": [p for p in m["content"] if p["type"] == "text"]} for m in templated]
        in_text = sum(piece.count(tokens.image) for piece, _ in render_chat(text_only, where, options, tools))
        if in_text:
            raise ProfileError([f"{where}: the text holds the image token id ({tokens.image}) outside its images "
                                f"({in_text} of them); remove it from the text"])
        source = "data.chat_template" if options.template is not None else "the tokenizer's chat template"
        raise ProfileError([f"{where}: {source} renders {placed} image tokens ({tokens.image}) for {len(refs)} images: "
                            "it must render each image part as one"])
    counts = iter([image_token_count(ref.grid, settings) for ref in refs])
    widened = []
    for piece, trained in pieces:
        for token in piece:
            # An image's tokens are never trained; the text around them keeps its piece's mark.
            ids = [token] * next(counts) if token == tokens.image else [token]
            is_trained = trained and token not in (tokens.image, tokens.start, tokens.end)
            if widened and widened[-1][1] == is_trained:
                widened[-1][0].extend(ids)
            else:
                widened.append((ids, is_trained))
    return widened, refs
