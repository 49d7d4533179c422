"""matmul specifics: inputs spanning the whole exponent range finish, exactly."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from fractions import Fraction

import numpy as np
import pytest

import exactref as er

from .oracle import bits_equal, round_fraction


@contextmanager
def no_hang(seconds: int):
    """Fail, rather than hang, if the block runs for more than ``seconds`` (a generous bound, not a benchmark)."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def whole_range(rng, shape, fmt, lo, hi):
    """Values +-2**e with e spread over [lo, hi], plus random significands."""
    e = rng.integers(lo, hi + 1, shape)
    sig = rng.uniform(1, 2, shape)
    return er.asarray(rng.choice([-1.0, 1.0], shape) * np.ldexp(sig, e), fmt)


@pytest.mark.parametrize("fmt, lo, hi", [("float32", -149, 127), ("float64", -1074, 1023)])
def test_inputs_spanning_the_whole_exponent_range_finish_exactly(fmt, lo, hi):
    rng = np.random.default_rng(11)
    n = 48
    A = whole_range(rng, (n, n), fmt, lo, hi)
    # B pairs each column with A's exponents reversed, so that products meet
    # across the range and many sums cancel down to their smallest terms.
    B = whole_range(rng, (n, n), fmt, lo, hi)[::-1]
    with no_hang(120), np.errstate(all="ignore"):
        res = er.matmul(A, B)
    for i, j in [(0, 0), (5, 17), (n - 1, n - 1), (20, 3)]:
        exact = sum(Fraction(float(A[i, k])) * Fraction(float(B[k, j])) for k in range(n))
        assert res.exact((i, j)) == exact
        assert bits_equal(res.rounded[i, j], round_fraction(exact, fmt))


def test_cancelling_sums_down_to_subnormals_are_exact():
    tiny = 2.0 ** -149
    A = er.asarray([[2.0 ** 127, -(2.0 ** 127), tiny, 3 * tiny]], "float32")
    B = er.asarray([[1.0], [1.0], [0.5], [0.5]], "float32")
    res = er.matmul(A, B)
    # 2**127 - 2**127 + 2**-150 + 3 * 2**-150 = 2**-148 exactly
    assert res.rounded[0, 0] == np.float32(2.0 ** -148)
    assert res.tolerance[0, 0] > 0


def test_one_dimensional_operands_follow_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    v = er.asarray(rng.standard_normal(5), "float32")
    M = er.asarray(rng.standard_normal((2, 5, 3)), "float32")
    for a, b in [(v, v), (v, M), (np.swapaxes(M, -1, -2), v)]:
        res = er.matmul(a, b)
        out = torch.matmul(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)))
        assert res.shape == tuple(out.shape)
        assert res.covers(out).all()
