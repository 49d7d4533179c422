"""Every per-op input set is accepted by PyTorch's function and by exactref's op, forward and backward,
with the shapes and dtypes the case says."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import exactref as er
import strategies as sx

torch = pytest.importorskip("torch")
from ._torch_ref import call, frechet_block  # noqa: E402

EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The ops exactref has so far; attention and the matrix exponential join as they land.  scaled_matmul's
# cases (float8, output dtype of their own) are checked against torch._scaled_mm in test_scaled_matmul.py.
EXACTREF_OPS = tuple(op for op in sx.OPS if hasattr(er, op) and op != "scaled_matmul")


def torch_dtype(fmt):
    return getattr(torch, fmt.torch_name)


def expected_shape(case):
    """The output shape, from the grad that the case carries (or, without one, from A)."""
    return tuple(case.grad.shape) if case.grad is not None else tuple(case.A.shape)


def check_torch(case):
    fmt = case.format
    t = case.to_torch("cpu", requires_grad=case.grad is not None)
    out = call(t)
    assert tuple(out.shape) == expected_shape(case)
    assert out.dtype == torch_dtype(fmt)
    if case.grad is None:
        return
    out.backward(t.grad)
    for name, value in t.inputs.items():
        if isinstance(value, torch.Tensor):
            assert value.grad is not None, f"PyTorch gave {name} no gradient"
            assert value.grad.shape == value.shape and value.grad.dtype == value.dtype


def check_exactref(case):
    try:
        result = case.forward()
        grads = case.backward() if case.grad is not None else None
    except er.ReferenceUnavailableError:
        # Documented for the transcendental ops only: a value exactly on a
        # rounding boundary, or exactly zero by cancellation, cannot be decided.
        if case.op in ("matmul", "gemm", "add", "multiply", "sum"):
            raise
        return
    assert result.shape == expected_shape(case)
    assert np.dtype(result.dtype) == np.dtype(case.format.dtype)
    if grads is None:
        return
    for name, value in case.inputs.items():
        if isinstance(value, np.ndarray):
            assert getattr(grads.rounded, f"grad_{name}").shape == value.shape
        else:
            assert f"grad_{name}" not in grads


STRATEGIES = {
    "matmul": lambda: sx.matmul_inputs(),
    "gemm": lambda: sx.gemm_inputs(allow_1d=True, max_batch_dims=2),
    "add": lambda: sx.add_inputs(scalars=True),
    "multiply": lambda: sx.multiply_inputs(scalars=True),
    "sum": lambda: sx.sum_inputs(),
    "scaled_dot_product_attention": lambda: sx.scaled_dot_product_attention_inputs(),
    "matrix_exp": lambda: sx.matrix_exp_inputs(),
    "matrix_exp_frechet": lambda: sx.matrix_exp_frechet_inputs(),
}


@pytest.mark.parametrize("op", list(STRATEGIES))
def test_pytorch_accepts_every_case(op):
    @EXAMPLES
    @given(STRATEGIES[op]())
    def run(case):
        assert case.op == op
        check_torch(case)
    run()


@pytest.mark.parametrize("op", EXACTREF_OPS)
def test_exactref_accepts_every_case(op):
    @EXAMPLES
    @given(STRATEGIES[op]())
    def run(case):
        check_exactref(case)
    run()


def test_the_frechet_block_matches_autograd_jvp():
    @settings(EXAMPLES, max_examples=10)
    @given(sx.matrix_exp_frechet_inputs(dtypes=["float64"]))
    def run(case):
        A, E = (torch.from_numpy(case.A), torch.from_numpy(case.E))
        _, jvp = torch.autograd.functional.jvp(torch.linalg.matrix_exp, A, E)
        block = frechet_block(A, E)
        assert jvp.shape == block.shape
        torch.testing.assert_close(block, jvp, rtol=1e-9, atol=1e-9)
    run()


def test_strategies_hand_out_torch_tensors_on_request():
    @settings(EXAMPLES, max_examples=10)
    @given(sx.matmul_inputs(dtypes=["bfloat16"], device="cpu"))
    def run(case):
        assert case.A.dtype == torch.bfloat16 and case.grad.dtype == torch.bfloat16
        back = case.to_numpy()
        assert back.A.dtype.name == "bfloat16" and back.A.shape == tuple(case.A.shape)
        # Bit for bit there and back: NaN payloads and signed zeros included.
        again = back.to_torch()
        for name in ("A", "B", "grad"):
            assert torch.equal(getattr(again, name).view(torch.int16), getattr(case, name).view(torch.int16))
    run()
