"""exactref.backends.scipy: scipy.linalg.expm judged under PADE13, against mpmath's expm.

scipy's complex128 path is covered; its real path with the beta bug fixed is
emulated (the emulation with beta=1 reproduces scipy's shipped results to a
few units in the last place, so with beta=0 it is scipy fixed) and covered;
scipy as shipped is rejected where the bug's error exceeds the bound.  Exact
values come from mpmath at 300 bits, never from the code under test.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest

import exactref as er

from .test_matrix_exp_pade import (
    ADVERSARIAL,
    bound,
    choose,
    errors,
    exact,
    expm_pade,
    random_matrices,
)

sl = pytest.importorskip("scipy.linalg")

BUG = ADVERSARIAL["bug example"]
# Non-triangular: the triangular path is another algorithm (a known failure, below).
CASES = [A for name, A in sorted(ADVERSARIAL.items())]


def test_scipy_complex128_is_within_the_bound():
    worst = 0.0
    matrices = random_matrices(21, 20, complex_=True) + [A * (1 + 0.5j) for A in CASES] + [A + 0j for A in CASES]
    for A in matrices:
        X = sl.expm(A)
        assert X.dtype == np.complex128
        worst = max(worst, float(np.max(errors(X, exact(A)) / bound(A))))
        assert er.matrix_exp(A, model="pade13").covers(X).all()
    assert 1e-3 < worst <= 1.0


def test_the_emulation_is_scipys_real_path():
    # With beta=1 and scipy's transposed LU, the emulation is scipy as shipped, up to BLAS's order of operations.
    for A in [BUG] + [A for A in random_matrices(22, 20) if choose(A)[1] <= 1]:
        X, Y = sl.expm(A), expm_pade(A, beta=1.0, transposed_lu=True)
        assert np.max(np.abs(X - Y)) <= 64 * 2.0 ** -53 * np.max(np.abs(X))
    # ... and the bug is what separates scipy from the fix there.
    assert np.max(np.abs(sl.expm(BUG) - expm_pade(BUG, transposed_lu=True))) > 1e-12


def test_scipy_with_the_beta_fix_is_within_the_bound():
    for A in CASES + random_matrices(23, 20):
        X = expm_pade(A, beta=0.0, transposed_lu=True)
        assert np.all(errors(X, exact(A)) <= bound(A))
        assert er.matrix_exp(A, model="pade13").covers(X).all()


def test_scipy_as_shipped_is_rejected_where_the_bug_exceeds_the_bound():
    E = exact(BUG)
    X = sl.expm(BUG)
    normwise = np.max(errors(X, E).sum(axis=0)) / np.max(np.abs(X).sum(axis=0)) / 2.0 ** -53
    assert normwise > 1000  # 1.8e3 u
    assert np.max(errors(X, E) / bound(BUG)) > 2
    assert not er.matrix_exp(BUG, model="pade13").covers(X).all()
    tridiagonal = np.diag(np.full(7, 3.0), 1) + np.diag(np.full(7, 1.0), -1)
    assert not er.matrix_exp(tridiagonal, model="pade13").covers(sl.expm(tridiagonal)).all()


def test_scipys_triangular_path_is_rejected():
    A = np.array([[5.0, 1.0], [0.0, 5.0 + 1e-9]])
    for dtype in (np.float64, np.complex128):
        assert not er.matrix_exp(A.astype(dtype), model="pade13").covers(sl.expm(A.astype(dtype))).all()


def test_the_transposed_lu_is_what_scipy_needs():
    # The bound for LU of Q alone (without Q^T's pattern) rejects scipy's complex path, which has no beta bug.
    pade = importlib.import_module("exactref.ops.matrix_exp._pade")
    A = ADVERSARIAL["non-normal"] + 0j
    X = sl.expm(A)
    assert np.all(errors(X, exact(A)) <= bound(A))
    real = pade.lu_magnitudes
    calls = []

    def q_only(Q, dQ, u, complex_):
        calls.append(1)
        G = real(Q, dQ, u, complex_)
        return G if len(calls) % 2 else G * 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pade, "lu_magnitudes", q_only)
        assert np.any(errors(X, exact(A)) > bound(A))


def test_the_backend_declares_what_scipy_returns():
    from exactref.backends import scipy as backend
    table = backend.EXACTREF_KERNELS("cpu")
    for op in ("matrix_exp", "matrix_exp_frechet"):
        for fmt in table[op]["formats"]:
            assert str(sl.expm(np.eye(2, dtype=fmt)).dtype) == fmt
        assert "beta=1" in table[op]["known_failures"]["float64"]
    assert sl.expm(np.eye(2, dtype=np.float16)).dtype == np.float32  # why float16 is not declared


def test_importing_the_backend_without_scipy_says_how_to_install_it():
    code = ("import sys; sys.modules['scipy'] = None; sys.modules['scipy.linalg'] = None\n"
            "try:\n    import exactref.backends.scipy\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert 'pip install "exactref[scipy]"' in out.stdout, out.stderr


def test_the_audit_runs_and_prints_a_table():
    out = subprocess.run([sys.executable, "-m", "exactref.cli", "audit", "--kernels", "exactref.backends.scipy",
                          "--examples", "10", "--seed", "1", "--dtypes", "float64,complex128"],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "matrix_exp          complex128  forward" in out.stdout
    assert "matrix_exp_frechet" in out.stdout
