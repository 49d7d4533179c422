"""`rounded` agrees bit for bit with the independent Fraction oracle, forward and every gradient.

Inputs come from pools of hard values (ties, near-ties, cancellation,
subnormal results, overflow) in every format, with 1-D and broadcast
operands.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er

from . import oracle
from .gen import COMPLEX, PART, REAL, array

EXAMPLES = settings(max_examples=150)
MATMUL_SIG = "(m?,n),(n,p?)->(m?,p?)"


def _f(x):
    return np.asarray(x, dtype=np.float64)


@st.composite
def matmul_case(draw, fmt):
    shapes = draw(hnp.mutually_broadcastable_shapes(signature=MATMUL_SIG, max_dims=3, max_side=4))
    a_shape, b_shape = shapes.input_shapes
    A = draw(array(fmt, a_shape))
    B = draw(array(fmt, b_shape))
    G = draw(array(fmt, shapes.result_shape))
    return A, B, G


def _grads_real(A, B, G, fmt, alpha=1.0):
    """Oracle grad_A = alpha * G @ B^T and grad_B = alpha * A^T @ G, summed over broadcast copies."""
    a2, b2, batch = oracle.matmul_shapes(A.shape, B.shape)
    M, K, N = a2[-2], a2[-1], b2[-1]
    G2 = np.broadcast_to(G.reshape(batch + (M, N)), batch + (M, N))
    A2 = np.broadcast_to(A.reshape(a2), batch + (M, K))
    B2 = np.broadcast_to(B.reshape(b2), batch + (K, N))

    def ga(s, idx):
        *b, i, k = idx
        for n in range(N):
            s.add(alpha, G2[tuple(b) + (i, n)], B2[tuple(b) + (k, n)])

    def gb(s, idx):
        *b, k, n = idx
        for i in range(M):
            s.add(alpha, A2[tuple(b) + (i, k)], G2[tuple(b) + (i, n)])

    gA = oracle.reduce_to(ga, batch + (M, K), a2, fmt).reshape(A.shape)
    gB = oracle.reduce_to(gb, batch + (K, N), b2, fmt).reshape(B.shape)
    return gA, gB


@pytest.mark.parametrize("fmt", REAL)
@EXAMPLES
@given(data=st.data())
def test_matmul_forward_and_backward_match_oracle(fmt, data):
    A, B, G = data.draw(matmul_case(fmt))
    res = er.matmul(A, B)
    assert oracle.bits_equal(res.rounded, oracle.matmul(_f(A), _f(B), fmt))
    g = res.backward(G)
    gA, gB = _grads_real(_f(A), _f(B), _f(G), fmt)
    assert oracle.bits_equal(g.rounded.grad_A, gA)
    assert oracle.bits_equal(g.rounded.grad_B, gB)


@pytest.mark.parametrize("fmt", COMPLEX)
# Fewer examples than the real formats' 150: four real sums per element, each through the exact
# path on these hard values, made this the suite's slowest test (30 s for complex128 alone).
@settings(max_examples=75)
@given(data=st.data())
def test_complex_matmul_forward_and_backward_match_oracle(fmt, data):
    A, B, G = data.draw(matmul_case(fmt))
    Ac, Bc, Gc = (np.asarray(v, dtype=np.complex128) for v in (A, B, G))
    res = er.matmul(A, B)
    expected = oracle.complex_matmul(Ac, Bc, fmt)
    assert oracle.bits_equal(res.rounded.real, expected.real)
    assert oracle.bits_equal(res.rounded.imag, expected.imag)
    g = res.backward(G)
    # grad_A = G @ B^H and grad_B = A^H @ G, the same complex oracle on conjugated, transposed inputs.
    swap = (lambda x: np.swapaxes(x, -1, -2)) if B.ndim > 1 else (lambda x: x)
    if A.ndim > 1 and B.ndim > 1 and G.ndim >= 2 and A.shape[:-2] == B.shape[:-2] == G.shape[:-2]:
        gA = oracle.complex_matmul(Gc, np.conj(swap(Bc)), fmt)
        assert oracle.bits_equal(g.rounded.grad_A.real, gA.real)
        assert oracle.bits_equal(g.rounded.grad_A.imag, gA.imag)
        gB = oracle.complex_matmul(np.conj(np.swapaxes(Ac, -1, -2)), Gc, fmt)
        assert oracle.bits_equal(g.rounded.grad_B.real, gB.real)
        assert oracle.bits_equal(g.rounded.grad_B.imag, gB.imag)


@pytest.mark.parametrize("fmt", REAL)
@EXAMPLES
@given(data=st.data(), alpha=st.sampled_from([1.0, -1.0, 0.0, 2.0, 0.1, 1 / 3, -1.5]),
       beta=st.sampled_from([1.0, 0.0, -1.0, 0.5, 0.3]))
def test_gemm_forward_and_backward_match_oracle(fmt, data, alpha, beta):
    A, B, G = data.draw(matmul_case(fmt))
    c_shape = data.draw(shape_to(G.shape))
    C = data.draw(array(fmt, c_shape))
    res = er.gemm(A, B, C, alpha=alpha, beta=beta)
    assert oracle.bits_equal(res.rounded, oracle.matmul(_f(A), _f(B), fmt, alpha, _f(C), beta))
    g = res.backward(G)
    gA, gB = _grads_real(_f(A), _f(B), _f(G), fmt, alpha)
    assert oracle.bits_equal(g.rounded.grad_A, gA)
    assert oracle.bits_equal(g.rounded.grad_B, gB)
    Gf = _f(G)
    gC = oracle.reduce_to(lambda s, idx: s.add(beta, Gf[idx]), G.shape, C.shape, fmt)
    assert oracle.bits_equal(g.rounded.grad_C, gC)


@st.composite
def shape_to(draw, shape):
    """A shape that broadcasts to ``shape``: a suffix of it with some sides set to 1."""
    k = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - k:]
    return tuple(draw(st.sampled_from([n, 1])) for n in tail)


@st.composite
def binary_case(draw, fmt, scalars=True):
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3))
    x = draw(array(fmt, shapes.input_shapes[0]))
    y = draw(array(fmt, shapes.input_shapes[1]))
    if scalars and draw(st.booleans()) and fmt in REAL:
        y = draw(st.sampled_from([0.5, -2.0, 0.1, 3.0, 1e-3]))
    G = draw(array(fmt, np.broadcast_shapes(np.shape(x), np.shape(y))))
    return x, y, G


@pytest.mark.parametrize("fmt", REAL)
@EXAMPLES
@given(data=st.data(), alpha=st.sampled_from([1.0, -1.0, 2.0, 0.1, 0.0, 1 / 3]))
def test_add_forward_and_backward_match_oracle(fmt, data, alpha):
    x, y, G = data.draw(binary_case(fmt))
    res = er.add(x, y, alpha=alpha)
    assert oracle.bits_equal(res.rounded, oracle.elementwise(lambda s, a, b: (s.add(a), s.add(alpha, b)),
                                                                _f(x), _f(y), fmt))
    g = res.backward(G)
    Gf = _f(G)
    assert oracle.bits_equal(g.rounded.grad_x, oracle.reduce_to(lambda s, i: s.add(Gf[i]), G.shape, x.shape, fmt))
    if isinstance(y, float):
        with pytest.raises(KeyError, match="Python scalar"):
            g["grad_y"]
    else:
        expected = oracle.reduce_to(lambda s, i: s.add(alpha, Gf[i]), G.shape, y.shape, fmt)
        assert oracle.bits_equal(g.rounded.grad_y, expected)


@pytest.mark.parametrize("fmt", REAL)
@EXAMPLES
@given(data=st.data())
def test_multiply_forward_and_backward_match_oracle(fmt, data):
    x, y, G = data.draw(binary_case(fmt))
    res = er.multiply(x, y)
    assert oracle.bits_equal(res.rounded, oracle.elementwise(lambda s, a, b: s.add(a, b), _f(x), _f(y), fmt))
    g = res.backward(G)
    shape = G.shape
    Gf, X, Y = _f(G), np.broadcast_to(_f(x), shape), np.broadcast_to(_f(y), shape)
    assert oracle.bits_equal(g.rounded.grad_x,
                             oracle.reduce_to(lambda s, i: s.add(Gf[i], Y[i]), shape, np.shape(x), fmt))
    if not isinstance(y, float):
        assert oracle.bits_equal(g.rounded.grad_y,
                                 oracle.reduce_to(lambda s, i: s.add(Gf[i], X[i]), shape, np.shape(y), fmt))


@pytest.mark.parametrize("fmt", COMPLEX)
@EXAMPLES
@given(data=st.data())
def test_complex_multiply_and_add_match_oracle(fmt, data):
    x, y, G = data.draw(binary_case(fmt, scalars=False))
    part = PART[fmt]
    X, Y = (np.asarray(v, dtype=np.complex128) for v in (x, y))

    def mul(part_index):
        def fn(s, a, b):
            if part_index == 0:
                s.add(a.real, b.real), s.add(-a.imag, b.imag)
            else:
                s.add(a.real, b.imag), s.add(a.imag, b.real)
        return fn

    res = er.multiply(x, y)
    assert oracle.bits_equal(res.rounded.real, oracle.elementwise(mul(0), X, Y, part))
    assert oracle.bits_equal(res.rounded.imag, oracle.elementwise(mul(1), X, Y, part))
    Gc = np.asarray(G, dtype=np.complex128)
    Yb = np.broadcast_to(Y, G.shape)
    # grad_x = sum of G * conj(y): real part gr*yr + gi*yi, imaginary part gi*yr - gr*yi
    g = res.backward(G)
    re = oracle.reduce_to(lambda s, i: (s.add(Gc[i].real, Yb[i].real), s.add(Gc[i].imag, Yb[i].imag)),
                          G.shape, x.shape, part)
    im = oracle.reduce_to(lambda s, i: (s.add(Gc[i].imag, Yb[i].real), s.add(-Gc[i].real, Yb[i].imag)),
                          G.shape, x.shape, part)
    assert oracle.bits_equal(g.rounded.grad_x.real, re)
    assert oracle.bits_equal(g.rounded.grad_x.imag, im)
    added = er.add(x, y, alpha=2)
    # As torch: alpha * y is a complex product, whose real part 2 yr - 0 yi holds the term (-0) yi: zero,
    # but it decides the sign of a zero result (-0 + 2 (-0) - 0 (-0) is +0).
    assert oracle.bits_equal(added.rounded.real, oracle.elementwise(
        lambda s, a, b: (s.add(a.real), s.add(2.0, b.real), s.add(-0.0, b.imag)), X, Y, part))


@pytest.mark.parametrize("fmt", REAL + COMPLEX)
@EXAMPLES
@given(data=st.data(), keepdims=st.booleans())
def test_sum_forward_and_backward_match_oracle(fmt, data, keepdims):
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    x = data.draw(array(fmt, shape))
    axis = data.draw(st.one_of(st.none(), *(
        [st.integers(0, len(shape) - 1), st.sets(st.integers(0, len(shape) - 1)).map(tuple)] if shape else [])))
    res = er.sum(x, axis=axis, keepdims=keepdims)
    xs = np.asarray(x)
    # As torch.sum: axis=() sums over every axis, as axis=None does.
    axes = tuple(range(xs.ndim)) if axis in (None, ()) else ((axis,) if isinstance(axis, int) else axis)
    out_shape = res.shape
    keep_shape = tuple(1 if i in axes else n for i, n in enumerate(xs.shape))
    parts = [("real", lambda v: v.real), ("imag", lambda v: v.imag)] if fmt in COMPLEX else [("real", lambda v: v)]
    pfmt = PART.get(fmt, fmt)
    for _, pick in parts:
        values = _f(pick(np.asarray(xs, dtype=np.complex128 if fmt in COMPLEX else np.float64)))
        expected = oracle.reduce_to(lambda s, i: s.add(values[i]), xs.shape, keep_shape, pfmt).reshape(out_shape)
        assert oracle.bits_equal(pick(res.rounded), expected)
    G = data.draw(array(fmt, out_shape))
    g = res.backward(G)
    expanded = np.broadcast_to(np.asarray(G).reshape(keep_shape), xs.shape)
    assert oracle.bits_equal(np.asarray(g.rounded.grad_x, dtype=np.complex128).real,
                             np.asarray(expanded, dtype=np.complex128).real)
