"""tests/exactref/spies.py: the spy records, call by call, whether the function returned something."""

from __future__ import annotations

from .spies import recording


def test_recording_notes_each_call_and_passes_arguments_and_results_through() -> None:
    made: list[bool] = []

    def declines_odd(x: int, *, scale: int = 1) -> int | None:
        return None if x % 2 else x * scale
    spy = recording(declines_odd, made)
    assert spy(2, scale=3) == 6
    assert spy(3) is None
    assert spy(0) == 0  # (a falsy result is still a result)
    assert made == [True, False, True]
    assert spy.__name__ == "declines_odd"
