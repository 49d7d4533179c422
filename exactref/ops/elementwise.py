"""add and multiply: forward, backward, tolerances and normal answers.

Broadcasting, type promotion and Python scalars follow PyTorch.  A Python
scalar keeps its exact value (the rounding PyTorch makes of it to the format
it computes in is budgeted in the tolerance) and gets no gradient.

Gradients: ``grad_x = grad`` and ``grad_y = conj(alpha) grad`` for add,
``grad_x = grad conj(y)`` and ``grad_y = grad conj(x)`` for multiply, each
summed over its operand's broadcast copies; a real operand of a complex
result gets the real part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._convert import Operand, check_promotion, operand, promote, values_of
from ..engine.sumprod import RowTerm, Solution, Term
from ..formats import ComplexFormat, Format, part_of
from ..models._bounds import (
    dot_error,
    overflow_possible,
    partials_error,
    products_exact,
    products_may_underflow,
    scalar_error,
    widening_error,
)
from ..models._error_model import DEFAULT, ErrorModel, accumulation_format, check_model, opmath_format
from ..result import Gradients, Result
from ..rounding import round_float64
from ._coef import held, magnitude, read_coefficient, scalar_relative_error
from ._common import Op, PartSpec, build, check_size, fold_copies, read_grad, zero_nonfinite

__all__ = ["add", "multiply"]


def _read(op: str, x: Any, y: Any, promotion: str = "torch") -> tuple[Operand, Operand, Format | ComplexFormat,
                                                                      tuple[int, ...]]:
    promotion = check_promotion(promotion, op)
    ox, oy = operand(x, "x"), operand(y, "y")
    if ox.tier == 0 and oy.tier == 0:
        raise TypeError(f"{op}: x and y are both Python scalars; at least one must be an array")
    fmt = promote([ox, oy], op, promotion)
    try:
        shape = np.broadcast_shapes(ox.shape, oy.shape)
    except ValueError:
        raise ValueError(f"{op}: x has shape {ox.shape} and y has shape {oy.shape}, "
                         "which do not broadcast") from None
    check_size(op, int(np.prod(shape, dtype=np.int64)) * 4, "the broadcast result")
    return ox, oy, fmt, shape


def _narrow(*ops: Operand) -> bool:
    return all(o.tier != 0 and 2 * part_of(o.fmt).p <= 53 for o in ops)


def _split(v: np.ndarray, complex_: bool) -> list[np.ndarray]:
    """Real and imaginary parts of a value array (the imaginary part of a real one is 0)."""
    if not complex_:
        return [v]
    return [np.real(v), np.imag(v)] if np.iscomplexobj(v) else [v, np.zeros_like(v)]


def _complex_products(xs: list[np.ndarray], ys: list[np.ndarray], p: int, conj_y: bool = False) -> tuple:
    """X, Y stacked along a last axis so that sum(X * Y) is part p of x * y (or x * conj(y))."""
    xr, xi = xs
    yr, yi = ys
    if conj_y:
        yi = -yi
    if p == 0:
        return np.stack([xr, -xi], axis=-1), np.stack([yr, yi], axis=-1)
    return np.stack([xr, xi], axis=-1), np.stack([yi, yr], axis=-1)


def _values(o: Operand, fmt: Format | ComplexFormat, scalar_fmt: Format) -> np.ndarray:
    """Exact values of an operand; a Python scalar too large for ``scalar_fmt`` becomes its infinity there.

    PyTorch converts such a scalar before computing, so it behaves as inf
    (and 0 * it as NaN).  A scalar in range keeps its exact value; the
    rounding of it is budgeted in the tolerance.
    """
    v = values_of(o, fmt)
    if o.tier != 0:
        return v
    parts = _split(v, fmt.is_complex)
    big = [np.where(np.abs(p) > scalar_fmt.max_finite, round_float64(p, scalar_fmt), p) for p in parts]
    if not fmt.is_complex:
        return big[0]
    out = np.empty(v.shape, dtype=np.complex128)
    out.real, out.imag = big
    return out


def _scalar_error(o: Operand, fmt: Format, scale: float | np.ndarray) -> float | np.ndarray:
    """What PyTorch's rounding of a Python scalar or zero-dim operand to ``fmt`` can cost."""
    if o.tier == 2:
        return 0.0
    value = complex(o.array.item()) if o.fmt.is_complex else float(o.array.item())
    return scalar_error(value, fmt) * scale


# ---------------------------------------------------------------------------- add


def add(x: Any, y: Any, *, alpha: float | complex = 1, model: ErrorModel = DEFAULT,
        promotion: str = "torch") -> Result:
    """The exact ``x + alpha * y`` with ``torch.add``'s semantics, rounded once.

    ``promotion="numpy"`` picks the output format by numpy 2's rules instead
    of torch's (a 0-d array counts as an array), to judge numpy code.

    >>> import exactref as er
    >>> er.add([1.0, 2.0], 0.5, alpha=2).rounded.tolist()
    [2.0, 3.0]
    """
    model = check_model(model)
    ox, oy, fmt, shape = _read("add", x, y, promotion)
    alpha = read_coefficient(alpha, "alpha", fmt, "add")
    pfmt = part_of(fmt)
    op_fmt = opmath_format(pfmt)
    # add converts a Python scalar to the tensor's dtype (seen for float16).
    X = np.broadcast_to(_values(ox, fmt, pfmt), shape)
    Y = np.broadcast_to(_values(oy, fmt, pfmt), shape)
    xs, ys = _split(X, fmt.is_complex), _split(Y, fmt.is_complex)
    absY = np.abs(zero_nonfinite(Y))
    narrow = _narrow(ox, oy)

    def terms(z: Callable[[np.ndarray], np.ndarray], coef: float | complex) -> list[list[Term]]:
        cr, ci = (coef.real, coef.imag) if isinstance(coef, complex) else (coef, 0.0)
        out = []
        for p in range(len(xs)):
            t: list[Term] = [RowTerm(1.0, z(xs[p])[..., None], None, narrow)]
            if fmt.is_complex:
                # part p of alpha * y: Re = ar yr - ai yi, Im = ar yi + ai yr
                pair = [(cr, ys[p]), (-ci if p == 0 else ci, ys[1 - p])]
                t += [RowTerm(c, z(v)[..., None], None, narrow) for c, v in pair]
            else:
                t.append(RowTerm(float(coef), z(ys[0])[..., None], None, narrow))
            out.append(t)
        return out

    # add converts alpha to the tensor's format: one that vanishes there makes 0 * inf = NaN.
    special = None if (np.isfinite(X).all() and np.isfinite(Y).all()) else terms(lambda v: v, held(alpha, pfmt))
    exact = terms(zero_nonfinite, alpha)
    depth = 1 + (0 if alpha in (1, -1) else 1) + (1 if isinstance(alpha, complex) and alpha.imag else 0)
    # PyTorch converts alpha to the tensor's own dtype first (seen for float16).
    rel = scalar_relative_error(alpha, pfmt)
    # For half types PyTorch's non-vectorised path rounds alpha * y to the
    # tensor's format before adding (seen for float16 tensors of a few elements).
    scaled_rounding = pfmt != op_fmt and alpha not in (1, -1)
    # ... where alpha * y alone may overflow to inf, whatever x is.
    scaled_overflow = scaled_rounding and magnitude(alpha) * absY * (1 + 4 * pfmt.unit_roundoff) >= pfmt.max_finite

    def tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        E = dot_error(sol.S, depth=depth, acc=op_fmt, out=pfmt, terms=2, underflow=alpha not in (1, -1))
        E = E + rel * sol.S + _scalar_error(ox, pfmt, 1.0) + _scalar_error(oy, pfmt, magnitude(alpha))
        if scaled_rounding:
            E = E + pfmt.unit_roundoff * magnitude(alpha) * absY * 1.01 + pfmt.min_subnormal
        return E, overflow_possible(sol.S, op_fmt, depth) | scaled_overflow

    specs = [PartSpec(t, special[p] if special else None, tol) for p, t in enumerate(exact)]

    def backward(grad: Any) -> Gradients:
        return _add_backward(ox, oy, grad, alpha, fmt, shape, model)

    return build("add", fmt, shape, specs, model, backward=backward)


def _add_backward(ox: Operand, oy: Operand, grad: Any, alpha: float | complex, fmt: Format | ComplexFormat,
                  shape: tuple[int, ...], model: ErrorModel) -> Gradients:
    G = np.broadcast_to(read_grad(grad, fmt, shape, "add"), shape)
    gs = _split(G, fmt.is_complex)
    conj_alpha = alpha.conjugate() if isinstance(alpha, complex) else alpha
    results, absent = {}, {}
    for o, coef in ((ox, 1.0), (oy, conj_alpha)):
        name = "grad_" + o.name
        if o.tier == 0:
            absent[name] = f"{o.name} was a Python scalar, so it has no gradient"
            continue
        if fmt.is_complex:
            cr, ci = complex(coef).real, complex(coef).imag
            # Re(c g) = cr gr - ci gi, Im(c g) = cr gi + ci gr
            parts = [[(cr, gs[0], None), (-ci, gs[1], None)], [(cr, gs[1], None), (ci, gs[0], None)]]
            parts = [[t for t in part if t[0] != 0] or part[:1] for part in parts]
        else:
            parts = [[(float(coef), gs[0], None)]]
        results[name] = _reduce_grad("add", name, o, fmt, model, parts, product=False)
    return Gradients("add.backward", results, absent)


# ---------------------------------------------------------------------------- multiply


def multiply(x: Any, y: Any, *, model: ErrorModel = DEFAULT, promotion: str = "torch") -> Result:
    """The exact ``x * y`` with ``torch.mul``'s semantics, rounded once.

    ``promotion="numpy"`` picks the output format by numpy 2's rules instead
    of torch's (a 0-d array counts as an array), to judge numpy code.

    >>> import exactref as er
    >>> er.multiply([3.0], [0.5]).rounded.tolist()
    [1.5]
    """
    model = check_model(model)
    ox, oy, fmt, shape = _read("multiply", x, y, promotion)
    pfmt = part_of(fmt)
    op_fmt = opmath_format(pfmt)
    # multiply reads a Python scalar in the format it computes in (float32 for half types).
    X = np.broadcast_to(_values(ox, fmt, op_fmt), shape)
    Y = np.broadcast_to(_values(oy, fmt, op_fmt), shape)
    narrow = _narrow(ox, oy)
    mixed = fmt.is_complex and not (np.iscomplexobj(ox.array) and np.iscomplexobj(oy.array))

    def terms(z: Callable[[np.ndarray], np.ndarray]) -> list[list[Term]]:
        if not fmt.is_complex:
            return [[RowTerm(1.0, z(X)[..., None], z(Y)[..., None], narrow)]]
        xs, ys = _split(z(X), True), _split(z(Y), True)
        return [[RowTerm(1.0, *_complex_products(xs, ys, p), narrow)] for p in range(2)]

    special = None if (np.isfinite(X).all() and np.isfinite(Y).all()) else terms(lambda v: v)
    exact = terms(zero_nonfinite)
    px, py = (part_of(o.fmt).p if o.tier else 53 for o in (ox, oy))
    exact_products = px + py <= op_fmt.p
    depth = (0 if exact_products else 1) + (1 if fmt.is_complex and not mixed else 0)
    underflow = not exact_products or products_may_underflow(pfmt, op_fmt)
    absX, absY = np.abs(X), np.abs(Y)

    def tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        E = dot_error(sol.S, depth=depth, acc=op_fmt, out=pfmt, terms=2, underflow=underflow)
        E = E + _scalar_error(ox, pfmt, absY) + _scalar_error(oy, pfmt, absX)
        return E, overflow_possible(sol.S, op_fmt, depth)

    specs = [PartSpec(t, special[p] if special else None, tol) for p, t in enumerate(exact)]

    def backward(grad: Any) -> Gradients:
        return _multiply_backward(ox, oy, grad, fmt, shape, model)

    return build("multiply", fmt, shape, specs, model, backward=backward)


def _multiply_backward(ox: Operand, oy: Operand, grad: Any, fmt: Format | ComplexFormat,
                       shape: tuple[int, ...], model: ErrorModel) -> Gradients:
    G = np.broadcast_to(read_grad(grad, fmt, shape, "multiply"), shape)
    X = np.broadcast_to(values_of(ox, fmt), shape)
    Y = np.broadcast_to(values_of(oy, fmt), shape)
    gr, gi = _split(G, True) if fmt.is_complex else (G, None)
    results, absent = {}, {}
    for o, other, other_op in ((ox, Y, oy), (oy, X, ox)):
        name = "grad_" + o.name
        if o.tier == 0:
            absent[name] = f"{o.name} was a Python scalar, so it has no gradient"
            continue
        if fmt.is_complex:
            vr, vi = _split(other, True)
            # g conj(v): Re = gr vr + gi vi, Im = gi vr - gr vi
            parts = [[(1.0, gr, vr), (1.0, gi, vi)], [(1.0, gi, vr), (-1.0, gr, vi)]]
        else:
            parts = [[(1.0, G, other)]]
        scalar_rel = 0.0
        if other_op.tier != 2:
            value = other_op.array.item()
            scalar_rel = scalar_relative_error(complex(value) if fmt.is_complex else float(value), part_of(fmt))
        results[name] = _reduce_grad("multiply", name, o, fmt, model, parts, product=True,
                                     scalar_factor=other_op.tier == 0, scalar_rel=scalar_rel)
    return Gradients("multiply.backward", results, absent)


# ---------------------------------------------------------------------------- shared backward


def _reduce_grad(op: str, name: str, o: Operand, fmt: Format | ComplexFormat, model: ErrorModel,
                 parts: list[list[tuple[float, np.ndarray, np.ndarray | None]]], *, product: bool,
                 scalar_factor: bool = False, scalar_rel: float = 0.0) -> Result:
    """A gradient from (coef, X, Y) triples per part, each summed over the broadcast copies of ``o``.

    X and Y have the broadcast output shape.  The result has ``o``'s shape
    and format; a real operand of a complex result gets the real part.
    """
    target, gpart = o.fmt, part_of(fmt)
    tpart = part_of(target)
    parts = parts[: 2 if target.is_complex else 1]
    narrow = 2 * gpart.p <= 53 and not scalar_factor
    folded = [[(c, fold_copies(X, o.shape), None if Y is None else fold_copies(Y, o.shape)) for c, X, Y in part]
              for part in parts]
    copies = folded[0][0][1].shape[-1]

    op_fmt = opmath_format(gpart)

    def terms(z: Callable[[np.ndarray], np.ndarray], coef: Callable[[float], float]) -> list[list[Term]]:
        return [[RowTerm(coef(c), z(X), None if Y is None else z(Y), narrow) for c, X, Y in part]
                for part in folded]

    values = [v for part in folded for _, X, Y in part for v in (X, Y) if v is not None]
    # Autograd multiplies by the coefficient in opmath: one that vanishes there makes 0 * inf = NaN.
    special = None if all(np.isfinite(v).all() for v in values) else terms(lambda v: v, lambda c: held(c, op_fmt))
    exact = terms(zero_nonfinite, lambda c: c)
    acc = accumulation_format(model, gpart)
    n = copies * len(folded[0])
    coef_depth = 0 if all(c in (1, -1) for part in parts for c, _, _ in part) else 1
    product_depth = 1 if product and (scalar_factor or not products_exact(gpart.p, acc)) else 0
    depth = max(n - 1, 0) + product_depth + coef_depth
    rel = max(scalar_relative_error(c, gpart) for part in parts for c, _, _ in part) + scalar_rel
    per_copy_depth = (1 if product and (scalar_factor or not products_exact(gpart.p, op_fmt)) else 0) \
        + coef_depth + (len(folded[0]) - 1)
    # PyTorch stores each scaled copy (alpha * grad) in the gradient's format
    # before summing the copies; the default budgets that, as the spec only
    # names multiply's per-copy products as outside it.
    per_copy = copies > 1 and ((coef_depth > 0 and not product) or (product and model.autograd_roundings))
    underflow = product and products_may_underflow(gpart, acc)
    out = tpart if tpart.p < gpart.p else gpart

    def tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        E = dot_error(sol.S, depth=depth, acc=acc, out=out, terms=n, underflow=underflow)
        if per_copy:
            E_copies = partials_error(sol.S, copies=copies, per_copy_depth=per_copy_depth, acc=acc, out=gpart)
            # With autograd_roundings the class is the default's kernels *and* PyTorch's per-copy
            # ones, so its bound is the larger of the two: budgeting roundings never shrinks it.
            E = np.maximum(E, E_copies) if product and model.autograd_roundings else E_copies
        E = widening_error(E + rel * sol.S, sol.S, gpart, tpart)
        may_overflow = overflow_possible(sol.S, acc, depth)
        if per_copy or gpart.p < tpart.p:
            # The per-copy products (or the whole sum) are stored in the gradient's format first.
            may_overflow = may_overflow | overflow_possible(sol.S, gpart, depth)
        return E, may_overflow

    specs = [PartSpec(t, special[p] if special else None, tol) for p, t in enumerate(exact)]
    return build(f"{op}.backward {name}", target, tuple(o.shape), specs, model)


add = Op("add", add, lambda x, y, grad, *, alpha=1, model=DEFAULT, promotion="torch":
         _backward_entry("add", x, y, grad, alpha, model, promotion))
multiply = Op("multiply", multiply, lambda x, y, grad, *, model=DEFAULT, promotion="torch":
              _backward_entry("multiply", x, y, grad, None, model, promotion))


def _backward_entry(op: str, x: Any, y: Any, grad: Any, alpha: Any, model: ErrorModel,
                    promotion: str = "torch") -> Gradients:
    model = check_model(model)
    ox, oy, fmt, shape = _read(op, x, y, promotion)
    if op == "add":
        return _add_backward(ox, oy, grad, read_coefficient(alpha, "alpha", fmt, op), fmt, shape, model)
    return _multiply_backward(ox, oy, grad, fmt, shape, model)

