"""Argument checks shared by every public strategy.

Each ``check_*`` helper takes the argument's name and value, returns the
value in canonical form, and raises TypeError (wrong kind of value) or
ValueError (right kind, bad value) with a message that names the argument,
shows the value and says what to pass instead.  Strategies call them eagerly,
so a bad argument fails where the strategy is built, not at the first draw.

Sizes have a limit, :data:`MAX_ELEMENTS` per drawn array, checked from the
size arguments before anything is drawn (:func:`check_size`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from exactref.formats import FLOAT8_FORMATS, FORMATS, ComplexFormat, Format, format_of

__all__ = [
    "MAX_ELEMENTS",
    "OP_FORMATS",
    "check_bool",
    "check_classes",
    "check_coefficient",
    "check_device",
    "check_dtypes",
    "check_int",
    "check_positive_float",
    "check_shape_size",
    "check_side_range",
    "check_size",
]

#: The most elements one drawn array may have: 2**24, 128 MiB as float64.  Larger
#: arrays make every example slow (ExactRef's working memory is several times an
#: input's size) and, with a large max_side, can exhaust the memory at draw time.
MAX_ELEMENTS = 2 ** 24

#: The formats the per-op strategies draw: every format but float8, on which PyTorch
#: computes only matmul and _scaled_mm (forward).  A default list of formats is this
#: one, so that callers who name none never get float8.
OP_FORMATS: tuple[str, ...] = tuple(n for n in FORMATS if n not in FLOAT8_FORMATS)


def check_int(name: str, value: Any, *, min_value: int | None = None,
              max_value: int | None = None) -> int:
    """``value`` as an int within [min_value, max_value]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = f"; pass e.g. {name}={min_value if min_value is not None else 1}"
        raise TypeError(f"{name}={value!r} must be an int{hint}")
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{name}={value} must be at least {min_value}; pass {name}={min_value} or more")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name}={value} must be at most {max_value}; pass {name}={max_value} or less")
    return value


def check_side_range(min_name: str, min_value: int, max_name: str, max_value: int) -> None:
    """Two already-checked bounds must not cross."""
    if min_value > max_value:
        raise ValueError(f"{min_name}={min_value} is larger than {max_name}={max_value}; "
                         f"raise {max_name} to {min_value} or lower {min_name}")


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; ints and other truthy things are refused so typos show."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
    return value


def check_positive_float(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A finite number greater than zero (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name}={value!r} must be a positive number{none}; pass e.g. {name}=4.0")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be finite and greater than zero; pass e.g. {name}=4.0")
    return value


def check_dtypes(name: str, value: Any, *, default: Iterable[str] | None = None,
                 allowed: Iterable[str] | None = None, op: str | None = None
                 ) -> tuple[Format | ComplexFormat, ...]:
    """A tuple of formats from one dtype or an iterable of them.

    A dtype is a name ("float32", "bfloat16"), a numpy or torch dtype, or an
    exactref Format.  None means ``default`` (when that is None too, the
    ``allowed`` formats that are not float8).  ``allowed`` restricts the
    formats an op accepts; it is :data:`OP_FORMATS` when None.
    """
    allowed_names = tuple(allowed) if allowed is not None else OP_FORMATS
    if value is None:
        names = tuple(default) if default is not None else tuple(n for n in allowed_names if n in OP_FORMATS)
        return tuple(FORMATS[n] for n in names)
    items = [value] if isinstance(value, (str, Format, ComplexFormat)) or not isinstance(value, Iterable) \
        else list(value)
    if not items:
        raise ValueError(f"{name}={value!r} is empty; pass at least one dtype, e.g. {name}=['float32']")
    out: list[Format | ComplexFormat] = []
    for item in items:
        try:
            fmt = format_of(item, argument=name)
        except TypeError:
            raise TypeError(f"{name} contains {item!r}, which is not a supported dtype; "
                            f"use names from: {', '.join(FORMATS)}") from None
        if fmt.name not in allowed_names:
            who = f"{op} " if op else "this strategy "
            why = ""
            if fmt.name in FLOAT8_FORMATS:
                why = (" (PyTorch computes only matmul and _scaled_mm on float8; draw float8 values with "
                       f"strategies.elements or strategies.arrays(dtype={fmt.name!r}, ...))")
            raise ValueError(f"{name} contains {fmt.name!r}, which {who}does not accept{why}; "
                             f"use names from: {', '.join(allowed_names)}")
        if fmt not in out:
            out.append(fmt)
    return tuple(out)


def check_classes(name: str, value: Any, known: tuple[str, ...]) -> tuple[str, ...]:
    """Which of the ``known`` classes are switched on.

    True means all of them, False or None none; otherwise an iterable of
    class names (a single name is accepted too).
    """
    if value is True:
        return known
    if value is False or value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Iterable):
        raise TypeError(f"{name}={value!r} must be True, False or a collection of class names "
                        f"from: {', '.join(known)}")
    chosen = []
    for item in items:
        if item not in known:
            raise ValueError(f"{name} contains {item!r}, which is not a class this strategy draws; "
                             f"use True, False or names from: {', '.join(known)}")
        if item not in chosen:
            chosen.append(item)
    # Keep the documented order, so the first class (the one shrinking prefers) does not
    # depend on how the caller spelled the collection.
    return tuple(k for k in known if k in chosen)


def check_coefficient(name: str, value: Any, fmt_names: tuple[str, ...]) -> float | complex | None:
    """A fixed alpha/beta: None (drawn), or a finite Python number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"{name}={value!r} must be None (drawn) or a Python int, float or complex; "
                        f"pass e.g. {name}=1.0")
    parts = (value.real, value.imag) if isinstance(value, complex) else (float(value),)
    if not all(math.isfinite(p) for p in parts):
        raise ValueError(f"{name}={value!r} must be finite; pass e.g. {name}=1.0")
    if isinstance(value, complex) and value.imag != 0:
        real = [n for n in fmt_names if not FORMATS[n].is_complex]
        if real:
            raise ValueError(f"{name}={value!r} is complex but dtypes include real formats "
                             f"({', '.join(real)}); pass only complex dtypes or a real {name}")
    return value if isinstance(value, complex) else float(value)


def check_device(name: str, value: Any) -> str | None:
    """None (numpy arrays) or a torch device, given as a string or torch.device."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name}='' is empty; pass None for numpy arrays or e.g. {name}='cpu'")
        return value
    if type(value).__module__ == "torch" and type(value).__name__ == "device":
        return str(value)
    raise TypeError(f"{name}={value!r} must be None (numpy arrays) or a torch device such as 'cpu' or 'cuda'")


def check_size(strategy: str, sizes: dict[str, int | None], elements: Callable[..., int]) -> None:
    """Refuse size arguments with which one drawn array could have more than MAX_ELEMENTS elements.

    ``sizes`` are the checked size arguments by name (None: that argument's
    default), ``elements(**sizes)`` the most elements one array drawn with
    them can have.  The message shows the arguments and, for each, the
    largest value that fits with the others as given.
    """
    worst = elements(**sizes)
    if worst <= MAX_ELEMENTS:
        return

    def lowest(name: str) -> int:
        return 0 if name.endswith("dims") else 1
    given = {k: v for k, v in sizes.items() if v is not None}
    fixes = []
    for name, value in given.items():
        fit = _largest_fitting(lambda v, name=name: elements(**{**sizes, name: v}), lowest(name), value)
        if fit is not None:
            fixes.append(f"{name}={fit}" if fit == lowest(name) else f"{name} at most {fit}")
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    fix = f"pass {', or '.join(fixes)}" if fixes else "pass smaller sizes"
    raise ValueError(f"{strategy}({shown}) could draw an array of {worst:,} elements "
                     f"({worst * 8 / 2**30:,.3g} GiB as float64), more than the limit of "
                     f"{MAX_ELEMENTS:,} (2**24) per array; {fix}")


def _largest_fitting(elements: Callable[[int], int], lowest: int, value: int) -> int | None:
    """The largest v in [lowest, value) with elements(v) <= MAX_ELEMENTS (monotone in v), or None."""
    if elements(lowest) > MAX_ELEMENTS:
        return None
    lo, hi = lowest, value  # elements(lo) fits, elements(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if elements(mid) <= MAX_ELEMENTS else (lo, mid)
    return lo


def check_shape_size(name: str, shape: tuple[int, ...], *, drawn: bool = False) -> tuple[int, ...]:
    """``shape``, if an array of it has at most MAX_ELEMENTS elements; ``drawn``: it came from a strategy."""
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        what = f"the {name} strategy drew {shape!r}, which" if drawn else f"{name}={shape!r}"
        fix = f"bound its sides, e.g. {name}=strategies.shapes(max_side=64)" if drawn else f"pass a smaller {name}"
        raise ValueError(f"{what} has {n:,} elements ({n * 8 / 2**30:,.3g} GiB as float64), more than the "
                         f"limit of {MAX_ELEMENTS:,} (2**24) per array; {fix}")
    return shape
