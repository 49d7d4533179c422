"""Speed and working memory of the exact sum against torch's float64 sum, measured in this process.

Prints one row per sum case of issue 12's table, each the median of
``--repeat`` interleaved runs, as a ratio to ``torch.sum`` on the same
inputs widened to float64 (its time is printed too).  No thread variable is
set.

* sum float32, n = 10^6 / 10^7: targets <= 5x;
* sum float32, n = 10^8: runs, in at most 32 bytes of working memory per element.

"Exact" is ``er.sum(x)`` with ``.rounded`` and ``.tolerance`` read.  Working
memory is measured with tracemalloc, to which numpy reports every array it
allocates: the highest traced total during one call, minus what was traced
before it (the input itself is not counted; the Result is), divided by n.

``--floor`` adds, under each row, numpy's own float64 sum of the float32
values (``np.sum(x, dtype=np.float64)``, one pairwise pass that widens them
as it reads): the least numpy work an exact sum of them can do, and so the
floor of the ratio for an engine built on numpy.

Run: python benchmarks/bench_sum.py [--only 1e8] [--repeat N] [--floor]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

# Run as a script, so benchmarks/ is on sys.path.
from _measure import blas, median_times, peak_bytes

import exactref as er

CASES = {"1e6": (10 ** 6, 5.0), "1e7": (10 ** 7, 5.0), "1e8": (10 ** 8, None)}
BYTES_TARGET = 32


def row(label: str, n: int, target: float | None, repeat: int) -> str:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    t64 = torch.from_numpy(x).double()

    def exact() -> er.Result:
        res = er.sum(x)
        res.rounded, res.tolerance  # noqa: B018 - what a user reads
        return res

    try:
        base, ours = median_times([lambda: torch.sum(t64), exact], repeat)
    except ValueError as exc:
        return f"sum float32 n={label}: refused: {exc}"
    ratio = ours / base
    line = (f"sum float32 n={label}: torch float64 {base * 1e3:8.2f} ms, exact {ours * 1e3:8.2f} ms, "
            f"ratio {ratio:6.1f}x")
    if target is not None:
        line += f" (target <= {target:g}x) {'ok' if ratio <= target else 'MISSED'}"
    else:
        per = peak_bytes(exact) / n
        line += f"; working memory {per:.1f} bytes/element (target <= {BYTES_TARGET}) " \
                f"{'ok' if per <= BYTES_TARGET else 'MISSED'}"
    return line


def floor_row(label: str, n: int, repeat: int) -> str:
    """numpy's one float64 pass over the values, against torch's float64 sum, interleaved."""
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    t64 = torch.from_numpy(x).double()
    base, one = median_times([lambda: torch.sum(t64), lambda: np.sum(x, dtype=np.float64)], repeat)
    return (f"floor float32 n={label}: torch float64 {base * 1e3:8.2f} ms, numpy's float64 sum alone "
            f"{one * 1e3:8.2f} ms, ratio {one / base:6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per row (median)")
    parser.add_argument("--only", default="", help="run only rows whose n contains this (1e6, 1e7, 1e8)")
    parser.add_argument("--floor", action="store_true",
                        help="diagnostic: also time numpy's own float64 sum of the values, the least numpy work")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} torch threads, "
          f"median of {args.repeat}")
    print(blas())
    for label, (n, target) in CASES.items():
        if args.only in label:
            repeat = args.repeat if n < 10 ** 8 else max(1, min(args.repeat, 3))
            print(row(label, n, target, repeat), flush=True)
            if args.floor:
                print(floor_row(label, n, repeat), flush=True)


if __name__ == "__main__":
    main()
