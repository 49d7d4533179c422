"""The vectorised float64 fast path: enclosures ``hi + lo +- rad`` of exact sums of products.

Every function here returns, for each output element, float64 arrays ``hi``,
``lo`` and ``rad`` with ``|exact - (hi + lo)| <= rad``, and ``S``, an upper
bound on the sum of the absolute values of the terms (what the tolerance
models scale with).  ``rad`` is inf where the fast path cannot bound an
element (overflow or underflow in float64); those elements go to the exact
path.

* :func:`matmul_narrow`: inputs with at most 26 significant bits (float32 and
  narrower), whose products are exact in float64: one BLAS product for ``hi``
  and one of the absolute values for the bound.
* :func:`matmul_sliced`: float64 inputs, by error-free slicing (Ozaki's
  scheme).  Each row of A and column of B is cut into slices whose products
  sum exactly in float64, so a few BLAS products give the result to about
  twice float64's precision.
* :func:`rowdot`: short per-element dot products (elementwise ops), in
  double-double arithmetic with exact two-products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rounding import next_up

__all__ = [
    "U64", "Enclosure", "combine", "finite_or_zero", "fits_narrow", "gamma",
    "matmul_narrow", "matmul_sliced", "rowdot", "two_prod", "two_sum", "up",
]

U64 = 2.0 ** -53
# Veltkamp's splitting constant for float64: 2**27 + 1.
_SPLITTER = 134217729.0
_SPLIT_MAX = 2.0 ** 995
_PRODUCT_MIN = 2.0 ** -968


def gamma(n: np.ndarray | int, u: float) -> np.ndarray | float:
    """Higham's gamma_n = n*u / (1 - n*u), rounded up; inf when n*u >= 1."""
    n = np.asarray(n, dtype=np.float64)
    nu = n * u
    with np.errstate(divide="ignore"):
        g = np.where(nu < 1, nu / (1 - nu), np.inf)
    g = next_up(next_up(g))
    return g if g.ndim else float(g)


def up(x: np.ndarray | float) -> np.ndarray | float:
    """A nonnegative bound ``x`` moved up by more than two float64 ulps.

    It pays for the roundings of the short computation that produced ``x``;
    a multiply-add is much cheaper than two nextafter calls.
    """
    return x * (1 + 2.0 ** -50) + 2.0 ** -1070


@dataclass
class Enclosure:
    """``|exact - (hi + lo)| <= rad`` element by element; ``S`` bounds the sum of |terms|."""

    hi: np.ndarray
    lo: np.ndarray
    rad: np.ndarray
    S: np.ndarray


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s + e == a + b`` exactly, with ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


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


def matmul_narrow(A: np.ndarray, B: np.ndarray) -> Enclosure:
    """``A @ B`` for inputs whose products are exact in float64 (float32 and narrower)."""
    K = A.shape[-1]
    hi = A @ B
    g = gamma(max(K - 1, 0), U64)
    S = _abs_product_bound(A, B)
    # Products are exact, so float64 sums err by at most gamma_{K-1} * sum|terms|.
    rad = up(g * S) if g else np.zeros_like(hi)
    return Enclosure(hi, np.zeros_like(hi), rad, S)


_F32_MAX = float(np.finfo(np.float32).max)


def _abs_product_bound(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """An upper bound on ``|A| @ |B|``, from a float32 product where that is safe.

    A float32 product is about twice as fast as a float64 one.  Its inputs'
    rounding (relative u each), its summation (gamma_K) and its underflows
    (half a subnormal per term) are paid for explicitly; values outside
    [2**-60, 2**60] could underflow or overflow, so those take float64.
    """
    K = A.shape[-1]
    absA, absB = np.abs(A), np.abs(B)
    if K == 0:
        return np.zeros(np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1]))
    if not (_in_float32_range(absA) and _in_float32_range(absB)):
        return up((absA @ absB) / (1 - gamma(K, U64)))
    S32 = absA.astype(np.float32) @ absB.astype(np.float32)
    u32 = 2.0 ** -24
    return up(S32.astype(np.float64) * ((1 + u32) ** 2 * (1 + gamma(K, u32))) + K * 2.0 ** -149)


def _in_float32_range(v: np.ndarray) -> bool:
    """Whether every nonzero |v| lies in [2**-60, 2**60], so float32 products neither under- nor overflow."""
    if v.size == 0:
        return True
    if v.max() > 2.0 ** 60:
        return False
    nonzero = v[v != 0]
    return nonzero.size == 0 or nonzero.min() >= 2.0 ** -60


def _slice_exponent(K: int) -> int:
    # Slices of beta bits: K products of two slices sum below 2**53 units.
    return max(1, (53 - max(K - 1, 1).bit_length()) // 2)


def _slices(X: np.ndarray, axis: int, beta: int, count: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Cut ``X`` into at most ``count`` slices along ``axis`` plus a remainder.

    Each slice holds, per row (or column), multiples of a power of two
    ``2**unit`` of magnitude at most ``2**beta`` units.  Also returns, per
    row, the lowest unit exponent used, or a large value where the slicing is
    not error-free (values too large or too small for the shifting trick).
    """
    out = []
    rest = X
    ok = np.ones(np.delete(X.shape, axis % X.ndim), dtype=bool)
    lowest = np.full(ok.shape, 4096, dtype=np.int64)
    for _ in range(count):
        mu = np.max(np.abs(rest), axis=axis, keepdims=True, initial=0.0)  # an empty sum (K = 0) has no slices
        if not mu.any():
            break
        ex = np.frexp(mu)[1].astype(np.int64)  # 2**ex > mu
        unit = ex - beta
        # fl(fl(x + sigma) - sigma) rounds x to a multiple of ulp(sigma) = 2**unit
        # while |x| <= sigma / 3 (Ozaki et al.).
        # sigma must be a normal float64 whose ulp is 2**unit.
        usable = (unit + 53 >= -1020) & (unit + 53 <= 1020) & (mu > 0)
        sigma = np.where(usable, np.ldexp(0.75, np.clip(unit + 53, -1020, 1020)), 0.0)
        piece = (rest + sigma) - sigma
        out.append(piece)
        rest = rest - piece
        usable = usable.squeeze(axis)
        lowest = np.minimum(lowest, np.where(usable, unit.squeeze(axis), 4096))
        ok &= usable | (mu.squeeze(axis) == 0)
    lowest = np.where(ok, lowest, -4096)
    return out, rest, lowest


def matmul_sliced(A: np.ndarray, B: np.ndarray, slices: int = 3, depth: int = 4) -> Enclosure:
    """``A @ B`` for float64 inputs, to about twice float64's precision, by error-free slicing."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _matmul_sliced(A, B, slices, depth)


def _matmul_sliced(A: np.ndarray, B: np.ndarray, slices: int, depth: int) -> Enclosure:
    K = A.shape[-1]
    beta = _slice_exponent(K)
    As, RA, lowA = _slices(A, -1, beta, slices)
    Bs, RB, lowB = _slices(B, -2, beta, slices)
    out_shape = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1])
    absA, absB = np.abs(A), np.abs(B)
    S = _abs_product_bound(A, B)
    if not As or not Bs:
        return Enclosure(np.zeros(out_shape), np.zeros(out_shape), np.zeros(out_shape), S)
    # Per-slice row maxima of A and column sums of |B| give rank-one bounds
    # max|a_row| * sum|b_col| >= |a_row| . |b_col| for every pair of slices,
    # and for the remainders RA, RB the slicing left behind.
    a_cols = [np.max(np.abs(a), axis=-1, keepdims=True) for a in As]
    b_rows = [np.sum(np.abs(b), axis=-2, keepdims=True) for b in Bs]
    a_cols += [np.max(np.abs(RA), axis=-1, keepdims=True),
               np.sum(absA, axis=-1, keepdims=True) + np.sum(np.abs(RA), axis=-1, keepdims=True)]
    b_rows += [np.sum(absB, axis=-2, keepdims=True), np.max(np.abs(RB), axis=-2, keepdims=True)]
    weight = np.zeros((len(As) + 2, len(Bs) + 2))
    products = _slice_products(As, Bs, depth)
    first, deep = [], []
    for (i, j), p in products.items():
        if i + j == 1:
            first.append(p)
        elif i + j > 1:
            deep.append(p)
            # Deeper products, about 2**-(2 beta) of the result, are summed in
            # plain float64: one rounding each, bounded through the rank-one bound.
            weight[i, j] = gamma(len(As) * len(Bs), U64)
    for i in range(len(As)):
        for j in range(len(Bs)):
            if i + j >= depth:
                weight[i, j] = 1.0
    weight[-2, -2] = weight[-1, -1] = 1.0
    bound = (np.concatenate(a_cols, axis=-1) @ weight) @ np.concatenate(b_rows, axis=-2)
    hi = products[0, 0]
    lo = np.zeros(out_shape)
    for p in first:
        hi, e = two_sum(hi, p)
        lo = lo + e
    for p in deep:
        lo = lo + p
    # lo's own sum errs by a few roundings of values below 2 ulps of hi (<= 2u S).
    rad = up((bound + 8 * U64 * U64 * S) * (1 + gamma(2 * K + 2, U64)))
    # A slice product whose unit underflows float64 is not exact.
    tiny = (lowA[..., :, None] + lowB[..., None, :]) < -1074 + 53
    bad = tiny | ~np.isfinite(S) | ~np.isfinite(hi) | ~np.isfinite(lo)
    return Enclosure(np.where(bad, 0.0, hi), np.where(bad, 0.0, lo), np.where(bad, np.inf, rad), S)


def _slice_products(As: list[np.ndarray], Bs: list[np.ndarray], depth: int) -> dict[tuple[int, int], np.ndarray]:
    """``As[i] @ Bs[j]`` for every pair with ``i + j < depth``.

    The products sharing a slice of A are one BLAS call on the slices of B
    side by side: the same arithmetic, but wide products run faster.
    """
    out = {}
    N = Bs[0].shape[-1]
    for i, a in enumerate(As):
        js = [j for j in range(len(Bs)) if i + j < depth]
        if not js:
            continue
        wide = a @ (Bs[js[0]] if len(js) == 1 else np.concatenate([Bs[j] for j in js], axis=-1))
        for k, j in enumerate(js):
            out[i, j] = wide[..., k * N:(k + 1) * N]
    return out


def fits_narrow(p: int) -> bool:
    """Whether inputs of precision ``p`` multiply exactly in float64."""
    return 2 * p <= 53


def finite_or_zero(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0.0)

