"""Run a strategy for a bounded, derandomized number of draws, whatever the profile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

FIXED = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck),
                 max_examples=1000)


class _Enough(Exception):
    """Raised to stop drawing once a test has seen what it needed."""


def each(strategy: st.SearchStrategy[Any], draws: int, check: Callable[[Any], Any]) -> int:
    """Call ``check`` on up to ``draws`` derandomized examples of ``strategy``.

    Stops early, without shrinking anything, as soon as ``check`` returns
    True.  Returns how many examples were drawn.
    """
    count = [0]

    @settings(FIXED, max_examples=draws, phases=[Phase.generate])
    @given(strategy)
    def run(value: Any) -> None:
        count[0] += 1
        if check(value) is True:
            raise _Enough

    try:
        run()
    except _Enough:
        pass
    return count[0]


def minimal(strategy: st.SearchStrategy[Any], condition: Callable[[Any], bool]) -> Any:
    """The shrunk example of ``strategy`` satisfying ``condition``, the same on every run."""
    return find(strategy, condition, settings=FIXED)
