"""The longdouble pass's whole rows by the compiled loop (exactref/ops/attention/_rowsums.py).

Its row sums W and D, and the weights then formed at the keys asked for, are checked against
softmax and D = sum_j P_j dP_j computed here in mpmath at 300 bits from the inputs (float32, so
every product is exact), and against the longdouble code's own values and bounds.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

import exactref as er
from exactref import _fused
from exactref.ops.attention import _rowsums
from exactref.ops.attention import _second as second
from exactref.ops.attention import op as attention

from .spies import recording
from .test_attention_oracle import _everything_through, _second_pass_holds

pytestmark = [pytest.mark.skipif(not second.available(), reason="longdouble is float64 here: no second pass"),
              pytest.mark.skipif(not _fused.available(), reason="numba is not installed")]


def _passes(q, k, v, grad, **kw) -> list[second.SecondPass]:
    """The longdouble passes that a forward and backward make (every element sent to them)."""
    made = []
    real = second.SecondPass.__init__

    def keep(self, *a):
        real(self, *a)
        made.append(self)
    with pytest.MonkeyPatch.context() as mp:
        _everything_through(mp, "second")
        mp.setattr(second.SecondPass, "__init__", keep)
        mp.setattr(attention, "_SECOND_PASS_MAX_P", 53)
        r = er.scaled_dot_product_attention(q, k, v, **kw)
        try:
            r.backward(grad)
        except er.ReferenceUnavailableError:
            pass
    return made


def _exact(q, k, v, grad, h, mask=None, M=None):
    """Per row of head h: the exact softmax P (rows of mpf) and D = sum_j P_j dP_j (scale 1/sqrt(E));
    with M, also W = sum_j exp(x_j - M_i) for the rows' shifts M."""
    L, S = q.shape[1], k.shape[1]
    with mpmath.workprec(300):
        scale = 1 / mpmath.sqrt(q.shape[-1])
        P, D, Ws = [], [], []
        for i in range(L):
            keys = [j for j in range(S) if mask is None or mask[i, j]]
            x = {j: scale * mpmath.fsum(mpmath.mpf(float(a)) * float(b) for a, b in zip(q[h, i], k[h, j]))
                 for j in keys}
            top = max(x.values()) if keys else 0
            w = {j: mpmath.exp(x[j] - top) for j in keys}
            W = mpmath.fsum(w.values())
            row = [w[j] / W if j in w else mpmath.mpf(0) for j in range(S)]
            dP = [mpmath.fsum(mpmath.mpf(float(a)) * float(b) for a, b in zip(grad[h, i], v[h, j])) for j in range(S)]
            P.append(row)
            D.append(mpmath.fsum(p * d for p, d in zip(row, dP)))
            if M is not None:
                Ws.append(mpmath.fsum(mpmath.exp(x[j] - float(M[i])) for j in keys))
    return (P, D) if M is None else (P, D, Ws)


def _mp(x) -> mpmath.mpf:
    """A longdouble (or float) exactly, as the sum of two float64s."""
    hi = float(x)
    return mpmath.mpf(hi) + float(np.longdouble(x) - np.longdouble(hi))


def _check_rows(sp, rows, P, D, S) -> tuple[float, float]:
    """|D~ - D| <= e_D and |P~ - P| <= e_P for every row and key; returns the largest e_D and the largest
    e_P / P seen, for tightness checks."""
    D_ld, e_D = rows._D[2], rows._D[3]
    P_ld, _, e_P = rows.weights(sp, np.arange(S))
    worst_D = worst_P = 0.0
    with mpmath.workprec(300):
        for i, (p_row, d) in enumerate(zip(P, D)):
            assert abs(_mp(D_ld[i]) - d) <= e_D[i], (i, D_ld[i], d, e_D[i])
            worst_D = max(worst_D, float(e_D[i]))
            for j in range(S):
                assert abs(_mp(P_ld[i, j]) - p_row[j]) <= e_P[i, j], (i, j)
                if p_row[j] > 1e-30:
                    worst_P = max(worst_P, float(e_P[i, j] / p_row[j]))
    return worst_D, worst_P


def _case(seed, L=24, S=None, E=6, size=2.0):
    # Key counts around the loop's 16 lanes: a tail of 4, none, a short row alone, two full chunks and 5.
    S = (20, 16, 5, 37)[seed % 4] if S is None else S
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, L, E)) * size).astype(np.float32)
    k = (rng.standard_normal((1, S, E)) * size).astype(np.float32)
    v, grad = (rng.standard_normal((1, n, E)).astype(np.float32) for n in (S, L))
    return q, k, v, grad


def _rows_of(q, k, v, grad, compiled: bool, **kw):
    with pytest.MonkeyPatch.context() as mp:
        if not compiled:
            mp.setattr(_rowsums, "row_sums", lambda *a, **k: None)
        sp = _passes(q, k, v, grad, **kw)[-1]  # the backward's
        rows = sp._all_rows(0)
        rows.dS(sp, np.arange(k.shape[1]))  # makes D and e_D
    return sp, rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("masked", [False, True])
def test_compiled_row_sums_and_weights_enclose_the_exact_softmax_and_D(seed, masked):
    q, k, v, grad = _case(seed)
    mask = np.random.default_rng(seed + 10).random((q.shape[1], k.shape[1])) < 0.7 if masked else None
    kw = {} if mask is None else {"attn_mask": mask}
    sp, rows = _rows_of(q, k, v, grad, True, **kw)
    assert rows.compiled and rows.w is None
    P, D, W = _exact(q, k, v, grad, 0, mask, sp.fp.M[0])
    worst_D, worst_P = _check_rows(sp, rows, P, D, k.shape[1])
    # The row sums themselves: |W~ - W| <= (epsbar + g_W) W <= pi W.
    with mpmath.workprec(300):
        for i, w in enumerate(W):
            if w:
                assert abs(_mp(rows.Wd[i]) - w) <= rows.pi[i] * w, i
    # Not vacuous: about the longdouble pass's own precision (2**-64), far below float64's.
    assert worst_P < 2.0 ** -55 and worst_D < 2.0 ** -50


@pytest.mark.parametrize("seed", range(4))
def test_compiled_bounds_are_no_looser_than_the_longdouble_codes(seed):
    q, k, v, grad = _case(seed)
    (sp_f, fast), (sp_s, slow) = _rows_of(q, k, v, grad, True), _rows_of(q, k, v, grad, False)
    assert fast.compiled and not slow.compiled
    D_f, e_f = fast._D[2:]
    D_s, e_s = slow._D[2:]
    with mpmath.workprec(300):
        for i in range(len(D_f)):
            assert abs(_mp(D_f[i]) - _mp(D_s[i])) <= mpmath.mpf(e_f[i]) + e_s[i]
    assert np.all(e_f <= 1.5 * e_s) and np.all(fast.pi <= slow.pi * 1.5)
    cols = np.array([0, k.shape[1] // 2, k.shape[1] - 1])
    Pf, _, ePf = fast.weights(sp_f, cols)
    Ps, _, ePs = slow.weights(sp_s, cols)
    assert np.all(np.abs(np.asarray(Pf - Ps, dtype=np.float64)) <= ePf + ePs)


def test_a_row_with_a_weight_below_exp_y_low_is_left_to_the_longdouble_code():
    # Logits some 1000 apart: exp(y) below exp(-600) for most keys.  The loop marks the row, and the
    # head is weighed as before, within its bounds.
    q, k, v, grad = _case(3, size=30.0)
    sp, rows = _rows_of(q, k, v, grad, True)
    assert not rows.compiled and rows.w is not None
    P, D = _exact(q, k, v, grad, 0)
    _check_rows(sp, rows, P, D, k.shape[1])


def test_the_loop_marks_exactly_the_rows_outside_its_range():
    q, k, v, grad = _case(1)
    sp = _passes(q, k, v, grad)[-1]
    parts = [tuple(a[0] for a in sp.fp.logit_parts), tuple(a[0] for a in sp.fp.dP_parts)]
    unm = np.ascontiguousarray(sp.fp.unmasked[0])
    M = np.ascontiguousarray(sp.fp.M[0]).copy()
    args = (sp.scale_parts, second.U2, (second._N / math.log(2), second._C_HI, second._C_LO), second._Q_COEF)
    out = _rowsums.row_sums(*parts, unm, M, *args)
    assert out[:, 9].all()
    M[5] += 700.0  # every y of row 5 now below -600 (and row 6's largest above 1/2: its max far above M)
    M[6] -= 2.0
    out = _rowsums.row_sums(*parts, unm, M, *args)
    assert list(np.flatnonzero(out[:, 9] == 0)) == [5, 6]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_rounding_is_the_longdouble_codes(dtype):
    # Every element sent through the second pass: the same bits with the loop and without.
    rng = np.random.default_rng(7)
    q, k, v, grad = (rng.standard_normal((2, 30, 8)).astype(dtype) * 2 for _ in range(4))
    got = {}
    for compiled in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not compiled:
                mp.setattr(_rowsums, "row_sums", lambda *a, **k: None)
            _everything_through(mp, "second")
            r = er.scaled_dot_product_attention(q, k, v)
            got[compiled] = {name: g.rounded for name, g in r.backward(grad).items()}
    for name in got[True]:
        assert np.array_equal(got[True][name].view(np.uint16 if dtype == np.float16 else np.uint32),
                              got[False][name].view(np.uint16 if dtype == np.float16 else np.uint32)), name


def test_a_moderate_case_through_the_loop_holds_the_oracle_values():
    # Every element through the second pass (the loop's rows for grad_key and grad_value), checked
    # against the independent oracle; an irrational scale and a boolean mask.
    calls: list[bool] = []
    rng = np.random.default_rng(11)
    q, k, v, grad = (rng.standard_normal((2, 9, 6)).astype(np.float32) * 2 for _ in range(4))
    mask = rng.random((9, 9)) < 0.8
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(second, "_compiled_rows", recording(second._compiled_rows, calls))
        n = _second_pass_holds(q, k, v, grad, {"attn_mask": mask}, {"mask": mask})
    assert n == 4 * q.size and calls and all(calls)


def test_the_loops_exp_bound_is_within_the_longdouble_ones():
    # Its derivation (docs/attention.md) counts fewer and smaller roundings than the longdouble exp's.
    assert second._EXP_REL_DD <= second._EXP_REL < 2.0 ** -60
    assert second._EXP_REL_ROWS == second._EXP_REL
    assert _rowsums.sum2_gamma(2 * 1024) < 2.0 ** -80
