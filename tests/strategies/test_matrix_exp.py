"""matrix_exp and matrix_exp_frechet input sets: the norm bound, and each hard class as promised."""

from fractions import Fraction

import numpy as np
import pytest

import strategies as sx
from exactref.formats import FORMATS, part_of
from strategies._validation import OP_FORMATS

from ._collect import each


def one_norm_bound_holds(A, bound):
    """Every column's sum of |entries| is at most ``bound``, exactly for real entries."""
    if np.iscomplexobj(A):
        return bool(np.all(np.abs(A.astype(np.complex128)).sum(axis=-2) <= bound))
    cols = np.moveaxis(A.astype(np.float64), -2, -1).reshape(-1, A.shape[-2])
    return all(sum(Fraction(abs(float(x))) for x in col) <= Fraction(bound) for col in cols)


@pytest.mark.parametrize("fmt", OP_FORMATS, ids=str)
def test_norm_bound_and_hard_classes(fmt):
    seen = set()
    part = part_of(FORMATS[fmt])

    def check(case):
        A, grad = case.A, case.grad
        assert A.shape[-1] == A.shape[-2] and grad.shape == A.shape
        assert one_norm_bound_holds(A, 2.0) and one_norm_bound_holds(grad, 2.0)
        for h in case.hard:
            M = A[h.index]
            if h.kinds == ("nilpotent",):
                assert not np.tril(M).any()
            else:
                assert h.kinds == ("threshold",)
                norm = max(sum(Fraction(abs(complex(x)).real) for x in col) for col in M.T)
                near = [t for t in sx.degree_thresholds(fmt, 2.0)
                        if abs(norm - Fraction(t)) <= 3 * Fraction(part.ulp(t))]
                assert near, f"1-norm {float(norm)} is not within 2 ulps of a threshold"
            seen.update(h.kinds)
        return seen == set(sx.MATRIX_EXP_HARD_CLASSES)

    each(sx.matrix_exp_inputs(dtypes=[fmt], max_norm=2.0), 300, check)
    assert seen == set(sx.MATRIX_EXP_HARD_CLASSES)


def test_frechet_has_no_grad_and_draws_commuting_directions():
    seen = set()

    def check(case):
        assert case.grad is None and case.E.shape == case.A.shape
        for h in case.hard:
            if h.kinds == ("commuting",):
                ratio = {float(e) / float(a) for a, e in zip(case.A[h.index].reshape(-1), case.E[h.index].reshape(-1))
                         if a != 0}
                assert len(ratio) <= 1 and all(np.log2(r).is_integer() for r in ratio)
            seen.update(h.kinds)
        return len(seen) == 3

    each(sx.matrix_exp_frechet_inputs(dtypes=["float64"]), 300, check)
    assert seen == {"nilpotent", "threshold", "commuting"}


def test_thresholds_follow_pytorch_tables():
    assert sx.degree_thresholds("float32", 4.0)[:2] == (1.192092800768788e-07, 5.978858893805233e-04)
    # every dtype but float32 and complex64 uses the double table, half types included
    assert sx.degree_thresholds("bfloat16", 4.0)[0] == 2.220446049250313e-16
    assert sx.degree_thresholds("float64", 4.4)[-1] == pytest.approx(4 * 1.090863719290036)


def finite(case):
    return bool(np.isfinite(case.A.astype(np.complex128)).all())


def test_specials_are_off_by_default():
    def check(case):
        assert finite(case)
    each(sx.matrix_exp_inputs(), 100, check)


def test_specials_can_be_switched_on():
    found = []

    def check(case):
        if not finite(case):
            found.append(case)
            return True
        return False

    each(sx.matrix_exp_inputs(specials=True), 200, check)
    assert found
