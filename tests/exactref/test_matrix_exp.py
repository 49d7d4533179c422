"""matrix_exp, matrix_exp_frechet and matrix_exp.backward against an independent oracle.

The oracle is mpmath's ``expm`` at 320 bits, with the Fréchet derivative
taken as the top-right block of the exponential of ``[[A, E], [0, A]]``,
rounded by ``oracle.round_fraction``.  Nothing here shares code with the
engine (Arb balls, Ziv's strategy, rounding of dyadics).

Also here: structural zeros, zero by cancellation, special values, overflow
and argument validation.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import ml_dtypes
import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er

from .oracle import bits_equal, round_fraction

ORACLE_BITS = 320
ALL_FORMATS = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
KINDS = ["dense", "upper", "lower", "diagonal", "nilpotent", "sparse"]
DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "complex64": np.complex64, "complex128": np.complex128}
PART = {"complex64": "float32", "complex128": "float64"}


# ---------------------------------------------------------------- generation

def shaped(M: np.ndarray, kind: str, mask: np.ndarray) -> np.ndarray:
    n = M.shape[-1]
    if kind == "upper":
        return np.triu(M)
    if kind == "lower":
        return np.tril(M)
    if kind == "diagonal":
        return M * np.eye(n)
    if kind == "nilpotent":
        return np.triu(M, 1)
    if kind == "sparse":
        return M * mask
    return M


def to_format(M: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(M).astype(DTYPES[fmt])


@st.composite
def square(draw: st.DrawFn, *, formats: list[str], max_n: int, n: int | None = None,
           log_norm: tuple[float, float] = (-3.0, 1.0)) -> tuple[np.ndarray, str]:
    """(A, format): a matrix of a given kind whose 1-norm is within a factor sqrt(2) of 10**log_norm."""
    fmt = draw(st.sampled_from(formats))
    n = draw(st.integers(1, max_n)) if n is None else n
    kind = draw(st.sampled_from(KINDS))
    cplx = fmt.startswith("complex")
    raw = draw(hnp.arrays(np.float64, (2 if cplx else 1, n, n), elements=st.floats(-1, 1, width=16)))
    mask = draw(hnp.arrays(np.bool_, (n, n)))
    M = shaped(raw[0] + 1j * raw[1] if cplx else raw[0], kind, mask)
    norm = float(np.abs(M).sum(axis=0).max())
    if norm > 0:
        target = 10.0 ** draw(st.floats(*log_norm))
        M = M * 2.0 ** round(math.log2(target / norm))  # a power of two keeps the values exact
    return to_format(M, fmt), fmt


def gradient(draw: st.DrawFn, shape: tuple[int, ...], fmt: str) -> np.ndarray:
    cplx = fmt.startswith("complex")
    raw = draw(hnp.arrays(np.float64, (2 if cplx else 1,) + shape, elements=st.floats(-4, 4, width=16)))
    return to_format(raw[0] + 1j * raw[1] if cplx else raw[0], fmt)


# ---------------------------------------------------------------- the oracle

def mp_matrix(M: np.ndarray) -> mpmath.matrix:
    M = np.asarray(M).astype(np.complex128 if np.iscomplexobj(M) else np.float64)
    conv = (lambda z: mpmath.mpc(z.real, z.imag)) if np.iscomplexobj(M) else mpmath.mpf
    return mpmath.matrix([[conv(x) for x in row] for row in M])


def expm_oracle(M: np.ndarray) -> mpmath.matrix:
    with mpmath.workprec(ORACLE_BITS):
        return mpmath.expm(mp_matrix(M))


def frechet_oracle(A: np.ndarray, E: np.ndarray) -> mpmath.matrix:
    """L(A, E): the top-right block of exp([[A, E], [0, A]])."""
    n = A.shape[-1]
    block = np.zeros((2 * n, 2 * n), dtype=np.result_type(A, E, np.float64))
    block[:n, :n] = block[n:, n:] = A
    block[:n, n:] = E
    full = expm_oracle(block)
    return mpmath.matrix([[full[i, n + j] for j in range(n)] for i in range(n)])


def to_fraction(x: mpmath.mpf) -> Fraction:
    sign, man, exp, _ = x._mpf_  # mpf's man_exp drops the sign
    if not man:
        return Fraction(0)
    return (-1) ** sign * Fraction(int(man)) * Fraction(2) ** int(exp)


def rounded_oracle(values: mpmath.matrix, fmt: str) -> list[np.ndarray]:
    """Each part of each element rounded once to fmt's part format."""
    part = PART.get(fmt, fmt)
    n = values.rows
    parts = [np.zeros((n, n)), np.zeros((n, n))]
    for i in range(n):
        for j in range(n):
            z = mpmath.mpc(values[i, j])
            parts[0][i, j] = round_fraction(to_fraction(z.real), part)
            parts[1][i, j] = round_fraction(to_fraction(z.imag), part)
    return parts if fmt.startswith("complex") else parts[:1]


def assert_bits(got: np.ndarray, expected: list[np.ndarray], fmt: str) -> None:
    got = np.asarray(got).astype(np.complex128 if fmt.startswith("complex") else np.float64)
    parts = [got.real, got.imag] if fmt.startswith("complex") else [got]
    for p, (g, e) in enumerate(zip(parts, expected)):
        assert bits_equal(g, e), f"part {p}: got {g.tolist()}, oracle {e.tolist()}"


# ---------------------------------------------------------------- oracle agreement

@settings(max_examples=150)
@given(square(formats=ALL_FORMATS, max_n=8))
def test_matrix_exp_is_the_oracle_rounded_once(case):
    A, fmt = case
    r = er.matrix_exp(A)
    assert r.dtype == np.dtype(DTYPES[fmt]) and r.shape == A.shape
    assert_bits(r.rounded, rounded_oracle(expm_oracle(A), fmt), fmt)


@settings(max_examples=80)
@given(st.data())
def test_matrix_exp_frechet_is_the_oracle_rounded_once(data):
    A, fmt = data.draw(square(formats=ALL_FORMATS, max_n=8))
    E = gradient(data.draw, A.shape, fmt)
    r = er.matrix_exp_frechet(A, E)
    assert_bits(r.rounded, rounded_oracle(frechet_oracle(A, E), fmt), fmt)


@settings(max_examples=80)
@given(st.data())
def test_matrix_exp_backward_is_the_oracle_rounded_once(data):
    A, fmt = data.draw(square(formats=ALL_FORMATS, max_n=8))
    G = gradient(data.draw, A.shape, fmt)
    g = er.matrix_exp.backward(A, G)
    # grad_A = L(A^H, grad): the adjoint of the Fréchet derivative, the spec's formula.
    assert_bits(g.rounded.grad_A, rounded_oracle(frechet_oracle(np.conj(A.T), G), fmt), fmt)
    assert bits_equal(er.matrix_exp(A).backward(G).rounded.grad_A.astype(np.complex128).view(np.float64),
                      g.rounded.grad_A.astype(np.complex128).view(np.float64))


@settings(max_examples=20)
@given(square(formats=["float64", "complex128"], max_n=5))
def test_exact_is_a_certified_ball_around_the_oracle(case):
    A, fmt = case
    r = er.matrix_exp(A)
    want = expm_oracle(A)
    for i in range(A.shape[0]):
        for j in range(A.shape[1]):
            ball = r.exact((i, j))
            z = mpmath.mpc(want[i, j])
            parts = [(ball.real, z.real), (ball.imag, z.imag)] if fmt == "complex128" else [(ball, z.real)]
            for b, v in parts:
                mid, rad = to_fraction(mpmath.mpf(b.mid().str(200, radius=False))), b.rad()
                slack = abs(to_fraction(v)) * Fraction(2) ** -250 + Fraction(2) ** -1000
                assert abs(to_fraction(v) - mid) <= Fraction(str(rad.str(30, radius=False))) * 2 + slack


def test_batches_are_each_matrix_rounded_once():
    rng = np.random.default_rng(7)
    A = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    r = er.matrix_exp(A)
    assert r.shape == (2, 3, 4, 4)
    for b in np.ndindex(2, 3):
        assert_bits(r.rounded[b], rounded_oracle(expm_oracle(A[b]), "float32"), "float32")


def test_frechet_broadcasts_batch_dimensions():
    rng = np.random.default_rng(8)
    A = rng.standard_normal((3, 3)) / 4
    E = rng.standard_normal((2, 3, 3))
    r = er.matrix_exp_frechet(A, E)
    assert r.shape == (2, 3, 3)
    for b in range(2):
        assert_bits(r.rounded[b], rounded_oracle(frechet_oracle(A, E[b]), "float64"), "float64")


def test_empty_matrices_give_empty_results():
    assert er.matrix_exp(np.zeros((0, 0))).shape == (0, 0)
    assert er.matrix_exp(np.zeros((0, 3, 3), dtype=np.float32)).shape == (0, 3, 3)
    assert er.matrix_exp.backward(np.zeros((2, 0, 0)), np.zeros((2, 0, 0)))["grad_A"].shape == (2, 0, 0)


# ---------------------------------------------------------------- structural zeros and cancellation

@pytest.mark.parametrize("fmt", ["float32", "float64", "complex64", "complex128"])
def test_structural_zeros_below_the_diagonal_are_exact_and_demanded(fmt):
    rng = np.random.default_rng(1)
    M = np.triu(rng.standard_normal((5, 5)) + (1j * rng.standard_normal((5, 5)) if "complex" in fmt else 0))
    A = to_format(M, fmt)
    r = er.matrix_exp(A)
    lower = np.tril(np.ones((5, 5), dtype=bool), -1)
    assert np.all(r.rounded[lower] == 0) and not np.signbit(r.rounded[lower].real).any()
    # PyTorch's products of upper-triangular matrices keep the zeros, and nothing else is accepted there.
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()
    nudged = r.rounded.copy()
    nudged[lower] = np.finfo(nudged.real.dtype).tiny
    assert not r.covers(nudged)[lower].any()
    assert all(str(r.exact(tuple(ij))) in ("0", "0 + 0j", "0j") for ij in np.argwhere(lower))


def test_entries_no_walk_reaches_are_exact_zeros_in_blocks_and_in_frechet():
    A = np.zeros((4, 4))
    A[:2, :2] = [[0.5, 1.25], [-2.0, 0.75]]
    A[2:, 2:] = [[1.0, 3.0], [0.0, -1.0]]
    r = er.matrix_exp(A)
    assert np.all(r.rounded[:2, 2:] == 0) and np.all(r.rounded[2:, :2] == 0)
    # L(D, E) of a diagonal D vanishes wherever E does.
    D = np.diag([0.5, -1.0, 2.0])
    E = np.zeros((3, 3))
    E[0, 2] = 1.5
    L = er.matrix_exp_frechet(D, E)
    assert np.count_nonzero(L.rounded) == 1 and L.rounded[0, 2] == rounded_oracle(frechet_oracle(D, E), "float64")[0][0, 2]


def test_parts_no_walk_produces_are_exact_zeros():
    # exp(iB) = cos(B) + i sin(B): with B bipartite, cos(B) vanishes across the sides and sin(B) within them.
    A = np.array([[0, 0.75j, 0], [-1.5j, 0, 0.5j], [0, 2j, 0]], dtype=np.complex128)
    r = er.matrix_exp(A)
    across = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=bool)
    assert np.all(r.rounded.real[across] == 0) and np.all(r.rounded.imag[~across] == 0)
    assert_bits(r.rounded, rounded_oracle(expm_oracle(A), "complex128"), "complex128")
    # A real matrix stored as complex: every imaginary part is exactly zero.
    R = er.matrix_exp(np.array([[1.0, 2.0], [3.0, -4.0]], dtype=np.complex64))
    assert np.all(R.rounded.imag == 0)


def test_zero_by_cancellation_raises_naming_the_element_in_bounded_time():
    # exp(aI + N) = e^a (I + N + N^2/2), whose (0, 2) entry is e^a (1 + (-2)/2) = 0.
    A = np.array([[0.5, 1.0, 1.0], [0.0, 0.5, -2.0], [0.0, 0.0, 0.5]])
    start = time.perf_counter()
    with pytest.raises(er.ReferenceUnavailableError, match=r"matrix_exp: element \(0, 2\) of exp\(A\)"):
        er.matrix_exp(A)
    with pytest.raises(er.ReferenceUnavailableError, match=r"element \(1, 0, 2\) of exp\(A\)"):
        er.matrix_exp(np.stack([np.eye(3), A]))
    assert time.perf_counter() - start < 30


def test_zero_by_cancellation_in_a_gradient_raises_naming_the_gradient():
    # L(A^H, G) with A^H = 0.5 I + N and G = I contains e^0.5 (I + N + N^2/2) in its top-right block.
    AH = np.array([[0.5, 1.0, 1.0], [0.0, 0.5, -2.0], [0.0, 0.0, 0.5]])
    with pytest.raises(er.ReferenceUnavailableError, match=r"matrix_exp.backward: element \(0, 2\) of grad_A"):
        er.matrix_exp.backward(AH.T.copy(), np.eye(3))


def test_zero_that_exact_arithmetic_proves_is_decided():
    # Nilpotent: exp(N) = I + N + N^2/2 is a finite sum that Arb evaluates exactly, so (0, 2) is a proven 0.
    A = np.array([[0.0, 1.0, 1.0], [0.0, 0.0, -2.0], [0.0, 0.0, 0.0]])
    r = er.matrix_exp(A)
    assert r.rounded[0, 2] == 0 and r.rounded[0, 1] == 1 and r.rounded[1, 2] == -2


# ---------------------------------------------------------------- special values and overflow

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("fmt", ["float32", "complex128"])
def test_a_matrix_holding_nan_or_inf_accepts_only_nan_and_inf(bad, fmt):
    A = to_format(np.array([[0.5, bad, 0.0], [0.25, 1.0, 0.0], [0.0, 0.0, 2.0]]), fmt)
    r = er.matrix_exp(A)
    assert r.normal is None
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()
    for value in (math.nan, math.inf, -math.inf):
        assert r.covers(np.full(A.shape, value, dtype=A.dtype)).all()
    if fmt == "complex128":
        # A complex value with one NaN or infinite part is a NaN or an infinity (C99 Annex G).
        assert r.covers(np.full(A.shape, complex(1.0, math.inf))).all()
        assert not r.covers(np.full(A.shape, complex(2.0, 3.0))).any()
    assert not r.covers(np.zeros(A.shape, dtype=A.dtype)).any()
    assert r.exact((2, 2)) is None


def test_a_gradient_holding_inf_makes_the_whole_gradient_special():
    A = np.array([[0.5, 1.0], [0.0, 0.25]])
    G = np.array([[1.0, math.inf], [0.0, 1.0]])
    g = er.matrix_exp.backward(A, G)["grad_A"]
    a = torch.from_numpy(A).requires_grad_()
    torch.linalg.matrix_exp(a).backward(torch.from_numpy(G))
    assert g.covers(a.grad).all()
    assert not g.covers(np.ones((2, 2))).any()


def test_in_a_batch_only_the_matrix_holding_nan_is_special():
    A = np.stack([np.array([[math.nan, 0.0], [0.0, 1.0]]), np.array([[0.5, 1.0], [0.0, 1.0]])]).astype(np.float32)
    r = er.matrix_exp(A)
    got = torch.linalg.matrix_exp(torch.from_numpy(A))
    assert r.covers(got).all()
    assert np.isnan(r.rounded[0]).all() and np.isfinite(r.rounded[1]).all()
    wrong = got.clone()
    wrong[1, 0, 0] = math.nan
    assert not r.covers(wrong)[1, 0, 0]


@pytest.mark.parametrize(("a", "accepted", "rejected"), [
    (-math.inf, [0.0, -0.0], [math.nan, math.inf, 1e-30]),
    (math.inf, [math.inf], [math.nan, -math.inf, 3.0e38]),
    (math.nan, [math.nan], [math.inf, 0.0]),
])
def test_one_by_one_follows_exp_special_values(a, accepted, rejected):
    r = er.matrix_exp(np.array([[a]], dtype=np.float32))
    assert r.covers(torch.linalg.matrix_exp(torch.tensor([[a]]))).all()
    for v in accepted:
        assert r.covers(np.array([[v]], dtype=np.float32)).all(), v
    for v in rejected:
        assert not r.covers(np.array([[v]], dtype=np.float32)).any(), v


@pytest.mark.parametrize("a", [complex(-math.inf, 1), complex(-math.inf, math.nan), complex(math.inf, 0),
                               complex(math.inf, 1), complex(math.inf, math.inf), complex(1, math.inf),
                               complex(math.nan, 0), complex(0, math.nan)])
def test_one_by_one_complex_follows_cexp(a):
    A = np.array([[a]], dtype=np.complex128)
    r = er.matrix_exp(A)
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()
    assert not r.covers(np.array([[complex(2.5, 2.5)]])).any()


def test_overflowing_elements_accept_inf_and_nan_but_not_finite_values():
    A = np.array([[100.0, 0.0], [0.0, 1.0]], dtype=np.float32)  # e^100 overflows float32
    r = er.matrix_exp(A)
    assert r.rounded[0, 0] == math.inf
    assert r.covers(torch.linalg.matrix_exp(torch.from_numpy(A))).all()
    for v in (math.inf, math.nan):
        assert r.covers(np.array([[v, 0], [0, r.rounded[1, 1]]], dtype=np.float32)).all()
    largest = np.finfo(np.float32).max
    assert not r.covers(np.array([[largest, 0], [0, r.rounded[1, 1]]], dtype=np.float32))[0, 0]
    # e^1 is reached by no overflowing partial result: NaN there is wrong.
    assert not r.covers(np.array([[math.inf, 0], [0, math.nan]], dtype=np.float32))[1, 1]


def test_a_one_by_one_past_float64s_range_rounds_to_inf():
    r = er.matrix_exp(np.array([[800.0]]))
    assert r.rounded[0, 0] == math.inf
    assert r.covers(torch.linalg.matrix_exp(torch.tensor([[800.0]], dtype=torch.float64))).all()


# ---------------------------------------------------------------- argument validation

@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: er.matrix_exp(np.ones(3)), ValueError, r"matrix_exp: A has shape \(3,\); it must be a square"),
    (lambda: er.matrix_exp(np.ones((2, 3))), ValueError, r"A has shape \(2, 3\)"),
    (lambda: er.matrix_exp(1.5), ValueError, r"matrix_exp: A=1.5; it must be a square matrix"),
    (lambda: er.matrix_exp(np.ones((2, 2), dtype=np.int64)), TypeError, r"A: .*int64"),
    (lambda: er.matrix_exp("abc"), TypeError, r"A: "),
    (lambda: er.matrix_exp_frechet(np.eye(2, dtype=np.float32), np.eye(2)), TypeError,
     r"A has dtype float32 but E has dtype float64"),
    (lambda: er.matrix_exp_frechet(np.eye(2), np.eye(3)), ValueError,
     r"A has shape \(2, 2\) and E has shape \(3, 3\)"),
    (lambda: er.matrix_exp_frechet(np.ones((2, 2, 2)), np.ones((3, 2, 2))), ValueError,
     r"batch dimensions of A \(2,\) and E \(3,\) do not broadcast"),
    (lambda: er.matrix_exp_frechet(np.eye(2), np.ones(2)), ValueError, r"E has shape \(2,\)"),
    (lambda: er.matrix_exp.backward(np.eye(2), None), TypeError, r"needs grad"),
    (lambda: er.matrix_exp.backward(np.eye(2), np.ones((2, 3))), ValueError,
     r"grad has shape \(2, 3\) but matrix_exp's output has shape \(2, 2\)"),
    (lambda: er.matrix_exp.backward(np.eye(2), np.eye(2, dtype=np.float32)), TypeError,
     r"grad has dtype float32 but matrix_exp's output has dtype float64"),
    (lambda: er.matrix_exp(np.eye(2)).backward(np.ones((3, 3))), ValueError, r"grad has shape \(3, 3\)"),
    (lambda: er.matrix_exp_frechet.backward, AttributeError, r"matrix_exp_frechet has no backward"),
    (lambda: er.matrix_exp_frechet(np.eye(2), np.eye(2)).backward(np.eye(2)), TypeError,
     r"matrix_exp_frechet has no backward"),
    (lambda: er.matrix_exp(np.eye(2)).exact((2, 0)), IndexError, r"index=\(2, 0\)"),
])
def test_bad_arguments_are_named_with_their_values(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_lists_and_tensors_are_read_like_torch():
    r = er.matrix_exp([[0.0, 1.0], [0.0, 0.0]])
    assert r.dtype == np.float32 and r.rounded.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    t = er.matrix_exp(torch.tensor([[0.0, 2.0], [0.0, 0.0]], dtype=torch.float64))
    assert t.dtype == np.float64 and t.rounded.tolist() == [[1.0, 2.0], [0.0, 1.0]]
