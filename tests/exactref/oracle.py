"""An independent oracle for the rational ops: Fractions, and a rounding written here.

Nothing in this module imports the engine.  Formats are restated as plain
numbers on purpose, the exact values are computed element by element with
Python's Fraction following PyTorch's documented semantics, and rounding is
done by scaling a Fraction to an integer grid, a method the engine does not
use.
"""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

# name: (precision p, emin, emax)
FORMATS = {
    "float64": (53, -1022, 1023),
    "float32": (24, -126, 127),
    "float16": (11, -14, 15),
    "bfloat16": (8, -126, 127),
}
# The float8 formats, from their specifications (OCP "8-bit Floating Point" v1.0 for
# E4M3 and E5M2, the fnuz variants of Graphcore and AMD, OCP MX v1.0 for E8M0),
# as the same three numbers: precision p, emin and emax of the normal numbers.
FORMATS.update({
    "float8_e4m3fn": (4, -6, 8),
    "float8_e5m2": (3, -14, 15),
    "float8_e4m3fnuz": (4, -7, 7),
    "float8_e5m2fnuz": (3, -15, 15),
    "float8_e8m0fnu": (1, -127, 127),
})
COMPLEX_PART = {"complex64": "float32", "complex128": "float64"}


class Encoding(NamedTuple):
    """What a format's bit patterns hold beyond (p, emin, emax), written out per format.

    ``max_finite`` is the largest finite value, spelled as a number (not
    derived from p and emax: in float8_e4m3fn the top pattern is NaN, so the
    largest is 1.75 * 2**8, not 1.875 * 2**8).  ``bias`` and ``exponent_bits``
    lay the byte out as sign, exponent field, significand field; ``nan``
    lists the NaN bytes.  ``saturates`` is torch's convention for a cast that
    overflows: True gives the largest finite value of the sign (infinities
    too), False gives inf where the format has one, else NaN.
    """

    max_finite: Fraction
    has_inf: bool
    has_negative_zero: bool
    unsigned: bool
    saturates: bool
    bias: int
    exponent_bits: int
    nan: tuple[int, ...]


_S = 0x80  # the sign bit of a byte
ENCODINGS = {
    # S.1111.111 is the only NaN; no infinities; 448 = 1.75 * 2**8.
    "float8_e4m3fn": Encoding(Fraction(448), False, True, False, True, 7, 4, (0x7F, 0xFF)),
    # IEEE-like: S.11111.00 is infinity, S.11111.01-11 NaN; 57344 = 1.75 * 2**15.
    "float8_e5m2": Encoding(Fraction(57344), True, True, False, False, 15, 5,
                            (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)),
    # The pattern of -0 (0x80) is the only NaN: no -0, no infinities; 240 = 1.875 * 2**7.
    "float8_e4m3fnuz": Encoding(Fraction(240), False, False, False, False, 8, 4, (_S,)),
    "float8_e5m2fnuz": Encoding(Fraction(57344), False, False, False, False, 16, 5, (_S,)),
    # Unsigned powers of two 2**(byte - 127), byte 0..254; 0xFF is NaN; no zero.
    "float8_e8m0fnu": Encoding(Fraction(2) ** 127, False, False, True, False, 127, 8, (0xFF,)),
}
SATURATIONS = (None, "satfinite", "nosat")


def encoding(fmt: str) -> Encoding:
    if fmt in ENCODINGS:
        return ENCODINGS[fmt]
    p, _, emax = FORMATS[fmt]
    return Encoding((2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax, True, True, False, False, 0, 0, ())


def _saturates(fmt: str, saturation: str | None) -> bool:
    if saturation not in SATURATIONS:
        raise ValueError(f"saturation={saturation!r}: use one of {SATURATIONS}")
    return encoding(fmt).saturates if saturation is None else saturation == "satfinite"


def floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    # Adjust the estimate by comparisons, which are exact.
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def round_fraction(q: Fraction, fmt: str, negative_zero: bool = False, saturation: str | None = None) -> float:
    """q rounded to nearest, ties to even, in ``fmt``, as a float.

    ``negative_zero`` is the sign of an exact zero.  ``saturation`` is None
    (torch's convention for the format), ``"satfinite"`` or ``"nosat"``.
    A format without -0 gives +0; float8_e8m0fnu gives NaN for a negative q.
    """
    p, emin, _ = FORMATS[fmt]
    enc = encoding(fmt)
    saturate = _saturates(fmt, saturation)
    if enc.unsigned:
        return _round_power_of_two(q, emin, enc.max_finite, saturate)
    if q == 0:
        return -0.0 if negative_zero and enc.has_negative_zero else 0.0
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = max(floor_log2(a), emin)
    quantum = Fraction(2) ** (e - p + 1)
    scaled = a / quantum
    n = scaled.numerator // scaled.denominator
    rest = scaled - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    # n * quantum is the rounding with an unbounded exponent range; past the
    # largest finite value it overflows (in e4m3fn a tie at 464 goes to the even 448).
    value = n * quantum
    if value > enc.max_finite:
        if saturate:
            return sign * float(enc.max_finite)
        return sign * math.inf if enc.has_inf else math.nan
    if value == 0 and not enc.has_negative_zero:
        return 0.0
    return sign * float(value)


def _round_power_of_two(q: Fraction, emin: int, largest: Fraction, saturate: bool) -> float:
    """float8_e8m0fnu: the nearest power of two in [2**emin, largest], the larger one on a tie.

    The tie between 2**e and 2**(e+1) is their midpoint 1.5 * 2**e (torch and
    ml_dtypes round it up).  Zero and anything below 2**emin give 2**emin,
    the nearest value the format has (as torch does; ml_dtypes gives NaN for zero).
    """
    if q < 0:
        return math.nan
    smallest = Fraction(2) ** emin
    if q <= smallest:
        return float(smallest)
    e = floor_log2(q)
    value = Fraction(2) ** (e + 1) if q >= 3 * Fraction(2) ** (e - 1) else Fraction(2) ** e
    if value > largest:
        return float(largest) if saturate else math.nan
    return float(value)


def round_value(x: float, fmt: str, saturation: str | None = None) -> float:
    """A float64 value ``x`` (NaN, inf and -0 included) rounded once to ``fmt``."""
    enc = encoding(fmt)
    if math.isnan(x):
        return math.nan
    if math.isinf(x):
        if enc.unsigned and x < 0:
            return math.nan
        # __NV_SATFINITE takes infinities to the largest finite value as well.
        if _saturates(fmt, saturation):
            return math.copysign(float(enc.max_finite), x)
        return x if enc.has_inf else math.nan
    return round_fraction(Fraction(x), fmt, negative_zero=math.copysign(1.0, x) < 0, saturation=saturation)


def decode_float8(fmt: str, byte: int) -> float:
    """The value of one byte of a float8 format, read field by field."""
    p, _, _ = FORMATS[fmt]
    enc = ENCODINGS[fmt]
    if byte in enc.nan:
        return math.nan
    if enc.unsigned:
        return float(Fraction(2) ** (byte - enc.bias))
    mant_bits = p - 1
    sign = -1.0 if byte & _S else 1.0
    field = (byte & 0x7F) >> mant_bits
    mant = byte & ((1 << mant_bits) - 1)
    if enc.has_inf and field == (1 << enc.exponent_bits) - 1:
        return sign * math.inf  # NaN patterns were handled above; a zero significand is infinity
    if field == 0:
        return sign * float(Fraction(mant, 1 << mant_bits) * Fraction(2) ** (1 - enc.bias))
    return sign * float((1 + Fraction(mant, 1 << mant_bits)) * Fraction(2) ** (field - enc.bias))


def encode_float8(fmt: str, x: float) -> tuple[int, ...]:
    """Every byte of a float8 format whose value is ``x`` (the NaN bytes for NaN), from decode_float8."""
    return _byte_table(fmt).get(_key(x), ())


def _key(x: float) -> tuple[float, bool]:
    # Every NaN maps to the one object math.nan, which a tuple compares by identity.
    return (math.nan, False) if math.isnan(x) else (x, math.copysign(1.0, x) < 0)


@functools.cache
def _byte_table(fmt: str) -> dict[tuple[float, bool], tuple[int, ...]]:
    table: dict[tuple[float, bool], tuple[int, ...]] = {}
    for byte in range(256):
        v = decode_float8(fmt, byte)
        k = _key(v)
        table[k] = table.get(k, ()) + (byte,)
    return table


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
