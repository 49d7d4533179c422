"""Float8 in the harness: the audit's float8 cells of matmul and scaled_matmul, planted float8 bugs caught
with a shrunk case saved that replays, float8 regression cases, and the probe that picks scaled_matmul's
saturation from what torch does."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
from exactref.harness.cases import (
    decode_case,
    decode_value,
    encode_value,
    read_case,
    suite_content,
    write_case,
)
from exactref.harness.judge import judge
from exactref.harness.kernels import (
    FLOAT8_INPUTS,
    FORMATS,
    OP_INPUTS,
    call_kernel,
    load_kernels,
)
from exactref.harness.replay import replay_case, replay_directory
from exactref.harness.standalone import standalone_test
from exactref.harness.suite import cells
from strategies.scaled_matmul import float8_arrays

from .conftest import Repo, kernel_module, output

torch = pytest.importorskip("torch")

FAST = settings(max_examples=30, deadline=None)


def _computes(fn) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _operand(name: str) -> torch.Tensor:
    return torch.ones((2, 2)).to(getattr(torch, name))


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


# What torch computes here, found by running it (the test's own probe, not the backend's).
TORCH_MATMUL = tuple(n for n in FLOAT8_INPUTS if _computes(lambda n=n: torch.matmul(_operand(n), _operand(n))))
TORCH_SCALED = tuple(n for n in FLOAT8_INPUTS if _computes(lambda n=n: torch._scaled_mm(
    _operand(n), _column_major(_operand(n)), torch.ones(()), torch.ones(()), out_dtype=torch.float32)))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, except that every NaN reads back as the one quiet NaN."""
    size = (a.dtype.itemsize,)
    same = (a.view(np.uint8).reshape(a.shape + size) == b.view(np.uint8).reshape(b.shape + size)).all(axis=-1)
    return bool((same | np.isnan(b.astype(np.float64))).all())


def _rows(text: str, op: str) -> list[tuple[str, str, str]]:
    """(format, direction, result) of each of the op's rows in the audit table."""
    return re.findall(rf"^{op} +(\S+) +(forward|backward) +\d+ +\d+ +\S+ +[\d.]+s +(.+)$", text, re.MULTILINE)


# ---------------------------------------------------------------- the audit of PyTorch's kernels


def test_the_audit_has_float8_cells_forward_only_and_they_pass(tmp_path):
    result = Repo(tmp_path).audit("--ops", "matmul,scaled_matmul", "--examples", "20", "--seed", "0")
    text = output(result)
    matmul, scaled = _rows(text, "matmul"), _rows(text, "scaled_matmul")
    float8 = [(f, d) for f, d, _ in matmul if f.startswith("float8")]
    assert float8 == [(f, "forward") for f in TORCH_MATMUL] and TORCH_MATMUL, text
    assert [(f, d) for f, d, _ in matmul if not f.startswith("float8")] == \
        [(f, d) for f in FORMATS for d in ("forward", "backward")]
    assert [(f, d) for f, d, _ in scaled] == [(f, "forward") for f in TORCH_SCALED] and TORCH_SCALED, text
    assert all(r == "ok" for *_, r in matmul + scaled), text
    assert "PASSED: no mismatches." in text and result.returncode == 0


# ---------------------------------------------------------------- planted float8 bugs

BROKEN = '''"""Float8 kernels with planted bugs (written by tests/plugin/test_float8_audit.py)."""
import torch

from exactref.backends.torch import kernels

TORCH = kernels("cpu")


def truncate(x, dtype):
    """x (float32) in dtype, rounded toward zero instead of to nearest: a planted bug."""
    r = x.to(dtype)
    bits = r.view(torch.uint8)
    # Sign and magnitude: one less in the low seven bits is one step toward zero.
    away = torch.isfinite(x) & torch.isfinite(r.float()) & (r.float().abs() > x.abs()) & ((bits & 0x7F) > 0)
    return torch.where(away, bits - 1, bits).view(dtype)


def truncating_matmul(A, B):
    return truncate(A.float() @ B.float(), A.dtype)


def scaled_mm_first_row_scale(A, B, scale_a, scale_b, **kwargs):
    """Every row scaled by the first row's scale: a row-wise scale dropped, a planted bug."""
    first = scale_a.reshape(-1)[:1].expand(scale_a.numel()).reshape(scale_a.shape).contiguous()
    return TORCH["scaled_matmul"]["forward"](A, B, first, scale_b, **kwargs)


EXACTREF_KERNELS = {
    "matmul": {"forward": truncating_matmul, "formats": ["float8_e4m3fn"]},
    "scaled_matmul": {**TORCH["scaled_matmul"], "forward": scaled_mm_first_row_scale, "formats": ["float8_e4m3fn"]},
}
'''


@pytest.mark.skipif("float8_e4m3fn" not in TORCH_SCALED, reason="torch._scaled_mm takes no float8_e4m3fn here")
def test_broken_float8_kernels_fail_their_cells_with_shrunk_cases_that_replay(tmp_path, monkeypatch):
    (tmp_path / "brokenf8.py").write_text(BROKEN)
    regressions = tmp_path / "cases"
    result = Repo(tmp_path).audit("--kernels", "brokenf8", "--examples", "60", "--seed", "0",
                                  "--regressions", str(regressions))
    text = output(result)
    assert result.returncode == 1, text
    assert _rows(text, "matmul") == [("float8_e4m3fn", "forward", "FAIL")], text
    assert _rows(text, "scaled_matmul") == [("float8_e4m3fn", "forward", "FAIL")], text
    # The dropped row scale shows as a value out of tolerance, or as an overflow to inf where the exact
    # value is finite: which one the search meets first depends on its path (Hypothesis mixes the
    # literals of the modules it finds local into its draws, so the path differs between checkouts).
    assert "-- OutOfToleranceError in matmul\n" in text, text
    assert re.search(r"-- (OutOfToleranceError|SpecialValueError) in scaled_matmul\n", text), text
    assert re.search(r"Inputs, exactly:\n  A: float8_e4m3fn \(\d, \d\) \[\[", text), text
    saved = {p: json.loads(p.read_text()) for p in sorted(regressions.glob("*.json"))}
    assert {(c["op"], c["format"], c["direction"]) for c in saved.values()} == \
        {("matmul", "float8_e4m3fn", "forward"), ("scaled_matmul", "float8_e4m3fn", "forward")}, text
    # Shrunk: a row scale only matters with two rows (and two scales that differ).
    for scaled in (c["case"] for c in saved.values() if c["op"] == "scaled_matmul"):
        assert scaled["inputs"]["A"]["dtype"] == "float8_e4m3fn" and scaled["inputs"]["A"]["shape"][0] == 2
        assert scaled["inputs"]["scale_a"]["shape"] == [2, 1] and scaled["inputs"]["B"]["shape"] == [1, 1]
        assert isinstance(scaled["kwargs"]["out_dtype"], str)
    mm = next(c["case"] for c in saved.values() if c["op"] == "matmul")
    assert [math.prod(mm["inputs"][k]["shape"]) for k in ("A", "B")] == [1, 1]

    # The saved cases replay: they fail on the broken kernels, and pass on PyTorch's own.
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = load_kernels("brokenf8")
    replayed = replay_directory(regressions, broken, module="brokenf8", device="cpu", timeout=None, root=tmp_path)
    assert [r.outcome for r in replayed] == ["failed"] * len(saved), [r.text for r in replayed]
    right = load_kernels("exactref.backends.torch")
    replayed = replay_directory(regressions, right, module="brokenf8", device="cpu", timeout=None, root=tmp_path)
    assert [r.outcome for r in replayed] == ["passed"] * len(saved), [r.text for r in replayed]
    # And so does the standalone test `exactref to-pytest` writes from one.
    path = next(p for p, c in saved.items() if c["op"] == "scaled_matmul")
    namespace: dict = {}
    exec(compile(standalone_test(read_case(path)), str(path), "exec"), namespace)  # noqa: S102
    test = next(v for k, v in namespace.items() if k.startswith("test_"))
    with pytest.raises((er.OutOfToleranceError, er.SpecialValueError)):
        test()


# ---------------------------------------------------------------- regression cases


@FAST
@given(st.sampled_from(FLOAT8_INPUTS).flatmap(lambda f: float8_arrays(dtype=f, shape=(2, 3))))
def test_float8_arrays_go_through_a_case_file_bit_for_bit(a):
    back = decode_value(json.loads(json.dumps(encode_value(a))))
    assert back.dtype == a.dtype and back.shape == a.shape and _same_bits(back, a)
    assert np.isnan(back.astype(np.float64)[np.isnan(a.astype(np.float64))]).all()


@pytest.mark.parametrize("fmt", [*FLOAT8_INPUTS, "float8_e8m0fnu"])
def test_every_byte_of_each_float8_format_goes_through_a_case_file(fmt):
    a = np.arange(256, dtype=np.uint8).view(er.FORMATS[fmt].dtype)
    back = decode_value(json.loads(json.dumps(encode_value(torch.from_numpy(a.view(np.uint8)).view(
        getattr(torch, fmt))))))
    assert back.dtype == a.dtype and _same_bits(back, a)


def test_a_dtype_keyword_is_saved_as_its_name():
    for dtype in (torch.bfloat16, np.dtype(np.float16), np.float32, er.FORMATS["float8_e5m2"].dtype, "float32"):
        assert json.loads(json.dumps(encode_value(dtype))) in ("bfloat16", "float16", "float32", "float8_e5m2")
    with pytest.raises(TypeError, match="cannot save the dtype int32"):
        encode_value(np.dtype(np.int32))


@pytest.mark.skipif("float8_e4m3fn" not in TORCH_SCALED, reason="torch._scaled_mm takes no float8_e4m3fn here")
def test_a_scaled_matmul_case_round_trips_and_replays(tmp_path):
    nan = math.nan
    inputs = {"A": er.asarray([[448.0, -0.0], [nan, 2.0 ** -9]], "float8_e4m3fn"),
              "B": er.asarray([[1.5, -3.0, 0.0], [240.0, 0.25, nan]], "float8_e4m3fn"),
              "scale_a": np.array([[0.5], [3.0]], np.float32), "scale_b": np.array([[1.0, 2.0 ** -7, 0.1]], np.float32)}
    kwargs = {"bias": er.asarray([1.0, -2.5, 1e4], "bfloat16"), "out_dtype": torch.bfloat16, "use_fast_accum": True}
    content = suite_content(test="exactref::scaled_matmul[float8_e4m3fn-forward]", kernel="m:scaled_matmul",
                            strategy="s", op="scaled_matmul", direction="forward", fmt="float8_e4m3fn",
                            inputs=inputs, kwargs=kwargs, grad=None, model="default", failure="F")
    saved = read_case(write_case(tmp_path, content))
    op, back, back_kwargs, grad = decode_case(saved.data["case"], "case")
    assert op == "scaled_matmul" and grad is None and list(back) == list(inputs)
    for name, value in [*inputs.items(), ("bias", kwargs["bias"])]:
        got = back[name] if name in back else back_kwargs[name]
        assert got.dtype == value.dtype and _same_bits(got, value), name
    assert back_kwargs["out_dtype"] == "bfloat16" and back_kwargs["use_fast_accum"] is True
    # PyTorch's kernel is right on it, whichever path it takes; exactref's output dtype is the saved one.
    kernel = load_kernels("exactref.backends.torch")["scaled_matmul"]
    replay_case(kernel, saved, device="cpu", timeout=None, note="")
    assert er.scaled_matmul(*back.values(), **back_kwargs).dtype.name == "bfloat16"


# ---------------------------------------------------------------- the harness's tables


def test_float8_cells_are_opt_in_and_forward_only(monkeypatch):

    def load(entries):
        return load_kernels(kernel_module(monkeypatch, "f8_kernels", EXACTREF_KERNELS=entries).__name__)

    assert not [f for f in FORMATS if f.startswith("float8")]
    plain = load({"matmul": {"forward": torch.matmul, "backward": "autograd"}, "add": torch.add})
    assert plain["matmul"].formats == plain["add"].formats == FORMATS
    declared = load({"matmul": {"forward": torch.matmul, "backward": "autograd",
                                "formats": ["float8_e5m2", "float32", torch.float8_e4m3fn]},
                     "scaled_matmul": lambda *a, **k: None})
    assert declared["matmul"].formats == ("float32", "float8_e4m3fn", "float8_e5m2")
    assert [c.name for c in cells(declared)] == [
        "matmul[float32-forward]", "matmul[float32-backward]", "matmul[float8_e4m3fn-forward]",
        "matmul[float8_e5m2-forward]", "scaled_matmul[float8_e4m3fn-forward]", "scaled_matmul[float8_e5m2-forward]"]
    assert OP_INPUTS["scaled_matmul"].inputs == ("A", "B", "scale_a", "scale_b")
    for entries, message in [
        ({"matmul": {"forward": torch.matmul, "formats": ["float8_e8m0fnu"]}}, "matmul takes the formats"),
        ({"add": {"forward": torch.add, "formats": ["float8_e4m3fn"]}}, "add takes the formats"),
        ({"scaled_matmul": {"forward": torch.matmul, "formats": ["bfloat16"]}},
         "scaled_matmul takes the formats float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz"),
        ({"scaled_matmul": {"forward": torch.matmul, "backward": "autograd"}}, "scaled_matmul has no backward"),
    ]:
        with pytest.raises(ValueError, match=message):
            load(entries)


def test_a_dtype_keyword_reaches_each_kernel_as_its_librarys_dtype(monkeypatch):

    seen = []

    def record(A, B, scale_a, scale_b, *, bias=None, out_dtype=None, use_fast_accum=False):
        seen.append(out_dtype)
        return A

    mod = kernel_module(monkeypatch, "f8_record", EXACTREF_KERNELS={"scaled_matmul": record})
    A = er.asarray([[1.0]], "float8_e5m2")
    inputs = {"A": A, "B": A, "scale_a": np.ones((), np.float32), "scale_b": np.ones((), np.float32)}
    for arrays, dtype in (("torch", torch.bfloat16), ("numpy", np.dtype(er.FORMATS["bfloat16"].dtype))):
        mod.EXACTREF_KERNELS = {"scaled_matmul": {"forward": record, "arrays": arrays}}
        kernel = load_kernels("f8_record")["scaled_matmul"]
        call_kernel(kernel, "forward", inputs, {"bias": None, "out_dtype": "bfloat16"}, None)
        assert seen.pop() == dtype
    call_kernel(kernel, "forward", inputs, {"out_dtype": None}, None)
    assert seen.pop() is None


# ---------------------------------------------------------------- the probes of PyTorch's paths


def _scaled_case(value: float, scale: float, *, rows: int = 1, out: str = "float8_e4m3fn",
                 bias: np.ndarray | None = None) -> tuple[dict, dict]:
    """A (rows, 1) @ (1, 1) case: A's elements and B ``value``, scale_a ``scale`` (tensor-wise for one row,
    row-wise otherwise), scale_b 1."""
    scale_shape = () if rows == 1 else (rows, 1)
    inputs = {"A": er.asarray(np.full((rows, 1), value), "float8_e4m3fn"),
              "B": er.asarray([[value]], "float8_e4m3fn"),
              "scale_a": np.full(scale_shape, scale, np.float32), "scale_b": np.ones(() if rows == 1 else (1, 1),
                                                                                    np.float32)}
    return inputs, {"bias": bias, "out_dtype": out, "use_fast_accum": False}


def _torch_answer(inputs: dict, kwargs: dict) -> float:
    t = {k: torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn) if v.dtype.itemsize == 1
         else torch.from_numpy(v) for k, v in inputs.items()}
    bias = None if kwargs["bias"] is None else torch.from_numpy(kwargs["bias"])
    out = torch._scaled_mm(t["A"], _column_major(t["B"]), t["scale_a"], t["scale_b"], bias=bias,
                           out_dtype=getattr(torch, kwargs["out_dtype"]))
    return float(out[0, 0].float())


def _both_paths():
    """(mkldnn enabled, its kernel module's scaled_matmul kernel), for each of torch's two CPU paths."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on oneDNN's TF32 when the flags change
        for enabled in (True, False):
            with torch.backends.mkldnn.flags(enabled=enabled):
                yield enabled, load_kernels("exactref.backends.torch")["scaled_matmul"]


@pytest.mark.skipif("float8_e4m3fn" not in TORCH_SCALED, reason="torch._scaled_mm takes no float8_e4m3fn here")
@pytest.mark.parametrize("finding, value, scale, right, exclusive", [
    # 448 * 448 overflows float8_e4m3fn: torch's cast saturates to 448; NaN does not saturate.
    ("overflow", 448.0, 1.0, 448.0, True),
    # Just above the midpoint of 1 and 1.125: rounded to float16 first, it is the midpoint, and the tie goes
    # to 1.  (Its option accepts a kernel that rounds once, too.)
    ("double rounding", 1.0, 1.0625 + 2.0 ** -12, 1.125, False),
])
def test_the_probes_pick_the_reference_options_of_the_path_torch_takes(finding, value, scale, right, exclusive):
    built, answers = {}, {}
    for enabled, kernel in _both_paths():
        with torch.backends.mkldnn.flags(enabled=enabled):
            for rows in (1, 2):
                inputs, kwargs = _scaled_case(value, scale, rows=rows)
                answer = _torch_answer(inputs, kwargs)
                # Only tensor-wise scales take oneDNN (when mkldnn is on); it departs, the emulation does not.
                if rows == 2 or not enabled:
                    assert answer == right, (finding, enabled, rows, answer)
                    assert kernel.reference_kwargs("forward", "float8_e4m3fn", inputs, kwargs) == {}
                else:
                    answers[enabled] = answer
                    if answer != right:
                        want = {"overflow": {"saturation": "nosat"}, "double rounding": {"output_via": "float16"}}
                        options = kernel.reference_kwargs("forward", "float8_e4m3fn", inputs, kwargs)
                        assert want[finding].items() <= options.items(), options
                judge(kernel, "forward", inputs, kwargs, None)
                # A float32 output goes straight from float32: no options.
                assert kernel.reference_kwargs("forward", "float8_e4m3fn", inputs, {**kwargs, "out_dtype": "float32"}) \
                    == {}
            built[enabled] = kernel
    inputs, kwargs = _scaled_case(value, scale)
    if answers[True] == right:
        pytest.skip(f"torch's oneDNN path shows no {finding} here")
    # The finding is real: exactref's plain reference refuses oneDNN's answer, and the emulated path's
    # options are wrong for oneDNN (and, for an exclusive finding, the other way round).
    with pytest.raises(er.MismatchError):
        er.scaled_matmul(*inputs.values(), **kwargs).check(er.asarray([[answers[True]]], "float8_e4m3fn"))
    for enabled, _ in _both_paths():
        if enabled or exclusive:
            with torch.backends.mkldnn.flags(enabled=enabled), pytest.raises(er.MismatchError):
                judge(built[not enabled], "forward", inputs, kwargs, None)


@pytest.mark.skipif("float8_e4m3fn" not in TORCH_SCALED, reason="torch._scaled_mm takes no float8_e4m3fn here")
def test_onednn_flushes_a_subnormal_float32_result_on_its_way_to_bfloat16():
    # A zero product plus float32's largest subnormal bias: exactly 2**-126 - 2**-149, which is 2**-126 in
    # bfloat16.  The default audit draws no subnormal bias for PyTorch's kernel (see exactref.backends.torch).
    bias = np.array([2.0 ** -126 - 2.0 ** -149], np.float32)
    inputs, kwargs = _scaled_case(0.0, 1.0, out="bfloat16", bias=bias)
    exact = er.scaled_matmul(*inputs.values(), **kwargs)
    for enabled, kernel in _both_paths():
        with torch.backends.mkldnn.flags(enabled=enabled):
            for rows in (1, 2):
                inputs, kwargs = _scaled_case(0.0, 1.0, rows=rows, out="bfloat16", bias=bias)
                answer = _torch_answer(inputs, kwargs)
                if enabled and rows == 1 and answer == 0.0:
                    with pytest.raises(er.OutOfToleranceError):
                        exact.check(er.asarray([[answer]], "bfloat16"))
                else:
                    judge(kernel, "forward", inputs, kwargs, None)
                    assert answer == 2.0 ** -126
    assert "subnormal" not in str(load_kernels("exactref.backends.torch")["scaled_matmul"].strategy_options)


def test_reference_options_may_follow_the_case(monkeypatch):

    def options(inputs, kwargs):
        return {"saturation": "nosat"} if kwargs["out_dtype"] == "float8_e4m3fn" else {}

    mod = kernel_module(monkeypatch, "f8_options",
                        EXACTREF_KERNELS={"scaled_matmul": {"forward": lambda *a, **k: None,
                                                            "reference_options": options}})
    kernel = load_kernels("f8_options")["scaled_matmul"]
    assert kernel.reference_kwargs("forward", "float8_e5m2", {}, {"out_dtype": "float8_e4m3fn"}) == \
        {"saturation": "nosat"}
    assert kernel.reference_kwargs("forward", "float8_e5m2", {}, {"out_dtype": "float32"}) == {}
    mod.EXACTREF_KERNELS["scaled_matmul"]["reference_options"] = lambda inputs, kwargs: ["nosat"]
    with pytest.raises(TypeError, match="the reference_options function of f8_options:scaled_matmul returned"):
        load_kernels("f8_options")["scaled_matmul"].reference_kwargs("forward", "float8_e5m2", {}, {})
    mod.EXACTREF_KERNELS["scaled_matmul"]["reference_options"] = 3
    with pytest.raises(TypeError, match="or a function of the case's inputs and keywords that returns one"):
        load_kernels("f8_options")
