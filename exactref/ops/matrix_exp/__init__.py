"""matrix_exp and matrix_exp_frechet: the public ops and their tolerance model.

``op`` is the public ops, certified with Arb balls; ``_model`` is the running
error bound of PyTorch's Taylor algorithm that the default tolerance comes
from; ``_pade`` is the normwise bound of Padé scaling and squaring (PADE13).
"""

from .op import PADE13, PYTORCH_MEXP, MatrixExpModel, matrix_exp, matrix_exp_frechet

__all__ = ["PADE13", "PYTORCH_MEXP", "MatrixExpModel", "matrix_exp", "matrix_exp_frechet"]
