"""The attention forward and backward together, with the backward's known failure.

Judged with ``pytest --exactref --exactref-kernels tritonkernels.exactref_attention_backward
-k backward``: known_failures is per format, and the forward, which passes in
float16, is judged from exactref_kernels.
"""

from . import attention
from .exactref_kernels import ATTENTION_FORWARD

# Measured on 40 cases of this repository's strategy: the worst element is 167 tolerances off in
# grad_value (query (1, 10, 13), 150 keys, |q| up to 31, the default scale), 7.2 in grad_key, 3.9 in
# grad_query.  With the pre-scaled K kept in float32 (the variant "float32_prescaled_k" in bugs.py)
# the suite passes 200 examples: covered.
REASON = ("the tutorial's backward recomputes the logits from K * sm_scale / ln 2 rounded to float16, and "
          "rounds dS to float16, which overflows where |dS| > 65504; FLASH_ATTENTION budgets neither "
          "(up to 167x the tolerance on drawn cases; covered when the pre-scaled K stays in float32)")

EXACTREF_KERNELS = {
    "scaled_dot_product_attention": {
        **ATTENTION_FORWARD,
        "backward": attention.attention_backward,
        "known_failures": {"float16": REASON},
    },
}
