"""The rational engine's pieces against Fractions: enclosures contain the exact value,
exact sums are exact, and exact rounding is correct."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.engine import fast
from exactref.engine.exact import exact_dot_rows, round_rows
from exactref.formats import FORMATS

from .oracle import bits_equal, round_fraction

F = Fraction


def wide_floats(max_exp: int = 1000) -> st.SearchStrategy[float]:
    """float64 values spread over a wide exponent range, zeros included."""
    return st.one_of(
        st.just(0.0),
        st.builds(lambda m, e: float(np.ldexp(m, e)), st.floats(-1, 1, allow_subnormal=False),
                  st.integers(-max_exp, min(max_exp, 1023))),
        st.floats(-4, 4),
    )


def matrices(max_exp: int = 1000):
    return st.integers(1, 5).flatmap(lambda k: st.tuples(
        hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.just(k)), elements=wide_floats(max_exp)),
        hnp.arrays(np.float64, st.tuples(st.just(k), st.integers(1, 4)), elements=wide_floats(max_exp))))


def exact_product(A, B):
    return [[sum((F(A[i, k]) * F(B[k, j]) for k in range(A.shape[1])), F(0)) for j in range(B.shape[1])]
            for i in range(A.shape[0])]


def contains(enc, exact, i, j):
    rad = enc.rad[i, j]
    if not np.isfinite(rad):
        return True
    return abs(exact - F(enc.hi[i, j]) - F(enc.lo[i, j])) <= F(rad)


@settings(max_examples=300)
@given(matrices())
def test_sliced_product_encloses_exact_value(AB):
    A, B = AB
    with np.errstate(all="ignore"):
        enc = fast.matmul_sliced(A, B)
    ex = exact_product(A, B)
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            assert contains(enc, ex[i][j], i, j)
            if np.isfinite(enc.S[i, j]):
                assert sum(abs(F(A[i, k]) * F(B[k, j])) for k in range(A.shape[1])) <= F(enc.S[i, j])


@settings(max_examples=200)
@given(matrices(max_exp=60))
def test_narrow_product_encloses_exact_value(AB):
    A, B = (v.astype(np.float32).astype(np.float64) for v in AB)
    enc = fast.matmul_narrow(A, B)
    ex = exact_product(A, B)
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            assert contains(enc, ex[i][j], i, j)


def test_sliced_product_is_tight_enough_to_decide_float64():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    enc = fast.matmul_sliced(A, B)
    assert np.median(enc.rad / np.abs(enc.hi)) < 2.0 ** -60


@settings(max_examples=300)
@given(st.integers(1, 6).flatmap(lambda t: hnp.arrays(np.float64, (3, t), elements=wide_floats(1070))),
       st.integers(1, 6).flatmap(lambda t: hnp.arrays(np.float64, (3, t), elements=wide_floats(1070))))
def test_exact_dot_rows_is_exact(X, Y):
    T = min(X.shape[1], Y.shape[1])
    X, Y = X[:, :T], Y[:, :T]
    for (n, e), x, y in zip(exact_dot_rows(X, Y), X, Y):
        assert F(n) * F(2) ** e == sum((F(a) * F(b) for a, b in zip(x, y)), F(0))
    for (n, e), x in zip(exact_dot_rows(X), X):
        assert F(n) * F(2) ** e == sum((F(a) for a in x), F(0))


@pytest.mark.parametrize("name", ["float64", "float32", "float16", "bfloat16"])
@settings(max_examples=200)
@given(rows=hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 6)), elements=wide_floats(300)))
def test_round_rows_rounds_correctly(name, rows):
    from exactref.rounding import round_float64

    fmt = FORMATS[name]
    value, lo, hi, ok = round_rows(rows, fmt.p)
    if fmt.p != 53:
        value = round_float64(value, fmt)
    for i, row in enumerate(rows):
        if not ok[i]:
            continue
        exact = sum((F(v) for v in row), F(0))
        assert F(lo[i]) <= exact <= F(hi[i])
        if exact != 0:
            assert bits_equal(value[i], round_fraction(exact, name))


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
def test_two_prod_is_exact_where_safe(a, b):
    with np.errstate(all="ignore"):
        p, e, safe = fast.two_prod(np.array([a]), np.array([b]))
    if safe[0] and np.isfinite(p[0]):
        assert F(p[0]) + F(e[0]) == F(a) * F(b)


@given(st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300),
       st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300))
def test_two_sum_is_exact(a, b):
    s, e = fast.two_sum(np.array([a]), np.array([b]))
    assert F(s[0]) + F(e[0]) == F(a) + F(b)
