"""Per-op input sets for matmul and gemm."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from exactref.formats import FLOAT8_FORMATS, FORMATS, part_of

from ._common import (
    Options,
    Patcher,
    coefficients,
    finish,
    in_part,
    index_of,
    patch_kinds,
    positions,
    power_of_two,
    read_options,
    source_index,
)
from ._draws import choice, coin, ints
from ._validation import (
    check_bool,
    check_coefficient,
    check_dtypes,
    check_int,
    check_size,
)
from .case import OpCase
from .hard import HARD_CLASSES, HardCase, draw_plan
from .scaled_matmul import FLOAT8_INPUTS, _float8_array
from .shapes import batch_side, gemm_shapes, matmul_shapes

__all__ = ["gemm_inputs", "matmul_inputs"]

_PARTS = ("real", "imag")
# matmul draws float8 operands only on request: PyTorch computes no other op on them.
_NOT_FLOAT8 = tuple(n for n in FORMATS if n not in FLOAT8_FORMATS)


def _as_2d(A: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Views of A and B with torch.matmul's 1-D operands given their missing dim."""
    return (A if A.ndim >= 2 else A[np.newaxis, :]), (B if B.ndim >= 2 else B[:, np.newaxis])


def _place(draw: st.DrawFn, o: Options, fmt: Any, arrays: dict[str, np.ndarray], alpha: float | complex,
           beta: float | complex | None) -> list[HardCase]:
    """Put hard dot products at some output elements; gemm passes beta (matmul None)."""
    A, B = arrays["A"], arrays["B"]
    A2, B2 = _as_2d(A, B)
    batch = np.broadcast_shapes(A2.shape[:-2], B2.shape[:-2])
    out2 = batch + (A2.shape[-2], B2.shape[-1])
    K = A2.shape[-1]
    size = int(np.prod(out2, dtype=np.int64))
    C = arrays.get("C")
    use_c = C is not None and beta != 0
    patcher = Patcher({"A": A2, "B": B2, **({"C": C} if C is not None else {})})
    hard: list[HardCase] = []
    for kind in patch_kinds(draw, size, o.hard if power_of_two(alpha) else ()):
        idx2 = index_of(draw, out2)
        b_idx, (i, j) = idx2[:-2], idx2[-2:]
        c_slot = use_c and power_of_two(beta) and draw(coin())
        plan = draw_plan(draw, part_of(fmt), kind, K + int(c_slot), products=True,
                         cancellation="cancellation" in o.hard)
        if plan is None:
            continue
        pairs = list(plan.pairs)
        c_value = 0.0
        if c_slot and len(pairs) >= 2:
            # Every multi-term plan starts with a term that is a value of the format.
            a0, b0 = pairs.pop(0)
            c_value = a0 * b0 / beta.real if isinstance(beta, complex) else a0 * b0 / beta
        if len(pairs) > K:
            continue
        scale = alpha.real if isinstance(alpha, complex) else alpha
        # Dividing by a power of two is exact unless it underflows.
        if any((a / scale) * scale != a for a, _ in pairs):
            continue
        pairs = [(a / scale, b) for a, b in pairs]
        row, col = [0.0] * K, [0.0] * K
        for k, (a, b) in zip(positions(draw, K, len(pairs)), pairs):
            row[k], col[k] = a, b
        part = draw(choice(_PARTS)) if fmt.is_complex else None
        a_idx = source_index(b_idx, A2.shape[:-2])
        bb_idx = source_index(b_idx, B2.shape[:-2])
        writes = [("A", a_idx + (i, k), in_part(row[k], fmt, part)) for k in range(K)]
        writes += [("B", bb_idx + (k, j), in_part(col[k], fmt, None)) for k in range(K)]
        out_idx = b_idx + ((i,) if A.ndim >= 2 else ()) + ((j,) if B.ndim >= 2 else ())
        if use_c:
            writes.append(("C", source_index(out_idx, C.shape), in_part(c_value, fmt, part)))
        if patcher.apply(writes):
            hard.append(HardCase(out_idx, plan.kinds, part))
    return hard


@st.composite
def _float8_matmul(draw: st.DrawFn, o: Options, name: str) -> OpCase:
    # Matrices only: PyTorch's CPU kernels have mm for float8, but no dot, mv or bmm.
    M, K, N = (draw(ints(1, o.max_side)) for _ in range(3))
    A = draw(_float8_array(name, (M, K), o.specials, o.max_abs))
    B = draw(_float8_array(name, (K, N), o.specials, o.max_abs))
    # A placeholder: there is no float8 backward to give it to (see matmul_inputs).
    grad = np.zeros((M, N), FORMATS[name].dtype)
    return finish(OpCase("matmul", {"A": A, "B": B}, {}, grad), o.device)


@st.composite
def _matmul(draw: st.DrawFn, o: Options, shape_sets: st.SearchStrategy[Any]) -> OpCase:
    fmt = draw(choice(o.dtypes))
    if fmt.name in FLOAT8_FORMATS:
        return draw(_float8_matmul(o, fmt.name))
    shapes = draw(shape_sets)
    A = draw(o.array(fmt, shapes.input_shapes[0]))
    B = draw(o.array(fmt, shapes.input_shapes[1]))
    # Hard cases are drawn last, so that the shrinker can drop them cleanly.
    grad = draw(o.array(fmt, shapes.result_shape))
    hard = _place(draw, o, fmt, {"A": A, "B": B}, 1.0, None) if o.hard else []
    return finish(OpCase("matmul", {"A": A, "B": B}, {}, grad, tuple(hard)), o.device)


def matmul_inputs(*, dtypes: Any = None, max_batch_dims: int = 2, max_side: int = 4,
                  max_batch_side: int | None = None, allow_1d: bool = True, specials: Any = True,
                  hard: Any = True, max_abs: float | None = None, device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``matmul(A, B)`` with torch.matmul's semantics.

    Shapes come from :func:`strategies.matmul_shapes`: batch dims that
    broadcast (sides up to ``max_batch_side``, by default ``max_side`` but at
    most 4), 1-D operands with ``allow_1d``, matrix sides up to ``max_side``.  Hard cases set one row of A and one column of B so that
    their dot product is a tie, a near tie or a cancellation, with the terms
    in a drawn order.

    The float8 formats (not e8m0) are drawn only when ``dtypes`` names them:
    their operands are matrices (PyTorch's CPU kernels have mm for float8,
    no dot, mv or bmm) drawn by :func:`strategies.float8_arrays`, without
    hard cases, and their ``grad`` is zeros, a placeholder: PyTorch has no
    float8 backward, and neither has exactref.

    >>> from hypothesis import find
    >>> case = find(matmul_inputs(), lambda c: c.A.shape[-1] >= 3)
    >>> case.A.shape, case.B.shape, case.grad.shape
    ((1, 3), (3, 1), (1, 1))
    >>> find(matmul_inputs(dtypes=["float8_e5m2"]), lambda c: True).A.dtype.name
    'float8_e5m2'
    """
    fmts = check_dtypes("dtypes", dtypes, default=_NOT_FLOAT8, allowed=_NOT_FLOAT8 + FLOAT8_INPUTS, op="matmul")
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=HARD_CLASSES, max_abs=max_abs, device=device)
    max_batch_dims = _check_sizes("matmul_inputs", max_batch_dims, o.max_side, max_batch_side)
    return _matmul(o, matmul_shapes(max_batch_dims=max_batch_dims, max_side=o.max_side,
                                    max_batch_side=max_batch_side, allow_1d=check_bool("allow_1d", allow_1d)))


def _check_sizes(strategy: str, max_batch_dims: Any, max_side: int, max_batch_side: Any) -> int:
    """The checked max_batch_dims, with the largest drawable operand within the size limit."""
    max_batch_dims = check_int("max_batch_dims", max_batch_dims, min_value=0, max_value=16)
    batch_side(max_side, max_batch_side)  # checks max_batch_side
    check_size(strategy, {"max_batch_dims": max_batch_dims, "max_side": max_side, "max_batch_side": max_batch_side},
               _elements)
    return max_batch_dims


def _elements(max_batch_dims: int, max_side: int, max_batch_side: int | None) -> int:
    """The most elements of A, B, C, the output or grad: batch sides are at most max_side too."""
    return min(batch_side(max_side, max_batch_side), max_side) ** max_batch_dims * max_side ** 2


@st.composite
def _gemm(draw: st.DrawFn, o: Options, shape_sets: st.SearchStrategy[Any], alpha: Any, beta: Any) -> OpCase:
    fmt = draw(choice(o.dtypes))
    shapes = draw(shape_sets)
    A, B, C = (draw(o.array(fmt, s)) for s in shapes.input_shapes)
    a = draw(coefficients(fmt)) if alpha is None else alpha
    b = draw(coefficients(fmt)) if beta is None else beta
    grad = draw(o.array(fmt, shapes.result_shape))
    hard = _place(draw, o, fmt, {"A": A, "B": B, "C": C}, a, b) if o.hard else []
    return finish(OpCase("gemm", {"A": A, "B": B, "C": C}, {"alpha": a, "beta": b}, grad, tuple(hard)),
                  o.device)


def gemm_inputs(*, dtypes: Any = None, max_batch_dims: int = 1, max_side: int = 4,
                max_batch_side: int | None = None, allow_1d: bool = False, specials: Any = True,
                hard: Any = True, alpha: float | complex | None = None,
                beta: float | complex | None = None, max_abs: float | None = None,
                device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``gemm(A, B, C, *, alpha, beta)``: beta * C + alpha * (A @ B).

    C broadcasts to the product's shape.  ``alpha`` and ``beta`` are drawn
    (shrinking to 1, and including 0, which makes a BLAS skip an operand)
    unless given.  A hard case may put one of its terms in C.

    >>> import numpy as np
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(gemm_inputs(dtypes=["float32"], alpha=1.0))
    ... def test_c_broadcasts(case):
    ...     out = np.matmul(np.zeros(case.A.shape), np.zeros(case.B.shape)).shape
    ...     assert case.alpha == 1.0 and np.broadcast_shapes(case.C.shape, out) == out == case.grad.shape
    >>> test_c_broadcasts()
    """
    fmts = check_dtypes("dtypes", dtypes, default=_NOT_FLOAT8, allowed=_NOT_FLOAT8, op="gemm")
    names = tuple(f.name for f in fmts)
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=HARD_CLASSES, max_abs=max_abs, device=device)
    max_batch_dims = _check_sizes("gemm_inputs", max_batch_dims, o.max_side, max_batch_side)
    shape_sets = gemm_shapes(max_batch_dims=max_batch_dims, max_side=o.max_side,
                             max_batch_side=max_batch_side, allow_1d=check_bool("allow_1d", allow_1d))
    return _gemm(o, shape_sets,
                 check_coefficient("alpha", alpha, names), check_coefficient("beta", beta, names))
