"""A tiled matmul: BLOCK_M x BLOCK_N tiles of C, each summed over BLOCK_K slices of K in float32.

The backward is two more launches of the same kernel on transposed views
(grad_A = G B^T, grad_B = A^T G): a transpose is only a swap of strides.
"""

import torch
import triton
import triton.language as tl

from .bugs import BUGS

BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 16


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, FP16_ACC: tl.constexpr, DROP_LAST_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if FP16_ACC:
        # Planted bug: the running sum is kept in float16, rounded after every K slice.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Planted bug: K // BLOCK_K slices, which forgets the partial slice at the end.
    n_k = K // BLOCK_K if DROP_LAST_K else tl.cdiv(K, BLOCK_K)
    for kb in range(n_k):
        k = kb * BLOCK_K + ks
        # Out-of-range rows, columns and k are loaded as zeros, which add nothing to the sums
        # of the elements that are stored.
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        if IEEE:
            # float32 inputs: full-precision products (a GPU's default for tl.dot is TF32).
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif FP16_ACC:
            acc = tl.dot(a, b, acc, out_dtype=tl.float16)
        else:
            acc = tl.dot(a, b, acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, c,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """C = A @ B for 2-D A (M, K) and B (K, N) of one format, views with any strides."""
    M, K = A.shape
    N = B.shape[1]
    C = torch.empty((M, N), dtype=A.dtype, device=A.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](A, B, C, M, N, K, A.stride(0), A.stride(1), B.stride(0), B.stride(1),
                         C.stride(0), C.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         IEEE=A.dtype == torch.float32,
                         FP16_ACC="fp16_accumulation" in BUGS and A.dtype == torch.float16,
                         DROP_LAST_K="drop_last_k_block" in BUGS)
    return C


def matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0] or A.dtype != B.dtype:
        raise ValueError(f"matmul takes 2-D matrices (M, K) and (K, N) of one dtype; got A {tuple(A.shape)} "
                         f"{A.dtype} and B {tuple(B.shape)} {B.dtype}")
    return _launch(A, B)


def matmul_backward(A: torch.Tensor, B: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"grad_A": _launch(grad, B.mT), "grad_B": _launch(A.mT, grad)}
