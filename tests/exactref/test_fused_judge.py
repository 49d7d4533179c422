"""exactref/_fused_judge.py: the one-pass decision and judgement of a narrow product's block, against
the numpy code it stands for (engine.decision's decisions, models._bounds' tolerance, result.judge),
bit for bit; then whole ops, with the pass and without it."""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er
from exactref import _fused_judge
from exactref.engine import decision, fast, products
from exactref.formats import FORMATS
from exactref.models import _bounds
from exactref.ops._common import _PART_DTYPES, _slackened
from exactref.result import judge

from .test_fused import _same, _values

F32, F64, F16, BF16 = FORMATS["float32"], FORMATS["float64"], FORMATS["float16"], FORMATS["bfloat16"]
E5M2 = FORMATS["float8_e5m2"]
NARROW = [F32, F16, BF16, E5M2]
IDS = ["float32", "float16", "bfloat16", "e5m2"]
SHAPE = (7, 1301)  # above the loops' threshold, rows of an odd length

numba = pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: the loops are not used")


def _products(rng: np.random.Generator, fmt) -> products.NarrowProduct:
    """A narrow product's BLAS products of SHAPE where the decisions and judgements part ways: hi of
    every kind of test_fused's _values, and float32 products P of |A| and |B| from far below |hi|
    to far above it (radii from 0 to wider than hi), zero, overflowing, or near float32's largest."""
    n = SHAPE[0] * SHAPE[1]
    hi = _values(rng, n, fmt)
    with np.errstate(all="ignore"):
        P = (np.abs(hi) * 2.0 ** rng.integers(-40, 50, n)).astype(np.float32)
    odd = rng.random(n) < 0.05
    P[odd] = rng.choice(np.array([0.0, np.inf, 3.4e38], dtype=np.float32), int(odd.sum()))
    # K = 1024: the widening's scale and addend, and the radius's factor gamma_1023.
    widening = products.Right(np.ones((1024, 1)), narrow=True)._widening()
    return products.NarrowProduct(hi.reshape(SHAPE), P.reshape(SHAPE), fast.gamma(1023, fast.U64), widening)


def _bound(fmt, underflow: bool = True) -> tuple[float, float, float, float]:
    """The constants of a 1024-term dot product's tolerance accumulated in float32 and rounded to fmt."""
    return _bounds.scaled_bound_constants(depth=1023, acc=F32, out=fmt, terms=1024, underflow=underflow,
                                          overflow_depth=1023)


def _judged(fmt, rounded, x_lo, x_hi, S, underflow: bool = True):
    """result.judge of these values with the numpy code's tolerance and overflow marks from S."""
    E = _bounds.dot_error(S, depth=1023, acc=F32, out=fmt, terms=1024, underflow=underflow)
    return judge(rounded, x_lo, x_hi, _slackened(E), fmt, overflow=_bounds.overflow_possible(S, F32, 1023))


def _want(fmt, product, underflow: bool = True):
    """The numpy code's S, its decisions, and its judgement of every element from them."""
    with np.errstate(all="ignore"):
        S = products._widened(product.P, *product.widening)
        x_lo, x_hi = decision.bounds_lo_zero(product.hi, fast.up(product.g * S))
        rounded, decided = decision.decide_narrow(x_lo, x_hi, fmt)
        return S, decided, _judged(fmt, rounded, x_lo, x_hi, S, underflow)


def _fields() -> dict[str, np.ndarray]:
    """The Part's arrays, each of SHAPE with two rows more above it and below it, full of 7."""
    return {name: np.full((SHAPE[0] + 4,) + SHAPE[1:], 7, dtype=dtype) for name, dtype in _PART_DTYPES.items()}


@pytest.mark.parametrize("fmt", NARROW, ids=IDS)
@pytest.mark.parametrize("underflow", [True, False])
def test_decide_and_judge_makes_the_numpy_codes_decisions_and_judgements(fmt, underflow) -> None:
    rng = np.random.default_rng(3)
    product = _products(rng, fmt)
    want_S, want_decided, want = _want(fmt, product, underflow)
    whole = _fields()
    before = {name: a.copy() for name, a in whole.items()}
    with np.errstate(all="ignore"):
        # (The block's views of the Part's arrays: rows 2 to 8.)
        made = _fused_judge.decide_and_judge(fmt, product, _bound(fmt, underflow), {n: a[2:9] for n, a in whole.items()})
    assert made is not None
    decided, judged, S = made
    assert _same(S, want_S) and _same(decided, want_decided)
    # Every element's decision; the judgement of those it says it judged.
    for name in ("rounded", "x_lo", "x_hi"):
        assert _same(whole[name][2:9], getattr(want, name)), name
    for name in _PART_DTYPES:
        assert _same(whole[name][2:9][judged], getattr(want, name)[judged]), name
        outside = np.r_[0:2, 9:11]
        assert _same(whole[name][outside], before[name][outside]), name  # only its block is written
    # Judged: the decided elements, less those whose bits the narrower formats' loop leaves.
    assert not (judged & ~decided).any()
    assert judged.any() and (~decided).any() and want.special_ok.any()
    if fmt is F32:
        assert _same(judged, decided) and want.special_ok[judged].any()
    else:
        assert (decided & ~judged).any()  # some left to the numpy code, though decided


@pytest.mark.parametrize("fmt", NARROW, ids=IDS)
@pytest.mark.parametrize("underflow", [True, False])
def test_judge_again_judges_the_given_elements_as_they_are_now(fmt, underflow) -> None:
    rng = np.random.default_rng(5)
    fields = {name: a[2:9] for name, a in _fields().items()}
    with np.errstate(all="ignore"):
        decided, judged, S = _fused_judge.decide_and_judge(fmt, _products(rng, fmt), _bound(fmt, underflow), fields)
    # The exact path's values written over the elements it rounds, as ops._common's blocks do.
    idx = np.flatnonzero(~judged)
    exact = _values(rng, idx.size, fmt)
    flat = {name: a.reshape(-1) for name, a in fields.items()}
    S = S.reshape(-1)
    with np.errstate(all="ignore"):
        flat["rounded"][idx] = decision.decide_narrow(exact, exact, fmt)[0]
        flat["x_lo"][idx], flat["x_hi"][idx] = np.nextafter(exact, -np.inf), np.nextafter(exact, np.inf)
    # And bounds S where the one-pass's own values seldom fall: S factor exactly the overflow
    # marks' limit, and 0 (a tolerance of up(add) alone: 2**-1070 where add is 0, which moves the
    # lower end of (2**-1070, 2**-1069) below zero).
    factor, limit = _bound(fmt)[2:]
    at, zero = idx[0::7], idx[1::7]
    S[at] = np.nextafter(limit / factor, np.inf) + rng.integers(-3, 4, at.size) * np.spacing(limit / factor)
    S[zero] = 0.0
    flat["rounded"][zero], flat["x_lo"][zero], flat["x_hi"][zero] = 0.0, 2.0 ** -1070, 2.0 ** -1069
    with np.errstate(over="ignore"):
        assert (S[at] * factor == limit).any()
    with np.errstate(all="ignore"):
        left = _fused_judge.judge_again(fmt, idx, S.reshape(SHAPE), _bound(fmt, underflow), fields)
        want = _judged(fmt, flat["rounded"][idx], flat["x_lo"][idx], flat["x_hi"][idx], S[idx], underflow)
    done = ~np.isin(idx, left)
    # (float16's and e5m2's ends of values so large lie past their range: the numpy code's.)
    assert done.any() and (done[0::7].any() or fmt in (F16, E5M2))
    for name in _PART_DTYPES:
        assert _same(flat[name][idx[done]], getattr(want, name)[done]), name
    if fmt is F32:
        assert not left.size  # (the narrower formats' tiny ends go to the numpy code)


def test_decide_and_judge_declines_what_its_loops_do_not_take() -> None:
    rng = np.random.default_rng(7)
    product = _products(rng, F32)
    fields = {name: a[2:9] for name, a in _fields().items()}
    before = {name: a.copy() for name, a in fields.items()}
    bound = _bound(F32)
    assert _fused_judge.decide_and_judge(F64, product, bound, fields) is None  # not a narrow format
    small = (slice(0, 1), slice(0, 100))
    assert _fused_judge.decide_and_judge(F32, products.NarrowProduct(product.hi[small], product.P[small], product.g,
                                                                     product.widening), bound,
                                         {n: a[small] for n, a in fields.items()}) is None
    strided = {n: a[:, ::-1] for n, a in fields.items()}
    assert _fused_judge.decide_and_judge(F32, product, bound, strided) is None
    float64 = products.NarrowProduct(product.hi, product.P.astype(np.float64), product.g, product.widening)
    assert _fused_judge.decide_and_judge(F32, float64, bound, fields) is None  # (a bound S itself)
    # Nothing was written.
    assert all(_same(a, before[name]) for name, a in fields.items())


def _matmul_fields(monkeypatch, A, B, *, fused: bool, **kwargs) -> tuple[list[dict[str, np.ndarray]], list]:
    calls: list = []
    real = _fused_judge.decide_and_judge

    def spy(*args):
        made = real(*args) if fused else None
        calls.append(made)
        return made
    monkeypatch.setattr(_fused_judge, "decide_and_judge", spy)
    res = er.matmul(A, B, **kwargs)
    monkeypatch.setattr(_fused_judge, "decide_and_judge", real)
    return [{name: getattr(p, name) for name in _PART_DTYPES} for p in res._parts], calls


# (dtype, how A and B are drawn, their scale): standard normal values leave some elements of each
# float32 or float16 block undecided, and small integers some of bfloat16's, at its ties (their
# exact path, and their judgement after it); small values put float16's ends among its
# subnormals, large ones its ends past its range (the numpy code's); "big" rows and columns of
# 2**60, the largest magnitudes the float32 bound takes, overflow the sums of |terms| of theirs.
_CASES = [("float32", "normal", 1.0), ("float32", "big", 1.0), ("float16", "normal", 1.0),
          ("float16", "normal", 2.0 ** -5), ("float16", "normal", 2.0 ** 7), ("bfloat16", "integers", 1.0),
          ("bfloat16", "big", 1.0)]


@pytest.mark.parametrize("dtype, values, scale", _CASES, ids=[f"{d}-{v}-{s:g}" for d, v, s in _CASES])
def test_a_matmul_is_the_same_with_the_one_pass_and_without_it(monkeypatch, dtype, values, scale) -> None:
    rng = np.random.default_rng(9)

    def draw(shape):
        v = rng.integers(-8, 9, shape).astype(float) if values == "integers" else rng.standard_normal(shape)
        return er.asarray(v * scale, dtype)
    # (An output above ops._common._JUDGE_BLOCK elements, to be judged block by block: two blocks.)
    A, B = draw((520, 512)), draw((512, 300))
    if values == "big":
        A[:3], B[:, :3] = 2.0 ** 60, 2.0 ** 60
    with np.errstate(all="ignore"):
        got, calls = _matmul_fields(monkeypatch, A, B, fused=True)
        want, _ = _matmul_fields(monkeypatch, A, B, fused=False)
    made = [c for c in calls if c is not None]
    assert len(made) == 2  # both blocks took the pass
    assert any((~judged).any() for _, judged, _ in made)  # and some elements were judged again
    assert values != "big" or got[0]["special_ok"].any()  # (marked: their partial sums may overflow)
    for g, w in zip(got, want):
        for name in _PART_DTYPES:
            assert _same(g[name], w[name]), name


_NOT_ALONE = {  # float16 tolerances with more than that bound, whose constants must not stand for them
    "coefficient": {"coef": 2.0 ** -20},
    "relative": {"relative": 2.0 ** -30},
    "absolute": {"absolute": 2.0 ** -140},
    "overflow marks": {"overflow": np.ones(SHAPE, dtype=bool)},
    "stored": {"stored": True},
    "rounded copies": {"per_copy_rounding": True, "copies": 4},
}


def _tolerance_of(fmt, model=er.models.DEFAULT, **kwargs):
    import importlib

    matmul = importlib.import_module("exactref.ops.matmul")
    return matmul._tolerance(fmt, fmt, 1024, model, **kwargs)


@pytest.mark.parametrize("fmt", [F32, F16, BF16, F64], ids=["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("extra", [0, 2])
def test_the_tolerances_constants_are_what_it_computes(fmt, extra) -> None:
    # ops/matmul.py gives its tolerance constants only where the tolerance is up(g S + add) with the
    # marks S factor >= limit alone: the one pass computes those in its place.
    from exactref.engine.fast import up
    from exactref.engine.sumprod import Solution

    tol = _tolerance_of(fmt, extra_depth=extra)
    assert tol.scaled_bound is not None
    g, add, factor, limit = tol.scaled_bound
    rng = np.random.default_rng(12)
    S = np.abs(_values(rng, SHAPE[0] * SHAPE[1], F32)).reshape(SHAPE)
    S[np.isnan(S)] = 0.0
    zeros = np.zeros(SHAPE)
    with np.errstate(all="ignore"):
        E, overflow = tol(Solution(zeros, zeros, zeros, S, 0))
        assert _same(E, up(g * S + add)) and _same(overflow, S * factor >= limit)
    assert overflow.any() and not overflow.all()


@pytest.mark.parametrize("kwargs", list(_NOT_ALONE.values()), ids=list(_NOT_ALONE))
def test_a_tolerance_with_more_than_the_bound_gives_no_constants(kwargs) -> None:
    from exactref.engine.sumprod import Solution

    tol = _tolerance_of(F16, **kwargs)
    assert tol.scaled_bound is None
    # And rightly: its values differ from the bound's alone for some S.
    plain = _tolerance_of(F16)
    rng = np.random.default_rng(13)
    S = np.abs(rng.standard_normal(SHAPE)) * 2.0 ** rng.integers(-140, 128, SHAPE)
    zeros = np.zeros(SHAPE)
    with np.errstate(all="ignore"):
        got = tol(Solution(zeros, zeros, zeros, S, 0))
        alone = plain(Solution(zeros, zeros, zeros, S, 0))
    assert not (_same(got[0], alone[0]) and _same(got[1], alone[1]))


@pytest.mark.parametrize("model", ["TF32_MATMUL", "declared"])
def test_a_model_with_more_than_the_bound_gives_no_constants(model) -> None:
    if model == "TF32_MATMUL":
        ones = (np.ones((SHAPE[0], 1)), np.ones((1, SHAPE[1])))
        tol = _tolerance_of(F32, er.models.TF32_MATMUL, rows=ones)
    else:
        X = np.ones((SHAPE[0], 1024))
        tol = _tolerance_of(F32, er.models.DEFAULT.replace(order="sequential"), dot=(X, X.T[:, :SHAPE[1]]))
    assert tol.scaled_bound is None
