"""A zoo of plausibly broken kernels: covers() rejects every one of them.

Each entry pairs a broken kernel with the correct one on the same inputs, so
that a rejection is due to the bug, and not to inputs that no kernel could
pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import exactref as er
from exactref.models import TF32_MATMUL

from .torch_helpers import to_torch

RNG = np.random.default_rng(2024)


def randn(shape, dtype, scale=1.0):
    return er.asarray(RNG.standard_normal(shape) * scale, dtype)


def crandn(shape, dtype):
    return er.asarray(RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape), dtype)


def half_accumulating_matmul(A, B):
    """Accumulates in the input's own float16, one term at a time."""
    out = np.zeros((A.shape[0], B.shape[1]), dtype=np.float16)
    for k in range(A.shape[1]):
        out = (out + (A[:, k:k + 1].astype(np.float32) * B[k:k + 1, :].astype(np.float32)).astype(np.float16))
    return out


def truncating_cast(x64, dtype):
    """float64 -> float16 by chopping the extra bits instead of rounding to nearest."""
    x = np.asarray(x64, dtype=np.float64)
    m, e = np.frexp(x)
    chopped = np.ldexp(np.trunc(np.ldexp(m, 11)), e - 11)
    return chopped.astype(dtype)


CASES = []


def case(fn):
    CASES.append(fn)
    return fn


@case
def fp16_accumulation():
    A = er.asarray(np.ones((1, 4096)), "float16")
    B = er.asarray(np.ones((4096, 1)), "float16")
    return er.matmul(A, B), half_accumulating_matmul(A, B), torch.matmul(to_torch(A), to_torch(B))


@case
def truncating_final_cast():
    A, B = randn((8, 16), "float16"), randn((16, 8), "float16")
    wide = A.astype(np.float64) @ B.astype(np.float64)
    return er.matmul(A, B), truncating_cast(wide, np.float16), torch.matmul(to_torch(A), to_torch(B))


@case
def missing_conjugate_in_backward():
    A, B, G = crandn((3, 4), "complex64"), crandn((4, 5), "complex64"), crandn((3, 5), "complex64")
    g = er.matmul.backward(A, B, G)
    bad = (G.astype(np.complex128) @ B.astype(np.complex128).T).astype(np.complex64)
    return g["grad_A"], bad, (to_torch(G) @ to_torch(B).mH)


@case
def broadcast_gradient_not_summed():
    x, y, G = randn((1, 4), "float32"), randn((3, 4), "float32"), randn((3, 4), "float32")
    g = er.add.backward(x, y, G)
    return g["grad_x"], G[:1], torch.sum(to_torch(G), dim=0, keepdim=True)


@case
def ignored_alpha():
    A, B, C = randn((4, 6), "float32"), randn((6, 3), "float32"), randn((4, 3), "float32")
    tA, tB, tC = to_torch(A), to_torch(B), to_torch(C)
    return er.gemm(A, B, C, alpha=2.5, beta=1), torch.addmm(tC, tA, tB), torch.addmm(tC, tA, tB, alpha=2.5)


@case
def ignored_beta():
    A, B, C = randn((4, 6), "float32"), randn((6, 3), "float32"), randn((4, 3), "float32")
    tA, tB, tC = to_torch(A), to_torch(B), to_torch(C)
    return er.gemm(A, B, C, alpha=1, beta=0.5), torch.addmm(tC, tA, tB), torch.addmm(tC, tA, tB, beta=0.5)


@case
def subnormals_flushed_to_zero():
    x = er.asarray([2.0 ** -70, 3.0 * 2.0 ** -80, 1.0], "float32")
    y = er.asarray([2.0 ** -70, 2.0 ** -60, 1.0], "float32")
    wide = x.astype(np.float64) * y.astype(np.float64)
    flushed = np.where(np.abs(wide) < 2.0 ** -126, 0.0, wide).astype(np.float32)
    return er.multiply(x, y), flushed, torch.mul(to_torch(x), to_torch(y))


@case
def nan_swallowed():
    A = er.asarray([[1.0, np.nan], [2.0, 3.0]], "float32")
    B = er.asarray([[1.0, 2.0], [3.0, 4.0]], "float32")
    bad = np.nan_to_num(A) @ B
    return er.matmul(A, B), bad, torch.matmul(to_torch(A), to_torch(B))


@case
def skip_zero_entries_loses_zero_times_inf():
    A = er.asarray([[0.0, 1.0]], "float32")
    B = er.asarray([[np.inf], [2.0]], "float32")
    # "if a == 0: continue" in the inner loop: 0 * inf never happens, so no NaN.
    bad = np.array([[sum(a * b for a, b in zip(A[0], B[:, 0]) if a != 0)]], dtype=np.float32)
    return er.matmul(A, B), bad, torch.matmul(to_torch(A), to_torch(B))


@case
def half_sum_accumulated_in_half():
    x = er.asarray(RNG.uniform(0.5, 1.5, 5000), "float16")
    bad = np.float16(0)
    for v in x:
        bad = np.float16(bad + v)
    return er.sum(x), np.array(bad), torch.sum(to_torch(x))


@case
def multiply_gradient_without_conjugate():
    x, y, G = crandn((5,), "complex64"), crandn((5,), "complex64"), crandn((5,), "complex64")
    g = er.multiply.backward(x, y, G)
    bad = (G.astype(np.complex128) * y.astype(np.complex128)).astype(np.complex64)
    return g["grad_x"], bad, to_torch(G) * to_torch(y).conj()


@case
def tf32_inputs_judged_as_full_float32():
    A, B = randn((16, 64), "float32"), randn((64, 16), "float32")
    bad = (_round_to_bits(A, 11).astype(np.float64) @ _round_to_bits(B, 11).astype(np.float64)).astype(np.float32)
    return er.matmul(A, B), bad, torch.matmul(to_torch(A), to_torch(B))


@case
def gemm_gradient_missing_alpha():
    A, B, C, G = (randn(s, "float32") for s in ((4, 6), (6, 3), (4, 3), (4, 3)))
    g = er.gemm.backward(A, B, C, G, alpha=3.0, beta=1.0)
    bad = (G.astype(np.float64) @ B.astype(np.float64).T).astype(np.float32)
    good = 3.0 * (to_torch(G) @ to_torch(B).T)
    return g["grad_A"], bad, good


def _round_to_bits(v, p):
    """float32 values rounded to p significant bits (nearest, ties to even), as TF32 keeps."""
    m, e = np.frexp(v.astype(np.float64))
    return np.ldexp(np.rint(np.ldexp(m, p)), e - p).astype(np.float32)


@case
def one_ulp_off_addition():
    x, y = randn((64,), "float32"), randn((64,), "float32")
    good = torch.add(to_torch(x), to_torch(y))
    bad = np.nextafter(good.numpy(), np.float32(np.inf))
    return er.add(x, y), bad, good


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_broken_kernel_is_rejected_and_correct_one_covered(make):
    ref, bad, good = make()
    assert ref.covers(good).all(), "the correct kernel must be covered on these inputs"
    assert not ref.covers(bad).all(), "the broken kernel must be rejected"


def test_zoo_has_at_least_ten_kernels():
    assert len(CASES) >= 10


def test_tf32_kernel_is_covered_under_the_tf32_model():
    A, B = randn((16, 64), "float32"), randn((64, 16), "float32")
    tf32 = (_round_to_bits(A, 11).astype(np.float64) @ _round_to_bits(B, 11).astype(np.float64)).astype(np.float32)
    assert er.matmul(A, B, model=TF32_MATMUL).covers(tf32).all()
    assert not er.matmul(A, B).covers(tf32).all()


def test_half_accumulation_is_covered_under_reduced_precision_model():
    A = er.asarray(np.ones((1, 4096)), "float16")
    B = er.asarray(np.ones((4096, 1)), "float16")
    bad = half_accumulating_matmul(A, B)
    assert er.matmul(A, B, model=er.models.REDUCED_PRECISION_REDUCTION).covers(bad).all()
