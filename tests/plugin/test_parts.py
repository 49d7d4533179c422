"""The plugin's parts, in process: case files, kernel modules, judging, configuration, standalone tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
import strategies as sx
from exactref.harness.cases import (
    CaseFileError,
    SavedCase,
    decode_value,
    encode_value,
    hex_float,
    read_case,
    suite_content,
    write_case,
)
from exactref.harness.config import ConfigError, build
from exactref.harness.judge import (
    DtypeMismatchError,
    ExceptionGroup,
    MissingGradientError,
    judge,
    keyed,
)
from exactref.harness.kernels import KernelOutputError, KernelRaisedError, load_kernels
from exactref.harness.standalone import standalone_test

from .conftest import kernel_module

FAST = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------- case files


@pytest.mark.parametrize("value, text", [
    (1.5, "0x1.8p+0"), (-0.0, "-0x0p+0"), (float("inf"), "inf"), (float("-inf"), "-inf"), (float("nan"), "nan"),
    (5e-324, "0x0.0000000000001p-1022"), (65504.0, "0x1.ffcp+15")])
def test_hex_floats_are_short_and_exact(value, text):
    assert hex_float(value) == text
    back = float.fromhex(text)
    assert back == value or (back != back and value != value)


@FAST
# float8_e8m0fnu has no special classes to draw; every byte of it goes through a case file in
# test_float8_audit.py.
@given(st.sampled_from([f for f in er.FORMATS if f != "float8_e8m0fnu"]).flatmap(
    lambda fmt: sx.arrays(dtype=fmt, shape=st.tuples(st.integers(0, 3), st.integers(1, 3)))))
def test_arrays_go_through_a_case_file_bit_for_bit(a):
    back = decode_value(json.loads(json.dumps(encode_value(a))))
    assert back.dtype == a.dtype and back.shape == a.shape
    # Equal bits, except that every NaN reads back as the one quiet NaN.
    nan = np.isnan(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64))
    size = (a.dtype.itemsize,)
    same = a.view(np.uint8).reshape(a.shape + size) == back.view(np.uint8).reshape(a.shape + size)
    assert (same.all(axis=-1) | nan).all()


def test_scalars_tuples_and_masks_go_through_a_case_file():
    for value in (None, True, 3, -0.0, 2.5, complex(1.5, -0.0), (0, 2), "x", np.array([[True, False]]),
                  np.array([[-3, 2**40]]), np.array([7], np.uint8)):
        back = decode_value(json.loads(json.dumps(encode_value(value))))
        if isinstance(value, np.ndarray):
            assert back.dtype == value.dtype and (back == value).all()
        else:
            assert back == value and type(back) is type(value) and str(back) == str(value)


def test_an_unknown_value_cannot_be_saved_and_says_why():
    with pytest.raises(TypeError, match="cannot save a value of type object in a regression case"):
        encode_value(object())


def _content(**overrides):
    A = np.ones((2, 1), np.float32)
    content = suite_content(test="exactref::matmul[float32-forward]", kernel="k:matmul", strategy="s",
                            op="matmul", direction="forward", fmt="float32", inputs={"A": A, "B": A.T},
                            kwargs={}, grad=None, model="default", failure="OutOfToleranceError[matmul]: ...")
    content.update(overrides)
    return content


def test_a_case_is_written_once_atomically_and_reads_back(tmp_path):
    first = write_case(tmp_path, _content())
    again = write_case(tmp_path, _content(failure="another message"))
    assert first == again and sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    text = first.read_text()
    assert '"A": {"dtype": "float32", "shape": [2, 1], "values": [["0x1p+0"], ["0x1p+0"]]}' in text
    saved = read_case(first)
    assert saved.kind == "suite" and saved.test == "exactref::matmul[float32-forward]"


@pytest.mark.parametrize("text, reason", [
    ("{oops", "is not valid JSON"),
    ("[1, 2]", "is not an exactref regression case"),
    (json.dumps({"exactref_regression": 2, "kind": "suite"}), "has format version 2"),
    (json.dumps({"exactref_regression": 1, "kind": "other", "test": "t"}), "has kind 'other'"),
    (json.dumps(_content(op=None)), "is corrupt: the field 'op' is missing"),
    (json.dumps(_content(case={"op": "matmul", "inputs": {"A": {"dtype": "float32", "shape": [2],
                                                               "values": ["0x1p+0"]}}, "kwargs": {}})),
     "1 values do not fill the shape (2,)"),
    (json.dumps(_content(case={"op": "matmul", "inputs": {"A": {"dtype": "float32", "shape": [1],
                                                               "values": ["one"]}}, "kwargs": {}})),
     "'one' is not a hex float string"),
])
def test_a_bad_case_file_is_an_error_naming_the_file(tmp_path, text, reason):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(CaseFileError) as info:
        read_case(path)
    assert str(path) in str(info.value) and reason in str(info.value)


# ---------------------------------------------------------------- kernel modules


@pytest.fixture
def module(monkeypatch):
    """A kernel module of the given contents, importable by name."""
    def make(**attributes):
        return kernel_module(monkeypatch, "fake_kernels", **attributes).__name__
    return make


def _numpy_matmul(A, B):
    return (A.astype(np.float64) @ B.astype(np.float64)).astype(A.dtype)


@pytest.mark.parametrize("kernels, message", [
    (None, "defines no EXACTREF_KERNELS"),
    ([1], "EXACTREF_KERNELS must be a dict"),
    ({"matmull": _numpy_matmul}, "has the key 'matmull', which is not an op"),
    ({"matmul": {"forward": _numpy_matmul, "speed": 1}}, "has unknown keys ['speed']"),
    ({"matmul": {"forward": 3}}, "['forward'] must be callable"),
    ({"matrix_exp_frechet": {"forward": _numpy_matmul, "backward": _numpy_matmul}}, "has no backward; remove it"),
    ({"matmul": {"forward": _numpy_matmul, "backward": "autograd", "arrays": "numpy"}}, "needs torch arrays"),
    ({"scaled_dot_product_attention": {"forward": _numpy_matmul, "formats": ["complex64"]}},
     "takes the formats float64, float32, float16, bfloat16"),
    ({"matmul": {"forward": _numpy_matmul, "model": "tf32"}}, "['model'] must be an ErrorModel"),
    ({"matrix_exp": {"forward": _numpy_matmul, "model": er.models.DEFAULT}}, "['model'] must be a MatrixExpModel"),
    ({"matmul": {"forward": _numpy_matmul, "known_failures": {"float8": "x"}}}, "names 'float8'"),
    ({"matmul": {"forward": _numpy_matmul, "known_failures": {"float32-sideways": "x"}}},
     "names 'float32-sideways', which is neither one of its formats"),
    ({"matmul": {"forward": _numpy_matmul, "known_failures": {"float32-backward": "x"}}},
     "nor such a format and a direction (forward), as in"),
])
def test_a_bad_kernel_module_is_an_error_naming_module_op_and_key(module, kernels, message):
    name = module(**({} if kernels is None else {"EXACTREF_KERNELS": kernels}))
    with pytest.raises((ValueError, TypeError)) as info:
        load_kernels(name)
    assert message in str(info.value) and "fake_kernels" in str(info.value)


def test_judge_passes_a_right_kernel_and_names_each_wrong_one(module):
    A = np.array([[1.0, 2.0]], np.float32)
    B = np.array([[3.0], [4.0]], np.float32)
    grad = np.ones((1, 1), np.float32)
    right = {"forward": _numpy_matmul, "arrays": "numpy",
             "backward": lambda A, B, g: (g @ B.T, A.T @ g)}
    kernel = load_kernels(module(EXACTREF_KERNELS={"matmul": right}))["matmul"]
    assert judge(kernel, "forward", {"A": A, "B": B}, {}, None).worst <= 1
    assert set(judge(kernel, "backward", {"A": A, "B": B}, {}, grad).ratios) == {"grad_A", "grad_B"}

    def wrong(**entry):
        return load_kernels(module(EXACTREF_KERNELS={"matmul": {**right, **entry}}))["matmul"]

    with pytest.raises(DtypeMismatchError) as info:
        judge(wrong(forward=lambda A, B: _numpy_matmul(A, B).astype(np.float64)), "forward",
              {"A": A, "B": B}, {}, None)
    assert type(info.value).__name__ == "DtypeMismatchError[matmul]"
    assert "matmul's output has dtype float64 but exactref's has dtype float32" in str(info.value)
    with pytest.raises(MissingGradientError, match="returned no grad_B"):
        judge(wrong(backward=lambda A, B, g: {"grad_A": g @ B.T}), "backward", {"A": A, "B": B}, {}, grad)
    with pytest.raises(KernelOutputError, match="returned 3 values"):
        judge(wrong(backward=lambda A, B, g: (g, g, g)), "backward", {"A": A, "B": B}, {}, grad)
    with pytest.raises(KernelRaisedError, match="raised ZeroDivisionError") as info:
        judge(wrong(forward=lambda A, B: 1 / 0), "forward", {"A": A, "B": B}, {}, None)
    assert "Traceback" in str(info.value) and "Inputs, exactly:\n  A: float32 (1, 2) [[0x1p+0, 0x1p+1]]" \
        in str(info.value)
    # Both gradients wrong at once: a group of two, one failure per gradient.
    with pytest.raises(ExceptionGroup) as group:
        judge(wrong(backward=lambda A, B, g: (2 * g @ B.T, 2 * A.T @ g)), "backward", {"A": A, "B": B}, {}, grad)
    assert [type(e).__name__ for e in group.value.exceptions] == \
        ["OutOfToleranceError[matmul.grad_A]", "OutOfToleranceError[matmul.grad_B]"]


def test_failure_types_are_one_per_kind_and_place_and_still_exactrefs():
    a, b = keyed(er.OutOfToleranceError, "matmul.grad_A"), keyed(er.OutOfToleranceError, "matmul.grad_B")
    assert a is keyed(er.OutOfToleranceError, "matmul.grad_A") and a is not b
    assert issubclass(a, er.OutOfToleranceError) and issubclass(a, AssertionError)
    assert keyed(er.SpecialValueError, "matmul.grad_A") is not a


# ---------------------------------------------------------------- configuration


def test_configuration_merges_the_command_line_over_pyproject(tmp_path):
    cfg = build(tmp_path, {"kernels": "a.b", "regressions": "tests/cases", "examples": 10},
                {"kernels": "c.d", "examples": None, "suite": True})
    assert (cfg.kernels, cfg.examples, cfg.suite) == ("c.d", 10, True)
    assert cfg.regressions == tmp_path / "tests" / "cases"


@pytest.mark.parametrize("table, message", [
    ({"kernel": "a.b"}, "has unknown keys ['kernel']"),
    ({"examples": 0}, "examples = 0"),
    ({"kernels": ""}, "kernels = ''"),
    ({"suite": "yes"}, "suite = 'yes'"),
    ({"ops": [1]}, "ops = [1]"),
    # A typo must not quietly select nothing.
    ({"ops": ["matmull"]}, "ops names 'matmull' ([tool.exactref] in"),
    ({"formats": ["float32", "fp16"]}, "formats names 'fp16' ([tool.exactref] in"),
])
def test_bad_configuration_names_key_and_value(tmp_path, table, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(tmp_path, table, {})


# ---------------------------------------------------------------- standalone tests


def test_standalone_code_rebuilds_every_kind_of_value(tmp_path):
    q = er.asarray([[1.5, -0.0]], "bfloat16")
    case = {"exactref_regression": 1, "kind": "test", "test": "tests/test_x.py::test_y", "failure": "E: x",
            "arguments": {"case": encode_value(sx.OpCase("sum", {"x": np.array([[1 + 2j, -3j]], np.complex64)},
                                                          {"axis": (0, 1), "keepdims": True},
                                                          np.ones((1, 1), np.complex64))),
                          "q": encode_value(q), "mask": encode_value(np.array([True, False])),
                          "alpha": encode_value(-0.0)}}
    source = standalone_test(SavedCase("test", case["test"], case, Path("c.json")), root=tmp_path,
                             output=tmp_path / "t.py")
    namespace: dict = {"__file__": str(tmp_path / "t.py")}
    exec(source.split("def test_")[0], namespace)  # the generated module's definitions
    args = namespace["ARGUMENTS"]
    assert args["case"].x.dtype == np.complex64 and args["case"].x.tolist() == [[1 + 2j, -3j]]
    assert args["case"].kwargs == {"axis": (0, 1), "keepdims": True}
    assert args["q"].dtype.name == "bfloat16" and args["q"].tobytes() == q.tobytes()
    assert args["mask"].tolist() == [True, False]
    assert str(args["alpha"]) == "-0.0"


# ---------------------------------------------------------------- the suite's search


def _sum(x, axis=None, keepdims=False):
    """torch.sum's semantics in numpy (a 0-d x takes axis 0 too), accumulated in float64."""
    return np.asarray(np.sum(x.astype(np.float64), axis=axis if x.ndim else None, keepdims=keepdims))


def _cell(module, forward, fmt="float32"):
    from exactref.harness.suite import cells

    kernels = load_kernels(module(EXACTREF_KERNELS={"sum": {"forward": forward, "arrays": "numpy",
                                                            "formats": [fmt]}}))
    return cells(kernels)[0]


def test_the_search_steers_by_the_worst_error_to_tolerance_ratio(module, monkeypatch):
    import exactref.harness.suite as suite

    seen = []
    monkeypatch.setattr(suite, "target", lambda value, label: seen.append((label, value)))
    cell = _cell(module, lambda x, axis=None, keepdims=False: _sum(x, axis, keepdims).astype(x.dtype))
    with np.errstate(over="ignore"):  # sums that overflow float32, on purpose
        run = suite.run_cell(cell, base=suite.audit_settings(), examples=20, seed_value=0)
    assert run.passed and run.examples == 20, [str(f) for f in run.failures]
    assert len(seen) == 20 and {label for label, _ in seen} == {suite.TARGET_LABEL}
    assert all(0 <= value <= 1 for _, value in seen) and max(run.ratios) == run.worst


def test_a_search_cut_short_keeps_the_smallest_failing_case_of_each_kind(module):
    import exactref.harness.suite as suite

    def off_by_one(x, axis=None, keepdims=False):
        return (_sum(x, axis, keepdims) + 1).astype(x.dtype)

    with np.errstate(over="ignore", invalid="ignore"):
        run = suite.run_cell(_cell(module, off_by_one), base=suite.audit_settings(), examples=50, seed_value=0,
                             shrink_seconds=0.0)
    assert run.cut_short and run.failures and run.examples <= 1
    kinds = [type(f).__name__ for f in run.failures]
    assert len(kinds) == len(set(kinds)) and "OutOfToleranceError[sum]" in kinds
    assert all(getattr(f, "_exactref_case", None) is not None for f in run.failures)
