"""PADE13: the Padé scaling-and-squaring class of matrix_exp (docs/matrix-exp.md, "Padé scaling and squaring").

The kernels judged here are an emulation of Al-Mohy and Higham's (2009)
algorithm written in this file with numpy: the degree and scaling chosen as
scipy's ``pick_pade_structure`` chooses them, U and V in scipy's order,
``np.linalg.solve`` (LAPACK's LU with partial pivoting) for (V - U) X = U,
r = I + 2X and s squarings.  ``beta`` reproduces scipy's real degree-13 bug
(U gains B^6).  Exact values come from mpmath's expm at 300 bits, never from
the code under test; the bound is the model's elementwise E.
"""

from __future__ import annotations

import importlib
import math

import mpmath
import numpy as np
import pytest

import exactref as er
from exactref.formats import FLOAT32, FLOAT64

pade = importlib.import_module("exactref.ops.matrix_exp._pade")

U64 = 2.0 ** -53
PADE = {3: (120., 60., 12., 1.), 5: (30240., 15120., 3360., 420., 30., 1.),
        7: (17297280., 8648640., 1995840., 277200., 25200., 1512., 56., 1.),
        9: (17643225600., 8821612800., 2075673600., 302702400., 30270240., 2162160., 110880., 3960., 90., 1.),
        13: (64764752532480000., 32382376266240000., 7771770303897600., 1187353796428800., 129060195264000.,
             10559470521600., 670442572800., 33522128640., 1323241920., 40840800., 960960., 16380., 182., 1.)}
THETA = (1.495585217958292e-2, 2.539398330063230e-1, 9.504178996162932e-1, 2.097847961257068, 4.25)
ELL = (1.1191048088221578e-11, 1.1167770708198077e-06, 4.9826124310493469e-01, 6.56628625e+05,
       1.2573361865339437e+19)


# ---------------------------------------------------------------- the emulation

def one_norm(X: np.ndarray) -> float:
    return float(np.abs(X).sum(axis=0).max())


def ell(A: np.ndarray, m: int, c: float) -> int:
    """ceil(log2(|| |A|^(2m+1) ||_1 / ||A||_1 / c) / 2m), at least 0 (Al-Mohy and Higham, (5.1))."""
    v = one_norm(np.linalg.matrix_power(np.abs(A), 2 * m + 1))
    return 0 if v == 0 else max(0, math.ceil(math.log2(v / one_norm(A) / c) / (2 * m)))


def choose(A: np.ndarray) -> tuple[int, int]:
    """Al-Mohy and Higham's Algorithm 5.1 with scipy's thetas: (degree, squarings)."""
    A2 = A @ A
    A4 = A2 @ A2
    A6 = A4 @ A2
    d4, d6 = one_norm(A4) ** 0.25, one_norm(A6) ** (1 / 6)
    for m, th, c in ((3, THETA[0], ELL[0]), (5, THETA[1], ELL[1])):
        if max(d4, d6) < th and ell(A, m, c) == 0:
            return m, 0
    d8 = one_norm(A4 @ A4) ** 0.125
    for m, th, c in ((7, THETA[2], ELL[2]), (9, THETA[3], ELL[3])):
        if max(d6, d8) < th and ell(A, m, c) == 0:
            return m, 0
    d10 = one_norm(A6 @ A4) ** 0.1
    eta = min(max(d6, d8), max(d8, d10))
    s = max(0, math.ceil(math.log2(eta / THETA[4]))) if eta > 0 else 0
    return 13, s + ell(A / 2.0 ** s, 13, ELL[4])


def solve_by_lu_of_transpose(Q: np.ndarray, U: np.ndarray) -> np.ndarray:
    """Q X = U by LU with partial pivoting of Q^T, as scipy does (getrf on Q^T, getrs("T")).

    Q^T = P L U_f, so Q = U_f^T L^T P^T: solve U_f^T y = b, L^T z = y, x = P z.
    """
    n = Q.shape[0]
    F = Q.T.copy()
    perm = np.arange(n)
    for k in range(n):
        p = k + int(np.argmax(np.abs(F[k:, k].real) + np.abs(F[k:, k].imag)))
        F[[k, p]] = F[[p, k]]
        perm[[k, p]] = perm[[p, k]]
        F[k + 1:, k] /= F[k, k]
        F[k + 1:, k + 1:] -= np.outer(F[k + 1:, k], F[k, k + 1:])
    X = U.copy()
    for i in range(n):  # U_f^T is lower triangular
        X[i] = (X[i] - F[:i, i] @ X[:i]) / F[i, i]
    for i in range(n - 1, -1, -1):  # L^T is unit upper triangular
        X[i] = X[i] - F[i + 1:, i] @ X[i + 1:]
    out = np.empty_like(X)
    out[perm] = X
    return out


def expm_pade(A: np.ndarray, beta: float = 0.0, transposed_lu: bool = False) -> np.ndarray:
    """Padé scaling and squaring in A's precision, in scipy's order; beta=1 is scipy's real degree-13 bug.

    The solve is numpy's (LU of V - U), or with ``transposed_lu`` scipy's (LU of (V - U)^T)."""
    n = A.shape[0]
    m, s = choose(A.astype(np.complex128 if np.iscomplexobj(A) else np.float64))
    I = np.eye(n, dtype=A.dtype)
    B = A / A.dtype.type(2.0 ** s)
    b = [A.real.dtype.type(c) for c in PADE[m]]
    B2 = B @ B
    if m == 13:
        B4 = B2 @ B2
        B6 = B4 @ B2
        N = b[7] * B6 + b[5] * B4 + b[3] * B2 + b[1] * I
        Q = b[12] * B6 + b[10] * B4 + b[8] * B2
        R = b[6] * B6 + b[4] * B4 + b[2] * B2 + b[0] * I
        W = B6 + b[11] * B4 + b[9] * B2
        V = Q @ B6 + R
        U = (W @ B6 + N) @ B + A.real.dtype.type(beta) * B6
    else:
        evens = {2: B2}
        if m >= 5:
            evens[4] = B2 @ B2
        if m >= 7:
            evens[6] = evens[4] @ B2
        if m == 9:
            evens[8] = evens[4] @ evens[4]
        U = (b[1] * I + sum(b[k + 1] * evens[k] for k in sorted(evens))) @ B
        V = b[0] * I + sum(b[k] * evens[k] for k in sorted(evens))
    X = solve_by_lu_of_transpose(V - U, U) if transposed_lu else np.linalg.solve(V - U, U)
    R = 2 * X + I
    for _ in range(s):
        R = R @ R
    return R


# ---------------------------------------------------------------- the oracle

def exact(A: np.ndarray) -> mpmath.matrix:
    with mpmath.workprec(300):
        entry = (lambda z: mpmath.mpc(complex(z))) if np.iscomplexobj(A) else (lambda z: mpmath.mpf(float(z)))
        return mpmath.expm(mpmath.matrix([[entry(z) for z in row] for row in A]))


def errors(X: np.ndarray, E: mpmath.matrix) -> np.ndarray:
    """|X - exp(A)| elementwise, X's values read exactly."""
    n = X.shape[0]
    with mpmath.workprec(300):
        return np.array([[float(abs(mpmath.mpc(complex(X[i, j])) - E[i, j])) for j in range(n)] for i in range(n)])


def bound(A: np.ndarray, fmt=FLOAT64) -> np.ndarray:
    return pade.pade_bound(A.astype(np.complex128 if np.iscomplexobj(A) else np.float64), fmt, np.iscomplexobj(A))


BANDED = np.diag(np.full(8, -1.0)) + np.diag(np.full(7, 2.5), 1) + np.diag(np.full(7, -0.7), -1)
ADVERSARIAL = {
    # far entries of exp(A) are tiny: the componentwise Taylor bound rejected Padé there by 1e14
    "banded": BANDED,
    "banded, scaled 2^5": 20 * BANDED,
    "pentadiagonal, far corner": np.diag(np.full(10, 0.5)) + np.diag(np.full(9, 1.5), 1) + np.diag(np.full(8, -1.0), 2)
    + np.diag(np.full(9, 0.25), -1),
    "non-normal": np.array([[-1.0, 60.0, 0.0], [1e-3, -2.0, 30.0], [0.0, 1e-3, -3.0]]),
    "non-normal hump": np.array([[-4.0, 500.0], [1e-4, -4.5]]),
    "large norm": np.random.default_rng(7).standard_normal((4, 4)) * 300,
    # no scaling, eigenvalues near +theta_13: the largest ||Q^-1|| the selection allows
    "largest Q^-1": np.array([[4.2, 0.3], [0.01, 4.1]]),
    "bug example": np.array([[1.35, -2.06], [-3.65, 0.147]]),
    "degree 3": np.array([[1e-3, 2e-3], [-1e-3, 5e-4]]),
    "degree 9": np.array([[0.9, -0.5], [0.7, 0.2]]),
}


def random_matrices(seed: int, count: int, complex_: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(2, 7))
        scale = float(rng.choice([0.01, 0.3, 1.0, 3.0, 10.0, 50.0]))
        A = rng.standard_normal((n, n)) * scale
        if complex_:
            A = A + 1j * rng.standard_normal((n, n)) * scale
        out.append(A)
    return out


# ---------------------------------------------------------------- coverage

@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_the_emulation_is_within_the_bound_on_adversarial_matrices(name):
    A = ADVERSARIAL[name]
    for transposed in (False, True):
        X = expm_pade(A, transposed_lu=transposed)
        err = errors(X, exact(A))
        assert np.all(err <= bound(A)), (name, float(np.max(err / bound(A))))
        assert er.matrix_exp(A, model="pade13").covers(X).all()


@pytest.mark.parametrize("complex_", [False, True])
def test_the_emulation_is_within_the_bound_on_random_matrices(complex_):
    worst = 0.0
    for i, A in enumerate(random_matrices(3, 25, complex_)):
        X = expm_pade(A, transposed_lu=bool(i % 2))
        worst = max(worst, float(np.max(errors(X, exact(A)) / bound(A))))
    assert worst <= 1.0
    assert worst > 1e-4  # the bound is not vacuous


def test_the_emulation_in_float32_is_within_the_float32_bound():
    for A in random_matrices(5, 10) + [ADVERSARIAL["banded"], ADVERSARIAL["largest Q^-1"]]:
        A32 = A.astype(np.float32)
        err = errors(expm_pade(A32), exact(A32.astype(np.float64)))
        assert np.all(err <= bound(A32.astype(np.float64), FLOAT32))
        assert er.matrix_exp(A32, model="pade13").covers(expm_pade(A32)).all()


def test_the_selection_is_the_emulations():
    for A in random_matrices(11, 40) + list(ADVERSARIAL.values()):
        assert pade.pick_pade(A, "double") == choose(A)
        assert choose(A) in pade.candidates(A, FLOAT64, A.shape[0])


def test_far_entries_of_a_banded_matrix_are_covered_where_the_taylor_tolerance_rejects_them():
    A = np.diag(np.full(11, 3.0), 1) + np.diag(np.full(11, 1.0), -1)
    X = expm_pade(A)
    assert er.matrix_exp(A, model="pade13").covers(X).all()
    # The default, componentwise class for PyTorch's Taylor algorithm is not this class: its far
    # entries are tiny, and Q^-1 spreads a unit roundoff of ||exp(A)|| onto them.
    far = ~er.matrix_exp(A).covers(X)
    assert far.any() and not np.any(far[np.abs(np.subtract.outer(range(12), range(12))) < 6])


# ---------------------------------------------------------------- rejection

def test_the_beta_bug_exceeds_the_bound_on_the_2x2_example():
    A = ADVERSARIAL["bug example"]
    E = exact(A)
    err_bug = errors(expm_pade(A, beta=1.0), E)
    assert np.max(err_bug / bound(A)) > 1.3
    assert np.max(errors(expm_pade(A), E) / bound(A)) < 0.05
    assert not er.matrix_exp(A, model="pade13").covers(expm_pade(A, beta=1.0)).all()


def test_wrong_algorithms_are_rejected():
    A = np.array([[2.0, 3.0], [-1.0, 1.5]]) * 3
    _, s = choose(A)
    assert s >= 1
    r = er.matrix_exp(A, model="pade13")
    # One squaring too few: exp(A / 2).
    X = np.eye(2)
    B = expm_pade(A / 2.0 ** s)
    for _ in range(s - 1):
        B = B @ B
    assert not r.covers(B).all()
    # Degree 3 without scaling.
    b = PADE[3]
    U = A @ (b[3] * A @ A + b[1] * X)
    V = b[2] * A @ A + b[0] * X
    assert not r.covers(np.linalg.solve(V - U, V + U)).all()
    assert not r.covers(expm_pade(A).T).all()


# ---------------------------------------------------------------- mutations of the derivation

def _no_amplification(e, N, g, mul):
    return e + g * mul(N + e, N + e)


def _large_norm(seed: int, index: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 3)) * 300 for _ in range(index + 1)][index]


def test_mutation_dropping_the_squaring_amplification_is_caught(monkeypatch):
    A = _large_norm(2, 2)  # 8 squarings
    assert choose(A) == (13, 8)
    err = errors(expm_pade(A), exact(A))
    assert np.all(err <= bound(A))
    monkeypatch.setattr(pade, "squaring_error", _no_amplification)
    assert np.any(err > bound(A))


def test_mutation_bounding_only_the_lu_of_q_is_caught(monkeypatch):
    # |L||U| of Q^T's factorization, transposed, has another pattern than Q's: scipy's solve needs it.
    A = ADVERSARIAL["non-normal"]
    err = errors(expm_pade(A, transposed_lu=True), exact(A))
    assert np.all(err <= bound(A))
    real = pade.lu_magnitudes
    calls = []

    def q_only(Q, dQ, u, complex_):  # the second call of each pair is for Q^T: drop it
        calls.append(1)
        G = real(Q, dQ, u, complex_)
        return G if len(calls) % 2 else G * 0
    monkeypatch.setattr(pade, "lu_magnitudes", q_only)
    assert np.any(err > bound(A))


def test_the_growth_bound_fallback_covers_and_is_looser(monkeypatch):
    # Where a pivot is not decided inside the balls, |L||U| falls back to the 2^(n-1) growth bound.
    A = ADVERSARIAL["non-normal"]
    tight = bound(A)
    monkeypatch.setattr(pade, "lu_magnitudes", lambda Q, dQ, u, complex_: None)
    loose = bound(A)
    for transposed in (False, True):
        assert np.all(errors(expm_pade(A, transposed_lu=transposed), exact(A)) <= loose)
    assert np.all(loose >= tight) and np.any(loose > 2 * tight)


def test_a_pivot_tie_is_not_decided():
    # A column of equal magnitudes: the kernel may pick either row.
    ctx = importlib.import_module("flint")
    Q = ctx.arb_mat([[1, 2], [-1, 3]])
    lu = importlib.import_module("exactref.ops.matrix_exp._lu")
    assert lu.lu_magnitudes(Q, np.zeros((2, 2)), U64, False) is None
    G = lu.lu_magnitudes(ctx.arb_mat([[1, 2], [-3, 4]]), np.zeros((2, 2)), U64, False)
    # Pivot -3: L = [[1, 0], [-1/3, 1]], U = [[-3, 4], [0, 2 + 4/3]]; |L||U| in Q's row order.
    assert np.allclose(G, [[1.0, 4 / 3 + 10 / 3], [3.0, 4.0]], rtol=1e-12)


def test_mutation_dropping_the_truncation_is_caught(monkeypatch):
    # Degree 13 on a norm past theta_13 without scaling: the truncation error dominates.
    A = np.array([[12.0, 1.0], [0.5, 11.5]])
    monkeypatch.setattr(pade, "candidates", lambda A, fmt, n: {(13, 0)})
    m = PADE[13]
    P = [np.linalg.matrix_power(A, k) for k in range(14)]
    U = sum(m[k] * P[k] for k in range(1, 14, 2))
    V = sum(m[k] * P[k] for k in range(0, 14, 2))
    X = np.linalg.solve(V - U, V + U)
    err = errors(X, exact(A))
    assert np.all(err <= bound(A))
    real = pade._enclose

    def no_truncation(*args):
        enc = real(*args)
        enc.truncation = np.zeros_like(enc.truncation)
        return enc
    monkeypatch.setattr(pade, "_enclose", no_truncation)
    assert np.any(err > bound(A))


# ---------------------------------------------------------------- Fréchet derivative and backward

def _block(A: np.ndarray, E: np.ndarray) -> np.ndarray:
    return np.block([[A, E], [np.zeros_like(A), A]])


@pytest.mark.parametrize("complex_", [False, True])
def test_frechet_and_backward_of_the_emulation_are_covered(complex_):
    rng = np.random.default_rng(13)
    for _ in range(4):
        n = int(rng.integers(2, 5))
        A = rng.standard_normal((n, n)) * 2
        G = rng.standard_normal((n, n))
        if complex_:
            A = A + 1j * rng.standard_normal((n, n))
            G = G + 1j * rng.standard_normal((n, n))
        L = expm_pade(_block(A, G))[:n, n:]
        assert er.matrix_exp_frechet(A, G, model="pade13").covers(L).all()
        AH = A.conj().T
        gA = expm_pade(_block(AH, G))[:n, n:]
        assert er.matrix_exp.backward(A, G, model="pade13")["grad_A"].covers(gA).all()
        assert er.matrix_exp(A, model="pade13").backward(G)["grad_A"].covers(gA).all()


# ---------------------------------------------------------------- the argument

def test_model_is_validated_with_an_error_naming_it():
    A = np.eye(2)
    with pytest.raises(TypeError, match=r"matrix_exp: model='taylor' is not a matrix_exp model.*'pade13'"):
        er.matrix_exp(A, model="taylor")
    with pytest.raises(TypeError, match="matrix_exp_frechet: model=3"):
        er.matrix_exp_frechet(A, A, model=3)
    with pytest.raises(ValueError, match="model=PADE13 has no float16 version"):
        er.matrix_exp(A.astype(np.float16), model="pade13")
    r = er.matrix_exp(A, model=importlib.import_module("exactref.ops.matrix_exp").PADE13)
    assert str(r.model) == "pade13" and str(er.matrix_exp(A).model) == "pytorch_mexp"
