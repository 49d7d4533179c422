"""The exact-arithmetic helpers the other tests trust."""

from fractions import Fraction

import numpy as np
import pytest

from exactref.formats import FORMATS
from strategies import OpCase

from ._exact import classify, exact_terms, floor_log2, product_terms, ulp

F32, F16 = FORMATS["float32"], FORMATS["float16"]
TWO = Fraction(2)


@pytest.mark.parametrize("v, e", [(Fraction(1), 0), (Fraction(3, 2), 0), (Fraction(1, 3), -2),
                                  (TWO ** 100 - 1, 99), (TWO ** -1074, -1074)])
def test_floor_log2(v, e):
    assert floor_log2(v) == e


def test_ulp_is_gradual_below_the_normal_range():
    assert ulp(F16, Fraction(1)) == TWO ** -10
    assert ulp(F16, TWO ** -20) == TWO ** -24


@pytest.mark.parametrize("v, terms, kinds", [
    (1 + TWO ** -24, [Fraction(1), TWO ** -24], {"tie"}),
    (1 + TWO ** -24 + TWO ** -60, [Fraction(1), TWO ** -24, TWO ** -60], {"near_tie"}),
    (1 + TWO ** -23, [Fraction(1), TWO ** -23], set()),
    (1 + TWO ** -25, [Fraction(1)], set()),  # a quarter ulp from the midpoint: not near
    (Fraction(0), [TWO ** 30, -TWO ** 30], {"cancellation"}),
    (TWO ** -20, [TWO ** 30, -TWO ** 30 + TWO ** -20], {"cancellation"}),
    (1 + TWO ** -24, [TWO ** 40, Fraction(1), TWO ** -24, -TWO ** 40], {"tie", "cancellation"}),
    (TWO ** 128, [TWO ** 128], set()),  # beyond float32's range: no rounding class
])
def test_classify(v, terms, kinds):
    assert classify(v, terms, F32) == kinds


def test_exact_terms_of_a_broadcast_1d_matmul_and_gemm():
    A = np.array([1.0, 2.0], np.float32)
    B = np.array([[[3.0], [4.0]], [[5.0], [6.0]]], np.float32)  # (2, 2, 1): batch of 2
    g = np.zeros((2, 1), np.float32)
    case = OpCase("matmul", {"A": A, "B": B}, {}, g)
    assert sum(exact_terms(case, (1, 0), None)) == 17
    C = np.array([0.5], np.float32)
    case = OpCase("gemm", {"A": A, "B": B, "C": C}, {"alpha": 2.0, "beta": -1.0}, g)
    assert sum(exact_terms(case, (0, 0), None)) == Fraction(43, 2)


def test_exact_terms_of_sum_and_complex_multiply():
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    case = OpCase("sum", {"x": x}, {"axis": -1, "keepdims": True}, np.zeros((2, 1)))
    assert sum(exact_terms(case, (1, 0), None)) == 12
    z = np.array([1 + 2j], np.complex64)
    case = OpCase("multiply", {"x": z, "y": z}, {}, z)
    assert sum(exact_terms(case, (0,), "real")) == -3 and sum(exact_terms(case, (0,), "imag")) == 4


def test_product_terms_expand_complex_factors():
    # i * (1 + 2i) * (3 + i) = i * (1 + 7i) = -7 + i
    assert sum(product_terms([1j, 1 + 2j, 3 + 1j], "real")) == -7
    assert sum(product_terms([1j, 1 + 2j, 3 + 1j], "imag")) == 1
    assert product_terms([2.0, 0.5], None) == [Fraction(1)]
