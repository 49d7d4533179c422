"""Every hard-case class appears for every format within a bounded number of draws,
and each claimed one holds, checked with exact arithmetic."""

import pytest

import strategies as sx
from exactref.formats import FORMATS
from strategies._validation import OP_FORMATS

from ._collect import each
from ._exact import hard_kinds_hold

RATIONAL = {
    "add": sx.add_inputs,
    "multiply": sx.multiply_inputs,
    "sum": sx.sum_inputs,
    "matmul": sx.matmul_inputs,
    "gemm": sx.gemm_inputs,
}
# The bound on draws; most formats see every class in a few dozen.
DRAWS = 300


def expected_classes(op, fmt):
    # A real product is one term: it can be a tie or a near tie, but cannot cancel.
    if op == "multiply" and not fmt.is_complex:
        return {"tie", "near_tie"}
    return set(sx.HARD_CLASSES)


@pytest.mark.parametrize("fmt", [FORMATS[n] for n in OP_FORMATS], ids=str)
@pytest.mark.parametrize("op", list(RATIONAL))
def test_every_hard_class_appears_and_holds_exactly(op, fmt):
    seen = set()
    want = expected_classes(op, fmt)

    def check(case):
        for hard, held in hard_kinds_hold(case):
            claimed = set(hard.kinds)
            assert claimed <= held, f"{op} {fmt}: {hard} claims {claimed} but the exact result is {held}"
            seen.update(claimed)
        return seen == want

    each(RATIONAL[op](dtypes=[fmt.name]), DRAWS, check)
    assert seen == want, f"{op} {fmt}: only {sorted(seen)} appeared in {DRAWS} draws"


@pytest.mark.parametrize("op", list(RATIONAL))
def test_claims_hold_with_larger_shapes_and_every_format(op):
    def check(case):
        for hard, held in hard_kinds_hold(case):
            assert set(hard.kinds) <= held, f"{hard} does not hold: {held}"
    each(RATIONAL[op](max_side=6), 40, check)


@pytest.mark.parametrize("op", list(RATIONAL))
def test_hard_off_places_nothing(op):
    def check(case):
        assert case.hard == ()
    each(RATIONAL[op](hard=False), 30, check)


def test_only_the_asked_for_class_is_placed():
    kinds = set()
    each(sx.matmul_inputs(hard=["near_tie"]), 60, lambda c: kinds.update(k for h in c.hard for k in h.kinds))
    assert kinds == {"near_tie"}
