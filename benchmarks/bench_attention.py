"""Benchmark: exact attention forward + backward against PyTorch's float64 math path, in one process.

Each row times exactref's forward plus backward of seeded inputs (q, k, v
and the output gradient drawn as ``torch.randn(B, H, L, E)`` in that order
from ``torch.Generator().manual_seed(seed)``) and PyTorch's float64 math path
forward plus backward of the same values, and prints their medians, the
ratio and the target (issue 12).  No thread variable is set: the thread
pools run as a user's would.

    python benchmarks/bench_attention.py [--only NAME ...] [--repeat N]
    python benchmarks/bench_attention.py --shape B H L E [--dtype float32] [--causal]
    python benchmarks/bench_attention.py --only f32 --cpu

``--cpu`` (a diagnostic) makes one more exactref forward + backward per row,
untimed, and prints the CPU time it took in user and in system (kernel) mode,
all threads together, and its minor page faults.  System time is mostly the
kernel zeroing pages that the process takes fresh from it: at 1x8x1024x64
float32, on 2 cores of a VM, 1.2-1.5 s of system time against 4.4-5.0 s of
user time, and 34,000-90,000 faults, per forward + backward (nine calls);
``perf record -e cpu-clock`` put 36% of one such call's samples in the
kernel's ``clear_page_erms``.

Rows: ``f32`` (float32, 1x8x1024x64, at most 10x), ``f16`` and ``bf16``
(1x4x2048x128, at most 10x), ``f64`` (float64, 1x4x256x64, at most 2 s),
``cliff`` (the seed-0 float32 1x8x1024x64 draw whose backward once hung in
the exact analysis: it is the ``f32`` row's inputs, timed separately for
the forward and the backward) and ``small`` (float32, 1x4x256x64).

Every row makes one untimed exactref call first (not with ``--no-warmup``),
and keeps each call's Result until the next call has returned, as a loop
``out = er.scaled_dot_product_attention(...)`` does.  So the first timed
call still finds no freed memory of the size it needs: the warm-up's Result
holds it.  Its fresh pages cost it system time (at 1x8x1024x64 float32,
about 370,000 page faults, against 2,000 to 15,000 in the calls after it);
with three runs, the median is a later one.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Run as a script, so benchmarks/ is on sys.path.
from _measure import blas

import exactref as er

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


@dataclass(frozen=True)
class Row:
    name: str
    dtype: str
    shape: tuple[int, int, int, int]
    target: str  # "10x" (a ratio) or "2s" (seconds)
    causal: bool = False
    split: bool = False  # time forward and backward separately


ROWS = [
    Row("f32", "float32", (1, 8, 1024, 64), "10x"),
    Row("f16", "float16", (1, 4, 2048, 128), "10x"),
    Row("bf16", "bfloat16", (1, 4, 2048, 128), "10x"),
    Row("f64", "float64", (1, 4, 256, 64), "2s"),
    Row("cliff", "float32", (1, 8, 1024, 64), "10x", split=True),
    Row("small", "float32", (1, 4, 256, 64), "50x"),
]


def _times(fn: Callable[[], object], repeat: int, warm: bool) -> list[float]:
    if warm:
        fn()  # first calls allocate and load libraries
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _inputs(row: Row, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*row.shape, generator=gen).to(_DTYPES[row.dtype]) for _ in range(4))


def _cpu_line(fn: Callable[[], object]) -> str:
    """One call of ``fn``: the process's user and system CPU time and its minor page faults."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (f"      one more forward + backward: user {after.ru_utime - before.ru_utime:.2f} s, "
            f"system {after.ru_stime - before.ru_stime:.2f} s (all threads), "
            f"{after.ru_minflt - before.ru_minflt} minor page faults")


def run_row(row: Row, repeat: int, seed: int, warm: bool, cpu: bool = False) -> None:
    q, k, v, grad = _inputs(row, seed)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    grad64 = grad.double()

    def torch_math() -> None:
        for t in (q64, k64, v64):
            t.grad = None
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=row.causal)
        out.backward(grad64)

    kept = {}

    def forward() -> None:
        kept["out"] = er.scaled_dot_product_attention(q, k, v, is_causal=row.causal)

    def backward() -> None:
        kept["grads"] = kept["out"].backward(grad)

    def both() -> None:
        forward()
        backward()

    t_torch = statistics.median(_times(torch_math, max(repeat, 3), True))
    label = f"{row.name:5s} {row.dtype:8s} {'x'.join(map(str, row.shape))}{' causal' if row.causal else ''}"
    if row.split:
        if warm:
            both()  # as _times does for the other rows: first calls allocate and load libraries
        tf, tb = [], []
        for _ in range(repeat):
            tf += _times(forward, 1, False)
            tb += _times(backward, 1, False)
        t_f, t_b = statistics.median(tf), statistics.median(tb)
        t_exact = t_f + t_b
        detail = f" (forward {t_f:.2f} s, backward {t_b:.2f} s)"
    else:
        t_exact = statistics.median(_times(both, repeat, warm))
        detail = ""
    ratio = t_exact / t_torch
    goal = f"target <= {row.target[:-1]} s" if row.target.endswith("s") else f"target <= {row.target}"
    print(f"{label}: exactref {t_exact:7.2f} s{detail}, torch float64 math {t_torch * 1e3:7.1f} ms, "
          f"ratio {ratio:6.1f}x, {goal}; median of {repeat}, torch threads {torch.get_num_threads()}",
          flush=True)
    out = kept["out"]
    tol = np.median(out.tolerance / np.maximum(np.abs(out.rounded.astype(np.float64)), 1e-30))
    print(f"      median relative tolerance of the output: {tol:.2e}", flush=True)
    if cpu:
        print(_cpu_line(both), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[r.name for r in ROWS], help="rows to run (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (default 3)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first exactref call")
    parser.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "L", "E"), help="one custom row")
    parser.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true",
                        help="diagnostic: one more untimed call, its user and system CPU time and page faults")
    args = parser.parse_args()
    if args.shape:
        rows = [Row("custom", args.dtype, tuple(args.shape), "10x", causal=args.causal)]
    else:
        rows = [r for r in ROWS if args.only is None or r.name in args.only]
    print(f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} torch threads")
    print(blas())
    for row in rows:
        run_row(row, args.repeat, args.seed, not args.no_warmup, args.cpu)


if __name__ == "__main__":
    main()
