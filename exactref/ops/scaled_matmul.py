"""scaled_matmul: the exact ``(scale_a * A) @ (B * scale_b) + bias`` of float8 operands, rounded once.

It mirrors ``torch._scaled_mm``.  The scales are

* tensor-wise: one float32 value each;
* row-wise: float32 ``scale_a`` of shape (M, 1) and ``scale_b`` of shape (1, N);
* block-wise (MX): float8_e8m0fnu ``scale_a`` of shape (M, K/32) and ``scale_b`` of
  shape (N, K/32), one power of two per 1 x 32 block along K of A's rows and B's columns.

The tolerance covers both ways kernels apply the scales: before the product
(PyTorch's CPU kernel rounds ``scale_a * A`` and ``B * scale_b`` to float32
and multiplies those in float32), or after it (cuBLAS and CUTLASS multiply
the float32 accumulator by ``scale_a * scale_b`` in the epilogue).  Its
derivation is in docs/float8.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._convert import Operand, operand, values_of, with_saturation
from ..engine.fast import gamma, up
from ..engine.sumprod import MatmulTerm, RowTerm, Solution, Term
from ..formats import FLOAT8_FORMATS, FLOAT32, FLOAT64, FORMATS, Format, format_of
from ..models._bounds import declared, dot_error
from ..models._error_model import DEFAULT, ErrorModel, check_model
from ..models._orders import tensor_core_of
from ..models._running import DotSource, ordered_error, tensor_core_bound
from ..models._tensor_core import check_tensor_core_inputs
from ..result import Result
from ._common import Op, PartSpec, build, check_bytes, zero_nonfinite

__all__ = ["scaled_matmul"]

MX_BLOCK = 32
_INPUTS = tuple(n for n in FLOAT8_FORMATS if n != "float8_e8m0fnu")
_BIAS = ("float32", "bfloat16", "float16")


def scaled_matmul(A: Any, B: Any, scale_a: Any, scale_b: Any, *, bias: Any = None, out_dtype: Any = None,
                  use_fast_accum: bool = False, model: ErrorModel = DEFAULT,
                  saturation: str | None = None, output_via: str | None = None) -> Result:
    """The exact ``(scale_a * A) @ (B * scale_b) + bias``, rounded once to ``out_dtype``.

    ``A`` (M, K) and ``B`` (K, N) are float8 (float8_e4m3fn, float8_e5m2 or
    a fnuz variant).  ``out_dtype`` defaults to A's dtype, as
    ``torch._scaled_mm``'s does; a float8 output saturates or not as
    ``saturation`` says (None: torch's cast, which saturates into
    float8_e4m3fn only).  ``bias`` has shape (N,).  ``use_fast_accum`` is
    accepted for torch's signature: how the kernel accumulates is the
    model's to say (``er.models.tensor_core(...)`` alone for fast
    accumulation, inside ``Blocked(128, ...)`` for a kernel that promotes).
    ``output_via`` names a format the kernel may round its result to before
    ``out_dtype`` ("float16" for oneDNN's float8 outputs): the outputs of
    both roundings in turn are accepted too.

    >>> import exactref as er
    >>> A = er.asarray([[1.0, 2.0]], "float8_e4m3fn")
    >>> B = er.asarray([[3.0], [4.0]], "float8_e4m3fn")
    >>> er.scaled_matmul(A, B, 0.5, 2.0, out_dtype="float32").rounded.tolist()
    [[11.0]]
    """
    model = check_model(model)
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"scaled_matmul: use_fast_accum={use_fast_accum!r} must be True or False")
    a, b = (_matrix(v, name) for v, name in ((A, "A"), (B, "B")))
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"scaled_matmul: A has shape {a.shape} and B has shape {b.shape}: A's columns ({K}) "
                         f"must equal B's rows ({b.shape[0]})")
    N = b.shape[1]
    out = with_saturation(format_of(a.fmt.name if out_dtype is None else out_dtype, argument="out_dtype"),
                          saturation)
    if out.is_complex or out.name == "float8_e8m0fnu":
        raise TypeError(f"scaled_matmul: out_dtype={out_dtype!r} must be a real float format such as bfloat16")
    via = None
    if output_via is not None:
        via = format_of(output_via, argument="output_via")
        if via.is_complex or via.name == "float8_e8m0fnu" or via.p <= out.p:
            raise ValueError(f"scaled_matmul: output_via={output_via!r} must be a real format finer than "
                             f"out_dtype ({out.name}), such as 'float16' for a float8 output")
    check_bytes("scaled_matmul", M * N * 24 * 8 + (M * K + 6 * K * N) * 8 + (256 << 20), "the product")
    kind, sa, sb = _scales(scale_a, scale_b, M, K, N)
    Av, Bv = values_of(a, a.fmt), values_of(b, b.fmt)
    c = _bias(bias, N)
    with np.errstate(invalid="ignore", over="ignore"):
        # scale_a * A and B * scale_b are exact in float64: a float32 (or a power of two) times a float8.
        X, Y = _scaled_operands(Av, Bv, sa, sb, kind)
    if kind == "tensor":
        # One coefficient instead: s_a * s_b is exact in float64, and A @ B has narrow terms.
        coef = float(sa) * float(sb)
        terms = _terms(Av, Bv, coef if np.isfinite(coef) else 0.0, c, narrow=True)
    else:
        terms = _terms(X, Y, 1.0, c, narrow=kind == "block")
    finite = all(np.isfinite(v).all() for v in (X, Y) + (() if c is None else (c,)))
    # Non-finite values follow the formula: 0 * inf in scale_a * A is NaN.
    special = None if finite else _terms(X, Y, 1.0, c, narrow=False, finite=False)
    if kind == "block":
        unscaled, s_ij = (X, Y), 1.0
    else:
        unscaled = (Av, Bv)
        with np.errstate(invalid="ignore", over="ignore"):
            s_ij = zero_nonfinite(np.abs(sa * sb) if kind == "tensor" else np.abs(sa) * np.abs(sb))
    tol = _tolerance(X, Y, c, model, a.fmt, b.fmt, K, unscaled, s_ij)
    return build("scaled_matmul", out, (M, N), [PartSpec(terms, special, tol)], model, via=via)


def _matrix(obj: Any, name: str) -> Operand:
    o = operand(obj, name, float8=True)
    if o.fmt.name not in _INPUTS:
        raise TypeError(f"scaled_matmul: {name} has dtype {o.fmt.name}; it must be one of {', '.join(_INPUTS)} "
                        f"(convert with er.asarray({name}, 'float8_e4m3fn'))")
    if o.array.ndim != 2:
        raise ValueError(f"scaled_matmul: {name} must be a matrix (2-D), got shape {o.shape}")
    return o


def _scales(scale_a: Any, scale_b: Any, M: int, K: int, N: int) -> tuple[str, np.ndarray, np.ndarray]:
    """('tensor' | 'row' | 'block', scale_a's values, scale_b's values) as float64."""
    sa, sb = (_scale(v, name) for v, name in ((scale_a, "scale_a"), (scale_b, "scale_b")))
    mx = [o.fmt.name == "float8_e8m0fnu" for o in (sa, sb)]
    if any(mx):
        if not all(mx):
            raise TypeError(f"scaled_matmul: scale_a has dtype {sa.fmt.name} and scale_b {sb.fmt.name}; MX block "
                            "scales are float8_e8m0fnu for both")
        if K % MX_BLOCK:
            raise ValueError(f"scaled_matmul: MX block scales need K (A's columns, B's rows) to be a multiple of "
                             f"{MX_BLOCK}, got K={K}")
        for o, want in ((sa, (M, K // MX_BLOCK)), (sb, (N, K // MX_BLOCK))):
            if o.shape != want:
                raise ValueError(f"scaled_matmul: {o.name} has shape {o.shape}; MX block scales need {want} "
                                 f"(one per {MX_BLOCK} values along K)")
        return "block", values_of(sa, sa.fmt), values_of(sb, sb.fmt)
    for o in (sa, sb):
        if o.fmt.name != "float32":
            raise TypeError(f"scaled_matmul: {o.name} has dtype {o.fmt.name}; scales are float32 (or "
                            f"float8_e8m0fnu for MX blocks): pass er.asarray({o.name}, 'float32')")
    if sa.array.size == 1 and sb.array.size == 1:
        return "tensor", values_of(sa, sa.fmt).reshape(()), values_of(sb, sb.fmt).reshape(())
    if sa.shape == (M, 1) and sb.shape == (1, N):
        return "row", values_of(sa, sa.fmt), values_of(sb, sb.fmt)
    raise ValueError(f"scaled_matmul: scale_a has shape {sa.shape} and scale_b {sb.shape}; use one value each "
                     f"(tensor-wise), or ({M}, 1) and (1, {N}) (row-wise)")


def _scale(obj: Any, name: str) -> Operand:
    """A scale; a Python number must be a float32 value, as torch's scale tensors are."""
    o = operand(obj, name, float8=True)
    if not o.is_python_scalar:
        return o
    value = float(o.scalar.real if isinstance(o.scalar, complex) else o.scalar)
    if isinstance(o.scalar, complex) or float(np.float32(value)) != value and np.isfinite(value):
        raise ValueError(f"scaled_matmul: {o.name}={o.scalar!r} is not a float32 value; scales are float32: "
                         f"pass er.asarray({o.scalar!r}, 'float32') to round it first")
    return Operand(o.name, np.asarray(value, dtype=np.float32), FORMATS["float32"], 1)


def _scaled_operands(Av: np.ndarray, Bv: np.ndarray, sa: np.ndarray, sb: np.ndarray,
                     kind: str) -> tuple[np.ndarray, np.ndarray]:
    if kind == "block":
        return Av * np.repeat(sa, MX_BLOCK, axis=1), Bv * np.repeat(sb, MX_BLOCK, axis=1).T
    return Av * sa, Bv * sb


def _bias(bias: Any, N: int) -> np.ndarray | None:
    if bias is None:
        return None
    o = operand(bias, "bias")
    if o.fmt.name not in _BIAS:
        raise TypeError(f"scaled_matmul: bias has dtype {o.fmt.name}; it must be one of {', '.join(_BIAS)}")
    if o.array.size != N or o.array.ndim != 1:
        raise ValueError(f"scaled_matmul: bias has shape {o.shape}; it must have shape ({N},), one per column of B")
    return values_of(o, o.fmt)


def _terms(X: np.ndarray, Y: np.ndarray, coef: float, c: np.ndarray | None, *, narrow: bool,
           finite: bool = True) -> list[Term]:
    z = zero_nonfinite if finite else (lambda v: v)
    # A row-wise scale times a float8 value has up to 28 significant bits: not narrow.
    terms: list[Term] = [MatmulTerm(coef, z(X), z(Y), narrow)]
    if c is not None:
        terms.append(RowTerm(1.0, z(np.broadcast_to(c, (X.shape[0], Y.shape[1])))[..., None], None, True))
    return terms


def _tolerance(X: np.ndarray, Y: np.ndarray, c: np.ndarray | None, model: ErrorModel, fa: Format, fb: Format,
               K: int, unscaled: tuple[np.ndarray, np.ndarray], s_ij: np.ndarray | float):
    """E = E_acc + (1 + sens) E_in + gamma_r (S + E_acc + E_in): the accumulation under the model, the
    float32 roundings of the scaled operands (scales applied first), and r roundings of an
    epilogue that applies them after (scale_a * scale_b, the multiply, + bias)."""
    Xf, Yf = zero_nonfinite(X), zero_nonfinite(Y)
    unscaled = tuple(zero_nonfinite(v) for v in unscaled)
    absX, absY = np.abs(Xf), np.abs(Yf)
    u, h = FLOAT32.unit_roundoff, FLOAT32.min_subnormal / 2
    S_ab = up((absX @ absY) * (1 + gamma(K + 2, FLOAT64.unit_roundoff)))
    # Rounding a' = s_a a and b' = b s_b to float32: |a'b' - ab| <= (2u + u^2)|a'b'| + h(1+u)(|a'| + |b'|) + h^2.
    rows = (absX.sum(axis=1, keepdims=True), absY.sum(axis=0, keepdims=True))
    E_in = up((2 * u + u * u) * S_ab + h * (1 + u) * (rows[0] + rows[1]) + K * h * h)
    epilogue = 2 + (1 if c is not None else 0)
    tc = tensor_core_of(model.order)
    if tc is not None:
        check_tensor_core_inputs(tc[0], fa)
        check_tensor_core_inputs(tc[0], fb)

    def tolerance(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
        if tc is not None:
            # The instruction aligns the products it multiplies: A's times B's, scaled by an MX
            # block's powers of two, and by tensor- or row-wise scales only in the epilogue.
            S_raw = up((np.abs(unscaled[0]) @ np.abs(unscaled[1])) * (1 + gamma(K + 2, FLOAT64.unit_roundoff)))
            E_acc, peak, sens = tensor_core_bound(DotSource(*unscaled), tc[0], S_raw, promote=tc[1])
            E_acc, peak = up(E_acc * s_ij), up(peak * s_ij)
        elif declared(model):
            E_acc, peak = ordered_error(DotSource(Xf, Yf), model.order, acc=FLOAT32, S=S_ab, products_rounded=True,
                                        final_is_root=False, underflow=FLOAT32.min_subnormal,
                                        failure_rate=model.failure_rate)
            sens = gamma(2 * K, u)
        else:
            # Any order: K - 1 additions and the product's rounding on every term's path.
            E_acc = dot_error(S_ab, depth=K, acc=FLOAT32, out=FLOAT64, terms=K, underflow=True)
            peak, sens = S_ab + E_acc, gamma(K, u)
        E = up(E_acc + (1 + sens) * E_in + gamma(epilogue, u) * (sol.S + E_acc + E_in))
        # A partial result, or a scaled operand on the way, may overflow float32.
        big = FLOAT32.max_finite
        may_overflow = (peak * (1 + gamma(epilogue, u)) + E_in >= big) | (sol.S * (1 + gamma(K + epilogue, u)) >= big)
        may_overflow = may_overflow | (absX.max(axis=1, keepdims=True, initial=0.0) >= big) | \
            (absY.max(axis=0, keepdims=True, initial=0.0) >= big)
        return E, may_overflow

    return tolerance


scaled_matmul = Op("scaled_matmul", scaled_matmul, no_backward=(
    "scaled_matmul has no backward: torch._scaled_mm has none; a float8 training step runs the backward "
    "as scaled_matmuls of its own, judge each with er.scaled_matmul"))
