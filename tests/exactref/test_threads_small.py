"""An op whose arrays are all small takes no BLAS limit; a larger one does (exactref/_threads.py),
but for a sum made by one compiled call on the calling thread, which makes no BLAS call.

OpenBLAS runs products of such arrays on the calling thread anyway, and
setting and restoring the limit on every small call wakes its workers.  The
limits are read with threadpoolctl, independently of the code under test,
under an outer limit of 3 threads, a value neither the machine's default nor
ExactRef's.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import exactref as er
import exactref._threads as threads

# The outer limit, the reader of the limits and the spy are test_threads.py's (its autouse fixture,
# which counts every array as large, is not imported: here the small ones are the point).
from .test_threads import OUTER, blas_threads, outer, spy  # noqa: F401  (outer: a fixture)

pytestmark = pytest.mark.skipif(not blas_threads(), reason="threadpoolctl sees no BLAS library in this process")


SMALL = np.arange(64, dtype=np.float32).reshape(8, 8) / 7  # _SMALL elements: the largest small array
LARGE = np.arange(81, dtype=np.float32).reshape(9, 9) / 7


def test_a_small_op_and_its_backward_leave_the_limit_alone(outer, monkeypatch):
    seen: list[list[int]] = []
    monkeypatch.setattr(er.matmul, "_forward", spy(seen, er.matmul._forward))
    res = er.matmul(SMALL, SMALL)
    monkeypatch.setattr(res, "_backward", spy(seen, res._backward))
    res.backward(SMALL)
    assert seen == [[OUTER] * len(blas_threads())] * 2
    assert set(blas_threads()) == {OUTER}


def test_an_op_with_a_larger_array_runs_on_one_thread_and_restores(outer, monkeypatch):
    seen: list[list[int]] = []
    monkeypatch.setattr(er.matmul, "_forward", spy(seen, er.matmul._forward))
    # One large operand is enough, and a small result's backward with a large grad is limited too.
    res = er.matmul(LARGE, LARGE[:, :1])
    monkeypatch.setattr(res, "_backward", spy(seen, res._backward))
    res.backward(LARGE[:, :1])
    small = er.matmul(SMALL, SMALL)
    monkeypatch.setattr(small, "_backward", spy(seen, small._backward))
    small.backward(torch.ones(8, 8))  # a small tensor: no limit
    assert seen == [[1] * len(blas_threads())] * 2 + [[OUTER] * len(blas_threads())] * 2
    assert set(blas_threads()) == {OUTER}


def test_limiting_changes_no_result(monkeypatch):
    def judged() -> list[np.ndarray]:
        res = er.matmul(SMALL, SMALL.T)
        g = res.backward(SMALL)
        return [res.rounded, res.tolerance, g.rounded.grad_A, g.tolerance.grad_B]
    unlimited = judged()
    monkeypatch.setattr(threads, "_SMALL", -1)  # every array counts as large: limited
    limited = judged()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(unlimited, limited))


@pytest.mark.parametrize(("values", "expected"), [
    ((np.ones(64), 2.0, None, "x", 1 + 2j), True),
    ((np.ones(65),), False),
    ((torch.ones(64),), True),
    ((torch.ones(65),), False),
    (([1.0, 2.0],), False),  # a list: its size is not known without reading it
    ((object(),), False),
])
def test_small_counts_arrays_and_tensors_and_nothing_else(values, expected):
    assert threads.small(values) is expected


def _sum_cases():
    """(x, axis, whether sum takes the limit): a full sum of a C-contiguous float32 array made by one
    call of the compiled loop on this thread takes none; other sums do."""
    from exactref.engine import fast
    from exactref.ops.reduction import _FUSED_SIZE

    x = np.random.default_rng(0).standard_normal(5 * (_FUSED_SIZE // 5 + 2), dtype=np.float32)
    return [
        (x, None, False),
        (x, 0, False),
        (x.reshape(5, -1)[:, :-1], None, True),  # not contiguous
        (x.reshape(-1, 5)[:, :4].copy(), 1, True),  # a sum per row
        (x.astype(np.float64), None, True),
        (x[:_FUSED_SIZE - 1], None, True),  # below the compiled loop's size: numpy's BLAS products
        (np.ones(fast._FUSED_PARALLEL, dtype=np.float32), None, True),  # blocks side by side
    ]


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba (exactref[fast]) is not installed")
def test_a_sum_made_by_one_compiled_call_takes_no_limit(outer, monkeypatch):
    for x, axis, limited in _sum_cases():
        seen: list[list[int]] = []
        monkeypatch.setattr(er.sum, "_forward", spy(seen, er.sum._forward))
        er.sum(x, axis=axis)
        assert seen == [[1 if limited else OUTER] * len(blas_threads())], (x.shape, x.dtype, axis)
        assert set(blas_threads()) == {OUTER}


def test_a_sum_is_the_same_with_the_limit_and_without_it(monkeypatch):
    for x, axis, _ in _sum_cases()[:2]:
        without = er.sum(x, axis=axis)
        monkeypatch.setattr(er.sum, "_needs_limit", None)  # every call that is not small: limited
        limited = er.sum(x, axis=axis)
        monkeypatch.undo()
        for p, q in zip(without._parts, limited._parts):
            for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance", "nan_ok", "special_ok"):
                assert getattr(p, name).tobytes() == getattr(q, name).tobytes(), name
