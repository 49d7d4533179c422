"""The fast forms of issue 12's hot spots give exactly the values of their definitions.

* rounding.next_up / next_down on large float64 arrays (bit arithmetic) against
  math.nextafter, element by element, zeros of both signs, subnormals, the
  largest finite values, infinities and NaN included;
* fast._first_level (the fused first level of a long float32 sum) against the
  exact sums of its groups of 64, written out here: the sums within gamma_63,
  the sums of |x| within gamma_63 of float32 (taken again in float64 where
  one overflows float32).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref import _fused, rounding
from exactref.engine import fast, products

F64_MAX = float(np.finfo(np.float64).max)
SPECIAL = [0.0, -0.0, 5e-324, -5e-324, 2.0 ** -1022, -(2.0 ** -1022), 2.0 ** -1022 - 5e-324,
           F64_MAX, -F64_MAX, 1.0, -1.0, 2.0 ** -960, 2.0 ** 1000, -(2.0 ** -1021)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)


def _adversarial(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal(n) * np.ldexp(1.0, rng.integers(-1100, 1020, n))  # finite: the bit path
    pick = rng.random(n) < 0.3
    x[pick] = rng.choice(SPECIAL, int(pick.sum()))
    return x


@pytest.mark.parametrize("special", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("up", [True, False])
def test_next_up_down_match_math_nextafter(special: float | None, up: bool) -> None:
    rng = np.random.default_rng(12)
    x = _adversarial(rng, 3 * rounding._BITS_MIN)
    assert np.isfinite(x).all()  # so that without a special value the bit arithmetic runs
    if special is not None:
        x[17] = special
    with np.errstate(over="ignore"):  # np.nextafter(F64_MAX, inf) warns, where an infinity is in x
        got = (rounding.next_up if up else rounding.next_down)(x)
    target = math.inf if up else -math.inf
    want = np.array([math.nextafter(v, target) for v in x.tolist()])
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan])
    # Both zeros have the same neighbours, of the right sign.
    if special is None:
        assert np.array_equal(_bits(got[x == 0]), _bits(np.full(int((x == 0).sum()), 5e-324 if up else -5e-324)))


def test_next_up_keeps_layout_and_input() -> None:
    x = _adversarial(np.random.default_rng(3), 4 * rounding._BITS_MIN).reshape(64, -1).T  # not C-contiguous
    before = x.copy()
    got = rounding.next_up(x)
    assert got.shape == x.shape
    assert np.array_equal(_bits(x), _bits(before))
    with np.errstate(over="ignore"):
        assert np.array_equal(_bits(got), _bits(np.nextafter(x, np.inf)))


@pytest.fixture
def numpy_first_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """fast._first_level's numpy code, as without numba (the compiled loop that takes its place
    where numba is present is tested in tests/exactref/test_fused_sums.py)."""
    monkeypatch.setattr(_fused, "available", lambda: False)


@pytest.mark.usefixtures("numpy_first_level")
@pytest.mark.parametrize(("rows", "T"), [(1, 4096), (1, 4097), (1, 300_001), (3, 70_000), (40, 5000)])
def test_first_level_sums_each_group_within_gamma_63(rows: int, T: int) -> None:
    # The groups, written out here: each row cut into bunches of 64 w values (the last padded with
    # zeros), a bunch read as a (64, w) matrix whose columns are the groups.
    rng = np.random.default_rng(T)
    x = (rng.standard_normal((rows, T)) * np.ldexp(1.0, rng.integers(-60, 60, (rows, T)))).astype(np.float32)
    x[:, ::5] = -x[:, ::5]
    first, first_abs, g_abs, made = fast._first_level(x)
    assert made == 1
    w = max(1, fast._FUSED_CHUNK // (64 * rows))
    groups = []
    for j0 in range(0, T, 64 * w):
        part = x[:, j0:j0 + 64 * w]
        cols = -(-part.shape[1] // 64)
        padded = np.zeros((rows, 64 * cols))
        padded[:, :part.shape[1]] = part
        groups.append(padded.reshape(rows, 64, cols))
    picks = sorted({0, 1, first.shape[1] - 1, *rng.integers(0, first.shape[1], 40).tolist()})
    gamma = 63 * 2.0 ** -53 / (1 - 63 * 2.0 ** -53)
    # The sums of |x| are float32 sums: gamma_63 in float32's unit roundoff.
    gamma32 = Fraction(63, 2 ** 24) / (1 - Fraction(63, 2 ** 24))
    assert gamma32 <= Fraction(g_abs) <= gamma32 * Fraction(101, 100)
    g_all = np.concatenate(groups, axis=2)
    assert first.shape == first_abs.shape == (rows, g_all.shape[2])
    beyond_float64 = 0  # groups whose sum of |x| errs by more than float64's gamma_63 would allow
    for r in range(rows):
        for k in picks:
            terms = [Fraction(float(v)) for v in g_all[r, :, k]]
            exact, absolute = sum(terms, Fraction(0)), sum(map(abs, terms), Fraction(0))
            bound = Fraction(gamma) * absolute
            assert abs(Fraction(float(first[r, k])) - exact) <= bound, (r, k)
            error = abs(Fraction(float(first_abs[r, k])) - absolute)
            assert error <= gamma32 * absolute, (r, k)
            beyond_float64 += error > bound
            assert absolute > 0
    # So the float32 bound is needed: float64's would be wrong for them.
    assert beyond_float64 > 0


@pytest.mark.usefixtures("numpy_first_level")
def test_first_level_takes_sums_of_abs_again_in_float64_where_float32_overflows() -> None:
    # 8192 values in one bunch of 128 groups: values 128 apart (and 1024 apart, as in the op's
    # bunches of 65536 below) share a group.  Two of 3e38 and -3e38 there overflow float32's sum of |x|.
    x = np.full((1, 8192), 1.0, dtype=np.float32)
    x[0, 3200], x[0, 3200 + 1024] = np.float32(3e38), np.float32(-3e38)
    with np.errstate(over="ignore"):  # (as long_sums calls it)
        first, first_abs, g_abs, _ = fast._first_level(x)
    assert g_abs == fast.gamma(63, fast.U64)
    assert np.isfinite(first_abs).all()
    exact = 62 + 2 * Fraction(float(np.float32(3e38)))
    assert abs(Fraction(float(first_abs[0, 0])) - exact) <= Fraction(g_abs) * exact
    assert abs(Fraction(float(first[0, 0])) - 62) <= Fraction(fast.gamma(63, fast.U64)) * exact
    # The op's sum: 65520 ones, the large values cancelling.
    res = er.sum(np.tile(x[0], 8))
    assert res.rounded == np.float32(65520)
    assert res.covers(np.float32(65520))


@pytest.mark.parametrize("seed", range(4))
def test_long_float32_sum_bounds_the_sum_of_abs_from_above(seed: int) -> None:
    # Values in [1, 2) are multiples of 2**-23: their exact sum is an integer sum.  The float32
    # group sums of |x| round either way; S, the computed sum times (1 + 2 (g32 + (L - 1) g64)),
    # must still be at least the exact one, and tight.
    x = np.random.default_rng(seed).uniform(1.0, 2.0, 1 << 20).astype(np.float32)
    exact = Fraction(int((x.astype(np.float64) * 2.0 ** 23).astype(np.int64).sum()), 2 ** 23)
    with np.errstate(over="ignore", invalid="ignore"):
        enc = fast.long_sums(x, True)
    assert exact <= Fraction(float(enc.S)) <= exact * (1 + Fraction(1, 10 ** 5))
    assert abs(Fraction(float(enc.hi)) + Fraction(float(enc.lo)) - exact) <= Fraction(float(enc.rad))


@pytest.mark.parametrize("rows", [3, 700])  # one block, and blocks of rows side by side
def test_sliced_product_without_bound_keeps_the_enclosure_and_never_a_nan_radius(rows: int) -> None:
    """matmul_sliced(bound=False) skips S only: hi, lo and rad are those of bound=True, bit for
    bit, and rad is finite or +inf (attention's `sliced` relies on that, copying nothing)."""
    rng = np.random.default_rng(7)
    A = rng.standard_normal((rows, 400)) * 2.0 ** rng.integers(-30, 30, (rows, 400))
    B = rng.standard_normal((400, 500))
    A[0, 0], A[1, 1], B[2, 3] = np.nan, np.inf, -np.inf
    full, light = products.matmul_sliced(A, B), products.matmul_sliced(A, B, bound=False)
    assert light.S is None and full.S is not None
    for a, b in ((full.hi, light.hi), (full.lo, light.lo), (full.rad, light.rad)):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(light.rad).any() and np.isinf(light.rad).any()


def _fits_float32_range(absB: np.ndarray) -> bool:
    """The definition, written out: every nonzero |b| lies in [2**-60, 2**60] (NaN fails both)."""
    return bool(np.all((absB == 0) | ((absB >= 2.0 ** -60) & (absB <= 2.0 ** 60))))


@pytest.mark.parametrize("shape", [(300, 200), (700, 600), (2, 500, 300)])  # one block; blocks side by side
@pytest.mark.parametrize("bad", [None, 2.0 ** 61, -(2.0 ** -61), np.nan, np.inf, 0.0])
@pytest.mark.parametrize("where", [0, -1])
def test_abs_of_b_in_float32_matches_its_definition(monkeypatch, shape, bad, where) -> None:
    """products._abs_float32 (blocks side by side, each checked in cache) gives |B| in float32
    exactly where every nonzero |b| is within [2**-60, 2**60], and |B| in float64 otherwise."""
    from exactref import _parallel
    monkeypatch.setattr(_parallel, "width", lambda: 1 if getattr(_parallel._local, "inside", False) else 4)
    B = np.random.default_rng(3).standard_normal(shape)
    if bad is not None:
        B.reshape(-1)[where] = bad
    absB, fits = products._abs_float32(B)
    assert fits is _fits_float32_range(np.abs(B)) and fits is (bad is None or bad == 0.0)
    # (float32 rounds these float64 values: products.Right.abs_bound pays for that rounding.)
    expected = np.abs(B).astype(np.float32) if fits else np.abs(B)
    assert absB.dtype == expected.dtype and absB.shape == B.shape
    np.testing.assert_array_equal(absB, expected)
    # A view (not C-contiguous) takes the one-piece path: the same answer.
    absT, fitsT = products._abs_float32(np.swapaxes(B, -1, -2))
    assert fitsT is fits
    np.testing.assert_array_equal(absT, np.swapaxes(expected, -1, -2))
