"""Hypothesis strategies for testing numerical kernels against exactref.

Building blocks (formats, shapes, broadcast shape sets, element values with
special values, arrays) and, for each op, ``<op>_inputs(...)``: a strategy of
:class:`OpCase` objects whose fields carry the op's parameter names and the
output gradient.  torch is only imported when tensors are asked for.

>>> from hypothesis import given, settings
>>> import strategies as sx
>>> @settings(max_examples=20)
... @given(sx.matmul_inputs(dtypes=["float16", "bfloat16"], max_side=8))
... def test_my_matmul_backward(case):
...     grads = case.backward()          # exactref's reference gradients
...     assert grads.rounded.grad_A.shape == case.A.shape
>>> test_my_matmul_backward()
"""

from .attention import (
    ATTENTION_HARD_CLASSES,
    MASK_KINDS,
    scaled_dot_product_attention_inputs,
)
from .case import OPS, SIGNATURES, OpCase, Signature, check_case
from .casts import CAST_CLASSES, cast_values
from .dtypes import FLOAT8, formats
from .elementwise import add_inputs, multiply_inputs, sum_inputs
from .hard import HARD_CLASSES, HardCase
from .linalg import gemm_inputs, matmul_inputs
from .matrix_exp import (
    MATRIX_EXP_HARD_CLASSES,
    degree_thresholds,
    matrix_exp_frechet_inputs,
    matrix_exp_inputs,
)
from .registry import (
    BUILTIN,
    load_module,
    register,
    registered,
    strategy_for,
    unregister,
)
from .scaled_matmul import (
    FLOAT8_INPUTS,
    SCALE_KINDS,
    float8_arrays,
    scaled_matmul_inputs,
)
from .shapes import (
    MATMUL_SIGNATURE,
    broadcast_shapes,
    gemm_shapes,
    matmul_shapes,
    shapes,
)
from .values import SPECIAL_CLASSES, arrays, elements, special_class, special_values

__all__ = [
    "ATTENTION_HARD_CLASSES",
    "BUILTIN",
    "CAST_CLASSES",
    "FLOAT8",
    "HARD_CLASSES",
    "MASK_KINDS",
    "MATMUL_SIGNATURE",
    "MATRIX_EXP_HARD_CLASSES",
    "OPS",
    "SCALE_KINDS",
    "SIGNATURES",
    "SPECIAL_CLASSES",
    "HardCase",
    "OpCase",
    "Signature",
    "add_inputs",
    "arrays",
    "broadcast_shapes",
    "cast_values",
    "check_case",
    "degree_thresholds",
    "elements",
    "formats",
    "gemm_inputs",
    "gemm_shapes",
    "load_module",
    "matmul_inputs",
    "matmul_shapes",
    "matrix_exp_frechet_inputs",
    "matrix_exp_inputs",
    "multiply_inputs",
    "register",
    "registered",
    "scaled_dot_product_attention_inputs",
    "scaled_matmul_inputs",
    "shapes",
    "special_class",
    "special_values",
    "strategy_for",
    "sum_inputs",
    "unregister",
]
