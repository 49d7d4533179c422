"""What ExactRef's thread-pool management (exactref/_threads.py) is worth: each case with it on and off.

ExactRef runs numpy's BLAS on one thread during its own calls and restores
the limits afterwards.  This prints, per case, the median time with that
management on and off (a private switch, for this benchmark only), each as
a ratio to torch's float64 op on the same inputs in the same process, with
the baseline's time.  Each repeat runs the torch op first, as a kernel
under test would run before ExactRef judges it, then the two modes in
alternating order, so that a change in the machine's load affects both.
No thread variable is set: the defaults are what users get.

    python benchmarks/bench_threads.py [--repeat N] [--large]

``--large`` adds a float32 2048³ matmul (about 5 s a run on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import threadpoolctl
import torch

import exactref as er
import exactref._threads as threads

# A case: its name, the ExactRef call, the torch float64 baseline, and how many calls one run makes (0: one).
Case = tuple[str, Callable[[], object], Callable[[], object], int]


def _timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def attention_case(shape: tuple[int, ...]) -> Case:
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(*shape, generator=gen) for _ in range(4))

    def exact() -> None:
        er.scaled_dot_product_attention(q, k, v).backward(g)

    def baseline() -> None:
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*leaves).backward(g.double())
    return f"attention float32 {'x'.join(map(str, shape))}, forward + backward", exact, baseline, 0


def matmul_case(n: int, backward: bool) -> Case:
    gen = torch.Generator().manual_seed(0)
    A, B, G = (torch.randn(n, n, generator=gen) for _ in range(3))

    def exact() -> None:
        r = er.matmul(A, B)
        if backward:
            r.backward(G)

    def baseline() -> None:
        a, b = A.double().requires_grad_(backward), B.double().requires_grad_(backward)
        out = a @ b
        if backward:
            out.backward(G.double())
    what = "forward + backward" if backward else "forward"
    return f"matmul float32 {n}³, {what}", exact, baseline, 0


def small_case(count: int = 200) -> Case:
    """``count`` matmuls with sides 1 to 8, forward, backward and covers of each output."""
    gen = torch.Generator().manual_seed(0)
    sides = torch.randint(1, 9, (count, 3), generator=gen).tolist()
    cases = [tuple(torch.randn(*s, generator=gen) for s in ((m, k), (k, n), (m, n))) for m, k, n in sides]

    def exact() -> None:
        for A, B, G in cases:
            r = er.matmul(A, B)
            r.covers(r.rounded)
            g = r.backward(G)
            g.covers(grad_A=g.rounded.grad_A, grad_B=g.rounded.grad_B)

    def baseline() -> None:
        for A, B, G in cases:
            a, b = A.double().requires_grad_(), B.double().requires_grad_()
            (a @ b).backward(G.double())
    return f"{count} small matmuls (sides 1-8), forward + backward + covers", exact, baseline, count


def run(name: str, exact: Callable[[], object], baseline: Callable[[], object], calls: int, repeat: int) -> None:
    times: dict[bool, list[float]] = {True: [], False: []}
    base = []
    exact()  # warm-up: imports, caches, threadpoolctl's controller
    for i in range(repeat):
        for managed in ((True, False) if i % 2 == 0 else (False, True)):
            base.append(_timed(baseline))
            threads._enabled = managed
            try:
                times[managed].append(_timed(exact))
            finally:
                threads._enabled = True
    t_base = statistics.median(base)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{name}  (torch float64: {t_base * 1e3:.1f} ms)")
    print(f"  managed  {on:8.3f} s  {on / t_base:8.1f}x")
    print(f"  default  {off:8.3f} s  {off / t_base:8.1f}x   (management off: {off / on:.2f} times slower)")
    if calls:
        print(f"  per second: {calls / on:.0f} managed, {calls / off:.0f} default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="add a float32 2048³ matmul")
    args = parser.parse_args()
    pools = ", ".join(f"{p['internal_api']} {p['num_threads']}" for p in threadpoolctl.threadpool_info())
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, thread pools: {pools}; "
          f"median of {args.repeat}")
    cases = [attention_case((1, 4, 256, 64)), matmul_case(512, backward=True), small_case()]
    if args.large:
        cases.append(matmul_case(2048, backward=False))
    for case in cases:
        run(*case, repeat=args.repeat)


if __name__ == "__main__":
    main()
