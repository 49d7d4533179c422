"""What ExactRef's thread management is worth: each case in three modes, in the same process.

ExactRef runs numpy's BLAS on one thread during its own calls and restores
the limits afterwards (exactref/_threads.py), and runs an op's independent
blocks side by side on its own threads, as many as the BLAS pool had
(exactref/_parallel.py).  This prints, per case, the median time of

* ``managed``: both, what users get;
* ``one thread``: the BLAS limit alone, every block on the calling thread;
* ``default``: neither (numpy's BLAS threads as it likes, blocks serial),

each as a ratio to torch's float64 op on the same inputs in the same
process, with the baseline's time; the modes are private switches, for
benchmarks only.  Each repeat runs the torch op first, as a kernel under
test would run before ExactRef judges it, then the modes in an order that
rotates, so that a change in the machine's load affects all of them.  No
thread variable is set: the defaults are what users get.

    python benchmarks/bench_threads.py [--repeat N] [--large]

``--large`` adds a float32 2048³ matmul and a float64 1024³ one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import threadpoolctl
import torch

import exactref as er
import exactref._parallel as parallel
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


def matmul_case(n: int, backward: bool, dtype: torch.dtype = torch.float32) -> Case:
    gen = torch.Generator().manual_seed(0)
    A, B, G = (torch.randn(n, n, generator=gen, dtype=dtype) for _ in range(3))

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
    return f"matmul {str(dtype).removeprefix('torch.')} {n}³, {what}", exact, baseline, 0


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


def sum_case(n: int) -> Case:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x64 = x.double()
    return f"sum float32 n={n:.0e}", lambda: er.sum(x), lambda: x64.sum(), 0


def _mode(name: str) -> None:
    """Switch ExactRef's thread management to the mode ``name`` (see the module's docstring)."""
    threads._enabled = name != "default"
    parallel._MAX_WIDTH = 1 if name != "managed" else _WIDTH


_WIDTH = parallel._MAX_WIDTH
MODES = ("managed", "one thread", "default")


def run(name: str, exact: Callable[[], object], baseline: Callable[[], object], calls: int, repeat: int) -> None:
    times: dict[str, list[float]] = {m: [] for m in MODES}
    base = []
    exact()  # warm-up: imports, caches, threadpoolctl's controller
    for i in range(repeat):
        for k in range(len(MODES)):
            mode = MODES[(i + k) % len(MODES)]
            base.append(_timed(baseline))
            _mode(mode)
            try:
                times[mode].append(_timed(exact))
            finally:
                _mode("managed")
    t_base = statistics.median(base)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"{name}  (torch float64: {t_base * 1e3:.1f} ms)")
    for m in MODES:
        slower = "" if m == "managed" else f"   ({med[m] / med['managed']:.2f} times managed's time)"
        per = f", {calls / med[m]:.0f} per second" if calls else ""
        print(f"  {m:10s} {med[m]:8.3f} s  {med[m] / t_base:8.1f}x{per}{slower}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="add a float32 2048³ matmul")
    args = parser.parse_args()
    pools = ", ".join(f"{p['internal_api']} {p['num_threads']}" for p in threadpoolctl.threadpool_info())
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, thread pools: {pools}; "
          f"median of {args.repeat}")
    cases = [attention_case((1, 4, 256, 64)), matmul_case(512, backward=True), sum_case(10**7), small_case()]
    if args.large:
        cases += [matmul_case(2048, backward=False), matmul_case(1024, backward=False, dtype=torch.float64)]
    for case in cases:
        run(*case, repeat=args.repeat)


if __name__ == "__main__":
    main()
