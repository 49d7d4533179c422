"""Budgeting more roundings never shrinks a tolerance.

``autograd_roundings=True`` names a larger class of kernels (the default's,
plus PyTorch's autograd formulas that round per-copy products and apply
alpha after rounding), so every tolerance under it must be at least the
tolerance without it, for every op, format, broadcast pattern and base
model.  The drawn cases come from ``strategies``, broadcasting batch and
element dimensions included; the explicit cases are the ones that once
shrank.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import exactref as er
import strategies as sx

BASES = [er.models.DEFAULT, er.models.REDUCED_PRECISION_REDUCTION, er.models.TF32_MATMUL, er.models.BF16_MATMUL]
DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64"]
INPUTS = {
    "matmul": lambda: sx.matmul_inputs(dtypes=DTYPES, max_batch_dims=2, max_side=4, specials=False),
    "gemm": lambda: sx.gemm_inputs(dtypes=DTYPES, max_batch_dims=1, max_side=4, specials=False),
    "add": lambda: sx.add_inputs(dtypes=DTYPES, max_dims=3, specials=False, scalars=True),
    "multiply": lambda: sx.multiply_inputs(dtypes=DTYPES, max_dims=3, specials=False),
    "sum": lambda: sx.sum_inputs(dtypes=DTYPES, max_dims=3, specials=False),
}


def tolerances(op: str, case, model) -> dict[str, np.ndarray]:
    fn = getattr(er, op)
    args, kw = list(case.inputs.values()), dict(case.kwargs)
    out = {"forward": fn(*args, **kw, model=model).tolerance}
    for name, res in fn.backward(*args, case.grad, **kw, model=model).items():
        out[name] = res.tolerance
    return out


def shrunk(base: dict[str, np.ndarray], more: dict[str, np.ndarray]) -> list[str]:
    """Names whose tolerance under the larger class is smaller somewhere (NaN counts as no bound)."""
    bad = []
    for name, t in base.items():
        lo, hi = np.nan_to_num(t, nan=np.inf), np.nan_to_num(more[name], nan=np.inf)
        if np.any(hi < lo):
            bad.append(f"{name}: {np.min(hi / np.where(lo > 0, lo, 1)):.3g} of the base")
    return bad


def test_shrunk_reports_a_smaller_tolerance_and_only_that():
    assert shrunk({"g": np.array([1.0, 2.0])}, {"g": np.array([1.0, 3.0])}) == []
    assert shrunk({"g": np.array([np.inf])}, {"g": np.array([np.nan])}) == []
    assert shrunk({"g": np.array([1.0, 2.0])}, {"g": np.array([0.5, 3.0])}) == ["g: 0.5 of the base"]


@pytest.mark.parametrize("op", list(INPUTS))
@settings(max_examples=40)
@given(data=st.data())
def test_autograd_roundings_never_shrink_a_tolerance(op, data):
    case = data.draw(INPUTS[op](), label="case")
    base = data.draw(st.sampled_from(BASES), label="base")
    more = base.replace(autograd_roundings=True)
    assert shrunk(tolerances(op, case, base), tolerances(op, case, more)) == []


def _batched_matmul_case(dtype):
    rng = np.random.default_rng(7)
    A = er.asarray(rng.standard_normal((3, 1, 4, 5)), dtype)
    B = er.asarray(rng.standard_normal((1, 4, 5, 2)), dtype)
    G = er.asarray(rng.standard_normal((3, 4, 4, 2)), dtype)
    return A, B, G


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul_gradients_with_broadcast_batches(dtype):
    # Both operands batched and broadcasting: PyTorch's per-batch products (rounded) are summed.
    A, B, G = _batched_matmul_case(dtype)
    base = er.matmul.backward(A, B, G)
    more = er.matmul.backward(A, B, G, model=er.models.PYTORCH_AUTOGRAD)
    for name in ("grad_A", "grad_B"):
        assert np.all(more[name].tolerance >= base[name].tolerance), name


def test_float16_multiply_gradients_under_reduced_precision_reduction():
    rng = np.random.default_rng(3)
    x = er.asarray(rng.standard_normal((64, 1)), "float16")
    y = er.asarray(rng.standard_normal((1, 200)), "float16")
    g = er.asarray(rng.standard_normal((64, 200)), "float16")
    model = er.models.REDUCED_PRECISION_REDUCTION
    base = er.multiply.backward(x, y, g, model=model)
    more = er.multiply.backward(x, y, g, model=model.replace(autograd_roundings=True))
    for name in ("grad_x", "grad_y"):
        assert np.all(more[name].tolerance >= base[name].tolerance), name
