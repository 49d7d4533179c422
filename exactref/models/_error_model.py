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
from dataclasses import dataclass
from typing import Literal

from ..formats import BFLOAT16, FLOAT32, TF32, Format
from ._orders import Order, check_order

__all__ = [
    "BF16_MATMUL",
    "DEFAULT",
    "PYTORCH_AUTOGRAD",
    "REDUCED_PRECISION_REDUCTION",
    "TF32_MATMUL",
    "ErrorModel",
    "accumulation_format",
    "check_model",
    "matmul_input_format",
    "opmath_format",
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
    order
        The summation order of every reduction of the op (matmul's K, sum's
        axes, the gradients' contractions): ``"any"`` (the default: sound
        for a kernel whose order is unknown, such as a BLAS), ``"sequential"``,
        ``"pairwise"`` (numpy's pairwise summation), ``Blocked(size, inner,
        splits)`` (a tiled kernel's BLOCK_K loop) or ``tensor_core(gpu,
        input_format)`` (the MMA steps of a tensor core, alone or as a
        ``Blocked`` inner order; see docs/float8.md).  A declared order gets a
        bound from the exact partial sums of that order, far tighter at
        large sizes.  Complex ops and the per-copy roundings of
        ``autograd_roundings`` keep the bound for any order.
    failure_rate
        None (the default) for sound bounds.  A number such as ``1e-12``
        asks for a probabilistic bound instead, that a correct kernel
        exceeds with at most that probability per element *if* its rounding
        errors are independent and of mean zero.  That fails for constant or
        integer data and for stagnating long sums; see
        ``docs/tolerance-models.md``.  Reports then say "probabilistic".
    flush_subnormals
        Also accept kernels that flush subnormal inputs and results to zero,
        as XLA on the CPU does and GPU code compiled with flush-to-zero: an
        output is covered for the inputs as given or with their subnormals
        replaced by zeros, each tolerance widened by ``(2n + 4)`` times the
        smallest normal of the formats involved (n: the elements the op
        reads), and zero accepted where the answer may be subnormal.  For
        matmul, gemm, add, multiply and sum, forward and backward.
    """

    name: str = "default"
    accumulation: Literal["float32", "input"] = "float32"
    float32_matmul_precision: Literal["highest", "high", "medium"] = "highest"
    autograd_roundings: bool = False
    order: Order = "any"
    failure_rate: float | None = None
    flush_subnormals: bool = False

    def __post_init__(self) -> None:
        check_order(self.order)
        rate = self.failure_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not 0 < rate < 1):
            raise ValueError(f"failure_rate={rate!r} must be None (sound bounds) or a probability "
                             "between 0 and 1, such as 1e-12")
        if not isinstance(self.flush_subnormals, bool):
            raise TypeError(f"flush_subnormals={self.flush_subnormals!r} must be True or False")
        if self.accumulation not in _ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r} is not one of {_ACCUMULATIONS}")
        if self.float32_matmul_precision not in _PRECISIONS:
            raise ValueError(
                f"float32_matmul_precision={self.float32_matmul_precision!r} is not one of {_PRECISIONS}")

    def replace(self, **changes: object) -> ErrorModel:
        """A copy with some fields changed, for combining models: ``TF32_MATMUL.replace(autograd_roundings=True)``."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        extra = [f"order={self.order}"] if self.order != "any" else []
        if self.failure_rate is not None:
            extra.append(f"probabilistic, failure_rate={self.failure_rate:g}")
        if self.flush_subnormals:
            extra.append("flush_subnormals")
        return self.name + (f" ({', '.join(extra)})" if extra else "")


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
