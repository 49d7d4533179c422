"""An op whose arrays are all small takes no BLAS limit; a larger one does (exactref/_threads.py).

OpenBLAS runs products of such arrays on the calling thread anyway, and
setting and restoring the limit on every small call wakes its workers.  The
limits are read with threadpoolctl, independently of the code under test,
under an outer limit of 3 threads, a value neither the machine's default nor
ExactRef's.
"""

from __future__ import annotations

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
