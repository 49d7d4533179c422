"""Values that are hard to round into a narrower format: inputs for tests of casts.

:func:`cast_values` draws values of a *source* format (float32 by default)
that a cast to ``dtype`` must round: midpoints between two neighbours of
``dtype`` (ties, which round to even), values just above and below them,
the overflow threshold and values beyond it, as well as values ``dtype``
holds exactly (subnormals included) and the specials.  Every value is
exactly representable in the source format and is returned as a Python
float, so a source array holds it without rounding.

The float8 formats are the main use (their casts saturate or overflow by
convention, see :func:`exactref.asarray`'s ``saturation``), but any real
format narrower than the source works: float16 and bfloat16 from float32,
float32 from float64.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from hypothesis import strategies as st

from exactref.formats import Format, format_of

from ._draws import choice, coin, ints
from ._validation import check_classes
from .values import _floor_to

__all__ = ["CAST_CLASSES", "cast_values"]

#: The classes of :func:`cast_values`, in the order examples shrink toward:
#:
#: - ``exact``: a nonzero finite value of ``dtype``, subnormals included (a cast keeps it);
#: - ``tie``: the midpoint of two neighbouring finite values of ``dtype``, from the one
#:   between 0 and the smallest subnormal up to the one below the largest finite value;
#: - ``near_tie``: a tie moved up or down by a power of two from the source's ulp (the
#:   closest the source can get) to a quarter of ``dtype``'s ulp;
#: - ``threshold``: the overflow threshold, the midpoint between the largest finite value
#:   and the next value an unbounded exponent would give, and values around it (moved as
#:   a near tie is);
#: - ``beyond``: a finite magnitude further above the threshold, up to the source's largest;
#: - ``special``: +0, -0, NaN, +inf, -inf.
#:
#: Each class draws both signs.
CAST_CLASSES: tuple[str, ...] = ("exact", "tie", "near_tie", "threshold", "beyond", "special")

_SIGNS = (1, -1)
_SPECIALS = (0.0, -0.0, math.nan, math.inf, -math.inf)


def _quantum(fmt: Format, e: int) -> float:
    """The spacing of ``fmt``'s values in the binade [2**e, 2**(e+1)) (the subnormals' below emin)."""
    return math.ldexp(1.0, max(e, fmt.emin) - fmt.p + 1)


def _threshold(fmt: Format) -> float:
    return fmt.max_finite + _quantum(fmt, fmt.emax) / 2


def _signed(values: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    return st.tuples(values, choice(_SIGNS)).map(lambda t: t[1] * t[0])


def _grid_point(fmt: Format, e: int, k: int, half: bool) -> float:
    """k * q (or (k + 1/2) * q) where q is the spacing of binade e; e = emin - 1 stands for the subnormals."""
    q = _quantum(fmt, e)
    return (k + 0.5) * q if half else k * q


def _significands(fmt: Format, e: int, ties: bool) -> tuple[int, int]:
    """The range of k for binade e: values k * q of ``fmt`` (or ties (k + 1/2) * q between finite neighbours)."""
    if e < fmt.emin:
        return (0, (1 << (fmt.p - 1)) - 1) if ties else (1, (1 << (fmt.p - 1)) - 1)
    top = int(fmt.max_finite / _quantum(fmt, e)) if e == fmt.emax else (1 << fmt.p) - 1
    return (1 << (fmt.p - 1), top - 1 if ties else top)


def _on_grid(fmt: Format, ties: bool) -> st.SearchStrategy[float]:
    # Binade e (shrinking toward 1's), then a significand k in it; emin - 1 is the subnormal range.
    binade = ints(fmt.emin - 1, fmt.emax)
    return binade.flatmap(lambda e: ints(*_significands(fmt, e, ties)).map(
        lambda k: _grid_point(fmt, e, k, ties)))


def _source_ulp(source: Format, x: float) -> float:
    return _quantum(source, math.frexp(x)[1] - 1)


def _moved(source: Format, target: Format, t: float, up: bool, j: int) -> float:
    """t moved by 2**j source ulps (at most a quarter of target's spacing), up or down."""
    d = _source_ulp(source, t) * 2.0 ** j
    return t + d if up else t - d


def _near(source: Format, target: Format, t: float) -> st.SearchStrategy[float]:
    # The offset shrinks toward one source ulp: the hardest case for a cast that rounds twice.
    room = math.frexp(_quantum(target, math.frexp(t)[1] - 1) / 4 / _source_ulp(source, t))[1] - 1
    return st.tuples(ints(0, max(0, room)), coin()).map(
        lambda jt: _moved(source, target, t, not jt[1], jt[0]))


def _beyond(source: Format, target: Format) -> st.SearchStrategy[float]:
    # Past the threshold class's neighbours, which reach a quarter of the top spacing above it.
    near = _threshold(target) + _quantum(target, target.emax) / 4
    low = near + _source_ulp(source, near)
    width = 64 if source.p > 24 else 32
    return st.floats(min_value=low, max_value=source.max_finite, width=width).map(
        lambda x: max(low, _floor_to(source, x)))


@functools.lru_cache(maxsize=64)
def _class_strategy(target: Format, source: Format, name: str) -> st.SearchStrategy[float]:
    if name == "exact":
        return _signed(_on_grid(target, ties=False))
    if name == "tie":
        return _signed(_on_grid(target, ties=True))
    if name == "near_tie":
        return _signed(_on_grid(target, ties=True).flatmap(lambda t: _near(source, target, t)))
    if name == "threshold":
        t = _threshold(target)
        return _signed(st.one_of(st.just(t), _near(source, target, t)))
    if name == "beyond":
        return _signed(_beyond(source, target))
    if name == "special":
        return choice(_SPECIALS)
    raise AssertionError(name)  # pragma: no cover - guarded by check_classes


@functools.lru_cache(maxsize=64)
def _cast_values(target: Format, source: Format, classes: tuple[str, ...]) -> st.SearchStrategy[float]:
    options = tuple(_class_strategy(target, source, c) for c in classes)
    # One integer picks the class, each as likely as the others, shrinking toward the first.
    return ints(0, len(options) - 1).flatmap(lambda k: options[k])


def _read_target(dtype: Any) -> Format:
    fmt = format_of(dtype, argument="dtype")
    if fmt.is_complex:
        raise ValueError(f"dtype={fmt.name!r} is complex; cast_values rounds real values, so pass its part's "
                         f"format, dtype={fmt.part.name!r}")
    if fmt.p >= 53:
        raise ValueError(f"dtype={fmt.name!r} has no wider format to cast from; pass a narrower dtype, "
                         "e.g. dtype='float32' (cast from float64)")
    if not fmt.signed:
        raise ValueError(f"dtype={fmt.name!r} holds only powers of two (an MX block scale, with no zero and no "
                         "sign); cast_values draws values for the signed formats, e.g. dtype='float8_e4m3fn'")
    return fmt


def _read_source(source: Any, target: Format) -> Format:
    if source is None:
        source = "float64" if target.p >= 22 else "float32"
    fmt = format_of(source, argument="source")
    # Room for a near tie (two bits more than the target), for the threshold and what lies
    # beyond it, and for moving half the smallest subnormal.
    fits = (not fmt.is_complex and fmt.signed and fmt.p >= target.p + 2
            and fmt.max_finite > _threshold(target) and fmt.min_subnormal <= target.min_subnormal / 4)
    if not fits:
        raise ValueError(f"source={fmt.name!r} cannot hold the hard cases of a cast to {target.name}: it needs "
                         f"at least {target.p + 2} bits of precision and a wider range; pass source='float32' "
                         "or source='float64'")
    return fmt


def cast_values(*, dtype: Any, source: Any = None, classes: Any = True) -> st.SearchStrategy[float]:
    """Draw a value of ``source`` that a cast to ``dtype`` has to round: a tie, a value beyond the range, ...

    ``classes`` is True (every class in :data:`CAST_CLASSES`), or a
    collection of class names.  ``source`` is the format the values are
    exact in: float32 by default (float64 for a float32 target); float16 and
    bfloat16 work for the float8 formats.  Draw arrays of them with
    Hypothesis, e.g. ``hypothesis.extra.numpy.arrays(np.float32, (4,),
    elements=cast_values(dtype="float8_e4m3fn"))``.

    >>> from hypothesis import find
    >>> find(cast_values(dtype="float8_e4m3fn", classes=["tie"]), lambda v: 400 < v < 460)
    432.0
    >>> find(cast_values(dtype="float8_e4m3fn", classes=["threshold"]), lambda v: v < 0)
    -464.0
    >>> find(cast_values(dtype="float8_e5m2", classes=["near_tie"]), lambda v: 1.125 < v < 1.126)
    1.1250001192092896
    """
    target = _read_target(dtype)
    fmt = _read_source(source, target)
    chosen = check_classes("classes", classes, CAST_CLASSES)
    if not chosen:
        raise ValueError(f"classes={classes!r} switches every class off; name at least one of: "
                         f"{', '.join(CAST_CLASSES)}")
    return _cast_values(target, fmt, chosen)
