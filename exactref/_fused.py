"""Compiled loops: several elementwise steps of a judgement in one pass over memory, by numba.

Why: numpy makes one pass over memory per operation, and writes each result
to a new array.  Once a matmul's BLAS products are made, the rest is mostly
such passes, a few dozen per output element: the bounds on the exact value
and whether they round alike (engine.decision), the bound on |A| |B| widened
from its float32 product and the enclosure's radius (engine.products), the
tolerance and its overflow marks (models._bounds), the acceptance interval,
the tolerance's slack and the copies into the result's arrays
(ops._common, result.judge).  A compiled loop makes each element's steps
while it is in a register, and writes each output once.  On 2 cores, each
call right after torch's float64 matmul of the same size, medians of four
rounds of 11 calls alternating in one process: a float32 matmul took 11.5
against 13.8 ms at 512**3, 44.2 against 49.3 ms at 1024**3 and 325 against
349 ms at 2048**3; a float64 one 24.0 against 26.7 ms at 512**3; a bfloat16
one 275 against 325 ms at 2048**3.

The loops make the numpy code's operations in the same order, in IEEE
double precision: numba compiles them with LLVM without fast-math, so
nothing is reassociated or contracted into a fused multiply-add, and the
values are those of the numpy code bit for bit (tests/exactref/test_fused.py
compares them on NaN, infinities, zeros, subnormals, values past float32's
range and at its rounding ties).  Where the numpy code takes nextafter, a
loop adds one to the bits, as exactref.rounding does, and leaves the
elements where that does not hold (infinities and NaN) to a second loop that
calls nextafter; where it rounds to float16, bfloat16 or float8_e5m2, a loop
rounds the bits as exactref.rounding's _round_bits_block does, and leaves
the elements outside that trick's range (subnormal results, overflow) to the
numpy code.  Each loop releases the GIL, so the blocks of a large
output run side by side (exactref/_parallel.py).

numba is optional (exactref[fast]): without it (:func:`available` is
False), or for a block of fewer than MIN_SIZE elements, where a call's fixed
cost would count, the numpy code runs, so a small op never loads numba.
The first process to run the loops compiles them (3.6 s for all of them, on
2 cores) and keeps the machine code on disk (numba's cache); a later
process loads numba and the loops in about 0.4 s (see _BITS for what keeps
the cache working).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["available", "decide_float64", "decide_narrow", "decides", "judge_into", "judges", "quick_cut",
           "read_float32", "scaled_bound", "usable", "widen_float32"]

# Elements below which a block keeps the numpy code.  There the loops gain microseconds (a
# float32 judgement of 4096 elements took 26 us against numpy's 41).  (A small output of one plain
# narrow product is the exception: one call of exactref/_fused_judge.py's loop replaces its thirty
# numpy calls (ops._common._judged_at_once), and so small matmuls load numba, about 0.4 s once
# per process.)
MIN_SIZE = 1 << 12


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether numba can be imported here (it is an optional dependency)."""
    try:
        import numba

        # numba's first compilation imports the rest of what it needs, scipy among them where it is
        # installed, and with scipy a BLAS library of its own (about 0.2 s, once): now, so that
        # the thread limits of the next op cover that library too (exactref/_threads.py).
        numba.njit(lambda: 0)()
    except Exception:  # noqa: BLE001 - an installed numba that fails to load is as good as none
        return False
    from . import _threads

    _threads.rescan()
    return True


# The compiled helpers that the loops call, set when first built.  A loop names them as globals of
# this module, not as variables of its factory's closure: numba's disk cache misses a function
# whose closure holds another compiled function, in every process, and then compiles it again
# (1.7 s for exactref/_fused_sums.py's loop) and adds one more entry to the cache.
_BITS: Any = None
_FROM_BITS: Any = None
_OUTWARD: Any = None
_ROUND_BITS: Any = None
_SLACKENED: Any = None
_FINISH: Any = None
_GAPS: Any = None
_TWO_PROD: Any = None


def _plain(*arrays: Any, dtype: Any = np.float64) -> bool:
    """Whether the loops take these arrays as they are: large enough to pay for the call, C-contiguous
    arrays of one shape and of ``dtype``, and numba present (tested last, so that an op whose
    arrays the loops would not take never imports numba)."""
    first = arrays[0]
    if type(first) is not np.ndarray or first.size < MIN_SIZE:
        return False
    return all(_laid_out(a, first.shape, dtype) for a in arrays) and available()


def _laid_out(a: Any, shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether ``a`` is a C-contiguous numpy array of this shape and dtype."""
    return type(a) is np.ndarray and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous


def _judge_constants() -> tuple[float, float, float]:
    """The judgement's slacks: ops._common's on the tolerance, rounding's below() and above()'s
    relative and absolute ones.  (Arguments, not constants of the loops: the machine code kept on
    disk is made again when this file changes, not when those modules do.)"""
    from .ops._common import _SLACK
    from .rounding import _ABS, _REL

    return _SLACK, _REL, _ABS


def _up_constants() -> tuple[float, float]:
    """engine.fast.up()'s factor and addend (arguments of the loops, as above)."""
    from .engine.fast import _UP_ABS, _UP_REL

    return _UP_REL, _UP_ABS


def usable(size: int) -> bool:
    """Whether an output block of ``size`` elements takes the loops (numba is present, and the block
    large enough)."""
    return size >= MIN_SIZE and available()


def _jit() -> Callable[[Callable[..., Any]], Any]:
    """numba's compiler as the loops use it: IEEE arithmetic (no fast-math: nothing reassociated or
    contracted into a fused multiply-add), the GIL released, bounds unchecked (every index is the
    loop's own), numpy's rules for division by zero, and the machine code cached on disk."""
    import numba

    return numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False, error_model="numpy")


@functools.lru_cache(maxsize=1)
def _outward() -> Callable[..., tuple[float, float]]:
    """A jitted ``(below(lo - w, w), above(hi + w, w))`` of exactref.rounding: the ends of an
    interval widened by w, each moved out by its slack ``(|end| + w) rel + absolute``."""
    @_jit()
    def outward(lo, hi, w, rel, absolute):
        low = lo - w
        high = hi + w
        return low - ((abs(low) + w) * rel + absolute), high + ((abs(high) + w) * rel + absolute)

    global _OUTWARD
    _OUTWARD = outward
    return outward


@functools.lru_cache(maxsize=1)
def _round_bits() -> Callable[..., tuple[float, bool]]:
    """A jitted exactref.rounding._round_bits_block of one value x: (x rounded to a format with p
    significant bits, whether x is outside the range where that holds).  ``f`` is the format's
    (53 - p, the bits of its smallest normal value, its largest finite value): see
    :func:`_bits_format`.  An element outside is left to the numpy code."""
    _bitcasts()  # (the helpers it calls: see _BITS)

    @_jit()
    def round_bits(x, f):
        d, normal_bits, max_finite = f
        b = _BITS(x)
        # Round to nearest, ties to even, by adding half a unit of the last kept bit less one, plus
        # that bit, and clearing the d bits below it (int64 arithmetic: the same bits as uint64's).
        r = _FROM_BITS((b + ((b >> d) & 1) + ((1 << (d - 1)) - 1)) & -(1 << d))
        mag = b & 0x7FFFFFFFFFFFFFFF
        # Outside: below the smallest normal value (not 0), where the quantum is the smallest
        # subnormal's; and a result past the largest finite value, which is where every value too
        # large for the trick, an infinity or a NaN ends (as inf or NaN).
        odd = ~((mag == 0) | (mag >= normal_bits)) | ~(abs(r) <= max_finite)
        return r, odd

    global _ROUND_BITS
    _ROUND_BITS = round_bits
    return round_bits


def _bits_format(fmt: Any) -> tuple[int, int, float]:
    """The constants of :func:`_round_bits` for ``fmt``."""
    return 53 - fmt.p, int(np.float64(fmt.min_normal).view(np.int64)), float(fmt.max_finite)


@functools.lru_cache(maxsize=1)
def _judge_loops() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int], Callable[..., None]]:
    """The loops of :func:`judge_into`: float32's, float64's and the narrower formats' (each returning
    how many elements another must redo), and float64's general one, for the elements its bit trick
    does not cover."""
    _bitcasts(), _outward(), _round_bits()  # (the helpers the loops call: see _BITS)
    inf = np.inf
    big = float(np.finfo(np.float64).max)
    jit = _jit()

    @jit
    def slackened(e, c):
        # ops._common._slackened: E where E <= 0, else fmin(E * _SLACK, inf) (NaN becomes inf).
        es = e * c[0]
        es = inf if es != es else es
        return e if e <= 0 else es

    @jit
    def finish(c, i, e, low, high, xl, xh, r, sp, lo, hi, tol):
        # The rest of result.judge: an exact answer where E is 0; the tolerance
        # np.maximum(x_hi - lo, hi - x_lo) (NaN if either is), with its slack where positive, else 0;
        # inf where the model marks an overflow (sp).  Only the three fields computed here: the
        # others are copies, made outside the loops (judge_into), so that the loops write three
        # arrays, few enough for the compiler to vectorise them (with the five other fields
        # written here too, float32's loop took 4.7 ns an element, against 0.65 and 0.44 for
        # the copies).
        exact = e == 0
        low = r if exact else low
        high = r if exact else high
        a = xh - low
        b = high - xl
        t = a if (a >= b) | (a != a) else b  # (b where b is NaN: a >= NaN is false)
        t = t + (t * c[1] + c[2]) if t > 0 else 0.0
        lo[i] = low
        hi[i] = high
        tol[i] = inf if sp else t

    global _SLACKENED, _FINISH
    _SLACKENED, _FINISH = slackened, finish

    @jit
    def float32(c, E, x_lo, x_hi, rounded, special, rare, lo, hi, tol):
        for i in range(E.size):
            e = _SLACKENED(E[i], c)
            xl = x_lo[i]
            xh = x_hi[i]
            # result._ends: below(x_lo - E, E) and above(x_hi + E, E), rounded to float32.
            la, ha = _OUTWARD(xl, xh, e, c[1], c[2])
            _FINISH(c, i, e, np.float64(np.float32(la)), np.float64(np.float32(ha)), xl, xh, rounded[i],
                    special[i], lo, hi, tol)
        return 0

    @jit
    def float64(c, E, x_lo, x_hi, rounded, special, rare, lo, hi, tol):
        count = 0
        for i in range(E.size):
            e = _SLACKENED(E[i], c)
            xl = x_lo[i]
            xh = x_hi[i]
            # next_down(x_lo - E) and next_up(x_hi + E) from the bits, as rounding._step does: -0 and +0
            # made the side's zero, then one unit toward -inf (or +inf).  Right for finite values.
            la = -(0.0 - (xl - e))
            ha = (xh + e) + 0.0
            bl = _BITS(la)
            bh = _BITS(ha)
            low = _FROM_BITS(bl - ((bl >> 63) | 1))
            high = _FROM_BITS(bh + ((bh >> 63) | 1))
            odd = (~(abs(la) <= big)) | (~(abs(ha) <= big))  # inf or NaN: the general loop's
            rare[i] = odd
            count += odd
            _FINISH(c, i, e, low, high, xl, xh, rounded[i], special[i], lo, hi, tol)
        return count

    @jit
    def half(c, f, E, x_lo, x_hi, rounded, special, rare, lo, hi, tol):
        # A narrower format (float16, bfloat16, float8_e5m2): the ends rounded by their bits; an
        # end outside the trick's range marks its element for the numpy code.
        count = 0
        for i in range(E.size):
            e = _SLACKENED(E[i], c)
            xl = x_lo[i]
            xh = x_hi[i]
            la, ha = _OUTWARD(xl, xh, e, c[1], c[2])
            low, odd_low = _ROUND_BITS(la, f)
            high, odd_high = _ROUND_BITS(ha, f)
            odd = odd_low | odd_high
            rare[i] = odd
            count += odd
            _FINISH(c, i, e, low, high, xl, xh, rounded[i], special[i], lo, hi, tol)
        return count

    @jit
    def general(c, E, x_lo, x_hi, rounded, special, rare, lo, hi, tol):
        for i in np.flatnonzero(rare):
            e = _SLACKENED(E[i], c)
            xl = x_lo[i]
            xh = x_hi[i]
            _FINISH(c, i, e, np.nextafter(xl - e, -inf), np.nextafter(xh + e, inf), xl, xh, rounded[i],
                    special[i], lo, hi, tol)

    return float32, float64, half, general


def judges(fmt: Any) -> bool:
    """Whether :func:`judge_into` judges outputs of ``fmt``: float32, whose rounding is numpy's cast,
    float64, and the narrower formats rounded by their bits (float16, bfloat16, float8_e5m2)."""
    return _rounds_by_cast(fmt) or _is_float64(fmt) or _rounds_by_bits(fmt)


def _rounds_by_cast(fmt: Any) -> bool:
    return (getattr(fmt, "dtype", None) == np.float32 and fmt.p == 24 and fmt.cast_rounds and fmt.has_inf
            and not fmt.saturates)


def _rounds_by_bits(fmt: Any) -> bool:
    """A format narrower than float32 with IEEE's rules (signed zeros, infinities, no saturation),
    which exactref.rounding rounds by its bits."""
    return (isinstance(getattr(fmt, "p", None), int) and 2 <= fmt.p < 24 and fmt.signed and fmt.has_negative_zero
            and fmt.has_inf and not fmt.saturates and fmt.nan_encoding == "ieee" and fmt.emax < 1000)


def _is_float64(fmt: Any) -> bool:
    return (getattr(fmt, "dtype", None) == np.float64 and fmt.p == 53 and fmt.emin == -1022 and fmt.has_inf
            and not fmt.saturates)


# The fields of a result's Part.
_FIELDS = ("lo", "hi", "tolerance", "rounded", "x_lo", "x_hi", "nan_ok", "special_ok")


def judge_into(fmt: Any, E: np.ndarray, x_lo: np.ndarray, x_hi: np.ndarray, rounded: np.ndarray,
               overflow: np.ndarray | None, out: dict[str, np.ndarray], place: Any) -> bool:
    """``exactref.result.judge(rounded, x_lo, x_hi, _slackened(E), fmt, overflow=overflow)``
    written into ``out[name][place]`` for every field of the Part, by one compiled loop; False
    (nothing written) where that loop does not apply: numba missing, a small block, or arrays
    that are not C-contiguous float64 of one shape (with ``overflow`` a bool array of it, or None).
    ``fmt`` is one that :func:`judges`."""
    shape = rounded.shape
    if not _plain(rounded, E, x_lo, x_hi):
        return False
    if overflow is not None and not _laid_out(overflow, shape, np.bool_):
        return False
    dst = {name: a[place] for name, a in out.items()}
    if any(a.shape != shape or not a.flags.c_contiguous for a in dst.values()):
        return False
    # The fields that are copies, first: the loops read the overflow marks from their copy.
    for name, src in (("rounded", rounded), ("x_lo", x_lo), ("x_hi", x_hi)):
        if dst[name].__array_interface__["data"][0] != src.__array_interface__["data"][0]:
            np.copyto(dst[name], src)  # (result._judge passes a Solution's own arrays as its Part's)
    dst["nan_ok"].fill(False)
    if overflow is None:
        dst["special_ok"].fill(False)
    else:
        np.copyto(dst["special_ok"], overflow)
    flat = [a.reshape(-1) for a in (E, x_lo, x_hi, rounded, dst["special_ok"])]
    outs = [dst[name].reshape(-1) for name in ("lo", "hi", "tolerance")]
    float32, float64, half, general = _judge_loops()
    rare = np.empty(rounded.size, dtype=bool)
    c = _judge_constants()
    if _is_float64(fmt):
        if float64(c, *flat, rare, *outs):
            general(c, *flat, rare, *outs)
    elif _rounds_by_cast(fmt):
        float32(c, *flat, rare, *outs)
    elif half(c, _bits_format(fmt), *flat, rare, *outs):
        # Ends past the format's range or among its subnormals: those elements by the numpy code.
        from .ops._common import _slackened
        from .result import judge

        idx = np.flatnonzero(rare)
        E_r, x_lo_r, x_hi_r, rounded_r, special_r = (a[idx] for a in flat)
        part = judge(rounded_r, x_lo_r, x_hi_r, _slackened(E_r), fmt,
                     overflow=special_r if overflow is not None else None)
        for name in _FIELDS:
            dst[name].reshape(-1)[idx] = getattr(part, name)
    return True


@functools.lru_cache(maxsize=1)
def _decide_narrow_loops() -> tuple[Callable[..., None], Callable[..., int]]:
    """The loops of :func:`decide_narrow`: float32's (numpy's cast) and the narrower formats' (by
    their bits, returning how many elements the numpy code must redo)."""
    _outward(), _round_bits()  # (the helpers the loops call: see _BITS)
    jit = _jit()

    @jit
    def float32(c, hi, rad, rounded, x_lo, x_hi, decided, rare):
        for i in range(hi.size):
            h = hi[i]
            # engine.decision.bounds_lo_zero: hi -+ rad, each moved out by its slack.
            low, high = _OUTWARD(h, h, rad[i], c[0], c[1])
            # engine.decision.decide_narrow: both ends cast to float32 alike (equal bits: equal
            # values, as -0 and +0 are only where the sign test fails), and of one sign.
            r_low = np.float32(low)
            r_high = np.float32(high)
            rounded[i] = np.float64(r_high)
            x_lo[i] = low
            x_hi[i] = high
            decided[i] = (r_low == r_high) & ((low > 0) | (high < 0))
        return 0

    @jit
    def half(c, f, hi, rad, rounded, x_lo, x_hi, decided, rare):
        count = 0
        for i in range(hi.size):
            h = hi[i]
            low, high = _OUTWARD(h, h, rad[i], c[0], c[1])
            r_low, odd_low = _ROUND_BITS(low, f)
            r_high, odd_high = _ROUND_BITS(high, f)
            odd = odd_low | odd_high
            rounded[i] = r_high
            x_lo[i] = low
            x_hi[i] = high
            decided[i] = (r_low == r_high) & ((low > 0) | (high < 0))
            rare[i] = odd
            count += odd
        return count

    return float32, half


def decides(fmt: Any) -> bool:
    """Whether :func:`decide_narrow` decides roundings to ``fmt``: float32 (numpy's cast rounds to it)
    and the narrower formats rounded by their bits (float16, bfloat16, float8_e5m2)."""
    return _rounds_by_cast(fmt) or _rounds_by_bits(fmt)


def decide_narrow(hi: np.ndarray, rad: np.ndarray, fmt: Any,
                  out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, ...] | None:
    """``engine.decision``'s rounding to ``fmt`` (one that :func:`decides`) of the values in
    ``hi +- rad`` (an enclosure whose lo is zero): the rounded values, float64 bounds x_lo and x_hi,
    and where decided, by one compiled loop; None where it does not apply (numba missing, a small
    or non-contiguous block).  ``out``: the arrays to write the first three into (see _outputs)."""
    if not _plain(hi, rad):
        return None
    outs = _outputs(hi.shape, out) + (np.empty(hi.shape, dtype=bool),)
    flat = [o.reshape(-1) for o in outs]
    rare = np.empty(hi.size, dtype=bool)
    float32, half = _decide_narrow_loops()
    c = _judge_constants()[1:]
    if _rounds_by_cast(fmt):
        float32(c, hi.reshape(-1), rad.reshape(-1), *flat, rare)
    elif half(c, _bits_format(fmt), hi.reshape(-1), rad.reshape(-1), *flat, rare):
        # Ends past the format's range or among its subnormals: rounded by the numpy code.
        from .engine.decision import decide_narrow

        idx = np.flatnonzero(rare)
        flat[0][idx], flat[3][idx] = decide_narrow(flat[1][idx], flat[2][idx], fmt)
    return outs


@functools.lru_cache(maxsize=1)
def _bitcasts() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Numba intrinsics: a float64's bits as an int64, and back (LLVM's bitcast, as numpy's view)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def bits(typingctx, x):  # noqa: ARG001 - numba's signature for intrinsics
        def codegen(context, builder, sig, args):  # noqa: ARG001
            return builder.bitcast(args[0], ir.IntType(64))
        return types.int64(types.float64), codegen

    @intrinsic
    def from_bits(typingctx, b):  # noqa: ARG001
        def codegen(context, builder, sig, args):  # noqa: ARG001
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(types.int64), codegen

    global _BITS, _FROM_BITS
    _BITS, _FROM_BITS = bits, from_bits
    return bits, from_bits


@functools.lru_cache(maxsize=1)
def _two_prod() -> Callable[..., tuple[float, float, bool]]:
    """A jitted engine.fast.two_prod of two float64 values: ``(p, e, safe)``, p = a b, and its error e
    by Dekker's steps (no fused multiply-add), 0 where it is not safe (a split that could
    overflow, an error that could fall below the normal range)."""
    from .engine.fast import _PRODUCT_MIN, _SPLIT_MAX, _SPLITTER

    splitter, split_max, product_min = float(_SPLITTER), float(_SPLIT_MAX), float(_PRODUCT_MIN)

    @_jit()
    def two_prod(a, b):
        p = a * b
        c = splitter * a
        ah = c - (c - a)
        al = a - ah
        c = splitter * b
        bh = c - (c - b)
        bl = b - bh
        e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
        safe = (abs(a) < split_max) & (abs(b) < split_max) & ((abs(p) >= product_min) | (a == 0.0) | (b == 0.0))
        return p, (e if safe else 0.0), safe

    global _TWO_PROD
    _TWO_PROD = two_prod
    return two_prod


@functools.lru_cache(maxsize=1)
def _gaps() -> Callable[..., tuple[float, ...]]:
    """A jitted step of engine.decision's decisions from hi + lo +- r, with s = hi + lo and its error
    e: s's float64 neighbours and the gaps to them, and e +- r each moved out by nextafter."""
    inf = np.inf

    @_jit()
    def gaps(s, e, r):
        s_up = np.nextafter(s, inf)
        s_down = np.nextafter(s, -inf)
        return s_up, s_down, s_up - s, s - s_down, np.nextafter(e + r, inf), np.nextafter(e - r, -inf)

    global _GAPS
    _GAPS = gaps
    return gaps


@functools.lru_cache(maxsize=1)
def _decide_float64_loop() -> Callable[..., None]:
    """The loop of :func:`decide_float64`: a vectorised pass for the common case, then the general
    code for the few elements outside it.  Its constants are facts of the float64 format (the
    exponent's bits, the neighbours of powers of two), fixed in the machine code."""
    from .engine import decision as dc

    _bitcasts(), _gaps()  # (the helpers the loop calls: see _BITS)
    inf = np.inf
    f64_max = float(np.finfo(np.float64).max)
    exp_bits, mant_bits, low_bits, high_bits = dc._EXP_BITS, dc._MANT_BITS, dc._COMMON_LOW, dc._COMMON_HIGH
    below_one, half_below, half_above, tiny = dc._BELOW, dc._HALF_BELOW, dc._HALF_ABOVE, dc._TINY

    @_jit()
    def common(hi, lo, rad, rounded, x_lo, x_hi, decided, rare):
        # engine.decision.decide_float64's common case, its operations in its order, without
        # branches (& on bools, selects), so that the loop is vectorised.  Returns how many
        # elements are rare (the general code's) or loose (decided, but the enclosure may hold a
        # float64), which general() completes.
        count = 0
        for i in range(hi.size):
            h = hi[i]
            lw = lo[i]
            r = rad[i]
            s = h + lw
            e = (h - s) + lw  # exact where |hi| >= |lo|, required below
            b = _BITS(s)
            ulp_b = b & exp_bits  # |s| rounded down to a power of two, for a normal s
            usual = (ulp_b >= low_bits) & (ulp_b <= high_bits) & ((b & mant_bits) != 0)
            usable = (abs(h) >= abs(lw)) & usual
            ulp = _FROM_BITS(ulp_b) * 2.0 ** -52
            w_hi = e + r
            w_lo = e - r
            t = ulp * below_one
            above = (w_lo > tiny) & (w_hi < t) & usable
            below = (w_hi < -tiny) & (w_lo > -t) & usable
            t = ulp * half_below
            to_s = (w_hi < t) & (w_lo > -t) & usable
            t = ulp * half_above
            to_up = (w_lo > t) & above
            to_down = (w_hi < -t) & below
            d = to_s | to_up | to_down
            rounded[i] = s + ulp if to_up else (s - ulp if to_down else s)
            step = ulp if above else 0.0
            x_lo[i] = s - (ulp - step)
            x_hi[i] = s + step
            decided[i] = d
            odd = (~usual) | (d & ~(above | below))
            rare[i] = odd
            count += odd
        return count

    @_jit()
    def general(hi, lo, rad, rounded, x_lo, x_hi, decided, rare):
        for i in np.flatnonzero(rare):
            h = hi[i]
            lw = lo[i]
            r = rad[i]
            s = h + lw
            e = (h - s) + lw
            b = _BITS(s)
            ulp_b = b & exp_bits
            if (ulp_b >= low_bits) & (ulp_b <= high_bits) & ((b & mant_bits) != 0):
                # Loose in the common case: the enclosure's own bounds, tight=True.
                x_lo[i] = np.nextafter(h + np.nextafter(lw - r, -inf), -inf)
                x_hi[i] = np.nextafter(h + np.nextafter(lw + r, inf), inf)
                continue
            # engine.decision.decide_float64_general, the definition, with nextafter.
            s_up, s_down, gap_up, gap_down, upper, lower = _GAPS(s, e, r)
            usable = (abs(h) >= abs(lw)) & (abs(s) < f64_max) & (abs(s) >= 2.0 ** -1021)
            above = usable & (lower > 0) & (upper < gap_up)
            below = usable & (upper < 0) & (lower > -gap_down)
            to_s = usable & (upper < gap_up / 2) & (lower > -gap_down / 2)
            to_up = above & (lower > gap_up / 2)
            to_down = below & (upper < -gap_down / 2)
            rounded[i] = s_up if to_up else (s_down if to_down else s)
            # A nonzero s: an enclosure touching zero is never decided (the sign of zero matters).
            d = (to_s | to_up | to_down) & (s != 0)
            decided[i] = d
            if d and not (above or below):
                x_lo[i] = np.nextafter(h + np.nextafter(lw - r, -inf), -inf)
                x_hi[i] = np.nextafter(h + np.nextafter(lw + r, inf), inf)
            else:
                x_lo[i] = s if above else s_down
                x_hi[i] = s_up if above else s

    def loop(hi, lo, rad, rounded, x_lo, x_hi, decided):
        rare = np.empty(hi.size, dtype=np.bool_)
        if common(hi, lo, rad, rounded, x_lo, x_hi, decided, rare):
            general(hi, lo, rad, rounded, x_lo, x_hi, decided, rare)

    return loop


def decide_float64(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray,
                   out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, ...] | None:
    """``engine.decision.decide_float64(hi, lo, rad)`` by one compiled loop: the same decisions, and
    the same values where decided; None where it does not apply (numba missing, a small block,
    arrays not C-contiguous float64 of one shape).  ``out``: as in :func:`decide_narrow`."""
    arrays = (hi, lo, rad)
    if not _plain(*arrays):
        return None
    outs = _outputs(hi.shape, out) + (np.empty(hi.shape, dtype=bool),)
    _decide_float64_loop()(*(a.reshape(-1) for a in arrays), *(o.reshape(-1) for o in outs))
    return outs


def _outputs(shape: tuple[int, ...], out: tuple[np.ndarray, ...] | None) -> tuple[np.ndarray, ...]:
    """The decisions' rounded values and bounds: ``out`` (three C-contiguous float64 arrays of
    ``shape``, a result's own, written in place), or three new arrays."""
    if out is None:
        return np.empty(shape), np.empty(shape), np.empty(shape)
    if not all(_laid_out(o, shape, np.float64) and o.flags.writeable for o in out):
        raise ValueError(f"_fused: out must be C-contiguous float64 arrays of shape {shape}")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _scaled_bound_loop() -> Callable[..., None]:
    @_jit()
    def loop(c, S, g, add, factor, limit, E, over):
        for i in range(S.size):
            s = S[i]
            # (Adding a zero changes at most -0 into +0, which up() makes the same.)
            E[i] = (g * s + add) * c[0] + c[1]
            over[i] = s * factor >= limit

    return loop


def scaled_bound(S: np.ndarray, g: float, add: float, factor: float,
                 limit: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``(up(g S + add), S * factor >= limit)`` elementwise, by one compiled loop: the bound of
    models._bounds.dot_error and the marks of overflow_possible; None where it does not apply
    (numba missing, a small or non-contiguous S)."""
    if not _plain(S):
        return None
    E, over = np.empty(S.shape), np.empty(S.shape, dtype=bool)
    _scaled_bound_loop()(_up_constants(), S.reshape(-1), float(g), float(add), float(factor), float(limit),
                         E.reshape(-1), over.reshape(-1))
    return E, over


@functools.lru_cache(maxsize=1)
def _widen_float32_loop() -> Callable[..., None]:
    @_jit()
    def loop(c, S32, scale, add, g, S, rad):
        for i in range(S32.size):
            s = (np.float64(S32[i]) * scale + add) * c[0] + c[1]
            S[i] = s
            rad[i] = (g * s) * c[0] + c[1]

    return loop


def widen_float32(S32: np.ndarray, scale: float, add: float, g: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``S = up(S32 * scale + add)`` in float64 (S32 a float32 product of |A| and |B|) and
    ``up(g * S)``, by one compiled loop: engine.products' bound on |A| @ |B| and a narrow
    product's radius; None where it does not apply (numba missing, a small or non-contiguous S32)."""
    if not _plain(S32, dtype=np.float32):
        return None
    S, rad = np.empty(S32.shape), np.empty(S32.shape)
    _widen_float32_loop()(_up_constants(), S32.reshape(-1), float(scale), float(add), float(g), S.reshape(-1),
                          rad.reshape(-1))
    return S, rad


@functools.lru_cache(maxsize=1)
def _read_float32_loop() -> Callable[..., tuple[int, int]]:
    big, small = np.float32(2.0 ** 60), np.float32(2.0 ** -60)

    @_jit()
    def loop(src, values, absolute):
        # Each value widened, and its magnitude in float32 (exact); the count of those not finite
        # (v - v is 0 for a finite v, NaN for inf and NaN), and of the magnitudes outside
        # engine.products._in_float32_range's [2**-60, 2**60] (a zero inside, a NaN outside).
        bad = 0
        outside = 0
        for i in range(src.size):
            v = src[i]
            w = np.float64(v)
            values[i] = w
            m = abs(v)
            absolute[i] = m
            bad += (w - w) != 0.0
            outside += not ((m <= big) & ((m >= small) | (m == 0)))
        return bad, outside

    return loop


def read_float32(src: np.ndarray) -> tuple[np.ndarray, bool, np.ndarray, bool] | None:
    """A float32 array's values in float64, whether every one is finite, their magnitudes in
    float32 (exact), and whether every nonzero magnitude lies in [2**-60, 2**60] (as
    engine.products._in_float32_range tests), in one pass by a compiled loop: a matmul operand's
    read (ops/matmul.py), whose magnitudes engine.products' bound on |A| |B| multiplies.  None
    where it does not apply (numba missing, a small or non-contiguous array).  (Widening,
    checking and taking |B| in float32 took 0.25 ms for a 512 x 512 B in several passes, 0.08 in
    this one; the range, 0.02 more on its own, and 0.05 to 0.1 in an op.)"""
    if not _plain(src, dtype=np.float32):
        return None
    values, absolute = np.empty(src.shape), np.empty(src.shape, dtype=np.float32)
    bad, outside = _read_float32_loop()(src.reshape(-1), values.reshape(-1), absolute.reshape(-1))
    return values, bad == 0, absolute, outside == 0


@functools.lru_cache(maxsize=1)
def _quick_cut_loop() -> Callable[..., int]:
    """The loop of :func:`quick_cut`."""
    inf = np.inf
    big = float(np.finfo(np.float64).max)

    @_jit()
    def loop(c, P0, P1, rest1, rest2, R0, S, lowA, lowB, hi, lo, rad):
        # engine.products.Right._sliced after its products, with one two-sum (the quick cut):
        # hi + e = P0 + P1 exactly; lo = e + rest; rad from the rank-one bound R0 and |lo|; an
        # element whose slices' unit underflows, or whose values are not finite, gets 0, 0, inf.
        # rest is rest1 (or +0 where that product was not made) plus rest2 where it was made.
        up_rel, up_abs, g, u, tail, has1, has2, has_s = c
        rows, cols = P0.shape
        bad = 0
        for i in range(rows):
            la = lowA[i]
            for j in range(cols):
                a = P0[i, j]
                b = P1[i, j]
                s = a + b  # engine.fast._two_sum_into
                bb = s - a
                e = (a - (s - bb)) + (b - bb)
                r = rest1[i, j] if has1 else 0.0
                if has2:
                    r = r + rest2[i, j]
                t = e + r
                R = (R0[i, j] * up_rel + up_abs) * up_rel + up_abs
                w = (R * g + abs(t) * u + tail) * up_rel + up_abs
                ok = ((la + lowB[j]) >= -1074 + 53) & (abs(s) <= big) & (abs(t) <= big)
                if has_s:
                    ok = ok & (abs(S[i, j]) <= big)
                ok = ok & (w < inf)
                hi[i, j] = s if ok else 0.0
                lo[i, j] = t if ok else 0.0
                rad[i, j] = w if ok else inf
                bad += ~ok
        return bad

    return loop


def quick_cut(P0: np.ndarray, P1: np.ndarray, rest1: np.ndarray | None, rest2: np.ndarray | None,
              R0: np.ndarray, S: np.ndarray | None, lowA: np.ndarray, lowB: np.ndarray, g: float, tail: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(hi, lo, rad) of engine.products.Right._sliced's quick cut from its products, by one compiled
    loop, the values of its numpy code: P0 = A0 B0 and P1 = A1 B0 (exact), rest1 = (A0 + A1) RB and
    rest2 = RA B (their float64 products, None where not made), R0 = cols @ rows (the rank-one
    bounds before their two roundings up), S the bound on |A| |B| (None where not made), lowA and
    lowB the slices' lowest unit exponents, ``g`` = gamma_(K+3) and ``tail`` = 3 K 2**-1074.  The
    products are matrices, or stacks of them (..., M, N) with lowA (..., M) and lowB (..., N), one
    call of the loop per matrix.  None where it does not apply (numba missing, a small block, or
    not C-contiguous float64 arrays)."""
    has1, has2, has_s = rest1 is not None, rest2 is not None, S is not None
    rest1, rest2, S = (r if r is not None else P0 for r in (rest1, rest2, S))  # (not read)
    lead = P0.shape[:-2]
    if not (_plain(P0, P1, rest1, rest2, R0, S) and P0.ndim >= 2 and lowA.shape == P0.shape[:-1]
            and lowB.shape == lead + P0.shape[-1:]):
        return None
    from .engine.fast import U64

    # Written over P0, P1 and R0, each element after the loop has read it: three arrays of the
    # block's size fewer (the products are the caller's own, made for this enclosure).
    hi, lo, rad = P0, P1, R0
    consts = (*_up_constants(), float(g), U64, float(tail), has1, has2, has_s)
    lowA, lowB = (np.ascontiguousarray(low, dtype=np.int64) for low in (lowA, lowB))
    loop = _quick_cut_loop()
    for i in np.ndindex(lead):
        loop(consts, P0[i], P1[i], rest1[i], rest2[i], R0[i], S[i], lowA[i], lowB[i], hi[i], lo[i], rad[i])
    return hi, lo, rad
