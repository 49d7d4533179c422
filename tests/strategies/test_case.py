"""OpCase: fields by name, calling an op module, torch conversion, and the checks on its fields."""

import pickle
import types

import ml_dtypes
import numpy as np
import pytest

import strategies as sx
from strategies import OpCase


def matmul_case():
    A = np.array([[1.0, 2.0]], np.float32)
    B = np.array([[3.0], [4.0]], np.float32)
    return OpCase("matmul", {"A": A, "B": B}, {}, np.ones((1, 1), np.float32))


def test_every_field_is_an_attribute():
    A = np.ones((2, 2), np.float32)
    case = OpCase("gemm", {"A": A, "B": A, "C": A}, {"alpha": 2.0, "beta": 0.5}, A)
    assert case.A is A and case.alpha == 2.0 and case.beta == 0.5 and case.grad is A
    assert list(case.fields) == ["A", "B", "C", "alpha", "beta", "grad"]
    with pytest.raises(AttributeError, match="has no field 'D'.*A, B, C, alpha, beta, grad"):
        case.D


def test_forward_and_backward_call_the_module():
    calls = []

    def matmul(A, B, **kw):
        calls.append(("forward", A.shape, B.shape, kw))
        return "out"

    matmul.backward = lambda A, B, grad, **kw: calls.append(("backward", grad.shape, kw)) or "grads"
    module = types.SimpleNamespace(matmul=matmul)
    case = matmul_case()
    assert case.forward(module) == "out" and case.backward(module) == "grads"
    assert calls == [("forward", (1, 2), (2, 1), {}), ("backward", (1, 1), {})]


def test_forward_defaults_to_exactref():
    assert matmul_case().forward().rounded.tolist() == [[11.0]]
    assert matmul_case().backward().rounded.grad_A.tolist() == [[3.0, 4.0]]


def test_a_missing_op_and_a_missing_backward_are_clear():
    with pytest.raises(AttributeError, match="has no op 'matmul'"):
        matmul_case().forward(types.SimpleNamespace())
    A = np.eye(2)
    with pytest.raises(TypeError, match="matrix_exp_frechet has no backward"):
        OpCase("matrix_exp_frechet", {"A": A, "E": A}, {}, None).backward()


def test_to_torch_and_back_keeps_values_dtypes_and_0d_shapes():
    torch = pytest.importorskip("torch")
    x = np.array(-0.0, dtype=ml_dtypes.bfloat16)
    y = np.array([1.5, np.nan], dtype=ml_dtypes.bfloat16)
    case = OpCase("add", {"x": x, "y": y}, {"alpha": 1.0}, y.copy())
    t = case.to_torch(requires_grad=True)
    assert t.x.shape == () and t.x.dtype == torch.bfloat16 and t.x.requires_grad
    assert not t.grad.requires_grad
    back = t.to_numpy()
    assert back.x.dtype == x.dtype and back.x.shape == ()
    assert back.x.view(np.uint16) == x.view(np.uint16)
    assert (back.y.view(np.uint16) == y.view(np.uint16)).all()


def test_to_torch_leaves_masks_and_scalars_without_gradients():
    torch = pytest.importorskip("torch")
    q = np.zeros((1, 2, 3), np.float32)
    mask = np.ones((2, 2), bool)
    case = OpCase("scaled_dot_product_attention", {"query": q, "key": q[:, :2], "value": q[:, :2]},
                  {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
                  np.zeros((1, 2, 3), np.float32))
    t = case.to_torch(requires_grad=True)
    assert t.query.requires_grad and not t.attn_mask.requires_grad and t.attn_mask.dtype == torch.bool


def test_cases_pickle_and_print_their_fields():
    case = pickle.loads(pickle.dumps(matmul_case()))
    assert case.A.tolist() == [[1.0, 2.0]]
    text = repr(case)
    assert text.startswith("OpCase(op='matmul', A=array([[1., 2.]], dtype=float32)") and "grad=" in text


@pytest.mark.parametrize("args, error, message", [
    (("mul", {"x": 1}, {}, 1), ValueError, "op='mul', which is not an op"),
    (("matmul", {"B": 1, "A": 1}, {}, 1), ValueError, r"inputs \('B', 'A'\); matmul's inputs are \('A', 'B'\)"),
    (("add", {"x": 1, "y": 1}, {"beta": 1}, 1), ValueError, r"keywords \['beta'\] that add does not take"),
    (("sum", {"x": 1}, {}, None), ValueError, "without grad"),
    (("matrix_exp_frechet", {"A": 1, "E": 1}, {}, 1), ValueError, "has no backward; pass grad=None"),
])
def test_a_case_with_wrong_fields_is_refused(args, error, message):
    with pytest.raises(error, match=message):
        OpCase(*args)


def test_check_case_names_the_source():
    with pytest.raises(TypeError, match="my module drew tuple .* must draw OpCase"):
        sx.check_case((1, 2), "matmul", source="my module")
    with pytest.raises(ValueError, match="my module for gemm drew a case for matmul"):
        sx.check_case(matmul_case(), "gemm", source="my module")
