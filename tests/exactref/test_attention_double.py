"""The double-double pass: its product of a ball by an exact matrix against Fractions, its scale, and
which heads it computes after the longdouble pass."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from exactref.engine.balls import Ball
from exactref.ops.attention._double import contract, scale_ball
from exactref.ops.attention._problem import default_scale

F = Fraction


@pytest.mark.parametrize("K", [1, 7, 64, 300])
def test_contract_holds_every_exact_product(K):
    rng = np.random.default_rng(K)
    hi = rng.random((2, 3, K)) * 2.0 ** rng.integers(-20, 20, (2, 3, K))
    # Low parts far from negligible in float64 (a tenth of hi's ulp and more), so that the float64
    # product lo @ Y rounds, and radii on half of the rows.
    lo = hi * rng.standard_normal((2, 3, K)) * 2.0 ** -50
    rad = np.abs(hi) * 2.0 ** -98 * (np.arange(3) % 2)[None, :, None]
    Y = rng.standard_normal((2, K, 4)) * 2.0 ** rng.integers(-10, 10, (2, K, 4))
    Z = contract(Ball(hi, lo, rad), Y)
    for b in range(2):
        for i in range(3):
            for j in range(4):
                centre = sum((F(hi[b, i, k]) + F(lo[b, i, k])) * F(Y[b, k, j]) for k in range(K))
                spread = sum(F(rad[b, i, k]) * abs(F(Y[b, k, j])) for k in range(K))
                err = abs(centre - F(Z.hi[b, i, j]) - F(Z.lo[b, i, j]))
                assert err + spread <= F(Z.rad[b, i, j]), (b, i, j)
                # And tight: the products' own part of the radius far below a float64 ulp of the sum
                # of |terms| (the slicing's, 2**-80 to 2**-87 of it here, is the most of it).
                absum = sum(abs(F(hi[b, i, k]) * F(Y[b, k, j])) for k in range(K))
                assert float((F(Z.rad[b, i, j]) - spread) / absum) < 2.0 ** -75


@pytest.mark.parametrize("E", [64, 2, 3, 128])
def test_the_scale_ball_holds_one_over_root_E(E):
    import mpmath

    s = scale_ball(default_scale(E))
    with mpmath.workprec(400):
        exact = 1 / mpmath.sqrt(E)
        assert abs(exact - mpmath.mpf(float(s.hi)) - mpmath.mpf(float(s.lo))) <= mpmath.mpf(float(s.rad))
    assert float(s.rad) < 2.0 ** -100


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_which_heads_the_double_pass_computes(monkeypatch, dtype):
    # An output tie (q = 0: each output is the exact mean of v's column, 1 + 2**-24 in float32, a
    # tie; exact in float64) that the longdouble pass leaves undecided: after it, the double-double
    # pass leaves the output's rows to Arb, and computes no head.  A float64 result goes to it
    # first, and it computes the head.
    import exactref as er
    from exactref.ops.attention import _double

    heads = []
    real = _double.DoublePass._P

    def recording(self, hs):
        heads.append(hs.tolist())
        return real(self, hs)

    monkeypatch.setattr(_double.DoublePass, "_P", recording)
    q = np.zeros((1, 2, 4), dtype=dtype)
    k = np.ones((2, 4), dtype=dtype)
    v = np.array([[1.0], [1.0 + 2.0 ** -23]], dtype=dtype)
    r = er.scaled_dot_product_attention(q, k, v)
    assert r.rounded[0, 0, 0] == (1.0 if dtype == np.float32 else 1.0 + 2.0 ** -24)
    assert heads == ([] if dtype == np.float32 else [[0]])
