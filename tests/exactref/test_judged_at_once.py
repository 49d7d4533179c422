"""ops/_common.py's _judged_at_once: a small output of one plain narrow product, decided, given its
tolerance and judged by one call of exactref/_fused_judge.py's loop.

Each op below is made twice, with _judged_at_once and with it declining every call (build's numpy
steps then make the Part): every field of every Result's Part is the same, bit for bit, forward and
backward.  It takes the plain products and declines the rest (an element left undecided, special
values, a tolerance that is not the bound for any order alone, outputs of _fused.MIN_SIZE elements
or more), as listed; the rounded values are the exact ones, by Fractions (tests/exactref/oracle.py);
and what it judged keeps no preparation of B.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import exactref as er
from exactref import _fused
from exactref.ops import _common

from . import oracle
from .oracle import bits_equal
from .spies import recording

pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loop is not used")

_FIELDS = ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance")


def _results(res: er.Result, grad: np.ndarray | None) -> list[er.Result]:
    if grad is None:
        return [res]
    g = res.backward(grad)
    return [res, g["grad_A"], g["grad_B"]]


def _both_ways(monkeypatch: pytest.MonkeyPatch, make) -> tuple[list[er.Result], list[bool]]:
    """The Results of ``make()`` with _judged_at_once (and whether it took each call), checked
    against those without it, field by field."""
    taken: list[bool] = []
    real = _common._judged_at_once
    monkeypatch.setattr(_common, "_judged_at_once", recording(real, taken))
    fast = make()
    monkeypatch.setattr(_common, "_judged_at_once", lambda *a: None)
    slow = make()
    monkeypatch.setattr(_common, "_judged_at_once", real)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        for p, q in zip(a._parts, b._parts):
            for name in _FIELDS:
                x, y = getattr(p, name), getattr(q, name)
                assert x.shape == y.shape and x.dtype == y.dtype, name
                assert bits_equal(x, y), (name, x, y)
    return fast, taken


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_small_matmuls_and_gradients_are_the_numpy_steps_values(monkeypatch: pytest.MonkeyPatch,
                                                                 dtype: str) -> None:
    rng = np.random.default_rng(11)
    taken_all: list[bool] = []
    for _ in range(40):
        m, k, n = rng.integers(1, 9, 3)
        A = er.asarray(rng.standard_normal((m, k)), dtype)
        B = er.asarray(rng.standard_normal((k, n)), dtype)
        G = er.asarray(rng.standard_normal((m, n)), dtype)
        results, taken = _both_ways(monkeypatch, lambda: _results(er.matmul(A, B), G))
        taken_all += taken
        want = oracle.matmul(A.astype(np.float64), B.astype(np.float64), dtype)
        assert bits_equal(results[0].rounded.astype(np.float64), want)
    # The loop took most of them (the rest: tolerances that are not the bound alone).
    assert sum(taken_all) > len(taken_all) // 2


@pytest.mark.parametrize(("A", "B", "why"), [
    ([[1.0, 2.0 ** -24]], [[1.0], [1.0]], "a tie: the exact path's"),
    ([[1.0, -1.0]], [[3.0], [3.0]], "a zero, whose sign is the exact path's"),
    (np.ones((2, 0)), np.ones((0, 3)), "no terms"),
])
def test_an_undecided_element_leaves_the_output_to_the_numpy_steps(monkeypatch: pytest.MonkeyPatch, A, B,
                                                                    why: str) -> None:
    A, B = er.asarray(A, "float32"), er.asarray(B, "float32")
    results, taken = _both_ways(monkeypatch, lambda: _results(er.matmul(A, B), None))
    assert taken == [False], why
    assert bits_equal(results[0].rounded.astype(np.float64), oracle.matmul(A.astype(np.float64),
                                                                           B.astype(np.float64), "float32"))


def test_special_values_and_other_tolerances_never_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    A = er.asarray([[1.0, np.inf], [2.0, 3.0]], "float32")
    B = er.asarray([[1.0, 2.0], [3.0, 4.0]], "float32")
    _, taken = _both_ways(monkeypatch, lambda: _results(er.matmul(A, B), None))
    assert taken == []  # special values: not even asked
    A = er.asarray([[1.5, 2.0], [2.0, 3.0]], "float32")
    for model in (er.models.TF32_MATMUL, er.models.ErrorModel(order="sequential")):
        _, taken = _both_ways(monkeypatch, lambda: _results(er.matmul(A, B, model=model), None))
        assert not any(taken)  # (TF32's is not even asked: not elementwise)
    C = er.asarray([[0.5, 0.25], [1.0, 2.0]], "float32")
    _, taken = _both_ways(monkeypatch, lambda: [er.gemm(A, B, C, alpha=1, beta=1)])
    assert not any(taken)  # two terms
    results, taken = _both_ways(monkeypatch, lambda: [er.matmul(A, B)])
    assert taken == [True]
    # The Result holds the Part it made (not one build made again).
    made: list[object] = []
    real = _common._judged_at_once
    monkeypatch.setattr(_common, "_judged_at_once", lambda *a: made.append(real(*a)) or made[-1])
    assert er.matmul(A, B)._parts[0] is made[0] is not None


def test_it_takes_outputs_below_the_loops_size_and_leaves_no_preparation_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    side = math.isqrt(_fused.MIN_SIZE)
    rng = np.random.default_rng(5)
    # (Positive integers: every element exact, and so decided, at both sizes.)
    B = er.asarray(rng.integers(1, 5, (side, side)), "float32")
    seen: list[object] = []
    real = _common.plain_narrow_product
    monkeypatch.setattr(_common, "plain_narrow_product", lambda terms: seen.append(terms[0]) or real(terms))
    for rows, takes in ((side - 1, True), (side, False)):  # (past it, the compiled loops' own blocks)
        A = er.asarray(rng.integers(1, 5, (rows, side)), "float32")
        results, taken = _both_ways(monkeypatch, lambda: [er.matmul(A, B)])
        assert taken == [takes]
    # The term of the output it judged keeps neither B's preparation nor the operands' magnitudes
    # (engine.sumprod.release_terms, as solve does).
    (term,) = seen[:1]
    assert term.right is None and term.abs_A is None and term.abs_B is None
