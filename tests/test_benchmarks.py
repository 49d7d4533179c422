"""The benchmark scripts run and print their rows (no timing is checked: speed lives in benchmarks/).

Each script runs in a process of its own, as a user runs it, at its smallest
settings, and its header must name the BLAS libraries loaded (the ratios rest
on them: benchmarks/_measure.py's ``blas``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

pytest.importorskip("torch")  # every benchmark times torch's op beside ExactRef's


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def header_names_blas(out: str) -> None:
    line = next((ln for ln in out.splitlines() if ln.startswith("BLAS loaded: ")), None)
    assert line is not None, out
    assert "kernels" in line and "threads" in line, line


@pytest.mark.parametrize(("script", "args", "row"), [
    ("bench_sum.py", ("--only", "1e6", "--repeat", "1"), "sum float32 n=1e6: torch float64"),
    ("bench_matmul.py", ("--sizes", "512", "--only", "matmul float32", "--repeat", "1"),
     "matmul float32  512^3: torch float64"),
    ("bench_attention.py", ("--shape", "1", "1", "32", "8", "--repeat", "1"), "custom float32  1x1x32x8: exactref"),
])
def test_benchmark_prints_its_rows(script, args, row):
    out = run(script, *args)
    header_names_blas(out)
    lines = [ln for ln in out.splitlines() if ln.startswith(row)]
    assert len(lines) == 1, out
    assert "ratio" in lines[0], lines[0]


def test_the_blas_line_names_every_blas_loaded():
    sys.path.insert(0, str(BENCH))
    try:
        import _measure
    finally:
        sys.path.remove(str(BENCH))
    import numpy as np
    import threadpoolctl

    np.ones((2, 2)) @ np.ones((2, 2))  # (numpy's BLAS is loaded with numpy)
    line = _measure.blas()
    found = [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    if not found:
        assert line == "BLAS loaded: none found"
        return
    for p in found:
        assert f"{p['internal_api']} {p['version']} ({p['architecture']} kernels" in line
        assert Path(p["filepath"]).name in line
