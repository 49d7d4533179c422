"""ExactRef's calls run numpy's BLAS on one thread and restore the limits (exactref/_threads.py).

The limits are read with threadpoolctl, independently of the code under
test; the outer limit is set to 3, a value neither the machine's default nor
ExactRef's, so that a limit left behind shows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import threadpoolctl

import exactref as er
import exactref._threads as threads
from exactref import _fused
from exactref import result as result_module

OUTER = 3


def blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]


pytestmark = pytest.mark.skipif(not blas_threads(), reason="threadpoolctl sees no BLAS library in this process")


@pytest.fixture(autouse=True)
def limit_small_ops_too(monkeypatch):
    """These tests use tiny arrays, which ExactRef leaves unlimited (test_threads_small.py): count
    every array as large, so that the limiting itself is what they test."""
    monkeypatch.setattr(threads, "_SMALL", -1)


@pytest.fixture
def outer():
    """Run the test under a BLAS limit of OUTER threads, as a user's own setting.

    numba (exactref[fast], loaded by the first op with a compiled loop, exactref/_fused.py) imports
    scipy, which loads a BLAS library of its own with its default threads: loaded first, as a
    user's import of scipy would be, it is under the limit too."""
    _fused.available()
    with threadpoolctl.threadpool_limits(limits=OUTER, user_api="blas"):
        assert blas_threads() and set(blas_threads()) == {OUTER}
        yield


def spy(record: list[list[int]], inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner``, recording the BLAS limits it runs under."""
    def f(*args: Any, **kwargs: Any) -> Any:
        record.append(blas_threads())
        return inner(*args, **kwargs)
    return f


M = np.array([[0.5, -1.0], [2.0, 0.25]], dtype=np.float32)
V = np.array([1.0, 3.0], dtype=np.float32)
Q = np.ones((1, 2, 2), dtype=np.float32)
OPS = {  # each op with arguments for its forward, and for its backward when it has one
    "matmul": (er.matmul, (M, M), (M, M, M)),
    "gemm": (er.gemm, (M, M, M), (M, M, M, M)),
    "add": (er.add, (V, V), (V, V, V)),
    "multiply": (er.multiply, (V, V), (V, V, V)),
    "sum": (er.sum, (V,), (V, np.float32(1.0))),
    "scaled_dot_product_attention": (er.scaled_dot_product_attention, (Q, Q, Q), (Q, Q, Q, Q)),
    "matrix_exp": (er.matrix_exp, (M,), (M, M)),
    "matrix_exp_frechet": (er.matrix_exp_frechet, (M, M), None),
}


@pytest.mark.parametrize("name", OPS)
def test_each_op_runs_on_one_blas_thread_and_restores_the_limit(name, outer, monkeypatch):
    op, args, _ = OPS[name]
    seen: list[list[int]] = []
    monkeypatch.setattr(op, "_forward", spy(seen, op._forward))
    res = op(*args)
    assert seen == [[1] * len(blas_threads())]
    assert set(blas_threads()) == {OUTER}
    assert isinstance(res, er.Result)


@pytest.mark.parametrize("name", [n for n, (_, _, b) in OPS.items() if b is not None])
def test_each_backward_runs_on_one_blas_thread(name, outer, monkeypatch):
    op, args, backward_args = OPS[name]
    seen: list[list[int]] = []
    monkeypatch.setattr(op, "_backward", spy(seen, op._backward))
    op.backward(*backward_args)
    res = op(*args)
    monkeypatch.setattr(res, "_backward", spy(seen, res._backward))
    res.backward(backward_args[-1])
    assert seen == [[1] * len(blas_threads())] * 2
    assert set(blas_threads()) == {OUTER}


def test_exact_and_the_check_report_run_on_one_blas_thread(outer, monkeypatch):
    res = er.matmul(M, M)
    exact: list[list[int]] = []
    report: list[list[int]] = []
    monkeypatch.setattr(res, "_exact", spy(exact, res._exact))
    res.exact((0, 0))
    assert exact == [[1] * len(blas_threads())]
    monkeypatch.setattr(result_module._report, "mismatch_report", spy(report, result_module._report.mismatch_report))
    with pytest.raises(er.OutOfToleranceError):
        res.check(res.rounded + 1)
    assert report == [[1] * len(blas_threads())]
    assert set(blas_threads()) == {OUTER}


def test_a_failed_half_attention_check_computes_its_flash_forward_on_one_blas_thread(outer, monkeypatch):
    q = np.array([[[0.5, -1.0], [2.0, 0.25]]], dtype=np.float16)
    res = er.scaled_dot_product_attention(q, q, q)
    seen: list[list[int]] = []
    monkeypatch.setattr(res, "_flash", spy(seen, res._flash))
    with pytest.raises(er.OutOfToleranceError):
        res.check((res.rounded.astype(np.float32) + 1).astype(np.float16))
    assert seen == [[1] * len(blas_threads())]
    assert set(blas_threads()) == {OUTER}


def test_a_real_call_restores_the_limit(outer):
    r = er.matmul(np.ones((64, 64), dtype=np.float32), np.ones((64, 64), dtype=np.float32))
    assert set(blas_threads()) == {OUTER}
    r.backward(np.ones((64, 64), dtype=np.float32))
    assert set(blas_threads()) == {OUTER}
    assert r.covers(r.rounded).all()


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_the_limit_is_restored_when_the_op_raises(error, outer, monkeypatch):
    def boom(*args: Any, **kwargs: Any) -> None:
        assert set(blas_threads()) == {1}
        raise error("from inside the op")
    monkeypatch.setattr(er.matmul, "_forward", boom)
    with pytest.raises(error, match="from inside the op"):
        er.matmul(M, M)
    assert set(blas_threads()) == {OUTER}
    monkeypatch.undo()
    assert er.matmul(M, M).covers(M @ M).all()  # and the next call works as before


def test_an_argument_error_restores_the_limit(outer):
    with pytest.raises(ValueError):
        er.matmul(np.ones((2, 3), dtype=np.float32), np.ones((2, 3), dtype=np.float32))
    assert set(blas_threads()) == {OUTER}


def test_nested_ops_limit_once_and_restore_only_at_the_outermost(outer, monkeypatch):
    limits: list[Any] = []
    real_limiter = threads._limiter

    def counting_limiter(*args: Any) -> Any:
        limits.append(args[1])
        return real_limiter(*args)
    monkeypatch.setattr(threads, "_limiter", counting_limiter)
    seen: list[list[int]] = []
    forward = er.matmul._forward

    def outer_forward(*args: Any, **kwargs: Any) -> Any:
        er.add(V, V)
        er.sum.backward(V, np.float32(1.0))
        seen.append(blas_threads())  # the inner ops' exits did not restore the outer limit
        return forward(*args, **kwargs)
    monkeypatch.setattr(er.matmul, "_forward", outer_forward)
    er.matmul(M, M).backward(M)
    # One limit for the outer call, one for the result's backward; none for the inner ops.
    assert limits == [[OUTER] * len(blas_threads())] * 2
    assert seen == [[1] * len(blas_threads())]
    assert set(blas_threads()) == {OUTER}


def test_the_kept_limiter_serves_only_the_threads_it_saved(monkeypatch):
    # threadpoolctl's limiter is kept from one op to the next (its set-up reads every library's
    # version), and entered again only while the libraries have the threads it saved: after an op
    # under the caller's own limit, the threads are that limit's, and after the next op outside
    # it, the default's.
    er.matmul(M, M)
    default = blas_threads()
    assert set(default) != {OUTER}
    seen: list[list[int]] = []
    monkeypatch.setattr(er.matmul, "_forward", spy(seen, er.matmul._forward))
    kept = threads._kept
    with threadpoolctl.threadpool_limits(limits=OUTER, user_api="blas"):
        er.matmul(M, M)
        assert blas_threads() == [OUTER] * len(default)
    assert threads._kept is not kept  # (made again for the caller's limit)
    er.matmul(M, M)
    er.matmul(M, M)
    assert blas_threads() == default
    assert seen == [[1] * len(default)] * 3


def test_other_threads_can_set_blas_limits_after_a_call():
    # threadpoolctl lets one Python thread at a time control OpenBLAS; ExactRef must hand control back.
    er.matmul(M, M)
    seen = []

    def other() -> None:
        with threadpoolctl.threadpool_limits(limits=OUTER, user_api="blas"):
            seen.append(blas_threads())
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [[OUTER] * len(blas_threads())]


def test_an_op_in_another_thread_leaves_the_owners_limit_alone(outer, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    seen: list[list[int]] = []
    forward = er.matmul._forward

    def held_forward(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            inside.set()
            release.wait(10)
            seen.append(blas_threads())  # after the other thread's op has returned
        return forward(*args, **kwargs)
    monkeypatch.setattr(er.matmul, "_forward", held_forward)
    done: list[bool] = []

    def other() -> None:
        inside.wait(10)
        done.append(bool(er.matmul(M, M).covers(M @ M).all()))
        release.set()
    t = threading.Thread(target=other)
    t.start()
    er.matmul(M, M)
    t.join()
    assert done == [True]
    assert seen == [[1] * len(blas_threads())]
    assert set(blas_threads()) == {OUTER}


def test_an_already_single_threaded_blas_is_left_alone(monkeypatch):
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        controller = threads._controller()
        monkeypatch.setattr(controller, "limit", lambda *a, **k: pytest.fail("limited a single-threaded BLAS"))
        er.matmul(M, M)
        assert set(blas_threads()) == {1}


def test_the_benchmarks_switch_turns_the_management_off(outer, monkeypatch):
    monkeypatch.setattr(threads, "_enabled", False)
    seen: list[list[int]] = []
    monkeypatch.setattr(er.matmul, "_forward", spy(seen, er.matmul._forward))
    er.matmul(M, M)
    assert seen == [[OUTER] * len(blas_threads())]
