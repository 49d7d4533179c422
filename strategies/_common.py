"""What the per-op strategies share: coefficients, broadcasting indices, and placing
hard cases into arrays without breaking an earlier one."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

from exactref.formats import ComplexFormat, Format

from ._draws import ints
from ._validation import check_device, check_int, check_positive_float
from .case import OpCase
from .values import SPECIAL_CLASSES, _array_strategy, _elements, check_classes

__all__ = [
    "Options",
    "Patcher",
    "check_max_dims",
    "coefficients",
    "finish",
    "in_part",
    "index_of",
    "patch_kinds",
    "positions",
    "power_of_two",
    "read_options",
    "source_index",
]


class Options:
    """The validated options every per-op strategy takes."""

    def __init__(self, *, dtypes: tuple, max_side: int, specials: tuple[str, ...],
                 hard: tuple[str, ...], max_abs: float | None, device: str | None) -> None:
        self.dtypes = dtypes
        self.max_side = max_side
        self.specials = specials
        self.hard = hard
        self.max_abs = max_abs
        self.device = device

    def array(self, fmt: Format | ComplexFormat, shape: tuple[int, ...], *,
              max_abs: float | None = None) -> st.SearchStrategy[np.ndarray]:
        """Arrays with these options; ``max_abs`` overrides the options' bound."""
        return _array_strategy(fmt, tuple(shape), self.specials, self.max_abs if max_abs is None else max_abs)

    def scalar(self, fmt: Format | ComplexFormat) -> st.SearchStrategy[Any]:
        """A Python scalar operand: finite, since exactref takes a scalar's exact value."""
        finite = tuple(c for c in self.specials if c not in ("infinity", "nan"))
        return _elements(fmt, finite, self.max_abs)


def read_options(*, dtypes: tuple, max_side: Any, specials: Any, hard: Any, hard_classes: tuple[str, ...],
                 max_abs: Any, device: Any) -> Options:
    """Check the options every per-op strategy shares (dtypes already checked)."""
    max_side = check_int("max_side", max_side, min_value=1)
    return Options(dtypes=dtypes, max_side=max_side,
                   specials=check_classes("specials", specials, SPECIAL_CLASSES),
                   hard=check_classes("hard", hard, hard_classes),
                   max_abs=check_positive_float("max_abs", max_abs, allow_none=True),
                   device=check_device("device", device))


def finish(case: OpCase, device: str | None) -> OpCase:
    """The case as drawn, or with torch tensors on ``device``."""
    return case if device is None else case.to_torch(device)


@functools.lru_cache(maxsize=64)
def coefficients(fmt: Format | ComplexFormat) -> st.SearchStrategy[float | complex]:
    """alpha/beta: mostly simple values (1, the shrink target, -1, 2, 0.5 and 0), else any bounded float.

    Arbitrary float64 values are drawn on purpose, one time in four: PyTorch
    rounds a Python scalar to the format it computes in, and the reference
    must budget that.  Hard cases need a power of two, hence the odds.
    """
    simple = st.sampled_from((1.0, -1.0, 2.0, 0.5, 0.0))
    real = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False, allow_infinity=False)
    other = st.one_of(real, st.builds(complex, real, real)) if fmt.is_complex else real
    return st.integers(0, 3).flatmap(lambda k: other if k == 3 else simple)


def power_of_two(c: Any) -> bool:
    """Whether c is a real, nonzero power of two (dividing by it is exact)."""
    if isinstance(c, complex):
        if c.imag != 0:
            return False
        c = c.real
    if c == 0 or not math.isfinite(c):
        return False
    return math.frexp(abs(c))[0] == 0.5


def source_index(out_index: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element of an operand of ``shape`` that broadcasting puts at ``out_index``."""
    tail = out_index[len(out_index) - len(shape):] if shape else ()
    return tuple(i if s != 1 else 0 for i, s in zip(tail, shape))


def in_part(v: float, fmt: Format | ComplexFormat, part: str | None) -> float | complex:
    """v as a value of fmt, in the real or imaginary ``part`` of a complex format."""
    if not fmt.is_complex:
        return v
    return complex(0.0, v) if part == "imag" else complex(v, 0.0)


def _fits(dtype: np.dtype, v: Any) -> bool:
    """Whether v is stored in dtype exactly (finite, no rounding, no overflow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        stored = np.array(v, dtype=dtype)
    back = complex(stored.astype(np.complex128)) if dtype.kind == "c" else float(stored.astype(np.float64))
    return back == v and math.isfinite(abs(complex(back)))


class Patcher:
    """Writes hard cases into arrays, each only where no earlier one depends.

    A patch lists every element its output element depends on, with the
    value to store there; it is skipped whole when one of those elements is
    already taken or a value does not fit the format.
    """

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.taken: set[tuple[str, tuple[int, ...]]] = set()

    def apply(self, writes: list[tuple[str, tuple[int, ...], Any]]) -> bool:
        keys = [(name, idx) for name, idx, _ in writes]
        if any(k in self.taken for k in keys) or len(set(keys)) != len(keys):
            return False
        if not all(_fits(self.arrays[name].dtype, v) for name, _, v in writes):
            return False
        for name, idx, v in writes:
            self.arrays[name][idx] = v
        self.taken.update(keys)
        return True


def patch_kinds(draw: st.DrawFn, size: int, kinds: tuple[str, ...]) -> list[str]:
    """The classes of the hard cases to try to place, in order; shrinks to none.

    The classes cycle from a drawn start, so a case with several hard cases
    holds several classes: a drawn class per hard case would lean toward the
    first class, as Hypothesis's generation leans toward the first choice.
    """
    if not kinds or size == 0:
        return []
    count = draw(ints(0, min(3, size)))
    if count == 0:
        return []
    start = draw(ints(0, len(kinds) - 1))
    return [kinds[(start + i) % len(kinds)] for i in range(count)]


def index_of(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """An index into ``shape``, shrinking to all zeros."""
    size = int(np.prod(shape, dtype=np.int64))
    flat = draw(ints(0, size - 1))
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def positions(draw: st.DrawFn, n: int, count: int) -> list[int]:
    """``count`` distinct slots out of ``n``, in drawn order (shrinking to 0, 1, ...)."""
    return draw(_distinct(n, count))


@functools.lru_cache(maxsize=1024)
def _distinct(n: int, count: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, n - 1), min_size=count, max_size=count, unique=True)


def check_max_dims(name: str, value: Any) -> int:
    """A dims bound; 16 keeps every broadcast within Hypothesis's own limit of 32 dims."""
    return check_int(name, value, min_value=0, max_value=16)
