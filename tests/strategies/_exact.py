"""Exact arithmetic for the strategy tests, written independently of the package.

Values are taken as exact Fractions; the exact result of an op at one output
element is computed from the case's arrays, and classified against a format
using only its precision and exponent range.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np

from exactref.formats import part_of

from ..exactref.oracle import floor_log2


def ulp(fmt: Any, v: Fraction) -> Fraction:
    """The spacing of fmt's values at |v| (gradual underflow below 2**emin)."""
    e = fmt.emin if v == 0 else max(floor_log2(abs(v)), fmt.emin)
    return Fraction(2) ** (e - fmt.p + 1)


def max_finite(fmt: Any) -> Fraction:
    return (Fraction(2) ** fmt.p - 1) * Fraction(2) ** (fmt.emax - fmt.p + 1)


def classify(v: Fraction, terms: list[Fraction], fmt: Any) -> set[str]:
    """Which hard-case classes the exact value v (the sum of ``terms``) belongs to in ``fmt``."""
    out = set()
    if abs(v) <= max_finite(fmt):
        u = ulp(fmt, v)
        r = v / u
        offset = abs((r - math.floor(r)) - Fraction(1, 2))
        if offset == 0:
            out.add("tie")
        elif offset * 8 <= 1:
            out.add("near_tie")
    magnitude = sum((abs(t) for t in terms), Fraction(0))
    if (v == 0 and magnitude > 0) or (v != 0 and magnitude >= 2 ** math.ceil(fmt.p / 2) * abs(v)):
        out.add("cancellation")
    return out


def _parts(z: Any) -> tuple[Fraction, Fraction]:
    z = complex(z)
    return Fraction(z.real), Fraction(z.imag)


def product_terms(factors: list[Any], part: str | None) -> list[Fraction]:
    """The real terms that make up part ``part`` of the product of ``factors`` (complex expanded).

    Each factor contributes its real or its imaginary part; k imaginary picks
    carry i**k, which lands in the real part (sign (-1)**(k/2)) for even k.
    """
    want = 1 if part == "imag" else 0
    terms = []
    for picks in itertools.product((0, 1), repeat=len(factors)):
        k = sum(picks)
        if k % 2 != want:
            continue
        value = Fraction(1 if (k // 2) % 2 == 0 else -1)
        for f, pick in zip(factors, picks):
            value *= _parts(f)[pick]
        if value:
            terms.append(value)
    return terms


def _at(a: Any, shape: tuple[int, ...], index: tuple[int, ...]) -> Any:
    """The element of a broadcast to ``shape`` at ``index`` (a Python scalar stays itself)."""
    if not isinstance(a, np.ndarray):
        return a
    return np.broadcast_to(a, shape)[index]


def exact_terms(case: Any, index: tuple[int, ...], part: str | None) -> list[Fraction]:
    """The exact terms whose sum is the op's output at ``index`` (one part for complex)."""
    op = case.op
    if op in ("add", "multiply"):
        out = np.broadcast_shapes(np.shape(case.x), np.shape(case.y))
        x, y = _at(case.x, out, index), _at(case.y, out, index)
        if op == "multiply":
            return product_terms([x, y], part)
        return product_terms([x], part) + product_terms([case.alpha, y], part)
    if op == "sum":
        x = case.x
        axes = tuple(range(x.ndim)) if case.axis is None else \
            tuple(sorted({a % max(x.ndim, 1) for a in ((case.axis,) if isinstance(case.axis, int) else case.axis)}))
        axes = axes if x.ndim else ()
        kept = [a for a in range(x.ndim) if a not in axes]
        fixed = {a: index[a] if case.keepdims else index[kept.index(a)] for a in kept}
        sel = tuple(fixed[a] if a in fixed else slice(None) for a in range(x.ndim))
        terms: list[Fraction] = []
        for v in np.asarray(x[sel]).reshape(-1):
            terms += product_terms([v], part)
        return terms
    if op in ("matmul", "gemm"):
        A, B = case.A, case.B
        A2 = A if A.ndim >= 2 else A[None, :]
        B2 = B if B.ndim >= 2 else B[:, None]
        batch = np.broadcast_shapes(A2.shape[:-2], B2.shape[:-2])
        nb = len(batch)
        b_idx, rest = index[:nb], list(index[nb:])
        i = rest.pop(0) if A.ndim >= 2 else 0
        j = rest.pop(0) if B.ndim >= 2 else 0
        row = np.broadcast_to(A2, batch + A2.shape[-2:])[b_idx + (i,)]
        col = np.broadcast_to(B2, batch + B2.shape[-2:])[b_idx + (slice(None), j)]
        scale = [case.alpha] if op == "gemm" else []
        terms = []
        for a, b in zip(row, col):
            terms += product_terms(scale + [a, b], part)
        if op == "gemm" and case.beta != 0:
            out = batch + ((A2.shape[-2],) if A.ndim >= 2 else ()) + ((B2.shape[-1],) if B.ndim >= 2 else ())
            terms += product_terms([case.beta, _at(case.C, out, index)], part)
        return terms
    raise ValueError(op)


def hard_kinds_hold(case: Any) -> list[tuple[Any, set[str]]]:
    """For each of the case's hard cases, the classes that really hold there."""
    fmt = part_of(case.format)
    out = []
    for h in case.hard:
        terms = exact_terms(case, h.index, h.part)
        out.append((h, classify(sum(terms, Fraction(0)), terms, fmt)))
    return out
