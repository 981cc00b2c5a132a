"""Cached decoding: key/value caches and recurrent states (cache.py) and the decode loop (decode.py)."""

from .cache import DecodeCache, DecodeStep

__all__ = ["DecodeCache", "DecodeStep"]
