"""scaled_dot_product_attention's arguments, semantics, special values and ReferenceUnavailableError."""

from __future__ import annotations

import math
import random
import re
import time
from fractions import Fraction

import flint
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er
from exactref.ops.attention import AttentionTolerance
from exactref.ops.attention import _second as second
from exactref.ops.attention._first import exp_bounded

sdpa = er.scaled_dot_product_attention


def _qkv(shape=(1, 2, 4, 8), seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for _ in range(3))


def _math(q, k, v, grad, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


# ---------------------------------------------------------------------------- the spec's third block


def test_the_spec_block_on_attention_prints_true_three_times():
    # backward.txt, "Checking against PyTorch's autograd": same draws, same calls.
    rng = random.Random(0)

    def randn(*shape):
        values = [rng.gauss(0, 1) for _ in range(math.prod(shape))]
        return torch.tensor(values).reshape(shape)

    randn(16, 32), randn(32, 8), randn(16, 8)  # the block before draws A, B and grad first
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
    grad = randn(1, 2, 8, 16)
    out.backward(grad)
    g = sdpa(q, k, v, is_causal=True).backward(grad)
    for name, t in [("grad_query", q_), ("grad_key", k_), ("grad_value", v_)]:
        assert g[name].covers(t.grad).all(), name


# ---------------------------------------------------------------------------- argument checks

Q = np.zeros((2, 3, 4), dtype=np.float32)
K = np.zeros((2, 5, 4), dtype=np.float32)
V = np.zeros((2, 5, 6), dtype=np.float32)

BAD_ARGUMENTS = [
    # (arguments, exception, pattern the message must match)
    ({"dropout_p": 0.1}, ValueError, r"dropout_p=0\.1 is not supported"),
    ({"dropout_p": "0"}, TypeError, r"dropout_p='0' must be a number"),
    ({"is_causal": 1}, TypeError, r"is_causal=1 must be a bool"),
    ({"enable_gqa": "yes"}, TypeError, r"enable_gqa='yes' must be a bool"),
    ({"is_causal": True, "attn_mask": np.ones((3, 5), bool)}, ValueError, r"is_causal=True and an attn_mask"),
    ({"causal_alignment": "lower_right", "is_causal": True}, ValueError, r"causal_alignment='lower_right'"),
    ({"causal_alignment": "bottom_right"}, ValueError, r"only applies with is_causal=True"),
    ({"scale": "x"}, TypeError, r"scale='x' must be None or a real number"),
    ({"scale": math.inf}, ValueError, r"scale=inf must be finite"),
    ({"attn_mask": np.ones((4, 5), bool)}, ValueError, r"attn_mask has shape \(4, 5\)"),
    ({"attn_mask": np.ones((3, 5), np.int32)}, TypeError, r"attn_mask has dtype int32"),
    ({"algorithm": "fastest"}, TypeError, r"algorithm='fastest' is not an AttentionAlgorithm"),
    ({"query": np.zeros((2, 3, 5), np.float32)}, ValueError, r"query has 5 features .* key has 4"),
    ({"value": np.zeros((2, 4, 6), np.float32)}, ValueError, r"key has 5 positions .* value has 4"),
    ({"value": V.astype(np.float64)}, TypeError, r"one dtype, got float32, float32 and float64"),
    ({"query": np.zeros(4, np.float32)}, ValueError, r"query must have at least 2 dimensions.*\(4,\)"),
    ({"query": np.zeros((2, 3, 0), np.float32), "key": np.zeros((2, 5, 0), np.float32)}, ValueError,
     r"default scale 1/sqrt\(0\)"),
    ({"query": np.zeros((3, 3, 4), np.float32)}, ValueError, r"batch dimensions of query \(3,\)"),
    ({"query": np.zeros((1, 3, 3, 4), np.float32), "key": np.zeros((1, 2, 5, 4), np.float32), "value": np.zeros((1, 2, 5, 6), np.float32), "enable_gqa": True}, ValueError, r"divide the heads of query"),
    ({"query": np.zeros((1, 4, 3, 4), np.float32), "key": np.zeros((1, 2, 5, 4), np.float32), "value": np.zeros((1, 2, 5, 6), np.float32)}, ValueError, r"needs enable_gqa=True"),
    ({"query": np.zeros((2, 3, 4), np.complex64)}, TypeError, r"query has dtype complex64"),
]


@pytest.mark.parametrize("arguments,error,pattern", BAD_ARGUMENTS, ids=lambda x: str(x)[:40])
def test_bad_arguments_are_refused_naming_the_argument(arguments, error, pattern):
    kw = dict(arguments)
    call = {"query": kw.pop("query", Q), "key": kw.pop("key", K), "value": kw.pop("value", V)}
    with pytest.raises(error, match=pattern):
        sdpa(**call, **kw)
    # The standalone backward checks the same arguments first.
    with pytest.raises(error, match=pattern):
        sdpa.backward(**call, grad=np.zeros((2, 3, 6), np.float32), **kw)


@pytest.mark.parametrize("grad,error,pattern", [
    (None, TypeError, r"needs grad"),
    (np.zeros((2, 6, 3), np.float32), ValueError, r"grad has shape \(2, 6, 3\) but .* has shape \(2, 3, 6\)"),
    (np.zeros((2, 3, 6), np.float64), TypeError, r"grad has dtype float64"),
])
def test_bad_grad_is_refused(grad, error, pattern):
    with pytest.raises(error, match=pattern):
        sdpa(Q, K, V).backward(grad)


def test_float_mask_gets_no_gradient_and_says_why():
    g = sdpa(Q, K, V, attn_mask=np.zeros((3, 5), np.float32)).backward(np.ones((2, 3, 6), np.float32))
    assert set(g) == {"grad_query", "grad_key", "grad_value"}
    with pytest.raises(KeyError, match="attn_mask gets no gradient"):
        g["grad_attn_mask"]


def test_algorithm_accepts_members_names_and_sdp_backends():
    q, k, v = _qkv()
    assert sdpa(q, k, v, algorithm="flash_attention").model is er.AttentionAlgorithm.FLASH_ATTENTION
    assert sdpa(q, k, v, algorithm=SDPBackend.EFFICIENT_ATTENTION).model is er.AttentionAlgorithm.EFFICIENT_ATTENTION
    for member in er.AttentionAlgorithm:
        # The Triton tutorial's class has no SDPBackend of its own.
        assert member.name in SDPBackend.__members__ or member is er.AttentionAlgorithm.TRITON_FLASH_ATTENTION
        assert isinstance(member.tolerance, AttentionTolerance)
        assert isinstance(member.backward_tolerance, AttentionTolerance)


# ---------------------------------------------------------------------------- semantics


def test_fully_masked_rows_give_zero_forward_and_backward_as_the_math_path_does():
    q, k, v = _qkv((1, 2, 4, 8), seed=1)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    grad = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(2))
    out, grads = _math(q, k, v, grad, attn_mask=mask)
    r = sdpa(q, k, v, attn_mask=mask)
    g = r.backward(grad)
    assert (r.rounded[:, :, 2] == 0).all() and (out[:, :, 2] == 0).all()
    assert (g.rounded.grad_query[:, :, 2] == 0).all() and (grads[0][:, :, 2] == 0).all()
    assert r.covers(out).all()
    for name, t in zip(("grad_query", "grad_key", "grad_value"), grads):
        assert g[name].covers(t).all()
    # A float mask of -inf masks the same way.
    fmask = torch.where(mask, 0.0, -math.inf)
    assert np.array_equal(sdpa(q, k, v, attn_mask=fmask).rounded, r.rounded)


def test_bottom_right_causal_alignment_is_pytorchs_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    q, _, _ = _qkv((1, 2, 3, 8), seed=3)
    _, k, v = _qkv((1, 2, 6, 8), seed=4)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 6))
        top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    r = sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert r.covers(out).all()
    assert not r.covers(top_left).all()


def test_broadcast_and_gqa_gradients_are_summed_over_copies():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    k, v = torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    grad = torch.randn(2, 4, 3, 8, generator=gen)
    out, grads = _math(q, k, v, grad, enable_gqa=True)
    r = sdpa(q, k, v, enable_gqa=True)
    g = r.backward(grad)
    assert g.rounded.grad_key.shape == (1, 2, 5, 8)
    assert r.covers(out).all()
    for name, t in zip(("grad_query", "grad_key", "grad_value"), grads):
        assert g[name].covers(t).all()


def test_exact_gives_a_certified_ball_that_rounds_to_rounded():
    q, k, v = _qkv((1, 1, 3, 4), seed=6)
    r = sdpa(q, k, v)
    ball = r.exact((0, 0, 1, 2))
    assert isinstance(ball, flint.arb)
    assert ball.rad() < 2.0 ** -100
    assert np.float32(float(ball.mid())) == r.rounded[0, 0, 1, 2]


def test_two_dimensional_inputs_and_an_empty_key_set():
    q = np.ones((2, 3), np.float32)
    r = sdpa(q, q, np.array([[1.0], [3.0]], np.float32))
    assert r.rounded.tolist() == [[2.0], [2.0]]
    empty = sdpa(q, np.zeros((0, 3), np.float32), np.zeros((0, 2), np.float32))
    assert empty.rounded.tolist() == [[0.0, 0.0], [0.0, 0.0]]


# ---------------------------------------------------------------------------- special values


def test_special_values_follow_the_math_path():
    q, k, v = _qkv((1, 1, 4, 4), seed=8)
    q[0, 0, 1, 2] = math.nan
    v[0, 0, 3, 0] = math.inf
    mask = torch.zeros(4, 4)
    mask[2, 1] = math.inf
    grad = torch.ones(1, 1, 4, 4)
    grad[0, 0, 0, 3] = -math.inf
    out, grads = _math(q, k, v, grad, attn_mask=mask)
    r = sdpa(q, k, v, attn_mask=mask)
    g = r.backward(grad)
    assert np.array_equal(np.isnan(r.rounded), out.isnan().numpy())
    assert np.array_equal(np.isinf(r.rounded), out.isinf().numpy())
    assert r.covers(out).all()
    for name, t in zip(("grad_query", "grad_key", "grad_value"), grads):
        assert np.array_equal(np.isnan(g[name].rounded), t.isnan().numpy()), name
        assert g[name].covers(t).all(), name
    # The normal answer is what covers() insists on: a finite value where NaN is due is refused.
    assert not r.covers(torch.nan_to_num(out)).all()


def test_bfloat16_logit_overflow_accepts_the_math_paths_nan_but_keeps_the_exact_value():
    q = torch.full((1, 1, 2, 4), 2.0 ** 100, dtype=torch.bfloat16)
    k = torch.full((1, 1, 3, 4), 2.0 ** 100, dtype=torch.bfloat16)
    k[0, 0, 1] = -k[0, 0, 1]
    v = torch.arange(12, dtype=torch.bfloat16).reshape(1, 1, 3, 4)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.isnan().all()  # q k overflows float32
    r = sdpa(q, k, v)
    assert np.isfinite(r.rounded.astype(np.float64)).all()
    assert r.covers(out).all()
    # Keys 0 and 2 share the top logit, key 1's weight is exp(-huge): the exact mean of v's rows 0 and 2.
    assert r.rounded.astype(np.float64).tolist() == [[[[4.0, 5.0, 6.0, 7.0]] * 2]]


# ---------------------------------------------------------------------------- ReferenceUnavailableError


def _raise_case(kind):
    # Keys k0 = 1, k1 = -1 (E = 1), so query 1 has logits (s, -s): transcendental weights.
    # v = 0 makes the output and grad_query/grad_key exactly 0, leaving grad_value = P^T dO.
    q = np.array([[1.0], [1.0], [0.0]], np.float32) if kind == "zero" else np.array([[1.0], [-1.0], [0.0]], np.float32)
    k = np.array([[1.0], [-1.0]], np.float32)
    v = np.zeros((2, 1), np.float32)
    if kind == "zero":
        # Rows 0 and 1 are the same, their output gradients opposite: grad_value is exactly 0.
        grad = np.array([[1.0], [-1.0], [0.0]], np.float32)
    else:
        # Row 1's weights are row 0's reversed, so P_0j + P_1j = 1 and grad_value_j = 1 + 2**-24:
        # exactly halfway between the float32 neighbours 1 and 1 + 2**-23.
        grad = np.array([[1.0], [1.0], [2.0 ** -23]], np.float32)
    return q, k, v, grad


def test_an_exact_zero_by_cancellation_is_decided_as_plus_zero():
    # grad_value is exactly 0 from two rows with transcendental weights; at the precision cap its ball
    # is proven below half float32's smallest subnormal, so it rounds to a zero: +0, the sign an exact
    # cancellation has (covers() treats +-0 alike).
    q, k, v, grad = _raise_case("zero")
    g = sdpa(q, k, v).backward(grad)
    assert g.rounded.grad_value.tolist() == [[0.0], [0.0]]
    assert all(np.copysign(1.0, x) == 1.0 for x in g.rounded.grad_value.ravel())


@pytest.mark.parametrize("kind,why", [("tie", r"lies on the rounding boundary 1\.0000000596046448")])
def test_exact_boundary_raises_naming_the_element_within_bounded_time(kind, why):
    q, k, v, grad = _raise_case(kind)
    r = sdpa(q, k, v)
    assert r.rounded.tolist() == [[0.0], [0.0], [0.0]]
    start = time.perf_counter()
    with pytest.raises(er.ReferenceUnavailableError) as info:
        r.backward(grad)
    assert time.perf_counter() - start < 30
    message = str(info.value)
    assert re.search(r"grad_value at \((0|1), 0\)", message)
    assert "transcendental attention weights" in message
    assert re.search(why, message)
    # The same sum with every row's weights rational (q = 0: uniform rows) is decided exactly.
    g = sdpa(np.zeros_like(q), k, v).backward(grad)
    expected = float(np.float32(grad.sum() / 2))
    assert g.rounded.grad_value.tolist() == [[expected], [expected]]


def test_a_rational_tie_rounds_to_even_without_raising():
    # Uniform rows (q = 0): grad_value_j = (1 + (1 + 2**-23)) / 2, a float32 tie, rounds to 1.0 (even).
    q = np.zeros((2, 1), np.float32)
    k = np.array([[1.0], [-1.0]], np.float32)
    v = np.zeros((2, 1), np.float32)
    grad = np.array([[1.0], [1.0 + 2.0 ** -23]], np.float32)
    g = sdpa(q, k, v).backward(grad)
    assert g.rounded.grad_value.tolist() == [[1.0], [1.0]]


# ---------------------------------------------------------------------------- the first pass's exp


def test_exp_bounded_holds_its_bound_against_arb():
    rng = np.random.default_rng(0)
    y = np.concatenate([-rng.exponential(30, 2000), -rng.random(500) * 1e-3, [0.0, -0.3465, -0.3466, -745.0]])
    w, rel = exp_bounded(y)
    assert rel < 2.0 ** -48
    with er.engine.certified.precision(200):
        for yi, wi in zip(y[::7], w[::7]):
            exact = flint.arb(float(yi)).exp()
            err = abs(flint.arb(float(wi)) - exact)
            assert err <= exact * flint.arb(rel) + flint.arb(2.0 ** -1074), (yi, wi)


def _running_bound(y: np.ndarray) -> np.ndarray:
    """The first pass's exp error bound computed element by element, as it once was: Higham's running
    error bound for Horner's rule (Accuracy and Stability, Algorithm 5.1) on each element's own r."""
    from exactref.ops.attention import _first
    U = 2.0 ** -53
    y = np.maximum(y, -746.0)
    k = np.rint(y * (_first._N / math.log(2)))
    r1 = y - k * _first._C_HI
    t = k * _first._C_LO
    r = r1 - t
    ar = np.abs(r)
    err_r = U * (np.abs(r1) + np.abs(t) + ar) * (1 + 2 * U) + np.abs(k) * _first._C_TAIL
    e_r = math.exp(_first._R_MAX) * (1 + 2.0 ** -40)
    p = np.full_like(r, _first._INV_FACT[-1])
    mu = np.abs(p) * 0.5
    for c in reversed(_first._INV_FACT[:-1]):
        p = p * r + c
        mu = ar * mu + np.abs(p)
    trunc = _first._R_MAX ** 7 / math.factorial(7) * e_r
    absolute = U * (2 * mu - np.abs(p)) * 1.01 + U * 2 * e_r + trunc * 2 + 2 * e_r * err_r * 1.01
    return (absolute / (p * (1 - 4 * U)) + 2 * U) * (1 + 2.0 ** -40)


def test_the_first_pass_exp_bound_is_the_running_bound_at_its_largest():
    # One relative bound for every element (_first._exp_error_bound) must dominate the bound each
    # element's own running error analysis gives, where it is largest: |r| at the edge of its
    # range (y halfway between two multiples of ln2/64) and |k| at its largest (y near -746).
    # And it must not be loose: a term dropped or halved (the table's rounding, the coefficients')
    # takes it below the running bound, a term doubled beyond 1% above.
    from exactref.ops.attention import _first
    step = math.log(2) / _first._N
    ks = np.concatenate([np.arange(-40, 1), np.arange(-68880, -68840), np.arange(-11000, -10990)])
    y = np.concatenate([(ks + 0.5) * step, (ks - 0.5) * step, ks * step, [-746.0, -745.9, 0.0, -1e-300]])
    y = y[(y <= 0) & (y >= -746)]
    running = _running_bound(y)
    rel = _first.EXP_BLOCK_REL
    assert running.max() <= rel <= running.max() * 1.01
    _, rel_block = _first._exp_block(y)
    assert rel_block == rel


def test_the_first_pass_exp_rounds_a_subnormal_result_once():
    # Below 2**-1021 the scaling by 2**floor(k/64) takes two products, the first exact: the result is
    # within half a subnormal spacing of e**y (plus rel of it, far below that here), as one
    # rounding leaves it; a rounding in each product could leave it a whole spacing off.
    from exactref.ops.attention import _first
    # Also just below multiples of ln 2, where the table's entry is 1 and e**r below 1: there a
    # first product by 2**-1022 would already be subnormal.
    m, delta = np.meshgrid(np.arange(-1074, -1022), np.linspace(1e-4, 5e-3, 6))
    y = np.concatenate([-np.linspace(725.0, 746.0, 401), (m * math.log(2) - delta).ravel()])
    w, rel = _first._exp_block(y)
    assert (w > 0).any() and (w == 0).any()
    with er.engine.certified.precision(200):
        for yi, wi in zip(y, w):
            exact = flint.arb(float(yi)).exp()
            err = abs(flint.arb(float(wi)) - exact)
            assert err <= flint.arb(2) ** -1075 + exact * flint.arb(rel), (yi, wi)


@pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass")
def test_the_second_pass_exp_holds_its_bound_against_arb():
    rng = np.random.default_rng(1)
    step = math.log(2) / 256
    edges = np.array([0.0, -1e-300, -2.0 ** -60, -step / 2, -step / 2 * (1 - 1e-12), -step * 1.5, -math.log(2),
                      -745.5, -10999.9, -11000.0, -20000.0])
    # Slightly above 0 too: the logits minus the first pass's float64 row maximum may be.
    above = np.array([1e-300, 2.0 ** -60, 2.0 ** -53, 3e-16])
    y = np.concatenate([-rng.exponential(20, 3000), -rng.random(500) * 1e-2, edges, above,
                        -np.arange(1, 300) * step * (1 + rng.random(299) * 1e-12)]).astype(second.LD)
    # A longdouble argument with bits below float64's, as the logits minus their row maximum are.
    y[:1000] += second.LD(rng.random(1000)) * second.LD(2.0 ** -60)
    w, rel = second._exp(y, np.asarray(y, dtype=np.float64))
    assert rel < 2.0 ** -60
    with er.engine.certified.precision(256):
        for yi, wi in zip(y, w):
            arg = _ld_arb(yi)
            # Below -11000 the pass returns exp(-11000), which its callers' TINY covers.
            exact = (arg if yi >= -11000 else flint.arb(-11000)).exp()
            err = abs(_ld_arb(wi) - exact)
            assert err <= exact * flint.arb(rel), (yi, wi)


@pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass")
def test_the_second_pass_exp_reduction_holds_its_bound_where_k_c_lo_rounds_most():
    # r = y - k ln2/256 is the one step of the exp whose bound, _ERR_R, is not a few units of
    # longdouble: k _C_LO rounds in float64 (up to half an ulp of it, 2**-71 at the largest k)
    # and ln2/256 - _C_HI - _C_LO is dropped (|k| |t|, 2**-72 at most).  At the k where the
    # rounding is largest, and of the sign the tail's error takes too, the two add up to about
    # 0.48 _ERR_R: dropping the rounding's term from _ERR_R (0.41 _ERR_R left) fails this test.
    import mpmath

    c_lo = second.LD(second._C_LO)
    ks = np.arange(-4_062_630.0, -3_900_000.0)  # the largest |k| that y >= -11000 allows
    # fl(k C_LO) - k C_LO, to 2**-11 of itself: the longdouble product has 11 bits more.
    err = second.LD(ks * second._C_LO) - second.LD(ks) * c_lo
    worst = ks[np.argsort(np.asarray(err, dtype=np.float64))[-8:]]  # rounded up the most
    assert float(np.max(err)) > 0.9 * 2.0 ** -71
    with mpmath.workprec(300):
        step = mpmath.log(2) / 256
        ys, exact_k = [], []
        for k in worst:
            for frac in (-0.49, -0.3, 0.0, 0.2, 0.49):
                y = second.LD(float(k * step)) + second.LD(float(frac * step))
                y += second.LD(2.0 ** -60) * second.LD(frac)  # bits below float64's
                ys.append(y)
                exact_k.append(k)
        y = np.array(ys, dtype=second.LD)
        k, r = second._reduce(y, np.asarray(y, dtype=np.float64))
        assert np.array_equal(k, exact_k)
        worst_err = 0
        for yi, ki, ri in zip(y, k, r):
            exact = mpmath.mpf(_ld_fraction(yi).numerator) / _ld_fraction(yi).denominator - int(ki) * step
            got = mpmath.mpf(_ld_fraction(ri).numerator) / _ld_fraction(ri).denominator
            assert abs(exact) <= second._R_MAX
            worst_err = max(worst_err, abs(got - exact))
        assert worst_err <= second._ERR_R
        assert worst_err > 0.45 * second._ERR_R  # (what makes the test sensitive to the bound's terms)


@pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass")
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 255, 256, 300])
def test_the_second_pass_pairwise_sum_holds_its_bound(n):
    from fractions import Fraction

    rng = np.random.default_rng(n)
    # Mixed signs and magnitudes, with bits below float64's, so that the sums round.
    x = (rng.standard_normal((4, n)) * 2.0 ** rng.integers(-30, 30, (4, n))).astype(second.LD)
    x += second.LD(rng.standard_normal((4, n))) * x * second.LD(2.0 ** -60)
    total, levels = second._pairwise_sum(x)
    assert levels == max(n - 1, 0).bit_length()
    for row, t in zip(x, total):
        exact = sum((_ld_fraction(v) for v in row), Fraction(0))
        bound = Fraction(second._gamma(levels)) * sum((abs(_ld_fraction(v)) for v in row), Fraction(0))
        assert abs(_ld_fraction(t) - exact) <= bound


@pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass")
@pytest.mark.parametrize("case", ["weights", "dP"])
def test_the_second_pass_row_sum_from_unnormalised_weights_holds_against_fractions(case):
    # D = rowsum(P dP) as rowsum(w dP) / W (_unnormalised_row_sums), with the exact values pushed to
    # the edges of what the bounds allow: weights within eps of the computed ones (rows of keys
    # with dP = +1 weighed up, dP = -1 down), or dP within its radius (all up).  Each case has one
    # dominant term, pi sum P |dP| or sum P e_dP: dropping it fails the test.
    rng = np.random.default_rng(3)
    rows, S = 6, 16
    w = second.LD(rng.random((rows, S)) + 0.1) * second.LD(1 + 2.0 ** -60)
    w[:, 0] = 1  # exp(0): the row's largest
    W, levels = second._pairwise_sum(w)
    sign = np.where(rng.random((rows, S)) < 0.5, 1.0, -1.0)
    dP_hi = sign * (1 + rng.random((rows, S)))
    eps, rad = (2.0 ** -30, 0.0) if case == "weights" else (2.0 ** -62, 2.0 ** -30)
    dP_rad = np.full((rows, S), rad)
    dP, e_dP, adP = second._dP(dP_hi, np.zeros((rows, S)), dP_rad)
    pi = np.asarray(second.ratio_error(np.full(rows, eps), second.U2, second._gamma(levels)))
    D, e_D = second._unnormalised_row_sums(w, W, pi, dP, e_dP, adP)
    for i in range(rows):
        exact_w = [_ld_fraction(w[i, j]) * (1 + Fraction(eps) * int(sign[i, j])) for j in range(S)]
        exact_dP = [Fraction(dP_hi[i, j]) + Fraction(rad) for j in range(S)]
        exact = sum(a * b for a, b in zip(exact_w, exact_dP)) / sum(exact_w)
        err = abs(_ld_fraction(D[i]) - exact)
        assert err <= Fraction(e_D[i]), (case, i)
        assert err >= Fraction(e_D[i]) / 8, (case, i)  # the bound is near what the edges reach


def _ld_fraction(x):
    from fractions import Fraction

    m, e = np.frexp(x)
    hi = float(m)
    return (Fraction(hi) + Fraction(float(m - second.LD(hi)))) * Fraction(2) ** int(e)


def _ld_arb(x) -> flint.arb:
    """A longdouble exactly, even below float64's range: its mantissa as two float64 parts, then the exponent."""
    m, e = np.frexp(x)
    hi = float(m)
    return (flint.arb(hi) + flint.arb(float(m - second.LD(hi)))) * flint.arb(2) ** int(e)


def test_backward_twice_from_one_forward_matches_the_standalone_backward():
    # The second backward must not reuse anything cached for the first one's gradient.
    q, k, v = (np.array(x, np.float32) for x in ([[1.0], [1.0], [0.0]], [[1.0], [-1.0]], [[0.5], [2.0]]))
    r = sdpa(q, k, v)
    grads = [np.array([[1.0], [0.5], [0.0]], np.float32), np.array([[0.25], [3.0], [-2.0]], np.float32)]
    first = r.backward(grads[0])
    second = r.backward(grads[1])
    for grad, g in zip(grads, (first, second)):
        alone = sdpa.backward(q, k, v, grad)
        for name in alone:
            assert np.array_equal(g[name].rounded, alone[name].rounded), name
            assert np.array_equal(g[name].tolerance, alone[name].tolerance), name
    assert not np.array_equal(first["grad_value"].rounded, second["grad_value"].rounded)
