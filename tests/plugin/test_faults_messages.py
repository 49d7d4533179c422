"""Faults of the harness and the CLI that the issue reported, each with the message it must give."""

from __future__ import annotations

import numpy as np
import pytest

from exactref import cli
from exactref.harness.judge import judge
from exactref.harness.kernels import KernelOutputError, load_kernels
from exactref.harness.suite import (
    Cell,
    audit_settings,
    cell_strategy,
    no_longer_fails,
    run_cell,
)

from .conftest import Repo, kernel_module, output


@pytest.fixture
def module(monkeypatch):
    """A kernel module of the given EXACTREF_KERNELS, importable as fake_fault_kernels."""
    def make(kernels):
        return kernel_module(monkeypatch, "fake_fault_kernels", EXACTREF_KERNELS=kernels).__name__
    return make


def _add(x, y, alpha=1):
    # Correctly rounded: the float64 value of x + alpha * y is exact for these cases' small float32 values
    # often enough, and rounded once; a known failure listed for it does not show in a few examples.
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(np.float64) + alpha * np.asarray(y, np.float64)).astype(x.dtype)


def _numpy_matmul(A, B):
    with np.errstate(over="ignore", invalid="ignore"):  # drawn cases may overflow the format: inf, as torch gives
        return (A.astype(np.float64) @ B.astype(np.float64)).astype(A.dtype)


A = np.array([[1.0, 2.0]], np.float32)
B = np.array([[3.0], [4.0]], np.float32)
GRAD = np.ones((1, 1), np.float32)


def _matmul_kernel(module, **entry):
    base = {"forward": _numpy_matmul, "arrays": "numpy", "formats": ["float32"]}
    return load_kernels(module({"matmul": {**base, **entry}}))["matmul"]


# ---------------------------------------------------------------- 10: a known failure that passes


_STALE = {"add": {"forward": _add, "arrays": "numpy", "formats": ["float32"],
                  "known_failures": {"float32": "was off by one ulp"}}}


def _stale_kernel(module):
    return load_kernels(module(_STALE))["add"]


def test_a_known_failure_that_passes_says_to_remove_the_entry(module):
    cell = Cell(_stale_kernel(module), "float32", "forward")
    run = run_cell(cell, base=audit_settings(), examples=5, seed_value=1)
    assert run.passed
    assert no_longer_fails(run).startswith("add[float32-forward]: known failure no longer fails: remove the entry "
                                           "'float32' from fake_fault_kernels.EXACTREF_KERNELS['add']"), run


def _scaled_grad_matmul(A, B, grad):
    # A backward that doubles grad_A: wrong in every cell, while the forward is right.
    with np.errstate(over="ignore", invalid="ignore"):
        ga, gb = grad.astype(np.float64) @ B.T.astype(np.float64), A.T.astype(np.float64) @ grad.astype(np.float64)
        return {"grad_A": (2 * ga).astype(A.dtype), "grad_B": gb.astype(B.dtype)}


def test_a_known_failure_may_name_one_direction(module):
    kernels = {"matmul": {"forward": _numpy_matmul, "backward": _scaled_grad_matmul, "arrays": "numpy",
                          "formats": ["float32"], "known_failures": {"float32-backward": "doubles grad_A"}}}
    kernel = load_kernels(module(kernels))["matmul"]
    forward, backward = Cell(kernel, "float32", "forward"), Cell(kernel, "float32", "backward")
    assert forward.known_failure is None and backward.known_failure == "doubles grad_A"
    runs = [run_cell(c, base=audit_settings(), examples=5, seed_value=1) for c in (forward, backward)]
    assert runs[0].passed and not no_longer_fails(runs[0])
    assert runs[1].failures, runs[1]
    # The narrower key wins, and a stale one is named as written.
    kernels["matmul"]["known_failures"] = {"float32": "both", "float32-forward": "forward only"}
    kernel = load_kernels(module(kernels))["matmul"]
    cell = Cell(kernel, "float32", "forward")
    assert cell.known_failure == "forward only" and Cell(kernel, "float32", "backward").known_failure == "both"
    run = run_cell(cell, base=audit_settings(), examples=5, seed_value=1)
    assert "remove the entry 'float32-forward' from fake_fault_kernels" in no_longer_fails(run), run


def test_a_suite_item_whose_known_failure_passes_fails_as_a_strict_xfail_would(repo: Repo):
    kernels = repo.root / "mykernels" / "exactref_kernels.py"
    text = kernels.read_text()
    assert '"add": {"forward": ops.add,' in text
    kernels.write_text(text.replace('"add": {"forward": ops.add,',
                                    '"add": {"known_failures": {"float32": "was wrong once"}, "forward": ops.add,'))
    result = repo.run("--exactref", "--exactref-examples", "5", "-k", "add and forward")
    text = output(result)
    assert result.returncode == 1, text
    assert "FAILED exactref::add[float32-forward]" in text, text
    assert ("add[float32-forward]: known failure no longer fails: remove the entry 'float32' from "
            "mykernels.exactref_kernels.EXACTREF_KERNELS['add']['known_failures'] (its reason: was wrong once)"
            ) in text, text


def test_the_audit_says_a_known_failure_no_longer_fails(module, capsys):
    module(_STALE)
    status = cli.main(["audit", "--kernels", "fake_fault_kernels", "--examples", "5", "--seed", "1",
                       "--dtypes", "float32"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "known failure no longer fails: remove the entry 'float32'" in out
    assert out.rstrip().endswith("PASSED: no mismatches."), out


# ---------------------------------------------------------------- 12: messages


def test_a_strategy_options_typo_names_the_unknown_key_and_the_valid_ones(module):
    cell = Cell(_matmul_kernel(module, strategy_options={"max_batch_dim": 1}), "float32", "forward")
    with pytest.raises(TypeError) as info:
        cell_strategy(cell)
    text = str(info.value)
    assert "['strategy_options'] has unknown key 'max_batch_dim'" in text, text
    assert "max_batch_dims" in text and "'dtypes'" in text and "rejected options" not in text, text


def test_an_extra_returned_gradient_is_called_extra(module):
    kernel = _matmul_kernel(module, backward=lambda A, B, g: {"grad_A": g @ B.T, "grad_B": A.T @ g, "grad_C": g})
    with pytest.raises(KernelOutputError, match="returned an extra gradient grad_C that this op does not have; "
                                                "its gradients are grad_A, grad_B"):
        judge(kernel, "backward", {"A": A, "B": B}, {}, GRAD)


def test_a_kernel_returning_a_list_is_told_to_return_an_array(module):
    kernel = _matmul_kernel(module, forward=lambda A, B: _numpy_matmul(A, B).tolist())
    with pytest.raises(KernelOutputError, match="returned a list .* as its output; return a torch tensor or a "
                                                "numpy array"):
        judge(kernel, "forward", {"A": A, "B": B}, {}, None)


# ---------------------------------------------------------------- 15: a subcommand's unknown option


@pytest.mark.parametrize("argv, usage", [(["audit", "--bogus"], "usage: exactref audit"),
                                          (["to-pytest", "case.json", "--bogus"], "usage: exactref to-pytest")])
def test_an_unknown_option_of_a_subcommand_shows_its_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err, err
