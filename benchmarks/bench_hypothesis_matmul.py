"""Examples per second of a Hypothesis property test of matmul backward on small shapes.

The target (DESIGN.md) is at least 200 examples per second for shapes up to
8x8x8: generation by ``strategies.matmul_inputs`` plus ExactRef's backward
and covers() on both gradients.  Generation alone is measured too, since it
bounds the rate.

Run: python benchmarks/bench_hypothesis_matmul.py [--examples N]
"""

from __future__ import annotations

import argparse
import time

from hypothesis import HealthCheck, given, settings

import exactref as er
import strategies as sx


def rate(examples: int, judge: bool) -> float:
    count = 0

    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(sx.matmul_inputs(dtypes=["float32", "float16", "bfloat16"], max_side=8, max_batch_dims=0))
    def prop(case):
        nonlocal count
        count += 1
        if judge:
            g = er.matmul.backward(case.A, case.B, case.grad)
            g["grad_A"].covers(g.rounded.grad_A)
            g["grad_B"].covers(g.rounded.grad_B)

    start = time.perf_counter()
    prop()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400)
    args = parser.parse_args()
    gen = rate(args.examples, judge=False)
    full = rate(args.examples, judge=True)
    print(f"generation only: {gen:.0f} examples/s")
    print(f"matmul backward property test (sides <= 8): {full:.0f} examples/s (target >= 200) "
          f"{'ok' if full >= 200 else 'MISSED'}")


if __name__ == "__main__":
    main()
