"""Exact, correctly rounded sums of products: the engine behind every rational op.

An output part (a real output, or the real or imaginary part of a complex
one) is a list of *terms*, each contributing ``coef * (sum of products)``:

* :class:`MatmulTerm`: ``coef * (A @ B)`` with batch broadcasting;
* :class:`RowTerm`: ``coef * sum_k X[..., k] * Y[..., k]`` (Y may be None).

:func:`solve` encloses every element with the float64 fast path, decides the
rounding where the enclosure allows it, and computes the rest exactly with
integer arithmetic (:mod:`.exact`).  :func:`specials` gives the IEEE special
values (NaN, +-inf) an evaluation of the same terms produces where an input
is not finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..formats import Format
from ..rounding import decide, enclosure_bounds, round_dyadic, round_dyadic_down_up, round_float64
from . import fast
from .exact import exact_dot_rows, round_rows

__all__ = ["MatmulTerm", "RowTerm", "Solution", "exact_values", "solve", "specials"]

# Sums longer than this take the BLAS path even when they come as rows.
_SHORT_ROW = 8


@dataclass
class MatmulTerm:
    """``coef * (A @ B)`` for float64 arrays (..., M, K) and (..., K, N) holding exact values."""

    coef: float
    A: np.ndarray
    B: np.ndarray
    narrow: bool = True  # every value has at most 26 significant bits

    @property
    def out_shape(self) -> tuple[int, ...]:
        batch = np.broadcast_shapes(self.A.shape[:-2], self.B.shape[:-2])
        return batch + (self.A.shape[-2], self.B.shape[-1])

    @property
    def length(self) -> int:
        return self.A.shape[-1]

    def enclose(self, shape: tuple[int, ...]) -> fast.Enclosure:
        return fast.matmul_narrow(self.A, self.B) if self.narrow else fast.matmul_sliced(self.A, self.B)

    def gather(self, idx: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        *batch, i, j = np.unravel_index(idx, shape)
        a_batch = _batch_index(batch, self.A.shape[:-2], len(shape) - 2)
        b_batch = _batch_index(batch, self.B.shape[:-2], len(shape) - 2)
        X = self.A[a_batch + (i, slice(None))]
        # Index B's columns through its transpose so that the advanced indices stay adjacent.
        Y = np.swapaxes(self.B, -1, -2)[b_batch + (j, slice(None))]
        K = self.A.shape[-1]
        return X.reshape(idx.size, K), Y.reshape(idx.size, K)

    def special(self) -> np.ndarray:
        return _sign_class(self.A) @ _sign_class(self.B)


@dataclass
class RowTerm:
    """``coef * sum_k X[..., k] * Y[..., k]``; X and Y broadcast to (..., T)."""

    coef: float
    X: np.ndarray
    Y: np.ndarray | None = None
    narrow: bool = True  # every value has at most 26 significant bits

    def shape_with(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape + (self.X.shape[-1],)

    @property
    def length(self) -> int:
        return self.X.shape[-1]

    def enclose(self, shape: tuple[int, ...]) -> fast.Enclosure:
        X = np.broadcast_to(self.X, self.shape_with(shape))
        Y = None if self.Y is None else np.broadcast_to(self.Y, self.shape_with(shape))
        if X.shape[-1] <= _SHORT_ROW:
            return fast.rowdot(X, Y)
        if Y is None:
            Y = np.ones(X.shape[-1:])
        enc = (fast.matmul_narrow if self.narrow else fast.matmul_sliced)(X[..., None, :], Y[..., :, None])
        return fast.Enclosure(*(v[..., 0, 0] for v in (enc.hi, enc.lo, enc.rad, enc.S)))

    def gather(self, idx: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        full = self.shape_with(shape)
        rows = (int(np.prod(shape, dtype=np.int64)), full[-1])
        X = np.broadcast_to(self.X, full).reshape(rows)[idx]
        Y = None if self.Y is None else np.broadcast_to(self.Y, full).reshape(rows)[idx]
        return X, Y

    def special(self, shape: tuple[int, ...]) -> np.ndarray:
        X = np.broadcast_to(_sign_class(self.X), self.shape_with(shape))
        if self.Y is None:
            return X.sum(axis=-1)
        return np.einsum("...k,...k->...", X, np.broadcast_to(_sign_class(self.Y), X.shape))


Term = MatmulTerm | RowTerm


def _batch_index(batch: list[np.ndarray], own: tuple[int, ...], ndim: int) -> tuple:
    """Index an operand's batch dims from broadcast batch indices (size-1 dims stay at 0)."""
    lead = ndim - len(own)
    return tuple(np.zeros_like(b) if n == 1 else b for b, n in zip(batch[lead:], own))


def _sign_class(x: np.ndarray) -> np.ndarray:
    # Finite nonzero values become +-1 so that sums cannot overflow, while
    # 0, inf and NaN keep their IEEE behaviour in products and sums.
    return np.where(np.isfinite(x), np.sign(x), x)


@dataclass
class Solution:
    """The rounded exact values of one part, float64 bounds on them, and sum|terms| for tolerances."""

    rounded: np.ndarray
    x_lo: np.ndarray
    x_hi: np.ndarray
    S: np.ndarray
    undecided: int


def _enclose(term: Term, shape: tuple[int, ...]) -> fast.Enclosure:
    enc = term.enclose(shape)
    return fast.Enclosure(*(np.broadcast_to(v, shape) for v in (enc.hi, enc.lo, enc.rad, enc.S)))


def enclose(terms: list[Term], shape: tuple[int, ...]) -> fast.Enclosure:
    """The fast-path enclosure of ``sum(coef * term)`` and the bound S on sum|coef * products|."""
    # A term with a zero coefficient is exactly zero (its inputs are finite here),
    # and enclosing it could only bring 0 * inf into the bounds.
    terms = [t for t in terms if t.coef != 0]
    if not terms:
        z = np.zeros(shape)
        return fast.Enclosure(z, z.copy(), z.copy(), z.copy())
    encs = [(t.coef, _enclose(t, shape)) for t in terms]
    if len(encs) == 1 and encs[0][0] == 1.0:
        return encs[0][1]
    parts: list[np.ndarray] = []
    rad = np.zeros(shape)
    S = np.zeros(shape)
    unsafe = np.zeros(shape, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        for coef, enc in encs:
            c = np.float64(coef)
            for v in (enc.hi, enc.lo):
                p, e, safe = fast.two_prod(c, v)
                parts += [p, e]
                unsafe |= ~safe
            rad = rad + abs(coef) * enc.rad
            S = S + abs(coef) * enc.S
        hi, lo, r = fast.combine(parts, fast.up(rad))
        S = fast.up(S)
    return fast.Enclosure(hi, lo, np.where(unsafe, np.inf, r), S)


def solve(terms: list[Term], shape: tuple[int, ...], fmt: Format) -> Solution:
    """Round ``sum(coef * term)`` to ``fmt`` element by element, exactly."""
    enc = enclose(terms, shape)
    x_lo, x_hi = enclosure_bounds(enc.hi, enc.lo, enc.rad, tight=fmt.p == 53)
    rounded, decided = decide(enc.hi, enc.lo, enc.rad, fmt, bounds=(x_lo, x_hi))
    rounded = np.array(rounded, dtype=np.float64).reshape(shape)
    x_lo = np.array(x_lo, dtype=np.float64).reshape(shape)
    x_hi = np.array(x_hi, dtype=np.float64).reshape(shape)
    idx = np.flatnonzero(~np.asarray(decided))
    if idx.size:
        _exact_round(terms, shape, idx, fmt, rounded.reshape(-1), x_lo.reshape(-1), x_hi.reshape(-1))
    return Solution(rounded, x_lo, x_hi, np.asarray(enc.S, dtype=np.float64).reshape(shape), idx.size)


def _exact_round(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray, fmt: Format,
                 flat_r: np.ndarray, flat_lo: np.ndarray, flat_hi: np.ndarray) -> None:
    """Fill in the correctly rounded values, and float64 bounds, of the elements ``idx``.

    Rows whose products split exactly into float64 pieces are summed with
    math.fsum; the rest (products underflowing or overflowing float64) go
    through the integer accumulator.
    """
    pieces, safe = _pieces(terms, shape, idx)
    value, lo, hi, ok = round_rows(pieces[safe], fmt.p)
    done = np.flatnonzero(safe)[ok]
    value, lo, hi = value[ok], lo[ok], hi[ok]
    if fmt.p != 53:
        value = round_float64(value, fmt)
    zero = (lo == 0) & (hi == 0)
    if zero.any():
        negzero = _all_negative_zero(terms, shape, idx[done[zero]])
        value[zero] = np.where(negzero, -0.0, 0.0)
    flat_r[idx[done]], flat_lo[idx[done]], flat_hi[idx[done]] = value, lo, hi
    rest = np.setdiff1d(np.arange(idx.size), done)
    if rest.size:
        values = exact_values(terms, shape, idx[rest])
        negzero = _all_negative_zero(terms, shape, idx[rest])
        for k, (n, e) in enumerate(values):
            i = idx[rest[k]]
            flat_r[i] = round_dyadic(n, e, fmt, negative_zero=bool(negzero[k]))
            flat_lo[i], flat_hi[i] = round_dyadic_down_up(n, e)


def _pieces(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 pieces whose row sums are the exact values of ``idx``, and which rows split safely."""
    cols: list[np.ndarray] = []
    safe = np.ones(idx.size, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for term in terms:
            if term.coef == 0:
                continue
            X, Y = term.gather(idx, shape)
            if Y is None:
                parts = [X]
            elif term.narrow:
                parts = [X * Y]  # exact: at most 26 significant bits each, far from underflow
            else:
                p, e, ok = fast.two_prod(X, Y)
                parts = [p, e]
                safe &= ok.all(axis=1)
            if term.coef != 1:
                scaled = []
                for v in parts:
                    p, e, ok = fast.two_prod(np.float64(term.coef), v)
                    scaled += [p, e]
                    safe &= ok.all(axis=1)
                parts = scaled
            cols += parts
    pieces = np.concatenate(cols, axis=1) if cols else np.zeros((idx.size, 0))
    safe &= np.isfinite(pieces).all(axis=1)
    return pieces, safe


def exact_values(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> list[tuple[int, int]]:
    """Exact ``(n, e)`` with value ``n * 2**e`` for the flat indices ``idx``."""
    totals = [(0, 0)] * idx.size
    for term in terms:
        if term.coef == 0:
            continue
        X, Y = term.gather(idx, shape)
        sums = exact_dot_rows(X, Y)
        cm, ce = _dyadic(term.coef)
        totals = [_add(t, (n * cm, e + ce)) for t, (n, e) in zip(totals, sums)]
    return totals


def exact_fraction(terms: list[Term], shape: tuple[int, ...], flat_index: int) -> Fraction:
    (n, e), = exact_values(terms, shape, np.array([flat_index]))
    return Fraction(n) * Fraction(2) ** e


def _dyadic(x: float) -> tuple[int, int]:
    m, e = math.frexp(x)
    return int(m * (1 << 53)), e - 53


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    (n1, e1), (n2, e2) = a, b
    if n1 == 0:
        return b
    if n2 == 0:
        return a
    if e1 <= e2:
        return n1 + (n2 << (e2 - e1)), e1
    return (n1 << (e1 - e2)) + n2, e2


def _all_negative_zero(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> np.ndarray:
    """Whether every product of the element is a zero with a minus sign (IEEE then sums to -0)."""
    result = np.ones(idx.size, dtype=bool)
    seen = np.zeros(idx.size, dtype=bool)
    for term in terms:
        X, Y = term.gather(idx, shape)
        zero = (X == 0) | (term.coef == 0)
        sign = np.signbit(X) ^ bool(np.signbit(term.coef))
        if Y is not None:
            zero |= Y == 0
            sign ^= np.signbit(Y)
        result &= np.all(zero & sign, axis=1)
        seen |= X.shape[1] > 0
    return result & seen


def specials(terms: list[Term], shape: tuple[int, ...]) -> np.ndarray:
    """float64 array: NaN or +-inf where an IEEE evaluation of the terms gives one, 0 elsewhere."""
    total = np.zeros(shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for term in terms:
            s = term.special() if isinstance(term, MatmulTerm) else term.special(shape)
            total = total + np.float64(math.copysign(1.0, term.coef) if term.coef else 0.0) * s
    return np.where(np.isfinite(total), 0.0, total)
