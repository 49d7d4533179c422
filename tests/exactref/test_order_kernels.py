"""The order-emulating kernels of order_kernels.py, checked on their own.

Independent of exactref's code under test: the references here are numpy
itself, plain Python loops over numpy scalars and exact rational arithmetic.

What numpy 2.4 does, as the tests below pin down:

* ``np.sum`` / ``np.add.reduce`` of a 1-D float32 array, contiguous or
  strided, is bit for bit ``+0.0 + pairwise_sum(x)`` over the whole array
  (n = 1..5000, 10**5, 10**6, 3 * 10**6 + 7 tried): the reduction iterator
  does not cut an uncast array into buffer chunks.  The +0.0 start
  (numpy's identity for add) only turns a -0.0 result into +0.0.
* float16 arrays likewise: one pairwise_sum accumulated in float32, rounded
  to float16 once.
* With a cast, ``np.sum(x, dtype=...)``, numpy buffers 8192 elements at a
  time: each buffer is one pairwise_sum and the buffers are added in a
  chain, i.e. Blocked(8192, inner="pairwise").  Pure pairwise_sum of the
  whole array then differs.
* ``np.sum(X, axis=0)`` of a C-ordered 2-D array adds the rows one after the
  other (a sequential chain per column); a Fortran-ordered one is pairwise
  per column.
"""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest

from . import order_kernels as ok

RNG_SEED = 20261201


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def wide_float32(rng, n):
    """Random signs and exponents over 2^-20..2^20: sums whose value depends on the order."""
    return (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 21, n)).astype(np.float32)


def python_chain(values, dtype):
    """acc = v0; acc = dtype(acc + v_k), one numpy scalar at a time."""
    acc = dtype(values[0])
    for v in values[1:]:
        acc = dtype(acc + dtype(v))
    return acc


# ---------------------------------------------------------------- numpy pairwise

def test_pairwise_equals_numpy_for_every_small_n():
    rng = np.random.default_rng(RNG_SEED)
    for n in range(1, 5001):
        x = wide_float32(rng, n)
        assert same_bits(np.float32(0) + ok.sum_pairwise(x[:, None])[0], np.add.reduce(x)), n


def test_the_data_tells_pairwise_from_sequential():
    """Sanity check of the test above: on this data the orders give different sums for most n."""
    rng = np.random.default_rng(RNG_SEED)
    differ = 0
    for n in range(9, 400):
        x = wide_float32(rng, n)
        differ += not same_bits(ok.sum_pairwise(x[:, None])[0], ok.sum_sequential(x[:, None])[0])
    assert differ > 300


@pytest.mark.parametrize("n", [10**5, 10**6, 3 * 10**6 + 7])
def test_pairwise_equals_numpy_for_large_n_contiguous_and_strided(n):
    rng = np.random.default_rng(n)
    x = wide_float32(rng, n)
    pw = np.float32(0) + ok.sum_pairwise(x[:, None])[0]
    assert same_bits(np.sum(x), pw)
    assert same_bits(np.add.reduce(np.repeat(x, 2)[::2]), pw)  # strided, no copy: still unchunked
    assert same_bits(ok.numpy_add_reduce(x), pw)


def test_float16_sum_is_one_float32_pairwise_rounded_once():
    rng = np.random.default_rng(RNG_SEED)
    for n in (100, 10**5, 10**6):
        h = rng.uniform(0, 0.05, n).astype(np.float16)
        assert same_bits(np.sum(h), ok.reduce_sum(h, "pairwise"))


def test_a_cast_sum_is_chunked_into_8192_element_buffers():
    rng = np.random.default_rng(RNG_SEED)
    differ = 0
    for _ in range(4):
        h = rng.uniform(0, 1, 10**6).astype(np.float16)
        x32 = h.astype(np.float32)
        chunked = ok.numpy_add_reduce(x32, buffersize=8192)
        assert same_bits(np.sum(h, dtype=np.float32), chunked)
        assert same_bits(chunked, np.float32(0) + ok.reduce_sum(x32, ok.Blocked(8192, inner="pairwise")))
        differ += not same_bits(chunked, ok.numpy_add_reduce(x32))
    assert differ  # the chunks do change the sum


def test_numpy_axis0_of_c_ordered_2d_is_sequential():
    rng = np.random.default_rng(RNG_SEED)
    X = wide_float32(rng, 3000).reshape(1000, 3)
    assert same_bits(np.sum(X, axis=0), ok.reduce_sum(X, "sequential", axis=0))
    assert same_bits(np.sum(np.asfortranarray(X), axis=0), ok.reduce_sum(X, "pairwise", axis=0))


def test_pairwise_leaf_starts_from_negative_zero():
    z = np.array([-0.0, -0.0], dtype=np.float32)
    assert np.signbit(ok.sum_pairwise(z[:, None])[0])
    assert not np.signbit(np.add.reduce(z))  # numpy's +0.0 identity


# ---------------------------------------------------------------- chains and blocks

@pytest.mark.parametrize("dtype", [np.float32, np.float16, ok.BFLOAT16])
def test_sequential_equals_a_python_loop(dtype):
    rng = np.random.default_rng(RNG_SEED)
    for n in (1, 2, 7, 100, 1000):
        x = rng.standard_normal(n).astype(dtype)
        got = ok.reduce_sum(x, "sequential", acc=dtype)
        assert same_bits(got, np.asarray(python_chain(list(x), dtype.type if hasattr(dtype, "type") else dtype)))


def hand_blocked_sequential(x, size, splits):
    """Blocks of ``size`` summed in chains, block sums chained within ``splits`` groups, groups added."""
    blocks = [python_chain(list(x[s:s + size]), np.float32) for s in range(0, len(x), size)]
    per = -(-len(blocks) // splits)
    groups = [python_chain(blocks[g:g + per], np.float32) for g in range(0, len(blocks), per)]
    return python_chain(groups, np.float32)  # at most two groups here: any order is this one


@pytest.mark.parametrize("size,splits", [(1, 1), (8, 1), (32, 1), (32, 2), (100, 2)])
def test_blocked_sequential_equals_a_hand_loop(size, splits):
    rng = np.random.default_rng(RNG_SEED + size)
    for n in (1, 31, 32, 33, 500, 1000):
        x = wide_float32(rng, n)
        got = ok.reduce_sum(x, ok.Blocked(size, inner="sequential", splits=splits), rng=rng)
        assert same_bits(got, np.asarray(hand_blocked_sequential(x, size, splits))), (n, size, splits)


def test_blocked_pairwise_blocks_are_numpy_pairwise_sums():
    rng = np.random.default_rng(RNG_SEED)
    x = wide_float32(rng, 1000)
    blocks = [np.add.reduce(x[s:s + 300]) for s in range(0, 1000, 300)]
    assert same_bits(ok.reduce_sum(x, ok.Blocked(300, inner="pairwise")), np.asarray(python_chain(blocks, np.float32)))


@pytest.mark.parametrize("order", ["any", ok.Blocked(32), ok.Blocked(7, splits=3), ok.Blocked(5, splits=40)])
def test_a_random_order_sums_every_term_once(order):
    """On integers small enough that every partial sum is exact, any order gives the exact sum."""
    rng = np.random.default_rng(RNG_SEED)
    for n in (1, 2, 7, 8, 9, 127, 128, 129, 1000):
        T = rng.integers(-1000, 1000, (n, 5)).astype(np.float32)
        for style in range(3):
            got = ok.sum_any(T, rng, style) if order == "any" else ok.reduce_terms(T, order, rng)
            assert np.array_equal(got, T.astype(np.int64).sum(axis=0)), (n, style)


def test_random_orders_vary():
    rng = np.random.default_rng(RNG_SEED)
    T = wide_float32(rng, 64 * 50).reshape(64, 50)
    for style in range(3):
        results = {ok.sum_any(T, rng, style).tobytes() for _ in range(4)}
        assert len(results) > 1, style


# ---------------------------------------------------------------- matmul kernels

def test_sequential_matmul_equals_a_float32_loop():
    rng = np.random.default_rng(RNG_SEED)
    A, B = wide_float32(rng, 3 * 200).reshape(3, 200), wide_float32(rng, 200 * 2).reshape(200, 2)
    got = ok.dot_matmul(A, B, "sequential")
    for i in range(3):
        for j in range(2):
            assert same_bits(got[i, j], python_chain([A[i, k] * B[k, j] for k in range(200)], np.float32))


def test_pairwise_matmul_is_numpy_pairwise_over_products():
    rng = np.random.default_rng(RNG_SEED)
    A, B = wide_float32(rng, 2 * 1000).reshape(2, 1000), wide_float32(rng, 1000 * 3).reshape(1000, 3)
    got = ok.dot_matmul(A, B, "pairwise")
    for i in range(2):
        for j in range(3):
            assert same_bits(got[i, j], np.float32(0) + np.add.reduce(A[i] * B[:, j]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_matmul_accumulates_in_float32_and_rounds_once(dtype):
    rng = np.random.default_rng(RNG_SEED)
    A = rng.standard_normal((2, 300)).astype(ok.fmt(dtype))
    B = rng.standard_normal((300, 2)).astype(ok.fmt(dtype))
    got = ok.dot_matmul(A, B, "sequential")
    assert got.dtype == ok.fmt(dtype)
    want = ok.reduce_terms(A.astype(np.float32).T[:, :, None] * B.astype(np.float32)[:, None, :], "sequential")
    assert same_bits(got, want.astype(ok.fmt(dtype)))


def rn32(q: Fraction) -> np.float32:
    """The float32 nearest to the rational q, ties to even (finite, normal range)."""
    guess = np.float32(float(q))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def test_fma_rounds_once():
    rng = np.random.default_rng(RNG_SEED)
    acc = wide_float32(rng, 2000)
    a, b = wide_float32(rng, 2000), wide_float32(rng, 2000)
    # Near-ties: acc + a*b where a*b sits half an ulp of acc away, plus tiny tails.
    acc[:500] = 1.0
    a[:500] = np.float32(2.0 ** -24) * (1 + rng.integers(0, 4, 500))
    b[:500] = 1 + np.float32(2.0 ** -23) * rng.integers(-2, 3, 500)
    p = a.astype(np.float64) * b.astype(np.float64)
    got = ok.fma_round32(acc, p)
    for i in range(2000):
        want = rn32(Fraction(float(acc[i])) + Fraction(float(a[i])) * Fraction(float(b[i])))
        assert same_bits(got[i], want), i
    assert not same_bits(got, (acc + a * b).astype(np.float32))  # the data does tell fma apart


def test_fma_chain_differs_from_rounded_products_only_by_rounding():
    rng = np.random.default_rng(RNG_SEED)
    A, B = rng.standard_normal((4, 512)).astype(np.float32), rng.standard_normal((512, 4)).astype(np.float32)
    fused = ok.dot_matmul(A, B, "sequential", fma=True)
    plain = ok.dot_matmul(A, B, "sequential")
    assert not same_bits(fused, plain)
    assert np.all(np.abs(fused.astype(np.float64) - plain) < 1e-4)
    blocked = ok.dot_matmul(A, B, ok.Blocked(512, inner="sequential"), fma=True)
    assert same_bits(blocked, fused)


def test_matmul_kernel_is_fast_at_large_k():
    rng = np.random.default_rng(RNG_SEED)
    A, B = rng.standard_normal((8, 16384)).astype(np.float32), rng.standard_normal((16384, 8)).astype(np.float32)
    start = time.perf_counter()
    for order in (ok.Blocked(32), ok.Blocked(32, splits=4), "pairwise"):
        ok.dot_matmul(A, B, order, rng=rng)
    # About 0.1 s each when the machine is idle; loose because it is shared.
    assert time.perf_counter() - start < 10


# ---------------------------------------------------------------- rounding helpers

def test_tf32_rounds_to_nearest_even():
    one = 1.0
    cases = {one + 2.0 ** -11: one, one + 3 * 2.0 ** -11: one + 2.0 ** -9,
             one + 2.0 ** -11 + 2.0 ** -20: one + 2.0 ** -10, one + 2.0 ** -10: one + 2.0 ** -10}
    x = np.array(list(cases), dtype=np.float32)
    assert np.array_equal(ok.round_tf32(x), np.array(list(cases.values()), dtype=np.float32))
    rng = np.random.default_rng(RNG_SEED)
    y = wide_float32(rng, 5000)
    m, e = np.frexp(y.astype(np.float64))
    want = np.ldexp(np.round(np.ldexp(m, 11)), e - 11)  # np.round: half to even
    assert np.array_equal(ok.round_tf32(y), want.astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_truncating_cast_rounds_toward_zero(dtype):
    rng = np.random.default_rng(RNG_SEED)
    x = rng.standard_normal(3000) * 2.0 ** rng.integers(-5, 6, 3000)
    y = ok.round_to(x, dtype, "truncate").astype(np.float64)
    assert np.all(np.abs(y) <= np.abs(x))
    away = np.nextafter(ok.round_to(x, dtype, "truncate"), np.copysign(np.inf, x).astype(ok.fmt(dtype)))
    assert np.all(np.abs(away.astype(np.float64)) > np.abs(x))
    assert np.any(y != ok.round_to(x, dtype).astype(np.float64))


# ---------------------------------------------------------------- planted bugs

@pytest.fixture
def inputs():
    rng = np.random.default_rng(RNG_SEED)
    return rng, rng.standard_normal((4, 1024)).astype(np.float32), rng.standard_normal((1024, 4)).astype(np.float32)


def test_input_rounding_bugs_differ(inputs):
    rng, A, B = inputs
    order = ok.Blocked(32, inner="sequential")
    good = ok.dot_matmul(A, B, order)
    assert np.all(ok.tf32_inputs_matmul(A, B, order) != good)
    assert np.all(ok.bf16_inputs_matmul(A, B, order) != good)
    exact_tf32 = ok.round_tf32(A[:, :8]) == A[:, :8]
    assert not exact_tf32.any()


def test_skipped_term_is_the_sum_without_one_product(inputs):
    rng, A, B = inputs
    k = np.random.default_rng(5).integers(1024)
    got = ok.skipped_term_matmul(A, B, "sequential", np.random.default_rng(5))
    A2, B2 = A.copy(), B.copy()
    A2[:, k] = 0
    assert same_bits(got, ok.dot_matmul(A2, B2, "sequential"))
    assert np.all(got != ok.dot_matmul(A, B, "sequential"))
    x = np.arange(1, 101, dtype=np.float32)
    assert 5050 - ok.skipped_term_sum(x, "pairwise", rng) in set(range(1, 101))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("k", [1, 4, 256])
def test_ulps_off_moves_one_element_k_ulps(dtype, k):
    rng = np.random.default_rng(k)
    y = (rng.standard_normal((3, 3)) * 100).astype(ok.fmt(dtype))
    z = ok.ulps_off(y, k, rng)
    changed = np.flatnonzero(z.reshape(-1) != y.reshape(-1))
    assert len(changed) == 1
    i = changed[0]
    v = y.reshape(-1)[i:i + 1]
    target = np.array(np.copysign(np.inf, float(z.reshape(-1)[i]) - float(v[0])), dtype=y.dtype)
    for _ in range(k):
        v = np.nextafter(v, target)
    assert v[0] == z.reshape(-1)[i]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_chunk_accumulation_is_a_half_format_loop(dtype):
    rng = np.random.default_rng(RNG_SEED)
    half = ok.fmt(dtype)
    A, B = rng.uniform(0, 1, (4, 4096)).astype(half), rng.uniform(0, 1, (4096, 4)).astype(half)
    got = ok.half_chunks_matmul(A, B)
    products = [half.type(np.float32(A[1, k]) * np.float32(B[k, 2])) for k in range(4096)]
    chunks = [python_chain(products[s:s + 16], half.type) for s in range(0, 4096, 16)]
    assert same_bits(got[1, 2], python_chain(chunks, half.type))
    assert np.mean(got != ok.dot_matmul(A, B, ok.Blocked(32), rng=rng)) > 0.5
    x = A.reshape(-1)
    chunk_sums = [python_chain(list(x[s:s + 16]), half.type) for s in range(0, x.size, 16)]
    assert same_bits(ok.half_chunks_sum(x), np.asarray(python_chain(chunk_sums, half.type)))


def test_truncating_kernels_chop(inputs):
    rng, A, B = inputs
    order = ok.Blocked(32)
    chopped = ok.truncating_matmul(A, B, order, rng).astype(np.float64)
    wide = ok.dot_matmul(A, B, order, acc="float64", out="float64", rng=rng)
    assert np.all(np.abs(chopped) <= np.abs(wide) * (1 + 2.0 ** -40))
    x = rng.standard_normal(1000).astype(np.float16)
    assert abs(float(ok.truncating_sum(x, "pairwise"))) <= abs(float(ok.reduce_sum(x, "pairwise", out="float64")))
    xs = rng.standard_normal((200, 1000)).astype(np.float16)
    t = ok.reduce_sum(xs, "pairwise", acc="float32", axis=1, cast="truncate")
    assert np.any(t != ok.reduce_sum(xs, "pairwise", axis=1))


def test_flush_small_zeroes_the_cancellation_result():
    rng = np.random.default_rng(RNG_SEED)
    a = rng.standard_normal(64).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    A = np.concatenate([a, a])[None, :]
    B = np.concatenate([b, -b + np.float32(1e-4) * rng.standard_normal(64).astype(np.float32)])[:, None]
    good = ok.dot_matmul(A, B, "pairwise")
    assert good[0, 0] != 0
    assert ok.flush_small(good, ok.abs_terms_matmul(A, B))[0, 0] == 0
