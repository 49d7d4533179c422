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
from typing import Any

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


# Below 2**_TINY every value rounds to zero in every format, float64 included.
_TINY = -1100
# Midpoint and radius further apart than this many binades: one of them is negligible.
_FAR = 1 << 15


def _ends(x: flint.arb, fmt: Format) -> tuple[tuple[int, int], tuple[int, int]]:
    """The ends ``mid -+ rad`` of ball ``x`` as exact dyadics ``(n, e)``.

    They are computed from the midpoint and radius in integer arithmetic:
    ``x.lower()`` and ``x.upper()`` would round them to the working
    precision, which is back at its default when the ball is decided.  A
    mantissa is widened to more than ``fmt.p`` bits, and a magnitude below
    2**_TINY is replaced by 2**_TINY, so that rounding it never shifts by a
    huge amount; neither changes how an end rounds.
    """
    m, e = _dyadic(x.mid())
    r, f = _dyadic(flint.arb(x.rad()))
    top_m, top_r = e + abs(m).bit_length(), f + r.bit_length()
    if r == 0:
        ends = [(m, e), (m, e)]
    elif m == 0 or top_r > top_m + _FAR:
        # The ball contains zero either way; only the signs of its ends matter.
        ends = [(-r, f), (r, f)]
    else:
        if top_m > top_r + _FAR:
            # Widen a negligible radius to 2**(top_m - _FAR), so that the shifts stay short.
            r, f = 1, top_m - _FAR
        k = min(e, f)
        c, w = m << (e - k), r << (f - k)
        ends = [(c - w, k), (c + w, k)]
    out = []
    for n, ex in ends:
        if n and abs(n).bit_length() + ex < _TINY:
            n, ex = (1 if n > 0 else -1), _TINY
        widen = max(0, fmt.p + 1 - abs(n).bit_length()) if n else 0
        out.append((n << widen, ex - widen))
    return out[0], out[1]


def decide_ball(x: flint.arb, fmt: Format) -> Decision | None:
    """The rounding of every point of ball ``x`` to ``fmt`` with float64 bounds, or None if they differ.

    An exact zero ball is decided as +0.  A ball containing zero otherwise
    is never decided: the sign of a zero result matters.
    """
    if not x.is_finite():
        return None
    if x.is_zero() and x.is_exact():
        return 0.0, 0.0, 0.0
    (lo_n, lo_e), (hi_n, hi_e) = _ends(x, fmt)
    if (lo_n <= 0 <= hi_n) or (lo_n >= 0 >= hi_n):
        return None
    r_lo = round_dyadic(lo_n, lo_e, fmt)
    r_hi = round_dyadic(hi_n, hi_e, fmt)
    if r_lo != r_hi or math.copysign(1.0, r_lo) != math.copysign(1.0, r_hi):
        return None
    return r_lo, round_dyadic_down_up(lo_n, lo_e)[0], round_dyadic_down_up(hi_n, hi_e)[1]


def round_certified(evaluate: Callable[[Sequence[int]], Sequence[flint.arb]], indices: Sequence[int],
                    fmt: Format, describe: Callable[[int], str], *,
                    start: int = START_PRECISION, cap: int = MAX_PRECISION,
                    decide_all: Callable[[list[Any], Format], Sequence[Decision | None]] | None = None
                    ) -> dict[int, Decision]:
    """Decide the rounding of each element in ``indices`` by Ziv's strategy.

    ``evaluate(indices)`` returns one Arb ball per index, computed at the
    precision currently set by :func:`precision`.  ``describe(index)`` names
    an element for the error message.  ``decide_all(items, fmt)`` decides an
    evaluation's whole list, a Decision or None per item (default:
    :func:`decide_ball` of each); an op may replace it to decide in bulk, or
    when its ``evaluate`` returns more than a ball (attention's exact part
    plus a remainder).
    """
    if decide_all is None:
        def decide_all(items: list[Any], fmt: Format) -> list[Decision | None]:
            return [decide_ball(x, fmt) for x in items]
    out: dict[int, Decision] = {}
    pending = list(indices)
    prec = start
    while pending:
        with precision(prec):
            balls = evaluate(pending)
        undecided = []
        for i, d in zip(pending, decide_all(list(balls), fmt)):
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
