"""What ExactRef judges: the tiled matmul and the FlashAttention-2 style attention, forward and backward."""

import exactref as er

from . import attention, matmul

MATMUL = {
    "forward": matmul.matmul,
    "backward": matmul.matmul_backward,
    "formats": ["float16", "float32"],
    # One float32 sum per element (tl.dot accumulates in float32), rounded once: the default model.
    "model": er.models.DEFAULT,
    # 2-D matrices of up to 24 (partial blocks of 16, and up to two K blocks), which the interpreter runs fast.
    "strategy_options": {"allow_1d": False, "max_batch_dims": 0, "max_side": 24},
}

ATTENTION_OPTIONS = {
    # What the kernel supports: no mask, no GQA (dropout is always 0), is_causal top-left, any scale.
    "masks": False, "gqa": False,
    # Sides up to 16 (exactref_strategies appends up to 15 blocks of 16 keys), batches up to 2 x 2,
    # values up to 32, which makes logits large, as a query scaled by 8 does.
    "max_side": 16, "max_batch_dims": 2, "max_batch_side": 2, "max_abs": 32.0, "specials": False,
}

ATTENTION = {
    "forward": attention.attention,
    "backward": attention.attention_backward,
    "formats": ["float16"],
    # Forward: FLASH_ATTENTION's (online softmax over blocks of 16 keys, weights rounded to float16
    # before P V).  Backward: the weights recomputed with exp2 from K * sm_scale / ln 2 rounded to
    # float16, dS rounded to float16 (and overflowing past 65504), float32 gradients over blocks of 16.
    "model": er.AttentionAlgorithm.TRITON_FLASH_ATTENTION,
    "strategy_options": ATTENTION_OPTIONS,
}

EXACTREF_KERNELS = {"matmul": MATMUL, "scaled_dot_product_attention": ATTENTION}
