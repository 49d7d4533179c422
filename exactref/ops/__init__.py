"""The ops, one module per family."""

from .attention import scaled_dot_product_attention
from .elementwise import add, multiply
from .matmul import gemm, matmul
from .matrix_exp import matrix_exp, matrix_exp_frechet
from .reduction import sum  # noqa: A004
from .scaled_matmul import scaled_matmul

__all__ = ["add", "gemm", "matmul", "matrix_exp", "matrix_exp_frechet", "multiply", "scaled_dot_product_attention",
           "scaled_matmul", "sum"]
