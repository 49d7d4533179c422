"""Fault injection: a kernel that hangs must cost one failure naming the call, never the run.

Each hanging kernel here waits on an Event that nobody sets: it never returns
and uses no CPU, and its daemon thread dies with the process.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from exactref.harness.config import DEFAULT_TIMEOUT, ConfigError, build
from exactref.harness.judge import judge
from exactref.harness.kernels import (
    KernelRaisedError,
    KernelTimeoutError,
    load_kernels,
    run_with_timeout,
)
from exactref.harness.suite import Cell, audit_settings, run_cell

from .conftest import Repo, kernel_module, output

_NEVER = threading.Event()


def _hang(*args, **kwargs):
    _NEVER.wait()


def _add(x, y, alpha=1):
    return (x.astype(np.float64) + alpha * np.asarray(y, np.float64)).astype(x.dtype)


@pytest.fixture
def module(monkeypatch):
    def make(kernels):
        return load_kernels(kernel_module(monkeypatch, "fake_hanging_kernels", EXACTREF_KERNELS=kernels).__name__)
    return make


# ---------------------------------------------------------------- the call


def test_a_call_within_the_limit_returns_its_value_and_raises_its_error():
    assert run_with_timeout(lambda: 42, 5.0) == 42

    def boom():
        raise ZeroDivisionError("inside")
    with pytest.raises(ZeroDivisionError, match="inside"):
        run_with_timeout(boom, 5.0)


def test_a_call_past_the_limit_raises_and_the_next_call_still_runs():
    start = time.perf_counter()
    with pytest.raises(KernelTimeoutError):
        run_with_timeout(_hang, 0.2)
    assert time.perf_counter() - start < 30
    # The hung call keeps its thread; the next call gets another.
    assert run_with_timeout(lambda: "next", 5.0) == "next"


def test_no_limit_runs_on_the_callers_thread():
    assert run_with_timeout(threading.current_thread, None) is threading.current_thread()
    assert run_with_timeout(threading.current_thread, 5.0) is not threading.current_thread()


def test_a_kernel_that_raises_on_the_worker_shows_its_own_frames_not_the_workers(module):
    def broken(x, y, alpha=1):
        raise ValueError("kernel bug")
    kernel = module({"add": {"forward": broken, "arrays": "numpy", "formats": ["float32"]}})["add"]
    x = np.ones(2, np.float32)
    with pytest.raises(KernelRaisedError) as info:
        judge(kernel, "forward", {"x": x, "y": x}, {"alpha": 1}, None, timeout=5.0)
    text = str(info.value)
    assert "in broken" in text and 'raise ValueError("kernel bug")' in text, text
    assert "_serve" not in text and "run_with_timeout" not in text, text


def test_a_hanging_kernel_is_a_timeout_failure_naming_the_call_and_its_inputs(module):
    kernel = module({"add": {"forward": _hang, "arrays": "numpy", "formats": ["float32"]}})["add"]
    x = np.array([1.5, -2.0], np.float32)
    with pytest.raises(KernelTimeoutError) as info:
        judge(kernel, "forward", {"x": x, "y": x}, {"alpha": 1}, None, timeout=0.2)
    text = str(info.value)
    assert type(info.value).__name__ == "KernelTimeoutError[add.forward]"
    assert "the add forward kernel (fake_hanging_kernels:add) did not return within 0.2 s" in text, text
    assert "--exactref-timeout N (pytest) or --timeout N (exactref audit); 0 means no limit" in text, text
    assert "Inputs, exactly:\n  x: float32 (2,) [0x1.8p+0, -0x1p+1]" in text, text


# ---------------------------------------------------------------- the search


def test_the_search_stops_at_the_first_hanging_call_without_shrinking(module):
    calls = []

    def sometimes_hangs(x, y, alpha=1):
        calls.append(1)
        if len(calls) >= 3:
            _NEVER.wait()
        return _add(x, y, alpha)
    kernel = module({"add": {"forward": sometimes_hangs, "arrays": "numpy", "formats": ["float32"]}})["add"]
    run = run_cell(Cell(kernel, "float32", "forward"), base=audit_settings(), examples=50, seed_value=1,
                   timeout=0.3)
    assert [type(e).__name__ for e in run.failures] == ["KernelTimeoutError[add.forward]"]
    assert run.examples == 2
    assert len(calls) == 3  # shrinking would call it again, and wait the timeout again each time
    assert "did not return within 0.3 s" in str(run.failures[0])


# ---------------------------------------------------------------- the configuration


@pytest.mark.parametrize(("value", "expected"), [(None, DEFAULT_TIMEOUT), (5, 5.0), ("2.5", 2.5), (0, None),
                                                 ("0", None)])
def test_the_timeout_is_read_from_the_table_or_the_option(tmp_path, value, expected):
    table = {} if value is None else {"timeout": value}
    assert build(tmp_path, table, {}).timeout == expected
    assert build(tmp_path, {}, {"timeout": value}).timeout == expected


@pytest.mark.parametrize("value", [-1, "soon", True, float("inf"), float("nan"), [60]])
def test_a_bad_timeout_names_the_key_and_the_value(tmp_path, value):
    with pytest.raises(ConfigError, match=r"timeout = .* must be a number of seconds, at least 0 \(0 means no "
                                          r"limit\), e\.g\. timeout = 60"):
        build(tmp_path, {"timeout": value}, {})


# ---------------------------------------------------------------- the plugin and the audit

HANGING_MODULE = '''
import threading

import numpy as np

def add(x, y, alpha=1):
    if x.size > 1:
        threading.Event().wait()
    return (x.astype(np.float64) + alpha * np.asarray(y, np.float64)).astype(x.dtype)

EXACTREF_KERNELS = {"add": {"forward": add, "arrays": "numpy", "formats": ["float32"]}}
'''


def test_pytest_with_a_hanging_kernel_fails_its_item_and_finishes(repo: Repo):
    (repo.root / "hanging_kernels.py").write_text(HANGING_MODULE)
    text = (repo.root / "pyproject.toml").read_text()
    (repo.root / "pyproject.toml").write_text(text.replace('[tool.exactref]\n', '[tool.exactref]\ntimeout = 0.5\n'))
    result = repo.run("--exactref", "--exactref-kernels", "hanging_kernels", "--exactref-examples", "30",
                      "-k", "exactref", timeout=300)
    text = output(result)
    assert result.returncode == 1, text
    assert "Failure: KernelTimeoutError in add.forward" in text, text
    assert "the add forward kernel (hanging_kernels:add) did not return within 0.5 s" in text, text
    assert "1 failed" in text, text


def test_the_audit_with_a_hanging_kernel_reports_it_and_exits(repo: Repo):
    (repo.root / "hanging_kernels.py").write_text(HANGING_MODULE)
    result = repo.audit("--kernels", "hanging_kernels", "--examples", "30", "--seed", "1", "--timeout", "0.5",
                        timeout=300)
    text = output(result)
    assert result.returncode == 1, text
    assert "Traceback" not in text, text
    row = next(line for line in result.stdout.splitlines() if line.startswith("add "))
    assert row.split()[4] == "1" and row.endswith("FAIL"), row
    assert "-- KernelTimeoutError in add.forward" in result.stdout, result.stdout


def test_a_bad_timeout_flag_is_one_line(repo: Repo):
    result = repo.audit("--timeout", "-3")
    assert result.returncode == 2, output(result)
    assert "timeout = '-3' (on the command line) must be a number of seconds" in result.stderr, output(result)
