"""exactref/ops/attention/_factors.py: each compiled factor against its numpy definition, bit for bit.

The factors bound kernels' errors; their derivations are tested through the
tolerance models (test_attention_bounds.py and the oracle tests).  Here the
loop gets values where numpy's and its could part (NaN, infinities, signed
zeros, subnormals, float64's largest values, whose sums overflow), in each
layout matmul_up hands it (a C-contiguous block, a block of rows of a stack,
and the transposed views of grad_key's and grad_value's factors), and the
result must have numpy's layout too, since the BLAS product after it reads
it as it is laid out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import exactref as er
from exactref.ops.attention import _factors
from exactref.ops.attention._first import matmul_up

from .spies import recording

numba = pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loops are not used")

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -5e-324, 2.0 ** -1022, 1e-300, 1e300,
           np.finfo(np.float64).max, 1.0, -1.0]
CONSTANTS = [0.0, 2.0 ** -40, 0.5, 3.0, 1e300, np.inf]


def _bits(x: np.ndarray) -> np.ndarray:
    """x's bits, every NaN as one (which NaN an invalid operation gives is the hardware's choice)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    return np.where(np.isnan(x), np.nan, x).view(np.uint64)


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-60, 60, shape)
    odd = rng.random(shape) < 0.05
    x[odd] = rng.choice(SPECIAL, int(odd.sum()))
    return x


def _blocks(layout: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two blocks of one layout, as matmul_up passes them to ``of``."""
    a, b = _values(rng, (3, 90, 120)), _values(rng, (3, 90, 120))
    if layout == "contiguous":
        return a[1], b[1]
    if layout == "rows of a stack":
        return a[:, 10:70, :], b[:, 10:70, :]
    if layout == "transposed":
        return np.swapaxes(a, -1, -2)[:, 20:100, :], np.swapaxes(b, -1, -2)[:, 20:100, :]
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["contiguous", "rows of a stack", "transposed"])
@pytest.mark.parametrize("kind", sorted(_factors.KINDS))
@pytest.mark.parametrize("c", CONSTANTS)
def test_the_loop_makes_the_numpy_factor(kind, layout, c) -> None:
    a, b = _blocks(layout, np.random.default_rng(len(layout) + len(kind)))
    code = {"abs": 0, "relative": 1, "grown": 2}[kind]
    got = _factors._compiled(code, c, a, b)
    assert got is not None  # (the loop took the blocks)
    with np.errstate(all="ignore"):
        want = _factors.KINDS[kind](c, a, b)
    assert got.shape == want.shape and got.strides == want.strides  # numpy's layout
    assert np.array_equal(_bits(got), _bits(want))
    assert np.array_equal(_bits(_factors.factor(kind, c)(a, b)), _bits(want))


def test_blocks_the_loop_does_not_take() -> None:
    rng = np.random.default_rng(2)
    a, b = _blocks("rows of a stack", rng)
    t, _ = _blocks("transposed", rng)
    assert _factors._compiled(0, 1.0, a, b) is not None
    assert _factors._compiled(0, 1.0, a.astype(np.float32), b.astype(np.float32)) is None
    assert _factors._compiled(0, 1.0, a[:, :, :5], b[:, :, :5]) is None  # too small to pay for the call
    assert _factors._compiled(0, 1.0, a[..., ::2], b[..., ::2]) is None  # no contiguous axis
    assert _factors._compiled(0, 1.0, t[:, :60, :90], a[:, :, :90]) is None  # layouts that differ
    # And the factor is numpy's there.
    with np.errstate(all="ignore"):
        assert np.array_equal(_bits(_factors.factor("grown", 3.0)(a[..., ::2], b[..., ::2])),
                              _bits(_factors.KINDS["grown"](3.0, a[..., ::2], b[..., ::2])))


@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_up_gives_the_same_bound_with_the_loop(transposed) -> None:
    rng = np.random.default_rng(4)
    X, Xe = np.abs(rng.standard_normal((4, 300, 200))), np.abs(rng.standard_normal((4, 300, 200))) * 1e-16
    Y = np.abs(rng.standard_normal((4, 300 if transposed else 200, 24)))
    if transposed:
        X, Xe = np.swapaxes(X, -1, -2), np.swapaxes(Xe, -1, -2)
    with np.errstate(all="ignore"):
        got = matmul_up(X, Y, of=_factors.factor("abs", 2.0 ** -45), more=(Xe,))
        want = matmul_up(X, Y, of=lambda x, e: _factors.KINDS["abs"](2.0 ** -45, x, e), more=(Xe,))
    assert np.array_equal(_bits(got), _bits(want))


def test_attention_gives_the_same_result_with_the_loop_and_without(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v, g = (torch.randn(1, 2, 160, 16, generator=gen) for _ in range(4))
    calls: list[bool] = []
    monkeypatch.setattr(_factors, "_compiled", recording(_factors._compiled, calls))

    def run() -> list[np.ndarray]:
        out = er.scaled_dot_product_attention(q, k, v)
        grads = out.backward(g)
        parts = [out, grads["grad_query"], grads["grad_key"], grads["grad_value"]]
        return [np.asarray(getattr(p, name)).copy() for p in parts for name in ("rounded", "tolerance")]
    fused = run()
    assert any(calls)  # the loop made some factors
    monkeypatch.setattr(_factors, "_compiled", lambda *a: None)
    for got, want in zip(fused, run()):
        assert np.array_equal(_bits(got), _bits(want))
