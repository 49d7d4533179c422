"""Format (dtype) strategies."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from exactref.formats import FLOAT8_FORMATS, FORMATS, ComplexFormat, Format

from ._validation import OP_FORMATS, check_bool, check_dtypes

__all__ = ["FLOAT8", "REAL_FORMATS", "formats"]

#: Names of the real formats, in the order strategies prefer them when shrinking (float8 aside).
REAL_FORMATS: tuple[str, ...] = tuple(n for n in OP_FORMATS if not FORMATS[n].is_complex)
#: Names of the float8 formats, which :func:`formats` draws only when asked for by name.
FLOAT8: tuple[str, ...] = tuple(FLOAT8_FORMATS)


def formats(*, dtypes: Any = None, allow_complex: bool = True) -> st.SearchStrategy[Format | ComplexFormat]:
    """Draw an exactref format from ``dtypes`` (every format but float8 by default).

    ``dtypes`` is one dtype or a collection of them: names, numpy or torch
    dtypes, or exactref formats.  Examples shrink toward the first one
    listed.  With ``allow_complex=False`` only real formats are drawn.  The
    float8 formats (:data:`FLOAT8`) are drawn only when ``dtypes`` names them.

    >>> from hypothesis import find
    >>> find(formats(dtypes=["bfloat16", "float16"]), lambda f: True).name
    'bfloat16'
    >>> find(formats(allow_complex=False), lambda f: f.p < 11).name
    'bfloat16'
    >>> find(formats(dtypes=FLOAT8), lambda f: not f.has_inf).name
    'float8_e4m3fn'
    """
    allow_complex = check_bool("allow_complex", allow_complex)
    allowed = (tuple(FORMATS) if allow_complex else REAL_FORMATS + FLOAT8)
    default = OP_FORMATS if allow_complex else REAL_FORMATS
    chosen = check_dtypes("dtypes", dtypes, allowed=allowed, default=default,
                          op=None if allow_complex else "allow_complex=False")
    return st.sampled_from(chosen)
