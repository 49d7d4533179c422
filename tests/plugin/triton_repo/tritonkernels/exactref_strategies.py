"""The repository's own attention cases: the built-in ones, with up to 15 more blocks of 16 keys.

The online softmax goes wrong, if at all, between blocks of keys, and some
errors (a float16 accumulator for P V) only show over many blocks; the
interpreter's cost grows with blocks of queries times blocks of keys.  So:
few query rows (the built-in strategy's max_side) against many keys.
Triton's own square test shapes (N_CTX 128 and 256) are judged by
tutorial_cases instead.
"""

import numpy as np
from hypothesis import strategies as st

import strategies as sx

BLOCK = 16  # the kernels' BLOCK_N


def attention_cases(*, max_extra_blocks: int = 15, **options):
    """scaled_dot_product_attention_inputs(**options), with 0..max_extra_blocks blocks of keys appended."""
    base = sx.scaled_dot_product_attention_inputs(**options)
    max_abs = options.get("max_abs", 4.0)
    specials = options.get("specials", True)

    @st.composite
    def longer(draw):
        case = draw(base)
        extra = draw(st.integers(0, max_extra_blocks)) * BLOCK
        if not extra:
            return case
        key, value = case.inputs["key"], case.inputs["value"]
        more = [draw(sx.arrays(dtype=a.dtype, shape=a.shape[:-2] + (extra, a.shape[-1]), specials=specials,
                               max_abs=max_abs)) for a in (key, value)]
        inputs = {"query": case.inputs["query"], "key": np.concatenate([key, more[0]], axis=-2),
                  "value": np.concatenate([value, more[1]], axis=-2)}
        # Hard cases index query rows and keys already there: they stay where they were.
        return sx.OpCase(case.op, inputs, case.kwargs, case.grad, case.hard)

    return longer()


EXACTREF_STRATEGIES = {"scaled_dot_product_attention": attention_cases}
