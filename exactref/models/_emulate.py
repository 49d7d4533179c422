"""One kernel of a declared order, emulated exactly on one element's terms: the "typical" error.

A worst-case bound says how far a kernel *may* be; this says how far one
such kernel *is* on the same inputs.  A report that shows both ratios makes
a kernel stand out that is well within the bound but far worse than its
class.  numpy's float32/float16 cumulative sums and its pairwise ``np.sum``
round every addition in the array's own dtype, so they are the kernels.
"""

from __future__ import annotations

import numpy as np

from ..formats import Format
from ._orders import Blocked, Order

__all__ = ["emulate"]


def emulate(terms: np.ndarray, order: Order, acc: Format, out: Format, products_rounded: bool) -> float:
    """The result of one kernel of ``order`` on exact float64 ``terms``, accumulated in ``acc``.

    ``"any"`` and an any-order block are emulated as numpy's pairwise sum,
    one of the orders they allow.
    """
    dtype = acc.dtype
    t = np.asarray(terms, dtype=np.float64)
    # Rounding an exact float64 product to acc is the kernel's product rounding; exact terms stay exact.
    t = t.astype(dtype) if products_rounded or acc.p < 53 else t
    value = _sum(t, order)
    return float(np.asarray(value, dtype=dtype).astype(out.dtype))


def _sum(t: np.ndarray, order: Order) -> np.generic:
    if not t.size:
        return t.dtype.type(0)
    if order == "sequential":
        return np.cumsum(t)[-1]
    if order in ("pairwise", "any"):
        return np.add.reduce(t)
    assert isinstance(order, Blocked)
    inner = "pairwise" if order.inner == "any" else order.inner
    blocks = [_sum(t[k:k + order.size], inner) for k in range(0, t.size, order.size)]
    per = -(-len(blocks) // order.splits)
    chains = [np.cumsum(np.array(blocks[i:i + per], dtype=t.dtype))[-1] for i in range(0, len(blocks), per)]
    return np.add.reduce(np.array(chains, dtype=t.dtype))
