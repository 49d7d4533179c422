"""A compiled loop for the backward tolerance's shared bounds (_model._dS_bound_rows), by numba.

Why: _dS_bound_rows makes dozens of numpy passes over each block of the (heads, rows, keys)
arrays: dP and T with their bounds, the three row sums of D's error, and e_S and |dS| + e_dS.
At 1x8x1024x64 in float32 on 2 cores, grad_query's tolerance, which makes these bounds for all
three gradients, took 0.23 to 0.28 s of a 1.0 s backward, and 0.14 to 0.17 s with this loop.  The
loop makes each row's sums in one pass over it and the elementwise bounds in a second, while the
row is in cache.

The values are the numpy code's, bit for bit: the same float64 operations in the same order
(numba without fast-math: nothing reassociated or fused into a multiply-add), np.maximum's NaN,
and the row sums in numpy's own pairwise order for a contiguous row (eight accumulators over
blocks of at most 128 terms, halved above that), which tests/exactref/test_attention_loops.py
compares with np.sum.  Like exactref/_fused.py's loops: the GIL released, the machine code kept
on disk, and the helpers named as globals of this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _fused

__all__ = ["ds_bound_rows"]

_BLOCK_SUM: Any = None
_PAIRWISE: Any = None


@functools.lru_cache(maxsize=64)
def _plan(n: int) -> np.ndarray:
    """numpy's pairwise sum (pairwise_sum in numpy's loops_utils) of n terms as a program without
    recursion (numba's disk cache fails on a recursive function): rows (start, length) sum a
    block of at most 128 terms onto a stack, rows (-1, 0) add the top two."""
    ops: list[tuple[int, int]] = []

    def walk(lo: int, m: int) -> None:
        if m <= 128:
            ops.append((lo, m))
            return
        half = m // 2
        half -= half % 8
        walk(lo, half)
        walk(lo + half, m - half)
        ops.append((-1, 0))
    walk(0, n)
    return np.array(ops, dtype=np.int64)


@functools.lru_cache(maxsize=1)
def _pairwise() -> Callable[..., float]:
    """numpy's pairwise sum of a contiguous row x, by its :func:`_plan` (``stack`` is scratch)."""
    jit = _fused._jit()

    @jit
    def block_sum(x, lo, n):
        # Fewer than 8 terms one after another; up to 128 in eight accumulators, then the rest.
        if n < 8:
            res = -0.0
            for i in range(n):
                res += x[lo + i]
            return res
        r0, r1, r2, r3 = x[lo], x[lo + 1], x[lo + 2], x[lo + 3]
        r4, r5, r6, r7 = x[lo + 4], x[lo + 5], x[lo + 6], x[lo + 7]
        m = n - n % 8
        i = 8
        while i < m:
            r0 += x[lo + i]
            r1 += x[lo + i + 1]
            r2 += x[lo + i + 2]
            r3 += x[lo + i + 3]
            r4 += x[lo + i + 4]
            r5 += x[lo + i + 5]
            r6 += x[lo + i + 6]
            r7 += x[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += x[lo + i]
            i += 1
        return res

    global _BLOCK_SUM, _PAIRWISE
    _BLOCK_SUM = block_sum

    @jit
    def pairwise(x, plan, stack):
        top = 0
        for k in range(plan.shape[0]):
            if plan[k, 0] >= 0:
                stack[top] = _BLOCK_SUM(x, plan[k, 0], plan[k, 1])
                top += 1
            else:
                top -= 1
                stack[top - 1] = stack[top - 1] + stack[top]
        # numpy's reduction adds the sum to its identity, +0: a sum of negative zeros is +0.
        return 0.0 + stack[0]

    _PAIRWISE = pairwise
    return pairwise


@functools.lru_cache(maxsize=1)
def _loop() -> Callable[..., None]:
    _pairwise()  # (the helper the loop calls: see _fused._BITS)

    @_fused._jit()
    def loop(B, dP_hi, dP_lo, dP_rad, D, e_D1, P_up, rho, unmasked, dS, e_dS, e_Db, c, ds_rounded,
             out_eS, out_dS_up, t1, t2, t3, plan, stack):
        u_, eta, g_dP, dP_eta, gS, S_eta, u_o, eta_o, U, TINY, slack, up_rel, up_abs, eta_gS, grow_c = c
        rows, n = B.shape
        for i in range(rows):
            D_i = D[i]
            # The three sums of e_Da over the row (_dS_bound_rows), their terms first.
            for j in range(n):
                hi = dP_hi[i, j]
                dP = hi + dP_lo[i, j]
                e_dP = (dP_rad[i, j] + U * abs(dP)) * up_rel + up_abs
                e_dPm = g_dP * B[i, j] + dP_eta
                dP_up = abs(dP) + e_dP
                r = rho[i, j]
                p = P_up[i, j]
                t1[j] = p * (r * dP_up + (1 + r) * e_dPm)
                t2[j] = p * (1 + r) * (dP_up + e_dPm)
                t3[j] = dP_up + e_dPm if unmasked[i, j] else 0.0
            e_Da = _PAIRWISE(t1, plan, stack) + gS * _PAIRWISE(t2, plan, stack) + S_eta \
                + eta_gS * _PAIRWISE(t3, plan, stack)
            e_b = e_Db[i]
            big = e_Da if (e_Da >= e_b) | (e_Da != e_Da) else e_b  # np.maximum: NaN if either is
            e_D = (big * slack) * up_rel + up_abs
            for j in range(n):
                hi = dP_hi[i, j]
                lo = dP_lo[i, j]
                rad = dP_rad[i, j]
                dP = hi + lo
                e_dP = (rad + U * abs(dP)) * up_rel + up_abs
                e_dPm = g_dP * B[i, j] + dP_eta
                # t_rows: T = dP - D in double-double (fast.two_sum), and its bound.
                b = -D_i
                s = hi + b
                bb = s - hi
                err = (hi - (s - bb)) + (b - bb)
                T = s + (err + lo)
                e_T = (rad + e_D1[i] + U * abs(T) * 2 + U * abs(lo) + TINY) * up_rel + up_abs
                t_up = abs(T) + e_T
                grow = (1 + rho[i, j]) * grow_c
                e_S = P_up[i, j] * ((grow - 1) * t_up + grow * (e_dPm + e_D)) \
                    + eta * (1 + grow * (t_up + e_dPm + e_D))
                dS_up = abs(dS[i, j]) + e_dS[i, j]
                if ds_rounded:
                    e_S = e_S + u_o * (dS_up + e_S) + eta_o
                e_S = e_S if unmasked[i, j] else 0.0
                out_eS[i, j] = e_S * up_rel + up_abs
                out_dS_up[i, j] = dS_up

    return loop


def ds_bound_rows(B: np.ndarray, dP_hi: np.ndarray, dP_lo: np.ndarray, dP_rad: np.ndarray, D: np.ndarray,
                  e_D1: np.ndarray, P_up: np.ndarray, rho: np.ndarray, unmasked: np.ndarray, dS: np.ndarray,
                  e_dS: np.ndarray, e_Db: np.ndarray, consts: tuple, *, U: float, TINY: float, slack: float,
                  up_constants: tuple[float, float]) -> tuple[np.ndarray, np.ndarray] | None:
    """_model._dS_bound_rows's (e_S, |dS| + e_dS), by the loop; None where it does not apply (numba
    missing, a small block, arrays not laid out as (rows, keys) C-contiguous float64)."""
    if not (_fused._plain(B, dP_hi, dP_lo, dP_rad, P_up, rho, dS, e_dS) and B.ndim == 2
            and _fused._laid_out(unmasked, B.shape, np.bool_)
            and all(_fused._laid_out(a, B.shape[:1], np.float64) for a in (D, e_D1, e_Db))):
        return None
    u, eta, g_dP, dP_eta, gS, S_eta, u_o, eta_o, ds_rounded = consts
    c = (u, eta, g_dP, dP_eta, gS, S_eta, u_o, eta_o, U, TINY, slack, *up_constants, eta * (1 + gS), (1 + u) ** 2)
    n = B.shape[1]
    out = (np.empty(B.shape), np.empty(B.shape))
    with np.errstate(all="ignore"):
        _loop()(B, dP_hi, dP_lo, dP_rad, D, e_D1, P_up, rho, unmasked, dS, e_dS, e_Db, tuple(map(float, c)),
                bool(ds_rounded), *out, np.empty(n), np.empty(n), np.empty(n), _plan(n), np.empty(64))
    return out
