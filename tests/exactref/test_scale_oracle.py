"""The engine's paths for realistic sizes against an independent oracle.

At 1024^3 a float64 matmul goes through the error-free sliced product, in
blocks of rows, and the elements it leaves undecided through the vectorised
tree sum and the exact fallback; long sums go through the blocked sums and,
for rows too long to gather, the exact sum by blocks of terms.  Each is
checked against exact values computed here (Fractions, or integers for long
sums) and rounded by the test's own rounding, on a sample of elements with
ties, near-ties, exact zeros and massive cancellation planted in the data.
"""

from __future__ import annotations

import dataclasses
import importlib
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref import _fused, _fused_refine, _parallel
from exactref import _pool as pool_module
from exactref.engine import decision
from exactref.engine import sumprod as sumprod_module
from exactref.ops import _common

from .oracle import round_fraction

F = Fraction
TIE = 2.0 ** -53  # 1 + TIE is halfway between 1 and the next float64
TIE32 = 2.0 ** -24


def cancelling(rng: np.random.Generator, n: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """x, y of length n (even) whose products cancel in pairs exactly: x = (r, r), y = (s, -s)."""
    r = rng.standard_normal(n // 2) * scale
    s = rng.standard_normal(n // 2) * scale
    return np.concatenate([r, r]), np.concatenate([s, -s])


# (what, [(a, b), ...] planted products besides the cancelling ones, float64 rounding expected)
PLANTED = [
    ("tie, to even", [(1.0, 1.0), (TIE, 1.0)], 1.0),
    ("a hair above a tie", [(1.0, 1.0), (TIE, 1.0), (2.0 ** -60, 2.0 ** -45)], 1.0 + 2.0 ** -52),
    ("a hair below a tie", [(1.0, 1.0), (TIE, 1.0), (-(2.0 ** -60), 2.0 ** -45)], 1.0),
    ("tie, odd below", [(1.0 + 2.0 ** -52, 1.0), (TIE, 1.0)], 1.0 + 2.0 ** -51),
    ("massive cancellation to a tiny value", [(3.0 * 2.0 ** -70, 1.0)], 3.0 * 2.0 ** -70),
    ("exact zero", [], 0.0),
]


def plant_matmul(A: np.ndarray, B: np.ndarray, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Plant each PLANTED case in a row of A and a column of B; returns their (i, j)."""
    K = A.shape[1]
    where = []
    for k, (_, products, _) in enumerate(PLANTED):
        i, j = 3 + 7 * k, 5 + 11 * k
        m = len(products)
        # Cancelling pairs of size 2**20 dwarf the result: S / |result| is about 2**50.
        x, y = cancelling(rng, K - m - (K - m) % 2, 2.0 ** 20)
        A[i, :] = 0.0
        B[:, j] = 0.0
        A[i, m:m + x.size], B[m:m + x.size, j] = x, y
        for t, (a, b) in enumerate(products):
            A[i, t], B[t, j] = a, b
        where.append((i, j))
    return where


def exact_dot(a: np.ndarray, b: np.ndarray) -> Fraction:
    return sum((F(float(x)) * F(float(y)) for x, y in zip(a, b)), F(0))


def check_element(res: er.Result, exact: Fraction, index: tuple, fmt: str) -> None:
    got = float(res.rounded[index])
    want = round_fraction(exact, fmt)
    assert got == want and np.signbit(got) == np.signbit(want), (index, got, want)
    part = res._parts[0]
    assert F(float(part.x_lo[index])) <= exact <= F(float(part.x_hi[index])), index


def planted_normal(seed: int, n: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray, list]:
    """Standard normal n x n A and B, with rows and columns of very different scales (so that
    slices of small elements matter) and the PLANTED cases (plant_matmul)."""
    rng = np.random.default_rng(seed)
    A, B = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    A[::9] *= 2.0 ** -30
    B[:, ::13] *= 2.0 ** 40
    return rng, A, B, plant_matmul(A, B, rng)


def test_float64_matmul_1024_against_fractions_with_planted_hard_cases():
    n = 1024
    rng, A, B, planted = planted_normal(12, n)
    res = er.matmul(A, B)
    for (i, j), (what, _, expected) in zip(planted, PLANTED):
        assert float(res.rounded[i, j]) == expected, what
        check_element(res, exact_dot(A[i], B[:, j]), (i, j), "float64")
    for i, j in zip(rng.integers(0, n, 40), rng.integers(0, n, 40)):
        check_element(res, exact_dot(A[i], B[:, j]), (int(i), int(j)), "float64")


@pytest.mark.parametrize("n", [512, 1024])
def test_float64_matmul_with_the_quick_cut_against_fractions(monkeypatch, n):
    """At K = 512 and 1024 B is cut once (products.Right's quick cut, four products): the elements
    its enclosure leaves undecided (every one at 512, 80 of them at 1024), the planted hard cases
    and a sample are checked."""
    from exactref.engine import products
    rng, A, B, planted = planted_normal(13, n)
    cuts: list[int] = []
    real_sliced = products.Right._sliced

    def sliced(self, A_rows, cut, *args):
        cuts.append(len(cut.slices))
        return real_sliced(self, A_rows, cut, *args)
    monkeypatch.setattr(products.Right, "_sliced", sliced)
    res = er.matmul(A, B)
    assert cuts and set(cuts) == {1}, "every block was meant to take the quick cut alone"
    # The elements the quick enclosure leaves to the exact path (which ones: not their values).
    with np.errstate(all="ignore"):
        enc = products.Right(B, narrow=False, quick=True).times(A)
    hard = np.argwhere(~decision.decide_float64(enc.hi, enc.lo, enc.rad)[3])
    assert len(hard) >= 20 + len(planted), "the quick cut was meant to leave some elements undecided"
    for (i, j), (what, _, expected) in zip(planted, PLANTED):
        assert float(res.rounded[i, j]) == expected, what
    hard = hard if n == 512 else hard[rng.choice(len(hard), 80, replace=False)]
    sample = [tuple(ij) for ij in hard] + list(zip(rng.integers(0, n, 30), rng.integers(0, n, 30)))
    for i, j in sample:
        check_element(res, exact_dot(A[i], B[:, j]), (int(i), int(j)), "float64")


def test_a_block_the_quick_cut_leaves_mostly_undecided_takes_the_six_products(monkeypatch):
    """Sums that cancel to about 2**-24 of their terms: the quick enclosure (a radius of about
    2**-76 of the sum of |terms|, 2**-49 of the value) decides none of the 1920 elements, so the
    block takes the six products' (2**-92, 2**-64), which decides 1915; the exact path gets the
    rest; the bound on |A| |B| is made once, for both.  Checked against Fractions."""
    from exactref.engine import products
    rng = np.random.default_rng(14)
    M, half, N = 48, 32, 40
    R, S = rng.standard_normal((M, half)), rng.standard_normal((half, N))
    D = rng.standard_normal((M, half)) * 2.0 ** -24
    A = np.concatenate([R, -(R + D)], axis=1)  # A B = R S - (R + D) S = -D S
    B = np.concatenate([S, S], axis=0)
    fine: list[bool] = []
    exact_path: list[int] = []
    bounds: list[int] = []
    real_times, real_round, real_bound = products.Right.times, sumprod_module._exact_round, products.Right.abs_bound

    def times(self, A_rows, **kw):
        fine.append(kw.get("fine", False))
        return real_times(self, A_rows, **kw)

    def abs_bound(self, A_rows, *args):
        bounds.append(A_rows.shape[-2])
        return real_bound(self, A_rows, *args)

    def exact_round(terms, shape, idx, *args):
        exact_path.append(idx.size)
        return real_round(terms, shape, idx, *args)
    monkeypatch.setattr(products.Right, "times", times)
    monkeypatch.setattr(products.Right, "abs_bound", abs_bound)
    monkeypatch.setattr(sumprod_module, "_exact_round", exact_round)
    res = er.matmul(A, B)
    assert fine == [False, True], "the block was meant to be enclosed again with the six products"
    assert bounds == [M], "the six products' enclosure was meant to reuse the quick one's bound"
    assert sum(exact_path) < M * N * sumprod_module._REFINE_SHARE
    for i in range(M):
        for j in range(0, N, 3):
            check_element(res, exact_dot(A[i], B[:, j]), (i, j), "float64")


# (what, row of A, column of B (their first entries), float64 rounding expected): float32 values,
# within 2**42 of their row's (column's) largest, so each element is the sum of its four exact slice
# products, and rounding it exactly takes those few pieces instead of the 1024 products.
PIECES_PLANTED = [
    ("tie, to even", [1.0, 2.0 ** -30], [1.0, 2.0 ** -23], 1.0),
    ("tie, odd below", [1.0, 2.0 ** -29, 2.0 ** -30], [1.0, 2.0 ** -23, 2.0 ** -23], 1.0 + 2.0 ** -51),
    ("negative tie", [-1.0, -(2.0 ** -30)], [1.0, 2.0 ** -23], -1.0),
    ("a hair above a tie", [1.0, 2.0 ** -30, 2.0 ** -35], [1.0, 2.0 ** -23, 2.0 ** -30], 1.0 + 2.0 ** -52),
    ("a hair below a tie", [1.0, 2.0 ** -30, -(2.0 ** -35)], [1.0, 2.0 ** -23, 2.0 ** -30], 1.0),
]


def float32_values_with_planted_ties(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Standard normal float32 values as float64 n x n A and B, with PIECES_PLANTED's rows and
    columns planted; returns A, B and the planted elements' (i, j)."""
    A = rng.standard_normal((n, n)).astype(np.float32).astype(np.float64)
    B = rng.standard_normal((n, n)).astype(np.float32).astype(np.float64)
    where = []
    for k, (_, a, b, _) in enumerate(PIECES_PLANTED):
        i, j = 2 + 5 * k, 3 + 9 * k
        A[i, :] = 0.0
        A[i, :len(a)] = a
        B[:len(b), j] = b
        where.append((i, j))
    return A, B, where


def test_float64_matmul_of_float32_values_1024_rounds_ties_from_the_slice_products(monkeypatch):
    # torch.randn(n, n).double() in a kernel's test: float32 values in float64.  With the six
    # products, which a K past the quick cut's limit takes (the quick cut's test is below).
    from exactref.engine import products
    monkeypatch.setattr(products, "_QUICK_MAX_K", 512)
    rng = np.random.default_rng(21)
    n = 1024
    A, B, where = float32_values_with_planted_ties(rng, n)
    sizes: list[int] = []
    real = sumprod_module._round_pieces

    def spy(parts, exact, idx, *args):
        rest = real(parts, exact, idx, *args)
        sizes.append(idx.size - rest.size)
        return rest
    monkeypatch.setattr(sumprod_module, "_round_pieces", spy)
    res = er.matmul(A, B)
    assert sum(sizes) >= 3, "the planted ties were meant to be rounded from the slice products"
    for (i, j), (what, _, _, expected) in zip(where, PIECES_PLANTED):
        assert float(res.rounded[i, j]) == expected, what
        check_element(res, exact_dot(A[i], B[:, j]), (i, j), "float64")
    for i, j in zip(rng.integers(0, n, 30), rng.integers(0, n, 30)):
        check_element(res, exact_dot(A[i], B[:, j]), (int(i), int(j)), "float64")
    # Every array is the one the exact path (over all 1024 products) gives.
    monkeypatch.setattr(sumprod_module, "_round_pieces", lambda parts, exact, idx, *args: idx)
    again = er.matmul(A, B)
    for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance"):
        np.testing.assert_array_equal(getattr(res._parts[0], name), getattr(again._parts[0], name), err_msg=name)


@pytest.mark.skipif(not _fused.available(), reason="numba is not installed (exactref[fast])")
def test_float64_matmul_of_float32_values_1024_with_the_quick_cut_rounds_ties_in_the_loop(monkeypatch):
    """The quick cut leaves hundreds of elements a block undecided here, ties and exact float64
    values among them (float32 values' sums have few bits): the exact path's compiled loop decides
    every one (a second extraction, and float64 ties to even), and every array is the numpy
    code's."""
    from exactref.engine import products
    rng = np.random.default_rng(22)
    n = 1024
    A, B, where = float32_values_with_planted_ties(rng, n)
    cuts: list[int] = []
    real_sliced = products.Right._sliced

    def sliced(self, A_rows, cut, *args):
        cuts.append(len(cut.slices))
        return real_sliced(self, A_rows, cut, *args)
    decided: list[tuple[int, int]] = []
    real_loop = _fused_refine.extract_decide

    def loop(P, fmt, **kw):
        out = real_loop(P, fmt, **kw)
        decided.append((int(out[3].sum()), len(P)))
        return out
    monkeypatch.setattr(products.Right, "_sliced", sliced)
    monkeypatch.setattr(_fused_refine, "extract_decide", loop)
    res = er.matmul(A, B)
    assert cuts and set(cuts) == {1}, "every block was meant to take the quick cut alone"
    assert sum(d for d, _ in decided) == sum(m for _, m in decided) > 400
    for (i, j), (what, _, _, expected) in zip(where, PIECES_PLANTED):
        assert float(res.rounded[i, j]) == expected, what
        check_element(res, exact_dot(A[i], B[:, j]), (i, j), "float64")
    for i, j in zip(rng.integers(0, n, 30), rng.integers(0, n, 30)):
        check_element(res, exact_dot(A[i], B[:, j]), (int(i), int(j)), "float64")
    monkeypatch.setattr(_fused_refine, "extract_decide", lambda *a, **k: None)
    monkeypatch.setattr(_fused_refine, "gather_two_products", lambda *a, **k: None)
    again = er.matmul(A, B)
    for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance"):
        np.testing.assert_array_equal(getattr(res._parts[0], name), getattr(again._parts[0], name), err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_narrow_matmul_long_rows_against_fractions(dtype):
    # K = 2048: the float64 product leaves some roundings undecided, which the tree sum decides.
    rng = np.random.default_rng(5)
    M, K, N = 96, 2048, 80
    A = er.asarray(rng.standard_normal((M, K)), dtype)
    B = er.asarray(rng.standard_normal((K, N)), dtype)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    res = er.matmul(A, B)
    eps = 2.0 ** -8 if dtype == "bfloat16" else TIE32
    # Plant a tie, and a cancellation, in one row and column each.
    A2, B2 = A64.copy(), B64.copy()
    x, y = cancelling(rng, K - 2, 1.0)
    x, y = (er.asarray(v, dtype).astype(np.float64) for v in (x, y))
    A2[0, :], B2[:, 0] = np.concatenate([[1.0, eps], x]), np.concatenate([[1.0, 1.0], y])
    A2[1, :], B2[:, 1] = np.concatenate([[eps, 0.0], x]), np.concatenate([[2.0 ** -20, 0.0], y])
    planted = er.matmul(er.asarray(A2, dtype), er.asarray(B2, dtype))
    assert float(planted.rounded[0, 0]) == 1.0  # the tie, to even
    check_element(planted, exact_dot(A2[0], B2[:, 0]), (0, 0), dtype)
    check_element(planted, exact_dot(A2[1], B2[:, 1]), (1, 1), dtype)
    for i, j in zip(rng.integers(0, M, 30), rng.integers(0, N, 30)):
        check_element(res, exact_dot(A64[i], B64[:, j]), (int(i), int(j)), dtype)


def exact_sum(x: np.ndarray) -> Fraction:
    """The exact sum of float values, by integers per binary exponent (not the engine's method)."""
    frac, ex = np.frexp(np.asarray(x, dtype=np.float64))
    m = np.ldexp(frac, 53).astype(np.int64)  # x = m * 2**(ex - 53) exactly
    total = F(0)
    for e in np.unique(ex):
        sel = m[ex == e]
        # Halves of 27 bits: int64 sums of fewer than 2**36 of them are exact.
        high, low = int(np.sum(sel >> 26)), int(np.sum(sel & ((1 << 26) - 1)))
        total += F((high << 26) + low) * F(2) ** (int(e) - 53)
    return total


# (what, planted values, expected rounding), as functions of u, the format's spacing above 1.
SUM_PLANTED = [
    ("tie, to even", lambda u: [1.0, u / 2], lambda u: 1.0),
    ("a hair above a tie", lambda u: [1.0, u / 2, u * 2.0 ** -10], lambda u: 1.0 + u),
    ("a hair below a tie", lambda u: [1.0, u / 2, -u * 2.0 ** -10], lambda u: 1.0),
    ("tie, odd below", lambda u: [1.0 + u, u / 2], lambda u: 1.0 + 2 * u),
    ("massive cancellation", lambda u: [2.0 ** -30], lambda u: 2.0 ** -30),
    ("exact zero", lambda u: [], lambda u: 0.0),
]


@pytest.mark.parametrize("dtype, n", [("float32", (1 << 19) + 6), ("float32", (1 << 22) + 4102),
                                      ("float64", (1 << 21) + 1030)])
@pytest.mark.parametrize("case", range(len(SUM_PLANTED)), ids=[c[0] for c in SUM_PLANTED])
def test_long_sum_against_integers_with_planted_hard_cases(dtype, n, case):
    # The float32 rows are gathered whole for the tree sum and math.fsum, the longer one past a
    # block of the first pass (fast._SUM_BLOCK), copied before it is summed; the float64 ones are
    # too long to gather at once, and the exact fallback sums them a block of terms at a time.
    what, planted, expected = SUM_PLANTED[case]
    rng = np.random.default_rng(case)
    u = 2.0 ** -23 if dtype == "float32" else 2.0 ** -52
    values = er.asarray(np.array(planted(u), dtype=np.float64), dtype)
    # Pairs r, -r of size 2**20 cancel exactly: S / |sum| is 2**40 and more.
    r = er.asarray(rng.standard_normal((n - values.size) // 2) * 2.0 ** 20, dtype)
    x = np.concatenate([r, -r, values])
    rng.shuffle(x)
    x = np.concatenate([x, np.zeros(n - x.size, dtype=x.dtype)])
    res = er.sum(x)
    exact = exact_sum(x)
    assert float(res.rounded) == round_fraction(exact, dtype) == expected(u), what
    assert not np.signbit(res.rounded)
    part = res._parts[0]
    assert F(float(part.x_lo)) <= exact <= F(float(part.x_hi))


def test_long_sums_along_an_axis_against_integers():
    rng = np.random.default_rng(7)
    x = er.asarray(rng.standard_normal((3, 40000)) * np.exp(rng.uniform(-30, 30, (3, 40000))), "float32")
    x[1] = np.concatenate([x[1, :20000], -x[1, :20000]])  # an exact zero
    x[2, 0], x[2, 1:] = 1.0, 0.0
    x[2, 1] = TIE32  # a tie
    res = er.sum(x, axis=1)
    for i in range(3):
        exact = exact_sum(x[i])
        assert float(res.rounded[i]) == round_fraction(exact, "float32"), i


def test_long_sum_stays_in_bounded_memory():
    x = np.random.default_rng(0).standard_normal(1 << 23).astype(np.float32)
    tracemalloc.start()
    try:
        er.sum(x).tolerance  # noqa: B018
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A float32 copy of x (4 bytes per element) plus the engine's blocks; the budget is 32.
    assert peak < 16 * x.size, peak / x.size


@pytest.fixture
def memory_16_gib(monkeypatch):
    """The guard's view of this machine: 16 GiB, whatever it has (the issue's cases assume no more)."""
    monkeypatch.setattr(pool_module, "_MEMORY", [16 << 30])


@pytest.mark.parametrize("side", [50000, 100000])
def test_memory_guard_refuses_huge_broadcast_views_from_their_shape(side, memory_16_gib):
    x = np.broadcast_to(np.float32(1), (side, side))
    er.sum(np.ones(3, dtype=np.float32))  # (the modules a first sum imports, not traced below)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"x has shape \({side}, {side}\): reading it needs about [\d.]+ GiB"):
            er.sum(x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Refused before any copy: nothing near the array's size was allocated.
    assert peak < 1 << 20, peak


def test_memory_guard_names_the_argument_of_matmul(memory_16_gib):
    A = np.broadcast_to(np.float64(1), (200000, 100000))
    with pytest.raises(ValueError, match=r"^B has shape \(200000, 100000\): reading it needs"):
        er.matmul(np.ones((2, 200000)), A)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of a few rows and elements, so that small cases take the paths of large ones."""
    from exactref.engine import fast, sumprod
    from exactref.ops import _common

    monkeypatch.setattr(sumprod, "_BLOCK", 5)
    monkeypatch.setattr(sumprod, "_PIECES", 16)
    monkeypatch.setattr(sumprod, "_LONG_ROW", 9)
    monkeypatch.setattr(fast, "_SUM_BLOCK", 7)
    monkeypatch.setattr(_common, "_JUDGE_BLOCK", 3)
    # A small output of one narrow product would be judged whole, before any block (its own
    # test: test_judged_at_once.py).
    monkeypatch.setattr(_common, "_judged_at_once", lambda *args: None)


def _hard(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    """Values over a wide range, with zeros, signed zeros and exact cancellations."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-40, 40, shape) * (0.2 if dtype == "float16" else 1))
    x[rng.random(shape) < 0.2] = 0.0
    x[rng.random(shape) < 0.1] = -0.0
    return er.asarray(x, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_blocked_paths_agree_with_the_oracle(dtype, tiny_blocks):
    from . import oracle

    rng = np.random.default_rng(3)
    A, B = _hard(rng, (2, 1, 7, 12), dtype), _hard(rng, (3, 12, 6), dtype)
    B[1, :, 2] = -B[0, :, 2]  # two batch entries of opposite sign
    got = er.matmul(A, B)
    want = oracle.matmul(A.astype(np.float64), B.astype(np.float64), dtype)
    assert oracle.bits_equal(got.rounded.astype(np.float64), want)
    A2, B2, C = _hard(rng, (9, 10), dtype), _hard(rng, (10, 8), dtype), _hard(rng, (8,), dtype)
    got = er.gemm(A2, B2, C, alpha=0.5, beta=-2.0)
    want = oracle.matmul(A2.astype(np.float64), B2.astype(np.float64), dtype, 0.5, C.astype(np.float64), -2.0)
    assert oracle.bits_equal(got.rounded.astype(np.float64), want)
    x = _hard(rng, (4, 30), dtype)
    x[1, 15:] = -x[1, :15]
    got = er.sum(x, axis=1)
    for i in range(4):
        exact = exact_sum(x[i])
        assert float(got.rounded[i]) == round_fraction(exact, dtype), i
        assert F(float(got._parts[0].x_lo[i])) <= exact <= F(float(got._parts[0].x_hi[i]))
    got = er.sum(x[:, :1], axis=0)  # a sum of one term per row, in blocks
    assert oracle.bits_equal(got.rounded.astype(np.float64), x[0, :1].astype(np.float64))


_PART_FIELDS = ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance")


def _fields(res) -> list[np.ndarray]:
    results = [res] if isinstance(res, er.Result) else [res[name] for name in sorted(res)]
    return [np.asarray(getattr(p, n)) for r in results for p in r._parts for n in _PART_FIELDS]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("loops", [False, True])
def test_judging_each_block_as_it_is_solved_gives_every_field_of_judging_the_whole(dtype, loops, tiny_blocks,
                                                                                 monkeypatch):
    # An elementwise tolerance (PartSpec.blockwise) lets build judge each block of rows on the
    # thread that solved it: in blocks of 5 elements, judged 3 at a time, the leading axis is the
    # rows' own (2-D outputs, 1-D sums) or a batch axis over them.  Against the same ops with the
    # flag off (the whole output solved, then its tolerance, then judged), bit for bit.  A block
    # whose rows are contiguous in the output is decided straight into the Part's arrays; with
    # ``loops``, by exactref/_fused.py's loops (at any size), which then write there themselves.
    if loops:
        if not _fused.available():
            pytest.skip("numba is not installed")
        monkeypatch.setattr(_fused, "MIN_SIZE", 1)
    rng = np.random.default_rng(21)
    A, B, G = _hard(rng, (9, 12), dtype), _hard(rng, (12, 7), dtype), _hard(rng, (9, 7), dtype)
    Ab, Bb, Gb = _hard(rng, (3, 4, 6), dtype), _hard(rng, (6, 5), dtype), _hard(rng, (3, 4, 5), dtype)
    C = _hard(rng, (7,), dtype)
    x, y = _hard(rng, (23, 3), dtype), _hard(rng, (3, 4, 10), dtype)
    # A[:1] @ B is one row: a single block of solving, larger than a judging block.
    calls = [lambda: er.matmul(A, B), lambda: er.matmul(A[:1], B), lambda: er.matmul.backward(A, B, G),
             lambda: er.matmul(Ab, Bb), lambda: er.matmul.backward(Ab, Bb, Gb),
             lambda: er.gemm.backward(A, B, C, G, beta=2.0),
             lambda: er.sum(x, axis=1), lambda: er.sum(y, axis=2), lambda: er.sum(y, axis=0)]
    fused = []
    original = _common._solve_judged
    monkeypatch.setattr(_common, "_solve_judged", lambda *a: fused.append(a[1]) or original(*a))
    blockwise = [_fields(call()) for call in calls]
    # Every part (the backwards have two gradients each, gemm.backward three); float64 products
    # keep B's slices while they are solved, and are judged after (test below): its sums alone.
    assert len(fused) == (4 if dtype == "float64" else 13)

    build = _common.build

    def whole(op, fmt, shape, specs, *args, **kwargs):
        return build(op, fmt, shape, [dataclasses.replace(s, blockwise=False) for s in specs], *args, **kwargs)
    for name in ("exactref.ops.matmul", "exactref.ops.reduction"):
        monkeypatch.setattr(importlib.import_module(name), "build", whole)
    fused.clear()
    for call, want in zip(calls, blockwise):
        got = _fields(call())
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    assert not fused


def test_a_float64_2048_cubed_matmul_peaks_below_four_times_its_inputs_and_output(monkeypatch):
    # Issue 12's bound on working memory (benchmarks/bench_matmul.py measures the same way), with
    # two threads: the blocks in flight at once set the peak.  B's five slices live while the blocks
    # are solved; judging each block as it is solved would put the output's six arrays beside them
    # (4.4 times).
    monkeypatch.setattr(_parallel, "_MAX_WIDTH", 2)
    # numba's import, once per process where it is installed (exactref/_fused.py), makes Python
    # objects that tracemalloc counts: not the op's working memory, so done before.
    _fused.available()
    n = 2048
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        res = er.matmul(A, B)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert res.rounded.shape == (n, n)
    assert peak <= 4 * 3 * n * n * 8, peak / (3 * n * n * 8)
