"""The bounds the error models are built from, as functions of the sums of |terms|.

The derivations are in ``docs/tolerance-models.md``.  Every function returns
float64 bounds rounded upwards (``up``), so that a bound computed in float64
is never smaller than the real number it stands for.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _fused
from ..engine.fast import _up_into, gamma, up
from ..formats import Format
from ..rounding import round_float64
from ._error_model import ErrorModel

__all__ = [
    "declared",
    "dot_error",
    "overflow_possible",
    "partials_error",
    "products_exact",
    "products_may_underflow",
    "scalar_error",
    "scaled_bound_constants",
    "widening_error",
]


def products_exact(p_in: int, acc: Format) -> bool:
    return 2 * p_in <= acc.p


def products_may_underflow(fin: Format, acc: Format) -> bool:
    return 2 * (fin.emin - fin.p + 1) < acc.emin


def declared(model: ErrorModel) -> bool:
    """Whether the model asks for more than the bound for any order: a declared order, or a failure rate."""
    return model.order != "any" or model.failure_rate is not None


def dot_error(S: np.ndarray, *, depth: int, acc: Format, out: Format, terms: int = 0,
              underflow: bool = False) -> np.ndarray:
    """Bound on |computed - exact| before the final rounding to ``out``.

    ``depth`` is the number of roundings in ``acc`` along any term's path
    (additions, rounded products, scalar multiplies).  When ``acc`` is the
    output format, the last of them *is* the final rounding and is budgeted
    by the acceptance interval instead.  ``underflow`` adds half a subnormal
    spacing of ``acc`` per term for products that may underflow.
    """
    k, underflow = _dot_roundings(depth, acc, out, terms, underflow)
    E = gamma(max(k, 0), acc.unit_roundoff) * S if k > 0 else np.zeros_like(S)
    # E is a fresh array (or a scalar): the steps below write over it, the same operations
    # without two more output-sized temporaries (at 2048 x 2048, 32 MiB each, fresh pages).
    fresh = type(E) is np.ndarray and E.dtype == np.float64
    if underflow:
        E = np.add(E, terms * acc.min_subnormal, out=E) if fresh else E + terms * acc.min_subnormal
    if not (k > 0 or underflow):
        return E
    return _up_into(E) if fresh else up(E)


def dot_error_and_overflow(S: np.ndarray, *, depth: int, acc: Format, out: Format, terms: int = 0,
                           underflow: bool = False, overflow_depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(dot_error(S, ...), overflow_possible(S, acc, overflow_depth))``: the same values, in one
    compiled pass over S where that applies (exactref/_fused.py)."""
    constants = scaled_bound_constants(depth=depth, acc=acc, out=out, terms=terms, underflow=underflow,
                                       overflow_depth=overflow_depth)
    if constants is not None:
        fused = _fused.scaled_bound(S, *constants)
        if fused is not None:
            return fused
    return (dot_error(S, depth=depth, acc=acc, out=out, terms=terms, underflow=underflow),
            overflow_possible(S, acc, overflow_depth))


def scaled_bound_constants(*, depth: int, acc: Format, out: Format, terms: int = 0, underflow: bool = False,
                           overflow_depth: int = 1) -> tuple[float, float, float, float] | None:
    """``(g, add, factor, limit)`` such that :func:`dot_error_and_overflow` with these arguments is
    ``(up(g * S + add), S * factor >= limit)`` elementwise; None where dot_error counts no rounding
    (it is then 0, or the underflow term alone)."""
    k, under = _dot_roundings(depth, acc, out, terms, underflow)
    if k <= 0:
        return None
    return (gamma(k, acc.unit_roundoff), terms * acc.min_subnormal if under else 0.0,
            _overflow_factor(acc, overflow_depth), acc.max_finite)


def _dot_roundings(depth: int, acc: Format, out: Format, terms: int, underflow: bool) -> tuple[int, bool]:
    """dot_error's roundings counted (the final one, where ``acc`` is ``out``, is the acceptance
    interval's) and whether half a subnormal per term is added."""
    same = acc is out or acc == out  # (the identity test spares the dataclass comparison, usually)
    k = depth - 1 if same else depth
    # An underflowing rounding breaks the relative bound, unless it is the final rounding itself.
    return k, bool(underflow and terms and (k > 0 or not same))


def overflow_possible(S: np.ndarray, acc: Format, depth: int = 1) -> np.ndarray:
    """Where a partial result in ``acc`` may overflow although the exact value need not."""
    return S * _overflow_factor(acc, depth) >= acc.max_finite


def _overflow_factor(acc: Format, depth: int) -> float:
    return 1 + gamma(max(depth, 1), acc.unit_roundoff)


def partials_error(S: np.ndarray, *, copies: int, per_copy_depth: int, acc: Format, out: Format) -> np.ndarray:
    """Bound for ``copies`` partial results, each rounded to ``out``, then summed in ``acc``.

    This is PyTorch's autograd for a broadcast operand: a per-copy product
    (``per_copy_depth`` roundings in ``acc``) is stored in the output dtype,
    and ``sum_to_size`` adds the copies.  S bounds the sum of |terms| over
    all copies.
    """
    u_out = out.unit_roundoff
    if acc == out:
        f1 = gamma(per_copy_depth, acc.unit_roundoff)
    else:
        g = gamma(per_copy_depth, acc.unit_roundoff)
        f1 = g + u_out * (1 + g)
    k2 = copies - 2 if acc == out else copies - 1
    g2 = gamma(max(k2, 0), acc.unit_roundoff) if k2 > 0 else 0.0
    E = (f1 + g2 * (1 + f1)) * S + copies * out.min_subnormal
    return up(E)


def widening_error(E: np.ndarray, S: np.ndarray, via: Format, target: Format) -> np.ndarray:
    """Add the rounding to ``via`` of a result later widened to ``target`` (exactly), if ``via`` is narrower."""
    if via.p >= target.p:
        return E
    return up(E + via.unit_roundoff * (S + E) + via.min_subnormal)


def scalar_error(value: float | complex, fmt: Format) -> float:
    """|value - value rounded to fmt| for a Python scalar (each part, summed, for complex)."""
    total = 0.0
    for part in (value.real, value.imag) if isinstance(value, complex) else (value,):
        if part == 1 or (part == 0 and fmt.has_zero) or (part == -1 and fmt.signed):
            # Every format holds 1 exactly (0 and -1 too, where it has them): the usual
            # coefficients need no rounding through numpy, which a small op would pay for.
            continue
        r = float(round_float64(np.asarray(part, dtype=np.float64), fmt))
        total += abs(part - r) if math.isfinite(r) else math.inf
    return total
