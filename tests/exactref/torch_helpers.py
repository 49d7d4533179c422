"""Moving test arrays to torch and running PyTorch's forward and autograd backward."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch


def to_torch(x, requires_grad: bool = False):
    """A torch tensor with exactly the values and dtype of a numpy array (bfloat16 included)."""
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(np.array(x, order="C").view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(x, order="C"))
    return t.requires_grad_(requires_grad)


def run(fn, inputs: dict, grad):
    """``fn(**tensors)`` and the gradients of every array input for the output gradient ``grad``."""
    tensors = {k: to_torch(v, requires_grad=isinstance(v, np.ndarray)) for k, v in inputs.items()}
    out = fn(**tensors)
    out.backward(to_torch(grad))
    grads = {"grad_" + k: t.grad for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    return out.detach(), grads
