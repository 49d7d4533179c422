"""A zoo of broken float8 kernels: er.scaled_matmul rejects every one of them.

Each entry returns the judgement, the broken kernel's output and a correct
kernel's output on the same inputs, so that a rejection is due to the bug
and not to inputs that no kernel could pass; some add further outputs that
must be covered (the broken kernel judged under the convention it does
follow, the promoted tensor-core kernel).  The kernels are small numpy or
torch functions written here.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import exactref as er

from .mma import tc_matmul
from .torch_helpers import to_torch

F8 = ("float8_e4m3fn", "float8_e5m2")


def f8_tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).view(getattr(torch, x.dtype.name))


def to_out(x32: np.ndarray, out: str) -> np.ndarray:
    """float32 values converted to ``out`` by torch's cast: to nearest, saturating into float8_e4m3fn."""
    t = torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32)).to(getattr(torch, out))
    if out in F8:
        return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, out))
    return er.asarray(t)


def to_out_nosat(x32: np.ndarray, out: str) -> np.ndarray:
    """ml_dtypes' conversion: to nearest, overflow to NaN (float8_e4m3fn) or inf."""
    return np.asarray(x32, dtype=np.float32).astype(getattr(ml_dtypes, out))


def correct(A, B, sa, sb, bias=None, out="float32"):
    """torch's emulated CPU kernel: float32 scaled operands, float32 matmul, + bias, one cast."""
    with torch.backends.mkldnn.flags(enabled=False):
        got = torch._scaled_mm(f8_tensor(A), f8_tensor(B), to_torch(sa), to_torch(sb),
                               bias=None if bias is None else to_torch(bias), out_dtype=getattr(torch, out))
    if out in F8:
        return got.view(torch.uint8).numpy().view(getattr(ml_dtypes, out))
    return er.asarray(got)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def matmul32(X, Y) -> np.ndarray:
    """A float32 matmul of float32 operands (numpy's BLAS)."""
    return f32(X) @ f32(Y)


# --- The broken kernels ---------------------------------------------------------------------------


def scale_after_rounding(A, B, sa, sb, out):
    """Rounds the unscaled A @ B to the output format, then scales and rounds again."""
    unscaled = to_out(matmul32(A.astype(np.float32), B.astype(np.float32)), out).astype(np.float32)
    return to_out(unscaled * f32(sa) * f32(sb), out)


def non_saturating(A, B, sa, sb, out):
    """Correct arithmetic, but the final cast overflows to NaN (or inf) instead of saturating."""
    return to_out_nosat(matmul32(A.astype(np.float32) * f32(sa), B.astype(np.float32) * f32(sb)), out)


def saturating(A, B, sa, sb, out):
    """Correct arithmetic, but the final cast saturates to the largest finite value (__NV_SATFINITE)."""
    x = matmul32(A.astype(np.float32) * f32(sa), B.astype(np.float32) * f32(sb))
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, out)).max)
    return to_out_nosat(np.clip(x, -top, top), out)


def only_scale_b(A, B, sa, sb, out):
    """Row-wise scales, but scale_a is dropped."""
    return to_out(matmul32(A.astype(np.float32), B.astype(np.float32) * f32(sb)), out)


def only_scale_a(A, B, sa, sb, out):
    """Row-wise scales, but scale_b is dropped."""
    return to_out(matmul32(A.astype(np.float32) * f32(sa), B.astype(np.float32)), out)


def truncate_to(x: np.ndarray, out: str) -> np.ndarray:
    """float32 values cast to ``out`` by truncation toward zero (chopping the extra significand bits)."""
    x = np.asarray(x, dtype=np.float64)
    p, emin = {"bfloat16": (8, -126), "float8_e4m3fn": (4, -6), "float8_e5m2": (3, -14), "float16": (11, -14)}[out]
    _, e = np.frexp(x)
    q = np.maximum(e - 1, emin) - (p - 1)
    chopped = np.ldexp(np.trunc(np.ldexp(x, -q)), q)
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, out)).max)
    # Truncation toward zero never rounds up past the largest value: saturate like torch's e4m3fn cast.
    return np.clip(chopped, -top, top).astype(getattr(ml_dtypes, out))


def truncating_cast(A, B, sa, sb, out):
    return truncate_to(matmul32(A.astype(np.float32) * f32(sa), B.astype(np.float32) * f32(sb)), out)


def tensor_core_kernel(A, B, sa, sb, *, promote):
    """H100-style float8 MMA (32 products a step, 14 bits, truncation), the scales in the float32 epilogue."""
    acc = tc_matmul(A.astype(np.float64), B.astype(np.float64), block=32, bits=14, normalization="truncate",
                    promote=promote)
    return f32(f32(acc) * f32(sa) * f32(sb))


# --- The entries ----------------------------------------------------------------------------------

RNG_SEED = 14
H100_PROMOTED = er.ErrorModel(order=er.models.Blocked(128, inner=er.models.tensor_core("H100", "float8_e4m3fn")))


def rng():
    return np.random.default_rng(RNG_SEED)


def randn(r, shape, fmt, scale=1.0):
    return er.asarray(r.standard_normal(shape) * scale, fmt)


def scale(value):
    return er.asarray(value, "float32")


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def random_case(kernel, out, scales, *, K=32, fb="float8_e4m3fn"):
    """(reference, broken kernel's output, correct kernel's output, []) on an 8 x K @ K x 8 product of random
    float8 values (B in ``fb``), with the scales ``scales(r)`` drawn after the operands."""
    r = rng()
    A, B = randn(r, (8, K), "float8_e4m3fn"), randn(r, (K, 8), fb)
    sa, sb = scales(r)
    res = er.scaled_matmul(A, B, sa, sb, out_dtype=out)
    return res, kernel(A, B, sa, sb, out), correct(A, B, sa, sb, out=out), []


def fixed(a, b):
    """Tensor-wise scales a and b."""
    return lambda r: (scale(a), scale(b))


def per_row(r):
    """Row-wise scales for an 8 x 8 output."""
    return row_scales(r, 8, 8)


@case
def a_scale_applied_after_rounding_bf16():
    return random_case(scale_after_rounding, "bfloat16", fixed(1.37, 0.61), K=64)


@case
def a_scale_applied_after_rounding_e4m3fn():
    return random_case(scale_after_rounding, "float8_e4m3fn", fixed(0.3, 0.7))


def near_overflow(r, fmt="float8_e4m3fn"):
    """Results on both sides of float8_e4m3fn's overflow threshold (464)."""
    A = er.asarray(r.uniform(10, 448, (6, 16)), fmt)
    B = er.asarray(r.uniform(0.05, 2.0, (16, 5)), fmt)
    return A, B, scale(0.5), scale(0.45)


@case
def b_nan_where_e4m3fn_saturates():
    """oneDNN's convention (NaN on overflow) judged under the default, saturating one; covered under 'nosat'."""
    A, B, sa, sb = near_overflow(rng())
    bad = non_saturating(A, B, sa, sb, "float8_e4m3fn")
    assert np.isnan(bad.astype(np.float64)).any() and np.isfinite(bad.astype(np.float64)).any()
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn")
    nosat = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn", saturation="nosat")
    return res, bad, correct(A, B, sa, sb, out="float8_e4m3fn"), [(nosat, bad)]


def e5m2_near_overflow(r):
    """float8_e5m2 inputs whose products, scaled by 1/8, mostly pass e5m2's overflow threshold (61440)."""
    A = er.asarray(r.uniform(1e4, 5.7e4, (6, 16)), "float8_e5m2")
    return A, er.asarray(r.uniform(0.5, 2, (16, 5)), "float8_e5m2")


@case
def b_inf_where_satfinite_saturates_e5m2():
    r = rng()
    A, B = e5m2_near_overflow(r)
    sa, sb = scale(0.5), scale(0.25)
    bad = non_saturating(A, B, sa, sb, "float8_e5m2")
    assert np.isinf(bad.astype(np.float64)).any()
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e5m2", saturation="satfinite")
    good = saturating(A, B, sa, sb, "float8_e5m2")
    return res, bad, good, [(er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e5m2"), bad)]


@case
def b_saturating_kernel_judged_under_nosat_e5m2():
    r = rng()
    A, B = e5m2_near_overflow(r)
    sa, sb = scale(0.5), scale(0.25)
    bad = saturating(A, B, sa, sb, "float8_e5m2")
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e5m2", saturation="nosat")
    satfinite = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e5m2", saturation="satfinite")
    return res, bad, correct(A, B, sa, sb, out="float8_e5m2"), [(satfinite, bad)]


@case
def b_saturating_kernel_judged_under_nosat_e4m3fn():
    A, B, sa, sb = near_overflow(rng())
    bad = saturating(A, B, sa, sb, "float8_e4m3fn")
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn", saturation="nosat")
    good = non_saturating(A, B, sa, sb, "float8_e4m3fn")
    return res, bad, good, [(er.scaled_matmul(A, B, sa, sb, out_dtype="float8_e4m3fn"), bad)]


def row_scales(r, M, N):
    return er.asarray(r.uniform(0.5, 2.0, (M, 1)), "float32"), er.asarray(r.uniform(0.5, 2.0, (1, N)), "float32")


@case
def c_row_scale_a_dropped():
    return random_case(only_scale_b, "float32", per_row, fb="float8_e5m2")


@case
def c_row_scale_b_dropped():
    return random_case(only_scale_a, "bfloat16", per_row)


@case
def d_truncating_cast_to_bf16():
    return random_case(truncating_cast, "bfloat16", fixed(1.37, 0.61))


@case
def d_truncating_cast_to_e4m3fn():
    return random_case(truncating_cast, "float8_e4m3fn", fixed(0.37, 0.61))


def softmax_times_values(r, M, K, N):
    """All-positive data: rows of A softmax-like probabilities (scaled up by 64), B positive values."""
    logits = r.standard_normal((M, K))
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return er.asarray(p * 64, "float8_e4m3fn"), er.asarray(r.uniform(0.25, 4.0, (K, N)), "float8_e4m3fn")


@case
def e_unpromoted_14_bit_accumulation_at_4096():
    """Hopper's float8 MMA chained over all of K; the promoted kernel (128 per float32 addition) is covered."""
    r = rng()
    A, B = softmax_times_values(r, 3, 4096, 3)
    sa, sb = scale(1.5), scale(0.75)
    res = er.scaled_matmul(A, B, sa, sb, out_dtype="float32", model=H100_PROMOTED)
    promoted = tensor_core_kernel(A, B, sa, sb, promote=128)
    bad = tensor_core_kernel(A, B, sa, sb, promote=None)
    return res, bad, correct(A, B, sa, sb, out="float32"), [(res, promoted)]


@pytest.mark.parametrize("name", list(CASES))
def test_broken_float8_kernel_is_rejected(name):
    res, bad, good, also = CASES[name]()
    assert res.covers(good).all(), "the correct kernel must be covered, or the rejection proves nothing"
    res.check(good)
    assert not res.covers(bad).all(), f"{name}: the broken kernel was accepted"
    with pytest.raises(er.MismatchError):
        res.check(bad)
    for judged, output in also:
        assert judged.covers(output).all()


def test_the_zoo_has_an_entry_of_each_kind():
    kinds = {name.split("_")[0] for name in CASES}
    assert kinds == {"a", "b", "c", "d", "e"}


def test_unpromoted_accumulation_loses_what_promotion_keeps():
    """Why (e) is caught: on all-positive data the unpromoted chain drops most of each small product."""
    r = rng()
    A, B = softmax_times_values(r, 2, 4096, 2)
    exact = A.astype(np.float64) @ B.astype(np.float64)
    one = scale(1.0)
    bad = tensor_core_kernel(A, B, one, one, promote=None).astype(np.float64)
    good = tensor_core_kernel(A, B, one, one, promote=128).astype(np.float64)
    assert np.max(np.abs(bad - exact) / exact) > 30 * np.max(np.abs(good - exact) / exact)
    assert math.isfinite(float(np.max(good)))
