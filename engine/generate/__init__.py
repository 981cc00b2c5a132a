"""Cached decoding: key/value caches and recurrent states (cache.py) and the decode loop (decode.py)."""

from .cache import DecodeCache, DecodeStep

__all__ = ["DecodeCache", "DecodeStep", "forward_cached", "generate_ids"]


def __getattr__(name: str):
    # decode.py imports the model, whose modules import cache.py: loading it on use keeps that import one-way.
    if name in ("forward_cached", "generate_ids"):
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
