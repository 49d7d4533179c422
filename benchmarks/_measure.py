"""What the benchmarks share: interleaved median times, and peak traced memory of one call."""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable

import threadpoolctl

from exactref import _fused, _pool

__all__ = ["blas", "loops", "median_times", "peak_bytes"]


def median_times(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median time of each function, runs interleaved so that load on the machine hits all alike.

    The first, the baseline (torch's op), runs twice in a row each round and its second run is
    timed, right after one of its own: an ExactRef op that runs blocks side by side ends torch's
    idle OpenMP workers (exactref/_threads.py), and the torch op after it starts new ones, which
    on 2 cores added 0.05 to 1 ms to a float64 matmul at 512³ and 1024³.  Timed after ExactRef's
    op, the baseline would be slower, and the ratios smaller, for that reason alone.  The rest
    run right after the baseline, as a test calls a kernel and then ExactRef.
    """
    for fn in fns:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        fns[0]()
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes traced at once while ``fn`` runs (its result included), above what was traced before.

    ExactRef's buffers kept from earlier results that nothing uses now are let go first
    (exactref/_pool.py), so that ``fn`` allocates what it would in a fresh process.
    """
    _pool.clear()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1]
        del kept
    finally:
        tracemalloc.stop()
    return peak - before


def loops() -> str:
    """Whether large outputs are judged by compiled loops (exactref/_fused.py), for a benchmark's header."""
    if not _fused.available():
        return "compiled loops off"
    import numba

    return f"compiled loops on (numba {numba.__version__})"


def blas() -> str:
    """The BLAS libraries loaded (numpy's among them), their versions and the kernels each chose for
    this CPU, for a benchmark's header.

    The ratios rest on it: on the 2-core AMD EPYC (Zen 5, CPU family 26) these benchmarks were
    measured on, numpy 2.4.6's OpenBLAS 0.3.31 ran its Haswell (AVX2) kernels, though the CPU has
    AVX-512, because that machine's environment sets ``OPENBLAS_CORETYPE=Haswell``; without it,
    OpenBLAS picks its SkylakeX kernels there.  Its float64 512^3 product on one thread took 4.7 ms
    with the Haswell kernels, against 3.0 with the SkylakeX ones.  The benchmarks take the
    environment as they find it.
    """
    found = [f"{p.get('internal_api')} {p.get('version')} ({p.get('architecture')} kernels, "
             f"{p.get('num_threads')} threads, {p.get('filepath', '').rsplit('/', 1)[-1]})"
             for p in threadpoolctl.threadpool_info() if p.get("user_api") == "blas"]
    return "BLAS loaded: " + ("; ".join(found) or "none found")
