"""A spy for the tests of compiled loops: which calls of a function that may decline returned something."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["recording"]


def recording(fn: Callable[..., Any], made: list[bool]) -> Callable[..., Any]:
    """``fn``, wrapped to append to ``made``, after each call, whether it returned something other than
    None.  The compiled loops return None where they decline their arrays (and the numpy code runs),
    so ``any(made)`` says a loop took some, and ``all(made)`` that it took every one."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        made.append(out is not None)
        return out
    return wrapper
