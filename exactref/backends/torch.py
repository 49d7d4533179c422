"""PyTorch's own kernels, as a kernel module: what ``exactref audit`` judges by default.

Each op is PyTorch's function for it, backward through autograd, judged under
the error model that describes PyTorch's algorithm on the device: the default
model forward; PYTORCH_AUTOGRAD backward, which budgets the extra roundings
of PyTorch's autograd formulas that the spec names (per-batch products
rounded before broadcast copies are summed, alpha applied after the product
is rounded); for attention, the class of the kernel that dispatch picks.
"""

from __future__ import annotations

import contextlib
from typing import Any

try:
    import torch
except ImportError as exc:  # the backend of a library that is not installed says how to get it
    raise ImportError(f'exactref.backends.torch needs torch ({exc}): pip install "exactref[torch]"') from None
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er

__all__ = ["EXACTREF_KERNELS"]

_HALF = ("float16", "bfloat16")
# docs/matrix-exp.md, "Half formats": torch 2.13 runs its double instantiation on
# half inputs, reading the double coefficient tables as half values.
_MEXP_HALF_BUG = ("torch.linalg.matrix_exp runs its double instantiation on half formats (exp(I) comes out "
                  "as -20896); see docs/matrix-exp.md, 'Half formats'")


def _gemm(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *, alpha: Any = 1, beta: Any = 1) -> torch.Tensor:
    if A.ndim == 3:
        return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)
    return torch.addmm(C, A, B, beta=beta, alpha=alpha)


def _sum(x: torch.Tensor, *, axis: Any = None, keepdims: bool = False) -> torch.Tensor:
    return torch.sum(x, dim=axis, keepdim=keepdims)


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               **kwargs: Any) -> torch.Tensor:
    # PyTorch's SDPA reads the mask's last two dims, so a 0-d or 1-d mask (which broadcasts to
    # (L, S) all the same) is given them first; the values it holds do not change.
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.ndim) + tuple(attn_mask.shape))
    # The CPU fused kernel departs from the math path on NaN and inf inputs (a NaN logit passes
    # for a masked one, so its row comes out 0), and exactref's normal answer is the math path's:
    # special values are audited there.  The departures themselves are shown in
    # tests/exactref/test_audit_findings.py and docs/audit.md.
    special = query.device.type == "cpu" and not all(bool(torch.isfinite(t).all()) for t in (query, key, value))
    with sdpa_kernel(SDPBackend.MATH) if special else contextlib.nullcontext():
        return F.scaled_dot_product_attention(query, key, value, attn_mask, **kwargs)


def _frechet(A: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """L(A, E) as PyTorch's matrix_exp backward computes it: the top-right block of exp([[A, E], [0, A]])."""
    n = A.shape[-1]
    A, E = torch.broadcast_tensors(A, E)
    top = torch.cat([A, E], dim=-1)
    bottom = torch.cat([torch.zeros_like(A), A], dim=-1)
    return torch.linalg.matrix_exp(torch.cat([top, bottom], dim=-2))[..., :n, n:]


def _matmul_models(device: str) -> tuple[dict[str, er.ErrorModel], dict[str, er.ErrorModel]]:
    """The forward and backward model of matmul and gemm, per format, on ``device``."""
    forward = {}
    if device.startswith("cuda"):
        flags = torch.backends.cuda.matmul
        reduced = {"float16": flags.allow_fp16_reduced_precision_reduction,
                   "bfloat16": flags.allow_bf16_reduced_precision_reduction}
        for fmt, on in reduced.items():
            if on:
                forward[fmt] = er.models.REDUCED_PRECISION_REDUCTION
        precision = torch.get_float32_matmul_precision()
        if flags.allow_tf32 and precision == "highest":
            precision = "high"
        if precision != "highest":
            forward["float32"] = er.models.DEFAULT.replace(name=f"float32_{precision}",
                                                           float32_matmul_precision=precision)
    base = {f: forward.get(f, er.models.DEFAULT) for f in er.FORMATS}
    backward = {f: m.replace(name=f"{m.name}+autograd", autograd_roundings=True)
                if m is not er.models.DEFAULT else er.models.PYTORCH_AUTOGRAD for f, m in base.items()}
    return base, backward


def _attention_models(device: str) -> dict[str, er.AttentionAlgorithm]:
    A = er.AttentionAlgorithm
    if device.startswith("cuda"):
        # Dispatch prefers FlashAttention for half formats and the memory-efficient kernel for float32.
        return {"float64": A.MATH, "float32": A.EFFICIENT_ATTENTION,
                "float16": A.FLASH_ATTENTION, "bfloat16": A.FLASH_ATTENTION}
    # On CPU, without a mask or with is_causal, dispatch picks the fused kernel, which rounds
    # half-format weights and dS to the half format: FLASH_ATTENTION's class (docs/attention.md).
    return {"float64": A.MATH, "float32": A.MATH, "float16": A.FLASH_ATTENTION, "bfloat16": A.FLASH_ATTENTION}


def kernels(device: str = "cpu") -> dict[str, Any]:
    """PyTorch's kernel of every op exactref has, with the models that describe them on ``device``."""
    mm_forward, mm_backward = _matmul_models(device)
    autograd = er.models.PYTORCH_AUTOGRAD
    attention = _attention_models(device)
    table: dict[str, Any] = {
        "matmul": {"forward": torch.matmul, "backward": "autograd", "model": mm_forward,
                   "backward_model": mm_backward},
        # gemm is addmm, so A and B are matrices (gemm_inputs draws batch dims otherwise).
        "gemm": {"forward": _gemm, "backward": "autograd", "model": mm_forward, "backward_model": mm_backward,
                 "strategy_options": {"max_batch_dims": 0}},
        "add": {"forward": torch.add, "backward": "autograd", "backward_model": autograd},
        "multiply": {"forward": torch.mul, "backward": "autograd", "backward_model": autograd},
        "sum": {"forward": _sum, "backward": "autograd", "backward_model": autograd},
        "scaled_dot_product_attention": {"forward": _attention, "backward": "autograd",
                                         "model": attention},
        "matrix_exp": {"forward": torch.linalg.matrix_exp, "backward": "autograd",
                       "known_failures": dict.fromkeys(_HALF, _MEXP_HALF_BUG)},
        "matrix_exp_frechet": {"forward": _frechet, "known_failures": dict.fromkeys(_HALF, _MEXP_HALF_BUG)},
    }
    return table


#: A function of the device, so that the models follow the device's matmul settings.
EXACTREF_KERNELS = kernels
