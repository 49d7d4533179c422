"""The repository's own strategy for matmul: float32 and float16 with K of at least 2."""

import strategies as sx


def matmul_cases(**options):
    options.setdefault("max_side", 3)
    return sx.matmul_inputs(**options).filter(lambda case: case.A.shape[-1] >= 2)


EXACTREF_STRATEGIES = {"matmul": matmul_cases}
