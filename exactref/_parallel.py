"""ExactRef's own threads: the independent blocks of one op's work run side by side.

Why: an op limits numpy's BLAS to one thread (exactref/_threads.py), because
OpenBLAS's spinning workers fight the single-threaded numpy work between its
products.  That left every core but one idle on a large op, while the torch
baseline a kernel engineer compares with uses them all.  Instead, an op's
blocks of output rows (and a long sum's blocks of terms) run on up to as
many threads as numpy's BLAS had when the op began, each calling BLAS on its
own thread: the cores are used, and nothing spins.  Both numpy's ufuncs and
its BLAS calls release the GIL on large arrays.

So the user's own setting decides: ``OPENBLAS_NUM_THREADS=1``, or a
``threadpool_limits(1)`` around the call, runs every block on the calling
thread, as before.  An op that takes no BLAS limit (a small op, or with the
limit switched off) runs serially too, so that threaded BLAS calls are never
made from several threads at once.

Blocks are handed out one at a time, so at most ``width()`` blocks are in
memory at once.  The calling thread works too.  numpy's error state goes
with each block.  A block's exception, or a
KeyboardInterrupt in the calling thread, stops the handing out; the blocks
already started finish (each is short), and then the first exception is
raised in the calling thread.  Work started inside a block runs serially.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import _threads
from ._pool import empty as _kept_empty

__all__ = ["copy_array", "copy_checked", "elementwise", "for_each", "for_each_slice", "serially", "width"]

# At most this many threads, whatever the BLAS pool: each holds a block (a few MiB) at a time.
_MAX_WIDTH = 8

_local = threading.local()  # .inside: this thread is running a block
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def width() -> int:
    """How many threads the current thread may use for its blocks now (1: run them serially)."""
    if getattr(_local, "inside", False):
        return 1
    return max(1, min(_threads.width(), _MAX_WIDTH))


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        # A forked child inherits the pool but not its threads: it makes its own.
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_MAX_WIDTH - 1, thread_name_prefix="exactref")
            _pool_pid = os.getpid()
        return _pool


class _Feed:
    """Hands out the indices 0..count-1, one at a time, until they run out or it is stopped."""

    def __init__(self, count: int) -> None:
        self._next = 0
        self._count = count
        self._lock = threading.Lock()
        self.stopped = False

    def take(self) -> int | None:
        with self._lock:
            if self.stopped or self._next >= self._count:
                return None
            i, self._next = self._next, self._next + 1
            return i


def _drain(fn: Callable[[int], None], feed: _Feed) -> None:
    _local.inside = True
    try:
        while (i := feed.take()) is not None:
            try:
                fn(i)
            except BaseException:
                feed.stopped = True
                raise
    finally:
        _local.inside = False


def _helper(err: dict[str, str], fn: Callable[[int], None], feed: _Feed) -> None:
    with np.errstate(**err):
        _drain(fn, feed)


def serially(fn: Callable[[int], None], count: int) -> None:
    """``fn(i)`` for each i in 0..count-1 on this thread: :func:`for_each` for work too small to share."""
    for i in range(count):
        fn(i)


def for_each(fn: Callable[[int], None], count: int) -> None:
    """``fn(i)`` for each i in 0..count-1, on up to :func:`width` threads; ``fn`` must write only its own
    block's output.  Returns once every call has returned; raises the first exception any raised."""
    threads = min(width(), count)
    if threads <= 1:
        serially(fn, count)
        return
    # torch's OpenMP workers, spinning since its last op, would take a core from the helpers.
    _threads.release_openmp()
    feed = _Feed(count)
    pool = _executor()
    # numpy's error state is a context variable from numpy 2 on, and per thread before: both ways.
    err = np.geterr()
    helpers: list[Future[None]] = [pool.submit(contextvars.copy_context().run, _helper, err, fn, feed)
                                   for _ in range(threads - 1)]
    error: BaseException | None = None
    try:
        _drain(fn, feed)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the helpers must stop before it goes up
        feed.stopped = True
        error = exc
    for helper in helpers:
        try:
            helper.result()
        except BaseException as exc:  # noqa: BLE001 - the helper's own, or a KeyboardInterrupt while waiting
            feed.stopped = True
            error = error or exc
            if helper.running():  # interrupted while waiting: the rest stop after their block
                break
    if error is not None:
        raise error


def for_each_slice(fn: Callable[[slice], None], n: int, step: int, *, first_alone: bool = False) -> None:
    """``fn(cut)`` for the blocks ``cut`` of ``step`` items that cover 0..n-1, by :func:`for_each`.  With
    ``first_alone`` the first block (empty if n is 0) runs on this thread before the rest: its results
    can make the output arrays the others write into."""
    count = -(-n // step)

    def block(i: int) -> None:
        fn(slice(i * step, (i + 1) * step))
    if first_alone:
        block(0)
        for_each(lambda i: block(i + 1), count - 1)
    else:
        for_each(block, count)


# Elements per block of copy_array(): large enough that handing it out costs nothing.
_COPY_BLOCK = 1 << 20


def copy_array(a: np.ndarray) -> np.ndarray:
    """``np.array(a, copy=True)``, a large C-contiguous array copied in blocks side by side."""
    return copy_checked(a, lambda block: True)[0]


def copy_checked(a: np.ndarray, check: Callable[[np.ndarray], bool],
                 dtype: np.dtype | type | None = None) -> tuple[np.ndarray, bool]:
    """``np.array(a, dtype, copy=True)``, a large C-contiguous array copied in blocks side by side,
    and whether ``check`` holds for every block of the copy, which together are the whole copy;
    each block is checked right after it is copied, while it is still in cache.  ``dtype`` (a
    wider one, say) defaults to a's own."""
    if a.size < 2 * _COPY_BLOCK or not a.flags.c_contiguous or width() == 1:
        out = np.array(a, dtype=dtype, copy=True)
        return out, check(out)  # (one block: a small copy is still in cache)
    # (A large copy comes from the buffers of results no longer used: exactref/_pool.py.)
    out = _kept_empty(a.shape, a.dtype if dtype is None else dtype)
    src, dst = a.reshape(-1), out.reshape(-1)
    ok: list[bool] = []  # appends are atomic: the order does not matter

    def block(cut: slice) -> None:
        dst[cut] = src[cut]  # (as astype: any cast, bfloat16 to float64 too)
        ok.append(check(dst[cut]))
    for_each_slice(block, a.size, _COPY_BLOCK)
    return out, all(ok)


def elementwise(fn: Callable[..., tuple[np.ndarray, ...]], *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``fn(*arrays)`` for an elementwise ``fn`` of arrays of one shape, returning a tuple of arrays of
    that shape: a large output computed in flat blocks side by side (the values are the same, since
    each element is computed alone), each block's temporaries in cache."""
    shape = arrays[0].shape
    size = arrays[0].size
    if size < 2 * _COPY_BLOCK or width() == 1 or any(a.shape != shape or not a.flags.c_contiguous for a in arrays):
        return fn(*arrays)
    flat = [a.reshape(-1) for a in arrays]
    outs: list[np.ndarray] = []

    def block(cut: slice) -> None:
        res = fn(*(f[cut] for f in flat))
        if not outs:
            outs.extend(np.empty(size, dtype=r.dtype) for r in res)
        for o, r in zip(outs, res):
            o[cut] = r
    # The first block's results make the outputs; the rest side by side.
    for_each_slice(block, size, _ELEMENTWISE_BLOCK, first_alone=True)
    return tuple(o.reshape(shape) for o in outs)


# Elements per block of elementwise(): its float64 temporaries stay near 1 MiB each.
_ELEMENTWISE_BLOCK = 1 << 17
