"""Attention's second pass: the first pass's undecided elements again, in 64-bit extended precision.

The first pass leaves a few elements undecided, and an element of grad_key or
grad_value needs every row of its heads: in Arb that is S exps and products
per row, in Python.  This pass recomputes just what those elements need,
vectorised in numpy's ``longdouble`` when that is the x87 80-bit format (u =
2**-64), with compensated sums and the same kind of proven bounds as the
first pass.  It is 2**11 times tighter, so it decides essentially every
element that is not exactly a boundary; those go on to Arb and the exact
analysis.  Where ``longdouble`` has no more precision than float64 (some
platforms), the pass is skipped.

It reuses the first pass's error-free products: the logits' dot products and
dP = dO V^T come as ``hi + lo +- rad`` with rad about 2**-100 relative.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

from ..engine.fast import up
from ._attention_first import TINY, FirstPass, expm1_up, ratio_error, sliced
from ._attention_problem import Problem

__all__ = ["SecondPass", "available"]

LD = np.longdouble
_INFO = np.finfo(LD)
_P = _INFO.nmant + 1
U2 = float(_INFO.eps) / 2


def _ld(x: mpmath.mpf) -> np.longdouble:
    # numpy parses a decimal string into longdouble to within an ulp.
    return LD(mpmath.nstr(x, 40, strip_zeros=False))


# exp(y) = 2**m * T[j] * exp(r) with y = (32 m + j) ln2/32 + r, |r| <= ln2/64: a degree-8
# polynomial then errs by at most |r|**9/9! e**|r| < 2**-76.  ln2/32 = _C_HI + _C_LO + t with
# _C_HI a multiple of 2**-36 (k * _C_HI exact for |k| < 2**22) and |t| < 2**-99.
with mpmath.workprec(256):
    _C = mpmath.log(2) / 32
    _C_HI = LD(float(mpmath.floor(_C * 2 ** 36))) / LD(2 ** 36)
    _C_LO = _ld(_C - mpmath.mpf(float(_C_HI)))
    _TABLE = np.array([_ld(mpmath.mpf(2) ** (mpmath.mpf(j) / 32)) for j in range(32)], dtype=LD)
_C_TAIL = 2.0 ** -99
_DEGREE = 8 if _P <= 64 else 16
_INV_FACT = [LD(1) / LD(math.factorial(n)) for n in range(_DEGREE + 1)]
_R_MAX = 0.01084
_TRUNC = _R_MAX ** (_DEGREE + 1) / math.factorial(_DEGREE + 1) * math.exp(_R_MAX)


def available() -> bool:
    """Whether longdouble has enough precision beyond float64 for this pass to pay."""
    return _P >= 64


def _f(x: np.ndarray) -> np.ndarray:
    """float64 upper bounds of nonnegative longdouble values."""
    return up(np.asarray(x, dtype=np.float64) * (1 + 2.0 ** -50))


def _gamma(n: int) -> float:
    return n * U2 / (1 - n * U2) * (1 + 2.0 ** -40)


def _dot(X: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum_k X[..., k] Y[..., k] in longdouble, and a bound (float64) on its rounding error.

    A plain sum in any order errs by at most gamma_{n+1} sum |X Y| (the products round
    too); the |X Y| sum, itself rounded, is scaled up to stay an upper bound.
    """
    n = X.shape[-1]
    prod = X * Y
    total = prod.sum(axis=-1)
    absum = _f(np.abs(prod).sum(axis=-1)) * (1 + 2 * _gamma(n))
    return total, up(_gamma(n + 1) * absum)


def _exp(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """exp(y) for longdouble y <= 0 and a bound (float64) on its relative error.

    Table-driven (see the constants above), with Higham's running error bound
    for the polynomial; the table entries and the final product each add at
    most an ulp.
    """
    y = np.maximum(y, LD(-11000))
    k = np.rint(y / (_C_HI + _C_LO))
    r1 = y - k * _C_HI
    t = k * _C_LO
    r = r1 - t
    ar = np.abs(r)
    err_r = _f(U2 * (np.abs(r1) + np.abs(t) + ar) * (1 + 2 * U2)) + _f(np.abs(k)) * _C_TAIL
    p = np.full_like(r, _INV_FACT[_DEGREE])
    mu = np.abs(p) / 2
    for c in reversed(_INV_FACT[:_DEGREE]):
        p = p * r + c
        mu = ar * mu + np.abs(p)
    ki = k.astype(np.int64)
    j = ki % 32
    value = np.ldexp(_TABLE[j] * p, (ki - j) // 32)
    # |r| <= ln2/64, so e**|r| < 1.011 and p > 0.98.
    absolute = _f(U2 * (2 * mu - np.abs(p))) * 1.01 + U2 * 1.011 + _TRUNC + 1.011 * err_r * 1.01
    rel = up(absolute / 0.98 + 4 * U2)
    return value, rel


class _Rows:
    """Weights and dS of some rows of one head, in longdouble with bounds."""

    def __init__(self, sp: SecondPass, h: int, rows: np.ndarray) -> None:
        fp, pb = sp.fp, sp.pb
        self.rows = rows
        unm = fp.unmasked[h, rows]
        d_hi, d_lo, d_rad = (a[rows] for a in sp.logit_parts(h))
        s, es = sp.s, sp.e_s
        d = LD(d_hi) + LD(d_lo)
        sd = s * d
        x = sd if pb.additive is None else sd + LD(pb.additive[h, rows])
        absd = _f(np.abs(d))
        ex = (es * absd + _f(np.abs(s)) * (d_rad + U2 * absd) + U2 * _f(np.abs(sd))
              + (0.0 if pb.additive is None else U2 * _f(np.abs(x))))
        M = LD(fp.M[h, rows])[:, None]
        yv = np.where(unm, x - M, LD(-np.inf))
        ey = up((ex + U2 * _f(np.abs(np.where(unm, yv, 0)))) * (1 + 4 * U2))
        w, rel = _exp(np.where(unm, yv, LD(-1)))
        w = np.where(unm, w, LD(0))
        eps = np.where(unm, up(expm1_up(ey) * (1 + rel) + rel), 0.0)
        epsbar = np.max(eps, axis=-1, initial=0.0)
        W, W_err = _dot(w, np.ones(w.shape))
        W_rel = np.where(W > 0, up(W_err / _f(W) * (1 + 2 ** -40)), 0.0)
        full = ~unm.any(axis=-1)
        self.P = w / np.where(full, LD(1), W)[:, None]
        pi = ratio_error(epsbar, U2, W_rel)
        pi = np.where(epsbar < 0.5, pi, np.inf)
        P_up = _f(self.P) * (1 + 2 * U2) / (1 - pi[:, None]) + TINY
        self.e_P = np.where(unm, up(P_up * pi[:, None] + TINY), 0.0)
        self.unm = unm
        self.h = h

    def dS(self, sp: SecondPass) -> tuple[np.ndarray, np.ndarray]:
        if hasattr(self, "_dS"):
            return self._dS
        h, rows = self.h, self.rows
        dP_hi, dP_lo, dP_rad = (a[rows] for a in sp.dP_parts(h))
        dP = LD(dP_hi) + LD(dP_lo)
        e_dP = dP_rad + U2 * _f(np.abs(dP))
        # D = sum_j P_ij dP_ij: the weights' own error counts with |dP|.
        D, D_err = _dot(self.P, dP)
        e_D = up(D_err + np.sum(self.e_P * (_f(np.abs(dP)) + e_dP) + _f(self.P) * e_dP, axis=-1))
        T = dP - D[:, None]
        e_T = up(e_dP + e_D[:, None] + U2 * _f(np.abs(T)))
        dS = np.where(self.unm, self.P * T, LD(0))
        e_dS = up(self.e_P * (_f(np.abs(T)) + e_T) + _f(self.P) * e_T * (1 + 2 * U2) + U2 * _f(np.abs(dS)))
        self._dS = (dS, np.where(self.unm, e_dS, 0.0))
        return self._dS


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
        self._logits: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._dP: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._rows: dict[tuple[int, str], _Rows] = {}

    def logit_parts(self, h: int):
        if h not in self._logits:
            self._logits[h] = sliced(self.fp.Qh[h], self.fp.Kh[h].T)
        return self._logits[h]

    def dP_parts(self, h: int):
        if h not in self._dP:
            self._dP[h] = sliced(self.G[h], self.fp.Vh[h].T)
        return self._dP[h]

    def _all_rows(self, h: int) -> _Rows:
        key = (h, "all")
        if key not in self._rows:
            self._rows[key] = _Rows(self, h, np.arange(self.pb.L))
        return self._rows[key]

    def _operands(self, which: str, hs: np.ndarray, r: np.ndarray, c: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per element: its terms' first factors (longdouble), their error bounds, and the exact second factors."""
        fp = self.fp
        m = self.pb.S if which in ("out", "query") else self.pb.L
        X = np.zeros((len(hs), m), dtype=LD)
        Xe = np.zeros((len(hs), m))
        Y = np.zeros((len(hs), m))
        for h in np.unique(hs):
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
                X[sel], Xe[sel], Y[sel] = rows.P[:, rr].T, rows.e_P[:, rr].T, self.G[h][:, c[sel]].T
            else:
                dS, e_dS = rows.dS(self)
                if which == "query":
                    X[sel], Xe[sel], Y[sel] = dS[rr], e_dS[rr], fp.Kh[h][:, c[sel]].T
                else:
                    X[sel], Xe[sel], Y[sel] = dS[:, rr].T, e_dS[:, rr].T, fp.Qh[h][:, c[sel]].T
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
        shape = (pb.H, pb.L, pb.Ev) if which == "out" else {"query": pb.Q, "key": pb.K, "value": pb.V}[which].shape
        b, r, c = np.unravel_index(flats, shape)
        heads = b[:, None] if which == "out" else pb.copies(which)[b]  # (n, copies)
        values = np.zeros(n, dtype=LD)
        errs = np.zeros(n)
        for k in range(heads.shape[1]):
            X, Xe, Y = self._operands(which, heads[:, k], r, c)
            t, te = _dot(X, LD(Y))
            te = te + np.sum(Xe * np.abs(Y), axis=-1)
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
