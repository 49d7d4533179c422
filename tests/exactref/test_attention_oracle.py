"""scaled_dot_product_attention's rounded values agree bit for bit with an independent mpmath oracle.

The oracle (``_attention_oracle``) works from the definition at 320 bits,
with Fractions for rows whose weights are rational.  Its own rounding noise
(2**-300 of the terms' magnitude) can hide a value that is exactly a rounding
boundary or zero; there exactref must either agree with one of the two
roundings next to the boundary or raise ReferenceUnavailableError, and the
test checks which.
"""

from __future__ import annotations

import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
from exactref.ops.attention import _double as double
from exactref.ops.attention import _second as second
from exactref.ops.attention import op as attention

from ._attention_oracle import Oracle, is_near_boundary, round_to

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
KINDS = ["plain", "bool_mask", "float_mask", "causal", "causal_bottom_right", "gqa", "broadcast", "empty_rows"]


@st.composite
def cases(draw, fmt):
    kind = draw(st.sampled_from(KINDS))
    L = draw(st.integers(1, 3))
    S = draw(st.integers(1, 3))
    if kind.startswith("causal") and L == S:
        S += draw(st.sampled_from([-1, 1])) if L > 1 else 1
    E = draw(st.integers(1, 3))
    Ev = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    # Small integers and halves make ties, zeros and equal logits (rational rows);
    # the normal draws make transcendental ones.
    values = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 0.25]),
                       st.floats(-8, 8, allow_nan=False, width=32))

    def arr(*shape):
        flat = draw(st.lists(values, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        return er.asarray(np.array(flat, dtype=np.float64).reshape(shape), fmt)

    qb, kb = (H,), (H,)
    kw, okw = {}, {}
    if kind == "gqa":
        qb, kb = (1, 2 * H), (1, H)
        kw["enable_gqa"] = okw["enable_gqa"] = True
    elif kind == "broadcast":
        qb, kb = (2, 1), (1, H)
    q, k, v = arr(*qb, L, E), arr(*kb, S, E), arr(*kb, S, Ev)
    if kind in ("bool_mask", "empty_rows"):
        m = np.array(draw(st.lists(st.booleans(), min_size=L * S, max_size=L * S))).reshape(L, S)
        if kind == "empty_rows":
            m[0] = False
        kw["attn_mask"] = okw["mask"] = m
    elif kind == "float_mask":
        m = arr(L, S)
        m[np.array(draw(st.lists(st.booleans(), min_size=L * S, max_size=L * S))).reshape(L, S)] = -np.inf
        kw["attn_mask"] = okw["mask"] = m
    elif kind.startswith("causal"):
        kw["is_causal"] = okw["is_causal"] = True
        if kind == "causal_bottom_right":
            kw["causal_alignment"] = "bottom_right"
            okw["bottom_right"] = True
    if draw(st.booleans()):
        kw["scale"] = okw["scale"] = draw(st.sampled_from([0.5, 0.3, 1.25, -0.75]))
    out_batch = qb if kind == "gqa" else np.broadcast_shapes(qb, kb)
    grad = arr(*out_batch, L, Ev)
    return q, k, v, grad, kw, okw


def _agree(got: np.ndarray, exact: np.ndarray, fmt: str, magnitudes: np.ndarray | None = None) -> None:
    """Bit-for-bit agreement, except where the oracle cannot tell a boundary from its neighbourhood."""
    expected = np.vectorize(lambda x: round_to(x, fmt), otypes=[np.float64])(exact)
    got = np.asarray(got, dtype=np.float64)
    for i in np.flatnonzero(got.reshape(-1).view(np.int64) != expected.reshape(-1).view(np.int64)):
        x = exact.reshape(-1)[i]
        mag = 0.0 if magnitudes is None else float(magnitudes.reshape(-1)[i])
        assert is_near_boundary(x, fmt, mag), (i, got.reshape(-1)[i], expected.reshape(-1)[i], x)


def check_case(case, fmt):
    q, k, v, grad, kw, okw = case
    oracle = Oracle(q, k, v, **okw)
    r = er.scaled_dot_product_attention(q, k, v, **kw)
    assert r.dtype == DTYPES[fmt]
    _agree(r.rounded, oracle.out(), fmt)
    exact = oracle.grads(grad)
    try:
        g = r.backward(grad)
    except er.ReferenceUnavailableError:
        # Only allowed when some gradient element is (within the oracle's noise) a boundary.
        near = [is_near_boundary(x, fmt, m) for name in exact
                for x, m in zip(exact[name].reshape(-1), oracle.magnitudes[name].reshape(-1))]
        assert any(near)
        return
    for name in ("grad_query", "grad_key", "grad_value"):
        assert g[name].rounded.shape == exact[name].shape
        _agree(g[name].rounded, exact[name], fmt, oracle.magnitudes[name])


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "float64"])
@settings(deadline=None, max_examples=100)
@given(data=st.data())
def test_rounded_values_agree_with_the_oracle(fmt, data):
    check_case(data.draw(cases(fmt)), fmt)


def test_uniform_rows_round_ties_to_even():
    # q = 0 makes every logit 0, so each output is the exact mean of v's column:
    # (1 + (1 + 2**-23)) / 2 = 1 + 2**-24 is a float32 tie, which rounds to even (1.0).
    q = np.zeros((1, 2, 4), dtype=np.float32)
    k = np.ones((2, 4), dtype=np.float32)
    v = np.array([[1.0], [1.0 + 2.0 ** -23]], dtype=np.float32)
    r = er.scaled_dot_product_attention(q, k, v)
    assert r.rounded.tolist() == [[[1.0], [1.0]]]
    v3 = np.array([[1.0 + 2.0 ** -22], [1.0 + 2.0 ** -23]], dtype=np.float32)
    # The mean 1 + 3 * 2**-24 is a tie between 1 + 2**-23 (odd) and 1 + 2**-22 (even).
    assert er.scaled_dot_product_attention(q, k, v3).rounded[0, 0, 0] == np.float32(1.0 + 2.0 ** -22)


def test_default_scale_is_irrational_not_its_float():
    # E = 3: 1/sqrt(3) is irrational; the oracle takes it exactly, so agreement on
    # many elements shows exactref does too.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 5, 3)).astype(np.float32) for _ in range(3))
    oracle = Oracle(q, k, v)
    _agree(er.scaled_dot_product_attention(q, k, v).rounded, oracle.out(), "float32")


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("seed", [0, 1])
def test_moderate_sizes_agree_with_the_oracle(fmt, seed):
    # Large enough that the first pass's sliced products and compensated sums do the deciding.
    rng = np.random.default_rng(seed)
    q, k, v = (er.asarray(rng.standard_normal((2, 9, 6)) * 2, fmt) for _ in range(3))
    grad = er.asarray(rng.standard_normal((2, 9, 6)), fmt)
    mask = rng.random((9, 9)) < 0.8
    oracle = Oracle(q, k, v, mask=mask)
    r = er.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _agree(r.rounded, oracle.out(), fmt)
    exact = oracle.grads(grad)
    g = r.backward(grad)
    for name in ("grad_query", "grad_key", "grad_value"):
        _agree(g[name].rounded, exact[name], fmt, oracle.magnitudes[name])


@pytest.mark.parametrize("kind", ["plain", "gqa"])
def test_float64_refinements_share_weights_and_dS_and_agree_with_the_oracle(monkeypatch, kind):
    # Without the double-double pass a float64 output leaves every element to Arb: the forward
    # computes every row's weights, the backward's grad_query every row's dS, and grad_key and
    # grad_value reuse both (_wholehead).
    from exactref.ops.attention import _wholehead

    _no_double_pass(monkeypatch)

    used = {"weights": 0, "dS": 0}
    real_init, real_full = _wholehead.WholeHead.__init__, _wholehead.WholeHead.full

    def init(self, pb, fp, G, h, head=None):
        import flint
        used["weights"] += len(fp.arb_weights.get((h, flint.ctx.prec), {})) == pb.L
        real_init(self, pb, fp, G, h, head)

    def full(self, which):
        used["dS"] += which == "key" and self.head is not None and len(self.head.dS_rows) == self.pb.L
        return real_full(self, which)

    monkeypatch.setattr(_wholehead.WholeHead, "__init__", init)
    monkeypatch.setattr(_wholehead.WholeHead, "full", full)
    rng = np.random.default_rng(7)
    heads, kw = ((2, 4), {"enable_gqa": True}) if kind == "gqa" else ((2, 2), {})
    q = er.asarray(rng.standard_normal((heads[1], 12, 5)) * 2, "float64")
    k, v = (er.asarray(rng.standard_normal((heads[0], 12, 5)) * 2, "float64") for _ in range(2))
    grad = er.asarray(rng.standard_normal((heads[1], 12, 5)), "float64")
    oracle = Oracle(q, k, v, enable_gqa=True) if kind == "gqa" else Oracle(q, k, v)
    r = er.scaled_dot_product_attention(q, k, v, **kw)
    _agree(r.rounded, oracle.out(), "float64")
    exact = oracle.grads(grad)
    g = r.backward(grad)
    for name in ("grad_query", "grad_key", "grad_value"):
        _agree(g[name].rounded, exact[name], "float64", oracle.magnitudes[name])
    assert used["weights"] >= 2 and used["dS"] >= 2


def _no_double_pass(monkeypatch):
    """Make the double-double pass decide nothing, as if it were not there."""
    def nothing(self, which, flats):
        n = len(flats)
        return np.zeros(n), np.zeros(n), np.full(n, np.inf)

    monkeypatch.setattr(double.DoublePass, "enclose", nothing)


def _everything_through(monkeypatch, stage):
    """Make the first pass (and, for stage "arb", the second) decide nothing."""
    from exactref.ops.attention import op as attention

    real = attention.decide

    def undecided(hi, lo, rad, fmt, bounds=None):
        rounded, ok = real(hi, lo, rad, fmt, bounds)
        # The first pass decides whole outputs (2 or more dimensions), the second a flat list.
        if stage == "arb" or np.ndim(hi) > 1:
            ok = np.zeros_like(ok)
        return rounded, ok

    monkeypatch.setattr(attention, "decide", undecided)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stage", ["second", "arb"])
def test_every_decision_stage_gives_the_same_rounding(monkeypatch, stage, dtype):
    # The first and second passes only decide what they can prove; sending every element
    # through the later stages must not change a single bit.  (float64 results go through the
    # double-double pass, narrower ones through the longdouble pass.)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 7, 5)).astype(dtype) for _ in range(3))
    grad = rng.standard_normal((2, 7, 5)).astype(dtype)
    mask = rng.random((7, 7)) < 0.7
    r = er.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = r.backward(grad)
    _everything_through(monkeypatch, stage)
    r2 = er.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g2 = r2.backward(grad)
    view = np.int32 if dtype == np.float32 else np.int64
    assert np.array_equal(r.rounded.view(view), r2.rounded.view(view))
    for name in g:
        assert np.array_equal(g[name].rounded.view(view), g2[name].rounded.view(view)), name


def test_a_second_pass_enclosure_clearing_a_midpoint_by_less_than_the_cheap_slack_is_decided():
    # The seed-0 1x8x1024x64 float32 backward's grad_key[0, 1, 893, 11]: its longdouble enclosure
    # clears the float32 midpoint below it by 9.6e-18 with a radius of 6.5e-18; the relative slack of
    # 2**-50 (4e-18 at 0.0045) left it undecided and sent its head to the double-double pass.
    from fractions import Fraction

    from .oracle import round_fraction
    enc = tuple(np.array([x]) for x in (0.004525490803644071, 3.049318610115481e-20, 6.512642691598746e-18))
    fmt = er.formats.FORMATS["float32"]
    _, cheap, _, _ = attention._rounded_and_bounds(*enc, fmt)
    rounded, ok, x_lo, x_hi = attention._rounded_and_bounds(*enc, fmt, tight=True)
    assert not cheap[0] and ok[0]
    exact_lo = Fraction(enc[0][0]) + Fraction(enc[1][0]) - Fraction(enc[2][0])
    exact_hi = exact_lo + 2 * Fraction(enc[2][0])
    assert rounded[0] == round_fraction(exact_lo, "float32") == round_fraction(exact_hi, "float32")
    assert Fraction(x_lo[0]) <= exact_lo and exact_hi <= Fraction(x_hi[0])


def _enclosures_hold(oracle: Oracle, grad, seen) -> int:
    """Each recorded (which, flat indices, hi, lo, rad) must hold the oracle's exact values;
    returns how many elements were checked."""
    exact = {"out": oracle.out(), **{name[5:]: x for name, x in oracle.grads(grad).items()}}
    with mpmath.workprec(320):
        for which, flats, hi, lo, rad in seen:
            for f, h, l_, r_ in zip(flats, hi, lo, rad):
                x = exact[which].reshape(-1)[f]
                x = mpmath.mpf(x.numerator) / x.denominator if hasattr(x, "numerator") else mpmath.mpf(x)
                assert abs(x - (mpmath.mpf(h) + mpmath.mpf(l_))) <= r_, (which, f, h, l_, r_, x)
    return sum(len(flats) for _, flats, *_ in seen)


def _second_pass_holds(q, k, v, grad, kw, okw, pass_cls=second.SecondPass, seen=None) -> int:
    """Send every element through a second pass (the longdouble one, or ``double.DoublePass``, for
    every output format) and check that each enclosure holds the oracle's value; returns how many
    elements it enclosed, and leaves the (which, flats, hi, lo, rad) it saw in ``seen``."""
    seen = [] if seen is None else seen
    real = pass_cls.enclose

    def recording(self, which, flats):
        hi, lo, rad = real(self, which, flats)
        seen.append((which, flats, hi, lo, rad))
        return hi, lo, rad

    with pytest.MonkeyPatch.context() as mp:
        _everything_through(mp, "second")
        mp.setattr(pass_cls, "enclose", recording)
        # The longdouble pass for every format (float64 skips it by default), or for none.
        mp.setattr(attention, "_SECOND_PASS_MAX_P", 53 if pass_cls is second.SecondPass else 0)
        r = er.scaled_dot_product_attention(q, k, v, **kw)
        try:
            r.backward(grad)
        except er.ReferenceUnavailableError:
            pass  # raised after the second pass, by the Arb stage
    return _enclosures_hold(Oracle(q, k, v, **okw), grad, seen)


def _first_pass_holds(q, k, v, grad, kw, okw) -> int:
    """Check that every first-pass enclosure (of the output and the three gradients) holds the
    oracle's value; returns how many elements it checked."""
    seen = []
    real = attention._decide

    def recording(passes, which, enclosure, fmt, special):
        hi, lo, rad = (np.asarray(a).reshape(-1).copy() for a in enclosure)
        seen.append((which, np.arange(hi.size), hi, lo, rad))
        return real(passes, which, enclosure, fmt, special)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_decide", recording)
        r = er.scaled_dot_product_attention(q, k, v, **kw)
        try:
            r.backward(grad)
        except er.ReferenceUnavailableError:
            pass  # raised after the first pass
    return _enclosures_hold(Oracle(q, k, v, **okw), grad, seen)


@pytest.mark.parametrize("fmt", ["float32", "float16", "float64"])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_first_pass_enclosures_hold_the_oracle_values(fmt, data):
    _first_pass_holds(*data.draw(cases(fmt)))


def test_first_pass_encloses_every_element_of_a_moderate_case():
    rng = np.random.default_rng(6)
    q, k, v, grad = (rng.standard_normal((2, 9, 6)).astype(np.float32) * 2 for _ in range(4))
    mask = rng.random((9, 9)) < 0.8
    assert _first_pass_holds(q, k, v, grad, {"attn_mask": mask}, {"mask": mask}) == 4 * q.size


def test_first_pass_gradients_pay_for_the_plain_products_rounding():
    # One key: every weight is exactly 1, so grad_value is the plain float64 sum of dO's column.  A 1
    # then 1023 terms just above half its ulp: each addition to a partial sum near 1 rounds up a whole
    # ulp, an error of about 3.4e-15 of the sum, above the bound on the weights' own error (1.9e-15):
    # only Higham's gamma_K term keeps the enclosure around the exact value.
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 1024, 1))
    k, v = rng.standard_normal((1, 1, 1)), rng.standard_normal((1, 1, 1))
    grad = np.full((1, 1024, 1), 2.0 ** -53 * (1 + 2.0 ** -52))
    grad[0, 0, 0] = 1.0
    assert _first_pass_holds(q, k, v, grad, {}, {}) == 2 * 1024 + 2  # out and grad_query, grad_key and grad_value


@pytest.mark.parametrize("fmt", ["float32", "float64"])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_second_pass_enclosures_hold_the_oracle_values(fmt, data):
    # Its decisions then cannot be wrong, whatever the output format.
    _second_pass_holds(*data.draw(cases(fmt)))


@pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass")
@pytest.mark.parametrize("rows_a_block", [None, 2])  # 2: five blocks of rows in a head of 9
def test_second_pass_encloses_every_element_of_a_moderate_case(rows_a_block, monkeypatch):
    if rows_a_block is not None:
        monkeypatch.setattr(second, "_ROWS_BLOCK", rows_a_block * 9)
    rng = np.random.default_rng(5)
    q, k, v, grad = (rng.standard_normal((2, 9, 6)).astype(np.float32) * 2 for _ in range(4))
    mask = rng.random((9, 9)) < 0.8
    n = _second_pass_holds(q, k, v, grad, {"attn_mask": mask}, {"mask": mask})
    assert n == 4 * q.size  # out, grad_query, grad_key and grad_value: none a structural zero


@pytest.mark.parametrize("fmt", ["float32", "float16", "float64"])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_double_pass_enclosures_hold_the_oracle_values(fmt, data):
    _second_pass_holds(*data.draw(cases(fmt)), pass_cls=double.DoublePass)


def test_double_pass_encloses_and_decides_a_float64_case():
    rng = np.random.default_rng(8)
    q, k, v, grad = (rng.standard_normal((2, 9, 6)) * 2 for _ in range(4))
    mask = rng.random((9, 9)) < 0.8
    n = _second_pass_holds(q, k, v, grad, {"attn_mask": mask}, {"mask": mask}, pass_cls=double.DoublePass)
    assert n == 4 * q.size
    # Its enclosures are near 2**-100 relative: by default it leaves nothing to Arb here.
    sent = []
    real = attention.Refiner.refine

    def counting(self, which, flats, fmt, presorted=False):
        sent.append(len(flats))
        return real(self, which, flats, fmt, presorted)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention.Refiner, "refine", counting)
        er.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)
    assert len(sent) == 4 and sum(sent) == 0


# Which outputs must come out tight, not just sound.  Huge logits make each row's weights nearly
# one-hot, so dS is an exponentially small difference of numbers near 1, which no double-double
# resolves (grad_query and grad_key go on to Arb's split R + eps); values near 2**-1000 are below
# what the error-free slicing handles (its radius is inf there), so everything goes on to Arb.
_TIGHT = {"huge_logits": {"out", "value"}, "tiny_values": set(), "wide": {"out", "query", "key", "value"}}


@pytest.mark.parametrize("size", list(_TIGHT))
def test_double_pass_encloses_weights_that_underflow_and_values_near_underflow(size):
    # Logits hundreds apart (weights below 2**-1074, clamped below exp(-745)), values near 2**-1000
    # (whose products' low parts underflow) and a mix of magnitudes.
    rng = np.random.default_rng(9)
    q, k, v, grad = (rng.standard_normal((1, 5, 4)) for _ in range(4))
    if size == "huge_logits":
        q *= 60.0
        k *= 60.0
    elif size == "tiny_values":
        v *= 2.0 ** -1000
        grad *= 2.0 ** -20
    else:
        q *= 2.0 ** rng.integers(-30, 6, q.shape)
        v *= 2.0 ** rng.integers(-900, 300, v.shape)
    seen = []
    assert _second_pass_holds(q, k, v, grad, {}, {}, pass_cls=double.DoublePass, seen=seen) == 4 * q.size
    for which, _, hi, lo, rad in seen:
        if which in _TIGHT[size]:
            # Not by giving up: finite, and far inside a float64 ulp.
            assert np.mean(rad <= 2.0 ** -70 * np.abs(hi)) >= 0.75, which


def test_a_float64_output_near_a_midpoint_is_rounded_correctly():
    # A fresh CI run drew this: the exact value lies 9.8e-26 beyond the midpoint of two float64
    # neighbours.  The longdouble second pass composed its weights' relative errors as
    # (1 + e)(1 + 2**-64)... / (...) - 1 in float64, where they all vanished, and missed it.
    h = float.fromhex
    q = np.zeros((1, 1, 3))
    q[0, 0] = [2.0, 0.0, -h("0x1.bc49d80000000p+2")]
    k = np.array([[[0.0, 0.0, 2.0], [0.25, 0.0, 0.0], [-h("0x1.31a0c60000000p+2"), 0.0, -h("0x1.80f9380000000p+2")]]])
    v = np.array([[[0.0], [h("0x1.d5d2a40000000p+2")], [0.0]]])
    r = er.scaled_dot_product_attention(q, k, v)
    _agree(r.rounded, Oracle(q, k, v).out(), "float64")
    assert r.rounded[0, 0, 0] == h("0x1.61a365a341dc7p-24")


@pytest.mark.parametrize("rels", [(0.0, 2.0 ** -64, 0.0), (2.0 ** -60, 2.0 ** -53, 1e-30), (1e-3, 0.25, 1e-9)])
def test_composed_relative_errors_do_not_vanish_and_bound_the_ratio(rels):
    from exactref.ops.attention._first import ratio_error

    with mpmath.workprec(300):
        num = mpmath.fprod([1 + mpmath.mpf(r) for r in rels])
        den = mpmath.fprod([1 - mpmath.mpf(r) for r in rels])
        exact = num / den - 1
    bound = float(ratio_error(*rels))
    assert mpmath.mpf(bound) >= exact
    assert bound <= 4 * float(exact) + 1e-300
