"""PyTorch's own kernels, as a kernel module: what ``exactref audit`` judges by default.

Each op is PyTorch's function for it, backward through autograd, judged under
the error model that describes PyTorch's algorithm on the device: the default
model forward; PYTORCH_AUTOGRAD backward, which budgets the extra roundings
of PyTorch's autograd formulas that the spec names (per-batch products
rounded before broadcast copies are summed, alpha applied after the product
is rounded); for attention, the class of the kernel that dispatch picks
(the math path where an input or the output gradient holds NaN or inf).
Float8: matmul forward, and scaled_matmul (``torch._scaled_mm``) under the
options of the path torch takes for each case, found by running torch when
the module is built (see ``_float8``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # the backend of a library that is not installed says how to get it
    raise ImportError(f'exactref.backends.torch needs torch ({exc}): pip install "exactref[torch]"') from None
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er
from exactref.harness.kernels import FLOAT8_INPUTS, FORMATS

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
    # The CPU fused kernel departs from the math path on NaN and inf inputs (a NaN logit passes
    # for a masked one, so its row comes out 0), and exactref's normal answer is the math path's:
    # special values are audited there.  The departures themselves are shown in
    # tests/exactref/test_audit_findings.py and docs/audit.md.
    return _sdpa(query, key, value, attn_mask, _any_special(query, key, value), **kwargs)


def _attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor,
                        attn_mask: Any = None, **kwargs: Any) -> dict[str, torch.Tensor]:
    """Autograd through :func:`_attention`, through the math path also where ``grad`` holds NaN or inf.

    The CPU fused kernel's backward forms D = rowsum(dO * O), the math path's sum_j P_ij dP_ij: with
    an infinite dO and values of both signs the first is an infinity and the second NaN, so dS and
    the gradients differ (tests/exactref/test_audit_findings.py).
    """
    leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    _sdpa(*leaves, attn_mask, _any_special(query, key, value, grad), **kwargs).backward(grad)
    return {f"grad_{name}": t.grad if t.grad is not None else torch.zeros_like(t)
            for name, t in zip(("query", "key", "value"), leaves)}


def _any_special(*tensors: torch.Tensor) -> bool:
    return not all(bool(torch.isfinite(t).all()) for t in tensors)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, special: bool,
          **kwargs: Any) -> torch.Tensor:
    # PyTorch's SDPA reads the mask's last two dims, so a 0-d or 1-d mask (which broadcasts to
    # (L, S) all the same) is given them first; the values it holds do not change.
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.ndim) + tuple(attn_mask.shape))
    math = special and query.device.type == "cpu"
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
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


def _scaled_mm(A: torch.Tensor, B: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               use_fast_accum: bool = False) -> torch.Tensor:
    # torch._scaled_mm takes B column-major only (as cuBLASLt's float8 kernels do): the same values.
    return torch._scaled_mm(A, B.t().contiguous().t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def _runs(fn: Any) -> bool:
    """Whether ``fn()`` returns: the probe of a dtype a kernel may not have on this device."""
    try:
        fn()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


# oneDNN's _scaled_mm (tensor-wise scales on the CPU) turns a float32 result below float32's smallest
# normal into 0 on the way to bfloat16; such a result needs a subnormal bias (the products of float8
# values and scales of at least 2**-16 are normal or zero), so the bias draws no subnormals.  The
# departure is shown in tests/plugin/test_float8_audit.py and docs/audit.md.
_BIAS_SPECIALS = ("signed_zero", "infinity", "nan", "min_normal", "max_finite", "power_of_two",
                  "near_power_of_two", "overflow")
# 16 x 16, since cuBLASLt's float8 kernels need sides that are multiples of 16.
_PROBE = 16


def _probe_operand(dtype: torch.dtype, device: str, corner: float = 0.0) -> torch.Tensor:
    t = torch.zeros((_PROBE, _PROBE), device=device)
    t[0, 0] = corner
    return t.to(dtype)


def _scales(kind: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit scales of the kind: one float32 each (tensor-wise), or per row of A and column of B."""
    shapes = ((), ()) if kind == "tensor" else ((_PROBE, 1), (1, _PROBE))
    return torch.ones(shapes[0], device=device), torch.ones(shapes[1], device=device)


def _corner(dtype: torch.dtype, kind: str, device: str, value: float, scale: float = 1.0) -> float:
    """Element (0, 0) of _scaled_mm with ``value`` there in A and B and the scale_a ``scale``, out in dtype."""
    sa, sb = _scales(kind, device)
    A = _probe_operand(torch.float8_e4m3fn, device, value)
    # The second of two calls: the first oneDNN call of a process was seen to round once and saturate
    # (tests/exactref/test_float8_torch.py).
    return [float(_scaled_mm(A, A, sa * scale, sb, out_dtype=dtype)[0, 0].float()) for _ in range(2)][-1]


# Just above the midpoint 1.0625 of float8_e4m3fn's 1 and 1.125: the first rounds to that midpoint in
# float16 and bfloat16, the second only in bfloat16 (and the tie then goes to 1, the even one).
_NEAR_TIES = (1.0625 + 2.0 ** -12, 1.0625 + 2.0 ** -9)


def _path(kind: str, device: str) -> dict[str, str]:
    """The reference options of _scaled_mm's float8 outputs under scales of ``kind``, read off torch."""
    e4m3 = torch.float8_e4m3fn
    options = {}
    # 448 * 448 overflows float8_e4m3fn: +448 saturates (exactref's default, torch's cast), NaN does not.
    if math.isnan(_corner(e4m3, kind, device, 448.0)):
        options["saturation"] = "nosat"
    got = [_corner(e4m3, kind, device, 1.0, float(np.float32(x))) for x in _NEAR_TIES]
    for via in ("float16", "bfloat16"):
        # A kernel that rounds to ``via`` first, then to float8, as er.scaled_matmul's output_via describes.
        twice = [float(er.asarray(er.asarray(x, via), "float8_e4m3fn")) for x in _NEAR_TIES]
        if got != [1.125, 1.125] and got == twice:
            options["output_via"] = via
            break
    return options


@functools.lru_cache(maxsize=16)
def _float8(device: str, mkldnn: bool) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, dict[str, str]]]:
    """The float8 formats torch.matmul and torch._scaled_mm compute on ``device``, and by kind of scale the
    reference options of _scaled_mm's float8 outputs there, each read off torch by running it.

    Probed, not assumed: torch 2.13 on the CPU runs _scaled_mm through oneDNN when mkldnn is enabled
    (the default) and both scales are tensor-wise.  oneDNN takes no fnuz inputs, and converts its float32
    result to float8 through float16, a double rounding (1.0625 + 2**-12 gives 1, not 1.125), without
    saturating (NaN where float8_e4m3fn overflows).  Row-wise scales, or mkldnn disabled, take torch's
    emulated path, which rounds once and saturates to +-448, as torch's cast does.  Other devices and
    versions may differ again.  The probes are 16 x 16, so that row-wise scales are not one value each
    (and cuBLASLt's sides are multiples of 16); ``mkldnn`` is in the cache key, so that a module built
    under torch.backends.mkldnn.flags(enabled=False) probes that path.
    """
    one = torch.ones((), device=device)
    dtypes = {name: getattr(torch, name) for name in FLOAT8_INPUTS}
    matmul = tuple(n for n, dt in dtypes.items()
                   if _runs(lambda dt=dt: torch.matmul(_probe_operand(dt, device), _probe_operand(dt, device))))
    scaled = tuple(n for n, dt in dtypes.items() if _runs(
        lambda dt=dt: _scaled_mm(_probe_operand(dt, device), _probe_operand(dt, device), one, one,
                                 out_dtype=torch.float32)))
    paths = {kind: _path(kind, device) if "float8_e4m3fn" in scaled else {} for kind in ("tensor", "row")}
    return matmul, scaled, paths


def _scaled_mm_options(paths: dict[str, dict[str, str]], inputs: dict[str, Any],
                       kwargs: dict[str, Any]) -> dict[str, Any]:
    """The reference options of one case: those of the path its kind of scales takes, for a float8 output."""
    kind = "tensor" if all(np.size(inputs[k]) == 1 for k in ("scale_a", "scale_b")) else "row"
    out = kwargs.get("out_dtype") or inputs["A"].dtype
    return dict(paths[kind]) if er.format_of(out).name in FLOAT8_INPUTS else {}


def kernels(device: str = "cpu") -> dict[str, Any]:
    """PyTorch's kernel of every op exactref has, with the models that describe them on ``device``."""
    mm_forward, mm_backward = _matmul_models(device)
    float8_matmul, float8_scaled, paths = _float8(device, bool(torch.backends.mkldnn.enabled))
    autograd = er.models.PYTORCH_AUTOGRAD
    attention = _attention_models(device)
    table: dict[str, Any] = {
        # Float8 too, forward only (PyTorch has no float8 backward): on the CPU a float32 matmul, then a cast.
        "matmul": {"forward": torch.matmul, "backward": "autograd", "model": mm_forward,
                   "backward_model": mm_backward, "formats": FORMATS + float8_matmul},
        # gemm is addmm, so A and B are matrices (gemm_inputs draws batch dims otherwise).
        "gemm": {"forward": _gemm, "backward": "autograd", "model": mm_forward, "backward_model": mm_backward,
                 "strategy_options": {"max_batch_dims": 0}},
        "add": {"forward": torch.add, "backward": "autograd", "backward_model": autograd},
        "multiply": {"forward": torch.mul, "backward": "autograd", "backward_model": autograd},
        "sum": {"forward": _sum, "backward": "autograd", "backward_model": autograd},
        "scaled_dot_product_attention": {"forward": _attention, "backward": _attention_backward,
                                         "model": attention},
        "matrix_exp": {"forward": torch.linalg.matrix_exp, "backward": "autograd",
                       "known_failures": dict.fromkeys(_HALF, _MEXP_HALF_BUG)},
        "matrix_exp_frechet": {"forward": _frechet, "known_failures": dict.fromkeys(_HALF, _MEXP_HALF_BUG)},
    }
    if float8_scaled:
        table["scaled_matmul"] = {"forward": _scaled_mm, "formats": float8_scaled,
                                  "reference_options": functools.partial(_scaled_mm_options, paths),
                                  "strategy_options": {"bias_specials": _BIAS_SPECIALS}}
    return table


#: A function of the device, so that the models follow the device's matmul settings.
EXACTREF_KERNELS = kernels
