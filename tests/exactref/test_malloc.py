"""While a large op runs, glibc's malloc keeps freed memory (exactref/_malloc.py).

The thresholds are read from a stand-in for libc, which records every
``mallopt``; one test reads glibc's own statistics (``mallinfo2``) in a
fresh interpreter, independently of the code under test.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import exactref as er
import exactref._malloc as malloc
import exactref._threads as threads

MMAP, TRIM, MMAP_MAX = -3, -1, -4  # mallopt's parameter numbers, from glibc's malloc.h
HELD = [(MMAP, 32 << 20), (TRIM, 1 << 30), (MMAP_MAX, 0)]
AFTER = [(MMAP_MAX, 65536), (TRIM, 64 << 20)]


class FakeLibc:
    """Records mallopt and malloc_trim calls; ``free`` is what mallinfo2 reports free."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.trims: list[float] = []  # time.monotonic() of each malloc_trim
        self.free = 0

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("trim", pad))
        self.trims.append(time.monotonic())
        return 1

    def mallinfo2(self):
        return malloc._Info(fordblks=self.free)


class FakeSwitch:
    """Stands for numpy's switch of its huge-page advice: records each setting, returns the one before."""

    def __init__(self, advice: bool) -> None:
        self.advice = advice
        self.calls: list[bool] = []

    def __call__(self, enabled: bool) -> bool:
        self.calls.append(enabled)
        before, self.advice = self.advice, enabled
        return before


@pytest.fixture
def switch(monkeypatch):
    fake = FakeSwitch(True)
    monkeypatch.setattr(malloc, "_huge_page_switch", lambda: fake)
    return fake


@pytest.fixture
def libc(monkeypatch, switch):
    fake = FakeLibc()
    monkeypatch.setattr(malloc, "_libc", fake)
    monkeypatch.setattr(malloc, "_count", 0)
    monkeypatch.setattr(malloc, "_advice", None)
    monkeypatch.setattr(malloc, "_enabled", True)
    monkeypatch.setattr(malloc, "_TRIM_AFTER", 0.05)
    yield fake
    _settle()  # no pending trim outlives the test


def _settle(limit: float = 5.0) -> None:
    """Wait until no trim is pending (each pending one decides within _TRIM_AFTER)."""
    deadline = time.monotonic() + limit
    while malloc._trimmer is not None:
        assert time.monotonic() < deadline, "a pending trim never ran"
        time.sleep(0.01)


def test_hold_raises_the_thresholds_and_release_lowers_the_trim_one(libc):
    assert malloc.hold()
    assert libc.calls == HELD
    malloc.release()
    assert libc.calls == HELD + AFTER


@pytest.mark.parametrize("free, trimmed", [(256 << 20, False), ((256 << 20) + 1, True)])
def test_the_heaps_free_memory_past_256_mib_goes_back_once_no_op_has_run_for_a_while(libc, free, trimmed):
    assert malloc.hold()
    libc.free = free
    start = time.monotonic()
    malloc.release()  # not at once: the next op would fault that memory in again
    _settle()
    assert libc.calls == HELD + AFTER + ([("trim", 0)] if trimmed else [])
    assert all(t - start >= malloc._TRIM_AFTER for t in libc.trims)


def test_an_op_within_the_wait_puts_the_trim_off_until_it_too_has_left(libc):
    libc.free = 1 << 30
    assert malloc.hold()
    malloc.release()
    assert malloc.hold()  # inside when the pending trim comes due: it does nothing
    time.sleep(3 * malloc._TRIM_AFTER)
    assert libc.trims == []
    start = time.monotonic()
    malloc.release()
    _settle()
    assert libc.calls == (HELD + AFTER) * 2 + [("trim", 0)]
    assert libc.trims[0] - start >= malloc._TRIM_AFTER


@pytest.mark.parametrize("free, inside, trimmed", [
    ((256 << 20) + 1, False, True),
    (256 << 20, False, False),
    ((256 << 20) + 1, True, False),  # an op inside uses the heap's free memory
])
def test_return_free_trims_past_256_mib_when_no_op_is_inside(libc, free, inside, trimmed):
    if inside:
        assert malloc.hold()
    libc.calls.clear()
    libc.free = free
    malloc.return_free()
    assert libc.calls == ([("trim", 0)] if trimmed else [])
    if inside:
        malloc.release()


def test_a_later_release_within_the_wait_moves_the_trim_after_it(libc):
    libc.free = 1 << 30
    assert malloc.hold()
    malloc.release()
    time.sleep(malloc._TRIM_AFTER / 2)
    assert malloc.hold()
    start = time.monotonic()
    malloc.release()  # the pending trim waits for the rest of the time since this one
    _settle()
    assert len(libc.trims) == 1 and libc.trims[0] - start >= malloc._TRIM_AFTER


def test_nested_holds_set_the_thresholds_once(libc):
    assert malloc.hold() and malloc.hold()
    malloc.release()
    assert libc.calls == HELD
    malloc.release()
    assert libc.calls == HELD + AFTER
    malloc.release()  # one too many: nothing happens
    assert libc.calls == HELD + AFTER


def test_holds_in_two_threads_are_counted_together(libc):
    inside, leave = threading.Barrier(2), threading.Event()

    def worker() -> None:
        malloc.hold()
        inside.wait()
        leave.wait()
        malloc.release()

    t = threading.Thread(target=worker)
    t.start()
    malloc.hold()
    inside.wait()
    malloc.release()
    assert libc.calls == HELD  # the other thread is still inside
    leave.set()
    t.join()
    assert libc.calls == HELD + AFTER


def test_disabled_it_holds_nothing(libc, switch, monkeypatch):
    monkeypatch.setattr(malloc, "_enabled", False)
    assert not malloc.hold()
    assert libc.calls == [] and switch.calls == []


@pytest.mark.parametrize("advice", [True, False])
def test_the_first_hold_turns_numpys_huge_page_advice_off_and_the_last_release_restores_it(
        libc, switch, advice):
    switch.advice = advice
    assert malloc.hold() and malloc.hold()
    assert switch.calls == [False] and switch.advice is False
    malloc.release()
    assert switch.calls == [False]  # the other hold is still inside
    malloc.release()
    assert switch.calls == [False, advice] and switch.advice is advice
    malloc.release()  # one too many: nothing happens
    assert switch.calls == [False, advice]


def test_a_child_forked_inside_an_op_sets_back_what_the_op_held(libc, switch):
    assert malloc.hold() and malloc.hold()  # two of the parent's ops inside
    malloc._after_fork_in_child()
    assert malloc._count == 0 and switch.advice is True
    assert libc.calls == HELD + AFTER  # the thresholds set back once
    malloc._after_fork_in_child()  # forked while no op was inside: nothing to set back
    assert libc.calls == HELD + AFTER and switch.calls == [False, True]


def test_a_users_huge_page_setting_leaves_the_advice_alone(monkeypatch):
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    assert malloc._huge_page_switch() is None


def _numpy_switch():
    """numpy's own switch (numpy.core in numpy 1, numpy._core in 2)."""
    core = np._core if hasattr(np, "_core") else np.core
    return core.multiarray._set_madvise_hugepage


def _numpy_advice() -> bool:
    """numpy's huge-page advice now, read through its own switch (set back at once)."""
    before = _numpy_switch()(False)
    _numpy_switch()(before)
    return before


@pytest.mark.parametrize("advice", [True, False])
def test_a_large_op_runs_without_numpys_huge_page_advice_and_leaves_it_as_it_was(monkeypatch, advice):
    from exactref.engine import sumprod
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.setattr(malloc, "_enabled", True)
    seen: list[bool] = []
    real = sumprod._solve_block

    def solve_block(*args):
        seen.append(_numpy_advice())
        return real(*args)
    monkeypatch.setattr(sumprod, "_solve_block", solve_block)
    before = _numpy_switch()(advice)
    try:
        er.matmul(BIG, BIG)
        assert seen and not any(seen)
        assert _numpy_advice() is advice
    finally:
        _numpy_switch()(before)


@pytest.mark.parametrize("name, value", [
    ("MALLOC_TRIM_THRESHOLD_", "1000000"),
    ("MALLOC_MMAP_MAX_", "0"),
    ("MALLOC_MMAP_THRESHOLD_", "1000000"),
    ("MALLOC_TOP_PAD_", "0"),
    ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000"),
])
def test_a_users_malloc_setting_leaves_malloc_alone(monkeypatch, name, value):
    monkeypatch.setattr(malloc, "_libc", None)
    monkeypatch.setenv(name, value)
    assert malloc._glibc() is False


def test_other_tunables_do_not_count_as_a_malloc_setting(monkeypatch):
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    monkeypatch.setattr(malloc, "_libc", None)
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert malloc._glibc()


BIG = np.linspace(-1.0, 1.0, 4096, dtype=np.float32).reshape(64, 64)


@pytest.mark.parametrize("large", [True, False])
def test_an_op_holds_once_and_releases_even_when_it_raises(libc, monkeypatch, large):
    if not large:
        monkeypatch.setattr(threads, "_SMALL", 1 << 40)
    res = er.matmul(BIG, BIG)
    res.backward(BIG)
    assert libc.calls == ((HELD + AFTER) * 2 if large else [])
    libc.calls.clear()
    with pytest.raises(ValueError):
        er.matmul(BIG, BIG[:3])
    assert malloc._count == 0
    assert libc.calls in ([], HELD + AFTER)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_glibc_serves_4_and_64_mib_arrays_from_the_heap_only_while_held():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")
    code = textwrap.dedent("""
        import ctypes
        import numpy as np
        from exactref import _malloc

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = Info

        def mmapped_for_4_mib():
            before = libc.mallinfo2().hblkhd
            a = np.ones(1 << 19)
            during = libc.mallinfo2().hblkhd
            del a
            return during - before

        print(mmapped_for_4_mib() >= 4 << 20)
        assert _malloc.hold()
        print(mmapped_for_4_mib() >= 4 << 20)
        a = np.ones(1 << 19)
        del a
        print(libc.mallinfo2().fordblks >= 4 << 20)
        before = libc.mallinfo2().hblkhd
        big = [np.ones(1 << 23) for _ in range(5)]  # 5 x 64 MiB: past mmap's largest threshold
        print(libc.mallinfo2().hblkhd == before)
        del big
        _malloc._TRIM_AFTER = 600.0  # (the wait itself is tested with a stand-in libc)
        _malloc.release()
        print(libc.mallinfo2().fordblks >= 256 << 20)  # kept for a while, for the next op
        _malloc.return_free()  # what the wait ends in, or the pool's letting buffers go
        print(libc.mallinfo2().fordblks < 64 << 20)  # more than 256 MiB were free: returned
    """)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "False", "True", "True", "True", "True"]
