"""A compiled loop for engine.fast._slices' usual call: two slices of float64 rows and their rest (numba).

Why: the numpy code makes about a dozen passes over X (|x|, the row maxima,
x + sigma, minus sigma, the rest, and again for the second slice), each
writing a temporary of X's size.  Attention's P V slices P, 8 x 1024 x
1024 weights at 1x8x1024x64, in blocks of 2**20 values: there the numpy
code took 6.6 to 7.4 ms per block on one thread, and this loop 1.8 ms
(medians of 41 calls, each loop's outputs allocated once).

The loop makes the numpy code's operations in its order, in IEEE double
precision without fast-math (exactref/_fused.py), so its slices, rest and
lowest units are those of the numpy code bit for bit: the row maxima are
NaN where a row holds one (np.max's), frexp gives exponent 0 for 0, inf and
NaN (numpy's and the C library's), and sigma is 0.75 * 2**(unit + 53) where
usable.  tests/exactref/test_fused_slices.py compares them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _fused

__all__ = ["last_axis"]

# The compiled helpers the loop calls, set when it is first built (see _fused._BITS).
_ROW_MAX: Any = None
_SIGMA: Any = None


@functools.lru_cache(maxsize=1)
def _loop() -> Callable[..., None]:
    @_fused._jit()
    def row_max(x):
        # np.max(np.abs(x), initial=0.0): NaN where x holds one.  (The NaN test beside the
        # maximum, not a branch out of the loop, so that the compiler vectorises it.)
        mu = 0.0
        nan = False
        for j in range(x.shape[0]):
            a = abs(x[j])
            nan |= a != a
            mu = a if a > mu else mu
        return np.nan if nan else mu

    @_fused._jit()
    def sigma_of(mu, beta):
        # _slices' sigma, unit and usable for a row's maximum mu.
        unit = math.frexp(mu)[1] - beta
        usable = (unit + 53 >= -1020) and (unit + 53 <= 1020) and (mu > 0)
        return (math.ldexp(0.75, min(max(unit + 53, -1020), 1020)) if usable else 0.0), unit, usable

    global _ROW_MAX, _SIGMA
    _ROW_MAX, _SIGMA = row_max, sigma_of

    @_fused._jit()
    def loop(X, beta, p0, p1, rest, lowest):
        n, K = X.shape
        for i in range(n):
            x, q0, q1, r = X[i], p0[i], p1[i], rest[i]
            mu = _ROW_MAX(x)
            sigma, unit, usable = _SIGMA(mu, beta)
            low = unit if usable else 4096
            ok = usable or mu == 0.0
            # The first slice and the rest; the rest's maximum as it is made.
            mu = 0.0
            nan = False
            for j in range(K):
                piece = (x[j] + sigma) - sigma
                q0[j] = piece
                t = x[j] - piece
                r[j] = t
                a = abs(t)
                nan |= a != a
                mu = a if a > mu else mu
            mu = np.nan if nan else mu
            sigma, unit, usable = _SIGMA(mu, beta)
            if usable:
                low = min(low, unit)
            ok = ok and (usable or mu == 0.0)
            for j in range(K):
                t = r[j]
                piece = (t + sigma) - sigma
                q1[j] = piece
                r[j] = t - piece
            lowest[i] = low if ok else -4096

    return loop


def last_axis(X: np.ndarray, beta: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray] | None:
    """engine.fast._slices(X, -1, beta, 2): the two slices along the last axis, the rest and the
    lowest units, by the compiled loop, which writes them into new C-contiguous arrays; None where
    it does not apply (numba missing, or X small, not float64, or its matrices X[i, ..., :, :] not
    each C-contiguous).  (A block of rows of a stack of matrices, as attention's P V takes its
    weights, is not C-contiguous as a whole, but each of its matrices is.)"""
    if not (type(X) is np.ndarray and X.dtype == np.float64 and X.ndim >= 1 and X.size >= _fused.MIN_SIZE):
        return None
    K = X.shape[-1]
    stacked = X.ndim >= 2 and not X.flags.c_contiguous
    if stacked and (X.strides[-1] != 8 or X.strides[-2] != 8 * K):
        return None
    if not (X.flags.c_contiguous or stacked) or not _fused.available():
        return None
    loop = _loop()
    p0, p1, rest = (np.empty(X.shape) for _ in range(3))
    lowest = np.empty(X.shape[:-1], dtype=np.int64)
    # One call per matrix of a stack (each C-contiguous), or one for the whole of a C-contiguous X.
    mats = np.ndindex(X.shape[:-2]) if stacked else [()]
    for i in mats:
        at = (*i, Ellipsis)  # (views: X[at] is C-contiguous, and lowest[at] an array even where 0-d)
        loop(X[at].reshape(-1, K), int(beta), *(a[at].reshape(-1, K) for a in (p0, p1, rest)), lowest[at].reshape(-1))
    return [p0, p1], rest, lowest
