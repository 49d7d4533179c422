"""While a large op runs, glibc's malloc keeps the memory that numpy frees, to hand it out again.

Why: an op works in blocks of about 1 MiB per array (exactref/_parallel.py),
and each numpy temporary is a fresh allocation.  glibc serves allocations of
that size by mmap, or from the top of its heap, which it trims whenever more
than a few MiB lie free there; so many temporaries come back as new pages,
which the kernel faults in and zeroes one by one.  Measured on 2 cores
(medians, each in a fresh process): three temporaries per 1 MiB block over
32 MiB took 11.7-12.3 ms, against 8.7 ms with the memory kept; a float32
512^3 matmul 28-35 ms, against 18-19 ms.  At 1024^3 and 2048^3 the
difference was within the noise, and the peak resident memory the same.

So the outermost large op (the one that limits the BLAS threads,
exactref/_threads.py) raises glibc's trim and mmap thresholds, and the last
op to leave sets them to the values glibc's own dynamic thresholds grow to
once a program frees a 32 MiB array (mmap 32 MiB, trim twice that): glibc
then gives back what lies free above 64 MiB at the next free.  (With an
explicit ``malloc_trim(0)`` at the end as well, a float32 512^3 matmul took
29-32 ms instead of 17-23 ms: the next op faulted its pages in again.)
``python benchmarks/bench_matmul.py --no-malloc-hold`` runs without it.

Larger arrays than 32 MiB (glibc's largest mmap threshold) are always mapped
afresh and unmapped when freed: attention at 1x8x1024x64 makes and frees
about 3 GiB of them in a forward and backward, each page faulted in and
zeroed again.  So while an op runs mmap is off (``M_MMAP_MAX`` 0) and they
come from the heap too, reused as they are freed.  On 2 cores the float32
forward and backward took 3.09-3.30 s with ``MALLOC_MMAP_MAX_=0`` set for the
whole process against 4.14-4.68 s without (the same tree, four alternating
processes), and 3.10-3.37 s with this hold against 4.71-4.97 s for the tree
before it and the change to the first pass's gradients (three).  Afterwards
mmap is back, and once no large op has run for ``_TRIM_AFTER`` seconds, if
more than 256 MiB lie free in the heap, ``malloc_trim(0)`` returns them to
the system, and so it does when exactref/_pool.py lets kept buffers go while
no op runs (:func:`return_free`); below that they stay for the next op, as
above.  A process at 267 MB before a float32 1x8x1024x64 attention forward
and backward held 2.5 GB after it and 270-295 MB within 4 s of deleting the
Result; with the trim at the end of each op and none when the buffers went,
2.1 GB stayed.  Not at the op's end: an attention backward right after
its forward, or the next call of a loop, faulted them all in again.  On 2
cores, alternating in one process (medians), a float32 1x8x1024x64 forward
and backward took 2.39 s against 2.51 s with the trim at the end of each op
(eight calls each), a float16 1x4x2048x128 one 4.10 s against 4.32 s (six),
its system time 0.59 s against 0.89 s.  A timer thread (a daemon) waits; an op
inside when it comes due puts it off until that op has left.

glibc has no way to read the thresholds, so where the user has set them
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_MMAP_MAX_``,
``MALLOC_TOP_PAD_`` or a ``glibc.malloc`` tunable) ExactRef leaves malloc alone, as it does on
any other C library.

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
for every array of 4 MiB or more.  Where the kernel's THP ``defrag`` setting
is ``madvise`` (the default of many distributions), a page fault in such a
region compacts memory then and there, to find a free 2 MiB page.  While an
op runs the hold turns that advice off, and the last op to leave restores
numpy's setting as it found it.  On 2 cores (THP ``madvise``), alternating
in one process, medians: a float32 1x8x1024x64 attention forward and
backward took 2.05 s without the advice against 2.11 s with it (system time
0.31 against 0.37 s, eight calls each); a float16 1x4x2048x128 one 3.93 and
4.14 s against 4.14 and 4.18 s (system time 0.55-0.61 against 0.93-0.95 s,
two runs of six and eight).  Matmuls did not change beyond the noise:
float32 1024^3 47.6 against 47.7 ms, float16 2048^3 299 and 308 against 294
and 305 ms, float64 2048^3 1.17 against 1.13 and 1.16 s.  Where the user
has chosen with ``NUMPY_MADVISE_HUGEPAGE``, the advice is left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["hold", "release", "return_free"]

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_MAX_DEFAULT = 65536  # glibc's DEFAULT_MMAP_MAX
# While an op runs: keep up to 1 GiB free, and take blocks below 32 MiB (mmap's largest
# threshold on 64-bit glibc) from the heap.
_HELD_TRIM = 1 << 30
_MMAP = 32 << 20
# Afterwards: where glibc's dynamic thresholds end up once a program frees a 32 MiB array.
_AFTER_TRIM = 2 * _MMAP

# Once no large op has run for _TRIM_AFTER seconds, malloc_trim returns the heap's free memory
# if more than _RETURN_FREE of it lies free (see above).
_RETURN_FREE = 256 << 20
_TRIM_AFTER = 2.0

_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")

# Off in tests and benchmarks that compare the two.
_enabled = True

_lock = threading.Lock()
_count = 0  # ops inside hold(), all threads together
_libc: Any = None  # ctypes' libc, False where malloc is left alone
_advice: bool | None = None  # numpy's huge-page advice before the first hold, restored by the last release
_last_release = 0.0  # time.monotonic() of the last release that left no op inside
_trimmer: threading.Timer | None = None  # the pending trim, if one is


def _glibc() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        user = any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get(
            "GLIBC_TUNABLES", "")
        if not user and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None)
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                if hasattr(libc, "mallinfo2"):
                    libc.mallinfo2.restype = _Info
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc


class _Info(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33 and later).
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _free_bytes(libc: Any) -> int:
    """Bytes free in the main arena (mallinfo2's fordblks); without mallinfo2, as if many."""
    info = getattr(libc, "mallinfo2", None)
    return 1 << 62 if info is None else int(info().fordblks)


def _huge_page_switch() -> Callable[[bool], bool] | None:
    """numpy's switch of its huge-page advice (it returns the setting it replaces), or None where
    numpy has none or the user chose the setting (``NUMPY_MADVISE_HUGEPAGE``)."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return None
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    return getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)


def hold() -> bool:
    """Keep freed memory for reuse, with numpy's huge-page advice off, until :func:`release`, which
    the caller owes if this returns True (the calls of all threads are counted)."""
    global _count, _advice
    if not _enabled:
        return False
    with _lock:
        _count += 1
        if _count == 1 and (switch := _huge_page_switch()) is not None:
            _advice = switch(False)
        if _count == 1 and (libc := _glibc()):
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP)
            libc.mallopt(_M_TRIM_THRESHOLD, _HELD_TRIM)
            libc.mallopt(_M_MMAP_MAX, 0)
    return True


def release() -> None:
    """Undo one :func:`hold` that returned True; the last sets the thresholds and numpy's huge-page
    advice back and returns the kept memory."""
    global _count, _advice
    with _lock:
        if _count == 0:
            return
        _count -= 1
        if _count > 0:
            return
        if _advice is not None and (switch := _huge_page_switch()) is not None:
            switch(_advice)
        _advice = None
        if libc := _glibc():
            libc.mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
            libc.mallopt(_M_TRIM_THRESHOLD, _AFTER_TRIM)
            _trim_later()


def _trim_later() -> None:
    """Have the heap's free memory returned once no large op has run for _TRIM_AFTER seconds
    (called under the lock, by the last release)."""
    global _last_release, _trimmer
    _last_release = time.monotonic()
    if _trimmer is None:
        _trimmer = _timer(_TRIM_AFTER)


def _trim_if_idle() -> None:
    """The pending trim: ``malloc_trim(0)`` if no op is inside and none has left for _TRIM_AFTER
    seconds and more than _RETURN_FREE lie free; else wait for the rest of that time."""
    global _trimmer
    with _lock:
        _trimmer = None
        if _count > 0:
            return  # that op's last release waits again
        wait = _last_release + _TRIM_AFTER - time.monotonic()
        if wait > 0:
            _trimmer = _timer(wait)
            return
        _trim()


def _timer(wait: float) -> threading.Timer:
    """A started daemon timer that calls :func:`_trim_if_idle` in ``wait`` seconds."""
    timer = threading.Timer(wait, _trim_if_idle)
    timer.daemon = True
    timer.start()
    return timer


def return_free() -> None:
    """Return the heap's free memory to the system now, if more than _RETURN_FREE lies free and no
    op is inside: for exactref/_pool.py, once it has let buffers go while no op runs."""
    with _lock:
        if _count == 0:
            _trim()


def _trim() -> None:
    """``malloc_trim(0)`` where more than _RETURN_FREE lies free (called under the lock)."""
    libc = _glibc() if _enabled else False
    if libc and _free_bytes(libc) > _RETURN_FREE:
        libc.malloc_trim(0)


def _after_fork_in_child() -> None:
    """The child has none of the parent's threads: neither their ops nor the pending trim.  What
    ops of the parent were holding (they never release here) is set back as their release would."""
    global _lock, _count, _advice, _trimmer
    _lock = threading.Lock()  # (one held by another thread at the fork stays held in the child)
    _trimmer = None
    if _count > 0:
        _count = 1
        release()
    _advice = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

