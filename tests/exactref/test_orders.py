"""Declared summation orders: the tolerance covers every correct kernel of that order.

The kernels come from order_kernels.py, which emulates an order bit for bit
(its own tests are in test_order_kernels.py); the inputs are adversarial:
N(0,1), uniform(0,1), wide-range exponents and cancellation-heavy pairs, at
lengths around numpy's pairwise thresholds (8, 128) and beyond, in float32,
float16 and bfloat16, with several seeds and fresh random inner orders.
Then the other direction: a kernel of one order is not always covered by the
bound of another, tighter one.
"""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er

from . import order_kernels as ok

models = pytest.importorskip("exactref.models")
if not hasattr(models, "Blocked"):
    pytest.skip("exactref.models.Blocked is not there yet", allow_module_level=True)
Blocked = models.Blocked

LENGTHS = (1, 2, 7, 8, 9, 127, 128, 129, 1000, 4096)
DTYPES = ("float32", "float16", "bfloat16")
DATA = ("normal", "uniform", "wide", "cancel")
SEEDS = (0, 1, 2)
# Each kernel order (order_kernels' twin) with the order named to exactref.
ORDERS = {
    "any": ("any", "any"),
    "sequential": ("sequential", "sequential"),
    "pairwise": ("pairwise", "pairwise"),
    "Blocked(32)": (ok.Blocked(32), Blocked(32)),
    "Blocked(32, sequential)": (ok.Blocked(32, "sequential"), Blocked(32, "sequential")),
    "Blocked(32, pairwise)": (ok.Blocked(32, "pairwise"), Blocked(32, "pairwise")),
    "Blocked(8, splits=4)": (ok.Blocked(8, splits=4), Blocked(8, splits=4)),
    "Blocked(100, sequential, splits=3)": (ok.Blocked(100, "sequential", 3), Blocked(100, "sequential", 3)),
}


def model(order, failure_rate=None):
    return er.models.DEFAULT.replace(order=order, failure_rate=failure_rate)


def values(kind: str, dtype: str, shape, rng, factors: int, n: int) -> np.ndarray:
    """Inputs of one kind; wide-range exponents split between the factors of a product, short of overflow."""
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "uniform":
        x = rng.uniform(0, 1, shape)
    elif kind == "wide":
        lo, hi = {"float32": (-124, 127), "float16": (-12, 15), "bfloat16": (-124, 127)}[dtype]
        hi -= int(np.ceil(np.log2(max(n, 2)))) + 2
        e = rng.integers(lo // factors, hi // factors + 1, shape)
        x = rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2, shape) * 2.0 ** e
    elif kind == "constant":
        x = np.full(shape, rng.uniform(0.1, 1))
    else:
        raise ValueError(kind)
    return x.astype(ok.fmt(dtype))


def pairs(dtype: str, n: int, cols: int, rng):
    """Rows a, a and b, -b + noise over a shuffled index: the products cancel but for a * noise."""
    f = ok.fmt(dtype)
    h = n // 2
    a = rng.standard_normal((h, cols)).astype(f)
    b = rng.standard_normal((h, cols)).astype(f)
    nb = (-b.astype(np.float64) + 2.0 ** -8 * rng.standard_normal((h, cols))).astype(f)
    odd = rng.standard_normal((n - 2 * h, cols)).astype(f)
    perm = rng.permutation(n)
    return np.concatenate([a, a, odd])[perm], np.concatenate([b, nb, odd])[perm]


def matmul_inputs(kind, dtype, K, rng, side=3):
    if kind == "cancel":
        a, b = pairs(dtype, K, side, rng)
        return np.ascontiguousarray(a.T), b
    return values(kind, dtype, (side, K), rng, 2, K), values(kind, dtype, (K, side), rng, 2, K)


def vector(kind, dtype, n, rng):
    if kind == "cancel":
        a, b = pairs(dtype, n, 1, rng)
        return np.where(np.arange(n) % 2 == 0, a[:, 0], b[:, 0]).astype(ok.fmt(dtype))
    return values(kind, dtype, n, rng, 1, n)


def assert_covered(res, got, what):
    cov = np.asarray(res.covers(got))
    if not cov.all():
        i = np.unravel_index(np.argmin(cov), cov.shape) if cov.ndim else ()
        exact = float(res.exact(i)) if cov.ndim else float(res.exact())
        raise AssertionError(f"{what}: {np.sum(~cov)} of {cov.size} not covered; at {i}: got "
                             f"{float(np.asarray(got)[i])!r}, exact {exact!r}, tolerance {np.asarray(res.tolerance)[i]!r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ORDERS))
def test_declared_order_covers_its_matmul_kernels(name, dtype):
    kernel_order, order = ORDERS[name]
    for seed in SEEDS:
        rng = np.random.default_rng([seed, LENGTHS[-1]])
        for K in LENGTHS:
            for kind in DATA:
                A, B = matmul_inputs(kind, dtype, K, rng)
                res = er.matmul(A, B, model=model(order))
                assert_covered(res, ok.dot_matmul(A, B, kernel_order, rng=rng), f"{name} {dtype} K={K} {kind} seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["sequential", "pairwise", "Blocked(32)", "Blocked(8, splits=4)"])
def test_probabilistic_declared_order_covers_its_matmul_kernels(name, dtype):
    kernel_order, order = ORDERS[name]
    for seed in SEEDS:
        rng = np.random.default_rng([seed, 7])
        for K in LENGTHS:
            for kind in DATA:
                A, B = matmul_inputs(kind, dtype, K, rng)
                res = er.matmul(A, B, model=model(order, 1e-12))
                assert_covered(res, ok.dot_matmul(A, B, kernel_order, rng=rng), f"{name} {dtype} K={K} {kind} seed {seed}")


@pytest.mark.parametrize("name", ["sequential", "Blocked(32, sequential)", "Blocked(100, sequential, splits=3)"])
def test_fused_multiply_adds_are_covered(name):
    kernel_order, order = ORDERS[name]
    if getattr(kernel_order, "splits", 1) > 1:
        pytest.skip("the fma emulation has no splits")
    rng = np.random.default_rng(11)
    for K in LENGTHS:
        for kind in DATA:
            A, B = matmul_inputs(kind, "float32", K, rng)
            res = er.matmul(A, B, model=model(order))
            assert_covered(res, ok.dot_matmul(A, B, kernel_order, fma=True), f"fma {name} K={K} {kind}")


def check_sums(name, dtype, failure_rate, seeds=SEEDS, kinds=DATA):
    kernel_order, order = ORDERS[name]
    for seed in seeds:
        rng = np.random.default_rng([seed, 3])
        # One long sum per test, past numpy's recursion depth of several levels.
        for n in LENGTHS + ((10**5,) if seed == seeds[0] else ()):
            for kind in kinds:
                x = vector(kind, dtype, n, rng)
                res = er.sum(x, model=model(order, failure_rate))
                got = ok.reduce_sum(x, kernel_order, rng=rng)
                assert_covered(res, got, f"{name} {dtype} n={n} {kind} seed {seed} failure_rate={failure_rate}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ORDERS))
def test_declared_order_covers_its_sum_kernels(name, dtype):
    check_sums(name, dtype, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [n for n in ORDERS if n != "any"])
def test_probabilistic_declared_order_covers_its_sum_kernels(name, dtype):
    check_sums(name, dtype, 1e-12)


def test_probabilistic_any_order_covers_a_random_chain():
    """n = 10**5 cancellation pairs summed in a random chain: partial sums wander to ~sqrt(n) and their
    roundings add up to ~u sqrt(sum of squared partial sums), far more than a tree's."""
    rng = np.random.default_rng(1)
    x = vector("cancel", "float32", 10**5, rng)
    res = er.sum(x, model=model("any", 1e-12))
    for _ in range(5):
        got = ok.sum_any(x[:, None], rng, style=0)[0]  # style 0: a random chain
        assert_covered(res, got, "random chain, order any, failure_rate 1e-12")


@pytest.mark.parametrize("name", ["sequential", "pairwise", "Blocked(32, sequential)", "Blocked(8, splits=4)"])
def test_several_reduced_axes_are_one_index_in_c_order(name):
    kernel_order, order = ORDERS[name]
    rng = np.random.default_rng(5)
    for kind in DATA:
        x = values(kind, "float32", (3, 40, 37), rng, 1, 40 * 37) if kind != "cancel" else \
            vector("cancel", "float32", 3 * 40 * 37, rng).reshape(3, 40, 37)
        res = er.sum(x, axis=(1, 2), model=model(order))
        assert_covered(res, ok.reduce_sum(x, kernel_order, axis=(1, 2), rng=rng), f"{name} {kind}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["sequential", "pairwise", "Blocked(32)", "Blocked(8, splits=4)"])
def test_declared_order_covers_its_gradient_kernels(name, dtype):
    """grad_A = G @ B^T sums over N, grad_B = A^T @ G over M, each in the declared order."""
    kernel_order, order = ORDERS[name]
    rng = np.random.default_rng(17)
    for length in (1, 7, 9, 129, 1000):
        for kind in DATA:
            # X (3, length) @ Y (length, 3) is the contraction; cancellation pairs run along it.
            X, Y = matmul_inputs(kind, dtype, length, rng)
            A = values("normal", dtype, (3, 3), rng, 2, 3)
            g = er.matmul.backward(A, np.ascontiguousarray(Y.T), X, model=model(order))
            assert_covered(g["grad_A"], ok.dot_matmul(X, Y, kernel_order, rng=rng), f"grad_A {name} N={length} {kind}")
            B = values("normal", dtype, (3, 3), rng, 2, 3)
            g = er.matmul.backward(np.ascontiguousarray(X.T), B, Y, model=model(order))
            assert_covered(g["grad_B"], ok.dot_matmul(X, Y, kernel_order, rng=rng), f"grad_B {name} M={length} {kind}")


# ---------------------------------------------------------------- another order's bound

def test_a_sequential_sum_is_not_covered_by_a_pairwise_or_blocked_bound():
    """float32(0.1) added 10**5 times in a chain drifts far beyond what a tree of these terms can."""
    x = np.full(10**5, 0.1, dtype=np.float32)
    got = ok.reduce_sum(x, "sequential")
    assert er.sum(x, model=model("sequential")).covers(got)
    assert er.sum(x).covers(got)  # any order
    assert not er.sum(x, model=model("pairwise")).covers(got)
    assert not er.sum(x, model=model(Blocked(32))).covers(got)


def test_a_sequential_matmul_is_not_always_covered_by_the_pairwise_bound():
    rng = np.random.default_rng(0)
    A, B = rng.uniform(0, 1, (8, 16384)).astype(np.float32), rng.uniform(0, 1, (16384, 8)).astype(np.float32)
    got = ok.dot_matmul(A, B, "sequential")
    assert er.matmul(A, B, model=model("sequential")).covers(got).all()
    assert not er.matmul(A, B, model=model("pairwise")).covers(got).all()


def test_probabilistic_blocked_order_covers_chains_on_constant_data():
    """Constant factors at K = 16384: the 512 block sums are equal, so the chain that adds them rounds the
    same way again and again.  About one pair of constants in ten went past the probabilistic bound."""
    A = np.full((1, 16384), 0.3964906930923462, dtype=np.float32)
    B = np.full((16384, 1), 0.9429788589477539, dtype=np.float32)
    got = ok.dot_matmul(A, B, ok.Blocked(32, "sequential"))
    assert er.matmul(A, B, model=model(Blocked(32))).covers(got).all()  # the sound bound holds
    assert_covered(er.matmul(A, B, model=model(Blocked(32), 1e-12)), got, "constant data, Blocked(32), failure_rate 1e-12")
