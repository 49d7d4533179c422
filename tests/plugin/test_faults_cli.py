"""Fault injection for the ``exactref`` command: bad case files, unwritable outputs, Ctrl-C mid-audit.

Each fault must end in one clear line naming the problem (exit status 2), or, for an audit, in the
results found so far; never in a raw traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from .conftest import Repo, output
from .test_faults_cases import GARBAGE, ONE, suite_case


def _to_pytest(repo: Repo, *args: str) -> subprocess.CompletedProcess[str]:
    return repo.command(sys.executable, "-m", "exactref.cli", "to-pytest", *args)


def _one_clear_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, output(result)
    assert "Traceback" not in output(result), output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", output(result)
    return lines[0]


def test_to_pytest_of_a_non_utf8_case_is_one_line_naming_the_file(repo: Repo):
    (repo.root / "garbage.json").write_bytes(GARBAGE)
    line = _one_clear_line(_to_pytest(repo, "garbage.json"))
    assert line.startswith("exactref to-pytest: error: regression case garbage.json: is not UTF-8 text"), line


def test_to_pytest_of_a_case_missing_an_input_writes_no_test(repo: Repo):
    (repo.root / "partial.json").write_text(json.dumps(suite_case(inputs={"A": ONE})))
    line = _one_clear_line(_to_pytest(repo, "partial.json", "-o", "tests/test_partial.py"))
    assert "partial.json: is corrupt: case: matmul's input 'B' is missing (matmul takes A, B)" in line, line
    assert not (repo.root / "tests" / "test_partial.py").exists()


@pytest.mark.parametrize("target", ["/proc/x.py", "pyproject.toml/x.py", "tests"])
def test_to_pytest_checks_its_output_path_first(repo: Repo, target):
    (repo.root / "good.json").write_text(json.dumps(suite_case()))
    line = _one_clear_line(_to_pytest(repo, "good.json", "-o", target))
    assert line.startswith(f"exactref to-pytest: error: -o {target}: "), line
    assert "pass -o a file in a writable directory" in line, line


@pytest.mark.parametrize("target", ["/proc/x.md", "pyproject.toml/report.html"])
def test_audit_checks_its_report_path_before_any_work(repo: Repo, target):
    line = _one_clear_line(repo.audit("--ops", "matmul", "--dtypes", "float32", "--examples", "5",
                                      "--report", target))
    assert line.startswith(f"exactref audit: error: --report {target}: "), line


def test_audit_with_an_unwritable_regressions_directory_keeps_its_report(repo: Repo):
    repo.plant("unsummed_broadcast")
    result = repo.audit("--ops", "matmul", "--dtypes", "float32", "--examples", "50", "--seed", "1",
                        "--regressions", "pyproject.toml")
    text = output(result)
    assert result.returncode == 1, text
    assert "Traceback" not in text, text
    assert "Minimal counterexamples" in result.stdout and "FAILED: 1 cells with mismatches" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("could not save the case: ")]
    assert len(lines) == 1, result.stdout
    assert "pyproject.toml is a file, not a directory" in lines[0] and "--regressions DIR" in lines[0]


INTERRUPTIBLE = ("import signal, sys\n"
                 # A background job of a non-interactive shell starts with SIGINT ignored.
                 "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                 "from exactref.cli import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")


def test_ctrl_c_mid_audit_prints_what_was_found_and_exits_130(repo: Repo):
    # The float16 forward cell fails at once; the backward one would run 100000 examples.
    repo.plant("fp16_accumulation")
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE, "audit", "--ops", "matmul", "--dtypes",
                              "float16", "--examples", "100000", "--seed", "3"], cwd=repo.root, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(300, child.kill)
    guard.start()
    try:
        progress = []
        for line in child.stderr:
            progress.append(line)
            if "1/2 cells" in line:
                break
        assert "1/2 cells" in "".join(progress), "".join(progress)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        guard.cancel()
        if child.poll() is None:
            child.kill()
    text = out + err
    assert child.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "matmul  float16  forward" in out and "FAIL" in out, out
    rows = [line for line in out.splitlines() if line.startswith("matmul  float16  backward")]
    assert len(rows) == 1 and rows[0].endswith("interrupted"), out
    assert "== matmul[float16-forward]" in out and "Inputs, exactly:" in out, out
    assert "INTERRUPTED" in out and "1 of 2 cells finished" in out, out


# ---------------------------------------------------------------- 8: the configuration from a subdirectory


def _audit_in(repo: Repo, where, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    return subprocess.run([sys.executable, "-m", "exactref.cli", "audit", *args], cwd=where, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_audit_from_a_subdirectory_uses_the_repositorys_table_and_says_so(repo: Repo):
    inner = repo.root / "mykernels" / "sub"
    inner.mkdir()
    # A pyproject.toml without the table does not hide the repository's (as for pytest's own table).
    (inner / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    result = _audit_in(repo, inner, "--ops", "add", "--examples", "3", "--seed", "1")
    assert result.returncode == 0, output(result)
    first, second = result.stdout.splitlines()[:2]
    assert first.startswith("exactref audit: mykernels.exactref_kernels; 2 cells"), first
    assert second == f"config: [tool.exactref] in {repo.root / 'pyproject.toml'}", second


def test_the_audit_outside_any_configured_repository_says_there_is_no_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "exactref.cli", "audit", "--ops", "add", "--dtypes", "float32",
                             "--examples", "2", "--seed", "1"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, output(result)
    assert result.stdout.splitlines()[1] == f"config: no [tool.exactref] in a pyproject.toml in {tmp_path} or above"


# ---------------------------------------------------------------- 9: the audit's regression cases


BROADCAST_CASE = {"exactref_regression": 1, "kind": "suite", "test": "exactref::matmul[float32-backward]",
                  "kernel": "mykernels.exactref_kernels:matmul", "op": "matmul", "direction": "backward",
                  "format": "float32", "model": "default", "strategy": "s", "failure": "OutOfToleranceError: x",
                  "case": {"op": "matmul", "kwargs": {},
                           "inputs": {"A": {"dtype": "float32", "shape": [2, 1, 1], "values": [[["0x1p+0"]]] * 2},
                                      "B": {"dtype": "float32", "shape": [1, 1], "values": [["0x1p+0"]]}},
                           "grad": {"dtype": "float32", "shape": [2, 1, 1], "values": [[["0x1p+0"]]] * 2}}}


def test_the_audit_replays_the_configured_regression_cases_first(repo: Repo):
    repo.regressions.mkdir(parents=True)
    (repo.regressions / "broadcast.json").write_text(json.dumps(BROADCAST_CASE))
    repo.plant("unsummed_broadcast")
    # One example: the search alone draws no broadcast batch, so only the replay can fail.
    failing = repo.audit("--ops", "matmul", "--dtypes", "float32", "--examples", "1", "--seed", "1")
    out = failing.stdout
    assert failing.returncode == 1, output(failing)
    assert ("regression cases: 1 saved case of mykernels.exactref_kernels replayed from "
            f"{repo.regressions} (1 failed)") in out, out
    assert "Saved regression cases that still fail\n\n== broadcast.json: failed\n-- " in out, out
    assert "Replayed from the regression case tests/exactref_regressions/broadcast.json" in out, out
    assert out.rstrip().endswith("FAILED: 1 saved regression case still fails or cannot be replayed "
                                 "(listed above)."), out
    repo.plant()
    passing = repo.audit("--ops", "matmul", "--dtypes", "float32", "--examples", "1", "--seed", "1")
    assert passing.returncode == 0, output(passing)
    assert "replayed from" in passing.stdout and "(all pass)" in passing.stdout, passing.stdout
    # Another op's audit leaves the matmul case alone.
    other = repo.audit("--ops", "add", "--examples", "1", "--seed", "1")
    assert "regression cases: 0 saved cases" in other.stdout, other.stdout


def test_the_audit_saves_into_the_configured_regressions_directory(repo: Repo):
    repo.plant("fp16_accumulation")
    result = repo.audit("--ops", "matmul", "--dtypes", "float16", "--examples", "50", "--seed", "1")
    assert result.returncode == 1, output(result)
    saved = [line for line in result.stdout.splitlines() if line.startswith("saved ")]
    assert saved and all(line.startswith(f"saved {repo.regressions}/matmul-forward-float16-") for line in saved)
    assert list(repo.regressions.glob("matmul-forward-float16-*.json"))


def test_the_audit_of_other_kernels_leaves_the_configured_directory_alone(repo: Repo):
    result = repo.audit("--kernels", "exactref.backends.torch", "--ops", "add", "--dtypes", "float32",
                        "--examples", "2", "--seed", "1")
    assert result.returncode == 0, output(result)
    assert "regression cases: none replayed (no regressions directory" in result.stdout, result.stdout


# ---------------------------------------------------------------- 11: the meta device


def test_the_audit_on_the_meta_device_is_one_line(repo: Repo):
    line = _one_clear_line(repo.audit("--device", "meta"))
    assert line == ("exactref audit: error: --device meta: meta tensors have shapes but no values, so there is "
                    "nothing to judge; use cpu or a device with memory, such as cuda"), line


def test_the_plugin_on_the_meta_device_is_one_failing_item(repo: Repo):
    result = repo.run("--exactref", "--exactref-device", "meta")
    text = output(result)
    assert result.returncode == 1, text
    assert "exactref: the device meta: meta tensors have shapes but no values" in text, text
    assert "KernelRaisedError" not in text, text


# ---------------------------------------------------------------- to-pytest: public API only


def test_a_repository_test_case_becomes_a_standalone_test_on_the_public_api(repo: Repo):
    repo.plant("unsummed_broadcast")
    assert repo.run("tests/test_mykernels.py").returncode == 1
    case = next(p for p in sorted(repo.regressions.glob("test_matmul_backward-*.json")))
    made = _to_pytest(repo, str(case.relative_to(repo.root)), "-o", "standalone/test_again.py")
    assert made.returncode == 0, output(made)
    source = (repo.root / "standalone" / "test_again.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert "from exactref.harness import run_test_once" in imports, imports
    assert not [line for line in imports if "exactref." in line and not line.startswith("from exactref.harness ")]
    assert "inner_test" not in source and "exactref._" not in source, source
    failing = repo.run("standalone/test_again.py", "-p", "no:exactref")
    assert failing.returncode == 1 and "1 failed" in output(failing), output(failing)
    repo.plant()
    passing = repo.run("standalone/test_again.py", "-p", "no:exactref")
    assert passing.returncode == 0 and "1 passed" in output(passing), output(passing)


def test_a_suite_case_becomes_a_standalone_test_on_the_public_api(repo: Repo):
    (repo.root / "broadcast.json").write_text(json.dumps(BROADCAST_CASE))
    made = _to_pytest(repo, "broadcast.json")
    assert made.returncode == 0, output(made)
    imports = [line for line in made.stdout.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import numpy as np", "import exactref as er", "from exactref.harness import check_kernel"]
