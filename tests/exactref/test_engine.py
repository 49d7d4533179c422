"""The rational engine's pieces against Fractions: enclosures contain the exact value,
exact sums are exact, and exact rounding is correct."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er
from exactref.engine import fast, products, sumprod
from exactref.engine.exact import exact_dot_rows, round_rows
from exactref.formats import FORMATS

from . import oracle
from .oracle import bits_equal, round_fraction

F = Fraction


def wide_floats(max_exp: int = 1000) -> st.SearchStrategy[float]:
    """float64 values spread over a wide exponent range, zeros included."""
    return st.one_of(
        st.just(0.0),
        st.builds(lambda m, e: float(np.ldexp(m, e)), st.floats(-1, 1, allow_subnormal=False),
                  st.integers(-max_exp, min(max_exp, 1023))),
        st.floats(-4, 4),
    )


def matrices(max_exp: int = 1000):
    return st.integers(1, 5).flatmap(lambda k: st.tuples(
        hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.just(k)), elements=wide_floats(max_exp)),
        hnp.arrays(np.float64, st.tuples(st.just(k), st.integers(1, 4)), elements=wide_floats(max_exp))))


def exact_product(A, B):
    return [[sum((F(A[i, k]) * F(B[k, j]) for k in range(A.shape[1])), F(0)) for j in range(B.shape[1])]
            for i in range(A.shape[0])]


def contains(enc, exact, i, j):
    rad = enc.rad[i, j]
    if not np.isfinite(rad):
        return True
    return abs(exact - F(enc.hi[i, j]) - F(enc.lo[i, j])) <= F(rad)


# e = 2**-60 from hi's two-sum, and a rest of 2**-120 that lo = e + rest rounds away: only the
# radius's U64 |lo| pays for that rounding (the products' own bound is about 2**-169).
ROUNDED_AWAY = (np.array([[1.0, 2.0 ** -60, 1.0]]), np.array([[1.0], [1.0], [2.0 ** -120 * (1 + 2.0 ** -52)]]))


@settings(max_examples=300)
@given(matrices())
@example(ROUNDED_AWAY)
def test_sliced_product_encloses_exact_value(AB):
    A, B = AB
    with np.errstate(all="ignore"):
        enc = products.matmul_sliced(A, B)
    ex = exact_product(A, B)
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            assert contains(enc, ex[i][j], i, j)
            if np.isfinite(enc.S[i, j]):
                assert sum(abs(F(A[i, k]) * F(B[k, j])) for k in range(A.shape[1])) <= F(enc.S[i, j])


@settings(max_examples=200)
@given(matrices(max_exp=60))
def test_narrow_product_encloses_exact_value(AB):
    A, B = (v.astype(np.float32).astype(np.float64) for v in AB)
    enc = products.matmul_narrow(A, B)
    ex = exact_product(A, B)
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            assert contains(enc, ex[i][j], i, j)


def test_sliced_product_takes_a_in_blocks_of_bounded_size_and_still_encloses(monkeypatch):
    """matmul_sliced's blocks of rows hold at most _A_BLOCK values of A (its slices are temporaries of
    that size), and each block's enclosure holds the exact values (Fractions)."""
    rng = np.random.default_rng(8)
    A = rng.standard_normal((40, 30)) * np.exp2(rng.integers(-20, 20, (40, 1)))
    B = rng.standard_normal((30, 6))
    sizes: list[int] = []
    real = products.Right.times

    def times(self, A_rows, **kw):
        sizes.append(A_rows.size)
        return real(self, A_rows, **kw)
    monkeypatch.setattr(products.Right, "times", times)
    monkeypatch.setattr(products, "_A_BLOCK", 300)  # 10 rows of 30
    enc = products.matmul_sliced(A, B)
    assert sizes == [300] * 4
    ex = exact_product(A, B)
    for i in range(40):
        for j in range(6):
            assert contains(enc, ex[i][j], i, j)
    monkeypatch.setattr(products, "_A_BLOCK", 1)  # a row alone is more: one row a block
    sizes.clear()
    products.matmul_sliced(A, B)
    assert sizes == [30] * 40


@pytest.mark.parametrize("seed", range(3))
def test_sliced_product_takes_the_quick_cut_at_any_length_when_asked_and_still_encloses(seed):
    """matmul_sliced(quick=True) cuts B into one slice past _QUICK_MAX_K too (attention's P V at
    2048 keys): the exact values (Fractions) lie in the enclosures, whose radius is about 2**-28
    gamma_K of the rest's rank-one bounds (row sums of |A| times column maxima of |B|, and row maxima
    times column sums), and far above the six products' (the mutation: quick ignored)."""
    rng = np.random.default_rng(seed)
    K = 2048
    assert K > products._QUICK_MAX_K
    # Weights of a softmax row (53-bit values spanning decades) against float32 values.
    A = rng.random((3, K)) * np.exp2(rng.integers(-40, 0, (3, K)))
    A[0, :3] = [1.0, -(2.0 ** -80), 3.0 * 2.0 ** -1000]
    B = rng.standard_normal((K, 4)).astype(np.float32).astype(np.float64)
    quick, fine = products.matmul_sliced(A, B, quick=True), products.matmul_sliced(A, B)
    ex = exact_product(A, B)
    absA, absB = np.abs(A), np.abs(B)
    R = absA.sum(1)[:, None] * absB.max(0) + absA.max(1)[:, None] * absB.sum(0)
    for i in range(3):
        for j in range(4):
            assert contains(quick, ex[i][j], i, j)
    assert (quick.rad <= 2.0 ** -26 * products.gamma(K, 2.0 ** -53) * R).all()
    assert (quick.rad > 2.0 ** 10 * fine.rad).any()


@pytest.mark.parametrize("seed", range(3))
def test_sliced_product_with_b_in_one_slice_of_24_bits_encloses_narrow_values(seed):
    """matmul_sliced(b_bits=24) (attention's q k^T and dO V^T for float32 and narrower inputs):
    float32 values whose rows and columns span more binades than the slices hold, so that A has
    a remainder past its two slices and B past its one: the exact values (Fractions) lie in the
    enclosures, whose radius stays near 2**-24 gamma_K of the rank-one bounds, far above the full
    cut's (the mutation: b_bits ignored)."""
    rng = np.random.default_rng(seed)
    K = 64
    A = (rng.standard_normal((4, K)) * np.exp2(rng.integers(-30, 10, (4, K)))).astype(np.float32).astype(np.float64)
    B = (rng.standard_normal((K, 5)) * np.exp2(rng.integers(-30, 10, (K, 5)))).astype(np.float32).astype(np.float64)
    narrow, full = products.matmul_sliced(A, B, quick=True, b_bits=24), products.matmul_sliced(A, B)
    ex = exact_product(A, B)
    for i in range(4):
        for j in range(5):
            assert contains(narrow, ex[i][j], i, j)
    absA, absB = np.abs(A), np.abs(B)
    R = absA.sum(1)[:, None] * absB.max(0) + absA.max(1)[:, None] * absB.sum(0)
    assert (narrow.rad <= 2.0 ** -20 * products.gamma(K, 2.0 ** -53) * R).all()
    assert (narrow.rad > 2.0 ** 10 * full.rad).any()
    # The point of the 24 bits: A's two slices, 23 bits each at K = 64, hold float32 rows that span
    # fewer binades whole, so that (A0 + A1) RB is the only rounded product (three in all).
    cut = products.Right(B, narrow=False, one_slice=products.one_slice_exponents(K, 24)).cut
    assert (cut.beta_a, len(cut.slices)) == (23, 1)
    # (Magnitudes in [2**-9, 2**11): 20 binades and 24 bits, within the 46 of two slices.)
    A_near = (rng.choice([-1.0, 1.0], (4, K)) * rng.uniform(0.5, 1.0, (4, K))
              * np.exp2(rng.integers(-8, 12, (4, K)))).astype(np.float32)
    _, RA, _ = fast._slices(A_near.astype(np.float64), -1, cut.beta_a, 2)
    assert not RA.any()


def test_sliced_product_is_tight_enough_to_decide_float64():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    enc = products.matmul_sliced(A, B)
    assert np.median(enc.rad / np.abs(enc.hi)) < 2.0 ** -60


@settings(max_examples=300)
@given(st.integers(1, 6).flatmap(lambda t: hnp.arrays(np.float64, (3, t), elements=wide_floats(1070))),
       st.integers(1, 6).flatmap(lambda t: hnp.arrays(np.float64, (3, t), elements=wide_floats(1070))))
def test_exact_dot_rows_is_exact(X, Y):
    T = min(X.shape[1], Y.shape[1])
    X, Y = X[:, :T], Y[:, :T]
    for (n, e), x, y in zip(exact_dot_rows(X, Y), X, Y):
        assert F(n) * F(2) ** e == sum((F(a) * F(b) for a, b in zip(x, y)), F(0))
    for (n, e), x in zip(exact_dot_rows(X), X):
        assert F(n) * F(2) ** e == sum((F(a) for a in x), F(0))


@pytest.mark.parametrize("name", ["float64", "float32", "float16", "bfloat16"])
@settings(max_examples=200)
@given(rows=hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 6)), elements=wide_floats(300)))
def test_round_rows_rounds_correctly(name, rows):
    from exactref.rounding import round_float64

    fmt = FORMATS[name]
    value, lo, hi, ok = round_rows(rows, fmt.p)
    if fmt.p != 53:
        value = round_float64(value, fmt)
    for i, row in enumerate(rows):
        if not ok[i]:
            continue
        exact = sum((F(v) for v in row), F(0))
        assert F(lo[i]) <= exact <= F(hi[i])
        if exact != 0:
            assert bits_equal(value[i], round_fraction(exact, name))


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
def test_two_prod_is_exact_where_safe(a, b):
    with np.errstate(all="ignore"):
        p, e, safe = fast.two_prod(np.array([a]), np.array([b]))
    if safe[0] and np.isfinite(p[0]):
        assert F(p[0]) + F(e[0]) == F(a) * F(b)


@given(st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300),
       st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300))
def test_two_sum_is_exact(a, b):
    s, e = fast.two_sum(np.array([a]), np.array([b]))
    assert F(s[0]) + F(e[0]) == F(a) + F(b)


@st.composite
def extract_rows(draw):
    """Rows for the extraction: near-equal values of one sign (their sum needs every bit of sigma's
    headroom of log2(2n) bits), float32 products, wide values, and a large pair that cancels."""
    n = draw(st.integers(1, 300))
    kind = draw(st.sampled_from(["one sign", "float32 products", "wide", "cancelling"]))
    if kind == "one sign":
        e = draw(st.integers(-900, 900))
        low = draw(hnp.arrays(np.int64, (2, n), elements=st.integers(0, 2 ** 20)))
        sign = draw(st.sampled_from([1.0, -1.0]))
        return sign * np.ldexp(1.0 - low * 2.0 ** -53, e)  # exact: 53-bit values just below 2**e
    if kind == "wide":
        return draw(hnp.arrays(np.float64, (2, n), elements=wide_floats(900)))
    x = draw(hnp.arrays(np.float32, (2, n), elements=st.floats(-8, 8, width=32)))
    y = draw(hnp.arrays(np.float32, (2, n), elements=st.floats(-8, 8, width=32)))
    P = x.astype(np.float64) * y.astype(np.float64)  # exact
    if kind == "cancelling" and n >= 2:
        P[:, 0], P[:, 1] = 2.0 ** 40, -(2.0 ** 40)
    return P


@settings(max_examples=300)
@given(rows=extract_rows())
def test_extract_sum_encloses_each_row_sum_within_8_n_cubed_times_2_to_the_minus_106_of_its_max(rows):
    hi, lo, rad = fast.extract_sum(rows)
    n = rows.shape[1]
    for i, row in enumerate(rows):
        exact = sum((F(v) for v in row), F(0))
        M = max(abs(F(v)) for v in row)
        if M == 0:
            assert rad[i] == np.inf
            continue
        # Finite wherever sigma = 2**k fits (k <= e + 10 here, and every value is below 2**900): the
        # extraction decides, it does not just give up.  Rows of tiny values only may be left.
        if M >= F(2) ** -990:
            assert rad[i] < np.inf
        elif rad[i] == np.inf:
            continue
        assert abs(exact - F(hi[i]) - F(lo[i])) <= F(rad[i])
        # sigma < 2 M 4 n, so rad = n gamma_{n-1} sigma 2**-53 < 8 n**3 2**-106 M.
        assert F(rad[i]) <= 8 * F(n) ** 3 * F(2) ** -106 * M + F(2) ** -1060


def test_extract_sum_pays_for_lo_s_roundings_in_numpy_s_order():
    # 0.75 sets sigma = 2**8 for 128 terms; the other 127 lie below half its grid, so they are the r
    # themselves.  numpy adds 128 terms in 8 accumulators (term j into accumulator j mod 8), then
    # pairwise; each term is picked to lose as much as it can in its accumulator, so lo errs by more
    # than gamma_127 2**(k - 53), the bound without its factor n.
    n, k = 128, 8
    rng = random.Random(0)
    row = np.zeros(n)
    row[0] = 0.75
    for j in range(8):
        partial = 0.0
        for t in range(1 if j == 0 else 0, 16):
            tries = [2.0 ** (k - 54) * (0.5 + rng.random() / 2) for _ in range(200)]
            x = max(tries, key=lambda v: F(partial) + F(v) - F(partial + v))
            row[j + 8 * t], partial = x, partial + x
    hi, lo, rad = fast.extract_sum(row[None])
    err = abs(sum((F(v) for v in row), F(0)) - F(hi[0]) - F(lo[0]))
    assert err <= F(rad[0])
    assert err > F(fast.gamma(n - 1, fast.U64)) * F(2) ** (k - 53)


def test_extract_sum_gives_the_same_enclosures_a_few_rows_at_a_time(monkeypatch):
    rows = np.random.default_rng(0).standard_normal((7, 5)) * np.ldexp(1.0, np.arange(-300, 400, 100))[:, None]
    rows[3] = 0.0
    whole = fast.extract_sum(rows)
    monkeypatch.setattr(fast, "_EXTRACT_CHUNK", 10)  # two rows per pass, the last pass one
    for got, want in zip(fast.extract_sum(rows), whole):
        assert np.array_equal(got, want)
    hi, lo, rad = whole
    for i, row in enumerate(rows):
        if i != 3:
            assert abs(sum((F(v) for v in row), F(0)) - F(hi[i]) - F(lo[i])) <= F(rad[i]) < F(2.0 ** -90) * max(abs(row))


def test_extract_sum_leaves_rows_of_zeros_and_huge_rows_to_the_tree_sum():
    rows = np.array([[0.0, -0.0, 0.0], [2.0 ** 1022, -(2.0 ** 1022), 1.0], [1.0, 2.0, 3.0]])
    hi, lo, rad = fast.extract_sum(rows)
    assert rad[0] == rad[1] == np.inf
    assert hi[2] + lo[2] == 6.0 and rad[2] < 2.0 ** -40


def test_round_certified_decides_each_precisions_list_at_once_with_decide_all():
    # decide_all sees each evaluation's whole list, once per precision; what it leaves (None) is
    # evaluated again at twice the precision.  The values k/3 round as the tests' own rounding says.
    import flint

    from exactref.engine.certified import decide_ball, round_certified

    calls = []

    def evaluate(indices):
        return [flint.arb(k) / 3 for k in indices]

    def decide_all(balls, fmt):
        calls.append(len(balls))
        if len(calls) == 1:
            return [None if k % 2 else decide_ball(b, fmt) for k, b in zip(indices, balls)]
        return [decide_ball(b, fmt) for b in balls]

    indices = list(range(1, 41))
    got = round_certified(evaluate, indices, FORMATS["float32"], str, start=64, decide_all=decide_all)
    assert calls == [40, 20]  # the odd ones went on to 128 bits
    for k in indices:
        assert bits_equal(got[k][0], round_fraction(Fraction(k, 3), "float32")), k
        assert Fraction(got[k][1]) <= Fraction(k, 3) <= Fraction(got[k][2]), k


@pytest.mark.parametrize("loops", [False, True])
@pytest.mark.parametrize(("T", "copy_first"), [(64 * 1000, False), (64 * 1000 + 5, False),
                                               ((1 << 22) + 64 * 3, False), ((1 << 22) + 64 * 3, True)])
def test_long_sums_copies_into_out_as_it_reads_and_gives_the_same_enclosure(T, copy_first, loops, monkeypatch):
    # The first level writes each bunch it reads into out, a partial group included; a row
    # longer than a block (_SUM_BLOCK = 2**22) goes block by block, and at such sizes up to
    # _COPY_FIRST_MAX the numpy code copies first (both ways here).  The compiled first level
    # (``loops``, where numba is present) copies as it reads at every size.
    from exactref import _fused
    from exactref.engine import fast
    from exactref.engine.fast import long_sums
    if loops and not _fused.available():
        pytest.skip("numba is not installed (exactref[fast])")
    if not loops:
        monkeypatch.setattr(_fused, "available", lambda: False)
    if copy_first:
        assert fast._SUM_BLOCK < T <= fast._COPY_FIRST_MAX  # the case is the one named
    else:
        monkeypatch.setattr(fast, "_COPY_FIRST_MAX", 0)
    x = np.random.default_rng(T).standard_normal(T).astype(np.float32)
    x[::997] *= np.float32(2.0 ** 60)  # wide exponents: the enclosure is not trivially exact
    out = np.full_like(x, np.nan)
    plain, fused = long_sums(x, True), long_sums(x, True, out=out)
    assert np.array_equal(out, x)
    for name in ("hi", "lo", "rad", "S"):
        assert np.array_equal(getattr(plain, name), getattr(fused, name)), name
    rows = np.stack([x[:T // 2], x[T // 2:2 * (T // 2)]])
    out2 = np.empty_like(rows)
    long_sums(rows, True, out=out2)
    assert np.array_equal(out2, rows)


@pytest.mark.parametrize("M, N, step", [
    (8, 8, None),  # small: one block
    (256, 512, None),  # half a block (2**17 elements): one block
    (512, 512, 256),  # a block's worth: two, for two threads
    (1024, 1024, 256),
    (2048, 2048, 128),  # 2**18 elements per block
    (3, 2**20, 1),  # rows longer than a block: one row each
])
def test_blocks_of_rows_hold_at_most_a_block_and_a_large_output_makes_two(M, N, step):
    """At most 2**18 output elements per block, and two blocks past half of that: a rule of the
    shapes alone (no thread count), so that the results do not depend on the threads."""
    term = sumprod.MatmulTerm(1.0, np.zeros((M, 1)), np.zeros((1, N)))
    assert sumprod._rows_per_block([term], (M, N)) == step


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 80])  # 2**80: |B| is past float32's safe range
def test_right_prepares_b_the_same_in_blocks_of_columns(monkeypatch, scale, quick):
    """B's slices, |B| and the rank-one rows, made block by block of columns side by side, are
    those of one block of all columns, bit for bit, and the product's enclosures with them (the
    quick cut's, and the fine one made on demand after it)."""
    rng = np.random.default_rng(11)
    B = rng.standard_normal((40, 37)) * scale
    B[:, 5] = np.round(B[:, 5])  # a column without a remainder
    A = rng.standard_normal((6, 40))
    whole = products.Right(B, narrow=False, pieces=True, quick=quick)
    monkeypatch.setattr(products, "_PREPARE_BLOCK", 40 * 3)  # blocks of 3 columns
    blocked = products.Right(B, narrow=False, pieces=True, quick=quick)
    assert blocked.refinable == whole.refinable == quick
    np.testing.assert_array_equal(blocked.absB, whole.absB)
    assert blocked.absB.dtype == whole.absB.dtype and blocked.in32 == whole.in32 == (scale == 1.0)
    for fine in (False, True):
        with np.errstate(all="ignore"):
            e1, e2 = whole.times(A, fine=fine), blocked.times(A, fine=fine)
        for name in ("hi", "lo", "rad", "S"):
            np.testing.assert_array_equal(getattr(e1, name), getattr(e2, name), err_msg=name)
        cut1, cut2 = (whole.fine, blocked.fine) if fine else (whole.cut, blocked.cut)
        assert len(cut1.slices) == len(cut2.slices) == (1 if quick and not fine else 2)
        for name in ("RB", "lowB", "rows", "RB_cols"):
            np.testing.assert_array_equal(getattr(cut2, name), getattr(cut1, name), err_msg=name)
            assert getattr(cut2, name).dtype == getattr(cut1, name).dtype, name
        for s1, s2 in zip(cut1.slices, cut2.slices):
            np.testing.assert_array_equal(s2, s1)
        assert cut1.RB_any and cut2.RB_any


# K = 4: four products of 18 and 34 significant bits (beta_a + beta_b = 52, one bit past K = 4's
# budget of 51) sum to 2**54 units, odd: a cut one bit too wide rounds A0 B0.
PAST_THE_BUDGET = (np.full((1, 4), 2 - 2.0 ** -17), np.array([[2 - 2.0 ** -33]] * 3 + [[2 - 2.0 ** -32]]))


@settings(max_examples=300)
@given(matrices())
@example(ROUNDED_AWAY)
@example(PAST_THE_BUDGET)
def test_quick_cut_encloses_exact_value(AB):
    """B cut once against A's two slices (products.Right's quick cut): the enclosure holds the
    exact value, and ``fine=True`` gives the six products' enclosure, bit for bit."""
    A, B = AB
    with np.errstate(all="ignore"):
        right = products.Right(B, narrow=False, quick=True)
        enc = right.times(A)
        fine, six = right.times(A, fine=True), products.matmul_sliced(A, B)
    assert right.refinable and len(right.cut.slices) == 1
    ex = exact_product(A, B)
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            assert contains(enc, ex[i][j], i, j)
    for name in ("hi", "lo", "rad", "S"):
        np.testing.assert_array_equal(getattr(fine, name), getattr(six, name), err_msg=name)


def test_quick_cut_balances_its_remainders_within_the_exact_budget():
    """beta_a + beta_b is the budget of two slices' products (K of them sum below 2**53 units),
    and B's one slice is about as wide as A's two: remainders of about the same size."""
    for K in (1, 2, 64, 511, 512, 513, 1024):
        beta_a, beta_b = products._quick_exponents(K)
        assert beta_a + beta_b == products._slice_budget(K) == 53 - max(K - 1, 1).bit_length()
        assert abs(2 * beta_a - beta_b) <= 2
        assert K * 2.0 ** (beta_a + beta_b) <= 2.0 ** 53


@pytest.mark.parametrize("shape", [(70, 5), (3, 32, 7), (2, 1, 33, 64), (0, 4), (5, 0), (31, 1)])
def test_transposed_copy_is_the_transpose_in_every_band(shape):
    # K (the second-to-last side) below, at and past one band, batch dimensions, empty sides.
    B = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    got = products._transposed(B)
    assert got.flags.c_contiguous
    assert np.array_equal(got, np.swapaxes(B, -1, -2))


def test_right_reads_columns_from_b_until_a_quarter_of_them_are_asked_for():
    B = np.random.default_rng(5).standard_normal((9, 40))
    right = products.Right(B, narrow=True)
    assert right.transpose_for(6) is None
    assert right.transpose_for(4) is None  # 10 columns: a quarter of N, not more
    BT = right.transpose_for(1)
    assert BT is not None and np.array_equal(BT, B.T)
    assert right.transpose_for(1) is BT  # made once
    other = products.Right(B, narrow=True)
    other.copying = True  # another block's thread is making the copy: read from B meanwhile
    assert other.transpose_for(40) is None


@pytest.mark.parametrize(("tie_rows", "tie_cols", "via_copy"), [(slice(0, None, 2), 24, True), (0, 2, False)])
def test_undecided_elements_match_the_oracle_read_either_way(monkeypatch, tie_rows, tie_cols, via_copy):
    # 2**24 +- 1 is a tie of float32: each such element is undecided by the float64 enclosure
    # and rounded exactly from its gathered row and column.  Many of them (every column of the
    # even rows) are read through B's transposed copy, two of them from B; the term k = 39 lies
    # in the copy's second band.  The other elements are near-ties and random values.
    rng = np.random.default_rng(11)
    A = np.zeros((2, 16, 40), dtype=np.float32)
    B = np.zeros((2, 40, 24), dtype=np.float32)
    A[..., 0] = 2.0 ** 24
    A[:, tie_rows, 39] = 1.0
    B[:, 0, :] = 1.0
    B[:, 39, :tie_cols] = rng.choice([-1.0, 1.0], (2, tie_cols))
    A[:, 1::2, 5:10] = rng.standard_normal((2, 8, 5)) * 2.0 ** -20
    B[:, 5:10, :] = rng.standard_normal((2, 5, 24))
    used = []
    original = products.Right.transpose_for

    def spy(self, count):
        BT = original(self, count)
        used.append(BT is not None)
        return BT
    monkeypatch.setattr(products.Right, "transpose_for", spy)
    res = er.matmul(A, B)
    assert used and all(u == via_copy for u in used)
    want = oracle.matmul(A.astype(np.float64), B.astype(np.float64), "float32")
    assert bits_equal(res.rounded.astype(np.float64), want)


@pytest.mark.parametrize("pieces", [None, 10])  # 10: rows too long to gather at once (_exact_long)
def test_undecided_elements_of_a_2d_product_gather_b_by_columns_and_match_the_oracle(monkeypatch, pieces):
    # The ties and near-ties above, in a 2-D product: B's columns are taken from B itself
    # (np.take), never through its transposed copy.
    rng = np.random.default_rng(12)
    A = np.zeros((16, 40), dtype=np.float32)
    B = np.zeros((40, 24), dtype=np.float32)
    A[:, 0] = 2.0 ** 24
    A[::2, 39] = 1.0
    B[0, :] = 1.0
    B[39, :] = rng.choice([-1.0, 1.0], 24)
    A[1::2, 5:10] = rng.standard_normal((8, 5)) * 2.0 ** -20
    B[5:10, :] = rng.standard_normal((5, 24))
    used = []
    monkeypatch.setattr(products.Right, "transpose_for", lambda self, count: used.append(count))
    if pieces is not None:
        monkeypatch.setattr(sumprod, "_PIECES", pieces)
    gathered = []
    real_gather = sumprod.MatmulTerm.gather
    monkeypatch.setattr(sumprod.MatmulTerm, "gather",
                        lambda self, idx, *a: gathered.append(idx.size) or real_gather(self, idx, *a))
    res = er.matmul(A, B)
    assert sum(gathered) >= 8 and not used, "B's columns were meant to be taken from B itself"
    want = oracle.matmul(A.astype(np.float64), B.astype(np.float64), "float32")
    assert bits_equal(res.rounded.astype(np.float64), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_exact_paths_roundings_and_bounds_are_the_exact_values(dtype):
    # A large narrow product (its blocks side by side, the exact path's compiled gather and first
    # try where numba is present) whose cancelling sums leave some elements to the exact path:
    # there the Part's rounding and bounds are the exact value's own (its rounding, and its float64
    # neighbours), checked against Fractions; elsewhere the bounds still contain it.
    rng = np.random.default_rng(31)
    A = (rng.integers(-64, 64, (260, 96)) * 2.0 ** rng.integers(-3, 3, (260, 96))).astype(dtype)
    B = (rng.integers(-64, 64, (96, 600)) / 3).astype(dtype)
    if dtype == "float32":
        # And exact values that are no float64, beside float32's midpoints: 1 + 2**-24 +- 2**-(60 + j),
        # whose bounds are two float64 neighbours.
        A[:10], B[:, :10] = 0, 0
        A[:10, :3] = [[1, 2.0 ** -24, (-1) ** r * 2.0 ** -60] for r in range(10)]
        B[:3, :10] = [[1] * 10, [1] * 10, [2.0 ** -j for j in range(10)]]
    part = er.matmul(A, B)._parts[0]
    exact_path = (part.x_lo == part.x_hi) | (np.nextafter(part.x_lo, np.inf) == part.x_hi)
    assert 10 <= exact_path.sum() < exact_path.size // 2
    assert dtype != "float32" or (part.x_lo[:10, :10] < part.x_hi[:10, :10]).all()
    checked = np.flatnonzero(exact_path.reshape(-1)).tolist() + random.Random(1).sample(range(part.x_lo.size), 60)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    for flat in checked:
        i, j = divmod(flat, B.shape[1])
        exact = sum((F(float(a)) * F(float(b)) for a, b in zip(A64[i], B64[:, j])), F(0))
        lo, hi = part.x_lo[i, j], part.x_hi[i, j]
        assert F(lo) <= exact <= F(hi)
        assert part.rounded[i, j] == round_fraction(exact, dtype)
        if exact_path[i, j]:
            assert lo == round_fraction(exact, "float64") == hi if F(lo) == exact else \
                (F(lo) < exact < F(hi) and np.nextafter(lo, np.inf) == hi)
