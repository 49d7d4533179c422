"""Result (one output judged against its exact value) and Gradients (several, by name).

Each real part of an output carries, per element:

* ``x_lo <= exact <= x_hi``: float64 bounds on the exact value (equal when
  the exact value is a float64; NaN where it does not exist because an input
  is NaN or infinite);
* the acceptance interval ``[lo, hi]``: the roundings to the output format of
  ``exact - E`` and ``exact + E``, where E bounds the error a correct
  implementation makes before its final rounding.  A correct implementation
  returns the rounding of some value in ``[exact - E, exact + E]``, and
  rounding is monotonic, so its output lies in ``[lo, hi]``;
* ``nan_ok``: NaN is accepted (the normal answer is NaN, or in a complex element,
  the other part meets an infinity);
* ``special_ok``: the error model cannot exclude an overflow of a partial
  result, so +-inf and NaN are accepted as well.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _fused, _report
from ._convert import _plain
from ._threads import own_threads, small
from .errors import (
    DtypeMismatchWarning,
    OutOfToleranceError,
    ShapeMismatchError,
    SpecialValueError,
)
from .formats import FORMATS, ComplexFormat, Format, part_of
from .rounding import (  # _ABS, _REL: the slack of below() and above(), which judge applies
    _ABS,
    _BITS_MIN,
    _REL,
    _slack_into,
    above,
    below,
    next_down,
    next_up,
    round_float64,
    to_dtype,
)

__all__ = ["Gradients", "Part", "Result", "judge", "judge_one"]


@dataclass
class Part:
    """The judgement of one real part of an output; every array has the output's shape."""

    rounded: np.ndarray
    x_lo: np.ndarray
    x_hi: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nan_ok: np.ndarray
    special_ok: np.ndarray
    tolerance: np.ndarray

    def covers(self, got: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            inside = (self.lo <= got) & (got <= self.hi)
        if np.isfinite(got).all():
            return inside  # no NaN or inf to excuse: two calls instead of seven, for small outputs
        return inside | (np.isnan(got) & (self.nan_ok | self.special_ok)) | (np.isinf(got) & self.special_ok)


def judge(rounded: np.ndarray, x_lo: np.ndarray, x_hi: np.ndarray, E: np.ndarray | float, fmt: Format, *,
          special: np.ndarray | None = None, overflow: np.ndarray | None = None,
          nan_also: np.ndarray | None = None, via: Format | None = None) -> Part:
    """Build a :class:`Part` from the rounded exact values, bounds on them and the model's error bound E.

    ``special`` is float64 with NaN or +-inf where the normal answer is that
    special value because of a non-finite input (0 elsewhere); ``overflow``
    marks elements whose partial results may overflow under the model;
    ``nan_also`` marks elements where NaN is accepted besides the answer.
    ``via`` is a format the kernel may round its result to before ``fmt``
    (oneDNN's float8 outputs go through float16): rounding is monotonic, so
    the outputs of such a kernel lie between the double roundings of the
    interval's ends, which are accepted as well.
    """
    E = np.asarray(E, dtype=np.float64)
    if E.shape != rounded.shape:  # np.broadcast_to costs more than the rest of a small judgement's steps
        E = np.broadcast_to(E, rounded.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        exact_needed = E == 0
        via_nan = None
        if fmt.p == 53:
            # float64 outputs: one rounding of slack matters, so use nextafter.
            low, high = next_down(x_lo - E), next_up(x_hi + E)
        else:
            low_at, high_at, low, high = _ends(x_lo, x_hi, E, fmt)
            if via is not None:
                via_low = round_float64(round_float64(low_at, via), fmt)
                via_high = round_float64(round_float64(high_at, via), fmt)
                # A NaN end (an overflow without inf) is kept apart: fmin and fmax pass over NaN.
                via_nan = (np.isnan(via_low) | np.isnan(via_high)) & ~np.isnan(x_lo)
                low, high = np.fmin(low, via_low), np.fmax(high, via_high)
                # Even an exact value may come out otherwise after two roundings.
                exact_needed &= round_float64(round_float64(x_lo, via), fmt) == rounded
        overflow_nan = None
        if not fmt.has_inf and not fmt.saturates:
            # Overflow gives NaN here (float8_e4m3fn under "nosat", the fnuz formats): past the
            # largest finite value an interval accepts NaN.
            high_nan, low_nan = np.isnan(high) & ~np.isnan(x_hi), np.isnan(low) & ~np.isnan(x_lo)
            # An end that overflows on its own side leaves no finite value on that side.
            high = np.where(high_nan, np.where(high_at < 0, -np.inf, fmt.max_finite), high)
            low = np.where(low_nan, np.where(low_at > 0, np.inf, -fmt.max_finite), low)
            overflow_nan = high_nan | low_nan | (np.isnan(rounded) & ~np.isnan(x_lo))
            if via_nan is not None:
                overflow_nan |= via_nan
        if type(low) is np.ndarray and type(high) is np.ndarray and not exact_needed.any():
            lo, hi = low, high  # (what the np.where calls below would copy: no E is 0)
        else:
            lo = np.where(exact_needed, rounded, low)
            hi = np.where(exact_needed, rounded, high)
        tol = np.maximum(x_hi - lo, hi - x_lo)
        # above(tol), where tol > 0 makes |tol| + 0 tol itself: two numpy calls fewer.
        tol = np.where(tol > 0, tol + (tol * _REL + _ABS), 0.0)
    special_ok = np.zeros(rounded.shape, dtype=bool) if overflow is None else np.asarray(overflow).copy()
    nan_ok = np.zeros(rounded.shape, dtype=bool) if overflow_nan is None else overflow_nan
    tol = np.where(special_ok, np.inf, tol)
    if special is not None:
        mask = special != 0
        if mask.any() and (fmt.saturates or not fmt.has_inf):
            # An infinite answer in a saturating format is its largest value, and NaN in one without inf.
            special = np.where(mask, round_float64(special, fmt), 0.0)
        if mask.any():
            nan = np.isnan(special)
            rounded = np.where(mask, special, rounded)
            lo = np.where(mask, np.where(nan, np.inf, special), lo)
            hi = np.where(mask, np.where(nan, -np.inf, special), hi)
            x_lo = np.where(mask, np.nan, x_lo)
            x_hi = np.where(mask, np.nan, x_hi)
            tol = np.where(mask, 0.0, tol)
            # An infinite answer meeting a finite part that overflows gives inf - inf.
            # Elsewhere keep the NaN that an overflow in a format without inf already allows.
            nan_ok = (nan_ok & ~mask) | nan | (mask & special_ok)
            special_ok &= ~mask
    if nan_also is not None:
        nan_ok = nan_ok | nan_also
    return Part(rounded, x_lo, x_hi, lo, hi, nan_ok, special_ok, tol)


def judge_one(x_lo: float, x_hi: float, E: float, fmt: Format) -> tuple[float, float, float] | None:
    """``(lo, hi, tolerance)`` of :func:`judge` for one element of a float32 output (``fmt`` rounded
    by numpy's cast) without special values or overflow marks, by the same IEEE operations in
    the same order on Python floats (rounding's below and above themselves), bit for bit (see
    engine.decision.decide_one for why).  None outside what it covers, which judge does: E not
    positive and finite (a zero E asks for the exact value, an infinite one for no bound), an end
    past float32's largest value."""
    if not (0 < E < np.inf and _fused._rounds_by_cast(fmt)):
        return None
    low_at, high_at = below(x_lo - E, E), above(x_hi + E, E)  # (as _ends makes them)
    if not (abs(low_at) <= fmt.max_finite and abs(high_at) <= fmt.max_finite):
        return None  # (NaN too)
    lo, hi = float(np.float32(low_at)), float(np.float32(high_at))
    tol = max(x_hi - lo, hi - x_lo)  # (no NaN, for np.maximum to differ)
    return lo, hi, tol + (tol * _REL + _ABS) if tol > 0 else 0.0


def _ends(x_lo: np.ndarray, x_hi: np.ndarray, E: np.ndarray,
          fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``below(x_lo - E, E)``, ``above(x_hi + E, E)`` and their roundings to ``fmt``.

    Both ends go through each numpy call together, stacked along a new first
    axis: every step is elementwise, so the values are those of the separate
    calls, and a small output (where each call's fixed cost is what counts) pays
    half the calls.  The slack is :func:`exactref.rounding.below`'s and
    :func:`~exactref.rounding.above`'s, ``(|v| + E) * _REL + _ABS``.
    """
    shape = E.shape
    if np.shape(x_lo) != shape or np.shape(x_hi) != shape:
        low_at, high_at = below(x_lo - E, E), above(x_hi + E, E)
        return low_at, high_at, round_float64(low_at, fmt), round_float64(high_at, fmt)
    v = np.empty((2,) + shape)
    low_at, high_at = v[0, ...], v[1, ...]  # (views, 0-d ones too)
    np.subtract(x_lo, E, out=low_at)
    np.add(x_hi, E, out=high_at)
    slack = _slack_into(v, E, np.empty_like(v))  # (in one buffer, as engine.decision.bounds_lo_zero's)
    np.subtract(low_at, slack[0, ...], out=low_at)  # (in place: elementwise)
    np.add(high_at, slack[1, ...], out=high_at)
    rounded = round_float64(v, fmt)
    return low_at, high_at, rounded[0, ...], rounded[1, ...]


class Result:
    """One output judged against its exact value.

    Attributes
    ----------
    rounded : numpy.ndarray
        The exact value rounded once to the output format (the normal
        answer's special value where an input is NaN or infinite).
    tolerance : numpy.ndarray
        float64 bounds on ``|implementation - exact|`` for every element.
    normal : numpy.ndarray or None
        The normal answer, which fixes NaN and infinities; None for an op
        without a canonical evaluation.
    """

    def __init__(self, *, op: str, fmt: Format | ComplexFormat, parts: list[Part], model: Any,
                 exact: Callable[[tuple[int, ...]], Any], has_normal: bool = True,
                 backward: Callable[[Any], Gradients] | None = None, no_backward: str = "",
                 typical: Callable[[tuple[int, ...]], float] | None = None) -> None:
        self.op = op
        # What one emulated kernel of the model's declared order returns at an element (reports only).
        self._typical = typical
        self.format = fmt
        self.model = model
        self._parts = parts
        self._exact = exact
        self._backward = backward
        self._no_backward = no_backward or f"{op} has no backward"
        # Set by the op when every array argument was small (see exactref/_threads.py).
        self._small = False
        # The values are the format's own, so the cast is exact and raises no floating-point
        # flag: to_dtype's np.errstate, which a small op notices, is not needed but for its
        # faster way for a large output of an ml_dtypes format.
        joined = np.asarray(_join(parts))
        self.rounded: np.ndarray = to_dtype(joined, fmt) if joined.size >= _BITS_MIN else joined.astype(fmt.dtype)
        if len(parts) == 1:
            self.tolerance: np.ndarray = parts[0].tolerance
        else:
            with np.errstate(over="ignore"):
                self.tolerance = next_up(np.hypot(parts[0].tolerance, parts[1].tolerance))
        self.normal: np.ndarray | None = self.rounded if has_normal else None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rounded.shape

    @property
    def dtype(self) -> np.dtype:
        return self.rounded.dtype

    def __repr__(self) -> str:
        return f"<Result of {self.op}: {self.format.name} {self.shape}, model {self.model}>"

    def exact(self, index: int | tuple[int, ...] = ()) -> Any:
        """The exact value of one element: a Fraction for the rational ops (a pair for complex).

        Returns None where the element has no exact value because an input
        is NaN or infinite.
        """
        idx = np.unravel_index(np.ravel_multi_index(_as_index(index, self.shape), self.shape), self.shape)
        if any(np.isnan(p.x_lo[idx]) for p in self._parts):
            return None
        with own_threads():
            return self._exact(tuple(int(i) for i in idx))

    def _got(self, x: Any, argument: str = "x") -> np.ndarray:
        try:
            got = np.asarray(_plain(x, copy=False))  # read once below, and copied by astype
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{argument}={x!r:.60} cannot be read as an array: {exc}") from None
        if got.dtype.kind not in "fciu" and got.dtype.name not in FORMATS:
            raise TypeError(f"{argument} has dtype {got.dtype}, which is not a number format")
        if got.shape != self.shape:
            raise ValueError(f"{argument} has shape {got.shape} but {self.op}'s output has shape {self.shape}")
        if got.dtype.kind == "c" and not self.format.is_complex:
            raise TypeError(f"{argument} is complex but {self.op}'s output format {self.format} is real")
        return got.astype(np.complex128 if self.format.is_complex else np.float64)

    def _covers_parts(self, got: np.ndarray) -> list[np.ndarray]:
        if len(self._parts) == 1:
            return [self._parts[0].covers(got)]
        return [self._parts[0].covers(got.real), self._parts[1].covers(got.imag)]

    def covers(self, x: Any) -> np.ndarray:
        """A bool array of the output's shape: True where ``x`` is acceptable.

        ``x`` is a torch tensor (any device), a numpy array or a list.  Only
        the values are judged.  An array of another dtype than the result's
        gets a :class:`DtypeMismatchWarning` saying why that may be (and
        :meth:`check` refuses it), unless it is float64 or complex128, which
        hold every format's values exactly and so carry values computed
        elsewhere (an oracle's, say).
        """
        got = self._got(x)
        wrong = _dtype_mismatch(x, self, allowed=_CARRIERS)
        if wrong:
            warnings.warn(wrong, DtypeMismatchWarning, stacklevel=2)
        ok = self._covers_parts(got)
        return ok[0] if len(ok) == 1 else ok[0] & ok[1]

    def check(self, x: Any, *, worst: int = 5) -> None:
        """Raise a :class:`MismatchError` explaining the worst elements unless ``x`` is covered."""
        __tracebackhide__ = True
        try:
            got = self._got(x)
        except ValueError as exc:
            raise ShapeMismatchError(str(exc), op=self.op) from None
        wrong = _dtype_mismatch(x, self)
        if wrong:
            raise ShapeMismatchError(wrong, op=self.op)
        ok = self._covers_parts(got)
        if all(o.all() for o in ok):
            return
        # The report computes exact values and emulates kernels: an op's work.
        with own_threads():
            text, indices, special = _report.mismatch_report(self, got, ok, worst)
        kind = SpecialValueError if special else OutOfToleranceError
        raise kind(text, op=self.op, indices=indices)

    def backward(self, grad: Any) -> Gradients:
        """The gradients of this op's inputs for the output gradient ``grad``."""
        if self._backward is None:
            raise TypeError(self._no_backward)
        tiny = getattr(self, "_small", False) and small((grad,))
        with own_threads(limit=not tiny), np.errstate(all="ignore"):
            return self._backward(grad)


# The dtypes covers() takes without a word: they hold every format's values exactly.
_CARRIERS = ("float64", "complex128")


def _dtype_mismatch(x: Any, result: Result, allowed: tuple[str, ...] = ()) -> str:
    """Why ``x``, an array with a dtype, does not have the result's format ('' when it does, is a list,
    or has one of the ``allowed`` dtypes).

    The usual cause is numpy's promotion, which differs from torch's (and so
    from exactref's): numpy 2 takes a 0-d array's dtype as an array's, so
    float16 array + float32 0-d array is float32 in numpy, float16 in torch.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return ""
    name, want = _dtype_name(dtype, False), _dtype_name(result.dtype, True)
    if name == want or name in allowed:
        return ""
    text = (f"{result.op}: got {name} values for a {want} result; check() judges a kernel's output in the "
            f"result's format. ")
    if isinstance(x, np.ndarray):
        text += (f"If the kernel is numpy code, numpy's promotion may have chosen {name}: numpy 2 promotes a "
                 f"float16 array with a float32 0-d array to float32, where torch, whose promotion ExactRef "
                 f"follows, keeps float16 (er.add and er.multiply take promotion='numpy' to follow numpy). ")
    return text + f"Cast the output to {want}, or compute the reference from inputs of the kernel's format."


@functools.lru_cache(maxsize=128)
def _dtype_name(dtype: Any, canonical: bool) -> str:
    """A numpy dtype's name if ``canonical``, else its str ('>f4' for big-endian float32), with
    torch's dtypes by their names; cached, since numpy's dtype.name is Python code (about 10 us,
    which a small output's covers() paid twice)."""
    return dtype.name if canonical else str(dtype).replace("torch.", "")


def _join(parts: list[Part]) -> np.ndarray:
    if len(parts) == 1:
        return parts[0].rounded
    # Set the parts directly: re + 1j * im would lose signs of zero and turn inf into NaN.
    out = np.empty(parts[0].rounded.shape, dtype=np.complex128)
    out.real, out.imag = parts[0].rounded, parts[1].rounded
    return out


def _as_index(index: int | tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = (index,) if isinstance(index, (int, np.integer)) else tuple(index)
    if len(idx) != len(shape) or any(not -n <= i < n for i, n in zip(idx, shape)):
        raise IndexError(f"index={index!r} is not an element of an output of shape {shape}")
    return tuple(i % n for i, n in zip(idx, shape))


class _Names:
    """Attribute access to one field of every gradient: ``g.rounded.grad_A``."""

    def __init__(self, grads: Gradients, field: str) -> None:
        self._grads = grads
        self._field = field

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._grads[name], self._field)
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None

    def __dir__(self) -> list[str]:
        return list(self._grads)

    def __repr__(self) -> str:
        return f"<{self._field} of {', '.join(self._grads)}>"


class Gradients(Mapping[str, Result]):
    """The gradients of a backward, by name (``"grad_" + parameter name``), each a :class:`Result`."""

    def __init__(self, op: str, results: dict[str, Result], absent: dict[str, str] | None = None) -> None:
        self.op = op
        self._results = results
        self._absent = absent or {}

    def __getitem__(self, name: str) -> Result:
        if name in self._results:
            return self._results[name]
        if name in self._absent:
            raise KeyError(f"{name}: {self._absent[name]}")
        raise KeyError(f"{name}: {self.op} has no gradient of that name; "
                       f"it has {', '.join(self._results) or 'none'}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def __repr__(self) -> str:
        return f"<Gradients of {self.op}: {', '.join(self._results)}>"

    @property
    def rounded(self) -> _Names:
        """The rounded gradients as attributes: ``g.rounded.grad_A``."""
        return _Names(self, "rounded")

    @property
    def tolerance(self) -> _Names:
        return _Names(self, "tolerance")

    @property
    def normal(self) -> _Names:
        return _Names(self, "normal")

    def _named(self, got: dict[str, Any]) -> dict[str, Any]:
        if not got:
            raise TypeError(f"pass the gradients to judge by name, e.g. {next(iter(self._results), 'grad_x')}=...")
        for name in got:
            self[name]  # raises a KeyError naming the problem
        return got

    def covers(self, **got: Any) -> dict[str, np.ndarray]:
        """For each gradient passed by name, the bool array of :meth:`Result.covers`."""
        return {name: self[name].covers(x) for name, x in self._named(got).items()}

    def check(self, **got: Any) -> None:
        """Check each gradient passed by name; raise one :class:`MismatchError` listing every failure."""
        __tracebackhide__ = True
        failures = []
        for name, x in self._named(got).items():
            try:
                self[name].check(x)
            except (OutOfToleranceError, SpecialValueError, ShapeMismatchError) as exc:
                failures.append(exc)
        if not failures:
            return
        if len(failures) == 1:
            raise failures[0]
        first = failures[0]
        text = "\n\n".join(str(f) for f in failures)
        raise type(first)(text, op=first.op, indices=first.indices)


def part_format(fmt: Format | ComplexFormat) -> Format:
    return part_of(fmt)
