"""The backward tolerance's compiled loop (exactref/ops/attention/_loops.py) gives the numpy code's
values bit for bit: its pairwise sums are numpy's own, and its bounds the same operations in the
same order, NaN, infinities and signed zeros included."""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er
from exactref import _fused
from exactref.engine.fast import _UP_ABS, _UP_REL
from exactref.ops.attention import _loops, _model
from exactref.ops.attention._first import TINY, U

from .spies import recording

pytestmark = pytest.mark.skipif(not _fused.available(), reason="numba is not installed (exactref[fast])")

torch = pytest.importorskip("torch")


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


@pytest.mark.parametrize("n", [*range(1, 140), 255, 256, 257, 511, 512, 513, 1000, 1024, 2047, 4097])
def test_the_pairwise_sum_is_numpys(n):
    rng = np.random.default_rng(n)
    X = rng.standard_normal((4, n)) * np.exp2(rng.integers(-60, 60, (4, n)))
    X[1] = -0.0  # a row of negative zeros
    X[2, ::3] = 0.0
    want = np.sum(X, axis=-1)
    pairwise = _loops._pairwise()
    stack = np.empty(64)
    for row, w in zip(X, want):
        assert same(np.float64(pairwise(row, _loops._plan(n), stack)), w)


def numpy_rows(*args):
    """_dS_bound_rows by the numpy code (the loop declined)."""
    real = _model.ds_bound_rows
    _model.ds_bound_rows = lambda *a, **k: None
    try:
        return _model._dS_bound_rows(*args)
    finally:
        _model.ds_bound_rows = real


def loop_rows(*args):
    out = _loops.ds_bound_rows(*args, U=U, TINY=TINY, slack=_model._SLACK, up_constants=(_UP_REL, _UP_ABS))
    assert out is not None
    return out


@pytest.mark.parametrize("ds_rounded", [False, True])
@pytest.mark.parametrize("specials", [False, True])
def test_the_bounds_are_the_numpy_codes(ds_rounded, specials):
    rng = np.random.default_rng(int(ds_rounded) + 2 * int(specials))
    rows, S = 40, 200
    wide = [rng.standard_normal((rows, S)) * np.exp2(rng.integers(-40, 40, (rows, S))) for _ in range(9)]
    B, dP_hi, dP_lo, dP_rad, P_up, rho, dS, e_dS, _ = wide
    dP_lo *= 2.0 ** -60
    for a in (B, dP_rad, P_up, rho, e_dS):
        np.abs(a, out=a)
    D, e_D1, e_Db = rng.standard_normal(rows), np.abs(rng.standard_normal(rows)), np.abs(rng.standard_normal(rows))
    unmasked = rng.random((rows, S)) < 0.8
    unmasked[3] = False
    if specials:
        for a in (B, dP_hi, P_up, rho, dS):
            a[rng.random((rows, S)) < 0.02] = np.inf
        dP_rad[rng.random((rows, S)) < 0.02] = np.nan
        e_Db[::7], D[::11], e_D1[::13] = np.nan, np.inf, np.inf
        dP_hi[5] = -0.0
    consts = (2.0 ** -24, 2.0 ** -126, 3e-6, 1e-36, 1.5e-5, 3e-36, 2.0 ** -11, 2.0 ** -24, ds_rounded)
    args = (B, dP_hi, dP_lo, dP_rad, D, e_D1, P_up, rho, unmasked, dS, e_dS, e_Db, consts)
    for got, want in zip(loop_rows(*args), numpy_rows(*args)):
        assert same(got, want)


@pytest.mark.parametrize("dtype, shape, causal", [
    ("float32", (1, 2, 256, 64), False), ("float16", (1, 2, 256, 64), True),
    ("bfloat16", (2, 2, 200, 48), True), ("float64", (1, 1, 128, 32), False)])
def test_an_attention_backward_is_the_same_with_the_loop_and_without_it(dtype, shape, causal, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(*shape, generator=gen).to(getattr(torch, dtype)) for _ in range(4))
    ran: list[bool] = []
    monkeypatch.setattr(_model, "ds_bound_rows", recording(_loops.ds_bound_rows, ran))
    with_loop = er.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    assert any(ran)
    monkeypatch.setattr(_model, "ds_bound_rows", lambda *a, **kw: None)
    without = er.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    for name in ("grad_query", "grad_key", "grad_value"):
        for field in ("rounded", "tolerance"):
            assert same(getattr(with_loop[name], field), getattr(without[name], field))


def test_the_bounds_are_the_numpy_codes_where_t_cancels():
    # T = dP - D = 0 with a large bound e_T (from e_D1), small weights' errors and no overflow
    # terms: e_S is then about (grow - 1) e_T, so each rounding step of e_T shows in it.
    rng = np.random.default_rng(7)
    rows, S = 64, 64  # (at least the loops' MIN_SIZE elements)
    D = rng.standard_normal(rows) * 1e-10
    dP_hi = np.repeat(D[:, None], S, axis=1)
    zeros = np.zeros((rows, S))
    e_D1 = np.abs(rng.standard_normal(rows)) + 1.0
    rho = np.full((rows, S), 0.5)
    P_up = rng.random((rows, S))
    consts = (2.0 ** -24, 2.0 ** -1000, 1e-30, 0.0, 1e-6, 0.0, 2.0 ** -11, 2.0 ** -24, False)
    args = (zeros, dP_hi, zeros, zeros, D, e_D1, P_up, rho, np.ones((rows, S), bool), zeros, zeros,
            np.zeros(rows), consts)
    for got, want in zip(loop_rows(*args), numpy_rows(*args)):
        assert same(got, want)


def _logits(rows_obj, compiled, sl, *args) -> bool:
    """rows_obj.logits(sl, *args) with the loop or without; whether the loop's values were kept."""
    from exactref.ops.attention import _first
    real = _first._Rows._compiled
    kept = []

    def loop(self, *a):
        kept.append(real(self, *a) if compiled else False)
        return kept[-1]
    _first._Rows._compiled = loop
    try:
        rows_obj.logits(sl, *args)
    finally:
        _first._Rows._compiled = real
    return kept == [True]


def _logit_case(seed, rows=16, S=1100):
    rng = np.random.default_rng(seed)
    d_hi = rng.standard_normal((rows, S)) * np.exp2(rng.integers(-3, 6, (rows, S)))
    d_lo = d_hi * 2.0 ** -60 * rng.standard_normal((rows, S))
    d_rad = np.abs(d_hi) * 2.0 ** -100
    unm = rng.random((rows, S)) < 0.8
    unm[3] = False  # a fully masked row
    unm[4] = True
    d_hi[5, 7] = -0.0
    d_hi[6, :] = 1.5  # every logit equal
    d_hi[7, 3] = -5920.0  # a weight below float64's normal range (s = 0.125): exp's scaling in two steps
    d_hi[8, 0] = 1e300  # a huge logit: its row's other weights underflow, and its bounds are element-wise
    d_hi[1, 5] = np.nan  # (its row's bounds are infinite: the first block of 4 rows goes to the numpy code)
    d_hi[11, 2] = np.inf  # (an infinite bound: its block goes to the numpy code)
    unm[7, 3] = unm[8, 0] = unm[1, 5] = unm[11, 2] = True
    return d_hi, d_lo, d_rad, unm


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("s", [0.125, 1 / np.sqrt(7.0), 3.0])
def test_the_logits_loop_gives_the_numpy_codes_values(seed, s):
    from exactref.ops.attention import _first
    d_hi, d_lo, d_rad, unm = _logit_case(seed)
    got, kept = {}, []
    for compiled in (True, False):
        rows = _first._Rows(*d_hi.shape)
        with np.errstate(all="ignore"):
            for start in range(0, d_hi.shape[0], 4):  # blocks of rows, as the first pass takes them
                sl = slice(start, start + 4)
                ran = _logits(rows, compiled, sl, d_hi[sl], d_lo[sl], d_rad[sl], unm[sl], None, s, s * 2.0 ** -53)
                kept.append(ran)
        got[compiled] = rows
    assert sum(kept) >= 2  # the loop's values were kept for some blocks (others have rows it leaves)
    for name in ("Z", "ez", "w", "M", "full", "epsbar", "logit_rowmax"):
        a, b = getattr(got[True], name), getattr(got[False], name)
        assert same(a, b) if a.dtype != bool else np.array_equal(a, b), name
    assert got[True].loose.keys() == got[False].loose.keys()


def test_the_logits_loop_runs_on_ordinary_rows_and_leaves_loose_ones_to_numpy():
    from exactref.ops.attention import _first
    calls: list[bool] = []
    real = _loops.logit_rows
    rng = np.random.default_rng(3)
    d_hi = rng.standard_normal((8, 600))
    zeros = np.zeros_like(d_hi)
    unm = np.ones(d_hi.shape, dtype=bool)
    rows = _first._Rows(*d_hi.shape)
    _loops.logit_rows = recording(real, calls)
    try:
        rows.logits(slice(0, 8), d_hi, zeros, zeros, unm, None, 0.5, 2.0 ** -60)
        assert rows.logit_rowmax[0] > 0 and calls == [True]
        d_hi[2, 0] = 1e12  # a logit whose rounding alone is a sizeable part of a nat: element-wise bounds
        assert rows._compiled(slice(0, 8), d_hi, zeros, zeros, unm, 0.5, 2.0 ** -60) is False
    finally:
        _loops.logit_rows = real


def _first_pass(q, k, v, loops: bool, **kw):
    from exactref.ops.attention import _first
    made = []
    real = _first.FirstPass.__init__

    def keep(self, *a):
        real(self, *a)
        made.append(self)
    saved = _loops.logit_rows, _loops.weight_rows
    if not loops:
        _loops.logit_rows, _loops.weight_rows = (lambda *a, **k: None), (lambda *a, **k: False)
    _first.FirstPass.__init__ = keep
    try:
        er.scaled_dot_product_attention(q, k, v, **kw)
    finally:
        _first.FirstPass.__init__ = real
        _loops.logit_rows, _loops.weight_rows = saved
    return made[0]


@pytest.mark.parametrize("kind", ["plain", "mask", "causal", "huge", "wide"])
def test_the_first_pass_is_the_same_with_the_loops_and_without(kind):
    rng = np.random.default_rng(len(kind))
    q, k, v = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) * 2 for _ in range(3))
    kw = {"attn_mask": rng.random((300, 300)) < 0.7} if kind == "mask" else {"is_causal": kind == "causal"}
    if kind == "huge":
        q[0, 1, 7] *= 1e6  # a row whose bounds are element-wise: its block keeps the numpy code
    if kind == "wide":
        q[0, 0, 3] *= 300  # logits hundreds apart: weights that underflow to 0, P_up and e_P from TINY
    calls = []
    real = _loops.weight_rows

    def counted(*a):
        calls.append(real(*a))
        return calls[-1]
    _loops.weight_rows = counted
    try:
        fast = _first_pass(q, k, v, True, **kw)
    finally:
        _loops.weight_rows = real
    slow = _first_pass(q, k, v, False, **kw)
    assert calls and all(calls)
    for name in ("Z", "ez", "P", "P_up", "e_P", "M", "pi", "logit_rowmax", "O_hi", "O_lo", "rad_O"):
        assert same(getattr(fast, name), getattr(slow, name)), name


@pytest.mark.parametrize("kind", ["plain", "mask", "wide", "float64"])
def test_the_backwards_ds_is_the_same_with_the_loop_and_without(kind):
    # (float64 inputs: dP = dO V^T has a nonzero lo part, which float32 products of 16 terms lack.)
    from exactref.ops.attention import _first
    rng = np.random.default_rng(len(kind) + 7)
    dtype = np.float64 if kind == "float64" else np.float32
    q, k, v, g = (rng.standard_normal((1, 2, 300, 16)).astype(dtype) * 2 for _ in range(4))
    kw = {"attn_mask": rng.random((300, 300)) < 0.7} if kind == "mask" else {}
    if kind == "wide":
        q[0, 0, 3] *= 300
    got, calls = {}, []
    real_init, real_loop = _first.FirstPass.__init__, _loops.ds_rows

    def keep(self, *a):
        real_init(self, *a)
        got[loop] = self

    def counted(*a):
        calls.append(real_loop(*a))
        return calls[-1]
    for loop in (True, False):
        _first.FirstPass.__init__ = keep
        _loops.ds_rows = counted if loop else (lambda *a, **k: False)
        try:
            er.scaled_dot_product_attention(q, k, v, **kw).backward(g)
        finally:
            _first.FirstPass.__init__, _loops.ds_rows = real_init, real_loop
    assert calls and all(calls)
    for name in ("dS", "e_dS", "D", "e_D"):
        assert same(getattr(got[True], name), getattr(got[False], name)), name


@pytest.mark.parametrize("kind", ["plain", "mask", "causal", "wide", "large", "huge", "float16"])
def test_the_weight_bounds_are_the_same_with_the_loop_and_without(kind):
    # Every algorithm's forward and backward models, each computing delta and h or reusing them.
    from exactref.ops.attention import _model
    rng = np.random.default_rng(len(kind) + 3)
    dtype = np.float16 if kind == "float16" else np.float32
    q, k, v = (rng.standard_normal((1, 2, 300, 16)).astype(dtype) * 2 for _ in range(3))
    kw = {"attn_mask": rng.random((300, 300)) < 0.7} if kind == "mask" else {"is_causal": kind == "causal"}
    if kind == "wide":
        q[0, 0, 3] *= 300
    if kind == "huge":
        q[0, 1, 7] *= 1e6
    if kind == "large":
        # Logits near 10**5 and 4 10**5: delta below 1, but delta + r (16-key blocks) past it, with h
        # below 1/2 (rows 21 and 22) and above it (row 3).  Their blocks go to the numpy code; the
        # first pass's bounds stay row-wise.
        q[0, 0, 3] *= 2.5e4
        q[0, 0, 21] *= 1.4e4
        q[0, 0, 22] *= 1.6e4
        q[0, 1, 9] *= 1e5
    fp = _first_pass(q, k, v, True, **kw)
    calls = []
    real = _model.rho_rows

    def counted(*a):
        calls.append(real(*a))
        return calls[-1]
    for algorithm in er.AttentionAlgorithm:
        got = {}
        for loop in (True, False):
            fp.weights_cache.clear()
            _model.rho_rows = counted if loop else (lambda *a, **k: False)
            try:
                models = (algorithm.tolerance, algorithm.backward_tolerance)
                got[loop] = [_model._Weights(fp, m, fp.pb.fmt) for m in models]
            finally:
                _model.rho_rows = real
        for a, b in zip(*got.values()):
            for name in ("delta", "h", "r", "rho"):
                assert same(getattr(a, name), getattr(b, name)), (algorithm, name)
    assert any(calls)
    assert all(calls) == (kind not in ("huge", "large"))  # their blocks go to the numpy code


@pytest.mark.parametrize("n", [1, 7, 64, 129])
def test_the_dot2_loop_gives_the_numpy_codes_sums(n, monkeypatch):
    # D = rowsum(dO O) by _first.dot_rows: Dekker's products, where they are exact and where they
    # are not (a factor past 2**995, a product below 2**-968, a zero beside a huge one), NaN and
    # infinities, signed zeros; and the error bound made from the sums.
    from exactref.ops.attention._first import dot_rows

    rng = np.random.default_rng(n)
    shape = (3, max(700, 1400 // n), n)  # (at least the loops' MIN_SIZE values)
    X, hi = (rng.standard_normal(shape) * np.exp2(rng.integers(-60, 60, shape)) for _ in range(2))
    lo = hi * np.exp2(-60.0) * rng.standard_normal(shape)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0 ** 996, -(2.0 ** 1000), 2.0 ** -500, 5e-324, 1e-300]
    for arr in (X, hi, lo):
        odd = rng.random(shape) < 0.01
        arr[odd] = rng.choice(specials, int(odd.sum()))
    X[0, :5] = 2.0 ** -600  # products of 2**-1200 and less: below 2**-968, the error term dropped
    hi[0, :5] = 2.0 ** -600
    calls: list[bool] = []
    monkeypatch.setattr(_loops, "dot2_rows", recording(_loops.dot2_rows, calls))
    with np.errstate(all="ignore"):
        got = dot_rows(X, hi, lo)
        assert calls == [True]  # (the loop made them)
        monkeypatch.setattr(_loops, "dot2_rows", lambda *a: None)
        want = dot_rows(X, hi, lo)
    for g, w in zip(got, want):
        # (Which NaN an invalid operation gives, its sign too, is the hardware's choice.)
        assert same(np.where(np.isnan(g), np.nan, g), np.where(np.isnan(w), np.nan, w))
    assert np.isinf(want[1]).any() and np.isfinite(want[1]).any() and np.isnan(want[0]).any()


@pytest.mark.parametrize("second", [False, True])
def test_the_cap_loop_gives_the_numpy_codes_answers(second, monkeypatch):
    # _caps._dS_rows: each row built to pass, or to fail one condition (the first by a hair, the
    # second where it is tested, the third), or to hold a NaN in one of its arrays, or a weight
    # bound above 1 that only min(P_up, 1) fails; the loop's answer for every row is the numpy code's.
    from exactref.ops.attention import _caps

    rng = np.random.default_rng(int(second))
    rows, n = 96, 300
    g_lo, g_hi, lo, hi = 1e-3, 2e-3, 1 - 2.0 ** -50, 1.001
    m = 5e-3 if second else 1e-4
    P_up = rng.uniform(0.01, 0.9, (rows, n))
    B = rng.uniform(0.5, 2.0, (rows, n))
    below = (1 + g_lo) * lo * P_up * B
    d = 0.5 * P_up * B  # the third condition holds
    d[:, 31] = P_up[:, 31] * (B[:, 31] + 0.5 * B.max(axis=-1))  # and needs the row's largest B

    def binding(g, hair):  # e where (e + g (d + e)) hi is below times 1 + hair
        return (below / hi * (1 + hair) - g * d) / (1 + g)
    kind = np.arange(rows) % 8
    e = binding(max(g_hi, m) if second else g_hi, -1e-12)
    e[kind == 1] = binding(g_hi, 1e-9)[kind == 1]  # fails the first condition by a hair
    e[kind == 2] = binding(g_hi, -1e-12)[kind == 2]  # holds the first, fails the second where tested
    d[kind == 3, 13] = 1e9  # fails the third: above P_up (B + max B)
    B[kind == 4, 17] = np.nan
    P_up[kind == 5, 19] = np.nan
    e[kind == 6, 23] = np.nan
    P_up[kind == 7, 29] = 1.5  # min(P_up, 1) is 1 there: the third condition fails
    d[kind == 7, 29] = 1.2 * (B[kind == 7, 29] + B[kind == 7].max(axis=-1))
    consts = (g_lo, g_hi, m, lo, hi)
    calls: list[bool] = []
    monkeypatch.setattr(_loops, "cap_rows", recording(_loops.cap_rows, calls))
    got = _caps._dS_rows(P_up, B, e, d, consts)[0]
    assert calls == [True]
    monkeypatch.setattr(_loops, "cap_rows", lambda *a: None)
    want = _caps._dS_rows(P_up, B, e, d, consts)[0]
    assert got.dtype == want.dtype == np.bool_ and np.array_equal(got, want)
    assert want[kind == 0].all() and not want[(kind >= 1) & (kind != 2)].any()
    assert not want[kind == 2].any() if second else want[kind == 2].all()


@pytest.mark.parametrize("S", [1, 2, 7, 128, 129, 1000])
def test_the_sums_loop_gives_numpys_sums(S, monkeypatch):
    # _model._dS_bound_sums: the sums of |dS| + e_S over the keys (numpy's pairwise order) and over
    # the rows (numpy's, one after another; with one key, pairwise, which the loop leaves to
    # numpy), with magnitudes 2**80 apart, infinities and NaN.
    rng = np.random.default_rng(S)
    shape = (3, max(3, 6000 // S), S)
    a, b = (rng.random(shape) * np.exp2(rng.integers(-40, 40, shape)) for _ in range(2))
    a[0, 1, 0] = np.inf
    b[1, 2, -1] = np.nan
    calls: list[bool] = []
    monkeypatch.setattr(_model, "ds_sums", recording(_loops.ds_sums, calls))
    fp = type("FP", (), {"bwd_cache": {}})()
    got = _model._dS_bound_sums(fp, "model", None, a, b)
    assert calls == [S > 1]
    monkeypatch.setattr(_model, "ds_sums", lambda *args: None)
    want = _model._dS_bound_sums(type("FP", (), {"bwd_cache": {}})(), "model", None, a, b)
    with np.errstate(invalid="ignore"):
        X = b + a
    for axis in (-1, -2):
        assert same(got[axis], want[axis]), axis
        assert same(want[axis], np.sum(X, axis=axis)), axis
    assert np.isnan(want[-1]).any() and np.isinf(want[-2]).any()
