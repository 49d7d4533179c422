"""scaled_matmul_inputs and float8_arrays: well-formed cases that torch._scaled_mm and exactref both take,
the special values of each float8 format, float8 matmul cases on request only, and argument checks."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings

import exactref as er
import strategies as sx
from strategies.scaled_matmul import FLOAT8_INPUTS, _class_values, float8_arrays, scaled_matmul_inputs

from ..exactref.oracle import FORMATS as ORACLE_FORMATS
from ..exactref.oracle import decode_float8

torch = pytest.importorskip("torch")

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIND = settings(max_examples=2000, deadline=None, database=None)


def values64(a):
    return np.asarray(a).astype(np.float64)


# ---------------------------------------------------------------- argument checks

CASES = [
    (scaled_matmul_inputs, {"dtypes": ["float32"]}, ValueError,
     "dtypes contains 'float32', which scaled_matmul does not accept"),
    (scaled_matmul_inputs, {"dtypes": "float8_e8m0fnu"}, ValueError, "dtypes contains 'float8_e8m0fnu'"),
    (scaled_matmul_inputs, {"dtypes": []}, ValueError, "dtypes=[] is empty"),
    (scaled_matmul_inputs, {"max_side": 0}, ValueError, "max_side=0 must be at least 1"),
    (scaled_matmul_inputs, {"max_side": "4"}, TypeError, "max_side='4' must be an int"),
    (scaled_matmul_inputs, {"scales": False}, ValueError, "scales=False switches every kind off"),
    (scaled_matmul_inputs, {"scales": ["block"]}, ValueError, "scales contains 'block'"),
    (scaled_matmul_inputs, {"bias": "yes"}, TypeError, "bias='yes' must be True or False"),
    (scaled_matmul_inputs, {"bias_dtypes": ["float8_e4m3fn"]}, ValueError,
     "bias_dtypes contains 'float8_e4m3fn', which scaled_matmul's bias does not accept"),
    (scaled_matmul_inputs, {"out_dtypes": ["float64"]}, ValueError,
     "out_dtypes contains 'float64', which scaled_matmul's out_dtype does not accept"),
    (scaled_matmul_inputs, {"use_fast_accum": 1}, TypeError, "use_fast_accum=1 must be True or False"),
    (scaled_matmul_inputs, {"specials": ["zero"]}, ValueError, "specials contains 'zero'"),
    (scaled_matmul_inputs, {"device": 3}, TypeError, "device=3 must be None"),
    (float8_arrays, {"dtype": "float32", "shape": (2,)}, ValueError,
     "dtype contains 'float32', which float8_arrays does not accept"),
    (float8_arrays, {"dtype": ["float8_e5m2", "float8_e4m3fn"], "shape": (2,)}, ValueError,
     "must be one float8 format"),
    (float8_arrays, {"dtype": "float8_e5m2", "shape": [2]}, TypeError, "shape=[2] must be a tuple"),
    (float8_arrays, {"dtype": "float8_e5m2", "shape": (2,), "max_abs": 0}, ValueError,
     "max_abs=0.0 must be finite and greater than zero"),
    (sx.matmul_inputs, {"dtypes": ["float8_e8m0fnu"]}, ValueError,
     "dtypes contains 'float8_e8m0fnu', which matmul does not accept"),
    (sx.gemm_inputs, {"dtypes": ["float8_e4m3fn"]}, ValueError,
     "dtypes contains 'float8_e4m3fn', which gemm does not accept"),
]


@pytest.mark.parametrize("factory, kwargs, error, text", CASES, ids=lambda v: getattr(v, "__name__", None))
def test_bad_arguments_are_refused_where_the_strategy_is_built(factory, kwargs, error, text):
    with pytest.raises(error) as info:
        factory(**kwargs)
    assert text in str(info.value)


# ---------------------------------------------------------------- special values


@pytest.mark.parametrize("fmt", FLOAT8_INPUTS)
def test_the_special_classes_are_the_formats_values_read_off_its_bytes(fmt):
    # The oracle decodes each byte from the format's specification, independently of ml_dtypes.
    decoded = [decode_float8(fmt, b) for b in range(256)]
    positive = sorted({v for v in decoded if 0 < v < math.inf})
    p, emin, emax = ORACLE_FORMATS[fmt]
    f = er.FORMATS[fmt]
    assert max(_class_values(f, "max_finite")) == positive[-1]
    assert max(_class_values(f, "min_subnormal")) == positive[0] == 2.0 ** (emin - p + 1)
    assert max(_class_values(f, "min_normal")) == 2.0 ** emin
    assert max(_class_values(f, "max_subnormal")) == max(v for v in positive if v < 2.0 ** emin)
    assert sorted(v for v in _class_values(f, "overflow") if v > 0) == [v for v in positive if v >= 2.0 ** emax]
    assert sorted(v for v in _class_values(f, "power_of_two") if v > 0) == \
        [2.0 ** e for e in range(emin - p + 1, emax)]
    # A power of two's neighbours: one step of its own binade up, one of the binade below down.
    powers = {2.0 ** e for e in range(emin - p + 1, emax + 1)}
    neighbours = {x + 2.0 ** (max(math.frexp(x)[1] - 1, emin) - p + 1) for x in powers} | \
        {x - 2.0 ** (max(math.frexp(x)[1] - 2, emin) - p + 1) for x in powers}
    assert sorted(v for v in _class_values(f, "near_power_of_two") if v > 0) == \
        sorted(v for v in neighbours - powers if v in positive)
    # Every class holds both signs of its values.
    for name in ("max_finite", "overflow", "power_of_two", "near_power_of_two"):
        assert sorted(_class_values(f, name)) == sorted(-v for v in _class_values(f, name))
    # Negative zero and infinities only where the format has them.
    has_neg_zero = any(v == 0 and math.copysign(1, v) < 0 for v in decoded)
    assert (_class_values(f, "signed_zero") == (-0.0,)) == has_neg_zero
    assert bool(_class_values(f, "infinity")) == any(math.isinf(v) for v in decoded)


@pytest.mark.parametrize("fmt", FLOAT8_INPUTS)
@pytest.mark.parametrize("want", ["max_finite", "subnormal", "zero", "nan", "top_binade"])
def test_float8_arrays_reach_every_kind_of_value(fmt, want):
    f = er.FORMATS[fmt]
    tests = {
        "max_finite": lambda v: (np.abs(v) == f.max_finite).any(),
        "subnormal": lambda v: ((np.abs(v) < f.min_normal) & (v != 0)).any(),
        "zero": lambda v: (v == 0).any(),
        "nan": lambda v: np.isnan(v).any(),
        "top_binade": lambda v: ((np.abs(v) >= 2.0 ** f.emax) & (np.abs(v) < f.max_finite)).any(),
    }
    a = find(float8_arrays(dtype=fmt, shape=(3, 3)), lambda a: tests[want](values64(a)), settings=FIND)
    assert a.dtype.name == fmt and a.shape == (3, 3)


def test_specials_can_be_switched_off():
    @EXAMPLES
    @given(float8_arrays(dtype="float8_e5m2", shape=(4, 4), specials=False, max_abs=8.0))
    def run(a):
        v = values64(a)
        assert np.isfinite(v).all() and (np.abs(v) <= 8).all()
        assert not ((v == 0) & np.signbit(v)).any()
    run()


# ---------------------------------------------------------------- cases


def _torch_scaled_mm(case):
    t = case.to_torch()
    out_dtype = getattr(torch, case.out_dtype)
    return torch._scaled_mm(t.A, t.B.t().contiguous().t(), t.scale_a, t.scale_b, bias=t.bias, out_dtype=out_dtype,
                            use_fast_accum=case.use_fast_accum)


def test_cases_are_well_formed_and_both_torch_and_exactref_take_them():
    @EXAMPLES
    @given(scaled_matmul_inputs(dtypes=FLOAT8_INPUTS[:2]))
    def run(case):
        M, K = case.A.shape
        assert case.B.shape[0] == K and case.A.dtype == case.B.dtype and case.A.dtype.name in FLOAT8_INPUTS[:2]
        N = case.B.shape[1]
        assert case.grad is None
        for s, shape in ((case.scale_a, (M, 1)), (case.scale_b, (1, N))):
            assert s.dtype == np.float32 and s.shape in ((), shape)
            assert (s > 0).all() and np.isfinite(s).all()
        assert (case.scale_a.shape == ()) == (case.scale_b.shape == ())
        assert case.bias is None or (case.bias.shape == (N,) and case.bias.dtype.name in ("float32", "bfloat16"))
        assert case.out_dtype in ("float32", "bfloat16", "float16", case.A.dtype.name)
        assert isinstance(case.use_fast_accum, bool)
        out = _torch_scaled_mm(case)
        result = case.forward()
        assert tuple(out.shape) == result.shape == (M, N)
        assert str(out.dtype) == f"torch.{case.out_dtype}" and result.dtype.name == case.out_dtype
    run()


@pytest.mark.parametrize("want", ["row", "tensor", "bias", "float8_out", "odd_scale", "fast_accum"])
def test_every_option_is_drawn(want):
    tests = {
        "row": lambda c: c.scale_a.shape == (c.A.shape[0], 1) and c.A.shape[0] >= 2,
        "tensor": lambda c: c.scale_a.shape == (),
        "bias": lambda c: c.bias is not None,
        "float8_out": lambda c: c.out_dtype == c.A.dtype.name,
        "odd_scale": lambda c: any(math.frexp(float(v))[0] != 0.5 for v in np.ravel(c.scale_a)),
        "fast_accum": lambda c: c.use_fast_accum,
    }
    find(scaled_matmul_inputs(), tests[want], settings=FIND)


def test_options_restrict_the_cases():
    @EXAMPLES
    @given(scaled_matmul_inputs(dtypes="float8_e4m3fnuz", scales="tensor", bias=False, out_dtypes=["bfloat16"],
                                use_fast_accum=True, max_side=2))
    def run(case):
        assert case.A.dtype.name == "float8_e4m3fnuz" and case.scale_a.shape == () and case.bias is None
        assert case.out_dtype == "bfloat16" and case.use_fast_accum is True
        assert max(case.A.shape + case.B.shape) <= 2
    run()


def test_cases_come_as_torch_tensors_on_request():
    case = find(scaled_matmul_inputs(device="cpu", bias=False), lambda c: True)
    assert case.A.dtype == torch.float8_e4m3fn and case.scale_a.dtype == torch.float32
    back = case.to_numpy()
    assert back.A.dtype.name == "float8_e4m3fn"
    assert torch.equal(back.to_torch().A.view(torch.uint8), case.A.view(torch.uint8))


# ---------------------------------------------------------------- float8 matmul


def test_matmul_draws_float8_only_on_request_and_then_matrices():
    @EXAMPLES
    @given(sx.matmul_inputs(dtypes=["float8_e4m3fn", "float8_e5m2fnuz"]))
    def float8(case):
        assert case.A.ndim == case.B.ndim == 2 and case.A.dtype.name in ("float8_e4m3fn", "float8_e5m2fnuz")
        assert case.grad.shape == (case.A.shape[0], case.B.shape[1]) and not values64(case.grad).any()
        out = torch.matmul(*case.to_torch().inputs.values())
        assert tuple(out.shape) == case.forward().shape
    float8()

    @EXAMPLES
    @given(sx.matmul_inputs(), sx.gemm_inputs())
    def default(mm, gemm):
        assert "float8" not in mm.A.dtype.name and "float8" not in gemm.A.dtype.name
    default()
