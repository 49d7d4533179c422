"""Test-data strategies for the op tests: values that make rounding hard.

Every value is exactly representable in its format.  The pools hold the
values that produce ties, near-ties, cancellation, subnormal results and
overflow when multiplied and summed in small numbers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from .oracle import FORMATS

REAL = ["float64", "float32", "float16", "bfloat16"]
COMPLEX = ["complex64", "complex128"]
DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "complex64": np.complex64, "complex128": np.complex128}
PART = {"complex64": "float32", "complex128": "float64"}


def pool(fmt: str) -> list[float]:
    p, emin, emax = FORMATS[fmt]
    big = (2 - 2.0 ** (1 - p)) * 2.0 ** emax
    values = [
        0.0, 1.0, 2.0, 3.0, 0.5, 0.75, 1.5,
        2.0 ** -p, 3 * 2.0 ** -(p + 1), 2.0 ** -(p - 1),   # half an ulp of 1: ties with 1
        1 + 2.0 ** (1 - p), 1 - 2.0 ** -p, 2 - 2.0 ** (1 - p),  # neighbours of 1 and 2
        2.0 ** emin, 2.0 ** (emin - p + 1), 2.0 ** emin - 2.0 ** (emin - p + 1),  # normal/subnormal edges
        2.0 ** (emin // 2), 2.0 ** (emin // 2 - p // 2),   # squares land near the subnormal range
        big, 2.0 ** emax, 2.0 ** (emax // 2 + 1),            # overflow when multiplied or summed
    ]
    return values


def element(fmt: str) -> st.SearchStrategy[float]:
    """Values of a real format: the hard pool (with signs) and plain values."""
    p, emin, emax = FORMATS[fmt]
    specials = st.sampled_from(pool(fmt)).flatmap(lambda v: st.sampled_from([v, -v]))
    ints = st.integers(-2 ** min(p, 20), 2 ** min(p, 20)).map(float)
    width = {"float64": 64, "float32": 32, "float16": 16}.get(fmt, 32)
    plain = st.floats(allow_nan=False, allow_infinity=False, width=width)
    if fmt == "bfloat16":
        plain = plain.map(lambda v: float(np.float32(v).astype(ml_dtypes.bfloat16)))
        plain = plain.filter(lambda v: np.isfinite(v))
    return st.one_of(specials, ints, plain)


def with_specials(fmt: str) -> st.SearchStrategy[float]:
    return st.one_of(element(fmt), st.sampled_from([np.inf, -np.inf, np.nan]))


def array(fmt: str, shape: tuple, specials: bool = False) -> st.SearchStrategy[np.ndarray]:
    """A numpy array of ``fmt``; complex formats draw both parts."""
    if fmt in PART:
        part = PART[fmt]
        el = with_specials(part) if specials else element(part)
        return st.tuples(hnp.arrays(np.float64, shape, elements=el),
                         hnp.arrays(np.float64, shape, elements=el)).map(lambda ri: _complex(ri, fmt))
    el = with_specials(fmt) if specials else element(fmt)
    return hnp.arrays(np.float64, shape, elements=el).map(lambda a: a.astype(DTYPES[fmt]))


def _complex(parts: tuple[np.ndarray, np.ndarray], fmt: str) -> np.ndarray:
    # Setting the parts directly: arithmetic like re + 1j * im would turn inf into NaN.
    out = np.empty(parts[0].shape, dtype=np.complex128)
    out.real, out.imag = parts
    return out.astype(DTYPES[fmt])
