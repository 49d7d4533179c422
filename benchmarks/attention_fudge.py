"""How exactref's attention tolerances compare with the fudge factors of PyTorch's test_transformers.py.

PyTorch's fused-attention tests pass when max|golden - fused| <= fudge *
max|golden - low-precision math path|, with fudge 4 for the output, 180 for
grad_query, 16 for grad_key and 4 for grad_value (flash vs math).  For each
format this prints, per output:

* ``needed``: max|exact - CPU fused| / max|exact - math path in the format``,
  the fudge PyTorch's CPU fused kernel needs on these inputs;
* ``granted``: max(tolerance) / max|exact - math path|, the fudge the model's
  tolerance amounts to;
* ``worst``: max over elements of |exact - CPU fused| / tolerance, and
  whether covers() accepts every element (it also accepts the rounding of a
  value within tolerance, so a half format can show a little above 1).

    python benchmarks/attention_fudge.py [--shape B H L E] [--seeds N]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er

NAMES = ("out", "grad_query", "grad_key", "grad_value")


def run(backend: SDPBackend, q, k, v, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 4, 128, 64], metavar=("B", "H", "L", "E"))
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"shape {tuple(args.shape)}, {args.seeds} seeds; PyTorch's fudge factors: out 4, grad_query 180, "
          "grad_key 16, grad_value 4")
    for fmt, algorithm in (("float16", er.AttentionAlgorithm.FLASH_ATTENTION),
                           ("bfloat16", er.AttentionAlgorithm.FLASH_ATTENTION),
                           ("float32", er.AttentionAlgorithm.MATH)):
        dtype = getattr(torch, fmt)
        stats = {n: [0.0, 0.0, 0.0, True] for n in NAMES}
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            q, k, v, grad = (torch.randn(*args.shape, generator=gen).to(dtype) for _ in range(4))
            fused = run(SDPBackend.FLASH_ATTENTION, q, k, v, grad)
            math_path = run(SDPBackend.MATH, q, k, v, grad)
            r = er.scaled_dot_product_attention(q, k, v, algorithm=algorithm)
            g = r.backward(grad)
            results = [r, g["grad_query"], g["grad_key"], g["grad_value"]]
            for name, res, f, m in zip(NAMES, results, fused, math_path):
                part = res._parts[0]
                exact = (part.x_lo + part.x_hi) / 2  # within 2**-40 relative of the exact value
                s_covered = bool(res.covers(f).all())
                err_f = np.abs(f.double().numpy() - exact)
                err_m = np.abs(m.double().numpy() - exact).max()
                s = stats[name]
                s[3] = s[3] and s_covered
                s[0] = max(s[0], err_f.max() / err_m)
                s[1] = max(s[1], res.tolerance.max() / err_m)
                s[2] = max(s[2], (err_f / res.tolerance).max())
        print(f"{fmt} under {algorithm.name}:")
        for name in NAMES:
            needed, granted, worst, covered = stats[name]
            print(f"  {name:11s} needed {needed:7.2f}  granted {granted:8.2f}  worst error/tolerance {worst:.3f}"
                  f"  {'covered' if covered else 'NOT COVERED'}")


if __name__ == "__main__":
    main()
