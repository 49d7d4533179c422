"""Planted failures shrink to the minimal example: small shapes, few specials, plain values."""

import math

import numpy as np
import pytest

import strategies as sx

from ._collect import minimal


def float_arrays(case):
    return {k: v for k, v in case.fields.items() if isinstance(v, np.ndarray) and v.dtype != np.bool_}


def nan_count(a):
    return int(np.isnan(np.asarray(a, dtype=np.complex128)).sum())


def plain_zero(v):
    z = complex(v)
    return z == 0 and math.copysign(1, z.real) > 0 and math.copysign(1, z.imag) > 0


def assert_single_nan_rest_plain(arrays):
    assert sum(nan_count(a) for a in arrays.values()) == 1
    for name, a in arrays.items():
        assert a.size == 1, f"{name} has shape {a.shape}; the minimal example has one element per array"
        flat = np.asarray(a, dtype=np.complex128).reshape(-1)
        for v in flat:
            assert np.isnan(v) or plain_zero(v), f"{name} holds {v}, not a plain +0"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_array_with_a_nan_shrinks_to_one_nan(dtype):
    a = minimal(sx.arrays(dtype=dtype, shape=sx.shapes()), lambda a: nan_count(a) > 0)
    assert a.shape == ()
    assert nan_count(a) == 1


def test_an_array_of_fixed_shape_keeps_one_nan_among_plain_zeros():
    a = minimal(sx.arrays(dtype="complex64", shape=(2, 3)), lambda a: nan_count(a) > 0)
    assert nan_count(a) == 1
    assert all(np.isnan(v) or plain_zero(v) for v in a.reshape(-1))


OPS = {
    "add": lambda: sx.add_inputs(dtypes=["float32"]),
    "sum": lambda: sx.sum_inputs(dtypes=["float32"]),
    "matmul": lambda: sx.matmul_inputs(dtypes=["float32"]),
    "gemm": lambda: sx.gemm_inputs(dtypes=["float32"]),
    "multiply (every dtype)": lambda: sx.multiply_inputs(),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_nan_anywhere_shrinks_to_the_smallest_shapes_and_one_nan(op):
    case = minimal(OPS[op](), lambda c: any(nan_count(a) for a in float_arrays(c).values()))
    assert_single_nan_rest_plain(float_arrays(case))
    assert case.hard == ()


def test_a_nan_in_an_input_shrinks_the_same_way():
    # Only A and B count: the NaN has to stay in an input, and grad becomes plain.
    case = minimal(sx.matmul_inputs(dtypes=["float32"]),
                   lambda c: nan_count(c.A) + nan_count(c.B) > 0)
    assert case.A.shape == (1, 1) and case.B.shape == (1, 1)
    assert_single_nan_rest_plain(float_arrays(case))


def test_matmul_with_k_at_least_3_shrinks_to_k_3_and_every_other_side_1():
    case = minimal(sx.matmul_inputs(), lambda c: c.A.ndim >= 1 and c.A.shape[-1] >= 3)
    assert case.A.shape == (1, 3)
    assert case.B.shape == (3, 1)
    assert case.grad.shape == (1, 1)
    for a in float_arrays(case).values():
        assert all(plain_zero(v) for v in a.reshape(-1))


def test_the_gradient_shrinks_too():
    case = minimal(sx.matmul_inputs(dtypes=["float64"]), lambda c: bool((c.grad != 0).any()))
    assert case.grad.tolist() == [[1.0]]
    assert case.A.tolist() == [[0.0]] and case.B.tolist() == [[0.0]]


def test_hard_cases_shrink_away_unless_needed():
    case = minimal(sx.sum_inputs(dtypes=["float32"]), lambda c: c.x.size >= 4)
    assert case.hard == ()
    case = minimal(sx.sum_inputs(dtypes=["float32"]), lambda c: len(c.hard) > 0)
    assert len(case.hard) == 1
    assert case.x.size == 2, "a hard sum needs two terms and no more"
