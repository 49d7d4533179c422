"""The vectorised float64 fast path: enclosures ``hi + lo +- rad`` of exact sums of products.

Every function here returns, for each output element, float64 arrays ``hi``,
``lo`` and ``rad`` with ``|exact - (hi + lo)| <= rad``, and ``S``, an upper
bound on the sum of the absolute values of the terms (what the tolerance
models scale with).  ``rad`` is inf where the fast path cannot bound an
element (overflow or underflow in float64); those elements go to the exact
path.

* :func:`long_sums`: long sums, in blocks of bounded memory.
* :func:`rowdot`: short per-element dot products (elementwise ops), in
  double-double arithmetic with exact two-products.

Matrix products are in :mod:`exactref.engine.products`.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _fused, _fused_slices, _fused_sums
from .._parallel import for_each, for_each_slice, serially
from ..rounding import next_up

__all__ = [
    "U64",
    "Enclosure",
    "combine",
    "finite_or_zero",
    "fits_narrow",
    "gamma",
    "long_sums",
    "rowdot",
    "tree_sum",
    "two_prod",
    "two_sum",
    "up",
]

U64 = 2.0 ** -53
U32 = 2.0 ** -24  # float32's unit roundoff
# Veltkamp's splitting constant for float64: 2**27 + 1.
_SPLITTER = 134217729.0
_SPLIT_MAX = 2.0 ** 995
_PRODUCT_MIN = 2.0 ** -968


def gamma(n: np.ndarray | int, u: float) -> np.ndarray | float:
    """Higham's gamma_n = n*u / (1 - n*u), rounded up; inf when n*u >= 1."""
    if isinstance(n, (int, np.integer)) and not isinstance(n, bool):
        return _gamma_scalar(int(n), float(u))
    n = np.asarray(n, dtype=np.float64)
    nu = n * u
    with np.errstate(divide="ignore"):
        g = np.where(nu < 1, nu / (1 - nu), np.inf)
    g = next_up(next_up(g))
    return g if g.ndim else float(g)


@functools.lru_cache(maxsize=4096)
def _gamma_scalar(n: int, u: float) -> float:
    # A scalar: the same IEEE operations in Python, without numpy's per-call overhead.  The
    # same few (n, u) pairs come back call after call (a small op computes several), so
    # they are remembered.
    nu = float(n) * u
    g = nu / (1 - nu) if nu < 1 else math.inf
    return math.nextafter(math.nextafter(g, math.inf), math.inf)


# up()'s factor and addend: more than two float64 ulps of relative and absolute slack.
_UP_REL = 1 + 2.0 ** -50
_UP_ABS = 2.0 ** -1070


def up(x: np.ndarray | float) -> np.ndarray | float:
    """A nonnegative bound ``x`` moved up by more than two float64 ulps.

    It pays for the roundings of the short computation that produced ``x``;
    a multiply-add is much cheaper than two nextafter calls.
    """
    return x * _UP_REL + _UP_ABS


@dataclass
class Enclosure:
    """``|exact - (hi + lo)| <= rad`` element by element; ``S`` bounds the sum of |terms|."""

    hi: np.ndarray
    lo: np.ndarray
    rad: np.ndarray
    S: np.ndarray | None  # None only from products.matmul_sliced(..., bound=False), which skips it
    # lo is exactly +0 everywhere (products of narrow values), which lets the bounds skip it.
    lo_zero: bool = False
    # Where ``exact`` is True, the float64 ``pieces`` sum exactly to the exact value (hi among
    # them): a few terms to round exactly, where the enclosure cannot decide (a tie, say).
    pieces: tuple[np.ndarray, ...] | None = None
    exact: np.ndarray | None = None


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s + e == a + b`` exactly, with ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _two_sum_into(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`two_sum` of fresh float64 arrays of one shape, whose memory it reuses (a and b are lost):
    the same operations, one temporary instead of five."""
    s = a + b
    bb = s - a
    np.subtract(b, bb, out=b)
    np.subtract(s, bb, out=bb)
    np.subtract(a, bb, out=a)
    np.add(a, b, out=a)
    return s, a


def _up_into(x: np.ndarray) -> np.ndarray:
    """:func:`up` of a fresh float64 array, in place."""
    np.multiply(x, _UP_REL, out=x)
    np.add(x, _UP_ABS, out=x)
    return x


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``p + e == a * b`` exactly where ``safe`` (Dekker); no fused multiply-add needed.

    Unsafe elements are those where splitting could overflow or where the
    error term could fall below float64's normal range.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        p = a * b
        ah, al = _split(a)
        bh, bl = _split(b)
        e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    # The error term is exact when the product is far enough above underflow.
    safe = (np.abs(a) < _SPLIT_MAX) & (np.abs(b) < _SPLIT_MAX)
    safe &= (np.abs(p) >= _PRODUCT_MIN) | (a == 0) | (b == 0)
    return p, np.where(safe, e, 0.0), safe


def combine(terms: list[np.ndarray], rad: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A double-double ``hi + lo +- rad`` for the exact sum of float64 ``terms`` (plus ``rad``)."""
    hi = terms[0]
    lo = np.zeros_like(hi)
    abs_err = np.zeros_like(hi)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in terms[1:]:
            hi, e = two_sum(hi, t)
            lo = lo + e
            abs_err = abs_err + np.abs(lo)
        n = len(terms)
        r = up(gamma(n, U64) * abs_err + rad) if n > 1 else up(np.asarray(rad, dtype=np.float64) + abs_err)
    bad = ~np.isfinite(hi) | ~np.isfinite(lo)
    r = np.where(bad, np.inf, r)
    return hi, np.where(bad, 0.0, lo), r


def tree_sum(P: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``hi + lo +- rad`` enclosing each row sum of finite float64 ``P`` (rows, n), to about u**2.

    Halves of the rows are added by two-sums, level by level, so ``hi`` plus
    the sum of every two-sum's error is the exact row sum.  The errors are
    summed in plain float64: ``lo`` errs by at most gamma_m of their absolute
    sum (m of them), which is at most about u log2(n) of the row's absolute
    sum.  rad is 0 exactly where hi is the exact sum, and inf where the
    partial sums overflow.
    """
    rows, n = P.shape
    if n == 0:
        z = np.zeros(rows)
        return z, z.copy(), z.copy()
    lo = np.zeros(rows)
    err_abs = np.zeros(rows)
    count = 0
    with np.errstate(over="ignore", invalid="ignore"):
        while n > 1:
            h = n // 2
            s, e = two_sum(P[:, :h], P[:, h:2 * h])
            if n % 2:  # the odd column joins the next level
                s = np.concatenate([s, P[:, 2 * h:]], axis=1)
            lo += e.sum(axis=1)
            err_abs += np.abs(e).sum(axis=1)
            count += e.shape[1] + 1
            P, n = s, s.shape[1]
        hi = P[:, 0]
        # Both sums of the errors are off by gamma_count relative; doubling covers either.
        # No two-sum erred: hi is the exact sum, rad exactly 0.
        rad = np.where(err_abs == 0, 0.0, up(2 * gamma(count, U64) * err_abs))
    bad = ~np.isfinite(hi) | ~np.isfinite(lo) | ~(rad < np.inf)
    return np.where(bad, 0.0, hi), np.where(bad, 0.0, lo), np.where(bad, np.inf, rad)


# extract_sum's sigma = 2**k stays within these exponents: below, its grid 2**(k - 53) would be
# finer than float64's subnormals (the argument holds there too, but is not needed); above, it
# would not be finite.
_EXTRACT_MIN_K, _EXTRACT_MAX_K = -1000, 1023
_EXTRACT_CHUNK = 1 << 17  # values per pass: two temporaries of 1 MiB (the fastest here)


def extract_sum(P: np.ndarray, *, remainders: bool = False) -> tuple[np.ndarray, ...]:
    """``hi + lo +- rad`` enclosing each row sum of finite float64 ``P`` (rows, n), by one error-free
    extraction (Rump, Ogita and Oishi's ExtractVector): about ten passes over P, where
    :func:`tree_sum` makes about ninety.

    Per row, let M = max|p| < 2**e and sigma = 2**k with k = e + ceil(log2(2n)), so
    sigma >= 2 n M.  Then sigma + p lies in [sigma/2, 2 sigma], so
    ``q = fl(fl(sigma + p) - sigma)`` is exact (Sterbenz), a multiple of
    2**(k - 53) (the ulp of anything in [sigma/2, 2 sigma] is at least that),
    and ``r = p - q`` is the rounding error of fl(sigma + p), exact, with
    |r| <= 2**(k - 53).  Every partial sum of the q, in any order, is a
    multiple of 2**(k - 53) of magnitude at most n (M + 2**(k - 53)) <= 2**k:
    representable, so ``hi = sum(q)`` is exact.  ``lo``, the float64 sum of
    the r in any order, errs by at most gamma_{n-1} sum|r| <=
    gamma_{n-1} n 2**(k - 53) = rad, about n**3 2**-106 M.  A row of zeros,
    or whose sigma would leave [2**-1000, 2**1023], gets rad = inf.  With ``remainders``, the r
    (rows, n) come fourth (engine.decision.extract_twice extracts again from them).
    """
    rows, n = P.shape
    hi, lo, k = np.zeros(rows), np.zeros(rows), np.zeros(rows, dtype=np.int64)
    if n == 0:
        return (hi, lo, np.full(rows, np.inf)) + ((np.zeros((rows, 0)),) if remainders else ())
    # A few rows at a time, so that the two temporaries stay in cache.
    step = max(1, _EXTRACT_CHUNK // n)
    buf, rest = np.empty((min(step, rows), n)), np.empty((rows if remainders else min(step, rows), n))
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, rows, step):
            p = P[start:start + step]
            t, r = buf[:p.shape[0]], rest[start:start + step] if remainders else rest[:p.shape[0]]
            M = np.max(np.abs(p, out=t), axis=1)
            _, e = np.frexp(M)  # M = f 2**e with 1/2 <= f < 1: M < 2**e
            kk = e + (2 * n - 1).bit_length()  # 2**k >= 2 n 2**e
            # (a row of zeros, or of a NaN, has no sigma: kk out of range marks it)
            kk[~((M > 0) & (M < np.inf))] = _EXTRACT_MAX_K + 1
            sigma = np.ldexp(1.0, np.clip(kk, _EXTRACT_MIN_K, _EXTRACT_MAX_K))[:, None]
            q = np.add(p, sigma, out=t)
            np.subtract(q, sigma, out=q)
            np.subtract(p, q, out=r)
            hi[start:start + step] = np.sum(q, axis=1)
            lo[start:start + step] = np.sum(r, axis=1)
            k[start:start + step] = kk
        ok = (k >= _EXTRACT_MIN_K) & (k <= _EXTRACT_MAX_K)
        rad = up(np.ldexp(n * gamma(n - 1, U64), np.where(ok, k, 0) - 53))
    out = np.where(ok, hi, 0.0), np.where(ok, lo, 0.0), np.where(ok, rad, np.inf)
    return out + ((rest,) if remainders else ())


# Terms per block of a long sum (temporaries of 16 to 32 MiB), and terms per partial sum.
_SUM_BLOCK = 1 << 22
_SUM_WIDTH = 64
_COPY_FIRST_MAX = 1 << 25  # see long_sums


def long_sums(X: np.ndarray, narrow: bool, out: np.ndarray | None = None) -> Enclosure:
    """Enclosures of the sums of X (..., T) over its last axis, for long rows, in bounded memory.

    ``narrow`` values (at most 26 significant bits) are added in float64 in
    groups of 64, the group sums again in groups of 64, and so on: each
    level errs by at most gamma_63 of its absolute sum, whatever order numpy
    or the BLAS (:func:`_first_level`) adds in, so L levels err by about
    L gamma_63 S (10**-14 S for 10**8 terms).  Other values (float64) are first split exactly,
    ``x = q1 + q2 + r`` (Ozaki's extraction, see :func:`_slices`), so that
    the q sum exactly and only the small r err.  X is read
    in blocks of rows (or of one row), so no float64 copy of it is made; a single narrow float32
    row shorter than _FUSED_PARALLEL is summed, every level, by one compiled call (:func:`_one_row`).
    ``out``, an array of X's shape and dtype, receives a copy of X, each part
    written while it is read for the sums (no pass over memory of its own),
    or, for some sizes, first (where that was measured to be the faster).
    """
    lead, T = X.shape[:-1], X.shape[-1]
    if out is not None and _SUM_BLOCK < X.size <= _COPY_FIRST_MAX and not _compiled(X):
        # Measured here (2 cores, medians of 25 interleaved runs): a fresh out written block by
        # block from two threads cost 19 ms at 10**7 float32 values and 52 ms at 3 * 10**7, a copy
        # first 12 and 40; at 4 * 10**6 (one block) and 10**8 writing as it reads was the faster.
        np.copyto(out, X)
        X, out = out, None
    rows = X.reshape(-1, T)
    dst = None if out is None else out.reshape(-1, T)  # (a view: out is C-contiguous, as X)
    if narrow and rows.shape[0] == 1 and _FUSED_MIN <= T < _FUSED_PARALLEL:
        # One row that one call of the compiled loop sums on this thread, every level of it (a
        # full sum of float32 values, whose one output element numpy's steps below cost the more).
        made = _fused_sums.row_sums(rows[0], None if dst is None else dst[0])
        if made is not None:
            return _one_row(*made, lead)
    hi, lo, rad, S = (np.empty(rows.shape[0]) for _ in range(4))
    step = _SUM_BLOCK // max(T, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        if step >= 1:
            def block(part: slice) -> None:
                hi[part], lo[part], rad[part], S[part] = _sum_block(rows[part], narrow,
                                                                    None if dst is None else dst[part])
            # Independent blocks, side by side (exactref/_parallel.py).  A single block runs on
            # this thread, so a narrow one shares out its own first level (_first_level).
            for_each_slice(block, rows.shape[0], step)
        else:
            for i in range(rows.shape[0]):
                hi[i], lo[i], rad[i], S[i] = _long_row(rows[i], narrow, None if dst is None else dst[i])
    bad = ~np.isfinite(hi) | ~np.isfinite(lo) | ~(rad < np.inf) | np.isnan(S)
    return Enclosure(np.where(bad, 0.0, hi).reshape(lead), np.where(bad, 0.0, lo).reshape(lead),
                     np.where(bad, np.inf, rad).reshape(lead), S.reshape(lead))


def _one_row(total: float, total_abs: float, levels: int, lead: tuple[int, ...]) -> Enclosure:
    """long_sums' enclosure of one narrow row from its compiled sums (exactref/_fused_sums.py's
    row_sums): :func:`_sum_block`'s bounds, on Python floats (the same IEEE operations)."""
    S = _abs_bound(total_abs, gamma(_SUM_WIDTH - 1, U32), levels)
    rad = up(2 * levels * gamma(_SUM_WIDTH - 1, U64) * S)
    if not rad < math.inf:
        # long_sums' own marks of a non-finite sum.  (The float64 sums of float32 values cannot
        # overflow: that of |x|, and so rad, is inf or NaN exactly where a value is, and so
        # wherever the sum is.)
        total, rad = 0.0, math.inf
    # (lead is all ones: np.array's ndmin makes that shape, at a third of np.full's cost.)
    return Enclosure(*(np.array(v, ndmin=len(lead)) for v in (total, 0.0, rad, S)))


def _abs_bound(S: Any, g_abs: float, levels: int) -> Any:
    """A bound on the exact sum of |x| from its computed one, made in ``levels`` levels, the first
    of which errs by at most ``g_abs`` of it and each later one by gamma_63."""
    # The computed sums of |x| are at least (1 - g_abs)(1 - g)**(levels - 1) >= 1 - g_abs -
    # (levels - 1) g times the exact ones (sums of nonnegative terms), and 1 / (1 - t) <= 1 + 2 t.
    return up(S * (1 + 2 * (g_abs + (levels - 1) * gamma(_SUM_WIDTH - 1, U64))))


def _compiled(X: np.ndarray) -> bool:
    """Whether X's first levels take the compiled loop, which copies as it reads at every size: its
    own test of a block (exactref/_fused_sums.py's group_sums)."""
    return _fused._plain(X, dtype=np.float32)


def _long_row(row: np.ndarray, narrow: bool, out: np.ndarray | None = None) -> tuple[float, float, float, float]:
    """One row longer than a block: its blocks' enclosures, added by a tree sum (``out``: see long_sums)."""
    starts = range(0, row.size, _SUM_BLOCK)
    parts: list[Any] = [None] * len(starts)

    def block(i: int) -> None:
        cut = slice(starts[i], starts[i] + _SUM_BLOCK)
        parts[i] = _sum_block(row[None, cut], narrow, None if out is None else out[None, cut])
    # A narrow block shares out its own first level (_first_level), which balances better.
    (serially if narrow else for_each)(block, len(starts))
    his, los, rads, Ss = (np.concatenate(v) for v in zip(*parts))
    h, lo, r = tree_sum(np.concatenate([his, los])[None, :])
    g = 1 + 2 * gamma(len(parts), U64)  # the float64 sums of the blocks' bounds
    return float(h[0]), float(lo[0]), float(up(r[0] + np.sum(rads) * g)), float(up(np.sum(Ss) * g))


def _sum_block(block: np.ndarray, narrow: bool, out: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hi, lo, rad, S) for each row of a 2-D block: ``|sum - (hi + lo)| <= rad``, ``sum|x| <= S``;
    ``out`` (of the block's shape) receives a copy of it."""
    T = block.shape[1]
    g = gamma(_SUM_WIDTH - 1, U64)
    g_abs = g  # the first level's bound for the sums of |x| (_first_level's may be float32's)
    if out is not None and not (narrow and T >= _FUSED_MIN):
        np.copyto(out, block)  # (only _first_level copies as it reads)
        out = None
    if narrow and T >= _FUSED_MIN:
        # The first level of both sums in one pass over the block, a few columns at a time;
        # then the same levels as _grouped_sum.
        first, first_abs, g_abs, made = _first_level(block, out)
        S, levels = _grouped_sum(first_abs, made)
        total, _ = _grouped_sum(first, made)
    elif narrow:
        S, levels = _grouped_sum(np.abs(block))
        total, _ = _grouped_sum(block)
    else:
        S, levels = _grouped_sum(np.abs(block))
    S = _abs_bound(S, g_abs, levels)
    if narrow:
        return total, np.zeros_like(total), up(2 * levels * g * S), S
    x = block.astype(np.float64)
    # Two slices of beta bits sum exactly in any order (T of them stay below 2**53 units);
    # the remainders are at most half a unit of the second each.
    beta = 53 - max(T, 1).bit_length()
    (q1, q2), r, lowest = _slices(x, -1, beta, 2)
    del x
    h1, _ = _grouped_sum(q1)
    h2, _ = _grouped_sum(q2)
    hr, levels = _grouped_sum(r)
    r_abs = np.where(lowest < 4096, T * np.ldexp(0.5, np.clip(lowest, -1100, 1100)), 0.0)
    hi, e = two_sum(h1, h2)
    lo = e + hr
    rad = up(2 * levels * g * r_abs + U64 * np.abs(lo))
    # (lowest is 4096 for a row of zeros, -4096 where the slicing is not error-free.)
    return hi, lo, np.where(lowest > -4096, rad, np.inf), S


# Blocks at least this long take _first_level; each of its bunches covers about this many
# float64 values (1 MiB, which stays in cache).
_FUSED_MIN = 1 << 12
_FUSED_CHUNK = 1 << 17
# Blocks at least this long share out their bunches (for_each); shorter ones run on the calling
# thread.  Measured on 2 cores, each sum right after torch's float64 sum of the same values (as a
# kernel's test runs them), medians of 21 to 101 alternating calls in one process: serial took
# 1.33-1.54 ms at 10**6 values against 1.57-1.89 shared, 3.25 ms at 2 * 10**6 against 3.56, 4.16
# at 4 * 10**6 against 4.42; at 10**7 (full blocks) both 13.0-13.2 ms, and at 10**8 sharing
# won, 112 ms against 153.  So only full blocks of _SUM_BLOCK values share.
_FUSED_PARALLEL = _SUM_BLOCK
# The compiled first levels (exactref/_fused_sums.py's group_sums) share out their blocks in parts
# of about _LOOP_CHUNK values, from _FUSED_PARALLEL values on too.  Measured on 2 cores, each
# whole sum right after torch's float64 sum of the same values, medians of 61 calls alternating
# in one process, shared out from 2**18 values against serially: 0.22-0.23 against 0.20-0.21 ms
# at 3 * 10**5 values, 0.33-0.37 against 0.31-0.38 ms at 10**6 (two runs that disagreed), 3.6
# against 3.5 ms at 10**7; but 48-52 against 57-60 ms at 10**8 (an earlier version of the loop).
_LOOP_CHUNK = 1 << 18
_ONES = np.ones(_SUM_WIDTH)
_ONES32 = np.ones(_SUM_WIDTH, dtype=np.float32)
_ONES.flags.writeable = _ONES32.flags.writeable = False  # (shared by every thread's products)


def _first_level(block: np.ndarray, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, float, int]:
    """The first level of the sums of a 2-D block and of its absolute values: sums of groups of
    _SUM_WIDTH values, in one pass over the block without a temporary of its size, the
    relative error bound of the sums of absolute values, and the number of levels made (1, or 2
    where the compiled loop made the first two: :func:`_compiled_levels`).  ``out`` (of the
    block's shape) receives a copy of the block, each bunch written right after it is read.

    The block's rows are cut into bunches of ``_SUM_WIDTH * w`` values (the last one padded
    with zeros); a bunch, widened to float64 and viewed as a (_SUM_WIDTH, w) matrix, is added
    over its columns by a BLAS product with a vector of ones.  Each column is a group: its
    terms are exact products 1 * x, added in float64 in whatever order the BLAS takes, so its
    sum errs by at most gamma_63 of its absolute sum, the bound of every level (_sum_block).
    BLAS products release the GIL, so the bunches run side by side (numpy's reductions do not
    share out across threads here).

    The sums of absolute values only bound the error and scale the tolerances, so a few
    parts in a million do not matter there: a float32 block's are float32 products with
    float32 ones, of |x| taken in float32 (half the memory traffic of float64, and no second
    float64 pass: 10**6 values on one thread took 0.61-0.93 ms against 0.71-1.10, 12-16% less in
    each of four alternating pairs of processes; in benchmarks/bench_sum.py the difference is
    within the noise).  Such a sum of nonnegative float32 values errs by at most gamma_63 in
    float32's unit roundoff (an addition of nonnegative values rounds only a normal result:
    underflow adds no error).  Where one overflows (values near float32's largest), they are all
    taken again in float64, from a float64 copy of the block (at most _SUM_BLOCK values).
    """
    compiled = _compiled_levels(block, out)
    if compiled is not None:
        return compiled
    rows, T = block.shape
    w = max(1, _FUSED_CHUNK // (_SUM_WIDTH * rows))
    C = _SUM_WIDTH * w
    m = -(-T // _SUM_WIDTH)
    in32 = block.dtype == np.float32
    bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # one pair of buffers per thread (exactref/_parallel.py)
    first, first_abs = np.empty((rows, m)), np.empty((rows, m), dtype=np.float32 if in32 else np.float64)

    def bunch(i: int) -> None:
        j0, j1 = i * C, min(T, (i + 1) * C)
        cols = -(-(j1 - j0) // _SUM_WIDTH)
        buf = bufs.get(threading.get_ident())
        if buf is None:
            buf = bufs[threading.get_ident()] = (np.empty(rows * C), np.empty(rows * C if in32 else 0, np.float32))
        src = block[:, j0:j1]
        if out is not None:
            np.copyto(out[:, j0:j1], src)
        part = _padded(buf[0], src, cols)
        k = slice(j0 // _SUM_WIDTH, j0 // _SUM_WIDTH + cols)
        np.matmul(_ONES, part, out=first[:, k])
        if in32:
            np.matmul(_ONES32, _padded(buf[1], src, cols, absolute=True), out=first_abs[:, k])
        else:
            np.matmul(_ONES, np.abs(part, out=part), out=first_abs[:, k])
    # Side by side only for a block long enough to pay for waking the helpers (see _FUSED_PARALLEL).
    (for_each if block.size >= _FUSED_PARALLEL else serially)(bunch, -(-T // C))
    if not in32:
        return first, first_abs, gamma(_SUM_WIDTH - 1, U64), 1
    if np.isinf(first_abs).any():  # (an infinite value too: rare either way)
        _, again, g_abs, _ = _first_level(block.astype(np.float64))
        return first, again, g_abs, 1
    return first, first_abs.astype(np.float64), gamma(_SUM_WIDTH - 1, U32), 1


def _compiled_levels(block: np.ndarray, out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, float, int] | None:
    """:func:`_first_level`'s result from exactref/_fused_sums.py's group_sums, which makes the first two
    levels of a float32 block's sums (each group of at most _SUM_WIDTH values added in float64,
    so each errs by at most gamma_63 of its absolute sum, at both levels; the first level's sums
    of absolute values in float32, as :func:`_first_level`'s own, so within float32's gamma_63),
    in one pass; None where the loop does not apply (see group_sums)."""
    compiled = _fused_sums.group_sums(block, out, _SUM_WIDTH) if block.dtype == np.float32 else None
    if compiled is None:
        return None
    second, second_abs, run = compiled
    rows, T = block.shape
    if block.size < _FUSED_PARALLEL:
        # On this thread: the whole block in one call, whose groups are those of any cut into whole
        # bunches.  (A 10**6 float32 sum right after torch's, medians of 101 alternating in one
        # process, twice: 278 and 320 us against 289 and 327 us in four parts of _LOOP_CHUNK.)
        run(0, rows, 0, T)
    else:
        # Parts of about _LOOP_CHUNK values: whole bunches of a long row, or several short rows.
        bunch = _fused_sums.GROUP * _fused_sums.LANES
        width = min(T, max(1, _LOOP_CHUNK // bunch) * bunch)
        height = max(1, _LOOP_CHUNK // width)
        parts = [(r, min(rows, r + height), c, min(T, c + width)) for r in range(0, rows, height)
                 for c in range(0, T, width)]
        for_each(lambda i: run(*parts[i]), len(parts))
    return second, second_abs, gamma(_SUM_WIDTH - 1, U32), 2


def _padded(buf: np.ndarray, src: np.ndarray, cols: int, *, absolute: bool = False) -> np.ndarray:
    """``src`` (rows, at most _SUM_WIDTH * cols), or ``|src|``, written into ``buf`` in its dtype,
    padded with zeros and viewed as (rows, _SUM_WIDTH, cols): its columns are the groups of
    _first_level."""
    rows, n = src.shape
    part = buf[:rows * _SUM_WIDTH * cols].reshape(rows, _SUM_WIDTH * cols)
    if absolute:
        np.abs(src, out=part[:, :n])
    else:
        np.copyto(part[:, :n], src)
    part[:, n:] = 0.0  # (the last bunch's padding)
    return part.reshape(rows, _SUM_WIDTH, cols)


def _grouped_sum(x: np.ndarray, levels: int = 0) -> tuple[np.ndarray, int]:
    """Row sums of a 2-D x in float64, by levels of groups of _SUM_WIDTH, and the number of levels
    (``levels`` of which made x)."""
    rows = x.shape[0]
    cur = x
    while cur.shape[1] > 1:
        pad = (-cur.shape[1]) % _SUM_WIDTH
        if pad:
            cur = np.concatenate([cur, np.zeros((rows, pad), dtype=cur.dtype)], axis=1)
        # Groups of terms _SUM_WIDTH apart: adding whole rows of the reshaped block is the fast way.
        cur = np.add.reduce(cur.reshape(rows, _SUM_WIDTH, -1), axis=1, dtype=np.float64)
        levels += 1
    total = cur[:, 0].astype(np.float64) if cur.shape[1] else np.zeros(rows)
    return total, levels


def rowdot(x: np.ndarray, y: np.ndarray | None) -> Enclosure:
    """Enclosures of ``sum(x[..., k] * y[..., k])`` over the last axis, for a short last axis."""
    terms = []
    unsafe = np.zeros(x.shape[:-1], dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        S = np.zeros(x.shape[:-1])
        for k in range(x.shape[-1]):
            if y is None:
                terms.append(x[..., k])
                S = S + np.abs(x[..., k])
                continue
            p, e, safe = two_prod(x[..., k], y[..., k])
            terms += [p, e]
            unsafe |= ~safe
            S = S + np.abs(p)
        if not terms:
            z = np.zeros(x.shape[:-1])
            return Enclosure(z, z.copy(), z.copy(), z.copy())
        hi, lo, rad = combine(terms)
        S = up(S * (1 + gamma(x.shape[-1], U64)))
    rad = np.where(unsafe, np.inf, rad)
    return Enclosure(hi, lo, rad, S)


def _slices(X: np.ndarray, axis: int, beta: int, count: int,
            abs_x: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Cut ``X`` into ``count`` slices along ``axis`` plus a remainder, whose sum is ``X`` exactly.

    Each slice holds, per row (or column), multiples of a power of two
    ``2**unit`` of magnitude at most ``2**beta`` units.  Also returns, per
    row, the lowest unit exponent used, or a large negative value where the
    slicing is not error-free (values too large or too small for the
    shifting trick).  The slices of an all-zero row are zero.  ``abs_x``
    may pass ``|X|``, already computed.
    """
    if count == 2 and axis % X.ndim == X.ndim - 1:
        # (The same values by one compiled loop where it applies: exactref/_fused_slices.py.)
        made = _fused_slices.last_axis(X, beta)
        if made is not None:
            return made
    out = []
    rest = X
    ok = np.ones(np.delete(X.shape, axis % X.ndim), dtype=bool)
    lowest = np.full(ok.shape, 4096, dtype=np.int64)
    for i in range(count):
        a = abs_x if i == 0 and abs_x is not None else np.abs(rest)
        mu = np.max(a, axis=axis, keepdims=True, initial=0.0)  # an empty sum (K = 0) has no slices
        del a
        ex = np.frexp(mu)[1].astype(np.int64)  # 2**ex > mu
        unit = ex - beta
        # fl(fl(x + sigma) - sigma) rounds x to a multiple of ulp(sigma) = 2**unit
        # while |x| <= sigma / 3 (Ozaki et al.).
        # sigma must be a normal float64 whose ulp is 2**unit.
        usable = (unit + 53 >= -1020) & (unit + 53 <= 1020) & (mu > 0)
        sigma = np.where(usable, np.ldexp(0.75, np.clip(unit + 53, -1020, 1020)), 0.0)
        piece = rest + sigma
        np.subtract(piece, sigma, out=piece)
        out.append(piece)
        # (The first rest is X itself, which is not to be written.)
        rest = rest - piece if i == 0 else np.subtract(rest, piece, out=rest)
        usable = usable.squeeze(axis)
        lowest = np.minimum(lowest, np.where(usable, unit.squeeze(axis), 4096))
        ok &= usable | (mu.squeeze(axis) == 0)
    lowest = np.where(ok, lowest, -4096)
    return out, rest, lowest


def fits_narrow(p: int) -> bool:
    """Whether inputs of precision ``p`` multiply exactly in float64."""
    return 2 * p <= 53


def finite_or_zero(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0.0)

