"""Hypothesis strategies that the composites draw from many times per example, built once.

Building a strategy costs validation on its first draw; a composite that
calls ``st.integers(lo, hi)`` afresh on every draw pays that each time.
"""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

__all__ = ["choice", "coin", "ints"]


@functools.lru_cache(maxsize=4096)
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """st.integers(lo, hi), built once: composites draw these many times per example."""
    return st.integers(lo, hi)


@functools.lru_cache(maxsize=1024)
def choice(options: tuple) -> st.SearchStrategy[Any]:
    """st.sampled_from(options), built once."""
    return st.sampled_from(options)


def coin() -> st.SearchStrategy[bool]:
    return choice((False, True))
