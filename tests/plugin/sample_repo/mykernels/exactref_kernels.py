"""What ExactRef tests: each op's kernel, its backward, and the formats it supports."""

import exactref as er

from . import ops

EXACTREF_KERNELS = {
    "matmul": {
        "forward": ops.matmul,
        "backward": ops.matmul_backward,
        "formats": ["float32", "float16", "complex64"],
        # The model PyTorch's own backward is judged under; this one's double-precision backward needs less.
        "backward_model": er.models.PYTORCH_AUTOGRAD,
        # Matrices only, and moderate finite values: every bug planted here shows on them, and a
        # failure then has one kind, so the tests can say which (Hypothesis looks for further
        # kinds for a while after the first, for as long as the machine's speed allows).
        "strategy_options": {"allow_1d": False, "specials": False, "max_abs": 16.0},
    },
    "add": {"forward": ops.add, "backward": "autograd", "formats": ["float32"],
            "backward_model": er.models.PYTORCH_AUTOGRAD},
}
