"""The pytest plugin in a kernel repository: planted bugs are found, reported minimal, saved and replayed.

Each test runs pytest in a fresh copy of ``sample_repo`` (a subprocess, as the
repository's CI would), with bugs planted in its kernels.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from exactref.harness.cases import read_case

from .conftest import Repo, output

MATMUL_F32_BACKWARD = ("--exactref", "--exactref-examples", "200", "-k", "matmul and float32 and backward")


def _case_of(repo: Repo, failure: str) -> dict:
    """The one saved case whose failure starts with ``failure`` (e.g. 'OutOfToleranceError[matmul.grad_B]')."""
    found = [c for c in repo.cases() if c["failure"].startswith(failure)]
    assert len(found) == 1, [c["failure"][:60] for c in repo.cases()]
    return found[0]


def test_unsummed_broadcast_gradient_is_minimal_saved_replayed_first_and_fixed(repo: Repo):
    repo.plant("unsummed_broadcast")
    first = repo.run(*MATMUL_F32_BACKWARD)
    text = output(first)
    assert first.returncode == 1, text
    assert "FAILED exactref::matmul[float32-backward]" in text
    # The report names the op, the gradient and the element, with got and exact, and the inputs in hex.
    assert "OutOfToleranceError in matmul.grad_B" in text
    assert "matmul.backward grad_B: 1 of 1 elements are not covered" in text
    assert re.search(r"  at \(0, 0\): got \S+ \(0x[0-9a-f.]+p[+-]\d+\)\n +exact .*, tolerance ", text), text
    assert re.search(r"A: float32 \(2(, 1)+\) \[+0x\S+p[+-]\d+\]+, \[+0x\S+\]+", text), text
    # Minimal: a batch of 2, every other side 1.
    case = _case_of(repo, "OutOfToleranceError[matmul.grad_B]")["case"]
    A, B, grad = case["inputs"]["A"]["shape"], case["inputs"]["B"]["shape"], case["grad"]["shape"]
    assert A[0] == 2 and set(A[1:]) == {1} and set(B) == {1} and grad == A, case
    assert "Saved as the regression case tests/exactref_regressions/matmul-backward-float32-" in text

    # The next run replays the saved cases before anything else, and fails on the first at once.
    second = repo.run("-x", *MATMUL_F32_BACKWARD)
    text = output(second)
    assert second.returncode == 1, text
    failed = [line for line in text.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED exactref::regression[matmul-backward-float32-"), text
    assert "still fails" in text and "stopping after 1 failures" in text

    # Fixed: the replays and the property item pass, and the cases are reported as fixed.
    repo.plant()
    third = repo.run(*MATMUL_F32_BACKWARD)
    text = output(third)
    assert third.returncode == 0, text
    saved = len(repo.cases())
    assert f"{saved + 1} passed" in text
    assert f"Fixed: {saved} saved case(s) now pass" in text


def test_planted_bugs_are_distinct_failures_by_kind_and_gradient(repo: Repo):
    # Three bugs in one kernel module: float16 accumulation in the forward, a missing conjugate in
    # grad_A and an unsummed broadcast in grad_B.  Each is a failure of its own, in its own item
    # or by gradient, and no two saved cases share a kind, a place and a format.
    repo.plant("fp16_accumulation", "missing_conj", "unsummed_broadcast")
    result = repo.run("--exactref", "--exactref-examples", "200",
                      "-k", "float16 and forward or float32 and backward or complex64 and backward")
    text = output(result)
    assert result.returncode == 1, text
    for item in ("float16-forward", "float32-backward", "complex64-backward"):
        assert f"FAILED exactref::matmul[{item}]" in text
    places = {(c["failure"].split(":")[0], c["format"]) for c in repo.cases()}
    assert len(places) == len(repo.cases())
    where = {(kind.split("[")[1].rstrip("]"), fmt) for kind, fmt in places}
    # float32 has no conjugate to miss, so its backward fails in grad_B only; complex64 in grad_A
    # (the first failure Hypothesis meets there has complex values, whatever its batch).
    assert {("matmul", "float16"), ("matmul.grad_B", "float32"), ("matmul.grad_A", "complex64")} <= where
    assert ("matmul.grad_A", "float32") not in where
    assert "OutOfToleranceError in matmul\n" in text and "OutOfToleranceError in matmul.grad_A" in text
    # The forward's minimal case needs no batch: an accumulation error in one dot product.
    forward = next(c for c in repo.cases() if c["format"] == "float16")["case"]["inputs"]
    assert len(forward["A"]["shape"]) == 2 and forward["A"]["shape"][-1] >= 2


def test_custom_strategies_are_honoured_and_named(repo: Repo):
    repo.plant("fp16_accumulation")
    result = repo.run("--exactref", "--exactref-strategies", "mykernels.exactref_strategies",
                      "--exactref-examples", "40", "-k", "matmul and float16 and forward")
    text = output(result)
    assert result.returncode == 1, text
    assert "Examples drawn by module 'mykernels.exactref_strategies'." in text
    assert repo.cases()
    for case in repo.cases():
        assert case["strategy"] == "module 'mykernels.exactref_strategies'"
        # The repository's strategy only draws K >= 2, and sides up to 3.
        A = case["case"]["inputs"]["A"]["shape"]
        assert A[-1] >= 2 and max(A) <= 3


def test_a_missing_strategy_module_is_a_clear_error(repo: Repo):
    result = repo.run("--exactref", "--exactref-strategies", "mykernels.no_such_module",
                      "-k", "strategies or mykernels")
    text = output(result)
    assert result.returncode == 1, text
    assert "FAILED exactref::strategies" in text
    assert "could not import the strategy module 'mykernels.no_such_module'" in text
    assert "INTERNALERROR" not in text
    assert "1 passed" in text  # the repository's own test still ran


def test_an_unusable_device_or_no_kernels_is_a_clear_error(repo: Repo):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = repo.run("--exactref", "--exactref-device", "cuda", "-k", "device or mykernels")
    text = output(result)
    assert "FAILED exactref::device" in text
    assert "exactref: the device cuda: no CUDA device is available here (torch " in text
    assert "1 failed, 1 passed" in text and "INTERNALERROR" not in text
    (repo.root / "pyproject.toml").write_text("[tool.exactref]\nregressions = 'tests/exactref_regressions'\n")
    result = repo.run("--exactref", "-k", "kernels")
    assert "exactref: --exactref runs the property suite against a kernel module, but none is configured" \
        in output(result)


def test_a_strategy_with_the_wrong_fields_is_a_clear_error(repo: Repo):
    (repo.root / "mykernels" / "bad_strategies.py").write_text(
        "import numpy as np\nfrom hypothesis import strategies as st\nfrom strategies import OpCase\n"
        "x = np.ones((1,), np.float32)\n"
        "EXACTREF_STRATEGIES = {'matmul': st.just(OpCase('add', {'x': x, 'y': x}, {'alpha': 1.0}, x))}\n")
    result = repo.run("--exactref", "--exactref-strategies", "mykernels.bad_strategies", "--exactref-examples", "5",
                      "-k", "matmul and float32 and forward")
    text = output(result)
    assert result.returncode == 1, text
    assert ("the strategy from module 'mykernels.bad_strategies' for matmul drew a case for add; "
            "it must draw OpCase(op='matmul', ...)") in text
    assert "INTERNALERROR" not in text


def test_a_kernel_that_raises_is_a_failure_with_its_traceback(repo: Repo):
    repo.plant("add_raises")
    result = repo.run("--exactref", "--exactref-examples", "30", "-k", "add and forward")
    text = output(result)
    assert result.returncode == 1, text
    assert "KernelRaisedError in add.forward" in text
    assert "raised RuntimeError: add: 0-d tensors are not supported" in text
    assert "Traceback (most recent call last)" in text and "mykernels/ops.py" in text
    assert "x: float32 () 0x0p+0" in text  # shrunk to a 0-d x
    assert _case_of(repo, "KernelRaisedError[add.forward]")["case"]["inputs"]["x"]["shape"] == []


def test_corrupt_and_stale_case_files_are_clear_errors_that_do_not_stop_the_run(repo: Repo):
    repo.regressions.mkdir(parents=True)
    (repo.regressions / "corrupt.json").write_text("{not json")
    (repo.regressions / "future.json").write_text(json.dumps({"exactref_regression": 99, "kind": "suite"}))
    stale = {"exactref_regression": 1, "kind": "suite", "test": "exactref::sum[float32-forward]",
             "kernel": "mykernels.exactref_kernels:sum", "op": "sum", "direction": "forward", "format": "float32",
             "case": {"op": "sum", "inputs": {"x": {"dtype": "float32", "shape": [1], "values": ["0x1p+0"]}},
                      "kwargs": {"axis": None, "keepdims": False}, "grad": None}}
    (repo.regressions / "stale.json").write_text(json.dumps(stale))
    gone = {"exactref_regression": 1, "kind": "test", "test": "tests/test_mykernels.py::test_renamed_away",
            "arguments": {}}
    (repo.regressions / "gone.json").write_text(json.dumps(gone))
    result = repo.run()
    text = output(result)
    assert result.returncode == 1, text
    assert "regression case tests/exactref_regressions/corrupt.json: is not valid JSON" in text
    assert "tests/exactref_regressions/future.json: has format version 99" in text
    assert ("regression case tests/exactref_regressions/stale.json is stale: the kernel module "
            "'mykernels.exactref_kernels' has no sum kernel now") in text
    assert ("regression case tests/exactref_regressions/gone.json is stale: its test "
            "tests/test_mykernels.py::test_renamed_away no longer exists") in text
    assert "4 failed, 1 passed" in text and "INTERNALERROR" not in text


def test_a_failing_repository_test_is_saved_and_replayed(repo: Repo):
    repo.plant("unsummed_broadcast")
    first = repo.run()
    assert first.returncode == 1
    saved = [c for c in repo.cases() if c["kind"] == "test"]
    assert saved and all(c["test"] == "tests/test_mykernels.py::test_matmul_backward" for c in saved)
    assert saved[0]["arguments"]["case"]["opcase"]["op"] == "matmul"
    # The report adds the drawn case in hex, and says where it was saved.
    assert "case (matmul), exactly:" in output(first) and "Saved the minimal failing case as" in output(first)
    second = repo.run("-x")
    failed = [line for line in output(second).splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1, output(second)
    assert failed[0].startswith("FAILED tests/test_mykernels.py::test_matmul_backward[exactref-regression-")
    assert "replaying the regression case tests/exactref_regressions/test_matmul_backward-" in output(second)
    repo.plant()
    third = repo.run()
    assert third.returncode == 0 and "Fixed:" in output(third), output(third)


PARAMETRIZED_TEST = """
import pytest
from hypothesis import given, settings
from mykernels import ops

import exactref as er
import strategies as sx


@pytest.mark.parametrize("label", ["one"])
@settings(max_examples=300, deadline=None)
@given(case=sx.matmul_inputs(dtypes=["float32"], max_side=2, allow_1d=False, max_batch_dims=1))
def test_parametrized(label, case):
    t = case.to_torch()
    got = ops.matmul_backward(t.A, t.B, t.grad)
    er.matmul.backward(case.A, case.B, case.grad, model=er.models.PYTORCH_AUTOGRAD).check(**got)
"""


def test_a_parametrized_test_replays_its_case_with_its_parameters(repo: Repo):
    (repo.root / "tests" / "test_parametrized.py").write_text(PARAMETRIZED_TEST)
    repo.plant("unsummed_broadcast")
    first = repo.run("tests/test_parametrized.py")
    assert first.returncode == 1, output(first)
    second = repo.run("-v", "-v", "-x", "tests/test_parametrized.py")  # -q comes first
    text = output(second)
    assert "fixture 'label' not found" not in text, text
    ran = [line for line in text.splitlines() if line.startswith("tests/test_parametrized.py::")]
    assert ran and "[exactref-regression-" in ran[0], ran
    assert " FAILED" in ran[0], ran
    assert "replaying the regression case tests/exactref_regressions/test_parametrized" in text


def test_xdist_writes_no_corrupt_or_duplicate_case_files(repo: Repo):
    # A failing suite item and a failing repository test, run by two workers.
    repo.plant("unsummed_broadcast", "add_raises")
    args = ("-n", "2", "--exactref", "--exactref-examples", "40", "-k", "add and forward or mykernels")
    first = repo.run(*args)
    assert first.returncode == 1, output(first)
    names = sorted(p.name for p in repo.regressions.iterdir())
    assert {json.loads((repo.regressions / n).read_text())["kind"] for n in names} == {"suite", "test"}
    assert not [n for n in names if not n.endswith(".json")], names  # no half-written temporary files
    cases = [read_case(p) for p in sorted(repo.regressions.glob("*.json"))]
    contents = [json.dumps(c.data.get("case") or c.data.get("arguments"), sort_keys=True) + c.test for c in cases]
    assert len(contents) == len(set(contents))
    # A second run, whose workers replay and search again, adds no copy of a case it already has.
    second = repo.run(*args)
    assert second.returncode == 1
    again = [read_case(p) for p in sorted(repo.regressions.glob("*.json"))]
    contents = [json.dumps(c.data.get("case") or c.data.get("arguments"), sort_keys=True) + c.test for c in again]
    assert len(contents) == len(set(contents))
    assert set(names) <= {p.name for p in repo.regressions.iterdir()}


def test_a_case_becomes_a_standalone_test_that_needs_no_hypothesis(repo: Repo):
    repo.plant("unsummed_broadcast")
    repo.run(*MATMUL_F32_BACKWARD)
    case = next(p for p in sorted(repo.regressions.glob("*.json"))
                if json.loads(p.read_text())["failure"].startswith("OutOfToleranceError[matmul.grad_B]"))
    made = repo.command(sys.executable, "-m", "exactref.cli", "to-pytest", str(case.relative_to(repo.root)),
                        "-o", "standalone/test_case.py")
    assert made.returncode == 0, output(made)
    source = (repo.root / "standalone" / "test_case.py").read_text()
    assert "hypothesis" not in source.lower().replace("not hypothesis", "")
    assert "float.fromhex(h) for h in ['0x1p+0', '0x1p+0']" in source
    # Run it with Hypothesis made unimportable: it must not need it.
    blocked = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('hypothesis', 'strategies'):\n"
               "            raise ImportError(f'{name} is blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import pytest\n"
               "sys.exit(pytest.main(['-q', '-p', 'no:hypothesispytest', '-p', 'no:cacheprovider', "
               "'standalone/test_case.py']))\n")
    failing = repo.command(sys.executable, "-c", blocked)
    assert failing.returncode == 1, output(failing)
    assert "OutOfToleranceError[matmul.grad_B]" in output(failing)
    repo.plant()
    passing = repo.command(sys.executable, "-c", blocked)
    assert passing.returncode == 0, output(passing)


def test_the_plugin_does_nothing_in_a_repository_that_does_not_use_it(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert True\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "-W", "ignore::DeprecationWarning"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and "1 passed" in result.stdout
    assert "exactref" not in result.stdout


def test_the_plugin_imports_nothing_of_exactref_in_a_repository_that_does_not_use_it(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "pyproject.toml").write_text("[tool.other]\nx = 1\n")
    code = ("import sys, pytest\n"
            "code = pytest.main(['-q', '-p', 'no:cacheprovider'])\n"
            "loaded = sys.modules.get('_exactref_pytestplugin') is not None\n"
            "print('plugin loaded', loaded, 'exactref imported', 'exactref' in sys.modules)\n"
            "sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plugin loaded True exactref imported False" in result.stdout
