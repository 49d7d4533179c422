"""Speed and memory of the exact matmul against torch's float64 matmul, measured in this process.

Prints one row per case of issue 12's table, each the median of ``--repeat``
interleaved runs, as a ratio to ``torch.matmul`` on the same inputs widened
to float64 (its time is printed too).  No thread variable is set: numpy and
torch run with their default thread pools, as users get them.

* matmul float32, 512^3 / 1024^3 / 2048^3: targets <= 2x / 2x / 3x;
* matmul float16 and bfloat16, 2048^3: <= 2x;
* matmul float64, 512^3 / 1024^3 / 2048^3: <= 8x, and at 2048^3 a peak
  memory of at most 4x that of the inputs and the output;
* small matmuls (sides 1 to 8), forward + backward + covers: >= 2,000 per second.

One row beyond the table: a float64 matmul of float32 values widened, as
``torch.randn(n, n).double()`` makes them (no target; it once took about
2.7 times the row of float64 draws, at 1024^3).

"Exact" is ``er.matmul(A, B)`` with ``.rounded`` and ``.tolerance`` read.
Peak memory is measured with tracemalloc, to which numpy reports every
array it allocates: the highest traced total during one call, minus what was
traced before it (the Result it returns is included), against the bytes of
the float64 inputs plus one float64 output.  torch's own allocations are not
traced; they belong to the baseline.

With numba installed (``exactref[fast]``), large outputs are judged by
compiled loops (exactref/_fused.py), which the header line says;
``--no-loops`` judges with the numpy code instead (the same values).

``--floor`` adds, under each row, the time of the BLAS products alone that
the exact matmul makes, in the engine's blocks on its threads: the floor of
this design (two products for float32 and narrower, seven for float64).

Run: python benchmarks/bench_matmul.py [--only float64] [--repeat N] [--sizes 512,1024] [--floor]
     [--no-blas-limit] [--no-malloc-hold] [--no-openmp-release] [--no-loops]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

# Run as a script, so benchmarks/ is on sys.path.
from _measure import blas, loops, median_times, peak_bytes

import exactref as er

TARGETS = {  # (dtype, n): ratio target
    ("float32", 512): 2, ("float32", 1024): 2, ("float32", 2048): 3,
    ("float16", 2048): 2, ("bfloat16", 2048): 2,
    ("float64", 512): 8, ("float64", 1024): 8, ("float64", 2048): 8,
}
MEMORY_TARGET = 4.0  # peak / (inputs + output), float64 at 2048^3
SMALL_TARGET = 2000


def inputs(dtype: str, n: int, values: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Standard normal A and B in ``dtype``; ``values``: a format they are rounded to first."""
    rng = np.random.default_rng(0)
    A, B = (er.asarray(er.asarray(rng.standard_normal((n, n)), values or dtype), dtype) for _ in range(2))
    return A, B


def big_row(dtype: str, n: int, repeat: int, memory: bool, values: str | None = None) -> str:
    A, B = inputs(dtype, n, values)
    tA, tB = torch.from_numpy(A.astype(np.float64)), torch.from_numpy(B.astype(np.float64))

    def exact() -> er.Result:
        res = er.matmul(A, B)
        res.rounded, res.tolerance  # noqa: B018 - what a user reads
        return res

    base, ours = median_times([lambda: torch.matmul(tA, tB), exact], repeat)
    ratio = ours / base
    target = TARGETS.get((dtype, n)) if values is None else None
    verdict = "" if target is None else f" (target <= {target}x) {'ok' if ratio <= target else 'MISSED'}"
    what = dtype if values is None else f"{dtype} of {values} values"
    line = (f"matmul {what:8s} {n}^3: torch float64 {base * 1e3:8.1f} ms, exact {ours * 1e3:8.1f} ms, "
            f"ratio {ratio:6.2f}x{verdict}")
    if memory:
        data = 3 * n * n * 8  # float64 A, B and output
        peak = peak_bytes(exact)
        mem_ok = "" if n != 2048 else f" (target <= {MEMORY_TARGET:g}x) {'ok' if peak <= MEMORY_TARGET * data else 'MISSED'}"
        line += f"; peak {peak / 2**20:.0f} MiB = {peak / data:.2f}x inputs+output{mem_ok}"
    return line


def small_cases_per_second(seconds: float) -> tuple[float, float]:
    """Cases per second of wall time, and per second of this process's CPU time (steadier on a
    shared machine; BLAS threads, if any ran, count in it too)."""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(200):
        m, k, n = rng.integers(1, 9, 3)
        A = er.asarray(rng.standard_normal((m, k)), "float32")
        B = er.asarray(rng.standard_normal((k, n)), "float32")
        G = er.asarray(rng.standard_normal((m, n)), "float32")
        cases.append((A, B, G, torch.from_numpy(A) @ torch.from_numpy(B)))
    done = 0
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        A, B, G, out = cases[done % len(cases)]
        res = er.matmul(A, B)
        res.covers(out)
        g = res.backward(G)
        g["grad_A"].covers(g.rounded.grad_A)
        g["grad_B"].covers(g.rounded.grad_B)
        done += 1
    return done / (time.perf_counter() - start), done / max(time.process_time() - cpu, 1e-9)


def floor_row(dtype: str, n: int, repeat: int) -> str:
    """The BLAS products alone that ``er.matmul`` makes, in the engine's blocks of rows on its threads.

    A float32 or narrower matmul makes one float64 product and one float32
    product (of |A| and |B|, for the bound); a float64 one makes six float64
    products of slices (exactref/engine/products.py), four where K is at most
    1024, and the float32 one.  What the engine does besides costs the
    difference from the "exact" row.
    """
    from exactref.engine.products import _QUICK_MAX_K
    from exactref._parallel import for_each_slice
    from exactref._threads import own_threads

    A, B = (v.astype(np.float64) for v in inputs(dtype, n))
    A32, B32 = np.abs(A).astype(np.float32), np.abs(B).astype(np.float32)
    count = (4 if n <= _QUICK_MAX_K else 6) if dtype == "float64" else 1
    step = max(1, min((1 << 18) // n, -(-n // 2)))  # exactref/engine/sumprod.py's blocks

    def products() -> None:
        def block(rows: slice) -> None:
            for _ in range(count):
                A[rows] @ B
            A32[rows] @ B32
        with own_threads():
            for_each_slice(block, n, step)

    tA, tB = torch.from_numpy(A), torch.from_numpy(B)
    base, ours = median_times([lambda: torch.matmul(tA, tB), products], repeat)
    return (f"floor  {dtype:8s} {n}^3: torch float64 {base * 1e3:8.1f} ms, the {count + 1} BLAS products "
            f"alone {ours * 1e3:8.1f} ms, ratio {ours / base:6.2f}x (blocks of {step} rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per row (median)")
    parser.add_argument("--sizes", default="512,1024,2048", help="comma-separated sides to run")
    parser.add_argument("--only", default="", help="run only rows whose name contains this (e.g. float64, small)")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of the small-matmul row")
    parser.add_argument("--floor", action="store_true",
                        help="diagnostic: also time the BLAS products alone, as the engine makes them")
    parser.add_argument("--no-blas-limit", action="store_true",
                        help="diagnostic: turn off ExactRef's one-BLAS-thread limit (exactref/_threads.py)")
    parser.add_argument("--no-malloc-hold", action="store_true",
                        help="diagnostic: let glibc's malloc trim freed memory, and numpy advise huge pages, as they "
                             "would (exactref/_malloc.py)")
    parser.add_argument("--no-openmp-release", action="store_true",
                        help="diagnostic: leave torch's idle OpenMP workers spinning (exactref/_threads.py)")
    parser.add_argument("--no-loops", action="store_true",
                        help="diagnostic: judge with the numpy code, not numba's compiled loops (exactref/_fused.py)")
    args = parser.parse_args()
    if args.no_malloc_hold:
        from exactref import _malloc

        _malloc._enabled = False
    if args.no_blas_limit:
        from exactref import _threads

        _threads._enabled = False
    if args.no_openmp_release:
        from exactref import _threads

        _threads._release = False
    sizes = {int(s) for s in args.sizes.split(",") if s}
    if args.no_loops:
        from exactref import _fused

        _fused.available = lambda: False
    print(f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} torch threads, "
          f"{loops()}, median of {args.repeat}{', BLAS limit off' if args.no_blas_limit else ''}"
          f"{', malloc and huge pages left alone' if args.no_malloc_hold else ''}")
    print(blas())
    for dtype, n in TARGETS:
        name = f"matmul {dtype} {n}"
        if n in sizes and args.only in name:
            print(big_row(dtype, n, args.repeat, memory=dtype == "float64"), flush=True)
            if args.floor:
                print(floor_row(dtype, n, args.repeat), flush=True)
    if 1024 in sizes and args.only in "matmul float64 1024 float32 values":
        print(big_row("float64", 1024, args.repeat, memory=False, values="float32"), flush=True)
    if args.only in "small matmuls":
        rate, cpu_rate = small_cases_per_second(args.seconds)
        print(f"small matmuls (sides 1-8), forward + backward + covers: {rate:.0f} cases/s "
              f"(target >= {SMALL_TARGET}) {'ok' if rate >= SMALL_TARGET else 'MISSED'}; "
              f"{cpu_rate:.0f} per CPU-second")


if __name__ == "__main__":
    main()
