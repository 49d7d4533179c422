"""Speed of the exact matmul against torch's float64 matmul, measured in this process.

Prints medians and the ratios the targets are stated in:

* float32 inputs, 512^3, rounded plus tolerance: at most 5x torch float64 matmul;
* float64 inputs, 512^3: at most 20x;
* forward, backward and covers() on small matmuls (sides 1 to 8): at least 500 cases per second.

Run: python benchmarks/bench_matmul.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import exactref as er


def median_times(fns, repeat: int) -> list[float]:
    """Median time of each function, runs interleaved so that load on the machine hits all alike."""
    for fn in fns:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def big(dtype: str, n: int, repeat: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    A = er.asarray(rng.standard_normal((n, n)), dtype)
    B = er.asarray(rng.standard_normal((n, n)), dtype)
    tA, tB = torch.from_numpy(A.astype(np.float64)), torch.from_numpy(B.astype(np.float64))

    def exact():
        res = er.matmul(A, B)
        return res.rounded, res.tolerance

    base, ours = median_times([lambda: torch.matmul(tA, tB), exact], repeat)
    return base, ours


def small_cases_per_second(seconds: float) -> float:
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(200):
        m, k, n = rng.integers(1, 9, 3)
        A = er.asarray(rng.standard_normal((m, k)), "float32")
        B = er.asarray(rng.standard_normal((k, n)), "float32")
        G = er.asarray(rng.standard_normal((m, n)), "float32")
        cases.append((A, B, G, torch.from_numpy(A) @ torch.from_numpy(B)))
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        A, B, G, out = cases[done % len(cases)]
        res = er.matmul(A, B)
        res.covers(out)
        g = res.backward(G)
        g["grad_A"].covers(g.rounded.grad_A)
        g["grad_B"].covers(g.rounded.grad_B)
        done += 1
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeat}")
    for dtype, target in (("float32", 5), ("float64", 20)):
        base, exact = big(dtype, args.size, args.repeat)
        ratio = exact / base
        print(f"{dtype} matmul {args.size}^3: torch float64 {base * 1e3:.2f} ms, exact {exact * 1e3:.2f} ms, "
              f"ratio {ratio:.2f}x (target <= {target}x) {'ok' if ratio <= target else 'MISSED'}")
    rate = small_cases_per_second(3.0)
    print(f"small matmuls (sides 1-8), forward + backward + covers: {rate:.0f} cases/s "
          f"(target >= 500) {'ok' if rate >= 500 else 'MISSED'}")


if __name__ == "__main__":
    main()
