"""The oracle is a test helper, so it is tested too: against numpy's float32 and float16 casts
(IEEE conversions implemented independently of both ExactRef and the oracle) and hand-made cases."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .oracle import Sum, bits_equal, round_fraction

F = Fraction
TWO = Fraction(2)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_round_fraction_matches_numpy_float32_cast(x):
    with np.errstate(over="ignore"):
        expected = float(np.float32(x))
    assert bits_equal(round_fraction(F(x), "float32"), expected) or (x == 0)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_round_fraction_matches_numpy_float16_cast(x):
    with np.errstate(over="ignore"):
        expected = float(np.float16(x))
    assert bits_equal(round_fraction(F(x), "float16"), expected) or (x == 0)


@pytest.mark.parametrize("q, fmt, expected", [
    (1 + TWO ** -24, "float32", 1.0),                      # tie, to even
    (1 + 3 * TWO ** -24, "float32", 1 + 2.0 ** -22),       # tie, to even upward
    (1 + TWO ** -24 + TWO ** -80, "float32", 1 + 2.0 ** -23),
    (TWO ** -150, "float32", 0.0),                          # subnormal tie to zero
    (3 * TWO ** -150, "float32", 2.0 ** -148),
    ((2 - TWO ** -24) * TWO ** 127, "float32", float("inf")),   # overflow threshold rounds up
    ((2 - TWO ** -23) * TWO ** 127, "float32", float(np.finfo(np.float32).max)),
    (1 + TWO ** -8, "bfloat16", 1.0),
    (1 + TWO ** -8 + TWO ** -30, "bfloat16", 1 + 2.0 ** -7),  # ml_dtypes' float64 cast gets this wrong
    (-(1 + TWO ** -53), "float64", -1.0),
    (F(1, 3), "float64", 1 / 3),
])
def test_round_fraction_hand_cases(q, fmt, expected):
    assert bits_equal(round_fraction(q, fmt), expected)


def test_sum_sign_of_zero_follows_ieee():
    s = Sum()
    s.add(-0.0, 1.0)
    s.add(0.0, -1.0)
    assert bits_equal(s.rounded("float32"), -0.0)
    s.add(1.0, 0.0)
    assert bits_equal(s.rounded("float32"), 0.0)
    assert bits_equal(Sum().rounded("float32"), 0.0)


def test_bits_equal_distinguishes_signed_zeros_and_matches_nans():
    assert not bits_equal(np.array([0.0]), np.array([-0.0]))
    assert bits_equal(np.array([np.nan]), np.array([np.nan]))
    assert not bits_equal(np.array([1.0]), np.array([1.0, 1.0]))
