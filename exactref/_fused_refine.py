"""Compiled loops for the exact path's first try: engine.fast.extract_sum and the decision of
engine.decision.decide_refined, row by row, in one pass over the pieces, and a second extraction
where the first does not decide; and the gathering of a 2-D product's pieces (numba).

Why: the exact path gathers, for each element that the products left undecided, the float64
pieces whose sum is its exact value, and decides most of them by one error-free extraction
(Rump, Ogita and Oishi's ExtractVector).  numpy makes that in dozens of passes over the
pieces and their row sums.  In a float32 1024³ matmul (about 470 undecided elements in 4 blocks
of 256 rows, on 2 cores) that step took 3.5 to 4.5 ms of the blocks' time, and 1.4 to 1.8 ms by
this loop, which makes each row's max, extraction and decision while the row is in cache.

The enclosure is extract_sum's, with the same sigma and the same bound rad; only the order in
which the float64 sum ``lo`` of the extraction's remainders is made differs (four partial sums,
so that the additions overlap), and that bound holds for a sum in any order.  Where the loop
decides a row, its rounding and float64 bounds are the exact value's, as the numpy code's are:
the same values.  A row the first extraction leaves is extracted again from its remainders
(``second``, as engine.decision.extract_twice; its bound is derived in
docs/guarantees-and-limits.md), and where either's sum is exact, a float64 output's tie goes to
even: so the sums of float32 values that lie on a float64 or halfway between two are decided
here (a float64 1024**3 matmul of float32 values, by the products' quick cut, has hundreds a
block).  A row it leaves (a row of zeros, a sigma out of range, enclosures that do not decide, a
rounding outside the bit trick's range) goes to the numpy code as before
(engine.decision.refine).  Like
exactref/_fused.py's loops: IEEE arithmetic without fast-math, the GIL released, the machine
code kept on disk, and helpers named as globals of this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _fused

__all__ = ["extract_decide", "gather_products", "gather_two_products"]

# The compiled helpers the loop calls, set when it is first built, named as globals (see _fused._BITS).
_BITS: Any = None
_ROUND_BITS: Any = None
_ROUNDED: Any = None
_DECIDE: Any = None
_GRID: Any = None
_GAPS: Any = None
_SECOND: Any = None
_TWO_PROD: Any = None
_TWO_ROW: Any = None


@functools.lru_cache(maxsize=1)
def _loop() -> Callable[..., None]:
    global _ROUND_BITS, _BITS, _ROUNDED, _DECIDE, _GRID, _GAPS, _SECOND
    _BITS = _fused._bitcasts()[0]
    _ROUND_BITS = _fused._round_bits()
    _GAPS = _fused._gaps()
    inf = np.inf
    f64_max = float(np.finfo(np.float64).max)
    tiny_normal = 2.0 ** -1021
    jit = _fused._jit()

    @jit
    def rounded(x, mode, f):
        # exactref.rounding.round_float64 of a float64 x to the format, and whether x lies outside
        # the bit trick's range (mode 2), where the numpy code must round it.
        if mode == 0:
            return x, False
        if mode == 1:
            return np.float64(np.float32(x)), False
        return _ROUND_BITS(x, f)

    _ROUNDED = rounded

    @jit
    def decide(hi, lo, rad, mode, f):
        # engine.decision.decide_refined for one row: (decided, value, x_lo, x_hi).
        s = hi + lo
        e = (hi - s) + lo  # exact: |hi| >= |lo| is required below
        ordered = abs(hi) >= abs(lo)
        if rad == 0 and e == 0 and s != 0 and ordered:
            v, outside = _ROUNDED(s, mode, f)  # the exact sum is the float64 s
            return not outside, v, s, s
        s_up, s_down, gap_up, gap_down, upper, lower = _GAPS(s, e, rad)
        above = (lower > 0) & (upper < gap_up)  # s < exact < s_up
        below = (upper < 0) & (lower > -gap_down)  # s_down < exact < s
        if not ((above | below) & ordered & (abs(s) < f64_max)):
            return False, 0.0, 0.0, 0.0
        xl = s if above else s_down
        xh = s_up if above else s
        if mode == 0:
            # Nearest: the side of the midpoint of (x_lo, x_hi) that exact - s lies on.
            half = (gap_up if above else -gap_down) / 2
            to_lo = upper < half
            to_hi = lower > half
            if rad == 0 and e == half:
                # exact = s + e exactly, on the midpoint: a tie, to the even one of x_lo and x_hi.
                to_lo = (_BITS(xl) & 1) == 0
                to_hi = not to_lo
            return (to_lo | to_hi) & (abs(s) >= tiny_normal), xl if to_lo else xh, xl, xh
        # Round to odd at 53 bits, then to nearest at p bits (Boldo and Melquiond).
        v, outside = _ROUNDED(xl if _BITS(xl) & 1 else xh, mode, f)
        return not outside, v, xl, xh

    @jit
    def grid(P, i):
        # engine.decision.grid of row i: the lowest set bit among its pieces (0 if none is above
        # zero's), a power of two of which the exact row sum is a multiple.
        g = inf
        for j in range(P.shape[1]):
            b = _BITS(P[i, j]) & 0x7FFFFFFFFFFFFFFF
            if b == 0:
                continue
            ex = b >> 52
            m = (b & 0xFFFFFFFFFFFFF) | (0x10000000000000 if ex else 0)
            low = math.ldexp(float(m & -m), int(max(ex, 1)) - 1075)
            g = low if low < g else g
        return g if g < inf else 0.0

    _DECIDE, _GRID = decide, grid

    @jit
    def second(P, i, sigma, tau, g, kmin, kmax, levels, c, up_rel, up_abs, mode, f):
        # A second extraction, from the remainders r = p - q of the first (sigma's), recomputed
        # exactly: tau (the first's exact sum of the q) + tau2 + the sum of the new remainders is
        # the exact row sum; (decided, value, x_lo, x_hi) as decide returns them.
        n = P.shape[1]
        M = 0.0
        for j in range(n):
            x = P[i, j]
            a = abs(x - ((x + sigma) - sigma))
            M = a if a > M else M
        k = math.frexp(M)[1] + levels  # (M = 0, all r 0, gives sigma2 = 2**levels: sound too)
        if k < kmin or k > kmax:
            return False, 0.0, 0.0, 0.0
        sigma2 = math.ldexp(1.0, k)
        t0 = t1 = 0.0
        l0 = l1 = 0.0
        j = 0
        while j + 2 <= n:
            x0 = P[i, j]
            x1 = P[i, j + 1]
            r0 = x0 - ((x0 + sigma) - sigma)
            r1 = x1 - ((x1 + sigma) - sigma)
            q0 = (r0 + sigma2) - sigma2
            q1 = (r1 + sigma2) - sigma2
            t0 += q0
            t1 += q1
            l0 += r0 - q0
            l1 += r1 - q1
            j += 2
        if j < n:
            x0 = P[i, j]
            r0 = x0 - ((x0 + sigma) - sigma)
            q0 = (r0 + sigma2) - sigma2
            t0 += q0
            l0 += r0 - q0
        tau2 = t0 + t1  # exact, as the first extraction's sum of the q
        lo2 = l0 + l1
        rad = math.ldexp(c, k - 53) * up_rel + up_abs
        if rad < g:
            rad = 0.0  # its error, a multiple of the grid below it, is zero
        # tau + tau2 = h + l and l + lo2 = t + e exactly (two-sums): the sum is h + t + e + (the
        # error of lo2), so h + t is within |e| + rad of it.
        h = tau + tau2
        b = h - tau
        l = (tau - (h - b)) + (tau2 - b)
        t = l + lo2
        b = t - l
        e = (l - (t - b)) + (lo2 - b)
        r = abs(e) if rad == 0.0 else (abs(e) + rad) * up_rel + up_abs
        return _DECIDE(h, t, r, mode, f)

    _SECOND = second

    @jit
    def loop(P, kmin, kmax, levels, c, up_rel, up_abs, mode, f, value, x_lo, x_hi, ok):
        # mode: 0 float64, 1 float32 (numpy's cast), 2 a narrower format rounded by its bits (f).
        rows, n = P.shape
        for i in range(rows):
            ok[i] = False
            M = 0.0
            for j in range(n):
                a = abs(P[i, j])
                M = a if a > M else M
            if not (M > 0.0) or not (M < inf):
                continue  # a row of zeros (or a NaN): no sigma, as in extract_sum
            k = math.frexp(M)[1] + levels  # M < 2**e: 2**k >= 2 n M
            if k < kmin or k > kmax:
                continue
            sigma = math.ldexp(1.0, k)
            h0 = h1 = h2 = h3 = 0.0
            l0 = l1 = l2 = l3 = 0.0
            j = 0
            while j + 4 <= n:
                q0 = (P[i, j] + sigma) - sigma
                q1 = (P[i, j + 1] + sigma) - sigma
                q2 = (P[i, j + 2] + sigma) - sigma
                q3 = (P[i, j + 3] + sigma) - sigma
                h0 += q0
                h1 += q1
                h2 += q2
                h3 += q3
                l0 += P[i, j] - q0
                l1 += P[i, j + 1] - q1
                l2 += P[i, j + 2] - q2
                l3 += P[i, j + 3] - q3
                j += 4
            while j < n:
                q0 = (P[i, j] + sigma) - sigma
                h0 += q0
                l0 += P[i, j] - q0
                j += 1
            hi = (h0 + h1) + (h2 + h3)  # exact: every partial sum of the q is representable
            lo = (l0 + l1) + (l2 + l3)
            rad = math.ldexp(c, k - 53) * up_rel + up_abs
            done, v, xl, xh = _DECIDE(hi, lo, rad, mode, f)
            if not done:
                g = _GRID(P, i)
                if rad < g:
                    # The error, a multiple of the grid below it, is zero: hi + lo is the exact sum.
                    done, v, xl, xh = _DECIDE(hi, lo, 0.0, mode, f)
                if not done:
                    done, v, xl, xh = _SECOND(P, i, sigma, hi, g, kmin, kmax, levels, c, up_rel, up_abs, mode, f)
            if done:
                value[i] = v
                x_lo[i] = xl
                x_hi[i] = xh
                ok[i] = True

    return loop


def extract_decide(P: np.ndarray, fmt: Any, *, kmin: int, kmax: int, c: float,
                   up_constants: tuple[float, float]) -> tuple[np.ndarray, ...] | None:
    """``(value, x_lo, x_hi, ok)`` of engine.decision.refine's first try for the rows of ``P``, or
    None where the loop does not apply (numba missing, few pieces, a format it does not round).

    ``kmin``, ``kmax`` and ``c`` are extract_sum's range of sigma's exponent and its bound's
    factor n gamma_{n-1}; ``up_constants`` those of engine.fast.up.
    """
    mode = 0 if _fused._is_float64(fmt) else 1 if _fused._rounds_by_cast(fmt) else 2 if _fused._rounds_by_bits(fmt) else -1
    if mode < 0 or P.ndim != 2 or not P.shape[1] or not _fused._plain(P):
        return None
    rows, n = P.shape
    out = (np.zeros(rows), np.zeros(rows), np.zeros(rows), np.zeros(rows, dtype=bool))
    f = _fused._bits_format(fmt) if mode == 2 else (1, 0, 0.0)
    _loop()(P, kmin, kmax, (2 * n - 1).bit_length(), c, *up_constants, mode, f, *out)
    return out


@functools.lru_cache(maxsize=1)
def _gather_loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(A, B, idx, N, P, safe):
        # Row r of P: the products A[i, k] * B[k, j] of element idx[r] = i N + j, one element after
        # another, each walking down B's column j (a stride the hardware prefetches); and whether
        # each is finite.  (Walking B's rows once instead, each row's values for every element, as
        # np.take does, took 89-105 us against 34-64 us for 25 elements of a 512 x 512 B, warm and
        # with the caches flushed, medians of 200 in turn.)
        count, K = P.shape
        for r in range(count):
            i = idx[r] // N
            j = idx[r] - i * N
            a, p = A[i], P[r]
            ok = True
            for k in range(K):
                v = a[k] * B[k, j]
                p[k] = v
                ok &= (v - v) == 0.0  # (0 for a finite v, NaN for inf and NaN)
            safe[r] = ok

    return loop


def gather_products(A: np.ndarray, B: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The exact path's pieces of the elements ``idx`` (flat indices) of ``A @ B``, for 2-D float64 A
    and B of at most 26 significant bits per value: row r holds the K products of element idx[r],
    each exact, and ``safe[r]`` whether they are all finite; engine.sumprod's gather and products
    by numpy give the same values.  None where the loop does not apply (numba missing, few
    products, operands not C-contiguous float64).  (For a float32 512**3 matmul's 20 to 31 undecided
    elements of a block of 256 rows, on one of 2 busy cores: 0.08 to 0.13 ms, against 0.17 to
    0.28 ms by np.take and numpy's products, with the loop's earlier order: see _gather_loop.)"""
    K = A.shape[-1]
    if A.ndim != 2 or B.ndim != 2 or not _fused.usable(idx.size * K):
        return None
    if not all(type(a) is np.ndarray and a.dtype == np.float64 and a.flags.c_contiguous for a in (A, B)):
        return None
    P, safe = np.empty((idx.size, K)), np.empty(idx.size, dtype=bool)
    _gather_loop()(A, B, idx.astype(np.int64, copy=False), B.shape[1], P, safe)
    return P, safe


@functools.lru_cache(maxsize=1)
def _gather_two_loops() -> tuple[Callable[..., None], Callable[..., None]]:
    """The two-product gather reading B's columns from B itself, and from its transpose."""
    global _TWO_ROW, _TWO_PROD
    _TWO_PROD = _fused._two_prod()
    jit = _fused._jit()

    @jit
    def two_row(a_row, b_col, p_row):
        # The products p = a_row[k] * b_col[k] in p_row's first K places and their errors e in the
        # next K, by engine.fast.two_prod (e 0 where it is not safe); returns whether every e is
        # safe and every piece finite.
        K = a_row.size
        ok = True
        for k in range(K):
            p, e, safe = _TWO_PROD(a_row[k], b_col[k])
            p_row[k] = p
            p_row[K + k] = e
            ok &= safe & ((p - p) == 0.0) & ((e - e) == 0.0)  # ((x - x) is 0 for a finite x, NaN else)
        return ok

    _TWO_ROW = two_row

    @jit
    def from_columns(A, B, idx, N, P, safe):
        # Element idx[r] = i N + j from row i of A and column j of B.
        for r in range(P.shape[0]):
            i = idx[r] // N
            j = idx[r] - i * N
            safe[r] = _TWO_ROW(A[i], B[:, j], P[r])

    @jit
    def from_transpose(A, BT, idx, N, P, safe):
        # The same, column j of B read as row j of its transpose.
        for r in range(P.shape[0]):
            i = idx[r] // N
            j = idx[r] - i * N
            safe[r] = _TWO_ROW(A[i], BT[j], P[r])

    return from_columns, from_transpose


def gather_two_products(A: np.ndarray, B: np.ndarray, idx: np.ndarray,
                        BT: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The exact path's pieces of the elements ``idx`` (flat indices) of ``A @ B`` for 2-D float64 A
    and B of any values: row r holds the K products of element idx[r] and then their K errors, by
    engine.fast.two_prod, and ``safe[r]`` whether every error is exact and every piece finite;
    engine.sumprod's gather and two_prod by numpy give the same values.  ``BT``, B's transpose,
    C-contiguous, where one was made: the columns are read from it, as from an F-contiguous B's
    own transpose (a gradient's B).  None where the loop does not apply (numba missing, few
    products, A not C-contiguous float64, B neither C- nor F-contiguous float64 without BT)."""
    K = A.shape[-1]
    if A.ndim != 2 or B.ndim != 2 or not _fused.usable(idx.size * K):
        return None
    if not all(type(a) is np.ndarray and a.dtype == np.float64 for a in (A, B)) or not A.flags.c_contiguous:
        return None
    if BT is None and B.flags.f_contiguous:
        BT = B.T  # (a gradient's B, the transpose of a C-contiguous array)
    if BT is None or not _fused._laid_out(BT, B.shape[::-1], np.float64):
        BT = None
        if not B.flags.c_contiguous:
            return None
    P, safe = np.empty((idx.size, 2 * K)), np.empty(idx.size, dtype=bool)
    from_columns, from_transpose = _gather_two_loops()
    idx = idx.astype(np.int64, copy=False)
    if BT is not None:
        from_transpose(A, BT, idx, B.shape[1], P, safe)
    else:
        from_columns(A, B, idx, B.shape[1], P, safe)
    return P, safe
