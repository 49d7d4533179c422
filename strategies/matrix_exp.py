"""Per-op input sets for matrix_exp and matrix_exp_frechet."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.formats import ComplexFormat, Format, part_of

from ._common import Options, finish, index_of, patch_kinds, read_options
from ._draws import choice, ints
from ._validation import check_dtypes, check_int, check_positive_float, check_size
from .case import OpCase
from .hard import HardCase
from .shapes import batch_side

__all__ = ["MATRIX_EXP_HARD_CLASSES", "degree_thresholds", "matrix_exp_frechet_inputs", "matrix_exp_inputs"]

#: The hard-case classes of matrix_exp (matrix_exp_frechet adds ``commuting``):
#:
#: - ``nilpotent``: a strictly upper triangular matrix, whose exponential is a
#:   finite polynomial, so its exact value is rational;
#: - ``threshold``: a 1-norm within two ulps of one of the norms at which
#:   PyTorch's ``mexp`` changes its Taylor degree or its number of squarings;
#: - ``commuting`` (Fréchet only): E a power of two times A, so the exact
#:   derivative is exp(A) E.
MATRIX_EXP_HARD_CLASSES: tuple[str, ...] = ("nilpotent", "threshold")
_FRECHET_HARD_CLASSES: tuple[str, ...] = ("nilpotent", "threshold", "commuting")

# The 1-norm bounds under which PyTorch's mexp (aten/src/ATen/native/LinearAlgebra.cpp)
# uses a Taylor polynomial of degree 1, 2, 4, 8, 12 or 18; above the last it
# scales by 2**s with s = ceil(log2(norm / theta_18)).  float32 and complex64
# use the first table, every other dtype (half types included) the second.
_THETAS_FLOAT = (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                 5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00)
_THETAS_DOUBLE = (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                  4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00)


def degree_thresholds(dtype: Any, max_norm: float) -> tuple[float, ...]:
    """The 1-norms up to ``max_norm`` at which PyTorch's matrix_exp changes method for ``dtype``.

    >>> thresholds = degree_thresholds("float32", 8.0)
    >>> print(*(round(t, 4) for t in thresholds[-3:]))
    1.4617 3.0101 6.0201
    """
    from exactref.formats import format_of
    fmt = format_of(dtype)
    thetas = _THETAS_FLOAT if fmt.name in ("float32", "complex64") else _THETAS_DOUBLE
    out = list(thetas)
    top = thetas[-1] * 2
    while top <= max_norm:
        out.append(top)
        top *= 2
    return tuple(t for t in out if t <= max_norm)


def _nearest(fmt: Format, x: float) -> float:
    return float(np.array(x, dtype=np.float64).astype(np.dtype(fmt.dtype)).astype(np.float64)) \
        if fmt.dtype is not None else x


def _threshold_matrix(draw: st.DrawFn, fmt: Format | ComplexFormat, M: np.ndarray, max_norm: float) -> bool:
    """Turn M (n, n) into a matrix whose 1-norm is a threshold give or take two ulps."""
    part = part_of(fmt)
    usable = [t for t in degree_thresholds(fmt, max_norm) if _nearest(part, t) >= part.min_normal]
    if not usable:
        return False
    theta = _nearest(part, draw(choice(tuple(usable))))
    target = theta + draw(ints(-2, 2)) * part.ulp(theta)
    if not 0 < target <= max_norm:
        return False
    n = M.shape[-1]
    i, j = draw(ints(0, n - 1)), draw(ints(0, n - 1))
    # Shrink the other columns by a power of two until their sums stay below
    # target / 2, so column j alone sets the norm, exactly.
    current = float(np.max(np.sum(np.abs(M.astype(np.complex128)), axis=-2), initial=0.0))
    if not math.isfinite(current):
        return False
    if current > 0:
        shift = max(0, math.ceil(math.log2(2 * current / target)) + 1)
        M[...] = M * np.array(2.0 ** -shift, dtype=M.dtype)
    M[:, j] = 0
    M[i, j] = target * draw(choice((1.0, -1.0)))
    return True


def _bounded(fmt: Format | ComplexFormat, n: int, max_norm: float) -> float:
    # |re| + |im| >= |z|, so halving the part bound of a complex entry keeps each
    # column's sum of moduli within max_norm.
    return max_norm / n / (2 if fmt.is_complex else 1)


@st.composite
def _matrices(draw: st.DrawFn, o: Options, batches: st.SearchStrategy[tuple[int, ...]], max_norm: float,
              frechet: bool) -> OpCase:
    fmt = draw(choice(o.dtypes))
    n = draw(ints(1, o.max_side))
    batch = draw(batches)
    shape = batch + (n, n)
    bound = _bounded(fmt, n, max_norm)
    A = draw(o.array(fmt, shape, max_abs=bound))
    E = draw(o.array(fmt, shape, max_abs=bound)) if frechet else None
    # The backward is the Fréchet derivative at A^H in the direction grad, so
    # grad gets the same norm bound as A.  Hard cases are drawn last, so that
    # the shrinker can drop them cleanly.
    grad = None if frechet else draw(o.array(fmt, shape, max_abs=bound))
    hard: list[HardCase] = []
    for kind in patch_kinds(draw, int(np.prod(batch, dtype=np.int64)), o.hard):
        b = index_of(draw, batch)
        if any(h.index == b for h in hard):
            continue
        if kind == "nilpotent":
            A[b] = np.triu(A[b], 1)
        elif kind == "threshold":
            if not _threshold_matrix(draw, fmt, A[b], max_norm):
                continue
        else:
            k = draw(ints(-2, 2))
            with np.errstate(over="ignore", invalid="ignore"):
                E[b] = A[b] * np.array(2.0 ** k, dtype=A.dtype)
                if not np.array_equal(E[b].astype(np.complex128), A[b].astype(np.complex128) * 2.0 ** k):
                    continue
        hard.append(HardCase(b, (kind,)))
    if frechet:
        return finish(OpCase("matrix_exp_frechet", {"A": A, "E": E}, {}, None, tuple(hard)), o.device)
    return finish(OpCase("matrix_exp", {"A": A}, {}, grad, tuple(hard)), o.device)


def _options(strategy: str, dtypes: Any, max_side: Any, specials: Any, hard: Any, device: Any,
             classes: tuple[str, ...], max_batch_dims: Any, max_norm: Any
             ) -> tuple[Options, st.SearchStrategy[tuple[int, ...]], float]:
    fmts = check_dtypes("dtypes", dtypes)
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard, hard_classes=classes,
                     max_abs=None, device=device)
    max_batch_dims = check_int("max_batch_dims", max_batch_dims, min_value=0, max_value=16)
    check_size(strategy, {"max_batch_dims": max_batch_dims, "max_side": o.max_side}, _elements)
    batches = hnp.array_shapes(min_dims=0, max_dims=max_batch_dims, min_side=1,
                               max_side=batch_side(o.max_side, None))
    return o, batches, check_positive_float("max_norm", max_norm)


def _elements(max_batch_dims: int, max_side: int) -> int:
    """The most elements of A, E or grad: batch sides are at most min(max_side, 4)."""
    return batch_side(max_side, None) ** max_batch_dims * max_side ** 2


def matrix_exp_inputs(*, dtypes: Any = None, max_batch_dims: int = 1, max_side: int = 4,
                      max_norm: float = 4.0, specials: Any = False, hard: Any = True,
                      device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``matrix_exp(A)``: A is ``(..., n, n)`` with 1-norm at most ``max_norm``.

    Entries are bounded by ``max_norm / n`` (half that per part for complex
    formats), so every column's sum of moduli is at most ``max_norm``; the
    output gradient gets the same bound.  Special values are off by default
    because a single inf or NaN makes the whole exponential NaN; switching
    them on lifts the norm bound for those entries.  Hard cases are
    :data:`MATRIX_EXP_HARD_CLASSES`, by batch index in ``case.hard``.

    >>> import numpy as np
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(matrix_exp_inputs(dtypes=["float64"], max_norm=1.0))
    ... def test_norm(case):
    ...     assert np.abs(case.A).sum(axis=-2).max(initial=0) <= 1.0
    >>> test_norm()
    """
    o, batches, max_norm = _options("matrix_exp_inputs", dtypes, max_side, specials, hard, device,
                                    MATRIX_EXP_HARD_CLASSES, max_batch_dims, max_norm)
    return _matrices(o, batches, max_norm, False)


def matrix_exp_frechet_inputs(*, dtypes: Any = None, max_batch_dims: int = 1, max_side: int = 4,
                              max_norm: float = 4.0, specials: Any = False, hard: Any = True,
                              device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``matrix_exp_frechet(A, E)``, the derivative of exp at A in the direction E.

    A and E are drawn as A is by :func:`matrix_exp_inputs`, each with
    1-norm at most ``max_norm``.  The op has no backward, so ``case.grad``
    is None.  Hard cases add ``commuting``: E = 2**k A.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(matrix_exp_frechet_inputs())
    ... def test_fields(case):
    ...     assert case.A.shape == case.E.shape and case.grad is None
    >>> test_fields()
    """
    o, batches, max_norm = _options("matrix_exp_frechet_inputs", dtypes, max_side, specials, hard, device,
                                    _FRECHET_HARD_CLASSES, max_batch_dims, max_norm)
    return _matrices(o, batches, max_norm, True)
