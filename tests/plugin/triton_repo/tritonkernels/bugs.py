# Which planted bugs (and which algorithm variants) are switched on; the tests rewrite this file.
#
# Bugs: "fp16_accumulation" and "drop_last_k_block" (matmul.py); "pv_fp16_accumulation",
# "missing_rescale" and "strict_causal" (attention.py, forward).
# Variants of the backward, not bugs: "float32_prescaled_k" keeps K * sm_scale / ln 2 in float32,
# "float32_ds" keeps dS in float32 (the tutorial rounds both to float16).
BUGS: set[str] = set()
