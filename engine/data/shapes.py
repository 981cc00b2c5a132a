"""The built-in image-text corpus of the tiny multimodal default: pictures of coloured shapes and what they show.

Deterministic in the seed. The answer depends on the picture only (the question never names the shape), so the
loss on it drops below the text-only floor only when the model learns to read the image.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?")


def _draw(draw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def write_shapes_corpus(directory: Path, documents: int, seed: int) -> Path:
    """Write `documents` PNG pictures and the JSONL of chat records about them into `directory` (once: an
    existing complete corpus of the same size and seed is reused). Returns the JSONL path."""
    from PIL import Image, ImageDraw

    directory = Path(directory)
    jsonl = directory / f"shapes-{documents}-{seed}.jsonl"
    if jsonl.is_file():
        return jsonl
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(documents):
        color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
        size = rng.choice((32, 40, 48))
        image = Image.new("RGB", (size, size), (245, 245, 245))
        margin = rng.randrange(2, size // 4)
        _draw(ImageDraw.Draw(image), shape, (margin, margin, size - margin, size - margin), COLORS[color])
        name = f"shape-{seed}-{i:05d}.png"
        image.save(directory / name)
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": f"A {color} {shape}."},
        ]}))
    tmp = jsonl.with_name(f".{jsonl.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(jsonl)  # written last and atomically: its presence means the pictures are complete
    return jsonl
