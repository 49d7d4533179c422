"""The cached strategies of strategies._draws keep the types of their bounds and options."""

from strategies._draws import choice, coin, ints

from ._collect import each


def test_equal_options_of_other_types_get_their_own_strategy():
    # (1, -1) == (1.0, -1.0) and hash alike: a cache keyed on the tuple alone handed hard.py's
    # integer signs a strategy of float signs built earlier by another module.
    floats, integers = choice((1.0, -1.0)), choice((1, -1))
    assert floats is not integers and choice((1, -1)) is integers
    types = set()
    each(integers, 20, lambda v: types.add(type(v)))
    assert types == {int}
    types.clear()
    each(floats, 20, lambda v: types.add(type(v)))
    assert types == {float}
    assert choice((True, False)) is not choice((1, 0))
    assert coin() is coin()


def test_ints_are_built_once_per_bounds():
    assert ints(0, 3) is ints(0, 3)
    assert ints(0, 3) is not ints(0, 4)
