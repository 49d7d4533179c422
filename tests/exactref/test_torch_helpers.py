"""Tests of the torch test helpers."""

import ml_dtypes
import numpy as np
import torch

from .torch_helpers import run, to_torch


def test_to_torch_keeps_bfloat16_bits():
    x = np.array([1.0, 2.0 ** -133, -3.5], dtype=ml_dtypes.bfloat16)
    t = to_torch(x)
    assert t.dtype == torch.bfloat16
    assert t.float().tolist() == x.astype(np.float32).tolist()


def test_run_returns_output_and_gradients_of_array_inputs_only():
    out, grads = run(lambda x, y: x * y, {"x": np.array([2.0, 3.0]), "y": 4.0}, np.array([1.0, 0.5]))
    assert out.tolist() == [8.0, 12.0]
    assert list(grads) == ["grad_x"]
    assert grads["grad_x"].tolist() == [4.0, 2.0]
