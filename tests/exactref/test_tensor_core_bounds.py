"""Every tensor-core bound in exactref holds on adversarial inputs, and breaks when its derivation is broken.

The kernels are emulated bit by bit (tests/exactref/mma.py, written from Fasi et al. 2021 and Khattak and
Mikaitis 2025, no exactref imports); the exact values are Fractions.  For each preset
``er.models.tensor_core(gpu, fmt)`` and each adversarial input the emulated output must be covered by
``er.matmul`` (float16, bfloat16; tf32 as float32 inputs under float32_matmul_precision="high") or
``er.scaled_matmul`` (float8, scales 1, float32 out), under ``ErrorModel(order=tc)`` and
``ErrorModel(order=Blocked(128, inner=tc))``, and be within ``result.tolerance`` of the exact value.  The raw
bound ``tensor_core_error`` (the derivation itself, without the output's rounding) must hold too, in both of
its forms: from the products' remainders (exact_terms=True) and the linear one (exact_terms=False).

Then mutations: each deliberate mistake in the derivation (a table row) is caught by a constructed input on
which the emulated error exceeds the mutated bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
from exactref.models import _tensor_core as T
from exactref.models._tensor_core import TensorCore, tensor_core_error

from .mma import tc_matmul

F = Fraction

# name: (dtype, significand bits, smallest normal exponent, largest exponent of a finite value)
FORMATS = {
    "float16": (np.float16, 11, -14, 15),
    "bfloat16": (ml_dtypes.bfloat16, 8, -126, 127),
    "tf32": (np.float32, 11, -126, 127),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 4, -6, 8),
    "float8_e5m2": (ml_dtypes.float8_e5m2, 3, -14, 15),
}
HALF, FP8 = ("float16", "bfloat16", "tf32"), ("float8_e4m3fn", "float8_e5m2")
PRESETS = [(g, f) for g in ("A100", "H100", "B200") for f in HALF + (FP8 if g != "A100" else ())]
PROMOTE = 128


def preset(gpu: str, fmt: str) -> TensorCore:
    return er.models.tensor_core(gpu, fmt)


# ---- values of a format, built exactly ----

def value(fmt: str, significand: float, exponent: int) -> float:
    """significand * 2**exponent, which must be a value of fmt (checked by a round trip)."""
    x = math.ldexp(significand, exponent)
    with np.errstate(over="ignore"):
        back = _tf32(x) if fmt == "tf32" else float(np.asarray(x, dtype=np.float64).astype(FORMATS[fmt][0]))
    if back != x:
        raise ValueError(f"value: {significand} * 2**{exponent} is not a {fmt} value")
    return x


def _tf32(x: float) -> float:
    """x rounded to 11 significant bits (tf32 has float32's exponents: all ours are normal)."""
    if x == 0:
        return 0.0
    m, e = math.frexp(x)
    return math.ldexp(round(m * 2 ** 11) / 2 ** 11, e)


def best_below_two(fmt: str) -> tuple[float, float]:
    """Significands (m_a, m_b) of fmt with m_a * m_b the largest product below 2."""
    p = FORMATS[fmt][1]
    grid = [1 + i * 2.0 ** (1 - p) for i in range(2 ** (p - 1))]
    if p > 4:  # (2 - 2**(1-p)) * 1 is within 2**(1-p) of 2, as close as matters
        return 2 - 2.0 ** (1 - p), 1.0
    return max(((a, b) for a in grid for b in grid if a * b < 2), key=lambda ab: ab[0] * ab[1])


def split(fmt: str, e: int) -> tuple[int, int]:
    """Exponents (ea, eb) of normal values of fmt with ea + eb = e."""
    emin, emax = FORMATS[fmt][2], FORMATS[fmt][3] - 1
    ea = max(emin, min(emax, e - e // 2))
    eb = e - ea
    if not emin <= eb <= emax:
        raise ValueError(f"split: 2**{e} is not a product of two normal {fmt} values")
    return ea, eb


def product(fmt: str, ma: float, mb: float, e: int) -> tuple[float, float]:
    """(a, b) of fmt with a * b = ma * mb * 2**e."""
    ea, eb = split(fmt, e)
    return value(fmt, ma, ea), value(fmt, mb, eb)


def big_exponent(fmt: str, tc: TensorCore) -> int:
    """An exponent eL for the accumulator such that a product just below its truncation unit exists."""
    return max(0, tc.bits + 2 * FORMATS[fmt][2])


# ---- adversarial inputs: builders return the vectors a, b of one dot product of length K ----

def stagnation(fmt: str, tc: TensorCore, K: int, *, period: int | None = None, sign: int = 1) -> tuple:
    """Alignment loss: a big first product, then products just below the accumulator's truncation unit, of
    one sign: every one is dropped.  With ``period`` the big product starts every chunk of that length."""
    eL = big_exponent(fmt, tc)
    big = product(fmt, 1.0, 1.0, eL)
    small = product(fmt, *best_below_two(fmt), eL - tc.bits)
    pairs = [big if k % (period or K) == 0 else small for k in range(K)]
    return [sign * a for a, _ in pairs], [b for _, b in pairs]


def drift(fmt: str, tc: TensorCore, K: int) -> tuple:
    """A big first product, then negative products just below its truncation unit: the accumulator stays
    at the big value while the exact partial sums sweep through zero (14 bits: about 256 steps to zero)."""
    a, b = stagnation(fmt, tc, K)
    return [a[0]] + [-x for x in a[1:]], b


def accumulator_loses(fmt: str, tc: TensorCore, K: int) -> tuple:
    """The accumulator losing bits: every other step puts bits R just below the truncation unit of a
    larger product P into c, and the next step adds P and -P: aligned to P, c drops R."""
    p = FORMATS[fmt][1]
    g = min(p, tc.bits - 2)  # R = (2**g - 1) units of c's own step
    eL = big_exponent(fmt, tc)
    uA = eL - tc.bits + 1
    L = product(fmt, 1.0, 1.0, eL)
    R = product(fmt, (2 ** g - 1) / 2 ** (g - 1), 1.0, uA + g - 1)
    P = product(fmt, 1.0, 1.0, eL + g)
    k, zero = tc.block, (0.0, 0.0)
    steps: list[list[tuple[float, float]]] = []
    for j in range(-(-K // k)):
        within = (j * k) % PROMOTE // k
        if within % 2 == 0:
            steps.append(([L] if within == 0 else []) + [R])
        else:
            steps.append([P, (-P[0], P[1])])
    pairs = [(steps[j] + [zero] * k)[i] for j in range(len(steps)) for i in range(k)][:K]
    return [x for x, _ in pairs], [y for _, y in pairs]


def cancellation(fmt: str, tc: TensorCore, K: int, *, sign: int = 1) -> tuple:
    """Large products of opposite sign that cancel in every step, beside small ones that alignment to the
    large ones drops: the exact sum is the small ones', the computed one stays near zero."""
    k = tc.block
    eP = big_exponent(fmt, tc)
    P = product(fmt, 1.0, 1.0, eP)
    small = product(fmt, *best_below_two(fmt), eP - tc.bits)
    pairs = []
    for i in range(K):
        r = i % k
        pairs.append(P if r == 0 else (-P[0], P[1]) if r == 1 else (sign * small[0], small[1]))
    return [x for x, _ in pairs], [y for _, y in pairs]


def normalisation_carry(fmt: str, tc: TensorCore, K: int) -> tuple:
    """One step whose exact sum carries past 2**m and whose low bits, (2**m - 1) units of the alignment,
    the truncation to float32 drops: a relative loss of nearly 2**-23.  Nothing is lost to alignment."""
    k, p = tc.block, FORMATS[fmt][1]
    m = math.ceil(math.log2(k - 1))
    # The smallest significand a of fmt with (k - 1) a >= 2**m.
    a = math.ceil(2 ** m / (k - 1) * 2 ** (p - 1)) / 2 ** (p - 1)
    big = (value(fmt, a, 0), value(fmt, 1.0, 0))
    low = product(fmt, (2 ** m - 1) / 2 ** (m - 1), 1.0, m - 1 - (tc.bits - 1))
    pairs = [big] * (k - 1) + [low]
    pairs = (pairs * (-(-K // k)))[:K]
    return [x for x, _ in pairs], [y for _, y in pairs]


def subnormal_sums(fmt: str, tc: TensorCore, K: int) -> tuple:
    """Steps whose exact sums are just below float32's smallest subnormal: truncated to zero every time."""
    k = tc.block
    ma, mb = best_below_two(fmt)
    e = -150 - int(math.log2(k))
    pair = product(fmt, ma, mb, e)
    return [pair[0]] * K, [pair[1]] * K


def varying(fmt: str, tc: TensorCore, K: int, *, seed: int = 0) -> tuple:
    """Random significands, signs and exponents that vary across every block."""
    rng = np.random.default_rng(seed)
    _, p, emin, emax = FORMATS[fmt]
    # float16's range is narrow: keep every partial sum of K products below its largest value.
    lo, hi = (-12, 0) if fmt == "float16" else (max(emin, -40), min(emax - 1, 40))
    out = []
    for _ in range(2):
        m = 1 + rng.integers(0, 2 ** (p - 1), K) / 2 ** (p - 1)
        e = rng.integers(lo, hi + 1, K)
        s = rng.choice([-1.0, 1.0], K)
        out.append([value(fmt, float(mi), int(ei)) * si for mi, ei, si in zip(m, e, s)])
    return out[0], out[1]


# ---- the checks ----

def as_inputs(rows: list[tuple], fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """A (M, K) and B (K, M) of fmt's dtype from M (a, b) vectors: element (i, i) is builder i's dot."""
    dtype = FORMATS[fmt][0]
    A = np.array([a for a, _ in rows], dtype=np.float64)
    B = np.array([b for _, b in rows], dtype=np.float64).T
    return A.astype(dtype), B.astype(dtype)


def judged(A: np.ndarray, B: np.ndarray, fmt: str, tc: TensorCore, promote: int | None) -> er.Result:
    order = tc if promote is None else er.models.Blocked(promote, inner=tc)
    if fmt in FP8:
        return er.scaled_matmul(A, B, np.float32(1), np.float32(1), out_dtype="float32",
                                model=er.ErrorModel(order=order))
    high = "high" if fmt == "tf32" else "highest"
    return er.matmul(A, B, model=er.ErrorModel(order=order, float32_matmul_precision=high))


def exact(A: np.ndarray, B: np.ndarray) -> list[list[Fraction]]:
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    return [[sum((F(float(x)) * F(float(y)) for x, y in zip(A64[i], B64[:, j])), F(0))
             for j in range(B.shape[1])] for i in range(A.shape[0])]


def raw_bound(A: np.ndarray, B: np.ndarray, tc: TensorCore, promote: int | None, exact_terms: bool) -> np.ndarray:
    """tensor_core_error on the exact products (float64 holds them exactly: at most 22 bits)."""
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    P = (A64[:, None, :] * B64.T[None, :, :]).reshape(-1, A.shape[1])
    S = np.array([math.fsum(row) for row in np.abs(P)]) * (1 + 2.0 ** -50)
    E, _, _ = tensor_core_error(P, tc, S, promote=promote, exact_terms=exact_terms)
    return E.reshape(A.shape[0], B.shape[1])


def failures(A: np.ndarray, B: np.ndarray, fmt: str, tc: TensorCore, promote: int | None, *,
             levels: tuple[str, ...] = ("public", "remainders", "linear")) -> list[str]:
    """What fails, if anything, for the emulated kernel on A @ B: each entry names the check and the figures."""
    emu = tc_matmul(A, B, block=tc.block, bits=tc.bits, normalization=tc.normalization, promote=promote)
    x = exact(A, B)
    out: list[str] = []

    def over(name: str, bound: np.ndarray, got: np.ndarray = emu) -> None:
        for i in range(A.shape[0]):
            for j in range(B.shape[1]):
                if not np.isfinite(got[i, j]):
                    continue  # an overflow: only `covers` can judge it
                e = abs(F(float(got[i, j])) - x[i][j])
                if e > F(float(bound[i, j])):
                    out.append(f"{name} at {(i, j)}: |emulated - exact| = {float(e):.6g} > "
                               f"{float(bound[i, j]):.6g} (ratio {float(e / F(float(bound[i, j]))):.4f})"
                               if bound[i, j] > 0 else f"{name} at {(i, j)}: error {float(e):.6g} > 0")

    if "public" in levels:
        r = judged(A, B, fmt, tc, promote)
        got = emu.astype(FORMATS[fmt][0]) if fmt in ("float16", "bfloat16") else emu
        ok = r.covers(got)
        if not ok.all():
            out.append(f"covers: {int((~ok).sum())} of {ok.size} outputs not covered")
        # The tolerance bounds the output's distance from the exact value: the kernel's output is the
        # float32 accumulator cast to the output format.
        over("tolerance", r.tolerance, got)
    if "remainders" in levels:
        over("bound (remainders)", raw_bound(A, B, tc, promote, True))
    if "linear" in levels:
        over("bound (linear)", raw_bound(A, B, tc, promote, False))
    return out


def ratio(A: np.ndarray, B: np.ndarray, tc: TensorCore, promote: int | None, exact_terms: bool) -> float:
    """The largest |emulated - exact| / bound over the outputs (for reports and tightness checks)."""
    emu = tc_matmul(A, B, block=tc.block, bits=tc.bits, normalization=tc.normalization, promote=promote)
    x = exact(A, B)
    E = raw_bound(A, B, tc, promote, exact_terms)
    return max(float(abs(F(float(emu[i, j])) - x[i][j]) / F(float(E[i, j])))
               for i in range(A.shape[0]) for j in range(B.shape[1]))


def adversarial_rows(fmt: str, tc: TensorCore, K: int) -> list[tuple]:
    rows = [stagnation(fmt, tc, K), stagnation(fmt, tc, K, period=PROMOTE, sign=-1),
            accumulator_loses(fmt, tc, K), cancellation(fmt, tc, K), varying(fmt, tc, K)]
    if tc.bits < 24:
        rows.append(drift(fmt, tc, K))
    else:
        rows.append(normalisation_carry(fmt, tc, K))
    if fmt in ("bfloat16", "tf32"):
        rows.append(subnormal_sums(fmt, tc, K))
    return rows


@pytest.mark.parametrize("promote", [None, PROMOTE], ids=["one chain", "promote 128"])
@pytest.mark.parametrize("gpu, fmt", PRESETS, ids=[f"{g}-{f}" for g, f in PRESETS])
def test_every_preset_covers_its_emulated_kernel_on_adversarial_inputs(gpu, fmt, promote):
    tc = preset(gpu, fmt)
    K = 1024
    A, B = as_inputs(adversarial_rows(fmt, tc, K), fmt)
    assert failures(A, B, fmt, tc, promote) == []


# Instructions no preset describes: normalisation to nearest (delta and eta halved), more alignment bits than
# float32 keeps (the step's sum then needs normalising more often), one product per step, 14 bits at 16.
CUSTOM = [
    ("float16", TensorCore("nearest", 16, 24, "nearest")),
    ("bfloat16", TensorCore("27 bits", 8, 27, "truncate")),
    ("float8_e4m3fn", TensorCore("one product", 1, 14, "truncate")),
    ("float8_e5m2", TensorCore("nearest 14 bits", 16, 14, "nearest")),
]


@pytest.mark.parametrize("promote", [None, PROMOTE], ids=["one chain", "promote 128"])
@pytest.mark.parametrize("fmt, tc", CUSTOM, ids=[tc.name for _, tc in CUSTOM])
def test_other_instructions_cover_their_emulated_kernels(fmt, tc, promote):
    A, B = as_inputs(adversarial_rows(fmt, tc, 512), fmt)
    assert failures(A, B, fmt, tc, promote) == []


@pytest.mark.parametrize("gpu, fmt", [("H100", f) for f in HALF + FP8])
def test_long_adversarial_sums_are_covered(gpu, fmt):
    tc = preset(gpu, fmt)
    K = 4096
    rows = [stagnation(fmt, tc, K), accumulator_loses(fmt, tc, K), cancellation(fmt, tc, K, sign=-1)]
    A, B = as_inputs(rows, fmt)
    for promote in (None, PROMOTE):
        assert failures(A, B, fmt, tc, promote) == []


@pytest.mark.parametrize("gpu, fmt", [("A100", "tf32"), ("H100", "float16"), ("H100", "float8_e4m3fn"),
                                      ("B200", "float8_e5m2")])
def test_the_remainder_bound_is_nearly_attained(gpu, fmt):
    # A bound that holds only because it is loose would hide mistakes.  On stagnation each step drops k
    # products of nearly one unit; the bound charges those, one unit for the accumulator and, at 24 bits,
    # delta |s_j| of about one unit more: k / (k + 2) of it is attained (k / (k + 1) at 14 bits).
    tc = preset(gpu, fmt)
    A, B = as_inputs([stagnation(fmt, tc, 512)], fmt)
    k = tc.block
    assert ratio(A, B, tc, None, True) > 0.97 * (k / (k + 2) if tc.bits == 24 else 0.95)


# ---- mutations: copies of the derivation with one deliberate mistake each ----

def chain_exact_copy(P: np.ndarray, tc: TensorCore, slack: np.ndarray, *, accumulator: bool = True,
                     unit_exponent: int = 1, previous_error: bool = True, largest_product: bool = True):
    """exactref.models._tensor_core._chain_exact, restated; the flags break one step of its derivation."""
    Q = T._steps(P, tc.block)
    steps = Q.shape[-2]
    absQ = np.abs(Q)
    M = absQ.max(axis=-1)
    s = np.cumsum(Q.sum(axis=-1), axis=-1)
    delta, eta = tc.delta, tc.eta
    unit = math.ldexp(1.0, unit_exponent - tc.bits)
    E = np.zeros(Q.shape[:-2])
    prev = np.zeros(Q.shape[:-2])
    rel = 1 + 2.0 ** -50
    for j in range(steps):
        V = (np.maximum(np.abs(prev), M[..., j] if largest_product else 0.0)
             + (E if previous_error else 0.0) + slack) * rel
        _, ex = np.frexp(unit * V)
        W = np.where(V > 0, np.ldexp(1.0, ex - 1), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            lost = np.where(W[..., None] > 0, np.fmod(absQ[..., j, :], np.where(W > 0, W, 1.0)[..., None]), 0.0)
        L = lost.sum(axis=-1) * rel + (W if j and accumulator else 0.0)
        E = ((1 + delta) * (E + L) + delta * np.abs(s[..., j]) + eta) * rel
        prev = s[..., j]
    E = T.up(E)
    peak = np.maximum(np.abs(s).max(axis=-1), M.max(axis=-1)) + E
    return E, peak, steps * ((1 + delta) * 2 * (tc.block + 1) * math.ldexp(1.0, 1 - tc.bits) + delta) * 2


def chain_copy(P: np.ndarray, tc: TensorCore, slack: np.ndarray | None = None, *, growth: bool = True):
    """exactref.models._tensor_core._chain (the linear bound), restated."""
    Q = T._steps(P, tc.block)
    steps = Q.shape[-2]
    M = np.abs(Q).max(axis=-1)
    s = np.cumsum(Q.sum(axis=-1), axis=-1)
    s_prev = np.concatenate([np.zeros(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    rho, delta = tc.rho, tc.delta
    grow = ((1 + rho) * (1 + delta)) ** steps * (1 + 1e-12) if growth else 1.0
    m = np.maximum(np.abs(s_prev), M)
    raw = (1 + delta) * rho * m.sum(axis=-1) + delta * np.abs(s).sum(axis=-1) + steps * tc.eta
    E = T.up(grow * raw)
    peak = np.maximum(np.abs(s).max(axis=-1), M.max(axis=-1)) + E
    return E, peak, grow * steps * ((1 + delta) * rho + delta)


def promoted_copy(P: np.ndarray, tc: TensorCore, b: int, chain, slack: np.ndarray, *, additions: bool = True):
    """exactref.models._tensor_core._promoted, restated."""
    Q = T._steps(P, b)
    nb = Q.shape[-2]
    E_b, peak_b, sens_b = chain(Q, tc, slack[..., None])
    A = np.cumsum(Q.sum(axis=-1), axis=-1)
    u = T.FLOAT32.unit_roundoff
    grow = 1 + T.gamma(nb, u)
    E = T.up(grow * (E_b.sum(axis=-1) + (u * np.abs(A[..., 1:]).sum(axis=-1) if additions else 0.0)))
    peak = np.maximum(peak_b.max(axis=-1), np.abs(A).max(axis=-1)) + E
    return E, peak, grow * (nb * sens_b + u * nb)


def promotion_rounding(fmt: str, tc: TensorCore, K: int) -> tuple:
    """Chunk results that the float32 additions of the promotion round: 1 in the first chunk, then chunks of
    0.49 ulp(1) each, every one rounded away.  Each chunk's product sits alone in the chunk's last step, so
    the chains themselves are exact and their bounds charge almost nothing."""
    last = PROMOTE - tc.block
    one = product(fmt, 1.0, 1.0, 0)
    tiny = product(fmt, *best_below_two(fmt), -25)  # just below 2**-24, half of float32's ulp at 1
    pairs = [(one if i == last else tiny if i % PROMOTE == last else (0.0, 0.0)) for i in range(K)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _patch_property(name: str, value: Callable[[TensorCore], float]):
    return lambda mp: mp.setattr(TensorCore, name, property(value))


def _patch_function(name: str, copy, **flags):
    return lambda mp: mp.setattr(T, name, functools.partial(copy, **flags))


# (mutation, patch, gpu, fmt, builder of the rows, K, promote, level at which the mutant is caught)
MUTATIONS = [
    ("accumulator charged nothing", _patch_function("_chain_exact", chain_exact_copy, accumulator=False),
     "H100", "float16", lambda f, tc, K: [accumulator_loses(f, tc, K)], 1024, None, "public"),
    ("accumulator charged nothing, promoted", _patch_function("_chain_exact", chain_exact_copy, accumulator=False),
     "H100", "float8_e4m3fn", lambda f, tc, K: [accumulator_loses(f, tc, K)], 1024, PROMOTE, "public"),
    ("truncation unit 2**-bits instead of 2**(1-bits)", _patch_function("_chain_exact", chain_exact_copy,
                                                                        unit_exponent=0),
     "H100", "float8_e4m3fn", lambda f, tc, K: [stagnation(f, tc, K)], 512, None, "public"),
    ("truncation unit 2**-bits, cancelling products", _patch_function("_chain_exact", chain_exact_copy,
                                                                       unit_exponent=0),
     "H100", "bfloat16", lambda f, tc, K: [cancellation(f, tc, K)], 1024, None, "public"),
    ("largest addend without the previous error", _patch_function("_chain_exact", chain_exact_copy,
                                                                   previous_error=False),
     "H100", "float8_e4m3fn", lambda f, tc, K: [drift(f, tc, K)], 4096, None, "public"),
    ("largest addend without the step's products", _patch_function("_chain_exact", chain_exact_copy,
                                                                    largest_product=False),
     "A100", "float16", lambda f, tc, K: [cancellation(f, tc, K)], 1024, None, "public"),
    ("delta of rounding to nearest under truncation", _patch_property("delta", lambda self: 2.0 ** -24),
     "H100", "float16", lambda f, tc, K: [normalisation_carry(f, tc, K)], 16, None, "remainders"),
    ("delta of rounding to nearest, block of 4", _patch_property("delta", lambda self: 2.0 ** -24),
     "A100", "tf32", lambda f, tc, K: [normalisation_carry(f, tc, K)], 4, None, "remainders"),
    ("eta dropped", _patch_property("eta", lambda self: 0.0),
     "H100", "bfloat16", lambda f, tc, K: [subnormal_sums(f, tc, K)], 1024, None, "remainders"),
    ("eta dropped, linear bound", _patch_property("eta", lambda self: 0.0),
     "A100", "tf32", lambda f, tc, K: [subnormal_sums(f, tc, K)], 1024, None, "linear"),
    ("promotion's float32 additions free", _patch_function("_promoted", promoted_copy, additions=False),
     "H100", "float16", lambda f, tc, K: [promotion_rounding(f, tc, K)], 4096, PROMOTE, "remainders"),
    ("linear: rho with 2**-bits", _patch_property("rho", lambda self: (self.block + 1) * 2.0 ** -self.bits),
     "H100", "tf32", lambda f, tc, K: [stagnation(f, tc, K)], 512, None, "linear"),
    ("linear: growth factor dropped", _patch_function("_chain", chain_copy, growth=False),
     "H100", "float8_e4m3fn", lambda f, tc, K: [drift(f, tc, K)], 4096, None, "linear"),
]


@pytest.mark.parametrize("mutation, patch, gpu, fmt, rows, K, promote, level", MUTATIONS,
                         ids=[m[0] for m in MUTATIONS])
def test_each_mistake_in_the_derivation_is_caught(monkeypatch, mutation, patch, gpu, fmt, rows, K, promote, level):
    tc = preset(gpu, fmt)
    A, B = as_inputs(rows(fmt, tc, K), fmt)
    assert failures(A, B, fmt, tc, promote, levels=(level,)) == []
    patch(monkeypatch)
    assert failures(A, B, fmt, tc, promote, levels=(level,)) != [], f"{mutation} survives"


def test_the_copies_are_the_derivation():
    # The mutants above are copies of exactref's functions with one flag changed: with no flag changed they
    # must be the functions themselves, else a mutant tests a derivation exactref no longer has.
    for gpu, fmt in (("H100", "float16"), ("H100", "float8_e5m2"), ("A100", "tf32")):
        tc = preset(gpu, fmt)
        A, B = as_inputs(adversarial_rows(fmt, tc, 512), fmt)
        P = (A.astype(np.float64)[:, None, :] * B.astype(np.float64).T[None, :, :]).reshape(-1, 512)
        slack = np.full(P.shape[0], 1e-30)
        for real, copy in ((T._chain_exact, chain_exact_copy), (T._chain, chain_copy)):
            for got, want in zip(copy(P, tc, slack), real(P, tc, slack)):
                np.testing.assert_array_equal(got, want)
        got = promoted_copy(P, tc, PROMOTE, T._chain_exact, slack)
        for g, w in zip(got, T._promoted(P, tc, PROMOTE, T._chain_exact, slack)):
            np.testing.assert_array_equal(g, w)


# ---- promotion, and the zoo's 14-bit kernel judged under the promoted model ----

def positive(fmt: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(shape).astype(FORMATS[fmt][0])


@pytest.mark.parametrize("gpu, fmt", [("H100", "float8_e4m3fn"), ("B200", "float8_e5m2"), ("H100", "float16")])
def test_promotion_gives_the_tighter_bound_at_4096(gpu, fmt):
    tc = preset(gpu, fmt)
    A, B = positive(fmt, (2, 4096), 5), positive(fmt, (4096, 2), 6)
    one_chain, promoted = judged(A, B, fmt, tc, None), judged(A, B, fmt, tc, PROMOTE)
    assert (promoted.tolerance <= one_chain.tolerance).all()
    # float16's output rounding can dominate both tolerances; the accumulation's own bounds still differ.
    assert (raw_bound(A, B, tc, PROMOTE, True) < raw_bound(A, B, tc, None, True)).all()
    if tc.bits < 24:
        assert (promoted.tolerance < one_chain.tolerance).all()
        # At 14 bits the one chain stagnates: its bound is far larger (about 80 against 0.6 here).
        assert (promoted.tolerance * 20 < one_chain.tolerance).all()


@pytest.mark.parametrize("gpu", ["H100", "B200"])
def test_14_bit_accumulation_without_promotion_fails_the_promoted_model(gpu):
    # The zoo item: a kernel that runs one 14-bit chain over K = 4096 (use_fast_accum=True) is judged under
    # the promoted model (what cuBLAS does without fast accumulation) and fails, while the model of what it
    # does covers it; the promoted kernel passes both.
    fmt = "float8_e4m3fn"
    tc = preset(gpu, fmt)
    A, B = positive(fmt, (4, 4096), 7), positive(fmt, (4096, 4), 8)
    fast = tc_matmul(A, B, block=tc.block, bits=tc.bits, normalization=tc.normalization)
    careful = tc_matmul(A, B, block=tc.block, bits=tc.bits, normalization=tc.normalization, promote=PROMOTE)
    promoted_model, fast_model = judged(A, B, fmt, tc, PROMOTE), judged(A, B, fmt, tc, None)
    assert not promoted_model.covers(fast).any()
    assert fast_model.covers(fast).all()
    assert promoted_model.covers(careful).all() and fast_model.covers(careful).all()


# ---- random data with exponents that vary across the block ----

HYPOTHESIS_PRESETS = [("H100", "float8_e4m3fn"), ("B200", "float8_e5m2"), ("A100", "float16"), ("H100", "float16")]


@st.composite
def tc_inputs(draw: st.DrawFn, *, fmt: str, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of fmt, (2, K) and (K, 2): significands, signs and exponents drawn per element, a few zeros."""
    if max_k < 1:
        raise ValueError(f"tc_inputs: max_k={max_k!r} must be at least 1")
    dtype, p, emin, emax = FORMATS[fmt]
    lo, hi = (-12, 0) if fmt == "float16" else (max(emin - p + 1, -60), min(emax - 1, 60))
    K = draw(st.integers(1, max_k))
    element = st.one_of(
        st.just(0.0),
        st.builds(lambda i, e, s: s * (1 + i / 2 ** (p - 1)) * 2.0 ** e,
                  st.integers(0, 2 ** (p - 1) - 1), st.integers(lo, hi), st.sampled_from([-1.0, 1.0])))
    a = draw(st.lists(element, min_size=2 * K, max_size=2 * K))
    b = draw(st.lists(element, min_size=2 * K, max_size=2 * K))
    with np.errstate(over="ignore"):
        A = np.array(a).reshape(2, K).astype(dtype)
        B = np.array(b).reshape(K, 2).astype(dtype)
    return A, B


@settings(max_examples=25, deadline=None)
@given(data=st.data(), which=st.sampled_from(HYPOTHESIS_PRESETS), promote=st.sampled_from([None, PROMOTE]))
def test_random_inputs_with_varying_exponents_are_covered(data, which, promote):
    gpu, fmt = which
    A, B = data.draw(tc_inputs(fmt=fmt, max_k=300))
    assert failures(A, B, fmt, preset(gpu, fmt), promote) == []
