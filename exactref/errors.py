"""The exceptions ExactRef raises."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DtypeMismatchWarning",
    "MismatchError",
    "OutOfToleranceError",
    "ReferenceBudgetError",
    "ReferenceUnavailableError",
    "ShapeMismatchError",
    "SpecialValueError",
]


class ReferenceUnavailableError(ArithmeticError):
    """The rounding of an exact value could not be decided within the precision cap.

    Raised for a transcendental expression whose value is exactly a rounding
    boundary, or exactly zero by cancellation, where no finite precision of
    interval arithmetic separates it from the boundary.  ExactRef raises this
    rather than guess.
    """


class ReferenceBudgetError(ReferenceUnavailableError):
    """Deciding a rounding would take more certified work than the op's budget allows.

    Raised instead of running for minutes or hours when a value is so close
    to a rounding boundary (or to zero) that each further doubling of the
    precision costs more than the budget left: such a value is almost always
    exactly a boundary.  The message names the element, the work the next
    step needs and the budget; an op that raises it takes a ``refine_budget``
    argument to allow more.
    """


class MismatchError(AssertionError):
    """An implementation's output is not covered by the reference.

    ``op`` names the op (and gradient), ``indices`` lists the mismatched
    elements, worst first.
    """

    def __init__(self, message: str, *, op: str = "", indices: list[tuple[int, ...]] | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.op = op
        self.indices = indices or []
        self.details = details


class OutOfToleranceError(MismatchError):
    """Some finite output is farther from the exact value than the tolerance allows."""


class SpecialValueError(MismatchError):
    """Some output has the wrong special value: NaN or inf where another value is required, or the reverse."""


class ShapeMismatchError(MismatchError):
    """The output has the wrong shape."""


class DtypeMismatchWarning(UserWarning):
    """``covers`` got an array of another dtype than the result's (float64 and complex128 aside): it
    judges the values, and says so.

    ``check`` raises :class:`ShapeMismatchError` with the same explanation.
    """
