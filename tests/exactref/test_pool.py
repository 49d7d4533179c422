"""Large result arrays reuse the buffers of results no longer used (exactref/_pool.py).

Whether two arrays share memory is asked of numpy (np.shares_memory), independently of the
pool's own bookkeeping; a Result's values are compared with copies taken before later ops ran.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref

import numpy as np
import pytest

import exactref as er
import exactref._malloc as malloc
import exactref._pool as pool
from exactref._threads import own_threads

BIG = pool._MIN_BYTES // 8 + 8  # float64 elements: just over the smallest size the pool keeps


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    # Each test has a pool of its own: a failed test's arrays, which its traceback keeps alive,
    # do not count against the next one.
    monkeypatch.setattr(pool, "_kept", [])
    yield
    pool.clear()


def test_a_buffer_is_reused_only_once_no_array_uses_it():
    a = pool.empty((BIG,), np.float64)
    b = pool.empty((BIG,), np.float64)
    assert not np.shares_memory(a, b)  # a is alive: b is another buffer
    a[:] = 1.0
    b[:] = 2.0
    assert (a == 1.0).all()
    del a
    c = pool.empty((BIG,), np.float64)  # a's buffer, now unused
    assert not np.shares_memory(b, c)
    assert len(pool._kept) == 2


def test_a_view_of_a_view_keeps_the_buffer_in_use():
    a = pool.empty((2, BIG // 2), np.float64)
    rest = a[1, 10:]  # numpy's base of a view is the buffer itself
    del a
    b = pool.empty((2, BIG // 2), np.float64)
    assert not np.shares_memory(b, rest)
    del rest, b
    c = pool.empty((2, BIG // 2), np.float64)
    assert len(pool._kept) == 2 and c.shape == (2, BIG // 2) and c.dtype == np.float64


def test_only_a_buffer_of_the_same_size_and_only_large_arrays():
    a = pool.empty((BIG,), np.float64)
    del a
    b = pool.empty((BIG + 1,), np.float64)  # the free buffer is too small, and a larger one would waste
    assert len(pool._kept) == 2
    small = pool.empty((1000,), np.float64)
    assert small.base is None and len(pool._kept) == 2
    del b
    bools = pool.empty((BIG * 8,), np.bool_)  # the same bytes, another dtype: a buffer reused
    assert bools.dtype == np.bool_ and len(pool._kept) == 2


def test_at_most_max_kept_bytes_are_kept(monkeypatch):
    monkeypatch.setattr(pool, "_MAX_KEPT", [3 * BIG * 8])
    arrays = [pool.empty((BIG,), np.float64) for _ in range(5)]
    assert len(pool._kept) == 3
    assert all(a.base is None for a in arrays[3:])  # plain arrays beyond the bound
    for i, a in enumerate(arrays):
        a[:] = i
    assert [float(a[0]) for a in arrays] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_unused_buffers_of_other_sizes_make_room_the_longest_unused_first(monkeypatch):
    monkeypatch.setattr(pool, "_MAX_KEPT", [3 * BIG * 8 + 64])
    a, b, c = (pool.empty((BIG,), np.float64) for _ in range(3))
    # (Weak references: a reference to a buffer would keep it in use.)
    a_buf, c_buf = weakref.ref(a.base), weakref.ref(c.base)
    del a
    time.sleep(0.01)  # (c unused later than a)
    del c
    d = pool.empty((BIG + 4,), np.float64)  # no room for it until a's buffer, the longest unused, goes
    assert a_buf() is None and c_buf() is not None
    assert d.base is not None and len(pool._kept) == 3
    e = pool.empty((2 * BIG,), np.float64)  # letting c's buffer go would not make room: none goes
    assert e.base is None and c_buf() is not None and len(pool._kept) == 3
    del b, d, e


def test_the_bound_is_a_quarter_of_this_machines_memory_and_at_least_512_mib(monkeypatch):
    monkeypatch.setattr(pool, "_MAX_KEPT", [])
    monkeypatch.setattr(pool, "_MEMORY", [64 << 30])
    assert pool.max_kept() == 16 << 30
    monkeypatch.setattr(pool, "_MAX_KEPT", [])
    monkeypatch.setattr(pool, "_MEMORY", [1 << 30])
    assert pool.max_kept() == 512 << 20


def test_a_buffer_goes_once_unused_for_the_idle_time():
    a = pool.empty((BIG,), np.float64)
    pool._kept[0].used -= 10 * pool._IDLE  # long ago
    pool._let_go_idle()
    assert len(pool._kept) == 1  # in use: kept, however long, and its idle time starts again
    del a
    pool._let_go_idle()
    assert len(pool._kept) == 1  # unused only since the last look
    pool._kept[0].used -= 10 * pool._IDLE
    pool._let_go_idle()
    assert not pool._kept


def test_letting_buffers_go_returns_the_heaps_free_memory(monkeypatch):
    returns: list[int] = []
    monkeypatch.setattr(malloc, "return_free", lambda: returns.append(len(pool._kept)))
    a = pool.empty((BIG,), np.float64)
    del a
    pool._let_go_idle()
    assert returns == []  # none went
    pool._kept[0].used -= 10 * pool._IDLE
    pool._let_go_idle()
    assert returns == [0]  # after the buffer went


def test_the_time_a_large_op_runs_does_not_count_as_idle():
    a = pool.empty((BIG,), np.float64)
    del a
    with own_threads():  # a large op (it takes the BLAS limit), as er.matmul's
        assert pool._ops == 1
        pool._kept[0].used -= 10 * pool._IDLE  # unused since long ago, but an op runs
        pool._let_go_idle()
        assert len(pool._kept) == 1
        pool._kept[0].used -= 10 * pool._IDLE
    assert pool._ops == 0
    pool._let_go_idle()
    assert len(pool._kept) == 1  # its idle time counts from the op's end
    pool._kept[0].used -= 10 * pool._IDLE
    pool._let_go_idle()
    assert not pool._kept


def test_an_op_that_fails_to_start_leaves_no_op_running(monkeypatch):
    def fail() -> bool:
        raise KeyboardInterrupt
    monkeypatch.setattr(malloc, "hold", fail)
    with pytest.raises(KeyboardInterrupt):
        with own_threads():
            pass
    assert pool._ops == 0
    with own_threads(limit=False):  # a small op pauses nothing
        assert pool._ops == 0


def test_the_thread_lets_buffers_go_and_stops_when_none_is_kept(monkeypatch):
    monkeypatch.setattr(pool, "_IDLE", 0.05)
    a = pool.empty((BIG,), np.float64)
    assert pool._reaper_pid != 0
    del a
    deadline = time.monotonic() + 10  # (a thread started earlier may still sleep the old idle time)
    while (pool._kept or pool._reaper_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pool._kept and pool._reaper_pid == 0
    b = pool.empty((BIG,), np.float64)  # a new buffer starts the thread again
    assert len(pool._kept) == 1 and pool._reaper_pid != 0
    del b


def test_threads_never_get_one_buffer_twice():
    got: list[np.ndarray] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(20):
            a = pool.empty((BIG,), np.float64)
            with lock:
                got.append(a)
                if len(got) > 6:
                    got.pop(0)
    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every pair of arrays alive at the end is apart; no more buffers than arrays ever alive at
    # once: seven in the list (one more before the pop) and each thread's last one.
    assert all(not np.shares_memory(x, y) for i, x in enumerate(got) for y in got[i + 1:])
    assert len(pool._kept) <= 7 + 4


def test_a_result_is_not_overwritten_by_later_ops_and_its_buffers_are_reused_once_gone():
    rng = np.random.default_rng(2)

    def operands() -> tuple[np.ndarray, np.ndarray]:
        return (rng.standard_normal((1500, 8)).astype(np.float16),
                rng.standard_normal((8, 1500)).astype(np.float16))
    first = er.matmul(*operands())
    kept = [np.array(getattr(first._parts[0], name)) for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance")]
    assert pool._kept, "the case was meant to be large enough for the pool"
    buffers = len(pool._kept)
    second = er.matmul(*operands())
    for name, value in zip(("rounded", "x_lo", "x_hi", "lo", "hi", "tolerance"), kept):
        np.testing.assert_array_equal(getattr(first._parts[0], name), value)
        assert not np.shares_memory(getattr(first._parts[0], name), getattr(second._parts[0], name))
    assert len(pool._kept) == 2 * buffers
    del first
    third = er.matmul(*operands())  # first's buffers
    assert len(pool._kept) == 2 * buffers
    assert third.covers(third.rounded).all() and second.covers(second.rounded).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_takes_buffers_though_the_lock_was_held_at_the_fork():
    a = pool.empty((BIG,), np.float64)
    with pool._lock:  # held by this thread at the fork: the child gets a new one
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                b = pool.empty((BIG,), np.float64)
                code = 0 if pool._reaper_pid == os.getpid() and not np.shares_memory(a, b) else 2
            finally:
                os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung on the pool's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_an_attention_result_keeps_its_first_pass_while_later_calls_reuse_memory(monkeypatch):
    # The forward's arrays (the first pass, which the backward reads) stay in use while the Result
    # lives; a second call's arrays are other buffers.  Checked against the same calls with nothing
    # kept (a bound of 0 bytes): the values must be the same, bit for bit.
    rng = np.random.default_rng(3)
    shape = (1, 2, 512, 16)  # 2 x 512 x 512 float64 weights: 4 MiB, the smallest size kept

    def draw() -> list[np.ndarray]:
        return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    first, second = draw(), draw()

    def run() -> list[np.ndarray]:
        one = er.scaled_dot_product_attention(*first[:3])
        two = er.scaled_dot_product_attention(*second[:3])
        grads = one.backward(first[3])  # after the second call took its arrays
        two.backward(second[3])
        parts = [one, *(grads[name] for name in ("grad_query", "grad_key", "grad_value"))]
        return [np.array(getattr(p, a)) for p in parts for a in ("rounded", "tolerance")]
    kept = run()
    assert len(pool._kept) >= 8, "the case was meant to be large enough for the pool"
    monkeypatch.setattr(pool, "_MAX_KEPT", [0])
    pool.clear()
    fresh = run()
    assert not pool._kept
    for a, b in zip(kept, fresh):
        np.testing.assert_array_equal(a, b)


def _tree(tmp_path, proc_text, files):
    """A fake /proc/self/cgroup holding ``proc_text``, and a cgroup mount holding ``files``."""
    proc = tmp_path / "cgroup"
    proc.write_text(proc_text)
    root = tmp_path / "fs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(proc), str(root)


@pytest.mark.parametrize("proc_text, files, expected", [
    # cgroup v2: the lowest limit on the way up; "max" is no limit.
    ("0::/a/b\n", {"a/b/memory.max": "max\n", "a/memory.max": "2147483648\n"}, 2 << 30),
    ("0::/a/b\n", {"a/b/memory.max": "1073741824\n", "a/memory.max": "2147483648\n"}, 1 << 30),
    ("0::/a\n", {"a/memory.max": "max\n"}, None),
    # v2 mounted under unified/ beside v1's controllers (hybrid).
    ("4:memory:/c\n0::/c\n", {"unified/c/memory.max": "3221225472\n"}, 3 << 30),
    # cgroup v1: the memory controller's line; no limit is a huge number.
    ("5:cpu:/x\n4:memory:/c\n", {"memory/c/memory.limit_in_bytes": "536870912\n"}, 512 << 20),
    ("4:memory:/c\n", {"memory/c/memory.limit_in_bytes": "9223372036854771712\n"}, None),
    ("4:cpu,memory:/c\n", {"memory/c/memory.limit_in_bytes": "536870912\n"}, 512 << 20),
    # In a container the path may not exist under the mount, whose root is its own cgroup.
    ("4:memory:/host/path\n", {"memory/memory.limit_in_bytes": "4294967296\n"}, 4 << 30),
    ("0::/host/path\n", {"memory.max": "4294967296\n"}, 4 << 30),
    # Nothing readable.
    ("4:memory:/c\n", {}, None),
    ("garbage\n", {"memory.max": "oops\n"}, None),
])
def test_the_cgroup_limit_is_the_lowest_on_the_way_up(tmp_path, proc_text, files, expected):
    assert pool.cgroup_limit(*_tree(tmp_path, proc_text, files)) == expected


def test_without_a_proc_file_there_is_no_cgroup_limit(tmp_path):
    assert pool.cgroup_limit(str(tmp_path / "absent"), str(tmp_path)) is None


@pytest.mark.parametrize("limit, expected", [(None, 64 << 30), (2 << 30, 2 << 30), (128 << 30, 64 << 30)])
def test_the_memory_an_op_may_use_is_the_lower_of_the_machines_and_the_cgroups(monkeypatch, limit, expected):
    monkeypatch.setattr(pool, "_MEMORY", [])
    monkeypatch.setattr(pool.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 << 20}[name])
    monkeypatch.setattr(pool, "cgroup_limit", lambda: limit)
    assert pool.physical_memory() == expected
