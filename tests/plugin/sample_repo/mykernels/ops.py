"""matmul and add kernels written out by hand, as a kernel repository would, with plantable bugs."""

import torch

from .bugs import BUGS


def matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    if "fp16_accumulation" in BUGS and A.dtype == torch.float16:
        # Bug: products and partial sums are rounded to float16 instead of accumulating in float32.
        shape = (*torch.broadcast_shapes(A.shape[:-2], B.shape[:-2]), A.shape[-2], B.shape[-1])
        out = torch.zeros(shape, dtype=torch.float16)
        for k in range(A.shape[-1]):
            out = out + A[..., :, k:k + 1] * B[..., k:k + 1, :]
        return out
    return torch.matmul(A, B)


def _sum_to(g: torch.Tensor, shape: torch.Size, bug: bool = False) -> torch.Tensor:
    """Sum a gradient over the broadcast copies of an operand of the given shape."""
    if bug and g.shape != shape:
        # Bug: keeps the first broadcast copy instead of summing all of them.
        g = g[(0,) * (g.ndim - len(shape))]
        return g[tuple(slice(0, 1) if s == 1 else slice(None) for s in shape)]
    return g.sum_to_size(shape)


def matmul_backward(A: torch.Tensor, B: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    # Computed in double precision and rounded once, so that only the planted bugs can show.
    wide = torch.complex128 if A.is_complex() else torch.float64
    Aw, Bw, gw = (t.to(wide) for t in (A, B, grad))
    B_h = Bw.mT if "missing_conj" in BUGS else Bw.mH  # bug: the conjugate is missing
    grad_A = _sum_to(gw @ B_h, A.shape)
    grad_B = _sum_to(Aw.mH @ gw, B.shape, bug="unsummed_broadcast" in BUGS)
    return {"grad_A": grad_A.to(A.dtype), "grad_B": grad_B.to(B.dtype)}


def add(x: torch.Tensor, y, *, alpha: float = 1) -> torch.Tensor:
    if "add_raises" in BUGS and x.ndim == 0:
        raise RuntimeError("add: 0-d tensors are not supported")
    return torch.add(x, y, alpha=alpha)
