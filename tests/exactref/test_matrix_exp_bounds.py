"""matrix_exp's tolerance at large norms: structural zeros, small entries next to huge ones, overflow.

At a large 1-norm the running error bound used to overflow float64 and, through
0 * inf in its own products, spill into every element: diag([1e4, -1e4]) had an
infinite tolerance everywhere and accepted [[inf, 5], [5, 2.718]].  Here:

* an element no path of A's graph reaches has tolerance 0 at any norm (NaN is
  still accepted where an overflow elsewhere can reach it through 0 * inf, as
  PyTorch's products produce it);
* an element whose exact value is small keeps a finite tolerance when the huge
  values are in another block, or where the diagonal is negative;
* an element whose exact value overflows accepts no finite value.

Which elements are structural zeros is worked out here from the pattern alone,
and the values come from mpmath (exp of each diagonal entry, or expm of the
small block at 320 bits), never from the code under test.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import exactref as er

from .oracle import round_fraction
from .test_matrix_exp import expm_oracle, rounded_oracle, to_fraction


def unreachable(A: np.ndarray) -> np.ndarray:
    """True at (i, j) when no path of A's graph leads from i to j (i != j): a breadth-first search."""
    n = A.shape[0]
    out = np.ones((n, n), dtype=bool)
    for i in range(n):
        seen, todo = {i}, [i]
        while todo:
            k = todo.pop()
            for j in range(n):
                if A[k, j] != 0 and j not in seen:
                    seen.add(j)
                    todo.append(j)
        out[i, list(seen)] = False
    return out


def exp_rounded(x: float, fmt: str) -> float:
    """exp(x) rounded once to fmt, by mpmath at 320 bits (inf past the range)."""
    with mpmath.workprec(320):
        return round_fraction(to_fraction(mpmath.exp(mpmath.mpf(x))), fmt)


def block_diagonal(a: float) -> np.ndarray:
    """Blocks {0, 2} (huge, all positive) and {1, 3} (small), interleaved so that no slice shows them."""
    A = np.zeros((4, 4))
    A[np.ix_([0, 2], [0, 2])] = [[a, 1.0], [1.0, a]]
    A[np.ix_([1, 3], [1, 3])] = SMALL
    return A


SMALL = np.array([[0.5, -0.25], [0.125, 0.75]])
PATTERNS = {
    "diagonal": lambda a: np.diag([a, -a, 0.5]),
    "block_diagonal": block_diagonal,
    "upper_triangular": lambda a: np.array([[-a, 1.0, 2.0], [0.0, a / 2, 3.0], [0.0, 0.0, -a]]),
}
# (format, 1-norm scale): moderate, one where the exact values overflow the format, and beyond.
SCALES = [("float64", 1.0), ("float64", 1e3), ("float64", 1e4), ("float32", 100.0), ("float32", 1e4)]
DTYPES = {"float32": np.float32, "float64": np.float64}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize(("fmt", "a"), SCALES)
def test_structural_zeros_have_tolerance_zero_at_any_norm(pattern, fmt, a):
    A = PATTERNS[pattern](a).astype(DTYPES[fmt])
    zero = unreachable(A)
    assert zero.any()
    r = er.matrix_exp(A)
    assert np.all(r.rounded[zero] == 0) and np.all(r.tolerance[zero] == 0)
    # Nothing finite but 0 is accepted there, not even the smallest subnormal.
    nudged = np.where(zero, np.finfo(DTYPES[fmt]).smallest_subnormal, r.rounded)
    assert not r.covers(nudged)[zero].any()
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()


def test_a_path_of_length_two_is_not_a_structural_zero():
    # (0, 2) is reached only through 1: exp(A)[0, 2] = 0.1 * 0.3 / 2, which a kernel computes with rounding.
    for extra in (0.0, 1e4):  # without, and next to, an overflowing diagonal entry in its own block
        A = np.zeros((4, 4))
        A[0, 1], A[1, 2], A[3, 3] = 0.1, 0.3, extra
        r = er.matrix_exp(A)
        want = rounded_oracle(expm_oracle(A[:3, :3]), "float64")[0]
        assert r.rounded[0, 2] == want[0, 2] == round_fraction(to_fraction(mpmath.mpf(0.1) * 0.3 / 2), "float64")
        assert 0 < r.tolerance[0, 2] < 1e-12
        # One ulp off is what a correct kernel may return.
        assert r.covers(np.where(np.arange(16).reshape(4, 4) == 2, np.nextafter(r.rounded, 1), r.rounded))[0, 2]
        assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()


@pytest.mark.parametrize(("fmt", "a"), [("float64", 1e4), ("float64", 1e3), ("float32", 100.0)])
def test_inf_and_fives_are_not_exp_of_diag_a_minus_a(fmt, a):
    dtype = DTYPES[fmt]
    A = np.diag([a, -a]).astype(dtype)
    r = er.matrix_exp(A)
    big, small = exp_rounded(a, fmt), exp_rounded(-a, fmt)
    assert big == math.inf and r.rounded[0, 0] == big and r.rounded[1, 1] == small
    covered = r.covers(np.array([[math.inf, 5.0], [5.0, 2.718]], dtype=dtype))
    assert covered.tolist() == [[True, False], [False, False]]
    assert r.covers(np.array([[math.inf, 0.0], [0.0, small]], dtype=dtype)).all()
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()


def test_nan_from_0_times_inf_is_accepted_where_an_overflow_reaches():
    # float64 overflows at the last squarings of e^1e4; the next ones meet 0 * inf: PyTorch gives all NaN.
    A = np.diag([1e4, -1e4])
    r = er.matrix_exp(A)
    assert torch.isnan(torch.linalg.matrix_exp(torch.from_numpy(A))).all()
    assert r.covers(np.full((2, 2), math.nan)).all()
    assert r.tolerance[0, 1] == 0 and r.tolerance[1, 0] == 0
    # In float32 e^100 overflows only at the last squaring: no 0 * inf, so NaN off the diagonal is wrong.
    r32 = er.matrix_exp(np.diag([100.0, -100.0]).astype(np.float32))
    assert r32.covers(np.full((2, 2), math.nan, dtype=np.float32)).tolist() == [[True, False], [False, False]]


@pytest.mark.parametrize(("fmt", "a", "limit"), [("float64", 1e4, 1e-320), ("float64", 1e3, 1e-320),
                                                 ("float32", 100.0, 1e-43)])
def test_a_small_entry_next_to_a_huge_one_has_a_small_tolerance(fmt, a, limit):
    A = np.diag([a, -a]).astype(DTYPES[fmt])
    r = er.matrix_exp(A)
    assert 0 < r.tolerance[1, 1] <= limit
    assert r.covers(np.array([[math.inf, 0.0], [0.0, exp_rounded(-a, fmt)]], dtype=DTYPES[fmt])).all()


@pytest.mark.parametrize("a", [1e3, 1e4])
def test_a_small_block_keeps_its_own_bound(a):
    A = block_diagonal(a)
    r = er.matrix_exp(A)
    idx = np.ix_([1, 3], [1, 3])
    want = rounded_oracle(expm_oracle(SMALL), "float64")[0]
    assert np.array_equal(r.rounded[idx], want)
    # About 2**s unit roundoffs of exp(|SMALL|), s = 14 squarings at a = 1e4.
    assert np.all(r.tolerance[idx] > 0) and np.all(r.tolerance[idx] < 1e-10)
    got = r.rounded.copy()
    got[idx] = want + 1e-9
    assert not r.covers(got)[idx].any()
    # The huge block overflows: e^a cosh(1) and e^a sinh(1) round to inf.
    assert np.all(r.rounded[np.ix_([0, 2], [0, 2])] == math.inf)
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()


def test_an_upper_triangular_matrix_keeps_its_negative_diagonal_small():
    a = 1e4
    A = PATTERNS["upper_triangular"](a)
    r = er.matrix_exp(A)
    # The diagonal of exp(A) is exp of A's diagonal: e^-1e4 at (0, 0) and (2, 2) round to 0.
    for i in (0, 2):
        assert r.rounded[i, i] == exp_rounded(A[i, i], "float64") == 0
        assert r.tolerance[i, i] < 1e-320
    assert r.rounded[1, 1] == exp_rounded(A[1, 1], "float64") == math.inf


@pytest.mark.parametrize(("fmt", "a"), [("float64", 1e4), ("float64", 800.0), ("float32", 100.0)])
def test_an_exact_value_past_the_range_accepts_no_finite_value(fmt, a):
    dtype = DTYPES[fmt]
    A = np.diag([a, 0.5]).astype(dtype)
    r = er.matrix_exp(A)
    assert exp_rounded(a, fmt) == math.inf
    largest = np.finfo(dtype).max
    for v in (largest, 1.0, 0.0):
        assert not r.covers(np.array([[v, 0.0], [0.0, exp_rounded(0.5, fmt)]], dtype=dtype))[0, 0], v
    assert r.covers(np.array([[math.inf, 0.0], [0.0, exp_rounded(0.5, fmt)]], dtype=dtype)).all()
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()


def test_bound_products_take_zero_times_inf_as_zero():
    # The model's products of nonnegative bounds: a zero bound is an exact zero of the kernel, so
    # 0 * inf counts 0; any other term with an inf is inf.  Checked against the sum term by term.
    from exactref.ops.matrix_exp._model import _mm

    rng = np.random.default_rng(3)
    for _ in range(20):
        X, Y = (np.where(rng.random((4, 4)) < 0.4, 0.0, rng.random((4, 4))) for _ in range(2))
        X[rng.random((4, 4)) < 0.2] = math.inf
        Y[rng.random((4, 4)) < 0.2] = math.inf
        want = np.array([[math.fsum(0.0 if X[i, k] == 0 or Y[k, j] == 0 else X[i, k] * Y[k, j]
                                    for k in range(4)) for j in range(4)] for i in range(4)])
        got = _mm(X, Y)
        assert np.array_equal(np.isinf(got), np.isinf(want))
        assert np.allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-14, atol=0)
