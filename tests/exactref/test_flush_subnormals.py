"""``ErrorModel(flush_subnormals=True)`` against exact emulations of flush-to-zero kernels.

The emulations flush every input and every intermediate result below the
format's smallest normal to a zero of its sign (DAZ and FTZ), with numpy's
correctly rounded float32 operations in between: they are written here,
independently of exactref.  Each must be covered under the model; the
adversarial cases are chosen so that the default model rejects them, and so
that dropping a term of the derivation (the widening for flushed partial
results) rejects one of them too.
"""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er
import exactref.ops._flush as flush_module

FTZ = er.models.DEFAULT.replace(name="ftz", flush_subnormals=True)
# The values meet 2**100 * 2**100 on purpose: an overflow to inf is an answer like any other here.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
TINY = np.finfo(np.float32).tiny  # 2**-126


def ftz(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def ftz_multiply(x, y):
    return ftz(ftz(x) * ftz(y))


def ftz_add(x, y):
    return ftz(ftz(x) + ftz(y))


def ftz_matmul(A, B):
    """A sequential float32 dot product per element, each product and partial sum flushed."""
    A, B = ftz(A), ftz(B)
    out = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for k in range(A.shape[1]):
        out = ftz(out + ftz(A[:, k:k + 1] * B[k:k + 1, :]))
    return out


def ftz_sum(x):
    total = np.float32(0)
    for v in ftz(x).ravel():
        total = ftz(total + v)
    return np.asarray(total, np.float32)


VALUES = np.float32([2.0 ** 100, 1.0, -3.0, 2.0 ** -10, 2.0 ** -126, -2.0 ** -126, 2.0 ** -127, 2.0 ** -149,
                     -2.0 ** -130, 1.5 * 2.0 ** -126, 0.0])


def test_elementwise_flush_to_zero_kernels_are_covered_and_need_the_model():
    x, y = np.meshgrid(VALUES, VALUES)
    for op, kernel in ((er.multiply, ftz_multiply), (er.add, ftz_add)):
        got = kernel(x, y)
        assert op(x, y, model=FTZ).covers(got).all(), op
        # 2**100 * 2**-127 is 2**-27 exactly; flushing the input gives 0.
        assert not op(x, y).covers(got).all(), op


def test_a_kernel_that_does_not_flush_is_covered_too():
    x, y = np.meshgrid(VALUES, VALUES)
    assert er.multiply(x, y, model=FTZ).covers(x * y).all()
    A = np.float32([[1.0, 2.0 ** -127, 3.0]])
    B = np.float32([[2.0 ** -130], [2.0 ** 120], [1.0]])
    assert er.matmul(A, B, model=FTZ).covers(A @ B).all()


def _accumulating_case(n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    # The smallest normal plus n products of 2**-140 each: the exact sum is normal, 2**-126 (1 + n 2**-14),
    # but a flushing kernel drops every product (each is subnormal) and returns 2**-126.
    A = np.concatenate([np.float32([1.0]), np.full(n, 2.0 ** -70, np.float32)])[None, :]
    B = np.concatenate([np.float32([TINY]), np.full(n, 2.0 ** -70, np.float32)])[:, None]
    return A, B


def test_flushed_partial_products_are_budgeted():
    A, B = _accumulating_case()
    got = ftz_matmul(A, B)
    assert got[0, 0] == TINY
    assert er.matmul(A, B, model=FTZ).covers(got).all()
    assert not er.matmul(A, B).covers(got).all()


def test_dropping_the_widening_for_flushed_partials_rejects_a_flushing_kernel(monkeypatch):
    # The mutation: no (2n + 4) m widening, only the union with the flushed inputs.
    monkeypatch.setattr(flush_module, "_widening", lambda values: 0.0)
    A, B = _accumulating_case()
    assert not er.matmul(A, B, model=FTZ).covers(ftz_matmul(A, B)).all()


def test_a_flushing_sum_is_covered():
    # Exactly 2**-126 (1 + 1/2 + 1/16): normal; a flushing kernel drops the subnormal terms.
    x = np.concatenate([np.float32([TINY, 2.0 ** -127]), np.full(64, 2.0 ** -136, np.float32)])
    got = ftz_sum(x)
    assert got == TINY
    assert er.sum(x, model=FTZ).covers(got).all()
    assert not er.sum(x).covers(got).all()


def test_flushing_gradients_are_covered():
    A = np.float32([[2.0 ** 100, 2.0 ** -127]])
    B = np.float32([[2.0 ** -127], [1.0]])
    G = np.float32([[1.0]])
    grads = er.matmul.backward(A, B, G, model=FTZ)
    grad_A = ftz_matmul(G, B.T)
    grad_B = ftz_matmul(A.T, G)
    assert grads["grad_A"].covers(grad_A).all() and grads["grad_B"].covers(grad_B).all()
    # The forward Result's own backward flushes too.
    again = er.matmul(A, B, model=FTZ).backward(G)
    assert again["grad_A"].covers(grad_A).all() and again["grad_B"].covers(grad_B).all()
    assert not er.matmul.backward(A, B, G)["grad_A"].covers(grad_A).all()


def test_a_wrong_kernel_is_still_caught_under_the_model():
    x, y = np.meshgrid(VALUES[:4], VALUES[:4])
    wrong = ftz_multiply(x, y) * np.float32(1 + 2.0 ** -10)
    assert not er.multiply(x, y, model=FTZ).covers(wrong).all()


def test_the_model_says_it_flushes_and_checks_its_argument():
    assert str(FTZ) == "ftz (flush_subnormals)"
    with pytest.raises(TypeError, match=r"flush_subnormals='yes' must be True or False"):
        er.models.ErrorModel(flush_subnormals="yes")


def test_xla_on_the_cpu_is_covered_under_the_model():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    x, y = np.meshgrid(VALUES, VALUES)
    got = np.asarray(jax.jit(jnp.multiply)(x, y))
    if np.array_equal(got, x * y):
        pytest.skip("this XLA build does not flush subnormals")
    assert er.multiply(x, y, model=FTZ).covers(got).all()
    assert not er.multiply(x, y).covers(got).all()
