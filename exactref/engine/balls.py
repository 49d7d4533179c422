"""Double-double balls: ``hi + lo +- rad`` in float64, for enclosures near 2**-100 relative.

A ball holds every real x with ``|x - (hi + lo)| <= rad``.  Each operation
here returns a ball that holds every exact result of its operands' points.
Its float64 operations are either error-free (Knuth's two_sum, Dekker's
two_prod) or roundings, and each rounding's error, at most
``u |computed| + 2**-1075`` with u = 2**-53 (the second term pays for an
underflow), goes into the radius.  The radius is then moved up by
:func:`~exactref.engine.fast.up`: its relative 2**-50 pays for the few
roundings of the radius's own formula (at most six per ``up``), and its
absolute 2**-1070 for the underflows of the operation's roundings (at most
32 of 2**-1075).  No published bound on double-double arithmetic is taken
on trust: each radius is computed from its operands, element by element.

Overflow gives inf or NaN somewhere in the ball; :func:`finite` turns such a
radius into inf, which the callers read as "undecided".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mpmath
import numpy as np

# (_SPLIT_MAX: two_prod's split overflows from it on.)
from .fast import _SPLIT_MAX, U64, two_prod, two_sum, up

__all__ = ["Ball", "add", "constant", "div", "exact", "exp", "finite", "mul", "neg", "sum_last", "where"]

U = U64


class Ball(NamedTuple):
    """Arrays ``hi``, ``lo`` and ``rad`` of one shape: the reals within ``rad`` of ``hi + lo``."""

    hi: np.ndarray
    lo: np.ndarray
    rad: np.ndarray

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, int):  # (NamedTuple's own field access)
            return tuple.__getitem__(self, index)
        return Ball(self.hi[index], self.lo[index], self.rad[index])

    def magnitude(self) -> np.ndarray:
        """An upper bound on |x| for every x in the ball."""
        return up(up(np.abs(self.hi) + np.abs(self.lo)) + self.rad)


def exact(x: np.ndarray | float) -> Ball:
    """The float64 values ``x`` as balls of radius 0."""
    x = np.asarray(x, dtype=np.float64)
    z = np.zeros_like(x)
    return Ball(x, z, z)


def where(cond: np.ndarray, x: Ball, y: Ball) -> Ball:
    return Ball(*(np.where(cond, a, b) for a, b in zip(x, y)))


def neg(x: Ball) -> Ball:
    return Ball(-x.hi, -x.lo, x.rad)


def finite(x: Ball) -> Ball:
    """``x`` with an infinite radius wherever a part is not finite (an overflow)."""
    ok = np.isfinite(x.hi) & np.isfinite(x.lo) & np.isfinite(x.rad)
    return Ball(np.where(ok, x.hi, 0.0), np.where(ok, x.lo, 0.0), np.where(ok, x.rad, np.inf))


def add(x: Ball, y: Ball) -> Ball:
    """x + y.  Two roundings (lo + lo, and that plus two_sum's error), each within u of its result."""
    with np.errstate(over="ignore", invalid="ignore"):
        s, e = two_sum(x.hi, y.hi)
        t = x.lo + y.lo
        c = t + e
        hi, lo = two_sum(s, c)
        rad = up(x.rad + y.rad + U * (np.abs(t) + np.abs(c)))
    return Ball(hi, lo, rad)


def _prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a b = p + e + err with |err| <= the third array: 0 where two_prod is exact, u |p| (+ underflow,
    which ``up`` pays) where p is too small for it, inf where its split overflows."""
    p, e, safe = two_prod(a, b)
    big = (np.abs(a) >= _SPLIT_MAX) | (np.abs(b) >= _SPLIT_MAX)
    return p, e, np.where(safe, 0.0, np.where(big, np.inf, U * np.abs(p)))


def mul(x: Ball, y: Ball) -> Ball:
    """x y.  hi hi exactly; hi lo and lo hi rounded, added and added to the error (four roundings);
    lo lo dropped; the radii propagate as |x~| ry + |y~| rx + rx ry."""
    with np.errstate(over="ignore", invalid="ignore"):
        p, e, err = _prod(x.hi, y.hi)
        a = x.hi * y.lo
        b = x.lo * y.hi
        t = a + b
        c = e + t
        hi, lo = two_sum(p, c)
        rounding = up(U * (np.abs(a) + np.abs(b) + np.abs(t) + np.abs(c)) + np.abs(x.lo) * np.abs(y.lo))
        mx, my = up(np.abs(x.hi) + np.abs(x.lo)), up(np.abs(y.hi) + np.abs(y.lo))
        spread = up(mx * y.rad + my * x.rad + x.rad * y.rad)
        rad = up(rounding + spread + err)
    return Ball(hi, lo, rad)


def div(x: Ball, y: Ball) -> Ball:
    """x / y, with radius inf where the ball y may hold 0.

    q1 = x.hi / y.hi, then the residual r = x~ - q1 y~ in five roundings
    (two_prod makes q1 y.hi exact), q2 = r / y.hi and hi + lo = q1 + q2.  The
    error of the points x~ = hi + lo of the balls is
    |x~/y~ - q1 - q2| <= (|r~ - r| + |r~| |y.lo| / |y.hi|) / |y~| + u |q2|, and
    the radii add (rx + |x~/y~| ry) / (|y~| - ry).
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        q1 = x.hi / y.hi
        p, e, err = _prod(q1, y.hi)
        d = x.hi - p
        f = d - e
        g_ = f + x.lo
        m = q1 * y.lo
        r = g_ - m
        q2 = r / y.hi
        hi, lo = two_sum(q1, q2)
        err_r = up(U * (np.abs(d) + np.abs(f) + np.abs(g_) + np.abs(m)) + U * np.abs(r) + err)
        # Lower bounds on |y~| and on every |Y| of the ball (a rounded difference is at most (1 + u)
        # times the exact one).
        yt = (np.abs(y.hi) - up(np.abs(y.lo))) * (1 - 2.0 ** -51)
        ymin = (yt - y.rad) * (1 - 2.0 ** -51)
        ratio = up(up(np.abs(x.hi) + np.abs(x.lo)) / yt)  # >= |x~ / y~|
        points = up(up(err_r + np.abs(r) * np.abs(y.lo) / np.abs(y.hi)) / yt + U * np.abs(q2))
        rad = up(points + up(x.rad + ratio * y.rad) / ymin)
        rad = np.where((ymin > 0) & (yt > 0), rad, np.inf)
    return Ball(hi, lo, rad)


def sum_last(x: Ball) -> Ball:
    """Sums over the last axis, by pairs (padded with zeros to a power of two)."""
    n = x.hi.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [(0, 0)] * (x.hi.ndim - 1) + [(0, width - n)]
        x = Ball(*(np.pad(a, pad) for a in x))
    while x.hi.shape[-1] > 1:
        x = add(x[..., 0::2], x[..., 1::2])
    return x[..., 0]


def constant(v: mpmath.mpf) -> tuple[float, float, float]:
    """(hi, lo, rad) of a real that the caller computed with mpmath at 300 bits: hi + lo within rad of it."""
    with mpmath.workprec(300):  # (the differences too)
        hi = float(v)
        lo = float(v - hi)
        rest = abs(v - hi - lo)
    # (2**-280 |v|: mpmath's own error at the 300 bits it works with.)
    return hi, lo, float(rest) * 2 + abs(hi) * 2.0 ** -280 + 2.0 ** -1074


# exp(y) = 2**m * 2**(j/N) * exp(r), y = (N m + j) ln2/N + r with k = N m + j = rint(y N / ln2), so
# |r| <= ln2/(2N) + (the rint's float64 error): a table of 2**(j/N) and a degree-8 Taylor polynomial,
# whose remainder |r|**9 / 9! e**|r| is near 2**-104 at |r| = 2**-9.5.  Its terms of degree 4 and more
# (below 2**-42) are summed in plain float64, with a bound: their error is near 2**-90.
# ln2/N = _C1 + _C2 + _C3 + t, |t| <= _C_TAIL, where _C1 and _C2 have at most 33 significant bits,
# so that k _C1 and k _C2 are exact for |k| < 2**20 (|k| <= 745 N / ln 2 + 1 < 2**19 here), and
# k _C3 (below 2**-55) rounds by less than 2**-108.
_N = 256
_DEGREE = 8
with mpmath.workprec(300):
    _C = mpmath.log(2) / _N
    _C1 = float(mpmath.floor(_C * 2 ** 41)) / 2 ** 41
    _C2 = float(mpmath.floor((_C - _C1) * 2 ** 74)) / 2 ** 74
    _C3 = float(_C - _C1 - _C2)
    _C_TAIL = float(abs(_C - _C1 - _C2 - _C3)) * 2 + 2.0 ** -1074
    _TABLE = np.array([constant(mpmath.mpf(2) ** (mpmath.mpf(j) / _N)) for j in range(_N)]).T.copy()
    _COEF = [constant(1 / mpmath.factorial(n)) for n in range(4)]
_TAIL = [1.0 / math.factorial(n) for n in range(4, _DEGREE + 1)]
_Y_MIN = -745.0  # exp(-744) < 2**-1073: below it a weight is 0 within 2**-1070
_Y_MAX = 8.0  # above it the result is given up (callers' arguments are at most about 0)


def _const(c: tuple[float, float, float], like: np.ndarray) -> Ball:
    return Ball(*(np.full_like(like, v) for v in c))


def _tail(r: Ball, ar: np.ndarray) -> Ball:
    """A ball holding sum_{n=4..8} r'**n / n! + (Taylor's remainder) for every r' of the ball r,
    from the float64 r.hi; ``ar`` bounds |r'|, and must be at most 0.5 (radius inf past it)."""
    rf = r.hi
    t = np.full_like(rf, _TAIL[-1])
    for c in reversed(_TAIL[:-1]):
        t = t * rf + c
    r2 = rf * rf
    t = t * (r2 * r2)
    # For ar <= 0.5: sum_{n>=4} ar**n / n! <= 1.12 ar**4 / 24, and |t'| <= 1.7 ar**3 / 6.  The
    # float64 evaluation makes 11 roundings on partial sums below that sum (14 u of it, the
    # coefficients' roundings included); r' differs from r.hi by at most |r.lo| + r.rad.
    a4 = ar * ar * ar * ar
    evaluation = 16 * U * 1.12 / 24 * a4
    spread = 1.7 / 6 * ar * ar * ar * (np.abs(r.lo) + r.rad)
    trunc = ar ** (_DEGREE + 1) / math.factorial(_DEGREE + 1) * 1.7
    err = np.where(ar <= 0.5, up(up(evaluation + spread) + trunc), np.inf)
    return Ball(t, np.zeros_like(t), err)


def exp(y: Ball) -> Ball:
    """exp(y) for balls y below about 8 (a ball below -745 gives [0, 2**-1070]; above 8, radius inf).

    The reduction r = y - k (ln2/N) is a ball operation, so its error (near
    2u**2 (|y| + |k ln2/N|)) is in r's radius and goes through the polynomial
    with it; the polynomial's float64 tail (:func:`_tail`) and the Taylor
    remainder are bounded element by element from |r|'s upper bound.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        low = y.hi < _Y_MIN
        high = ~(y.hi <= _Y_MAX)  # NaN too
        yc = where(low | high, exact(np.zeros_like(y.hi)), y)
        k = np.rint(yc.hi * (_N / math.log(2)))
        kc3 = k * _C3
        # (Normalised first: a lo as large as k _C2 would round, in add, at 2**-77.)
        r = add(yc, neg(Ball(*two_sum(k * _C1, k * _C2), np.zeros_like(k))))
        r = add(r, neg(Ball(kc3, np.zeros_like(k), up(U * np.abs(kc3) + np.abs(k) * _C_TAIL))))
        ar = r.magnitude()
        p = _const(_COEF[3], k)
        for n in (2, 1, 0):
            p = add(mul(p, r), _const(_COEF[n], k))
        p = add(p, _tail(r, ar))
        ki = k.astype(np.int64)
        j = ki & (_N - 1)
        w = mul(Ball(_TABLE[0][j], _TABLE[1][j], _TABLE[2][j]), p)
        m = (ki - j) // _N
        w = Ball(np.ldexp(w.hi, m), np.ldexp(w.lo, m), up(np.ldexp(w.rad, m)))
        # Below -745: 0 <= exp(y) <= exp(-744) where the ball lies below -744.
        # (1e-9 is far above the roundings of that sum, near 2**-43 at 745.)
        tiny = np.where(y.hi + np.abs(y.lo) + y.rad + 1e-9 <= -744.0, 2.0 ** -1070, np.inf)
        zero = np.zeros_like(y.hi)
        w = where(low, Ball(zero, zero, tiny), w)
        w = where(high, Ball(zero, zero, np.full_like(zero, np.inf)), w)
    return finite(w)
