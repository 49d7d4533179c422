"""Fault injection for regression case files in the pytest plugin: bad bytes, missing inputs, unwritable
directories.  Each fault must give a failing item or a line that names the problem, never a crash."""

from __future__ import annotations

import json

import pytest

from exactref.harness.cases import CaseFileError, read_case

from .conftest import Repo, output

MATMUL_F32_BACKWARD = ("--exactref", "--exactref-examples", "200", "-k", "matmul and float32 and backward")
GARBAGE = bytes(range(128, 256)) * 16  # not UTF-8 from its first byte


def suite_case(**case_overrides) -> dict:
    """A valid suite case of matmul; ``case_overrides`` replace fields of its stored case."""
    one = {"dtype": "float32", "shape": [1, 1], "values": [["0x1p+0"]]}
    case = {"op": "matmul", "inputs": {"A": one, "B": one}, "kwargs": {}, "grad": None}
    case.update(case_overrides)
    return {"exactref_regression": 1, "kind": "suite", "test": "exactref::matmul[float32-forward]",
            "kernel": "mykernels.exactref_kernels:matmul", "op": "matmul", "direction": "forward",
            "format": "float32", "model": "default", "strategy": "s", "failure": "OutOfToleranceError: x",
            "case": case}


ONE = {"dtype": "float32", "shape": [1, 1], "values": [["0x1p+0"]]}


# ---------------------------------------------------------------- reading, in process


def test_a_case_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "garbage.json"
    path.write_bytes(GARBAGE)
    with pytest.raises(CaseFileError) as info:
        read_case(path)
    assert str(path) in str(info.value) and "is not UTF-8 text" in str(info.value)
    assert "delete the file" in str(info.value)


@pytest.mark.parametrize("case, reason", [
    ({"inputs": {"A": ONE}}, "matmul's input 'B' is missing (matmul takes A, B)"),
    ({"inputs": {"A": ONE, "B": ONE, "Z": ONE}}, "'Z' is not an input of matmul (matmul takes A, B)"),
    ({"kwargs": {"alpha": 2}}, "'alpha' is not a keyword of matmul (it takes none)"),
    ({"op": "nosuchop"}, "op 'nosuchop' is not one of matmul, gemm"),
])
def test_a_case_that_does_not_fit_its_ops_signature_is_corrupt(tmp_path, case, reason):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(suite_case(**case)))
    with pytest.raises(CaseFileError) as info:
        read_case(path)
    assert str(path) in str(info.value) and "is corrupt" in str(info.value)
    assert reason in str(info.value)


def test_a_test_case_whose_opcase_lacks_an_input_is_corrupt(tmp_path):
    opcase = {"opcase": {"op": "sum", "inputs": {}, "kwargs": {}, "grad": None}}
    path = tmp_path / "test.json"
    path.write_text(json.dumps({"exactref_regression": 1, "kind": "test", "test": "tests/t.py::t",
                                "arguments": {"case": opcase}}))
    with pytest.raises(CaseFileError, match=r"argument 'case': sum's input 'x' is missing"):
        read_case(path)


def test_inputs_stored_out_of_order_are_read_in_call_order(tmp_path):
    path = tmp_path / "swapped.json"
    two = {"dtype": "float32", "shape": [1, 2], "values": [["0x1p+0", "0x1p+1"]]}
    path.write_text(json.dumps(suite_case(inputs={"B": ONE, "A": two})))
    from exactref.harness.cases import decode_case

    _, inputs, _, _ = decode_case(read_case(path).data["case"], "case")
    assert list(inputs) == ["A", "B"]


# ---------------------------------------------------------------- in a pytest run


def test_a_non_utf8_case_file_is_a_failing_item_and_the_run_goes_on(repo: Repo):
    repo.regressions.mkdir(parents=True)
    (repo.regressions / "garbage.json").write_bytes(GARBAGE)
    result = repo.run()
    text = output(result)
    assert result.returncode == 1, text
    assert "INTERNALERROR" not in text and "UnicodeDecodeError" not in text, text
    assert "FAILED exactref::regression[garbage.json]" in text
    assert "regression case tests/exactref_regressions/garbage.json: is not UTF-8 text" in text
    assert "1 failed, 1 passed" in text


def test_a_case_missing_an_input_is_reported_corrupt_not_replayed(repo: Repo):
    repo.regressions.mkdir(parents=True)
    (repo.regressions / "partial.json").write_text(json.dumps(suite_case(inputs={"A": ONE})))
    result = repo.run()
    text = output(result)
    assert result.returncode == 1, text
    assert "TypeError" not in text and "Traceback" not in text, text
    assert ("regression case tests/exactref_regressions/partial.json: is corrupt: case: matmul's input 'B' "
            "is missing") in text
    assert "1 failed, 1 passed" in text


@pytest.mark.parametrize("regressions", ["pyproject.toml", "pyproject.toml/cases", "/proc/exactref-cases"])
def test_an_unwritable_regressions_directory_keeps_the_mismatch_report(repo: Repo, regressions):
    repo.plant("unsummed_broadcast")
    result = repo.run(*MATMUL_F32_BACKWARD, "--exactref-regressions", regressions)
    text = output(result)
    assert result.returncode == 1, text
    assert "OutOfToleranceError in matmul.grad_B" in text
    assert "matmul.backward grad_B: 1 of 1 elements are not covered" in text
    lines = [line for line in text.splitlines() if "could not save the case: " in line]
    assert lines and regressions in lines[0], text
    assert "--exactref-regressions" in lines[0], lines[0]
    assert "Traceback" not in text and "pathlib.py" not in text, text
    assert len(text.splitlines()) < 150, len(text.splitlines())


def test_a_repository_tests_case_that_cannot_be_saved_keeps_its_report(repo: Repo):
    repo.plant("unsummed_broadcast")
    result = repo.run("tests/test_mykernels.py", "--exactref-regressions", "pyproject.toml/cases")
    text = output(result)
    assert result.returncode == 1, text
    assert "case (matmul), exactly:" in text
    assert "could not save the case: " in text and "pathlib.py" not in text, text
