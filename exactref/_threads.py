"""ExactRef's own calls run numpy's BLAS on one thread and hand the previous limits back afterwards.

Why: OpenBLAS's worker threads keep spinning for a while after each call,
waiting for more work.  ExactRef makes many small and mid-size BLAS calls
between long stretches of single-threaded numpy work, so those spinning
workers take the cores from the thread doing the work, and from torch's
OpenMP threads, and from the other processes.  On 2 shared cores
(benchmarks/bench_threads.py), attention 1x4x256x64 forward and backward
ran 2.4 to 3.7 times faster with one BLAS thread, a float32 512³ matmul
with its backward 1.5 to 2.8 times, and a float32 2048³ matmul, whose
enclosure includes two 2048³ BLAS products, was not slower (4.7 s against
5.3 s); so there is no size above which threads are kept.

The cores are not left idle: the op's independent blocks run side by side
on ExactRef's own threads, as many as the BLAS pool had before the limit
(:func:`width`, exactref/_parallel.py), each calling BLAS on one thread.

Only the BLAS pools are limited: ExactRef runs no OpenMP code of its own,
and limiting torch's OpenMP pool as well measured no further gain.

threadpoolctl's limit reads every library's version and more before it sets
the limit (15 microseconds on 2 cores): so its limiter is kept, and entered
again by the next op while the libraries' threads are still those it saved,
with the limit set again through its controllers (threadpoolctl's own calls,
so that its rule of one thread controlling OpenBLAS holds as before).  Then
an outermost entry's limit costs about 13 microseconds and its restore 5
(22 and 5 with a new limiter each time; right after a torch matmul the limit
took 57 to 73 microseconds so, and 30 to 36 kept); a nested entry well under
one.  Worse, raising the
limit back wakes OpenBLAS's workers, which then spin beside the next op: on
2 shared cores, small matmuls (sides 1 to 8, forward, backward and covers,
benchmarks/bench_matmul.py) ran about 1,100 a second with the limit and
1,900 without.  So an op whose every array argument has at most ``_SMALL``
elements takes no limit (``own_threads(limit=False)``): OpenBLAS runs such
products on the calling thread anyway (it threads a product only above 65536
multiply-adds, and a product of two such arrays has at most 64 * 64), so
there is nothing for the limit to do.  Nor for a sum whose work is one call of
a compiled loop on the calling thread (a full sum of 2**16 to 2**22 float32
values in one C-contiguous array, with numba: ops/reduction.py's
``_needs_limit``), which makes no BLAS call.

OpenBLAS's pthreads pool, numpy's by default, is shared by the whole
process, so one thread at a time owns the limit: the first to enter an op
sets it, and restores it when its outermost op returns or raises
(KeyboardInterrupt included).  Ops entered inside an op, or from other
threads while the owner is inside, change nothing.  threadpoolctl does the
limiting; its controller is built once, on the first op.

torch's OpenMP workers spin too.  After each torch op that ran on several
threads, GNU OpenMP's workers (libgomp, which PyTorch's Linux wheels ship)
wait for the next parallel region by spinning for milliseconds, each on a
core.  A test that calls a torch kernel and then an ExactRef op hands the op
a machine with a core taken: on 2 cores, the two BLAS products of a float32
512³ matmul, on ExactRef's two threads, took 6.5 to 6.7 ms right after
torch's matmul and 3.3 to 3.5 ms on their own.  So before an op first runs
blocks side by side (:func:`release_openmp`, called by exactref/_parallel.py),
it releases the calling thread's idle libgomp workers with OpenMP 5.0's
``omp_pause_resource_all``: they end, and torch's next parallel op starts new
ones, with the same number of threads (on 2 cores a torch float64 512³ matmul
took 2.56 to 2.61 ms so, against 2.51 to 2.53; at 1024³ the cost was up to
1 ms).  In libgomp that call ends the pool of the calling thread alone, and
does nothing inside a parallel region (gomp_pause_host, team.c), so the
pools of other threads are not touched.  Other OpenMP runtimes (LLVM's
libomp, Intel's libiomp5) pause the whole runtime with that call, every
thread's pool at once, so they are left alone.  An op on one thread does not
release them: torch's spinning worker takes one core, and the op has another.
The runtimes are scanned at the first op that runs blocks side by side
(until rescan()), apart from the BLAS scan, so that a torch imported after
ExactRef's first op is seen.
"""

from __future__ import annotations

import ctypes
import threading
from types import TracebackType
from typing import Any

import numpy as np
import threadpoolctl

from . import _malloc, _pool

__all__ = ["own_threads", "release_openmp", "small", "width"]

_BLAS_THREADS = 1
# An op whose array arguments have at most this many elements each takes no limit (see above).
_SMALL = 64

# Off only in benchmarks/bench_threads.py, which compares the two.
_enabled = True
# Off only in the benchmarks' --no-openmp-release, which compares the two.
_release = True
_OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft

_local = threading.local()  # .depth: how many ops this thread is inside; .released: see release_openmp
_lock = threading.Lock()
_owner: int | None = None  # the thread whose outermost op holds the limit
_held: Any = None  # threadpoolctl's limiter of the owner; exiting it restores the limits
_kept: tuple[Any, list[int]] | None = None  # the last limiter, and the threads it saved (see _limit)
_blas: Any = None  # threadpoolctl's controller of the loaded BLAS libraries
_pauses: list[Any] | None = None  # omp_pause_resource_all of each loaded libgomp
_width = 1  # the owner's BLAS threads before its limit: the threads its blocks may use (_parallel)


def _controller() -> Any:
    global _blas
    if _blas is None:
        # Scanning the loaded libraries takes milliseconds: once (until rescan()).  numpy's BLAS,
        # the only one ExactRef calls, is loaded with numpy, so libraries loaded later need not
        # be seen.
        _blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    return _blas


def rescan() -> None:
    """Have the next op scan the loaded BLAS libraries again, so that one ExactRef's own imports
    loaded since (numba imports scipy, which brings its BLAS) is held to the limit like the rest;
    and the OpenMP runtimes, for :func:`release_openmp`."""
    global _blas, _pauses, _kept
    with _lock:
        _blas = _pauses = _kept = None


def _openmp_pauses() -> list[Any]:
    """``omp_pause_resource_all`` of each libgomp loaded (scanned once, until rescan())."""
    global _pauses
    with _lock:
        if _pauses is None:
            found = []
            for lib in threadpoolctl.ThreadpoolController().select(user_api="openmp").lib_controllers:
                pause = getattr(lib.dynlib, "omp_pause_resource_all", None) if lib.prefix == "libgomp" else None
                if pause is not None:
                    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                    found.append(pause)
            _pauses = found
        return _pauses


def release_openmp() -> None:
    """End the calling thread's idle libgomp workers (torch's, spinning since its last op), once per
    outermost op: called before the op's first blocks run side by side (see the module's doc)."""
    if not _release or getattr(_local, "released", False):
        return
    _local.released = True
    for pause in _openmp_pauses():
        pause(_OMP_PAUSE_SOFT)


def _limit() -> None:
    global _owner, _held, _width
    with _lock:
        if _owner is not None:
            return
        blas = _controller()
        threads = [lib.get_num_threads() for lib in blas.lib_controllers]
        before = max([n or 1 for n in threads] + [1])
        if before <= _BLAS_THREADS:
            return  # already single-threaded (OPENBLAS_NUM_THREADS=1, one core): nothing to undo
        held = _limiter(blas, threads)
        held.__enter__()
        _held, _owner, _width = held, threading.get_ident(), before


def _limiter(blas: Any, threads: list[int]) -> Any:
    """threadpoolctl's limiter of the BLAS libraries to _BLAS_THREADS, its limit set (called under
    the lock).  The last one is kept: where the libraries still have the threads it saved, the
    same limiter restores them right, and its limit is set again by each library's controller."""
    global _kept
    if _kept is not None and _kept[1] == threads:
        held = _kept[0]
        for lib in blas.lib_controllers:
            lib.set_num_threads(_BLAS_THREADS)
        return held
    held = blas.limit(limits=_BLAS_THREADS)
    _kept = (held, threads)
    return held


def _restore() -> None:
    global _owner, _held
    with _lock:
        if _owner != threading.get_ident() or _held is None:
            return
        held, _held, _owner = _held, None, None
        held.__exit__(None, None, None)


class _OwnThreads:
    """The context manager :func:`own_threads` returns; it keeps no state of its own, so two serve all."""

    __slots__ = ("_limits",)

    def __init__(self, limits: bool) -> None:
        self._limits = limits

    def __enter__(self) -> None:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0 and self._limits:
            try:
                # While a large op runs, kept buffers do not go for idleness (exactref/_pool.py).
                _pool.op_started()
                _local.pool = True
                # A large op also keeps the memory numpy frees, to reuse it (exactref/_malloc.py).
                _local.malloc = _malloc.hold()
                if _enabled:
                    _limit()
            except BaseException:
                _local.depth = depth
                _restore()
                _release_malloc()
                _end_pool()
                raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.depth -= 1
        if _local.depth == 0:
            _local.released = False
            _restore()
            _release_malloc()
            _end_pool()


def _release_malloc() -> None:
    if getattr(_local, "malloc", False):
        _local.malloc = False
        _malloc.release()


def _end_pool() -> None:
    if getattr(_local, "pool", False):
        _local.pool = False
        _pool.op_ended()


_OWN = _OwnThreads(True)
_SMALL_OP = _OwnThreads(False)


def own_threads(limit: bool = True) -> _OwnThreads:
    """``with own_threads():`` runs the block with numpy's BLAS on one thread, then restores the limits.

    Nested entries cost a few attribute reads and change nothing.  ``limit=False`` (a small op,
    see :func:`small`) sets no limit, and an op nested in it none either.
    """
    return _OWN if limit else _SMALL_OP


def width() -> int:
    """The threads the calling thread's op may use for its blocks (exactref/_parallel.py): the BLAS
    pool's size before the limit, for the thread that holds the limit; 1 for any other thread, and
    where no limit is held (a small op, a single-threaded BLAS, the limit switched off)."""
    return _width if _owner == threading.get_ident() else 1


def small(values: Any) -> bool:
    """Whether every numpy array or torch tensor among ``values`` has at most ``_SMALL`` elements and
    every other value is a Python number, a string or None: such an op's BLAS products run on one
    thread without a limit.  Anything else (a list, another library's array) counts as large."""
    for v in values:
        if isinstance(v, np.ndarray):
            if v.size > _SMALL:
                return False
        elif v is None or isinstance(v, (int, float, complex, str)):
            continue
        elif type(v).__module__.startswith("torch") and hasattr(v, "numel"):
            if v.numel() > _SMALL:
                return False
        else:
            return False
    return True
