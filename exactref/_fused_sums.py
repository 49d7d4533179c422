"""Compiled loops for a long float32 sum's levels: engine.fast's group sums (numba).

The sums of a float32 block's groups of 64 values in float64, and of their absolute values in
float32 (as the numpy code's, engine.fast._first_level), and those sums' own sums in groups of
64, in float64, made in one pass over the block, which it copies as it reads (the op's own copy
of x: ops/reduction.py); for one row, the later levels in the same call (row_sums).  Unlike
exactref/_fused.py's loops, they do not make the numpy code's values: that code adds in the
BLAS's order, which no loop can repeat; they add in an order of their own (below), and their
sums lie within the same bound as any order's.  Like those loops: IEEE arithmetic without
fast-math, the GIL released, the machine code kept on disk, and the helpers they call named as
globals of this module (see _fused._BITS).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _fused

__all__ = ["GROUP", "LANES", "group_sums", "row_sums"]

# The compiled helpers the loop calls, set when it is first built (see _fused._BITS).
_SECOND_LEVEL: Any = None
_REFILL: Any = None
_LEVELS: Any = None
_LOOP: Any = None

# The groups of a float32 sum's first level (group_sums): GROUP values each, lying across LANES
# lanes: group j of a bunch of GROUP * LANES values takes its values j, j + LANES, j + 2 LANES, ...
# So the loop adds LANES contiguous values to LANES accumulators at a time, which the compiler
# vectorises.  Both are constants of the machine code (measured on one thread, 10**6 values:
# 16 lanes took 0.41 ms, not vectorised, 128 lanes 0.14; GROUP passed as an argument, 0.34).
GROUP = 64
LANES = 128


@functools.lru_cache(maxsize=1)
def _group_sums_loop() -> Callable[..., None]:
    lanes, width = LANES, GROUP

    @_fused._jit()
    def second(s, a, cols, f, fa, k):
        # The second level: the first cols sums of s (and of a), in groups of width, each added
        # one after another from 0.0, into f[k], f[k + 1], ... (and fa).
        for h in range((cols + width - 1) // width):
            t = 0.0
            t_abs = 0.0
            for j in range(h * width, min(cols, (h + 1) * width)):
                t += s[j]
                t_abs += a[j]
            f[k + h] = t
            fa[k + h] = t_abs

    global _SECOND_LEVEL
    _SECOND_LEVEL = second

    @_fused._jit()
    def refill(xr, b0, cols, n, a32, a):
        # The lanes' float32 sums of |x| into a, in float64; those not finite (a value inf or NaN,
        # or the sum overflowed) added again in float64, in the same order: float64 sums of
        # float32 values do not overflow.  (The conversion here, not in the loop's own body
        # beside this call: there the loop took 0.25 against 0.12-0.14 ms for 10**6 values.)
        for j in range(cols):
            a[j] = a32[j]
            if not a32[j] < np.inf:
                t = 0.0
                for i in range(width):
                    if i * cols + j < n:
                        t += abs(np.float64(xr[b0 + i * cols + j]))
                a[j] = t

    global _REFILL
    _REFILL = refill

    @_fused._jit()
    def loop(x, out, copy, r0, r1, c0, c1, first, first_abs):
        # Each group's values added in float64 one after another from 0.0 (the first addition
        # exact), and their absolute values in float32 (_REFILL: again in float64 where that is
        # not finite); then those sums, by second() (_SECOND_LEVEL), into first and first_abs;
        # x's rows r0..r1 and columns c0..c1 (c0 at a bunch's start) copied into out where
        # ``copy``, each value as it is read.
        bunch = width * lanes
        T = x.shape[1]
        end = min(c1, T)
        full = (end - c0) // bunch
        s, a = np.empty(lanes), np.empty(lanes)
        a32 = np.empty(lanes, np.float32)
        for r in range(r0, r1):
            xr, orow, f, fa = x[r], out[r], first[r], first_abs[r]
            for b in range(full):
                b0 = c0 + b * bunch
                s[:] = 0.0
                a32[:] = 0.0
                for i in range(width):
                    # (A view per row of lanes: indexing xr at b0 + i * lanes + j, which the
                    # compiler cannot prove nonnegative, kept the loop from vectorising, 0.35
                    # against 0.11 ms for 10**6 values.  The copy and |x| in float32, in this loop:
                    # 0.12-0.14 against 0.14-0.19 ms for the copy after each bunch and |x| in float64.)
                    xs = xr[b0 + i * lanes:b0 + (i + 1) * lanes]
                    if copy:
                        os = orow[b0 + i * lanes:b0 + (i + 1) * lanes]
                        for j in range(lanes):
                            v = xs[j]
                            os[j] = v
                            s[j] += np.float64(v)
                            a32[j] += abs(v)
                    else:
                        for j in range(lanes):
                            v = xs[j]
                            s[j] += np.float64(v)
                            a32[j] += abs(v)
                _REFILL(xr, b0, lanes, bunch, a32, a)
                _SECOND_LEVEL(s, a, lanes, f, fa, b0 // (width * width))
            b0 = c0 + full * bunch
            n = end - b0
            if n > 0:
                # The last, short bunch: its groups lie across cols lanes (as many values as a
                # full group, but for the last ones, past the row's end).
                cols = (n + width - 1) // width
                s[:] = 0.0
                a32[:] = 0.0
                for i in range(width):
                    for j in range(cols):
                        t = i * cols + j
                        if t < n:
                            v = xr[b0 + t]
                            s[j] += np.float64(v)
                            a32[j] += abs(v)
                if copy:
                    orow[b0:end] = xr[b0:end]
                _REFILL(xr, b0, cols, n, a32, a)
                _SECOND_LEVEL(s, a, cols, f, fa, b0 // (width * width))

    return loop


@functools.lru_cache(maxsize=1)
def _row_sums_loop() -> Callable[..., tuple[float, float, int]]:
    loop = _group_sums_loop()
    width = GROUP

    @_fused._jit()
    def levels(s, a):
        # The later levels of one row: the m sums of s (and of a) in groups of width values j,
        # j + k, j + 2k, ... (k = ceil(m / width)), each added one after another from its first
        # value, into s[j] (and a[j]), until one is left; returns it and how many levels it took.
        m = s.shape[0]
        made = 0
        while m > 1:
            k = (m + width - 1) // width
            for j in range(k):
                t = s[j]
                t_abs = a[j]
                for i in range(1, width):
                    if i * k + j < m:
                        t += s[i * k + j]
                        t_abs += a[i * k + j]
                s[j] = t
                a[j] = t_abs
            m = k
            made += 1
        return s[0], a[0], made

    global _LEVELS, _LOOP
    _LEVELS, _LOOP = levels, loop

    @_fused._jit()
    def row_sums(x, out, copy, first, first_abs):
        _LOOP(x, out, copy, 0, 1, 0, x.shape[1], first, first_abs)
        return _LEVELS(first[0], first_abs[0])

    return row_sums


def row_sums(row: np.ndarray, out: np.ndarray | None) -> tuple[float, float, int] | None:
    """engine.fast's sums of one float32 row (1-D), by one compiled call: group_sums' first two
    levels, then the later ones, each group of at most GROUP sums added one after another; and
    a copy of the row into ``out`` as it is read.  Returns ``(sum, sum of |x|, levels)``, or None
    where group_sums does not apply (or the row is not 1-D).  Each level errs by at most gamma_63
    of its absolute sum (the first level's sums of |x|: float32's, as group_sums says)."""
    if np.ndim(row) != 1 or not _fused._plain(*((row,) if out is None else (row, out)), dtype=np.float32):
        return None  # (group_sums' own test)
    m = -(-row.size // (GROUP * GROUP))
    first, first_abs = np.empty((1, m)), np.empty((1, m))
    # (See group_sums for the stand-in out.)
    dst = np.empty((1, 0), np.float32) if out is None else out[None, :]
    total, total_abs, made = _row_sums_loop()(row[None, :], dst, out is not None, first, first_abs)
    return total, total_abs, made + 2


def group_sums(block: np.ndarray, out: np.ndarray | None, width: int
               ) -> tuple[np.ndarray, np.ndarray, Callable[[int, int, int, int], None]] | None:
    """The first two levels of engine.fast's sums of a 2-D float32 block, by a compiled loop: each
    row's sums of groups of ``width`` values, in float64, and of their absolute values, in float32
    (again in float64 where that sum is inf or NaN), and those sums' own sums in groups of
    ``width``, in float64; and a copy of the block into ``out`` (of its shape) as it is read.
    Returns ``(second, second_abs, run)``, the second level's arrays: call
    ``run(r0, r1, c0, c1)`` for the blocks of rows and columns to fill, c0 a multiple of
    ``GROUP * LANES`` (each call writes only its own block's groups, and releases the GIL, so
    blocks run side by side).  None where it does not apply (numba missing, a small or
    non-contiguous block, not float32, or ``width`` other than GROUP).

    Each group sum, at either level, is made of at most ``width`` values added one after another
    from 0.0: at most ``width - 1`` roundings, so it errs by at most gamma_(width-1) of its
    absolute sum (engine.fast's bound for a level's group added in any order), in float64's unit
    roundoff; a first-level sum of absolute values within float32's (made in float32, or, where
    that is not finite, in float64).  Which values form a group differs from the numpy code's
    (see LANES): the sums are the same to within those bounds, not bit for bit."""
    arrays = (block,) if out is None else (block, out)
    if width != GROUP or np.ndim(block) != 2 or not _fused._plain(*arrays, dtype=np.float32):
        return None
    rows, T = block.shape
    m = -(-T // (width * width))
    first, first_abs = np.empty((rows, m)), np.empty((rows, m))
    loop = _group_sums_loop()
    copy = out is not None
    # (Not written where copy is False; a writable stand-in, since numba compiles a read-only
    # array as a type that cannot be written, even in a branch not taken.)
    dst = np.empty((rows, 0), np.float32) if out is None else out

    def run(r0: int, r1: int, c0: int, c1: int) -> None:
        loop(block, dst, copy, r0, r1, c0, c1, first, first_abs)
    return first, first_abs, run
