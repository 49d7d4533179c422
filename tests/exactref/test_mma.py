"""The tensor-core emulator of tests/exactref/mma.py is itself tested: hand-worked steps, and agreement of
its fast integer path with the Fraction description and with exact sums where nothing is dropped."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .mma import exact_dot, float32_from_fraction, mma_step, tc_dot, tc_matmul
from .oracle import round_fraction

F = Fraction
TWO = Fraction(2)
U23 = 2.0 ** -23  # one float32 ulp at 1
SUB = 2.0 ** -149  # float32's subnormal spacing


def step(c: float, products: list, bits: int = 24, normalization: str = "truncate") -> float:
    return mma_step(c, [F(p) for p in products], bits=bits, normalization=normalization)


# (what the case shows, c, products, bits, normalization, expected): each worked by hand from the model.
HAND = [
    # Alignment to E = 0 keeps multiples of 2**-23: a product of half a unit is dropped, one unit is kept.
    ("small product next to c, dropped", 1.0, [TWO ** -24], 24, "truncate", 1.0),
    ("small product next to c, three quarters of a unit dropped", 1.0, [F(3, 4) * TWO ** -23], 24, "truncate", 1.0),
    ("small product of one unit kept", 1.0, [TWO ** -23], 24, "truncate", 1 + U23),
    ("1.5 units truncated to one", 1.0, [F(3, 2) * TWO ** -23], 24, "truncate", 1 + U23),
    # Truncation is before the sum: rounding the sum to nearest does not bring the dropped bits back.
    ("alignment truncates even under nearest", 1.0, [F(3, 4) * TWO ** -23] * 2, 24, "nearest", 1.0),
    ("but exact sums of kept bits do add", 1.0, [TWO ** -23] * 2, 24, "nearest", 1 + 2 * U23),
    # The accumulator itself is an addend: a larger product (E = 1, unit 2**-22) drops c's last bit.
    ("accumulator loses its last bit", 1 + U23, [2.0], 24, "truncate", 3.0),
    ("accumulator loses its last bit, nearest", 1 + U23, [2.0], 24, "nearest", 3.0),
    ("accumulator at the largest exponent keeps its bits", 1 + U23, [0.5], 24, "truncate", 1.5 + U23),
    # bits = 14: unit 2**-13 at E = 0; c = 1 + 2**-20 is a float32 but loses everything below 2**-13.
    ("14 bits: accumulator loses its low bits", 1 + 2.0 ** -20, [2.0 ** -13], 14, "truncate", 1 + 2.0 ** -13),
    ("14 bits: product just below the unit dropped", 1.0, [F(63, 64) * TWO ** -13] * 32, 14, "truncate", 1.0),
    # Carries: the exact sum needs more than 24 bits, and the normalisation decides.
    ("carry, exact", 2.0 ** 24 - 1, [1.0], 24, "truncate", 2.0 ** 24),
    ("carry, truncated", 2.0 ** 24 - 1, [1.0, 1.0], 24, "truncate", 2.0 ** 24),
    ("carry, tie to even", 2.0 ** 24 - 1, [1.0, 1.0], 24, "nearest", 2.0 ** 24),
    ("carry, three", 2.0 ** 24 - 1, [1.0, 1.0, 1.0], 24, "truncate", 2.0 ** 24 + 2),
    ("sum of 1.5 ulps at 2, truncated", 0.0, [1 + TWO ** -23, 1 + TWO ** -22], 24, "truncate", 2 + 2.0 ** -22),
    ("sum of 1.5 ulps at 2, to nearest even", 0.0, [1 + TWO ** -23, 1 + TWO ** -22], 24, "nearest", 2 + 2.0 ** -21),
    ("sum of 0.75 ulp at 4, to nearest", 0.0, [1 + TWO ** -23] * 3 + [1], 24, "nearest", 4 + 2.0 ** -21),
    ("sum of 0.75 ulp at 4, truncated", 0.0, [1 + TWO ** -23] * 3 + [1], 24, "truncate", 4.0),
    # Signs: a negative addend is truncated towards zero too, so it loses magnitude.
    ("negative addend truncated towards zero", 1.0, [-F(3, 2) * TWO ** -23], 24, "truncate", 1 - U23),
    ("cancellation after alignment", 1.0, [-1.0, TWO ** -30], 24, "truncate", 0.0),
    ("cancellation with kept bits", 1.0, [-1.0, TWO ** -23], 24, "truncate", U23),
    ("cancellation of large products to a small sum", 0.0, [2.0 ** 20, -(2.0 ** 20), F(3, 2)], 24, "truncate", 1.5),
    ("negative result truncated towards zero", 0.0, [-(1 + TWO ** -23), -(1 + TWO ** -22)], 24, "truncate",
     -(2 + 2.0 ** -22)),
    # Zero products take no part in choosing E.
    ("zero products", 2.0 ** -30, [0, 0, 0], 24, "truncate", 2.0 ** -30),
    ("all zero", 0.0, [0, 0], 24, "truncate", 0.0),
    ("no products", 1.25, [], 24, "truncate", 1.25),
    # Subnormal results: truncation to the 2**-149 grid, or to nearest with ties to even.
    ("subnormal, truncated", 0.0, [F(3, 2) * TWO ** -149], 24, "truncate", SUB),
    ("subnormal, tie to even", 0.0, [F(3, 2) * TWO ** -149], 24, "nearest", 2 * SUB),
    ("below the smallest subnormal, truncated", 0.0, [F(3, 4) * TWO ** -149], 24, "truncate", 0.0),
    ("below the smallest subnormal, nearest", 0.0, [F(3, 4) * TWO ** -149], 24, "nearest", SUB),
    ("half the smallest subnormal ties to zero", 0.0, [TWO ** -150], 24, "nearest", 0.0),
    ("subnormal accumulator plus subnormal", 5 * SUB, [TWO ** -149], 24, "truncate", 6 * SUB),
    ("sum crossing into the normals", 0.0, [TWO ** -127, TWO ** -127], 24, "truncate", 2.0 ** -126),
    # Overflow.
    ("overflow to inf", 3.0e38, [F(2) ** 127], 24, "truncate", math.inf),
    ("negative overflow to -inf", -3.0e38, [-F(2) ** 127], 24, "nearest", -math.inf),
]


@pytest.mark.parametrize("what, c, products, bits, normalization, expected", HAND, ids=[h[0] for h in HAND])
def test_mma_step_by_hand(what, c, products, bits, normalization, expected):
    got = step(c, products, bits, normalization)
    assert got == expected and math.copysign(1, got) == math.copysign(1, expected), (what, got, expected)


@pytest.mark.parametrize("what, c, products, bits, normalization, expected", HAND, ids=[h[0] for h in HAND])
def test_fast_path_by_hand(what, c, products, bits, normalization, expected):
    # The same step through tc_dot: c as a first step of its own (it is a float32, so exact), then the products.
    dyadic = [float(p) for p in products if F(float(p)) == p]
    if len(dyadic) != len(products) or not math.isfinite(expected) or not products:
        pytest.skip("products that are not doubles, or overflow: only mma_step takes them")
    a = [c] + dyadic
    got = tc_dot(a, [1.0] * len(a), block=len(a), bits=bits, normalization=normalization)
    assert got == step(c, products, bits, normalization), what


def test_float32_from_fraction_matches_the_oracle_to_nearest():
    for q in (F(1, 3), -F(7, 5), F(2) ** -149 * F(5, 3), F(10) ** 30, F(2 ** 24 + 1), F(2) ** 127 * F(3, 2)):
        assert float32_from_fraction(q, "nearest") == round_fraction(q, "float32")


def _floats(fmt: str, *, min_exp: int, max_exp: int):
    """Values of fmt with varying exponents: a significand in [1, 2), a power of two, a sign."""
    dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
             "float8_e5m2": ml_dtypes.float8_e5m2}[fmt]
    return st.builds(lambda m, e, neg, zero: 0.0 if zero else float(dtype((-1 if neg else 1) * m * 2.0 ** e)),
                     st.floats(1, 2, exclude_max=True), st.integers(min_exp, max_exp), st.booleans(),
                     st.sampled_from([False] * 9 + [True]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]),
       block=st.sampled_from([1, 2, 4, 8, 16, 32]), bits=st.sampled_from([3, 8, 14, 24, 25, 28]),
       normalization=st.sampled_from(["truncate", "nearest"]), n=st.integers(1, 70))
def test_fast_path_matches_a_chain_of_mma_step(data, fmt, block, bits, normalization, n):
    lo, hi = (-9, 7) if fmt.startswith("float8") else (-14, 14)
    values = _floats(fmt, min_exp=lo, max_exp=hi)
    a = data.draw(st.lists(values, min_size=n, max_size=n))
    b = data.draw(st.lists(values, min_size=n, max_size=n))
    c = 0.0
    for start in range(0, n, block):
        products = [F(x) * F(y) for x, y in zip(a[start:start + block], b[start:start + block])]
        c = mma_step(c, products, bits=bits, normalization=normalization)
    assert tc_dot(a, b, block=block, bits=bits, normalization=normalization) == c


@settings(max_examples=40, deadline=None)
@given(products=st.lists(st.floats(-6e4, 6e4) | st.floats(-1e-3, 1e-3), max_size=40),
       normalization=st.sampled_from(["truncate", "nearest"]))
def test_many_bits_give_the_exact_sum_normalised_once(products, normalization):
    # With more bits than any addend's span nothing is dropped: the step is the exact sum, normalised.
    exact = sum((F(p) for p in products), F(0))
    got = mma_step(0.0, [F(p) for p in products], bits=1200, normalization=normalization)
    assert got == float32_from_fraction(exact, normalization)
    if normalization == "nearest":
        assert got == round_fraction(exact, "float32") or exact == 0
    else:
        assert abs(F(got)) <= abs(exact) and abs(exact - F(got)) < F(2) ** -149 + abs(exact) * F(2) ** -23


def test_one_product_per_step_with_many_bits_is_float32_sequential_summation():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(300).astype(np.float16).astype(float)
    b = rng.standard_normal(300).astype(np.float16).astype(float)
    acc = np.float32(0)
    for x, y in zip(a, b):
        acc = np.float32(acc + np.float32(x * y))  # x * y is exact in float32 (22 bits)
    assert tc_dot(list(a), list(b), block=1, bits=400, normalization="nearest") == float(acc)


def test_promote_adds_the_chunk_chains_in_float32():
    rng = np.random.default_rng(2)
    a = list(rng.standard_normal(300).astype(ml_dtypes.float8_e4m3fn).astype(float))
    b = list(rng.standard_normal(300).astype(ml_dtypes.float8_e4m3fn).astype(float))
    acc = np.float32(0)
    for s in range(0, 300, 128):
        acc = acc + np.float32(tc_dot(a[s:s + 128], b[s:s + 128], block=32, bits=14))
    assert tc_dot(a, b, block=32, bits=14, promote=128) == float(acc)
    # A promote at least the length is one chain.
    assert tc_dot(a, b, block=32, bits=14, promote=300) == tc_dot(a, b, block=32, bits=14)


def test_promotion_fixes_the_stagnation_that_14_bits_cause():
    # c = 4 keeps multiples of 2**-11; every later product (0.984 of that) is dropped without promotion.
    K = 4096
    a = [2.0] + [1.125 * 2 ** -6] * (K - 1)
    b = [2.0] + [1.75 * 2 ** -6] * (K - 1)
    exact = exact_dot(a, b)
    stagnated = tc_dot(a, b, block=32, bits=14)
    promoted = tc_dot(a, b, block=32, bits=14, promote=128)
    assert stagnated == 4.0
    assert abs(F(promoted) - exact) < abs(F(stagnated) - exact) / 10


def test_tc_matmul_is_tc_dot_per_element():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((3, 70)).astype(np.float16)
    B = rng.standard_normal((70, 2)).astype(np.float16)
    out = tc_matmul(A, B, block=16, bits=24)
    assert out.dtype == np.float32
    for i in range(3):
        for j in range(2):
            assert out[i, j] == tc_dot(list(A[i].astype(float)), list(B[:, j].astype(float)), block=16, bits=24)
    exact = [[float(exact_dot(list(A[i].astype(float)), list(B[:, j].astype(float)))) for j in range(2)]
             for i in range(3)]
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)


def test_8x4096_by_4096x8_is_fast():
    import time
    rng = np.random.default_rng(4)
    A = rng.standard_normal((8, 4096)).astype(ml_dtypes.float8_e4m3fn)
    B = rng.standard_normal((4096, 8)).astype(ml_dtypes.float8_e4m3fn)
    t0 = time.process_time()
    tc_matmul(A, B, block=32, bits=14)
    assert time.process_time() - t0 < 5.0


@pytest.mark.parametrize("call, match", [
    (lambda: mma_step(0.0, [], bits=0, normalization="truncate"), "bits=0"),
    (lambda: mma_step(0.0, [], bits=24, normalization="round"), "normalization='round'"),
    (lambda: mma_step(math.inf, [], bits=24, normalization="truncate"), "c=inf"),
    (lambda: tc_dot([1.0], [1.0, 2.0], block=4, bits=24), "len"),
    (lambda: tc_dot([1.0], [1.0], block=0, bits=24), "block=0"),
    (lambda: tc_dot([1.0], [1.0], block=4, bits=24, promote=0), "promote=0"),
    (lambda: tc_dot([math.nan], [1.0], block=4, bits=24), "nan"),
    (lambda: tc_matmul(np.ones((2, 3)), np.ones((2, 3)), block=4, bits=24), "shape"),
    (lambda: float32_from_fraction(F(1), "up"), "normalization='up'"),
])
def test_emulator_refuses_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
