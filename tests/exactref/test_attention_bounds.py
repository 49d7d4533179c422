"""Attention at huge logits: finite, sound tolerances (the hull and finite-computation caps) and no false
ReferenceUnavailableError where an element is a rational part plus a remainder far below it."""

from __future__ import annotations

import math
from fractions import Fraction

import flint
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er
from exactref.engine.fast import up
from exactref.formats import FLOAT32
from exactref.ops.attention._split import Split, decide_split

from ._attention_oracle import Oracle, is_near_boundary, round_to

GRADS = ("grad_query", "grad_key", "grad_value")


def _large_logits(seed):
    """q * 3000 against k * 100, (1, 1, 8, 4) float32: logit gaps of 10**4 to 10**6 nats."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 8, 4, generator=gen) * 3000
    k = torch.randn(1, 1, 8, 4, generator=gen) * 100
    v = torch.randn(1, 1, 8, 4, generator=gen)
    grad = torch.randn(1, 1, 8, 4, generator=gen)
    return q, k, v, grad


def _torch(q, k, v, grad, backend):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _leaky_causal(q, k, v, fill=-1e6):
    """A float32 causal attention whose masked logits get a finite fill, as a -1e6 Triton kernel does."""
    L = q.shape[-2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    x = (q @ k.transpose(-2, -1)) / 2 + torch.where(j <= i, 0.0, fill)
    return torch.softmax(x, -1) @ v


@pytest.mark.parametrize("seed", range(8))
def test_huge_logits_give_finite_tolerances_that_cover_torch(seed):
    q, k, v, grad = _large_logits(seed)
    r = er.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = r.backward(grad)
    assert np.isfinite(r.tolerance).all()
    assert all(np.isfinite(g[n].tolerance).all() for n in GRADS)
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        out, grads = _torch(q, k, v, grad, backend)
        assert r.covers(out).all(), backend
        for name, got in zip(GRADS, grads):
            assert g[name].covers(got).all(), (backend, name)


@pytest.mark.parametrize("seed", [5, 6])  # covered before the cap, rejected after
def test_a_causal_fill_that_leaks_at_huge_logits_is_rejected(seed):
    # With logits near 10**6 a -1e6 fill no longer masks; before the hull cap the tolerance was inf there.
    q, k, v, _ = _large_logits(seed)
    r = er.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert r.covers(_leaky_causal(q, k, v, fill=-math.inf)).all()
    assert not r.covers(_leaky_causal(q, k, v)).all()
    with pytest.raises(er.MismatchError):
        r.check(_leaky_causal(q, k, v))


def test_the_forward_cap_is_the_hull_of_the_unmasked_values():
    # Row 0 sees only key 0, so a correct kernel returns v[0] up to its roundings: the tolerance is tiny.
    q, k, v, _ = _large_logits(0)
    r = er.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (r.tolerance[0, 0, 0] <= 1e-5 * np.abs(v[0, 0, 0].numpy()) + 1e-30).all()
    assert (r.tolerance <= 2.01 * (v.abs().amax(-2, keepdim=True)).numpy()).all()


@pytest.mark.parametrize("seed", range(8))
def test_float32_backward_at_huge_logits_agrees_with_the_oracle(seed):
    # Raised ReferenceUnavailableError in most seeds: grad_value elements whose rational part is exactly
    # a float32 rounding boundary, off it by exp(-gap), far below 2**-4096.
    q, k, v, grad = _large_logits(seed)
    g = er.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    prec = 4000
    oracle = Oracle(q.numpy(), k.numpy(), v.numpy(), is_causal=True, prec=prec)
    want = oracle.grads(grad.numpy())
    checked = 0
    for name in GRADS:
        for idx in np.ndindex(want[name].shape):
            x = want[name][idx]
            if is_near_boundary(x, "float32", oracle.magnitudes[name][idx], bits=prec - 80) and abs(x) > 2.0 ** -200:
                continue  # the oracle's 4000 bits cannot see which side: test_exact_boundary_plus_remainder
            assert round_to(x, "float32") == g[name].rounded[idx], (name, idx)
            checked += 1
    assert checked >= 64


def test_exact_boundary_plus_remainder_rounds_by_the_remainders_sign():
    # Row 0 sees key 0 at a logit 6e5 above key 1: P = (1, w) / (1 + w) with w = exp(-6e5); row 1 weighs
    # both keys 1/2.  grad_value[0] = 1/(1 + w) + 3 * 2**-24 is below the tie 1 + 3 * 2**-24 by about w:
    # it rounds down to 1 + 2**-23, where the tie itself would round (to even) up to 1 + 2**-22.
    q = np.array([[3000.0], [0.0]], dtype=np.float32)
    k = np.array([[100.0], [-100.0]], dtype=np.float32)
    v = np.zeros((2, 1), dtype=np.float32)
    grad = np.array([[1.0], [3 * 2.0 ** -23]], dtype=np.float32)
    g = er.scaled_dot_product_attention(q, k, v, scale=1.0).backward(grad)
    assert g["grad_value"].rounded[0, 0] == np.float32(1 + 2.0 ** -23)
    assert g["grad_value"].rounded[1, 0] == np.float32(3 * 2.0 ** -24)


def _huge_range(seed):
    rng = np.random.default_rng(seed)

    def draw():
        return rng.choice([-1.0, 1.0], size=(4, 4)) * np.ldexp(1.0, rng.integers(-1070, 1021, size=(4, 4)))

    return draw(), draw(), draw(), draw()


@pytest.mark.parametrize("seed", [0, 1])
def test_float64_backward_over_the_whole_range_agrees_with_the_oracle(seed):
    # Raised ReferenceUnavailableError for every seed: gradients of order exp(-2**1000) that round to +-0
    # were computed from a float64 row maximum that had overflowed, and cancelled to a ball around zero.
    q, k, v, grad = _huge_range(seed)
    r = er.scaled_dot_product_attention(q, k, v)
    g = r.backward(grad)
    # The logits reach 2**2000: the oracle needs more than their 2000 bits to get exp's argument right.
    oracle = Oracle(q, k, v, prec=4400)
    want = dict(oracle.grads(grad), out=oracle.out())
    for name, arr in want.items():
        res = r if name == "out" else g[name]
        for idx in np.ndindex(arr.shape):
            expected = round_to(arr[idx], "float64")
            got = float(res.rounded[idx])
            assert got == expected, (name, idx)
            assert math.copysign(1, got) == math.copysign(1, expected), (name, idx)


def test_decide_split_settles_a_boundary_by_the_remainders_sign():
    tie = Fraction(1) + Fraction(3, 2 ** 24)
    tiny = flint.arb(2) ** -200000  # exact: a power of two
    for eps, want in ((tiny, 1 + 2.0 ** -22), (-tiny, 1 + 2.0 ** -23)):
        split = Split(flint.arb(flint.fmpq(tie.numerator, tie.denominator)) + eps, tie, eps)
        rounded, lo, hi = decide_split(split, FLOAT32)
        assert rounded == want and lo <= float(tie) <= hi
    # A ball of unknown sign below half float32's smallest subnormal is +0, at the final precision only.
    zero = flint.arb(0, 2.0 ** -200)
    assert decide_split(zero, FLOAT32) is None
    assert decide_split(zero, FLOAT32, final=True)[0] == 0.0


def _huge_key_rows(seed):
    """float64 (1, 1, 4, 2) q and (1, 1, 5, 2) k where one key is 2**40 to 2**60: its logit's float64
    rounding is a sizeable fraction of a nat, while its weight underflows to 0 beside the others."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 4, 2))
    k = rng.standard_normal((1, 1, 5, 2)) * 3
    k[0, 0, rng.integers(5)] = rng.choice([-1, 1], 2) * 2.0 ** rng.uniform(40, 60, 2)
    return q, k, rng.standard_normal((1, 1, 5, 3))


def _check_weights_against_the_exact_softmax(fp, q, k, scale=None, mask=None) -> int:
    """Assert P <= P_up and |P~ - P| <= e_P for every weight of the first pass ``fp`` of one head,
    against the exact softmax (rational logits, mpmath at 400 bits); ``scale`` None is 1/sqrt(E).
    Returns how many exact weights lie above P~ (1 + 2**-40)."""
    import mpmath

    L, S, E = q.shape[2], k.shape[2], q.shape[3]
    above = 0
    with mpmath.workprec(400):
        s = 1 / mpmath.sqrt(E) if scale is None else mpmath.mpf(scale)
        for i in range(L):
            dots = [sum(Fraction(q[0, 0, i, c]) * Fraction(k[0, 0, j, c]) for c in range(E)) for j in range(S)]
            x = [mpmath.mpf(d.numerator) / d.denominator * s + (0 if mask is None else mpmath.mpf(mask[0, 0, i, j]))
                 for j, d in enumerate(dots)]
            w = [mpmath.exp(t - max(x)) for t in x]
            for j in range(S):
                P = w[j] / mpmath.fsum(w)
                assert P <= fp.P_up[0, i, j], (i, j, float(P), fp.P_up[0, i, j])
                assert abs(fp.P[0, i, j] - P) <= fp.e_P[0, i, j], (i, j, float(abs(fp.P[0, i, j] - P)),
                                                                    fp.e_P[0, i, j])
                above += P > fp.P[0, i, j] * (1 + 2.0 ** -40)
    return above


@pytest.mark.parametrize("block", [None, 5])  # 5: a block per row, so rows past the first block count
@pytest.mark.parametrize("seed", range(6))
def test_first_pass_weights_bound_the_exact_softmax_beside_a_huge_logit(seed, block, monkeypatch):
    # Found by the audit: the row-wise bound P / (1 - pi) went negative when the huge logit's error
    # made pi >= 1, and the weights' upper bound P_up became ~1e-323; the models then budgeted nothing.
    from exactref.ops.attention._first import FirstPass
    from exactref.ops.attention._problem import read_problem
    if block is not None:
        monkeypatch.setattr("exactref.ops.attention._first._BLOCK", block)
    q, k, v = _huge_key_rows(seed)
    fp = FirstPass(read_problem(q, k, v, None, 0.0, False, None, False, "top_left"))
    _check_weights_against_the_exact_softmax(fp, q, k)
    # Where the huge logit's weight underflows, the others keep float64-sized bounds.
    huge = int(np.argmax(np.abs(k[0, 0, :, 0])))
    rows = fp.P[0, :, huge] == 0
    assert rows.any()
    assert (fp.e_P[0][rows] <= 1e-13 * fp.P[0][rows] + 1e-290).all()


def _huge_close_rows(seed):
    """(1, 1, 3, 2) q against (1, 1, 6, 2) k whose logits are all near 2**40 and within a few nats of each
    other: every weight is O(1), and each logit's float64 rounding (about 2**-13) is far above _LOOSE."""
    rng = np.random.default_rng(seed)
    q = np.zeros((1, 1, 3, 2))
    q[0, 0, :, 0] = 2.0 ** 20 * (1 + rng.integers(0, 8, 3) * 2.0 ** -30)
    q[0, 0, :, 1] = rng.standard_normal(3)
    k = np.zeros((1, 1, 6, 2))
    k[0, 0, :, 0] = 2.0 ** 20 + rng.integers(-4, 5, 6) * 2.0 ** -20  # logits a few nats apart
    k[0, 0, :, 1] = rng.standard_normal(6)
    return q, k, rng.standard_normal((1, 1, 6, 3))


@pytest.mark.parametrize("seed", range(6))
def test_first_pass_weights_bound_the_exact_softmax_when_every_logit_is_huge(seed):
    # Every weight is O(1) and every logit errs by about 2**-13: the element-wise bounds must still
    # hold the exact softmax, where a row-wise bound once went negative.
    from exactref.ops.attention import _first
    from exactref.ops.attention._problem import read_problem
    q, k, v = _huge_close_rows(seed)
    fp = _first.FirstPass(read_problem(q, k, v, None, 0.0, False, None, False, "top_left"))
    assert (fp.pi >= _first._LOOSE).all()  # every row takes the element-wise bounds
    # Some exact weights lie well above the computed ones, as the bounds must allow.
    assert _check_weights_against_the_exact_softmax(fp, q, k)


def _one_imprecise_logit(seed):
    """(1, 1, 2, 2) q, (1, 1, 5, 2) k and a float64 additive mask, for the scale 0.3 (a float, so exact):
    key 0's logit 0.3 (q . k) is near 2**38 and the mask takes it back to a few nats, so its float64
    rounding (up to 2**-15, of either sign as k varies) stays in a logit of ordinary size, while the
    other keys' logits are exact to 2**-50."""
    rng = np.random.default_rng(seed)
    q = np.zeros((1, 1, 2, 2))
    q[0, 0, :, 0] = 2.0 ** 20
    q[0, 0, :, 1] = rng.uniform(0.5, 1.5, 2)
    k = np.zeros((1, 1, 5, 2))
    k[0, 0, 0, 0] = 2.0 ** 20 * (1 + rng.integers(1, 2 ** 20) * 2.0 ** -40)
    k[0, 0, 1:, 1] = rng.standard_normal(4)
    mask = np.zeros((1, 1, 2, 5))
    mask[0, 0, :, 0] = -float(k[0, 0, 0, 0] * 2.0 ** 20 * 0.3) + rng.uniform(-4, 0, 2)
    return q, k, rng.standard_normal((1, 1, 5, 3)), mask


@pytest.mark.parametrize("seed", range(8))
def test_first_pass_weights_bound_the_exact_softmax_beside_one_imprecise_logit(seed):
    # Rows whose worst logit error passes _LOOSE take element-wise bounds (_loose_rows, _loose_weights).
    # Here that error sits in one weight of moderate size and the row's other weights are precise, so
    # each of e_P's terms must carry its own part: the weight's own error (err / W) for key 0, and the
    # row sum's error (A, in W_lo and dW) for the others.
    from exactref.ops.attention import _first
    from exactref.ops.attention._problem import read_problem
    q, k, v, mask = _one_imprecise_logit(seed)
    fp = _first.FirstPass(read_problem(q, k, v, mask, 0.0, False, 0.3, False, "top_left"))
    assert (fp.pi >= _first._LOOSE).all()  # both rows take the element-wise bounds
    _check_weights_against_the_exact_softmax(fp, q, k, scale=0.3, mask=mask)


@pytest.mark.parametrize("seed", range(4))
def test_loose_rows_bound_every_weight_its_logit_error_allows(seed):
    # _loose_rows' lemma, at the edges of what its inputs allow: the exact weight exp(x - M) is any
    # value with |(x - M) - y| <= ey, and w~ = exp(y) within rel.  Both ends, e**(y - ey) and
    # e**(y + ey), must lie below wup and within err of w~ (wup's growth factor e**ey is the point).
    import mpmath

    from exactref.ops.attention import _first
    rng = np.random.default_rng(seed)
    y = -np.concatenate([rng.uniform(0, 3, 60), rng.uniform(0, 700, 20), [0.0, 745.0, 800.0]])
    ey = np.ldexp(1.0, rng.integers(-30, 1, y.size)).astype(np.float64)
    w, rel = _first._exp_block(y)
    eps = up(_first.expm1_up(ey) * (1 + rel) + rel)  # as _Rows.logits computes it
    rows = np.array([0])
    _, wup, err = _first._loose_rows(rows, w[None], rel, ey[None], eps[None], np.ones((1, y.size), bool))
    with mpmath.workprec(200):
        for j in range(y.size):
            for end in (-1, 1):
                exact = mpmath.exp(mpmath.mpf(y[j]) + end * mpmath.mpf(ey[j]))
                assert exact <= wup[0, j], (j, end, y[j], ey[j])
                assert abs(exact - mpmath.mpf(w[j])) <= err[0, j], (j, end, y[j], ey[j])


@pytest.mark.parametrize("seed", range(4))
def test_weights_recomputed_from_a_stored_logsumexp_stay_under_the_kernel_weight_bound(seed):
    # A fused backward recomputes each weight as exp(x~_ij - lse~_i) from the logsumexp its forward
    # stored.  With the forward's logits low by their whole error bound delta and the backward's high
    # by it, a dominant weight is about e^(delta_ij + max_k delta_ik): above 1, and above what the
    # bound would allow without the row's largest delta (_caps._kernel_weights).
    from exactref.ops.attention._caps import _kernel_weights
    from exactref.ops.attention._first import FirstPass
    from exactref.ops.attention._model import AttentionTolerance, _weights
    from exactref.ops.attention._problem import read_problem
    q, k, v, _ = _large_logits(seed)
    fp = FirstPass(read_problem(q, k, v, None, 0.0, False, None, False, "top_left"))
    wts = _weights(fp, AttentionTolerance("stored lse"), FLOAT32)
    # float32 values: the products, their 4-term sums and the scale 1/2 are exact in float64.
    x = (q.double() @ k.double().transpose(-2, -1)).numpy()[0] * 0.5
    delta = wts.delta[0]
    low = x - delta
    top = low.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(low - top).sum(axis=-1, keepdims=True))
    kernel = np.exp(x + delta - lse)
    bound = _kernel_weights(fp.unmasked[0], delta, wts.r[0], wts.rho[0], fp.P_up[0], wts.F)
    assert (kernel <= bound).all()
    assert kernel.max() > 1.05  # the stored logsumexp's error matters here


def test_row_sums_by_halves_are_within_their_bound_where_every_level_rounds():
    # 1 + h + h + 0 with h just above half an ulp of 1: the first halves' sum rounds up by about
    # h, and so does the next: an error of about 2 u of the sum, which gamma_2 (levels = 2) covers
    # and gamma_1 (the mutation: a level fewer) does not.
    from exactref.ops.attention import _first
    h = 2.0 ** -53 * (1 + 2.0 ** -52)
    w = np.array([[1.0, h, h, 0.0]])
    got, rel = _first._sum_rows(w)
    exact = 1 + 2 * Fraction(h)
    err = abs(Fraction(got[0]) - exact)
    assert err <= Fraction(rel[0]) * exact
    assert err > Fraction(_first.g(1)) * exact


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_row_sums_in_blocks_on_threads_are_within_their_bound(rows, monkeypatch):
    # _sum_rows adds each block of rows by halves, the blocks on several threads: every row's sum
    # must be within gamma_levels sum(w) of the exact sum (Fractions), odd lengths included, and the
    # result the same whatever the blocks.
    from exactref import _parallel
    from exactref.ops.attention import _first
    monkeypatch.setattr(_parallel, "width", lambda: 1 if getattr(_parallel._local, "inside", False) else 3)
    rng = np.random.default_rng(rows)
    n = 301
    # Weights over many binades, some zero.
    w = np.exp(rng.standard_normal((2, rows, n)) * 12) * (rng.random((2, rows, n)) < 0.9)
    got, rel = _first._sum_rows(w)
    for h in range(2):
        for i in range(rows):
            exact = sum(Fraction(x) for x in w[h, i])
            assert abs(Fraction(got[h, i]) - exact) <= Fraction(rel[h, i]) * exact, (h, i)
    for block in (n, 3 * n, 10 ** 9):  # one row a block, three, all rows in one
        monkeypatch.setattr(_first, "_SUM_ROWS_BLOCK", block)
        again, _ = _first._sum_rows(w)
        np.testing.assert_array_equal(again, got)


def test_dP_and_T_made_again_block_by_block_enclose_the_exact_values(monkeypatch):
    # The first pass keeps dP only as hi + lo +- rad, and makes dP and T = dP - D (with their bounds)
    # again wherever they are needed, a block of rows at a time (by_rows).  Each block must read its
    # own rows of D and e_D, and the bounds must hold through T's cancellation: D is dP within a few
    # ulps, so T is far below dP.  Checked against Fractions.
    from exactref import _parallel
    from exactref.ops.attention import _first
    monkeypatch.setattr(_parallel, "width", lambda: 1 if getattr(_parallel._local, "inside", False) else 3)
    monkeypatch.setattr(_first, "_BLOCK", 5 * 16)  # five rows of 16 keys a block
    rng = np.random.default_rng(7)
    H, L, S = 2, 23, 16
    hi = rng.standard_normal((H, L, S)) * 2.0 ** rng.integers(-20, 20, (H, L, 1))
    lo = hi * 2.0 ** -60 * rng.standard_normal((H, L, S))
    rad = np.abs(hi) * 2.0 ** -90
    # D: each row's first dP, perturbed by a few ulps, off by at most e_D.
    D = hi[..., 0] * (1 + 2.0 ** -50 * rng.standard_normal((H, L)))
    e_D = np.abs(D) * 2.0 ** -70

    def both(hi, lo, rad, D, e_D):
        return (*_first.dp_rows(hi, lo, rad), *_first.t_rows(hi, lo, rad, D, e_D))
    dP, e_dP, T, e_T = _first.by_rows(both, H, L, hi, lo, rad, D, e_D)
    for idx in np.ndindex(H, L, S):
        h, i, _ = idx
        for sign_p in (-1, 1):
            exact_dP = Fraction(hi[idx]) + Fraction(lo[idx]) + sign_p * Fraction(rad[idx])
            assert abs(Fraction(dP[idx]) - exact_dP) <= Fraction(e_dP[idx]), idx
            for sign_d in (-1, 1):
                exact_T = exact_dP - (Fraction(D[h, i]) + sign_d * Fraction(e_D[h, i]))
                assert abs(Fraction(T[idx]) - exact_T) <= Fraction(e_T[idx]), idx
    # The cancellation happened: some T are far below their dP.
    assert (np.abs(T[..., 0]) < np.abs(dP[..., 0]) * 2.0 ** -40).all()


def test_matmul_up_bounds_of_a_times_b_forming_of_in_blocks_of_bounded_size(monkeypatch):
    """_first.matmul_up with ``of``: an upper bound on of(A, E) @ B, within a few ulps of it, with
    each block of A's rows that ``of`` forms holding at most _MATMUL_A_BLOCK values (a whole row
    where one row alone is more).  Checked against Fractions."""
    from exactref.ops.attention import _first
    rng = np.random.default_rng(5)
    A = np.abs(rng.standard_normal((3, 50, 40)))
    E = np.abs(rng.standard_normal((3, 50, 40))) * 2.0 ** -40
    B = np.abs(rng.standard_normal((3, 40, 7)))
    blocks: list[int] = []

    def of(x, e):
        blocks.append(x.size)
        return x + e
    monkeypatch.setattr(_first, "_MATMUL_A_BLOCK", 400)  # 3 rows of 3 x 40 values
    out = _first.matmul_up(A, B, of=of, more=(E,))
    assert sum(blocks) == A.size and max(blocks) <= 400 and len(blocks) == 17
    for h in range(3):
        for i in range(50):
            row = [Fraction(float(x)) + Fraction(float(e)) for x, e in zip(A[h, i], E[h, i])]
            for j in range(7):
                exact = sum(r * Fraction(float(b)) for r, b in zip(row, B[h, :, j]))
                assert exact <= Fraction(float(out[h, i, j])) <= exact * (1 + Fraction(1, 2 ** 45))
    monkeypatch.setattr(_first, "_MATMUL_A_BLOCK", 1)  # a row alone is more: one row a block
    blocks.clear()
    _first.matmul_up(A, B, of=of, more=(E,))
    assert blocks == [120] * 50


def _cap_cases():
    """(name, q, k, v, grad, kwargs, whether the cap may be skipped for every gradient)."""
    gen = torch.Generator().manual_seed(11)

    def draw(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)
    q, k, v, g = (draw(1, 2, 64, 16) for _ in range(4))
    yield "float32", q, k, v, g, {}, True
    q, k, v, g = (draw(1, 2, 64, 16, dtype=torch.float16) for _ in range(4))
    yield "float16", q, k, v, g, {}, True
    yield "float16 efficient", q, k, v, g, {"algorithm": er.AttentionAlgorithm.EFFICIENT_ATTENTION}, True
    yield "float16 flash", q, k, v, g, {"algorithm": er.AttentionAlgorithm.FLASH_ATTENTION}, False
    q, k, v, g = draw(1, 4, 32, 8), draw(1, 2, 32, 8), draw(1, 2, 32, 8), draw(1, 4, 32, 8)
    yield "grouped heads", q, k, v, g, {"enable_gqa": True}, True
    q, k, v, g = (draw(1, 2, 48, 8) for _ in range(4))
    yield "causal", q, k, v, g, {"is_causal": True}, False
    # Logits of a few thousand nats in float32: the weights' relative bound is loose, and the cap binds.
    q, k, v, g = draw(1, 2, 16, 8) * 30, draw(1, 2, 16, 8) * 10, draw(1, 2, 16, 8), draw(1, 2, 16, 8)
    yield "large logits", q, k, v, g, {}, False
    # bfloat16 output gradients near 2e37, 64 queries on 4 keys: grad_value's sums of |terms| may
    # overflow float32 (dO V^T may not), so its overflow marks come from the bound on them, not
    # from a rank-one bound above it.
    q, k = draw(1, 1, 64, 4, dtype=torch.bfloat16), draw(1, 1, 4, 4, dtype=torch.bfloat16)
    v, g = (draw(1, 1, 4, 4) * 0.1).to(torch.bfloat16), (draw(1, 1, 64, 4) * 2e37).to(torch.bfloat16)
    yield "near overflow", q, k, v, g, {}, True


def _same_judgements(a, b, name):
    for grad in GRADS:
        for field in ("tolerance", "lo", "hi", "nan_ok", "special_ok"):
            x, y = (getattr(r[grad]._parts[0], field) for r in (a, b))
            assert np.array_equal(x, y, equal_nan=True), (name, grad, field)


@pytest.mark.parametrize("case", list(_cap_cases()), ids=lambda c: c[0])
def test_a_skipped_backward_cap_leaves_every_tolerance_as_computing_it_would(case, monkeypatch):
    # _caps.cap_cannot_bind spares the cap where it proves min(E, cap) = E: the gradients'
    # tolerances and overflow marks are bit for bit those of computing it.  Where the cap binds
    # (large logits), a check that always said yes (the mutation) changes them.
    from exactref.ops.attention import _model
    name, q, k, v, g, kw, skips = case
    real = _model.cap_cannot_bind
    answers = []

    def recording(*a, **k_):
        answers.append(real(*a, **k_))
        return answers[-1]
    monkeypatch.setattr(_model, "cap_cannot_bind", recording)
    skipped = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
    assert answers and all(answers) == skips
    monkeypatch.setattr(_model, "cap_cannot_bind", lambda *a, **k_: False)
    computed = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
    _same_judgements(skipped, computed, name)
    if name == "large logits":
        monkeypatch.setattr(_model, "cap_cannot_bind", lambda *a, **k_: True)
        always = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
        assert any(not np.array_equal(always[grad].tolerance, computed[grad].tolerance) for grad in GRADS)


@pytest.mark.parametrize("case", list(_cap_cases()), ids=lambda c: c[0])
def test_the_overflow_marks_from_a_rank_one_bound_are_those_of_the_exact_bound(case, monkeypatch):
    # backward_tolerance makes the bound on the gradients' sums of |terms| (for their overflow
    # marks) only where a rank-one bound above it does not keep every element below the overflow:
    # the marks are those of always making it.  Near overflow some are set, and a rank-one
    # "bound" that is no bound (the mutation: zeros) loses them.
    from exactref.ops.attention import _model
    name, q, k, v, g, kw, _ = case
    default = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
    real = _model._rank_one_bound
    monkeypatch.setattr(_model, "_rank_one_bound", lambda *a: np.full_like(real(*a), np.inf))
    exact = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
    _same_judgements(default, exact, name)
    if name == "near overflow":
        assert any(default[grad]._parts[0].special_ok.any() for grad in GRADS)
        monkeypatch.setattr(_model, "_rank_one_bound", lambda *a: np.zeros_like(real(*a)))
        lost = er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
        assert sum(lost[grad]._parts[0].special_ok.sum() for grad in GRADS) < sum(
            default[grad]._parts[0].special_ok.sum() for grad in GRADS)
