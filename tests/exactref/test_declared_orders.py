"""Declared summation orders: the bounds hold where they are tight, and break when their derivation does.

The kernels here are stagnating sums, the worst case of a running error
bound: every addition of a value just under half an ulp of the partial sum
loses all of it, so the computed result is off by almost exactly
``u * sum |partial sums|``.  They are written as plain float32 loops, and the
exact values are Fractions, so nothing here comes from exactref's own
arithmetic.  Each mutation changes one step of the derivation in
docs/tolerance-models.md ("Declared orders") and must make a test fail.
"""

from __future__ import annotations

import dataclasses
import importlib
from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref.models import Blocked
from exactref.models import _running
from exactref.ops import reduction

# The module, not the op of the same name that exactref.ops exports.
matmul_module = importlib.import_module("exactref.ops.matmul")

F32 = np.float32
# Just under half an ulp of 1 in float32: 1 + DELTA rounds back to 1.
DELTA = F32(2.0 ** -24 - 2.0 ** -34)


def model(order, **kw):
    return er.models.DEFAULT.replace(order=order, **kw)


def chain(values) -> np.float32:
    acc = F32(values[0])
    for v in values[1:]:
        acc = F32(acc + F32(v))
    return acc


def blocked_stagnating(n_blocks: int, b: int) -> tuple[np.ndarray, np.float32]:
    """x whose first term is 1 and whose blocks each sum exactly to DELTA: every block add stagnates."""
    x = np.zeros(n_blocks * b, dtype=np.float32)
    x[0] = 1
    for j in range(n_blocks):
        x[j * b + 1 if j == 0 else j * b] = DELTA
    blocks = [chain(x[j * b:(j + 1) * b]) for j in range(n_blocks)]
    return x, chain(blocks)


def in_block_stagnating(b: int) -> tuple[np.ndarray, np.float32]:
    """One block: 1, then b-1 DELTAs, summed in index order (one of the orders 'any' allows)."""
    x = np.full(b, DELTA, dtype=np.float32)
    x[0] = 1
    return x, chain(x)


def exact_sum(x) -> Fraction:
    return sum((Fraction(float(v)) for v in x), Fraction(0))


def test_the_kernels_stagnate_and_the_exact_value_is_far():
    x = np.full(1000, DELTA, dtype=np.float32)
    x[0] = 1
    assert chain(x) == 1
    assert exact_sum(x) - 1 > Fraction(999 * 2 ** -25)
    xb, got = blocked_stagnating(64, 32)
    assert got == 1 and exact_sum(xb) - 1 == 64 * Fraction(float(DELTA))


@pytest.mark.parametrize("n", [3, 100, 1000])
def test_a_stagnating_sequential_sum_is_covered_nearly_at_its_bound(n):
    x = np.full(n, DELTA, dtype=np.float32)
    x[0] = 1
    res = er.sum(x, model=model("sequential"))
    assert res.covers(chain(x))
    # The bound is tight: the error is most of the tolerance (and the next float down is far outside).
    err = float(exact_sum(x) - 1)
    assert err / float(res.tolerance) > 0.99
    assert not res.covers(np.nextafter(F32(1), F32(0)))


def test_the_declared_bound_is_far_below_the_default_on_random_data():
    x = er.asarray(np.random.default_rng(0).standard_normal(4096), "float32")
    assert float(er.sum(x).tolerance) > 10 * float(er.sum(x, model=model("sequential")).tolerance)


def test_blocked_bounds_cover_stagnation_across_and_within_blocks():
    x, got = blocked_stagnating(64, 32)
    assert er.sum(x, model=model(Blocked(32))).covers(got)
    y, got_y = in_block_stagnating(32)
    assert er.sum(y, model=model(Blocked(32))).covers(got_y)
    assert er.sum(y, model=model(Blocked(32, inner="sequential"))).covers(got_y)


def _half_u(monkeypatch):
    """Mutation: each addition costs u/2 (a unit roundoff of 2**-(p+1)) instead of u."""
    real = _running.ordered_error

    def mutated(source, order, *, acc, **kw):
        return real(source, order, acc=dataclasses.replace(acc, p=acc.p + 1), **kw)

    monkeypatch.setattr(reduction, "ordered_error", mutated)
    monkeypatch.setattr(matmul_module, "ordered_error", mutated)


def test_mutation_half_a_unit_roundoff_per_addition_is_caught(monkeypatch):
    x = np.full(1000, DELTA, dtype=np.float32)
    x[0] = 1
    assert er.sum(x, model=model("sequential")).covers(chain(x))
    _half_u(monkeypatch)
    assert not er.sum(x, model=model("sequential")).covers(chain(x))


def test_mutation_forgetting_the_additions_of_block_sums_is_caught(monkeypatch):
    x, got = blocked_stagnating(64, 32)
    assert er.sum(x, model=model(Blocked(32))).covers(got)
    monkeypatch.setattr(_running, "_add_node", lambda st, partial: None)
    assert not er.sum(x, model=model(Blocked(32))).covers(got)


def test_mutation_a_block_in_any_order_budgeted_as_a_balanced_tree_is_caught(monkeypatch):
    # An order "any" allows is the chain in index order, which stagnates: 31 roundings, not log2(32).
    y, got = in_block_stagnating(32)
    y2 = np.concatenate([y, np.zeros(32, np.float32)])
    assert er.sum(y2, model=model(Blocked(32))).covers(got)
    real = _running._add_group
    monkeypatch.setattr(_running, "_add_group",
                        lambda st, depth, T: real(st, max(depth, 1).bit_length(), T))
    assert not er.sum(y2, model=model(Blocked(32))).covers(got)


def test_mutation_a_pairwise_tree_without_its_leaf_chains_is_caught(monkeypatch):
    # 128 terms: eight chains of 16; chain j starts at 1 and then adds DELTAs that are all lost.
    x = np.full(128, DELTA, dtype=np.float32)
    x[:8] = 1
    got = np.sum(x)  # numpy's own pairwise sum is the kernel
    assert got == 8
    assert er.sum(x, model=model("pairwise")).covers(got)
    real = _running._pairwise_leaf

    def no_chains(P, exclude_root):
        lin, sq, total, peak = real(P, exclude_root)
        body = P.shape[-1] - P.shape[-1] % 8
        chains = np.cumsum(P[..., :body].reshape(P.shape[:-1] + (body // 8, 8)), axis=-2)[..., 1:, :]
        return lin - np.abs(chains).sum(axis=(-1, -2)), sq, total, peak

    monkeypatch.setattr(_running, "_pairwise_leaf", no_chains)
    assert not er.sum(x, model=model("pairwise")).covers(got)


def test_a_matmul_that_stagnates_in_float32_is_covered_and_the_mutation_caught(monkeypatch):
    # Products of float16-exact values are exact in float32: the dot's error is the chain's alone.
    K = 512
    A = np.full((1, K), DELTA, dtype=np.float32)
    A[0, 0] = 1
    B = np.ones((K, 1), dtype=np.float32)
    got = np.array([[chain(A[0] * B[:, 0])]])
    assert er.matmul(A, B, model=model("sequential")).covers(got)
    _half_u(monkeypatch)
    assert not er.matmul(A, B, model=model("sequential")).covers(got)


def test_a_float16_sum_of_zeros_has_tolerance_zero_at_any_length():
    for n in (32767, 32768, 100_000):
        res = er.sum(er.asarray(np.zeros(n), "float16"))
        assert float(res.tolerance) == 0
        assert not res.covers(np.float16(0.001))


def test_a_long_float16_sum_is_judged_under_a_declared_order():
    rng = np.random.default_rng(2)
    x = er.asarray(rng.choice([-1, 1], 10 ** 6) * 2.0 ** rng.uniform(-5, 5, 10 ** 6), "float16")
    exact = exact_sum(x)
    assert -3500 < float(exact) < -1500
    # Sound for any order, the bound exceeds float16's range, so it judges nothing.
    assert er.sum(x).covers(np.float16(12345))
    res = er.sum(x, model=model("pairwise"))
    assert float(res.tolerance) < 4
    assert not res.covers(np.float16(12345)) and not res.covers(np.float16(np.inf))
    # numpy's float16 sum (pairwise, accumulated in float32) is a kernel of that class.
    assert res.covers(np.sum(x))


def test_partial_sums_that_may_overflow_add_only_inf_and_nan():
    x = er.asarray([60000.0, 60000.0, -60000.0, -60000.0, 1.0], "float16")
    res = er.sum(x, model=er.models.REDUCED_PRECISION_REDUCTION.replace(order="sequential"))
    assert res.covers(np.float16(1)) and res.covers(np.float16(np.inf))
    assert not res.covers(np.float16(-1000))
    # Under a pairwise order (n < 8 is a plain chain too) the same holds; in float32 no partial overflows.
    assert not er.sum(x, model=model("sequential")).covers(np.float16(np.inf))


def test_the_report_names_the_order_and_says_probabilistic():
    x = np.full(100, DELTA, dtype=np.float32)
    x[0] = 1
    res = er.sum(x, model=model(Blocked(32, inner="pairwise", splits=2), failure_rate=1e-12))
    with pytest.raises(er.MismatchError, match=r"order=Blocked\(32, inner='pairwise', splits=2\), probabilistic"):
        res.check(F32(2))
    assert "probabilistic" in repr(res)


def test_the_report_gives_the_error_of_one_emulated_kernel_of_the_order():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(300).astype(np.float32)
    res = er.sum(x, model=model(Blocked(16, inner="sequential")))
    by_hand = chain([chain(x[k:k + 16]) for k in range(0, 300, 16)])
    assert res._typical(()) == float(by_hand)
    typical = abs(float(Fraction(float(by_hand)) - exact_sum(x)))
    with pytest.raises(er.MismatchError) as info:
        res.check(F32(0))
    assert f"kernel, emulated on these inputs, is off by {typical:.3g}" in str(info.value)
    assert "Blocked(16, inner='sequential') kernel" in str(info.value)
    # Under the default ("any") the report has no such line: no order was declared.
    with pytest.raises(er.MismatchError) as info:
        er.sum(x).check(F32(0))
    assert "typical" not in str(info.value)


def test_the_emulated_matmul_kernel_rounds_its_products():
    A = np.array([[1 + 2.0 ** -12, 1.0]], dtype=np.float32)
    B = np.array([[1 + 2.0 ** -12], [-1.0]], dtype=np.float32)
    res = er.matmul(A, B, model=model("sequential"))
    # fl(a b) = 1 + 2^-11 (the 2^-24 is lost), then minus 1.
    assert res._typical((0, 0)) == 2.0 ** -11
    assert float(res.rounded[0, 0]) == 2.0 ** -11 + 2.0 ** -24


@pytest.mark.parametrize("order", [Blocked(32, inner="sequential"), Blocked(32, inner="sequential", splits=2),
                                   "sequential", "pairwise", "any"])
def test_a_one_term_sum_accepts_only_its_value_and_warns_nothing(order):
    with np.errstate(all="raise"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            res = er.sum(np.ones(1, np.float32), model=model(order, failure_rate=1e-12))
    # As under the default: only the exact value (the tolerance shows float64 slack, 2^-50).
    assert res.tolerance.dtype == np.float64 and float(res.tolerance) == float(er.sum(np.ones(1, np.float32)).tolerance)
    assert res.covers(np.float32(1)) and not res.covers(np.nextafter(np.float32(1), np.float32(2)))


def test_the_probabilistic_bound_keeps_the_sound_one_on_constant_data():
    x = np.full(100_000, 0.1, dtype=np.float32)
    sound, prob = er.sum(x, model=model("sequential")), er.sum(x, model=model("sequential", failure_rate=1e-12))
    assert float(prob.tolerance) == float(sound.tolerance)
    x[::2] = 0.3  # two values: varied enough for the model, and much tighter
    assert float(er.sum(x, model=model("sequential", failure_rate=1e-12)).tolerance) < \
        float(er.sum(x, model=model("sequential")).tolerance) / 10


@pytest.mark.parametrize("order", ["sequential", "pairwise", Blocked(4), Blocked(4, inner="pairwise", splits=2)])
@pytest.mark.parametrize("failure_rate", [None, 1e-12])
def test_empty_sums_and_empty_outputs_under_every_order(order, failure_rate):
    m = model(order, failure_rate=failure_rate)
    A, B = np.zeros((2, 0), np.float32), np.zeros((0, 3), np.float32)
    assert er.matmul(A, B, model=m).covers(np.zeros((2, 3))).all()
    g = er.matmul.backward(A, B, np.ones((2, 3), np.float32), model=m)
    assert g["grad_A"].shape == (2, 0) and g["grad_B"].shape == (0, 3)
    assert er.sum(np.zeros((2, 0), np.float32), axis=1, model=m).covers(np.zeros(2)).all()
    assert er.sum(np.zeros((0, 4), np.float32), axis=1, model=m).shape == (0,)


@pytest.mark.parametrize("preset", [er.models.TF32_MATMUL, er.models.BF16_MATMUL])
@pytest.mark.parametrize("kind", ["normal", "cancel"])
def test_rounded_inputs_under_a_declared_order_cover_their_kernels(preset, kind):
    from . import order_kernels as ok

    rng = np.random.default_rng(11)
    for K in (7, 129, 4096):
        A = rng.standard_normal((4, K)).astype(np.float32)
        B = rng.standard_normal((K, 4)).astype(np.float32)
        if kind == "cancel":
            B[K // 2:] = -B[:K - K // 2][: K - K // 2] if K > 1 else B[K // 2:]
            A[:, K // 2:] = A[:, :K - K // 2]
        kernel = ok.tf32_inputs_matmul if preset is er.models.TF32_MATMUL else ok.bf16_inputs_matmul
        for order, kernel_order in ((Blocked(32), ok.Blocked(32)), ("sequential", "sequential")):
            got = kernel(A, B, kernel_order, rng=rng)
            res = er.matmul(A, B, model=preset.replace(order=order))
            assert res.covers(got).all(), (preset, order, K, kind)
            # The inputs' rounding does not depend on the order, so it stays in the bound.
            assert np.all(res.tolerance <= er.matmul(A, B, model=preset).tolerance)
