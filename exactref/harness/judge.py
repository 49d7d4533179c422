"""Judging one kernel on one case: the worst error/tolerance ratio, or a failure that says what and where.

Hypothesis tells failures apart by exception type and the place it was
raised, and shrinks each one separately.  Every failure raised here is an
instance of a subclass made for its kind *and* its place in the op, such as
``OutOfToleranceError[matmul.grad_B]``, so that a wrong special value in
grad_A and a tolerance miss in grad_B stay two failures instead of merging
into whichever Hypothesis saw first.  The subclasses derive from exactref's
own (``except er.OutOfToleranceError`` still catches them).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _report
from ..errors import MismatchError, OutOfToleranceError, ShapeMismatchError, SpecialValueError
from .cases import hex_float
from .kernels import Kernel, KernelOutputError, KernelRaisedError, KernelTimeoutError, call_kernel

if sys.version_info >= (3, 11):
    import builtins

    BaseExceptionGroup = builtins.BaseExceptionGroup
    ExceptionGroup = builtins.ExceptionGroup
else:  # pragma: no cover - Python 3.10, where Hypothesis brings the backport
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

__all__ = ["BaseExceptionGroup", "DtypeMismatchError", "ExceptionGroup", "MissingGradientError", "Verdict",
           "add_note", "describe_inputs", "first_line", "flatten", "is_keyed", "judge", "keyed", "reference"]

#: Arrays up to this many elements are written out in full in a report.
SMALL = 64


class DtypeMismatchError(ShapeMismatchError):
    """The output has the right shape but the wrong dtype."""


class MissingGradientError(MismatchError):
    """The backward kernel returned no value for a gradient the op has."""


_KEYED: dict[tuple[type, str], type] = {}


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, on Python 3.10 too."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def keyed(base: type[BaseException], where: str) -> type:
    """The subclass of ``base`` for failures at ``where`` ("matmul", "matmul.grad_B", "matmul.backward")."""
    key = (base, where)
    if key not in _KEYED:
        name = f"{base.__name__}[{where}]"
        _KEYED[key] = type(name, (base,), {"__module__": "exactref", "__qualname__": name,
                                           "where": where, "kind": base.__name__})
    return _KEYED[key]


def is_keyed(exc: BaseException) -> bool:
    """Whether ``exc`` is of a class made by :func:`keyed` (and so knows where it failed)."""
    return hasattr(type(exc), "where")


def first_line(exc: BaseException) -> str:
    """The failure's type and the first two lines of its message, for a case file's ``failure``."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {' / '.join(lines[:2])}"[:300] if lines else type(exc).__name__


def flatten(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, exception groups unpacked at every depth."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in flatten(inner)]
    return [exc]


@dataclass
class Verdict:
    """A case the kernel passed: the worst error/tolerance ratio of each output, by name."""

    ratios: dict[str, float] = field(default_factory=dict)
    # |error| / the error of one emulated kernel of the declared order, at the worst element.
    typical: dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> float:
        return max(self.ratios.values(), default=0.0)

    @property
    def worst_typical(self) -> float | None:
        return max(self.typical.values()) if self.typical else None


def reference(kernel: Kernel, direction: str, fmt: str, inputs: Mapping[str, Any], kwargs: Mapping[str, Any],
              grad: Any) -> dict[str, Any]:
    """exactref's judgement of the case: ``{"output": Result}`` or the Gradients, by name.

    Raises ReferenceUnavailableError where the spec allows it.
    """
    import exactref as er

    op = getattr(er, kernel.op)
    extra = kernel.reference_kwargs(direction, fmt, inputs, kwargs)
    if direction == "forward":
        return {"output": op(*inputs.values(), **kwargs, **extra)}
    return dict(op.backward(*inputs.values(), grad, **kwargs, **extra))


def error_ratio(result: Any, got: np.ndarray) -> float:
    """The worst |got - exact| / tolerance over the elements where both are finite (0 if none).

    An element whose tolerance is 0 counts 0 when it is exact and inf when not.
    """
    return _worst(result, got)[0]


def typical_ratio(result: Any, got: np.ndarray) -> float | None:
    """At the worst element, |got - exact| / |typical - exact|, where typical is what one emulated
    kernel of the model's declared order returns (None without a declared order)."""
    if result._typical is None or len(result._parts) != 1:
        return None
    ratio, index = _worst(result, got)
    if index is None:
        return None
    part = result._parts[0]
    return _report.typical_ratio(result, index, float(got[index]), 0.5 * (part.x_lo[index] + part.x_hi[index]))[0]


def _worst(result: Any, got: np.ndarray) -> tuple[float, tuple[int, ...] | None]:
    # A result may accept several alternatives (a flush_subnormals model: the inputs as given, or
    # flushed); an element's ratio is its best one.
    alternatives = getattr(result, "_alternatives", lambda: [result._parts])()
    values = [got] if len(result._parts) == 1 else [got.real, got.imag]
    worst, where = 0.0, None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for k, g in enumerate(values):
            g = np.asarray(g, dtype=np.float64)
            best = None
            for parts in alternatives:
                r = _ratios(parts[k], g)
                best = r if best is None else np.fmin(best, r)
            if best is None or np.isnan(best).all():
                continue
            value = float(np.nanmax(best))
            if where is None or value > worst:
                worst = value
                where = tuple(int(i) for i in np.unravel_index(int(np.nanargmax(best)), best.shape))
    return worst, where


def _ratios(part: Any, g: np.ndarray) -> np.ndarray:
    """|g - exact| / tolerance per element, NaN where either is not finite (0/0 exact: 0, x/0: inf)."""
    mid = 0.5 * (part.x_lo + part.x_hi)
    tol = part.tolerance
    ok = np.isfinite(mid) & np.isfinite(g) & np.isfinite(tol)
    err = np.abs(g - mid)
    r = np.where(tol > 0, err / np.where(tol > 0, tol, 1.0), np.where(err == 0, 0.0, np.inf))
    return np.where(ok, r, np.nan)


def _show_array(a: np.ndarray) -> str:
    head = f"{a.dtype.name} {tuple(a.shape)}"
    if a.size > SMALL:
        return f"{head} ({a.size} values; every one is in the regression case file)"
    if a.dtype.kind == "b":
        return f"{head} {a.tolist()}"
    kind = "c" if a.dtype.kind == "c" else "f"
    as64 = a.astype(np.complex128 if kind == "c" else np.float64)

    def fmt(v: Any) -> str:
        if kind == "c":
            return f"({hex_float(v.real)}{'+' if not str(hex_float(v.imag)).startswith('-') else ''}"\
                   f"{hex_float(v.imag)}j)"
        return hex_float(v)

    def nest(x: Any) -> str:
        if isinstance(x, list):
            return "[" + ", ".join(nest(v) for v in x) + "]"
        return fmt(x)

    return f"{head} {nest(as64.tolist())}"


def _show(value: Any) -> str:
    from .kernels import to_numpy

    value = to_numpy(value)
    if isinstance(value, np.ndarray):
        return _show_array(value)
    if isinstance(value, float):
        return f"{hex_float(value)} ({value!r})"
    if isinstance(value, complex):
        return f"complex({hex_float(value.real)}, {hex_float(value.imag)}) ({value!r})"
    return repr(value)


def describe_inputs(inputs: Mapping[str, Any], kwargs: Mapping[str, Any], grad: Any, direction: str) -> str:
    """The case written out exactly: shape, dtype and hex values of each array, and the keywords."""
    lines = [f"  {name}: {_show(v)}" for name, v in inputs.items()]
    lines += [f"  {name}={_show(v)}" for name, v in kwargs.items()]
    if direction == "backward":
        lines.append(f"  grad: {_show(grad)}")
    return "\n".join(lines)


def _format_of(inputs: Mapping[str, Any]) -> str:
    for v in inputs.values():
        if isinstance(v, np.ndarray):
            return v.dtype.name
    raise TypeError("the case has no array input, so its format is unknown")


def judge(kernel: Kernel, direction: str, inputs: Mapping[str, Any], kwargs: Mapping[str, Any], grad: Any, *,
          device: str = "cpu", note: str = "", timeout: float | None = None) -> Verdict:
    """Run ``kernel`` on the case and judge every output against exactref; return the Verdict.

    ``inputs`` (in call order), ``kwargs`` and ``grad`` are numpy arrays and
    Python scalars.  A failure raises a keyed subclass of OutOfToleranceError,
    SpecialValueError, ShapeMismatchError (DtypeMismatchError for a dtype),
    MissingGradientError, KernelRaisedError, KernelOutputError or
    KernelTimeoutError (the kernel ran past ``timeout`` seconds), whose
    message holds exactref's element-by-element report, then the inputs
    exactly, then ``note``; when several outputs fail, an ExceptionGroup of
    them.  ReferenceUnavailableError propagates.
    """
    __tracebackhide__ = True
    fmt = _format_of(inputs)
    expected = reference(kernel, direction, fmt, inputs, kwargs, grad)
    model = kernel.model(direction, fmt)
    header = (f"{kernel.op} {direction}, {fmt}, kernel {kernel.source}"
              f"{'' if model is None else f', error model {model}'}")

    def tail() -> str:
        # Written out only for a failure: most cases pass, and this is the slow part of a report.
        shown = describe_inputs(inputs, kwargs, grad, direction)
        return f"\n\nInputs, exactly:\n{shown}" + (f"\n\n{note}" if note else "")

    failed: tuple[type, str] | None = None
    try:
        got = call_kernel(kernel, direction, inputs, kwargs, grad, device=device, timeout=timeout)
    except (KernelRaisedError, KernelOutputError, KernelTimeoutError) as exc:
        failed = (type(exc), str(exc))
        if isinstance(exc, KernelRaisedError):
            raise keyed(KernelRaisedError, f"{kernel.op}.{direction}")(f"{header}\n{exc}{tail()}") from exc
    if failed is not None:
        raise keyed(failed[0], f"{kernel.op}.{direction}")(f"{header}\n{failed[1]}{tail()}")
    if direction == "forward":
        got = {"output": got}
    verdict = Verdict()
    failures: list[tuple[str, type, str, MismatchError | None]] = []
    for name, result in expected.items():
        where = kernel.op if name == "output" else f"{kernel.op}.{name}"
        label = f"{kernel.op}'s output" if name == "output" else f"{kernel.op}'s {name}"
        if name not in got:
            failures.append((where, MissingGradientError,
                             f"the backward kernel returned no {name}; it must return every gradient "
                             f"({', '.join(expected)})", None))
            continue
        value = got[name]
        if tuple(value.shape) != tuple(result.shape):
            failures.append((where, ShapeMismatchError, f"{label} has shape {tuple(value.shape)} but exactref's "
                             f"has shape {tuple(result.shape)}", None))
            continue
        if value.dtype.name != result.dtype.name:
            failures.append((where, DtypeMismatchError, f"{label} has dtype {value.dtype.name} but "
                             f"exactref's has dtype {result.dtype.name}", None))
            continue
        verdict.ratios[name] = error_ratio(result, value)
        typical = typical_ratio(result, value)
        if typical is not None:
            verdict.typical[name] = typical
        try:
            result.check(value)
        except MismatchError as exc:
            kind = SpecialValueError if isinstance(exc, SpecialValueError) else OutOfToleranceError
            failures.append((where, kind, str(exc), exc))
    if failures:
        errors = []
        written = tail()
        for where, kind, text, exc in failures:
            error = keyed(kind, where)(f"{header}\n{text}{written}", op=exc.op if exc else kernel.op,
                                       indices=exc.indices if exc else [])
            error.verdict = verdict
            errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        # Several outputs fail at once: a group, which Hypothesis tells apart from each one
        # failing alone, so that a bug in grad_B is not hidden behind one in grad_A.
        group = ExceptionGroup(f"{header}: {len(errors)} outputs are not covered", errors)
        group.verdict = verdict  # type: ignore[attr-defined]
        raise group
    return verdict
