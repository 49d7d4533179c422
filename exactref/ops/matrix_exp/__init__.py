"""matrix_exp and matrix_exp_frechet: the public ops and their tolerance model.

``op`` is the public ops, certified with Arb balls; ``_model`` is the running
error bound of PyTorch's Taylor algorithm that the tolerance comes from.
"""

from .op import PYTORCH_MEXP, MatrixExpModel, matrix_exp, matrix_exp_frechet

__all__ = ["PYTORCH_MEXP", "MatrixExpModel", "matrix_exp", "matrix_exp_frechet"]
