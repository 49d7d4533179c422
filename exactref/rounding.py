"""Correct rounding into a format, and deciding a rounding from an enclosure.

Rounding is to nearest, ties to even, with gradual underflow; a result whose
magnitude reaches the format's overflow threshold becomes the format's
overflow value (inf, or NaN for a finite-only format).

Two kinds of input are rounded here:

* float64 arrays holding *exact* values (:func:`round_float64`), vectorised;
* exact dyadic rationals ``n * 2**e`` with Python integers
  (:func:`round_dyadic`), one at a time, for the elements the fast path could
  not decide.

:func:`decide` takes an enclosure ``hi + lo +- rad`` of exact values and says,
element by element, whether every point of it rounds to the same value, and
to which.  An enclosure that contains zero, or a point of each sign, is never
decided: the sign of a zero result matters.
"""

from __future__ import annotations

import math

import numpy as np

from ._parallel import elementwise
from .formats import ComplexFormat, Format

__all__ = [
    "above",
    "below",
    "cast_is_faster",
    "decide",
    "enclosure_bounds",
    "next_down",
    "next_up",
    "round_dyadic",
    "round_float64",
    "to_dtype",
]

_NEG_INF = -np.inf
_POS_INF = np.inf


# Arrays at least this large step and round by integer arithmetic on their bits (_step, _round_bits),
# and are stored in an ml_dtypes format through float32 (to_dtype).
_BITS_MIN = 2048


def next_down(x: np.ndarray) -> np.ndarray:
    """The largest float64 below ``x``: a lower bound for a value ``x`` approximates to nearest."""
    if type(x) is np.ndarray and x.dtype == np.float64 and x.size >= _BITS_MIN:
        return _step(x, up=False)
    return np.nextafter(x, _NEG_INF)


def next_up(x: np.ndarray) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.float64 and x.size >= _BITS_MIN:
        return _step(x, up=True)
    return np.nextafter(x, _POS_INF)


def _step(x: np.ndarray, *, up: bool) -> np.ndarray:
    """``np.nextafter(x, +-inf)`` for a float64 array, the same values, several times faster.

    Finite float64 values are ordered as their bits are, as sign and magnitude: the next value
    up is the bits plus one for a positive value (+0 included) and minus one for a negative
    one.  -0 is made +0 first (``x + 0.0``; for the next value down, ``-(0.0 - x)`` makes +0
    into -0).  An array holding an infinity or a NaN (where the bits would run into the other
    special values) takes np.nextafter.
    """
    if not (np.isfinite(np.maximum.reduce(x, axis=None)) and np.isfinite(np.minimum.reduce(x, axis=None))):
        return np.nextafter(x, _POS_INF if up else _NEG_INF)
    if up:
        y = np.add(x, 0.0)
    else:
        y = np.subtract(0.0, x)
        np.negative(y, out=y)
    bits = y.view(np.int64)
    # +1 for a positive value (sign bit clear), -1 for a negative one; the other way down.
    delta = np.right_shift(bits, 63)  # 0 or -1
    np.bitwise_or(delta, 1, out=delta)  # 1 or -1
    if up:
        np.add(bits, delta, out=bits)
    else:
        np.subtract(bits, delta, out=bits)
    return y


# Relative and absolute slack covering the roundings of a few float64 operations.
_REL = 2.0 ** -50
_ABS = 2.0 ** -1070


def below(v: np.ndarray, scale: np.ndarray | float = 0.0) -> np.ndarray:
    """A float64 lower bound for an exact value that ``v`` approximates.

    ``v`` must come from a few float64 operations whose operands are at most
    ``max(|v|, scale)`` in magnitude; their roundings are paid for by a
    relative slack of 2**-50 of that magnitude.  Cheaper than nextafter.  ``v`` and ``scale`` may
    be Python floats too (the same operations, without numpy's per-call cost: the one-value
    decisions of engine.decision.decide_one and result.judge_one).
    """
    return v - ((abs(v) + scale) * _REL + _ABS)  # (abs: np.absolute for an array)


def above(v: np.ndarray, scale: np.ndarray | float = 0.0) -> np.ndarray:
    """The upper-bound twin of :func:`below`."""
    return v + ((abs(v) + scale) * _REL + _ABS)


def _slack_into(v: np.ndarray, scale: np.ndarray | float, out: np.ndarray) -> np.ndarray:
    """The slack of :func:`below` and :func:`above`, ``(|v| + scale) * _REL + _ABS``, written into
    ``out`` by the same operations: on large arrays, fresh temporaries cost more in page faults
    than the arithmetic."""
    np.abs(v, out=out)
    np.add(out, scale, out=out)
    np.multiply(out, _REL, out=out)
    np.add(out, _ABS, out=out)
    return out


def enclosure_bounds(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray, *,
                     tight: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds ``low <= hi + lo - rad`` and ``hi + lo + rad <= high``.

    ``tight`` costs two nextafter calls per bound and loses at most two ulps;
    otherwise a cheaper relative slack of 2**-50 is used.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        if tight:
            return next_down(hi + next_down(lo - rad)), next_up(hi + next_up(lo + rad))
        t_low, t_high = lo - rad, lo + rad
        scale = abs(lo) + rad  # (np.absolute for an array; Python floats too, as in below)
        return below(hi + t_low, scale), above(hi + t_high, scale)


def round_float64(x: np.ndarray, fmt: Format) -> np.ndarray:
    """Round float64 values, taken as exact, to ``fmt``; the result is float64.

    NaN passes through.  An infinity stays one in a format that has it, and
    becomes NaN in one without (the largest finite value if ``fmt``
    saturates).  See :func:`_encode` for the formats without negative zero or
    without zero.
    """
    x = np.asarray(x, dtype=np.float64)
    if fmt.p == 53 and fmt.emin == -1022:
        return np.where(np.isinf(x), np.copysign(fmt.max_finite, x), x) if fmt.saturates else x.copy()
    if cast_is_faster(fmt, x.size):
        with np.errstate(over="ignore"):
            r = x.astype(fmt.dtype).astype(np.float64)
        return np.where(np.isinf(r), np.copysign(fmt.max_finite, r), r) if fmt.saturates else r
    if x.size >= _BITS_MIN and fmt.signed and fmt.has_negative_zero:
        return _round_bits(x, fmt)
    return _round_general(x, fmt)


def cast_is_faster(fmt: Format, size: int) -> bool:
    """Whether ``size`` values are best rounded to ``fmt`` by numpy's cast to its dtype.

    The cast is one correct rounding where ``fmt.cast_rounds`` (IEEE conversion).  numpy's own
    (float32, float16) is a vectorised loop; ml_dtypes' (bfloat16) is slow, 4.5 ms per 2**19
    values against numpy's 0.9 ms into float16 (2 cores), so a large array takes
    :func:`_round_bits` instead (0.5 ms per 2**18 values, measured later), and a small one the
    cast's two numpy calls.
    """
    return fmt.cast_rounds and (fmt.dtype.kind == "f" or size < _BITS_MIN)


def _round_general(x: np.ndarray, fmt: Format) -> np.ndarray:
    """:func:`round_float64` for any format and any float64 values, by the exponent of each."""
    # Quantum (ulp) exponent of each element: max(exponent, emin) - (p - 1).
    _, ex = np.frexp(x)
    q = np.maximum(ex - 1, fmt.emin) - (fmt.p - 1)
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.ldexp(np.rint(np.ldexp(x, -q)), q)
        overflow = np.abs(r) > fmt.max_finite
    if overflow.any():
        r = np.where(overflow, np.copysign(fmt.overflow_value, x), r)
    if fmt.has_inf and not fmt.saturates:
        r = np.where(np.isfinite(x), r, x)
    else:
        r = np.where(np.isinf(x), np.copysign(fmt.overflow_value, x) if fmt.saturates else np.nan, r)
    r = _encode(r, fmt)
    if not fmt.signed:
        # Every negative value is NaN here, one that rounds to -0 too (only a zero itself is 2**-127).
        r = np.where(x < 0, np.nan, r)
    return r


_SIGN_OFF = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_ONE = np.uint64(1)


def _round_bits(x: np.ndarray, fmt: Format) -> np.ndarray:
    """:func:`round_float64` for a signed format with negative zero, by integer arithmetic on the
    bits of x (:func:`_round_bits_block`), _BITS_BLOCK values at a time.

    Its ten passes over memory then stay in the cache: on 2 cores, 2**18 values took
    0.49-0.51 ms so against 1.94 ms in one piece (medians of 21).  Each value is rounded
    alone, so the blocks change no value.  (:func:`exactref._parallel.elementwise` splits
    only outputs past 2**21 elements, for threads; the judge's blocks are smaller.)
    """
    if x.size <= _BITS_BLOCK:
        return _round_bits_block(x, fmt)
    flat = x.reshape(-1)
    out = np.empty(flat.shape)
    for start in range(0, flat.size, _BITS_BLOCK):
        out[start:start + _BITS_BLOCK] = _round_bits_block(flat[start:start + _BITS_BLOCK], fmt)
    return out.reshape(x.shape)


# Values per block of _round_bits (256 KiB of float64).  Blocks of 2**14, 2**15 and 2**16 values
# took 0.58-0.59, 0.50-0.51 and 0.46-0.51 ms for 2**18 values (medians of 21, 2 cores).
_BITS_BLOCK = 1 << 15


def _round_bits_block(x: np.ndarray, fmt: Format) -> np.ndarray:
    """:func:`_round_bits` of one block, about ten passes over it; the few values it does not
    cover take :func:`_round_general`.

    Where |x| is 0 or a normal value of ``fmt`` (at least 2**emin, below 2**(emax + 2)), the
    rounding keeps the top p of float64's 53 significand bits: with d = 53 - p, adding
    2**(d-1) - 1, plus the last kept bit, to the bits and clearing the low d bits rounds to
    nearest, ties to even (a tie carries exactly when the last kept bit is 1).  A carry out of
    the significand raises the exponent field by one, which is the rounding up to the next
    power of two; below 2**(emax + 2) it cannot reach the sign bit or the all-ones exponent.  A
    result above the largest finite value has overflowed; it, the values below 2**emin (whose
    quantum is the format's smallest subnormal, not their own) and NaN and infinities are
    rounded by :func:`_round_general`.  A zero keeps its sign: its bits only gain the bias.
    """
    d = 53 - fmt.p
    b = x.view(np.uint64)
    bits = np.right_shift(b, np.uint64(d))
    np.bitwise_and(bits, _ONE, out=bits)
    np.add(bits, np.uint64((1 << (d - 1)) - 1), out=bits)
    np.add(bits, b, out=bits)
    np.bitwise_and(bits, np.uint64(~((1 << d) - 1) & 0xFFFF_FFFF_FFFF_FFFF), out=bits)
    r = bits.view(np.float64)
    mag = np.bitwise_and(b, _SIGN_OFF)
    top = mag.max(initial=0)
    np.subtract(mag, _ONE, out=mag)  # (a zero wraps round to the largest value: it is covered)
    big = math.ldexp(1.0, fmt.emax + 2)
    if (top < _bits_of(big) and mag.min(initial=_bits_of(big)) >= _bits_of(fmt.min_normal) - 1
            and r.max(initial=0.0) <= fmt.max_finite and r.min(initial=0.0) >= -fmt.max_finite):
        return r
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(x)
        odd = ~(magnitude < big) | ((magnitude < fmt.min_normal) & (x != 0)) | ~(np.abs(r) <= fmt.max_finite)
    r[odd] = _round_general(x[odd], fmt)
    return r


def _bits_of(value: float) -> int:
    """The bits of a positive float64, as an integer: float64 values of one sign are ordered as these."""
    return int(np.float64(value).view(np.uint64))


def _encode(r: np.ndarray, fmt: Format) -> np.ndarray:
    """What the format's encoding makes of correctly rounded values ``r``.

    Without negative zero (fnuz) a zero is +0.  Without zero (e8m0) a value
    below the smallest one rounds to it, the nearest value the format has;
    without negative values (e8m0) a negative value or zero is NaN.
    """
    if fmt.has_negative_zero:
        return r
    if not fmt.has_zero:
        with np.errstate(invalid="ignore"):
            r = np.where(r == 0, fmt.min_subnormal, r)
            return np.where(np.signbit(r) & ~np.isnan(r), np.nan, r)
    return np.where(r == 0, 0.0, r)


def to_dtype(x: np.ndarray, fmt: Format | ComplexFormat) -> np.ndarray:
    """Store float64 (or complex128) values that ``fmt`` represents exactly in ``fmt``'s dtype."""
    x = np.asarray(x)
    if x.size >= _BITS_MIN and x.flags.c_contiguous:
        # A large array in blocks side by side (exactref/_parallel.py).
        return elementwise(lambda block: (_store(block, fmt),), x)[0]
    return _store(x, fmt)


def _store(x: np.ndarray, fmt: Format | ComplexFormat) -> np.ndarray:
    with np.errstate(over="ignore"):
        if x.size >= _BITS_MIN and _within_float32(fmt):
            # Exact both ways; ml_dtypes converts float32 several times faster than float64.
            return x.astype(np.float32).astype(fmt.dtype)
        return x.astype(fmt.dtype)


def _within_float32(fmt: Format | ComplexFormat) -> bool:
    """Whether ``fmt`` is an ml_dtypes format all of whose values float32 holds."""
    return (fmt.dtype is not None and fmt.dtype.kind == "V" and fmt.p <= 24 and fmt.emax <= 127
            and fmt.emin - fmt.p + 1 >= -149)


def round_dyadic(n: int, e: int, fmt: Format, *, negative_zero: bool = False) -> float:
    """Round the exact value ``n * 2**e`` to ``fmt`` and return it as a float.

    ``negative_zero`` gives the sign of an exact zero.
    """
    if n < 0 and not fmt.signed:
        return math.nan
    if n == 0:
        return float(_encode(np.array(-0.0 if negative_zero else 0.0), fmt))
    sign = -1 if n < 0 else 1
    m = abs(n)
    top = m.bit_length() - 1 + e  # value lies in [2**top, 2**(top+1))
    q = max(top, fmt.emin) - (fmt.p - 1)
    shift = q - e
    if shift > 0:
        rest = m & ((1 << shift) - 1)
        m >>= shift
        half = 1 << (shift - 1)
        if rest > half or (rest == half and m & 1):
            m += 1
    else:
        m <<= -shift
    if m.bit_length() + q - 1 > fmt.emax or (m > 0 and math.ldexp(m, q) > fmt.max_finite):
        return sign * fmt.overflow_value
    # copysign keeps the sign of a nonzero value that rounds to zero.
    return float(_encode(np.array(math.copysign(math.ldexp(m, q), sign)), fmt))


def round_dyadic_down_up(n: int, e: int) -> tuple[float, float]:
    """float64 bounds ``(lo, hi)`` with ``lo <= n * 2**e <= hi``, equal when exact."""
    if n == 0:
        return 0.0, 0.0
    m = abs(n)
    top = m.bit_length() - 1 + e
    if top > 1023:
        mag_lo, mag_hi = float(np.finfo(np.float64).max), math.inf
    else:
        q = max(top, -1022) - 52
        shift = q - e
        if shift > 0:
            mag_lo = math.ldexp(m >> shift, q)
            exact = (m & ((1 << shift) - 1)) == 0
        else:
            mag_lo, exact = math.ldexp(m, e), True
        mag_hi = mag_lo if exact else math.nextafter(mag_lo, math.inf)
    return (mag_lo, mag_hi) if n > 0 else (-mag_hi, -mag_lo)


def decide(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray, fmt: Format,
           bounds: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decide the rounding of exact values known to lie in ``hi + lo +- rad``.

    ``hi``, ``lo`` and ``rad`` are float64 arrays; ``rad`` may be inf.  Returns
    ``(rounded, decided)``: the rounding to ``fmt`` (as float64) where
    ``decided`` is True, and garbage elsewhere.  ``bounds`` may pass in
    :func:`enclosure_bounds` already computed.
    """
    if fmt.p > 51:
        return _decide_double(hi, lo, rad, fmt)
    low, high = enclosure_bounds(hi, lo, rad) if bounds is None else bounds
    r_low = round_float64(low, fmt)
    r_high = round_float64(high, fmt)
    decided = (r_low == r_high) & (np.signbit(r_low) == np.signbit(r_high))
    # An enclosure touching zero is never decided, even if both ends round to zero.
    decided &= (low > 0) | (high < 0)
    return r_high, decided


def _decide_double(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    # Here the rounding target is float64 itself: normalise hi + lo, then the
    # candidate s is decided when the whole enclosure stays strictly inside
    # the half-gaps to s's neighbours.
    with np.errstate(invalid="ignore", over="ignore"):
        s = hi + lo
        z = hi - s
        e = z + lo  # exact when |hi| >= |lo| (fast two-sum); we ensure it by checking below
        up_gap = next_up(s) - s
        down_gap = s - next_down(s)
        e_high = next_up(e + rad)
        e_low = next_down(e - rad)
        decided = (e_high < up_gap * 0.5) & (e_low > -down_gap * 0.5)
        decided &= np.abs(hi) >= np.abs(lo)
        decided &= np.isfinite(s) & (np.abs(s) < fmt.max_finite) & (s != 0)
        # Near the bottom of the format the half gaps are not representable.
        decided &= np.abs(s) >= math.ldexp(1.0, fmt.emin + 2)
    return s, decided
