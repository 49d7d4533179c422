"""ExactRef: exact, correctly rounded references with sound tolerances for numerical kernels."""

from . import models
from ._convert import asarray
from .errors import (
    DtypeMismatchWarning,
    MismatchError,
    OutOfToleranceError,
    ReferenceBudgetError,
    ReferenceUnavailableError,
    ShapeMismatchError,
    SpecialValueError,
)
from .formats import FORMATS, ComplexFormat, Format, format_of
from .models import ErrorModel
from .ops import (  # noqa: A004
    add,
    gemm,
    matmul,
    matrix_exp,
    matrix_exp_frechet,
    multiply,
    scaled_dot_product_attention,
    scaled_matmul,
    sum,
)
from .ops.attention import AttentionAlgorithm
from .result import Gradients, Result

__version__ = "0.1.0"

__all__ = [
    "AttentionAlgorithm",
    "FORMATS",
    "ComplexFormat",
    "DtypeMismatchWarning",
    "ErrorModel",
    "Format",
    "Gradients",
    "MismatchError",
    "OutOfToleranceError",
    "ReferenceBudgetError",
    "ReferenceUnavailableError",
    "Result",
    "ShapeMismatchError",
    "SpecialValueError",
    "add",
    "asarray",
    "format_of",
    "gemm",
    "matmul",
    "matrix_exp",
    "matrix_exp_frechet",
    "models",
    "multiply",
    "scaled_dot_product_attention",
    "scaled_matmul",
    "sum",
]
