"""Triton kernels (a tiled matmul and a FlashAttention-2 style attention) judged by ExactRef on a CPU.

The kernels run in Triton's interpreter, which executes them with numpy.  It
is chosen by TRITON_INTERPRET=1, read when the kernels are defined, so it is
set here before ``triton`` is imported (unless the environment says otherwise).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
