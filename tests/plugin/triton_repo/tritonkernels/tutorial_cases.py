"""The cases of Triton's own fused-attention test: N_CTX 128 and 256, causal or not, q scaled by 8.

``python -m tritonkernels.tutorial_cases [ALGORITHM ...]`` runs the example's
forward and backward on them, in float16, and prints one line per case,
algorithm and output: how many elements are not covered and the worst
error in tolerances.  The suite's strategy draws at most 16 query rows (the
interpreter's cost grows with blocks of rows times blocks of keys), so these
long, square cases are judged here instead, with blocks of 32 rows and keys
(the tutorial's own are 32 to 128): a quarter of the programs of blocks of
16, and the same roundings.  The classes hold for blocks of 16 or more.
"""

import sys
import warnings

import torch

import exactref as er
from exactref.harness.judge import error_ratio

from . import attention

N_CTX = (128, 256)
HEAD_DIM = 64
BLOCK = 32


def cases():
    """(name, q, k, v, dO, is_causal): one head of the tutorial's shapes, seeded, q scaled by 8."""
    for n in N_CTX:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(n + causal)
            q, k, v, do = (torch.randn(1, 1, n, HEAD_DIM, generator=gen) for _ in range(4))
            yield f"N_CTX={n} causal={causal}", (q * 8).half(), k.half(), v.half(), do.half(), causal
    # And one whose dS overflows float16: P = 1/2 twice, dP = +-160000, D = 0, so dS = +-80000,
    # inf in float16, and grad_key is NaN (inf * 0) where the exact value is 0.
    q, k = torch.zeros(1, 1, 1, 1), torch.tensor([[[[0.0], [1.0]]]])
    v, do = torch.tensor([[[[400.0], [-400.0]]]]), torch.full((1, 1, 1, 1), 400.0)
    yield "dS overflow", q.half(), k.half(), v.half(), do.half(), False


def main(names: list[str]) -> None:
    algorithms = [er.AttentionAlgorithm[name] for name in names] or [er.AttentionAlgorithm.TRITON_FLASH_ATTENTION]
    attention.BLOCK_M = attention.BLOCK_N = BLOCK
    # The interpreter's numpy warns of the overflow of dS in the last case.
    warnings.simplefilter("ignore", RuntimeWarning)
    for name, q, k, v, do, causal in cases():
        out = attention.attention(q, k, v, is_causal=causal)
        grads = attention.attention_backward(q, k, v, do, is_causal=causal)
        for algorithm in algorithms:
            r = er.scaled_dot_product_attention(q, k, v, is_causal=causal, algorithm=algorithm)
            g = r.backward(do)
            for which, got, judged in [("out", out, r)] + [(w, grads[w], g[w]) for w in
                                                            ("grad_query", "grad_key", "grad_value")]:
                got = got.float().numpy()
                bad = int((~judged.covers(got)).sum())
                print(f"{name} {algorithm.name} {which}: {bad} not covered, worst {error_ratio(judged, got):.3g}")


if __name__ == "__main__":
    main(sys.argv[1:])
