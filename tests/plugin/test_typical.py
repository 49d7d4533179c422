"""The audit's err/typical ratio: how far a kernel is from one emulated kernel of its declared order."""

from __future__ import annotations

import numpy as np
from hypothesis import settings

import exactref as er
from exactref.harness.audit_report import table
from exactref.harness.judge import judge
from exactref.harness.kernels import Kernel
from exactref.harness.suite import Cell, run_cell

PAIRWISE = er.models.DEFAULT.replace(order="pairwise")


def numpy_sum(x, *, axis=None, keepdims=False):
    return np.sum(x, axis=axis, keepdims=keepdims)


def sum_kernel(forward, model=PAIRWISE) -> Kernel:
    return Kernel("sum", forward, None, ("float32",), "numpy", "test:sum", {"forward": model})


def test_numpys_sum_is_its_own_typical_kernel():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    verdict = judge(sum_kernel(numpy_sum), "forward", {"x": x}, {}, None)
    # The emulated pairwise kernel is numpy's own sum, so the ratio is 1 (or 0 where both are exact).
    assert verdict.typical["output"] in (0.0, 1.0)


def test_a_sloppier_kernel_is_many_typical_errors_away():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)

    def sequential_sum(x, *, axis=None, keepdims=False):
        return np.cumsum(x)[-1]

    verdict = judge(sum_kernel(sequential_sum, er.models.DEFAULT.replace(order="sequential")), "forward",
                    {"x": x}, {}, None)
    assert verdict.typical["output"] in (0.0, 1.0)
    blocked = judge(sum_kernel(sequential_sum, er.models.DEFAULT.replace(order=er.models.Blocked(64))),
                    "forward", {"x": x}, {}, None)
    assert blocked.typical["output"] > 1


def test_no_declared_order_no_typical_ratio():
    x = np.ones(10, np.float32)
    assert judge(sum_kernel(numpy_sum, er.models.DEFAULT), "forward", {"x": x}, {}, None).typical == {}


def test_the_table_shows_the_column_only_when_a_cell_has_it():
    base = settings(max_examples=5, database=None, deadline=None)
    declared = run_cell(Cell(sum_kernel(numpy_sum), "float32", "forward"), base=base, seed_value=0)
    default = run_cell(Cell(sum_kernel(numpy_sum, er.models.DEFAULT), "float32", "forward"), base=base,
                       seed_value=0)
    assert declared.typical and not default.typical
    assert "err/typical" in table([declared, default]).splitlines()[0]
    assert "err/typical" not in table([default]).splitlines()[0]
    rows = table([declared, default]).splitlines()
    assert all(len(r.split()) == len(rows[2].split()) for r in rows[2:])
