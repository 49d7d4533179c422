"""numpy's own kernels, as a kernel module: ``exactref audit --backend numpy``.

numpy has no autograd, so only the forward of each op is judged, and it has
no kernel of gemm (``alpha * A @ B + beta * C`` rounds three times), of
attention or of matrix_exp.

* matmul is ``np.matmul``: BLAS for float32, float64 and the complex
  formats, numpy's own loop for float16; each a dot product in some order,
  rounded once: the default model.  bfloat16 (an ml_dtypes type) is left
  out: its matmul returns float32.
* add and multiply are ``np.add`` and ``np.multiply``, rounded once, with
  numpy's promotion (``promotion="numpy"``: a 0-d array counts as an
  array).  add is
  drawn with ``alpha=1``: ``np.add`` has no alpha, and ``x + alpha * y``
  would round twice.  Complex add is a known failure, of semantics rather
  than accuracy: numpy adds the parts separately, so 0 + (inf+0j) is inf+0j,
  where exactref's normal answer is torch's, inf+nanj (torch multiplies y by
  alpha as a complex number, 0 * inf in the imaginary part, even for x + y).
* sum is ``np.sum``: pairwise along a contiguous axis, one running sum per
  output element along a strided one; either is an order the default model
  covers.  Half formats are summed in the format itself (float16 by numpy
  along a strided axis, bfloat16 by ml_dtypes), which the default model,
  one rounding at the end, does not allow: REDUCED_PRECISION_REDUCTION does.
  ``axis=()`` means every axis in exactref (as in torch) and none in numpy,
  so it is passed on as None.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import exactref as er
from exactref.harness.kernels import FORMATS

__all__ = ["EXACTREF_KERNELS"]

_HALF = ("float16", "bfloat16")
_COMPLEX_ADD = ("np.add adds complex parts separately: 0 + (inf+0j) gives inf+0j, where torch (and exactref's "
                "normal answer, which follows torch) gives inf+nanj; see exactref/backends/numpy.py")


def _add(x: Any, y: Any, alpha: Any = 1) -> Any:
    if alpha != 1:
        raise ValueError(f"alpha={alpha!r}: np.add has no alpha; this backend's add is drawn with alpha=1")
    return np.add(x, y)


def _sum(x: np.ndarray, *, axis: Any = None, keepdims: bool = False) -> Any:
    if axis == ():
        axis = None
    # A 0-d array has no axis 0 in numpy; torch reads axis 0 (or -1) of a 0-d tensor as the whole of it.
    if x.ndim == 0:
        axis = None
    return np.sum(x, axis=axis, keepdims=keepdims)


EXACTREF_KERNELS: dict[str, Any] = {
    "matmul": {"forward": np.matmul, "arrays": "numpy",
               "formats": [f for f in FORMATS if f != "bfloat16"]},
    "add": {"forward": _add, "arrays": "numpy", "strategy_options": {"alpha": 1},
            "reference_options": {"promotion": "numpy"},
            "known_failures": dict.fromkeys(("complex64", "complex128"), _COMPLEX_ADD)},
    "multiply": {"forward": np.multiply, "arrays": "numpy", "reference_options": {"promotion": "numpy"}},
    "sum": {"forward": _sum, "arrays": "numpy",
            "model": dict.fromkeys(_HALF, er.models.REDUCED_PRECISION_REDUCTION)},
}
