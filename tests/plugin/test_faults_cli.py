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
