"""exactref/_fused_sums.py: the compiled levels of a long float32 sum (group_sums' first two, and
row_sums' every level of one row).

Unlike the other loops, they do not make the numpy code's values (that code
adds in the BLAS's order, which no loop can repeat): they add in an order of
their own, documented in _fused_sums.py.  So they are checked three ways:

* bit for bit against that order, emulated here with numpy's elementwise
  float64 and float32 additions, and Python's float ones (each IEEE's, as
  the loop's);
* each sum within its levels' bound against Fractions: gamma_63 (2 + gamma_63)
  of its absolute sum for two levels of float64 additions;
* whole sums with the loop and without it: the same rounded value, the exact
  one (Fractions rounded by tests/exactref/oracle.py), and enclosures that
  hold it; at a million values too, through the exact path.
"""

from __future__ import annotations

import functools
import math
import operator
from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref import _fused, _fused_sums
from exactref.engine import fast, sumprod

from .oracle import round_fraction

numba = pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loops are not used")

G, L = 64, 128  # the order the tests expect: groups of 64 values across 128 lanes
BUNCH = G * L


def _bits(x: np.ndarray) -> np.ndarray:
    """x's bits, every NaN as one (which NaN an invalid addition gives is the hardware's choice)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    return np.where(np.isnan(x), np.nan, x).view(np.uint64)


def _emulated(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented order: a row's bunches of 8192 values (the last one shorter); in a bunch of
    n values with c = min(128, ceil(n / 64)) lanes, value t goes to lane t % c, each lane added one
    value after another from 0.0, in float64, and its |values| in float32 (in float64 where that
    sum is not finite); then the lanes, 64 at a time, added one after another from 0.0, in
    float64.  Returns the second level's sums and sums of |x|."""
    rows, T = x.shape
    second = np.empty((rows, -(-T // (G * G))))
    second_abs = np.empty_like(second)
    for r in range(rows):
        for b0 in range(0, T, BUNCH):
            vals32 = x[r, b0:b0 + BUNCH]
            vals = vals32.astype(np.float64)
            cols = min(L, -(-vals.size // G))
            s, a32, a64 = np.zeros(cols), np.zeros(cols, np.float32), np.zeros(cols)
            for i in range(0, vals.size, cols):  # (inf - inf is NaN there as in the loop)
                row = vals[i:i + cols]
                s[:row.size] += row
                with np.errstate(over="ignore"):
                    a32[:row.size] += np.abs(vals32[i:i + cols])  # (float32's own additions)
                a64[:row.size] += np.abs(row)
            a = np.where(np.isfinite(a32), a32.astype(np.float64), a64)
            for h in range(-(-cols // G)):
                t, t_abs = np.float64(0.0), np.float64(0.0)
                for j in range(h * G, min(cols, (h + 1) * G)):
                    t, t_abs = t + s[j], t_abs + a[j]
                second[r, b0 // (G * G) + h], second_abs[r, b0 // (G * G) + h] = t, t_abs
    return second, second_abs


def _wide(rng: np.random.Generator, shape: tuple[int, ...], special: bool = False) -> np.ndarray:
    """float32 values of wide exponents, of both signs, and float32's edge values where ``special``."""
    x = (rng.standard_normal(shape) * np.ldexp(1.0, rng.integers(-140, 120, shape))).astype(np.float32)
    if special:
        f32 = np.finfo(np.float32)
        edges = np.array([0.0, -0.0, f32.smallest_subnormal, -f32.smallest_subnormal, f32.tiny, f32.max, -f32.max,
                          np.inf, -np.inf, np.nan], dtype=np.float32)
        pick = rng.random(shape) < 0.05
        x[pick] = rng.choice(edges, int(pick.sum()))
    return x


def test_the_order_the_tests_emulate_is_the_loops() -> None:
    assert (_fused_sums.GROUP, _fused_sums.LANES) == (G, L) == (fast._SUM_WIDTH, L)


@pytest.mark.parametrize(("rows", "T", "special"), [
    (1, BUNCH, False), (1, BUNCH + 1, False), (1, 3 * BUNCH + 4095, True), (1, 300_001, False),
    (3, 70_000, True), (40, 5000, False), (2, 4096 + 7, True), (1, 2 * BUNCH + 64 * 64 + 1, False)])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_group_sums_add_in_their_documented_order_and_copy(rows: int, T: int, special: bool) -> None:
    rng = np.random.default_rng(T + rows)
    x = _wide(rng, (rows, T), special)
    want, want_abs = _emulated(x)
    for parts in (1, 3):  # in one call, and in blocks of rows and whole bunches (as threads take them)
        out = np.full_like(x, np.nan)
        made = _fused_sums.group_sums(x, out, G)
        assert made is not None
        second, second_abs, run = made
        cuts = sorted({0, T, *(BUNCH * rng.integers(0, -(-T // BUNCH) + 1, parts - 1)).tolist()})
        row_cuts = sorted({0, rows, *rng.integers(0, rows + 1, parts - 1).tolist()})
        for r0, r1 in zip(row_cuts, row_cuts[1:]):
            for c0, c1 in zip(cuts, cuts[1:]):
                run(r0, r1, c0, min(c1, T))
        assert np.array_equal(_bits(second), _bits(want)), parts
        assert np.array_equal(_bits(second_abs), _bits(want_abs)), parts
        assert np.array_equal(out.view(np.uint32), x.view(np.uint32)), parts  # (NaN's bits too)
    # Without out, the same sums.
    second, second_abs, run = _fused_sums.group_sums(x, None, G)
    run(0, rows, 0, T)
    assert np.array_equal(_bits(second), _bits(want)) and np.array_equal(_bits(second_abs), _bits(want_abs))


@pytest.mark.parametrize("kind", ["wide", "cancelling"])
def test_group_sums_are_within_two_levels_of_gamma_63(kind: str) -> None:
    # Each level adds at most 64 values: gamma_63 of their absolute sum, the second level's terms
    # being the first's sums, at most (1 + gamma_63) times theirs.  So gamma_63 (2 + gamma_63).
    # The sums of |x|: g32 (float32's gamma_63) at the first level, so g32 + gamma_63 (1 + g32).
    rng = np.random.default_rng(5)
    T = 5 * BUNCH + 3000
    x = _wide(rng, (1, T))
    if kind == "cancelling":  # a value and its negation, and small values between them
        x = np.repeat(rng.standard_normal(T // 2).astype(np.float32) * np.float32(2.0 ** 40), 2)[None, :]
        x[0, 1::2] *= -1
        x[0, ::7] = rng.standard_normal(x[0, ::7].size).astype(np.float32)
    second, second_abs, run = _fused_sums.group_sums(x, None, G)
    run(0, 1, 0, x.shape[1])
    g = Fraction(63, 2 ** 53) / (1 - Fraction(63, 2 ** 53))
    g32 = Fraction(63, 2 ** 24) / (1 - Fraction(63, 2 ** 24))
    for k in range(second.shape[1]):
        # Second-level group k: half k % 2 of bunch k // 2's lanes (value t of a bunch in lane
        # t % cols, cols lanes: 128, or fewer in the last bunch).
        bunch = x[0, k // 2 * BUNCH:(k // 2 + 1) * BUNCH]
        cols = min(L, -(-bunch.size // G))
        lanes = np.arange(bunch.size) % cols
        terms = [Fraction(float(v)) for v in bunch[lanes // G == k % 2]]
        exact, absolute = sum(terms, Fraction(0)), sum(map(abs, terms), Fraction(0))
        assert abs(Fraction(float(second[0, k])) - exact) <= g * (2 + g) * absolute, k
        assert abs(Fraction(float(second_abs[0, k])) - absolute) <= (g32 + g * (1 + g32)) * absolute, k


def test_the_first_level_reports_the_two_levels_the_loop_made() -> None:
    # _sum_block's bound counts the levels from there: the loop's two, then _grouped_sum's.
    x = _wide(np.random.default_rng(1), (1, 3 * BUNCH))
    first, first_abs, g_abs, made = fast._first_level(x)
    assert made == 2 and first.shape == (1, 6) and g_abs == fast.gamma(63, fast.U32)
    assert np.array_equal(_bits(first), _bits(_emulated(x)[0]))


@pytest.mark.parametrize(("rows", "T"), [(1, 10 * BUNCH + 5), (50, 5000), (7, 3 * BUNCH)])
def test_the_first_level_fills_every_part_it_cuts(monkeypatch, rows: int, T: int) -> None:
    # Parts of 2 bunches' worth: a long row in several, short rows several to a part.
    monkeypatch.setattr(fast, "_LOOP_CHUNK", 2 * BUNCH)
    monkeypatch.setattr(fast, "_FUSED_PARALLEL", 0)  # (side by side where the op's threads allow)
    x = _wide(np.random.default_rng(rows), (rows, T))
    out = np.full_like(x, np.nan)
    first, first_abs, _, made = fast._first_level(x, out)
    want, want_abs = _emulated(x)
    assert made == 2 and np.array_equal(_bits(first), _bits(want)) and np.array_equal(_bits(first_abs), _bits(want_abs))
    assert np.array_equal(out, x)
    if T < BUNCH:
        return  # (an op sums rows this short another way)
    # And through an op, on its threads: sums along the last axis, the same with the loop and without.
    ran = []
    real = _fused_sums.group_sums
    monkeypatch.setattr(_fused_sums, "group_sums", lambda *a: ran.append(1) or real(*a))
    got = er.sum(x, axis=1).rounded
    assert ran
    monkeypatch.setattr(_fused, "available", lambda: False)
    assert np.array_equal(got, er.sum(x, axis=1).rounded)


@pytest.mark.parametrize(("rows", "T"), [(1, 10 * BUNCH + 5), (50, 5000), (7, 3 * BUNCH)])
def test_a_block_on_one_thread_takes_one_call_of_the_loop(monkeypatch, rows: int, T: int) -> None:
    # Below _FUSED_PARALLEL values the whole block is one call (each costs microseconds), with the
    # groups that parts of 2 bunches would have made: those of the documented order.
    monkeypatch.setattr(fast, "_LOOP_CHUNK", 2 * BUNCH)
    calls = []
    real = _fused_sums.group_sums

    def counted(*args):
        second, second_abs, run = real(*args)
        return second, second_abs, lambda *cut: calls.append(cut) or run(*cut)
    monkeypatch.setattr(_fused_sums, "group_sums", counted)
    x = _wide(np.random.default_rng(rows + 1), (rows, T))
    assert x.size < fast._FUSED_PARALLEL
    out = np.full_like(x, np.nan)
    first, first_abs, _, made = fast._first_level(x, out)
    want, want_abs = _emulated(x)
    assert calls == [(0, rows, 0, T)]
    assert made == 2 and np.array_equal(_bits(first), _bits(want)) and np.array_equal(_bits(first_abs), _bits(want_abs))
    assert np.array_equal(out, x)


@pytest.mark.parametrize("n", [3 * BUNCH + 5, 300_007])
def test_a_long_float32_sum_is_the_exact_one_with_the_loop_and_without(monkeypatch, n: int) -> None:
    rng = np.random.default_rng(n)
    x = _wide(rng, (n,))
    x = np.concatenate([x, -x[: n // 2]])  # half of it cancels, exactly
    rng.shuffle(x)
    exact = sum((Fraction(float(v)) for v in x), Fraction(0))
    want = round_fraction(exact, "float32")
    results = {}
    for loops in (True, False):
        if not loops:
            monkeypatch.setattr(_fused, "available", lambda: False)
        with np.errstate(over="ignore", invalid="ignore"):
            enc = fast.long_sums(x, True)
        lo_hi = Fraction(float(enc.hi)) + Fraction(float(enc.lo))
        assert abs(lo_hi - exact) <= Fraction(float(enc.rad)), loops
        assert sum(abs(Fraction(float(v))) for v in x) <= Fraction(float(enc.S)), loops
        results[loops] = er.sum(x)
    assert results[True].rounded == results[False].rounded == np.float32(want)
    # The tolerances are the bound for any order on S, the bound on the sum of |x|: both are float32
    # sums of |x| in groups of 64, in different orders, raised by 2 gamma_63 of float32 (7.5e-6).
    tol = [float(results[b].tolerance) for b in (True, False)]
    assert math.isclose(tol[0], tol[1], rel_tol=1e-5)  # (inf where the sum may overflow float32)


def test_a_float32_sum_of_magnitudes_that_overflows_is_made_again_in_float64() -> None:
    # Every lane of the first bunch holds 64 values of float32's largest magnitude: their float32
    # sum overflows; the float64 one, 64 times that, does not, and it is what the loop keeps.
    big = np.finfo(np.float32).max
    x = np.full((1, 2 * BUNCH + 100), 0.5, np.float32)
    x[0, :BUNCH] = big
    x[0, 1:BUNCH:2] = -big
    x[0, BUNCH + 7] = np.float32(2.0 ** 127)  # a finite lane of a later bunch, beside
    second, second_abs, run = _fused_sums.group_sums(x, None, G)
    run(0, 1, 0, x.shape[1])
    want, want_abs = _emulated(x)
    assert np.array_equal(_bits(second), _bits(want)) and np.array_equal(_bits(second_abs), _bits(want_abs))
    assert second_abs[0, 0] == second_abs[0, 1] == 64 * 64 * float(big)
    # So the whole sum's S is finite, and the enclosure from the loop stands.
    terms = [Fraction(float(v)) for v in x[0]]
    enc = fast.long_sums(x[0], True)
    assert np.isfinite(enc.S) and Fraction(float(enc.S)) >= sum(map(abs, terms))
    assert abs(Fraction(float(enc.hi)) + Fraction(float(enc.lo)) - sum(terms)) <= Fraction(float(enc.rad))


def test_a_short_or_non_float32_block_keeps_the_numpy_code() -> None:
    assert _fused_sums.group_sums(np.ones((1, _fused.MIN_SIZE - 1), np.float32), None, G) is None
    assert _fused_sums.group_sums(np.ones((1, BUNCH)), None, G) is None  # float64
    assert _fused_sums.group_sums(np.ones((2, BUNCH), np.float32)[:, ::2], None, G) is None  # not contiguous
    assert _fused_sums.group_sums(np.ones((1, BUNCH), np.float32), None, 32) is None  # another width


def _later_levels(s: np.ndarray, a: np.ndarray) -> tuple[float, float, int]:
    """row_sums' documented later levels: m sums in groups j, j + k, j + 2k, ... (k = ceil(m / 64)),
    each added one after another from its first value, until one is left."""
    s, a, made = s.tolist(), a.tolist(), 0  # (Python floats: IEEE float64 additions)
    while len(s) > 1:
        k = -(-len(s) // G)
        groups = [range(j, len(s), k) for j in range(k)]
        s = [functools.reduce(operator.add, [s[i] for i in g]) for g in groups]
        a = [functools.reduce(operator.add, [a[i] for i in g]) for g in groups]
        made += 1
    return s[0], a[0], made


@pytest.mark.parametrize(("T", "special"), [
    (4096, False), (BUNCH, False), (BUNCH + 1, True), (300_001, False), (64 * 4096 + 1, False),
    (64 * 64 * 4096 + 3, False), (1_000_000, True)])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_row_sums_add_every_level_in_their_documented_order_and_copy(T: int, special: bool) -> None:
    x = _wide(np.random.default_rng(T), (T,), special)
    second, second_abs = _emulated(x[None, :])
    want = _later_levels(second[0], second_abs[0])
    out = np.full_like(x, np.nan)
    total, total_abs, levels = _fused_sums.row_sums(x, out)
    assert np.array_equal(_bits(np.array([total, total_abs])), _bits(np.array(want[:2])))
    assert levels == want[2] + 2 == 2 + max(0, math.ceil(math.log(second.shape[1], G)))
    assert np.array_equal(out.view(np.uint32), x.view(np.uint32))
    assert _fused_sums.row_sums(x, None)[:2] == (total, total_abs) or special  # (NaN != NaN)


def test_row_sums_takes_what_group_sums_takes() -> None:
    assert _fused_sums.row_sums(np.ones(4096, np.float32), None) is not None
    assert _fused_sums.row_sums(np.ones(_fused.MIN_SIZE - 1, np.float32), None) is None
    assert _fused_sums.row_sums(np.ones(BUNCH), None) is None  # float64
    assert _fused_sums.row_sums(np.ones(2 * BUNCH, np.float32)[::2], None) is None  # not contiguous
    assert _fused_sums.row_sums(np.ones((2, BUNCH), np.float32), None) is None  # not one row
    assert _fused_sums.row_sums(np.ones(BUNCH, np.float32), np.ones(BUNCH)) is None  # out float64


@pytest.mark.parametrize("lead", [(), (1,), (1, 1)])
@pytest.mark.parametrize("kind", ["wide", "inf", "nan", "overflowing"])
def test_one_rows_enclosure_is_the_numpy_codes_bounds_on_its_sums(monkeypatch, lead: tuple[int, ...],
                                                                   kind: str) -> None:
    # long_sums of one row takes row_sums; its enclosure is _sum_block's bounds on those sums, which
    # hold the exact sum (checked against Fractions), and the same marks where a value is not finite.
    T = 3 * BUNCH + 77
    x = _wide(np.random.default_rng(len(lead)), (T,))
    if kind != "wide":
        x[T // 2] = {"inf": np.inf, "nan": np.nan, "overflowing": np.finfo(np.float32).max}[kind]
        x[T // 3] = x[T // 2]
    X = x.reshape(lead + (T,))
    calls = []
    real = _fused_sums.row_sums
    monkeypatch.setattr(_fused_sums, "row_sums", lambda *a: calls.append(1) or real(*a))
    out = np.full_like(X, np.nan)
    enc = fast.long_sums(X, True, out=out)
    assert calls and np.array_equal(out.view(np.uint32), X.view(np.uint32))
    total, total_abs, levels = real(x, None)
    g, g32 = fast.gamma(63, fast.U64), fast.gamma(63, fast.U32)
    S = fast.up(total_abs * (1 + 2 * (g32 + (levels - 1) * g)))
    assert all(a.shape == lead and a.dtype == np.float64 for a in (enc.hi, enc.lo, enc.rad, enc.S))
    assert np.array_equal(_bits(enc.S), _bits(np.full(lead, S)))
    hi, lo, rad, S_enc = (a.item() for a in (enc.hi, enc.lo, enc.rad, enc.S))
    if kind in ("wide", "overflowing"):
        assert (hi, lo, rad) == (total, 0.0, fast.up(2 * levels * g * S))
        terms = [Fraction(float(v)) for v in x]
        assert abs(Fraction(hi) - sum(terms)) <= Fraction(rad)
        assert sum(map(abs, terms)) <= Fraction(S_enc)
    else:
        assert (hi, lo, rad) == (0.0, 0.0, np.inf) and not np.isfinite(S_enc)
    # The numpy code's enclosure is the same kind: the same marks, and it holds the same sum.
    monkeypatch.setattr(_fused_sums, "row_sums", lambda *a: None)
    other = fast.long_sums(X, True)
    assert np.isfinite(other.rad) == np.isfinite(enc.rad) and np.isfinite(other.S) == np.isfinite(enc.S)


@pytest.mark.parametrize("tail", [
    [1.0, 2.0 ** -24],  # a tie between 1 and its float32 successor: the even one, 1
    [1.0, 2.0 ** -24, 2.0 ** -60],  # just past the tie: the successor
    [2.0 ** 100, 3.0, -(2.0 ** 100)],  # cancellation down to 3
    [-(2.0 ** -130), 2.0 ** -149],  # a subnormal result
    [1000.5],  # farther from a boundary than the radius (S, about 8e5, times 6e-14): decided at once
])
def test_a_full_sum_of_a_million_values_is_the_exact_one_rounded(monkeypatch, tail: list[float]) -> None:
    # The benchmark's size, through the op's one compiled call (row_sums), with cancelling values
    # around a tail that puts the exact sum on, or next to, a float32 rounding boundary, or within
    # the enclosure's radius of one: those take the exact path, which reads the op's copy of x
    # that the loop made.
    rng = np.random.default_rng(len(tail))
    a = rng.standard_normal(500_000).astype(np.float32)
    x = np.concatenate([a, -a, np.array(tail, np.float32)])
    rng.shuffle(x)
    assert x.size < fast._FUSED_PARALLEL and np.array_equal(np.array(tail, np.float32), tail)
    scale = 2.0 ** 149  # every float32 is an integer multiple of 2**-149, so the sum is exact in ints
    exact = Fraction(sum(int(v) for v in (x.astype(np.float64) * scale).tolist()), 2 ** 149)
    calls, exactly = [], []
    real = _fused_sums.row_sums
    monkeypatch.setattr(_fused_sums, "row_sums", lambda *a: calls.append(1) or real(*a))
    for name in ("_exact_round", "_exact_long"):
        monkeypatch.setattr(sumprod, name, functools.partial(
            lambda f, *a: exactly.append(1) or f(*a), getattr(sumprod, name)))
    res = er.sum(x)
    assert calls and res.rounded == np.float32(round_fraction(exact, "float32"))
    assert bool(exactly) == (tail != [1000.5])
    part = res._parts[0]  # (the bounds on the exact value that judged it)
    assert Fraction(float(part.x_lo)) <= exact <= Fraction(float(part.x_hi))
    x[:] = 0  # the Result keeps its own copy: its exact value does not change with x
    assert res.exact(()) == exact
