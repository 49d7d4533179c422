"""exactref/_fused_slices.py: the compiled slicing against engine.fast._slices' numpy code, bit for bit.

The numpy code is the definition (tests/exactref/test_engine.py holds the
slices to their sums exactly); here the loop gets the rows where the two
could part: NaN and infinities (whose row maxima and units differ from a
finite row's), zeros and all-zero rows, subnormals, float64's largest
values (where sigma leaves the range and the row is marked not
error-free), and slices whose rest is exactly zero.  Then whole ops with
the loop and without it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er
from exactref import _fused, _fused_slices
from exactref.engine import fast

from .spies import recording

numba = pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loops are not used")

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -5e-324, 2.0 ** -1022, 1e-300, 1e300,
           np.finfo(np.float64).max, -np.finfo(np.float64).max, 1.0, 0.75, 2.0 ** 1000]


def _bits(x: np.ndarray) -> np.ndarray:
    """x's bits, every NaN as one (which NaN an invalid subtraction gives is the hardware's choice)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    return np.where(np.isnan(x), np.nan, x).view(np.uint64)


def _numpy_slices(X: np.ndarray, beta: int, monkeypatch) -> tuple:
    with monkeypatch.context() as m, np.errstate(invalid="ignore"):  # (inf - inf in a rest)
        m.setattr(_fused_slices, "last_axis", lambda *a: None)
        return fast._slices(X, -1, beta, 2)


def _assert_same(got: tuple, want: tuple) -> None:
    (g0, g1), g_rest, g_low = got
    (w0, w1), w_rest, w_low = want
    for g, w in ((g0, w0), (g1, w1), (g_rest, w_rest)):
        assert g.shape == w.shape and g.dtype == w.dtype == np.float64
        assert np.array_equal(_bits(g), _bits(w))
    assert g_low.shape == w_low.shape and g_low.dtype == w_low.dtype and np.array_equal(g_low, w_low)


def _rows(rng: np.random.Generator, n: int, K: int) -> np.ndarray:
    """Rows of spread magnitudes, with special values in some of them, a row of zeros, a row of
    one subnormal, and a row that two slices hold exactly (a short dyadic range)."""
    X = rng.standard_normal((n, K)) * 2.0 ** rng.integers(-40, 40, (n, 1)) * 2.0 ** rng.integers(-30, 30, (n, K))
    marked = rng.random((n, K)) < 0.02
    X[marked] = rng.choice(SPECIAL, int(marked.sum()))
    X[0] = 0.0
    X[1] = 0.0
    X[1, K // 2] = 5e-324
    X[2] = rng.integers(-2 ** 10, 2 ** 10, K) * 2.0 ** -5
    return X


@pytest.mark.parametrize("beta", [10, 19, 26, 33, 45])
@pytest.mark.parametrize("shape", [(9, 1024), (4096, 1), (3, 50, 97), (5000,), "stacked"])
def test_the_loop_makes_the_numpy_codes_slices(monkeypatch, beta, shape) -> None:
    rng = np.random.default_rng(beta)
    if shape == "stacked":
        # A block of rows of a stack of matrices (attention's P V): each matrix C-contiguous, the whole not.
        X = _rows(rng, 4 * 60, 90).reshape(4, 60, 90)[:, 7:55, :]
        assert not X.flags.c_contiguous
    else:
        K = shape[-1]
        n = int(np.prod(shape[:-1], dtype=np.int64))
        X = _rows(rng, max(n, 3), K)[:n].reshape(shape) if n >= 3 else rng.standard_normal(shape)
    made = _fused_slices.last_axis(X, beta)
    assert made is not None  # (the loop took it)
    _assert_same(made, _numpy_slices(X, beta, monkeypatch))
    # And through _slices itself, which takes the loop.
    _assert_same(fast._slices(X, -1, beta, 2), made)


@given(X=hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                    elements=st.one_of(st.floats(), st.sampled_from(SPECIAL))),
       beta=st.integers(1, 52))
def test_the_loop_makes_the_numpy_codes_slices_of_any_rows(X, beta) -> None:
    # The loop called directly: _slices sends blocks this small to the numpy code.
    p0, p1, rest = (np.empty_like(X) for _ in range(3))
    lowest = np.empty(X.shape[0], dtype=np.int64)
    _fused_slices._loop()(X, beta, p0, p1, rest, lowest)
    with pytest.MonkeyPatch.context() as m:
        want = _numpy_slices(X, beta, m)
    _assert_same(([p0, p1], rest, lowest), want)


def test_blocks_the_loop_does_not_take() -> None:
    X = np.random.default_rng(1).standard_normal((64, 128))
    assert _fused_slices.last_axis(X[:, :100], 20) is None  # rows not C-contiguous
    assert _fused_slices.last_axis(np.stack([X, X])[:, :, :100], 20) is None  # nor a stack's rows
    assert _fused_slices.last_axis(X[::2], 20) is None
    assert _fused_slices.last_axis(X.astype(np.float32), 20) is None
    assert _fused_slices.last_axis(X[:2], 20) is None  # too small to pay for the call
    assert _fused_slices.last_axis(X, 20) is not None


@pytest.mark.parametrize("op", ["matmul", "attention"])
def test_an_op_gives_the_same_result_with_the_loop_and_without(monkeypatch, op) -> None:
    rng = np.random.default_rng(3)
    calls: list[bool] = []
    monkeypatch.setattr(_fused_slices, "last_axis", recording(_fused_slices.last_axis, calls))

    def run() -> list[np.ndarray]:
        if op == "matmul":
            # float64 operands are sliced (A's rows by the loop); spread magnitudes leave rests.
            A, B = (rng.standard_normal(s) * 2.0 ** rng.integers(-30, 30, s) for s in ((96, 300), (300, 80)))
            res = er.matmul(A, B)
            grads = res.backward(np.ones((96, 80)))
            parts = [res, grads["grad_A"], grads["grad_B"]]
        else:
            # Attention's P V slices the weights P (float64) by rows.
            q, k, v, g = (rng.standard_normal((1, 2, 96, 16)).astype(np.float32) for _ in range(4))
            res = er.scaled_dot_product_attention(q, k, v)
            grads = res.backward(g)
            parts = [res, grads["grad_query"], grads["grad_key"], grads["grad_value"]]
        return [np.asarray(getattr(p, name)).copy() for p in parts for name in ("rounded", "tolerance")]
    state = rng.bit_generator.state
    fused = run()
    assert any(calls)  # (the loop took some blocks)
    rng.bit_generator.state = state
    monkeypatch.setattr(_fused, "available", lambda: False)
    plain = run()
    for g, w in zip(fused, plain):
        assert np.array_equal(_bits(g), _bits(w))
