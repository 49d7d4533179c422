"""Binary floating-point formats, each described once as data.

A :class:`Format` holds the precision ``p`` (significand bits, hidden bit
included), the exponent range ``emin``/``emax`` of normal numbers, whether the
format has infinities, and how it encodes NaN.  Every other constant (largest
finite value, unit roundoff, smallest subnormal, ...) is derived from those
fields, exactly, as a :class:`fractions.Fraction` or a float built with
``math.ldexp``.

A :class:`ComplexFormat` is a pair of parts in one real format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "ComplexFormat",
    "FORMATS",
    "Format",
    "format_of",
]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    ``nan_encoding`` is ``"ieee"`` (all-ones exponent field, nonzero
    significand) or ``"fn"`` (finite-only formats such as float8_e4m3fn, where
    only the all-ones bit pattern is NaN and the format has no infinities).
    ``dtype`` is the numpy dtype that stores the format, or None for a format
    that only exists inside an algorithm (TF32).
    """

    name: str
    p: int
    emin: int
    emax: int
    has_inf: bool = True
    nan_encoding: str = "ieee"
    dtype: Any = field(default=None, compare=False, repr=False)
    torch_name: str | None = field(default=None, compare=False, repr=False)

    is_complex = False

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-p: the relative error bound of one rounding to nearest."""
        return math.ldexp(1.0, -self.p)

    @property
    def max_finite(self) -> float:
        # In an "fn" format the top significand pattern of the top binade is NaN.
        top = 2 if self.nan_encoding == "fn" else 1
        return math.ldexp((1 << self.p) - top, self.emax - self.p + 1)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.p + 1)

    @property
    def max_subnormal(self) -> float:
        return self.min_normal - self.min_subnormal

    @property
    def overflow_threshold(self) -> Fraction:
        """The smallest magnitude that rounds to infinity (or NaN), exactly.

        It is the midpoint between the largest finite value and the next value
        the format would have with an unbounded exponent.
        """
        step = Fraction(2) ** (self.emax - self.p + 1)
        return Fraction(self.max_finite) + step / 2

    @property
    def overflow_value(self) -> float:
        """What a rounding that overflows yields: inf, or NaN in an fn format."""
        return math.inf if self.has_inf else math.nan

    def ulp(self, x: float) -> float:
        """The spacing of the format at the magnitude of ``x``."""
        e = math.frexp(abs(x))[1] - 1 if x != 0 and math.isfinite(x) else self.emin
        return math.ldexp(1.0, max(e, self.emin) - self.p + 1)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ComplexFormat:
    """A complex format: real and imaginary parts in the real format ``part``."""

    name: str
    part: Format
    dtype: Any = field(default=None, compare=False, repr=False)
    torch_name: str | None = field(default=None, compare=False, repr=False)

    is_complex = True

    def __str__(self) -> str:
        return self.name


def _real(name: str, p: int, emin: int, emax: int, dtype: Any, **kw: Any) -> Format:
    return Format(name, p, emin, emax, dtype=np.dtype(dtype) if dtype else None,
                  torch_name=kw.pop("torch_name", name), **kw)


FLOAT64 = _real("float64", 53, -1022, 1023, np.float64)
FLOAT32 = _real("float32", 24, -126, 127, np.float32)
FLOAT16 = _real("float16", 11, -14, 15, np.float16)
BFLOAT16 = _real("bfloat16", 8, -126, 127, ml_dtypes.bfloat16)
FLOAT8_E4M3FN = _real("float8_e4m3fn", 4, -6, 8, ml_dtypes.float8_e4m3fn,
                      has_inf=False, nan_encoding="fn")
FLOAT8_E5M2 = _real("float8_e5m2", 3, -14, 15, ml_dtypes.float8_e5m2)
# TF32 is not a storage format: it is the precision tensor cores round float32
# inputs to under torch.set_float32_matmul_precision("high").
TF32 = _real("tf32", 11, -126, 127, None, torch_name=None)

COMPLEX64 = ComplexFormat("complex64", FLOAT32, np.dtype(np.complex64), "complex64")
COMPLEX128 = ComplexFormat("complex128", FLOAT64, np.dtype(np.complex128), "complex128")

#: Every format ExactRef can judge an output in, by name.
FORMATS: dict[str, Format | ComplexFormat] = {
    f.name: f for f in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16, COMPLEX64, COMPLEX128)
}
#: Formats that exist as data but that no op accepts yet.
LATER_FORMATS: dict[str, Format] = {f.name: f for f in (FLOAT8_E4M3FN, FLOAT8_E5M2)}

_ALIASES = {
    "double": "float64", "float": "float32", "half": "float16", "single": "float32",
    "cfloat": "complex64", "cdouble": "complex128",
}


def _name_of(dtype: Any) -> str | None:
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").removeprefix("numpy.")
        return _ALIASES.get(name, name)
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def format_of(dtype: Any, *, argument: str = "dtype") -> Format | ComplexFormat:
    """The format for ``dtype``: a name, a numpy dtype or a torch dtype.

    Raises TypeError naming ``argument`` when the dtype is not one ExactRef
    supports.
    """
    if isinstance(dtype, (Format, ComplexFormat)):
        return dtype
    name = _name_of(dtype)
    if name in FORMATS:
        return FORMATS[name]
    supported = ", ".join(FORMATS)
    hint = " (float8 formats are described but no op accepts them yet)" if name in LATER_FORMATS else ""
    raise TypeError(f"{argument}={dtype!r} is not a supported format{hint}; use one of: {supported}")


def complex_of(fmt: Format) -> ComplexFormat:
    """The complex format whose parts are ``fmt``."""
    for f in FORMATS.values():
        if isinstance(f, ComplexFormat) and f.part == fmt:
            return f
    raise TypeError(f"there is no complex format with {fmt.name} parts; "
                    "PyTorch's complex32 is not supported")


def part_of(fmt: Format | ComplexFormat) -> Format:
    """The real format of ``fmt``'s parts (``fmt`` itself when real)."""
    return fmt.part if isinstance(fmt, ComplexFormat) else fmt
