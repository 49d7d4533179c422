"""Per-op input sets for scaled_matmul, and float8 arrays (which matmul_inputs draws too).

A float8 format has at most 256 values, so its special values are read off
the list of all of them rather than derived: the largest finite value and
its neighbours, subnormals, zeros, NaN, infinities where the format has them.
Plain values are Hypothesis floats within the finite range, rounded to the
format once by ``er.asarray``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.formats import FLOAT8_FORMATS, FORMATS, Format

from ._common import finish
from ._draws import choice, coin, ints
from ._validation import (
    check_bool,
    check_classes,
    check_device,
    check_dtypes,
    check_int,
    check_positive_float,
)
from .case import OpCase
from .values import SPECIAL_CLASSES, arrays

__all__ = ["FLOAT8_INPUTS", "SCALE_KINDS", "float8_arrays", "scaled_matmul_inputs"]

#: The float8 formats an operand may have (float8_e8m0fnu is only ever an MX scale).
FLOAT8_INPUTS: tuple[str, ...] = tuple(n for n in FLOAT8_FORMATS if n != "float8_e8m0fnu")
#: How the scales apply: one float32 each (``tensor``), or per row of A and column of B (``row``).
SCALE_KINDS: tuple[str, ...] = ("tensor", "row")
# The OCP formats, which NVIDIA's and Intel's kernels take, are the default; the fnuz ones are AMD's.
_DEFAULT_INPUTS = ("float8_e4m3fn", "float8_e5m2")
_OUTPUTS = ("float32", "bfloat16", "float16")
_BIAS = ("float32", "bfloat16")
# A scale is 2**e or a float32 in [2**-_SCALE_EXP, 2**_SCALE_EXP]: wide enough that products
# overflow a float16 or float8 output and underflow into its subnormals.
_SCALE_EXP = 16
# An array draws k in [0, _SPECIAL_STEPS) and holds max(0, k - _SPECIAL_STEPS + 4) specials,
# as strategies.arrays does: none about 5 times in 8, then one, two or three.
_SPECIAL_STEPS = 8


@functools.lru_cache(maxsize=16)
def _all_values(name: str) -> tuple[float, ...]:
    """Every finite value of the float8 format ``name``, each once, in increasing order."""
    bits = np.arange(256, dtype=np.uint8).view(FORMATS[name].dtype).astype(np.float64)
    finite = np.unique(bits[np.isfinite(bits)])
    return tuple(float(v) for v in finite)


def _class_values(fmt: Format, name: str) -> tuple[float, ...]:
    """The values of ``fmt`` in the special class ``name`` (see strategies.SPECIAL_CLASSES)."""
    values = _all_values(fmt.name)
    positive = [v for v in values if v > 0]

    def both(vs: list[float]) -> tuple[float, ...]:
        return tuple(s * v for v in vs for s in (1.0, -1.0))

    if name == "signed_zero":
        return (-0.0,) if fmt.has_negative_zero else ()
    if name == "infinity":
        return (math.inf, -math.inf) if fmt.has_inf else ()
    if name == "nan":
        return (math.nan,)
    if name in ("min_subnormal", "max_subnormal", "min_normal", "max_finite"):
        return both([float(getattr(fmt, name))])
    top = math.ldexp(1.0, fmt.emax)
    if name == "power_of_two":
        return both([v for v in positive if math.frexp(v)[0] == 0.5 and v < top])
    if name == "near_power_of_two":
        # The neighbours of each power of two in the format's own list of values.
        near = {positive[j] for i, v in enumerate(positive) if math.frexp(v)[0] == 0.5
                for j in (i - 1, i + 1) if 0 <= j < len(positive) and math.frexp(positive[j])[0] != 0.5}
        return both(sorted(near))
    if name == "overflow":
        return both([v for v in positive if v >= top])
    raise AssertionError(name)  # pragma: no cover - guarded by check_classes


@functools.lru_cache(maxsize=256)
def _special(name: str, classes: tuple[str, ...]) -> st.SearchStrategy[float] | None:
    """One special value: a class first (each as likely as the others), then a value of it."""
    fmt = FORMATS[name]
    options = [values for values in (_class_values(fmt, c) for c in classes) if values]
    if not options:
        return None
    return ints(0, len(options) - 1).flatmap(lambda k: st.sampled_from(options[k]))


@functools.lru_cache(maxsize=64)
def _plain(name: str, max_abs: float | None) -> st.SearchStrategy[float]:
    top = FORMATS[name].max_finite if max_abs is None else min(max_abs, FORMATS[name].max_finite)
    return st.floats(min_value=-top, max_value=top, allow_nan=False, allow_infinity=False)


@st.composite
def _float8_array(draw: st.DrawFn, name: str, shape: tuple[int, ...], classes: tuple[str, ...],
                  max_abs: float | None = None) -> np.ndarray:
    import exactref as er

    plain = _plain(name, max_abs)
    values = draw(hnp.arrays(np.float64, shape, elements=plain, fill=plain))
    # Rounded once, correctly (within the finite range nothing overflows); then +0 for -0, as plain
    # values never carry the sign of zero (-0 is a special class of its own): a tiny negative
    # value rounds to -0.
    values = er.asarray(values, name).astype(np.float64) + 0.0
    special = _special(name, classes)
    size = values.size
    if special is not None and size:
        k = draw(ints(0, _SPECIAL_STEPS - 1))
        flat = values.reshape(-1)
        for _ in range(min(size, max(0, k - (_SPECIAL_STEPS - 4)))):
            flat[draw(ints(0, size - 1))] = draw(special)
    # Every value is one of the format's already: nothing changes but the dtype.
    return er.asarray(values, name)


def float8_arrays(*, dtype: Any, shape: tuple[int, ...], specials: Any = True,
                  max_abs: float | None = None) -> st.SearchStrategy[np.ndarray]:
    """Draw a numpy array (ml_dtypes) of the float8 format ``dtype`` and of ``shape``.

    Plain elements are floats in the format's finite range (up to
    ``max_abs``) rounded to it; up to three elements are special values of
    the switched-on classes (the names of :data:`strategies.SPECIAL_CLASSES`;
    a class the format lacks, such as float8_e4m3fn's infinities, draws
    nothing; special values ignore ``max_abs``).

    >>> import numpy as np
    >>> from hypothesis import find
    >>> a = find(float8_arrays(dtype="float8_e4m3fn", shape=(2,), specials=["max_finite"]),
    ...          lambda a: (a.astype(np.float64) == 448).any())
    >>> a.dtype.name, a.astype(np.float64).tolist()
    ('float8_e4m3fn', [448.0, 0.0])
    """
    fmt = check_dtypes("dtype", dtype, allowed=FLOAT8_INPUTS, op="float8_arrays")
    if len(fmt) != 1:
        raise ValueError(f"dtype={dtype!r} must be one float8 format, such as dtype='float8_e4m3fn'")
    if not isinstance(shape, tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TypeError(f"shape={shape!r} must be a tuple of non-negative ints, such as shape=(2, 3)")
    classes = check_classes("specials", specials, SPECIAL_CLASSES)
    return _float8_array(fmt[0].name, shape, classes, check_positive_float("max_abs", max_abs, allow_none=True))


def _scale_value() -> st.SearchStrategy[float]:
    """A positive float32 scale: a power of two (shrinking to 1) or any float32 in the range."""
    power = ints(-_SCALE_EXP, _SCALE_EXP).map(lambda e: math.ldexp(1.0, e))
    other = st.floats(min_value=math.ldexp(1.0, -_SCALE_EXP), max_value=math.ldexp(1.0, _SCALE_EXP), width=32)
    return coin().flatmap(lambda any_float: other if any_float else power)


@functools.lru_cache(maxsize=64)
def _scales(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    value = _scale_value()
    return hnp.arrays(np.float32, shape, elements=value, fill=value)


class _Options:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@st.composite
def _scaled_matmul(draw: st.DrawFn, o: _Options) -> OpCase:
    fmt = draw(choice(o.dtypes))
    M, K, N = (draw(ints(1, o.max_side)) for _ in range(3))
    A = draw(_float8_array(fmt, (M, K), o.specials))
    B = draw(_float8_array(fmt, (K, N), o.specials))
    kind = draw(choice(o.scales))
    shape_a, shape_b = ((), ()) if kind == "tensor" else ((M, 1), (1, N))
    scale_a, scale_b = draw(_scales(shape_a)), draw(_scales(shape_b))
    bias = None
    if o.bias and draw(coin()):
        bias = draw(arrays(dtype=draw(choice(o.bias_dtypes)), shape=(N,), specials=o.bias_specials,
                           max_abs=o.bias_max_abs))
    outs = o.out_dtypes if o.out_dtypes is not None else (*_OUTPUTS, fmt)
    kwargs = {"bias": bias, "out_dtype": draw(choice(outs)),
              "use_fast_accum": draw(coin()) if o.use_fast_accum is None else o.use_fast_accum}
    inputs = {"A": A, "B": B, "scale_a": scale_a, "scale_b": scale_b}
    return finish(OpCase("scaled_matmul", inputs, kwargs, None), o.device)


def scaled_matmul_inputs(*, dtypes: Any = None, max_side: int = 4, scales: Any = True, bias: bool = True,
                         bias_dtypes: Any = None, out_dtypes: Any = None, use_fast_accum: bool | None = None,
                         specials: Any = True, bias_specials: Any = None,
                         device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``scaled_matmul(A, B, scale_a, scale_b, *, bias, out_dtype, use_fast_accum)``.

    A (M, K) and B (K, N) are float8 arrays of one of ``dtypes``
    (float8_e4m3fn and float8_e5m2 by default; the fnuz formats on request)
    with sides up to ``max_side``, drawn by :func:`float8_arrays` with
    ``specials``.  ``scales`` picks the kinds of scaling drawn: ``"tensor"``
    (a 0-d float32 each) and ``"row"`` (float32 of shapes (M, 1) and (1, N));
    a scale is a positive power of two or any float32 between 2**-16 and
    2**16.  With ``bias`` a float32 or bfloat16 bias of shape (N,) is drawn
    about half the time (``bias_dtypes`` to choose; its special values are
    ``bias_specials``' classes, by default those of ``specials``).
    ``out_dtype`` is a format name, drawn from ``out_dtypes`` (by default
    float32, bfloat16, float16 and the input's own format): exactref's ops
    take it as it is, and the plugin and ``exactref audit`` call a torch
    kernel with the torch dtype (``getattr(torch, case.out_dtype)``).
    ``use_fast_accum`` is drawn unless given.  The case has no grad:
    scaled_matmul has no backward.

    >>> from hypothesis import find
    >>> case = find(scaled_matmul_inputs(scales="row"), lambda c: c.A.shape == (2, 3))
    >>> case.A.dtype.name, case.B.shape, case.scale_a.shape, case.scale_b.shape, case.out_dtype
    ('float8_e4m3fn', (3, 1), (2, 1), (1, 1), 'float32')
    """
    names = tuple(f.name for f in check_dtypes("dtypes", dtypes, default=_DEFAULT_INPUTS, allowed=FLOAT8_INPUTS,
                                               op="scaled_matmul"))
    max_side = check_int("max_side", max_side, min_value=1, max_value=1024)
    kinds = check_classes("scales", scales, SCALE_KINDS)
    if not kinds:
        raise ValueError(f"scales={scales!r} switches every kind off; pass True or names from: "
                         f"{', '.join(SCALE_KINDS)}")
    bias = check_bool("bias", bias)
    bias_names = tuple(f.name for f in check_dtypes("bias_dtypes", bias_dtypes, default=_BIAS,
                                                    allowed=(*_BIAS, "float16"), op="scaled_matmul's bias"))
    if out_dtypes is not None:
        out_dtypes = tuple(f.name for f in check_dtypes("out_dtypes", out_dtypes, allowed=(*_OUTPUTS, *FLOAT8_INPUTS),
                                                        op="scaled_matmul's out_dtype"))
    if use_fast_accum is not None:
        use_fast_accum = check_bool("use_fast_accum", use_fast_accum)
    classes = check_classes("specials", specials, SPECIAL_CLASSES)
    bias_classes = classes if bias_specials is None else check_classes("bias_specials", bias_specials, SPECIAL_CLASSES)
    o = _Options(dtypes=names, max_side=max_side, scales=kinds, bias=bias, bias_dtypes=bias_names,
                 out_dtypes=out_dtypes, use_fast_accum=use_fast_accum, specials=classes,
                 # A bias of float8 products' size: larger ones would hide the product's rounding.
                 bias_specials=bias_classes, bias_max_abs=2.0 ** 20, device=check_device("device", device))
    return _scaled_matmul(o)
