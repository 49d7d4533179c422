"""The text of a MismatchError: the count of mismatches, then the worst elements explained."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from .formats import part_of

if TYPE_CHECKING:
    from .result import Part, Result

__all__ = ["describe_exact", "mismatch_report"]

_PART_NAMES = ("real part", "imaginary part")


def _num(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.9g} ({float(x).hex()})"


def describe_exact(value: Any) -> str:
    """A short decimal rendering of an exact value (Fraction, or anything with a str)."""
    if isinstance(value, Fraction):
        if value == 0:
            return "0"
        digits = 17
        sign = "-" if value < 0 else ""
        q = abs(value)
        exp10 = math.floor(math.log10(q.numerator) - math.log10(q.denominator))
        scaled = q / Fraction(10) ** (exp10 - digits + 1)
        mant = round(scaled)
        if mant >= 10 ** digits:
            mant //= 10
            exp10 += 1
        text = str(mant)
        approx = "" if Fraction(mant) == scaled else "~"
        return f"{approx}{sign}{text[0]}.{text[1:].rstrip('0') or '0'}e{exp10:+03d}"
    return str(value)


def _rule(part: Part, i: int, g: float, fmt_name: str) -> str | None:
    """The special-value rule element i breaks, or None when it is a plain tolerance miss."""
    lo, hi = part.lo.flat[i], part.hi.flat[i]
    if lo > hi and not math.isnan(g):  # an empty interval: the answer is NaN
        return "the normal answer is NaN (an input is NaN, or the element meets 0*inf or inf-inf)"
    if math.isnan(part.x_lo.flat[i]):
        return f"the normal answer is {_num(lo)} (an input is infinite)"
    if math.isnan(g):
        return "NaN where the exact value is finite"
    if math.isinf(g):
        return (f"{_num(g)} where the exact value is finite and no correct implementation overflows "
                f"(accepted: {_num(lo)} to {_num(hi)})")
    if math.isinf(lo) and lo == hi:
        return f"the exact value overflows {fmt_name}, so the answer is {_num(lo)}"
    return None


def typical_ratio(result: Result, index: tuple[int, ...], got: float, x_mid: float) -> tuple[float, float]:
    """(|got - exact| / |typical - exact|, |typical - exact|) at ``index``, where typical is what one
    emulated kernel of the model's declared order returns (0 where both are exact)."""
    err, typical = abs(got - x_mid), abs(result._typical(index) - x_mid)
    return (err / typical if typical else (0.0 if err == 0 else math.inf)), typical


def _typical_line(result: Result, index: tuple[int, ...], got: float, x_mid: float) -> str:
    """How far the kernel is from one kernel of its declared order on the same inputs."""
    ratio, typical = typical_ratio(result, index, got, x_mid)
    order = getattr(result.model, "order", "any")
    return (f"      off by {ratio:.3g} typical errors: one {order} kernel, emulated on these inputs, "
            f"is off by {typical:.3g}")


def mismatch_report(result: Result, got: np.ndarray, ok: list[np.ndarray], worst: int) -> tuple[str, list, bool]:
    """Return the report text, the mismatched indices (worst first) and whether any is a special-value miss."""
    fmt = part_of(result.format)
    values = [got] if len(ok) == 1 else [got.real, got.imag]
    rows = []
    for p, (part, good, vals) in enumerate(zip(result._parts, ok, values)):
        for i in np.flatnonzero(~good.reshape(-1)):
            g = float(vals.flat[i])
            rule = _rule(part, i, g, fmt.name)
            x_mid = 0.5 * (part.x_lo.flat[i] + part.x_hi.flat[i])
            tol = float(part.tolerance.flat[i])
            ratio = math.inf if rule or tol == 0 else abs(g - x_mid) / tol
            rows.append((ratio, i, p, g, rule))
    rows.sort(key=lambda r: (-r[0], r[1]))
    total = result.rounded.size
    bad = len({r[1] for r in rows})
    shape = result.shape
    indices = [tuple(int(v) for v in np.unravel_index(r[1], shape)) for r in rows]
    special = any(r[4] for r in rows)
    lines = [f"{result.op}: {bad} of {total} elements are not covered "
             f"({result.format.name}, error model {result.model})."]
    lines.append(f"The worst {min(worst, len(rows))}, by error in tolerances:")
    for (ratio, i, p, g, rule), index in zip(rows[:worst], indices):
        part = result._parts[p]
        where = f"  at {index}" + (f" {_PART_NAMES[p]}" if len(result._parts) > 1 else "")
        if rule:
            lines.append(f"{where}: got {_num(g)}: {rule}")
            continue
        exact = result.exact(index)
        if isinstance(exact, tuple):
            exact = exact[p]
        r = float(part.rounded.flat[i])
        x_mid = 0.5 * (part.x_lo.flat[i] + part.x_hi.flat[i])
        ulps = (g - x_mid) / fmt.ulp(r)
        lines.append(f"{where}: got {_num(g)}")
        lines.append(f"      exact {describe_exact(exact)}, rounded {_num(r)}, "
                     f"tolerance {float(part.tolerance.flat[i]):.3g}")
        lines.append(f"      off by {ratio:.3g} tolerances, {ulps:+.3g} ulps")
        if result._typical is not None and len(result._parts) == 1:
            lines.append(_typical_line(result, index, g, x_mid))
    if len(rows) > worst:
        lines.append(f"  ... and {len(rows) - worst} more")
    return "\n".join(lines), indices, special
