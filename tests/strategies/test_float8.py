"""float8 in the strategies: asked for by name only, exact values, their special classes, and cast_values.

Expected classes and values come from the oracle's plain numbers per format
(tests/exactref/oracle.py: p, emin, emax, the largest finite value, the
bytes), not from exactref's Format objects.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import exactref as er
import strategies as sx
from exactref.formats import FORMATS

from ..exactref.oracle import ENCODINGS, decode_float8, encoding, floor_log2, round_value
from ..exactref.oracle import FORMATS as ORACLE_FORMATS
from ._collect import each, minimal

SIGNED = [n for n in ENCODINGS if not ENCODINGS[n].unsigned]
E8M0 = "float8_e8m0fnu"
OLD_DEFAULT = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128")
TWO = Fraction(2)


# --- asked for by name only -------------------------------------------------------------------

def drawn_names(strategy, draws=300):
    seen = set()
    each(strategy, draws, lambda f: seen.add(f.name))
    return seen


def test_formats_default_is_unchanged_and_has_no_float8():
    assert drawn_names(sx.formats()) == set(OLD_DEFAULT)
    assert drawn_names(sx.formats(allow_complex=False)) == set(OLD_DEFAULT[:4])


def test_formats_draws_float8_when_named():
    assert sx.FLOAT8 == tuple(ENCODINGS)
    assert drawn_names(sx.formats(dtypes=sx.FLOAT8)) == set(ENCODINGS)
    assert drawn_names(sx.formats(dtypes="float8_e4m3fn", allow_complex=False)) == {"float8_e4m3fn"}
    assert drawn_names(sx.formats(dtypes=[torch.float8_e5m2, "float32"])) == {"float8_e5m2", "float32"}
    assert minimal(sx.formats(dtypes=["float8_e5m2fnuz", "float8_e4m3fn"]), lambda f: True).name == "float8_e5m2fnuz"


@pytest.mark.parametrize("factory", [sx.add_inputs, sx.multiply_inputs, sx.sum_inputs, sx.gemm_inputs,
                                     sx.matrix_exp_inputs, sx.scaled_dot_product_attention_inputs])
def test_op_strategies_draw_no_float8_by_default_and_refuse_it(factory):
    def check(case):
        for v in case.fields.values():
            if isinstance(v, np.ndarray):
                assert v.dtype.name not in ENCODINGS, (factory.__name__, v.dtype)
    each(factory(), 30, check)
    with pytest.raises(ValueError, match=r"dtypes contains 'float8_e4m3fn', which .*does not accept"):
        factory(dtypes=["float32", "float8_e4m3fn"])


# --- values of the format ---------------------------------------------------------------------

@functools.cache
def all_values(name):
    """Every finite value of the format, from the oracle's byte decoding, increasing, +0 once."""
    vals = {decode_float8(name, b) for b in range(256)}
    return tuple(sorted(v for v in vals if math.isfinite(v) and not (v == 0 and math.copysign(1, v) < 0)))


@functools.cache
def positive_values(name):
    return [x for x in all_values(name) if x > 0]


def independent_class(v, name):
    """The special class of a value, read off the sorted list of the format's values."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "infinity"
    if v == 0:
        return "signed_zero" if math.copysign(1, v) < 0 else None
    _, emin, emax = ORACLE_FORMATS[name]
    positive = positive_values(name)
    a = abs(v)
    named = {"min_subnormal": positive[0], "max_subnormal": max(x for x in positive if x < 2.0 ** emin),
             "min_normal": 2.0 ** emin, "max_finite": float(ENCODINGS[name].max_finite)}
    for cls, value in named.items():
        if a == value:
            return cls
    if a >= 2.0 ** emax:
        return "overflow"

    def power(x):
        return math.frexp(x)[0] == 0.5
    if power(a):
        return "power_of_two"
    i = positive.index(a)
    if power(positive[i - 1]) or (i + 1 < len(positive) and power(positive[i + 1])):
        return "near_power_of_two"
    return None


def expected_classes(name):
    enc = ENCODINGS[name]
    absent = set() if enc.has_inf else {"infinity"}
    absent |= set() if enc.has_negative_zero else {"signed_zero"}
    return set(sx.SPECIAL_CLASSES) - absent


def stored_exactly(v, name):
    back = float(np.array([v]).astype(getattr(ml_dtypes, name)).astype(np.float64)[0])
    return (math.isnan(v) and math.isnan(back)) or (back == v and math.copysign(1, back) == math.copysign(1, v))


@pytest.mark.parametrize("name", SIGNED)
def test_every_class_the_format_has_appears_and_no_other(name):
    seen = set()
    want = expected_classes(name)

    def check(a):
        assert a.dtype.name == name and a.shape == (4, 4)
        seen.update(c for c in (independent_class(v, name) for v in a.astype(np.float64).ravel().tolist()) if c)
        assert seen <= want, seen - want
        return seen == want

    n = each(sx.arrays(dtype=name, shape=(4, 4)), 1000, check)
    assert seen == want, f"{name}: missing {sorted(want - seen)} after {n} arrays"


@pytest.mark.parametrize("name", SIGNED)
def test_elements_are_exact_and_special_class_agrees(name):
    def check(v):
        assert isinstance(v, float) and stored_exactly(v, name), v
        assert sx.special_class(v, dtype=name) == independent_class(v, name), v
    each(sx.elements(dtype=name), 300, check)
    for v in all_values(name) + tuple(-v for v in all_values(name)):
        if name in ("float8_e4m3fnuz", "float8_e5m2fnuz") and v == 0:
            continue
        assert sx.special_class(v, dtype=name) == independent_class(v, name), v


@pytest.mark.parametrize("name", SIGNED)
def test_plain_values_are_normal_or_zero_bounded_and_cover_the_binades(name):
    emin = ORACLE_FORMATS[name][1]
    binades = set()

    def check(a):
        for v in a.astype(np.float64).ravel().tolist():
            assert (v == 0 and math.copysign(1, v) > 0) or 2.0 ** emin <= abs(v) <= 20, v
            if v:
                binades.add(math.frexp(abs(v))[1] - 1)
    each(sx.arrays(dtype=name, shape=(3, 3), specials=False, max_abs=20.0), 200, check)
    assert len(binades) >= min(5, 4 - emin), binades


@pytest.mark.parametrize("name, classes, expected", [
    ("float8_e4m3fn", ["max_finite"], {448.0, -448.0}),
    ("float8_e4m3fn", ["min_subnormal"], {2.0 ** -9, -(2.0 ** -9)}),
    ("float8_e4m3fn", ["overflow"], {s * v for s in (1, -1) for v in (256, 288, 320, 352, 384, 416, 448)}),
    ("float8_e5m2", ["infinity"], {math.inf, -math.inf}),
    ("float8_e5m2", ["max_finite", "min_normal"], {57344.0, -57344.0, 2.0 ** -14, -(2.0 ** -14)}),
    ("float8_e4m3fnuz", ["max_finite", "max_subnormal"], {240.0, -240.0, 7 * 2.0 ** -10, -7 * 2.0 ** -10}),
    ("float8_e5m2fnuz", ["min_subnormal", "min_normal"], {2.0 ** -17, -(2.0 ** -17), 2.0 ** -15, -(2.0 ** -15)}),
])
def test_special_values_are_the_spec_constants(name, classes, expected):
    seen = set()
    each(sx.special_values(dtype=name, classes=classes), 200, lambda v: seen.add(v) or seen == expected)
    assert seen == expected


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_a_format_without_infinity_or_negative_zero_never_draws_them(name):
    # Switching only absent classes on leaves NaN alone (fnuz: no -0; fn and fnuz: no inf).
    enc = ENCODINGS[name]
    classes = ["nan", "infinity"] + ([] if enc.has_negative_zero else ["signed_zero"])

    def check(v):
        assert math.isnan(v), v
    each(sx.special_values(dtype=name, classes=classes), 50, check)


def test_torch_tensors_of_float8_arrays():
    def check(t):
        assert t.dtype == torch.float8_e4m3fn and t.shape == (2, 3)
    each(sx.arrays(dtype="float8_e4m3fn", shape=(2, 3), device="cpu"), 10, check)


@pytest.mark.parametrize("function", [sx.elements, sx.special_values, sx.special_class])
def test_e8m0_has_no_element_strategy(function):
    args = (1.0,) if function is sx.special_class else ()
    with pytest.raises(ValueError, match="dtype='float8_e8m0fnu' holds only the powers of two"):
        function(*args, dtype=E8M0)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        sx.arrays(dtype=E8M0, shape=(2,))


# --- cast_values ------------------------------------------------------------------------------

def grid(name):
    """(p, emin, largest finite, spacing function) of a format, from the oracle's numbers."""
    p, emin, _ = ORACLE_FORMATS[name]
    largest = encoding(name).max_finite

    def spacing(a):
        e = max(floor_log2(a), emin) if a else emin
        return TWO ** (e - p + 1)
    return p, emin, largest, spacing


def cast_class(v, name):
    """The cast_values class of v for target ``name``, computed exactly."""
    if math.isnan(v) or math.isinf(v) or v == 0:
        return "special"
    _, _, largest, spacing = grid(name)
    a = Fraction(abs(v))
    top = spacing(largest)
    threshold = largest + top / 2
    if abs(a - threshold) <= top / 4:
        return "threshold"
    if a > threshold:
        return "beyond"
    q = spacing(a)
    r = a / q
    if r.denominator == 1:
        return "exact"
    offset = abs(r - (math.floor(r) + Fraction(1, 2)))
    if offset == 0:
        return "tie"
    return "near_tie" if offset <= Fraction(1, 4) else None


def in_source(v, source):
    back = float(np.array([v]).astype(FORMATS[source].dtype).astype(np.float64)[0])
    return (math.isnan(v) and math.isnan(back)) or (back == v and math.copysign(1, back) == math.copysign(1, v))


@pytest.mark.parametrize("name, source", [(n, "float32") for n in SIGNED] + [
    ("float8_e4m3fn", "float64"), ("float8_e5m2", "float16"), ("float8_e4m3fn", "bfloat16"),
    ("float16", "float32"), ("bfloat16", "float32"), ("float32", "float64")])
def test_cast_values_are_exact_in_the_source_and_in_their_class(name, source):
    for cls in sx.CAST_CLASSES:
        signs = set()

        def check(v, cls=cls, signs=signs):
            assert isinstance(v, float) and in_source(v, source), (v, source)
            assert cast_class(v, name) == cls, (v, cls)
            signs.add(math.copysign(1, v))
        each(sx.cast_values(dtype=name, source=source, classes=[cls]), 60, check)
        assert signs == {1, -1}, cls
    seen = set()
    each(sx.cast_values(dtype=name, source=source), 300,
         lambda v: seen.add(cast_class(v, name)) or seen == set(sx.CAST_CLASSES))
    assert seen == set(sx.CAST_CLASSES)


@pytest.mark.parametrize("name", SIGNED)
def test_cast_values_reach_every_kind_of_tie(name):
    # The tie to zero (half the smallest subnormal), one between subnormals, the one below the smallest
    # normal and the top one (below the largest finite value) all come up, with both signs.
    _, emin, largest, spacing = grid(name)
    tiny = spacing(Fraction(0))
    wanted = {float(tiny / 2), float(tiny * 3 / 2), float(TWO ** emin - tiny / 2),
              float(largest - spacing(largest) / 2)}
    wanted |= {-v for v in wanted}
    seen = set()
    each(sx.cast_values(dtype=name, classes=["tie"]), 1000, lambda v: seen.add(v) or wanted <= seen)
    assert wanted <= seen, sorted(wanted - seen)


def test_cast_values_find_the_double_rounding_of_torchs_cast_from_float64():
    # A near tie whose offset float32 cannot hold: torch rounds it onto the tie, exactref does not.
    found = []

    def check(v):
        torch_value = torch.tensor([v], dtype=torch.float64).to(torch.float8_e4m3fn).to(torch.float64).item()
        ours = float(er.asarray(np.array([v]), "float8_e4m3fn").astype(np.float64)[0])
        assert ours == round_value(v, "float8_e4m3fn")
        if torch_value != ours:
            found.append(v)
            return True
    each(sx.cast_values(dtype="float8_e4m3fn", source="float64", classes=["near_tie"]), 300, check)
    assert found


def test_cast_values_near_ties_shrink_to_one_source_ulp():
    v = minimal(sx.cast_values(dtype="float8_e4m3fn", classes=["near_tie"]), lambda v: 1 < v < 1.1)
    assert v == 1.0625 + 2.0 ** -23
    assert minimal(sx.cast_values(dtype="float8_e4m3fn", classes=["threshold"]), lambda v: v > 0) == 464.0
