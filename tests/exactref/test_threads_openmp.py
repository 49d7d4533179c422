"""Before an op first runs blocks side by side, it ends the calling thread's idle libgomp workers
(torch's, spinning since its last op): exactref/_threads.py's release_openmp.

The workers are seen as the process's native threads (Linux's /proc/self/task), independently of
the code under test: the threads a parallel torch op starts, and whether they are still there.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import exactref as er
import exactref._parallel as parallel
import exactref._threads as threads

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="native threads are counted on Linux")


def native_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def torch_work() -> float:
    """A torch op that runs on torch's OpenMP threads (a reduction far past its grain size)."""
    return float((torch.arange(1 << 22, dtype=torch.float64) * 0.5).sum())


def wait_until(condition, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def two_torch_threads():
    """torch on two threads (restored after), and the OpenMP runtimes scanned now that torch is loaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    threads.rescan()
    yield
    torch.set_num_threads(before)


def fresh_workers() -> set[int]:
    """The native threads a torch op starts, from no pool: released first, on this thread."""
    with threads.own_threads():
        threads.release_openmp()
    time.sleep(0.05)
    before = native_threads()
    torch_work()
    workers = native_threads() - before
    assert workers, "no new worker: the release left torch's pool, or torch ran on one thread"
    return workers


def test_release_ends_this_threads_idle_openmp_workers_and_torch_starts_new_ones(two_torch_threads):
    expected = torch_work()
    workers = fresh_workers()
    with threads.own_threads():
        threads.release_openmp()
    assert wait_until(lambda: not workers & native_threads())
    assert torch.get_num_threads() == 2
    before = native_threads()
    assert torch_work() == expected
    assert len(native_threads() - before) == len(workers)  # the same number of threads again


def test_an_op_that_runs_blocks_side_by_side_releases_them(two_torch_threads, monkeypatch):
    workers = fresh_workers()
    monkeypatch.setattr(parallel, "width", lambda: 1 if getattr(parallel._local, "inside", False) else 2)
    A = np.ones((512, 8), dtype=np.float32)
    er.matmul(A, A.T)  # a 512 x 512 output: blocks of rows
    assert wait_until(lambda: not workers & native_threads())


def test_an_op_on_one_thread_leaves_them(two_torch_threads, monkeypatch):
    workers = fresh_workers()
    monkeypatch.setattr(parallel, "width", lambda: 1)
    A = np.ones((512, 8), dtype=np.float32)
    er.matmul(A, A.T)
    time.sleep(0.2)
    assert workers <= native_threads()


def test_another_threads_release_leaves_this_threads_workers(two_torch_threads):
    workers = fresh_workers()

    def other() -> None:
        with threads.own_threads():
            threads.release_openmp()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    time.sleep(0.2)
    assert workers <= native_threads()


def test_each_outermost_op_releases_once(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(threads, "_openmp_pauses", lambda: [calls.append])
    monkeypatch.setattr(threads, "_SMALL", -1)
    monkeypatch.setattr(parallel, "width", lambda: 1 if getattr(parallel._local, "inside", False) else 2)
    A = np.ones((512, 8), dtype=np.float32)
    for _ in range(2):
        res = er.matmul(A, A.T)  # several sets of blocks side by side: copies, solving, judging
    assert calls == [threads._OMP_PAUSE_SOFT] * 2
    res.backward(np.ones((512, 512), dtype=np.float32))
    assert len(calls) == 3
    monkeypatch.setattr(threads, "_release", False)  # the benchmarks' switch
    er.matmul(A, A.T)
    assert len(calls) == 3
