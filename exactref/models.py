"""Error models: what a tolerance assumes about the implementation being judged.

An :class:`ErrorModel` names an algorithm class.  The tolerance of an element
is how far any implementation in that class can be from the exact value; the
formulas are in ``docs/tolerance-models.md``.  The building block is the
classical bound for a sum of ``n`` terms accumulated in a format with unit
roundoff ``u``, in any order: every term passes through at most ``d``
roundings, so the computed sum is within ``gamma_d * sum|terms|`` of the
exact one, with ``gamma_d = d*u / (1 - d*u)`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, Lemma 3.1 and section 3.1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .engine.fast import gamma, up
from .formats import BFLOAT16, FLOAT32, TF32, Format
from .rounding import round_float64

__all__ = [
    "BF16_MATMUL",
    "DEFAULT",
    "PYTORCH_AUTOGRAD",
    "REDUCED_PRECISION_REDUCTION",
    "TF32_MATMUL",
    "ErrorModel",
]

_ACCUMULATIONS = ("float32", "input")
_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class ErrorModel:
    """An algorithm class that tolerances are computed for.

    accumulation
        ``"float32"``: sums of float16 and bfloat16 values are accumulated in
        float32 (PyTorch's CPU kernels, and cuBLAS with its reduced-precision
        flags off).  ``"input"``: sums are accumulated in the input's own
        format, as cuBLAS may when
        ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``
        or ``allow_bf16_reduced_precision_reduction`` is set.
    float32_matmul_precision
        As ``torch.set_float32_matmul_precision``: ``"highest"`` multiplies
        float32 matmul inputs as they are, ``"high"`` rounds them to TF32 (10
        fraction bits) first, ``"medium"`` to bfloat16.
    autograd_roundings
        Also budget the extra roundings PyTorch's autograd makes: per-batch
        products rounded before broadcast copies are summed (matmul with two
        batched operands, multiply), and alpha applied after the product has
        been rounded (gemm, add).
    """

    name: str = "default"
    accumulation: Literal["float32", "input"] = "float32"
    float32_matmul_precision: Literal["highest", "high", "medium"] = "highest"
    autograd_roundings: bool = False

    def __post_init__(self) -> None:
        if self.accumulation not in _ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r} is not one of {_ACCUMULATIONS}")
        if self.float32_matmul_precision not in _PRECISIONS:
            raise ValueError(
                f"float32_matmul_precision={self.float32_matmul_precision!r} is not one of {_PRECISIONS}")

    def replace(self, **changes: object) -> ErrorModel:
        """A copy with some fields changed, for combining models: ``TF32_MATMUL.replace(autograd_roundings=True)``."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.name


#: PyTorch's CPU kernels: float32 accumulation for half types, any summation order.
DEFAULT = ErrorModel()
#: Sums of half types accumulated in the half format itself.
REDUCED_PRECISION_REDUCTION = ErrorModel("reduced_precision_reduction", accumulation="input")
#: float32 matmul inputs rounded to TF32, as set_float32_matmul_precision("high").
TF32_MATMUL = ErrorModel("tf32_matmul", float32_matmul_precision="high")
#: float32 matmul inputs rounded to bfloat16, as set_float32_matmul_precision("medium").
BF16_MATMUL = ErrorModel("bf16_matmul", float32_matmul_precision="medium")
#: The default plus the extra roundings of PyTorch's autograd formulas.
PYTORCH_AUTOGRAD = ErrorModel("pytorch_autograd", autograd_roundings=True)


def check_model(model: object, argument: str = "model") -> ErrorModel:
    if not isinstance(model, ErrorModel):
        raise TypeError(f"{argument}={model!r} is not an ErrorModel; use one of "
                        "er.models.DEFAULT, REDUCED_PRECISION_REDUCTION, TF32_MATMUL, BF16_MATMUL, "
                        "PYTORCH_AUTOGRAD or ErrorModel(...)")
    return model


def opmath_format(fmt: Format) -> Format:
    """The format PyTorch computes elementwise ops of ``fmt`` in: float32 for half types."""
    return fmt if fmt.p >= FLOAT32.p else FLOAT32


def accumulation_format(model: ErrorModel, fmt: Format) -> Format:
    """The format sums of ``fmt`` values are accumulated in under ``model``."""
    return fmt if model.accumulation == "input" else opmath_format(fmt)


def matmul_input_format(model: ErrorModel, fmt: Format) -> Format | None:
    """The format float32 matmul inputs are rounded to before multiplying, if any."""
    if fmt != FLOAT32:
        return None
    return {"highest": None, "high": TF32, "medium": BFLOAT16}[model.float32_matmul_precision]


def products_exact(p_in: int, acc: Format) -> bool:
    return 2 * p_in <= acc.p


def products_may_underflow(fin: Format, acc: Format) -> bool:
    return 2 * (fin.emin - fin.p + 1) < acc.emin


def dot_error(S: np.ndarray, *, depth: int, acc: Format, out: Format, terms: int = 0,
              underflow: bool = False) -> np.ndarray:
    """Bound on |computed - exact| before the final rounding to ``out``.

    ``depth`` is the number of roundings in ``acc`` along any term's path
    (additions, rounded products, scalar multiplies).  When ``acc`` is the
    output format, the last of them *is* the final rounding and is budgeted
    by the acceptance interval instead.  ``underflow`` adds half a subnormal
    spacing of ``acc`` per term for products that may underflow.
    """
    k = depth - 1 if acc == out else depth
    E = gamma(max(k, 0), acc.unit_roundoff) * S if k > 0 else np.zeros_like(S)
    # An underflowing rounding breaks the relative bound, unless it is the final rounding itself.
    underflow = bool(underflow and terms and (k > 0 or acc != out))
    if underflow:
        E = E + terms * acc.min_subnormal
    return up(E) if k > 0 or underflow else E


def overflow_possible(S: np.ndarray, acc: Format, depth: int = 1) -> np.ndarray:
    """Where a partial result in ``acc`` may overflow although the exact value need not."""
    return S * (1 + gamma(max(depth, 1), acc.unit_roundoff)) >= acc.max_finite


def partials_error(S: np.ndarray, *, copies: int, per_copy_depth: int, acc: Format, out: Format) -> np.ndarray:
    """Bound for ``copies`` partial results, each rounded to ``out``, then summed in ``acc``.

    This is PyTorch's autograd for a broadcast operand: a per-copy product
    (``per_copy_depth`` roundings in ``acc``) is stored in the output dtype,
    and ``sum_to_size`` adds the copies.  S bounds the sum of |terms| over
    all copies.
    """
    u_out = out.unit_roundoff
    if acc == out:
        f1 = gamma(per_copy_depth, acc.unit_roundoff)
    else:
        g = gamma(per_copy_depth, acc.unit_roundoff)
        f1 = g + u_out * (1 + g)
    k2 = copies - 2 if acc == out else copies - 1
    g2 = gamma(max(k2, 0), acc.unit_roundoff) if k2 > 0 else 0.0
    E = (f1 + g2 * (1 + f1)) * S + copies * out.min_subnormal
    return up(E)


def widening_error(E: np.ndarray, S: np.ndarray, via: Format, target: Format) -> np.ndarray:
    """Add the rounding to ``via`` of a result later widened to ``target`` (exactly), if ``via`` is narrower."""
    if via.p >= target.p:
        return E
    return up(E + via.unit_roundoff * (S + E) + via.min_subnormal)


def scalar_error(value: float | complex, fmt: Format) -> float:
    """|value - value rounded to fmt| for a Python scalar (each part, summed, for complex)."""
    total = 0.0
    for part in (value.real, value.imag) if isinstance(value, complex) else (value,):
        r = float(round_float64(np.asarray(part, dtype=np.float64), fmt))
        total += abs(part - r) if math.isfinite(r) else math.inf
    return total
