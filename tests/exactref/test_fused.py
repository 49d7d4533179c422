"""exactref/_fused.py: each compiled loop against the numpy code it stands for, bit for bit.

The numpy code is the definition (its own tests hold it to Fractions and
Arb); here each loop gets values chosen where the two could part: NaN, both
infinities, both zeros, subnormals, values past float32's range and at its
ties, tolerances of 0, -0, NaN and inf.  Then whole ops, with the loops and
without them.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

import exactref as er
from exactref import _fused, _fused_judge
from exactref.engine import decision, products
from exactref.formats import FORMATS
from exactref.models import _bounds
from exactref.ops._common import _PART_DTYPES, _slackened
from exactref.result import judge
from exactref.rounding import round_float64

from .spies import recording

F32, F64, F16, BF16 = FORMATS["float32"], FORMATS["float64"], FORMATS["float16"], FORMATS["bfloat16"]
E5M2 = FORMATS["float8_e5m2"]  # (IEEE's rules in 8 bits: rounded by its bits too)
N = 2 * _fused.MIN_SIZE + 3  # an odd size, above the loops' threshold

numba = pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loops are not used")


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint64 if x.dtype == np.float64 else np.uint8)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and got.dtype == want.dtype and np.array_equal(_bits(got), _bits(want))


def _values(rng: np.random.Generator, n: int, fmt=F32) -> np.ndarray:
    """float64 values where the roundings to ``fmt`` (and float64's), and their special cases, part
    ways: its range's ends, its subnormals, its midpoints and their neighbours (float64's own:
    float32's, with float64's largest values among the special ones)."""
    fmt = fmt if fmt.emax < 1000 else F32
    f32 = np.finfo(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -5e-324, 2.0 ** -1022, 1e-300,
                        float(f32.max), -float(f32.max), float(f32.max) * (1 + 2.0 ** -25), 3.5e38, 1e308,
                        np.finfo(np.float64).max, float(f32.smallest_subnormal), 2.0 ** -150, 1.0, -1.0,
                        fmt.max_finite, fmt.max_finite * (1 + 2.0 ** -fmt.p),
                        fmt.max_finite * (1 + 2.0 ** -(fmt.p + 1)),
                        fmt.min_normal, fmt.min_normal * (1 - 2.0 ** -30), fmt.min_subnormal, fmt.min_subnormal / 2,
                        2.0 ** (fmt.emax + 2), 2.0 ** (fmt.emax + 2) * (1 - 2.0 ** -53)])
    # Midpoints of fmt's values, over its whole range and past it.
    ties = (rng.integers(2 ** (fmt.p - 1), 2 ** fmt.p, n) + 0.5) * 2.0 ** rng.integers(
        fmt.emin - fmt.p - 10, fmt.emax + 4, n).astype(float)
    kinds = [rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n), ties, rng.choice(special, n),
             np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)]
    pick = rng.integers(0, len(kinds), n)
    return np.choose(pick, kinds) * rng.choice([1.0, -1.0], n)


def _tolerances(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    E = np.abs(x) * 2.0 ** rng.integers(-60, 0, x.size)
    odd = rng.random(x.size) < 0.1
    E[odd] = rng.choice([0.0, -0.0, np.nan, np.inf, 5e-324, 1e300, -1.0], int(odd.sum()))
    return E


def test_the_loops_are_compiled_without_contracting_a_product_and_a_sum() -> None:
    # a * b rounds to 1 here, so a * b + c is 0; a fused multiply-add would give -2**-60.
    @_fused._jit()
    def loop(a, b, c, out):
        for i in range(a.size):
            out[i] = a[i] * b[i] + c[i]
    a, b, c = np.full(64, 1 + 2.0 ** -30), np.full(64, 1 - 2.0 ** -30), np.full(64, -1.0)
    out = np.empty(64)
    loop(a, b, c, out)
    assert np.array_equal(out, a * b + c) and (out == 0).all()


@pytest.mark.parametrize("fmt", [F32, F64, F16, BF16, E5M2], ids=["float32", "float64", "float16", "bfloat16", "e5m2"])
@pytest.mark.parametrize("marks", [False, True])
def test_judge_into_writes_what_judge_returns(fmt, marks) -> None:
    rng = np.random.default_rng(7 + marks)
    x = _values(rng, N, fmt)
    with np.errstate(all="ignore"):
        width = np.abs(x) * 2.0 ** rng.integers(-60, 0, N)
        x_lo, x_hi = x - width, x + width
        x_lo[rng.random(N) < 0.05] = np.nan  # (a special answer's bounds are NaN)
        rounded = round_float64(x, fmt)
    E = _tolerances(rng, x)
    overflow = (rng.random(N) < 0.2) if marks else None
    with np.errstate(all="ignore"):
        want = judge(rounded, x_lo, x_hi, _slackened(E), fmt, overflow=overflow)
        out = {name: np.full(N + 10, 7, dtype=dtype) for name, dtype in _PART_DTYPES.items()}
        before = {name: a.copy() for name, a in out.items()}
        assert _fused.judge_into(fmt, E, x_lo, x_hi, rounded, overflow, out, slice(5, 5 + N))
    for name in _PART_DTYPES:
        assert _same(out[name][5:5 + N], getattr(want, name)), name
        outside = np.r_[0:5, 5 + N:N + 10]
        assert _same(out[name][outside], before[name][outside]), name  # only its place is written


@pytest.mark.parametrize("fmt", [F32, F64, F16, BF16], ids=["float32", "float64", "float16", "bfloat16"])
def test_judge_into_the_solutions_own_arrays(fmt) -> None:
    # ops._common._judge passes a Solution's rounded value and bounds as the Part's own arrays: the
    # loops read them while the rest of the Part is written (and the copies are skipped).
    rng = np.random.default_rng(11)
    x = _values(rng, N, fmt)
    with np.errstate(all="ignore"):
        width = np.abs(x) * 2.0 ** rng.integers(-60, 0, N)
        x_lo, x_hi = x - width, x + width
        rounded = round_float64(x, fmt)
    E = _tolerances(rng, x)
    overflow = rng.random(N) < 0.2
    with np.errstate(all="ignore"):
        want = judge(rounded, x_lo, x_hi, _slackened(E), fmt, overflow=overflow)
        out = {"rounded": rounded, "x_lo": x_lo, "x_hi": x_hi}
        out.update((name, np.full(N, 7, dtype=dtype)) for name, dtype in _PART_DTYPES.items() if name not in out)
        assert _fused.judge_into(fmt, E, x_lo, x_hi, rounded, overflow, out, slice(None))
    for name in _PART_DTYPES:
        assert _same(out[name], getattr(want, name)), name


@pytest.mark.parametrize("fmt", [F16, BF16, E5M2], ids=["float16", "bfloat16", "e5m2"])
def test_round_bits_rounds_to_the_format_or_says_it_cannot(fmt) -> None:
    # The loops' rounding by the bits, one value at a time, against round_float64: equal wherever it
    # does not hand the value on, at the format's midpoints (ties to even) too.
    rng = np.random.default_rng(17)
    x = _values(rng, 2000, fmt)
    with np.errstate(all="ignore"):
        want = round_float64(x, fmt)
    round_bits, f = _fused._round_bits(), _fused._bits_format(fmt)
    got = [round_bits(float(v), f) for v in x]
    odd = np.array([o for _, o in got])
    r = np.array([v for v, _ in got])
    assert _same(r[~odd], want[~odd])
    assert odd.any() and (~odd).sum() > 500
    # The midpoints in range, both ways: half go up (to an even last bit) and half down.
    m = rng.integers(2 ** (fmt.p - 1), 2 ** fmt.p, 200)
    mid = (m + 0.5) * 2.0 ** -(fmt.p - 1)
    assert _same(np.array([round_bits(float(v), f)[0] for v in mid]), round_float64(mid, fmt))
    assert len({float(v) > float(w) for v, w in zip(round_float64(mid, fmt), mid)}) == 2


@pytest.mark.parametrize("fmt", [F32, F16, BF16, E5M2], ids=["float32", "float16", "bfloat16", "e5m2"])
def test_decide_narrow_is_the_numpy_decision(fmt) -> None:
    rng = np.random.default_rng(3)
    hi = _values(rng, N, fmt)
    rad = np.abs(hi) * 2.0 ** rng.integers(-70, -20, N)
    odd = rng.random(N) < 0.05
    rad[odd] = rng.choice([0.0, np.inf, np.nan, 5e-324], int(odd.sum()))
    with np.errstate(all="ignore"):
        x_lo, x_hi = decision.bounds_lo_zero(hi, rad)
        rounded, decided = decision.decide_narrow(x_lo, x_hi, fmt)
    got = _fused.decide_narrow(hi, rad, fmt)
    assert decided.any() and not decided.all()
    for g, w in zip(got, (rounded, x_lo, x_hi, decided)):
        assert _same(g, w)


@pytest.mark.parametrize("kind", ["ordinary", "powers of two", "ties"])
def test_decide_float64_makes_the_decisions_of_its_definition(kind) -> None:
    # As tests/exactref/test_engine_speedups.py holds the numpy code to the same definition: the
    # decisions everywhere, and the values where decided (elsewhere the exact path overwrites them).
    rng = np.random.default_rng(["ordinary", "powers of two", "ties"].index(kind))
    if kind == "ordinary":
        hi = rng.standard_normal(N) * 2.0 ** rng.integers(-1000, 1000, N)
    elif kind == "powers of two":
        hi = np.ldexp(rng.choice([-1.0, 1.0], N), rng.integers(-1074, 1024, N))
        hi[: N // 8] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float64).max], N // 8)
    else:
        hi = np.round(rng.standard_normal(N) * 8) / 8
    with np.errstate(all="ignore"):
        ulp = np.spacing(np.abs(hi))
        lo = ulp * rng.choice([0.0, 0.5, -0.5, 0.25, -0.25, 0.5 * (1 - 2.0 ** -53), -0.5 * (1 - 2.0 ** -53), 2.0], N)
        # (A half-ulp lo and a radius one unit below a half ulp put the far end exactly one unit below
        # the next float64, the near one just past s.)
        rad = ulp * rng.choice([0.0, 2.0 ** -30, 0.1, 0.25, 0.49, 0.5, 0.5 * (1 - 2.0 ** -52), 0.51, 1.0], N)
    odd = rng.random(N) < 0.03
    rad[odd] = rng.choice([np.inf, np.nan, 0.0], int(odd.sum()))
    with np.errstate(all="ignore"):
        ref = decision.decide_float64_general(hi, lo, rad)
        fast = decision.decide_float64(hi, lo, rad)
    got = _fused.decide_float64(hi, lo, rad)
    decided = ref[3]
    assert decided.any() and not decided.all()
    assert _same(got[3], decided) and _same(fast[3], decided)
    for g, w in zip(got[:3], ref[:3]):
        assert _same(g[decided], w[decided])


@pytest.mark.parametrize("underflow", [False, True])
def test_scaled_bound_is_dot_error_and_overflow_possible(underflow) -> None:
    rng = np.random.default_rng(11)
    S = np.abs(_values(rng, N))
    for acc, out, depth in ((F32, F32, 1023), (F64, F64, 511), (F32, FORMATS["float16"], 4096)):
        with np.errstate(all="ignore"):
            want = (_bounds.dot_error(S, depth=depth, acc=acc, out=out, terms=depth, underflow=underflow),
                    _bounds.overflow_possible(S, acc, depth))
            got = _bounds.dot_error_and_overflow(S, depth=depth, acc=acc, out=out, terms=depth,
                                                 underflow=underflow, overflow_depth=depth)
        assert _same(got[0], want[0]) and _same(got[1], want[1])
        assert want[1].any() and not want[1].all()


def test_widen_float32_is_the_bound_and_radius_of_a_narrow_product() -> None:
    from exactref.engine import products

    rng = np.random.default_rng(13)
    with np.errstate(all="ignore"):
        S32 = np.abs(_values(rng, N)).astype(np.float32).reshape(1, N)
        right = products.Right(np.ones((1000, 3)), narrow=True)  # K = 1000, whose scale and addend count
        g = 999 * 2.0 ** -53 / (1 - 999 * 2.0 ** -53)
        S = right._widen(S32)
        want = (S, g * S * (1 + 2.0 ** -50) + 2.0 ** -1070)
    got = _fused.widen_float32(S32, *right._widening(), g)
    assert _same(got[0], want[0]) and _same(got[1], want[1])
    assert np.isinf(S32).any() and (S32 == 0).any()


_QUICK_CASES = ["normal", "B in one slice", "A in two slices", "wide exponents", "overflow",
                "float32 bound overflows", "short", "stack", "stack without the bound"]


@pytest.mark.parametrize("case", _QUICK_CASES)
def test_the_quick_cut_loop_makes_the_enclosure_of_the_numpy_code(monkeypatch, case) -> None:
    from exactref.engine import products

    rng = np.random.default_rng(_QUICK_CASES.index(case))
    M, K, N = 96, (3 if case == "short" else 512), 80
    lead = (3,) if case.startswith("stack") else ()
    A, B = rng.standard_normal(lead + (M, K)), rng.standard_normal(lead + (K, N))
    if lead:  # (attention's products: a stack of heads, each with rows of every size)
        A *= 2.0 ** rng.integers(-20, 20, lead + (M, 1))
        A[1, ::4] *= 2.0 ** -1040
    if case == "B in one slice":  # values of a few bits: no (A0 + A1) RB product
        B = np.round(B * 8) / 8
    elif case == "A in two slices":  # values of a few bits: no remainder of A, no RA B product
        A = np.round(A * 8) / 8
    elif case == "wide exponents":  # rows whose slices' unit underflows, and huge ones
        A *= 2.0 ** rng.integers(-60, 10, (M, K))
        B *= 2.0 ** rng.integers(-40, 40, (K, N))
        A[::3] *= 2.0 ** -1040
        A[1::7] *= 2.0 ** 900
    elif case == "overflow":
        A[::5] *= 1e300
        B[:, ::3] *= 1e10
        # Where only the rank-one bound on the rest overflows: a row's sum meets a column's
        # remainder (a value of 2**100 + 2**69, past B's slice of 30 bits), at other terms.
        A[2], B[:, 2] = 0.0, 0.0
        A[2, :2], B[1, 2] = (2.0 ** 956, 1.0), 2.0 ** 100 + 2.0 ** 69
    elif case == "float32 bound overflows":  # S in float32 past its range, the values themselves small
        A[1], B[:, 1] = 2.0 ** 60, np.resize([2.0 ** 60, -(2.0 ** 60)], K)
    calls = []
    quick_cut = _fused.quick_cut
    monkeypatch.setattr(_fused, "quick_cut", lambda *a: calls.append(1) or quick_cut(*a))
    # (Rows and columns without a remainder make exact pieces, which the loop leaves to the numpy
    # code: the constructed ones of the overflow cases are asked for without.)
    pieces = case not in ("overflow", "float32 bound overflows")
    bound = case != "stack without the bound"
    with np.errstate(all="ignore"):
        got = products.Right(B, narrow=False, pieces=pieces, quick=True, bound=bound).times(A)
        assert calls
        monkeypatch.setattr(_fused, "available", lambda: False)
        want = products.Right(B, narrow=False, pieces=pieces, quick=True, bound=bound).times(A)
    for name in ("hi", "lo", "rad") + (("S",) if bound else ()):
        assert _same(getattr(got, name), getattr(want, name)), name
    assert (got.S is None) == (want.S is None) == (not bound)
    assert want.pieces is None
    if case in ("wide exponents", "overflow") or lead:
        assert np.isinf(want.rad).any()
    if case == "overflow":
        assert want.S[2, 2] < np.inf and np.isinf(want.rad[2, 2]) and A[2] @ B[:, 2] != 0
    if case == "float32 bound overflows":
        assert np.isinf(want.S[1, 1]) and np.isinf(want.rad[1, 1])
        assert np.isfinite(A[1] @ B[:, 1])


@pytest.mark.parametrize("case", ["exact pieces", "broadcast B"])
def test_the_quick_cut_loop_leaves_what_it_cannot_make_to_the_numpy_code(monkeypatch, case) -> None:
    # Rows and columns without remainders sum exactly from pieces, which the loop does not keep;
    # and a stack of A times one B has lowest units of B's shape alone.
    from exactref.engine import products

    rng = np.random.default_rng(11)
    A = rng.standard_normal((3, 96, 512) if case == "broadcast B" else (96, 512))
    B = rng.standard_normal((512, 80))
    if case == "exact pieces":
        A, B = np.round(A * 8) / 8, np.round(B * 8) / 8
    calls = []
    quick_cut = _fused.quick_cut
    monkeypatch.setattr(_fused, "quick_cut", lambda *a: calls.append(1) or quick_cut(*a))
    with np.errstate(all="ignore"):
        got = products.Right(B, narrow=False, pieces=True, quick=True).times(A)
        assert not calls
        monkeypatch.setattr(_fused, "available", lambda: False)
        want = products.Right(B, narrow=False, pieces=True, quick=True).times(A)
    for name in ("hi", "lo", "rad", "S"):
        assert _same(getattr(got, name), getattr(want, name)), name
    assert (got.pieces is not None) == (want.pieces is not None) == (case == "exact pieces")


def test_formats_the_loops_take() -> None:
    for fmt in (F32, F64, F16, BF16, E5M2):
        assert _fused.judges(fmt), fmt.name
    for fmt in (F32, F16, BF16, E5M2):
        assert _fused.decides(fmt), fmt.name
    assert not _fused.decides(F64)  # (float64 decisions take decide_float64)
    # Saturating formats, ones without infinities or negative zero: the numpy code.
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if name in FORMATS:
            assert not _fused.judges(FORMATS[name]) and not _fused.decides(FORMATS[name]), name


def _fields(res: er.Result) -> list[np.ndarray]:
    return [np.asarray(getattr(p, name)).copy() for p in res._parts for name in _PART_DTYPES]


@pytest.mark.parametrize(("shapes", "dtype"), [
    (((512, 512), (512, 512)), "float32"),  # judged block by block as it is solved
    (((3, 200, 96), (96, 300)), "float32"),
    (((600, 300), (300, 500)), "float64"),  # judged after solving
    (((512, 300), (300, 512)), "float16"),  # rounded by the bits
    (((2, 512, 64), (64, 300)), "bfloat16"),
])
def test_an_op_gives_the_same_result_with_the_loops_and_without(monkeypatch, shapes, dtype) -> None:
    rng = np.random.default_rng(5)
    spread = 20 if dtype in ("float32", "float64") else 3  # (finite products in the half formats)
    A, B = (er.asarray(rng.standard_normal(s) * 2.0 ** rng.integers(-spread, spread, s), dtype) for s in shapes)
    G = er.asarray(rng.standard_normal(np.broadcast_shapes(A.shape[:-1], (1,))[:-1] + (A.shape[-2], B.shape[-1])),
                   dtype)
    calls = []
    judge_into = _fused.judge_into
    monkeypatch.setattr(_fused, "judge_into", lambda *a: calls.append(1) or judge_into(*a))
    # (A narrow product's blocks are judged by exactref/_fused_judge.py's one pass instead.)
    one_pass = _fused_judge.decide_and_judge
    monkeypatch.setattr(_fused_judge, "decide_and_judge", recording(one_pass, calls))

    def run() -> list[np.ndarray]:
        res = er.matmul(A, B)
        grads = res.backward(G)
        return _fields(res) + _fields(grads["grad_A"]) + _fields(grads["grad_B"])
    fused = run()
    assert any(calls)  # the loops judged it
    monkeypatch.setattr(_fused, "available", lambda: False)
    plain = run()
    assert len(fused) == len(plain)
    for g, w in zip(fused, plain):
        assert _same(g, w)


def test_read_float32_widens_checks_and_takes_magnitudes() -> None:
    rng = np.random.default_rng(9)
    f32 = np.finfo(np.float32)
    x = (rng.standard_normal(N) * 2.0 ** rng.integers(-150, 125, N)).astype(np.float32)
    x[:6] = [0.0, -0.0, f32.smallest_subnormal, -f32.max, f32.max, -f32.tiny]
    for bad in (None, 0, N // 2, N - 1):
        for value in ((np.inf, -np.inf, np.nan) if bad is not None else (None,)):
            y = x.copy()
            if bad is not None:
                y[bad] = value
            for z in (y, y[:N - 1].reshape(2, -1)):  # (a 2-D one without the last value)
                values, finite, magnitudes, in_range = _fused.read_float32(z)
                assert values.shape == magnitudes.shape == z.shape
                assert _same(values, z.astype(np.float64))
                assert _same(magnitudes, np.abs(z)) and magnitudes.dtype == np.float32
                assert finite is (bad is None or (z.ndim == 2 and bad == N - 1)) and not np.shares_memory(values, z)
                assert in_range is products._in_float32_range(np.abs(z))
    # The range's ends, inside and just outside, alone among values inside it.
    f32 = np.float32
    for end, inside in ((2.0 ** 60, True), (2.0 ** -60, True), (np.nextafter(f32(2.0 ** 60), f32(np.inf)), False),
                        (np.nextafter(f32(2.0 ** -60), f32(0)), False), (0.0, True), (-0.0, True), (np.nan, False)):
        y = np.ones(N, dtype=np.float32)
        y[N // 3] = -end
        assert _fused.read_float32(y)[3] is inside is products._in_float32_range(np.abs(y))
    assert _fused.read_float32(x[::2]) is None  # (not contiguous)
    assert _fused.read_float32(x[:100]) is None  # (small)
    assert _fused.read_float32(x.astype(np.float64)) is None


@pytest.mark.parametrize("case", ["huge B", "tiny A rows", "huge A", "B not contiguous", "gemm", "vector", "batched"])
def test_magnitudes_read_with_the_operands_give_the_same_result(monkeypatch, case) -> None:
    # A float32 matmul's operands are read with their magnitudes (ops/matmul.py's _read), which
    # engine.products' float32 bound on |A| |B| multiplies: where a magnitude lies outside
    # [2**-60, 2**60] (a block of A's rows, or B), the bound is made in float64, as without them.
    rng = np.random.default_rng(13)
    A = (rng.standard_normal((96, 64)) * 2.0 ** rng.integers(-20, 20, (96, 64))).astype(np.float32)
    B = (rng.standard_normal((64, 80)) * 2.0 ** rng.integers(-20, 20, (64, 80))).astype(np.float32)
    C = rng.standard_normal((96, 80)).astype(np.float32)
    if case == "huge B":
        B[3, 7] = 2.0 ** 100  # (past 2**60: the bound on |A| |B| is made in float64)
    elif case == "tiny A rows":
        A[5, :3] = 2.0 ** -100
    elif case == "huge A":
        A[90, 1] = 2.0 ** 100
    elif case == "B not contiguous":
        B = np.asfortranarray(B)
    elif case == "vector":
        B = B[:, 0].copy()
        A = np.concatenate([A] * 50)
    elif case == "batched":
        A = np.stack([A, -A, A * 2])
    read = _fused.read_float32
    calls = []
    monkeypatch.setattr(_fused, "read_float32", lambda x: calls.append(x.shape) or read(x))

    def run() -> list[np.ndarray]:
        res = er.gemm(A, B, C, alpha=3.0, beta=0.5) if case == "gemm" else er.matmul(A, B)
        return _fields(res) + [np.float64(res.exact((1,) * res.rounded.ndim))]
    with_magnitudes = run()
    # (B of 64 values is too small for the loop, and a Fortran-ordered one is not contiguous.)
    assert calls and (read(A) is not None) and (read(B) is None) is (case in ("B not contiguous", "vector"))
    monkeypatch.setattr(_fused, "read_float32", lambda x: None)
    without = run()
    for g, w in zip(with_magnitudes, without):
        assert _same(g, w)


def test_a_result_keeps_no_magnitudes_of_its_operands(monkeypatch) -> None:
    # The magnitudes serve the bound on |A| |B| while the op solves; the result keeps A and B's
    # values (for exact values on demand) but not them.
    made: list[weakref.ref] = []
    read = _fused.read_float32

    def reading(x: np.ndarray) -> tuple | None:
        got = read(x)
        if got is not None:
            made.append(weakref.ref(got[2]))
        return got
    monkeypatch.setattr(_fused, "read_float32", reading)
    rng = np.random.default_rng(3)
    A, B = (rng.standard_normal((256, 256)).astype(np.float32) for _ in range(2))
    res = er.matmul(A, B)
    gc.collect()
    assert len(made) == 2 and all(ref() is None for ref in made)
    assert res.exact((0, 0)) is not None


def test_a_small_block_never_asks_for_numba_but_a_small_products_judgement_does(monkeypatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(_fused, "available", lambda: asked.append(1) or False)
    small = np.ones(_fused.MIN_SIZE - 1)
    assert _fused.decide_float64(small, small, small) is None
    assert _fused.decide_narrow(small, small, F32) is None
    assert _fused.scaled_bound(small, 1.0, 0.0, 1.0, 1.0) is None
    assert not asked
    # A small output of one narrow product is judged by one call of a loop (ops._common's
    # _judged_at_once), which asks; without numba, the numpy steps judge it.
    res = er.matmul(er.asarray(np.ones((8, 8)), "float32"), er.asarray(np.ones((8, 8)), "float32"))
    assert (res.rounded == 8).all() and asked


def test_without_numba_the_numpy_code_runs(monkeypatch) -> None:
    monkeypatch.setattr(_fused, "available", lambda: False)
    big = np.ones(N)
    assert _fused.decide_float64(big, big, big) is None
    assert not _fused.judge_into(F32, big, big, big, big, None, {}, slice(None))
    rng = np.random.default_rng(1)
    A, B = (er.asarray(rng.standard_normal((300, 300)), "float32") for _ in range(2))
    assert er.matmul(A, B).covers((A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32)).all()


_EVERY_LOOP = """
import ml_dtypes
import numpy as np
import exactref as er
rng = np.random.default_rng(0)
for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
    A, B = (rng.standard_normal((256, 256)).astype(dtype) for _ in range(2))
    res = er.matmul(A, B)
    res.rounded
    res.backward(np.ones((256, 256), dtype))
er.sum(rng.standard_normal(10 ** 6).astype(np.float32))
# The exact path's compiled first try (exactref/_fused_refine.py), on rows of pieces.
from exactref.engine import decision
from exactref.formats import FORMATS
for name in ("float64", "float32", "bfloat16"):
    decision.refine(rng.standard_normal((8, 1024)), FORMATS[name])
# Attention's first pass and backward tolerance (exactref/ops/attention/_loops.py), half and not.
for dtype in (np.float32, np.float16):
    q, k, v, g = (rng.standard_normal((1, 1, 128, 32)).astype(dtype) for _ in range(4))
    er.scaled_dot_product_attention(q, k, v).backward(g)
# The longdouble pass's row sums (exactref/ops/attention/_rowsums.py).
from exactref.ops.attention import _rowsums, _second
z = np.zeros((4, 40))
assert _rowsums.row_sums((z, z, z), (z, z, z), np.ones((4, 40), bool), np.zeros(4), (0.125, 0.0, 0.0, 0.125),
                         _second.U2, (_second._N / np.log(2), _second._C_HI, _second._C_LO), _second._Q_COEF) is not None
"""


def test_a_later_process_loads_every_loop_from_numbas_disk_cache(tmp_path) -> None:
    # A loop whose closure held another compiled function missed numba's disk cache in every
    # process: it was compiled again (about 1.7 s for the sum's) and one more entry was written.
    # The ops here run every loop; a second process must find them all and write nothing.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run() -> list[str]:
        subprocess.run([sys.executable, "-c", _EVERY_LOOP], env=env, check=True, timeout=600)
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    first = run()
    names = {p.rsplit("-", 1)[0] for p in first if p.endswith(".nbi")}
    assert len(names) >= 10, names  # (the loops ran, and were cached)
    for loop in ("_logits_loop.locals.loop", "_weights_loop.locals.loop", "_ds_loop.locals.loop", "_rho_loop.locals.loop",
                 "_rowsums._loop.locals.rows", "_fused_slices._loop.locals.loop",
                 "_factors._loop.locals.loop", "_dot2_loop.locals.loop", "_cap_loop.locals.loop",
                 "_sums_loop.locals.loop"):
        assert any(n.endswith(loop) for n in names), (loop, names)
    assert run() == first
