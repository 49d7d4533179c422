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


CASES = [
    # (call, exception, pattern the message must match)
    (lambda: er.asarray([1, 2]), TypeError, r"obj holds int64.*dtype='float32'"),
    (lambda: er.asarray([1.0], "int8"), TypeError, r"dtype='int8' is not a supported format"),
    (lambda: er.asarray([1.0], "float8_e4m3fn"), TypeError, r"float8.*no op accepts"),
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
]


@pytest.mark.parametrize("call, exc, pattern", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_argument_is_rejected_with_a_clear_message(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
