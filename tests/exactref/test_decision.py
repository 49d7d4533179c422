"""exactref/engine/decision.py: the roundings it decides from enclosures, and their float64 bounds.

* grid: the lowest set bit of a row's pieces, against Fractions;
* refine: where it decides a row sum, its rounding and float64 bounds are the exact sum's, against
  Fractions rounded by tests/exactref/oracle.py;
* decide_float64 (no nextafter) against decide_float64_general, the nextafter definition, bit for
  bit, on enclosures at and around every threshold (half gaps, gaps, powers of two, the edges of the
  common range);
* decide_one (one float32 value on Python floats) against enclosure_bounds and decide_narrow, bit
  for bit, on enclosures around float32's rounding boundaries, or declining what they leave
  undecided.

(The decisions' compiled forms are held to these in test_fused.py, test_fused_refine.py and
test_fused_judge.py; decide_narrow's roundings to formats whose cast rounds, in test_rounding.py.)
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.engine import decision, fast
from exactref.formats import FORMATS
from exactref.rounding import enclosure_bounds

from .oracle import bits_equal, round_fraction
from .test_engine import wide_floats
from .test_engine_speedups import SPECIAL, _bits

F = Fraction


def lowest_bit(x: float) -> Fraction:
    """The largest power of two of which the float x (nonzero) is a multiple, by Fractions: x is
    n / d with d a power of two, and n's lowest set bit over d."""
    q = abs(F(x))
    return F(q.numerator & -q.numerator, q.denominator)


@settings(max_examples=300)
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 6)), elements=wide_floats(1070)))
def test_grid_is_the_lowest_set_bit_of_the_pieces(rows):
    grid = decision.grid(rows)
    for g, row in zip(grid, rows):
        nonzero = [v for v in row if v != 0]
        assert F(g) == (min(lowest_bit(v) for v in nonzero) if nonzero else 0)


@st.composite
def refine_rows(draw):
    """Rows of float32 products, some with a large pair that cancels, so that the sum is small and exactly
    a float64 (as a float32 matmul's undecided elements are), and rows of wider values."""
    n = draw(st.integers(2, 40))
    kind = draw(st.sampled_from(["float32 products", "cancelling", "wide", "rounded errors"]))
    if kind == "wide":
        return draw(hnp.arrays(np.float64, (3, n), elements=wide_floats(300)))
    if kind == "rounded errors":
        # Large values that the tree sum cancels exactly, each paired at its first level with a
        # small one of few bits and a spread exponent, and 2**12 (an odd column, kept to the last level): the
        # two-sums' errors are the small values, whose float64 sum lo rounds, so hi + lo is not
        # the exact sum.
        m = 2 * draw(st.integers(1, 10))
        big = np.repeat([[2.0 ** 60, -(2.0 ** 60)]], 3 * m // 2, axis=0).reshape(3, m)
        small = draw(hnp.arrays(np.float64, (3, m), elements=st.builds(
            lambda k, e: float(np.ldexp(k, e)), st.integers(-7, 7), st.integers(-70, 5))))
        return np.concatenate([np.sort(big, axis=1)[:, ::-1], small, np.full((3, 1), 2.0 ** 12)], axis=1)
    x = draw(hnp.arrays(np.float32, (3, n), elements=st.floats(-8, 8, width=32)))
    y = draw(hnp.arrays(np.float32, (3, n), elements=st.floats(-8, 8, width=32)))
    P = x.astype(np.float64) * y.astype(np.float64)  # exact
    if kind == "cancelling":  # a large pair that cancels, and the rest
        P[:, 0] = 2.0 ** 40
        P[:, 1] = -(2.0 ** 40)
    return P


@pytest.mark.parametrize("name", ["float64", "float32", "bfloat16"])
@settings(max_examples=300)
@given(rows=refine_rows())
def test_refine_decides_only_correctly(name, rows):
    fmt = FORMATS[name]
    value, lo, hi, ok = decision.refine(rows, fmt)
    for i, row in enumerate(rows):
        if not ok[i]:
            continue
        exact = sum((F(v) for v in row), F(0))
        assert F(lo[i]) <= exact <= F(hi[i])
        assert (lo[i] == hi[i]) == (F(lo[i]) == exact)
        assert bits_equal(value[i], round_fraction(exact, name))


def test_refine_takes_an_exact_float64_sum_of_float32_products_as_exact():
    # The products cancel to 2**-30 + 3 * 2**-60, a float64; the tree sum's bound is not zero.
    row = np.array([[1.0, 2.0 ** -30, -1.0, 3 * 2.0 ** -60, 0.375, -0.375]])
    assert fast.tree_sum(row)[2][0] > 0
    value, lo, hi, ok = decision.refine(row, FORMATS["float32"])
    assert ok[0] and lo[0] == hi[0] == 2.0 ** -30 + 3 * 2.0 ** -60
    assert value[0] == np.float32(2.0 ** -30)


def _enclosures(rng: np.random.Generator, n: int, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if kind == 0:  # ordinary values, lo and rad at fractions of an ulp around the half gap
        hi = rng.standard_normal(n)
    elif kind == 1:  # powers of two (one gap is half the other) and the edges of the common range
        hi = np.ldexp(rng.choice([-1.0, 1.0], n), rng.integers(-1074, 1024, n))
        hi[: n // 4] = rng.choice(SPECIAL, n // 4)
    else:  # ties and small integers
        hi = np.round(rng.standard_normal(n) * 8) / 8
    with np.errstate(over="ignore", invalid="ignore"):  # the ulp of F64_MAX times 1.0 is fine; inf * 0 is not
        ulp = np.spacing(np.abs(hi))
        # 0.5 (1 - 2**-53): lo (and e) just below the half gap, where nextafter(e) is the half gap.
        lo = ulp * rng.choice([0.0, 0.5, -0.5, 0.25, -0.25, 0.5 * (1 - 2.0 ** -53), -0.5 * (1 - 2.0 ** -53), 1e-9], n)
        rad = ulp * rng.choice([0.0, 2.0 ** -30, 0.1, 0.25, 0.49, 0.5, 0.51, 1.0], n)
    odd = rng.random(n) < 0.03
    rad[odd] = rng.choice([math.inf, math.nan, -1.0, 0.0], int(odd.sum()))
    return hi, lo, rad


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_decide_float64_matches_its_definition(kind: int) -> None:
    rng = np.random.default_rng(40 + kind)
    for _ in range(20):
        hi, lo, rad = _enclosures(rng, 500, kind)
        with np.errstate(all="ignore"):
            fast_out = decision.decide_float64(hi, lo, rad)
            ref = decision.decide_float64_general(hi, lo, rad)
        decided = ref[3]
        assert np.array_equal(fast_out[3], decided)
        assert decided.any()
        for got, want in zip(fast_out[:3], ref[:3]):
            assert np.array_equal(_bits(got)[decided], _bits(want)[decided])


F32 = FORMATS["float32"]


@st.composite
def float32_enclosures(draw: st.DrawFn) -> tuple[float, float, float]:
    """``(hi, lo, rad)`` around float32's rounding boundaries: hi a float32 value, or the midpoint
    of two, moved by a few float64 ulps; lo within one of hi's ulps (one time in ten, any float);
    rad from 0 to a few float32 ulps.  Zeros, subnormals and values near float32's largest among
    them."""
    f = draw(st.floats(width=32, allow_nan=False, allow_infinity=False))
    with np.errstate(over="ignore"):  # (inf past the largest value)
        up_ = float(np.nextafter(np.float32(f), np.float32(np.inf)))
    hi = draw(st.sampled_from([f, (f + up_) / 2 if math.isfinite(up_) else f]))
    hi = float(hi + draw(st.integers(-3, 3)) * math.ulp(hi))
    lo = draw(st.sampled_from([0.0, -0.0])) or draw(st.floats(-1, 1)) * math.ulp(hi) / 2
    if draw(st.integers(0, 9)) == 0:
        lo = draw(wide_floats(300))  # (not an enclosure long_sums makes: the same operations all the same)
    scale = max(abs(hi), 2.0 ** -149) * 2.0 ** -24
    rad = draw(st.sampled_from([0.0, 2.0 ** -1074])) or draw(st.floats(0, 4)) * scale * 2.0 ** -draw(st.integers(0, 40))
    return hi, lo, rad


def _numpy_decision(hi: float, lo: float, rad: float) -> tuple[float, float, float, bool]:
    """What the engine gives the value (sumprod._decide for an enclosure whose lo is not marked zero)."""
    with np.errstate(over="ignore", invalid="ignore"):
        x_lo, x_hi = enclosure_bounds(np.array(hi), np.array(lo), np.array(rad))
        rounded, decided = decision.decide_narrow(x_lo, x_hi, F32)
    return float(rounded), float(x_lo), float(x_hi), bool(decided)


def _check_decide_one(hi: float, lo: float, rad: float) -> bool:
    """decide_one's answer is the numpy code's, bit for bit, or it declines one that code leaves
    undecided or whose ends lie past float32's largest value; returns whether it decided."""
    rounded, x_lo, x_hi, decided = _numpy_decision(hi, lo, rad)
    got = decision.decide_one(hi, lo, rad, F32)
    if got is None:
        assert not decided or max(abs(x_lo), abs(x_hi)) > F32.max_finite, (hi, lo, rad)
        return False
    assert decided and bits_equal(np.array(got), np.array([rounded, x_lo, x_hi])), (hi, lo, rad, got)
    return True


@settings(max_examples=1000)
@given(float32_enclosures())
def test_decide_one_is_the_numpy_codes_decision(enc: tuple[float, float, float]) -> None:
    _check_decide_one(*enc)


@pytest.mark.parametrize(("hi", "lo", "rad", "decides"), [
    (1000.5, 0.0, 1e-10, True),  # far from a boundary
    (1.0 + 2.0 ** -24, 0.0, 0.0, False),  # on a tie: the ends' slack puts them on both sides
    (1.0 + 2.0 ** -24, 2.0 ** -60, 2.0 ** -61, False),  # past it by less than the slack
    (1.0 + 2.0 ** -24 + 2.0 ** -40, 0.0, 2.0 ** -45, True),  # past it by more than the radius
    (-(1.0 + 2.0 ** -24 + 2.0 ** -40), 0.0, 2.0 ** -45, True),  # negative
    (0.0, 0.0, 0.0, False),  # a zero's sign is the exact path's
    (2.0 ** -160, 0.0, 2.0 ** -170, True),  # rounds to +0, both ends positive
    (-(2.0 ** -160), 0.0, 2.0 ** -170, True),  # rounds to -0
    (2.0 ** -149 * 1.5, 0.0, 2.0 ** -160, False),  # a subnormal tie
    (float(np.finfo(np.float32).max) * (1 - 2.0 ** -40), 0.0, 1.0, True),  # rounds to the largest
    (float(np.finfo(np.float32).max), 0.0, 2.0 ** 104, False),  # an end past the largest value
    (3.5e38, 0.0, 1.0, False),  # both ends round to inf: decided there, declined here
    (math.inf, 0.0, 0.0, False),
    (math.nan, 0.0, 0.0, False),
    (1.0, 0.0, math.inf, False),
])
def test_decide_one_decides_what_the_numpy_code_decides(hi: float, lo: float, rad: float, decides: bool) -> None:
    assert _check_decide_one(hi, lo, rad) is decides


def test_decide_one_declines_other_formats() -> None:
    for name in ("float64", "float16", "bfloat16"):
        assert decision.decide_one(1000.5, 0.0, 1e-10, FORMATS[name]) is None
