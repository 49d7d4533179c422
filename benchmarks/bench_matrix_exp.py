"""Benchmark: exact matrix_exp plus backward against torch.linalg.matrix_exp forward plus backward, in one process.

The target (issue 5): exactref's matrix_exp and its backward of a 16 x 16
float64 matrix with 1-norm 2, exact and with tolerances, take at most 100
times PyTorch's forward plus autograd backward of the same inputs.  Prints
the medians and their ratio.  The two are timed alternately, so that a change
in the machine's load affects both.  No thread setting is touched: both run
with the defaults users get (ExactRef manages its own BLAS threads, see
docs/guarantees-and-limits.md).

    python benchmarks/bench_matrix_exp.py [--repeat N] [--n N] [--norm X] [--dtype float64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import exactref as er


def _median_times(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    for fn in fns:
        fn()  # warm up: first calls allocate and load libraries
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--norm", type=float, default=2.0, help="1-norm of A")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64", "complex64", "complex128"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    A = torch.randn(args.n, args.n, generator=gen, dtype=dtype)
    A = A * (args.norm / A.abs().sum(-2).max())
    grad = torch.randn(args.n, args.n, generator=gen, dtype=dtype)

    def torch_fwd_bwd() -> None:
        a = A.clone().requires_grad_()
        torch.linalg.matrix_exp(a).backward(grad)

    def exact() -> None:
        er.matrix_exp(A).backward(grad)

    t_torch, t_exact = _median_times([torch_fwd_bwd, exact], args.repeat)
    print(f"{args.n}x{args.n} {args.dtype}, 1-norm {args.norm}, median of {args.repeat}, "
          f"torch on {torch.get_num_threads()} thread(s):")
    print(f"  torch.linalg.matrix_exp forward + backward: {t_torch * 1e3:8.3f} ms")
    print(f"  er.matrix_exp forward + backward:           {t_exact * 1e3:8.3f} ms")
    print(f"  ratio: {t_exact / t_torch:.1f}x (target: at most 100x)")


if __name__ == "__main__":
    main()
