"""Double-double balls against Fractions (add, mul, div) and mpmath at 400 bits (exp).

Each operation's ball must hold the exact result at every corner and at the
centre of its operands' balls, on data built to be hard: cancellation, lo
parts of either sign, radii from 0 to a tenth of the value, magnitudes near
underflow and near the split's overflow.  And it must be tight where it
should be: a radius near 2**-100 relative for exact operands of ordinary
size, or the pass it serves would decide nothing.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exactref.engine import balls
from exactref.engine.balls import Ball

F = Fraction


def _parts(hi: float, lo_rel: float, rad_rel: float) -> tuple[float, float, float]:
    lo = float(np.float64(hi) * lo_rel)
    # A normalised pair: lo below half an ulp of hi.
    s = hi + lo
    lo = float(F(hi) + F(lo) - F(s))
    return s, lo, abs(s) * rad_rel


@st.composite
def ball_values(draw, min_exp: int = -1000, max_exp: int = 900):
    mant = draw(st.floats(0.5, 1.0, exclude_max=True))
    e = draw(st.integers(min_exp, max_exp))
    sign = draw(st.sampled_from([-1.0, 1.0]))
    hi = sign * float(np.ldexp(mant, e))
    lo_rel = draw(st.sampled_from([0.0, 2.0 ** -54, -(2.0 ** -53) * 0.9, 2.0 ** -70]))
    rad_rel = draw(st.sampled_from([0.0, 0.0, 2.0 ** -100, 2.0 ** -60, 0.1]))
    return _parts(hi, lo_rel, rad_rel)


def _ball(parts) -> Ball:
    return Ball(*(np.array([p]) for p in parts))


def _points(parts):
    hi, lo, rad = parts
    c = F(hi) + F(lo)
    return [c - F(rad), c, c + F(rad)]


def _holds(result: Ball, exact: Fraction) -> bool:
    if not np.isfinite(result.rad[0]):
        return True  # given up: sound, and the callers send the element on
    return abs(exact - F(result.hi[0]) - F(result.lo[0])) <= F(result.rad[0])


@settings(max_examples=400, deadline=None)
@given(x=ball_values(), y=ball_values(), cancel=st.booleans())
def test_add_holds_every_corner(x, y, cancel):
    if cancel:  # y close to -x: the hard case of a sum
        y = _parts(-x[0] * (1 + 2.0 ** -40), 2.0 ** -54, 0.0)
    z = balls.add(_ball(x), _ball(y))
    for a, b in itertools.product(_points(x), _points(y)):
        assert _holds(z, a + b), (x, y, z)


@settings(max_examples=400, deadline=None)
@given(x=ball_values(-500, 480), y=ball_values(-560, 480))
def test_mul_holds_every_corner(x, y):
    z = balls.mul(_ball(x), _ball(y))
    for a, b in itertools.product(_points(x), _points(y)):
        assert _holds(z, a * b), (x, y, z)


@settings(max_examples=400, deadline=None)
@given(x=ball_values(-500, 480), y=ball_values(-480, 480))
def test_div_holds_every_corner(x, y):
    z = balls.div(_ball(x), _ball(y))
    for a, b in itertools.product(_points(x), _points(y)):
        if b != 0:
            assert _holds(z, a / b), (x, y, z)


def test_products_below_the_split_range_and_above_it():
    # Near underflow two_prod's error term is not exact, above 2**995 its split overflows.
    for a, b in [(2.0 ** -600, 3.0 * 2.0 ** -420), (2.0 ** -1000, 0.75), (5e-324, 3.0), (2.0 ** 996, 1.5)]:
        z = balls.mul(balls.exact(np.array([a])), balls.exact(np.array([b])))
        assert _holds(z, F(a) * F(b)), (a, b)
    assert not np.isfinite(balls.mul(balls.exact(np.array([2.0 ** 996])), balls.exact(np.array([1.5]))).rad[0])


def test_exact_operands_of_ordinary_size_give_radii_near_2_to_the_minus_100():
    rng = np.random.default_rng(0)
    x, y = (balls.exact(rng.standard_normal(1000) * 10.0 ** rng.integers(-5, 5, 1000)) for _ in range(2))
    for op in (balls.mul, balls.div):
        z = op(x, y)
        assert np.max(z.rad / np.abs(z.hi)) < 2.0 ** -100, op.__name__
    s = balls.add(x, y)  # relative to the operands: a sum's cancellation is not its error
    assert np.max(s.rad / (np.abs(x.hi) + np.abs(y.hi))) < 2.0 ** -100


def test_sum_last_holds_the_exact_sums():
    rng = np.random.default_rng(1)
    hi = rng.standard_normal((6, 37)) * 2.0 ** rng.integers(-40, 40, (6, 37))
    lo = hi * rng.standard_normal((6, 37)) * 2.0 ** -60
    rad = np.abs(hi) * 2.0 ** -90
    total = balls.sum_last(Ball(hi, lo, rad))
    for i in range(6):
        exact = sum((F(a) + F(b) for a, b in zip(hi[i], lo[i])), F(0))
        slack = sum((F(r) for r in rad[i]), F(0))
        assert abs(exact - F(total.hi[i]) - F(total.lo[i])) <= F(total.rad[i]) - slack
        assert total.rad[i] - float(slack) < 2.0 ** -95 * np.sum(np.abs(hi[i]))  # the sum's own


def _exp_cases() -> np.ndarray:
    rng = np.random.default_rng(2)
    y = np.concatenate([
        -rng.random(3000) * 745.0,  # the whole range of weights
        -rng.random(1000) * 2.0 ** -20,  # near 1
        np.arange(-400, 1) * np.log(2) / 256,  # at the table's own points and between
        (np.arange(-400, 1) + 0.5) * np.log(2) / 256,
        [-744.5, -744.0, -708.4, -700.0, 0.0, 1e-300, 2.0 ** -40, 1.0, 7.9],
    ])
    return y


def test_exp_holds_mpmath_at_400_bits_and_is_near_2_to_the_minus_90():
    y = _exp_cases()
    rng = np.random.default_rng(3)
    lo = y * rng.standard_normal(y.size) * 2.0 ** -56  # an argument with bits below float64's
    rad = np.abs(y) * 2.0 ** -104 * rng.integers(0, 2, y.size)
    w = balls.exp(Ball(y, lo, rad))
    with mpmath.workprec(400):
        for i in range(y.size):
            for c in (-1, 0, 1):
                arg = mpmath.mpf(y[i]) + mpmath.mpf(lo[i]) + c * mpmath.mpf(rad[i])
                err = abs(mpmath.exp(arg) - mpmath.mpf(w.hi[i]) - mpmath.mpf(w.lo[i]))
                assert err <= w.rad[i], (y[i], lo[i], rad[i])
    # Tight: the bound on the float64 tail of the polynomial (near 2**-91 at |r| = 2**-9.5) and the
    # reduction's 2u**2 |y| (2**-94 at y = -745) are the most of it.
    normal = (w.hi > 2.0 ** -900) & (rad == 0)
    assert np.max(w.rad[normal] / w.hi[normal]) < 2.0 ** -90
    assert np.median(w.rad[normal] / w.hi[normal]) < 2.0 ** -95


def test_exp_far_below_and_above():
    y = np.array([-746.0, -1e6, -np.inf, 9.0, np.nan])
    w = balls.exp(balls.exact(y))
    assert np.all(w.hi[:3] == 0) and np.all(w.rad[:3] <= 2.0 ** -1069)
    assert not np.isfinite(w.rad[3:]).any()


@pytest.mark.parametrize("v", [mpmath.mpf(1) / 3, mpmath.pi, mpmath.mpf(2) ** -1060])
def test_constants_hold_their_value(v):
    with mpmath.workprec(300):
        hi, lo, rad = balls.constant(v)
        assert abs(v - mpmath.mpf(hi) - mpmath.mpf(lo)) <= mpmath.mpf(rad)


def test_mul_of_balls_whose_lo_is_not_below_an_ulp_of_hi():
    # A caller's pair need not be normalised: (1 + 1/2)(1 + 1/2) drops lo * lo = 1/4 exactly.
    for x, y in [((1.0, 0.5), (1.0, 0.5)), ((3.0, -1.0), (1.0, 0.75)), ((2.0 ** -500, 2.0 ** -502), (7.0, 3.0))]:
        z = balls.mul(_ball((*x, 0.0)), _ball((*y, 0.0)))
        assert _holds(z, (F(x[0]) + F(x[1])) * (F(y[0]) + F(y[1]))), (x, y)
