"""matmul and gemm: forward, backward, tolerances and normal answers.

Semantics follow ``torch.matmul`` (1-D operands, batch broadcasting) and
``torch.addmm``'s BLAS convention (``beta == 0`` does not read C,
``alpha == 0`` does not compute A @ B).  A complex product is computed on its
real embedding: the real part of ``X @ Y`` is ``[Xr, Xi] @ [Yr; -Yi]`` and
the imaginary part ``[Xr, Xi] @ [Yi; Yr]``.

Gradients: ``grad_A = conj(alpha) grad @ B^H`` and ``grad_B = conj(alpha)
A^H @ grad``, with the broadcast copies of the operand folded into the
contraction, so each element is one dot product rounded once;
``grad_C = conj(beta) grad`` summed over C's broadcast copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _fused
from .._convert import Operand, operand, values_checked, values_of
from .._parallel import elementwise
from ..engine.fast import gamma, up
from ..engine.sumprod import MatmulTerm, RowTerm, Solution, Term
from ..formats import FLOAT8_FORMATS, FLOAT64, ComplexFormat, Format, part_of
from ..models._bounds import (
    declared,
    dot_error,
    dot_error_and_overflow,
    overflow_possible,
    partials_error,
    products_exact,
    products_may_underflow,
    scaled_bound_constants,
)
from ..models._emulate import emulate
from ..models._error_model import (
    DEFAULT,
    ErrorModel,
    accumulation_format,
    check_model,
    matmul_input_format,
    opmath_format,
)
from ..models._orders import tensor_core_of
from ..models._running import DotSource, ordered_error, tensor_core_bound
from ..models._tensor_core import check_tensor_core_inputs
from ..result import Gradients, Result
from ..rounding import round_float64
from ._coef import held, magnitude, read_coefficient, scalar_relative_error, scaled
from ._common import (
    Op,
    PartSpec,
    build,
    check_bytes,
    check_size,
    fold_copies,
    read_grad,
    zero_nonfinite,
)

__all__ = ["gemm", "matmul"]

Tolerance = Callable[[Solution], tuple[np.ndarray, np.ndarray]]


def _read_operands(op: str, *, float8: bool = False, copy: bool = True,
                   **named: Any) -> tuple[list[Operand], Format | ComplexFormat]:
    """The operands, each of them a copy (or, without ``copy``, the caller's own memory: see _forward)."""
    ops = [operand(v, k, float8=float8, copy=copy) for k, v in named.items()]
    for o in ops:
        if o.tier == 0 or (o.array.ndim == 0 and o.name in "AB"):
            raise ValueError(f"{op}: {o.name} must be an array with at least one dimension, "
                             f"got {o.array.tolist()!r}")
    fmt = ops[0].fmt
    for o in ops[1:]:
        if o.fmt != fmt:
            raise TypeError(f"{op}: {ops[0].name} has dtype {fmt.name} but {o.name} has dtype {o.fmt.name}; "
                            "PyTorch requires one dtype for all operands")
    return ops, fmt


def _shapes(a: tuple[int, ...], b: tuple[int, ...], op: str) -> tuple[tuple, tuple, tuple, tuple]:
    """2-D forms of A and B, the broadcast batch shape, and the op's output shape."""
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        which = "only" if len(b) == 1 else "second-to-last"
        raise ValueError(f"{op}: A has shape {a} and B has shape {b}: A's last dimension ({a2[-1]}) "
                         f"must equal B's {which} dimension ({b2[-2]})")
    try:
        # Equal batch shapes (plain matrices: none) need no np.broadcast_shapes, which costs
        # as much as the rest of this function.
        batch = a2[:-2] if a2[:-2] == b2[:-2] else np.broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError:
        raise ValueError(f"{op}: the batch dimensions of A {a2[:-2]} and B {b2[:-2]} do not broadcast") from None
    out = batch + ((a2[-2],) if len(a) > 1 else ()) + ((b2[-1],) if len(b) > 1 else ())
    return a2, b2, batch, out


def _embed(X: np.ndarray, Y: np.ndarray, complex_: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(X', Y') per real part, with ``X' @ Y'`` that part of ``X @ Y``."""
    if not complex_:
        return [(X, Y)]
    Xe = np.concatenate([X.real, X.imag], axis=-1)
    return [(Xe, np.concatenate([Y.real, -Y.imag], axis=-2)),
            (Xe, np.concatenate([Y.imag, Y.real], axis=-2))]


def _product_terms(X: np.ndarray, Y: np.ndarray, coef: float | complex, fmt: Format | ComplexFormat, *,
                   drop_zero: bool, magnitudes: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
                   ) -> list[list[Term]]:
    """The terms per part of ``coef * (X @ Y)``; ``magnitudes``: |X| and |Y| in float32, exact, where
    the op made them as it read them (real operands only: see _read)."""
    narrow = 2 * part_of(fmt).p <= 53
    abs_X, abs_Y = magnitudes if narrow and not fmt.is_complex else (None, None)
    if coef == 1 and not fmt.is_complex:
        # What scaled() gives, without its set-up.
        return [[MatmulTerm(1.0, X, Y, narrow, abs_A=abs_X, abs_B=abs_Y)]]
    pairs = _embed(X, Y, fmt.is_complex)
    makers = [lambda c, xy=xy: MatmulTerm(c, xy[0], xy[1], narrow, abs_A=abs_X, abs_B=abs_Y) for xy in pairs]
    return [scaled(coef, makers, p, drop_zero=drop_zero) for p in range(len(pairs))]


def _array_terms(C: np.ndarray, coef: float | complex, fmt: Format | ComplexFormat, *,
                 drop_zero: bool) -> list[list[Term]]:
    """Terms per part of ``coef * C`` for an array C of the output's shape."""
    narrow = 2 * part_of(fmt).p <= 53
    values = [C.real, C.imag] if fmt.is_complex else [C]
    makers = [lambda c, v=v: RowTerm(c, v[..., None], None, narrow) for v in values]
    return [scaled(coef, makers, p, drop_zero=drop_zero) for p in range(len(values))]


def _all_finite(*arrays: np.ndarray) -> bool:
    return all(np.isfinite(a).all() for a in arrays)


def _both(exact: Callable[[bool], list[list[Term]]], finite: bool) -> tuple[list, list | None]:
    """The terms on finite-ized inputs, and, unless every input is ``finite``, on the real inputs."""
    special = None if finite else exact(False)
    return exact(True), special


def _tolerance(fin: Format, out: Format, n: int, model: ErrorModel, *, extra_depth: int = 0,
               relative: float = 0.0, rows: tuple[np.ndarray, np.ndarray] | None = None,
               copies: int = 1, per_copy_rounding: bool = False,
               overflow: np.ndarray | None = None, coef: float | complex = 1.0,
               stored: bool = False, absolute: np.ndarray | float = 0.0,
               dot: tuple[np.ndarray, np.ndarray] | None = None, tin_exact: bool = False) -> Tolerance:
    """Tolerance of an n-term dot product of ``fin`` values accumulated under ``model``, rounded to ``out``.

    ``rows`` (sum|a| by row, sum|b| by column) is needed when the model rounds
    float32 inputs to TF32 or bfloat16.  With ``per_copy_rounding`` the sum
    is ``copies`` partial products, each rounded to ``out`` first.  ``dot``
    (X, Y with the terms ``X[..., i, k] * Y[..., k, j]``, finite) lets a
    declared order bound the sum from its exact partial sums.  ``tin_exact``:
    rounding the inputs to the model's input format changes none of them.
    """
    acc = accumulation_format(model, fin)
    tin = matmul_input_format(model, fin) if rows is not None else None
    tc = tensor_core_of(model.order)
    if tc is not None:
        check_tensor_core_inputs(tc[0], tin or fin)
    exact = products_exact(tin.p if tin else fin.p, acc)
    depth = max(n - 1, 0) + (0 if exact else 1) + extra_depth
    underflow = not exact or products_may_underflow(tin or fin, acc)
    per_copy = max(n // copies - 1, 0) + (0 if exact else 1)

    def tolerance(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        S = sol.S
        E_in = 0.0
        if tin is not None and not tin_exact:
            # |a_t b_t - a b| <= (2u + u^2)|ab| + h((1+u)|a| + |b|), h half of tin's subnormal spacing.
            u, h = tin.unit_roundoff, tin.min_subnormal / 2
            E_in = (2 * u + u * u) * S + h * ((1 + u) * rows[0] + rows[1])
            S = S * (1 + 3 * u) + E_in
        def any_order(S: np.ndarray) -> np.ndarray:
            return dot_error(S, depth=depth, acc=acc, out=out, terms=n, underflow=underflow)

        if per_copy_rounding and copies > 1:
            E_any = any_order(S)
            E = partials_error(S, copies=copies, per_copy_depth=per_copy, acc=acc, out=out)
            E = E + dot_error(S, depth=extra_depth + 1, acc=acc, out=out) if extra_depth else E
            # Kernels of the default's class belong to this class too: never a smaller tolerance.
            E = np.maximum(E, E_any)
            may_overflow = overflow_possible(S, acc, depth)
        elif declared(model) and dot is not None:
            E_any = any_order(S)
            E, may_overflow, sens = _ordered_dot(dot, S, model, acc, out, n, exact, underflow, extra_depth, coef,
                                                 perturbed=tin is not None and not tin_exact)
            if tin is not None and not tin_exact:
                # Every partial sum of the rounded inputs' products is off by at most E_in; the bound
                # grows by at most `sens` per unit of that.
                E = up(E + sens * E_in * (1 + 3 * tin.unit_roundoff))
            if tc is None:
                # The bound for any order holds for this one too: at small sizes it can be the tighter.
                # (Not for a tensor core, whose steps truncate: its class is not float32's.)
                E = np.minimum(E, E_any)
        else:
            # Elementwise: a large output's blocks side by side (exactref/_parallel.py).
            E, may_overflow = elementwise(lambda s: dot_error_and_overflow(
                s, depth=depth, acc=acc, out=out, terms=n, underflow=underflow, overflow_depth=depth), S)
        inner = S / magnitude(coef) if coef not in (0, 1, -1) else S
        if coef not in (0, 1, -1):
            # The product may be formed before it is scaled by a small coefficient.
            may_overflow = may_overflow | overflow_possible(inner, acc, depth)
        if stored:
            # Autograd stores partial products in the output format before summing or scaling them.
            may_overflow = may_overflow | overflow_possible(inner, out, depth)
        if overflow is not None:
            may_overflow = may_overflow | overflow
        if not (_is_zero(E_in) and _is_zero(absolute)):  # (E is never -0, which + 0.0 would change)
            E = E + E_in + absolute
        return E + relative * S if relative else E, may_overflow

    # Where the tolerance is the bound for any order alone, its constants: a narrow product's blocks
    # are then decided, given it and judged in one compiled pass (ops._common._solve_judged).
    alone = (not (per_copy_rounding and copies > 1) and not (declared(model) and dot is not None)
             and (tin is None or tin_exact) and coef in (0, 1, -1) and not stored and overflow is None
             and _is_zero(absolute) and not relative)
    tolerance.scaled_bound = scaled_bound_constants(  # type: ignore[attr-defined]
        depth=depth, acc=acc, out=out, terms=n, underflow=underflow, overflow_depth=depth) if alone else None
    return tolerance


def _blockwise(fmt: Format | ComplexFormat, model: ErrorModel, rows: tuple[np.ndarray, np.ndarray] | None,
               overflow: np.ndarray | None, absolute: np.ndarray | float) -> bool:
    """Whether a large output is judged block by block as it is solved (``PartSpec.blockwise``).

    That needs :func:`_tolerance` with these arguments to be elementwise in the Solution: the bound
    for any order (or for rounded partial products), without TF32's row sums, overflow marks or an
    absolute term that is an array, of a real output.  And it needs narrow operands: float64 ones
    keep B's five slices (products.Right) until every block is solved, and the output's six
    float64 arrays beside them took a float64 2048**3 matmul's peak memory from 3.8 to 4.4 times
    its inputs and output (benchmarks/bench_matmul.py), past issue 12's 4.  Judged after solving,
    the output's arrays come when the slices are gone.
    """
    return (not fmt.is_complex and 2 * part_of(fmt).p <= 53 and rows is None and not declared(model)
            and overflow is None and not isinstance(absolute, np.ndarray))


def _is_zero(v: np.ndarray | float) -> bool:
    """Whether v is the Python number 0 (not an array), whose addition can be skipped."""
    return isinstance(v, (int, float)) and v == 0


def _ordered_dot(dot: tuple[np.ndarray, np.ndarray], S: np.ndarray, model: ErrorModel, acc: Format, out: Format,
                 n: int, exact: bool, underflow: bool, extra_depth: int,
                 coef: float | complex, *, perturbed: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """The bound for the model's declared order, then ``extra_depth`` roundings (alpha, + beta C) after it.

    The third value bounds the growth of the bound per unit of perturbation of the terms.
    """
    X, Y = dot
    final = acc == out and extra_depth == 0
    per_term = acc.min_subnormal if underflow and not (n == 1 and final) else 0.0
    scale = magnitude(coef) if coef != 0 else 1.0
    # sum|X Y| itself, where S also holds the coefficients and beta * C.
    S_dot = S if extra_depth == 0 and scale == 1 else \
        up((np.abs(X) @ np.abs(Y)) * (1 + gamma(n + 2, FLOAT64.unit_roundoff)))
    tc = tensor_core_of(model.order)
    if tc is not None:
        # A tensor core multiplies the inputs exactly, unless they were rounded (to tf32) first.
        E, partial_max, sens = tensor_core_bound(DotSource(X, Y), tc[0], S_dot, promote=tc[1],
                                                 exact_terms=not perturbed)
    else:
        E, partial_max = ordered_error(DotSource(X, Y), model.order, acc=acc, S=S_dot, products_rounded=not exact,
                                       final_is_root=final, underflow=per_term, failure_rate=model.failure_rate)
        # Fewer than 2n roundings (additions, and the depths of any-order blocks) see a perturbed partial sum.
        sens = gamma(2 * n, acc.unit_roundoff)
    E = scale * E
    k = extra_depth - (1 if acc == out else 0)
    if k > 0:
        # Each later rounding (alpha, adding beta * C) costs at most u times what it rounds.
        E = up(E + gamma(k, acc.unit_roundoff) * (S + E))
    return E, scale * partial_max >= acc.max_finite, sens


def _alpha_depth(alpha: float | complex) -> int:
    """Roundings a multiply by alpha adds: none for +-1, two for a complex alpha."""
    if alpha in (1, -1):
        return 0
    return 2 if isinstance(alpha, complex) and alpha.imag and alpha.real else 1


def matmul(A: Any, B: Any, *, model: ErrorModel = DEFAULT) -> Result:
    """The exact ``A @ B`` with ``torch.matmul``'s semantics, rounded once.

    >>> import exactref as er
    >>> er.matmul([[1.0, 2.0]], [[3.0], [4.0]]).rounded.tolist()
    [[11.0]]
    """
    model = check_model(model)
    (a, b), fmt = _read_operands("matmul", float8=True, copy=False, A=A, B=B)
    return _forward("matmul", a, b, None, fmt, 1.0, 0.0, model)


def gemm(A: Any, B: Any, C: Any, *, alpha: float | complex = 1, beta: float | complex = 1,
         model: ErrorModel = DEFAULT) -> Result:
    """The exact ``beta * C + alpha * (A @ B)``, rounded once, with ``torch.addmm``'s conventions.

    C broadcasts to the product's shape.  ``beta == 0`` ignores C entirely
    (its NaNs do not propagate) and ``alpha == 0`` does not compute A @ B.

    >>> import exactref as er
    >>> er.gemm([[1.0]], [[2.0]], [[0.5]], alpha=3, beta=2).rounded.tolist()
    [[7.0]]
    """
    model = check_model(model)
    (a, b, c), fmt = _read_operands("gemm", copy=False, A=A, B=B, C=C)
    alpha = read_coefficient(alpha, "alpha", fmt, "gemm")
    beta = read_coefficient(beta, "beta", fmt, "gemm")
    return _forward("gemm", a, b, c, fmt, alpha, beta, model)


def _forward(op: str, a: Operand, b: Operand, c: Operand | None, fmt: Format | ComplexFormat,
             alpha: float | complex, beta: float | complex, model: ErrorModel) -> Result:
    """The op's Result.  The operands' arrays are the caller's memory (_read_operands without a copy):
    they are read once here, into the float64 (complex128) values that the Result and its backward
    keep, and not again.  (A copy of a narrower operand first, which its widening copies again, cost
    0.55 of the 3 ms before a float32 1024**3 matmul's blocks start.)"""
    a2s, b2s, batch, out_shape = _shapes(a.shape, b.shape, op)
    shape2 = batch + (a2s[-2], b2s[-1])
    # The result's arrays (about 24 float64 per element), the operands' float64 values and
    # B's slices (6 arrays of B's size), and the blocks of rows solved at a time.
    check_bytes(op, math.prod(shape2) * 24 * 8 + (a.array.size + 6 * b.array.size) * 8
                + (256 << 20), "the product")
    # Read only from here on.  Whether each operand is finite is learned as it is copied or
    # widened (_read), and so, for float32 operands, are their magnitudes.
    (A2, finite_a, abs_a), (B2, finite_b, abs_b) = _read(a, fmt), _read(b, fmt)
    A2, B2 = A2.reshape(a2s), B2.reshape(b2s)
    fin = part_of(fmt)
    # torch.addmm on float32/float64 (a BLAS) skips A @ B when alpha is 0; the
    # half-type and batched kernels compute it and multiply by 0, so NaN and
    # inf in it still give NaN.
    blas_skip = len(a.shape) <= 2 and len(b.shape) <= 2 and fin.p >= 24
    # Every kernel reads alpha in opmath first, where a tiny one is 0.
    alpha_held = held(alpha, opmath_format(fin)) if c is not None else alpha
    use_ab = c is None or alpha_held != 0 or not blas_skip
    alpha_vanishes = not use_ab and alpha != 0
    # A kernel reads beta in the format it computes in (a float32 or float64 BLAS in the inputs'
    # format; PyTorch's CPU kernels for float16 and bfloat16 in float32): one that rounds to zero
    # there skips C as well.  (A beta zero in bfloat16 but not in float32 still reads C: NaN in C
    # gives NaN.)
    beta_vanishes = c is not None and beta != 0 and held(beta, opmath_format(fin)) == 0
    use_c = c is not None and beta != 0 and not beta_vanishes
    if c is not None:
        try:
            Cv = np.broadcast_to(values_of(c, fmt), out_shape).reshape(shape2)
        except ValueError:
            raise ValueError(f"{op}: C has shape {c.shape}, which does not broadcast to the product's "
                             f"shape {out_shape}") from None

    # Finiteness is checked once: when it holds, the finite-ized operands are the operands.
    all_finite = (not use_c or _all_finite(Cv)) and (not use_ab or (finite_a and finite_b))
    zA, zB = (A2, B2) if all_finite or not use_ab else (zero_nonfinite(A2), zero_nonfinite(B2))
    zC = None if not use_c else Cv if all_finite else zero_nonfinite(Cv)
    # The magnitudes are those of zA and zB where the operands are finite (they are A2 and B2);
    # otherwise there are none, for the finite terms or the special ones.
    magnitudes = (None, None) if not all_finite else \
        tuple(None if m is None else m.reshape(s2) for m, s2 in ((abs_a, a2s), (abs_b, b2s)))

    def terms(finite: bool) -> list[list[Term]]:
        coef = alpha if finite else alpha_held
        parts = [[] for _ in range(2 if fmt.is_complex else 1)]
        if use_ab:
            X, Y = (zA, zB) if finite else (A2, B2)
            for p, t in enumerate(_product_terms(X, Y, coef, fmt, drop_zero=c is not None and coef != 0,
                                                 magnitudes=magnitudes)):
                parts[p] += t
        if use_c:
            for p, t in enumerate(_array_terms(zC if finite else Cv, beta, fmt, drop_zero=True)):
                parts[p] += t
        return parts

    exact_terms, special_terms = _both(terms, all_finite)
    # Without A @ B a part is beta * C alone: two products summed for a complex beta.
    n = a2s[-1] * (2 if fmt.is_complex else 1) if use_ab else (2 if _alpha_depth(beta) == 2 else 1)
    extra = (_alpha_depth(alpha) if use_ab and c is not None else 0) + (1 if use_c and use_ab else 0)
    acc = accumulation_format(model, fin)
    # Coefficients may be converted to the tensors' own dtype first.
    rel = (scalar_relative_error(alpha, fin) if use_ab and c is not None else 0.0)
    rel += scalar_relative_error(beta, fin) if use_c else 0.0
    vanished = 0.0
    if beta_vanishes:
        vanished = magnitude(beta) * np.abs(zero_nonfinite(Cv)) * (2 if fmt.is_complex else 1)
    if alpha_vanishes:
        with np.errstate(over="ignore"):
            vanished = vanished + magnitude(alpha) * (np.abs(zero_nonfinite(A2)) @ np.abs(zero_nonfinite(B2))) \
                * (2 if fmt.is_complex else 1)
    rows, tin_exact = _input_rounding(A2, B2, fin, model) if use_ab else (None, False)
    scaled_overflow = None
    if use_ab and c is not None and alpha not in (1, -1, 0):
        # A BLAS may scale A (or B) by alpha before multiplying, so alpha * a can overflow on its own.
        big = acc.max_finite / magnitude(alpha)
        rowmax = np.max(np.abs(A2), axis=-1, keepdims=True, initial=0.0)
        colmax = np.max(np.abs(B2), axis=-2, keepdims=True, initial=0.0)
        scaled_overflow = np.broadcast_to((rowmax >= big) | (colmax >= big), shape2)
    scaled_underflow = 0.0
    if use_ab and c is not None and alpha not in (1, -1, 0):
        # alpha * a (or alpha * b) may land among the subnormals and lose bits:
        # half a subnormal spacing per entry, times the other factor.
        rowsum = np.sum(np.abs(A2), axis=-1, keepdims=True)
        colsum = np.sum(np.abs(B2), axis=-2, keepdims=True)
        scaled_underflow = acc.min_subnormal * (rowsum + colsum) * (2 if fmt.is_complex else 1)
    if use_ab and alpha_held == 0 and c is not None:
        # The product is formed and then multiplied by zero: its overflow makes NaN.
        with np.errstate(over="ignore"):
            inner = np.abs(zero_nonfinite(A2)) @ np.abs(zero_nonfinite(B2))
        if fmt.is_complex:
            inner = inner * 2
        scaled_overflow = np.broadcast_to(inner * 1.01 >= acc.max_finite, shape2)
    dot = (zA, zB) if use_ab and not fmt.is_complex else None
    tol = _tolerance(fin, fin, n, model, extra_depth=extra, relative=rel, rows=rows, overflow=scaled_overflow,
                     coef=alpha if use_ab and c is not None else 1.0, absolute=scaled_underflow + vanished,
                     dot=dot, tin_exact=tin_exact)
    blockwise = _blockwise(fmt, model, rows, scaled_overflow, scaled_underflow + vanished)
    specs = [PartSpec(t, special_terms[p] if special_terms else None, tol, blockwise)
             for p, t in enumerate(exact_terms)]

    def backward(grad: Any) -> Gradients:
        # The forward has checked that A and B are finite: the backward need only check grad.
        return _backward(op, a, b, c, grad, fmt, alpha, beta, model, ab_finite=use_ab and all_finite,
                         values=(A2, B2))

    typical = _typical(dot, fin, model) if c is None and rows is None else None
    return build(op, fmt, shape2, specs, model, out_shape=out_shape, backward=backward, typical=typical)


def _read(o: Operand, fmt: Format | ComplexFormat) -> tuple[np.ndarray, bool, np.ndarray | None]:
    """An operand's float64 values (its own copy), whether every one is finite, and, for a float32
    operand, their magnitudes in float32 (engine.products' bound on |A| |B| multiplies them), in
    one pass where exactref/_fused.py's loop applies and every nonzero one lies in [2**-60, 2**60]
    (what engine.sumprod.MatmulTerm asks of them); else the magnitudes are None."""
    if not fmt.is_complex and o.array.dtype == np.float32:
        read = _fused.read_float32(o.array)
        if read is not None:
            values, finite, magnitudes, in_range = read
            return values, finite, magnitudes if in_range else None
    return (*values_checked(o, fmt, own=True), None)


def _input_rounding(X: np.ndarray, Y: np.ndarray, fin: Format,
                    model: ErrorModel) -> tuple[tuple[np.ndarray, np.ndarray] | None, bool]:
    """(sum|x| by row, sum|y| by column) where the model rounds the inputs first (TF32), else None;
    and whether that rounding leaves every input unchanged (values already in TF32)."""
    tin = matmul_input_format(model, fin)
    if tin is None:
        return None, False
    rows = (np.sum(np.abs(X), axis=-1, keepdims=True), np.sum(np.abs(Y), axis=-2, keepdims=True))
    parts = [p for v in (X, Y) for p in ((v.real, v.imag) if np.iscomplexobj(v) else (v,))]
    exact = all(np.array_equal(round_float64(zero_nonfinite(p), tin), zero_nonfinite(p)) for p in parts)
    return rows, exact


def _typical(dot: tuple[np.ndarray, np.ndarray] | None, fin: Format,
             model: ErrorModel) -> Callable[[tuple[int, ...]], float] | None:
    """One kernel of the declared order, emulated at an element, for the report (None: none to emulate)."""
    if dot is None or not declared(model) or tensor_core_of(model.order) is not None:
        return None
    source, acc = DotSource(*dot), accumulation_format(model, fin)
    rounded = not products_exact(fin.p, acc)
    return lambda index: emulate(source.terms_at(index), model.order, acc, fin, rounded)


def _fold(X: np.ndarray, Y: np.ndarray, own: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
    """Fold the broadcast copies of an operand with batch shape ``own`` into the contraction.

    X (batch..., M, L) and Y (batch..., L, K) are broadcast to the full batch
    shape.  Returns X' (keep..., M, copies*L) and Y' (keep..., copies*L, K)
    whose product, reshaped to ``own + (M, K)``, sums the per-copy products.
    """
    full = X.shape[:-2]
    nb = len(full)
    if nb == 0:
        return X, Y, 1  # plain matrices: nothing to fold (the general path returns views like these)
    padded = (1,) * (nb - len(own)) + tuple(own)
    reduce_axes = [i for i in range(nb) if padded[i] == 1 and full[i] != 1]
    keep = [i for i in range(nb) if i not in reduce_axes]
    copies = int(np.prod([full[i] for i in reduce_axes], dtype=np.int64)) if reduce_axes else 1
    keep_shape = tuple(full[i] for i in keep)
    M, L, K = X.shape[-2], X.shape[-1], Y.shape[-1]
    Xp = np.transpose(X, keep + [nb] + reduce_axes + [nb + 1]).reshape(keep_shape + (M, copies * L))
    Yp = np.transpose(Y, keep + reduce_axes + [nb, nb + 1]).reshape(keep_shape + (copies * L, K))
    return Xp, Yp, copies


def _broadcast(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``np.broadcast_to(x, shape)``: a read-only view, made without np.broadcast_to's per-call cost
    (several times that of the rest of a small backward's set-up) where x has the shape already."""
    if x.shape != shape:
        return np.broadcast_to(x, shape)
    view = x.view()
    view.flags.writeable = False
    return view


def _mT(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _backward(op: str, a: Operand, b: Operand, c: Operand | None, grad: Any, fmt: Format | ComplexFormat,
              alpha: float | complex, beta: float | complex, model: ErrorModel, *,
              ab_finite: bool = False, values: tuple[np.ndarray, np.ndarray] | None = None) -> Gradients:
    """The gradients; ``ab_finite``: A and B are known to hold finite values only; ``values``: A's
    and B's values, as the forward read them (then ``a``, ``b`` and ``c`` are read for their shapes
    alone: their arrays are the caller's memory, see _forward)."""
    a2s, b2s, batch, out_shape = _shapes(a.shape, b.shape, op)
    shape2 = batch + (a2s[-2], b2s[-1])
    G_out = read_grad(grad, fmt, out_shape, op)
    G = _broadcast(G_out.reshape(shape2), shape2)
    A_values, B_values = values if values is not None else \
        (values_of(a, fmt, copy=False), values_of(b, fmt, copy=False))
    A2 = _broadcast(A_values.reshape(a2s), batch + a2s[-2:])
    B2 = _broadcast(B_values.reshape(b2s), batch + b2s[-2:])
    both_batched = len(a.shape) >= 3 and len(b.shape) >= 3
    conj_alpha = alpha.conjugate() if isinstance(alpha, complex) else alpha
    # Both products' operands are finite when A, B and grad are (folding and conj keep that).
    finite = _all_finite(G) if ab_finite else None
    results = {
        "grad_A": _grad_product(op, "grad_A", G, np.conj(_mT(B2)), a2s[:-2], conj_alpha, fmt, a.shape,
                                model, both_batched, finite),
        "grad_B": _grad_product(op, "grad_B", np.conj(_mT(A2)), G, b2s[:-2], conj_alpha, fmt, b.shape,
                                model, both_batched, finite),
    }
    if c is not None:
        conj_beta = beta.conjugate() if isinstance(beta, complex) else beta
        results["grad_C"] = _grad_scaled_sum(op, G_out, c.shape, conj_beta, fmt, model)
    return Gradients(f"{op}.backward", results)


def _grad_product(op: str, name: str, X: np.ndarray, Y: np.ndarray, own: tuple[int, ...],
                  coef: float | complex, fmt: Format | ComplexFormat, shape: tuple[int, ...],
                  model: ErrorModel, both_batched: bool, finite: bool | None = None) -> Result:
    """One of ``X @ Y``'s gradients; ``finite``: whether X and Y are finite, if the caller knows."""
    Xf, Yf, copies = _fold(X, Y, own)
    check_size(op, Xf.size + Yf.size, f"{name}")
    fin = part_of(fmt)

    # Finiteness is checked once: when it holds, the finite-ized operands are the operands.
    all_finite = _all_finite(Xf, Yf) if finite is None else finite
    zX, zY = (Xf, Yf) if all_finite else (zero_nonfinite(Xf), zero_nonfinite(Yf))

    def terms(finite: bool) -> list[list[Term]]:
        # Autograd multiplies by alpha in opmath, where a tiny one is 0 and makes 0 * inf = NaN.
        return _product_terms(zX if finite else Xf, zY if finite else Yf,
                              coef if finite else held(coef, opmath_format(fin)), fmt, drop_zero=False)

    exact_terms, special_terms = _both(terms, all_finite)
    n = Xf.shape[-1] * (2 if fmt.is_complex else 1)
    rounded_partials = model.autograd_roundings and both_batched and copies > 1
    extra = _alpha_depth(coef)
    rel = scalar_relative_error(coef, fin)
    absolute = 0.0
    if model.autograd_roundings and coef not in (1, -1):
        # addmm's backward rounds grad @ B^H to the output format (maybe a
        # subnormal: half a spacing), then multiplies by alpha.
        extra += 1
        rel += fin.unit_roundoff * 1.01
        absolute = fin.min_subnormal * magnitude(coef) * (2 if fmt.is_complex else 1)
    inner_overflow = None
    if coef == 0:
        # grad @ B^H is still computed, then multiplied by zero: its overflow makes NaN.
        absX, absY = np.abs(zX), np.abs(zY)
        with np.errstate(over="ignore"):
            inner = absX @ absY
        # ... and PyTorch stores it in the output format before the multiply.
        inner_overflow = inner * 1.01 >= min(accumulation_format(model, fin).max_finite, fin.max_finite)
    dot = None if fmt.is_complex else (zX, zY)
    # The gradients are float32 matmuls too: under TF32 their operands are rounded first.
    rows, tin_exact = _input_rounding(Xf, Yf, fin, model)
    tol = _tolerance(fin, fin, n, model, extra_depth=extra, relative=rel, copies=copies,
                     per_copy_rounding=rounded_partials, overflow=inner_overflow, coef=coef, absolute=absolute,
                     stored=model.autograd_roundings and (rounded_partials or coef not in (1, -1)), dot=dot,
                     rows=rows, tin_exact=tin_exact)
    blockwise = _blockwise(fmt, model, rows, inner_overflow, absolute)
    specs = [PartSpec(t, special_terms[p] if special_terms else None, tol, blockwise)
             for p, t in enumerate(exact_terms)]
    typical = _typical(dot, fin, model) if coef == 1 and not rounded_partials and rows is None else None
    return build(f"{op}.backward {name}", fmt, Xf.shape[:-2] + (Xf.shape[-2], Yf.shape[-1]), specs, model,
                 out_shape=shape, typical=typical)


def _grad_scaled_sum(op: str, G: np.ndarray, shape: tuple[int, ...], coef: float | complex,
                     fmt: Format | ComplexFormat, model: ErrorModel) -> Result:
    """``coef * grad`` summed over the broadcast copies of an operand of ``shape`` (gemm's grad_C)."""
    folded = fold_copies(G, shape)
    copies = folded.shape[-1]
    fin = part_of(fmt)
    narrow = 2 * fin.p <= 53

    def terms(finite: bool) -> list[list[Term]]:
        v = zero_nonfinite(folded) if finite else folded
        values = [v.real, v.imag] if fmt.is_complex else [v]
        makers = [lambda k, w=w: RowTerm(k, w, None, narrow) for w in values]
        k = coef if finite else held(coef, opmath_format(fin))
        return [scaled(k, makers, p, drop_zero=False) for p in range(len(values))]

    exact_terms, special_terms = _both(terms, _all_finite(folded))
    acc = accumulation_format(model, fin)
    extra = _alpha_depth(coef)
    rel = scalar_relative_error(coef, fin)
    # PyTorch scales every copy of grad by beta in the output format, then sums the copies.
    per_copy = copies > 1 and extra > 0

    def tol(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        if per_copy:
            E = partials_error(sol.S, copies=copies, per_copy_depth=extra, acc=acc, out=fin)
        else:
            E = dot_error(sol.S, depth=copies - 1 + extra, acc=acc, out=fin)
        may_overflow = overflow_possible(sol.S, acc, copies)
        if per_copy:
            may_overflow = may_overflow | overflow_possible(sol.S, fin, copies)
        return E + rel * sol.S, may_overflow

    specs = [PartSpec(t, special_terms[p] if special_terms else None, tol, not fmt.is_complex)
             for p, t in enumerate(exact_terms)]
    return build(f"{op}.backward grad_C", fmt, tuple(shape), specs, model)


matmul = Op("matmul", matmul, lambda A, B, grad, *, model=DEFAULT: _matmul_backward(A, B, grad, model))
gemm = Op("gemm", gemm,
          lambda A, B, C, grad, *, alpha=1, beta=1, model=DEFAULT: _gemm_backward(A, B, C, grad, alpha, beta, model))


def _matmul_backward(A: Any, B: Any, grad: Any, model: ErrorModel) -> Gradients:
    model = check_model(model)
    (a, b), fmt = _read_operands("matmul", float8=True, A=A, B=B)
    if fmt.name in FLOAT8_FORMATS:
        raise TypeError(f"matmul.backward: A and B have dtype {fmt.name}, and PyTorch has no float8 backward "
                        "(its sum and mul kernels refuse float8); judge the backward of the bfloat16 or float32 "
                        "values, which hold float8 values exactly")
    return _backward("matmul", a, b, None, grad, fmt, 1.0, 0.0, model)


def _gemm_backward(A: Any, B: Any, C: Any, grad: Any, alpha: Any, beta: Any, model: ErrorModel) -> Gradients:
    model = check_model(model)
    (a, b, c), fmt = _read_operands("gemm", A=A, B=B, C=C)
    alpha = read_coefficient(alpha, "alpha", fmt, "gemm")
    beta = read_coefficient(beta, "beta", fmt, "gemm")
    return _backward("gemm", a, b, c, grad, fmt, alpha, beta, model)
