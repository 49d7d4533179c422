"""Roundings decided from enclosures: the one value of a format that all of ``hi + lo +- rad`` rounds to.

The engine's decisions (:mod:`.sumprod`), apart from its terms and blocks;
where an enclosure straddles a rounding boundary, none is made:

* :func:`decide_narrow`: both ends of [low, high] rounded to a format of at
  most 51 bits, decided where they agree (:func:`bounds_lo_zero` gives the
  ends of an enclosure whose low part is +0, in fewer numpy calls;
  :func:`decide_one`, one float32 value's ends and decision on Python floats);
* :func:`decide_float64`: the rounding to float64 of ``hi + lo +- rad``, with
  the float64 neighbours of the exact value as bounds, by the exponent bits
  in the common case and by nextafter (:func:`decide_float64_general`, the
  definition) elsewhere;
* :func:`refine`: the rounding of exact sums given as rows of float64 pieces,
  by an error-free extraction or a tree sum (:func:`decide_refined`), and
  :func:`grid`, which shows where such a sum is exactly its float64 value.

exactref/_fused.py and exactref/_fused_refine.py repeat these decisions in
compiled loops, bit for bit; the tests compare the two.
"""

from __future__ import annotations

import numpy as np

from .. import _fused, _fused_refine
from ..formats import Format
from ..rounding import (
    _slack_into,
    cast_is_faster,
    decide,
    enclosure_bounds,
    next_down,
    next_up,
    round_float64,
)
from . import fast

__all__ = ["bounds_lo_zero", "decide_float64", "decide_float64_general", "decide_narrow", "decide_one",
           "decide_refined", "grid", "refine", "refine_numpy"]


def bounds_lo_zero(hi: np.ndarray, rad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``enclosure_bounds(hi, lo, rad)`` where lo is exactly +0: the same values in about half the
    numpy calls, which are a small product's cost.

    With lo = +0, ``lo - rad``, ``lo + rad`` and ``|lo| + rad`` are ``-rad``, ``rad`` and ``rad``
    (``hi + (0 - rad)`` and ``hi - rad`` differ at most in the sign of a zero, from which
    :func:`exactref.rounding.below` subtracts a positive slack either way).  Each end's slack
    ``(|v| + rad) * _REL + _ABS`` is computed in place in one buffer: a block's temporaries
    are fresh memory, whose page faults cost more than the arithmetic.
    """
    shape = np.shape(hi)
    low, high, slack = np.empty(shape), np.empty(shape), np.empty(shape)  # (0-d arrays too)
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(hi, rad, out=low)
        np.add(hi, rad, out=high)
        for end, sign in ((low, np.subtract), (high, np.add)):
            sign(end, _slack_into(end, rad, slack), out=end)
    return low, high


def decide_one(hi: float, lo: float, rad: float, fmt: Format) -> tuple[float, float, float] | None:
    """``(rounded, x_lo, x_hi)`` of one value in ``hi + lo +- rad``, for a float32 output: what
    :func:`~exactref.rounding.enclosure_bounds` and :func:`decide_narrow` give it, by the first
    itself on Python floats and the second's comparison written out, bit for bit, without the
    numpy calls' fixed costs (which a full sum's one output pays after its long loop, its caches cold: see
    ops/reduction.py).  None where those leave it undecided (a zero, an end on both sides of a
    rounding boundary), or where the ends are not finite or lie past float32's largest value
    (where the cast would overflow): the numpy code decides those.

    Equal roundings of two ends of one sign are equal bits (a positive end rounds to +0 at the
    least, a negative one to -0), so comparing values is :func:`decide_narrow`'s comparison of
    bits."""
    if not _fused._rounds_by_cast(fmt):
        return None
    low, high = enclosure_bounds(hi, lo, rad)  # (on floats: Python's arithmetic, IEEE's)
    if not (low > 0 or high < 0) or not (abs(low) <= fmt.max_finite and abs(high) <= fmt.max_finite):
        return None  # (NaN fails both tests)
    r_high = float(np.float32(high))  # numpy's cast: round_float64's for float32
    if float(np.float32(low)) != r_high:
        return None
    return r_high, low, high


def decide_narrow(low: np.ndarray, high: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """The rounding to ``fmt`` (p <= 51) of values in [low, high], and where both ends round alike."""
    if not fmt.cast_rounds or fmt.saturates:
        return decide(low, low, low, fmt, bounds=(low, high))
    with np.errstate(over="ignore", invalid="ignore"):
        if cast_is_faster(fmt, np.size(low)):
            # The cast is one correct rounding: compare in that format.
            r_low, r_high = np.asarray(low).astype(fmt.dtype), np.asarray(high).astype(fmt.dtype)
        else:
            r_low, r_high = round_float64(low, fmt), round_float64(high, fmt)
        # Equal values of one sign are equal bits (for a small output the calls are the cost).  Two
        # NaNs of equal bits are not decided either: their bounds fail the sign test.
        bits = np.dtype(f"u{r_low.dtype.itemsize}")
        same = r_low.view(bits) == r_high.view(bits)
        decided = same & ((low > 0) | (high < 0))
    return r_high.astype(np.float64, copy=False), decided


# The float64 bits of the exponent field, and the fast decision's range of |s|: [2**-960, 2**1000].
_EXP_BITS = 0x7FF0000000000000
_MANT_BITS = 0x000FFFFFFFFFFFFF
_COMMON_LOW = int(np.float64(2.0 ** -960).view(np.int64))
_COMMON_HIGH = int(np.float64(2.0 ** 1000).view(np.int64))
# nextafter(2**k, -inf) = 2**k * _BELOW and nextafter(2**(k-1), +inf) = 2**k * _HALF_ABOVE, exactly,
# for normal results.
_BELOW = 1 - 2.0 ** -53
_HALF_BELOW = 0.5 * _BELOW
_HALF_ABOVE = 0.5 * (1 + 2.0 ** -52)
_TINY = 2.0 ** -1074  # nextafter(0, +inf)


def decide_float64(hi: np.ndarray, lo: np.ndarray,
                   rad: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rounding to float64 of values in ``hi + lo +- rad``, float64 bounds on them, and where decided.

    Where the enclosure lies strictly between two adjacent float64 values,
    those are the bounds (as the exact path gives them); where it decides
    the rounding but may hold a float64, the bounds are the enclosure's own.

    The same values as :func:`decide_float64_general`, bit for bit, without its six nextafter
    calls (each costs about twenty plain passes): where ``s = hi + lo`` is not a power of two and
    2**-960 <= |s| <= 2**1000, both gaps of s are its ulp, a power of two from the exponent bits,
    and ``nextafter(w, +inf) < c`` is ``w < nextafter(c, -inf)`` (and ``nextafter(w, -inf) > c``
    is ``w > nextafter(c, +inf)``) for every w, NaN and infinities included, where the
    neighbours of the thresholds c (0, +-ulp, +-ulp/2) are exact products of the ulp.  The other
    elements (none, usually) take the general code.
    """
    hi, lo, rad = (np.asarray(v, dtype=np.float64) for v in (hi, lo, rad))
    if hi.ndim == 0 or hi.shape != lo.shape or hi.shape != rad.shape or hi.size < 64:
        return decide_float64_general(hi, lo, rad)
    with np.errstate(invalid="ignore", over="ignore"):
        s = hi + lo
        e = hi - s
        e += lo  # exact where |hi| >= |lo|, required below
        bits = s.view(np.int64)
        ulp = np.bitwise_and(bits, _EXP_BITS)  # |s| rounded down to a power of two, for a normal s
        common = (ulp >= _COMMON_LOW) & (ulp <= _COMMON_HIGH)  # (a negative s's bits are masked off)
        common &= np.bitwise_and(bits, _MANT_BITS) != 0  # not a power of two
        ulp = ulp.view(np.float64)
        ulp *= 2.0 ** -52
        usable = np.abs(hi)
        usable = usable >= np.abs(lo)
        usable &= common
        w_hi = e + rad  # upper = nextafter(w_hi, +inf) in the general code
        w_lo = e - rad  # lower = nextafter(w_lo, -inf)
        t = ulp * _BELOW  # nextafter(gap, -inf)
        above = w_lo > _TINY  # lower > 0
        above &= w_hi < t  # upper < gap_up
        above &= usable
        below = w_hi < -_TINY  # upper < 0
        np.negative(t, out=t)
        below &= w_lo > t  # lower > -gap_down
        below &= usable
        np.multiply(ulp, _HALF_BELOW, out=t)  # nextafter(gap / 2, -inf)
        to_s = w_hi < t  # upper < half_up
        np.negative(t, out=t)
        to_s &= w_lo > t  # lower > half_down
        to_s &= usable
        np.multiply(ulp, _HALF_ABOVE, out=t)  # nextafter(gap / 2, +inf)
        to_up = w_lo > t  # lower > half_up
        to_up &= above
        np.negative(t, out=t)
        to_down = w_hi < t  # upper < half_down
        to_down &= below
        del t, w_hi, w_lo, e
        # (Never in fact: s is the nearest float64 to hi + lo; kept as the general code has it.)
        moved = bool(to_up.any() or to_down.any())
        decided = to_s | to_up | to_down
        if moved:
            rounded = s.copy()
            rounded[to_up] += ulp[to_up]
            to_down &= ~to_up  # (the general code's np.where takes to_up first)
            rounded[to_down] -= ulp[to_down]
        else:
            rounded = s
        # x_lo = s where above else s - ulp; x_hi = s + ulp where above else s (exact: s is normal).
        step = ulp * above
        x_hi = s + step
        np.subtract(ulp, step, out=step)
        x_lo = s - step
        del step
    rare = ~common
    if rare.any():
        r_r, lo_r, hi_r, dec_r = decide_float64_general(hi[rare], lo[rare], rad[rare])
        if rounded is s:
            rounded = s.copy()
        rounded[rare], x_lo[rare], x_hi[rare], decided[rare] = r_r, lo_r, hi_r, dec_r
        above[rare] = below[rare] = True  # their loose elements are done
    loose = decided & ~(above | below)
    if loose.any():
        b_lo, b_hi = enclosure_bounds(hi[loose], lo[loose], rad[loose], tight=True)
        x_lo[loose], x_hi[loose] = b_lo, b_hi
    return rounded, x_lo, x_hi, decided


def decide_float64_general(hi: np.ndarray, lo: np.ndarray,
                           rad: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`decide_float64` for any elements, with nextafter: the definition, which the fast
    version follows bit for bit and uses for the elements outside its common case."""
    hi, lo, rad = (np.asarray(v, dtype=np.float64) for v in (hi, lo, rad))
    with np.errstate(invalid="ignore", over="ignore"):
        s = hi + lo
        e = (hi - s) + lo  # exact where |hi| >= |lo|, required below
        s_up, s_down = next_up(s), next_down(s)
        gap_up, gap_down = s_up - s, s - s_down
        upper, lower = next_up(e + rad), next_down(e - rad)
        usable = (np.abs(hi) >= np.abs(lo)) & (np.abs(s) < _F64_MAX) & (np.abs(s) >= 2.0 ** -1021)
        above = usable & (lower > 0) & (upper < gap_up)
        below = usable & (upper < 0) & (lower > -gap_down)
        half_up, half_down = gap_up / 2, -gap_down / 2
        to_s = usable & (upper < half_up) & (lower > half_down)
        to_up = above & (lower > half_up)
        to_down = below & (upper < half_down)
        rounded = np.where(to_up, s_up, np.where(to_down, s_down, s))
        decided = to_s | to_up | to_down
        # A nonzero s: an enclosure touching zero is never decided (the sign of zero matters).
        decided &= s != 0
        x_lo = np.where(above, s, s_down)
        x_hi = np.where(above, s_up, s)
    loose = decided & ~(above | below)
    if loose.any():
        b_lo, b_hi = enclosure_bounds(hi[loose], lo[loose], rad[loose], tight=True)
        x_lo[loose], x_hi[loose] = b_lo, b_hi
    return rounded, x_lo, x_hi, decided


def refine(pieces: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rounding to ``fmt`` and the float64 neighbours of each row sum, where an error-free
    extraction (:func:`fast.extract_sum`) or else a tree sum decides them.

    Returns ``(value, x_lo, x_hi, ok)``.  Where ``ok``, either the exact
    row sum is a nonzero float64 (``x_lo == x_hi``), or it lies strictly
    between the adjacent float64 values ``x_lo < x_hi``; ``value`` is its
    correct rounding: exactly what the exact path gives.  Elsewhere the
    values are garbage.
    """
    # The extraction and its decision by one compiled loop where it applies, which extracts again
    # where that does not decide and rounds exact float64 ties (exactref/_fused_refine.py); the
    # rows it leaves, by the numpy code.
    n = pieces.shape[1] if pieces.ndim == 2 else 0
    fused = _fused_refine.extract_decide(pieces, fmt, kmin=fast._EXTRACT_MIN_K, kmax=fast._EXTRACT_MAX_K,
                                         c=n * fast.gamma(max(n - 1, 0), fast.U64),
                                         up_constants=(fast._UP_REL, fast._UP_ABS))
    if fused is None:
        return refine_numpy(pieces, fmt)
    value, x_lo, x_hi, ok = fused
    rest = np.flatnonzero(~ok)
    if rest.size:
        value[rest], x_lo[rest], x_hi[rest], ok[rest] = refine_numpy(pieces[rest], fmt)
    return value, x_lo, x_hi, ok


def refine_numpy(pieces: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`refine` by numpy alone."""
    count = pieces.shape[0]
    value, x_lo, x_hi = np.zeros(count), np.zeros(count), np.zeros(count)
    ok = np.zeros(count, dtype=bool)
    rest = np.arange(count)
    # One error-free extraction decides nearly every row in a ninth of the tree sum's passes; a
    # second, from its remainders, most of the rest (sums that lie on a float64, or halfway between
    # two, among them); the tree sum is the tighter for long rows (its bound grows as log n, the
    # extraction's as n**3).
    for enclose in (fast.extract_sum, extract_twice, fast.tree_sum):
        part = pieces if rest.size == count else pieces[rest]
        hi, lo, rad = enclose(part)
        v, a, b, done = decide_refined(hi, lo, rad, fmt)
        # hi + lo is the exact sum itself where the error bound is below the grid the pieces lie on.
        sure = np.flatnonzero(~done)
        sure = sure[rad[sure] < grid(part[sure])]
        if sure.size:
            v[sure], a[sure], b[sure], done[sure] = decide_refined(hi[sure], lo[sure], np.zeros(sure.size), fmt)
        value[rest], x_lo[rest], x_hi[rest], ok[rest] = v, a, b, done
        rest = rest[~done]
        if not rest.size:
            break
    return value, x_lo, x_hi, ok


def extract_twice(P: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``hi + lo +- rad`` enclosing each row sum of finite float64 ``P`` (rows, n) by two error-free
    extractions: :func:`fast.extract_sum`'s, and the same again on its remainders r = p - q.

    The first's sum tau of the q is exact, and so is the second's, tau2; the exact row sum is tau +
    tau2 + the sum of the second's remainders, whose float64 sum lo2 errs by at most the second's
    bound rad2.  With tau + tau2 = h + l and l + lo2 = t + e by two-sums, h + t lies within |e| +
    rad2 of the exact sum.  (Where that is below the grid of P, the error is zero: refine's grid
    step.)  A row with no sigma at either step gets rad = inf.  exactref/_fused_refine.py's loop
    makes the same enclosure; the derivation is in docs/guarantees-and-limits.md.
    """
    tau, _, rad1, r = fast.extract_sum(P, remainders=True)
    tau2, lo2, rad2 = fast.extract_sum(r)
    with np.errstate(over="ignore", invalid="ignore"):
        h, l = fast.two_sum(tau, tau2)
        t, e = fast.two_sum(l, lo2)
        rad = fast.up(np.abs(e) + rad2)
    bad = ~(rad1 < np.inf) | ~(rad < np.inf)
    return np.where(bad, 0.0, h), np.where(bad, 0.0, t), np.where(bad, np.inf, rad)


def decide_refined(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray,
                   fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`refine`'s decision from the tree sums' enclosures ``hi + lo +- rad``."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = hi + lo
        e = (hi - s) + lo  # exact: |hi| >= |lo| is required below
        s_up, s_down = next_up(s), next_down(s)
        gap_up, gap_down = s_up - s, s - s_down
        upper, lower = next_up(e + rad), next_down(e - rad)
        above = (lower > 0) & (upper < gap_up)  # s < exact < s_up
        below = (upper < 0) & (lower > -gap_down)  # s_down < exact < s
        ok = (above | below) & (np.abs(hi) >= np.abs(lo)) & (np.abs(s) < _F64_MAX)
        x_lo = np.where(above, s, s_down)
        x_hi = np.where(above, s_up, s)
        if fmt.p == 53:
            # Nearest: the side of the midpoint of (x_lo, x_hi) that exact - s lies on.
            # Half a gap is exact away from the subnormals.
            half = np.where(above, gap_up, -gap_down) / 2
            to_lo, to_hi = upper < half, lower > half
            # exact = s + e exactly, on the midpoint: a tie, to the even one of x_lo and x_hi.
            tie = (rad == 0) & (e == half)
            even = (x_lo.view(np.int64) & 1) == 0
            to_lo, to_hi = np.where(tie, even, to_lo), np.where(tie, ~even, to_hi)
            ok &= (to_lo | to_hi) & (np.abs(s) >= 2.0 ** -1021)
            value = np.where(to_lo, x_lo, x_hi)
        else:
            # Round to odd at 53 bits, then to nearest at p <= 51 bits (Boldo and Melquiond).
            odd = (x_lo.view(np.int64) & 1).astype(bool)
            value = round_float64(np.where(odd, x_lo, x_hi), fmt)
        # No error, and s + e = hi + lo with e = 0: the exact sum is the float64 s.
        exact = (rad == 0) & (e == 0) & (s != 0) & (np.abs(hi) >= np.abs(lo))
        x_lo, x_hi = np.where(exact, s, x_lo), np.where(exact, s, x_hi)
        value = np.where(exact, round_float64(s, fmt), value)
    return value, x_lo, x_hi, ok | exact


_F64_MAX = float(np.finfo(np.float64).max)


def grid(pieces: np.ndarray) -> np.ndarray:
    """Per row, a power of two 2**g of which every piece is a multiple: the lowest set bit among them
    (0 where that is below 2**-1074, or where every piece is zero).

    So is the exact row sum, and so are tree_sum's hi and lo: two-sums and float64 roundings of
    multiples of 2**g stay multiples of 2**g (a rounding's ulp is at least 2**g, or it is exact).
    So are extract_sum's: each q is p, or a multiple of its grid 2**(k - 53), itself a multiple of
    2**g where some p is not; so is r = p - q.  Where ``|exact - (hi + lo)| <= rad`` has rad below
    2**g, the difference, a multiple of 2**g, is zero: hi + lo is the exact sum.  A sum of float32
    products that cancels to a small value is such a sum: exactly a float64, and undecided by any
    error bound that is not zero.
    """
    frac, ex = np.frexp(pieces)  # pieces = m * 2**(ex - 53), m an integer below 2**53
    m = np.ldexp(frac, 53).astype(np.int64)
    with np.errstate(under="ignore"):
        low = np.ldexp(np.bitwise_and(m, -m).astype(np.float64), ex - 53)  # lowest set bit (or 0)
    low[pieces == 0] = np.inf
    g = np.min(low, axis=1, initial=np.inf)
    return np.where(g < np.inf, g, 0.0)
