"""Bad arguments are rejected with an error that names the argument and shows the bad value."""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er

F32 = np.ones((2, 3), dtype=np.float32)
F32_B = np.ones((3, 2), dtype=np.float32)
F64 = np.ones((2, 3), dtype=np.float64)


def _meta(shape):
    torch = pytest.importorskip("torch")
    return torch.ones(shape, device="meta")


def ok_result():
    return er.matmul(F32, F32_B)


def e4(shape, fmt="float8_e4m3fn"):
    return er.asarray(np.ones(shape), fmt)


def f32(value):
    return er.asarray(value, "float32")


def scaled(A=None, B=None, sa=None, sb=None, **kw):
    """er.scaled_matmul of a (2, 32) by (32, 3) float8 product, tensor-wise, with one argument replaced."""
    return er.scaled_matmul(e4((2, 32)) if A is None else A, e4((32, 3)) if B is None else B,
                            f32(1.0) if sa is None else sa, f32(1.0) if sb is None else sb, **kw)


def h100_fp8():
    return er.models.tensor_core("H100", "float8_e4m3fn")


CASES = [
    # (call, exception, pattern the message must match)
    (lambda: er.asarray([1, 2]), TypeError, r"obj holds int64.*dtype='float32'"),
    (lambda: er.asarray([1.0], "int8"), TypeError, r"dtype='int8' is not a supported format"),
    (lambda: er.add(e4((2, 3)), F32), TypeError,
     r"^x has dtype float8_e4m3fn, which only er.matmul and er.scaled_matmul take.*er.asarray\(x, 'bfloat16'\)"),
    (lambda: er.asarray([[1.0], [1.0, 2.0]]), TypeError, r"obj=.*cannot be read|not a rectangular"),
    (lambda: er.asarray([1j], "float32"), TypeError, r"complex values cannot be converted to float32"),
    (lambda: er.matmul(F32, F32), ValueError, r"A has shape \(2, 3\) and B has shape \(2, 3\)"),
    (lambda: er.matmul(F32, F64.T), TypeError, r"A has dtype float32 but B has dtype float64"),
    (lambda: er.matmul(2.0, F32), ValueError, r"A must be an array with at least one dimension"),
    (lambda: er.matmul(np.ones((2, 2, 3)), np.ones((3, 3, 1))), ValueError, r"batch dimensions.*\(2,\).*\(3,\)"),
    (lambda: er.matmul(F32, F32_B, model="tf32"), TypeError, r"model='tf32' is not an ErrorModel"),
    (lambda: er.matmul.backward(F32, F32_B, None), TypeError, r"needs grad.*no default of ones"),
    (lambda: er.matmul.backward(F32, F32_B, np.ones((3, 2), np.float32)), ValueError,
     r"grad has shape \(3, 2\) but matmul's output has shape \(2, 2\)"),
    (lambda: er.matmul.backward(F32, F32_B, np.ones((2, 2))), TypeError,
     r"grad has dtype float64 but matmul's output has dtype float32"),
    (lambda: er.gemm(F32, F32_B, np.ones((3, 3), np.float32)), ValueError,
     r"C has shape \(3, 3\), which does not broadcast to the product's shape \(2, 2\)"),
    (lambda: er.gemm(F32, F32_B, np.ones((2, 2), np.float32), alpha=1j), TypeError,
     r"alpha=1j is complex but the inputs are float32"),
    (lambda: er.gemm(F32, F32_B, np.ones((2, 2), np.float32), beta="2"), TypeError,
     r"beta='2' must be a Python int, float or complex"),
    (lambda: er.gemm(F32, F32_B, np.ones((2, 2), np.float32), alpha=float("inf")), ValueError,
     r"alpha=inf must be finite"),
    (lambda: er.add(F32, np.ones((3, 2), np.float32)), ValueError,
     r"x has shape \(2, 3\) and y has shape \(3, 2\), which do not broadcast"),
    (lambda: er.add(1.0, 2.0), TypeError, r"x and y are both Python scalars"),
    (lambda: er.add(F32, True), TypeError, r"y=True is a bool"),
    (lambda: er.add(F32, 2 ** 60), ValueError, r"y=1152921504606846976 is an integer too large"),
    (lambda: er.add(F32, F32, alpha=float("nan")), ValueError, r"alpha=nan must be finite"),
    (lambda: er.multiply(F32, np.ones(3, dtype=np.int32)), TypeError, r"y: obj holds int32"),
    (lambda: er.sum(F32, axis=2), ValueError, r"axis=2 is out of range for x with 2 dimensions"),
    (lambda: er.sum(F32, axis=(0, 0)), ValueError, r"axis=\(0, 0\) repeats a dimension"),
    (lambda: er.sum(F32, axis="0"), TypeError, r"axis='0' must be None, an int or a tuple of ints"),
    (lambda: er.sum(F32, keepdims=1), TypeError, r"keepdims=1 must be a bool"),
    (lambda: er.sum(3.0), TypeError, r"x=3.0 must be an array"),
    (lambda: ok_result().covers(np.ones((3, 3))), ValueError, r"x has shape \(3, 3\) but matmul's output has shape \(2, 2\)"),
    (lambda: ok_result().covers(np.ones((2, 2), dtype=complex)), TypeError, r"x is complex but matmul's output format float32 is real"),
    (lambda: ok_result().covers("abc"), TypeError, r"x has dtype <U3, which is not a number format"),
    (lambda: ok_result().exact((5, 0)), IndexError, r"index=\(5, 0\) is not an element of an output of shape \(2, 2\)"),
    (lambda: er.add.backward(F32, 2.0, F32)["grad_y"], KeyError, r"grad_y: y was a Python scalar, so it has no gradient"),
    (lambda: er.add.backward(F32, 2.0, F32).rounded.grad_y, AttributeError, r"y was a Python scalar"),
    (lambda: er.add.backward(F32, F32, F32).check(), TypeError, r"pass the gradients to judge by name"),
    (lambda: er.add.backward(F32, F32, F32).check(grad_z=F32), KeyError, r"grad_z: add.backward has no gradient of that name"),
    (lambda: er.models.ErrorModel(accumulation="float16"), ValueError, r"accumulation='float16' is not one of"),
    (lambda: er.models.ErrorModel(float32_matmul_precision="low"), ValueError,
     r"float32_matmul_precision='low' is not one of"),
    (lambda: er.models.ErrorModel(order="tree"), ValueError, r"order='tree' is not a summation order"),
    (lambda: er.models.ErrorModel(order=32), ValueError, r"order=32 is not a summation order.*Blocked"),
    (lambda: er.models.Blocked(0), ValueError, r"Blocked: size=0 must be a positive int"),
    (lambda: er.models.Blocked(32, splits=2.0), ValueError, r"Blocked: splits=2.0 must be a positive int"),
    (lambda: er.models.Blocked(32, inner="random"), ValueError, r"Blocked: inner='random' must be one of"),
    (lambda: er.models.ErrorModel(failure_rate=0), ValueError, r"failure_rate=0 must be None .* or a probability"),
    (lambda: er.models.ErrorModel(failure_rate="1e-12"), ValueError, r"failure_rate='1e-12' must be None"),
    (lambda: er.matmul(np.ones((1 << 17, 1), np.float32), np.ones((1, 1 << 17), np.float32)),
     ValueError, r"matmul: the product needs about .* GiB of working memory"),
    (lambda: er.sum(np.broadcast_to(np.float32(1), (10 ** 6, 10 ** 6))), ValueError,
     r"x has shape \(1000000, 1000000\): reading it needs about 18626.5 GiB \(a copy and its float64"),
    (lambda: er.sum(np.ma.masked_array([1.0, 2.0], mask=[False, True])), TypeError,
     r"x is a numpy masked array.*x.filled\(value\).*np.asarray\(x.data\)"),
    (lambda: er.matmul(F32, np.ma.masked_array(F32_B)), TypeError, r"^B is a numpy masked array"),
    (lambda: er.asarray(np.ma.masked_array([1.0])), TypeError, r"obj is a numpy masked array"),
    (lambda: er.matmul.backward(F32, F32_B, np.ma.masked_array(np.ones((2, 2), np.float32))), TypeError,
     r"grad is a numpy masked array"),
    (lambda: er.matmul(_meta((2, 3)), F32_B), TypeError, r"^A is a torch tensor on the meta device.*device='cpu'"),
    (lambda: er.sum(_meta((4,))), TypeError, r"^x is a torch tensor on the meta device"),
    # float8: er.scaled_matmul, er.asarray's saturation and MX scales, the tensor-core models
    (lambda: scaled(A=F32), TypeError,
     (r"scaled_matmul: A has dtype float32; it must be one of float8_e4m3fn, float8_e5m2"
      r".*er.asarray\(A, 'float8_e4m3fn'\)")),
    (lambda: scaled(B=e4((32, 3), "bfloat16")), TypeError, r"scaled_matmul: B has dtype bfloat16; it must be one of"),
    (lambda: scaled(A=e4((2, 32), "float8_e8m0fnu")), TypeError, r"scaled_matmul: A has dtype float8_e8m0fnu"),
    (lambda: scaled(A=e4((32,))), ValueError, r"scaled_matmul: A must be a matrix \(2-D\), got shape \(32,\)"),
    (lambda: scaled(B=e4((1, 32, 3))), ValueError,
     r"scaled_matmul: B must be a matrix \(2-D\), got shape \(1, 32, 3\)"),
    (lambda: scaled(B=e4((31, 3))), ValueError,
     r"A has shape \(2, 32\) and B has shape \(31, 3\): A's columns \(32\) must equal B's rows \(31\)"),
    (lambda: scaled(sa=er.asarray(np.ones(2), "float32")), ValueError,
     r"scale_a has shape \(2,\) and scale_b \(\); use one value each \(tensor-wise\), or \(2, 1\) and \(1, 3\)"),
    (lambda: scaled(sa=er.asarray(np.ones((2, 1)), "float32"), sb=er.asarray(np.ones((3, 1)), "float32")), ValueError,
     r"scale_a has shape \(2, 1\) and scale_b \(3, 1\)"),
    (lambda: scaled(sa=er.asarray(1.0, "bfloat16")), TypeError,
     r"scale_a has dtype bfloat16; scales are float32.*er.asarray\(scale_a, 'float32'\)"),
    (lambda: scaled(sb=np.float64(2.0)), TypeError, r"scale_b has dtype float64; scales are float32"),
    (lambda: scaled(sa=0.1), ValueError, r"scale_a=0.1 is not a float32 value.*er.asarray\(0.1, 'float32'\)"),
    (lambda: scaled(sa=e4((2, 1), "float8_e8m0fnu")), TypeError,
     r"scale_a has dtype float8_e8m0fnu and scale_b float32; MX block scales are float8_e8m0fnu for both"),
    (lambda: scaled(e4((2, 16)), e4((16, 3)), e4((2, 1), "float8_e8m0fnu"), e4((3, 1), "float8_e8m0fnu")), ValueError,
     r"MX block scales need K \(A.s columns, B.s rows\) to be a multiple of 32, got K=16"),
    (lambda: scaled(sa=e4((2, 2), "float8_e8m0fnu"), sb=e4((3, 1), "float8_e8m0fnu")), ValueError,
     r"scale_a has shape \(2, 2\); MX block scales need \(2, 1\)"),
    (lambda: scaled(bias=np.ones(2, np.float32)), ValueError, r"bias has shape \(2,\); it must have shape \(3,\)"),
    (lambda: scaled(bias=np.ones((1, 3), np.float32)), ValueError,
     r"bias has shape \(1, 3\); it must have shape \(3,\)"),
    (lambda: scaled(bias=np.ones(3)), TypeError,
     r"bias has dtype float64; it must be one of float32, bfloat16, float16"),
    (lambda: scaled(bias=e4((3,))), TypeError,
     r"bias has dtype float8_e4m3fn, which only er.matmul and er.scaled_matmul"),
    (lambda: scaled(out_dtype="complex64"), TypeError, r"out_dtype='complex64' must be a real float format"),
    (lambda: scaled(out_dtype="float8_e8m0fnu"), TypeError, r"out_dtype='float8_e8m0fnu' must be a real float format"),
    (lambda: scaled(out_dtype="int8"), TypeError, r"out_dtype='int8' is not a supported format"),
    (lambda: scaled(saturation="bogus"), ValueError, r"saturation='bogus' must be None .*'satfinite'.*'nosat'"),
    (lambda: scaled(out_dtype="float32", output_via="float16"), ValueError,
     r"output_via='float16' must be a real format finer than out_dtype \(float32\)"),
    (lambda: scaled(output_via="float99"), TypeError, r"output_via='float99' is not a supported format"),
    (lambda: scaled(use_fast_accum=1), TypeError, r"use_fast_accum=1 must be True or False"),
    (lambda: scaled(model="fast"), TypeError, r"model='fast' is not an ErrorModel"),
    (lambda: er.scaled_matmul.backward(e4((2, 32)), e4((32, 3)), f32(1.0), f32(1.0), np.ones((2, 3), np.float32)),
     AttributeError, r"scaled_matmul has no backward: torch._scaled_mm has none"),
    (lambda: er.asarray([1.0], "float8_e4m3fn", saturation="bogus"), ValueError, r"saturation='bogus' must be None"),
    (lambda: er.asarray([1.0], saturation="satfinite"), ValueError,
     r"saturation='satfinite' needs a dtype to round to, such as dtype='float8_e4m3fn'"),
    (lambda: er.asarray([2.0, -1.0], "float8_e8m0fnu"), ValueError,
     r"float8_e8m0fnu holds positive powers of two only, and obj has the value .*-1\.0"),
    (lambda: er.sum(e4((4,))), TypeError, r"^x has dtype float8_e4m3fn, which only er.matmul and er.scaled_matmul"),
    (lambda: er.multiply(F32, e4((2, 3), "float8_e5m2")), TypeError, r"^y has dtype float8_e5m2, which only er.matmul"),
    (lambda: er.matmul.backward(e4((2, 32)), e4((32, 3)), np.ones((2, 3), np.float32)), TypeError,
     r"matmul.backward: A and B have dtype float8_e4m3fn, and PyTorch has no float8 backward"),
    (lambda: er.models.tensor_core("A100", "float8_e4m3fn"), ValueError,
     r"tensor_core: A100 has no tensor-core model for input_format='float8_e4m3fn'; it has bfloat16, float16, tf32"),
    (lambda: er.models.tensor_core("X100", "float16"), ValueError, r"tensor_core: gpu='X100' must be one of"),
    (lambda: er.matmul(F32, F32_B, model=er.ErrorModel(order=er.models.tensor_core("H100", "tf32"))), ValueError,
     r"model: the H100 tf32 tensor core multiplies tf32, not float32.*float32_matmul_precision='high'"),
    (lambda: scaled(model=er.ErrorModel(order=er.models.tensor_core("H100", "float16"))), ValueError,
     r"model: the H100 float16/bfloat16 tensor core multiplies float16, bfloat16, not float8_e4m3fn"),
    (lambda: er.models.Blocked(128, inner=h100_fp8(), splits=2), ValueError,
     r"Blocked: splits=2 with a tensor core inside is not modelled; use splits=1"),
    (lambda: er.sum(F32, model=er.ErrorModel(order=h100_fp8())), ValueError,
     r"sum: model=.*order=tensor_core\(H100 float8\).* has a tensor-core order, which only matmul, gemm and"),
    (lambda: er.sum(F32, model=er.ErrorModel(order=er.models.Blocked(128, inner=h100_fp8()))), ValueError,
     r"sum: model=.*Blocked\(128, inner=tensor_core\(H100 float8\)\).* has a tensor-core order"),
    (lambda: er.scaled_dot_product_attention(F32, F32, F32, masked_rows="nan"), ValueError,
     r"scaled_dot_product_attention: masked_rows='nan' must be one of \('zero', 'mean'\): 'zero' \(PyTorch"),
    (lambda: er.scaled_dot_product_attention(F32, F32, F32, masked_rows=None), ValueError,
     r"masked_rows=None must be one of \('zero', 'mean'\)"),
    (lambda: er.scaled_dot_product_attention(F32, F32, F32, mask_nan="ignore"), ValueError,
     r"scaled_dot_product_attention: mask_nan='ignore' must be one of \('propagate', 'hide'\): 'propagate'"),
    (lambda: er.scaled_dot_product_attention.backward(F32, F32, F32, F32, mask_nan=True), ValueError,
     r"mask_nan=True must be one of \('propagate', 'hide'\)"),
    (lambda: er.scaled_dot_product_attention.backward(F32, F32, F32, F32, masked_rows="MEAN"), ValueError,
     r"masked_rows='MEAN' must be one of \('zero', 'mean'\)"),
]


@pytest.mark.parametrize("call, exc, pattern", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_argument_is_rejected_with_a_clear_message(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
