"""er.scaled_matmul's rounded values, bit for bit, against a Fraction oracle written here.

The oracle follows the formula ``(scale_a * A) @ (B * scale_b) + bias``
element by element: the exact value is a Fraction, rounded once to the
output format by tests/exactref/oracle.py's ``round_fraction`` (a rounding
on an integer grid, with the three overflow conventions).  Where an input is NaN or infinite the normal
answer follows IEEE arithmetic on the formula: ``0 * inf`` in
``scale_a * A`` is NaN, ``inf - inf`` is NaN, NaN anywhere in a row
(after scaling) makes the row NaN.

Nothing here reads the engine's formats or rounding: the output formats'
largest values, used to build the hard cases, are restated as numbers.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er

from .oracle import bits_equal, floor_log2, round_fraction

# name: (precision p, emin, largest finite value, has an infinity)
OUT_FORMATS = {
    "float32": (24, -126, (2 - Fraction(2) ** -23) * Fraction(2) ** 127, True),
    "bfloat16": (8, -126, (2 - Fraction(2) ** -7) * Fraction(2) ** 127, True),
    "float16": (11, -14, Fraction(65504), True),
    # S.1111.111 is NaN: the top binade stops one value short, at 448.
    "float8_e4m3fn": (4, -6, Fraction(448), False),
    "float8_e5m2": (3, -14, Fraction(57344), True),
}
INPUTS = ("float8_e4m3fn", "float8_e5m2")
SATURATIONS = (None, "satfinite", "nosat")
MX = 32


def saturates(fmt: str, saturation: str | None) -> bool:
    """torch's cast saturates into float8_e4m3fn only; 'satfinite' and 'nosat' choose for every format."""
    if saturation is None:
        return fmt == "float8_e4m3fn"
    return saturation == "satfinite"


def overflow_value(fmt: str, saturation: str | None, sign: int) -> float:
    _, _, largest, has_inf = OUT_FORMATS[fmt]
    if saturates(fmt, saturation):
        return sign * float(largest)
    return sign * math.inf if has_inf else math.nan


def round_out(q: Fraction, fmt: str, saturation: str | None = None, negative_zero: bool = False) -> float:
    """q rounded to nearest, ties to even, in ``fmt``; past the largest value as ``saturation`` says."""
    return round_fraction(q, fmt, negative_zero, saturation=saturation)


def special_out(x: float, fmt: str, saturation: str | None) -> float:
    """An infinite or NaN answer stored in ``fmt``.

    A saturating conversion gives the largest finite value for an infinity,
    as torch's cast to float8_e4m3fn does and NVIDIA's __NV_SATFINITE does
    for every float8 format (cuda_fp8.hpp: |x| > the overflow threshold,
    infinities included, gives MAXNORM).
    """
    if math.isnan(x):
        return math.nan
    return overflow_value(fmt, saturation, 1 if x > 0 else -1)


def scaled_values(A, B, sa, sb, kind):
    """The float64 values of scale_a * A and B * scale_b (exact: float32 or 2**e times a float8)."""
    Av, Bv = np.asarray(A).astype(np.float64), np.asarray(B).astype(np.float64)
    sa, sb = np.asarray(sa).astype(np.float64), np.asarray(sb).astype(np.float64)
    with np.errstate(invalid="ignore"):
        if kind == "block":
            return Av * np.repeat(sa, MX, axis=1), Bv * np.repeat(sb, MX, axis=1).T
        return Av * sa, Bv * sb


def oracle(A, B, sa, sb, bias, out, saturation, kind):
    """(rounded answer, exact Fractions or None) per element of (scale_a * A) @ (B * scale_b) + bias."""
    X, Y = scaled_values(A, B, sa, sb, kind)
    M, K = X.shape
    N = Y.shape[1]
    c = None if bias is None else np.asarray(bias).astype(np.float64)
    rounded = np.empty((M, N))
    exact = {}
    for i in range(M):
        for j in range(N):
            terms = [(X[i, k], Y[k, j]) for k in range(K)]
            with np.errstate(invalid="ignore"):
                products = [x * y for x, y in terms]
            specials = [v for v in products + ([] if c is None else [c[j]]) if not math.isfinite(v)]
            if specials:
                # IEEE on the formula: any NaN, or infinities of both signs, give NaN.
                nan = any(math.isnan(v) for v in specials) or len({v > 0 for v in specials}) == 2
                rounded[i, j] = special_out(math.nan if nan else specials[0], out, saturation)
                exact[i, j] = None
                continue
            total = sum((Fraction(x) * Fraction(y) for x, y in terms), Fraction(0))
            negative = [math.copysign(1.0, x) * math.copysign(1.0, y) < 0 and x * y == 0 for x, y in terms]
            if c is not None:
                total += Fraction(c[j])
                negative.append(c[j] == 0 and math.copysign(1.0, c[j]) < 0)
            # IEEE: an exact zero sum is -0 only when every term is -0.
            negative_zero = len(negative) > 0 and all(negative)
            rounded[i, j] = round_out(total, out, saturation, negative_zero)
            exact[i, j] = total
    return rounded, exact


def run(A, B, sa, sb, *, bias=None, out="float32", saturation=None, kind=None):
    kind = kind or ("block" if np.asarray(sa).dtype.name == "float8_e8m0fnu"
                    else "tensor" if np.asarray(sa).size == 1 and np.asarray(sb).size == 1 else "row")
    with np.errstate(all="ignore"):
        res = er.scaled_matmul(A, B, sa, sb, bias=bias, out_dtype=out, saturation=saturation)
    want, exact = oracle(A, B, sa, sb, bias, out, saturation, kind)
    return res, want, exact


def assert_matches(res, want, exact, *, skip=frozenset()):
    """Bit for bit, and res.exact() equal to the oracle's Fraction except at the elements ``skip``."""
    got = np.asarray(res.rounded).astype(np.float64)
    assert bits_equal(got, want), f"rounded {got.tolist()} but the oracle says {want.tolist()}"
    for (i, j), value in exact.items():
        if (i, j) not in skip:
            assert res.exact((i, j)) == value


def inexact_products(A, B, sa, sb, kind):
    """Elements with a product of scaled values that float64 does not hold exactly (see EXACT_OF_WIDE_PRODUCTS)."""
    X, Y = scaled_values(A, B, sa, sb, kind)
    out = set()
    with np.errstate(all="ignore"):
        for i in range(X.shape[0]):
            for j in range(Y.shape[1]):
                for k in range(X.shape[1]):
                    x, y = X[i, k], Y[k, j]
                    if math.isfinite(x * y) and Fraction(x * y) != Fraction(x) * Fraction(y):
                        out.add((i, j))
    return out


def f8(values, fmt="float8_e4m3fn"):
    return er.asarray(np.asarray(values, dtype=np.float64), fmt)


def f32(values):
    return er.asarray(np.asarray(values, dtype=np.float64), "float32")


def e8m0(exponents):
    return er.asarray(np.ldexp(1.0, np.asarray(exponents)), "float8_e8m0fnu")


# --- The oracle's own rounding, on values whose answers are known by hand ----------------------------


@pytest.mark.parametrize("q, fmt, saturation, want", [
    (Fraction(464), "float8_e4m3fn", "nosat", 448.0),          # the tie below 480 goes to even 448
    (Fraction(465), "float8_e4m3fn", "nosat", math.nan),
    (Fraction(465), "float8_e4m3fn", None, 448.0),
    (Fraction(61440), "float8_e5m2", None, math.inf),          # the tie goes to even 2**16: overflow
    (Fraction(61439), "float8_e5m2", None, 57344.0),
    (Fraction(61440), "float8_e5m2", "satfinite", 57344.0),
    (Fraction(65520), "float16", None, math.inf),
    (Fraction(-65520), "float16", "satfinite", -65504.0),
    (Fraction(1, 2 ** 10), "float8_e4m3fn", None, 0.0),        # half the smallest subnormal: to even 0
    (Fraction(3, 2 ** 10), "float8_e4m3fn", None, 2.0 ** -8),
    (Fraction(-1, 2 ** 12), "float8_e4m3fn", None, -0.0),
    (Fraction(17, 16), "float8_e4m3fn", None, 1.0),
    (Fraction(19, 16), "float8_e4m3fn", None, 1.25),
])
def test_the_oracle_rounds_hand_checked_values(q, fmt, saturation, want):
    assert bits_equal(round_out(q, fmt, saturation), want)


# --- Hypothesis: random inputs in every format, scale kind, bias and overflow convention --------------


@functools.cache
def finite_values(fmt: str) -> tuple[float, ...]:
    """Every finite value of a float8 format (all 256 bit patterns, decoded)."""
    dtype = getattr(ml_dtypes, fmt)
    v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    return tuple(sorted(set(v[np.isfinite(v)].tolist())))


def float8_matrix(draw, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    values = draw(st.lists(st.sampled_from(finite_values(fmt)), min_size=shape[0] * shape[1],
                           max_size=shape[0] * shape[1]))
    return f8(np.reshape(values, shape), fmt)


def float32_scale(*, zero: bool = True):
    """float32 values: powers of two over a wide range, and values with 24-bit significands."""
    powers = st.integers(-140, 120).map(lambda e: math.ldexp(1.0, e))
    wide = st.floats(min_value=2.0 ** -40, max_value=2.0 ** 40, width=32)
    signed = st.tuples(st.one_of(powers, wide), st.sampled_from([1.0, -1.0])).map(lambda t: t[0] * t[1])
    return st.one_of(signed, st.just(0.0)) if zero else signed


@st.composite
def scaled_case(draw, *, kind: str):
    fa, fb = draw(st.sampled_from(INPUTS)), draw(st.sampled_from(INPUTS))
    M, N = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    K = MX * draw(st.integers(1, 2)) if kind == "block" else draw(st.integers(1, 6))
    A, B = float8_matrix(draw, fa, (M, K)), float8_matrix(draw, fb, (K, N))
    if kind == "tensor":
        sa, sb = f32(draw(float32_scale())), f32(draw(float32_scale()))
    elif kind == "row":
        sa = f32(np.reshape(draw(st.lists(float32_scale(), min_size=M, max_size=M)), (M, 1)))
        sb = f32(np.reshape(draw(st.lists(float32_scale(), min_size=N, max_size=N)), (1, N)))
    else:
        exps = st.integers(-127, 127)
        sa = e8m0(np.reshape(draw(st.lists(exps, min_size=M * K // MX, max_size=M * K // MX)), (M, K // MX)))
        sb = e8m0(np.reshape(draw(st.lists(exps, min_size=N * K // MX, max_size=N * K // MX)), (N, K // MX)))
    bias = None
    bias_dtype = draw(st.sampled_from([None, "float32", "bfloat16"]))
    if bias_dtype is not None:
        bias = er.asarray(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=N, max_size=N)), bias_dtype)
    out = draw(st.sampled_from(sorted(OUT_FORMATS)))
    saturation = draw(st.sampled_from(SATURATIONS))
    return A, B, sa, sb, bias, out, saturation


@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rounded_values_match_the_fraction_oracle_bit_for_bit(kind, data):
    A, B, sa, sb, bias, out, saturation = data.draw(scaled_case(kind=kind))
    res, want, exact = run(A, B, sa, sb, bias=bias, out=out, saturation=saturation, kind=kind)
    assert_matches(res, want, exact)


def test_exact_value_of_a_product_of_27_bit_scaled_values():
    """scale_a * A = 7 * 13887373 * 2**-25 and B * scale_b = 7 * 14947157 * 2**-25: 27 bits each, 54 bits together.

    Result.exact() once rounded this product: engine/exact.py took factors of 27 significant bits for exact
    float64 products."""
    A, B = f8([[1.75], [1.0]]), f8([[1.75, 1.0]])
    sa, sb = f32([[13887373 * 2.0 ** -23], [1.0]]), f32([[14947157 * 2.0 ** -23, 1.0]])
    res, want, exact = run(A, B, sa, sb, out="float32")
    assert (0, 0) in inexact_products(A, B, sa, sb, "row")
    assert bits_equal(np.asarray(res.rounded).astype(np.float64), want)  # the rounding itself is right
    assert res.exact((0, 0)) == exact[0, 0]


def test_the_hypothesis_cases_reach_every_format_and_overflow():
    """The strategy is worth running: it draws overflowing float8 outputs and all three conventions."""
    seen = set()

    # Enough examples that the draws reach them whatever constants Hypothesis mixes in (they depend on
    # the checkout's path: CI's clone draws otherwise than a working copy).
    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(data=st.data())
    def probe(data):
        A, B, sa, sb, bias, out, saturation = data.draw(scaled_case(kind="tensor"))
        want, _ = oracle(A, B, sa, sb, bias, out, saturation, "tensor")
        big = float(OUT_FORMATS[out][2])
        seen.add((out, bool(np.any(~np.isfinite(want) | (np.abs(want) == big)))))
        seen.add(saturation)

    probe()
    assert {None, "satfinite", "nosat"} <= seen
    assert ("float8_e4m3fn", True) in seen and ("float8_e5m2", True) in seen


# --- Hard cases: ties of the output format, its overflow threshold, its subnormals ------------------


def ulp(x: Fraction, fmt: str) -> Fraction:
    p, emin, _, _ = OUT_FORMATS[fmt]
    return Fraction(2) ** (max(floor_log2(abs(x)), emin) - p + 1)


def biased_case(base: Fraction, half: Fraction, nudge: int, fmt: str, *, sign: int = 1):
    """exact = bias + s * (1 + nudge * 2**-24), bias = sign * base, s = sign * half; one K=2 product each.

    The products 1 * 1 and (+-2**-12) * 2**-12 are float8_e5m2 values, s is a float32 power of two.
    """
    A = f8([[1.0, math.copysign(2.0 ** -12, nudge) if nudge else 0.0]], "float8_e5m2")
    B = f8([[1.0], [2.0 ** -12]], "float8_e5m2")
    return A, B, f32(sign * float(half)), f32(1.0), f32([sign * float(base)])


def hard_cases():
    """(id, inputs, out, saturation, expected) built from each format's numbers, the answer known by construction."""
    cases = []
    for fmt, (p, emin, largest, _) in OUT_FORMATS.items():
        one = Fraction(1)
        odd = one + ulp(one, fmt)
        for base, tie_goes in ((one, "down"), (odd, "up")):
            half = ulp(base, fmt) / 2
            up = base + 2 * half
            for nudge, where in ((0, "on"), (1, "above"), (-1, "below")):
                want = up if (where == "above" or (where == "on" and tie_goes == "up")) else base
                for sign in (1, -1):
                    cases.append((f"{fmt}-tie-{tie_goes}-{where}-{'+' if sign > 0 else '-'}",
                                  biased_case(base, half, nudge, fmt, sign=sign), fmt, None, sign * float(want)))
        # The overflow threshold: the largest value plus half its spacing.
        half = ulp(largest, fmt) / 2
        threshold_rounds_up = (largest / (2 * half)) % 2 == 1  # an odd largest value: the tie overflows
        for saturation in SATURATIONS:
            over = overflow_value(fmt, saturation, 1)
            for nudge, where in ((0, "on"), (1, "above"), (-1, "below")):
                overflows = where == "above" or (where == "on" and threshold_rounds_up)
                want = over if overflows else float(largest)
                for sign in (1, -1):
                    cases.append((f"{fmt}-threshold-{where}-{saturation}-{'+' if sign > 0 else '-'}",
                                  biased_case(largest, half, nudge, fmt, sign=sign), fmt, saturation, sign * want))
        # Subnormal results: s * (a * b) with s the smallest subnormal of the output format, a * b in
        # units of s: halves tie to even (1/2 -> 0, 3/2 -> 2, 5/2 -> 2, 7/2 -> 4), a zero keeps its sign.
        tiny = Fraction(2) ** (emin - p + 1)
        for a, b, want in ((1.0, 0.5, 0), (3.0, 0.5, 2), (5.0, 0.5, 2), (7.0, 0.5, 4), (3.0, 0.25, 1),
                           (1.0, 0.25, 0), (5.0, 1.0, 5)):
            for sign in (1, -1):
                cases.append((f"{fmt}-subnormal-{a * b}-{'+' if sign > 0 else '-'}",
                              (f8([[sign * a]], "float8_e5m2"), f8([[b]], "float8_e5m2"), f32(float(tiny)), f32(1.0),
                               None), fmt, None, math.copysign(float(want * tiny), sign)))
    return cases


def hard_params():
    params = []
    for name, inputs, out, saturation, want in hard_cases():
        params.append(pytest.param(inputs, out, saturation, want, id=name))
    return params


@pytest.mark.parametrize("inputs, out, saturation, want", hard_params())
def test_hard_cases_are_rounded_as_constructed(inputs, out, saturation, want):
    A, B, sa, sb, bias = inputs
    res, oracle_says, exact = run(A, B, sa, sb, bias=bias, out=out, saturation=saturation)
    # The oracle agrees with the construction, and er.scaled_matmul with both.
    assert bits_equal(oracle_says, np.array([[want]])), f"the oracle says {oracle_says} for {want}"
    assert_matches(res, oracle_says, exact)


@pytest.mark.parametrize("out", sorted(OUT_FORMATS))
def test_ties_without_bias_are_rounded_to_even(out):
    """Ties made by the scales alone, and their neighbours at +-2**-32 relative, tensor-wise and row-wise."""
    p = OUT_FORMATS[out][0]
    # a * s = a + (odd / 2) * spacing at 1: a = 1, s = 1 + k 2**-p; for float32 (1 + 2**-24 is no
    # float32) a = 1.5, s = 1 + k 2**-23, which gives 1.5 k / 2 spacings.
    a, step = (1.5, 2.0 ** -23) if p > 23 else (1.0, 2.0 ** -p)
    A = f8([[a, 2.0 ** -16], [a, -(2.0 ** -16)], [a, 0.0]], "float8_e5m2")
    B = f8([[1.0], [2.0 ** -16]], "float8_e5m2")
    for k in (1, 3, 5):
        s = 1 + k * step
        res, want, exact = run(A, B, f32(s), f32(1.0), out=out)
        assert_matches(res, want, exact)
        assert exact[2, 0].denominator > 1 and want[0, 0] > want[1, 0] and want[2, 0] in (want[0, 0], want[1, 0])
        assert_matches(*run(A, B, f32([[s], [-s], [s]]), f32([[1.0]]), out=out))


def test_mx_block_scales_apply_per_block_of_32():
    """Each 32-block of a row has its own power of two: 2**-127 and 2**127 both reach the result exactly."""
    A = f8(np.ones((2, 64)))
    B = f8(np.ones((64, 1)))
    sa = e8m0([[-127, 0], [127, -127]])
    sb = e8m0([[0, 3]])
    res, want, exact = run(A, B, sa, sb, out="float32")
    assert_matches(res, want, exact)
    assert exact[0, 0] == 32 * Fraction(2) ** -127 + 32 * 8
    assert exact[1, 0] == 32 * Fraction(2) ** 127 + 32 * Fraction(2) ** -124
    assert res.rounded[1, 0] == np.inf  # 2**132 overflows float32


def test_subnormal_float32_scales_give_exact_results():
    A = f8([[2.0 ** -9, -(2.0 ** -9)], [448.0, 2.0 ** -9]])
    B = f8([[2.0 ** -9], [2.0 ** -8]])
    for out in OUT_FORMATS:
        for saturation in SATURATIONS:
            assert_matches(*run(A, B, f32(2.0 ** -149), f32(2.0 ** 20), out=out, saturation=saturation))
            assert_matches(*run(A, B, f32([[2.0 ** -149], [2.0 ** -140]]), f32([[3.0]]), out=out))


# --- NaN and infinity: the normal answer of the formula ----------------------------------------------

INF, NAN = math.inf, math.nan

SPECIAL = [
    # id, A (values, format), B, scale_a, scale_b, bias
    ("nan-in-A", ([[NAN, 1.0], [1.0, 2.0]], "float8_e4m3fn"), ([[0.0], [1.0]], "float8_e4m3fn"), 1.0, 1.0, None),
    ("inf-in-A", ([[INF, 1.0], [1.0, 2.0]], "float8_e5m2"), ([[2.0], [1.0]], "float8_e5m2"), 1.0, 1.0, None),
    ("inf-times-zero-B", ([[INF, 1.0]], "float8_e5m2"), ([[0.0], [1.0]], "float8_e5m2"), 1.0, 1.0, None),
    ("inf-minus-inf", ([[INF, -INF]], "float8_e5m2"), ([[1.0], [1.0]], "float8_e5m2"), 1.0, 1.0, None),
    ("inf-in-B-negative", ([[-2.0, 1.0]], "float8_e4m3fn"), ([[INF], [1.0]], "float8_e5m2"), 1.0, 1.0, None),
    ("inf-bias", ([[1.0, 1.0], [2.0, 3.0]], "float8_e4m3fn"), ([[1.0, 2.0], [1.0, 3.0]], "float8_e4m3fn"), 1.0, 1.0,
     [INF, -INF]),
    ("inf-bias-meets-inf", ([[INF]], "float8_e5m2"), ([[1.0, 1.0]], "float8_e5m2"), 1.0, 1.0, [-INF, INF]),
    ("nan-bias", ([[1.0]], "float8_e4m3fn"), ([[1.0, 2.0]], "float8_e4m3fn"), 1.0, 1.0, [NAN, 0.0]),
    # scale_a * A is 0 * inf = NaN where A holds a zero, as the formula says.
    ("zero-times-inf-scale", ([[0.0, 1.0], [2.0, 1.0]], "float8_e4m3fn"), ([[1.0], [1.0]], "float8_e4m3fn"),
     INF, 1.0, None),
    ("inf-scale-times-zero-scale", ([[1.0, 1.0]], "float8_e4m3fn"), ([[1.0], [1.0]], "float8_e4m3fn"), INF, 0.0, None),
    ("negative-inf-scale", ([[3.0, 1.0]], "float8_e4m3fn"), ([[1.0], [1.0]], "float8_e4m3fn"), -INF, 1.0, None),
    ("nan-scale", ([[1.0]], "float8_e4m3fn"), ([[1.0]], "float8_e4m3fn"), NAN, 1.0, None),
    ("row-inf-scale-zero-A", ([[0.0, 1.0], [2.0, 1.0], [1.0, 1.0]], "float8_e4m3fn"),
     ([[1.0, 1.0], [1.0, 0.0]], "float8_e4m3fn"), [[INF], [INF], [1.0]], [[1.0, 2.0]], None),
    ("row-inf-scale-b", ([[1.0, 1.0]], "float8_e4m3fn"), ([[0.0, 1.0], [1.0, 1.0]], "float8_e4m3fn"),
     [[1.0]], [[INF, -INF]], [1.0, 1.0]),
]


def special_inputs(A, B, sa, sb, bias):
    args = [f8(*A), f8(*B)]
    args += [f32(sa), f32(sb)]
    return (*args, None if bias is None else f32(bias))


def special_params():
    params = []
    for name, A, B, sa, sb, bias in SPECIAL:
        inputs = special_inputs(A, B, sa, sb, bias)
        kind = "tensor" if np.size(sa) == 1 else "row"
        for out in OUT_FORMATS:
            # Elements whose normal answer is an infinity (from an infinite input, not an overflow).
            for saturation in SATURATIONS:
                params.append(pytest.param(inputs, out, saturation, id=f"{name}-{out}-{saturation}"))
    return params


@pytest.mark.parametrize("inputs, out, saturation", special_params())
def test_nan_and_inf_follow_the_formula(inputs, out, saturation):
    A, B, sa, sb, bias = inputs
    res, want, exact = run(A, B, sa, sb, bias=bias, out=out, saturation=saturation)
    assert_matches(res, want, exact)
    assert res.covers(want).all(), "the normal answer itself must be accepted"


def test_mx_nan_scale_makes_its_row_nan():
    A, B = f8(np.ones((2, 64))), f8(np.ones((64, 2)))
    sa = er.asarray(np.array([[np.nan, 1.0], [1.0, 1.0]]), "float8_e8m0fnu")
    assert np.isnan(sa.astype(np.float64)[0, 0])
    res, want, exact = run(A, B, sa, e8m0([[0, 0], [1, -1]]), out="bfloat16")
    assert_matches(res, want, exact)
    assert np.isnan(want[0]).all() and np.isfinite(want[1]).all()


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_inputs_with_nan_and_inf_match_the_oracle(data):
    """Hypothesis puts NaN and inf into e5m2 inputs, scales and bias."""
    M, K, N = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    pool = st.sampled_from((0.0, -0.0, 1.0, -2.0, 0.5, 57344.0, INF, -INF, NAN))
    A = f8(np.reshape(data.draw(st.lists(pool, min_size=M * K, max_size=M * K)), (M, K)), "float8_e5m2")
    B = f8(np.reshape(data.draw(st.lists(pool, min_size=K * N, max_size=K * N)), (K, N)), "float8_e5m2")
    scale = st.sampled_from((1.0, -0.5, 0.0, 3.0e38, INF, NAN))
    sa, sb = f32(data.draw(scale)), f32(data.draw(scale))
    bias = data.draw(st.one_of(st.none(), st.lists(pool, min_size=N, max_size=N)))
    out = data.draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]))
    saturation = data.draw(st.sampled_from([None, "nosat"]))
    assert_matches(*run(A, B, sa, sb, bias=None if bias is None else f32(bias), out=out, saturation=saturation))
