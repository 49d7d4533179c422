"""ops/_common.py's one_part: a long full float32 sum's one value decided, given its tolerance and
judged on Python floats (ops/reduction.py).

Each sum below is made twice, with one_part and with it declining every call (build's numpy steps
then make the Part): every field of the Part, the Result's rounded value, tolerance, exact value
and gradient are the same, bit for bit.  one_part takes the sums that engine.decision.decide_one
and result.judge_one cover and declines the rest, as listed; and the rounded value is the exact
sum's, by integers (every float32 is a multiple of 2**-149) rounded by tests/exactref/oracle.py.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import exactref as er
from exactref.ops import reduction

from .oracle import bits_equal, round_fraction

pytest.importorskip("numba", reason="numba (exactref[fast]) is not installed: no enclosure comes with the copy")

_FIELDS = ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance")
_N = 1 << 16  # the least full sum whose enclosure comes with the op's copy (reduction._FUSED_SIZE)


def _cancelling(tail: list[float], n: int = _N, seed: int = 0) -> np.ndarray:
    """n float32 values: standard normal ones and their negatives, then ``tail``, shuffled: the
    exact sum is that of the tail."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n - len(tail)) // 2).astype(np.float32)
    x = np.concatenate([a, -a, np.zeros(n - len(tail) - 2 * a.size, np.float32), np.array(tail, np.float32)])
    rng.shuffle(x)
    return x


def _on_zeros(tail: list[float], n: int = _N) -> np.ndarray:
    """``tail`` among n - len(tail) zeros: the sum of |x| is the tail's, and so the radius is small."""
    x = np.zeros(n, np.float32)
    x[-len(tail):] = tail
    return x


_LARGE = np.nextafter(np.float32(np.finfo(np.float32).max / _N), np.float32(0))


def _cancelling_large() -> np.ndarray:
    """Pairs +-_LARGE and 2**110: S near float32's largest value (so the tolerance says an overflow
    is possible), but the sum 2**110, decided, and its interval's ends well inside the range."""
    x = np.zeros(_N, np.float32)
    x[0:_N - 2:2], x[1:_N - 2:2], x[-1] = _LARGE, -_LARGE, 2.0 ** 110
    return x


# (name, x, kwargs, whether one_part takes it)
CASES = [
    ("normal", np.random.default_rng(1).standard_normal(_N, dtype=np.float32), {}, True),
    ("a million", np.random.default_rng(2).standard_normal(10 ** 6, dtype=np.float32), {}, True),
    ("blocks", np.random.default_rng(3).standard_normal(reduction._FUSED_SIZE * 70 + 3, dtype=np.float32),
     {}, True),  # past one compiled call: long_sums' blocks, whose lo need not be zero
    ("past a tie", _on_zeros([1.0, 2.0 ** -24, 2.0 ** -40]), {}, True),
    ("within the radius", _cancelling([1.0, 2.0 ** -24, 2.0 ** -40]), {}, False),  # (S about 5e4)
    ("negative", _cancelling([-1000.5]), {}, True),
    ("a tie", _cancelling([1.0, 2.0 ** -24]), {}, False),  # the exact path's
    ("within the slack of a tie", _on_zeros([1.0, 2.0 ** -24, 2.0 ** -60]), {}, False),
    ("zero", _cancelling([]), {}, False),  # its sign is the exact path's
    ("overflow possible", np.full(_N, _LARGE, np.float32), {}, False),  # a float32, but S near the largest
    ("overflow possible, cancelling", _cancelling_large(), {}, False),  # judge_one alone would take it
    ("overflows", np.full(_N, np.float32(2.0 ** 120)), {}, False),
    ("axis=()", np.random.default_rng(4).standard_normal((256, 256), dtype=np.float32), {"axis": ()}, True),
    ("keepdims", np.random.default_rng(5).standard_normal((256, 256), dtype=np.float32), {"keepdims": True},
     True),
    ("axis=0 of one axis", np.random.default_rng(6).standard_normal(_N, dtype=np.float32), {"axis": 0}, True),
]


def _declining(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduction, "one_part", lambda *args: None)


@pytest.mark.parametrize(("name", "x", "kwargs", "takes"), CASES, ids=[c[0] for c in CASES])
def test_one_part_gives_builds_values_where_it_takes_the_sum(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             x: np.ndarray, kwargs: dict, takes: bool) -> None:
    real = reduction.one_part
    made: list[object] = []
    monkeypatch.setattr(reduction, "one_part", lambda *a: made.append(real(*a)) or made[-1])
    fast = er.sum(x, **kwargs)
    assert [p is not None for p in made] == [takes]
    if takes:  # the Result holds the Part one_part made
        assert fast._parts[0] is made[0]
    _declining(monkeypatch)
    slow = er.sum(x, **kwargs)
    for name_ in _FIELDS:
        a, b = getattr(fast._parts[0], name_), getattr(slow._parts[0], name_)
        assert a.shape == b.shape == slow.shape and a.dtype == b.dtype, name_
        assert bits_equal(a, b), (name_, a, b)
    assert fast.rounded.dtype == slow.rounded.dtype == np.float32
    assert bits_equal(fast.rounded, slow.rounded) and bits_equal(fast.tolerance, slow.tolerance)
    # The exact sum, by integers, is the rounded value's, and lies within the bounds.
    exact = Fraction(sum(int(v) for v in (x.astype(np.float64) * 2.0 ** 149).ravel().tolist()), 2 ** 149)
    part = fast._parts[0]
    assert float(fast.rounded.reshape(())) == round_fraction(exact, "float32")
    assert Fraction(float(part.x_lo.reshape(()))) <= exact <= Fraction(float(part.x_hi.reshape(())))
    index = (0,) * fast.rounded.ndim
    assert fast.exact(index) == slow.exact(index) == exact


def test_one_parts_result_has_the_ops_gradient_and_keeps_its_own_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(7).standard_normal(_N, dtype=np.float32)
    fast = er.sum(x)
    _declining(monkeypatch)
    slow = er.sum(x)
    grad = np.float32(0.75)
    g_fast, g_slow = fast.backward(grad)["grad_x"], slow.backward(grad)["grad_x"]
    assert bits_equal(g_fast.rounded, g_slow.rounded) and bits_equal(g_fast.tolerance, g_slow.tolerance)
    assert np.all(g_fast.rounded == np.float32(0.75))
    exact = fast.exact(())
    x[:] = 1  # the Result reads its own copy of x
    assert fast.exact(()) == exact and fast.covers(fast.rounded)
    assert not fast.covers(fast.rounded + fast.tolerance * 4)


def test_a_sum_with_nan_or_inf_never_reaches_one_part(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(reduction, "one_part", lambda *a: calls.append(1))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(_N, np.float32)
        x[5] = bad
        res = er.sum(x)
        assert bits_equal(res.rounded, np.float32(bad))
    assert not calls
