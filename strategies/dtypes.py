"""Format (dtype) strategies."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from exactref.formats import FORMATS, ComplexFormat, Format

from ._validation import check_bool, check_dtypes

__all__ = ["REAL_FORMATS", "formats"]

#: Names of the real formats, in the order strategies prefer them when shrinking.
REAL_FORMATS: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if not f.is_complex)


def formats(*, dtypes: Any = None, allow_complex: bool = True) -> st.SearchStrategy[Format | ComplexFormat]:
    """Draw an exactref format from ``dtypes`` (every format by default).

    ``dtypes`` is one dtype or a collection of them: names, numpy or torch
    dtypes, or exactref formats.  Examples shrink toward the first one
    listed.  With ``allow_complex=False`` only real formats are drawn.

    >>> from hypothesis import find
    >>> find(formats(dtypes=["bfloat16", "float16"]), lambda f: True).name
    'bfloat16'
    >>> find(formats(allow_complex=False), lambda f: f.p < 11).name
    'bfloat16'
    """
    allow_complex = check_bool("allow_complex", allow_complex)
    allowed = tuple(FORMATS) if allow_complex else REAL_FORMATS
    chosen = check_dtypes("dtypes", dtypes, allowed=allowed,
                          op=None if allow_complex else "allow_complex=False")
    return st.sampled_from(chosen)
