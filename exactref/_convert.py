"""Turning user inputs into numpy arrays, and PyTorch's type promotion.

Inputs may be nested lists, Python scalars, numpy arrays, torch tensors on
any device, or DLPack objects.  An *operand* remembers whether it was a
Python scalar (which never widens the result's dtype and gets no gradient), a
zero-dimensional array, or an array with dimensions: the three tiers of
``torch.result_type``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._parallel import _COPY_BLOCK, copy_array, copy_checked, elementwise
from ._pool import physical_memory
from .formats import (
    FLOAT8_FORMATS,
    FLOAT32,
    FORMATS,
    ComplexFormat,
    Format,
    complex_of,
    format_of,
    part_of,
)
from .rounding import round_float64, to_dtype

__all__ = ["PROMOTIONS", "SATURATIONS", "Operand", "asarray", "check_readable", "finite_values",
           "format_of_dtype", "operand", "promote", "values_checked", "values_of"]

def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_readable(obj: Any, name: str) -> None:
    """Refuse, from its shape alone and before any copy, an argument ExactRef cannot read.

    * a numpy masked array: its mask would be ignored;
    * a torch tensor on the meta device: it holds no values;
    * an array whose copy and float64 values (reading it makes both) would
      take more than half of this machine's memory, such as a huge
      ``np.broadcast_to`` view, which occupies almost none itself.
    """
    if isinstance(obj, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy masked array, whose mask ExactRef would ignore; pass "
                        f"{name}.filled(value) to replace the masked values, or np.asarray({name}.data) "
                        "to use the values underneath")
    if _is_torch(obj) and getattr(getattr(obj, "device", None), "type", None) == "meta":
        raise TypeError(f"{name} is a torch tensor on the meta device, which has a shape but no values; "
                        "create it on a real device (e.g. device='cpu')")
    shape, itemsize = _shape_of(obj)
    if shape is None:
        return
    size = 1
    for n in shape:
        size *= int(n)
    need = size * (itemsize + 16)  # its copy, and float64 (complex128) values at most
    if need > physical_memory() // 2:
        raise ValueError(f"{name} has shape {tuple(int(n) for n in shape)}: reading it needs about {_gib(need)} "
                         f"(a copy and its float64 values), more than half of this machine's "
                         f"{_gib(physical_memory())}; use a smaller input")


def _shape_of(obj: Any) -> tuple[tuple[int, ...] | None, int]:
    """The shape and bytes per element of an array-like, without reading its values (None if unknown)."""
    if isinstance(obj, np.ndarray):
        return obj.shape, obj.dtype.itemsize
    if _is_torch(obj):
        try:
            return tuple(obj.shape), int(obj.element_size())
        except (AttributeError, TypeError, RuntimeError):
            return None, 0
    return None, 0


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "detach")


def _torch_to_numpy(t: Any, copy: bool = True) -> np.ndarray:
    """The tensor's values as a numpy array: a copy of them unless ``copy`` is False (then
    possibly a view of the tensor's memory, for a caller that only reads it at once)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    name = str(t.dtype).removeprefix("torch.")
    if name == "bfloat16" or name in FLOAT8_FORMATS:
        # numpy has no such dtype: reinterpret the bits as ml_dtypes' twin.
        import ml_dtypes

        bits = torch.int16 if name == "bfloat16" else torch.uint8
        values = t.contiguous().view(bits).numpy().view(getattr(ml_dtypes, name))
        return values.copy() if copy else values
    try:
        return t.numpy().copy() if copy else t.numpy()
    except TypeError as exc:
        raise TypeError(f"a torch tensor of dtype {t.dtype} is not supported: {exc}") from None


def _plain(obj: Any, copy: bool = True) -> np.ndarray:
    """The array behind ``obj`` without any dtype change (``copy`` False: a torch tensor's may be
    a view of its memory)."""
    if isinstance(obj, np.ndarray):
        return obj
    if _is_torch(obj):
        return _torch_to_numpy(obj, copy)
    if hasattr(obj, "__dlpack__") and not isinstance(obj, (list, tuple)):
        try:
            return np.from_dlpack(obj)
        except (TypeError, RuntimeError, BufferError):
            # numpy's DLPack has no bfloat16; __array__ (JAX's gives ml_dtypes' bfloat16) needs no torch.
            if hasattr(obj, "__array__"):
                arr = np.asarray(obj)
                if arr.dtype != object:
                    return arr
            import torch

            return _torch_to_numpy(torch.from_dlpack(obj))
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    return np.asarray(obj)


#: The overflow conventions of a rounding into a format, by NVIDIA's names for them.
SATURATIONS = ("satfinite", "nosat")


def check_saturation(saturation: Any, argument: str = "saturation") -> bool | None:
    """None (the format's own convention, torch's), or whether to saturate."""
    if saturation is None:
        return None
    if saturation not in SATURATIONS:
        raise ValueError(f"{argument}={saturation!r} must be None (torch's convention for the format: float8_e4m3fn "
                         "saturates, the others overflow to inf or NaN), 'satfinite' (overflow gives the largest "
                         "finite value) or 'nosat' (overflow gives inf, or NaN where the format has no inf)")
    return saturation == "satfinite"


def with_saturation(fmt: Format | ComplexFormat, saturation: Any, argument: str = "saturation") -> Format | ComplexFormat:
    saturates = check_saturation(saturation, argument)
    if saturates is None or fmt.is_complex:
        return fmt
    return fmt.with_saturation(saturates)


def asarray(obj: Any, dtype: Any = None, *, saturation: str | None = None) -> np.ndarray:
    """A numpy array of ``obj`` in a supported format.

    ``obj`` is a nested list, a scalar, a numpy array, a torch tensor on any
    device (detached and copied to the host) or a DLPack object.  ``dtype``
    is a name ("float32", "bfloat16", ...) or a numpy or torch dtype; when it
    is given the values are rounded to it once, correctly (to nearest, ties
    to even).  Without it, arrays keep their dtype, and Python numbers follow
    ``torch.tensor``: floats become float32 and complex numbers complex64.
    ``saturation`` chooses what a value beyond the format's range becomes:
    None follows torch's cast (float8_e4m3fn saturates to +-448, infinities
    included; every other format overflows to inf, or to NaN without one),
    ``"satfinite"`` gives the largest finite value of the sign, ``"nosat"``
    gives inf or NaN (ml_dtypes' convention).

    >>> import exactref as er
    >>> er.asarray([[1.0, 2.5]], "bfloat16").dtype.name
    'bfloat16'
    """
    fmt = None if dtype is None else with_saturation(format_of(dtype), saturation)
    if dtype is None and saturation is not None:
        raise ValueError(f"saturation={saturation!r} needs a dtype to round to, such as dtype='float8_e4m3fn'")
    check_readable(obj, "obj")
    return _read_array(obj, fmt)


def _read_array(obj: Any, fmt: Format | ComplexFormat | None, copy: bool = True) -> np.ndarray:
    """:func:`asarray` of an ``obj`` that :func:`check_readable` has passed (its format inferred if None).
    Without ``copy``, an array already in its format's dtype comes back as it is, obj's own memory."""
    try:
        # Not a copy of a tensor's memory: convert() makes the one copy (or a converted array).
        arr = _plain(obj, copy=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"obj={_short(obj)} cannot be read as an array: {exc}") from None
    if arr.dtype == object:
        arr = _from_objects(arr, obj)
    if fmt is None:
        fmt = _infer_format(arr, obj)
    if not copy and arr.dtype == fmt.dtype:
        return arr
    return convert(arr, fmt)


def finite_values(x: np.ndarray) -> bool:
    """Whether every value of the float32 or float64 array x is finite: its largest and smallest
    values are finite exactly when every value is (a NaN is both), two reductions without a temporary."""
    return not x.size or bool(np.isfinite(np.maximum.reduce(x, axis=None))
                              and np.isfinite(np.minimum.reduce(x, axis=None)))


_BY_DTYPE: dict[np.dtype, Format | ComplexFormat] = {}


def format_of_dtype(dtype: np.dtype, argument: str = "dtype") -> Format | ComplexFormat:
    """``format_of(dtype, argument=argument)`` for a numpy dtype, remembered: reading a dtype's name
    costs microseconds, and a small op reads several operands' dtypes."""
    fmt = _BY_DTYPE.get(dtype)
    if fmt is None:
        fmt = format_of(dtype, argument=argument)  # raises, naming the argument, for an unsupported dtype
        _BY_DTYPE[dtype] = fmt
    return fmt


class _IntegerValues(TypeError):
    """Integer or bool values without a dtype: the fix depends on where they were passed."""

    def __init__(self, message: str, dtype: np.dtype) -> None:
        super().__init__(message)
        self.dtype = dtype


def _from_objects(arr: np.ndarray, obj: Any) -> np.ndarray:
    """An object array whose elements are all floats, as a float array; otherwise a TypeError."""
    items = arr.ravel().tolist() if arr.size else []
    if items and all(isinstance(v, (float, np.floating)) for v in items):
        return arr.astype(np.result_type(*{np.asarray(v).dtype for v in items}))
    if isinstance(obj, np.ndarray):
        raise TypeError(f"obj={_short(obj)} is an object array (dtype=object) and not all its elements are "
                        "floats; convert it first with obj.astype(float)")
    raise TypeError(f"obj={_short(obj)} is not a rectangular array of numbers")


def _infer_format(arr: np.ndarray, obj: Any) -> Format | ComplexFormat:
    kind = arr.dtype.kind
    # Python data (lists, numbers) takes torch's default dtypes; an array of any library (numpy, torch, JAX,
    # CuPy: anything with a dtype, __dlpack__ or __array__) keeps its own.
    from_python = not (isinstance(obj, (np.ndarray, np.generic)) or _is_torch(obj) or hasattr(obj, "dtype")
                       or hasattr(obj, "__dlpack__") or hasattr(obj, "__array__"))
    if from_python and kind in "fc":
        return FORMATS["complex64"] if kind == "c" else FLOAT32
    if kind in "iub":
        raise _IntegerValues(f"obj holds {arr.dtype} values, which no supported format is; "
                             "pass dtype='float32' (or another float format) to convert them", arr.dtype)
    return format_of_dtype(arr.dtype, argument="obj's dtype")


def convert(arr: np.ndarray, fmt: Format | ComplexFormat) -> np.ndarray:
    """``arr`` in ``fmt``, each value rounded once, correctly."""
    if arr.dtype == fmt.dtype:
        return copy_array(arr)  # the op's own copy: what the caller does to arr later does not reach it
    if arr.dtype.kind == "c" and not fmt.is_complex:
        raise TypeError(f"complex values cannot be converted to {fmt.name}; use a complex format")
    if arr.dtype.kind not in "fciub" and arr.dtype.name not in FORMATS:
        raise TypeError(f"values of dtype {arr.dtype} cannot be converted to {fmt.name}")
    wide = arr.astype(np.complex128 if arr.dtype.kind == "c" or fmt.is_complex else np.float64)
    part = part_of(fmt)
    if fmt.is_complex:
        # Parts are set directly: re + 1j * im would turn an infinite part into NaN.
        out = np.empty(wide.shape, dtype=np.complex128)
        out.real, out.imag = round_float64(wide.real, part), round_float64(wide.imag, part)
    else:
        if not part.signed and (wide <= 0).any():
            bad = float(wide[wide <= 0].ravel()[0])
            raise ValueError(f"{fmt.name} holds positive powers of two only, and obj has the value {bad!r}; "
                             "an MX block scale is 2**e, e from -127 to 127")
        out = round_float64(wide, part)
    return to_dtype(out, fmt)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Operand:
    """One input of an op, as read from the user."""

    name: str
    array: np.ndarray  # in ``fmt``'s dtype; a 0-d array for scalars
    fmt: Format | ComplexFormat
    tier: int  # 2: has dimensions, 1: zero-dimensional array, 0: Python scalar
    scalar: float | complex | None = None
    finite: bool | None = None  # every value finite, where the op's copy of it could tell (sum's)

    @property
    def is_python_scalar(self) -> bool:
        return self.tier == 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape


def _too_large(obj: numbers.Integral, name: str) -> None:
    text = str(obj)
    short = text if len(text) <= 20 else f"{text[:12]}...({len(text.lstrip('-'))} digits)"
    try:
        float(obj)
    except OverflowError:
        raise OverflowError(f"{name}={short} does not fit in float64, whose largest "
                            "value is about 1.8e308") from None
    raise ValueError(f"{name}={short} is an integer too large to be a float64 exactly")


def operand(obj: Any, name: str, *, float8: bool = False, copy: bool = True) -> Operand:
    """Read argument ``name``: a Python number becomes a scalar operand, anything else an array.

    float8 arrays are refused unless ``float8``: PyTorch computes no op on them but matmul and _scaled_mm.
    Without ``copy``, an array already in its format's dtype is obj's own memory, for an op that
    copies it on its own first pass (and learns there whether every value is finite,
    :attr:`Operand.finite`); it must not be kept.
    """
    if isinstance(obj, bool):
        raise TypeError(f"{name}={obj!r} is a bool; pass a float")
    if isinstance(obj, numbers.Number) and not isinstance(obj, np.generic):
        if isinstance(obj, numbers.Integral) and abs(obj) > 2 ** 53:
            _too_large(obj, name)
        value = complex(obj) if isinstance(obj, complex) else float(obj)
        fmt = FORMATS["complex128"] if isinstance(value, complex) else FORMATS["float64"]
        return Operand(name, np.asarray(value), fmt, 0, value)
    check_readable(obj, name)
    try:
        arr = _read_array(obj, None, copy)  # asarray(obj), without checking obj a second time
    except _IntegerValues as exc:
        raise TypeError(f"{name}: obj holds {exc.dtype} values, which no supported format is; convert it "
                        f"first with er.asarray({name}, 'float32') (or another float format)") from None
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    fmt = format_of_dtype(arr.dtype)
    if fmt.name in FLOAT8_FORMATS and not float8:
        raise TypeError(f"{name} has dtype {fmt.name}, which only er.matmul and er.scaled_matmul take (PyTorch has "
                        f"no other float8 op); convert it first with er.asarray({name}, 'bfloat16'), exactly")
    return Operand(name, arr, fmt, 2 if arr.ndim else 1)


def _promote_pair(a: Format | ComplexFormat, b: Format | ComplexFormat) -> Format | ComplexFormat:
    pa, pb = part_of(a), part_of(b)
    if pa == pb:
        part = pa
    elif {pa.name, pb.name} == {"float16", "bfloat16"}:
        part = FLOAT32
    else:
        part = max(pa, pb, key=lambda f: f.p)
    return complex_of(part) if a.is_complex or b.is_complex else part


#: The type promotion rules an elementwise op may follow.
PROMOTIONS = ("torch", "numpy")


def check_promotion(promotion: Any, op: str) -> str:
    if promotion not in PROMOTIONS:
        raise ValueError(f"{op}: promotion={promotion!r} must be 'torch' (torch.result_type, the default) or "
                         "'numpy' (numpy 2's rules, where a 0-d array counts as an array)")
    return str(promotion)


def promote(operands: list[Operand], op: str, promotion: str = "torch") -> Format | ComplexFormat:
    """``torch.result_type`` of the operands: dimensioned arrays, then 0-d arrays, then Python scalars.

    With ``promotion="numpy"``, numpy 2's rules (NEP 50): a 0-d array counts
    as an array, and only Python scalars are weak, so float16 array + float32
    0-d array is float32 (torch: float16).
    """
    tiers: list[Format | ComplexFormat | None] = [None, None, None]
    for o in operands:
        fmt = o.fmt
        tier = 2 if promotion == "numpy" and o.tier == 1 else o.tier
        if o.tier == 0:
            # A Python float or complex counts as the default dtype in its tier.
            fmt = FORMATS["complex64"] if o.fmt.is_complex else FLOAT32
        tiers[tier] = fmt if tiers[tier] is None else _promote_pair(tiers[tier], fmt)
    result = None
    for fmt in reversed(tiers):
        if fmt is None:
            continue
        if result is None:
            result = fmt
        elif fmt.is_complex and not result.is_complex:
            # A lower tier can only raise the category, keeping the higher tier's precision.
            try:
                result = complex_of(part_of(result) if result.name != "bfloat16" else FLOAT32)
            except TypeError:
                raise TypeError(f"{op}: a complex scalar with a {result.name} array gives complex32, "
                                "which ExactRef does not support") from None
    assert result is not None  # noqa: S101 - at least one operand always exists
    return result


def values_of(o: Operand, fmt: Format | ComplexFormat, *, copy: bool = True) -> np.ndarray:
    """The operand's exact values as float64 (complex128 when ``fmt`` is complex).

    PyTorch widens arrays to the promoted format exactly.  The only
    narrowing it makes is of a zero-dimensional array or Python scalar, to
    the format it computes in; ExactRef keeps such values exact and budgets
    that rounding in the tolerance.  With ``copy`` False, operand values
    already in float64 (complex128) are returned as they are, not copied:
    the caller must not write into them.
    """
    if not fmt.is_complex and np.iscomplexobj(o.array):
        raise TypeError(f"{o.name} is complex but the result format {fmt.name} is real")
    wide = np.complex128 if fmt.is_complex else np.float64
    arr = np.asarray(o.array)
    if arr.dtype != wide and arr.flags.c_contiguous:
        # A large array is widened in blocks side by side (exactref/_parallel.py).
        return elementwise(lambda block: (block.astype(wide),), arr)[0]
    return arr.astype(wide, copy=copy)


def values_checked(o: Operand, fmt: Format | ComplexFormat, *, own: bool = False) -> tuple[np.ndarray, bool]:
    """``values_of(o, fmt, copy=own)``, and whether every value is finite.

    A large array is checked as it is copied or widened, block by block while
    each is in cache, instead of in one more pass over the float64 values: for two
    float16 2048 x 2048 operands that pass took 5.2 ms on one thread, of the
    38 ms before a matmul's blocks of rows start (line_profiler).  ``own``: ``o.array``
    is the caller's memory (``operand(copy=False)``), so the values are made a copy of it
    even where they need no widening.
    """
    arr = np.asarray(o.array)
    if arr.size < 2 * _COPY_BLOCK:
        # One block: numpy's isfinite is the fewest calls, which is what a small op pays for.
        values = values_of(o, fmt, copy=own)
        return values, bool(np.isfinite(values).all())
    if fmt.is_complex or not np.iscomplexobj(arr):
        wide = np.complex128 if fmt.is_complex else np.float64
        if (arr.dtype != wide or own) and arr.flags.c_contiguous:
            return copy_checked(arr, _all_finite_parts, wide)
    values = values_of(o, fmt, copy=own)
    return values, _all_finite_parts(values)


def _all_finite_parts(x: np.ndarray) -> bool:
    """:func:`finite_values` of a real array, or of both parts of a complex one (the largest complex
    value, ordered by its real part first, can be finite beside an infinite imaginary part)."""
    return finite_values(x.real) and (not np.iscomplexobj(x) or finite_values(x.imag))
