"""A compiled loop for the longdouble pass's whole rows (_second._Rows), in double-double, by numba.

Why: an element of grad_key or grad_value needs every row of its head, and each row its sum of
weights W = sum_j exp(y_j) and D = sum_j P_j dP_j.  The longdouble pass made every weight of the
head in numpy's longdouble, about 70 numpy passes over arrays of the head's size.  At 1x8x1024x64
float32 (the benchmark's ``cliff`` row) that was the largest single step of the backward: 0.36 to
0.57 s for 240 elements of grad_key, which need all 8 heads.  This loop makes each row's two sums
in one pass, with no array of the head's size, and only the keys the pending elements ask for are
weighed in longdouble afterwards (_second._Rows.weights).

Each longdouble operation of the pass's exp (_second._exp) is done in double-double (a float64
pair hi + lo), and more precisely than the longdouble one; the sums are compensated (Ogita, Rump
and Oishi's Sum2, without its final rounding).  So the pass's bounds hold with its own formulas,
and the loop widens them only by its own, far smaller, terms.  Derived in docs/attention.md, "The
compiled row sums"; the tests (tests/exactref/test_attention_rowsums.py) check every step against
exact arithmetic and mpmath.  Like exactref/_fused.py's loops: IEEE arithmetic without
fast-math, the GIL released and the machine code kept on disk.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import mpmath
import numpy as np

from ... import _fused
from ...engine.fast import up

__all__ = ["Y_HIGH", "Y_LOW", "exp_rel", "row_sums", "sum2_gamma"]

U = 2.0 ** -53
# The loop weighs logits y with Y_LOW <= y <= Y_HIGH (float64 parts): there exp(y) >= 2**-866, so that
# every product the loop forms stays far above float64's underflow but for its error terms; a row
# with a weight outside (or anything not finite) is left to the longdouble code.
Y_LOW = -600.0
# (An unmasked y is at most a few float64 units above 0; 1/2, not the longdouble code's 1, keeps the
# longdouble y of the keys weighed later, within an ulp of the loop's, inside that code's range too.)
Y_HIGH = 0.5
_N = 256
with mpmath.workprec(256):
    _T = [mpmath.mpf(2) ** (mpmath.mpf(j) / _N) for j in range(_N)]
    _T_HI = np.array([float(t) for t in _T])
    _T_LO = np.array([float(t - mpmath.mpf(float(t))) for t in _T])  # |T - T_HI - T_LO| <= u**2 T


# The loop takes LANES keys at a time, each lane with sums of its own (added together at the end of
# the row), so that the compiler vectorises it: no branch, masked keys and the tail selected away.
LANES = 16
_POW2_MIN = -900  # the scalings 2**m the loop reads from a table (m >= Y_LOW / ln2 - 1 > -900)
_POW2 = np.ldexp(1.0, np.arange(_POW2_MIN, 4))
# The compiled helpers the loop calls, set when it is first built (named as globals: see _fused._BITS).
_TWO_SUM: Any = None
_SPLIT: Any = None
_TWO_PROD: Any = None


def exp_rel(c_lo: float, c_tail: float, q_err: Callable[[float], float]) -> float:
    """The relative error bound of the loop's exp, for y in [Y_LOW, Y_HIGH], the reduction's constants
    being _second's (ln2/N = c_hi + c_lo + t, |t| <= c_tail / 2) and ``q_err(r_max)`` the error
    bound of its float64 q(r).

    The reduction r = y~ - k ln2/N: k c_hi is exact (|k| < 2**18, c_hi has 31 bits), two_sum is
    exact, and three float64 roundings remain, each at most u of a value below |k c_lo| + 2**-30;
    the tail costs |k| c_tail.  s = r + q and T (1 + s) in double-double, with the table's own
    error, come to at most 14.3 u**2 of the result (counted as 21).  The scaling by 2**m is exact
    but for a low part that falls below float64's normal range: 2**-1075 at most, against a weight
    of at least 2**-866 (the 2**-200).
    """
    k_max = -Y_LOW * _N / math.log(2) + 1
    r_max = math.log(2) / (2 * _N) * (1 + 2.0 ** -40) + -Y_LOW * 2.0 ** -48
    err_r = (3 * U * (k_max * abs(c_lo) * (1 + 2.0 ** -50) + 2.0 ** -30) + k_max * c_tail) * 1.01
    return float(up((err_r + q_err(r_max)) * 1.002 + 21 * U * U + 2.0 ** -200))


def sum2_gamma(terms: int) -> float:
    """A bound on the loop's compensated sum of ``terms`` float64 terms (without its last rounding),
    relative to the sum of their magnitudes.

    Sum2 (Ogita, Rump and Oishi) of m terms errs by at most gamma_m**2 of that sum: its running sum
    and the sum of its two_sum errors add up to the exact sum, and the errors' own float64 sum errs
    by gamma_m of their magnitudes, which are at most gamma_m of the terms'.  The loop adds m <= n
    terms in each of LANES lanes, then the 2 LANES lanes' sums and error sums by Sum2 again, whose
    magnitudes are at most (1 + 2 gamma_n) of the terms': in all, below twice gamma_(n + 2 LANES + 1)**2.
    """
    nu = (terms + 2 * LANES + 1) * U
    return float(up(2.01 * up(nu / (1 - nu)) ** 2)) if nu < 0.5 else math.inf


@functools.lru_cache(maxsize=1)
def _helpers() -> None:
    """two_sum (Knuth), Dekker's split and his product of a split a and b: exact, in IEEE float64."""
    global _TWO_SUM, _SPLIT, _TWO_PROD

    @_fused._jit()
    def two_sum(a, b):
        s = a + b
        bb = s - a
        return s, (a - (s - bb)) + (b - bb)

    @_fused._jit()
    def split(a):
        t = 134217729.0 * a
        hi = t - (t - a)
        return hi, a - hi

    @_fused._jit()
    def two_prod(a, ah, al, b):
        # a b = p + e exactly, for a = ah + al split; b split here.  (No overflow: |a|, |b| < 2**900.)
        p = a * b
        t = 134217729.0 * b
        bh = t - (t - b)
        bl = b - bh
        return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl

    _TWO_SUM, _SPLIT, _TWO_PROD = two_sum, split, two_prod


@functools.lru_cache(maxsize=1)
def _loop() -> Callable[..., None]:
    lanes = LANES
    _helpers()
    # The rows of the loop's scratch array: each lane's inputs, intermediate values and sums.
    DH, DL, DR, PH, PL, PR, LV, S1, S2, KF, ADP, EDP, TH, TL, SC = range(15)
    W0, W1, Q0, Q1, EY, SA, SE, SP, SR, BAD = range(15, 25)

    @_fused._jit()
    def rows(d_hi, d_lo, d_rad, p_hi, p_lo, p_rad, unm, M, c, q_coef, T_hi, T_lo, pow2, out):
        # out[i] = (W hi, W lo, Q hi, Q lo, ey max, sum w_f |dP|, sum w_f e_dP, sum |dP|, sum e_dP, ok)
        (s_hi, s_lo, es, abs_s, U2, up_rel, up_abs, inv_c, c_hi, c_lo, y_low, y_high) = c
        magic = 6755399441055744.0  # 1.5 * 2**52: x + magic - magic is rint(x) for |x| < 2**51
        sh, sl = _SPLIT(s_hi)  # (once)
        q0, q1, q2, q3, q4 = q_coef[0], q_coef[1], q_coef[2], q_coef[3], q_coef[4]
        n, S = d_hi.shape
        # One scratch array for every lane's values: rows of it, at constant offsets, are what the
        # compiler can tell apart and so vectorise the loops over the lanes (separate arrays, or
        # the inputs read directly, it cannot).
        B = np.empty((25, lanes))
        for i in range(n):
            B[W0:, :] = 0.0
            m_i = M[i]
            for jb in range(0, S, lanes):
                # Four loops over the lanes: the row's keys jb.. copied in (zeros past the row's
                # end, dead lanes), the arithmetic up to the table index, the tables read (the
                # compiler vectorises no loop that reads a table at a computed index), the rest.
                cnt = min(lanes, S - jb)
                for ln in range(cnt):
                    B[DH, ln] = d_hi[i, jb + ln]
                    B[DL, ln] = d_lo[i, jb + ln]
                    B[DR, ln] = d_rad[i, jb + ln]
                    B[PH, ln] = p_hi[i, jb + ln]
                    B[PL, ln] = p_lo[i, jb + ln]
                    B[PR, ln] = p_rad[i, jb + ln]
                    B[LV, ln] = 1.0 if unm[i, jb + ln] else 0.0
                for ln in range(cnt, lanes):
                    for r in range(LV + 1):
                        B[r, ln] = 0.0
                for ln in range(lanes):
                    live = B[LV, ln] != 0.0
                    ph = B[PH, ln]
                    pl = B[PL, ln]
                    adP = ((abs(ph) + abs(pl)) * (1 + 2.0 ** -50)) * up_rel + up_abs
                    e_dP = B[PR, ln] + U2 * adP
                    dh = B[DH, ln]
                    dl = B[DL, ln]
                    dr = B[DR, ln]
                    ad = (((abs(dh) + abs(dl)) + dr) * (1 + 2.0 ** -50)) * up_rel + up_abs
                    # x = s d: s_hi dh exactly (Dekker), then the rest in float64.
                    p, e = _TWO_PROD(s_hi, sh, sl, dh)
                    t1 = s_hi * dl + s_lo * dh
                    e2 = e + t1
                    # y = x - M: two_sum(p, -M) exactly, e2 into its error term, then renormalised.
                    a, y2 = _TWO_SUM(p, -m_i)
                    y2 = y2 + e2
                    y_hi, y_lo = _TWO_SUM(a, y2)
                    # The pass's bound on |y~ - y| (_second._unnormalised), and the loop's own
                    # roundings, dropped s_lo dl and underflows (docs/attention.md).
                    ex = es * ad + abs_s * (dr + U2 * ad) + U2 * abs_s * ad * (1 + 2.0 ** -50)
                    ex = ex + ((abs_s * abs(dl) + abs(t1) + abs(e2) + abs(y2)) * 2.0 ** -52
                               + abs_s * abs(dh) * 2.0 ** -105 + 2.0 ** -1060) * (1 + 2.0 ** -40)
                    ey = ((ex + U2 * (abs(y_hi) * up_rel + up_abs)) * (1 + 4 * U2)) * up_rel + up_abs
                    fine = (y_low <= y_hi) & (y_hi <= y_high) & (abs(dh) < 2.0 ** 900) & (abs(ph) < 2.0 ** 900) \
                        & (abs(pl) < 2.0 ** 900) & (ey <= 1.0)
                    # exp(y~): k = rint(y N / ln2); r = y~ - k ln2/N in double-double.  (Outside
                    # Y_LOW..Y_HIGH, y is replaced by 0: the row is left to the longdouble code anyway.)
                    yh = y_hi if fine else 0.0
                    yl = y_lo if fine else 0.0
                    kf = (yh * inv_c + magic) - magic
                    r1, re = _TWO_SUM(yh, -(kf * c_hi))
                    r2 = (re + yl) - kf * c_lo
                    r_hi, r_lo = _TWO_SUM(r1, r2)
                    # q(r) = e**r - 1 - r in float64 from r_hi, as the pass does; s = r + q.
                    q = (((q4 * r_hi + q3) * r_hi + q2) * r_hi + q1) * r_hi + q0
                    s1, s2 = _TWO_SUM(r_hi, q * r_hi * r_hi)
                    B[S2, ln] = s2 + r_lo
                    B[S1, ln] = s1
                    B[KF, ln] = kf
                    B[ADP, ln] = adP
                    B[EDP, ln] = e_dP
                    B[EY, ln] = max(B[EY, ln], ey if live else 0.0)
                    B[SP, ln] += adP
                    B[SR, ln] += e_dP
                    B[BAD, ln] += 0.0 if fine or not live else 1.0
                for ln in range(lanes):
                    # (An index always in range: y is in range or replaced by 0.)
                    ki = np.int64(B[KF, ln])
                    B[TH, ln] = T_hi[ki & 255]
                    B[TL, ln] = T_lo[ki & 255]
                    B[SC, ln] = pow2[(ki >> 8) - _POW2_MIN] * B[LV, ln]
                for ln in range(lanes):
                    # T (1 + s) = T + T s: T_hi s1 exactly, then the small terms in float64.
                    th = B[TH, ln]
                    tl = B[TL, ln]
                    s1 = B[S1, ln]
                    ah, al = _SPLIT(th)
                    p, e = _TWO_PROD(th, ah, al, s1)
                    v1, ve = _TWO_SUM(th, p)
                    rest = ((ve + e) + tl) + (th * B[S2, ln] + tl * s1)
                    w_hi, w_lo = _TWO_SUM(v1, rest)
                    w_hi = w_hi * B[SC, ln]
                    w_lo = w_lo * B[SC, ln]
                    # W += w (Sum2: the running sum and its errors' sum), lane by lane.
                    Ws, c1 = _TWO_SUM(B[W0, ln], w_hi)
                    Ws, c2 = _TWO_SUM(Ws, w_lo)
                    B[W0, ln] = Ws
                    B[W1, ln] += c1 + c2
                    # Q += w dP: w_hi ph and w_hi pl exactly (Dekker), w_lo (ph + pl) rounded.
                    ph = B[PH, ln]
                    pl = B[PL, ln]
                    ah, al = _SPLIT(w_hi)
                    p1, e1 = _TWO_PROD(w_hi, ah, al, ph)
                    p2, e2 = _TWO_PROD(w_hi, ah, al, pl)
                    Qs, c1 = _TWO_SUM(B[Q0, ln], p1)
                    Qs, c2 = _TWO_SUM(Qs, e1)
                    Qs, c3 = _TWO_SUM(Qs, p2)
                    Qs, c4 = _TWO_SUM(Qs, e2)
                    Qs, c5 = _TWO_SUM(Qs, w_lo * (ph + pl))
                    B[Q0, ln] = Qs
                    B[Q1, ln] += (((c1 + c2) + c3) + c4) + c5
                    w_f = (w_hi * (1 + 2.0 ** -50)) * up_rel + up_abs
                    B[SA, ln] += w_f * B[ADP, ln]
                    B[SE, ln] += w_f * B[EDP, ln]
            # The lanes' sums together: Sum2 again for W and Q, plain sums for the rest.
            for k in (W0, Q0):
                Ss = 0.0
                Sc = 0.0
                for ln in range(lanes):
                    for part in (B[k, ln], B[k + 1, ln]):
                        Ss, c1 = _TWO_SUM(Ss, part)
                        Sc += c1
                out[i, k - W0] = Ss
                out[i, k - W0 + 1] = Sc
            out[i, 4] = B[EY].max()
            out[i, 5] = B[SA].sum()
            out[i, 6] = B[SE].sum()
            out[i, 7] = B[SP].sum()
            out[i, 8] = B[SR].sum()
            out[i, 9] = 1.0 if B[BAD].sum() == 0.0 else 0.0

    global _ROWS
    _ROWS = rows
    return rows


def row_sums(logit_parts: tuple[np.ndarray, ...], dP_parts: tuple[np.ndarray, ...], unmasked: np.ndarray,
             M: np.ndarray, scale: tuple[float, float, float, float], U2: float, c_reduce: tuple[float, float, float],
             q_coef: list[float]) -> np.ndarray | None:
    """The loop's per-row sums of one head's rows (see the loop's ``out``); None where it does not apply
    (numba missing, arrays not laid out as (rows, keys) C-contiguous float64)."""
    if not (all(_fused._laid_out(a, unmasked.shape, np.float64) for a in (*logit_parts, *dP_parts))
            and _fused._laid_out(unmasked, unmasked.shape, np.bool_) and unmasked.ndim == 2
            and _fused._laid_out(M, unmasked.shape[:1], np.float64) and _fused.available()):
        return None
    out = np.empty((unmasked.shape[0], 10))
    c = (*scale, U2, *_fused._up_constants(), *c_reduce, Y_LOW, Y_HIGH)
    with np.errstate(all="ignore"):
        _loop()(*logit_parts, *dP_parts, unmasked, M, tuple(map(float, c)), np.array(q_coef), _T_HI, _T_LO,
                _POW2, out)
    return out
