"""Certified enclosures with python-flint's Arb balls, and Ziv's strategy for correct rounding.

Transcendental results (attention, the matrix exponential) are computed as
Arb balls ``[mid +- rad]`` guaranteed to contain the exact value.  A ball
decides the rounding when both of its ends round to the same value in the
target format and it does not contain zero.  Undecided elements are computed
again at twice the precision, up to a cap; an element still undecided there
(its value may be exactly a rounding boundary, or exactly zero by
cancellation) raises :class:`~exactref.errors.ReferenceUnavailableError`.

python-flint keeps its working precision in a global context; every change
of it here goes through :func:`precision`, which restores it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import flint

from ..errors import ReferenceUnavailableError
from ..formats import Format
from ..rounding import round_dyadic, round_dyadic_down_up

__all__ = ["Decision", "decide_ball", "precision", "round_certified"]

#: Working precision (bits) of the first certified pass, and the cap.
START_PRECISION = 64
MAX_PRECISION = 4096

Decision = tuple[float, float, float]  # (rounded, x_lo, x_hi)


@contextmanager
def precision(bits: int) -> Iterator[None]:
    """Run a block with python-flint's working precision set to ``bits``, restoring it after."""
    old = flint.ctx.prec
    flint.ctx.prec = bits
    try:
        yield
    finally:
        flint.ctx.prec = old


def _dyadic(x: flint.arb) -> tuple[int, int]:
    m, e = x.man_exp()
    return int(m), int(e)


def decide_ball(x: flint.arb, fmt: Format) -> Decision | None:
    """The rounding of every point of ball ``x`` to ``fmt`` with float64 bounds, or None if they differ.

    An exact zero ball is decided as +0.  A ball containing zero otherwise
    is never decided: the sign of a zero result matters.
    """
    if not x.is_finite():
        return None
    if x.is_zero() and x.is_exact():
        return 0.0, 0.0, 0.0
    lo_n, lo_e = _dyadic(x.lower())
    hi_n, hi_e = _dyadic(x.upper())
    if (lo_n <= 0 <= hi_n) or (lo_n >= 0 >= hi_n):
        return None
    r_lo = round_dyadic(lo_n, lo_e, fmt)
    r_hi = round_dyadic(hi_n, hi_e, fmt)
    if r_lo != r_hi or math.copysign(1.0, r_lo) != math.copysign(1.0, r_hi):
        return None
    return r_lo, round_dyadic_down_up(lo_n, lo_e)[0], round_dyadic_down_up(hi_n, hi_e)[1]


def round_certified(evaluate: Callable[[Sequence[int]], Sequence[flint.arb]], indices: Sequence[int],
                    fmt: Format, describe: Callable[[int], str], *,
                    start: int = START_PRECISION, cap: int = MAX_PRECISION) -> dict[int, Decision]:
    """Decide the rounding of each element in ``indices`` by Ziv's strategy.

    ``evaluate(indices)`` returns one Arb ball per index, computed at the
    precision currently set by :func:`precision`.  ``describe(index)`` names
    an element for the error message.
    """
    out: dict[int, Decision] = {}
    pending = list(indices)
    prec = start
    while pending:
        with precision(prec):
            balls = evaluate(pending)
        undecided = []
        for i, ball in zip(pending, balls):
            d = decide_ball(ball, fmt)
            if d is None:
                undecided.append(i)
            else:
                out[i] = d
        pending = undecided
        if pending and prec >= cap:
            i = pending[0]
            raise ReferenceUnavailableError(
                f"{describe(i)}: its rounding to {fmt.name} is still undecided at {prec} bits of precision; "
                "its exact value is probably exactly a rounding boundary of the format, or exactly zero "
                "by cancellation, which interval arithmetic cannot separate")
        prec *= 2
    return out
