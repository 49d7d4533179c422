"""torch.linalg.matrix_exp and its backward are covered; a zoo of broken kernels is rejected.

The no-false-alarm tests run PyTorch's own kernels on the kinds of matrices
the oracle tests use (n up to 16, 1-norms from 1e-3 to 10, real and
complex, triangular, diagonal and nilpotent, single and batched), in the four
formats PyTorch computes matrix_exp in correctly.  Near the norms where
PyTorch switches its Taylor degree, the degree it picks depends on its own
rounded norm, which the tolerance must allow for.

The zoo holds kernels a kernel engineer could plausibly write, each wrong in
one way; every one must be rejected.  ``t18_scaled`` restates PyTorch's
degree-18 scheme with scaling and squaring (``LinearAlgebra.cpp``,
``compute_T18_scale_square``) in numpy, rounding every operation to a chosen
format; it shares no code with the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import exactref as er

FORMATS = ["float32", "float64", "complex64", "complex128"]
KINDS = ["dense", "upper", "lower", "diagonal", "nilpotent"]
TORCH = {"float32": torch.float32, "float64": torch.float64, "complex64": torch.complex64,
         "complex128": torch.complex128, "float16": torch.float16}
# thetas_float and thetas_double of PyTorch's mexp.
THETAS = {
    "float": [1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
              1.461661507209034e+00, 3.010066362817634e+00],
    "double": [2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04, 4.991228871115323e-02,
               2.996158913811580e-01, 1.090863719290036e+00],
}


def kind_of(fmt: str) -> str:
    return "double" if fmt in ("float64", "complex128") else "float"


@st.composite
def matrices(draw: st.DrawFn, *, fmt: str, max_n: int = 16, batch: tuple[int, ...] = (),
             log_norm: tuple[float, float] = (-3.0, 1.0)) -> torch.Tensor:
    n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(KINDS))
    shape = batch + (n, n)
    raw = draw(hnp.arrays(np.float64, (2,) + shape, elements=st.floats(-1, 1, width=32)))
    M = raw[0] + 1j * raw[1] if fmt.startswith("complex") else raw[0]
    M = {"upper": np.triu(M), "lower": np.tril(M), "diagonal": M * np.eye(n),
         "nilpotent": np.triu(M, 1)}.get(kind, M)
    norm = float(np.abs(M).sum(axis=-2).max()) if M.size else 0.0
    if norm > 0:
        M = M * (10.0 ** draw(st.floats(*log_norm)) / norm)
    return torch.from_numpy(np.ascontiguousarray(M)).to(TORCH[fmt])


def like(A: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(A.shape, generator=g, dtype=A.dtype)


def torch_backward(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    a = A.clone().requires_grad_()
    torch.linalg.matrix_exp(a).backward(G)
    return a.grad


# ---------------------------------------------------------------- no false alarms

@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40)
@given(data=st.data())
def test_torch_matrix_exp_forward_and_backward_are_covered(fmt, data):
    batch = data.draw(st.sampled_from([(), (1,), (2,), (3,)]))
    A = data.draw(matrices(fmt=fmt, batch=batch, max_n=16 if not batch else 8))
    G = like(A, data.draw(st.integers(0, 2 ** 16)))
    r = er.matrix_exp(A)
    r.check(torch.linalg.matrix_exp(A))
    r.backward(G).check(grad_A=torch_backward(A, G))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("degree", range(6))
@pytest.mark.parametrize("side", [-1, 0, 1])
def test_torch_is_covered_where_its_rounded_norm_picks_the_degree(fmt, degree, side):
    # 1-norms a few ulps from a switch point: PyTorch's rounded norm decides which side it lands on.
    theta = THETAS[kind_of(fmt)][degree]
    rng = np.random.default_rng(degree * 3 + side + 10)
    cplx = fmt.startswith("complex")
    for n in (2, 7):
        M = rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if cplx else 0)
        M *= theta / np.abs(M).sum(axis=0).max() * (1 + side * 4 * np.finfo(np.float32).eps)
        A = torch.from_numpy(M).to(TORCH[fmt])
        G = like(A, n)
        r = er.matrix_exp(A)
        r.check(torch.linalg.matrix_exp(A))
        # The backward's block matrix has a larger norm; scale G to put that norm at theta too.
        Gs = G * (theta / max(float(G.abs().sum(-2).max()), 1e-30))
        er.matrix_exp.backward(A / 2, Gs / 2).check(grad_A=torch_backward(A / 2, Gs / 2))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=10)
@given(data=st.data())
def test_torch_is_covered_at_large_norms(fmt, data):
    # Many squarings: the bound doubles its relative error at each one, as PyTorch's error can.
    A = data.draw(matrices(fmt=fmt, max_n=6, log_norm=(1.0, 1.6)))
    er.matrix_exp(A).check(torch.linalg.matrix_exp(A))


# ---------------------------------------------------------------- a half-precision implementation

B18 = [
    [0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.],
    [0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04],
    [-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05],
    [-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05],
    [0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05],
]


def rounding(dtype: type) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: np.asarray(x).astype(dtype).astype(np.float64)


def t18_scaled(A: np.ndarray, rnd: Callable[[np.ndarray], np.ndarray], theta: float) -> np.ndarray:
    """exp(A) by PyTorch's degree-18 scheme, scaled by 2**-s, s = ceil(log2(norm / theta)), then squared s times.

    Each product is computed in float64 and rounded once by ``rnd``, each
    linear combination accumulates one rounded term at a time.
    """
    norm = float(np.abs(A).sum(axis=0).max())
    s = max(0, math.ceil(math.log2(norm / theta))) if norm > 0 else 0
    B = rnd(A * 2.0 ** -s)
    As = [np.eye(len(A)), B]
    As.append(rnd(B @ B))
    As.append(rnd(B @ As[2]))
    As.append(rnd(As[3] @ As[3]))

    def combination(row: list[float]) -> np.ndarray:
        out = np.zeros_like(B)
        for c, X in zip(row, As):
            out = rnd(out + rnd(float(rnd(c)) * X))
        return out

    Bs = [combination(row) for row in B18]
    A9 = rnd(Bs[3] + rnd(Bs[0] @ Bs[4]))
    X = rnd(Bs[1] + rnd(rnd(Bs[2] + A9) @ A9))
    for _ in range(s):
        X = rnd(X @ X)
    return X


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@settings(max_examples=25)
@given(data=st.data())
def test_a_half_precision_implementation_is_covered_in_its_format(dtype, data):
    # PyTorch takes the double branch of mexp for half types; a batch of two always takes degree 18.
    A = data.draw(matrices(fmt="float64", batch=(2,), max_n=8, log_norm=(-3.0, 0.9))).numpy().astype(dtype)
    if A.shape[-1] == 1:
        # PyTorch's shortcut for 1 x 1 matrices, whatever the batch: exp itself, rounded once here.
        got = rounding(dtype)(np.exp(A.astype(np.float64)))
    else:
        got = np.stack([t18_scaled(a.astype(np.float64), rounding(dtype), THETAS["double"][5]) for a in A])
    er.matrix_exp(A).check(got.astype(dtype))


def test_torch_float16_matrix_exp_is_rejected():
    # torch 2.13 runs mexp's double instantiation on half tensors and reads its coefficient
    # tables as half: exp(I) comes out as -20896.  ExactRef says so.
    I3 = torch.eye(3, dtype=torch.float16)
    r = er.matrix_exp(I3)
    assert r.rounded[0, 0] == np.float16(math.e)
    assert not r.covers(torch.linalg.matrix_exp(I3)).diagonal().any()


# ---------------------------------------------------------------- the zoo

def taylor4_no_scaling(A: torch.Tensor) -> torch.Tensor:
    I = torch.eye(A.shape[-1], dtype=A.dtype)
    A2 = A @ A
    return I + A + A2 / 2 + A2 @ A / 6 + A2 @ A2 / 24


def one_squaring_too_few(A: torch.Tensor) -> torch.Tensor:
    theta = THETAS[kind_of(str(A.dtype).removeprefix("torch."))][5]
    s = max(0, math.ceil(math.log2(float(A.abs().sum(-2).max()) / theta)))
    X = torch.linalg.matrix_exp(A * 2.0 ** -s)
    for _ in range(s - 1):
        X = X @ X
    return X


def half_precision(A: torch.Tensor) -> torch.Tensor:
    # The whole computation in float16, the answer widened back.
    X = t18_scaled(A.numpy().astype(np.float16).astype(np.float64), rounding(np.float16), THETAS["double"][5])
    return torch.from_numpy(X.astype(np.float16)).to(A.dtype)


def float_theta_for_double(A: torch.Tensor) -> torch.Tensor:
    # Degree 18 with the float32 threshold in float64: too little scaling for float64's precision.
    return torch.from_numpy(t18_scaled(A.numpy(), lambda x: np.asarray(x, dtype=np.float64),
                                       THETAS["float"][5]))


def transposed(A: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_exp(A).mT


def backward_without_adjoint(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    # L(A, G), the top-right block of exp([[A, G], [0, A]]), where L(A^H, G) is right.
    n = A.shape[-1]
    Z = torch.zeros_like(A)
    block = torch.cat([torch.cat([A, G], -1), torch.cat([Z, A], -1)], -2)
    return torch.linalg.matrix_exp(block)[..., :n, n:]


ZOO = [
    # (kernel, formats it is judged in, the range of log10 of the 1-norm where it is wrong, entries >= 0)
    (taylor4_no_scaling, ["float32", "complex64", "float64"], (0.0, 1.0), False),
    (one_squaring_too_few, ["float32", "float64", "complex128"], (0.6, 1.0), False),
    (half_precision, ["float32", "float64"], (-1.0, 1.0), False),
    # Its truncation error shows where the scaled norm is near 3.01 (norms 5.8 to 6) and the
    # spectral radius near the norm (positive matrices).
    (float_theta_for_double, ["float64"], (0.765, 0.778), True),
    (transposed, ["float32", "float64", "complex64"], (-2.0, 1.0), False),
]


def zoo_inputs(fmt: str, log_norm: tuple[float, float], positive: bool = False, count: int = 6) -> list[torch.Tensor]:
    rng = np.random.default_rng([ord(c) for c in fmt] + [int(10 * log_norm[0]) + 50, int(positive)])
    out = []
    for k in range(count):
        n = (2, 3, 5, 8, 12, 16)[k % 6]
        M = rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if fmt.startswith("complex") else 0)
        M = np.abs(M) if positive else M
        M *= 10 ** rng.uniform(*log_norm) / np.abs(M).sum(axis=0).max()
        out.append(torch.from_numpy(M).to(TORCH[fmt]))
    return out


@pytest.mark.parametrize(("kernel", "fmt", "log_norm", "positive"),
                         [(k, f, r, p) for k, fmts, r, p in ZOO for f in fmts],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_every_broken_forward_kernel_is_rejected(kernel, fmt, log_norm, positive):
    for A in zoo_inputs(fmt, log_norm, positive):
        r = er.matrix_exp(A)
        assert not r.covers(kernel(A)).all(), f"{kernel.__name__} passed on a {tuple(A.shape)} {fmt} matrix"
        r.check(torch.linalg.matrix_exp(A))  # while the real kernel passes on the same input


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_backward_without_the_adjoint_is_rejected(fmt):
    for A in zoo_inputs(fmt, (-1.0, 1.0)):
        G = like(A, 3)
        g = er.matrix_exp.backward(A, G)["grad_A"]
        with pytest.raises(er.MismatchError, match="grad_A"):
            g.check(backward_without_adjoint(A, G))
        g.check(torch_backward(A, G))
