"""Formats and rounding against the Fraction oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import exactref as er
from exactref import rounding
from exactref.engine import decision
from exactref.formats import FLOAT8_FORMATS, FORMATS
from exactref.rounding import (
    decide,
    round_dyadic,
    round_dyadic_down_up,
    round_float64,
    to_dtype,
)

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
    value, decided = decision.decide_narrow(np.array([x]), np.array([x]), fmt)
    assert decided[0] and bits_equal(float(value[0]), want)


@pytest.mark.parametrize("tight", [False, True])
@given(hi=st.floats(-1e300, 1e300), lo=st.floats(-1e-3, 1e-3), rad=st.floats(0, 1e-3))
def test_enclosure_bounds_hold_the_enclosures_ends(tight, hi, lo, rad):
    low, high = rounding.enclosure_bounds(np.array([hi]), np.array([lo]), np.array([rad]), tight=tight)
    assert Fraction(float(low[0])) <= Fraction(hi) + Fraction(lo) - Fraction(rad)
    assert Fraction(float(high[0])) >= Fraction(hi) + Fraction(lo) + Fraction(rad)


@example(hi=1.0, near=2.0 ** -30, rad=2.0 ** -60)  # lo - rad rounds by 2**-60, much more than |v| 2**-50
@given(hi=st.floats(-1, 1), near=st.floats(-1, 1), rad=st.floats(0, 1e-9))
def test_enclosure_bounds_hold_cancelling_ends_on_arrays_and_python_floats(hi, near, rad):
    # lo about -hi: hi + lo is small, and the rounding of lo -+ rad is paid for by |lo| in the slack's
    # scale.  Python floats (engine.decision.decide_one's) get the array's bounds, bit for bit.
    lo = near - hi
    exact = Fraction(hi) + Fraction(lo)
    low, high = rounding.enclosure_bounds(np.array([hi]), np.array([lo]), np.array([rad]))
    assert Fraction(float(low[0])) <= exact - Fraction(rad) and exact + Fraction(rad) <= Fraction(float(high[0]))
    assert bits_equal(np.array(rounding.enclosure_bounds(hi, lo, rad)), np.array([low[0], high[0]]))


@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("name", REAL)
@given(mid=st.floats(-1e6, 1e6), rad=st.floats(0, 1e-3), lo=st.floats(-1e-12, 1e-12))
def test_decide_is_sound(name, mid, rad, lo, tight):
    """Where decide() decides, every point of the enclosure rounds to its answer."""
    fmt = FORMATS[name]
    enc = (np.array([mid]), np.array([lo]), np.array([rad]))
    bounds = rounding.enclosure_bounds(*enc, tight=True) if tight else None
    r, ok = decide(*enc, fmt, bounds)
    if ok[0]:
        for point in (Fraction(mid) + Fraction(lo) - Fraction(rad), Fraction(mid) + Fraction(lo) + Fraction(rad)):
            assert bits_equal(float(r[0]), round_fraction(point, name)) or point == 0


def test_decide_never_decides_an_enclosure_touching_zero():
    r, ok = decide(np.array([0.0, 1e-300]), np.array([0.0, 0.0]), np.array([0.0, 2e-300]), FORMATS["float32"])
    assert not ok.any()


# A large array rounds through its bits (exactref.rounding._round_bits), the few values outside a
# format's normal range through the exponent of each: both against the oracle, in one array.
LARGE = 2048
ORACLE_NAMES = [name for name in ORACLE_FORMATS if name != "float64"]


def _hard_values(name: str) -> np.ndarray:
    """Ties and their neighbours in every binade of the format, its overflow threshold, its
    subnormals and the bottom of its normal range, zeros, infinities and NaN, of both signs."""
    fmt = FORMATS[name]
    out: list[float] = []
    for e in range(fmt.emin - fmt.p, fmt.emax + 2):
        ulp = math.ldexp(1.0, max(e, fmt.emin) - fmt.p + 1)
        for m in (0, 1, 2, 3, (1 << (fmt.p - 1)) - 1, 1 << (fmt.p - 1), (1 << fmt.p) - 1):
            base = math.ldexp(1.0, e) + m * ulp if e >= fmt.emin else m * ulp
            tie = base + ulp / 2
            out += [base, tie, math.nextafter(tie, -math.inf), math.nextafter(tie, math.inf), base + ulp / 4]
    top = float(fmt.overflow_threshold)
    out += [fmt.max_finite, top, math.nextafter(top, 0), math.nextafter(top, math.inf), 2 * top,
            fmt.min_normal, math.nextafter(fmt.min_normal, 0), fmt.min_subnormal / 2, fmt.min_subnormal / 4,
            0.0, math.inf, math.nan, 1e300, 1e-300]
    x = np.array(out)
    x = np.concatenate([x, -x])
    return x[np.isnan(x) | (np.abs(x) < np.finfo(np.float64).max)]


def _oracle(x: np.ndarray, name: str) -> np.ndarray:
    def one(v: float) -> float:
        if math.isnan(v):
            return math.nan
        if math.isinf(v):  # what a value far past the overflow threshold rounds to: inf, NaN or the largest
            return round_fraction(Fraction(math.copysign(2, v)) * Fraction(FORMATS[name].overflow_threshold), name)
        return round_fraction(Fraction(v), name, negative_zero=math.copysign(1, v) < 0)
    return np.array([one(float(v)) for v in x])


@pytest.mark.parametrize("block", [None, 1000])
@pytest.mark.parametrize("name", ORACLE_NAMES)
def test_round_float64_of_a_large_array_matches_oracle_at_ties_and_edges(name, block, monkeypatch):
    # block: _round_bits's blocks of 1000 values, the last one partial, so that the values outside
    # the normal range fall in some blocks and not in others.
    if block is not None:
        monkeypatch.setattr(rounding, "_BITS_BLOCK", block)
    x = _hard_values(name)
    n = max(2 * LARGE, 2 * x.size) + 7  # each value twice at least, at two places in the array
    got = round_float64(np.resize(x, n), FORMATS[name])
    want = _oracle(x, name)
    assert bits_equal(got[:x.size], want)
    assert bits_equal(got, np.resize(want, n))


@pytest.mark.parametrize("name", ORACLE_NAMES)
def test_round_float64_of_a_large_array_of_normal_values_needs_no_exponents(name, monkeypatch):
    # The values of the normal range alone, ties among them: every one by its bits.
    fmt = FORMATS[name]
    x = _hard_values(name)
    with np.errstate(invalid="ignore"):
        x = x[(np.abs(x) >= fmt.min_normal) & (np.abs(x) < fmt.max_finite) | (x == 0)]
    want = _oracle(x, name)
    calls = []
    general = rounding._round_general
    monkeypatch.setattr(rounding, "_round_general", lambda *a: calls.append(a) or general(*a))
    got = round_float64(np.resize(x, max(LARGE, x.size)), fmt)
    assert bits_equal(got[:x.size], want)
    if fmt.signed and fmt.has_negative_zero and not (fmt.cast_rounds and fmt.dtype.kind == "f"):
        assert calls == []  # (numpy's own casts, float32's and float16's, are used as they are)


@pytest.mark.parametrize("name", ORACLE_NAMES)
def test_round_float64_of_a_large_array_overflows_as_the_oracle_does(name):
    # Normal values and values about the overflow threshold, nothing else outside the normal range.
    fmt = FORMATS[name]
    x = _hard_values(name)
    with np.errstate(invalid="ignore"):
        x = x[(np.abs(x) >= fmt.min_normal) & (np.abs(x) < math.ldexp(1.0, fmt.emax + 2))]
    assert (np.abs(x) > fmt.max_finite).any()
    got = round_float64(np.resize(x, max(LARGE, x.size)), fmt)
    assert bits_equal(got[:x.size], _oracle(x, name))


@pytest.mark.parametrize("name", ORACLE_NAMES)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=16),
       scale=st.sampled_from([1.0, 2.0 ** -100, 2.0 ** 100, 2.0 ** -20]))
def test_round_float64_of_a_large_array_matches_oracle(name, values, scale):
    with np.errstate(over="ignore"):
        x = np.array(values) * scale
    got = round_float64(np.resize(x, LARGE), FORMATS[name])
    assert bits_equal(got[:x.size], _oracle(x, name))


@pytest.mark.parametrize("name", [name for name, fmt in FORMATS.items()
                                  if fmt.dtype is not None and fmt.dtype.kind == "V"])
def test_to_dtype_stores_every_value_of_an_ml_dtypes_format(name):
    # Every bit pattern, NaNs included: through float32 (a large array) as directly.
    fmt = FORMATS[name]
    width = np.dtype(f"u{fmt.dtype.itemsize}")
    patterns = np.arange(1 << (8 * fmt.dtype.itemsize), dtype=np.int64).astype(width)
    every = np.resize(patterns, max(patterns.size, LARGE)).view(fmt.dtype)
    with np.errstate(invalid="ignore"):  # (the NaN patterns)
        values = every.astype(np.float64)
    stored = to_dtype(values, fmt)
    assert stored.dtype == fmt.dtype and values.size >= LARGE
    assert bits_equal(stored.astype(np.float64), values)
    finite = ~np.isnan(values)
    assert (stored.view(width)[finite] == every.view(width)[finite]).all()
    # And each of them rounds to itself.
    assert bits_equal(round_float64(values, fmt), values)
