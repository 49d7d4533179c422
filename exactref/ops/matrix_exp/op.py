"""matrix_exp, matrix_exp_frechet and matrix_exp.backward: certified, correctly rounded, with tolerances.

The exact value of ``exp(A)`` is transcendental.  Each element is enclosed in
an Arb ball (``arb_mat.exp`` / ``acb_mat.exp`` of python-flint) and rounded
by Ziv's strategy (:func:`~exactref.engine.certified.round_certified`): the
first pass runs at 64 bits (96 for float64 parts), an element still
undecided is computed again at twice the precision, up to the cap, where
:class:`~exactref.errors.ReferenceUnavailableError` names it.

The Fréchet derivative ``L(A, E)`` is the top-right block of
``exp([[A, E], [0, A]])``, and the gradient of matrix_exp is
``grad_A = L(A^H, grad)``, the block matrix PyTorch's autograd builds.

Structural zeros: an element no walk of A's graph reaches is exactly zero,
decided without Arb.  For a complex A the walks are followed with their
parity of imaginary factors, so the real or imaginary part that no walk can
produce (every imaginary part of exp(A) for a real A, the real part of
``exp(iB)`` between the two sides of a bipartite B) is exactly zero too.
An element that is zero by cancellation has a ball around zero at every
precision and raises ReferenceUnavailableError at the cap.

The tolerance is the running error bound of ``_model`` for PyTorch's
algorithm; a 1 x 1 forward is ``torch.exp`` (PyTorch's shortcut), whose
tolerance is a few ulps.  matrix_exp has no canonical evaluation and so no
normal answer; what covers() accepts for non-finite inputs and for overflow
is on ``docs/matrix-exp.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flint
import numpy as np

from ..._convert import Operand, operand, values_of
from ...engine.certified import MAX_PRECISION, round_certified
from ...errors import ReferenceUnavailableError
from ...formats import ComplexFormat, Format, part_of
from ...models._matrix_exp import PADE13, PYTORCH_MEXP, MatrixExpModel
from ...result import Gradients, Result, judge
from ...rounding import above
from .._common import Op, check_size, read_grad
from ._model import mexp_tolerance
from ._pade import pade_bound

__all__ = ["PADE13", "PYTORCH_MEXP", "MatrixExpModel", "matrix_exp", "matrix_exp_frechet"]

# E is multiplied by this: the model's constants are PyTorch's, emulated, and
# one of them computed differently in its last bit must not cause a false alarm.
_SLACK = 1.0 + 2.0 ** -20
# Above this 1-norm, an undecided element may be a loss of precision rather than a zero or a tie.
_LARGE_NORM = 32.0
_NO_BACKWARD = ("matrix_exp_frechet has no backward; differentiate matrix_exp instead "
                "(er.matrix_exp.backward(A, grad))")


_MODELS = {m.name: m for m in (PYTORCH_MEXP, PADE13)}


def _check_model(model: Any, op: str, fmt: Format | ComplexFormat) -> MatrixExpModel:
    if isinstance(model, str) and model in _MODELS:
        model = _MODELS[model]
    if not isinstance(model, MatrixExpModel) or model.name not in _MODELS:
        raise TypeError(f"{op}: model={model!r} is not a matrix_exp model; use model='pade13' for Padé "
                        "scaling and squaring (scipy.linalg.expm) or 'pytorch_mexp' (the default), or the "
                        "er.models.PADE13 and er.models.PYTORCH_MEXP")
    if model == PADE13 and part_of(fmt).p < 24:
        raise ValueError(f"{op}: model=PADE13 has no {fmt.name} version (scipy.linalg.expm computes half "
                         "formats in float32); use float32, float64, complex64 or complex128")
    return model


def _read_square(x: Any, name: str, op: str) -> Operand:
    o = operand(x, name)
    shape = o.array.shape
    if o.tier == 0 or len(shape) < 2 or shape[-1] != shape[-2]:
        shown = f"{name}={x!r}" if o.tier == 0 else f"{name} has shape {shape}"
        raise ValueError(f"{op}: {shown}; it must be a square matrix or a batch of them, "
                         "of shape (..., n, n)")
    return o


def _block(A: np.ndarray, E: np.ndarray) -> np.ndarray:
    """``[[A, E], [0, A]]`` for every matrix of the batch."""
    n = A.shape[-1]
    out = np.zeros(A.shape[:-2] + (2 * n, 2 * n), dtype=np.result_type(A, E))
    out[..., :n, :n] = A
    out[..., n:, n:] = A
    out[..., :n, n:] = E
    return out


def _reach(V: np.ndarray, complex_: bool) -> tuple[np.ndarray, np.ndarray]:
    """Where a walk of V's graph can make the real part, and the imaginary part, of exp(V) nonzero.

    The walks are followed on a doubled graph whose second copy counts an odd
    number of imaginary factors: an entry with a nonzero real part keeps the
    parity, one with a nonzero imaginary part flips it.
    """
    m = V.shape[0]
    keep = np.real(V) != 0
    if not complex_:
        T = keep | np.eye(m, dtype=bool)
        for _ in range(max(1, int(m).bit_length())):
            T = (T.astype(np.float64) @ T.astype(np.float64)) > 0
        return T, np.zeros_like(T)
    flip = np.imag(V) != 0
    adj = np.block([[keep, flip], [flip, keep]]) | np.eye(2 * m, dtype=bool)
    for _ in range(max(1, int(2 * m).bit_length())):
        adj = (adj.astype(np.float64) @ adj.astype(np.float64)) > 0
    return adj[:m, :m], adj[:m, m:]


def _arb_exp(V: np.ndarray, use_complex: bool) -> Any:
    """Arb's certified exp of V at the current python-flint precision (V's float64 values are exact)."""
    m = V.shape[0]
    if use_complex:
        return flint.acb_mat(m, m, [flint.acb(float(z.real), float(z.imag)) for z in V.flat]).exp()
    return flint.arb_mat(m, m, [float(x) for x in np.real(V).flat]).exp()


@dataclass
class _Problem:
    """One call: a stack of matrices whose exponentials are wanted, or a block of them."""

    op: str  # the op's name in messages, e.g. "matrix_exp.backward"
    what: str  # what the output is, e.g. "grad_A = L(A^H, grad)"
    name: str  # the Result's name, e.g. "matrix_exp.backward grad_A"
    fmt: Format | ComplexFormat
    V: np.ndarray  # (b, m, m) float64 or complex128: the matrices to exponentiate
    batch_shape: tuple[int, ...]
    rows: slice  # the output block of each exponential
    cols: slice
    shortcut: bool  # 1 x 1 forward: PyTorch calls exp
    model: MatrixExpModel = PYTORCH_MEXP

    @property
    def k(self) -> int:
        return self.rows.stop - self.rows.start


def _describe(pb: _Problem, parts: int) -> Callable[[int], str]:
    k = pb.k

    def describe(flat: int) -> str:
        part = flat % parts
        b, i, j = np.unravel_index(flat // parts, (pb.V.shape[0], k, k))
        index = np.unravel_index(b, pb.batch_shape) + (i, j) if pb.batch_shape else (i, j)
        where = " (imaginary part)" if part else (" (real part)" if parts == 2 else "")
        return f"{pb.op}: element {tuple(int(x) for x in index)}{where} of {pb.what}"
    return describe


def _certify(pb: _Problem, finite: list[int]) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], dict]:
    """Rounded values and float64 bounds, per part, of every element of the finite matrices."""
    pfmt = part_of(pb.fmt)
    parts = 2 if pb.fmt.is_complex else 1
    b, k = pb.V.shape[0], pb.k
    rounded = [np.zeros((b, k, k)) for _ in range(parts)]
    x_lo = [np.zeros((b, k, k)) for _ in range(parts)]
    x_hi = [np.zeros((b, k, k)) for _ in range(parts)]
    indices = []
    use_complex = {}
    for bi in finite:
        re, im = _reach(pb.V[bi], pb.fmt.is_complex)
        use_complex[bi] = bool(np.any(np.imag(pb.V[bi]) != 0))
        for p, mask in enumerate((re, im)[:parts]):
            ii, jj = np.nonzero(mask[pb.rows, pb.cols])
            indices.extend(((bi * k + ii) * k + jj) * parts + p)
    balls: dict[int, Any] = {}

    def evaluate(pending: list[int]) -> list[Any]:
        cache: dict[int, Any] = {}
        out = []
        for flat in pending:
            rest, p = divmod(flat, parts)
            rest, j = divmod(rest, k)
            bi, i = divmod(rest, k)
            if bi not in cache:
                cache[bi] = _arb_exp(pb.V[bi], use_complex[bi])
            entry = cache[bi][i + pb.rows.start, j + pb.cols.start]
            if use_complex[bi]:
                entry = entry.imag if p else entry.real
            balls[flat] = entry
            out.append(entry)
        return out

    start = 64 if pfmt.p <= 24 else 96
    # round_certified doubles the precision until it reaches the cap: keep the last step within it.
    cap = start << max(0, (MAX_PRECISION // start).bit_length() - 1)
    try:
        decided = round_certified(evaluate, [int(x) for x in indices], pfmt, _describe(pb, parts),
                                  start=start, cap=cap)
    except ReferenceUnavailableError as exc:
        norm = max(float(np.max(np.abs(pb.V[bi]).sum(axis=0))) for bi in finite)
        if norm <= _LARGE_NORM:
            raise
        raise ReferenceUnavailableError(
            f"{exc}; the precision needed also grows with the 1-norm of the matrix, here {norm:.6g}: "
            "Arb's scaling and squaring loses about log2(max exp(|A|) / |exp(A)|) bits") from None
    for flat, (r, lo, hi) in decided.items():
        p = flat % parts
        idx = np.unravel_index(flat // parts, (b, k, k))
        rounded[p][idx], x_lo[p][idx], x_hi[p][idx] = r, lo, hi
    return rounded, x_lo, x_hi, balls


def _shortcut_tolerance(x_lo: list[np.ndarray], x_hi: list[np.ndarray], V: np.ndarray,
                        fmt: Format | ComplexFormat) -> tuple[np.ndarray, np.ndarray]:
    """torch.exp of a 1 x 1 matrix: within 2 ulps for real formats, 4 ulps of |exp(a)| per complex part."""
    pfmt = part_of(fmt)
    u = pfmt.unit_roundoff
    mag = np.hypot(*[np.maximum(np.abs(lo), np.abs(hi)) for lo, hi in zip(x_lo, x_hi)]) \
        if len(x_lo) == 2 else np.maximum(np.abs(x_lo[0]), np.abs(x_hi[0]))
    with np.errstate(over="ignore"):
        E = (8 if fmt.is_complex else 4) * u * mag * (1 + 2.0 ** -40) + 2 * pfmt.min_subnormal
    # A complex exp multiplies exp(Re a), which may overflow alone, by cos and sin.
    O = (np.real(V) > math.log(pfmt.max_finite) - 1e-6) if fmt.is_complex else np.zeros(E.shape, dtype=bool)
    return E, O


def _solve(pb: _Problem, backward: Callable[[Any], Gradients] | None = None) -> Result:
    fmt = pb.fmt
    pfmt = part_of(fmt)
    parts = 2 if fmt.is_complex else 1
    b, k = pb.V.shape[0], pb.k
    finite_m = np.array([bool(np.isfinite(pb.V[bi]).all()) for bi in range(b)], dtype=bool)
    finite = [int(bi) for bi in np.nonzero(finite_m)[0]]
    rounded, x_lo, x_hi, balls = _certify(pb, finite)

    E = np.zeros((b, k, k))
    L = np.full((b, k, k), -np.inf)
    O = np.zeros((b, k, k), dtype=bool)
    for bi in finite:
        # PADE13's class holds Padé on a 1 x 1 too (JAX's expm has no shortcut); its bound on a diagonal
        # matrix also covers exp of the diagonal (scipy's shortcut).
        if pb.shortcut and pb.model != PADE13:
            E[bi], O[bi] = _shortcut_tolerance([x[bi] for x in x_lo], [x[bi] for x in x_hi], pb.V[bi], fmt)
            continue
        if pb.model == PADE13:
            E[bi], O[bi], L[bi] = _pade_tolerance(pb, bi, x_lo, x_hi)
            continue
        absV = np.abs(pb.V[bi])
        if fmt.is_complex:
            absV = absV * (1 + 2.0 ** -51)  # hypot is within an ulp
        Eb, Ob, Lb = mexp_tolerance(absV, pfmt, fmt.is_complex, batched=b > 1,
                                    diag=np.real(np.diagonal(pb.V[bi])))
        E[bi], O[bi], L[bi] = Eb[pb.rows, pb.cols], Ob[pb.rows, pb.cols], Lb[pb.rows, pb.cols]
    E = np.where(E > 0, E * _SLACK, E)

    special, accept_special = _specials(pb, finite_m, x_lo, x_hi, rounded)
    out_shape = pb.batch_shape + (k, k)
    result_parts = []
    for p in range(parts):
        part = judge(rounded[p], x_lo[p], x_hi[p], E, pfmt, special=special[p], overflow=O)
        part.special_ok |= accept_special
        _exclude_finite(part, np.isinf(E) & np.isfinite(L), L, lambda idx, p=p: balls.get(
            int(np.ravel_multi_index(idx, (b, k, k))) * parts + p), pfmt)
        _finite_tolerance(part, O)
        for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance"):
            setattr(part, name, np.asarray(getattr(part, name)).reshape(out_shape))
        result_parts.append(part)

    def exact(index: tuple[int, ...]) -> Any:
        bi = int(np.ravel_multi_index(index[:-2], pb.batch_shape)) if pb.batch_shape else 0
        flat = ((bi * k + index[-2]) * k + index[-1]) * parts
        values = [balls.get(flat + p, flint.arb(0)) for p in range(parts)]
        return values[0] if parts == 1 else flint.acb(values[0], values[1])

    return _Result(op=pb.name, fmt=fmt, parts=result_parts, model=pb.model, exact=exact, has_normal=False,
                   backward=backward, no_backward=_NO_BACKWARD, nonfinite=accept_special.reshape(out_shape))


def _pade_tolerance(pb: _Problem, bi: int, x_lo: list[np.ndarray],
                    x_hi: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PADE13's (E, O, L) on the output block of matrix bi (elementwise bounds, each within the normwise one).

    A diagonal matrix is exp of each diagonal entry (scipy's shortcut), within 2 ulps.
    """
    pfmt = part_of(pb.fmt)
    V = pb.V[bi]
    E = pade_bound(V, pfmt, pb.fmt.is_complex)[pb.rows, pb.cols]
    if not np.count_nonzero(V - np.diag(np.diagonal(V))):
        mag = [np.maximum(np.abs(lo[bi]), np.abs(hi[bi])) for lo, hi in zip(x_lo, x_hi)]
        size = np.hypot(*mag) * (1 + 2.0 ** -50) if len(mag) == 2 else mag[0]
        E = np.maximum(E, 4 * pfmt.unit_roundoff * size + 2 * pfmt.min_subnormal)
    O = ~np.isfinite(E) | (E >= pfmt.max_finite)
    with np.errstate(divide="ignore"):
        return E, O, np.where(O, np.inf, np.log2(E))


def _exclude_finite(part: Any, where: np.ndarray, L: np.ndarray, ball: Callable[[tuple], Any],
                    pfmt: Format) -> None:
    """Accept no finite value where E overflowed float64 but 2**L bounds it and exact - 2**L is past the range.

    A computed value that is finite obeys the error bound, so it lies within
    2**L of the exact value; past max_finite * (1 + 2**(1 - p)) every such
    value rounds to infinity.  Only +-inf (and NaN where O says so) remain.
    """
    limit = flint.arb(pfmt.max_finite) * (1 + flint.arb(2) ** (1 - pfmt.p))
    for idx in zip(*np.nonzero(where & np.isinf(part.rounded))):
        x = ball(tuple(int(i) for i in idx))
        if x is not None and (abs(x).lower() - flint.arb(2) ** flint.arb(float(L[idx]))) > limit:
            part.lo[idx] = part.hi[idx] = part.rounded[idx]


def _finite_tolerance(part: Any, overflow: np.ndarray) -> None:
    """Where only a possible overflow makes NaN and +-inf acceptable, report the bound on finite values.

    judge() writes inf there; but a finite value must still lie in [lo, hi], and at a
    structural zero that NaN can reach (0 * inf in a product) the only finite value is 0,
    so its tolerance stays 0 at any norm.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        tol = np.maximum(part.x_hi - part.lo, part.hi - part.x_lo)
        # inf - inf: an exact value past the range where only inf is accepted.
        tol = np.where(np.isnan(tol), np.inf, np.where(tol > 0, above(tol), 0.0))
    part.tolerance = np.where(overflow, tol, part.tolerance)


class _Result(Result):
    """A Result whose complex elements from a non-finite matrix accept any value with a NaN or infinite part.

    C99 (Annex G) counts a complex value with an infinite part as an
    infinity and one with a NaN part as a NaN, whatever the other part is;
    PyTorch returns NaN + 0j for a matrix holding NaN.
    """

    def __init__(self, *, nonfinite: np.ndarray, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._nonfinite = nonfinite

    def _covers_parts(self, got: np.ndarray) -> list[np.ndarray]:
        ok = super()._covers_parts(got)
        if len(ok) == 2 and self._nonfinite.any():
            either = self._nonfinite & ~(np.isfinite(got.real) & np.isfinite(got.imag))
            ok = [o | either for o in ok]
        return ok


def _specials(pb: _Problem, finite_m: np.ndarray, x_lo: list[np.ndarray], x_hi: list[np.ndarray],
              rounded: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per part, the special array for judge, and where NaN and +-inf are accepted.

    A matrix holding NaN or +-inf has no exact exponential: every element
    must be NaN or infinite (for complex, in at least one part), and no
    finite value is accepted.  A 1 x 1 forward follows exp: exp(NaN) = NaN,
    exp(+inf) = +inf, exp(-inf) = 0; for complex a = x + iy with x = -inf
    both parts are 0 (C99's cexp, which torch.exp follows), and otherwise
    the same rule as for larger matrices applies.
    """
    parts = len(x_lo)
    b, k = pb.V.shape[0], pb.k
    special = [np.zeros((b, k, k)) for _ in range(parts)]
    accept = np.zeros((b, k, k), dtype=bool)
    for bi in np.nonzero(~finite_m)[0]:
        a = complex(pb.V[bi].flat[0])
        if pb.shortcut and math.isinf(a.real) and a.real < 0:
            for p in range(parts):
                rounded[p][bi] = x_lo[p][bi] = x_hi[p][bi] = 0.0
        elif pb.shortcut and parts == 1:
            special[0][bi] = math.exp(a.real) if not math.isnan(a.real) else math.nan
        else:
            for p in range(parts):
                special[p][bi] = np.nan
            accept[bi] = True
    return special, accept


def _problem(op: str, what: str, fmt: Format | ComplexFormat, V: np.ndarray, n: int, frechet: bool,
             model: MatrixExpModel, name: str = "") -> _Problem:
    m = V.shape[-1]
    check_size(op, max(1, V.size) * 8, "the matrices to exponentiate")
    flat = V.reshape((math.prod(V.shape[:-2]), m, m))
    rows, cols = (slice(0, n), slice(n, 2 * n)) if frechet else (slice(0, n), slice(0, n))
    return _Problem(op, what, name or op, fmt, flat, tuple(V.shape[:-2]), rows, cols,
                    shortcut=not frechet and n == 1, model=model)


def matrix_exp(A: Any, *, model: MatrixExpModel | str = PYTORCH_MEXP) -> Result:
    """The exact matrix exponential ``exp(A)`` of a square matrix or a batch of them, rounded once.

    ``A`` has shape (..., n, n) in float16, bfloat16, float32, float64,
    complex64 or complex128.  The tolerance is that of ``model``'s algorithm
    class: ``torch.linalg.matrix_exp``'s by default, ``er.PADE13`` for
    Padé scaling and squaring (``scipy.linalg.expm``); there is no normal answer.
    ``result.exact(index)`` is a certified Arb ball (an acb for complex).

    >>> import exactref as er
    >>> er.matrix_exp(er.asarray([[0.0, 1.0], [0.0, 0.0]], "float64")).rounded.tolist()
    [[1.0, 1.0], [0.0, 1.0]]
    """
    o = _read_square(A, "A", "matrix_exp")
    model = _check_model(model, "matrix_exp", o.fmt)
    V = values_of(o, o.fmt)
    n = V.shape[-1]
    pb = _problem("matrix_exp", "exp(A)", o.fmt, V, n, frechet=False, model=model)
    return _solve(pb, backward=lambda grad: _backward(o, grad, model))


def matrix_exp_frechet(A: Any, E: Any, *, model: MatrixExpModel | str = PYTORCH_MEXP) -> Result:
    """The exact Fréchet derivative ``L(A, E)`` of the matrix exponential at A in direction E, rounded once.

    ``L(A, E)`` is the top-right block of ``exp([[A, E], [0, A]])``; A and E
    have shapes (..., n, n) whose batch dimensions broadcast, and one format.
    The tolerance is that of taking that block of ``model``'s exponential
    of the block matrix (``torch.linalg.matrix_exp``'s by default, or
    ``er.PADE13``'s).  It has no backward.
    """
    op = "matrix_exp_frechet"
    a, e = _read_square(A, "A", op), _read_square(E, "E", op)
    if a.fmt != e.fmt:
        raise TypeError(f"{op}: A has dtype {a.fmt.name} but E has dtype {e.fmt.name}; they must be the same")
    model = _check_model(model, op, a.fmt)
    n = a.shape[-1]
    if e.shape[-1] != n:
        raise ValueError(f"{op}: A has shape {a.shape} and E has shape {e.shape}; their matrices must "
                         "have the same size")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], e.shape[:-2])
    except ValueError:
        raise ValueError(f"{op}: the batch dimensions of A {a.shape[:-2]} and E {e.shape[:-2]} "
                         "do not broadcast") from None
    VA = np.broadcast_to(values_of(a, a.fmt), batch + (n, n))
    VE = np.broadcast_to(values_of(e, e.fmt), batch + (n, n))
    return _solve(_problem(op, "L(A, E)", a.fmt, _block(VA, VE), n, frechet=True, model=model))


def _backward(o: Operand, grad: Any, model: MatrixExpModel) -> Gradients:
    fmt = o.fmt
    G = read_grad(grad, fmt, tuple(o.shape), "matrix_exp")
    V = values_of(o, fmt)
    AH = np.conj(np.swapaxes(V, -1, -2)) if fmt.is_complex else np.swapaxes(V, -1, -2)
    n = V.shape[-1]
    pb = _problem("matrix_exp.backward", "grad_A = L(A^H, grad)", fmt, _block(AH, G), n, frechet=True,
                  model=model, name="matrix_exp.backward grad_A")
    return Gradients("matrix_exp.backward", {"grad_A": _solve(pb)})


def _matrix_exp_backward(A: Any, grad: Any, *, model: MatrixExpModel | str = PYTORCH_MEXP) -> Gradients:
    o = _read_square(A, "A", "matrix_exp.backward")
    return _backward(o, grad, _check_model(model, "matrix_exp.backward", o.fmt))


matrix_exp = Op("matrix_exp", matrix_exp, _matrix_exp_backward)
matrix_exp_frechet = Op("matrix_exp_frechet", matrix_exp_frechet, no_backward=_NO_BACKWARD)
