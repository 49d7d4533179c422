"""Result and Gradients: inputs covers() takes, what check() reports, exact values; judge_one against
judge, bit for bit."""

from __future__ import annotations

import re
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
from exactref.formats import FORMATS
from exactref.result import judge, judge_one

from .oracle import bits_equal

A = er.asarray([[1.0, 2.0], [3.0, 4.0]], "float32")
B = er.asarray([[0.1], [0.2]], "float32")


def test_covers_takes_lists_numpy_and_torch_tensors():
    res = er.matmul(A, B)
    good = A @ B
    assert res.covers(good).all()
    assert res.covers(good.tolist()).all()
    assert res.covers(torch.from_numpy(good)).all()
    assert res.covers(torch.from_numpy(good).requires_grad_()).all()  # detached for us
    assert res.covers(good.astype(np.float64)).all()


def test_covers_takes_bfloat16_tensors():
    x = er.asarray([1.0, 2.5], "bfloat16")
    res = er.multiply(x, x)
    t = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    assert res.covers(t * t).all()
    assert res.rounded.dtype == ml_dtypes.bfloat16


def test_check_reports_count_index_values_and_distances():
    res = er.matmul(A, B)
    bad = np.array([[0.5], [1.25]], dtype=np.float32)
    with pytest.raises(er.OutOfToleranceError) as info:
        res.check(bad)
    text = str(info.value)
    assert text.startswith("matmul: 1 of 2 elements are not covered (float32, error model default).")
    assert "at (1, 0): got 1.25 (0x1.4000000000000p+0)" in text
    assert "exact ~1.1000000163912773e+00" in text
    assert "rounded 1.10000002 (0x1.19999a0000000p+0)" in text
    assert re.search(r"tolerance 1\.12e-07\n\s+off by [0-9.e+]+ tolerances, \+[0-9.e+]+ ulps", text)
    assert info.value.indices == [(1, 0)]
    assert isinstance(info.value, AssertionError)


def test_check_lists_the_worst_elements_first():
    x = er.asarray(np.ones(8), "float32")
    res = er.add(x, x)
    bad = np.full(8, 2.0, dtype=np.float32)
    bad[3] += 1.0
    bad[6] += 0.5
    with pytest.raises(er.MismatchError) as info:
        res.check(bad)
    assert info.value.indices == [(3,), (6,)]
    assert "2 of 8 elements" in str(info.value)


def test_check_names_the_broken_special_value_rule():
    x = er.asarray([np.nan, 1.0, 3.0e38], "float32")
    res = er.add(x, x)
    with pytest.raises(er.SpecialValueError) as info:
        res.check(np.array([0.0, np.nan, 3.4e38], dtype=np.float32))
    text = str(info.value)
    assert "at (0,): got 0 (0x0.0p+0): the normal answer is NaN" in text
    assert "at (1,): got nan: NaN where the exact value is finite" in text
    assert "at (2,): got 3.39999995e+38 (0x1.ff933c0000000p+127): the exact value overflows float32" in text


def test_check_with_wrong_shape_raises_shape_mismatch():
    with pytest.raises(er.ShapeMismatchError, match=r"x has shape \(2,\) but matmul's output has shape \(2, 1\)"):
        er.matmul(A, B).check(np.zeros(2))


def test_exact_values_are_fractions_and_pairs_for_complex():
    res = er.matmul(A, B)
    q = res.exact((1, 0))
    assert isinstance(q, Fraction)
    assert q == 3 * Fraction(float(B[0, 0])) + 4 * Fraction(float(B[1, 0]))
    z = er.multiply(er.asarray([1 + 2j], "complex64"), er.asarray([3 - 1j], "complex64"))
    assert z.exact((0,)) == (Fraction(5), Fraction(5))
    assert er.add(er.asarray([np.inf], "float32"), 1.0).exact(0) is None


def test_gradients_check_reports_every_failing_gradient():
    g = er.matmul.backward(A, B, er.asarray([[1.0], [1.0]], "float32"))
    with pytest.raises(er.OutOfToleranceError) as info:
        g.check(grad_A=g.rounded.grad_A + 1, grad_B=g.rounded.grad_B + 1)
    text = str(info.value)
    assert "matmul.backward grad_A:" in text and "matmul.backward grad_B:" in text
    g.check(grad_A=g.rounded.grad_A, grad_B=g.rounded.grad_B)


def test_result_backward_reuses_the_forward_inputs():
    grad = er.asarray([[1.0], [2.0]], "float32")
    via_result = er.matmul(A, B).backward(grad)
    standalone = er.matmul.backward(A, B, grad)
    for name in ("grad_A", "grad_B"):
        assert np.array_equal(via_result[name].rounded, standalone[name].rounded)


def test_normal_equals_rounded_where_inputs_are_finite_and_gives_specials_elsewhere():
    x = er.asarray([1.0, np.inf, np.nan], "float32")
    res = er.multiply(x, 0.0)
    assert np.isnan(res.normal[1]) and np.isnan(res.normal[2])
    assert res.normal[0] == 0.0
    assert res.tolerance.tolist() == [0.0, 0.0, 0.0]


def test_matrix_exp_frechet_has_no_backward():
    with pytest.raises(AttributeError, match="no backward"):
        er.matrix_exp_frechet.backward


class _DLPackOnly:
    """An object that offers nothing but the DLPack protocol, as array libraries do."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_objects_are_read_as_arrays():
    data = np.array([[1.0, 2.0]], dtype=np.float32)
    assert er.asarray(_DLPackOnly(data)).tolist() == [[1.0, 2.0]]
    res = er.matmul(_DLPackOnly(data), _DLPackOnly(data.T.copy()))
    assert res.covers(_DLPackOnly(np.array([[5.0]], dtype=np.float32))).all()


def _judge_numpy(x_lo: float, x_hi: float, E: float) -> tuple[float, float, float]:
    rounded = float(np.float32(x_hi)) if abs(x_hi) <= 3e38 else x_hi
    with np.errstate(over="ignore", invalid="ignore"):
        part = judge(np.array(rounded), np.array(x_lo), np.array(x_hi), np.array(E), FORMATS["float32"])
    assert not part.special_ok and not part.nan_ok
    return float(part.lo), float(part.hi), float(part.tolerance)


def _check_judge_one(x_lo: float, x_hi: float, E: float) -> bool:
    """judge_one's (lo, hi, tolerance) are judge's, bit for bit, or it declines an E that is not
    positive and finite, or ends past float32's largest value; returns whether it judged."""
    got = judge_one(x_lo, x_hi, E, FORMATS["float32"])
    if got is None:
        big = max(abs(x_lo), abs(x_hi)) + E > 3.4e38
        assert not 0 < E < np.inf or big, (x_lo, x_hi, E)
        return False
    assert bits_equal(np.array(got), np.array(_judge_numpy(x_lo, x_hi, E))), (x_lo, x_hi, E, got)
    return True


_VALUES = st.floats(-3.4e38, 3.4e38) | st.floats(-1e-30, 1e-30)


@settings(max_examples=1000)
@given(x=_VALUES, width=st.floats(0, 1) | st.just(0.0), E=st.floats(0, 1e38) | st.floats(0, 1e-40))
def test_judge_one_is_judges_values(x: float, width: float, E: float) -> None:
    # bounds x_lo <= x_hi around x, as far apart as the ends of a decided value may lie
    _check_judge_one(x, x + width * abs(x) * 2.0 ** -30, E)


@pytest.mark.parametrize(("x_lo", "x_hi", "E", "judges"), [
    (1.0, 1.0 + 2.0 ** -50, 1e-3, True),
    (-5.5, -5.5, 2.0 ** -1074, True),  # the least E
    (0.0, 0.0, 1e-45, True),
    (-(2.0 ** -1073), -(2.0 ** -1073), 2.0 ** -1074, True),  # the absolute slack makes hi +0, not -0
    (3.0e38, 3.0e38, 1e37, True),  # an end near the largest value
    (3.0e38, 3.0e38, 1e38, False),  # past it
    (1.0, 1.0, 0.0, False),  # E = 0 asks for the exact value itself
    (1.0, 1.0, np.inf, False),
    (1.0, 1.0, np.nan, False),
])
def test_judge_one_judges_what_it_covers(x_lo: float, x_hi: float, E: float, judges: bool) -> None:
    assert _check_judge_one(x_lo, x_hi, E) is judges
