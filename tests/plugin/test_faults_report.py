"""Fault injection for the audit's report: its plots count what the table counts, and say what they show."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from exactref.harness.audit_report import PLOT_NOTE, bin_counts, counted_ratios, write_report
from exactref.harness.suite import CellRun

pytest.importorskip("matplotlib")


def _run(fmt="float32", direction="forward", examples=0, ratios=(), failures=()):
    cell = SimpleNamespace(op="matmul", fmt=fmt, direction=direction, known_failure=None,
                           name=f"matmul[{fmt}-{direction}]")
    return CellRun(cell, examples=examples, ratios=list(ratios), failures=list(failures), seconds=1.0)


def _failure(worst):
    exc = ValueError("mismatch")
    exc.verdict = SimpleNamespace(worst=worst)
    return exc


def test_a_failing_cell_plots_the_examples_the_table_counts_not_every_shrinking_call():
    # 2 examples passed, then a failure, then 960 calls while shrinking: the table says 2.
    run = _run(examples=2, ratios=[0.5, 0.25, 300.0] + [7.0] * 960, failures=[_failure(255.0)])
    passed, failed = counted_ratios(run)
    assert passed == [0.5, 0.25]
    assert failed == [255.0]


def test_a_kernel_that_raised_has_no_ratio_to_plot():
    assert counted_ratios(_run(examples=3, ratios=[1.0, 1.0, 1.0], failures=[ValueError("raised")])) == (
        [1.0, 1.0, 1.0], [])


def test_a_ratio_of_exactly_one_counts_left_of_the_tolerance_line():
    edges = np.linspace(-8.0, 1.25, 38)  # 0 is an edge: log10(1) falls on it
    assert 0.0 in edges
    counts = bin_counts([1.0, 1.0 + 2.0 ** -40, 0.0, 1e-30], edges)
    line = int(np.flatnonzero(edges == 0.0)[0])
    assert counts[line - 1] == 1  # exactly 1: the bin that ends at the line
    assert counts[line] == 1      # just over 1: the bin that starts there
    assert counts[0] == 2         # exact, and below the floor
    assert counts.sum() == 4


def test_infinite_ratios_are_left_out_of_the_bins():
    assert bin_counts([math.inf, 0.5], np.linspace(-8.0, 1.0, 10)).sum() == 1


@pytest.mark.parametrize("suffix", [".md", ".html"])
def test_a_report_with_a_cell_of_no_examples_writes_without_warnings(tmp_path, suffix):
    runs = [_run(examples=0), _run(direction="backward", examples=2, ratios=[1.0, 0.5])]
    path = tmp_path / f"report{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(path, runs, kernel_name="k", seed=1, elapsed=1.0)
    text = path.read_text()
    assert (PLOT_NOTE if suffix == ".md" else PLOT_NOTE.replace("'", "&#x27;")) in text


def test_a_report_of_only_empty_cells_says_no_examples_ran(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(tmp_path / "r.md", [_run(examples=0)], kernel_name="k", seed=1, elapsed=0.0)
    assert (tmp_path / "r_plots" / "matmul.png").stat().st_size > 0
