"""Per-op input sets for add, multiply and sum."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from exactref.formats import part_of

from ._common import (
    Options,
    Patcher,
    check_max_dims,
    coefficients,
    finish,
    in_part,
    index_of,
    patch_kinds,
    positions,
    power_of_two,
    read_options,
    source_index,
)
from ._draws import choice, coin
from ._validation import check_bool, check_coefficient, check_dtypes, check_size
from .case import OpCase
from .hard import HARD_CLASSES, HardCase, complex_cancellation, draw_plan, draw_product_plan

__all__ = ["add_inputs", "multiply_inputs", "sum_inputs"]

_PARTS = ("real", "imag")


def _operands(draw: st.DrawFn, o: Options, fmt: Any, pairs: st.SearchStrategy[Any], scalars: bool
              ) -> tuple[Any, Any, tuple[int, ...]]:
    shapes = draw(pairs)
    which = draw(choice((None, "x", "y"))) if scalars else None
    x = draw(o.scalar(fmt)) if which == "x" else draw(o.array(fmt, shapes.input_shapes[0]))
    y = draw(o.scalar(fmt)) if which == "y" else draw(o.array(fmt, shapes.input_shapes[1]))
    out = np.broadcast_shapes(np.shape(x), np.shape(y))
    return x, y, out


@st.composite
def _add(draw: st.DrawFn, o: Options, pairs: st.SearchStrategy[Any], scalars: bool, alpha: Any) -> OpCase:
    fmt = draw(choice(o.dtypes))
    x, y, out = _operands(draw, o, fmt, pairs, scalars)
    a = draw(coefficients(fmt)) if alpha is None else alpha
    # The output gradient is drawn before the hard cases, whose draws come
    # last so that the shrinker can drop them without disturbing the rest.
    grad = draw(o.array(fmt, out))
    hard: list[HardCase] = []
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and power_of_two(a):
        patcher = Patcher({"x": x, "y": y})
        for kind in patch_kinds(draw, int(np.prod(out, dtype=np.int64)), o.hard):
            idx = index_of(draw, out)
            plan = draw_plan(draw, part_of(fmt), kind, 2, products=False)
            if plan is None:
                continue
            part = draw(choice(_PARTS)) if fmt.is_complex else None
            terms = [u for u, _ in plan.pairs] + [0.0] * (2 - len(plan.pairs))
            if draw(coin()):
                terms.reverse()
            ix, iy = source_index(idx, x.shape), source_index(idx, y.shape)
            # alpha * y must be the second term; alpha is a power of two, so this is exact.
            writes = [("x", ix, in_part(terms[0], fmt, part)),
                      ("y", iy, in_part(terms[1] / a.real if isinstance(a, complex) else terms[1] / a,
                                        fmt, part))]
            if patcher.apply(writes):
                hard.append(HardCase(idx, plan.kinds, part))
    return finish(OpCase("add", {"x": x, "y": y}, {"alpha": a}, grad, tuple(hard)), o.device)


def add_inputs(*, dtypes: Any = None, max_dims: int = 3, max_side: int = 4, specials: Any = True,
               hard: Any = True, scalars: bool = False, alpha: float | complex | None = None,
               max_abs: float | None = None, device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``add(x, y, *, alpha)``: x + alpha * y, broadcasting.

    Shapes have up to ``max_dims`` dims of up to ``max_side``.  With
    ``scalars`` one operand may be a Python scalar (finite; it gets no
    gradient).
    ``alpha`` is drawn (shrinking to 1) unless given.  ``hard`` places ties,
    near ties and cancellations at some output elements; they are listed in
    ``case.hard``.

    >>> import numpy as np
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(add_inputs(dtypes=["float16"], scalars=True))
    ... def test_shapes(case):
    ...     assert case.grad.shape == np.broadcast_shapes(np.shape(case.x), np.shape(case.y))
    >>> test_shapes()
    """
    fmts = check_dtypes("dtypes", dtypes)
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=HARD_CLASSES, max_abs=max_abs, device=device)
    return _add(o, _pairs(_max_dims("add_inputs", max_dims, o.max_side), o.max_side), check_bool("scalars", scalars),
                check_coefficient("alpha", alpha, tuple(f.name for f in fmts)))


_ROTATIONS = {"real": ((1, 1), (1j, 1j)), "imag": ((1j, 1), (1, 1j))}


@st.composite
def _multiply(draw: st.DrawFn, o: Options, pairs: st.SearchStrategy[Any], scalars: bool) -> OpCase:
    fmt = draw(choice(o.dtypes))
    x, y, out = _operands(draw, o, fmt, pairs, scalars)
    grad = draw(o.array(fmt, out))
    hard: list[HardCase] = []
    kinds = o.hard if fmt.is_complex else tuple(k for k in o.hard if k != "cancellation")
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and kinds:
        patcher = Patcher({"x": x, "y": y})
        for kind in patch_kinds(draw, int(np.prod(out, dtype=np.int64)), kinds):
            idx = index_of(draw, out)
            part = draw(choice(_PARTS)) if fmt.is_complex else None
            if kind == "cancellation":
                u, v = complex_cancellation(draw, part_of(fmt), part)
            else:
                plan = draw_product_plan(draw, part_of(fmt), kind)
                if plan is None:
                    continue
                u, v = plan.pairs[0]
                if fmt.is_complex:
                    # i*i = -1 moves the product to the other part or flips its sign.
                    ru, rv = draw(choice(_ROTATIONS[part]))
                    u, v = u * ru, v * rv
            writes = [("x", source_index(idx, x.shape), u), ("y", source_index(idx, y.shape), v)]
            if patcher.apply(writes):
                hard.append(HardCase(idx, (kind,), part))
    return finish(OpCase("multiply", {"x": x, "y": y}, {}, grad, tuple(hard)), o.device)


def multiply_inputs(*, dtypes: Any = None, max_dims: int = 3, max_side: int = 4, specials: Any = True,
                    hard: Any = True, scalars: bool = False, max_abs: float | None = None,
                    device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``multiply(x, y)``, broadcasting.

    Hard cases are products that are ties or near ties (the significands'
    product is solved for its dropped bits), and, for complex formats,
    cancellations in one part; a real product cannot cancel.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(multiply_inputs(dtypes=["bfloat16"], specials=False))
    ... def test_hard_cases_are_products(case):
    ...     assert all(h.kinds in (("tie",), ("near_tie",)) for h in case.hard)
    >>> test_hard_cases_are_products()
    """
    fmts = check_dtypes("dtypes", dtypes)
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=HARD_CLASSES, max_abs=max_abs, device=device)
    return _multiply(o, _pairs(_max_dims("multiply_inputs", max_dims, o.max_side), o.max_side),
                     check_bool("scalars", scalars))


def _max_dims(strategy: str, max_dims: Any, max_side: int) -> int:
    """The checked max_dims, with max_side ** max_dims (the largest drawable array) within the limit."""
    max_dims = check_max_dims("max_dims", max_dims)
    check_size(strategy, {"max_dims": max_dims, "max_side": max_side}, _elements)
    return max_dims


def _elements(max_dims: int, max_side: int) -> int:
    return max_side ** max_dims


def _pairs(max_dims: int, max_side: int) -> st.SearchStrategy[Any]:
    return hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=max_dims, max_side=max_side)


@functools.lru_cache(maxsize=64)
def _axis_strategy(ndim: int) -> st.SearchStrategy[Any]:
    n = max(ndim, 1)
    return st.one_of(st.none(), st.integers(-n, n - 1),
                     st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(tuple))


def _reduced_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    items = (axis,) if isinstance(axis, int) else axis
    return tuple(sorted({a % ndim for a in items})) if ndim else ()


@st.composite
def _sum(draw: st.DrawFn, o: Options, shapes: st.SearchStrategy[tuple[int, ...]]) -> OpCase:
    fmt = draw(choice(o.dtypes))
    shape = draw(shapes)
    x = draw(o.array(fmt, shape))
    axis = draw(_axis_strategy(len(shape)))
    keepdims = draw(coin())
    axes = _reduced_axes(axis, len(shape))
    kept = [i for i in range(len(shape)) if i not in axes]
    out = tuple(1 if i in axes else n for i, n in enumerate(shape)) if keepdims else \
        tuple(shape[i] for i in kept)
    grad = draw(o.array(fmt, out))
    hard: list[HardCase] = []
    slots = int(np.prod([shape[i] for i in axes], dtype=np.int64))
    if slots >= 2:
        patcher = Patcher({"x": x})
        for kind in patch_kinds(draw, int(np.prod(out, dtype=np.int64)), o.hard):
            idx = index_of(draw, out)
            plan = draw_plan(draw, part_of(fmt), kind, slots, products=False,
                             cancellation="cancellation" in o.hard)
            if plan is None:
                continue
            part = draw(choice(_PARTS)) if fmt.is_complex else None
            fixed = {a: idx[a] if keepdims else idx[kept.index(a)] for a in kept}
            cells = [tuple(fixed[a] if a in fixed else r[axes.index(a)] for a in range(len(shape)))
                     for r in itertools.product(*(range(shape[a]) for a in axes))]
            where = positions(draw, slots, len(plan.pairs))
            values = [0.0] * slots
            for k, (t, _) in zip(where, plan.pairs):
                values[k] = t
            if patcher.apply([("x", c, in_part(v, fmt, part)) for c, v in zip(cells, values)]):
                hard.append(HardCase(idx, plan.kinds, part))
    return finish(OpCase("sum", {"x": x}, {"axis": axis, "keepdims": keepdims}, grad, tuple(hard)),
                  o.device)


def sum_inputs(*, dtypes: Any = None, max_dims: int = 3, max_side: int = 4, specials: Any = True,
               hard: Any = True, max_abs: float | None = None, device: Any = None) -> st.SearchStrategy[OpCase]:
    """Draw inputs for ``sum(x, *, axis, keepdims)``.

    ``axis`` is None (shrink target), an int (maybe negative) or a tuple of
    distinct axes; ``keepdims`` shrinks to False.  Hard cases fill one
    reduced slice with terms whose exact sum is a tie, a near tie or a
    cancellation, in a drawn order.

    A 0-d ``x`` may come with ``axis=0`` or ``(0,)``, which torch.sum takes
    (and numpy's does not):

    >>> import exactref as er
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20)
    ... @given(sum_inputs(dtypes=["float32"]))
    ... def test_grad_shape(case):
    ...     res = er.sum(case.x, axis=case.axis, keepdims=case.keepdims)
    ...     assert case.grad.shape == res.rounded.shape
    >>> test_grad_shape()
    """
    fmts = check_dtypes("dtypes", dtypes)
    o = read_options(dtypes=fmts, max_side=max_side, specials=specials, hard=hard,
                     hard_classes=HARD_CLASSES, max_abs=max_abs, device=device)
    shapes = hnp.array_shapes(min_dims=0, max_dims=_max_dims("sum_inputs", max_dims, o.max_side), min_side=1,
                              max_side=o.max_side)
    return _sum(o, shapes)

