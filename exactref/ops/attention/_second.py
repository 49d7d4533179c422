"""Attention's second pass: the first pass's undecided elements again, in 64-bit extended precision.

The first pass leaves a few elements undecided, and an element of grad_key or
grad_value needs every row of its heads: in Arb that is S exps and products
per row, in Python.  This pass recomputes just what those elements need,
vectorised in numpy's ``longdouble`` when that is the x87 80-bit format (u =
2**-64), with the same kind of proven bounds as the first pass.  Only the
values are longdouble; the bounds are float64, from float64 bounds on the
values' magnitudes, which keeps the slow longdouble operations few; sums go
by pairs, whose error bound grows with the log of their length.  Its
enclosures are about 1000 to 4000 times tighter than the first pass's, so
for a float32 or narrower output it decides essentially every element that
is not exactly a boundary; a float64 output still sends most of its elements
on.  The rest go on to Arb and the exact analysis.  Where ``longdouble`` has no more precision than float64 (some
platforms), the pass is skipped.

It reuses the first pass's error-free products: the logits' dot products and
dP = dO V^T come as ``hi + lo +- rad`` with rad about 2**-100 relative.
With numba, the whole rows that grad_key and grad_value need (each row's sum of
weights and D) come from a compiled double-double loop instead (_rowsums), and
only the keys asked for are weighed here.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

from ..._parallel import for_each, serially
from ..._pool import empty
from ...engine.fast import up
from . import _rowsums
from ._first import TINY, FirstPass, expm1_up, ratio_error
from ._problem import Problem

__all__ = ["SecondPass", "available"]

LD = np.longdouble
_SHARED_HEAD = 1 << 14  # a head of at least this many weights is worth a thread of its own
_INFO = np.finfo(LD)
_P = _INFO.nmant + 1
U2 = float(_INFO.eps) / 2


def _ld(x: mpmath.mpf) -> np.longdouble:
    # numpy parses a decimal string into longdouble to within an ulp.
    return LD(mpmath.nstr(x, 40, strip_zeros=False))


# exp(y) = 2**m * T[j] * (1 + r + q(r)) with y = (N m + j) ln2/N + r, |r| <= R_MAX, and
# q(r) = exp(r) - 1 - r.  Only 1 + r needs longdouble's precision: q(r) < R_MAX**2 < 2**-19, so
# float64 gives it to about 2**-70 absolutely.  ln2/N = _C_HI + _C_LO + t with _C_HI a multiple of
# 2**-39 below 2**-8 (31 bits, so k * _C_HI is exact in float64 for |k| < 2**22, as every k here is),
# _C_LO a float64 below 2**-39 (k * _C_LO, below 2**-17, rounds in float64 by at most 2**-70) and
# |t| <= _C_TAIL, about 2**-93.  Both products in float64 and then converted: two longdouble
# multiplications fewer per exp (each about 3 ns an element, a float64 one a tenth of that).
_N = 256
with mpmath.workprec(256):
    _C = mpmath.log(2) / _N
    _C_HI = float(mpmath.floor(_C * 2 ** 39)) / 2 ** 39
    _C_LO = float(_C - _C_HI)
    _C_TAIL = float(abs(_C - _C_HI - _C_LO)) * 2
    _TABLE = np.array([_ld(mpmath.mpf(2) ** (mpmath.mpf(j) / _N)) for j in range(_N)], dtype=LD)
_Y_MIN = -11000.0  # exp(-11000) > 2**-15870 is normal in the x87 format and in binary128
_K_MAX = -_Y_MIN * _N / math.log(2) + 1
# k = rint(y N / ln2) in float64 errs from the exact nearest integer by at most 2**-50 |y N / ln2|.
_R_MAX = math.log(2) / (2 * _N) * (1 + 2.0 ** -40) + -_Y_MIN * 2.0 ** -48
_Q_COEF = [1.0 / math.factorial(n) for n in range(2, 7)]


def _q_error(r_max: float) -> float:
    """|q~ - q(r)| for |r| <= r_max: the degree-6 truncation, r's rounding to float64 (q' = e**r - 1),
    and the float64 evaluation: 10 roundings plus 5 coefficients 1/n!, each at most 2**-53
    relative, on terms whose magnitudes sum to below 0.51 r_max**2 (counted as 32 to spare); plus
    underflow."""
    return (r_max ** 7 / math.factorial(7) * math.exp(r_max) + 2 * r_max * 2.0 ** -53 * r_max
            + 32 * 2.0 ** -53 * 0.51 * r_max ** 2) * 1.01 + 2.0 ** -1000


_E_Q = _q_error(_R_MAX)
# |r~ - r| <= U2 (|r1| + |t| + |r|) + 2**-53 |k _C_LO| + |k| C_TAIL, with |t| <= |k| |C_LO| (1 + 2**-53)
# and |r1| <= |r| + |t| + U2 |r1|: the two longdouble subtractions, k _C_LO's float64 rounding and
# the tail of ln2/N.
_ERR_R = (U2 * (2 * _R_MAX + 2 * _K_MAX * abs(_C_LO) * (1 + 2.0 ** -52)) * (1 + 4 * U2)
          + 2.0 ** -53 * _K_MAX * abs(_C_LO) + _K_MAX * _C_TAIL) * 1.01
# The table entry (2 U2), T s (U2) and T + T s (U2) each round once in longdouble, s = r + q (U2 |s|);
# everything else enters through |s~ - s| over 1 - |s|.
_EXP_REL = up(4 * U2 + (_ERR_R + _E_Q + U2 * 0.0014) * 1.002 + 2.0 ** -100)
# The relative error of a weight in _rowsums' loop (double-double), and one bound for both.
_EXP_REL_DD = _rowsums.exp_rel(_C_LO, _C_TAIL, _q_error)
_EXP_REL_ROWS = max(_EXP_REL, _EXP_REL_DD)


def available() -> bool:
    """Whether longdouble has enough precision beyond float64 for this pass to pay."""
    return _P >= 64


def _f(x: np.ndarray) -> np.ndarray:
    """float64 upper bounds of nonnegative longdouble values."""
    return up(np.asarray(x, dtype=np.float64) * (1 + 2.0 ** -50))


def _gamma(n: int) -> float:
    return n * U2 / (1 - n * U2) * (1 + 2.0 ** -40)


def _pairwise_sum(x: np.ndarray) -> tuple[np.ndarray, int]:
    """Sums over the last axis, by pairs, and the number of levels of pairs.

    Each term passes through at most ``levels`` = ceil(log2 n) roundings, so
    the error is at most gamma_levels times the sum of the |terms|: 8 for 256
    terms, where a sum in any order can only be bounded by gamma_255.
    """
    n = x.shape[-1]
    levels = max(n - 1, 0).bit_length()
    if n != 1 << levels:
        padded = np.zeros(x.shape[:-1] + (1 << levels,), dtype=x.dtype)
        padded[..., :n] = x
        x = padded
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0], levels


def _dot(X: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum_k X[..., k] Y[..., k] in longdouble, and a bound (float64) on its rounding error.

    Each product rounds once and the pairwise sum adds ``levels`` more, so the error is at
    most gamma_{levels+1} sum |X Y|; that sum, itself rounded, is scaled up to stay an upper bound.
    """
    n = X.shape[-1]
    prod = X * Y
    total, levels = _pairwise_sum(prod)
    absum = _f(np.abs(prod).sum(axis=-1)) * (1 + 2 * _gamma(n))
    return total, up(_gamma(levels + 1) * absum)


def _reduce(y: np.ndarray, yf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k = rint(y N / ln2) (float64, from ``yf``, y rounded to float64) and r = y - k ln2/N in
    longdouble, within _ERR_R of the exact r, for -11000 <= y <= 1 (see the constants above)."""
    k = np.rint(yf * (_N / math.log(2)))
    return k, (y - LD(k * _C_HI)) - LD(k * _C_LO)


def _exp(y: np.ndarray, yf: np.ndarray) -> tuple[np.ndarray, float]:
    """exp(y) for longdouble y <= 0 (a few units of float64 above 0 allowed), and a bound on its relative error.

    ``yf`` is y rounded to float64.  Table-driven with N = 256 entries; see
    the constants above.  Below -11000 (-inf included) the value is
    exp(-11000), far below the callers' ``TINY``.  Above 1 (a masked logit
    above the row's maximum) and at NaN (where the callers' bounds are
    infinite) the value is meaningless but harmless.
    """
    inside = (yf >= _Y_MIN) & (yf <= 1.0)
    if not inside.all():
        yf = np.clip(np.nan_to_num(yf, nan=_Y_MIN), _Y_MIN, 1.0)
        y = np.where(inside, y, LD(yf))
    k, r = _reduce(y, yf)
    rf = np.asarray(r, dtype=np.float64)
    q = _Q_COEF[-1]
    for c in reversed(_Q_COEF[:-1]):
        q = q * rf + c
    s = r + LD(q * rf * rf)
    ki = k.astype(np.int64)
    j = ki & (_N - 1)  # ki mod N, and m = (ki - j) / N below, for N a power of two
    t = _TABLE[j]
    value, m = t + t * s, ki >> (_N.bit_length() - 1)
    if m.min(initial=0) < -1022:
        return np.ldexp(value, m), _EXP_REL
    # A float64 power of two (its bits written directly: np.ldexp costs several times more) is
    # exact in longdouble, and multiplying by it is much faster than ldexp.
    return value * ((m + 1023) << 52).view(np.float64).astype(LD), _EXP_REL


def _abs_up(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray | float = 0.0) -> np.ndarray:
    """A float64 bound on |hi + lo| + rad and on the magnitude of its longdouble sum."""
    return up((np.abs(hi) + np.abs(lo) + rad) * (1 + 2.0 ** -50))


def _sum_up(x: np.ndarray) -> np.ndarray:
    """An upper bound on the exact sum of nonnegative float64 x over the last axis."""
    return up(np.sum(x, axis=-1) * (1 + _G64 * x.shape[-1]))


_G64 = 2.0 ** -52  # above gamma_1 for float64: a float64 sum of n terms errs by at most n of these
_ROWS_BLOCK = 1 << 16  # weights per block of rows of _Rows (its longdouble temporaries: 1 MiB each)


class _Rows:
    """Weights and dS of some rows of one head, in longdouble with bounds.

    Only the values are longdouble; the bounds are float64, from float64
    bounds on the values' magnitudes, so that the costly longdouble
    operations are few.

    With ``whole`` False (every row of a head, for grad_key and grad_value, which ask for a few
    keys) the weights are kept unnormalised, w and the row sums W: the weights P = w / W and
    dS are formed at the keys asked for, and D = rowsum(P dP) as rowsum(w dP) / W.  That spares,
    per weight of the head, a division, its float64 bounds and five arrays of the head's size: at
    1x8x1024x64 float32, grad_key's pass (223 elements in 8 heads) took 0.39 s against 0.42 s with
    the exp's changes alone and 0.46 s before them (medians of 6).
    """

    def __init__(self, sp: SecondPass, h: int, rows: np.ndarray, whole: bool = True) -> None:
        self.rows, self.h = rows, h
        self.unm = sp.fp.unmasked[h, rows]
        n, S = self.unm.shape
        self.compiled = False
        if whole:
            self.w = None
            self.P = empty((n, S), LD)
            self.P_f, self.e_P = empty((n, S), np.float64), empty((n, S), np.float64)
        else:
            self.w = None
            done = _compiled_rows(sp, h, rows, self.unm)
            if done is not None:
                # Only the row sums: the keys asked for are weighed later (weights, dS).
                self.Wd, self.pi, D, e_D = done
                self._D = (None, None, D, e_D)
                self.compiled = True
                return
            self.w, self.Wd, self.pi = empty((n, S), LD), np.empty(n, dtype=LD), np.empty(n)
        # Each row's weights are its own: a block of rows at a time, so that the temporaries (a
        # longdouble is 16 bytes) stay in the cache.  A whole head of 1024 x 1024 took 137 ms on its
        # own, in blocks of 64 rows 102 (minima of three).
        for sl in self._blocks():
            self._weights(sp, sl)

    def _blocks(self) -> list[slice]:
        """The blocks of rows of about _ROWS_BLOCK weights that the passes over whole rows take."""
        n, S = self.unm.shape
        step = max(1, _ROWS_BLOCK // max(S, 1))
        return [slice(a, a + step) for a in range(0, n, step)]

    def _weights(self, sp: SecondPass, sl: slice) -> None:
        """P, P_f >= P~ and e_P >= |P~ - P| of the rows ``sl`` of this object's rows (or w, W and pi)."""
        rows = self.rows[sl]
        unm = self.unm[sl]
        w, ey, rel = _unnormalised(sp, self.h, rows, slice(None), unm)
        # The row's worst relative error of a weight, epsbar = max_j up(expm1_up(ey_j) (1 + rel) + rel)
        # over its unmasked keys, is that of the largest ey_j: the bound is nondecreasing in ey up
        # to 1 (beyond, expm1_up changes formula and each element counts).
        ey_unm = ey if unm.all() else np.where(unm, ey, 0.0)
        eymax = np.max(ey_unm, axis=-1, initial=0.0)
        epsbar = np.where(unm.any(axis=-1), up(expm1_up(eymax) * (1 + rel) + rel), 0.0)
        past = np.nonzero(eymax > 1)[0]
        if past.size:
            eps = np.where(unm[past], up(expm1_up(ey[past]) * (1 + rel) + rel), 0.0)
            epsbar[past] = np.max(eps, axis=-1, initial=0.0)
        # The pairwise sum of nonnegative terms errs by at most gamma_levels of the sum.
        W, levels = _pairwise_sum(w)
        full = ~unm.any(axis=-1)
        Wd = np.where(full, LD(1), W)
        # |w~_j / W~ - P_j| <= pi P_j (+ TINY), and so for its rounding P~ (pi holds a u for it).
        pi = _pi(epsbar, _gamma(levels))
        if self.w is not None:
            self.w[sl], self.Wd[sl], self.pi[sl] = w, Wd, pi
            return
        P = self.P[sl]  # (a view: written in place)
        np.divide(w, Wd[:, None], out=P)
        self.P_f[sl], self.e_P[sl] = _weight_bounds(P, pi, unm)

    def weights(self, sp: SecondPass, cols: np.ndarray | slice = slice(None)
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P, P_f and e_P at the keys ``cols`` of every row (formed there if the weights are kept
        unnormalised: the same values as those of the whole rows; weighed there, if only the row
        sums were made: values within the same bound)."""
        if self.compiled:
            # Each weight's error is at most the row's epsbar, which the loop's eymax bounds
            # (docs/attention.md, "The compiled row sums"), whatever its own ey.
            unm = self.unm[:, cols]
            w = _unnormalised(sp, self.h, self.rows, cols, unm)[0]
            P = w / self.Wd[:, None]
            return (P, *_weight_bounds(P, self.pi, unm))
        if self.w is None:
            return self.P[:, cols], self.P_f[:, cols], self.e_P[:, cols]
        P = self.w[:, cols] / self.Wd[:, None]
        return (P, *_weight_bounds(P, self.pi, self.unm[:, cols]))

    def dS(self, sp: SecondPass, cols: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """dS of these rows and bounds on its error, at the keys ``cols`` (every key if None).

        D needs each row whole; the rest is elementwise, so only the columns asked for are formed:
        grad_key asks for a few keys of every row of its heads (1x8x1024x64 float32: about 30 of
        1024 keys a head, where forming every column took about 15% of the head's time).
        """
        if not hasattr(self, "_D"):
            n, S = self.unm.shape
            kept = (empty((n, S), LD), empty((n, S), np.float64)) if self.w is None else (None, None)
            self._D = (*kept, np.empty(n, dtype=LD), np.empty(n))
            for sl in self._blocks():
                self._row_sums(sp, sl)
        dP_all, e_dP_all, D, e_D = self._D
        at = (slice(None), slice(None) if cols is None else cols)
        P, P_f, e_P = self.weights(sp, at[1])
        unm = self.unm[at]
        if dP_all is not None:
            dP, e_dP = dP_all[at], e_dP_all[at]
        else:
            # (Only those keys' values are read: not a copy of every row's first.)
            pick = (self.rows,) if cols is None else np.ix_(self.rows, cols)
            dP, e_dP, _ = _dP(*(a[pick] for a in sp.dP_parts(self.h)))
        T = dP - D[:, None]
        aT = _f(np.abs(T))
        e_T = up(e_dP + e_D[:, None] + U2 * aT)
        dS = P * T
        if not unm.all():
            dS = np.where(unm, dS, LD(0))
        e_dS = up(e_P * (aT + e_T) + P_f * e_T * (1 + 2 * U2) + U2 * P_f * aT * (1 + 4 * U2))
        return dS, np.where(unm, e_dS, 0.0)

    def _row_sums(self, sp: SecondPass, sl: slice) -> None:
        """D = rowsum(P dP) and e_D of the rows ``sl`` (and their dP and e_dP, if the weights are kept
        whole), into ``self._D``."""
        dP_all, e_dP_all, D, e_D = self._D
        dP_b, e_dP_b, adP = _dP(*(a[self.rows[sl]] for a in sp.dP_parts(self.h)))
        if dP_all is not None:
            dP_all[sl], e_dP_all[sl] = dP_b, e_dP_b
            P, P_f, e_P = self.P[sl], self.P_f[sl], self.e_P[sl]
            # D = sum_j P_ij dP_ij: the products and their pairwise sum err by gamma_{levels+1}
            # sum |P~ dP~|, and the weights' own error counts with |dP|.
            D[sl], levels = _pairwise_sum(P * dP_b)
            D_err = _gamma(levels + 1) * _sum_up(P_f * adP)
            e_D[sl] = up(D_err + _sum_up(e_P * (adP + e_dP_b) + P_f * e_dP_b))
            return
        D[sl], e_D[sl] = _unnormalised_row_sums(self.w[sl], self.Wd[sl], self.pi[sl], dP_b, e_dP_b, adP)


def _unnormalised(sp: SecondPass, h: int, rows: np.ndarray, cols: np.ndarray | slice, unm: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, float]:
    """The weights w~ = exp(y~) of head h at ``rows`` x ``cols`` (0 where masked), ey >= |y~ - y| and
    the exp's relative error."""
    fp, pb = sp.fp, sp.pb
    at = np.ix_(rows, cols) if isinstance(cols, np.ndarray) else (rows, cols)
    d_hi, d_lo, d_rad = (a[at] for a in sp.logit_parts(h))
    s, es, abs_s = sp.s, sp.e_s, sp.abs_s
    x = s * (LD(d_hi) + LD(d_lo))  # d~ = hi + lo errs by U2 |d~| and d_rad; s d~ by U2 |s d~|
    ad = _abs_up(d_hi, d_lo, d_rad)  # >= |d| and |d~|
    ex = es * ad + abs_s * (d_rad + U2 * ad) + U2 * abs_s * ad * (1 + 2.0 ** -50)
    if pb.additive is not None:
        add = pb.additive[h][at]
        x = x + LD(add)
        ex = ex + U2 * up(abs_s * ad * (1 + 2.0 ** -50) + np.abs(add))
    yv = x - LD(fp.M[h, rows])[:, None]
    yf = np.asarray(yv, dtype=np.float64)
    ey = up((ex + U2 * np.where(unm, up(np.abs(yf)), 0.0)) * (1 + 4 * U2))
    w, rel = _exp(yv, yf)
    if not unm.all():
        w = np.where(unm, w, LD(0))
    return w, ey, rel


def _pi(epsbar: np.ndarray, g_W: float) -> np.ndarray:
    """|w~_j / W~ - P_j| <= pi P_j (+ TINY) for weights within epsbar and a row sum W~ within g_W of
    the sum of w~ (pi holds a u for the quotient's rounding)."""
    return np.where(epsbar < 0.5, ratio_error(epsbar, U2, g_W), np.inf)


def _compiled_rows(sp: SecondPass, h: int, rows: np.ndarray, unm: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Wd, pi, D and e_D of head h's ``rows`` from _rowsums' loop; None where it does not apply (no
    numba, an additive mask, a row with a weight below exp(Y_LOW) or an error bound past 1)."""
    if sp.pb.additive is not None or sp.scale_parts is None:
        return None
    whole = len(rows) == unm.shape[0] == sp.pb.L and bool((rows == np.arange(len(rows))).all())
    at = slice(None) if whole else rows
    out = _rowsums.row_sums(tuple(a[at] for a in sp.logit_parts(h)), tuple(a[at] for a in sp.dP_parts(h)),
                            np.ascontiguousarray(unm), np.ascontiguousarray(sp.fp.M[h, rows]), sp.scale_parts, U2,
                            (_N / math.log(2), _C_HI, _C_LO), _Q_COEF)
    if out is None or not out[:, 9].all():
        return None
    S = unm.shape[1]
    full = ~unm.any(axis=-1)
    Wd = np.where(full, LD(1), LD(out[:, 0]) + LD(out[:, 1]))
    # Every weight's ey (the loop's, and the one _unnormalised finds for it, whose float64 y may
    # differ by an ulp: 2**-52 of its ey at most) lies below the row's eymax.
    eymax = up(out[:, 4] * (1 + 2.0 ** -40))
    epsbar = np.where(full, 0.0, up(expm1_up(eymax) * (1 + _EXP_REL_ROWS) + _EXP_REL_ROWS))
    pi = _pi(epsbar, up((U2 + 1.01 * _rowsums.sum2_gamma(2 * S)) * (1 + 2.0 ** -40)))
    D = (LD(out[:, 2]) + LD(out[:, 3])) / Wd
    grow = 1 + _G64 * S
    sums = tuple(up(out[:, k] * grow) for k in (5, 6, 7, 8))
    g_Q = up((1.01 * U2 + 2.02 * 2.0 ** -106 + 1.01 * _rowsums.sum2_gamma(5 * S)) * (1 + 2.0 ** -40))
    return Wd, pi, D, _d_bound(D, Wd, pi, sums, g_Q, S * 2.0 ** -1060)


def _weight_bounds(P: np.ndarray, pi: np.ndarray, unm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P_f >= P~ and e_P >= |P~ - P| for weights P~ (longdouble) of rows with the bound pi."""
    P_f = _f(P)
    P_up = P_f * (1 + 2 * U2) / (1 - pi[:, None]) + TINY
    return P_f, np.where(unm, up(P_up * pi[:, None] + TINY), 0.0)


def _dP(dP_hi: np.ndarray, dP_lo: np.ndarray, dP_rad: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dP~ = hi + lo in longdouble, e_dP >= |dP~ - dP| and a bound on |dP~|."""
    adP = _abs_up(dP_hi, dP_lo)  # >= |dP~|
    return LD(dP_hi) + LD(dP_lo), dP_rad + U2 * adP, adP


def _unnormalised_row_sums(w: np.ndarray, Wd: np.ndarray, pi: np.ndarray, dP: np.ndarray, e_dP: np.ndarray,
                           adP: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """D~ = rowsum(w~ dP~) / W~ and e_D >= |D~ - D|, D = sum_j P_j dP_j the exact one.

    With Q = sum_j w~_j dP~_j exactly, Q~ its pairwise sum and a_j = w~_j / W~ (real quotients),
    D~ - D = (D~ - Q~/W~) + (Q~ - Q)/W~ + sum_j (a_j - P_j) dP~_j + P_j (dP~_j - dP_j), where
    |a_j - P_j| <= pi P_j + TINY, so P_j <= a_j / (1 - pi) + 2 TINY (pi < 1/2), and
    |Q~ - Q| <= gamma_{levels+1} sum_j w~_j |dP~_j|.  Every sum of a_j x_j is bounded in float64
    by sum_j w_f x_j over a lower bound on W~ (at least 1, its largest term being exp(0)).
    """
    Q, levels = _pairwise_sum(w * dP)
    D = Q / Wd
    w_f = _f(w)  # >= w~
    sums = (_sum_up(w_f * adP), _sum_up(w_f * e_dP), _sum_up(adP), _sum_up(e_dP))
    return D, _d_bound(D, Wd, pi, sums, _gamma(levels + 1))


def _d_bound(D: np.ndarray, Wd: np.ndarray, pi: np.ndarray, sums: tuple[np.ndarray, ...], g_Q: float,
             absolute: float = 0.0) -> np.ndarray:
    """e_D of :func:`_unnormalised_row_sums`, from upper bounds ``sums`` on the row sums of w_f |dP~|,
    w_f e_dP, |dP~| and e_dP, and Q~'s error, g_Q sum_j w~_j |dP~_j| + ``absolute``."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # A lower bound on W~ (1 - pi), two float64 roundings and the conversion paid for.
        den = np.asarray(Wd, dtype=np.float64) * (1 - pi) * (1 - 2.0 ** -50)
        SA = up(sums[0] / den)  # >= sum_j P_j |dP~_j| and sum_j a_j |dP~_j|
        SE = up(sums[1] / den)  # >= sum_j P_j e_dP_j
        tiny = 2 * TINY * (sums[2] + sums[3])
        e_D = up((g_Q + pi) * SA + SE + tiny + 2 * U2 * _f(np.abs(D)) + absolute / den)
    return np.where(pi < 0.5, e_D, np.inf)


class SecondPass:
    """Tighter enclosures of chosen elements of the outputs, from the first pass's exact products."""

    def __init__(self, pb: Problem, fp: FirstPass, G: np.ndarray | None) -> None:
        self.pb, self.fp, self.G = pb, fp, G
        sc = pb.scale
        if sc.rational is not None:
            self.s = LD(sc.rational.numerator) / LD(sc.rational.denominator)
            self.e_s = U2 * abs(float(self.s)) * 2 * (1 + 2 ** -40)
        else:
            self.s = LD(1) / np.sqrt(LD(sc.root_of))
            self.e_s = 3 * U2 * abs(float(self.s)) * (1 + 2 ** -40)
        self.abs_s = float(_f(abs(self.s)))
        # s as two float64s, exactly, for _rowsums' loop (None if it does not split so).
        s_hi = float(self.s)
        s_lo = float(self.s - LD(s_hi))
        exact = LD(s_hi) + LD(s_lo) == self.s and math.isfinite(s_hi) and abs(s_hi) > 2.0 ** -900
        self.scale_parts = (s_hi, s_lo, self.e_s, self.abs_s) if exact else None
        self._rows: dict[tuple[int, str], _Rows] = {}

    def logit_parts(self, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(a[h] for a in self.fp.logit_parts)

    def dP_parts(self, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(a[h] for a in self.fp.dP_parts)

    def _all_rows(self, h: int) -> _Rows:
        key = (h, "all")
        if key not in self._rows:
            self._rows[key] = _Rows(self, h, np.arange(self.pb.L), whole=False)
        return self._rows[key]

    def _operands(self, which: str, hs: np.ndarray, r: np.ndarray, c: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per element: its terms' first factors (longdouble), their error bounds, and the exact second factors."""
        fp = self.fp
        m = self.pb.S if which in ("out", "query") else self.pb.L
        X = np.zeros((len(hs), m), dtype=LD)
        Xe = np.zeros((len(hs), m))
        Y = np.zeros((len(hs), m))
        heads = np.unique(hs)

        def head(i: int) -> None:
            h = heads[i]
            sel = np.flatnonzero(hs == h)
            if which in ("out", "query"):
                # Only the elements' own rows; they are indexed through ``index`` below.
                own = np.unique(r[sel])
                rows = _Rows(self, int(h), own)
                index = np.full(self.pb.L, -1)
                index[own] = np.arange(len(own))
                rr = index[r[sel]]
            else:
                rows = self._all_rows(int(h))
                rr = r[sel]
            if which == "out":
                X[sel], Xe[sel], Y[sel] = rows.P[rr], rows.e_P[rr], fp.Vh[h][:, c[sel]].T
            elif which == "value":
                P, _, e_P = rows.weights(self, rr)
                X[sel], Xe[sel], Y[sel] = P.T, e_P.T, self.G[h][:, c[sel]].T
            else:
                if which == "query":
                    dS, e_dS = rows.dS(self)
                    X[sel], Xe[sel], Y[sel] = dS[rr], e_dS[rr], fp.Kh[h][:, c[sel]].T
                else:
                    dS, e_dS = rows.dS(self, rr)
                    X[sel], Xe[sel], Y[sel] = dS.T, e_dS.T, fp.Qh[h][:, c[sel]].T
        # Independent heads, side by side (exactref/_parallel.py), where a head's rows are worth
        # waking the helpers for.
        (for_each if self.pb.L * self.pb.S >= _SHARED_HEAD else serially)(head, len(heads))
        return X, Xe, Y

    def enclose(self, which: str, flats: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hi, lo, rad) float64 enclosures of the elements ``flats`` of output ``which``."""
        pb = self.pb
        n = len(flats)
        hi = np.zeros(n)
        lo = np.zeros(n)
        rad = np.full(n, np.inf)
        if n == 0:
            return hi, lo, rad
        shape = pb.flat_shape(which)
        b, r, c = np.unravel_index(flats, shape)
        heads = b[:, None] if which == "out" else pb.copies(which)[b]  # (n, copies)
        values = np.zeros(n, dtype=LD)
        errs = np.zeros(n)
        for k in range(heads.shape[1]):
            X, Xe, Y = self._operands(which, heads[:, k], r, c)
            t, te = _dot(X, LD(Y))
            te = te + _sum_up(Xe * np.abs(Y))
            values = values + t
            errs = errs + te + U2 * _f(np.abs(values))
        if which in ("query", "key"):
            prod = self.s * values
            errs = (abs(float(self.s)) * errs * (1 + 4 * U2) + self.e_s * _f(np.abs(values))
                    + U2 * _f(np.abs(prod)))
            values = prod
        errs = up(errs * (1 + 2 ** -40) + TINY)
        hi = np.asarray(values, dtype=np.float64)
        lo = np.asarray(values - LD(hi), dtype=np.float64)
        # Below float64's normal range the split of the longdouble into two floats is inexact.
        tiny = np.abs(hi) < 2.0 ** -960
        rad = np.where(tiny | ~np.isfinite(errs), np.inf, errs)
        return hi, lo, rad
