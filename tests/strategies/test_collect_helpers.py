"""The drawing helpers the other tests rely on."""

import pytest
from hypothesis import strategies as st

from ._collect import each, minimal


def test_each_draws_the_bound_when_never_satisfied():
    assert each(st.integers(), 25, lambda v: None) == 25


def test_each_stops_as_soon_as_check_returns_true():
    # Hypothesis replays the stopping example once more before it gives up.
    assert each(st.integers(0, 10), 500, lambda v: True) <= 2


def test_each_lets_a_failing_check_fail():
    def check(v):
        assert v < 0
    with pytest.raises(AssertionError):
        each(st.integers(0, 10), 10, check)


def test_minimal_is_shrunk_and_repeatable():
    assert minimal(st.integers(), lambda v: v >= 17) == 17
    assert minimal(st.lists(st.integers()), lambda v: len(v) >= 2) == [0, 0]
