"""An independent oracle for the rational ops: Fractions, and a rounding written here.

Nothing in this module imports the engine.  Formats are restated as plain
numbers on purpose, the exact values are computed element by element with
Python's Fraction following PyTorch's documented semantics, and rounding is
done by scaling a Fraction to an integer grid, a method the engine does not
use.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

# name: (precision p, emin, emax)
FORMATS = {
    "float64": (53, -1022, 1023),
    "float32": (24, -126, 127),
    "float16": (11, -14, 15),
    "bfloat16": (8, -126, 127),
}
COMPLEX_PART = {"complex64": "float32", "complex128": "float64"}


def floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    # Adjust the estimate by comparisons, which are exact.
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def round_fraction(q: Fraction, fmt: str, negative_zero: bool = False) -> float:
    """q rounded to nearest, ties to even, in ``fmt``, as a float."""
    p, emin, emax = FORMATS[fmt]
    if q == 0:
        return -0.0 if negative_zero else 0.0
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = max(floor_log2(a), emin)
    quantum = Fraction(2) ** (e - p + 1)
    scaled = a / quantum
    n = scaled.numerator // scaled.denominator
    rest = scaled - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    value = n * quantum
    largest = (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax
    if value > largest:
        return sign * math.inf
    return sign * float(value)


def frac(x: float) -> Fraction:
    return Fraction(float(x))


def cfrac(z: complex) -> tuple[Fraction, Fraction]:
    return Fraction(float(z.real)), Fraction(float(z.imag))


class Sum:
    """An exact sum with the IEEE rule for the sign of a zero result: -0 only if every term is -0."""

    def __init__(self) -> None:
        self.value = Fraction(0)
        self.terms = 0
        self.negzero_terms = 0

    def add(self, *factors: float) -> None:
        value = Fraction(1)
        negative = False
        for f in factors:
            value *= frac(f)
            negative ^= math.copysign(1.0, f) < 0
        self.value += value
        self.terms += 1
        self.negzero_terms += value == 0 and negative

    def rounded(self, fmt: str) -> float:
        negzero = self.terms > 0 and self.negzero_terms == self.terms
        return round_fraction(self.value, fmt, negzero if self.value == 0 else False)


def matmul_shapes(a: tuple, b: tuple) -> tuple:
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    return a2, b2, batch


def matmul(A: np.ndarray, B: np.ndarray, fmt: str, alpha: float = 1.0, C: np.ndarray | None = None,
           beta: float = 0.0) -> np.ndarray:
    """torch.matmul (and addmm's beta*C + alpha*A@B) for real inputs, each element rounded once.

    As documented for gemm: alpha == 0 skips A @ B only for float32/float64
    operands of at most two dimensions (a BLAS call); beta == 0 always skips C.
    """
    a2, b2, batch = matmul_shapes(A.shape, B.shape)
    A2 = np.broadcast_to(A.reshape(a2), batch + a2[-2:])
    B2 = np.broadcast_to(B.reshape(b2), batch + b2[-2:])
    M, K, N = a2[-2], a2[-1], b2[-1]
    out = np.empty(batch + (M, N))
    Cb = None if C is None else np.broadcast_to(C, _out_shape(A.shape, B.shape)).reshape(batch + (M, N))
    for idx in itertools.product(*(range(n) for n in batch + (M, N))):
        *bi, i, j = idx
        s = Sum()
        blas = A.ndim <= 2 and B.ndim <= 2 and FORMATS[fmt][0] >= 24
        if C is None or alpha != 0 or not blas:
            for k in range(K):
                if C is None:
                    s.add(A2[tuple(bi) + (i, k)], B2[tuple(bi) + (k, j)])
                else:
                    s.add(alpha, A2[tuple(bi) + (i, k)], B2[tuple(bi) + (k, j)])
        if Cb is not None and beta != 0:
            s.add(beta, Cb[idx])
        out[idx] = s.rounded(fmt)
    return out.reshape(_out_shape(A.shape, B.shape))


def _out_shape(a: tuple, b: tuple) -> tuple:
    a2, b2, batch = matmul_shapes(a, b)
    return batch + ((a2[-2],) if len(a) > 1 else ()) + ((b2[-1],) if len(b) > 1 else ())


def complex_matmul(A: np.ndarray, B: np.ndarray, fmt: str) -> np.ndarray:
    """torch.matmul for complex inputs: each part of each element rounded once."""
    part = COMPLEX_PART[fmt]
    a2, b2, batch = matmul_shapes(A.shape, B.shape)
    A2 = np.broadcast_to(A.reshape(a2), batch + a2[-2:])
    B2 = np.broadcast_to(B.reshape(b2), batch + b2[-2:])
    M, K, N = a2[-2], a2[-1], b2[-1]
    out = np.empty(batch + (M, N), dtype=np.complex128)
    for idx in itertools.product(*(range(n) for n in batch + (M, N))):
        *bi, i, j = idx
        re, im = Sum(), Sum()
        for k in range(K):
            a, b = A2[tuple(bi) + (i, k)], B2[tuple(bi) + (k, j)]
            re.add(a.real, b.real)
            re.add(-a.imag, b.imag)
            im.add(a.real, b.imag)
            im.add(a.imag, b.real)
        out[idx] = complex(re.rounded(part), im.rounded(part))
    return out.reshape(_out_shape(A.shape, B.shape))


def elementwise(fn, x: np.ndarray, y: np.ndarray, fmt: str) -> np.ndarray:
    """Apply ``fn(Sum, x_element, y_element)`` over the broadcast shape and round each result."""
    shape = np.broadcast_shapes(np.shape(x), np.shape(y))
    X, Y = np.broadcast_to(x, shape), np.broadcast_to(y, shape)
    out = np.empty(shape)
    for idx in itertools.product(*(range(n) for n in shape)):
        s = Sum()
        fn(s, X[idx], Y[idx])
        out[idx] = s.rounded(fmt)
    return out


def reduce_to(values_fn, full: tuple, shape: tuple, fmt: str) -> np.ndarray:
    """Sum, for each element of ``shape``, the terms ``values_fn(Sum, full_index)`` over its broadcast copies."""
    lead = len(full) - len(shape)
    padded = (1,) * lead + tuple(shape)
    sums = {}
    for idx in itertools.product(*(range(n) for n in full)):
        target = tuple(0 if padded[d] == 1 else idx[d] for d in range(len(full)))[lead:]
        values_fn(sums.setdefault(target, Sum()), idx)
    out = np.empty(shape)
    for idx in itertools.product(*(range(n) for n in shape)):
        out[idx] = sums.get(idx, Sum()).rounded(fmt)
    return out


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same values, same signs of zero, NaN equal to NaN."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    same = (a == b) & (np.signbit(a) == np.signbit(b))
    return bool(np.all(same | (np.isnan(a) & np.isnan(b))))
