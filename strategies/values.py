"""Element values per format, special values, and arrays.

Every value is exactly representable in its format and is returned as a
Python float (or complex), so it can be put into a numpy array of any of the
formats, bfloat16 and the float8 formats included, without rounding.
float8_e8m0fnu (unsigned powers of two, no zero: an MX block scale) has no
element strategy.

An element is a *plain* value (finite, normal or +0, as Hypothesis's
``floats`` draws them) or, about one time in eight, a *special* value from
one of the switched-on classes in :data:`SPECIAL_CLASSES`.  An array is
plain values with up to three specials written at drawn positions (none
about five times in eight).  Shrinking always prefers plain values: it
drops specials one by one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.formats import FLOAT8_FORMATS, ComplexFormat, Format, format_of, part_of

from ._draws import coin, ints
from ._validation import (
    check_classes,
    check_device,
    check_positive_float,
    check_shape_size,
)

__all__ = [
    "SPECIAL_CLASSES",
    "arrays",
    "elements",
    "special_class",
    "special_values",
]

#: The special-value classes, in the order their switches are documented.
#:
#: - ``signed_zero``: -0 (+0 is a plain value, and the shrink target; absent from
#:   the fnuz formats, which have no -0);
#: - ``infinity``: +inf and -inf (absent from formats without infinities);
#: - ``nan``: NaN;
#: - ``min_subnormal`` / ``max_subnormal``: the smallest and largest subnormal, either sign;
#: - ``min_normal``: the smallest normal value, either sign;
#: - ``max_finite``: the largest finite value, either sign;
#: - ``power_of_two``: 2**e for every e the format holds, subnormal to largest, either sign;
#: - ``near_power_of_two``: the neighbours just above and below a power of two;
#: - ``overflow``: values in the top binade, [2**emax, max_finite]: two of them
#:   with one sign overflow when summed, and so does one times anything >= 2.
SPECIAL_CLASSES: tuple[str, ...] = (
    "signed_zero", "infinity", "nan", "min_subnormal", "max_subnormal", "min_normal",
    "max_finite", "power_of_two", "near_power_of_two", "overflow",
)

# One element drawn alone in this many is special (when any class is on).
_SPECIAL_ODDS = 8
# An array draws k in [0, _SPECIAL_STEPS) and holds max(0, k - _SPECIAL_STEPS + 4)
# specials: none about 5 times in 8, then one, two or three.
_SPECIAL_STEPS = 8

_SIGNS = (1.0, -1.0)
_WIDTHS = {"float16": 16, "float32": 32, "float64": 64}


def _floor_to(fmt: Format, x: float) -> float:
    """The largest value of ``fmt`` not above ``x`` (for 0 < x), clamped to max_finite."""
    if x >= fmt.max_finite:
        return fmt.max_finite
    e = max(math.frexp(x)[1] - 1, fmt.emin)
    q = math.ldexp(1.0, e - fmt.p + 1)
    return math.floor(x / q) * q


def _positive_zero(v: float) -> float:
    # Adding +0 turns -0 into +0 and leaves everything else alone: plain values
    # never carry the sign of zero, which is a special class of its own.
    return v + 0.0


def _to_bfloat16(v: float) -> float:
    return float(ml_dtypes.bfloat16(v))


@functools.lru_cache(maxsize=256)
def _raw_part(fmt: Format, max_abs: float | None) -> st.SearchStrategy[float]:
    """Finite normal values (and zeros of either sign) no larger than max_abs.

    For bfloat16 these are float32 values: storing one in a bfloat16 array
    rounds it once, and since the formats share their exponent range a
    normal float32 no larger than ``hi`` becomes a normal bfloat16 no larger
    than ``hi``.
    """
    hi = fmt.max_finite if max_abs is None else _floor_to(fmt, max_abs)
    if fmt.name in FLOAT8_FORMATS:
        # Hypothesis's floats, which shrink toward simple numbers, cut down to the format's few values:
        # toward zero, so none exceeds hi, and numpy stores them without rounding.
        return st.floats(min_value=-hi, max_value=hi, allow_nan=False, allow_infinity=False,
                         allow_subnormal=False, width=32).map(functools.partial(_truncate_to_normal, fmt))
    width = _WIDTHS.get(fmt.name)
    if width is None and fmt.name != "bfloat16":
        raise TypeError(f"dtype={fmt.name!r} has no element strategy yet")
    return st.floats(min_value=-hi, max_value=hi, allow_nan=False, allow_infinity=False,
                     allow_subnormal=False, width=width or 32)


def _truncate_to_normal(fmt: Format, x: float) -> float:
    """x rounded toward zero to ``fmt``, and 0 where that is below the smallest normal value."""
    a = abs(x)
    if a < fmt.min_normal:
        return 0.0
    q = math.ldexp(1.0, math.frexp(a)[1] - fmt.p)
    return math.copysign(math.floor(a / q) * q, x)


def _plain_part(fmt: Format, max_abs: float | None) -> st.SearchStrategy[float]:
    raw = _raw_part(fmt, max_abs)
    if fmt.name == "bfloat16":
        raw = raw.map(_to_bfloat16)
    return raw.map(_positive_zero)


def _signed(values: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    return st.tuples(st.sampled_from(_SIGNS), values).map(lambda t: t[0] * t[1])


def _neighbour(fmt: Format, e: int, up: bool) -> float:
    x = math.ldexp(1.0, e)
    if up:
        return x + math.ldexp(1.0, max(e, fmt.emin) - fmt.p + 1)
    return x - math.ldexp(1.0, max(e - 1, fmt.emin) - fmt.p + 1)


def _class_strategy(fmt: Format, name: str) -> st.SearchStrategy[float]:
    lowest = fmt.emin - fmt.p + 1
    if name == "signed_zero":
        # +0 is the plain shrink target already; the class adds its sign.
        return st.just(-0.0)
    if name == "infinity":
        return st.sampled_from((math.inf, -math.inf))
    if name == "nan":
        return st.just(math.nan)
    if name in ("min_subnormal", "max_subnormal", "min_normal", "max_finite"):
        return _signed(st.just(float(getattr(fmt, name))))
    if name == "power_of_two":
        # 2**emax belongs to the overflow class.
        return _signed(st.integers(lowest, fmt.emax - 1).map(lambda e: math.ldexp(1.0, e)))
    if name == "near_power_of_two":
        # Among the smallest subnormals a neighbour of a power of two is itself
        # one (2**lowest * 2 - 2**lowest), so those exponents are left out.
        return _signed(st.tuples(st.integers(lowest + 2, fmt.emax - 1), st.booleans()).map(
            lambda t: _neighbour(fmt, t[0], t[1])))
    if name == "overflow":
        top = fmt.max_finite
        lo = math.ldexp(1.0, fmt.emax)
        step = math.ldexp(1.0, fmt.emax - fmt.p + 1)
        count = int((top - lo) / step)
        return _signed(st.integers(0, count).map(lambda k: lo + k * step))
    raise AssertionError(name)  # pragma: no cover - guarded by check_classes


def _class_strategies(fmt: Format, classes: tuple[str, ...]) -> list[st.SearchStrategy[float]]:
    absent = {"infinity": not fmt.has_inf, "signed_zero": not fmt.has_negative_zero}
    return [_class_strategy(fmt, c) for c in classes if not absent.get(c, False)]


def _weighted(plain: st.SearchStrategy[Any], *specials: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """plain, or one time in _SPECIAL_ODDS one of ``specials``, each as likely as the others.

    One integer picks the branch: it shrinks to 0, the plain branch.  A
    one_of would pick plain only half the time and, as generation leans to
    early branches, the later specials hardly ever.
    """
    n = len(specials)
    if n == 0:
        return plain
    first = (_SPECIAL_ODDS - 1) * n
    return st.integers(0, first + n - 1).flatmap(lambda k: plain if k < first else specials[k - first])


def _complex(real: st.SearchStrategy[float], imag: st.SearchStrategy[float]) -> st.SearchStrategy[complex]:
    return st.builds(complex, real, imag)


@functools.lru_cache(maxsize=256)
def _elements(fmt: Format | ComplexFormat, classes: tuple[str, ...], max_abs: float | None
              ) -> st.SearchStrategy[Any]:
    part = part_of(fmt)
    plain = _plain_part(part, max_abs)
    specials = [after_plain(plain, s) for s in _class_strategies(part, classes)]
    if not fmt.is_complex:
        return _weighted(plain, *specials)
    # A special complex value has one special part; the other stays plain.
    return _weighted(_complex(plain, plain), *[_complex(s, plain) for s in specials],
                     *[_complex(plain, s) for s in specials])


def after_plain(plain: st.SearchStrategy[Any], special: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``special``, drawn after a plain value that is thrown away.

    Hypothesis shrinks toward shorter choice sequences first, and a special
    drawn alone (st.just(nan)) is shorter than a plain float: without the
    extra draw, shrinking would prefer the special value.
    """
    return st.tuples(plain, special).map(_second)


def _second(pair: tuple[Any, Any]) -> Any:
    return pair[1]


def _read_format(dtype: Any) -> Format | ComplexFormat:
    fmt = format_of(dtype, argument="dtype")
    if not part_of(fmt).signed:
        raise ValueError(f"dtype={fmt.name!r} holds only the powers of two 2**-127 to 2**127 (an MX block "
                         "scale: no zero, no sign, no subnormals), so it has no special classes; draw its "
                         "exponent instead, e.g. st.integers(-127, 127).map(lambda e: 2.0 ** e)")
    return fmt


def elements(*, dtype: Any, specials: Any = True, max_abs: float | None = None) -> st.SearchStrategy[Any]:
    """Draw one value of ``dtype``'s format, as a Python float or complex.

    ``specials`` is True (every class in :data:`SPECIAL_CLASSES`), False, or
    a collection of class names.  ``max_abs`` bounds the plain values (it is
    rounded down to the format); special values ignore it.

    >>> import math
    >>> from hypothesis import find
    >>> find(elements(dtype="float16"), lambda v: v >= 1000)
    1000.0
    >>> find(elements(dtype="float32", specials=["nan"]), lambda v: v != v)
    nan
    """
    fmt = _read_format(dtype)
    classes = check_classes("specials", specials, SPECIAL_CLASSES)
    max_abs = check_positive_float("max_abs", max_abs, allow_none=True)
    return _elements(fmt, classes, max_abs)


def special_values(*, dtype: Any, classes: Any = True) -> st.SearchStrategy[Any]:
    """Draw only special values of ``dtype``'s format, from the switched-on ``classes``.

    For a complex format, one part is special and the other plain.

    >>> from hypothesis import find
    >>> find(special_values(dtype="float16", classes=["max_finite"]), lambda v: v < 0)
    -65504.0
    >>> find(special_values(dtype="float32", classes=["near_power_of_two"]), lambda v: 1 < v < 1.5)
    1.0000001192092896
    """
    fmt = _read_format(dtype)
    chosen = check_classes("classes", classes, SPECIAL_CLASSES)
    if not chosen:
        raise ValueError(f"classes={classes!r} switches every class off; name at least one of: "
                         f"{', '.join(SPECIAL_CLASSES)}")
    part = part_of(fmt)
    special = st.one_of(_class_strategies(part, chosen))
    if not fmt.is_complex:
        return special
    plain = _plain_part(part, None)
    return st.one_of(_complex(special, plain), _complex(plain, special))


def special_class(value: Any, *, dtype: Any) -> str | None:
    """The special-value class of one real value in ``dtype``'s format, or None if it is plain.

    Where classes overlap the more specific one wins: the largest finite value
    is ``max_finite``, not ``overflow``; the smallest subnormal is
    ``min_subnormal``, not ``power_of_two``.

    >>> special_class(-0.0, dtype="float32"), special_class(2.0 ** -24, dtype="float16")
    ('signed_zero', 'min_subnormal')
    >>> special_class(1.5, dtype="float32") is None
    True
    """
    fmt = part_of(_read_format(dtype))
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "infinity"
    a = abs(v)
    if a == 0:
        return "signed_zero" if math.copysign(1.0, v) < 0 else None
    for name in ("min_subnormal", "max_subnormal", "min_normal", "max_finite"):
        if a == getattr(fmt, name):
            return name
    if a >= math.ldexp(1.0, fmt.emax):
        return "overflow"
    m, e = math.frexp(a)
    if m == 0.5:
        return "power_of_two"
    if _neighbour(fmt, e, False) == a or _neighbour(fmt, e - 1, True) == a:
        return "near_power_of_two"
    return None


def arrays(*, dtype: Any, shape: Any, specials: Any = True, max_abs: float | None = None,
           device: Any = None) -> st.SearchStrategy[Any]:
    """Draw an array of ``dtype`` and ``shape`` (a tuple or a strategy of tuples).

    Plain elements are drawn as by :func:`elements`, and the rest of a large
    array is one plain ``fill`` value, as Hypothesis's ``arrays`` does, so big
    shapes stay cheap; then up to three special values go to drawn
    positions.  Arrays are numpy arrays (bfloat16 through ml_dtypes); pass a
    ``device`` such as ``"cpu"`` or ``"cuda"`` for torch tensors there.

    >>> import numpy as np
    >>> from hypothesis import find
    >>> a = find(arrays(dtype="bfloat16", shape=(3,)), lambda a: np.isnan(a.astype(np.float32)).any())
    >>> a.dtype.name, a.astype(np.float32).tolist()
    ('bfloat16', [nan, 0.0, 0.0])
    """
    fmt = _read_format(dtype)
    classes = check_classes("specials", specials, SPECIAL_CLASSES)
    max_abs = check_positive_float("max_abs", max_abs, allow_none=True)
    device = check_device("device", device)
    if not isinstance(shape, (tuple, st.SearchStrategy)):
        raise TypeError(f"shape={shape!r} must be a tuple of ints or a strategy of them; "
                        "pass e.g. shape=(2, 3) or shape=strategies.shapes()")
    if isinstance(shape, tuple) and not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"shape={shape!r} must hold non-negative ints")
    if isinstance(shape, tuple):
        check_shape_size("shape", shape)
    else:
        # A strategy's shapes are known only when drawn: each is checked then.
        shape = shape.map(functools.partial(check_shape_size, "shape", drawn=True))
    strategy = _array_strategy(fmt, shape, classes, max_abs)
    if device is None:
        return strategy
    from .case import tensor_from_numpy
    return strategy.map(lambda a: tensor_from_numpy(a, device))


@functools.lru_cache(maxsize=4096)
def _array_strategy(fmt: Format | ComplexFormat, shape: Any, classes: tuple[str, ...],
                    max_abs: float | None) -> st.SearchStrategy[np.ndarray]:
    if not isinstance(shape, tuple):
        return shape.flatmap(lambda s: _array_strategy(fmt, tuple(s), classes, max_abs))
    raw = _raw_part(part_of(fmt), max_abs)
    plain = st.builds(complex, raw, raw) if fmt.is_complex else raw
    # The raw values skip the per-value rounding and sign fixing of
    # elements(): numpy rounds to bfloat16 as it stores, and _with_specials
    # clears the sign of zeros for the whole array at once.
    base = hnp.arrays(np.dtype(fmt.dtype), shape, elements=plain, fill=plain)
    specials = tuple(_class_strategies(part_of(fmt), classes))
    size = int(np.prod(shape, dtype=np.int64))
    return _with_specials(base, size, fmt.is_complex, _uniform(specials) if specials else None)


@functools.lru_cache(maxsize=256)
def _uniform(options: tuple[st.SearchStrategy[Any], ...]) -> st.SearchStrategy[Any]:
    # One integer picks the class, so that each is as likely as the others (a
    # one_of leans toward its first branches).
    return ints(0, len(options) - 1).flatmap(lambda k: options[k])


@st.composite
def _with_specials(draw: st.DrawFn, base: st.SearchStrategy[np.ndarray], size: int, is_complex: bool,
                   special: st.SearchStrategy[float] | None) -> np.ndarray:
    """A plain array with up to three special values written at drawn positions.

    The number of specials shrinks to zero and each one's draws are its own,
    so the shrinker removes specials one by one and leaves plain values.
    """
    a = draw(base)
    # -0 + 0 is +0: plain values never carry the sign of zero.
    np.add(a, a.dtype.type(0), out=a)
    if special is None or size == 0:
        return a
    k = draw(ints(0, _SPECIAL_STEPS - 1))
    flat = a.reshape(-1)
    for _ in range(min(size, max(0, k - (_SPECIAL_STEPS - 4)))):
        i = draw(ints(0, size - 1))
        v = draw(special)
        if is_complex:
            z = complex(flat[i])
            flat[i] = complex(z.real, v) if draw(coin()) else complex(v, z.imag)
        else:
            flat[i] = v
    return a
