"""The refinement at scale: whole-head Arb for grad_key and grad_value, the cheap exact analysis, the budget.

Every value is checked against the independent mpmath/Fraction oracle of
``_attention_oracle``; the fast passes are switched off (as in
test_attention_oracle's ``_everything_through``) so that the paths under test
decide every element.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref.ops.attention import _certified as certified
from exactref.ops.attention import op as attention

from ._attention_oracle import Oracle, is_near_boundary, round_to


def _nothing_decided_before_arb(mp: pytest.MonkeyPatch) -> None:
    real = attention.decide

    def undecided(hi, lo, rad, fmt, bounds=None):
        rounded, ok = real(hi, lo, rad, fmt, bounds)
        return rounded, np.zeros_like(ok)

    mp.setattr(attention, "decide", undecided)


def _agree(got, exact, fmt: str, magnitudes=None) -> None:
    expected = np.vectorize(lambda x: round_to(x, fmt), otypes=[np.float64])(exact)
    got = np.asarray(got, dtype=np.float64)
    bad = np.flatnonzero(got.reshape(-1).view(np.int64) != expected.reshape(-1).view(np.int64))
    for i in bad:
        mag = 0.0 if magnitudes is None else float(magnitudes.reshape(-1)[i])
        assert is_near_boundary(exact.reshape(-1)[i], fmt, mag), (i, got.reshape(-1)[i], expected.reshape(-1)[i])


def _check_grads(q, k, v, grad, **kw) -> er.Gradients:
    g = er.scaled_dot_product_attention(q, k, v, **kw).backward(grad)
    oracle = Oracle(q, k, v)
    exact = oracle.grads(grad)
    for name in ("grad_query", "grad_key", "grad_value"):
        _agree(g[name].rounded, exact[name], "float32", oracle.magnitudes[name])
    return g


def _inputs(seed: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("split", [True, False])
def test_whole_head_arb_and_direct_balls_agree_with_the_oracle(monkeypatch, split):
    # Every element goes to Arb; grad_key and grad_value through the whole-head products.  Without
    # the split (its cost made unaffordable), every precision evaluates direct balls.
    q, k, v, grad = _inputs(5, (2, 24, 6))
    _nothing_decided_before_arb(monkeypatch)
    if not split:
        monkeypatch.setattr(certified, "_FRACTION", 1e30)
    _check_grads(q, k, v, grad)


def test_whole_head_arb_agrees_with_a_mask_and_broadcast_copies(monkeypatch):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 3, 10, 4)).astype(np.float32)
    k, v = (rng.standard_normal((1, 3, 12, 4)).astype(np.float32) for _ in range(2))
    grad = rng.standard_normal((2, 3, 10, 4)).astype(np.float32)
    mask = rng.random((10, 12)) < 0.6
    mask[3] = False  # a row that attends to nothing
    _nothing_decided_before_arb(monkeypatch)
    g = er.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)
    oracle = Oracle(q, k, v, mask=mask)
    exact = oracle.grads(grad)
    for name in ("grad_query", "grad_key", "grad_value"):
        _agree(g[name].rounded, exact[name], "float32", oracle.magnitudes[name])


def test_rows_with_constant_dP_add_exactly_zero(monkeypatch):
    # v_j = a + t_j e_0, so dP_ij = dO_i . a + t_j dO_i0: constant over the keys where dO_i0 = 0.
    # Those rows add nothing to grad_key; with every row so, grad_key and grad_query are exactly 0,
    # which only the exact analysis (not any ball) decides.
    rng = np.random.default_rng(7)
    L, S, E = 9, 8, 4
    q, k = (rng.standard_normal((L if n == 0 else S, E)).astype(np.float32) for n in range(2))
    a = rng.standard_normal(E).astype(np.float32)
    v = np.tile(a, (S, 1))
    v[:, 0] += np.arange(S, dtype=np.float32)
    grad = rng.standard_normal((L, E)).astype(np.float32)
    grad[:, 0] = 0
    _nothing_decided_before_arb(monkeypatch)
    g = _check_grads(q, k, v, grad)
    assert not g.rounded.grad_key.any() and not g.rounded.grad_query.any()
    # Some rows varying again: the exact analysis must count only those.
    grad[::3, 0] = 1
    _check_grads(q, k, v, grad)


def test_the_cheap_row_analysis_matches_the_exact_definitions():
    # _dP_varies and _rational_rows decide most rows from enclosures: compare every row with
    # Fractions computed here.
    rng = np.random.default_rng(8)
    L, S, E = 12, 10, 4
    q = rng.standard_normal((1, L, E)).astype(np.float32)
    q[0, :4] = 0  # rows with equal logits: rational weights
    k = rng.standard_normal((1, S, E)).astype(np.float32)
    v = rng.standard_normal((1, S, E)).astype(np.float32)
    v[0, :, 1:] = v[0, :1, 1:]
    grad = rng.standard_normal((1, L, E)).astype(np.float32)
    grad[0, 5:, 0] = 0  # rows whose dP is constant
    captured = {}
    real = certified.Refiner.refine

    def keep(self, which, flats, fmt, **kw):
        captured.setdefault(which, self)
        return real(self, which, flats, fmt, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(certified.Refiner, "refine", keep)
        er.scaled_dot_product_attention(q, k, v).backward(grad)
    ref = captured["key"]
    F = [[Fraction(float(x)) for x in row] for row in grad[0]]
    Vf = [[Fraction(float(x)) for x in row] for row in v[0]]
    for i in range(L):
        dP = {sum(F[i][c] * Vf[j][c] for c in range(E)) for j in range(S)}
        assert bool(ref._dP_varies(0)[i]) == (len(dP) > 1), i
        logits = {sum(Fraction(float(q[0, i, c])) * Fraction(float(k[0, j, c])) for c in range(E))
                  for j in range(S)}
        assert bool(ref._rational_rows(0)[i]) == (len(logits) == 1), i


def test_a_tiny_budget_raises_a_budget_error_naming_the_element(monkeypatch):
    q, k, v, _ = _inputs(9, (6, 3))
    _nothing_decided_before_arb(monkeypatch)
    with pytest.raises(er.ReferenceUnavailableError) as info:
        er.scaled_dot_product_attention(q, k, v, refine_budget=10)
    assert type(info.value).__name__ == "ReferenceBudgetError"
    text = str(info.value)
    assert text.startswith("scaled_dot_product_attention at (") and "refine_budget" in text
    # The same call with the default budget decides everything.
    r = er.scaled_dot_product_attention(q, k, v)
    _agree(r.rounded, Oracle(q, k, v).out(), "float32")


def test_a_zero_budget_is_unused_when_the_fast_passes_decide():
    q, k, v, _ = _inputs(10, (2, 16, 8))
    r = er.scaled_dot_product_attention(q, k, v, refine_budget=0)
    _agree(r.rounded, Oracle(q, k, v).out(), "float32")


@pytest.mark.parametrize("bad", [-1, "a lot", True, float("nan")])
def test_a_bad_budget_names_the_argument(bad):
    with pytest.raises((TypeError, ValueError), match="refine_budget"):
        er.scaled_dot_product_attention([[1.0]], [[1.0]], [[1.0]], refine_budget=bad)


def test_a_moderate_random_case_through_arb_agrees_with_the_oracle(monkeypatch):
    # A smaller cousin of the benchmark's cliff: 64 positions, every gradient element through Arb.
    q, k, v, grad = _inputs(0, (1, 64, 8))
    _nothing_decided_before_arb(monkeypatch)
    _check_grads(q, k, v, grad)
