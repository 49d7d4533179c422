"""Tensor-core accumulation: what one MMA instruction does to a block of products, and its bound.

The model follows Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior
of NVIDIA tensor cores" (PeerJ CS, 2021), and Khattak and Mikaitis,
"Accurate models of NVIDIA tensor cores" (arXiv 2512.07004, 2025).  One
step of the instruction takes the float32 accumulator ``c`` and ``block``
products of the inputs:

1. the products are exact;
2. ``c`` and the products are aligned to the largest exponent among them,
   and every one is truncated (towards zero) to ``bits`` bits counted from
   that exponent's leading bit;
3. the aligned values are added exactly;
4. the sum is normalised to float32, by truncation or to nearest.

The bound (derived in docs/float8.md, "Tensor cores") follows the exact
partial sums of the chain of steps, so it is a declared order in the sense
of ``_running``: ``ErrorModel(order=tensor_core(...))`` for one chain over
the whole reduction, ``Blocked(128, inner=tensor_core(...))`` for a kernel
that promotes each 128-product partial sum into a float32 accumulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engine.fast import gamma, up
from ..formats import FLOAT32, FLOAT64

__all__ = ["NORMALIZATIONS", "TENSOR_CORES", "TensorCore", "check_tensor_core_inputs", "tensor_core", "tensor_core_error"]

NORMALIZATIONS = ("truncate", "nearest")


@dataclass(frozen=True)
class TensorCore:
    """The accumulation of one MMA instruction, applied to consecutive blocks of ``block`` products.

    ``bits`` is how many bits of every aligned addend survive, counted from
    the leading bit of the largest exponent in the step (the accumulator's
    included); ``normalization`` is how the step's exact sum becomes the
    float32 accumulator again.  ``inputs`` names the input formats the
    instruction multiplies.

    >>> from exactref.models import tensor_core
    >>> tensor_core("H100", "float8_e4m3fn")
    TensorCore(name='H100 float8', block=32, bits=14, normalization='truncate')
    """

    name: str
    block: int
    bits: int
    normalization: str = "truncate"
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("block", "bits"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TensorCore: {field}={value!r} must be a positive int")
        if self.bits > 64:
            raise ValueError(f"TensorCore: bits={self.bits!r} is more than any accumulator keeps; use 24 to 28")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"TensorCore: normalization={self.normalization!r} must be one of {NORMALIZATIONS}")

    def __repr__(self) -> str:
        return (f"TensorCore(name={self.name!r}, block={self.block}, bits={self.bits}, "
                f"normalization={self.normalization!r})")

    def __str__(self) -> str:
        return f"tensor_core({self.name})"

    @property
    def rho(self) -> float:
        """Alignment: (block + 1) addends, each losing less than 2**(1 - bits) of the step's largest magnitude."""
        return (self.block + 1) * math.ldexp(1.0, 1 - self.bits)

    @property
    def delta(self) -> float:
        """Normalisation to float32: relative error below one ulp (truncation) or half of one (nearest)."""
        return math.ldexp(1.0, -23 if self.normalization == "truncate" else -24)

    @property
    def eta(self) -> float:
        """Normalisation among float32's subnormals: one spacing (truncation) or half of one."""
        return FLOAT32.min_subnormal * (1.0 if self.normalization == "truncate" else 0.5)


_HALF = ("float16", "bfloat16")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
# (GPU, formats): block, bits, normalisation.  The blocks are the papers' (Fasi et al. for A100,
# Khattak and Mikaitis for H100 and B200); where a paper reports extra alignment bits beyond
# float32's 24 we keep 24, and for Hopper's float8 the 14 bits that the DeepSeek-V3 report
# measured (13 fraction bits).  Fewer bits give a larger, still sound, bound.  B200 float8 keeps
# Hopper's figure until it is measured here.
TENSOR_CORES: dict[tuple[str, tuple[str, ...]], tuple[int, int, str]] = {
    ("A100", _HALF): (8, 24, "truncate"),
    ("A100", ("tf32",)): (4, 24, "truncate"),
    ("H100", _HALF): (16, 24, "truncate"),
    ("H100", ("tf32",)): (8, 24, "truncate"),
    ("H100", _FP8): (32, 14, "truncate"),
    ("B200", _HALF): (16, 24, "truncate"),
    ("B200", ("tf32",)): (8, 24, "truncate"),
    ("B200", _FP8): (32, 14, "truncate"),
}
GPUS = ("A100", "H100", "B200")


def tensor_core(gpu: str, input_format: str) -> TensorCore:
    """The tensor-core accumulation of ``gpu`` ("A100", "H100" or "B200") for ``input_format``.

    ``input_format`` is what the instruction multiplies: "float16",
    "bfloat16", "tf32" (float32 inputs under
    ``float32_matmul_precision="high"``), "float8_e4m3fn" or "float8_e5m2".
    """
    if gpu not in GPUS:
        raise ValueError(f"tensor_core: gpu={gpu!r} must be one of {GPUS}")
    name = getattr(input_format, "name", input_format)
    for (g, formats), (block, bits, norm) in TENSOR_CORES.items():
        if g == gpu and name in formats:
            group = "float8" if formats == _FP8 else "/".join(formats)
            return TensorCore(f"{gpu} {group}", block, bits, norm, formats)
    have = sorted({f for (g, formats) in TENSOR_CORES if g == gpu for f in formats})
    raise ValueError(f"tensor_core: {gpu} has no tensor-core model for input_format={input_format!r}; "
                     f"it has {', '.join(have)}")


def tensor_core_error(P: np.ndarray, tc: TensorCore, S: np.ndarray, *, promote: int | None = None,
                      exact_terms: bool = True) -> tuple[np.ndarray, np.ndarray, float]:
    """(bound, peak, sensitivity) for the exact terms ``P`` (elements, n) accumulated by ``tc``.

    Without ``promote`` the chain of steps runs over all n terms from a zero
    accumulator.  With ``promote=b`` every block of b terms runs its own
    chain from zero, and the block results are added in index order into a
    float32 accumulator rounding to nearest (the DeepSeek-V3 fix).
    ``S`` bounds sum |t| per element.  ``exact_terms``: the instruction
    multiplies exactly these products, so what the alignment drops from each
    is known to be at most its remainder modulo the truncation unit; without
    it (inputs rounded to tf32 first) each addend may lose a whole unit, and
    ``sensitivity`` bounds how much the bound grows per unit of perturbation
    of the terms.  ``peak`` bounds every partial result's magnitude.
    """
    n = P.shape[-1]
    # The partial sums below are float64 sums: each within gamma_{2n} * S of the exact one.
    slack = gamma(2 * n + 4, FLOAT64.unit_roundoff) * np.broadcast_to(S, P.shape[:-1])
    chain = _chain_exact if exact_terms else _chain
    if promote is None or promote >= n:
        E, peak, sens = chain(P, tc, slack)
    else:
        E, peak, sens = _promoted(P, tc, promote, chain, slack)
    return up(E + sens * slack), up(peak + slack), sens


def _steps(P: np.ndarray, k: int) -> np.ndarray:
    """The terms as (..., steps, k), the last step padded with zeros."""
    n = P.shape[-1]
    steps = -(-n // k)
    Q = np.pad(P, [(0, 0)] * (P.ndim - 1) + [(0, steps * k - n)])
    return Q.reshape(P.shape[:-1] + (steps, k))


def _chain_exact(P: np.ndarray, tc: TensorCore, slack: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The chain of steps, with what each known product can lose to the alignment.

    Step j truncates to multiples of U = 2**(E - bits + 1), E the exponent of
    its largest addend: 2**E <= max(|c|, M_j) <= max(|s_{j-1}|, M_j) + e_{j-1}
    =: V_j, so U <= W_j, the largest power of two <= 2**(1 - bits) V_j.  The
    product t loses |t| mod U <= |t| mod W_j (U divides W_j), the accumulator
    less than U <= W_j (nothing in the first step, where it is 0).  Then
    e_j <= (1 + delta)(e_{j-1} + L_j) + delta |s_j| + eta.
    """
    Q = _steps(P, tc.block)
    steps = Q.shape[-2]
    absQ = np.abs(Q)
    M = absQ.max(axis=-1)
    s = np.cumsum(Q.sum(axis=-1), axis=-1)
    delta, eta = tc.delta, tc.eta
    unit = math.ldexp(1.0, 1 - tc.bits)
    E = np.zeros(Q.shape[:-2])
    prev = np.zeros(Q.shape[:-2])
    # Float64 slack in computing V and the remainders: a relative 2**-50 is far more than enough.
    rel = 1 + 2.0 ** -50
    for j in range(steps):
        V = (np.maximum(np.abs(prev), M[..., j]) + E + slack) * rel
        _, ex = np.frexp(unit * V)
        W = np.where(V > 0, np.ldexp(1.0, ex - 1), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            lost = np.where(W[..., None] > 0, np.fmod(absQ[..., j, :], np.where(W > 0, W, 1.0)[..., None]), 0.0)
        L = lost.sum(axis=-1) * rel + (W if j else 0.0)
        E = ((1 + delta) * (E + L) + delta * np.abs(s[..., j]) + eta) * rel
        prev = s[..., j]
    E = up(E)
    peak = np.maximum(np.abs(s).max(axis=-1), M.max(axis=-1)) + E
    # The float64 slack of the partial sums is in V already; for delta |s_j| and the remainders it
    # counts as a perturbation, which this factor covers with room to spare.
    return E, peak, steps * ((1 + delta) * 2 * (tc.block + 1) * unit + delta) * 2


def _chain(P: np.ndarray, tc: TensorCore, slack: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """The chain of steps over the last axis, from a zero accumulator.

    With e_j the error after step j, s_j the exact partial sum and M_j the
    largest |product| of the step: |e_j| <= (1 + rho)(1 + delta) |e_{j-1}|
    + (1 + delta) rho max(|s_{j-1}|, M_j) + delta |s_j| + eta.
    """
    Q = _steps(P, tc.block)
    steps = Q.shape[-2]
    totals = Q.sum(axis=-1)
    M = np.abs(Q).max(axis=-1)
    s = np.cumsum(totals, axis=-1)
    s_prev = np.concatenate([np.zeros(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    rho, delta = tc.rho, tc.delta
    grow = ((1 + rho) * (1 + delta)) ** steps * (1 + 1e-12)
    m = np.maximum(np.abs(s_prev), M)
    raw = (1 + delta) * rho * m.sum(axis=-1) + delta * np.abs(s).sum(axis=-1) + steps * tc.eta
    E = up(grow * raw)
    peak = np.maximum(np.abs(s).max(axis=-1), M.max(axis=-1)) + E
    return E, peak, grow * steps * ((1 + delta) * rho + delta)


def _promoted(P: np.ndarray, tc: TensorCore, b: int, chain, slack: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Chains over blocks of b terms, their results added by float32 additions to nearest.

    With E_b the bound of block b's chain and A_j the exact sum of the first
    j blocks: |error| <= (1 + u)^nb (sum_b E_b + u sum_{j >= 2} |A_j|).
    """
    Q = _steps(P, b)
    nb = Q.shape[-2]
    E_b, peak_b, sens_b = chain(Q, tc, slack[..., None])
    A = np.cumsum(Q.sum(axis=-1), axis=-1)
    u = FLOAT32.unit_roundoff
    grow = 1 + gamma(nb, u)
    E = up(grow * (E_b.sum(axis=-1) + u * np.abs(A[..., 1:]).sum(axis=-1)))
    peak = np.maximum(peak_b.max(axis=-1), np.abs(A).max(axis=-1)) + E
    return E, peak, grow * (nb * sens_b + u * nb)


def check_tensor_core_inputs(tc: TensorCore, multiplied: object) -> None:
    """Refuse a tensor-core model for inputs its instruction does not multiply."""
    name = getattr(multiplied, "name", multiplied)
    if not tc.inputs or name in tc.inputs:
        return
    hint = ("; float32 inputs reach a tensor core as tf32: pass float32_matmul_precision='high' with "
            "tensor_core(gpu, 'tf32')" if name in ("float32", "tf32") else "")
    raise ValueError(f"model: the {tc.name} tensor core multiplies {', '.join(tc.inputs)}, not {name}{hint}")
