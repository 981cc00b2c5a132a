"""Command-line pieces of the `python -m moe_tune.engine.bench.*` scripts: one-line refusals, exit 2."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line; argparse would print its usage block first.
        self.exit(2, f"{self.prog}: {message}\n")


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value
