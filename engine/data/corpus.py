"""The built-in corpus of the tiny default: short generated stories, deterministic in the seed.

Small vocabulary, fixed sentence templates and consistent facts inside each story, so a byte-level model learns
visibly within a few hundred steps on a CPU.
"""

from __future__ import annotations

import random

NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo"]
COLORS = ["red", "blue", "green", "white", "black", "gold"]
THINGS = ["cat", "dog", "fox", "hen", "owl", "bee", "cow", "pig"]
PLACES = ["the farm", "the park", "the hill", "the lake", "the barn"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    color, thing, place = rng.choice(COLORS), rng.choice(THINGS), rng.choice(PLACES)
    count = rng.randrange(2, 10)
    given = rng.randrange(1, count)
    sentences = [
        f"{name} has {NUMBERS[count - 1]} {color} {thing}s.",
        f"{name} goes to {place} with {friend}.",
        f"{name} gives {NUMBERS[given - 1]} {thing}s to {friend}.",
        f"Now {name} has {NUMBERS[count - given - 1]} {color} {thing}s.",
        f"The end.",
    ]
    return " ".join(sentences)


def generate_corpus(num_documents: int, seed: int) -> list[str]:
    """`num_documents` stories; the same (num_documents, seed) always gives the same list."""
    rng = random.Random(seed)
    return [_story(rng) for _ in range(num_documents)]
