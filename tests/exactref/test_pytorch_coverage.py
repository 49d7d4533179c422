"""PyTorch's CPU kernels are covered, forward and backward, for every op, format and broadcast pattern.

Under the default model everything is covered except the extra roundings the
spec names (matmul backward with two batched operands that broadcast,
multiply backward over broadcast copies, gemm backward's separate alpha);
under PYTORCH_AUTOGRAD those are covered too.  Inputs include NaN, +-inf
and signed zeros.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er
from exactref.formats import FLOAT8_FORMATS
from exactref.models import PYTORCH_AUTOGRAD

from .gen import COMPLEX, DTYPES, REAL, array
from .torch_helpers import run

ALL = REAL + COMPLEX
EXAMPLES = settings(max_examples=60)


def assert_covered(result, got, what=""):
    ok = result.covers(got)
    if not ok.all():
        result.check(got)  # raises with the report
    assert ok.all(), what


def _randn(rng, shape, fmt, scale=1.0):
    values = rng.standard_normal(shape) * scale
    if fmt in COMPLEX:
        values = values + 1j * rng.standard_normal(shape) * scale
    return er.asarray(values, fmt)


def _check_grads(g, grads, model_needed: set[str], g_autograd=None):
    for name, got in grads.items():
        if name in model_needed:
            assert_covered(g_autograd[name], got, name)
        else:
            assert_covered(g[name], got, name)


# ---------------------------------------------------------------- matmul


@st.composite
def matmul_inputs(draw, fmt, specials):
    shapes = draw(hnp.mutually_broadcastable_shapes(signature="(m?,n),(n,p?)->(m?,p?)", max_dims=3, max_side=4))
    a, b = shapes.input_shapes
    return (draw(array(fmt, a, specials)), draw(array(fmt, b, specials)),
            draw(array(fmt, shapes.result_shape, specials)))


def _matmul_needs_autograd_model(A, B):
    both = A.ndim >= 3 and B.ndim >= 3
    batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) if both else ()
    return {name for name, x in (("grad_A", A), ("grad_B", B)) if both and x.shape[:-2] != batch}


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("specials", [False, True])
@EXAMPLES
@given(data=st.data())
def test_matmul_covered(fmt, specials, data):
    A, B, G = data.draw(matmul_inputs(fmt, specials))
    out, grads = run(torch.matmul, {"input": A, "other": B}, G)
    res = er.matmul(A, B)
    assert_covered(res, out)
    grads = {"grad_A": grads["grad_input"], "grad_B": grads["grad_other"]}
    needed = _matmul_needs_autograd_model(A, B)
    _check_grads(res.backward(G), grads, needed, er.matmul.backward(A, B, G, model=PYTORCH_AUTOGRAD))


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("seed", range(4))
def test_matmul_covered_on_long_random_sums(fmt, seed):
    rng = np.random.default_rng(seed)
    M, K, N = rng.integers(1, 40), rng.integers(50, 400), rng.integers(1, 40)
    A, B, G = _randn(rng, (M, K), fmt), _randn(rng, (K, N), fmt), _randn(rng, (M, N), fmt)
    out, grads = run(torch.matmul, {"input": A, "other": B}, G)
    res = er.matmul(A, B)
    assert_covered(res, out)
    g = res.backward(G)
    assert_covered(g["grad_A"], grads["grad_input"])
    assert_covered(g["grad_B"], grads["grad_other"])


@pytest.mark.parametrize("fmt", REAL)
def test_batched_broadcast_matmul_backward_is_covered_under_autograd_model(fmt):
    rng = np.random.default_rng(1)
    A, B = _randn(rng, (1, 3, 4, 40), fmt), _randn(rng, (5, 1, 40, 6), fmt)
    G = _randn(rng, (5, 3, 4, 6), fmt)
    _, grads = run(torch.matmul, {"input": A, "other": B}, G)
    g = er.matmul.backward(A, B, G, model=PYTORCH_AUTOGRAD)
    assert_covered(g["grad_A"], grads["grad_input"])
    assert_covered(g["grad_B"], grads["grad_other"])


# ---------------------------------------------------------------- gemm


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("specials", [False, True])
@EXAMPLES
@given(data=st.data(), alpha=st.sampled_from([1, 2, -0.5, 0, 0.1]), beta=st.sampled_from([1, 0, 0.5, -3, 0.3]))
def test_addmm_covered(fmt, specials, data, alpha, beta):
    M, K, N = (data.draw(st.integers(1, 4)) for _ in range(3))
    c_shape = data.draw(st.sampled_from([(M, N), (N,), (1, N), (M, 1), ()]))
    A, B = data.draw(array(fmt, (M, K), specials)), data.draw(array(fmt, (K, N), specials))
    C, G = data.draw(array(fmt, c_shape, specials)), data.draw(array(fmt, (M, N), specials))
    fn = lambda C, A, B: torch.addmm(C, A, B, beta=beta, alpha=alpha)  # noqa: E731
    out, grads = run(fn, {"C": C, "A": A, "B": B}, G)
    res = er.gemm(A, B, C, alpha=alpha, beta=beta)
    assert_covered(res, out)
    needed = {"grad_A", "grad_B"} if alpha not in (1,) else set()
    needed |= {"grad_C"} if beta not in (1,) and c_shape != (M, N) else set()
    _check_grads(res.backward(G), grads, needed,
                 er.gemm.backward(A, B, C, G, alpha=alpha, beta=beta, model=PYTORCH_AUTOGRAD))


@pytest.mark.parametrize("fmt", REAL)
def test_baddbmm_covered_on_long_random_sums(fmt):
    rng = np.random.default_rng(7)
    A, B, C, G = (_randn(rng, s, fmt) for s in ((3, 5, 200), (3, 200, 4), (3, 5, 4), (3, 5, 4)))
    fn = lambda C, A, B: torch.baddbmm(C, A, B, beta=0.5, alpha=3.0)  # noqa: E731
    out, grads = run(fn, {"C": C, "A": A, "B": B}, G)
    res = er.gemm(A, B, C, alpha=3.0, beta=0.5)
    assert_covered(res, out)
    g = er.gemm.backward(A, B, C, G, alpha=3.0, beta=0.5, model=PYTORCH_AUTOGRAD)
    for name in ("grad_A", "grad_B", "grad_C"):
        assert_covered(g[name], grads[name])


# ---------------------------------------------------------------- add and multiply


@st.composite
def binary_inputs(draw, fmt, specials):
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4))
    x = draw(array(fmt, shapes.input_shapes[0], specials))
    y = draw(array(fmt, shapes.input_shapes[1], specials))
    if draw(st.booleans()):
        y = draw(st.sampled_from([0.5, -2.0, 0.1, 3.0, 1e-3, 1e30]))
    G = draw(array(fmt, np.broadcast_shapes(np.shape(x), np.shape(y)), specials))
    return x, y, G


def _broadcast_names(x, y, shape):
    return {name for name, v in (("grad_x", x), ("grad_y", y)) if isinstance(v, np.ndarray) and v.shape != shape}


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("specials", [False, True])
@EXAMPLES
@given(data=st.data(), alpha=st.sampled_from([1, -1, 2, 0.1, 0]))
def test_add_covered(fmt, specials, data, alpha):
    x, y, G = data.draw(binary_inputs(fmt, specials))
    out, grads = run(lambda x, y: torch.add(x, y, alpha=alpha), {"x": x, "y": y}, G)
    res = er.add(x, y, alpha=alpha)
    assert_covered(res, out)
    needed = _broadcast_names(None, y, G.shape) if alpha not in (1, -1) else set()
    _check_grads(res.backward(G), grads, needed, er.add.backward(x, y, G, alpha=alpha, model=PYTORCH_AUTOGRAD))


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("specials", [False, True])
@EXAMPLES
@given(data=st.data())
def test_multiply_covered(fmt, specials, data):
    x, y, G = data.draw(binary_inputs(fmt, specials))
    out, grads = run(torch.mul, {"input": x, "other": y}, G)
    res = er.multiply(x, y)
    assert_covered(res, out)
    grads = {k.replace("input", "x").replace("other", "y"): v for k, v in grads.items()}
    needed = _broadcast_names(x, y, G.shape)
    _check_grads(res.backward(G), grads, needed, er.multiply.backward(x, y, G, model=PYTORCH_AUTOGRAD))


# ---------------------------------------------------------------- sum


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("specials", [False, True])
@EXAMPLES
@given(data=st.data(), keepdims=st.booleans())
def test_sum_covered(fmt, specials, data, keepdims):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5))
    x = data.draw(array(fmt, shape, specials))
    axis = data.draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
    res = er.sum(x, axis=axis, keepdims=keepdims)
    G = data.draw(array(fmt, res.shape, specials))
    dim = tuple(range(len(shape))) if axis is None else axis
    fn = (lambda x: torch.sum(x)) if axis is None and not keepdims else (
        lambda x: torch.sum(x, dim=dim, keepdim=keepdims))
    out, grads = run(fn, {"x": x}, G)
    assert_covered(res, out)
    assert_covered(res.backward(G)["grad_x"], grads["grad_x"])


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("n", [1000, 40000, 100003])
def test_long_sums_covered_on_every_thread_count(fmt, n):
    rng = np.random.default_rng(n)
    x = _randn(rng, (n,), fmt, scale=10.0)
    res = er.sum(x)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert_covered(res, torch.sum(torch.from_numpy(np.asarray(x).view(np.int16)).view(torch.bfloat16))
                           if fmt == "bfloat16" else torch.sum(torch.from_numpy(np.asarray(x))))
        finally:
            torch.set_num_threads(old)


def test_dtype_table_is_complete():
    # The float8 formats have their own tests (test_float8_torch.py): torch has only matmul and _scaled_mm for them.
    assert set(DTYPES) == set(er.FORMATS) - set(FLOAT8_FORMATS)
