"""A bit-level emulation of NVIDIA tensor-core MMA accumulation, written from the papers.

Nothing here imports exactref: the emulator is an independent oracle for
the tensor-core bounds in ``exactref/models/_tensor_core.py``.

The model of one MMA step is the one measured by Fasi, Higham, Mikaitis
and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ Computer
Science 7:e330 (2021), and refined for Hopper and Blackwell by Khattak
and Mikaitis, "Accurate models of NVIDIA tensor cores", arXiv 2512.07004
(2025).  A step takes the float32 accumulator ``c`` and ``block`` exact
products of the inputs and

1. finds E, the largest exponent (floor(log2|x|)) among the nonzero
   addends, ``c`` included;
2. aligns every addend to E and truncates it towards zero to a multiple
   of 2**(E - bits + 1), i.e. keeps ``bits`` bits counted from the leading
   bit of an addend of exponent E (this is the alignment shifter dropping
   the bits it shifts out, with no guard, round or sticky bit; a negative
   addend loses magnitude, as in a sign-magnitude datapath.  A two's
   complement shifter would round it towards -inf instead: either way an
   addend loses less than one unit, which is all the bounds use);
3. adds the truncated addends exactly (the papers find no error in the
   multi-operand adder itself);
4. normalises the sum to float32, by truncation towards zero ("truncate",
   what the papers report for the GPUs they measured) or round to nearest, ties to
   even ("nearest"), with float32's subnormals; a magnitude that does not
   fit float32 becomes inf in both modes (a truncating unit might stop at
   the largest finite value instead; no bound test gets near the range).

A dot product of length K is a chain of such steps over consecutive
blocks of ``block`` products from ``c = 0``.  With ``promote=P`` (the
DeepSeek-V3 "promotion" of float8 GEMMs) every chunk of P products runs
its own chain from zero and the chunk results are added, in index order,
into a float32 accumulator rounding to nearest (ordinary CUDA-core float32
additions, done here with numpy float32).

Two implementations of one step agree by test: ``mma_step`` follows the
description on Fractions (any rational products), and ``_step_int``, used
by ``tc_dot``, works on Python ints that carry every value scaled by one
common power of two, so that 8x4096 @ 4096x8 takes well under a second.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["NORMALIZATIONS", "exact_dot", "float32_from_fraction", "mma_step", "tc_dot", "tc_matmul"]

NORMALIZATIONS = ("truncate", "nearest")

# float32: 24-bit significand, smallest normal exponent -126, subnormal spacing 2**-149, overflow at 2**128.
_P32, _EMIN32, _QMIN32, _EOVER32 = 24, -126, -149, 128


def _check(bits: int, normalization: str, block: int | None = None, promote: int | None = None) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
        raise ValueError(f"mma: bits={bits!r} must be a positive int, e.g. 24")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"mma: normalization={normalization!r} must be one of {NORMALIZATIONS}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"mma: block={block!r} must be a positive int, e.g. 16")
    if promote is not None and (isinstance(promote, bool) or not isinstance(promote, int) or promote < 1):
        raise ValueError(f"mma: promote={promote!r} must be a positive int or None, e.g. 128")


def _floor_log2(x: Fraction) -> int:
    """floor(log2 x) for a positive Fraction, by exact comparisons."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    return e


def _trunc_to(x: Fraction, unit: Fraction) -> Fraction:
    """x truncated towards zero to a multiple of unit."""
    q = abs(x) / unit
    n = q.numerator // q.denominator
    return n * unit if x >= 0 else -n * unit


def float32_from_fraction(s: Fraction, normalization: str) -> float:
    """s normalised to float32 by truncation or to nearest even, with subnormals; too large -> inf."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"float32_from_fraction: normalization={normalization!r} must be one of {NORMALIZATIONS}")
    if s == 0:
        return 0.0
    a = abs(s)
    e = max(_floor_log2(a), _EMIN32)
    quantum = Fraction(2) ** (e - _P32 + 1)
    scaled = a / quantum
    n = scaled.numerator // scaled.denominator
    if normalization == "nearest":
        rest = scaled - n
        if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
            n += 1
    value = n * quantum
    if value >= Fraction(2) ** _EOVER32:
        return math.copysign(math.inf, s)
    return float(value) if s > 0 else -float(value)


def mma_step(c: float, products: list[Fraction], *, bits: int, normalization: str) -> float:
    """One MMA step: ``c + sum(products)`` with alignment truncation to ``bits`` bits, normalised to float32.

    >>> mma_step(1.0, [Fraction(1, 2**24)], bits=24, normalization="truncate")
    1.0
    >>> mma_step(1.0, [Fraction(1, 2**23)], bits=24, normalization="truncate") == 1 + 2**-23
    True
    """
    _check(bits, normalization)
    if not math.isfinite(c):
        raise ValueError(f"mma_step: c={c!r} must be finite")
    addends = [Fraction(c)] + [Fraction(p) for p in products]
    nonzero = [x for x in addends if x != 0]
    if not nonzero:
        return 0.0
    E = max(_floor_log2(abs(x)) for x in nonzero)
    unit = Fraction(2) ** (E - bits + 1)
    total = sum((_trunc_to(x, unit) for x in nonzero), Fraction(0))
    return float32_from_fraction(total, normalization)


def exact_dot(a: list[float], b: list[float]) -> Fraction:
    """sum a[i] * b[i], exactly."""
    if len(a) != len(b):
        raise ValueError(f"exact_dot: len(a)={len(a)} and len(b)={len(b)} must match")
    return sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a, b)), Fraction(0))


# ---- the fast path: every value is an int N standing for N * 2**L, one L per dot product ----

def _ratio(x: float) -> tuple[int, int]:
    """(n, e) with x == n * 2**e exactly (e = 0 for zero)."""
    if not math.isfinite(x):
        raise ValueError(f"mma: input {x!r} must be finite")
    num, den = float(x).as_integer_ratio()
    return num, -(den.bit_length() - 1)


def _step_int(c: int, products: list[int], L: int, bits: int, nearest: bool) -> int:
    """One step on ints scaled by 2**L (L <= -149, so c's value is an int too); returns the float32 as an int."""
    top = abs(c).bit_length()
    for p in products:
        top = max(top, abs(p).bit_length())
    if top == 0:
        return 0
    # E = top - 1 + L; the truncation unit 2**(E - bits + 1) is 2**shift in units of 2**L.
    shift = top - bits
    if shift > 0:
        total = (c >> shift if c >= 0 else -((-c) >> shift))
        for p in products:
            total += p >> shift if p >= 0 else -((-p) >> shift)
        total <<= shift
    else:
        total = c + sum(products)
    return _normalise_int(total, L, nearest)


def _normalise_int(total: int, L: int, nearest: bool) -> int:
    if total == 0:
        return 0
    a = abs(total)
    e = max(a.bit_length() - 1 + L, _EMIN32)
    s = (e - _P32 + 1) - L  # the float32 spacing at e, in units of 2**L
    if s > 0:
        n = a >> s
        if nearest:
            rest = a - (n << s)
            half = 1 << (s - 1)
            if rest > half or (rest == half and n & 1):
                n += 1
        a = n << s
    if a.bit_length() - 1 + L >= _EOVER32:
        raise _Overflow(total > 0)
    return a if total > 0 else -a


class _Overflow(Exception):
    """A step's sum does not fit float32: the accumulator becomes inf and stays so."""

    def __init__(self, positive: bool) -> None:
        super().__init__(positive)
        self.value = math.inf if positive else -math.inf


def _dot_int(terms: list[tuple[int, int]], block: int, bits: int, nearest: bool) -> float:
    """A chain of steps from zero over exact products given as (n, e) pairs."""
    L = min([_QMIN32] + [e for n, e in terms if n])
    ints = [n << (e - L) for n, e in terms]
    c = 0
    try:
        for start in range(0, len(ints), block):
            c = _step_int(c, ints[start:start + block], L, bits, nearest)
    except _Overflow as overflow:
        return overflow.value
    # c < 2**128 in units of 2**L with at most 24 significant bits: ldexp is exact.
    return math.ldexp(c, L) if c else 0.0


def _tc_dot_ratios(ra: list[tuple[int, int]], rb: list[tuple[int, int]], block: int, bits: int,
                   normalization: str, promote: int | None) -> float:
    terms = [(na * nb, ea + eb) for (na, ea), (nb, eb) in zip(ra, rb)]
    nearest = normalization == "nearest"
    if promote is None or promote >= len(terms):
        return _dot_int(terms, block, bits, nearest)
    acc = np.float32(0.0)
    with np.errstate(over="ignore"):
        for start in range(0, len(terms), promote):
            acc = acc + np.float32(_dot_int(terms[start:start + promote], block, bits, nearest))
    return float(acc)


def tc_dot(a: list[float], b: list[float], *, block: int, bits: int, normalization: str = "truncate",
           promote: int | None = None) -> float:
    """sum a[i] * b[i] as the tensor core computes it: a chain of ``mma_step`` over blocks of ``block``.

    >>> tc_dot([1.0] + [2.0**-25] * 4, [1.0] * 5, block=4, bits=24)
    1.0
    >>> tc_dot([2.0**-25] * 4 + [1.0], [1.0] * 5, block=4, bits=24) == 1 + 2**-23
    True
    """
    _check(bits, normalization, block, promote)
    if len(a) != len(b):
        raise ValueError(f"tc_dot: len(a)={len(a)} and len(b)={len(b)} must match")
    return _tc_dot_ratios([_ratio(x) for x in a], [_ratio(y) for y in b], block, bits, normalization, promote)


def tc_matmul(A: np.ndarray, B: np.ndarray, *, block: int, bits: int, normalization: str = "truncate",
              promote: int | None = None) -> np.ndarray:
    """A @ B (float32 result) with every element a ``tc_dot`` of a row of A and a column of B."""
    _check(bits, normalization, block, promote)
    A64 = np.asarray(A).astype(np.float64)
    B64 = np.asarray(B).astype(np.float64)
    if A64.ndim != 2 or B64.ndim != 2 or A64.shape[1] != B64.shape[0]:
        raise ValueError(f"tc_matmul: A.shape={A64.shape} and B.shape={B64.shape} must be (M, K) and (K, N)")
    rows = [[_ratio(x) for x in row] for row in A64.tolist()]
    cols = [[_ratio(y) for y in col] for col in B64.T.tolist()]
    out = np.empty((A64.shape[0], B64.shape[1]), dtype=np.float32)
    for i, ra in enumerate(rows):
        for j, rb in enumerate(cols):
            out[i, j] = _tc_dot_ratios(ra, rb, block, bits, normalization, promote)
    return out
