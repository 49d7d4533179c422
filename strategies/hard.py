"""Hard rounding cases: terms whose exact sum (or one product) is hard to round.

A *plan* is a short list of ``(a, b)`` pairs, each the factors of one term
``a * b`` (``b`` is 1 where the op sums values rather than products).  The
exact sum of the terms is, in the output format:

- ``tie``: exactly the midpoint between two adjacent values;
- ``near_tie``: not a midpoint, but within 1/8 ulp of one (often far closer:
  the offset is drawn down to the format's smallest subnormal, so a wider
  accumulator that rounds twice gets it wrong);
- ``cancellation``: the terms cancel, so the sum is zero or at least
  2**ceil(p/2) times smaller than the sum of the terms' magnitudes.

A plan may be both a (near) tie and a cancellation: a large pair +B, -B
hides the tie from an accumulator that is too narrow.  Every value a plan
holds is exactly representable in the input format.

The per-op strategies place plans into their arrays; the builders here only
need the format, the number of slots and whether the terms are products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from hypothesis import strategies as st

from exactref.formats import Format

from ._draws import choice, coin, ints

__all__ = ["HARD_CLASSES", "HardCase", "Plan", "complex_cancellation", "draw_plan", "draw_product_plan"]

#: The hard-case classes of the rational ops.
HARD_CLASSES: tuple[str, ...] = ("tie", "near_tie", "cancellation")

_SIGNS = (1, -1)


class HardCase(NamedTuple):
    """Where a case holds a hard rounding case, and which.

    ``index`` is the output element's index, ``kinds`` the classes it
    belongs to, and ``part`` ``"real"`` or ``"imag"`` for a complex output
    (the other part is zero by construction, or harmless), None otherwise.
    """

    index: tuple[int, ...]
    kinds: tuple[str, ...]
    part: str | None = None


@dataclass(frozen=True)
class Plan:
    """Terms ``a * b`` whose exact sum is hard, and the classes it is in."""

    pairs: tuple[tuple[float, float], ...]
    kinds: tuple[str, ...]


def _pow2(e: int) -> float:
    return math.ldexp(1.0, e)


def _lowest(fmt: Format) -> int:
    """The exponent of the smallest subnormal."""
    return fmt.emin - fmt.p + 1


def _significand(draw: st.DrawFn, p: int, margin: int = 1) -> int:
    """A p-bit integer significand kept ``margin`` away from the binade's ends."""
    return draw(ints((1 << (p - 1)) + margin, (1 << p) - 1 - margin))


def _split(draw: st.DrawFn, fmt: Format, t: float) -> tuple[float, float]:
    """Factors a * b == t with b a signed power of two and both in fmt's normal range."""
    if t == 0:
        return 0.0, 1.0
    e = math.frexp(abs(t))[1] - 1
    lo, hi = max(-2, e - fmt.emax), min(2, e - fmt.emin)
    s = draw(ints(lo, hi)) if lo <= hi else 0
    b = _pow2(s) * draw(choice(_SIGNS))
    return t / b, b


def _split_power(x: int, sign: int) -> tuple[float, float]:
    """Factors of sign * 2**x as two powers of two of about equal size."""
    return _pow2(x - x // 2), sign * _pow2(x // 2)


def draw_plan(draw: st.DrawFn, fmt: Format, kind: str, slots: int, *, products: bool,
              cancellation: bool = True) -> Plan | None:
    """A plan of class ``kind`` with at most ``slots`` terms, or None if it cannot fit.

    With ``products`` each term is a product of two values of ``fmt``, which
    also allows a single-product (near) tie; otherwise ``b`` is always 1.
    With ``cancellation`` a (near) tie may also hide behind a cancelling pair.
    """
    if slots < (1 if products and kind != "cancellation" else 2):
        return None
    if kind != "cancellation" and products and (slots == 1 or draw(coin())):
        return draw_product_plan(draw, fmt, kind)
    p = fmt.p
    if kind == "cancellation":
        terms, tiny = _cancelling_pair(draw, fmt), []
        kinds_out: tuple[str, ...] = ("cancellation",)
    else:
        e = draw(ints(-2, 2))
        terms = [_significand(draw, p) * _pow2(e - p + 1), draw(choice(_SIGNS)) * _pow2(e - p)]
        tiny = []
        if kind == "near_tie":
            sign = draw(choice(_SIGNS))
            if slots >= 3:
                # The offset may sit far below the format's precision: a product
                # of two powers of two reaches twice as far down as one value.
                floor = 2 * _lowest(fmt) if products else _lowest(fmt)
                d = draw(ints(2, max(2, e - p - floor)))
                tiny = [(e - p - d, sign)]
            else:
                # Merged into the half-ulp term, which then needs d + 1 bits.
                d = draw(ints(2, p - 1))
                terms[1] += sign * math.copysign(_pow2(e - p - d), terms[1])
        kinds_out = (kind,)
        if cancellation and slots >= len(terms) + len(tiny) + 2 and draw(coin()):
            c = draw(ints(p // 2 + 1, max(p // 2 + 1, min(fmt.emax - e, 3 * p))))
            big = _significand(draw, p) * _pow2(e + c - p + 1)
            terms += [big, -big]
            kinds_out = (kind, "cancellation")
    if products:
        pairs = [_split(draw, fmt, t) for t in terms] + [_split_power(x, s) for x, s in tiny]
    else:
        pairs = [(t, 1.0) for t in terms] + [(s * _pow2(x), 1.0) for x, s in tiny]
    return Plan(tuple(pairs), kinds_out)


def _cancelling_pair(draw: st.DrawFn, fmt: Format) -> list[float]:
    """B and -(B - D), where D is a few ulps of B or zero: their sum D is tiny or 0."""
    p = fmt.p
    exponent = draw(ints(-4, min(fmt.emax, 3 * p)))
    big = _significand(draw, p, margin=8)
    k = draw(ints(-7, 7))
    unit = _pow2(exponent - p + 1)
    return [big * unit, -(big - k) * unit]


def _odd_in(draw: st.DrawFn, bits: int) -> int:
    return draw(ints(1 << (bits - 1), (1 << bits) - 1)) | 1


def draw_product_plan(draw: st.DrawFn, fmt: Format, kind: str) -> Plan | None:
    """One product x * y of two values of ``fmt`` that is a tie or near tie in ``fmt``.

    Write the product of the integer significands a * b with L = p + 1 + t
    bits: its low t + 1 bits are what rounding to p bits drops, and it is a
    tie when they are 1 followed by t zeros.  a is odd, so it is invertible
    modulo 2**(t + 1) and b can be solved for any low bits, 2**t + r, that
    we want: r = 0 for a tie, r = +-1 for a near tie 2**-(t+1) ulp away.
    """
    p = fmt.p
    near = kind == "near_tie"
    t = draw(ints(2 if near else 0, p - 3))
    i = draw(ints(t + 2, p - 1))
    a = _odd_in(draw, i)
    r = draw(choice(_SIGNS)) if near else 0
    m = 1 << (t + 1)
    b0 = ((1 << t) + r) * pow(a, -1, m) % m
    L = p + 1 + t
    lo = -(-(1 << (L - 1)) // a)
    hi = min(((1 << L) - 1) // a, (1 << p) - 1)
    first = lo + (b0 - lo) % m
    if first > hi:
        return None
    b = first + m * draw(ints(0, (hi - first) // m))
    shift = draw(ints(-2, 2))
    x = draw(choice(_SIGNS)) * a * _pow2(shift - (a.bit_length() - 1))
    y = draw(choice(_SIGNS)) * b * _pow2(-(b.bit_length() - 1))
    return Plan(((x, y),), (kind,))


def complex_cancellation(draw: st.DrawFn, fmt: Format, part: str) -> tuple[complex, complex]:
    """x, y whose complex product cancels in ``part`` ("real" or "imag")."""
    big, small = _cancelling_pair(draw, fmt)
    u = _pow2(draw(ints(-2, 2)))
    # With x = u(1 + i), x*y = u(yr - yi) + i u(yr + yi); big + small is the tiny D,
    # so yi = -small leaves u*D in the real part and yi = small in the imaginary one.
    return complex(u, u), complex(big, -small if part == "real" else small)
