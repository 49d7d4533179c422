"""Benchmark: exact attention forward + backward against PyTorch's float64 math path, in one process.

The target (issue 4): exactref's forward plus backward at 1x4x256x64 float32,
exact, takes at most 50 times PyTorch's float64 math path forward plus
backward of the same inputs.  Prints the medians and their ratio.

    python benchmarks/bench_attention.py [--repeat N] [--shape B H L E] [--causal]

numpy's OpenBLAS runs single-threaded here (OPENBLAS_NUM_THREADS=1, set
before numpy loads, unless the environment sets it): on a small shared
machine its spinning threads and PyTorch's OpenMP threads slow each other
down by up to 50x, and exactref's matmuls are small.  PyTorch keeps its
default threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er


def _median_time(fn, repeat: int) -> float:
    fn()  # warm up: first calls allocate and load libraries
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 4, 256, 64], metavar=("B", "H", "L", "E"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    B, H, L, E = args.shape
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v, grad = (torch.randn(B, H, L, E, generator=gen) for _ in range(4))

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    grad64 = grad.double()

    def torch_math() -> None:
        for t in (q64, k64, v64):
            t.grad = None
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=args.causal)
        out.backward(grad64)

    refined = {}

    def exact() -> None:
        r = er.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        g = r.backward(grad)
        refined["out"] = r
        refined["grads"] = g

    t_torch = _median_time(torch_math, args.repeat)
    t_exact = _median_time(exact, args.repeat)
    print(f"shape {B}x{H}x{L}x{E} float32{' causal' if args.causal else ''}, median of {args.repeat} runs; "
          f"torch threads {torch.get_num_threads()}, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"  PyTorch float64 math path, forward + backward: {t_torch * 1e3:8.1f} ms")
    print(f"  exactref exact, forward + backward:            {t_exact * 1e3:8.1f} ms")
    print(f"  ratio: {t_exact / t_torch:.1f}x (target: at most 50x)")
    tol = np.median(refined["out"].tolerance / np.maximum(np.abs(refined["out"].rounded.astype(np.float64)), 1e-30))
    print(f"  median relative tolerance of the output: {tol:.2e}")


if __name__ == "__main__":
    main()
