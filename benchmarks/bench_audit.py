"""How long the default audit takes: ``exactref audit --seed 0`` on PyTorch's CPU kernels, 92 cells.

Prints the median wall time of ``--repeat`` runs, each in a fresh process
from an empty directory (no ``[tool.exactref]``), as a user starts it, with
the audit's own closing line and the 3-minute target it was built to.  No
thread variable is set.

Run: python benchmarks/bench_audit.py [--repeat N] [--seed S]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 180.0


def one_run(seed: int) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as here:
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "exactref.cli", "audit", "--seed", str(seed)], cwd=here,
                             capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - start
    lines = [line for line in out.stdout.splitlines() if " cells, " in line and " examples in " in line]
    return elapsed, (lines[-1] if lines else f"exit {out.returncode}: {out.stderr.strip()[-200:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs to take the median of")
    parser.add_argument("--seed", type=int, default=0, help="the audit's --seed")
    args = parser.parse_args()
    runs = [one_run(args.seed) for _ in range(args.repeat)]
    for elapsed, line in runs:
        print(f"  {elapsed:6.1f} s  {line}")
    median = statistics.median(t for t, _ in runs)
    verdict = "ok" if median <= TARGET_S else "MISSED"
    print(f"default audit: median {median:.1f} s of {len(runs)} (target <= {TARGET_S:.0f} s) {verdict}")


if __name__ == "__main__":
    main()
