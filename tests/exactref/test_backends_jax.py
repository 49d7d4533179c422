"""exactref.backends.jax's known failure of matrix_exp, traced to its cause.

``jax.scipy.linalg.expm`` (``_calc_P_Q``) scales A by 2**-s with
s = floor(log2(|A|_1 / theta)), so the scaled matrix's norm may reach 2 theta,
past the norm up to which the Padé approximant is accurate to the unit
roundoff; with ceil it stays at most theta.  The evidence: at a 1-norm
between theta and 2 theta jax takes no squaring and is off by about 1e8 u,
and exactref's PADE13 class rejects it; taking the one squaring ceil gives,
expm(A/2)**2 (A/2 and the squaring in float64, everything else jax's), is a
few u off and covered.  Exact values come from mpmath at 300 bits.
"""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er

from .test_matrix_exp_pade import errors, exact

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jsl = pytest.importorskip("jax.scipy.linalg")
jax.config.update("jax_enable_x64", True)

THETA = {np.float64: 5.371920351148152, np.complex128: 5.371920351148152, np.float32: 3.925724783138660}
# 1-norms between theta and 2 theta, where floor takes no squaring and ceil takes one
CASES = [
    (np.array([[0.0, 10.7], [-10.7, 0.0]]), np.float64),
    (np.array([[10.0, 0.5], [0.2, -0.1]]), np.float64),
    (np.array([[-10.0, 0.7], [0.0, -9.0]]), np.float64),
    (np.array([[0.0, 10.7], [-10.7, 0.0]]) * (0.6 + 0.8j), np.complex128),
    (np.array([[0.0, 7.6], [-7.6, 0.0]]), np.float32),
]


def normwise(X: np.ndarray, A: np.ndarray) -> float:
    """|X - exp(A)|_1 / |X|_1 in units of X's unit roundoff."""
    u = float(np.finfo(X.dtype).eps) / 2
    return float(errors(X, exact(A)).sum(axis=0).max() / np.abs(X).sum(axis=0).max() / u)


@pytest.mark.parametrize(("A", "dtype"), CASES, ids=[f"{np.dtype(d).name}-{i}" for i, (_, d) in enumerate(CASES)])
def test_jax_expm_scales_with_floor_where_ceil_is_right(A, dtype):
    A = A.astype(dtype)
    norm = float(np.abs(A).sum(axis=0).max())
    assert THETA[dtype] < norm < 2 * THETA[dtype]
    assert np.floor(np.log2(norm / THETA[dtype])) == 0 and np.ceil(np.log2(norm / THETA[dtype])) == 1
    shipped = np.asarray(jsl.expm(jnp.asarray(A)))
    half = np.asarray(jsl.expm(jnp.asarray(A / 2)))  # its scaled norm is below theta: no squaring inside
    ceil = half @ half
    assert shipped.dtype == ceil.dtype == A.dtype
    assert normwise(shipped, A) > 1e3 * normwise(ceil, A)
    assert normwise(ceil, A) < 64
    result = er.matrix_exp(A, model="pade13")
    assert not result.covers(shipped).all()
    assert result.covers(ceil).all()


def test_the_backend_declares_the_cause():
    from exactref.backends import jax as backend
    entry = backend.EXACTREF_KERNELS["matrix_exp"]
    reason = entry["known_failures"]["float64"]
    assert "floor" in reason and "ceil" in reason and "_calc_P_Q" in reason
    # Judged in its own class, with norms drawn past theta, where floor goes wrong.
    assert entry["model"] is er.models.PADE13 and entry["strategy_options"]["max_norm"] > 2 * THETA[np.float64]
    # jnp.add's complex semantics differ in the forward only; its vjp is torch's.
    assert set(backend.EXACTREF_KERNELS["add"]["known_failures"]) == {"complex64-forward", "complex128-forward"}


def test_pade13_holds_jaxs_pade_on_a_1x1_as_well_as_scipys_exp():
    # JAX runs Padé on a 1 x 1 (12 ulps off at [[3]]: Q's cancellation), scipy returns exp.
    shipped = np.asarray(jsl.expm(jnp.asarray(np.array([[3.0]]))))
    assert not er.matrix_exp(np.array([[3.0]])).covers(shipped).all()  # torch's class: exp within an ulp
    for x in (3.0, -3.0, 5.0, 0.5):
        A = np.array([[x]])
        result = er.matrix_exp(A, model="pade13")
        assert result.covers(np.asarray(jsl.expm(jnp.asarray(A)))).all()
        assert result.covers(np.exp(A)).all()
        assert not result.covers(np.exp(A) * (1 + 1e-11)).all()
