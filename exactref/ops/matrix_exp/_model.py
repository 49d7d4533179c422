"""The tolerance model of ``torch.linalg.matrix_exp``: a running error bound through PyTorch's algorithm.

PyTorch (``aten/src/ATen/native/LinearAlgebra.cpp``, ``mexp``) evaluates one
of the Bader-Blanes-Casas Taylor schemes T1, T2, T4, T8, T12 or T18, chosen by
the 1-norm of A, and for T18 first scales A by ``2**-s`` and squares the
result s times.  A batch of more than one matrix always takes T18 with
scaling.  This module runs that exact sequence of matrix products, linear
combinations and additions on *bounds* instead of values.

Every intermediate matrix X of the algorithm carries three arrays:

* ``M >= |X|`` elementwise, where X is the value the algorithm would compute
  in exact arithmetic (with PyTorch's own constants, rounded to the format
  as PyTorch rounds them);
* ``D >= |X_computed - X|``, the accumulated rounding error;
* ``O``: the computed entry may be NaN or infinite because some partial
  result it depends on may have overflowed.

The rules (u the unit roundoff of the format, gamma_k = k u / (1 - k u),
Higham's Lemma 3.1, H = M + D the bound on the computed magnitudes):

* product Z = X Y of n x n matrices, any summation order, with or without
  FMA: ``D_Z = D_X H_Y + M_X D_Y + g_n H_X H_Y`` with ``g_n = gamma_n`` for
  real formats and ``sqrt(2) gamma_2n`` for complex ones (each part of a
  complex dot product is a real dot product of 2n terms bounded by
  ``|x||y|``); half formats accumulate in float32 and round once:
  ``g_n = u + (1 + u) gamma_n(float32)``;
* linear combination ``Z = sum_k c_k X_k`` of m matrices, which PyTorch's
  ``_compute_linear_combination`` accumulates one term at a time:
  ``D_Z = sum |c_k| D_k + gamma_(m+1) sum |c_k| H_k`` (m roundings, plus one
  to spare for a constant that differs from ours in its last bit);
* addition: ``D_Z = D_X + D_Y + u (H_X + H_Y)``;
* every rounding that may underflow adds half the smallest subnormal, only
  where the entry is not structurally zero.

After the polynomial, the truncation error of the scheme is added: the
exact-arithmetic polynomial P(x) = sum p_k x^k that the scheme evaluates is
computed once in rational arithmetic from PyTorch's constants, and
``|P(B) - exp(B)| <= sum_k |p_k - 1/k!| |B|^k`` elementwise (plus a tail
bound past degree 40).  The squaring phase then runs the product rule with
``M >= |exp(B)^(2^j)|``, starting from ``M = min(M_P + R, exp(|B|))`` (the
scheme's coefficients have mixed signs, so its own M can exceed exp(|B|)
several times, and the squarings would raise that to the power 2**s); the
final D bounds ``|computed - exp(A)|``.
That starting M is also capped by exp(W), W = |B| off the diagonal and
Re(b_ii) on it (``_exp_majorant``), so a negative diagonal stays small
through the squarings.  All bound arithmetic is float64 rounded upward, with
0 * inf taken as 0 in its products (``_mm``: a zero bound is an exact zero of
the kernel), so an overflow in one block of A neither reaches another block
nor a structural zero.  Where it overflows the tolerance is infinite, and
``_log2_squarings`` reruns the squarings on rescaled bounds to give log2 of
it, so that op.py can reject finite values for exact values past the range.
The derivation is on ``docs/matrix-exp.md``.

PyTorch picks the scheme and s from the 1-norm it computes in the format;
that norm can differ from the exact one by a relative gamma_(n+2), so every
(degree, s) that such a norm could select is evaluated and the largest
bound is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

import numpy as np

from ...engine.fast import gamma
from ...formats import FLOAT32, FLOAT64, Format
from ...rounding import next_up, round_float64

__all__ = ["DEGREES", "Scheme", "mexp_tolerance", "scheme_constants", "select"]

DEGREES = (1, 2, 4, 8, 12, 18)

# thetas_float and thetas_double of mexp: the largest 1-norm each degree is used for.
_THETAS_FLOAT = (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                 5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00)
_THETAS_DOUBLE = (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                  4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00)

# compute_T12's and compute_T18's coefficient tables, as PyTorch writes them.
_B12 = (
    (9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
    (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
    (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
    (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359),
)
_B18 = (
    (0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.),
    (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04),
    (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05),
    (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05),
    (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05),
)

# Past this degree the truncation error is bounded by a tail formula.
_TAIL_DEGREE = 40
# More squarings than this overflow every float64 bound anyway.
_MAX_SQUARINGS = 1100


@dataclass(frozen=True, eq=False)
class Scheme:
    """The constants one format's instantiation of mexp uses (one object per format: compared by identity).

    ``kind`` is "float" (float32 and complex64: ``mexp_impl<float>``),
    "double" (float64 and complex128), or the name of a half format, for
    which PyTorch takes the double branch; the half model rounds the double
    constants to the format, as a working half instantiation would.
    """

    kind: str
    thetas: tuple[float, ...]
    t4: tuple[float, ...]
    t8: dict
    b12: tuple[tuple[float, ...], ...]
    b18: tuple[tuple[float, ...], ...]


def _t8_constants(rnd: Callable[[float], float]) -> dict:
    """compute_T8's constexpr constants: scalar_t values combined in double, then rounded to scalar_t.

    PyTorch's x7 divides by ``5040 x3``; Bader, Blanes and Casas divide by
    ``5040 x3**2``.  With PyTorch's value T8 agrees with the Taylor
    polynomial only up to degree 4, so its truncation error is far above a
    unit roundoff near the top of its norm range.  The model reproduces
    PyTorch, so that error is in the tolerance.
    """
    s177 = rnd(0.1330413469565007072504e+2)
    x3 = rnd(2.0 / 3.0)
    return {
        "x1": rnd(x3 * ((1.0 + s177) / 88.0)),
        "x2": rnd(x3 * ((1.0 + s177) / 352.0)),
        "x3": x3,
        "x4": rnd((-271.0 + 29.0 * s177) / (315.0 * x3)),
        "x5": rnd((-11.0 + 11.0 * s177) / (1260.0 * x3)),
        "x6": rnd((-99.0 + 11.0 * s177) / (5040.0 * x3)),
        "x7": rnd((89.0 - s177) / (5040.0 * x3)),
        "y2": rnd((857.0 - 58.0 * s177) / 630.0),
    }


@cache
def scheme_constants(fmt: Format) -> Scheme:
    """The constants mexp uses for matrices of real format ``fmt`` (the part format for complex)."""
    if fmt == FLOAT32:
        kind = "float"

        def rnd(x: float) -> float:
            return float(np.float32(x))
        thetas = tuple(rnd(t) for t in _THETAS_FLOAT)
    elif fmt == FLOAT64:
        kind = "double"

        def rnd(x: float) -> float:
            return float(x)
        thetas = _THETAS_DOUBLE
    else:
        kind = fmt.name

        def rnd(x: float) -> float:
            return float(round_float64(np.asarray(float(x)), fmt))
        thetas = _THETAS_DOUBLE
    return Scheme(kind, thetas, (rnd(1 / 2.0), rnd(1 / 6.0), rnd(1 / 24.0)), _t8_constants(rnd),
                  tuple(tuple(rnd(x) for x in row) for row in _B12),
                  tuple(tuple(rnd(x) for x in row) for row in _B18))


def _evaluate(degree: int, k: Scheme, ops: _Ops, A: object) -> object:
    """Run compute_T<degree> of mexp on A with the arithmetic ``ops`` (exact polynomials or bounds)."""
    I = ops.eye()
    if degree == 1:
        return ops.lincomb((1.0, 1.0), (I, A))
    A2 = ops.mm(A, A)
    if degree == 2:
        # As[2] /= 2, then As.sum(0): the halving is exact, the sum rounds.
        return ops.lincomb((1.0, 1.0, 0.5), (I, A, A2))
    if degree == 4:
        P = ops.mm(A2, ops.lincomb(k.t4, (I, A, A2)))
        return ops.lincomb((1.0, 1.0, 0.0, 1.0), (I, A, A2, P))
    if degree == 8:
        c = k.t8
        A4 = ops.mm(A2, ops.lincomb((c["x1"], c["x2"]), (A, A2)))
        A8 = ops.mm(ops.lincomb((c["x3"], 1.0), (A2, A4)),
                    ops.lincomb((c["x4"], c["x5"], c["x6"], c["x7"]), (I, A, A2, A4)))
        return ops.lincomb((1.0, 1.0, c["y2"], 0.0, 1.0), (I, A, A2, A4, A8))
    A3 = ops.mm(A, A2)
    if degree == 12:
        As = (I, A, A2, A3)
        Bs = [ops.lincomb(row, As) for row in k.b12]
        A6 = ops.add(Bs[2], ops.mm(Bs[3], Bs[3]))
        return ops.add(Bs[0], ops.mm(ops.add(Bs[1], A6), A6))
    A6 = ops.mm(A3, A3)
    As = (I, A, A2, A3, A6)
    Bs = [ops.lincomb(row, As) for row in k.b18]
    A9 = ops.add(Bs[3], ops.mm(Bs[0], Bs[4]))
    return ops.add(Bs[1], ops.mm(ops.add(Bs[2], A9), A9))


class _Ops:
    """The arithmetic a scheme runs on: exact polynomials, or error bounds."""

    def eye(self) -> object: ...
    def mm(self, X: object, Y: object) -> object: ...
    def lincomb(self, coefs: Sequence[float], Xs: Sequence[object]) -> object: ...
    def add(self, X: object, Y: object) -> object: ...


class _PolyOps(_Ops):
    """Exact polynomials in one variable: coefficient lists of Fractions."""

    def eye(self) -> list[Fraction]:
        return [Fraction(1)]

    def mm(self, X: list[Fraction], Y: list[Fraction]) -> list[Fraction]:
        out = [Fraction(0)] * (len(X) + len(Y) - 1)
        for i, x in enumerate(X):
            if x:
                for j, y in enumerate(Y):
                    out[i + j] += x * y
        return out

    def lincomb(self, coefs: Sequence[float], Xs: Sequence[list[Fraction]]) -> list[Fraction]:
        out = [Fraction(0)] * max(len(X) for X in Xs)
        for c, X in zip(coefs, Xs):
            for i, x in enumerate(X):
                out[i] += Fraction(c) * x
        return out

    def add(self, X: list[Fraction], Y: list[Fraction]) -> list[Fraction]:
        return self.lincomb((1.0, 1.0), (X, Y))


@cache
def truncation_coefficients(k: Scheme, degree: int) -> tuple[float, ...]:
    """Upper bounds of |p_j - 1/j!| for j = 0.._TAIL_DEGREE, P the polynomial compute_T<degree> evaluates."""
    p = _evaluate(degree, k, _PolyOps(), [Fraction(0), Fraction(1)])
    out = []
    for j in range(_TAIL_DEGREE + 1):
        d = abs((p[j] if j < len(p) else 0) - Fraction(1, math.factorial(j)))
        out.append(float(next_up(np.float64(float(d)))) if d else 0.0)
    return tuple(out)


def _mm(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """``X @ Y`` for nonnegative bounds, with 0 * inf taken as 0.

    A zero bound H (or M, or D) is an entry the kernel computes as exactly 0
    (where it computes a finite value at all; a non-finite one is O's
    business), and a finite value times an exact 0 is an exact 0.  So a bound
    that overflowed to inf in one block of A does not spill into another.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        Xi, Yi = np.isinf(X), np.isinf(Y)
        if not (Xi.any() or Yi.any()):
            return X @ Y
        P = np.where(Xi, 0.0, X) @ np.where(Yi, 0.0, Y)
        hit = Xi.astype(np.float64) @ (Y > 0).astype(np.float64) + (X > 0).astype(np.float64) @ Yi.astype(np.float64)
        return np.where(hit > 0, np.inf, P)


@dataclass
class _Bound:
    M: np.ndarray  # >= |exact-arithmetic value|
    D: np.ndarray  # >= |computed - exact-arithmetic value|
    O: np.ndarray  # computed entry may be non-finite

    @property
    def H(self) -> np.ndarray:
        return self.M + self.D


def _half_spacing(fmt: Format) -> float:
    """The most one rounding among the subnormals costs, rounded up to a float64."""
    # Half of float64's own smallest subnormal is 0 in float64; the bound must not be.
    return max(fmt.min_subnormal / 2, FLOAT64.min_subnormal)


class _BoundOps(_Ops):
    """The rounding error rules of one format's arithmetic on n x n matrices."""

    def __init__(self, fmt: Format, complex_: bool, n: int) -> None:
        self.n = n
        self.u = fmt.unit_roundoff
        eta = _half_spacing(fmt)
        root2 = math.sqrt(2) * (1 + 2.0 ** -50)
        self.cplx = root2 if complex_ else 1.0
        if fmt.p < FLOAT32.p:
            # Products of half values are exact in float32; the sum is rounded once to the format.
            self.g_mm = self.u + (1 + self.u) * gamma(n, FLOAT32.unit_roundoff)
            self.eta_mm = eta
        elif complex_:
            self.g_mm = root2 * gamma(2 * n, self.u)
            self.eta_mm = root2 * 2 * n * eta
        else:
            self.g_mm = gamma(n, self.u)
            self.eta_mm = n * eta
        self.eta = eta
        self.big = fmt.max_finite
        # Float64 rounding of the bound arithmetic itself, for sums of up to 2n nonnegative terms.
        self.fudge = 1 + (4 * n + 32) * 2.0 ** -52
        self.tiny = 2 * n * FLOAT64.min_subnormal
        self.I = np.eye(n)
        self.no = np.zeros((n, n), dtype=bool)

    def _clean(self, D: np.ndarray) -> np.ndarray:
        # NaN only arises from 0 * inf among nonnegative bounds: no bound is known there.
        return np.where(np.isnan(D), np.inf, D * self.fudge)

    def eye(self) -> _Bound:
        return _Bound(self.I, np.zeros((self.n, self.n)), self.no)

    def mm(self, X: _Bound, Y: _Bound, unit: int = 0) -> _Bound:
        """Z = X Y; ``unit``: X and Y are bounds divided by 2**(unit / 2), so Z is one divided by 2**unit."""
        tiny, eta_mm = _in_units(self.tiny, unit), _in_units(self.eta_mm, unit)
        with np.errstate(over="ignore", invalid="ignore"):
            HX, HY = X.H, Y.H
            S = _mm(HX, HY) * self.fudge
            # Where the float64 bound S underflows to 0 the kernel's sum may still round: test
            # for a nonzero term structurally, not by S.
            reach = ((HX > 0).astype(np.float64) @ (HY > 0).astype(np.float64)) > 0
            # The float64 products of M may underflow to 0 where |X Y| is not 0.
            M = _mm(X.M, Y.M) * self.fudge + np.where(reach, tiny, 0.0)
            D = _mm(X.D, HY) + _mm(X.M, Y.D) + self.g_mm * S + np.where(reach, eta_mm, 0.0)
            # A non-finite entry of X spoils its whole row of the product, one of Y its column.
            O = X.O.any(axis=-1)[:, None] | Y.O.any(axis=-2)[None, :] | (S * (1 + self.g_mm) >= self.big)
        return _Bound(M, self._clean(D), O)

    def lincomb(self, coefs: Sequence[float], Xs: Sequence[_Bound]) -> _Bound:
        m = len(coefs)
        g = gamma(m + 1, self.u)
        with np.errstate(over="ignore", invalid="ignore"):
            S = sum(abs(c) * X.H for c, X in zip(coefs, Xs) if c) * self.fudge
            M = sum(abs(c) * X.M for c, X in zip(coefs, Xs) if c) * self.fudge
            # abs(c) * X.H can underflow to 0 in the bound while c * x still rounds in the kernel.
            reach = np.logical_or.reduce([X.H > 0 for c, X in zip(coefs, Xs) if c] or [np.zeros_like(S, dtype=bool)])
            D = sum(abs(c) * X.D for c, X in zip(coefs, Xs) if c) + g * S \
                + np.where(reach, (m + 1) * self.eta * self.cplx, 0.0)
            # A zero coefficient still multiplies: 0 * inf is NaN.
            O = np.logical_or.reduce([X.O for X in Xs]) | (S * (1 + g) >= self.big)
        return _Bound(M, self._clean(D), O)

    def add(self, X: _Bound, Y: _Bound) -> _Bound:
        with np.errstate(over="ignore", invalid="ignore"):
            S = (X.H + Y.H) * self.fudge
            D = X.D + Y.D + self.u * S
            O = X.O | Y.O | (S * (1 + self.u) >= self.big)
        return _Bound((X.M + Y.M) * self.fudge, self._clean(D), O)


def _in_units(x: float, unit: int) -> float:
    """An absolute error x in units of 2**unit, rounded up and never to 0."""
    if not unit:
        return x
    with np.errstate(over="ignore"):
        return max(float(next_up(np.float64(math.ldexp(x, -unit)))), FLOAT64.min_subnormal)


def _scaled_down(X: np.ndarray, k: int) -> np.ndarray:
    """An upper bound on X / 2**k that is 0 only where X is."""
    return np.where(X > 0, np.maximum(next_up(np.ldexp(X, -k)), FLOAT64.min_subnormal), 0.0)


def _log2_squarings(X: _Bound, s: int, ops: _BoundOps) -> np.ndarray:
    """An upper bound on log2 of the D that s squarings of X give, also where D overflows float64.

    The same product rule runs on X / 2**e, with e renormalised after each
    squaring so that the largest bound stays below 1; the absolute terms of the
    rule are divided by 2**e as well.  Entries far below the largest lose
    their bound to the 2**-1074 floor, so this only serves entries whose
    plain float64 bound is infinite.
    """
    e = 0
    for _ in range(s):
        X = ops.mm(X, X, unit=2 * e)
        e *= 2
        top = float(np.max(X.H)) if X.H.size else 0.0
        k = math.frexp(top)[1] if 0 < top < math.inf else 0
        X = _Bound(_scaled_down(X.M, k), _scaled_down(X.D, k), X.O)
        e += k
    with np.errstate(divide="ignore"):
        return np.log2(X.D) + 1e-9 * (1 + abs(e)) + e


def _reach(absB: np.ndarray) -> np.ndarray:
    """1.0 where a path of B's graph (or i == j) leads from i to j: the entries exp(B) can make nonzero."""
    n = absB.shape[0]
    R = (absB > 0) | np.eye(n, dtype=bool)
    for _ in range(max(1, int(n - 1).bit_length())):
        R = (R.astype(np.float64) @ R.astype(np.float64)) > 0
    return R.astype(np.float64)


def _series(coefs: Sequence[float], MB: np.ndarray, fudge: float) -> np.ndarray:
    """Elementwise bound on ``sum_j c_j |B|^j`` over all j >= 0 for nonnegative ``coefs``
    (``c_j = 1/j!`` past the last one given), by Horner on |B|."""
    n = MB.shape[0]
    I = np.eye(n)
    with np.errstate(over="ignore", invalid="ignore"):
        R = coefs[-1] * I
        for c in reversed(coefs[:-1]):
            R = (R @ MB + c * I) * fudge
        # sum_{j > K} |B|^j / j! <= theta^(K+1) e^theta / (K+1)! entrywise, theta = ||B||_1.
        theta = float(np.max(MB.sum(axis=0))) * fudge if n else 0.0
        K1 = len(coefs)
        if theta > 0:
            log_tail = K1 * math.log(theta) + theta - math.lgamma(K1 + 1)
            tail = math.exp(log_tail) * (1 + 2.0 ** -30) if log_tail < 700 else math.inf
            R = R + tail * _reach(MB)
    return np.where(np.isnan(R), np.inf, R)


_EXP_COEFFICIENTS = tuple(float(next_up(np.float64(1 / math.factorial(j)))) for j in range(_TAIL_DEGREE + 1))


def _exp_majorant(MB: np.ndarray, dB: np.ndarray, fudge: float) -> np.ndarray:
    """Elementwise bound on |exp(B)| for |B| <= MB off the diagonal and Re(b_ii) <= dB_i.

    |exp(B)| <= exp(W), W the Metzler matrix with W_ii = dB_i and W_ij = MB_ij
    (comparison of x' = Bx with y' = Wy: d|x_i|/dt <= Re(b_ii)|x_i| + sum_j |b_ij||x_j|).
    exp(W) = e^-c exp(W + cI) with W + cI >= 0, which _series bounds.  Unlike
    exp(|B|), this keeps exp(B)^(2^s) small where the diagonal is negative:
    diag(1e4, -1e4) gets e^-1e4, not e^1e4, at (1, 1).
    """
    n = MB.shape[0]
    if not n:
        return MB.copy()
    c = max(0.0, -float(np.min(dB)))
    W = MB.copy()
    np.fill_diagonal(W, np.maximum(next_up(dB + c), 0.0))
    with np.errstate(over="ignore", invalid="ignore"):
        out = _series(_EXP_COEFFICIENTS, W, fudge) * (math.exp(-c) * (1 + 2.0 ** -50))
    return np.where(np.isnan(out), np.inf, out)


def select(norm_lo: float, norm_hi: float, k: Scheme, u: float, *, batched: bool) -> list[tuple[int, int]]:
    """Every (degree, s) that mexp can choose for a matrix whose computed 1-norm lies in [norm_lo, norm_hi].

    A single matrix takes T1..T12 on the norm intervals (theta_(i-1), theta_i]
    and T18 with scaling from theta_12 up; a batch of several takes T18 with
    scaling always.  ``s = max(0, ceil(log2(norm / theta_18)))`` is computed
    in the format (unit roundoff ``u``), so it is widened by the error of
    that division and log2.
    """
    th = k.thetas
    out: list[tuple[int, int]] = []
    if not batched:
        lower = (-1.0,) + th[:4]
        for i in range(5):
            if norm_hi > lower[i] and norm_lo <= th[i]:
                out.append((DEGREES[i], 0))
        if norm_hi < th[4]:
            return out
        norm_lo = max(norm_lo, th[4])
    def s_of(norm: float, side: int) -> int:
        if norm <= 0:
            return 0
        with np.errstate(over="ignore"):
            ratio = norm / th[5] * (1 + side * 2 * u)
        L = math.log2(ratio) if math.isfinite(ratio) else math.inf
        L += side * (4 * u * abs(L) + 1e-12)
        return max(0, math.ceil(L)) if math.isfinite(L) else 1 << 20

    lo, hi = s_of(norm_lo, -1), s_of(norm_hi, +1)
    if hi > _MAX_SQUARINGS:
        return out + [(18, hi)]  # the caller gives up on this bound
    return out + [(18, s) for s in range(lo, hi + 1)]


def mexp_tolerance(absA: np.ndarray, fmt: Format, complex_: bool, *, batched: bool,
                   diag: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E, O, L) for one finite n x n matrix with ``|A| <= absA``: E bounds |computed - exp(A)|, O marks
    entries where a partial result may overflow, so that NaN or infinity is possible, and
    ``2**L >= E`` also where E overflows float64 (L is inf where nothing bounds E).

    ``diag`` bounds the real parts of A's diagonal from above (``diag(absA)`` when not given); with
    it, the squarings use the sign-aware bound of :func:`_exp_majorant` on |exp(A / 2^s)|.
    Entries no path of A's graph reaches get E = 0 at any norm.
    """
    n = absA.shape[0]
    k = scheme_constants(fmt)
    u = fmt.unit_roundoff
    ops = _BoundOps(fmt, complex_, n)
    diag = np.diagonal(absA).copy() if diag is None else np.asarray(diag, dtype=np.float64)
    col = absA.sum(axis=0)
    # The computed norm: abs, a sum of n terms and a max, in the format.
    eps = gamma(n + 2, u)
    norm = float(np.max(col)) if n else 0.0
    norm_hi = norm * (1 + eps) * ops.fudge
    norm_lo = norm * (1 - eps) / ops.fudge
    E = np.zeros((n, n))
    L = np.full((n, n), -np.inf)
    O = np.zeros((n, n), dtype=bool)
    candidates = select(norm_lo, norm_hi, k, u, batched=batched)
    if not candidates or max(s for _, s in candidates) > _MAX_SQUARINGS:
        E = np.where(_reach(absA) > 0, np.inf, 0.0)
        return E, np.ones((n, n), dtype=bool), np.log2(E)
    eta = _half_spacing(fmt) * ops.cplx
    for degree, s in candidates:
        MB = np.ldexp(absA, -s)
        # The scaling is exact unless an entry lands among the subnormals of the format.
        DB = np.where((absA > 0) & (s > 0) & (MB < 2 * fmt.min_normal), eta, 0.0)
        MB = np.where(absA > 0, next_up(MB), 0.0)
        P = _evaluate(degree, k, ops, _Bound(MB, DB, ops.no))
        # |P(B) - exp(B)| <= sum_j |p_j - 1/j!| |B|^j: the scheme's truncation error.
        R = _series(truncation_coefficients(k, degree), MB, ops.fudge)
        # |exp(B)| <= exp(W) <= exp(|B|), usually far below P's bound, whose scheme coefficients
        # have mixed signs; the squarings raise this bound to the power 2**s.
        majorant = np.minimum(_series(_EXP_COEFFICIENTS, MB, ops.fudge),
                              _exp_majorant(MB, next_up(np.ldexp(diag, -s)), ops.fudge))
        exp_B = np.minimum(P.M + R, majorant) * ops.fudge
        X0 = X = _Bound(exp_B, (P.D + R) * ops.fudge, P.O)
        for _ in range(s):
            X = ops.mm(X, X)
        with np.errstate(divide="ignore"):
            Lc = np.log2(X.D)
        if np.isposinf(X.D).any():
            Lc = np.where(np.isposinf(X.D), _log2_squarings(X0, s, ops), Lc)
        E = np.maximum(E, X.D)
        L = np.maximum(L, Lc)
        O |= X.O
    return E, O, L
