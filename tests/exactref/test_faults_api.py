"""Faults of the public API that the issue reported, each with the behaviour or message it must give."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import exactref as er

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------- 12: messages


def test_an_object_array_of_floats_is_read_as_floats():
    a = er.asarray(np.array([1.0, 2.0], dtype=object))
    assert a.dtype == np.float64 and a.tolist() == [1.0, 2.0]


def test_an_object_array_of_other_things_says_to_convert_it():
    with pytest.raises(TypeError, match=r"is an object array \(dtype=object\).*obj\.astype\(float\)"):
        er.asarray(np.array([1.0, "a"], dtype=object))


def test_integer_operands_point_to_er_asarray_not_a_dtype_keyword():
    with pytest.raises(TypeError) as info:
        er.matmul([[1]], [[2]])
    text = str(info.value)
    assert "er.asarray(A, 'float32')" in text and "dtype=" not in text, text


def test_a_python_int_too_large_for_float64_names_the_argument():
    with pytest.raises(OverflowError) as info:
        er.add(np.ones(2, np.float32), 10 ** 400)
    text = str(info.value)
    assert text.startswith("y=100000000000...(401 digits) does not fit in float64"), text


# ---------------------------------------------------------------- 13: sum over axis=()


def test_sum_over_no_axes_sums_every_axis_as_torch_does():
    x = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)
    expected = torch.sum(torch.from_numpy(x), dim=())
    res = er.sum(x, axis=())
    assert res.shape == tuple(expected.shape) == ()
    res.check(expected)
    kept = er.sum(x, axis=(), keepdims=True)
    assert kept.shape == tuple(torch.sum(torch.from_numpy(x), dim=(), keepdim=True).shape) == (1, 1, 1)
    grad = er.sum.backward(x, np.float32(1.0), axis=())
    assert grad.rounded.grad_x.shape == x.shape


# ---------------------------------------------------------------- 17: half attention under MATH


def test_a_half_attention_failing_under_math_names_flash_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).half() for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with pytest.raises(er.OutOfToleranceError) as info:
        er.scaled_dot_product_attention(q, k, v).check(out)
    assert "pass algorithm=er.AttentionAlgorithm.FLASH_ATTENTION" in str(info.value)
    er.scaled_dot_product_attention(q, k, v, algorithm=er.AttentionAlgorithm.FLASH_ATTENTION).check(out)


def test_a_half_attention_failing_under_flash_too_gets_no_hint():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 8, 4, generator=g).half() for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v) * 1.01
    with pytest.raises(er.OutOfToleranceError) as info:
        er.scaled_dot_product_attention(q, k, v).check(out)
    assert "FLASH_ATTENTION" not in str(info.value)


# ---------------------------------------------------------------- dtype mismatches (issue 13, item 4)


def test_check_refuses_an_array_of_another_dtype_and_names_numpys_promotion():
    x, y = np.ones(3, np.float16), np.array(np.float32(2))
    got = x + y  # numpy 2: float32; torch would keep float16
    assert got.dtype == np.float32
    result = er.add(x, y)
    assert result.dtype == np.float16
    with pytest.warns(er.DtypeMismatchWarning, match="numpy 2 promotes a float16 array with a float32 0-d array"):
        assert result.covers(got).all()  # covers() judges the values, and says the dtype differs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the result's own dtype, or a list: nothing to say
        assert result.covers(got.astype(np.float16)).all() and result.covers([3.0, 3.0, 3.0]).all()
        # float64 (and complex128) carry any format's values exactly: an oracle's values, say.
        assert result.covers(got.astype(np.float64)).all()
        assert result.covers(torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)).all()
    with pytest.warns(er.DtypeMismatchWarning, match="multiply: got bfloat16 values for a float32 result"):
        er.multiply(np.float32([1.5]), np.float32([2.0])).covers(torch.tensor([3.0], dtype=torch.bfloat16))
    with pytest.raises(er.ShapeMismatchError) as info:
        result.check(got)
    text = str(info.value)
    assert text.startswith("add: got float32 values for a float16 result"), text
    assert "numpy 2 promotes a float16 array with a float32 0-d array to float32" in text, text
    result.check(got.astype(np.float16))
    result.check([3.0, 3.0, 3.0])  # a list has no dtype to compare


def test_check_names_a_torch_tensor_of_another_dtype():
    result = er.multiply(np.float32([1.5]), np.float32([2.0]))
    with pytest.raises(er.ShapeMismatchError, match="multiply: got float64 values for a float32 result"):
        result.check(torch.tensor([3.0], dtype=torch.float64))


def test_promotion_numpy_follows_numpys_rules_forward_and_backward():
    x, y = np.ones(3, np.float16), np.array(np.float32(2))
    for op, numpy_op in ((er.add, np.add), (er.multiply, np.multiply)):
        assert op(x, y).dtype == np.float16  # torch: the 0-d array does not widen the array
        judged = op(x, y, promotion="numpy")
        assert judged.dtype == np.result_type(x, y) == np.float32
        judged.check(numpy_op(x, y))
        grads = op.backward(x, y, np.ones(3, np.float32), promotion="numpy")
        assert grads["grad_x"].dtype == np.float16 and grads["grad_y"].dtype == np.float32
    # Python scalars stay weak in numpy 2 as in torch.
    assert er.add(x, 2.5, promotion="numpy").dtype == np.float16


def test_an_unknown_promotion_names_the_argument():
    with pytest.raises(ValueError, match=r"add: promotion='jax' must be 'torch' .* or 'numpy'"):
        er.add(np.ones(2, np.float32), np.ones(2, np.float32), promotion="jax")
