"""Attention's elements as an exact rational part plus a remainder, for the refinement past its first precision.

With T_i the keys of row i at its exact largest logit (n of them), the
weights are P_ij = P0_ij + d_ij with P0_ij = 1/n on T_i and 0 elsewhere, and

    d_ij = -r_i / (n W_i) on T_i,   d_ij = w_ij / W_i off it,

where w_ij = exp(x_ij - x_iT) < 1 from the exact difference of the logits,
r_i = sum_{j not in T_i} w_ij and W_i = n + r_i.  Every element is then R +
eps: R the same expression with P0 in place of P, a rational computed
exactly, and eps a sum of terms each proportional to some w, computed in Arb
with its own relative precision.  A direct Arb evaluation must resolve eps
against R, which takes about log2(1/w) bits: 144000 for a logit gap of
10**5, more than the 4096-bit cap, so an R that is exactly a rounding
boundary, or zero, left it undecided.  Here R + eps is decided exactly
(:func:`decide_split`): the remainder's sign settles a boundary.

The logit differences are exact, so no logit that overflows float64 (whose
float64 row maximum is then meaningless) enters a shift.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any

import flint

from ...engine.certified import Decision, decide_ball, precision
from ...formats import Format
from ...rounding import round_dyadic, round_dyadic_down_up

__all__ = ["RowSplit", "Split", "decide_split"]


class Split:
    """One element: ``ball`` holds its value; ``R`` (a Fraction, or None) is its exact part, ``eps`` the rest."""

    __slots__ = ("R", "ball", "eps")

    def __init__(self, ball: flint.arb, R: Fraction | None, eps: flint.arb) -> None:
        self.ball, self.R, self.eps = ball, R, eps

    def contains(self, x: Any) -> bool:
        return self.ball.contains(x)

    def mid(self) -> Any:
        return self.ball.mid()


def _ball(x: Fraction) -> flint.arb:
    """An Arb ball of the rational x: exact when x is dyadic."""
    d = x.denominator
    if d & (d - 1) == 0:
        with precision(max(flint.ctx.prec, abs(x.numerator).bit_length() + 8)):
            return flint.arb(flint.fmpz(x.numerator)) * flint.arb(2) ** (-(d.bit_length() - 1))
    return flint.arb(flint.fmpq(x.numerator, d))


def _compare(a: Any, b: Any, E: int | None) -> int:
    """The sign of logit(a) - logit(b), exactly; a key is a Fraction, or (d, m) for s d + m with s = 1/sqrt(E)."""
    if E is None:
        return (a > b) - (a < b)
    A, B = a[0] - b[0], a[1] - b[1]
    if A == 0 or B == 0 or (A > 0) == (B > 0):
        x = A if A != 0 else B
        return (x > 0) - (x < 0)
    # s A + B with opposite signs: |s A| against |B|, i.e. A**2 against E B**2 (never equal: sqrt(E) is irrational).
    dominant = A if A * A > E * B * B else B
    return 1 if dominant > 0 else -1


class RowSplit:
    """P0, d and, for a backward, dS0 and eps_dS of one row, at the current precision."""

    def __init__(self, keys: list[Any], scale: Any, dP: list[Fraction] | None) -> None:
        E = scale.root_of
        live = [j for j, k in enumerate(keys) if k is not None]
        S = len(keys)
        self.live = live
        self.P0: list[Fraction] = [Fraction(0)] * S
        zero = flint.arb(0)
        self.d: list[flint.arb] = [zero] * S
        self.T: set[int] = set()
        if not live:
            self.dS0, self.eps = [Fraction(0)] * S, [zero] * S
            return
        cmp = functools.cmp_to_key(lambda a, b: _compare(keys[a], keys[b], E))
        top = max(live, key=cmp)
        T = {j for j in live if _compare(keys[j], keys[top], E) == 0}
        n = len(T)
        s = scale.ball()
        w = {}
        for j in live:
            if j not in T:
                diff = (_ball(keys[j] - keys[top]) if E is None
                        else s * _ball(keys[j][0] - keys[top][0]) + _ball(keys[j][1] - keys[top][1]))
                w[j] = diff.exp()
        r = sum(w.values(), zero)
        W = r + n
        for j in T:
            self.P0[j] = Fraction(1, n)
            self.d[j] = -r / (W * n) if w else zero
        for j, wj in w.items():
            self.d[j] = wj / W
        self.T, self.n, self.w, self.r, self.W = T, n, w, r, W
        if dP is not None:
            self._backward(dP)

    def _backward(self, g: list[Fraction]) -> None:
        """dS = dS0 + eps with dS0_j = (g_j - D0) / n on T; D = D0 + Delta with
        Delta = sum_{k not in T} w_k (g_k - D0) / W, so nothing of order 1 cancels."""
        S, T, n, W = len(g), self.T, self.n, self.W
        zero = flint.arb(0)
        D0 = sum((g[j] for j in T), Fraction(0)) / n
        Delta = sum((wk * _ball(g[k] - D0) for k, wk in self.w.items() if g[k] != D0), zero) / W
        self.dS0 = [(g[j] - D0) / n if j in T else Fraction(0) for j in range(S)]
        self.eps = [zero] * S
        for j in T:
            t = -self.r * _ball(g[j] - D0) / (W * n) if g[j] != D0 and self.w else zero
            self.eps[j] = t - Delta / W
        for j, wj in self.w.items():
            self.eps[j] = wj / W * (_ball(g[j] - D0) - Delta)

    def pair_weight(self, j: int, k: int) -> tuple[Fraction, flint.arb]:
        """P_j P_k as P0_j P0_k + its remainder, each remainder term a product of w's."""
        n, W = self.n, self.W
        inj, ink = j in self.T, k in self.T
        if inj and ink:
            return Fraction(1, n * n), -self.r * (self.r + 2 * n) / (W * W * (n * n)) if self.w else flint.arb(0)
        if inj or ink:
            other = k if inj else j
            return Fraction(0), self.w[other] / (W * W)
        return Fraction(0), self.w[j] * self.w[k] / (W * W)


def _top(n: int, e: int) -> int:
    return e + abs(n).bit_length() if n else -(1 << 62)


def _end(x: flint.arb, sign: int, cut: int) -> tuple[int, int]:
    """mid + sign * rad of ball x as a dyadic (n, e), rounded outward, a magnitude below 2**cut made sign * 2**cut."""
    m, e = (int(t) for t in x.mid().man_exp())
    r, f = (int(t) for t in flint.arb(x.rad()).man_exp())
    if m == 0 and r == 0:
        return 0, 0
    if max(_top(m, e), _top(r, f)) < cut:
        # The whole ball is below 2**cut: only the end's sign matters.
        if r == 0 or _top(r, f) < _top(m, e) - 1:
            s = 1 if m > 0 else -1
        elif m == 0 or _top(m, e) < _top(r, f) - 1:
            s = sign
        else:
            k = min(e, f)
            v = (m << (e - k)) + sign * (r << (f - k))
            s = (v > 0) - (v < 0)
        return (s, cut) if s else (0, 0)
    k = max(min(e, f), cut - 64)
    if e >= k:
        mid = m << (e - k)
    elif _top(m, e) < k:
        mid = (-1 if m < 0 else 0) if sign < 0 else (0 if m < 0 else 1)
    else:
        mid = m >> (k - e) if sign < 0 else -((-m) >> (k - e))
    rad = r << (f - k) if f >= k else (-((-r) >> (k - f)) if _top(r, f) >= k else 1)
    v = mid + sign * rad
    if v and _top(v, k) < cut:
        return (1 if v > 0 else -1), cut
    return v, k


def _decide_sum(R: Fraction, eps: flint.arb, fmt: Format) -> Decision | None:
    """The rounding of R + eps for a dyadic R != 0, exactly.

    A remainder end below 2**cut is moved to +-2**cut: below R's lowest bit
    and every format's rounding grid (2**-1075 and coarser), that changes
    neither the rounding nor the float64 bounds.
    """
    n, d = R.numerator, R.denominator
    e = -(d.bit_length() - 1)
    cut = min((n & -n).bit_length() - 1 + e, -1076) - 2
    ends = []
    for sign in (-1, 1):
        a, k = _end(eps, sign, cut)
        b = min(e, k)
        ends.append(((n << (e - b)) + (a << (k - b)), b))
    (lo_n, lo_e), (hi_n, hi_e) = ends
    if (lo_n > 0) != (hi_n > 0) or lo_n == 0 or hi_n == 0:
        return None
    r_lo, r_hi = round_dyadic(lo_n, lo_e, fmt), round_dyadic(hi_n, hi_e, fmt)
    if r_lo != r_hi or math.copysign(1.0, r_lo) != math.copysign(1.0, r_hi):
        return None
    return r_lo, round_dyadic_down_up(lo_n, lo_e)[0], round_dyadic_down_up(hi_n, hi_e)[1]


def _tiny_zero(ball: flint.arb, fmt: Format) -> Decision | None:
    """+0 for a ball of unknown sign proven below half the format's smallest subnormal in magnitude.

    Every point of it rounds to a zero; only the zero's sign is unknown, and
    +0 is what an exact cancellation gives (covers() treats +-0 alike).
    """
    if not ball.is_finite():
        return None
    top = ball.abs_upper()
    if not top < flint.arb(fmt.min_subnormal) / 2:
        return None
    bound = math.nextafter(float(top), math.inf)
    return 0.0, -bound, bound


def _dyadic(R: Fraction) -> bool:
    return R.denominator & (R.denominator - 1) == 0


def decide_split(item: Any, fmt: Format, final: bool = False) -> Decision | None:
    """Decide a ball or a :class:`Split`: the ball itself, then R + eps exactly, and at the ``final``
    precision a value of unknown sign proven to round to zero as +0 (a higher precision may still give its sign)."""
    ball = item.ball if isinstance(item, Split) else item
    decided = decide_ball(ball, fmt)
    if decided is None and isinstance(item, Split) and item.R is not None and item.R != 0 and _dyadic(item.R):
        decided = _decide_sum(item.R, item.eps, fmt)
    if decided is None and final:
        decided = _tiny_zero(ball, fmt)
    return decided
