"""Formats and rounding against the Fraction oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import exactref as er
from exactref.engine import sumprod
from exactref.formats import FLOAT8_FORMATS, FORMATS
from exactref.rounding import decide, round_dyadic, round_dyadic_down_up, round_float64

from .oracle import FORMATS as ORACLE_FORMATS
from .oracle import bits_equal, round_fraction

REAL = ["float64", "float32", "float16", "bfloat16"]


@pytest.mark.parametrize("name", REAL)
def test_format_constants_match_numpy_and_ml_dtypes(name):
    fmt = FORMATS[name]
    info = ml_dtypes.finfo(fmt.dtype) if name == "bfloat16" else np.finfo(fmt.dtype)
    assert fmt.max_finite == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert (fmt.p, fmt.emin, fmt.emax) == ORACLE_FORMATS[name]


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_formats_are_described_as_data(name):
    fmt = FLOAT8_FORMATS[name]
    assert fmt.max_finite == float(ml_dtypes.finfo(fmt.dtype).max)
    assert fmt.min_subnormal == float(ml_dtypes.finfo(fmt.dtype).smallest_subnormal)


@pytest.mark.parametrize("name", REAL)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_round_float64_matches_oracle(name, x):
    got = float(round_float64(np.array([x]), FORMATS[name])[0])
    assert bits_equal(got, round_fraction(Fraction(x), name, negative_zero=math.copysign(1, x) < 0))


@pytest.mark.parametrize("name", REAL)
@given(n=st.integers(-(2 ** 80), 2 ** 80), e=st.integers(-1200, 1100))
def test_round_dyadic_matches_oracle(name, n, e):
    q = Fraction(n) * Fraction(2) ** e
    assert bits_equal(round_dyadic(n, e, FORMATS[name]), round_fraction(q, name))
    lo, hi = round_dyadic_down_up(n, e)
    if math.isfinite(lo) and math.isfinite(hi):
        assert Fraction(lo) <= q <= Fraction(hi)
        assert (lo == hi) == (Fraction(lo) == q)
    else:
        # Beyond float64's range one end is the largest finite value and the other infinite.
        assert abs(q) > Fraction(np.finfo(np.float64).max)


def test_asarray_rounds_once_where_a_cast_through_float32_rounds_twice():
    # Just above a bfloat16 tie: float32 rounds it onto the tie, which then rounds to even.
    # (torch and ml_dtypes before 0.7 cast float64 to bfloat16 that way.)
    x = 1 + 2.0 ** -8 + 2.0 ** -30
    assert float(np.float32(x).astype(ml_dtypes.bfloat16)) == 1.0  # the double rounding
    assert float(er.asarray([x], "bfloat16")[0]) == 1 + 2.0 ** -7


@pytest.mark.parametrize("name", [f.name for f in FORMATS.values() if getattr(f, "cast_rounds", False)])
@given(m=st.integers(0, 2 ** 11), binade=st.integers(0, 10 ** 6), offset=st.integers(2, 52),
       sign=st.sampled_from([1, -1]), side=st.sampled_from([1, -1]))
def test_a_format_whose_cast_rounds_rounds_once_just_off_its_ties(name, m, binade, offset, sign, side):
    # A tie (m + 1/2) ulp moved by 2**-offset ulp: a cast through float32 first would put the
    # farther ones onto the tie, which then rounds to even (float16 is cast directly).
    fmt = FORMATS[name]
    q = fmt.emin - fmt.p + 1 + binade % (fmt.emax - fmt.emin + 2)  # the ulp's exponent
    m %= 1 << fmt.p
    x = sign * math.ldexp(2 * m + 1 + side * 2.0 ** -offset, q - 1)
    want = round_fraction(Fraction(x), name, negative_zero=sign < 0)
    assert bits_equal(float(round_float64(np.array([x]), fmt)[0]), want)
    value, decided = sumprod._decide_narrow(np.array([x]), np.array([x]), fmt)
    assert decided[0] and bits_equal(float(value[0]), want)


@pytest.mark.parametrize("name", REAL)
@given(mid=st.floats(-1e6, 1e6), rad=st.floats(0, 1e-3), lo=st.floats(-1e-12, 1e-12))
def test_decide_is_sound(name, mid, rad, lo):
    """Where decide() decides, every point of the enclosure rounds to its answer."""
    fmt = FORMATS[name]
    r, ok = decide(np.array([mid]), np.array([lo]), np.array([rad]), fmt)
    if ok[0]:
        for point in (Fraction(mid) + Fraction(lo) - Fraction(rad), Fraction(mid) + Fraction(lo) + Fraction(rad)):
            assert bits_equal(float(r[0]), round_fraction(point, name)) or point == 0


def test_decide_never_decides_an_enclosure_touching_zero():
    r, ok = decide(np.array([0.0, 1e-300]), np.array([0.0, 0.0]), np.array([0.0, 2e-300]), FORMATS["float32"])
    assert not ok.any()
