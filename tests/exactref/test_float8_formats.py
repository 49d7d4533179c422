"""The float8 formats: constants, bit patterns and rounding, against an oracle written in the tests.

The oracle (``oracle.round_fraction`` / ``round_value`` / ``decode_float8``)
restates each format as plain numbers (p, emin, emax, the largest finite
value, the NaN bytes) and rounds Fractions on an integer grid; it shares no
code with exactref.  exactref's ``round_float64``, ``round_dyadic`` and
``er.asarray`` must agree with it bit for bit, under each overflow
convention; torch's and ml_dtypes' casts are compared with it where they
round once (from float32), and the double rounding of torch's cast from
float64 is shown.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
from exactref.formats import FLOAT8_FORMATS
from exactref.rounding import round_dyadic, round_float64

from .oracle import (
    ENCODINGS,
    FORMATS,
    SATURATIONS,
    bits_equal,
    decode_float8,
    encode_float8,
    round_fraction,
    round_value,
)

NAMES = list(ENCODINGS)
SIGNED = [n for n in NAMES if not ENCODINGS[n].unsigned]
E8M0 = "float8_e8m0fnu"
ALL_BYTES = np.arange(256, dtype=np.uint8)
TWO = Fraction(2)


def dtype(name):
    return np.dtype(getattr(ml_dtypes, name))


def saturates(saturation):
    return None if saturation is None else saturation == "satfinite"


def fmt_with(name, saturation):
    fmt = FLOAT8_FORMATS[name]
    return fmt if saturation is None else fmt.with_saturation(saturation == "satfinite")


def same(got, want):
    return bits_equal(np.array(float(got)), np.array(float(want)))


# --- constants and bit patterns -------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_constants_match_ml_dtypes_finfo_and_exactref(name):
    p, emin, emax = FORMATS[name]
    enc = ENCODINGS[name]
    info = ml_dtypes.finfo(dtype(name))
    assert Fraction(float(info.max)) == enc.max_finite
    assert Fraction(float(info.smallest_normal)) == TWO ** emin
    assert Fraction(float(info.smallest_subnormal)) == TWO ** (emin - (p - 1))
    assert Fraction(float(info.eps)) == TWO ** (1 - p)
    assert (info.nmant, info.minexp, info.maxexp) == (p - 1, emin, emax + 1)
    fmt = FLOAT8_FORMATS[name]
    assert (fmt.p, fmt.emin, fmt.emax) == (p, emin, emax)
    assert Fraction(fmt.max_finite) == enc.max_finite
    assert Fraction(fmt.min_normal) == TWO ** emin
    assert Fraction(fmt.min_subnormal) == TWO ** (emin - (p - 1))
    assert (fmt.has_inf, fmt.has_negative_zero, fmt.signed, fmt.has_zero, fmt.saturates) == (
        enc.has_inf, enc.has_negative_zero, not enc.unsigned, not enc.unsigned, enc.saturates)
    assert fmt.dtype == dtype(name)


@pytest.mark.parametrize("name", NAMES)
def test_every_byte_decodes_as_the_oracle_reads_its_fields(name):
    got = ALL_BYTES.view(dtype(name)).astype(np.float64)
    want = np.array([decode_float8(name, int(b)) for b in ALL_BYTES])
    assert bits_equal(got, want)
    t = torch.from_numpy(ALL_BYTES.copy()).view(getattr(torch, name)).to(torch.float64).numpy()
    assert bits_equal(t, want)


@pytest.mark.parametrize("name, nan_bytes", [
    ("float8_e4m3fn", [0x7F, 0xFF]),  # S.1111.111 only: S.1111.110 is +-448
    ("float8_e5m2", [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]),  # IEEE: S.11111.00 is inf
    ("float8_e4m3fnuz", [0x80]),  # the pattern of -0
    ("float8_e5m2fnuz", [0x80]),
    ("float8_e8m0fnu", [0xFF]),
])
def test_nan_patterns(name, nan_bytes):
    values = ALL_BYTES.view(dtype(name)).astype(np.float64)
    assert np.flatnonzero(np.isnan(values)).tolist() == nan_bytes
    assert list(ENCODINGS[name].nan) == nan_bytes
    inf_bytes = np.flatnonzero(np.isinf(values)).tolist()
    assert inf_bytes == ([0x7C, 0xFC] if name == "float8_e5m2" else [])


@pytest.mark.parametrize("name, value, expected_bytes", [
    ("float8_e4m3fn", 448.0, [0x7E]), ("float8_e4m3fn", -448.0, [0xFE]), ("float8_e4m3fn", -0.0, [0x80]),
    ("float8_e4m3fn", math.nan, [0x7F, 0xFF]), ("float8_e4m3fn", 2.0 ** -9, [0x01]),
    ("float8_e5m2", 57344.0, [0x7B]), ("float8_e5m2", -math.inf, [0xFC]), ("float8_e5m2", 2.0 ** -16, [0x01]),
    ("float8_e4m3fnuz", 240.0, [0x7F]), ("float8_e4m3fnuz", -0.0, [0x00]), ("float8_e4m3fnuz", math.nan, [0x80]),
    ("float8_e5m2fnuz", -57344.0, [0xFF]), ("float8_e5m2fnuz", -0.0, [0x00]),
    ("float8_e8m0fnu", 1.0, [0x7F]), ("float8_e8m0fnu", 2.0 ** 127, [0xFE]), ("float8_e8m0fnu", 2.0 ** -127, [0x00]),
    ("float8_e8m0fnu", math.nan, [0xFF]),
])
def test_asarray_writes_the_bit_pattern_of_the_spec(name, value, expected_bytes):
    got = int(er.asarray(np.array([value]), name).view(np.uint8)[0])
    assert got in expected_bytes
    assert encode_float8(name, round_value(value, name)) == tuple(expected_bytes)


# --- exactref against the oracle --------------------------------------------------------------

def edge_values(name):
    """Every value of the format, every midpoint of neighbours, the values just either side of
    each, the overflow threshold and beyond, and the specials; both signs."""
    positive = sorted({v for v in (decode_float8(name, b) for b in range(256)) if 0 < v < math.inf})
    mids = [float((Fraction(a) + Fraction(b)) / 2) for a, b in itertools.pairwise(positive)]
    enc = ENCODINGS[name]
    p, _, emax = FORMATS[name]
    step = TWO ** (emax - p + 1)
    threshold = float(enc.max_finite + step / 2)  # where rounding with an unbounded range leaves the format
    out = positive + mids + [positive[0] / 2, positive[0] / 4, 3 * positive[0] / 4, threshold,
                             float(enc.max_finite + step), 2 * threshold, 1e30, 1.7976931348623157e308]
    out += [math.nextafter(v, math.inf) for v in mids + [threshold, positive[0] / 2]]
    out += [math.nextafter(v, -math.inf) for v in mids + [threshold, positive[0] / 2]]
    out += [-v for v in out] + [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324]
    return out


def signed_only(name, xs):
    """The values er.asarray accepts: float8_e8m0fnu refuses zero and negative values."""
    return [x for x in xs if not ENCODINGS[name].unsigned or math.isnan(x) or x > 0]


def e8m0_tiny_negative(name, x):
    """A negative value that rounds to -0 on a signed grid: round_float64 gives float8_e8m0fnu 2**-127 for it
    (see test_round_float64_makes_every_negative_value_nan_in_e8m0)."""
    return name == E8M0 and -(2.0 ** -128) <= x < 0


@pytest.mark.parametrize("saturation", SATURATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_edge_values_round_as_the_oracle_says(name, saturation):
    xs = [x for x in edge_values(name) if not e8m0_tiny_negative(name, x)]
    want = np.array([round_value(x, name, saturation) for x in xs])
    fmt = fmt_with(name, saturation)
    assert bits_equal(round_float64(np.array(xs), fmt), want)
    for x, w in zip(xs, want):
        if math.isfinite(x):
            n, d = x.as_integer_ratio()
            assert same(round_dyadic(n, -(d.bit_length() - 1), fmt, negative_zero=math.copysign(1, x) < 0), w), x
    ok = signed_only(name, xs)
    got = er.asarray(np.array(ok), name, saturation=saturation)
    assert got.dtype == dtype(name)
    for x, b in zip(ok, got.view(np.uint8).tolist()):
        assert b in encode_float8(name, round_value(x, name, saturation)), (x, b)


@pytest.mark.parametrize("name, x, saturation, expected", [
    # e4m3fn: the tie between 448 and 480 (not a value: NaN's pattern) goes to the even 448, even without
    # saturation; anything above it overflows.  torch saturates, infinities included.
    ("float8_e4m3fn", 464.0, "nosat", 448.0),
    ("float8_e4m3fn", math.nextafter(464.0, math.inf), "nosat", math.nan),
    ("float8_e4m3fn", math.nextafter(464.0, math.inf), None, 448.0),
    ("float8_e4m3fn", -1e30, None, -448.0),
    ("float8_e4m3fn", math.inf, None, 448.0),
    ("float8_e4m3fn", -math.inf, "satfinite", -448.0),
    ("float8_e4m3fn", -math.inf, "nosat", math.nan),
    ("float8_e4m3fn", 2.0 ** -10, None, 0.0),  # half the smallest subnormal: a tie, to even (zero)
    ("float8_e4m3fn", -(2.0 ** -10) * 1.0000001, None, -(2.0 ** -9)),
    ("float8_e4m3fn", 1.0625, None, 1.0), ("float8_e4m3fn", 1.1875, None, 1.25),
    # e5m2 overflows to inf from its threshold 61440 (57344's significand is odd: the tie rounds up).
    ("float8_e5m2", 61440.0, None, math.inf),
    ("float8_e5m2", math.nextafter(61440.0, 0), None, 57344.0),
    ("float8_e5m2", -61440.0, "satfinite", -57344.0),
    ("float8_e5m2", math.nan, "satfinite", math.nan),
    # fnuz: one NaN, no -0, overflow is NaN.
    ("float8_e4m3fnuz", 248.0, None, math.nan),
    ("float8_e4m3fnuz", math.nextafter(248.0, 0), None, 240.0),
    ("float8_e4m3fnuz", -248.0, "satfinite", -240.0),
    ("float8_e4m3fnuz", -0.0, None, 0.0),
    ("float8_e4m3fnuz", -(2.0 ** -12), None, 0.0),  # a negative value that rounds to zero is +0
    ("float8_e5m2fnuz", 61440.0, None, math.nan),
    ("float8_e5m2fnuz", math.inf, "satfinite", 57344.0),
    # e8m0: powers of two, ties 1.5 * 2**e up, nothing below 2**-127, overflow NaN.
    ("float8_e8m0fnu", 1.5, None, 2.0), ("float8_e8m0fnu", math.nextafter(1.5, 0), None, 1.0),
    ("float8_e8m0fnu", 3.0, None, 4.0), ("float8_e8m0fnu", 0.75, None, 1.0),
    ("float8_e8m0fnu", 2.0 ** -140, None, 2.0 ** -127),
    ("float8_e8m0fnu", 1.5 * 2.0 ** 127, None, math.nan),
    ("float8_e8m0fnu", 1.5 * 2.0 ** 127, "satfinite", 2.0 ** 127),
    ("float8_e8m0fnu", math.nextafter(1.5 * 2.0 ** 127, 0), None, 2.0 ** 127),
])
def test_hand_cases(name, x, saturation, expected):
    assert same(round_value(x, name, saturation), expected)
    assert same(round_float64(np.array([x]), fmt_with(name, saturation))[0], expected)
    assert same(er.asarray(np.array([x]), name, saturation=saturation).astype(np.float64)[0], expected)


def test_round_float64_makes_every_negative_value_nan_in_e8m0():
    fmt = FLOAT8_FORMATS[E8M0]
    assert math.isnan(round_dyadic(-1, -1074, fmt))
    assert bits_equal(round_float64(np.array([-5e-324, -(2.0 ** -128)]), fmt), np.array([math.nan, math.nan]))


def test_e8m0_zero_and_negative_values():
    fmt = FLOAT8_FORMATS[E8M0]
    # round_float64 and round_dyadic: zero is 2**-127 (torch's cast), a negative value NaN.
    assert bits_equal(round_float64(np.array([0.0, -0.0, -2.0, -math.inf]), fmt),
                      np.array([2.0 ** -127, 2.0 ** -127, math.nan, math.nan]))
    assert same(round_dyadic(0, 0, fmt), 2.0 ** -127) and math.isnan(round_dyadic(-3, 0, fmt))
    # er.asarray refuses them, naming the value.
    for bad in (0.0, -0.0, -2.0):
        with pytest.raises(ValueError, match="positive powers of two only"):
            er.asarray(np.array([1.0, bad]), E8M0)


def near_grid(name):
    """Exact dyadics on and near the format's grid: n * 2**e with a few bits more than p, and
    midpoints moved by a tiny power of two (values just above and below ties)."""
    p, emin, emax = FORMATS[name]
    lo, hi = emin - p - 4, emax + 2
    on = st.builds(math.ldexp, st.integers(-(2 ** (p + 6)), 2 ** (p + 6)), st.integers(lo, hi))
    near = st.builds(lambda n, e, k, s: math.ldexp(2 * n + 1, e - 1) + s * math.ldexp(1.0, e - 1 - k),
                     st.integers(-(2 ** (p + 2)), 2 ** (p + 2)), st.integers(lo, hi),
                     st.integers(1, 50), st.sampled_from((1, -1)))
    return st.one_of(on, near)


def float64_values(name):
    enc = ENCODINGS[name]
    wide = float(enc.max_finite) * 4
    return st.one_of(near_grid(name), st.floats(-wide, wide), st.floats())


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200)
@given(data=st.data())
def test_round_float64_and_asarray_match_the_oracle(name, data):
    x = data.draw(float64_values(name).filter(lambda x: not e8m0_tiny_negative(name, x)), label="x")
    saturation = data.draw(st.sampled_from(SATURATIONS), label="saturation")
    want = round_value(x, name, saturation)
    assert same(round_float64(np.array([x]), fmt_with(name, saturation))[0], want)
    if signed_only(name, [x]):
        b = int(er.asarray(np.array([x]), name, saturation=saturation).view(np.uint8)[0])
        assert b in encode_float8(name, want), (x, b, want)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200)
@given(n=st.integers(-(2 ** 70), 2 ** 70), e=st.integers(-215, 130), saturation=st.sampled_from(SATURATIONS),
       negative_zero=st.booleans())
def test_round_dyadic_matches_the_oracle(name, n, e, saturation, negative_zero):
    q = Fraction(n) * TWO ** e
    want = round_fraction(q, name, negative_zero=negative_zero, saturation=saturation)
    got = round_dyadic(n, e, fmt_with(name, saturation), negative_zero=negative_zero)
    assert same(got, want), (n, e)


# --- torch's and ml_dtypes' casts -------------------------------------------------------------

def torch_cast_bytes(name, xs, source=torch.float32):
    t = torch.tensor(np.asarray(xs, dtype=np.float64), dtype=torch.float64).to(source)
    return t.to(getattr(torch, name)).view(torch.uint8).tolist()


def to_float32(x):
    """x rounded to float32, as a float (inf past float32's range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def float32_values(name):
    return st.one_of(near_grid(name), st.floats(width=32)).map(to_float32)


def e8m0_torch_rounds_correctly(x):
    # torch's e8m0 cast reads |x| and, for a float32 subnormal in (2**-127, 1.5 * 2**-127), gives
    # 2**-126 (see test_torch_e8m0_cast_differs_from_a_correct_rounding); elsewhere it is exact.
    return x > 0 and not 2.0 ** -127 < x < 1.5 * 2.0 ** -127


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200)
@given(data=st.data())
def test_torch_cast_from_float32_is_the_oracles_rounding(name, data):
    x = data.draw(float32_values(name), label="x")
    if name == E8M0 and not (math.isnan(x) or e8m0_torch_rounds_correctly(x)):
        return
    (b,) = torch_cast_bytes(name, [x])
    assert b in encode_float8(name, round_value(x, name)), (x, b)


@pytest.mark.parametrize("name", NAMES)
def test_torch_cast_of_float32_edge_values(name):
    xs = [x for x in edge_values(name) if math.isnan(x) or to_float32(x) == x]
    if name == E8M0:
        xs = [x for x in xs if math.isnan(x) or e8m0_torch_rounds_correctly(x)]
    for x, b in zip(xs, torch_cast_bytes(name, xs)):
        assert b in encode_float8(name, round_value(x, name)), (x, b)


@pytest.mark.parametrize("name, xs, expected", [
    # torch saturates into e4m3fn, infinities included; e5m2 overflows to inf; fnuz to NaN.
    ("float8_e4m3fn", [math.inf, -math.inf, 1e6, -500.0, 464.0, 470.0], [448, -448, 448, -448, 448, 448]),
    ("float8_e5m2", [math.inf, 61440.0, -1e6, 61439.0], [math.inf, math.inf, -math.inf, 57344.0]),
    ("float8_e4m3fnuz", [math.inf, 248.0, -1e6, -0.0], [math.nan, math.nan, math.nan, 0.0]),
    ("float8_e5m2fnuz", [61440.0, -math.inf], [math.nan, math.nan]),
    ("float8_e8m0fnu", [1.5, 3.0, 0.75, 1.4999, 0.0, 2.0 ** 127 * 1.5], [2.0, 4.0, 1.0, 1.0, 2.0 ** -127, math.nan]),
])
def test_torch_casts_follow_their_documented_conventions(name, xs, expected):
    got = torch.tensor(xs, dtype=torch.float32).to(getattr(torch, name)).to(torch.float64).numpy()
    assert bits_equal(got, np.array(expected, dtype=np.float64))
    assert bits_equal(np.array([round_value(x, name) for x in xs]), np.array(expected, dtype=np.float64))
    keep = [i for i, x in enumerate(xs) if signed_only(name, [x])]
    ours = er.asarray(np.array(xs, dtype=np.float32)[keep], name).astype(np.float64)
    assert bits_equal(ours, np.array(expected, dtype=np.float64)[keep])


def test_torch_e8m0_cast_differs_from_a_correct_rounding():
    # Findings about torch's cast to float8_e8m0fnu (exactref rounds correctly, as ml_dtypes does):
    # it ignores the sign, and a float32 subnormal just above 2**-127 goes to 2**-126.
    xs = [-2.0, -0.5, 1.25 * 2.0 ** -127]
    got = torch.tensor(xs, dtype=torch.float32).to(torch.float8_e8m0fnu).to(torch.float64).tolist()
    assert got == [2.0, 0.5, 2.0 ** -126]
    assert bits_equal(np.array([round_value(x, E8M0) for x in xs]), np.array([math.nan, math.nan, 2.0 ** -127]))
    assert float(er.asarray(np.array(xs[2:]), E8M0).astype(np.float64)[0]) == 2.0 ** -127
    assert float(np.array(xs[2:], dtype=np.float32).astype(ml_dtypes.float8_e8m0fnu).astype(np.float64)[0]) == \
        2.0 ** -127


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200)
@given(data=st.data())
def test_ml_dtypes_cast_is_the_nosat_rounding(name, data):
    # ml_dtypes overflows to inf or NaN (e4m3fn included), and (0.7) rounds float64 once, as it
    # does float32; for e8m0 it gives NaN for zero, where torch and exactref give 2**-127.
    x = data.draw(float64_values(name) | float32_values(name), label="x")
    if name == E8M0 and x == 0:
        return
    with np.errstate(over="ignore"):
        got = float(np.array([x]).astype(dtype(name)).astype(np.float64)[0])
    assert same(got, round_value(x, name, "nosat")), x
    if to_float32(x) == x or math.isnan(x):
        got32 = float(np.array([x], dtype=np.float32).astype(dtype(name)).astype(np.float64)[0])
        assert same(got32, round_value(x, name, "nosat")), x


@pytest.mark.parametrize("name, x, torch_value, correct", [
    # Just above a tie: float32 rounds it onto the tie, which then rounds to even.
    ("float8_e4m3fn", 1 + 2.0 ** -4 + 2.0 ** -30, 1.0, 1.125),
    ("float8_e5m2", 1 + 2.0 ** -3 + 2.0 ** -30, 1.0, 1.25),
    ("float8_e4m3fnuz", -(3 + 2.0 ** -3 + 2.0 ** -40), -3.0, -3.25),
    ("float8_e5m2fnuz", 2.0 ** -18 * (1 + 2.0 ** -35), 0.0, 2.0 ** -17),  # above half the smallest subnormal
])
def test_torch_cast_from_float64_rounds_twice_and_asarray_once(name, x, torch_value, correct):
    via_float32 = torch.tensor([x], dtype=torch.float64).to(getattr(torch, name)).to(torch.float64).item()
    assert via_float32 == torch_value != correct
    assert round_value(x, name) == correct
    assert float(er.asarray(np.array([x]), name).astype(np.float64)[0]) == correct
    assert float(er.asarray(torch.tensor([x], dtype=torch.float64), name).astype(np.float64)[0]) == correct


# --- torch float8 tensors read by er.asarray -----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_asarray_reads_torch_float8_tensors_bit_for_bit(name):
    t = torch.from_numpy(ALL_BYTES.copy()).view(getattr(torch, name))
    a = er.asarray(t)
    assert a.dtype == dtype(name)
    assert a.view(np.uint8).tolist() == ALL_BYTES.tolist()
    wide = er.asarray(t, "float32").astype(np.float64)
    assert bits_equal(wide, np.array([decode_float8(name, int(b)) for b in ALL_BYTES]))
    # A strided (non-contiguous) view is read too.
    assert er.asarray(t[::3]).view(np.uint8).tolist() == ALL_BYTES[::3].tolist()


@pytest.mark.parametrize("source, target", [("float8_e5m2", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
                                            ("float8_e5m2", "float8_e4m3fnuz"), ("float8_e4m3fnuz", "float8_e5m2fnuz")])
def test_asarray_converts_between_float8_formats(source, target):
    t = torch.from_numpy(ALL_BYTES.copy()).view(getattr(torch, source))
    for saturation in SATURATIONS:
        got = er.asarray(t, target, saturation=saturation).view(np.uint8).tolist()
        for b, g in zip(ALL_BYTES.tolist(), got):
            assert g in encode_float8(target, round_value(decode_float8(source, b), target, saturation)), (b, g)


def test_oracle_round_fraction_keeps_the_other_formats():
    # The float8 additions leave the IEEE formats alone: overflow to inf, -0 kept, no saturation by default.
    assert round_fraction((2 - TWO ** -24) * TWO ** 127, "float32") == math.inf
    assert round_fraction((2 - TWO ** -24) * TWO ** 127, "float32", saturation="satfinite") == float(
        np.finfo(np.float32).max)
    assert same(round_fraction(Fraction(0), "float16", negative_zero=True), -0.0)
    assert same(round_fraction(-TWO ** -30, "float16"), -0.0)
