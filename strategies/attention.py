"""Per-op input sets for scaled_dot_product_attention."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.formats import part_of

from ._common import Options, finish, index_of, patch_kinds, read_options, source_index
from ._draws import choice, coin, ints
from ._validation import check_bool, check_classes, check_dtypes, check_int, check_size
from .case import OpCase
from .dtypes import REAL_FORMATS
from .hard import HardCase
from .shapes import batch_side, draw_broadcastable_to
from .values import _elements, _weighted, after_plain

__all__ = ["ATTENTION_HARD_CLASSES", "MASK_KINDS", "scaled_dot_product_attention_inputs"]

#: The hard-case classes of attention:
#:
#: - ``masked_row``: a row of attn_mask that masks every key (False, or -inf
#:   everywhere), which PyTorch's math path turns into zeros, not NaN;
#: - ``large_scores``: a query and a key whose scaled score exceeds the log of
#:   the format's largest finite value, so exp overflows unless the row
#:   maximum is subtracted first.
ATTENTION_HARD_CLASSES: tuple[str, ...] = ("masked_row", "large_scores")
#: The kinds of attn_mask: a bool mask (True attends) or a float mask added to the scores.
MASK_KINDS: tuple[str, ...] = ("bool", "float")

_SCALES = (1.0, 0.5, 0.125)


@functools.lru_cache(maxsize=1024)
def _mask_shape(draw: st.DrawFn, attn_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``attn_shape``, (..., L, S), with at least its two last dims: PyTorch
    rejects a mask of fewer ("Dimension specified as -2 but tensor has no dimensions")."""
    shape = draw_broadcastable_to(draw, attn_shape)
    return (1,) * max(0, 2 - len(shape)) + shape


def _mask_strategy(kind: str, fmt: Any, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    if kind == "bool":
        # Shrink toward True: a mask that lets everything through is the simple one.
        attend = st.booleans().map(operator.not_)
        return hnp.arrays(np.bool_, shape, elements=attend, fill=st.just(True))
    plain = _elements(fmt, (), 4.0)
    masked = after_plain(plain, st.just(-math.inf))
    return hnp.arrays(np.dtype(fmt.dtype), shape, elements=_weighted(plain, masked),
                      fill=st.just(0.0))


@functools.lru_cache(maxsize=1)
def _scales() -> st.SearchStrategy[float | None]:
    return st.one_of(st.none(), st.sampled_from(_SCALES), st.floats(min_value=1 / 16, max_value=4.0))


@st.composite
def _attention(draw: st.DrawFn, o: Options, batches: st.SearchStrategy[Any], masks: tuple[str, ...],
               causal: bool, gqa: bool, scale: bool) -> OpCase:
    fmt = draw(choice(o.dtypes))
    side = ints(1, o.max_side)
    L, S, E, Ev = draw(side), draw(side), draw(side), draw(side)
    batch = draw(batches)
    qb, kb = batch.input_shapes
    use_gqa = gqa and draw(coin())
    if use_gqa:
        H, groups = draw(side), draw(side)
        q_shape, k_shape, v_shape = qb + (H * groups, L, E), kb + (H, S, E), kb + (H, S, Ev)
        heads: tuple[int, ...] = (H * groups,)
    else:
        groups = 1
        q_shape, k_shape, v_shape = qb + (L, E), kb + (S, E), kb + (S, Ev)
        heads = ()
    query = draw(o.array(fmt, q_shape))
    key = draw(o.array(fmt, k_shape))
    value = draw(o.array(fmt, v_shape))
    out_batch = batch.result_shape + heads
    attn_shape = out_batch + (L, S)
    mask_kind = draw(choice((None, *masks)))
    mask = draw(_mask_strategy(mask_kind, fmt, _mask_shape(draw, attn_shape))) if mask_kind else None
    is_causal = mask is None and causal and draw(coin())
    factor = draw(_scales()) if scale else None
    # Hard cases are drawn last, so that the shrinker can drop them cleanly.
    grad = draw(o.array(fmt, out_batch + (L, Ev)))
    hard: list[HardCase] = []
    kinds = tuple(k for k in o.hard if k != "masked_row" or mask is not None)
    # Mask rows that a large score let through, and rows masked whole: neither
    # patch may undo the other.
    opened: set[tuple[int, ...]] = set()
    masked: set[tuple[int, ...]] = set()
    for kind in patch_kinds(draw, int(np.prod(out_batch + (L,), dtype=np.int64)), kinds):
        if kind == "large_scores":
            row = index_of(draw, out_batch + (L,))
            s = draw(ints(0, min(row[-1], S - 1) if is_causal else S - 1))
            if mask is not None:
                mask_row = source_index(row, mask.shape[:-1])
                if mask_row in masked:
                    continue
                opened.add(mask_row)
            _large_score(fmt, query, key, mask, row, s, len(heads) > 0, groups, factor)
            hard.append(HardCase(row + (s,), ("large_scores",)))
        else:
            row = index_of(draw, mask.shape[:-1])
            if row in opened:
                continue
            mask[row] = False if mask.dtype == np.bool_ else -math.inf
            masked.add(row)
            hard.append(HardCase(row, ("masked_row",)))
    kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": is_causal, "scale": factor,
              "enable_gqa": use_gqa}
    return finish(OpCase("scaled_dot_product_attention", {"query": query, "key": key, "value": value},
                         kwargs, grad, tuple(hard)), o.device)


def _large_score(fmt: Any, query: np.ndarray, key: np.ndarray, mask: np.ndarray | None,
                 row: tuple[int, ...], s: int, has_heads: bool, groups: int, factor: float | None) -> None:
    """Make query row ``row`` and key ``s`` score above log(max_finite), and let the mask through."""
    E = query.shape[-1]
    effective = factor if factor is not None else 1 / math.sqrt(E)
    threshold = math.log(part_of(fmt).max_finite) + 1
    c = 2.0 ** math.ceil(math.log2(math.sqrt(threshold / abs(effective))))
    *out_b, l = row
    if has_heads:
        *ob, h = out_b
        q_idx = source_index(tuple(ob), query.shape[:-3]) + (h, l)
        k_idx = source_index(tuple(ob), key.shape[:-3]) + (h // groups, s)
    else:
        q_idx = source_index(tuple(out_b), query.shape[:-2]) + (l,)
        k_idx = source_index(tuple(out_b), key.shape[:-2]) + (s,)
    query[q_idx] = 0
    key[k_idx] = 0
    query[q_idx + (0,)] = c
    key[k_idx + (0,)] = math.copysign(c, effective)
    if mask is not None:
        mask[source_index(tuple(out_b) + (l, s), mask.shape)] = True if mask.dtype == np.bool_ else 0.0


def scaled_dot_product_attention_inputs(
        *, dtypes: Any = None, max_batch_dims: int = 2, max_side: int = 4,
        max_batch_side: int | None = None, masks: Any = True,
        causal: bool = True, gqa: bool = True, scale: bool = True, specials: Any = True, hard: Any = True,
        max_abs: float | None = 4.0, device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``scaled_dot_product_attention(query, key, value, ...)``.

    query is ``(..., Hq, L, E)``, key ``(..., H, S, E)`` and value
    ``(..., H, S, Ev)`` with broadcasting batch dims; without GQA the head
    dim is one of the batch dims.  Each of L, S, E, Ev, H and the GQA group
    size is up to ``max_side``, drawn independently, so L != S is common;
    batch sides are up to ``max_batch_side`` (by default ``max_side``, but at
    most 4).

    - ``masks``: True, False or a collection of :data:`MASK_KINDS`; a mask
      broadcasts to ``(..., Hq, L, S)`` and has at least two dims (PyTorch
      rejects fewer).  A float mask holds -inf entries.
    - ``causal``: is_causal may be True (never together with a mask).
    - ``gqa``: enable_gqa may be True, with Hq a multiple of H.
    - ``scale``: scale may be a float (None is the shrink target).
    - ``hard``: :data:`ATTENTION_HARD_CLASSES`; ``case.hard`` gives a masked
      row's index in attn_mask without its last dim, or for large scores the
      output row's index followed by the key's position.

    Inputs are real formats only: PyTorch's softmax has no complex kernel.
    Plain values are bounded by ``max_abs``.  dropout_p is always 0.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(scaled_dot_product_attention_inputs(dtypes=["float16"], masks=["bool"]))
    ... def test_heads(case):
    ...     if case.enable_gqa:
    ...         assert case.query.shape[-3] % case.key.shape[-3] == 0
    ...     assert case.grad.shape[-1] == case.value.shape[-1]
    >>> test_heads()
    """
    fmts = check_dtypes("dtypes", dtypes, allowed=REAL_FORMATS, op="scaled_dot_product_attention")
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=ATTENTION_HARD_CLASSES, max_abs=max_abs, device=device)
    max_batch_dims = check_int("max_batch_dims", max_batch_dims, min_value=0, max_value=16)
    cap = batch_side(o.max_side, max_batch_side)
    gqa = check_bool("gqa", gqa)

    def elements(max_batch_dims: int, max_side: int, max_batch_side: int | None) -> int:
        # query and the mask are (batch..., heads, L, E or S): with GQA, heads are up to max_side ** 2.
        cap = batch_side(max_side, max_batch_side)
        return cap ** max_batch_dims * max_side ** (4 if gqa else 2)
    check_size("scaled_dot_product_attention_inputs",
               {"max_batch_dims": max_batch_dims, "max_side": o.max_side, "max_batch_side": max_batch_side},
               elements)
    batches = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=max_batch_dims, max_side=cap)
    return _attention(o, batches, check_classes("masks", masks, MASK_KINDS),
                      check_bool("causal", causal), gqa, check_bool("scale", scale))

