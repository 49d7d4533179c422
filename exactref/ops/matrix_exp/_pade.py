"""The tolerance model of Padé scaling and squaring (Al-Mohy and Higham 2009), as scipy.linalg.expm runs it.

The algorithm: pick a degree m in (3, 5, 7, 9, 13) and a scaling s from
norms of powers of A (``pick_pade``); with B = A / 2**s evaluate the even and
odd parts V and U of the [m/m] Padé numerator; solve (V - U) X = U by LU
with partial pivoting; r = I + 2 X; square r s times.

Two bounds are proven, a normwise (1-norm) one and a componentwise one, and
the smaller is kept on each element.  Their parts, derived on
``docs/matrix-exp.md`` ("Padé scaling and squaring"):

* the running error bound of the polynomial phase, componentwise, on |B|
  (``_Poly``): D_U >= |U_computed - U|, D_V >= |V_computed - V|, with U and V
  the exact-arithmetic values for the kernel's constants;
* the solve: Q = V - U is computed with error dQ; LU with partial pivoting
  (of Q, as numpy, or of Q^T, as scipy) solves (Q + dQ + dA) x = u_computed
  with |dA| <= gamma_(3n+2) |L||U| (Higham, Theorem 9.4), |L||U| enclosed by
  running the factorization on Arb balls (``_lu``), or by the growth bound;
* the squarings: e_(j+1) = e_j N_j + (N_j + e_j) e_j + g (N_j + e_j)^2, with
  N_j >= |r^(2^j)|;
* the truncation |exp(A) - r^(2^s)| for the exact r of the kernel's
  constants, and N_j, |Q^-1| and |Q^-1 U|, all enclosed with Arb.

Every (m, s) the kernel's floating-point selection can make is bounded
(``candidates``) and the largest bound kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flint
import numpy as np

from ...engine.fast import gamma
from ...formats import FLOAT32, FLOAT64, Format
from ...rounding import next_up
from ._lu import lu_magnitudes

__all__ = ["PADE_COEFFICIENTS", "candidates", "pade_bound", "pick_pade"]

#: b_0..b_m of the [m/m] Padé numerator p(x) = sum b_k x^k (q(x) = p(-x)), as scipy writes them.
PADE_COEFFICIENTS: dict[int, tuple[int, ...]] = {
    3: (120, 60, 12, 1),
    5: (30240, 15120, 3360, 420, 30, 1),
    7: (17297280, 8648640, 1995840, 277200, 25200, 1512, 56, 1),
    9: (17643225600, 8821612800, 2075673600, 302702400, 30270240, 2162160, 110880, 3960, 90, 1),
    13: (64764752532480000, 32382376266240000, 7771770303897600, 1187353796428800, 129060195264000,
         10559470521600, 670442572800, 33522128640, 1323241920, 40840800, 960960, 16380, 182, 1),
}
# pick_pade_structure's theta and the ell() coefficients, per scipy instantiation.
_THETA = (1.495585217958292e-002, 2.539398330063230e-001, 9.504178996162932e-001, 2.097847961257068e+000, 4.25)
_ELL = {"double": (1.1191048088221578e-11, 1.1167770708198077e-06, 4.9826124310493469e-01,
                   6.5662862500000000e+05, 1.2573361865339437e+19),
        "float": (6.0081481933593750e-03, 5.9956512451171875e+02, 2.6750196800000000e+08,
                  3.5252480874905600e+14, 6.7502722515508048e+27)}
_MAX_SQUARINGS = 200
_PREC = 192  # Arb's working precision for the enclosures, in bits


# ---------------------------------------------------------------- the selection

def _norm1(X: np.ndarray) -> float:
    return float(np.max(np.abs(X).sum(axis=0))) if X.size else 0.0


def _ell(absA: np.ndarray, normA: float, power: int, coeff: float, m: int) -> int:
    """ell of Al-Mohy and Higham: the extra squarings that ||  |A|^(2m+1) ||_1 asks for."""
    v = np.ones(absA.shape[0])
    for _ in range(power):
        v = absA.T @ v
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = math.log2(float(np.max(v)) / normA / coeff) / (2 * m) if normA > 0 and np.max(v) > 0 else -math.inf
    return max(0, math.ceil(x)) if math.isfinite(x) else (0 if x < 0 else 1 << 20)


def pick_pade(A: np.ndarray, kind: str) -> tuple[int, int]:
    """The (m, s) that scipy's ``pick_pade_structure`` chooses, with the arithmetic done in float64."""
    coeff = _ELL[kind]
    absA = np.abs(A)
    normA = _norm1(A)
    A2 = A @ A
    A4 = A2 @ A2
    A6 = A4 @ A2
    d4, d6 = _norm1(A4) ** 0.25, _norm1(A6) ** (1 / 6)
    eta = max(d4, d6)
    if eta < _THETA[0] and _ell(absA, normA, 7, coeff[0], 3) == 0:
        return 3, 0
    if eta < _THETA[1] and _ell(absA, normA, 11, coeff[1], 5) == 0:
        return 5, 0
    d8 = _norm1(A4 @ A4) ** 0.125
    eta2 = max(d6, d8)
    if eta2 < _THETA[2] and _ell(absA, normA, 15, coeff[2], 7) == 0:
        return 7, 0
    if eta2 < _THETA[3] and _ell(absA, normA, 19, coeff[3], 9) == 0:
        return 9, 0
    d10 = _norm1(A6 @ A4) ** 0.1
    eta4 = min(eta2, max(d8, d10))
    s = max(0, math.ceil(math.log2(eta4 / _THETA[4]))) if eta4 > 0 else 0
    if s > _MAX_SQUARINGS:
        return 13, s
    B = np.ldexp(absA, -s)
    s += _ell(B, normA * 2.0 ** -s, 27, coeff[4], 13)
    return 13, s


def candidates(A: np.ndarray, fmt: Format, n: int) -> set[tuple[int, int]]:
    """Every (m, s) the selection can make when its norms carry rounding errors.

    The kernel computes the norms of A's powers in the format; each decision
    compares a quantity homogeneous in A with a threshold, so the choices for
    A scaled by 1 -+ eps (eps far above those rounding errors) bracket it.
    """
    kind = "float" if fmt == FLOAT32 else "double"
    eps = min(2.0 ** -8, 64 * (n + 8) * fmt.unit_roundoff)
    return {pick_pade(A * c, kind) for c in (1 - eps, 1.0, 1 + eps)}


# ---------------------------------------------------------------- the polynomial phase

@dataclass
class _Mat:
    M: np.ndarray  # >= |exact-arithmetic value|
    D: np.ndarray  # >= |computed - exact-arithmetic value|

    @property
    def H(self) -> np.ndarray:
        return self.M + self.D


class _Poly:
    """Componentwise rounding error rules of the format, for n x n matrices (Higham's Lemma 3.1)."""

    def __init__(self, fmt: Format, complex_: bool, n: int) -> None:
        self.n, self.u = n, fmt.unit_roundoff
        self.cplx = math.sqrt(2) * (1 + 2.0 ** -50) if complex_ else 1.0
        self.complex_ = complex_
        self.eta = max(fmt.min_subnormal / 2, FLOAT64.min_subnormal)
        self.fudge = 1 + (4 * n + 64) * 2.0 ** -52
        self.I = np.eye(n)

    def gemm(self, X: _Mat, Y: _Mat, C: _Mat | None = None) -> _Mat:
        """X Y (+ C): each part a real dot product of n (2n for complex) terms, plus C's part."""
        terms = (2 * self.n if self.complex_ else self.n) + (C is not None)
        g = self.cplx * gamma(terms, self.u)
        M, D, S = X.M @ Y.M, X.D @ Y.H + X.M @ Y.D, X.H @ Y.H
        if C is not None:
            M, D, S = M + C.M, D + C.D, S + C.H
        return _Mat(M * self.fudge, (D + g * S + terms * self.eta * self.cplx) * self.fudge)

    def lincomb(self, coefs: tuple[float, ...], Xs: tuple[_Mat, ...], diag: float = 0.0) -> _Mat:
        """sum c_k X_k (+ diag I), summed one term at a time: at most t roundings per term."""
        t = len(coefs) + (diag != 0)
        g = self.cplx * gamma(t + 1, self.u)  # one to spare: a constant may be rounded to the format
        M = sum(abs(c) * X.M for c, X in zip(coefs, Xs)) + abs(diag) * self.I
        S = sum(abs(c) * X.H for c, X in zip(coefs, Xs)) + abs(diag) * self.I
        D = sum(abs(c) * X.D for c, X in zip(coefs, Xs)) + g * S + (t + 1) * self.eta * self.cplx
        return _Mat(M * self.fudge, D * self.fudge)


def _uv(m: int, b: tuple[float, ...], ops: _Poly, B: _Mat) -> tuple[_Mat, _Mat]:
    """Bounds on U and V in scipy's ``pade_UV_calc`` order of operations, for the powers of B."""
    B2 = ops.gemm(B, B)
    evens = {2: B2}
    if m >= 5:
        evens[4] = ops.gemm(B2, B2)
    if m >= 7:
        evens[6] = ops.gemm(evens[4], B2)
    if m == 9:
        evens[8] = ops.gemm(evens[4], evens[4])
    if m == 13:
        B4, B6 = evens[4], evens[6]
        N = ops.lincomb((b[7], b[5], b[3]), (B6, B4, B2), b[1])
        Qm = ops.lincomb((b[12], b[10], b[8]), (B6, B4, B2))
        R = ops.lincomb((b[6], b[4], b[2]), (B6, B4, B2), b[0])
        W = ops.lincomb((b[13], b[11], b[9]), (B6, B4, B2))
        V = ops.gemm(Qm, B6, R)
        U = ops.gemm(ops.gemm(W, B6, N), B)
        return U, V
    ks = sorted(evens)
    odd = ops.lincomb(tuple(b[k + 1] for k in ks), tuple(evens[k] for k in ks), b[1])
    U = ops.gemm(odd, B)
    V = ops.lincomb(tuple(b[k] for k in ks), tuple(evens[k] for k in ks), b[0])
    return U, V


# ---------------------------------------------------------------- enclosures with Arb

def _up(x: Any) -> float:
    """A float64 upper bound on the arb x (inf if x is not finite)."""
    v = float(x.mid()) + float(x.rad())
    if math.isnan(v):
        return math.inf
    return float(next_up(next_up(np.float64(v))))


def _abs_up(X: Any, n: int) -> np.ndarray:
    """Elementwise upper bounds on |X| for an arb_mat or acb_mat."""
    return np.array([[_up(abs(X[i, j])) for j in range(n)] for i in range(n)]).reshape(n, n)


@dataclass
class _Enclosed:
    q_inv: np.ndarray  # >= |Q^-1|
    x: np.ndarray  # >= |Q^-1 U|
    powers: list[np.ndarray]  # powers[j] >= |r^(2^j)|, j = 0..s
    truncation: np.ndarray  # >= |exp(A) - r^(2^s)|
    Q: Any = None  # Q = V - U as an Arb matrix


def _enclose(A: np.ndarray, m: int, s: int, b: tuple[float, ...], complex_: bool) -> _Enclosed:
    n = A.shape[0]
    old = flint.ctx.prec
    flint.ctx.prec = _PREC + 4 * s
    try:
        if complex_:
            mat, num = flint.acb_mat, (lambda z: flint.acb(float(z.real), float(z.imag)))
        else:
            mat, num = flint.arb_mat, (lambda z: flint.arb(float(np.real(z))))
        Aa = mat(n, n, [num(z) for z in A.flat])
        B = Aa * flint.arb(2) ** (-s)
        I = mat(n, n, [num(1.0 if i == j else 0.0) for i in range(n) for j in range(n)])
        U = I * 0
        V = I * 0
        Bk = I
        for k in range(m + 1):
            term = Bk * flint.arb(b[k])
            if k % 2:
                U += term
            else:
                V += term
            Bk = Bk * B
        Q = V - U
        Qi = Q.inv()
        X = Qi * U
        r = I + X * 2
        powers = [_abs_up(r, n)]
        for _ in range(s):
            r = r * r
            powers.append(_abs_up(r, n))
        trunc = _abs_up(Aa.exp() - r, n)
        return _Enclosed(_abs_up(Qi, n), _abs_up(X, n), powers, trunc, Q)
    except (ZeroDivisionError, ValueError):
        inf = np.full((n, n), np.inf)
        return _Enclosed(inf, inf, [inf] * (s + 1), inf)
    finally:
        flint.ctx.prec = old


# ---------------------------------------------------------------- the bound

def squaring_error(e: Any, N: Any, g: float, mul: Callable[[Any, Any], Any]) -> Any:
    """The error after one squaring of a computed R with |R - r| <= e, |r| <= N (matrices, with ``mul`` @;
    or 1-norms, with ``mul`` *).

    R^2 - r^2 = (R - r) r + R (R - r), and the product rounds by g |R||R|.
    """
    return mul(e, N) + mul(N + e, e) + g * mul(N + e, N + e)


def solve_error(q_inv: np.ndarray, F: np.ndarray, dU: np.ndarray, x: np.ndarray) -> float:
    """A bound on ||X_computed - X||_1, X = Q^-1 U, where column by column (Q + F_j) x_computed = u_computed.

    |Q^-1| <= q_inv, |X| <= x, |u_computed - u| <= dU, |F_j| <= F.
    From Q (x_c - x) = (u_c - u) - F x - F (x_c - x):
    ||x_c - x|| <= (|| |Q^-1| dU || + || |Q^-1| F |x| ||) / (1 - ||Q^-1|| ||F||).
    """
    f = 1 + (4 * q_inv.shape[0] + 8) * 2.0 ** -52
    k = _norm1(q_inv) * _norm1(F) * f * f
    if not k < 1:
        return math.inf
    return (_norm1(q_inv @ dU) + _norm1(q_inv @ (F @ x)) * f) * f * f / (1 - k)


def solve_error_elementwise(q_inv: np.ndarray, F: np.ndarray, dU: np.ndarray, x: np.ndarray,
                            eX: float) -> np.ndarray:
    """|X_computed - X| <= |Q^-1| (dU + F |X_computed|), with |X_computed| <= |X| + eX (eX the 1-norm bound)."""
    f = 1 + (4 * q_inv.shape[0] + 8) * 2.0 ** -52
    return q_inv @ (dU + F @ ((x + eX) * f)) * f ** 3


def _lu_unit(u: float, complex_: bool) -> float:
    """The relative error of one operation of the LU solve: u, or sqrt(2) gamma_4 for complex (Higham, Lemma 3.5)."""
    return math.sqrt(2) * gamma(4, u) * (1 + 2.0 ** -50) if complex_ else u


def lu_growth(n: int, complex_: bool) -> float:
    """A bound on each entry of |L||U| / max|Q| for LU with partial pivoting of an n x n Q.

    |l_ik| <= 1 (sqrt 2 for complex, which LAPACK pivots by |re| + |im|), and
    row k of U is bounded by c^(k-1) max|Q|, c = 2 (1 + sqrt 2 for complex),
    so (|L||U|)_ij <= l (1 + c + ... + c^(n-1)) max|Q|.  The factor (1 + u)^(2n)
    of the computed growth is included.
    """
    c, lmax = (1 + math.sqrt(2), math.sqrt(2)) if complex_ else (2.0, 1.0)
    return lmax * (c ** n - 1) / (c - 1) * (1 + 2.0 ** -40) * (1 + 4 * n * 2.0 ** -52) ** (2 * n)


def lu_backward_error(Q: Any, dQ: np.ndarray, HQ: np.ndarray, u: float, complex_: bool) -> np.ndarray:
    """A bound on |dA| of Higham's Theorem 9.4 for the kernel's solve: (Q_computed + dA) x = b,
    |dA| <= gamma_3n |L||U| (gamma_(3n+2): the multipliers may be a reciprocal and a product),
    for LU with partial pivoting of Q or of Q^T.

    |L||U| is enclosed by running the factorization on balls (``_lu``); where a
    pivot is not decided there, by the growth bound on every entry.
    """
    n = dQ.shape[0]
    uc = _lu_unit(u, complex_)
    g = gamma(3 * n + 2, uc)
    # scipy factors Q^T (its row-major memory read as column-major) and solves with getrs("T"); numpy's
    # solve factors Q.  Both solve Q x = b, with |dA| <= gamma |L||U| for Q, or gamma (|L||U|)^T for Q^T.
    G = lu_magnitudes(Q, dQ, uc, complex_) if Q is not None else None
    GT = lu_magnitudes(Q.transpose(), dQ.T, uc, complex_) if G is not None else None
    if G is None or GT is None:
        return np.full((n, n), g * lu_growth(n, complex_) * float(np.max(HQ)))
    return g * np.maximum(G, GT.T) * (1 + 2.0 ** -50)


def _bound_one(A: np.ndarray, m: int, s: int, fmt: Format, complex_: bool) -> np.ndarray:
    n = A.shape[0]
    if s > _MAX_SQUARINGS:
        return np.full((n, n), np.inf)
    u = fmt.unit_roundoff
    # The kernel's constants: the integers b_k rounded to its format.
    b = tuple(float(np.float32(c)) if fmt == FLOAT32 else float(c) for c in PADE_COEFFICIENTS[m])
    ops = _Poly(fmt, complex_, n)
    absB = np.ldexp(np.abs(A), -s)
    # The scaling is exact unless an entry falls below the normal range.
    DB = np.where((absB > 0) & (absB < 2 * fmt.min_normal) & (s > 0), ops.eta * ops.cplx, 0.0)
    U, V = _uv(m, b, ops, _Mat(absB, DB))
    enc = _enclose(A, m, s, b, complex_)
    fudge = ops.fudge
    HQ = (U.H + V.H) * (1 + u) * fudge
    # Q_computed = fl(V_computed - U_computed).
    dQ = ((U.D + V.D) + u * (U.H + V.H) + ops.eta) * fudge
    F = dQ + lu_backward_error(enc.Q, dQ, HQ, u, complex_) + 3 * n * ops.eta
    eX = solve_error(enc.q_inv, F, U.D, enc.x) * fudge
    if not math.isfinite(eX):
        return np.full((n, n), np.inf)
    Ex = solve_error_elementwise(enc.q_inv, F, U.D, enc.x, eX)
    xn = _norm1(enc.x) * fudge
    # r = I + 2 X: the doubling is exact, the diagonal addition rounds once.
    e = (2 * eX + u * (1 + 2 * (xn + eX)) + ops.eta) * fudge
    Em = (2 * Ex + np.diag(u * (1 + 2 * (np.diagonal(enc.x) + eX))) + ops.eta) * fudge
    g = ops.cplx * gamma(2 * n if complex_ else n, u)
    # A partial result past the range makes inf, then NaN from inf - inf or 0 * inf, which a product
    # spreads: then every element may be NaN or infinite (an infinite bound).
    big = fmt.max_finite
    if float(np.max(HQ)) >= big:
        return np.full((n, n), np.inf)
    for j in range(s):
        N = enc.powers[j]
        if not float(np.max(_matmul(N + e, N + e))) * (1 + g) * fudge < big:
            return np.full((n, n), np.inf)
        e = (squaring_error(e, _norm1(N) * fudge, g, _times) + n * ops.eta * ops.cplx) * fudge
        Em = (squaring_error(Em, N, g, _matmul) + n * ops.eta * ops.cplx) * fudge
    # Both bounds hold; the elementwise one is usually the smaller.
    total = np.minimum(Em, e) + enc.truncation
    return np.where(np.isnan(total), np.inf, total * fudge)


def _times(a: float, b: float) -> float:
    return a * b


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a @ b


def pade_bound(A: np.ndarray, fmt: Format, complex_: bool) -> np.ndarray:
    """Elementwise upper bounds on |exp(A) - computed| for every Padé scaling-and-squaring kernel of the class.

    ``A`` holds the matrix's exact values (float64 or complex128); ``fmt``
    is the (part) format the kernel computes in.
    """
    n = A.shape[0]
    if not np.isfinite(A).all():
        return np.full((n, n), np.inf)
    if n == 0 or not np.any(A):
        return np.full((n, n), 2 * fmt.unit_roundoff)
    return np.maximum.reduce([_bound_one(A, m, s, fmt, complex_) for m, s in sorted(candidates(A, fmt, n))])
