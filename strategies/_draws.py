"""Hypothesis strategies that the composites draw from many times per example, built once.

Building a strategy costs validation on its first draw; a composite that
calls ``st.integers(lo, hi)`` afresh on every draw pays that each time.
"""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

__all__ = ["choice", "coin", "ints"]


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """st.integers(lo, hi), built once: composites draw these many times per example."""
    return _ints(lo, hi, type(lo), type(hi))


def choice(options: tuple) -> st.SearchStrategy[Any]:
    """st.sampled_from(options), built once."""
    return _choice(options, tuple(type(o) for o in options))


# The types are part of the cache keys: (1, -1) == (1.0, -1.0) == (True, -1), so without them
# one caller's choice((1, -1)) could hand back another's strategy of floats.
@functools.lru_cache(maxsize=4096)
def _ints(lo: int, hi: int, *types: type) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


@functools.lru_cache(maxsize=1024)
def _choice(options: tuple, types: tuple[type, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(options)


def coin() -> st.SearchStrategy[bool]:
    return choice((False, True))
