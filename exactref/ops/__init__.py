"""The ops, one module per family."""

from .elementwise import add, multiply
from .matmul import gemm, matmul
from .reduction import sum  # noqa: A004

__all__ = ["add", "gemm", "matmul", "multiply", "sum"]
