"""Error models: the algorithm classes that tolerances are computed for.

``er.models.DEFAULT`` is PyTorch's CPU kernels; the other presets and
:class:`ErrorModel` describe other classes, and :func:`tensor_core` the
accumulation of NVIDIA's MMA instructions, as an order.  The formulas behind every model
are derived in ``docs/tolerance-models.md``.
"""

from ._error_model import (
    BF16_MATMUL,
    DEFAULT,
    PYTORCH_AUTOGRAD,
    REDUCED_PRECISION_REDUCTION,
    TF32_MATMUL,
    ErrorModel,
)
from ._matrix_exp import PADE13, PYTORCH_MEXP, MatrixExpModel
from ._orders import Blocked
from ._tensor_core import TensorCore, tensor_core

__all__ = [
    "BF16_MATMUL",
    "DEFAULT",
    "PADE13",
    "PYTORCH_AUTOGRAD",
    "PYTORCH_MEXP",
    "REDUCED_PRECISION_REDUCTION",
    "TF32_MATMUL",
    "Blocked",
    "ErrorModel",
    "MatrixExpModel",
    "TensorCore",
    "tensor_core",
]
