"""No false alarms: PyTorch's CPU float8 kernels are covered under the default model.

``torch._scaled_mm`` on CPU takes one of two paths:

* mkldnn enabled (the default) on a CPU with AMX-INT8: oneDNN, for
  tensor-wise scales and inputs of one format.  On this machine it computes
  every product ``a * b`` exactly, multiplies it by ``scale_a`` and then
  ``scale_b`` in float32, adds the terms in index order in float32, adds
  the bias in float32; a float8 output goes through float16 (two
  roundings: er.scaled_matmul rejects some of them, see
  test_onednn_float8_output_rounds_twice_through_float16) and does not
  saturate (a float8_e4m3fn overflow is NaN) -- except the first call of
  a process, which was seen to round once and saturate.  Row-wise scales, mixed input
  formats (they need AMX-FP16) and CPUs without AMX take the other path.
* ``_scaled_mm_out_cpu_emulated`` (mkldnn disabled, aten/src/ATen/native/
  Blas.cpp): ``A.to(float) * scale_a`` and ``B.to(float) * scale_b`` in
  float32, a float32 ``at::matmul``, ``+ bias`` in float32, then ``.to(out)``
  (which saturates into float8_e4m3fn).

Which convention a float8_e4m3fn output follows is found with a probe, not
assumed.  ``torch.matmul`` on float8 inputs (2-D, and the batched and 1-D
forms that fold into one mm) is a float32 matmul cast back to float8.

Every case also records the largest ``|got - exact| / tolerance``: how much
of the bound the kernel uses (``FIGURES``; run with ``-s`` to print them).
"""

from __future__ import annotations

import functools
import math
import zlib
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest
import torch

import exactref as er

from .torch_helpers import to_torch

KS = (1, 2, 3, 16, 31, 32, 33, 128, 129, 1000, 4096)
DATA = ("random", "positive", "cancelling", "near_overflow")
OUTS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
PAIRS = (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"), ("float8_e4m3fn", "float8_e5m2"))
BIASES = (None, "float32", "bfloat16", "float16")
LARGEST = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38, "float16": 65504.0,
           "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
M, N = 6, 5

# The exact values are float64 estimates: a ratio may pass 1 by their rounding.
SLACK = 1 + 1e-9
# (test, path, kind, out) -> largest |got - exact| / tolerance (all K, and K = 4096), elements judged,
# elements that are not the correctly rounded exact value
FIGURES: dict[tuple, dict[str, float]] = {}
# (test, path, kind, out) -> elements outside the bound that oneDNN rounded twice (float32 -> float16 -> float8)
TWICE: dict[tuple, int] = {}


@contextmanager
def path(name: str):
    with torch.backends.mkldnn.flags(enabled=name == "onednn"):
        yield


def f8_tensor(x: np.ndarray) -> torch.Tensor:
    """A torch float8 tensor with the bits of a numpy float8 array."""
    dtype = getattr(torch, x.dtype.name)
    return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).view(dtype)


def from_torch(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.contiguous().view(torch.uint8).numpy().view(getattr(ml_dtypes, str(t.dtype).removeprefix("torch.")))
    return er.asarray(t)


@functools.cache
def e4m3fn_saturation(name: str, kind: str, fa: str, fb: str) -> str | None:
    """The convention of a float8_e4m3fn output on this path: None (saturating) or 'nosat', by a probe.

    448 * 448 overflows float8_e4m3fn: the emulated path's cast gives 448, oneDNN's NaN.  The
    answer depends on the scales' kind and the input formats (mixed formats need AMX-FP16 for
    oneDNN), so the probe uses the case's own.
    """
    A = f8_tensor(er.asarray(np.full((2, 2), 448.0), fa))
    B = f8_tensor(er.asarray(np.full((2, 2), 448.0), fb))
    # Row-wise scales of shape (1, 1) would count as tensor-wise: the probe needs M, N > 1.
    sa, sb = (torch.ones(()), torch.ones(())) if kind == "tensor" else (torch.ones(2, 1), torch.ones(1, 2))
    with path(name):
        # Twice: the first oneDNN call of a process was seen to round once and saturate, the later ones not.
        got = [float(torch._scaled_mm(A, B, sa, sb, out_dtype=torch.float8_e4m3fn).float()[0, 0]) for _ in range(2)][-1]
    if math.isnan(got):
        return "nosat"
    assert got == 448.0, f"the probe of the {name} path gave {got}, neither 448 nor NaN"
    return None


def data(kind: str, rng: np.random.Generator, shape: tuple[int, int], fmt: str, side: str) -> np.ndarray:
    """Float8 inputs of each flavour: spread, all positive, cancelling in pairs, near the format's top."""
    K = shape[1] if side == "A" else shape[0]
    if kind == "random":
        x = rng.standard_normal(shape) * 2.0 ** rng.integers(-4, 5, shape)
    elif kind == "positive":
        # Softmax-like probabilities (rows of A) times positive values (B): all terms add up.
        x = rng.exponential(1.0, shape)
        if side == "A":
            x = x / x.sum(axis=1, keepdims=True) * min(K, 64)
    elif kind == "cancelling":
        x = rng.standard_normal(shape)
        # Pair term k with term k + K/2 of opposite sign in A and equal in B: the exact sums
        # cancel down to the odd term and to what the float8 rounding of the copies leaves.
        half = K // 2
        if side == "A":
            x[:, half:2 * half] = -x[:, :half] * (1 + rng.uniform(-0.1, 0.1, (shape[0], half)))
        else:
            x[half:2 * half, :] = x[:half, :]
    else:
        top = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
        x = top * rng.uniform(0.5, 1.0, shape) * rng.choice([-1.0, 1.0], shape, p=[0.1, 0.9])
    return er.asarray(x, fmt)


def scales(kind: str, data_kind: str, rng: np.random.Generator, A: np.ndarray, B: np.ndarray, out: str):
    """float32 scales; for 'near_overflow' they put the results around the output format's largest value."""
    if data_kind == "near_overflow":
        typical = float(np.median(np.abs(A.astype(np.float64) @ B.astype(np.float64)))) or 1.0
        # A power of two per side, so the product lands within a factor of 2 of the largest value.
        total = round(math.log2(LARGEST[out] / typical))
        base_a, base_b = 2.0 ** (total // 2), 2.0 ** (total - total // 2)
    else:
        base_a, base_b = 1.0, 1.0
    if kind == "tensor":
        sa, sb = base_a * rng.uniform(0.7, 1.4), base_b * rng.uniform(0.7, 1.4)
        return er.asarray(sa, "float32"), er.asarray(sb, "float32")
    sa = base_a * rng.uniform(0.7, 1.4, (A.shape[0], 1))
    sb = base_b * rng.uniform(0.7, 1.4, (1, B.shape[1]))
    return er.asarray(sa, "float32"), er.asarray(sb, "float32")


def exact_estimate(A, B, sa, sb, bias):
    """float64 estimates of the exact values: the scales factor out of each sum, the float8 products are exact."""
    P = A.astype(np.float64)[:, :, None] * B.astype(np.float64)[None, :, :]
    S = np.array([[math.fsum(P[i, :, j]) for j in range(P.shape[2])] for i in range(P.shape[0])])
    with np.errstate(over="ignore", invalid="ignore"):
        X = S * np.asarray(sa, np.float64).reshape(-1, 1) * np.asarray(sb, np.float64).reshape(1, -1)
        return X if bias is None else X + bias.astype(np.float64)


def record(key, res, got, exact, K):
    """The largest |got - exact| / tolerance over the elements with a finite answer and bound.

    For outputs narrower than float32 the tolerance is mostly the final rounding, so FIGURES also
    counts the elements that are not the correctly rounded exact value.
    """
    g = np.asarray(got).astype(np.float64)
    tol = np.asarray(res.tolerance)
    ok = np.isfinite(g) & np.isfinite(exact) & np.isfinite(tol)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(ok & (tol > 0), np.abs(g - exact) / np.where(tol > 0, tol, 1.0), 0.0)
    worst = float(r.max(initial=0.0))
    off = int((ok & (g != np.asarray(res.rounded).astype(np.float64))).sum())
    old = FIGURES.get(key, {"worst": 0.0, "worst_4096": 0.0, "elements": 0, "not_nearest": 0})
    FIGURES[key] = {"worst": max(old["worst"], worst),
                    "worst_4096": max(old["worst_4096"], worst if K == 4096 else 0.0),
                    "elements": old["elements"] + int(ok.sum()), "not_nearest": old["not_nearest"] + off}
    return worst


def cases():
    """(K, data kind, input formats, bias dtype) for one (path, kind, out): every K and data kind, the rest rotating."""
    out = []
    for i, K in enumerate(KS):
        for j, d in enumerate(DATA):
            out.append((K, d, PAIRS[(i + j) % len(PAIRS)], BIASES[(i + 2 * j) % len(BIASES)]))
    return out


def scaled_mm(name, A, B, sa, sb, bias, out):
    with path(name):
        got = torch._scaled_mm(f8_tensor(A), f8_tensor(B), to_torch(sa), to_torch(sb),
                               bias=None if bias is None else to_torch(bias), out_dtype=getattr(torch, out))
    return from_torch(got)


def through_float16(name, A, B, sa, sb, bias, out):
    """oneDNN's float8 output as float32 -> float16 -> float8 (two roundings); its float16 output must be covered."""
    g16 = scaled_mm(name, A, B, sa, sb, bias, "float16")
    assert er.scaled_matmul(A, B, sa, sb, bias=bias, out_dtype="float16").covers(g16).all()
    # numpy's float16 -> ml_dtypes' float8 conversion: to nearest, overflow to NaN (e4m3fn) or inf (e5m2).
    return g16.astype(getattr(ml_dtypes, out)).astype(np.float64)


@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("kind", ["tensor", "row"])
@pytest.mark.parametrize("name", ["onednn", "emulated"])
def test_scaled_mm_is_covered(name, kind, out):
    """Every element is covered; oneDNN's float8 outputs under output_via="float16" (FIGURES counts the
    elements that only its double rounding explains)."""
    rng = np.random.default_rng(zlib.crc32(f"{name} {kind} {out}".encode()))
    twice = 0
    for K, d, (fa, fb), bias_dtype in cases():
        A, B = data(d, rng, (M, K), fa, "A"), data(d, rng, (K, N), fb, "B")
        sa, sb = scales(kind, d, rng, A, B, out)
        bias = None if bias_dtype is None else er.asarray(rng.standard_normal(N) * 4, bias_dtype)
        onednn = e4m3fn_saturation(name, kind, fa, fb) == "nosat"
        got = scaled_mm(name, A, B, sa, sb, bias, out)
        saturation = "nosat" if onednn and out == "float8_e4m3fn" else None
        via = "float16" if onednn and out.startswith("float8") else None
        res = er.scaled_matmul(A, B, sa, sb, bias=bias, out_dtype=out, saturation=saturation, output_via=via)
        covered = res.covers(got)
        if via is not None:
            # Without output_via the double rounding is rejected: each such element must be the float8
            # rounding of oneDNN's float16 result, itself covered.
            once = er.scaled_matmul(A, B, sa, sb, bias=bias, out_dtype=out, saturation=saturation).covers(got)
            g, twice_rounded = got.astype(np.float64), through_float16(name, A, B, sa, sb, bias, out)
            explained = (g == twice_rounded) | (np.isnan(g) & np.isnan(twice_rounded))
            assert (explained | once).all()
            twice += int((~once).sum())
        assert covered.all(), (f"K={K} data={d} inputs={fa},{fb} bias={bias_dtype}: not covered at "
                               f"{np.argwhere(~covered)[:3].tolist()}; got {got.astype(np.float64)[~covered][:3]}, "
                               f"rounded exact {res.rounded.astype(np.float64)[~covered][:3]}")
        res.check(got)
        worst = record(("scaled_mm", name, kind, out), res, got, exact_estimate(A, B, sa, sb, bias), K)
        assert worst <= SLACK or twice
    TWICE[("scaled_mm", name, kind, out)] = twice


def test_onednn_float8_output_rounds_twice_through_float16():
    """The finding, on one element: oneDNN gives float8(float16(x)), which er.scaled_matmul rejects.

    x = -13.4999... (float32): float16 makes it -13.5, a tie of float8_e4m3fn that goes to -14; the
    correct rounding is -13.  The emulated path (one rounding) gives -13.
    """
    A, B = er.asarray([[1.0]], "float8_e4m3fn"), er.asarray([[1.0]], "float8_e4m3fn")
    sa, sb = er.asarray(-13.4999, "float32"), er.asarray(1.0, "float32")
    if e4m3fn_saturation("onednn", "tensor", "float8_e4m3fn", "float8_e4m3fn") is None:
        pytest.skip("this machine's mkldnn path is torch's emulated kernel (no AMX-INT8): nothing to show")
    got = scaled_mm("onednn", A, B, sa, sb, None, "float8_e4m3fn")
    assert float(got[0, 0]) == -14.0
    assert float(scaled_mm("emulated", A, B, sa, sb, None, "float8_e4m3fn")[0, 0]) == -13.0
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn", saturation="nosat")
    assert not res.covers(got).any()
    assert res.covers(np.array([[-13.0]])).all()
    # Named as its class, the kernel is covered; so is the single rounding, and nothing further off.
    via = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn", saturation="nosat", output_via="float16")
    assert via.covers(got).all() and via.covers(np.array([[-13.0]])).all()
    assert not via.covers(np.array([[-12.0]])).any() and not via.covers(np.array([[-15.0]])).any()


def test_the_data_reach_overflow_and_cancellation():
    """The 'near_overflow' data overflow some float8 outputs and not others; the 'cancelling' data cancel."""
    rng = np.random.default_rng(5)
    over = under = 0
    for K in KS:
        A = data("near_overflow", rng, (M, K), "float8_e4m3fn", "A")
        B = data("near_overflow", rng, (K, N), "float8_e4m3fn", "B")
        sa, sb = scales("tensor", "near_overflow", rng, A, B, "float8_e4m3fn")
        exact = np.abs(exact_estimate(A, B, sa, sb, None))
        over, under = over + int((exact > 464).sum()), under + int((exact < 448).sum())
    assert over > 20 and under > 20
    A = data("cancelling", rng, (M, 1000), "float8_e4m3fn", "A")
    B = data("cancelling", rng, (1000, N), "float8_e4m3fn", "B")
    terms = np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64))
    assert (np.abs(exact_estimate(A, B, 1.0, 1.0, None)) < terms / 8).all()


def onednn_like(A, B, sa, sb, bias, out):
    """What this machine's oneDNN path was measured to do, in numpy: fl(fl(a*b * sa) * sb), added in index order."""
    a, b = A.astype(np.float32), B.astype(np.float32)
    sa, sb = np.float32(sa), np.float32(sb)
    acc = np.zeros((A.shape[0], B.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(A.shape[1]):
            acc = acc + (a[:, k:k + 1] * b[k:k + 1, :]) * sa * sb
        if bias is not None:
            acc = acc + bias.astype(np.float32)
    # The final conversion to nearest, as numpy and ml_dtypes convert float32.
    return acc.astype(ml_dtypes.bfloat16 if out == "bfloat16" else np.float32)


@pytest.mark.parametrize("d", ["positive", "random"])
def test_the_measured_onednn_accumulation_is_covered_at_4096(d):
    """Sequential float32 accumulation of scaled products (no machine needed): covered."""
    rng = np.random.default_rng(8)
    A, B = data(d, rng, (M, 4096), "float8_e4m3fn", "A"), data(d, rng, (4096, N), "float8_e4m3fn", "B")
    sa, sb = er.asarray(1.1, "float32"), er.asarray(0.7, "float32")
    bias = er.asarray(rng.standard_normal(N), "float32")
    for out in ("float32", "bfloat16"):
        got = onednn_like(A, B, sa, sb, bias, out)
        res = er.scaled_matmul(A, B, sa, sb, bias=bias, out_dtype=out)
        assert res.covers(got).all()
        exact = exact_estimate(A, B, sa, sb, bias)
        assert record(("onednn_like", "numpy", "tensor", out), res, got, exact, 4096) <= SLACK


# --- torch.matmul on float8 ----------------------------------------------------------------------

MATMUL_SHAPES = {
    "2d": ((M, None), (None, N)),
    "batched": ((3, M, None), (None, N)),      # folds into one mm
    "1d_left": ((None,), (None, N)),
    "batched_both": ((3, M, None), (3, None, N)),
    "1d_right": ((M, None), (None,)),
    "1d_both": ((None,), (None,)),
}


def fsum_matmul(A, B):
    """np.matmul of the float64 values with every dot product summed exactly (math.fsum), then rounded once."""
    a = A.astype(np.float64)[None] if A.ndim == 1 else A.astype(np.float64)
    b = B.astype(np.float64)[:, None] if B.ndim == 1 else B.astype(np.float64)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = np.broadcast_to(a, batch + a.shape[-2:]), np.broadcast_to(b, batch + b.shape[-2:])
    out = np.empty(batch + (a.shape[-2], b.shape[-1]))
    for idx in np.ndindex(out.shape):
        *bi, i, j = idx
        out[idx] = math.fsum(a[tuple(bi) + (i,)] * b[tuple(bi) + (slice(None), j)])
    if A.ndim == 1:
        out = out[..., 0, :]
    if B.ndim == 1:
        out = out[..., 0]
    return out


def shape_of(template, K):
    return tuple(K if s is None else s for s in template)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("form", list(MATMUL_SHAPES))
@pytest.mark.parametrize("name", ["onednn", "emulated"])
def test_float8_matmul_is_covered(name, form, fmt):
    rng = np.random.default_rng(zlib.crc32(f"{name} {form} {fmt}".encode()))
    ta, tb = MATMUL_SHAPES[form]
    for K in KS:
        for d in DATA:
            sa, sb = shape_of(ta, K), shape_of(tb, K)
            A = data(d, rng, (int(np.prod(sa[:-1], dtype=int)), K), fmt, "A").reshape(sa)
            B = data(d, rng, (K, int(np.prod(sb[1:], dtype=int)) if len(sb) > 1 else 1), fmt, "B")
            B = B.reshape(sb) if len(sb) < 3 else np.broadcast_to(B.reshape((1,) + sb[1:]), sb).copy()
            try:
                with path(name):
                    got = from_torch(torch.matmul(f8_tensor(A), f8_tensor(B)))
            except (RuntimeError, NotImplementedError) as exc:
                if "not implemented" in str(exc):
                    pytest.skip(f"torch {torch.__version__} has no float8 kernel for this form: {exc}")
                raise
            res = er.matmul(A, B)
            assert res.covers(got).all(), f"K={K} data={d}"
            exact = fsum_matmul(A, B)
            record(("matmul", name, form, fmt), res, got, exact, K)


def test_print_figures(capsys):
    """The figures of this module's cases so far (run the whole file with -s to see them)."""
    with capsys.disabled():
        print()
        for key, f in sorted(FIGURES.items()):
            extra = f", {TWICE[key]} rounded twice" if TWICE.get(key) else ""
            print(f"{' / '.join(map(str, key)):44s} max |got - exact| / tol {f['worst']:.3g} "
                  f"(K=4096: {f['worst_4096']:.3g}); {f['not_nearest']} of {f['elements']} not nearest{extra}")


def test_the_scaled_operands_roundings_are_needed_in_the_tolerance():
    """A mutation of docs/float8.md's derivation: without the roundings of s_a a and b s_b (E_in) and of an
    epilogue, the tolerance of a K = 1 product is the accumulation's gamma_1 |t| alone.  The emulated path
    rounds a' = fl(s_a a) and b' = fl(b s_b) before the product, and here lands 2.02 u |t| off: outside
    what the mutated tolerance accepts, covered by the real one.  Both acceptances are computed here
    from the exact value with the oracle's rounding, not by exactref."""
    from fractions import Fraction

    from .oracle import round_fraction

    a, b, s_a, s_b = 1.75, 1.625, float(np.float32(1.257397174835205)), float(np.float32(1.718843698501587))
    A, B = er.asarray([[a]], "float8_e4m3fn"), er.asarray([[b]], "float8_e4m3fn")
    sa, sb = er.asarray(s_a, "float32"), er.asarray(s_b, "float32")
    got = scaled_mm("emulated", A, B, sa, sb, None, "float32")
    # What the emulated path computes, in float32 steps.
    f32 = np.float32
    assert float(got[0, 0]) == float(f32(f32(f32(a) * f32(s_a)) * f32(f32(b) * f32(s_b))))
    exact = Fraction(a) * Fraction(s_a) * Fraction(b) * Fraction(s_b)
    u = Fraction(1, 2 ** 24)
    E_mutated = u / (1 - u) * abs(exact)  # gamma_1 |t|: the product's rounding, nothing else
    lo, hi = (round_fraction(exact - E_mutated, "float32"), round_fraction(exact + E_mutated, "float32"))
    assert not lo <= float(got[0, 0]) <= hi, "the mutated derivation would accept it: the test shows nothing"
    assert er.scaled_matmul(A, B, sa, sb, out_dtype="float32").covers(got).all()
