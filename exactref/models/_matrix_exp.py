"""matrix_exp's algorithm classes: PyTorch's Taylor scheme (the default) and Padé scaling and squaring."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PADE13", "PYTORCH_MEXP", "MatrixExpModel"]


@dataclass(frozen=True)
class MatrixExpModel:
    """The algorithm class matrix_exp's tolerances are computed for.

    ``PYTORCH_MEXP`` (the default): PyTorch's ``mexp``, Bader-Blanes-Casas
    Taylor schemes of degree 1, 2, 4, 8, 12 or 18 chosen by the 1-norm (a
    batch of several matrices always takes degree 18), scaling by a power of
    two and squaring, with matrix products in any summation order; a 1 x 1
    forward is ``torch.exp``.  The tolerance is componentwise.

    ``PADE13``: Al-Mohy and Higham's (2009) Padé scaling and squaring, as
    ``scipy.linalg.expm`` runs it: degree 3, 5, 7, 9 or 13 and the scaling
    chosen from norms of powers of A, (V - U)^-1 (V + U) by LU with partial
    pivoting, s squarings; a diagonal A (a 1 x 1 included) gives exp of its
    diagonal, or, as in JAX's expm, which has no shortcut, Padé's value.  The
    tolerance is a normwise bound on ||computed - exp(A)||_1, applied to
    every element (docs/matrix-exp.md, "Padé scaling and squaring").
    Formats float32, float64, complex64 and complex128.
    """

    name: str = "pytorch_mexp"

    def __str__(self) -> str:
        return self.name


#: PyTorch's matrix_exp (Taylor schemes, scaling and squaring): the default, componentwise.
PYTORCH_MEXP = MatrixExpModel()
#: Padé-13 scaling and squaring as scipy.linalg.expm runs it: a normwise bound on every element.
PADE13 = MatrixExpModel("pade13")
