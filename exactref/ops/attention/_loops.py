"""Compiled loops for the first pass's logits, weights and dS (_first._Rows.logits and .weights,
_first._ds_rows), the tolerance models' weight bounds (_model._Weights), the backward
tolerance's shared bounds and their sums (_model._dS_bound_rows, _model._dS_bound_sums) and its
caps' test (_caps._dS_rows), by numba.

Why: _dS_bound_rows makes dozens of numpy passes over each block of the (heads, rows, keys)
arrays: dP and T with their bounds, the three row sums of D's error, and e_S and |dS| + e_dS.
At 1x8x1024x64 in float32 on 2 cores, grad_query's tolerance, which makes these bounds for all
three gradients, took 0.23 to 0.28 s of a 1.0 s backward, and 0.14 to 0.17 s with this loop.  The
loop makes each row's sums in one pass over it and the elementwise bounds in a second, while the
row is in cache.  The other loops replace numpy chains of the same kind, a dozen or more passes
over each block: with them and _rowsums' loop, a float32 1x8x1024x64 forward and backward took
1.53 s against 2.60 s without (medians of 8, in turn in one process, 2 cores).

Where a row needs what a loop leaves out (element-wise weight bounds, an exp bound's argument
above 1, NaN), the loop says so and the numpy code makes that block's values again.

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
from ..._parallel import for_each

__all__ = ["cap_rows", "dot2_rows", "ds_bound_rows", "ds_rows", "ds_sums", "logit_rows", "rho_rows",
           "weight_rows"]

_BLOCK_SUM: Any = None
_PAIRWISE: Any = None
_TWO_PROD: Any = None  # exactref/_fused.py's two_prod
# 2**e for e in [-1077, 1023], which the logits' loop scales its weights by.
_POW2 = np.ldexp(1.0, np.arange(-1077, 1024))
_POW2.flags.writeable = False


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


@functools.lru_cache(maxsize=1)
def _logits_loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(d_hi, d_lo, d_rad, unmasked, s, ds, c, inv_fact, table, pow2, Z, ez, w, M, full, eymax, rowmax):
        # _first._Rows.logits for rows without an additive mask, its numpy operations in order, row by
        # row: Z and ez, the row's maximum M, then Y = Z - M, ey, the weights by _first._exp_block
        # and the row's largest ey and |Z| + ez.
        U, TINY, up_rel, up_abs, inv_c, c_hi, c_lo = c
        abs_s = abs(s)
        rows, n = d_hi.shape
        for i in range(rows):
            m = -np.inf
            nan = False
            for j in range(n):
                d = d_hi[i, j] + d_lo[i, j]
                sD = s * d
                e = U * (abs(d) + abs(sD)) * abs_s + abs_s * d_rad[i, j] + ds * (abs(d) + d_rad[i, j]) \
                    + U * abs(sD)
                e = (e * (1 + 4 * U) + TINY) * up_rel + up_abs
                if unmasked[i, j]:
                    Z[i, j] = sD
                    ez[i, j] = e
                    if sD != sD:
                        nan = True
                    elif sD > m:
                        m = sD
                else:
                    Z[i, j] = -np.inf
                    ez[i, j] = 0.0
            # np.max: NaN wherever a value is.
            m = np.nan if nan else m
            f = m == -np.inf
            m = 0.0 if f else m
            M[i] = m
            full[i] = f
            for j in range(n):
                live = unmasked[i, j]
                y = Z[i, j] - m
                y = y if live else -np.inf
                # _exp_block: y = max(y, -746) (NaN kept), k = rint(y N / ln2), the reduction, Horner
                # (degree 6: logit_rows checks it).
                y = y if (y >= -746.0) | (y != y) else -746.0
                k = np.rint(y * inv_c)
                r = (y - k * c_hi) - k * c_lo
                p = (((((inv_fact[6] * r + inv_fact[5]) * r + inv_fact[4]) * r + inv_fact[3]) * r
                      + inv_fact[2]) * r + inv_fact[1]) * r + inv_fact[0]
                ki = np.int64(k)
                x = table[ki & 63] * p
                # x 2**e exact for e >= -1021, else (x 2**-1021) 2**(e + 1021) rounded once (as
                # _exp_block does), the powers read from pow2: e is in [-1077, 0] (y in [-746, 0]),
                # or anything for NaN, whose product is NaN whatever the power.
                e2 = min(max(ki >> 6, -1077), 1023)
                v = (x * pow2[max(e2, -1021) + 1077]) * pow2[min(e2 + 1021, 0) + 1077]
                w[i, j] = v if live else 0.0
            # The row's largest ey and |Z| + ez apart from the weights: with those maxima (and
            # np.max's NaN) in the weights' loop, and a call to ldexp for each weight, a block of 32
            # rows of 1024 keys (1x8x1024x64's) took 0.47 ms against 0.33 to 0.37 so (one thread).
            big = -np.inf
            top = -np.inf
            for j in range(n):
                live = unmasked[i, j]
                y = Z[i, j] - m
                ey = (ez[i, j] + U * (abs(y) if live else 0.0)) * up_rel + up_abs
                # (np.max's NaN: once seen, kept.)
                big = ey if ((ey > big) | (ey != ey)) and big == big else big
                a = abs(Z[i, j]) + ez[i, j] if live else 0.0
                top = a if ((a > top) | (a != a)) and top == top else top
            eymax[i] = big if n else 0.0
            rowmax[i] = top if n else 0.0

    return loop


def logit_rows(d_hi: np.ndarray, d_lo: np.ndarray, d_rad: np.ndarray, unmasked: np.ndarray, s: float, ds: float,
               out: tuple[np.ndarray, ...], consts: tuple, inv_fact: np.ndarray, table: np.ndarray
               ) -> tuple[np.ndarray, ...] | None:
    """_first._Rows.logits's Z, ez and w (into ``out``'s views) and each row's M, full, largest ey and
    largest |Z| + ez, by the loop; None where it does not apply (numba missing, a small block, arrays not
    laid out as (rows, keys) C-contiguous float64)."""
    if not (_fused._plain(d_hi, d_lo, d_rad, *out) and d_hi.ndim == 2
            and _fused._laid_out(unmasked, d_hi.shape, np.bool_) and np.shape(inv_fact) == (7,)):
        return None
    rows = d_hi.shape[0]
    M, eymax, rowmax = np.empty(rows), np.empty(rows), np.empty(rows)
    full = np.empty(rows, dtype=bool)
    with np.errstate(all="ignore"):
        _logits_loop()(d_hi, d_lo, d_rad, unmasked, float(s), float(ds), tuple(map(float, consts)), inv_fact,
                       table, _POW2, *out, M, full, eymax, rowmax)
    return M, full, eymax, rowmax


@functools.lru_cache(maxsize=1)
def _weights_loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(w, unmasked, Wd, pi, TINY, up_rel, up_abs, P, P_up, e_P):
        # _first._Rows.weights's elementwise part, its numpy operations in order: P = w / W, the
        # upper bound P_up = up((P + TINY) / (1 - pi)) and e_P = up(P_up pi + TINY), 0 where masked.
        rows, n = w.shape
        for i in range(rows):
            d, p_i = Wd[i], pi[i]
            q = 1 - p_i
            for j in range(n):
                x = w[i, j] / d
                P[i, j] = x
                if unmasked[i, j]:
                    up_ = ((x + TINY) / q) * up_rel + up_abs
                    P_up[i, j] = up_
                    e_P[i, j] = (up_ * p_i + TINY) * up_rel + up_abs
                else:
                    P_up[i, j] = 0.0
                    e_P[i, j] = 0.0

    return loop


def weight_rows(w: np.ndarray, unmasked: np.ndarray, Wd: np.ndarray, pi: np.ndarray, out: tuple[np.ndarray, ...],
                TINY: float, up_constants: tuple[float, float]) -> bool:
    """_first._Rows.weights's P, P_up and e_P into ``out``'s views, by the loop; False where it does not
    apply (numba missing, a small block, arrays not laid out as (rows, keys) C-contiguous float64)."""
    if not (_fused._plain(w, *out) and w.ndim == 2 and _fused._laid_out(unmasked, w.shape, np.bool_)
            and all(_fused._laid_out(a, w.shape[:1], np.float64) for a in (Wd, pi))):
        return False
    with np.errstate(all="ignore"):
        _weights_loop()(w, unmasked, Wd, pi, float(TINY), *map(float, up_constants), *out)
    return True


@functools.lru_cache(maxsize=1)
def _ds_loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(dP_hi, dP_lo, dP_rad, D, e_D, P, e_P, unmasked, U, TINY, up_rel, up_abs, dS, e_dS):
        # _first._ds_rows, its numpy operations in order: T = dP - D in double-double (two_sum) and
        # its bound e_T (_first.t_rows), dS = P T and e_dS, 0 where masked.
        rows, n = dP_hi.shape
        for i in range(rows):
            b = -D[i]
            e_Di = e_D[i]
            for j in range(n):
                hi = dP_hi[i, j]
                lo = dP_lo[i, j]
                s = hi + b
                bb = s - hi
                err = (hi - (s - bb)) + (b - bb)
                T = s + (err + lo)
                e_T = ((((dP_rad[i, j] + e_Di) + U * abs(T) * 2) + U * abs(lo)) + TINY) * up_rel + up_abs
                if unmasked[i, j]:
                    x = P[i, j] * T
                    dS[i, j] = x
                    e_dS[i, j] = ((e_P[i, j] * (abs(T) + e_T) + P[i, j] * e_T) + U * abs(x)) * up_rel + up_abs
                else:
                    dS[i, j] = 0.0
                    e_dS[i, j] = 0.0

    return loop


def ds_rows(dP_hi: np.ndarray, dP_lo: np.ndarray, dP_rad: np.ndarray, D: np.ndarray, e_D: np.ndarray, P: np.ndarray,
            e_P: np.ndarray, unmasked: np.ndarray, out: tuple[np.ndarray, np.ndarray], U: float, TINY: float,
            up_constants: tuple[float, float]) -> bool:
    """_first._ds_rows's dS and e_dS into ``out``'s views, by the loop; False where it does not apply
    (numba missing, a small block, arrays not laid out as (rows, keys) C-contiguous float64)."""
    if not (_fused._plain(dP_hi, dP_lo, dP_rad, P, e_P, *out) and dP_hi.ndim == 2
            and _fused._laid_out(unmasked, dP_hi.shape, np.bool_)
            and all(_fused._laid_out(a, dP_hi.shape[:1], np.float64) for a in (D, e_D))):
        return False
    with np.errstate(all="ignore"):
        _ds_loop()(dP_hi, dP_lo, dP_rad, D, e_D, P, e_P, unmasked, float(U), float(TINY), *map(float, up_constants),
                   *out)
    return True


@functools.lru_cache(maxsize=1)
def _dot2_loop() -> Callable[..., None]:
    global _TWO_PROD
    _TWO_PROD = _fused._two_prod()

    @_fused._jit()
    def loop(X, hi, lo, s_out, c_out, absum_out):
        # _first.dot_rows' sums, its numpy operations in order, one row at a time: Dekker's product
        # of X and hi (engine.fast.two_prod, its error 0 where unsafe), Knuth's two_sum into s, the
        # errors and X lo into c, and sum |X| (|hi| + |lo|).
        rows, n = X.shape
        for i in range(rows):
            s = 0.0
            c = 0.0
            absum = 0.0
            for j in range(n):
                a = X[i, j]
                b = hi[i, j]
                p, e, _ = _TWO_PROD(a, b)
                t = s + p
                z = t - s
                c = c + ((((s - (t - z)) + (p - z)) + e) + a * lo[i, j])
                s = t
                absum = absum + abs(a) * (abs(b) + abs(lo[i, j]))
            s_out[i] = s
            c_out[i] = c
            absum_out[i] = absum

    return loop


def dot2_rows(X: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """_first.dot_rows' s, c and sum |X| (|hi| + |lo|) over the last axis, by the loop; None where it
    does not apply (numba missing, small or not C-contiguous float64 arrays of one shape)."""
    if not (_fused._plain(X, hi, lo) and X.ndim >= 1):
        return None
    n = X.shape[-1]
    out = tuple(np.empty(X.shape[:-1]) for _ in range(3))
    with np.errstate(all="ignore"):
        _dot2_loop()(X.reshape(-1, n), hi.reshape(-1, n), lo.reshape(-1, n), *(o.reshape(-1) for o in out))
    return out


@functools.lru_cache(maxsize=1)
def _rho_loop() -> Callable[..., None]:
    _pairwise()  # (the helper the loop calls: see _fused._BITS)

    @_fused._jit()
    def loop(unmasked, Z, ez, A, P_up, M, l1q, l1k, rowmax, make, c, delta, h, r, rho, t, plan, stack, ok):
        # _model._Weights's _logit_block (where ``make``) and _weight_block, their numpy operations in
        # order, for rows without an additive mask or pre-scaled operands; expm1_up by its formula for
        # arguments up to 1 (a row with a larger one, or NaN, is marked in ``ok`` for the numpy code).
        (u, eta, g_logit, sigma, s, E, log_term, nb, kk, F, up_rel, up_abs) = c
        rows, n = Z.shape
        two_u = 2 * u
        lq = 2 * sigma * (1 + u)
        for i in range(rows):
            # (good & ..., not good and ...: the branch of a short-circuit kept both loops over the
            # row scalar, 0.29 against 0.13 ms for 32 rows of 1024 keys.)
            good = True
            if make:
                ezmax = -np.inf
                for j in range(n):
                    e = ez[i, j]
                    ezmax = e if ((e > ezmax) | (e != e)) and ezmax == ezmax else ezmax
                m = M[i]
                M_up = abs(m) + ezmax
                for j in range(n):
                    live = unmasked[i, j]
                    z = Z[i, j]
                    e = ez[i, j]
                    x_up = (abs(z) if live else 0.0) + e
                    shift = abs(z - m if live else 0.0) + e + ezmax
                    d = (g_logit * A[i, j] + two_u * (x_up + 0.0) + two_u * (M_up + shift + log_term + 1)
                         + eta * (lq * (l1q[i] + l1k[i, j]) + 4 * E) * (1 + s))
                    d = (d if live else 0.0) * up_rel + up_abs
                    delta[i, j] = d
                    good = good & (d <= 1.0)
                    t[j] = P_up[i, j] * ((d + d * d) * up_rel + up_abs)
                h[i] = _PAIRWISE(t, plan, stack)
            ri = (nb - 1) * (2 * (kk + 2) * u + 4 * u * rowmax[i]) if nb > 1 else 0.0
            r[i] = ri
            hi = h[i]
            for j in range(n):
                a = delta[i, j] + ri
                good = good & (a <= 1.0)
                x = ((1 + ((a + a * a) * up_rel + up_abs)) * F / (1 - hi) - 1) * up_rel + up_abs
                x = x if (hi < 0.5) & (abs(x) < np.inf) else np.inf
                rho[i, j] = x if unmasked[i, j] else 0.0
            ok[i] = good

    return loop


def rho_rows(unmasked: np.ndarray, Z: np.ndarray, ez: np.ndarray, A: np.ndarray, P_up: np.ndarray, M: np.ndarray,
             l1q: np.ndarray, l1k: np.ndarray, rowmax: np.ndarray, make: bool, consts: tuple,
             out: tuple[np.ndarray, ...]) -> bool:
    """_model._Weights's delta and h (where ``make``), r and rho of some rows into ``out``'s views (delta,
    h, r, rho), by the loop; False where it does not apply or a row needs the numpy code."""
    if not (_fused._plain(Z, ez, A, P_up, out[0], out[3]) and Z.ndim == 2 and Z.shape[1] > 0
            and _fused._laid_out(unmasked, Z.shape, np.bool_)
            and all(_fused._laid_out(a, Z.shape[:1], np.float64) for a in (M, l1q, rowmax, out[1], out[2]))
            and _fused._laid_out(l1k, Z.shape, np.float64)):
        return False
    n = Z.shape[1]
    ok = np.empty(Z.shape[0], dtype=bool)
    with np.errstate(all="ignore"):
        _rho_loop()(unmasked, Z, ez, A, P_up, M, l1q, l1k, rowmax, bool(make), tuple(map(float, consts)), *out,
                    np.empty(n), _plan(n), np.empty(64), ok)
    return bool(ok.all())


@functools.lru_cache(maxsize=1)
def _cap_loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(P_up, B, e, d, c1, g_hi, m, hi, second, ok):
        # _caps._dS_rows, its numpy operations in order, a row at a time: the row's largest B, then
        # each key's three conditions; the row is ok where all hold.  (np.max's NaN is not kept: a
        # NaN in B fails its own key's first condition, and so its row, whatever the largest B.)
        rows, n = B.shape
        for i in range(rows):
            Bmax = 0.0
            for j in range(n):
                b = B[i, j]
                Bmax = b if b > Bmax else Bmax
            good = True
            for j in range(n):
                p = P_up[i, j]
                pm = p if (p < 1.0) | (p != p) else 1.0  # np.minimum(P_up, 1.0): NaN kept
                b = B[i, j]
                below = c1 * pm * b
                ei = e[i, j]
                di = d[i, j]
                de = di + ei
                t = ((ei + g_hi * de) * hi <= below) & (di <= pm * (b + Bmax))
                if second:
                    t = t & ((ei + m * de) * hi <= below)
                good = good & t
            ok[i] = good

    return loop


def cap_rows(P_up: np.ndarray, B: np.ndarray, e: np.ndarray, d: np.ndarray,
             consts: tuple[float, float, float, float, float]) -> np.ndarray | None:
    """_caps._dS_rows's answer per row (its three conditions on every key), by the loop; None where it
    does not apply (numba missing, a small block, arrays not (rows, keys) C-contiguous float64)."""
    if not (_fused._plain(P_up, B, e, d) and B.ndim == 2):
        return None
    g_lo, g_hi, m, lo, hi = consts
    ok = np.empty(B.shape[0], dtype=bool)
    with np.errstate(all="ignore"):
        _cap_loop()(P_up, B, e, d, float((1 + g_lo) * lo), float(g_hi), float(m), float(hi), bool(m > g_lo), ok)
    return ok


@functools.lru_cache(maxsize=1)
def _sums_loop() -> Callable[..., None]:
    _pairwise()  # (the helper the loop calls: see _fused._BITS)

    @_fused._jit()
    def loop(a, b, rows_out, cols_out, t, plan, stack):
        # _model._dS_bound_sums for one head: X = a + b a row at a time, its sum by numpy's pairwise
        # order (np.sum over the last axis), and its values added to the columns' sums one row after
        # another, the first row copied (np.sum over the rows adds them so, in turn).
        L, S = a.shape
        for i in range(L):
            for j in range(S):
                t[j] = a[i, j] + b[i, j]
            rows_out[i] = _PAIRWISE(t, plan, stack)
            if i == 0:
                for j in range(S):
                    cols_out[j] = t[j]
            else:
                for j in range(S):
                    cols_out[j] = cols_out[j] + t[j]

    return loop


def ds_sums(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.sum(a + b, axis=-1)`` and ``np.sum(a + b, axis=-2)`` of (heads, rows, keys) arrays, by the
    loop, each head on its own (heads side by side), without the sum's array; None where it does
    not apply (numba missing, small or not C-contiguous float64 arrays of one 3-D shape, no row, or
    one key: numpy then sums the rows of each head by its pairwise order, their values being
    contiguous)."""
    if not (_fused._plain(a, b) and a.ndim == 3 and a.shape[1] > 0 and a.shape[2] > 1):
        return None
    H, L, S = a.shape
    rows, cols = np.empty((H, L)), np.empty((H, S))
    loop, plan = _sums_loop(), _plan(S)

    def head(h: int) -> None:
        loop(a[h], b[h], rows[h], cols[h], np.empty(S), plan, np.empty(64))
    with np.errstate(all="ignore"):
        for_each(head, H)
    return rows, cols
