"""Fault injection for matmul and gemm: an empty inner dimension (K = 0) is an exact zero product."""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er

FORMATS = ["float64", "float32", "complex128"]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_matmul_with_k_zero_is_exact_zeros(dtype, batch):
    A, B = np.zeros(batch + (2, 0), dtype), np.zeros(batch + (0, 3), dtype)
    result = er.matmul(A, B)
    assert result.shape == batch + (2, 3) and result.dtype == np.dtype(dtype)
    # Exact zeros; a complex tolerance is the hypot of its parts' rounded up, one subnormal at most.
    assert not result.rounded.any() and (result.tolerance <= np.finfo(np.float64).smallest_subnormal).all()
    result.check(np.zeros(batch + (2, 3), dtype))
    with pytest.raises(er.errors.OutOfToleranceError):
        result.check(np.full(batch + (2, 3), np.finfo(dtype).tiny, dtype))


@pytest.mark.parametrize("dtype", FORMATS)
def test_gemm_with_k_zero_is_beta_times_c(dtype):
    C = np.arange(6, dtype=dtype).reshape(2, 3)
    result = er.gemm(np.zeros((2, 0), dtype), np.zeros((0, 3), dtype), C, alpha=2, beta=3)
    assert result.shape == (2, 3)
    np.testing.assert_array_equal(result.rounded, 3 * C)
    result.check(3 * C)


@pytest.mark.parametrize("dtype", FORMATS)
def test_matmul_and_gemm_backward_with_k_zero_give_empty_input_gradients(dtype):
    A, B = np.zeros((2, 0), dtype), np.zeros((0, 3), dtype)
    grad = np.ones((2, 3), dtype)
    g = er.matmul.backward(A, B, grad)
    assert g.rounded.grad_A.shape == (2, 0) and g.rounded.grad_B.shape == (0, 3)
    g.check(grad_A=np.zeros((2, 0), dtype), grad_B=np.zeros((0, 3), dtype))
    C = np.zeros((2, 3), dtype)
    g = er.gemm.backward(A, B, C, grad, alpha=2, beta=3)
    np.testing.assert_array_equal(g.rounded.grad_C, 3 * grad)
    g.check(grad_A=np.zeros((2, 0), dtype), grad_B=np.zeros((0, 3), dtype), grad_C=3 * grad)


def test_a_nonzero_product_beside_an_empty_one_is_still_judged():
    # K = 0 must not turn off the judging of an ordinary float64 product afterwards.
    A = np.array([[1.0, 2.0]])
    result = er.matmul(A, A.T)
    result.check(np.array([[5.0]]))
    with pytest.raises(er.errors.OutOfToleranceError):
        result.check(np.array([[5.0 + 2 ** -40]]))
