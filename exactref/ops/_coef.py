"""Scalar coefficients (alpha, beta): reading them, and scaling complex terms by them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from ..engine.sumprod import Term
from ..formats import ComplexFormat, Format
from ..models._bounds import scalar_error

__all__ = ["held", "magnitude", "read_coefficient", "scaled", "scalar_relative_error"]


def read_coefficient(value: Any, name: str, fmt: Format | ComplexFormat, op: str) -> float | complex:
    """A Python number for ``alpha``/``beta``, checked the way PyTorch checks it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"{op}: {name}={value!r} must be a Python int, float or complex")
    if isinstance(value, complex) or (hasattr(value, "imag") and value.imag != 0):
        if not fmt.is_complex:
            raise TypeError(f"{op}: {name}={value!r} is complex but the inputs are {fmt.name}; "
                            "a complex coefficient needs complex inputs")
        result: float | complex = complex(value)
        parts = (result.real, result.imag)
    else:
        if isinstance(value, numbers.Integral) and abs(int(value)) > 2 ** 53:
            raise ValueError(f"{op}: {name}={value} is too large to be a float64 exactly")
        result = float(value)
        parts = (result,)
    if not all(math.isfinite(p) for p in parts):
        raise ValueError(f"{op}: {name}={value!r} must be finite")
    return result


def scaled(coef: float | complex, parts: list[Callable[[float], Term]], p: int, *, drop_zero: bool) -> list[Term]:
    """Terms of part ``p`` of ``coef * D``, where ``parts[q](c)`` is the term ``c * (part q of D)``.

    With ``drop_zero`` a zero coefficient removes its term, as a BLAS does
    for alpha or beta of zero; otherwise it stays, so that 0 * inf gives NaN
    as PyTorch's elementwise kernels do.
    """
    if coef == 1:
        # PyTorch skips the multiply by a coefficient of one (autograd's maybe_multiply, BLAS's alpha).
        return [parts[p](1.0)]
    if len(parts) == 1:
        c = coef.real if isinstance(coef, complex) else coef
        combos = [(float(c), 0)]
    else:
        cr, ci = complex(coef).real, complex(coef).imag
        combos = [(cr, 0), (-ci, 1)] if p == 0 else [(cr, 1), (ci, 0)]
    return [parts[q](c) for c, q in combos if c != 0 or not drop_zero]


def scalar_relative_error(c: float | complex, fmt: Format) -> float:
    """The relative error of using c in ``fmt`` arithmetic: |c - c rounded to fmt| / |c|.

    For a complex c it is the largest of its parts' own relative errors: each
    part multiplies terms of its own, so dividing by |c| instead would
    understate the error of a part that is small next to the other.
    """
    worst = 0.0
    for part in (c.real, c.imag) if isinstance(c, complex) else (c,):
        if part == 0:
            continue
        err = scalar_error(part, fmt)
        if math.isinf(err):
            return math.inf
        worst = max(worst, err / abs(part))
    return worst


def magnitude(c: float | complex) -> float:
    """|c|, which is inf (not an OverflowError, as ``abs`` of a complex gives) when it overflows."""
    return math.hypot(c.real, c.imag) if isinstance(c, complex) else abs(c)


def held(c: float | complex, fmt: Format) -> float | complex:
    """``c`` as far as special values go once PyTorch has converted it to ``fmt``.

    A part that rounds to zero there is zero, so that it turns an infinite
    operand into NaN as PyTorch's kernels do; any other part keeps its value,
    since only its sign matters to inf and NaN.
    """
    tiny = fmt.min_subnormal / 2  # ties to even: exactly half the spacing also rounds to 0

    def part(x: float) -> float:
        return 0.0 if abs(x) <= tiny else x

    if isinstance(c, complex):
        return complex(part(c.real), part(c.imag))
    return part(c)
