"""Element values: exact in their format, special classes switchable, each class found in bounded draws."""

import math
from fractions import Fraction

import numpy as np
import pytest

import strategies as sx
from exactref.formats import FORMATS, part_of
from strategies._validation import OP_FORMATS

from ._collect import each

# The formats a default list holds; the float8 ones have tests of their own in test_float8.py.
FORMAT_LIST = [FORMATS[n] for n in OP_FORMATS]


def independent_class(v, fmt):
    """The special class of a real value, from the format's p, emin and emax alone."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "infinity"
    if v == 0:
        return "signed_zero" if math.copysign(1, v) < 0 else None
    a = Fraction(abs(v))
    two = Fraction(2)
    tiny = two ** (fmt.emin - fmt.p + 1)
    named = {
        "min_subnormal": tiny,
        "max_subnormal": two ** fmt.emin - tiny,
        "min_normal": two ** fmt.emin,
        "max_finite": (two ** fmt.p - 1) * two ** (fmt.emax - fmt.p + 1),
    }
    for name, value in named.items():
        if a == value:
            return name
    if a >= two ** fmt.emax:
        return "overflow"
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e = e - 1 if two ** e > a else e
    if a == two ** e:
        return "power_of_two"
    spacing = two ** (max(e, fmt.emin) - fmt.p + 1)
    if a == two ** e + spacing or a == two ** (e + 1) - two ** (max(e, fmt.emin) - fmt.p + 1):
        return "near_power_of_two"
    return None


def parts(v, fmt):
    return [v.real, v.imag] if fmt.is_complex else [v]


def stored_exactly(v, fmt):
    back = np.array(v, dtype=fmt.dtype).astype(np.complex128 if fmt.is_complex else np.float64)
    return all(np.isnan(x) and np.isnan(y) or x == y
               for x, y in zip(parts(complex(back) if fmt.is_complex else float(back), fmt), parts(v, fmt)))


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=str)
def test_every_special_class_appears_in_bounded_draws(fmt):
    seen = set()
    want = set(sx.SPECIAL_CLASSES)

    def check(a):
        for v in a.reshape(-1).tolist():
            seen.update(c for c in map(lambda x: independent_class(x, part_of(fmt)), parts(v, fmt)) if c)
        return seen == want

    n = each(sx.arrays(dtype=fmt.name, shape=(4, 4)), 1000, check)
    assert seen == want, f"{fmt}: missing {sorted(want - seen)} after {n} arrays"


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=str)
def test_values_are_exact_and_agree_with_special_class(fmt):
    def check(v):
        assert stored_exactly(v, fmt), v
        for x in parts(v, fmt):
            assert sx.special_class(x, dtype=fmt.name) == independent_class(x, part_of(fmt)), x
    each(sx.elements(dtype=fmt.name), 300, check)


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=str)
def test_specials_off_draws_plain_values_only(fmt):
    def check(a):
        for v in a.reshape(-1).tolist():
            for x in parts(v, fmt):
                assert independent_class(x, part_of(fmt)) in (None, "power_of_two", "near_power_of_two",
                                                              "min_normal", "max_finite", "overflow"), x
                assert math.isfinite(x) and (x == 0 or abs(x) >= part_of(fmt).min_normal)
                assert math.copysign(1, x) > 0 or x != 0
    each(sx.arrays(dtype=fmt.name, shape=(3, 3), specials=False), 100, check)


def test_only_switched_on_classes_appear():
    seen = set()

    def check(a):
        seen.update(independent_class(v, FORMATS["float16"]) for v in a.reshape(-1).tolist())
    each(sx.arrays(dtype="float16", shape=(8,), specials=["nan", "min_subnormal"], max_abs=1.0), 200, check)
    # Plain values may happen to be a power of two (1.0 or the smallest normal) or the
    # neighbour of one; no other class appears.
    assert {"nan", "min_subnormal"} <= seen
    assert seen <= {None, "nan", "min_subnormal", "power_of_two", "near_power_of_two", "min_normal"}


def test_max_abs_bounds_plain_values_and_is_rounded_down_to_the_format():
    def check(v):
        assert abs(v) <= 0.1
    each(sx.elements(dtype="float16", specials=False, max_abs=0.1), 200, check)


def test_special_values_only():
    def check(v):
        assert sx.special_class(v, dtype="bfloat16") in ("infinity", "max_finite")
    each(sx.special_values(dtype="bfloat16", classes=["infinity", "max_finite"]), 50, check)


def test_complex_special_values_keep_one_part_plain():
    def check(z):
        classes = [sx.special_class(z.real, dtype="complex64"), sx.special_class(z.imag, dtype="complex64")]
        assert "nan" in classes
    each(sx.special_values(dtype="complex64", classes=["nan"]), 50, check)


def test_arrays_give_torch_tensors_on_request():
    torch = pytest.importorskip("torch")

    def check(t):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.shape == (2, 3)
        assert t.device.type == "cpu"
    each(sx.arrays(dtype="bfloat16", shape=(2, 3), device="cpu"), 20, check)


def test_arrays_take_a_strategy_of_shapes():
    def check(a):
        assert a.dtype == np.float32 and a.ndim <= 2
    each(sx.arrays(dtype="float32", shape=sx.shapes(max_dims=2)), 30, check)
