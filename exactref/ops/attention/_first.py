"""Attention's first pass: float64 values with rigorous error bounds, vectorised over heads.

Every quantity X of the exact computation is computed as a float64 array X~
together with a bound ``e_X`` with ``|X~ - X| <= e_X``.  An output element
is decided when its whole enclosure rounds to one value of the output
format (:func:`exactref.rounding.decide`); the rest go to the certified
refinement.  The bounds use u = 2**-53 and Higham's gamma_n = n u / (1 - n u)
for a float64 sum of n terms in any order, and:

* products of float32 (or narrower) inputs are exact in float64, so a float64
  matmul of them errs only in its additions; float64 inputs add one rounding
  per product, which gamma_n with n = terms + 1 covers;
* numpy's exp and expm1 are within ``EXP_REL`` (2**-40) of the exact value,
  relatively: libm's are within a few ulps (2**-51), and the test suite
  checks numpy's against Arb;
* an underflow in a float64 product or exp costs at most 2**-1074 in
  absolute value; every such cost here is below ``TINY`` (2**-1000) times a
  count far below 2**70, and ``TINY`` is added where it matters.

The shift ``M`` subtracted before exp is the largest float64 logit of the row,
an exact float, so ``exp(x - M) / sum exp(x - M)`` is exactly the softmax
whatever M's error.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mpmath
import numpy as np

from ... import _fused
from ..._parallel import for_each, for_each_slice
from ..._pool import empty
from ...engine.fast import gamma, two_prod, two_sum, up
from ...engine.products import matmul_sliced, rows_per_block
from . import _factors, _loops
from ._problem import Problem

__all__ = ["FirstPass"]

U = 2.0 ** -53
EXP_REL = 2.0 ** -40
TINY = 2.0 ** -1000


def ratio_error(*rels: np.ndarray | float) -> np.ndarray:
    """An upper bound on prod(1 + r) / prod(1 - r) - 1 for nonnegative relative errors r, sum < 1.

    prod(1 + r) <= e**t and prod(1 - r) >= 1 - t for t = sum r, so the ratio
    minus 1 is at most (expm1(t) + t) / (1 - t).  Written out as products of
    (1 + r) in float64, every r below 2**-53 would vanish.
    """
    t = up(sum(np.asarray(r, dtype=np.float64) for r in rels))
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = up((up(np.expm1(t)) + t) / (1 - t))
    return np.where(t < 1, bound, np.inf)


def g(n: int) -> float:
    """gamma_n for float64, rounded up."""
    return float(gamma(max(n, 0), U))


# y = (N m + j) ln2 / N + r with |r| <= ln2 / (2N): a table of 2**(j/N), correctly rounded, and a
# short Taylor polynomial.  ln2 / N = _C_HI + _C_LO + t with |t| <= _C_TAIL; _C_HI has 36 significant
# bits, so k * _C_HI is exact for |k| < 2**17 (|k| <= 746 N / ln 2 + 1 < 68900 here).
_N = 64
with mpmath.workprec(256):
    _C = mpmath.log(2) / _N
    _C_HI = float(mpmath.floor(_C * 2 ** 42)) / 2 ** 42  # 2**-42 units, below 2**-6: 36 bits
    _C_LO = float(_C - _C_HI)
    _C_TAIL = float(abs(_C - _C_HI - _C_LO)) * 2
    _TABLE = np.array([float(mpmath.mpf(2) ** (mpmath.mpf(j) / _N)) for j in range(_N)])
_DEGREE = 6
_INV_FACT = [1.0 / math.factorial(n) for n in range(_DEGREE + 1)]
# rint(y N / ln2) in float64 errs from the exact nearest integer by at most 2**-50 |y N / ln2|.
_R_MAX = math.log(2) / (2 * _N) * (1 + 2.0 ** -40) + 746 * 2.0 ** -49


def _exp_error_bound() -> float:
    """The relative error bound of :func:`_exp_block`, one number for every y in [-746, 0].

    Each term is the largest, over |r| <= the reduction's bound, of a term of
    the bound the block could compute element by element (the reduction's
    error, Higham's running error bound for Horner's rule, the coefficients'
    rounding, the Taylor remainder): every one grows with |r|, and |r| is at
    most ln2/128 and a little.  On [-700, 0] the element-by-element bound
    ran from 5.02 to 5.07 u and this one is 5.09 u; the block makes about a
    third of the numpy calls it made (docs/attention.md, "How the exact value
    is found").
    """
    k_max = 746 * _N / math.log(2) + 1  # |k|
    t_max = k_max * abs(_C_LO) * (1 + 2 * U)  # |t| = |fl(k _C_LO)|
    r_c = _R_MAX + 2.0 ** -40  # |r| as computed: the exact one's bound and its error (below 2**-60)
    e_c = math.exp(r_c) * (1 + 2.0 ** -40)  # >= e**|r|
    r1 = r_c * (1 + 2 * U) + t_max  # |r1|, from r = fl(r1 - t)
    # |r~ - r| for the exact reduced argument r = y - k ln2/N: three roundings and _C_TAIL per unit of k.
    err_r = U * (r1 + t_max + r_c) * (1 + 2 * U) + k_max * _C_TAIL
    # Horner's p_i, as computed, is at most sum_{j>=i} |r|**(j-i) / j! (and a few u), so the running
    # bound mu_i = |r| mu_(i+1) + |p_i| (mu_6 = |p_6| / 2) is at most its value at |r| = r_c.
    p_max = [sum(_INV_FACT[j] * r_c ** (j - i) for j in range(i, _DEGREE + 1)) * (1 + 2.0 ** -40)
             for i in range(_DEGREE + 1)]
    mu = p_max[_DEGREE] / 2
    for i in reversed(range(_DEGREE)):
        mu = r_c * mu + p_max[i]
    p_low = math.exp(-r_c) * (1 - 2.0 ** -40)  # <= p, the computed e**r
    trunc = r_c ** (_DEGREE + 1) / math.factorial(_DEGREE + 1) * e_c  # Taylor's remainder, about 2**-65
    # u (2 mu - |p|) for Horner's roundings (1.01: its second-order terms); 2 u e**|r| for the
    # coefficients 1/n!, rounded; twice the remainder; e**|r| |r~ - r| for the reduction, twice.
    absolute = U * (2 * mu - p_low) * 1.01 + U * 2 * e_c + trunc * 2 + 2 * e_c * err_r * 1.01
    rel_p = absolute / (p_low * (1 - 4 * U))
    # (1 + rel_p)(1 + u)**2 - 1 for the table entry and the product, rel_p + 2u being below 2**-40.
    return float(up((rel_p + 2 * U) * (1 + 2.0 ** -40)))


EXP_BLOCK_REL = _exp_error_bound()
# The compiled logits loop's constants (exactref/ops/attention/_loops.py): u, TINY, up()'s two, N / ln2 and
# the parts of ln2 / N; and the Taylor coefficients as an array.
_LOGIT_CONSTANTS = (U, TINY, *_fused._up_constants(), _N / math.log(2), _C_HI, _C_LO)
_INV_FACT_ARRAY = np.array(_INV_FACT)


_BLOCK = 1 << 15  # elements per block of exp_bounded: its temporaries stay in the cache


def exp_bounded(y: np.ndarray) -> tuple[np.ndarray, float]:
    """exp(y) for float64 y <= 0 (or -inf), and a bound on its relative error; see :func:`_exp_block`."""
    y = np.asarray(y, dtype=np.float64)
    flat = y.reshape(-1)
    w = empty(flat.shape, np.float64)

    def block(cut: slice) -> None:
        w[cut], _ = _exp_block(flat[cut])
    for_each_slice(block, flat.size, _BLOCK)
    return w.reshape(y.shape), EXP_BLOCK_REL


def _exp_block(y: np.ndarray) -> tuple[np.ndarray, float]:
    """exp(y) for float64 y <= 0 (or -inf), and a bound on its relative error, not trusting libm.

    y = k ln2/N + r with |r| <= ln2/(2N), N = 64 (Cody and Waite's two-part
    ln2/N), then a degree-6 Taylor polynomial for e**r by Horner's rule,
    times the table entry 2**(j/N) (j = k mod N, rounded to nearest: one
    more u) with one more rounding, scaled by 2**floor(k/N).  The bound,
    ``EXP_BLOCK_REL`` (:func:`_exp_error_bound`), adds the reduction's error,
    Horner's roundings (Higham, Accuracy and Stability, Algorithm 5.1), the
    rounding of the coefficients 1/n! and the Taylor remainder, each at its
    largest over the range of r; a result below float64's normal range may
    also be off by 2**-1074 in absolute value, which the callers' TINY covers.
    """
    y = np.maximum(y, -746.0)
    k = np.rint(y * (_N / math.log(2)))
    r = (y - k * _C_HI) - k * _C_LO
    p = np.full_like(r, _INV_FACT[_DEGREE])
    for c in reversed(_INV_FACT[:_DEGREE]):
        p = p * r + c
    ki = k.astype(np.int64)
    x = _TABLE[ki & (_N - 1)] * p  # in [0.99, 2.02)
    m = ki >> 6
    if m.min(initial=0) >= -1021:
        # x 2**m is exact: the product by a power of two (its bits written directly) is
        # np.ldexp(x, m), at a fraction of ldexp's cost.
        return x * _pow2(m), EXP_BLOCK_REL
    # Below: x 2**m1 is exact (normal, as x >= 0.99) and the product by 2**(m - m1) rounds once,
    # as ldexp does (m >= -1077, so m - m1 >= -56).
    m1 = np.maximum(m, -1021)
    return (x * _pow2(m1)) * _pow2(m - m1), EXP_BLOCK_REL


def _pow2(m: np.ndarray) -> np.ndarray:
    """2.0**m for int64 m in [-1022, 1023], from its bits."""
    return ((m + 1023) << 52).view(np.float64)


def expm1_up(a: np.ndarray) -> np.ndarray:
    """An upper bound on exp(a) - 1 for a >= 0 (inf where a is inf or huge)."""
    # For 0 <= a <= 1 the tail sum_{k>=2} a**k / k! is at most (e - 2) a**2 < a**2.
    with np.errstate(over="ignore", invalid="ignore"):
        small = up(a + a * a)
        if np.ndim(a) and a.size and np.max(a) <= 1:  # the usual case: no expm1 over the whole array
            return small
        large = up(np.expm1(np.minimum(a, 1e3)) * (1 + 2 * EXP_REL))
        return np.where(a <= 1, small, np.where(a < 700, large, np.inf))


def _sum_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sums of the nonnegative w over the last axis, and a bound on their relative error.

    By pairs of halves: each step adds the first half of every row to its second, so a term
    passes through at most ceil(log2 n) additions and the error is at most gamma_levels of the
    sum (10 u for 1024 terms).  Each step reads contiguous halves, which numpy adds with SIMD:
    at 1x8x1024x64 float32 the row sums took about 10 ms against 60 for a compensated Sum2
    (Ogita, Rump and Oishi; its bound about 2 u), whose column loop is a numpy call per key.
    The looser bound costs the first pass a few more undecided elements, which the second
    pass decides.
    """
    n = w.shape[-1]
    flat = w.reshape(math.prod(w.shape[:-1]), n)
    total = np.empty(flat.shape[0])

    def block(part: slice) -> None:
        x = flat[part]
        while x.shape[-1] > 1:
            h = x.shape[-1] // 2
            y = x[:, :h] + x[:, h:2 * h]
            # An odd row's last term passes to the next step unadded.
            x = y if x.shape[-1] % 2 == 0 else np.concatenate([y, x[:, 2 * h:]], axis=1)
        total[part] = x[:, 0] if n else 0.0
    # Blocks of rows are independent: side by side (exactref/_parallel.py).
    for_each_slice(block, flat.shape[0], max(1, _SUM_ROWS_BLOCK // max(n, 1)))
    total = total.reshape(w.shape[:-1])
    levels = max(n - 1, 0).bit_length()
    return total, np.full(total.shape, up(g(levels)))


# Weights per block of _sum_rows (its halves' temporaries, 4 MiB at most).
_SUM_ROWS_BLOCK = 1 << 19


def matmul_up(A: np.ndarray, B: np.ndarray, *, of: Callable[..., np.ndarray] | None = None,
              more: tuple[np.ndarray, ...] = ()) -> np.ndarray:
    """An upper bound on A @ B for nonnegative A and B (float64 rounding and underflow included).

    With ``of``, an elementwise function with nonnegative values, the bound is on
    ``of(A, *more) @ B`` (each array of ``more`` of A's shape): each block of rows of A and of
    ``more`` goes through ``of`` just before its product, on the block's thread, so the values
    are those of ``matmul_up(of(A, *more), B)`` without a temporary of A's size.
    """
    n = A.shape[-1]
    shape = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1])
    M = shape[-2]
    # (Without ``of``, A's blocks are views: only the output's size counts.)
    step = rows_per_block(shape, _MATMUL_BLOCK, *((A.shape, _MATMUL_A_BLOCK) if of is not None else ()))
    out = empty(shape, np.float64)

    def block(rows: slice) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            part = A[..., rows, :] if of is None else of(A[..., rows, :], *(m[..., rows, :] for m in more))
            out[..., rows, :] = up((part @ B) / (1 - g(n)) + n * TINY)
    # Blocks of rows side by side (exactref/_parallel.py).  The blocks are fixed, so the values
    # do not depend on the threads; each block's bound holds whatever order its BLAS adds in.
    for_each_slice(block, M, step)
    return out


_MATMUL_BLOCK = 1 << 18  # output elements per block of matmul_up
# And values of A per block, where ``of`` forms them: a gradient's product has 64 or 128 columns,
# so _MATMUL_BLOCK alone made two blocks of 4M values of A, whose temporaries missed the cache,
# and the thread that finished its block first waited for the other's.  In blocks of 2**20, a
# float32 1x8x1024x64 forward and backward took 1.98 s against 2.04, and float16 1x4x2048x128
# 3.86 s against 4.00 (medians of 10 and 8, alternating in one process; the same values).
_MATMUL_A_BLOCK = 1 << 20


def matmul_rows(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """``A @ B`` in float64, blocks of rows of A side by side (exactref/_parallel.py).

    Each element is still one float64 dot product, in some order: bounds for any order (Higham's
    gamma_K) hold.  On one thread (the op's BLAS limit) a (8, 1024, 1024) @ (8, 1024, 64) took
    30-40 ms.
    """
    shape = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1])
    M = shape[-2]
    out = empty(shape, np.float64)

    def block(rows: slice) -> None:
        out[..., rows, :] = A[..., rows, :] @ B
    for_each_slice(block, M, max(1, _MATMUL_BLOCK // max(math.prod(shape) // max(M, 1), 1)))
    return out


def sliced(A: np.ndarray, B: np.ndarray, quick: bool = False,
           b_bits: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``A @ B`` as ``hi + lo +- rad`` to about twice float64's precision (error-free slicing);
    ``quick``: with four BLAS products instead of six, to about 2**-28 gamma_K times rank-one bounds
    on ``|A| @ |B|``; ``b_bits``: the quick cut with B in one slice of that many bits
    (:func:`exactref.engine.products.matmul_sliced`)."""
    if A.shape[-1] == 0:
        z = np.zeros(A.shape[:-1] + B.shape[-1:])
        return z, z.copy(), z.copy()
    # S, the bound on |A| @ |B|, is not wanted here (the logits' own comes from matmul_up).
    # The radius is finite or +inf, never NaN: Right._sliced sets inf wherever it is not
    # below inf, so no copy is made to turn a NaN into inf.
    enc = matmul_sliced(A, B, bound=False, quick=quick or b_bits is not None, b_bits=b_bits)
    return enc.hi, enc.lo, enc.rad


def dot_rows(X: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum_c X[..., c] (hi + lo)[..., c], compensated (Dot2), and a bound on its error.

    X holds exact values; the error bound is u |result| + gamma_{2n}**2 sum |X (hi + lo)|
    (Ogita, Rump and Oishi), plus what dropping lo's own products' errors costs.
    """
    n = X.shape[-1]
    # (The same sums by one compiled loop, a row at a time, where it applies: _loops.py.)
    made = _loops.dot2_rows(X, hi, lo)
    if made is not None:
        s, c, absum = made
    else:
        s = np.zeros(X.shape[:-1])
        c = np.zeros(X.shape[:-1])
        absum = np.zeros(X.shape[:-1])
        for j in range(n):
            p, e, _ = two_prod(X[..., j], hi[..., j])
            t = s + p
            z = t - s
            c += ((s - (t - z)) + (p - z)) + e + X[..., j] * lo[..., j]
            s = t
            absum += np.abs(X[..., j]) * (np.abs(hi[..., j]) + np.abs(lo[..., j]))
    total = s + c
    g2 = g(2 * n + 2)
    err = up(U * np.abs(total) + (g2 * g2 / (1 - g2) * 4 + U * U * 4) * absum + n * TINY)
    # Dekker's product is exact only away from overflow; there the bound gives up.
    huge = (np.max(np.abs(X), axis=-1, initial=0.0) >= 2.0 ** 990) | (np.max(np.abs(hi), axis=-1, initial=0.0) >= 2.0 ** 990)
    return total, np.where(huge | ~np.isfinite(err), np.inf, err)


def by_rows(fn, H: int, L: int, *arrays):
    """fn applied to blocks of the rows of (H, L, ...) arrays (other arguments passed whole), so that
    the temporaries of an elementwise computation stay in the cache; returns its outputs, (H, L, ...)."""
    n = H * L
    flat = [a.reshape((n,) + a.shape[2:]) if isinstance(a, np.ndarray) and a.shape[:2] == (H, L) else None
            for a in arrays]
    width = max([math.prod(f.shape[1:]) for f in flat if f is not None] + [1])
    step = max(1, _BLOCK // max(width, 1))
    outs: list[np.ndarray] = []

    def block(sl: slice) -> None:
        res = fn(*(x if f is None else f[sl] for x, f in zip(arrays, flat)))
        if not outs:
            outs.extend(empty((n,) + r.shape[1:], r.dtype) for r in res)
        for o, r in zip(outs, res):
            o[sl] = r
    # The first block's results' shapes and dtypes make the outputs; the rest side by side.
    for_each_slice(block, n, step, first_alone=True)
    return [o.reshape((H, L) + o.shape[1:]) for o in outs]


def dp_rows(dP_hi, dP_lo, dP_rad):
    """dP = dP_hi + dP_lo and its error bound e_dP, of some rows (see FirstPass.backward)."""
    with np.errstate(over="ignore", invalid="ignore"):
        dP = dP_hi + dP_lo
        return dP, up(dP_rad + U * np.abs(dP))


def t_rows(dP_hi, dP_lo, dP_rad, D, e_D):
    """T = dP - D and its error bound e_T, of some rows (see FirstPass.backward).

    Made again from dP's enclosure wherever it is needed, a block of rows at a time, rather
    than kept whole: at 1x4x2048x128 each of T and e_T is 134 MB of float64.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        # T = dP - D in double-double, so the cancellation between them costs nothing.
        t_hi, t_lo = two_sum(dP_hi, -D[..., None])
        T = t_hi + (t_lo + dP_lo)
        return T, up(dP_rad + e_D[..., None] + U * np.abs(T) * 2 + U * np.abs(dP_lo) + TINY)


def _ds_all(H: int, L: int, *arrays: np.ndarray) -> list[np.ndarray]:
    """:func:`_ds_rows` of every row, (H, L, S): by the compiled loop (exactref/ops/attention/_loops.py,
    the same values bit for bit) a block of rows at a time where it applies, else by the numpy code."""
    dP_hi = arrays[0]
    if not _fused.usable(dP_hi.size):
        return by_rows(_ds_rows, H, L, *arrays)
    n, S = H * L, dP_hi.shape[-1]
    flat = [a.reshape((n,) + a.shape[2:]) for a in arrays]
    outs = [empty((n, S), np.float64), empty((n, S), np.float64)]

    def block(sl: slice) -> None:
        views = (outs[0][sl], outs[1][sl])
        if not _loops.ds_rows(*(f[sl] for f in flat), views, U, TINY, _fused._up_constants()):
            views[0][...], views[1][...] = _ds_rows(*(f[sl] for f in flat))
    for_each_slice(block, n, max(1, _BLOCK // max(S, 1)))
    return [o.reshape(H, L, S) for o in outs]


def _ds_rows(dP_hi, dP_lo, dP_rad, D, e_D, P, e_P, unmasked):
    """dS = P T and e_dS of some rows (see FirstPass.backward)."""
    T, e_T = t_rows(dP_hi, dP_lo, dP_rad, D, e_D)
    with np.errstate(over="ignore", invalid="ignore"):
        dS = np.where(unmasked, P * T, 0.0)
        absT = np.abs(T) + e_T
        e_dS = up(e_P * absT + P * e_T + U * np.abs(dS))
        e_dS = np.where(unmasked, e_dS, 0.0)
    return dS, e_dS


class _Rows:
    """The softmax of the first pass, computed by blocks of rows so that its temporaries stay in the cache."""

    def __init__(self, n: int, S: int) -> None:
        self.n, self.S = n, S
        self.Z, self.ez, self.w = (empty((n, S), np.float64) for _ in range(3))
        self.P, self.P_up, self.e_P = (empty((n, S), np.float64) for _ in range(3))
        self.M, self.pi, self.logit_rowmax, self.epsbar = (np.empty(n) for _ in range(4))
        self.full = np.empty(n, dtype=bool)
        self.loose: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # see _loose_rows

    def blocks(self) -> list[slice]:
        step = max(1, _BLOCK // max(self.S, 1))
        return [slice(a, a + step) for a in range(0, self.n, step)]

    def logits(self, sl: slice, d_hi: np.ndarray, d_lo: np.ndarray, d_rad: np.ndarray, unmasked: np.ndarray,
               additive: np.ndarray | None, s: float, ds: float) -> None:
        """The logits Z with their bounds ez, the row maxima M and the unnormalised weights w of rows ``sl``."""
        S = self.S
        if additive is None and self._compiled(sl, d_hi, d_lo, d_rad, unmasked, s, ds):
            return
        d = d_hi + d_lo
        sD = s * d
        Z = sD if additive is None else sD + additive
        # |Z - x| for the exact logit x = s (q . k) + m.
        ez = U * (np.abs(d) + np.abs(sD)) * abs(s) + abs(s) * d_rad + ds * (np.abs(d) + d_rad) + U * np.abs(sD)
        if additive is not None:
            ez = ez + U * np.abs(Z)
        ez = up(ez * (1 + 4 * U) + TINY)
        Z = np.where(unmasked, Z, -np.inf)
        ez = np.where(unmasked, ez, 0.0)
        M = np.max(Z, axis=-1) if S else np.full(Z.shape[:-1], -np.inf)
        full = M == -np.inf  # fully masked rows: output and gradients exactly 0
        M = np.where(full, 0.0, M)
        Y = Z - M[..., None]
        ey = up(ez + U * np.where(unmasked, np.abs(Y), 0.0))
        w, rel = _exp_block(np.where(unmasked, Y, -np.inf))
        self.Z[sl], self.ez[sl], self.M[sl], self.full[sl] = Z, ez, M, full
        self.w[sl] = np.where(unmasked, w, 0.0)
        # The exp's own relative error compounds with that of its argument: a weight's error is
        # at most eps(ey) = up(expm1_up(ey) (1 + rel) + rel), and the row's worst, epsbar, is
        # eps of the row's largest ey, eps being nondecreasing up to ey = 1 (a masked key's ey,
        # up(0), is the least there is).  Past 1 it is not, and every weight counts (_row_eps).
        eymax = np.max(ey, axis=-1) if S else np.zeros(Z.shape[:-1])
        epsbar = np.where(full, 0.0, _eps(eymax, rel))
        beyond = np.nonzero(~full & (eymax > 1))[0]
        if beyond.size:
            epsbar[beyond] = np.max(_row_eps(beyond, ey, rel, unmasked), axis=-1)
        self.epsbar[sl] = epsbar
        loose = np.nonzero(epsbar >= _LOOSE)[0]
        if loose.size:
            self.loose[sl.start] = _loose_rows(loose, w, rel, ey, _row_eps(loose, ey, rel, unmasked), unmasked)
        self.logit_rowmax[sl] = np.max(np.where(unmasked, np.abs(Z) + ez, 0.0), axis=-1) if S else 0.0

    def _compiled(self, sl: slice, d_hi: np.ndarray, d_lo: np.ndarray, d_rad: np.ndarray, unmasked: np.ndarray,
                  s: float, ds: float) -> bool:
        """:meth:`logits` by the compiled loop (exactref/ops/attention/_loops.py: the same values, bit for
        bit); False where it does not apply or a row needs element-wise bounds, and then the numpy
        code makes every value of the block again."""
        out = (self.Z[sl], self.ez[sl], self.w[sl])
        got = _loops.logit_rows(d_hi, d_lo, d_rad, unmasked, s, ds, out, _LOGIT_CONSTANTS, _INV_FACT_ARRAY, _TABLE)
        if got is None:
            return False
        M, full, eymax, rowmax = got
        epsbar = np.where(full, 0.0, _eps(eymax, EXP_BLOCK_REL))
        if np.any(~full & (eymax > 1)) or np.any(epsbar >= _LOOSE):
            return False  # (rows for _row_eps or _loose_rows, which need every ey: the numpy code)
        self.M[sl], self.full[sl], self.epsbar[sl], self.logit_rowmax[sl] = M, full, epsbar, rowmax
        return True

    def weights(self, sl: slice, unmasked: np.ndarray, W: np.ndarray, W_err: np.ndarray) -> None:
        """P = w / W of rows ``sl`` with |P~ - P| <= pi P + TINY, an upper bound P_up and e_P >= |P~ - P|."""
        Wd = np.where(self.full[sl], 1.0, W)
        epsbar = self.epsbar[sl]
        pi = ratio_error(epsbar, U, W_err)
        pi = np.where((epsbar < 0.5) & np.isfinite(pi), pi, np.inf)
        self.pi[sl] = pi
        # (By the compiled loop where it applies: the same values, bit for bit.)
        if not _loops.weight_rows(self.w[sl], unmasked, Wd, pi, (self.P[sl], self.P_up[sl], self.e_P[sl]), TINY,
                                  _fused._up_constants()):
            P = self.w[sl] / Wd[..., None]
            P_up = np.where(unmasked, up((P + TINY) / (1 - pi[..., None])), 0.0)
            self.P[sl], self.P_up[sl] = P, P_up
            self.e_P[sl] = np.where(unmasked, up(P_up * pi[..., None] + TINY), 0.0)  # |P~ - P|
        if sl.start in self.loose:
            rows, wup, err = self.loose[sl.start]
            at = sl.start + rows
            # (W, W_err and unmasked are the block's own, like ``rows``.)
            self.P_up[at], self.e_P[at] = _loose_weights(self.P[at], wup, err, W[rows], W_err[rows], unmasked[rows])


# The row-wise bound pi takes the row's worst weight error for every weight: one huge logit, whose
# float64 rounding is a sizeable fraction of a nat, would loosen them all, though its own weight
# underflows; and once pi >= 1 the bound P / (1 - pi) is negative, not a bound.  Rows whose worst
# error reaches _LOOSE get element-wise bounds (_loose_weights) instead.  Below it pi < 3/4, and
# ordinary rows (logits below ~10**6, epsbar ~ 1e-15) keep the row-wise bound and its speed.
_LOOSE = 2.0 ** -30


def _eps(ey: np.ndarray, rel: float) -> np.ndarray:
    """A bound on the relative error of a weight exp(y) computed within rel, for y off by at most ey."""
    return up(expm1_up(ey) * (1 + rel) + rel)


def _row_eps(rows: np.ndarray, ey: np.ndarray, rel: float, unmasked: np.ndarray) -> np.ndarray:
    """:func:`_eps` of every weight of the rows ``rows`` of a block, 0 at a masked key."""
    return np.where(unmasked[rows], _eps(ey[rows], rel), 0.0)


def _loose_rows(rows, w, rel, ey, eps, unmasked):
    """For the rows ``rows`` of a block: an upper bound wup on each exact weight exp(x_j - M), and
    err >= |w~_j - exp(x_j - M)|, from the element's own errors rather than the row's worst.

    x_j - M <= y_j + ey_j <= ey_j (y_j = Z_j - M <= 0), so exp(x_j - M) <= e**ey_j, and it is at most
    e**ey_j (w~_j + 2**-1074) / (1 - rel) from the exp's own result (rel: its relative error bound,
    2**-1074: its underflow).  ``eps`` is :func:`_row_eps` of these rows.
    """
    w, ey, unm = w[rows], ey[rows], unmasked[rows]  # (eps: of these rows already)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        grow = up(1 + expm1_up(ey))  # >= e**ey, inf where ey is huge
        from_w = np.where(rel < 0.5, up(grow * (w + 2.0 ** -1074) / (1 - rel)), np.inf)
        wup = np.fmin(from_w, grow)
        err = np.fmin(up(eps * wup), up(w + wup))  # eps may be inf; |w~ - w| <= w~ + w anyway
    return rows, np.where(unm, wup, 0.0), np.where(unm, err, 0.0)


def _loose_weights(P, wup, err, W, W_err, unm):
    """P_up >= P_j and e_P >= |P~_j - P_j| element by element, for rows with loose weights.

    With the exact row sum W_x: |sum_j w~_j - W_x| <= sum_j err_j = A, the computed W within W_err
    of sum_j w~_j, so W_x >= W / (1 + W_err) - A and |W - W_x| <= A + W_err W / (1 - W_err); then
    P_j = w_j / W_x <= min(1, wup_j / W_x) and, with P~_j = fl(w~_j / W),
    |P~_j - P_j| <= err_j / W + P_j |W - W_x| / W + u P~_j, and at most P~_j + P_j.
    """
    S = P.shape[-1]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        A = up(np.sum(err, axis=-1) * (1 + g(S)) + S * 2.0 ** -1074)
        W_lo = (W / (1 + W_err) * (1 - 4 * U) - A) * (1 - 4 * U)
        P_up = np.where((W_lo > 0)[..., None], np.fmin(up(wup / W_lo[..., None]), 1.0), 1.0)
        dW = up(A + W_err * W / (1 - W_err))
        e_P = up(err / W[..., None] + P_up * (dW / W)[..., None] + U * P + TINY)
        e_P = np.where(np.isfinite(e_P), np.fmin(e_P, up(P + P_up)), up(P + P_up))
    return np.where(unm, P_up, 0.0), np.where(unm, e_P, 0.0)


class FirstPass:
    """The float64 enclosures of one attention problem, forward first, the backward on demand.

    The matmuls whose errors would dominate (q k^T, P V, dO V^T) are
    sliced products (:func:`exactref.engine.products.matmul_sliced`: error-free
    for float64 inputs, within about 2**-24 gamma_K of their terms otherwise),
    the row sums taken by halves, and the exp bounded by :func:`exp_bounded`:
    what is left is a few units of float64 rounding per quantity, so the
    rounding of a float32 or narrower output is decided for all but a handful
    of elements.  The gradients' final products are plain float64 ones (see
    :meth:`grad`).
    """

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.weights_cache: dict = {}  # the tolerance models' bounds on the weights, by model
        # Arb weights P_i of rows, by (head, precision): the refinements of the forward and of every
        # backward compute the same ones (_certified._Head, _wholehead.WholeHead), so they share them.
        self.arb_weights: dict = {}
        # The double-double pass's weights and output balls (_double.DoublePass), computed when needed.
        self.double: dict = {}
        H, L, S = pb.H, pb.L, pb.S
        # Inputs of at most 24 significant bits (float32 and narrower): q k^T and dO V^T take B in
        # one slice of 24 bits, three BLAS products instead of four, with a rest rounded at about
        # 2**-24 gamma_E of |q| |k| (matmul_sliced): below the longdouble pass's own rounding of
        # the logits' parts, u_ld (|hi| + |lo|), by a factor of about 2**-3 at E = 64 (and the
        # double-double pass's logits, for a float32 or narrower output, err by about 2**-68 of
        # |q| |k| instead of 2**-104).  At 1x8x1024x64 float32, q k^T took 70-75 ms against
        # 102-108 (medians of 9).
        self.narrow_b = 24 if pb.fmt.p <= 24 else None
        self.Qh, self.Kh, self.Vh = pb.Q[pb.qi], pb.K[pb.ki], pb.V[pb.vi]
        if pb.uniform is not None:
            # A row weighed uniformly (masked_rows="mean") has constant logits: with its query read
            # as zero (a copy per head) every pass computes them exactly 0, whatever the keys.
            self.Qh[pb.uniform] = 0.0
        unmasked = ~pb.masked
        self.unmasked = unmasked
        s, ds = pb.scale.approx, pb.scale.err
        with np.errstate(over="ignore", invalid="ignore"):
            Kt = np.swapaxes(self.Kh, -1, -2)
            d_hi, d_lo, d_rad = sliced(self.Qh, Kt, b_bits=self.narrow_b)
            self.logit_parts = (d_hi, d_lo, d_rad)  # the second pass starts from them
            # A bounds sum_c |q_ic k_jc|, the size every logit error of a kernel scales with.
            self.A = matmul_up(np.abs(self.Qh), np.abs(Kt))
            rows = _Rows(H * L, S)
            flat = [a.reshape(H * L, S) for a in (d_hi, d_lo, d_rad, unmasked)]
            add = None if pb.additive is None else pb.additive.reshape(H * L, S)
            blocks = rows.blocks()  # independent: side by side (exactref/_parallel.py)
            for_each(lambda i: rows.logits(blocks[i], *(a[blocks[i]] for a in flat),
                                           None if add is None else add[blocks[i]], s, ds), len(blocks))
            W, W_err = _sum_rows(rows.w)
            for_each(lambda i: rows.weights(blocks[i], flat[3][blocks[i]], W[blocks[i]], W_err[blocks[i]]),
                     len(blocks))
            for name in ("Z", "ez", "P", "P_up", "e_P"):
                setattr(self, name, getattr(rows, name).reshape(H, L, S))
            for name in ("full", "M", "pi", "logit_rowmax"):
                setattr(self, name, getattr(rows, name).reshape(H, L))

            # Forward: out = P V.
            self.absV = np.abs(self.Vh)
            self.colsumV = np.sum(self.absV, axis=-2)  # (H, Ev)
            # The weights' own error, e_P |V| (about 5 u P |V|), dominates the radius: the quick cut's
            # rest, about 2**-28 gamma_S times rank-one bounds on P |V| (1x8x1024x64 float32: a radius
            # of at most 1.2e-21 against about 4e-16), adds nothing to it that matters, and its four
            # products cost two fewer (91 against 118 ms there).  (The logits and dP need more: the
            # later passes start from them.)
            self.O_hi, self.O_lo, rad = sliced(self.P, self.Vh, quick=True)
            self.O = self.O_hi + self.O_lo
            self.rad_O = up(rad + matmul_up(self.e_P, self.absV) + U * np.abs(self.O))
            self.rad_O = np.where(np.isfinite(self.rad_O), self.rad_O, np.inf)

    # ------------------------------------------------------------------ backward

    def backward(self, G: np.ndarray) -> None:
        """Enclosures of dP = G V^T, D, dS for the output gradient G (H, L, Ev)."""
        pb = self.pb
        Ev = pb.Ev
        unmasked = self.unmasked
        with np.errstate(over="ignore", invalid="ignore"):
            Vt = np.swapaxes(self.Vh, -1, -2)
            dP_hi, dP_lo, dP_rad = sliced(G, Vt, b_bits=self.narrow_b)
            self.dP_parts = (dP_hi, dP_lo, dP_rad)
            self.absG = np.abs(G)
            self.B = matmul_up(self.absG, np.swapaxes(self.absV, -1, -2))
            D, D_err = dot_rows(G, self.O_hi, self.O_lo) if Ev else (np.zeros(G.shape[:-1]),) * 2
            e_D = up(D_err + np.einsum("hlc,hlc->hl", self.absG, self.rad_O) * (1 + g(Ev + 1)) + TINY)
            # dP, T and their bounds are not kept whole: dp_rows and t_rows make them again from
            # dP_parts where needed (four fewer arrays of the logits' size).
            self.dS, self.e_dS = _ds_all(pb.H, pb.L, dP_hi, dP_lo, dP_rad, D, e_D, self.P, self.e_P, unmasked)
        self.D, self.e_D = D, e_D
        self.G = G
        self.bwd_cache: dict = {}  # the tolerance model's bounds for this G, shared by the three gradients

    def grad(self, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hi, lo, radius) of one gradient in its operand's own batch, summed over the copies."""
        pb = self.pb
        cop = pb.copies(which)
        n, c = cop.shape
        s, ds = pb.scale.approx, pb.scale.err
        with np.errstate(over="ignore", invalid="ignore"):
            if which == "query":
                # grad_q = s sum_copies dS K, the copies concatenated along the keys.
                X, Xe = _cat_cols(self.dS, cop), _cat_cols(self.e_dS, cop)
                Y = self.Kh[cop].reshape(n, c * pb.S, pb.E)
            elif which == "key":
                X, Xe = _cat_rows_t(self.dS, cop), _cat_rows_t(self.e_dS, cop)
                Y = self.Qh[cop].reshape(n, c * pb.L, pb.E)
            else:
                X, Xe = _cat_rows_t(self.P, cop), _cat_rows_t(self.e_P, cop)
                Y = self.G[cop].reshape(n, c * pb.L, pb.Ev)
            # A plain float64 product, with Higham's gamma_K for any order of its K products and
            # sums.  It widens the enclosures of grad_query and grad_key about 2 times (dS's own
            # error is of the same order) and grad_value's about 8; the few more undecided
            # elements cost the second pass less than error-free products would cost here.
            K = X.shape[-1]
            absY = np.abs(Y)
            hi = matmul_rows(X, Y)
            # One product bounds both the rounding, gamma_K |X| |Y|, and X's own error, Xe |Y|:
            # Z = up(gamma_K |X| + Xe) is at least their sum of factors, element by element (two
            # roundings, which up pays for), and is formed a block of rows at a time.
            gK = g(K)
            rad = up(matmul_up(X, absY, of=_factors.factor("abs", gK), more=(Xe,)) + K * TINY)
            hi = np.where(np.isfinite(rad) & np.isfinite(hi), hi, 0.0)
            lo = np.zeros_like(hi)
            if which != "value":
                # s (hi +- rad): s's float64 value errs by ds; s hi = p_hi + p_lo where safe.
                val = np.abs(hi) + rad
                hi, lo, safe = two_prod(np.full_like(hi, s), hi)
                rad = up(abs(s) * rad + ds * val + 4 * U * np.abs(lo) + TINY)
                rad = np.where(safe, rad, np.inf)
        return hi, lo, np.where(np.isfinite(rad), rad, np.inf)


def _own_heads(X: np.ndarray, cop: np.ndarray) -> bool:
    """Whether every batch element has one copy, its own head: X itself is the concatenation."""
    return cop.shape == (X.shape[0], 1) and bool((cop[:, 0] == np.arange(X.shape[0])).all())


def _cat_cols(X: np.ndarray, cop: np.ndarray) -> np.ndarray:
    """(H, L, S) per head -> (n, L, copies*S): each batch element's copies side by side."""
    if _own_heads(X, cop):
        return X  # (no copy of an array of the weights' size)
    n, c = cop.shape
    Xc = X[cop]  # (n, c, L, S)
    return np.moveaxis(Xc, 1, 2).reshape(n, X.shape[1], c * X.shape[2])


def _cat_rows_t(X: np.ndarray, cop: np.ndarray) -> np.ndarray:
    """(H, L, S) per head -> (n, S, copies*L): the transposes of the copies side by side."""
    if _own_heads(X, cop):
        return np.swapaxes(X, -1, -2)  # a view, which BLAS reads transposed
    n, c = cop.shape
    Xc = np.swapaxes(X[cop], -1, -2)  # (n, c, S, L)
    return np.moveaxis(Xc, 1, 2).reshape(n, X.shape[2], c * X.shape[1])
