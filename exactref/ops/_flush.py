"""``ErrorModel(flush_subnormals=True)``: kernels that may flush subnormal values to zero.

XLA on the CPU, and GPU code compiled with flush-to-zero, replace subnormal
inputs by zero (DAZ) and subnormal results of each operation by zero (FTZ).
The derivation is in ``docs/tolerance-models.md``, "Flushing subnormals"; in
short, an output is covered when it is covered for the inputs as given or
for the inputs with every subnormal replaced by a zero of its sign, with
each of the two tolerances widened by about ``(2n + 4) * m``:

* ``n`` bounds the number of products or terms summed into one element
  (the number of array elements the op reads: every term of an element
  holds a distinct element of some input, or of ``grad``);
* each flushed product or partial sum moves the computed value by less
  than ``m``, the largest smallest-normal of the formats involved, and a
  sum of ``n`` terms makes at most ``2n`` such roundings, plus the final
  rounding, alpha, beta and a conversion; the later roundings scale each
  move by at most ``(1 + u)^(2n+4) <= 1 / (1 - (2n + 4) u)``, so the
  widening is ``(2n + 4) m / (1 - (2n + 4) u)`` (no bound once
  ``(2n + 4) u >= 1``);

and with zero accepted wherever the widened interval reaches below ``m``
in magnitude (a subnormal result flushed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._convert import _is_torch, _plain
from ..formats import format_of, part_of
from ..models._error_model import ErrorModel
from ..result import Gradients, Part, Result
from ..rounding import next_down, next_up, round_float64

__all__ = ["flushed", "flushed_backward", "wants_flush"]


def wants_flush(kwargs: dict[str, Any]) -> bool:
    model = kwargs.get("model")
    return isinstance(model, ErrorModel) and model.flush_subnormals


def _flush_value(value: Any) -> Any:
    """``value`` with its subnormal elements replaced by zeros of their sign (others unchanged)."""
    if not (isinstance(value, (np.ndarray, np.generic)) or _is_torch(value) or hasattr(value, "__dlpack__")):
        return value  # Python numbers and lists: weak scalars and default-format data, left as given
    arr = np.array(_plain(value), copy=True)
    if arr.dtype.kind not in "fc" and arr.dtype.name != "bfloat16":
        return value
    tiny = part_of(format_of(arr.dtype, argument="an input's dtype")).min_normal
    wide = arr.astype(np.complex128 if arr.dtype.kind == "c" else np.float64)
    parts = [wide.real, wide.imag] if arr.dtype.kind == "c" else [wide]
    for p in parts:
        small = (p != 0) & (np.abs(p) < tiny)
        p[small] = np.copysign(0.0, p[small])
    if arr.dtype.kind != "c":
        return parts[0].astype(arr.dtype)
    out = np.empty(arr.shape, dtype=np.complex128)
    # Parts set directly: re + 1j * im would turn an infinite part into NaN.
    out.real, out.imag = parts
    return out.astype(arr.dtype)


def _reads(values: list[Any]) -> tuple[int, float, float]:
    """How many array elements the op reads, and the largest smallest-normal and unit roundoff among
    their formats (float32's for lists, which are read as float32)."""
    count, tiny, u = 0, 0.0, 0.0
    for value in values:
        if isinstance(value, (np.ndarray, np.generic)) or _is_torch(value) or hasattr(value, "__dlpack__"):
            arr = _plain(value)
            count += int(arr.size)
            if arr.dtype.kind in "fc" or arr.dtype.name == "bfloat16":
                fmt = part_of(format_of(arr.dtype, argument="an input's dtype"))
                tiny, u = max(tiny, fmt.min_normal), max(u, fmt.unit_roundoff)
        elif isinstance(value, (list, tuple)):
            count += int(np.asarray(value, dtype=object).size)
            fmt = part_of(format_of("float32"))
            tiny, u = max(tiny, fmt.min_normal), max(u, fmt.unit_roundoff)
    return count, tiny, u


class _Flushed(Result):
    """A result that accepts what either of two widened results accepts: inputs as given, or flushed."""

    def __init__(self, given: Result, flushed: Result, widen: float,
                 backward: Callable[[Any], Gradients] | None) -> None:
        super().__init__(op=given.op, fmt=given.format, parts=[_widen(p, widen, given) for p in given._parts],
                         model=given.model, exact=given._exact, has_normal=given.normal is not None,
                         backward=backward, no_backward=given._no_backward, typical=given._typical)
        self._other = [_widen(p, widen, given) for p in flushed._parts]

    def _alternatives(self) -> list[list[Part]]:
        """The parts of each way of accepting an output, for reports of the best ratio per element."""
        return [self._parts, self._other]

    def _covers_parts(self, got: np.ndarray) -> list[np.ndarray]:
        mine = super()._covers_parts(got)
        values = [got] if len(self._other) == 1 else [got.real, got.imag]
        return [ok | p.covers(v) for ok, p, v in zip(mine, self._other, values, strict=True)]


def _widen(part: Part, widen: float, result: Result) -> Part:
    """``part`` with its acceptance interval widened by ``widen`` outwards, and zero accepted wherever the
    interval reaches below the format's smallest normal in magnitude."""
    fmt = part_of(result.format)
    tiny = max(widen, fmt.min_normal)
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = next_down(part.lo - widen), next_up(part.hi + widen)
        if fmt.p < 53:
            lo, hi = round_float64(next_down(lo), fmt), round_float64(next_up(hi), fmt)
        finite = np.isfinite(part.lo) & np.isfinite(part.hi) & (part.lo <= part.hi)
        lo, hi = np.where(finite, np.minimum(lo, part.lo), part.lo), np.where(finite, np.maximum(hi, part.hi), part.hi)
        reaches_zero = finite & (lo < tiny) & (hi > -tiny)
        lo = np.where(reaches_zero, np.minimum(lo, -0.0), lo)
        hi = np.where(reaches_zero, np.maximum(hi, 0.0), hi)
        tol = np.where(finite, np.maximum(part.tolerance, np.maximum(part.x_hi - lo, hi - part.x_lo)), part.tolerance)
    return Part(part.rounded, part.x_lo, part.x_hi, lo, hi, part.nan_ok, part.special_ok, tol)


def _widening(values: list[Any]) -> float:
    """(2n + 4) m, times the most that the later roundings can scale a flush: (1 + u)^(2n+4) <= 1 / (1 - (2n+4) u)."""
    count, tiny, u = _reads(values)
    k = 2 * count + 4
    if k * u >= 1:
        return np.inf  # no bound: the roundings alone could double a flushed amount
    return float(next_up(np.float64(k * tiny) / np.float64(1 - k * u)) * (1 + 2.0 ** -50))


def _both(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    given = run(*args, **kwargs)
    flushed = run(*(_flush_value(a) for a in args),
                  **{k: (_flush_value(v) if k != "model" else v) for k, v in kwargs.items()})
    return given, flushed


def flushed(forward: Callable[..., Result], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Result:
    """The forward Result under a flush_subnormals model (see the module's docstring)."""
    given, other = _both(forward, args, kwargs)
    read = [*args, *kwargs.values()]

    def backward(grad: Any) -> Gradients:
        return _union_gradients(given.backward(grad), other.backward(_flush_value(grad)),
                                _widening([*read, grad]))
    return _Flushed(given, other, _widening(read), backward if given._backward is not None else None)


def flushed_backward(backward: Callable[..., Gradients], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Gradients:
    """The Gradients of a standalone backward (``grad`` among its arguments) under a flush_subnormals model."""
    given, other = _both(backward, args, kwargs)
    return _union_gradients(given, other, _widening([*args, *kwargs.values()]))


def _union_gradients(given: Gradients, other: Gradients, widen: float) -> Gradients:
    return Gradients(given.op, {name: _Flushed(given[name], other[name], widen, None) for name in given},
                     dict(given._absent))
