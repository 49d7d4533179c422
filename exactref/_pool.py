"""Large arrays come from buffers kept, for a few seconds, from arrays no longer used.

Why: a Result keeps about eight arrays of its output's shape, and the op's
own float64 copies of its operands; a large op's are fresh memory, which the
kernel faults in and zeroes page by page as they are first written (at
2048 x 2048, about 260 MB).  glibc keeps none of it for the next op: such
arrays are mapped afresh, or trimmed from the heap's top as soon as they are
freed (exactref/_malloc.py keeps memory only while an op runs).  On 2 cores
of a VM, each call right after a torch float64 matmul of the same size
(which took 194 to 208 ms), medians of 8 to 12 calls of each kind,
alternating in one process: a float16 2048^3 matmul took 459 ms with fresh
arrays, 404 ms with its Result's arrays reused and 386 ms with its operands'
copies reused as well; bfloat16 509, 424 and 411 ms; float32 628, 428 and
416 ms.

So :func:`empty` hands out a view of a kept buffer that nothing else uses,
or of a new one, kept in turn.  Every view of a buffer holds a reference to
it (numpy's ``base``), so a buffer that the pool alone references is used
by no array: its reference count says so.  At most :func:`max_kept` bytes
are kept, buffers in use included (a quarter of this machine's memory, and
at least 512 MiB): to keep a new buffer past it, the unused buffers of
other sizes are let go first, the longest unused first.  A buffer that has
been unused for ``_IDLE`` seconds while no large op ran is let go (a
thread checks every ``_IDLE`` seconds while any is kept, and stops when
none is), so memory a deleted Result held is freed within twice that time
of the last op, and returned to the system (exactref/_malloc.py's
``return_free``: the buffers came from malloc's heap).  The time an op
runs does not count: a float16 1x4x2048x128 attention forward takes about
3 s, so the arrays only its backward uses went between one call's backward
and the next's, and were faulted in again.  Keeping them cut the kernel's
time per call from 1.1-2.5 s to 0.8-1.5 s (three alternating pairs of
processes, three calls each); the wall time, 7.2-8.0 s against 7.3-7.9 s,
moved within the noise.  :func:`clear` lets every unused buffer go at once.

Attention's working arrays come from here too.  A float32 1x8x1024x64
forward and backward makes about 2 GB of them, in arrays of a few sizes,
and frees most of them within the call; fresh, their pages cost 1.4 to 2.7
s of the kernel's time per call, zeroing them.  On 2 cores, medians of four
calls in three alternating pairs of processes: 3.20, 3.53 and 4.11 s a call
with the arrays kept, against 3.54, 4.00 and 4.42 s without (the kernel's
time 0.4 to 1.5 s).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

import numpy as np

from . import _malloc

__all__ = ["cgroup_limit", "clear", "empty", "max_kept", "op_ended", "op_started", "physical_memory"]

# Only arrays at least this large.  A float32 1024^3 matmul (arrays of 8 MiB) took 63-64 ms with
# them reused against 71-73 without; at 512^3 (2 MiB, which glibc's heap keeps) no difference.
_MIN_BYTES = 4 << 20
# At least this much may be kept, buffers in use included: two Results of a 2048 x 2048 matmul.
_MIN_KEPT = 512 << 20
# Seconds a buffer may stay unused before it is let go.
_IDLE = 2.0

_lock = threading.Lock()
_kept: list[_Buffer] = []
_MEMORY: list[int] = []  # this machine's memory, once read
_MAX_KEPT: list[int] = []  # max_kept(), once computed (a test may set it)
_ops = 0  # large ops running now, all threads together (exactref/_threads.py)
_reaper_pid = 0  # the process whose reaper thread runs (a forked child starts its own)


class _Buffer:
    __slots__ = ("data", "used")

    def __init__(self, nbytes: int) -> None:
        self.data = np.empty(nbytes, dtype=np.uint8)
        self.used = time.monotonic()


def _free(buf: _Buffer) -> bool:
    """Whether no array uses ``buf``: its data is referenced by the buffer alone."""
    # (getrefcount counts its own argument: the buffer's reference and that one.)
    return sys.getrefcount(buf.data) <= _FREE_COUNT


def _count_of_unused() -> int:
    probe = _Buffer(0)
    return sys.getrefcount(probe.data)


_FREE_COUNT = _count_of_unused()


def physical_memory() -> int:
    """The memory this process may use, in bytes: the machine's, or its cgroup's limit where lower.

    16 GiB where neither can be read.  A container's limit is what the
    kernel's out-of-memory killer enforces: a guard that measured the host's
    memory alone would let an op start that the container cannot hold.
    """
    if not _MEMORY:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            have = 16 << 30
        limit = cgroup_limit()
        _MEMORY.append(have if limit is None else min(have, limit))
    return _MEMORY[0]


def cgroup_limit(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors, or None if there is none.

    Reads cgroup v2's ``memory.max`` and v1's ``memory.limit_in_bytes``.  In
    a container, /proc/self/cgroup may name a path outside the mounted tree,
    whose root is then the container's own cgroup: it is read too.
    """
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2's unified hierarchy
            limits += _limits_up(os.path.join(root, "unified"), path, "memory.max")
            limits += _limits_up(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_up(os.path.join(root, "memory"), path, "memory.limit_in_bytes")
    return min(limits, default=None)


def _limits_up(mount: str, path: str, name: str) -> list[int]:
    """The limits in file ``name`` of the cgroup at ``path`` under ``mount``, its ancestors and the mount's root."""
    parts = [p for p in path.split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        try:
            with open(os.path.join(mount, *parts[:depth], name)) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        # "max" is v2's no limit; v1 writes no limit as a huge page-rounded number.
        if text.isdigit() and int(text) < 1 << 60:
            found.append(int(text))
    return found


def max_kept() -> int:
    """The most bytes the pool keeps, buffers in use included."""
    if not _MAX_KEPT:
        _MAX_KEPT.append(max(_MIN_KEPT, physical_memory() // 4))
    return _MAX_KEPT[0]


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """``np.empty(shape, dtype)``; a large one is a view of a kept buffer that no array uses."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    with _lock:
        for buf in _kept:
            # The same size only: a larger buffer would hold memory no array uses.
            if buf.data.size == nbytes and _free(buf):
                buf.used = time.monotonic()
                return buf.data.view(dtype).reshape(shape)  # (made under the lock: now in use)
        if not _make_room(nbytes):
            return np.empty(shape, dtype=dtype)
        buf = _Buffer(nbytes)
        _kept.append(buf)
        _start_reaper()
        return buf.data.view(dtype).reshape(shape)


def _make_room(nbytes: int) -> bool:
    """Whether a new buffer of ``nbytes`` can be kept, after letting unused buffers go, the longest
    unused first, as far as it needs (called under the lock)."""
    room = max_kept() - sum(b.data.size for b in _kept)
    if room >= nbytes:
        return True
    unused = sorted((b for b in _kept if _free(b)), key=lambda b: b.used)
    if room + sum(b.data.size for b in unused) < nbytes:
        return False  # (then none is let go: the buffers in use alone leave no room)
    gone = set()
    for b in unused:
        if room >= nbytes:
            break
        room += b.data.size
        gone.add(id(b))
    _kept[:] = [b for b in _kept if id(b) not in gone]
    return True


def clear() -> None:
    """Let go every kept buffer that no array uses."""
    with _lock:
        _kept[:] = [b for b in _kept if not _free(b)]


def op_started() -> None:
    """A large op begins: until it ends, no buffer's idle time counts."""
    global _ops
    with _lock:
        _ops += 1


def op_ended() -> None:
    """A large op that :func:`op_started` began ends: idle times count from now."""
    global _ops
    with _lock:
        _ops = max(_ops - 1, 0)
        now = time.monotonic()
        for b in _kept:
            b.used = now


def _let_go_idle() -> None:
    """Let go the buffers unused for ``_IDLE`` seconds while no large op ran."""
    now = time.monotonic()
    with _lock:
        for b in _kept:
            if _ops or not _free(b):
                b.used = now  # in use, or an op runs: its idle time starts later
        count = len(_kept)
        _kept[:] = [b for b in _kept if now - b.used < _IDLE]
        gone = len(_kept) < count
    if gone:
        # Their memory now lies free in malloc's heap, where an op took it from: return it.
        _malloc.return_free()


def _start_reaper() -> None:
    """Start the thread that lets idle buffers go, unless it runs (called under the lock)."""
    global _reaper_pid
    if _reaper_pid == os.getpid():
        return
    _reaper_pid = os.getpid()
    threading.Thread(target=_reap, name="exactref-pool", daemon=True).start()


def _after_fork_in_child() -> None:
    # A lock held by another thread at the fork stays held in the child: a new one.  (Its
    # kept buffers are its own copies; _reaper_pid, the parent's, makes it start its own thread.)
    global _lock, _ops
    _lock = threading.Lock()
    _ops = 0  # (the ops of other threads, which the child has not)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reap() -> None:
    global _reaper_pid
    while True:
        time.sleep(_IDLE)
        _let_go_idle()
        with _lock:
            # (Under the lock, as empty() keeps a buffer: one kept from now on starts a new thread.)
            if not _kept:
                _reaper_pid = 0
                return
