"""Examples per second of every per-op strategy at its default sizes.

Run from the repository root:

    python benchmarks/bench_strategies.py [--examples N] [--dtype NAME]

Each strategy runs under Hypothesis's engine as a test does (generation only,
derandomized, no shrinking, a test body that does nothing), so the figure is
what generation costs a property test.  A baseline row shows Hypothesis's own
``arrays`` drawing three 4x4 float32 arrays, for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

# Run as a script, sys.path starts at benchmarks/; the packages live one level up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import strategies as sx  # noqa: E402


def rate(strategy: st.SearchStrategy[Any], examples: int) -> tuple[int, float]:
    """(examples drawn, seconds) for ``examples`` draws of ``strategy``."""
    count = [0]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(value: Any) -> None:
        count[0] += 1

    start = time.perf_counter()
    run()
    return count[0], time.perf_counter() - start


def rows(dtype: str | None) -> list[tuple[str, Callable[[], st.SearchStrategy[Any]]]]:
    real = None if dtype is None else [dtype]
    kw: dict[str, Any] = {} if dtype is None else {"dtypes": real}
    return [
        ("baseline: hnp.arrays 3 x (4, 4) float32",
         lambda: st.tuples(*[hnp.arrays(np.float32, (4, 4), elements=st.floats(width=32))] * 3)),
        ("matmul_inputs", lambda: sx.matmul_inputs(**kw)),
        ("gemm_inputs", lambda: sx.gemm_inputs(**kw)),
        ("add_inputs", lambda: sx.add_inputs(**kw)),
        ("multiply_inputs", lambda: sx.multiply_inputs(**kw)),
        ("sum_inputs", lambda: sx.sum_inputs(**kw)),
        ("scaled_dot_product_attention_inputs",
         lambda: sx.scaled_dot_product_attention_inputs(**({} if dtype is None or "complex" in dtype else kw))),
        ("matrix_exp_inputs", lambda: sx.matrix_exp_inputs(**kw)),
        ("matrix_exp_frechet_inputs", lambda: sx.matrix_exp_frechet_inputs(**kw)),
        ("matmul_inputs(specials=False, hard=False)",
         lambda: sx.matmul_inputs(specials=False, hard=False, **kw)),
        ("matmul_inputs(max_side=8)", lambda: sx.matmul_inputs(max_side=8, **kw)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="draws per strategy (default 300)")
    parser.add_argument("--dtype", default=None, help="one dtype for every strategy (default: all formats)")
    args = parser.parse_args()
    table = []
    for name, make in rows(args.dtype):
        strategy = make()
        rate(strategy, 5)  # warm the strategy's caches and Hypothesis's
        n, seconds = rate(strategy, args.examples)
        table.append((name, n, seconds, n / seconds))
    width = max(len(r[0]) for r in table)
    print(f"{'strategy':<{width}}  {'examples':>8}  {'seconds':>7}  {'examples/s':>10}")
    for name, n, seconds, per in table:
        print(f"{name:<{width}}  {n:>8}  {seconds:>7.2f}  {per:>10.0f}")


if __name__ == "__main__":
    main()
