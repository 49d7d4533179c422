"""PyTorch's function for each op, called the way a case's fields say."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def frechet_block(A: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """The Fréchet derivative of exp at A in direction E: the top-right block of exp([[A, E], [0, A]])."""
    n = A.shape[-1]
    top = torch.cat([A, E], dim=-1)
    bottom = torch.cat([torch.zeros_like(A), A], dim=-1)
    return torch.linalg.matrix_exp(torch.cat([top, bottom], dim=-2))[..., :n, n:]


def call(case: Any) -> torch.Tensor:
    """PyTorch's result for a case whose arrays are torch tensors."""
    f, k = case.fields, case.kwargs
    op = case.op
    if op == "matmul":
        return torch.matmul(f["A"], f["B"])
    if op == "gemm":
        A, B, C = f["A"], f["B"], f["C"]
        alpha, beta = k["alpha"], k["beta"]
        if A.ndim == 2 and B.ndim == 2:
            return torch.addmm(C, A, B, beta=beta, alpha=alpha)
        if A.ndim == 3 and B.ndim == 3 and A.shape[0] == B.shape[0]:
            return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)
        return beta * C + alpha * torch.matmul(A, B)
    if op == "add":
        return torch.add(f["x"], f["y"], alpha=k["alpha"])
    if op == "multiply":
        return torch.mul(f["x"], f["y"])
    if op == "sum":
        return torch.sum(f["x"], dim=k["axis"], keepdim=k["keepdims"])
    if op == "scaled_dot_product_attention":
        return F.scaled_dot_product_attention(f["query"], f["key"], f["value"], **k)
    if op == "matrix_exp":
        return torch.linalg.matrix_exp(f["A"])
    if op == "matrix_exp_frechet":
        return frechet_block(f["A"], f["E"])
    raise ValueError(op)
