"""sum: forward, backward, tolerance and normal answer.

``torch.sum`` on the CPU is a cascade sum accumulated in float32 for float16
and bfloat16.  A full reduction of at least ``GRAIN_SIZE`` elements may run on
several threads, each rounding its partial sum to the output dtype before
the partials are added; the tolerance budgets that rounding for half types.

The gradient puts, at every element of x, the gradient of the output it was
summed into: a copy, exact, so its tolerance is zero.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from .. import _fused
from .._convert import Operand, finite_values, operand, values_of
from .._parallel import copy_array, copy_checked, for_each_slice
from ..engine.fast import _FUSED_PARALLEL, Enclosure, long_sums, up
from ..engine.sumprod import RowTerm, Solution, Term
from ..formats import part_of
from ..models._bounds import declared, dot_error, overflow_possible
from ..models._emulate import emulate
from ..models._error_model import DEFAULT, ErrorModel, accumulation_format, check_model
from ..models._orders import tensor_core_of
from ..models._running import RowSource, ordered_error
from ..result import Gradients, Result
from ._common import Op, PartSpec, build, check_bytes, one_part, read_grad, zero_nonfinite

__all__ = ["sum"]

# Working memory per output element (about 24 float64 arrays of the result and its
# temporaries), and what the engine's blocks take at most.
_RESULT_BYTES = 24 * 8
_BLOCK_BYTES = 256 << 20

# at::internal::GRAIN_SIZE: below it a reduction runs on one thread.
GRAIN_SIZE = 32768


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    items = (axis,) if isinstance(axis, (int, np.integer)) else axis
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"sum: axis={axis!r} must be None, an int or a tuple of ints") from None
    if not items:
        # torch.sum(x, dim=()) reduces every dimension (numpy's reduces none).
        return tuple(range(ndim))
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"sum: axis={axis!r} must be None, an int or a tuple of ints")
        if not -max(ndim, 1) <= a < max(ndim, 1):
            raise ValueError(f"sum: axis={axis!r} is out of range for x with {ndim} dimensions")
        out.append(int(a) % max(ndim, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"sum: axis={axis!r} repeats a dimension")
    return tuple(sorted(set(out))) if ndim else ()


def _all_finite(x: np.ndarray) -> bool:
    """Whether every value of x is finite."""
    if x.size and x.dtype in (np.float32, np.float64):
        # A large contiguous x in blocks, side by side (exactref/_parallel.py).
        flat = x.reshape(-1) if x.flags.c_contiguous else None
        if flat is None or flat.size < 2 * _FINITE_BLOCK:
            return finite_values(x)
        ok: list[bool] = []  # appends are atomic: the order does not matter
        for_each_slice(lambda cut: ok.append(finite_values(flat[cut])), flat.size, _FINITE_BLOCK)
        return all(ok)
    return bool(np.isfinite(x).all())


_FINITE_BLOCK = 1 << 20


def _reduce(x: Any, axis: Any, keepdims: bool, copy: bool = True) -> tuple:
    o = operand(x, "x", copy=copy)  # without copy, sum's _own makes the copy
    if o.tier == 0:
        raise TypeError(f"sum: x={x!r} must be an array, not a Python scalar")
    if not isinstance(keepdims, (bool, np.bool_)):
        raise TypeError(f"sum: keepdims={keepdims!r} must be a bool")
    axes = _axes(axis, o.array.ndim)
    keep = [i for i in range(o.array.ndim) if i not in axes]
    out_shape = tuple(1 if i in axes else n for i, n in enumerate(o.shape)) if keepdims else \
        tuple(o.shape[i] for i in keep)
    return o, axes, keep, out_shape


# A full sum of at least this many float32 values is enclosed as it is copied (_own).
_FUSED_SIZE = 1 << 16


def _own(o: Operand, axes: tuple[int, ...]) -> tuple[Operand, Enclosure | None]:
    """The op's own copy of x, read by operand(copy=False) (the Result keeps it, for exact values
    on demand), and, for a long full sum of float32 values, the enclosure of that sum, computed as
    the copy is made.

    The sums of |x| there are float32 sums, made again in float64 where one is not finite (float64
    sums of float32 values cannot overflow): they are inf or NaN exactly where a value is, so they
    tell whether every value is finite.  RowTerm.enclose would compute the same enclosure from
    the copy (fast.long_sums, on the same values in the same layout); a sum with a non-finite
    value is computed as before, without it.
    """
    arr = o.array
    if arr.dtype == np.float32 and len(axes) == arr.ndim and arr.flags.c_contiguous and arr.size >= _FUSED_SIZE:
        mine = np.empty_like(arr)
        enc = long_sums(arr.reshape(-1), True, out=mine.reshape(-1))
        finite = bool(np.isfinite(enc.S))
        return replace(o, array=mine, finite=finite), enc if finite else None
    if arr.dtype in (np.float32, np.float64):
        # Whether every value is finite comes with the copy, each block checked while in cache.
        mine, finite = copy_checked(arr, finite_values)
    else:
        mine, finite = copy_array(arr), None
    return replace(o, array=mine, finite=finite), None


def sum(x: Any, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False,  # noqa: A001
        model: ErrorModel = DEFAULT) -> Result:
    """The exact sum of ``x`` over ``axis`` (all axes by default), rounded once.

    As in ``torch.sum``, ``axis=()`` sums over every axis too (numpy's sums over none).

    >>> import exactref as er
    >>> er.sum([[1.0, 2.0], [3.0, 4.0]], axis=0).rounded.tolist()
    [4.0, 6.0]
    """
    model = check_model(model)
    if tensor_core_of(model.order) is not None:
        raise ValueError(f"sum: model={model} has a tensor-core order, which only matmul, gemm and scaled_matmul "
                         "accumulate with; use 'any', 'sequential', 'pairwise' or Blocked(...) with a plain inner order")
    o, axes, keep, out_shape = _reduce(x, axis, keepdims, copy=False)
    out_size = math.prod(out_shape)  # (np.prod of a tuple costs several microseconds)
    # The result's arrays, a float64 (or transposed) copy of x at most, and the engine's blocks.
    check_bytes("sum", out_size * _RESULT_BYTES + o.array.size * 16 + _BLOCK_BYTES, "x")
    o, known = _own(o, axes)
    fmt = o.fmt
    pfmt = part_of(fmt)
    narrow = 2 * pfmt.p <= 53
    # Narrow real values are read as float32 (exact), half the memory of float64:
    # the engine widens only the blocks it works on.
    V = o.array.astype(np.float32, copy=False) if narrow and not fmt.is_complex else values_of(o, fmt)
    length = math.prod(o.shape[i] for i in axes)
    moved = np.transpose(V, keep + list(axes)).reshape(tuple(o.shape[i] for i in keep) + (length,))
    n = moved.shape[-1]
    values = [moved.real, moved.imag] if fmt.is_complex else [moved]

    all_finite = o.finite if o.finite is not None else _all_finite(moved)

    def terms(finite: bool) -> list[list[Term]]:
        return [[RowTerm(1.0, zero_nonfinite(v) if finite and not all_finite else v, None, narrow,
                         known=known if finite else None)] for v in values]

    special = None if all_finite else terms(False)
    acc = accumulation_format(model, pfmt)
    threaded = pfmt.p < acc.p and o.array.size >= GRAIN_SIZE

    def bound(S: Any) -> tuple[Any, Any]:
        # (Elementwise in S, an array or a float: see one_part below.)
        E = dot_error(S, depth=n - 1, acc=acc, out=pfmt)
        if threaded:
            # A thread's partial sum is rounded to the output format, then the partials are added.
            # Partial sums of pfmt values are multiples of its smallest subnormal, and so is every
            # subnormal of pfmt: that rounding never underflows, so it costs u * |partial| alone.
            E = up(E + pfmt.unit_roundoff * (S + E) * 2)
        return E, overflow_possible(S, acc, n)

    def tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        return bound(sol.S)

    # The terms of the finite values, for a declared order's bound and its emulated kernel.
    source = None
    if declared(model) and not fmt.is_complex:
        source = RowSource(zero_nonfinite(moved).astype(np.float64, copy=False))

    def ordered_tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        E, partial_max = ordered_error(source, model.order, acc=acc, S=sol.S,
                                       products_rounded=False, final_is_root=acc == pfmt,
                                       failure_rate=model.failure_rate)
        # The bound for any order holds for this one too: at small sizes it can be the tighter.
        E = np.minimum(E, dot_error(sol.S, depth=n - 1, acc=acc, out=pfmt))
        return E, partial_max >= acc.max_finite

    chosen = tol if source is None else ordered_tol
    # The bound for any order is elementwise in S: a large output is judged block by block.
    specs = [PartSpec(t, special[p] if special else None, chosen, source is None and not fmt.is_complex)
             for p, t in enumerate(terms(True))]

    def backward(grad: Any) -> Gradients:
        return _backward(o, axes, out_shape, grad, model)

    def typical(index: tuple[int, ...]) -> float:
        return emulate(source.terms_at(index), model.order, acc, pfmt, False)

    # A long full sum of float32 values: its one value decided and judged from the enclosure made
    # as x was copied, on Python floats, where that covers it (the same values: _common.one_part).
    one = one_part(known, pfmt, bound) if known is not None and source is None else None
    return build("sum", fmt, moved.shape[:-1], specs, model, out_shape=out_shape, backward=backward,
                 typical=None if source is None else typical, judged=None if one is None else [one])


def _backward(o: Any, axes: tuple[int, ...], out_shape: tuple[int, ...], grad: Any, model: ErrorModel) -> Gradients:
    fmt = o.fmt
    G = read_grad(grad, fmt, out_shape, "sum")
    expanded = np.broadcast_to(np.expand_dims(G, axes) if len(out_shape) < o.array.ndim else G, o.shape)
    narrow = 2 * part_of(fmt).p <= 53
    values = [expanded.real, expanded.imag] if fmt.is_complex else [expanded]

    def terms(finite: bool) -> list[list[Term]]:
        return [[RowTerm(1.0, (zero_nonfinite(v) if finite else v)[..., None], None, narrow)] for v in values]

    special = None if np.isfinite(expanded).all() else terms(False)

    def tol(sol: Solution) -> tuple[np.ndarray, None]:
        return np.zeros(sol.S.shape), None

    specs = [PartSpec(t, special[p] if special else None, tol) for p, t in enumerate(terms(True))]
    res = build("sum.backward grad_x", fmt, tuple(o.shape), specs, model)
    return Gradients("sum.backward", {"grad_x": res})


def _sum_backward(x: Any, grad: Any, *, axis: Any = None, keepdims: bool = False,
                  model: ErrorModel = DEFAULT) -> Gradients:
    model = check_model(model)
    if tensor_core_of(model.order) is not None:
        raise ValueError(f"sum: model={model} has a tensor-core order, which only matmul, gemm and scaled_matmul "
                         "accumulate with; use 'any', 'sequential', 'pairwise' or Blocked(...) with a plain inner order")
    o, axes, keep, out_shape = _reduce(x, axis, keepdims)
    return _backward(o, axes, out_shape, grad, model)


def _needs_limit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of sum takes the BLAS limit (ops._common.Op): not a full sum of a C-contiguous
    float32 array whose enclosure is one call of the compiled loop on this thread (_own, below
    fast's _FUSED_PARALLEL), and no BLAS product.  (For 10**6 values, right after torch.sum: 281 and
    296 us against 320 and 332, medians of 101; the limit and its release are two calls into
    threadpoolctl and two into malloc's settings.)"""
    x = args[0] if args else kwargs.get("x")
    axis = kwargs.get("axis")
    every = axis is None or (type(axis) is tuple and not axis) or (
        type(x) is np.ndarray and x.ndim == 1 and type(axis) is int and axis in (0, -1))
    one_call = (type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous and every
                and _FUSED_SIZE <= x.size < _FUSED_PARALLEL and _fused.available())
    return not one_call


sum = Op("sum", sum, _sum_backward, needs_limit=_needs_limit)  # noqa: A001
