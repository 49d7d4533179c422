"""The elementwise factors that _first.matmul_up forms a block of rows at a time (its ``of``), each
by numpy or by one compiled loop (numba) that gives numpy's values bit for bit.

Why: the gradients' radii and the tolerance models' bounds multiply, by |V|, |K|, |Q| or |dO|,
an elementwise function of two arrays of the weights' size, such as up(gamma_K |dS| + e_dS).
numpy makes three or four passes over each block for it, each writing a temporary; at
1x8x1024x64 each of those six products took 23-27 ms against 13 ms for the plain product
(float64, on 2 cores, the blocks side by side).  The loop reads each block once.

Every factor is ``kind`` with a constant c:

* ``"abs"``: up(c |x| + e), the gradients' radii (x = dS or P, e its error);
* ``"relative"``: P (r + (1 + r) c), the weights' bound times their relative error;
* ``"grown"``: e + c (d + e), dS's error bound grown by a kernel's sums.

The loop makes numpy's float64 operations in the same order (no fast-math: nothing
reassociated or contracted into a multiply-add; exactref/_fused.py), and writes its result in
the layout numpy's would have, so the BLAS product that follows reads the same matrix the same
way.  It takes blocks whose every array has a contiguous last axis, or a contiguous second to
last (the transposed views of grad_key's and grad_value's factors); others go to numpy.
tests/exactref/test_attention_factors.py compares them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ... import _fused
from ...engine.fast import _UP_ABS, _UP_REL, up

__all__ = ["KINDS", "factor"]

# numpy's definitions, each (c, first, second) -> factor.
KINDS: dict[str, Callable[[float, np.ndarray, np.ndarray], np.ndarray]] = {
    "abs": lambda c, x, e: up(c * np.abs(x) + e),
    "relative": lambda c, P, r: P * (r + (1 + r) * c),
    "grown": lambda c, e, d: e + c * (d + e),
}
_CODES = {"abs": 0, "relative": 1, "grown": 2}


def factor(kind: str, c: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """matmul_up's ``of`` for the factor ``kind`` with constant ``c`` (see the module's doc)."""
    numpy_fn = KINDS[kind]
    code, c = _CODES[kind], float(c)

    def of(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        made = _compiled(code, c, a, b)
        return made if made is not None else numpy_fn(c, a, b)
    return of


def _compiled(code: int, c: float, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The factor by the loop, or None where it does not take the blocks (numba missing, the blocks
    small, not float64, of other shapes or layouts)."""
    if not (type(a) is np.ndarray and type(b) is np.ndarray and a.dtype == b.dtype == np.float64
            and a.shape == b.shape and a.ndim in (2, 3) and a.size >= _fused.MIN_SIZE):
        return None
    out = np.empty_like(a)  # (numpy's layout for an elementwise result of a: order "K")
    views = [a, b, out]
    if a.strides[-1] != 8:
        views = [np.swapaxes(v, -1, -2) for v in views]  # a transposed block, read in its memory order
    if any(v.strides[-1] != 8 for v in views) or not _fused.available():
        return None
    if a.ndim == 2:
        views = [v[None] for v in views]
    _loop()(code, c, *views, _UP_REL, _UP_ABS)
    return out


@functools.lru_cache(maxsize=1)
def _loop() -> Callable[..., None]:
    @_fused._jit()
    def loop(code, c, a, b, out, up_rel, up_abs):
        # Each row's values in turn; a row is contiguous in every array.
        H, R, K = a.shape
        for h in range(H):
            for i in range(R):
                x, y, o = a[h, i], b[h, i], out[h, i]
                if code == 0:
                    for j in range(K):
                        o[j] = (c * abs(x[j]) + y[j]) * up_rel + up_abs
                elif code == 1:
                    for j in range(K):
                        o[j] = x[j] * (y[j] + (1 + y[j]) * c)
                else:
                    for j in range(K):
                        o[j] = x[j] + c * (y[j] + x[j])
    return loop

