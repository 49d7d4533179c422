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

import dataclasses
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "FLOAT8_FORMATS",
    "FORMATS",
    "ComplexFormat",
    "Format",
    "format_of",
]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    ``nan_encoding`` says which bit patterns are NaN:

    * ``"ieee"``: an all-ones exponent field with a nonzero significand (the
      field with a zero significand is infinity);
    * ``"fn"``: only the all-ones pattern (float8_e4m3fn: S.1111.111), so the
      top binade holds one value fewer and there is no infinity;
    * ``"fnuz"``: only the pattern of negative zero (float8_e4m3fnuz,
      float8_e5m2fnuz), so there is no infinity and no negative zero;
    * ``"fnu"``: only the all-ones byte of an unsigned, exponent-only format
      (float8_e8m0fnu, the MX block scale), which has no zero either.

    ``saturates`` is the convention of a rounding that overflows: True gives
    the largest finite value of the sign (infinities too), as torch's cast to
    float8_e4m3fn and NVIDIA's ``__NV_SATFINITE`` do; False gives infinity,
    or NaN in a format without one (``__NV_NOSAT``, ml_dtypes).
    ``dtype`` is the numpy dtype that stores the format, or None for a format
    that only exists inside an algorithm (TF32).  ``cast_rounds`` says that
    numpy's cast of float64 values to ``dtype`` is itself one correct
    rounding to nearest, ties to even, with gradual underflow and overflow to
    infinity: float32; float16, which numpy converts directly, not through
    float32 (whose rounding first could round twice); bfloat16 from
    ml_dtypes 0.7 on.
    """

    name: str
    p: int
    emin: int
    emax: int
    has_inf: bool = True
    nan_encoding: str = "ieee"
    saturates: bool = False
    dtype: Any = field(default=None, compare=False, repr=False)
    torch_name: str | None = field(default=None, compare=False, repr=False)
    cast_rounds: bool = field(default=False, compare=False, repr=False)

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
        """The midpoint between the largest finite value and the next value the format
        would have with an unbounded exponent, exactly.

        Magnitudes above it overflow; the midpoint itself overflows only when
        the largest finite value's significand is odd (ties go to even: in
        float8_e4m3fn, 464 rounds to 448).
        """
        step = Fraction(2) ** (self.emax - self.p + 1)
        return Fraction(self.max_finite) + step / 2

    @property
    def overflow_value(self) -> float:
        """What a rounding that overflows yields: the largest finite value if saturating, else inf or NaN."""
        if self.saturates:
            return self.max_finite
        return math.inf if self.has_inf else math.nan

    @property
    def signed(self) -> bool:
        """Whether the format has negative values (float8_e8m0fnu has none)."""
        return self.nan_encoding != "fnu"

    @property
    def has_zero(self) -> bool:
        return self.nan_encoding != "fnu"

    @property
    def has_negative_zero(self) -> bool:
        return self.nan_encoding not in ("fnuz", "fnu")

    def with_saturation(self, saturates: bool) -> Format:
        """This format with the other overflow convention (see ``saturates``)."""
        return dataclasses.replace(self, saturates=saturates)

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
FLOAT32 = _real("float32", 24, -126, 127, np.float32, cast_rounds=True)
FLOAT16 = _real("float16", 11, -14, 15, np.float16, cast_rounds=True)
# ml_dtypes casts float64 to bfloat16 directly, one rounding, from 0.7 on; before, through float32.
_ML_DTYPES_ROUNDS_ONCE = tuple(int(part) for part in re.findall(r"\d+", ml_dtypes.__version__)[:2]) >= (0, 7)
BFLOAT16 = _real("bfloat16", 8, -126, 127, ml_dtypes.bfloat16, cast_rounds=_ML_DTYPES_ROUNDS_ONCE)
# torch's cast saturates into float8_e4m3fn only; into the others it overflows to inf or NaN.
FLOAT8_E4M3FN = _real("float8_e4m3fn", 4, -6, 8, ml_dtypes.float8_e4m3fn,
                      has_inf=False, nan_encoding="fn", saturates=True)
FLOAT8_E5M2 = _real("float8_e5m2", 3, -14, 15, ml_dtypes.float8_e5m2)
FLOAT8_E4M3FNUZ = _real("float8_e4m3fnuz", 4, -7, 7, ml_dtypes.float8_e4m3fnuz,
                        has_inf=False, nan_encoding="fnuz")
FLOAT8_E5M2FNUZ = _real("float8_e5m2fnuz", 3, -15, 15, ml_dtypes.float8_e5m2fnuz,
                        has_inf=False, nan_encoding="fnuz")
# Powers of two from 2**-127 to 2**127: the shared exponent of an MX block (OCP MX spec, E8M0).
FLOAT8_E8M0FNU = _real("float8_e8m0fnu", 1, -127, 127, ml_dtypes.float8_e8m0fnu,
                       has_inf=False, nan_encoding="fnu")
# TF32 is not a storage format: it is the precision tensor cores round float32
# inputs to under torch.set_float32_matmul_precision("high").
TF32 = _real("tf32", 11, -126, 127, None, torch_name=None)

COMPLEX64 = ComplexFormat("complex64", FLOAT32, np.dtype(np.complex64), "complex64")
COMPLEX128 = ComplexFormat("complex128", FLOAT64, np.dtype(np.complex128), "complex128")

#: The float8 formats: storage for matmul and scaled_matmul operands and outputs (and MX scales).
FLOAT8_FORMATS: dict[str, Format] = {
    f.name: f for f in (FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E4M3FNUZ, FLOAT8_E5M2FNUZ, FLOAT8_E8M0FNU)
}
#: Every format ExactRef can judge an output in, by name.
FORMATS: dict[str, Format | ComplexFormat] = {
    **{f.name: f for f in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16, COMPLEX64, COMPLEX128)},
    **FLOAT8_FORMATS,
}

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
    raise TypeError(f"{argument}={dtype!r} is not a supported format; use one of: {supported}")


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
