"""The compiled first try of the exact path (exactref/_fused_refine.py): where it decides a row sum,
its rounding and float64 bounds are the exact sum's, checked against Fractions rounded by
tests/exactref/oracle.py, and equal, bit for bit, to the numpy code's wherever that decides too.
"""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er
from exactref import _fused, _fused_refine
from exactref.engine import decision, fast, sumprod
from exactref.formats import FORMATS

from .oracle import bits_equal, round_fraction, round_value
from .spies import recording

pytestmark = pytest.mark.skipif(not _fused.available(), reason="numba is not installed (exactref[fast])")

NAMES = ["float64", "float32", "float16", "bfloat16"]


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The loop takes arrays of any size here (a small one keeps numpy's code in the op)."""
    monkeypatch.setattr(_fused, "MIN_SIZE", 1)


def loop(P: np.ndarray, name: str) -> tuple[np.ndarray, ...]:
    n = P.shape[1]
    out = _fused_refine.extract_decide(np.ascontiguousarray(P), FORMATS[name], kmin=fast._EXTRACT_MIN_K,
                                       kmax=fast._EXTRACT_MAX_K, c=n * fast.gamma(n - 1, fast.U64),
                                       up_constants=(fast._UP_REL, fast._UP_ABS))
    assert out is not None
    return out


def exact(row: np.ndarray) -> F:
    return sum((F(float(v)) for v in row), F(0))


def gap_terms(gap: F) -> list[float]:
    """Three float64 values whose exact sum is ``gap`` (each the float64 nearest what is left)."""
    terms = []
    for _ in range(3):
        terms.append(float(gap))
        gap -= F(terms[-1])
    assert gap == 0
    return terms


def midpoint_rows(name: str, count: int, seed: int, length: int = 65) -> np.ndarray:
    """Sums of float32 products that land on a midpoint of ``name``'s values, a float64 unit or a
    quarter of one off it, or on one of its values: ties, near-ties (exactly a float64, or strictly
    between two whose lower or upper is the midpoint), and values exactly a float64."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        x = (rng.standard_normal(length - 3) * 4).astype(np.float32).astype(np.float64)
        y = (rng.standard_normal(length - 3) * 4).astype(np.float32).astype(np.float64)
        P = x * y
        total = float(np.sum(P))
        # A value of the format near the sum, half a unit of it, and a nudge of a float64 unit.
        v = round_value(total, name)
        unit = 2.0 ** (int(np.floor(np.log2(abs(v)))) - fmt.p + 1) if v else 2.0 ** -20
        tie = F(v) + F(unit) / 2
        step = F(float(np.spacing(np.float64(tie))))
        target = tie + step * F(int(rng.choice([0, 1, -1, 1, -1])), int(rng.choice([1, 4])))
        if rng.random() < 0.1:
            target = F(v)  # one of the values
        rows.append(np.concatenate([P, gap_terms(target - exact(P))]))
    return np.array(rows)


@st.composite
def rows(draw):
    """Row sums of the kinds the exact path meets: float32 products, with a large pair that
    cancels, of wide exponents, near-equal values of one sign, zeros, and huge values."""
    n = draw(st.integers(1, 200))
    kind = draw(st.sampled_from(["float32 products", "cancelling", "wide", "one sign", "zeros", "huge"]))
    if kind == "zeros":
        return np.zeros((2, n))
    if kind == "huge":
        return np.full((2, n), 2.0 ** 1020) * draw(st.sampled_from([1.0, -1.0]))
    if kind == "one sign":
        e = draw(st.integers(-900, 900))
        low = draw(hnp.arrays(np.int64, (2, n), elements=st.integers(0, 2 ** 20)))
        return np.ldexp(1.0 - low * 2.0 ** -53, e)
    if kind == "wide":
        return draw(hnp.arrays(np.float64, (2, n), elements=st.builds(
            lambda m, e: float(np.ldexp(m, e)), st.integers(-2 ** 30, 2 ** 30), st.integers(-1000, 900))))
    x = draw(hnp.arrays(np.float32, (2, n), elements=st.floats(-8, 8, width=32)))
    y = draw(hnp.arrays(np.float32, (2, n), elements=st.floats(-8, 8, width=32)))
    P = x.astype(np.float64) * y.astype(np.float64)
    if kind == "cancelling" and n >= 2:
        P[:, 0], P[:, 1] = 2.0 ** 40, -(2.0 ** 40)
    return P


def check_decided(P: np.ndarray, name: str) -> np.ndarray:
    """Every row the loop decides has the exact sum's rounding and float64 neighbours; the numpy
    code gives the same values where it decides too.  Returns the loop's ``ok``."""
    value, lo, hi, ok = loop(P, name)
    v2, lo2, hi2, ok2 = decision.refine_numpy(P, FORMATS[name])
    for i, row in enumerate(P):
        if not ok[i]:
            continue
        s = exact(row)
        assert F(lo[i]) <= s <= F(hi[i])
        assert (lo[i] == hi[i]) == (F(lo[i]) == s)
        if lo[i] != hi[i]:
            assert np.nextafter(lo[i], np.inf) == hi[i]  # the float64 neighbours
        assert bits_equal(value[i], round_fraction(s, name)), (i, name)
        if ok2[i]:
            assert bits_equal(value[i], v2[i]) and lo[i] == lo2[i] and hi[i] == hi2[i]
    return ok


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200)
@given(P=rows())
def test_a_decided_row_is_the_exact_sums_rounding(name, P):
    check_decided(P, name)


@pytest.mark.parametrize("name", NAMES)
def test_ties_near_ties_and_exact_float64_sums_round_correctly(name):
    P = midpoint_rows(name, 60, seed=NAMES.index(name))
    ok = check_decided(P, name)
    # Every sum but one exactly halfway between two float64 values is decided: one that is a float64
    # too (the grid says the error bound's zero is the truth).  Those halfway are ties of a float64
    # output, which the numpy code's exact path rounds.
    halfway = np.array([float64_midpoint(exact(r)) for r in P])
    assert ok[~halfway].all()
    assert (~halfway).sum() >= 20


@pytest.mark.parametrize("name", ["float64", "float32"])
def test_ties_in_rows_of_the_length_of_a_1024_cubed_matmul(name):
    # The rows the loop meets in a 1024**3 matmul: 1024 pieces, the sigma of a longer row.
    P = midpoint_rows(name, 12, seed=5, length=1024)
    ok = check_decided(P, name)
    halfway = np.array([float64_midpoint(exact(r)) for r in P])
    assert ok[~halfway].all() and (~halfway).sum() >= 4


def float64_midpoint(s: F) -> bool:
    a = float(s)
    if F(a) == s:
        return False
    b = float(np.nextafter(a, np.inf if s > F(a) else -np.inf))
    return (F(a) + F(b)) / 2 == s


def test_rows_the_loop_leaves_go_to_the_numpy_code():
    P = np.array([[0.0, -0.0, 0.0], [2.0 ** 1022, -(2.0 ** 1022), 1.0], [1.0, 2.0, 3.0]])
    value, lo, hi, ok = loop(P, "float32")
    assert ok.tolist() == [False, False, True] and value[2] == 6.0
    got = decision.refine(P, FORMATS["float32"])
    want = decision.refine_numpy(P, FORMATS["float32"])
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_a_cancelling_float32_sum_is_decided_as_the_exact_float64_it_is():
    row = np.array([[1.0, 2.0 ** -30, -1.0, 3 * 2.0 ** -60, 0.375, -0.375]])
    value, lo, hi, ok = loop(row, "float32")
    assert ok[0] and lo[0] == hi[0] == 2.0 ** -30 + 3 * 2.0 ** -60
    assert value[0] == np.float32(2.0 ** -30)


def test_a_float32_matmul_is_the_same_with_the_loop_and_without_it(monkeypatch):
    # Integers of a few bits and their halves: many products cancel to values near roundings, so the
    # exact path has many rows for the loop.  (Narrower formats' products leave it none, and a float64
    # one's few rows are mostly exact zeros, whose sign the exact path finds.)
    dtype = np.float32
    rng = np.random.default_rng(3)
    A = (rng.integers(-64, 64, (96, 160)) * 2.0 ** rng.integers(-3, 3, (96, 160))).astype(dtype)
    B = (rng.integers(-64, 64, (160, 80)) / 3).astype(dtype)
    seen = []
    real = _fused_refine.extract_decide

    def spy(P, fmt, **kw):
        out = real(P, fmt, **kw)
        seen.append(0 if out is None else int(out[3].sum()))
        return out
    monkeypatch.setattr(_fused_refine, "extract_decide", spy)
    with_loop = er.matmul(A, B)
    assert sum(seen) > 0  # the loop decided rows
    monkeypatch.setattr(_fused_refine, "extract_decide", lambda *a, **k: None)
    without = er.matmul(A, B)
    for name in ("rounded", "tolerance"):
        assert np.array_equal(getattr(with_loop, name), getattr(without, name))
    want = np.array([[float(sum((F(float(a)) * F(float(b)) for a, b in zip(A[i], B[:, j])), F(0)))
                      for j in range(0, 80, 7)] for i in range(0, 96, 5)])
    assert np.array_equal(with_loop.rounded[::5, ::7], want.astype(dtype).astype(np.float64))


def _numpy_products(A: np.ndarray, B: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact path's gather and products by numpy (engine.sumprod's, without the loop)."""
    i, j = np.divmod(idx, B.shape[1])
    with np.errstate(all="ignore"):
        P = A[i] * B[:, j].T
    return P, np.isfinite(P).all(axis=1)


def test_gather_products_are_numpys_gather_and_products():
    rng = np.random.default_rng(21)
    A = (rng.standard_normal((37, 300)) * 2.0 ** rng.integers(-60, 60, (37, 300))).astype(np.float32)
    B = rng.standard_normal((300, 53)).astype(np.float32)
    A[3, 7], A[5, 0], B[10, 4] = np.inf, np.nan, -np.inf  # rows 3 and 5, column 4: not safe
    A, B = A.astype(np.float64), B.astype(np.float64)
    idx = np.sort(rng.choice(37 * 53, 90, replace=False))
    idx[:3] = [3 * 53 + 1, 5 * 53 + 2, 4]  # one each
    got = _fused_refine.gather_products(A, B, idx)
    assert got is not None
    want = _numpy_products(A, B, idx)
    assert bits_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert not got[1][:3].any() and got[1].any()


def test_gather_products_declines_what_it_does_not_take(monkeypatch):
    A, B, idx = np.ones((4, 6)), np.ones((6, 5)), np.arange(3)
    assert _fused_refine.gather_products(A, B, idx) is not None
    assert _fused_refine.gather_products(A.astype(np.float32), B, idx) is None
    assert _fused_refine.gather_products(A, np.asfortranarray(np.ones((6, 5))), idx) is None
    assert _fused_refine.gather_products(A[None], B[None], idx) is None
    monkeypatch.setattr(_fused, "MIN_SIZE", 19)  # 3 rows of 6 products: too few
    assert _fused_refine.gather_products(A, B, idx) is None


def test_a_float32_matmul_is_the_same_with_the_gather_loop_and_without_it(monkeypatch):
    rng = np.random.default_rng(3)  # (the draws above: many rows for the exact path)
    A = (rng.integers(-64, 64, (96, 160)) * 2.0 ** rng.integers(-3, 3, (96, 160))).astype(np.float32)
    B = (rng.integers(-64, 64, (160, 80)) / 3).astype(np.float32)
    seen: list[bool] = []
    monkeypatch.setattr(_fused_refine, "gather_products", recording(_fused_refine.gather_products, seen))
    with_loop = er.matmul(A, B)
    assert seen and all(seen)  # the exact path gathered by the loop
    monkeypatch.setattr(_fused_refine, "gather_products", lambda *a: None)
    without = er.matmul(A, B)
    for p, q in zip(with_loop._parts, without._parts):
        for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance", "nan_ok", "special_ok"):
            assert bits_equal(getattr(p, name), getattr(q, name)), name


def first_extraction_decides(P: np.ndarray, name: str) -> np.ndarray:
    """Which rows one extraction decides (the numpy code's first try, its grid test included)."""
    hi, lo, rad = fast.extract_sum(P)
    done = decision.decide_refined(hi, lo, rad, FORMATS[name])[3]
    exact_sum = rad < decision.grid(P)
    done |= exact_sum & decision.decide_refined(hi, lo, np.zeros(len(P)), FORMATS[name])[3]
    return done


def second_extraction_rows(name: str, seed: int, length: int = 1024) -> tuple[np.ndarray, list[str]]:
    """Sums of float32 products (an undecided element of a float64 matmul of float32 values, say)
    that one extraction cannot decide and a second can: each is exactly one of ``name``'s
    midpoints, one of its values, or a float64 next to either, or lies 2**-85 of the largest piece
    M off a midpoint, or 2**-105 M (about the second's own rounding error); a pair +-delta, delta =
    2**-107 M, puts the lowest set bit of the pieces (the grid) below the first extraction's error
    bound (about 2**-75 M) and above the second's (at most 2**-114 M), which is then zero; or, for
    a finer grid, delta = 2**-200 M, below both.  Returns the rows and what each is."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    rows, kinds = [], []
    for kind in ["midpoint", "value", "next to a midpoint", "next to a value", "near a midpoint",
                 "just off a midpoint", "just off a midpoint, finer grid"] * 3:
        x = (rng.standard_normal(length - 5) * 4).astype(np.float32).astype(np.float64)
        y = (rng.standard_normal(length - 5) * 4).astype(np.float32).astype(np.float64)
        P = x * y
        M = float(np.max(np.abs(P)))
        v = round_value(float(np.sum(P)), name)
        unit = F(2) ** (int(np.floor(np.log2(abs(v)))) - fmt.p + 1)
        target = F(v) + unit / 2 if "midpoint" in kind else F(v)
        if kind.startswith("next to"):
            target += F(float(np.spacing(np.float64(target))))
        if kind.startswith(("near a midpoint", "just off a midpoint")):
            below = 85 if kind.startswith("near") else 105
            target += F(2) ** (int(np.floor(np.log2(M))) - below) * int(rng.choice([1, -1]))
        delta = 2.0 ** (int(np.floor(np.log2(M))) - (200 if kind.endswith("finer grid") else 107))
        rows.append(np.concatenate([P, gap_terms(target - exact(P)), [delta, -delta]]))
        kinds.append(kind)
    return np.array(rows), kinds


@pytest.mark.parametrize("name", NAMES)
def test_a_second_extraction_decides_what_the_first_cannot(name):
    P, kinds = second_extraction_rows(name, seed=7 + NAMES.index(name))
    first = first_extraction_decides(P, name)
    # Exact values of the format's grid, and float64 values, straddle any interval of nonzero radius;
    # a float64 output's midpoints too; and the near-midpoints lie within the first bound.
    undecidable = [k != "next to a midpoint" and (k != "midpoint" or name == "float64") for k in kinds]
    assert not first[undecidable].any()
    ok = check_decided(P, name)
    # Just off a midpoint, the offset is about the rounding error of the second's double-double:
    # where that error counts, the loop must leave the row to the numpy code (check_decided checks
    # those it decides).
    assert all(o for k, o in zip(kinds, ok) if not k.startswith("just off")), [k for k, o in zip(kinds, ok) if not o]
    # So does the numpy code's second extraction (decision.extract_twice), with the same values.
    ok2 = decision.refine_numpy(P, FORMATS[name])[3]
    assert all(o for k, o in zip(kinds, ok2) if not k.startswith("just off"))


# (row, float64 rounding expected): sums exactly halfway between two float64 values, whose
# extraction bound lies below the grid, so that hi + lo is the exact sum; to even.
TIES = [
    ([1.0, 2.0 ** -53], 1.0),
    ([1.0 + 2.0 ** -52, 2.0 ** -53], 1.0 + 2.0 ** -51),
    ([-1.0, -(2.0 ** -53)], -1.0),
    ([-(1.0 + 2.0 ** -52), -(2.0 ** -53)], -(1.0 + 2.0 ** -51)),
    ([2.0 - 2.0 ** -52, 2.0 ** -53], 2.0),  # up to the power of two
    ([2.0, -(2.0 ** -53)], 2.0),  # below a power of two, whose gap below is half the one above
    ([2.0, 2.0 ** -52], 2.0),
    ([3.0, 2.0 ** -52, 2.0 ** -60, -(2.0 ** -60)], 3.0),
]


def test_a_float64_tie_is_rounded_to_even_where_the_sum_is_exact():
    P = np.zeros((len(TIES), 4))
    for i, (row, _) in enumerate(TIES):
        P[i, :len(row)] = row
    value, lo, hi, ok = loop(P, "float64")
    assert ok.all()
    for i, (row, want) in enumerate(TIES):
        s = exact(P[i])
        assert float64_midpoint(s)
        assert value[i] == want == round_fraction(s, "float64"), i
        assert F(lo[i]) < s < F(hi[i]) and np.nextafter(lo[i], np.inf) == hi[i]
    # The numpy code's decision rounds them the same way.
    assert decision.refine_numpy(P, FORMATS["float64"])[3].all()
    check_decided(P, "float64")


def same_sign_remainder_rows(count: int, seed: int, length: int = 1024) -> np.ndarray:
    """Rows summing exactly to a float64 value: 1, then values m 2**-40 + rho (m in [32, 64), rho
    in [2**-42, 2**-41), of 53 bits down to 2**-87), and the gap to the float64 nearest their sum.
    The first extraction (sigma = 2**12) leaves each the remainder rho, all of one sign, whose
    partial sums reach about 2**-31.5: sums the second extraction makes exactly only with its sigma
    2**-30 at least 2 n max|rho| (with 2**-33 they would need more than 53 bits)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        m = rng.integers(32, 64, length - 2)
        rho = np.ldexp(rng.integers(2 ** 45, 2 ** 46, length - 2).astype(np.float64), -87)
        P = np.concatenate([[1.0], np.ldexp(m.astype(np.float64), -40) + rho])
        assert (P[1:] - np.ldexp(m.astype(np.float64), -40) == rho).all()  # exact
        s = exact(P)
        gap = F(float(s)) - s
        assert F(float(gap)) == gap
        out.append(np.concatenate([P, [float(gap)]]))
    return np.array(out)


@pytest.mark.parametrize("name", ["float64", "float32"])
def test_the_second_extraction_adds_many_remainders_of_one_sign_exactly(name):
    P = same_sign_remainder_rows(4, seed=11)
    assert not first_extraction_decides(P, name).any()
    value, lo, hi, ok = loop(P, name)
    assert ok.all() and decision.refine_numpy(P, FORMATS[name])[3].all()
    check_decided(P, name)
    assert (lo == hi).all()  # each sum is a float64


def special_float64(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Standard normal values with zeros, subnormals, values past two_prod's split limit (2**995),
    factors of products below its exactness limit (2**-968), values within the limit whose
    products overflow, infinities and NaNs mixed in."""
    X = rng.standard_normal(shape)
    picks = rng.random(shape)
    for low, value in [(0.0, 0.0), (0.05, 3.0 * 2.0 ** -1070), (0.08, 1.5 * 2.0 ** 996), (0.11, 2.0 ** -500),
                       (0.14, 1.9 * 2.0 ** 994), (0.17, np.inf), (0.18, np.nan)]:
        X[(picks >= low) & (picks < low + (0.03 if low < 0.17 else 0.01))] = value
    return X


def numpy_two_products(A: np.ndarray, B: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """engine.sumprod's pieces of a float64 matmul's elements by its numpy code (the loop off)."""
    term = sumprod.MatmulTerm(1.0, A, B, narrow=False)
    real = _fused_refine.gather_two_products
    _fused_refine.gather_two_products = lambda *a, **k: None
    try:
        return sumprod._pieces([term], (A.shape[0], B.shape[1]), idx)
    finally:
        _fused_refine.gather_two_products = real


@pytest.mark.parametrize("layout", ["B", "its transpose given", "B F-contiguous"])
@pytest.mark.parametrize("seed", range(3))
def test_the_two_product_gather_is_numpys_gather_and_two_prod(layout, seed):
    rng = np.random.default_rng(seed)
    M, K, N = 9, 37, 11
    # Special values in A's first four rows and B's first five columns: other elements are safe.
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    A[:4], B[:, :5] = special_float64(rng, (4, K)), special_float64(rng, (K, 5))
    A[4, ::3], B[::4, 5] = 0.0, 0.0  # zeros alone: safe
    A[5, 0] = B[0, 6] = 1.9 * 2.0 ** 994  # within the split limit, their product overflows: unsafe
    if seed == 0:
        A[~np.isfinite(A)], B[~np.isfinite(B)] = 1.0, -1.0  # all finite: only two_prod's limits unsafe
    idx = rng.choice(M * N, 40, replace=False)
    if 5 * N + 6 not in idx:
        idx[0] = 5 * N + 6
    BT = None
    if layout == "its transpose given":
        BT = np.ascontiguousarray(B.T)
    elif layout == "B F-contiguous":
        B = np.asfortranarray(B)
    got = _fused_refine.gather_two_products(A, B, idx, BT)
    assert got is not None
    want = numpy_two_products(np.ascontiguousarray(A), np.ascontiguousarray(B), idx)
    assert got[0].shape == want[0].shape == (40, 2 * K)
    assert np.array_equal(got[0].view(np.int64), want[0].view(np.int64))  # bit for bit, NaNs too
    assert np.array_equal(got[1], want[1])
    assert 0 < got[1].sum() < 40  # safe rows and unsafe ones


def test_the_two_product_gather_declines_what_it_does_not_read():
    A, B = np.ones((4, 5)), np.ones((5, 6))
    idx = np.arange(10)
    assert _fused_refine.gather_two_products(np.asfortranarray(A), B, idx) is None
    assert _fused_refine.gather_two_products(A, np.ones((10, 6))[::2], idx) is None  # rows strided
    assert _fused_refine.gather_two_products(A.astype(np.float32), B.astype(np.float32), idx) is None


def test_rows_without_a_first_sigma_get_no_second_extraction():
    # 2**1020 (1 + 2**-52), four to a row: sigma would be 2**1024.  Their remainders against the
    # largest sigma there is are not, with the first sum lost, an enclosure of anything.
    p = 2.0 ** 1020 * (1 + 2.0 ** -52)
    P = np.array([[p, p, -p, 0.0], [p, -p, 3.0, 0.0]])
    assert np.isinf(fast.extract_sum(P)[2]).all()
    assert np.isinf(decision.extract_twice(P)[2]).all()
    check_decided(P, "float64")


def test_the_second_extraction_is_row_by_row_past_the_first_ones_chunks():
    # More rows than extract_sum takes in one chunk (fast._EXTRACT_CHUNK values): each row's
    # enclosure is the one it gets alone.
    P = np.random.default_rng(4).standard_normal((fast._EXTRACT_CHUNK // 1024 * 2 + 3, 1024))
    whole = decision.extract_twice(P)
    alone = [decision.extract_twice(P[i:i + 1]) for i in range(len(P))]
    for k in range(3):
        assert np.array_equal(whole[k], np.concatenate([a[k] for a in alone]))
