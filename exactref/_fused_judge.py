"""One compiled pass from a narrow product's BLAS products to its judged block (numba).

A float32 (or narrower) matmul's block, once its two BLAS products are made, went through four
compiled passes over memory, each writing arrays that the next read back: the bound S and the
radius widened from the float32 product of |A| and |B| (exactref/_fused.py's widen_float32), the
decisions from hi +- rad (its decide_narrow), the tolerance and its overflow marks from S (its
scaled_bound), and the judgement (its judge_into).  Where the tolerance is the bound for any
order alone (``up(g S + add)``, overflow where ``S factor >= limit``:
models._bounds.scaled_bound_constants), the four are one loop here: each element's S and radius
are widened, its rounding decided, its tolerance made and its judgement written while in
registers.  Only S, the decisions and the Part's fields are written; the radius, the tolerance
and its marks are never stored.  (A float32 512**3 matmul's block of 256 rows took 0.37 to
0.46 ms so, on one of 2 cores beside the other block, against 0.7 to 0.9 ms for the four.)

The steps are those of the four loops, in the same order and with the same helpers (their
IEEE arithmetic, without fast-math: see exactref/_fused.py), so every field is theirs bit for
bit.  An element the exact path then rounds (undecided), or whose bits the loops leave to the
numpy code (float16, bfloat16 or float8_e5m2 ends outside the bit trick's range), is marked as
not judged: its caller judges it again once its rounding is known (ops._common._solve_judged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _fused

__all__ = ["decide_and_judge"]

# The compiled helpers the loops call, set when they are first built: globals of this module, for
# numba's disk cache (see _fused._BITS).
_OUTWARD: Any = None
_ROUND_BITS: Any = None
_SLACKENED: Any = None
_FINISH: Any = None
_JUDGE: Any = None
_WIDENED: Any = None


@functools.lru_cache(maxsize=1)
def _loops() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int]]:
    """float32's loop (numpy's cast rounds to it), the narrower formats' (by their bits, returning
    how many elements the numpy code must redo), and the loop judging given elements again."""
    global _OUTWARD, _ROUND_BITS, _SLACKENED, _FINISH, _JUDGE, _WIDENED
    _OUTWARD, _ROUND_BITS = _fused._outward(), _fused._round_bits()
    _fused._judge_loops()  # (sets _fused's _SLACKENED and _FINISH)
    _SLACKENED, _FINISH = _fused._SLACKENED, _fused._FINISH
    jit = _fused._jit()

    @jit
    def judge(cj, cu, bound, f, i, S, low, high, r, lo, high_end, tol, special, nan):
        # Element i's tolerance and overflow mark, by _fused.scaled_bound's steps, then its
        # judgement by _fused.judge_into's float32 loop (f None) or its narrower formats' (f
        # their constants); returns whether its ends are left to the numpy code.
        g, add, factor, limit = bound
        s = S[i]
        e = _SLACKENED((g * s + add) * cu[0] + cu[1], cj)
        sp = s * factor >= limit
        special[i] = sp
        nan[i] = False
        la, ha = _OUTWARD(low, high, e, cj[1], cj[2])
        if f is None:
            odd = False
            end_low = np.float64(np.float32(la))
            end_high = np.float64(np.float32(ha))
        else:
            end_low, odd_low = _ROUND_BITS(la, f)
            end_high, odd_high = _ROUND_BITS(ha, f)
            odd = odd_low | odd_high
        _FINISH(cj, i, e, end_low, end_high, low, high, r, sp, lo, high_end, tol)
        return odd

    _JUDGE = judge

    @jit
    def widened(cu, w, P, S, i):
        # _fused.widen_float32's steps for element i: S (written) and the radius (returned).
        scale, add, g = w
        s = (np.float64(P[i]) * scale + add) * cu[0] + cu[1]
        S[i] = s
        return (g * s) * cu[0] + cu[1]

    _WIDENED = widened

    @jit
    def float32(cd, cj, cu, bound, w, hi, P, S, rounded, x_lo, x_hi, decided, lo, high_end, tol, special, nan):
        for i in range(hi.size):
            # _fused.widen_float32's steps, then decide_narrow's float32 loop, then the judgement.
            h = hi[i]
            low, high = _OUTWARD(h, h, _WIDENED(cu, w, P, S, i), cd[0], cd[1])
            r_low = np.float32(low)
            r_high = np.float32(high)
            r = np.float64(r_high)
            rounded[i] = r
            x_lo[i] = low
            x_hi[i] = high
            decided[i] = (r_low == r_high) & ((low > 0) | (high < 0))
            _JUDGE(cj, cu, bound, None, i, S, low, high, r, lo, high_end, tol, special, nan)
        return 0

    @jit
    def half(cd, cj, cu, bound, w, f, hi, P, S, rounded, x_lo, x_hi, decided, lo, high_end, tol, special, nan,
             rare):
        count = 0
        for i in range(hi.size):
            # The widening, decide_narrow's loop of the narrower formats, then the judgement.
            h = hi[i]
            low, high = _OUTWARD(h, h, _WIDENED(cu, w, P, S, i), cd[0], cd[1])
            r_low, odd_low = _ROUND_BITS(low, f)
            r_high, odd_high = _ROUND_BITS(high, f)
            rounded[i] = r_high
            x_lo[i] = low
            x_hi[i] = high
            decided[i] = (r_low == r_high) & ((low > 0) | (high < 0))
            odd = _JUDGE(cj, cu, bound, f, i, S, low, high, r_high, lo, high_end, tol, special, nan)
            odd = odd | odd_low | odd_high
            rare[i] = odd
            count += odd
        return count

    @jit
    def again(cj, cu, bound, f, idx, S, rounded, x_lo, x_hi, lo, high_end, tol, special, nan, rare):
        # The elements idx judged from their rounded values and bounds as they are now; rare[r]:
        # whether idx[r]'s ends are left to the numpy code.
        count = 0
        for r in range(idx.size):
            i = idx[r]
            odd = _JUDGE(cj, cu, bound, f, i, S, x_lo[i], x_hi[i], rounded[i], lo, high_end, tol, special, nan)
            rare[r] = odd
            count += odd
        return count

    return float32, half, again


_FLOAT_FIELDS = ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance")


def _fields(out: dict[str, np.ndarray], shape: tuple[int, ...]) -> list[np.ndarray] | None:
    """The Part's fields in ``out`` flattened, in _FLOAT_FIELDS's order, then the marks: None unless
    each is C-contiguous of ``shape``, float64 (bool for the marks)."""
    if not all(_fused._laid_out(out[name], shape, np.float64) for name in _FLOAT_FIELDS) or not all(
            _fused._laid_out(out[name], shape, np.bool_) for name in ("special_ok", "nan_ok")):
        return None
    return [out[name].reshape(-1) for name in _FLOAT_FIELDS + ("special_ok", "nan_ok")]


def _constants(bound: tuple[float, float, float, float]) -> tuple[tuple[float, ...], ...]:
    """The loops' first arguments: the decisions' slacks, the judgement's, up()'s, and ``bound``."""
    cj = _fused._judge_constants()
    return cj[1:], cj, _fused._up_constants(), tuple(float(b) for b in bound)


def decide_and_judge(fmt: Any, product: Any, bound: tuple[float, float, float, float], out: dict[str, np.ndarray],
                     *, small: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """From a narrow product's BLAS products (an engine.products.NarrowProduct whose P is float32):
    widen its bound S and radius as ``_fused.widen_float32`` does, decide the rounding to ``fmt``
    of the values in ``hi +- rad`` as ``_fused.decide_narrow`` does, and judge each element with
    the tolerance ``up(g S + add)`` and the overflow marks ``S factor >= limit`` (``bound = (g,
    add, factor, limit)``) as ``_fused.judge_into`` does, writing every field of the Part into
    ``out`` (the block's own views of the result's arrays, by field name).  Returns ``(decided,
    judged, S)``, of the block's shape: ``judged`` is False where the element must be judged again
    (not decided, or its bits left to the numpy code); there ``rounded``, ``x_lo`` and ``x_hi``
    are those the numpy code decides, but the other fields are not.  None (nothing written) where
    the loops do not apply: numba missing, a small block, arrays not C-contiguous of one shape
    (hi and the float64 fields float64, P float32, the marks' fields bool), or ``fmt`` one that
    :func:`_fused.decides` does not cover."""
    hi, P = product.hi, product.P
    laid_out = _fused._laid_out(hi, hi.shape, np.float64) and _fused.available() if small else _fused._plain(hi)
    if not _fused.decides(fmt) or not laid_out or not _fused._laid_out(P, hi.shape, np.float32):
        return None
    fields = _fields(out, hi.shape)
    if fields is None:
        return None
    decided, S = np.empty(hi.shape, dtype=bool), np.empty(hi.shape)
    # (rounded, x_lo, x_hi, decided, then the judgement's fields: the loops' order.)
    fields.insert(3, decided.reshape(-1))
    float32, half, _ = _loops()
    w = (float(product.widening[0]), float(product.widening[1]), float(product.g))
    flat = (hi.reshape(-1), P.reshape(-1), S.reshape(-1))
    if _fused._rounds_by_cast(fmt):
        float32(*_constants(bound), w, *flat, *fields)
        return decided, decided, S
    rare = np.empty(hi.size, dtype=bool)
    if half(*_constants(bound), w, _fused._bits_format(fmt), *flat, *fields, rare):
        # Bits outside the trick's range: those elements decided by the numpy code (as
        # _fused.decide_narrow does), and judged again by the caller.
        from .engine.decision import decide_narrow

        idx = np.flatnonzero(rare)
        fields[0][idx], fields[3][idx] = decide_narrow(fields[1][idx], fields[2][idx], fmt)
    return decided, decided & ~rare.reshape(hi.shape), S


def judge_again(fmt: Any, idx: np.ndarray, S: np.ndarray, bound: tuple[float, float, float, float],
                out: dict[str, np.ndarray]) -> np.ndarray:
    """Judge the elements ``idx`` (flat indices of the block) again from their rounded values and
    bounds in ``out`` as they are now, as :func:`decide_and_judge` judges; returns those whose bits
    are left to the numpy code (the caller judges them).  ``out`` must be what
    :func:`decide_and_judge` took, and ``S`` the bound it returned."""
    fields = _fields(out, S.shape)
    _, _, again = _loops()
    _, cj, cu, b = _constants(bound)
    f = _fused._bits_format(fmt) if not _fused._rounds_by_cast(fmt) else None
    idx = idx.astype(np.int64, copy=False)
    rare = np.empty(idx.size, dtype=bool)
    if again(cj, cu, b, f, idx, S.reshape(-1), *fields, rare):
        return idx[rare]
    return idx[:0]
