"""FlashAttention-2 style attention, forward and backward, in the manner of Triton's fused-attention tutorial.

Forward: each program takes BLOCK_M query rows and walks the keys in blocks
of BLOCK_N with an online softmax kept in base 2: the logits are multiplied by
sm_scale / ln 2 so that exp2 can stand for exp, the running maximum rescales
the float32 row sums and output accumulator, and the weights are rounded to
float16 before they multiply V.  It stores the output and, per row, the
base-2 logsumexp M for the backward.

Backward: D = rowsum(dO * O) first; then one kernel for dK and dV (a program
per block of keys, walking the query rows) and one for dQ (a program per
block of query rows, walking the keys).  Both recompute the weights as
exp2(q . k' - M) from a K' = K * (sm_scale / ln 2) that is computed once and
rounded to float16, as the tutorial does, and round dS = P (dP - D) to
float16 before its matmuls.  Those two roundings (and dS's overflow past
65504) are what ExactRef's TRITON_FLASH_ATTENTION class adds to
FLASH_ATTENTION (see docs/triton.md).

Shapes: query (..., L, E), key (..., S, E), value (..., S, Ev), with batch
dims that broadcast; every size may be anything (partial blocks are masked).
No attn_mask, no dropout, no GQA; is_causal puts the causal mask top-left,
as PyTorch does (query row i sees keys 0..i).
"""

import math

import torch
import triton
import triton.language as tl

from .bugs import BUGS

BLOCK_M, BLOCK_N = 16, 16
LOG2E = 1.0 / math.log(2.0)  # 1 / ln 2
LN2 = math.log(2.0)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _attn_fwd(Q, K, V, O, M, qk_scale, L, S, E, EV,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
              CAUSAL: tl.constexpr, PV_FP16_ACC: tl.constexpr, SKIP_RESCALE: tl.constexpr,
              STRICT_CAUSAL: tl.constexpr):
    # Every tensor is contiguous (Z, rows, features); program (i, z) owns rows i*BLOCK_M.. of batch z.
    start = tl.program_id(0) * BLOCK_M
    z = tl.program_id(1)
    rows = start + tl.arange(0, BLOCK_M)
    e = tl.arange(0, BLOCK_E)
    ev = tl.arange(0, BLOCK_EV)
    row_ok = rows < L
    q = tl.load(Q + z * L * E + rows[:, None] * E + e[None, :], mask=row_ok[:, None] & (e[None, :] < E), other=0.0)
    # The running maximum and sum are in the base-2 domain of qk_scale = sm_scale / ln 2.
    m_run = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_run = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PV_FP16_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_EV), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_EV), dtype=tl.float32)
    # Under the causal mask, no key after the block's last row is seen: stop there.
    stop = tl.minimum(S, start + BLOCK_M) if CAUSAL else S
    for n0 in range(0, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < S
        kt = tl.load(K + z * S * E + cols[None, :] * E + e[:, None], mask=col_ok[None, :] & (e[:, None] < E),
                     other=0.0)
        logits = tl.dot(q, kt) * qk_scale
        keep = col_ok[None, :]
        if CAUSAL:
            if STRICT_CAUSAL:
                keep = keep & (rows[:, None] > cols[None, :])  # planted bug: a row no longer sees its own key
            else:
                keep = keep & (rows[:, None] >= cols[None, :])
        logits = tl.where(keep, logits, float("-inf"))
        # Key 0 is in the first block and every row sees it, so m_new is finite from the start.
        m_new = tl.maximum(m_run, tl.max(logits, 1))
        p = tl.math.exp2(logits - m_new[:, None])
        alpha = tl.math.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.sum(p, 1)
        v = tl.load(V + z * S * EV + cols[:, None] * EV + ev[None, :], mask=col_ok[:, None] & (ev[None, :] < EV),
                    other=0.0)
        if SKIP_RESCALE:
            # Planted bug: the accumulator is not rescaled when the second block raises the maximum.
            acc = acc * tl.where(n0 == BLOCK_N, 1.0, alpha)[:, None]
        else:
            acc = acc * alpha[:, None]
        if PV_FP16_ACC:
            acc = tl.dot(p.to(tl.float16), v, acc.to(tl.float32)).to(tl.float16)  # planted bug: P V summed in float16
        else:
            acc = tl.dot(p.to(tl.float16), v, acc)
        m_run = m_new
    out = acc.to(tl.float32) / l_run[:, None]
    tl.store(O + z * L * EV + rows[:, None] * EV + ev[None, :], out.to(tl.float16),
             mask=row_ok[:, None] & (ev[None, :] < EV))
    tl.store(M + z * L + rows, m_run + tl.math.log2(l_run), mask=row_ok)


@triton.jit
def _dot(a, b, acc, HALF: tl.constexpr):
    # HALF: float16 operands, as the tutorial has them; otherwise both in float32 with exact products.
    if HALF:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _attn_bwd_delta(O, DO, D, L, EV, BLOCK_M: tl.constexpr, BLOCK_EV: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    z = tl.program_id(1)
    ev = tl.arange(0, BLOCK_EV)
    ok = (rows[:, None] < L) & (ev[None, :] < EV)
    where = z * L * EV + rows[:, None] * EV + ev[None, :]
    o = tl.load(O + where, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + where, mask=ok, other=0.0).to(tl.float32)
    tl.store(D + z * L + rows, tl.sum(o * do, 1), mask=rows < L)


@triton.jit
def _attn_bwd_dkdv(Q, K2, V, DO, M, D, DK, DV, sm_scale, L, S, E, EV,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                   CAUSAL: tl.constexpr, DS_FP16: tl.constexpr, K2_FP16: tl.constexpr):
    # Program (j, z) owns keys j*BLOCK_N.. of batch z and walks the query rows; K2 is the pre-scaled K.
    n0 = tl.program_id(0) * BLOCK_N
    z = tl.program_id(1)
    cols = n0 + tl.arange(0, BLOCK_N)
    e = tl.arange(0, BLOCK_E)
    ev = tl.arange(0, BLOCK_EV)
    col_ok = cols < S
    k2 = tl.load(K2 + z * S * E + cols[:, None] * E + e[None, :], mask=col_ok[:, None] & (e[None, :] < E), other=0.0)
    v = tl.load(V + z * S * EV + cols[:, None] * EV + ev[None, :], mask=col_ok[:, None] & (ev[None, :] < EV),
                other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_EV), dtype=tl.float32)
    # Under the causal mask only rows from this block's first key on see it.
    first = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start in range(first, L, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        qt = tl.load(Q + z * L * E + rows[None, :] * E + e[:, None], mask=row_ok[None, :] & (e[:, None] < E),
                     other=0.0)
        m = tl.load(M + z * L + rows, mask=row_ok, other=0.0)
        # The transposed weights P^T, recomputed in base 2 from the stored logsumexp.
        zero_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        pt = tl.math.exp2(_dot(k2, qt, zero_t, K2_FP16) - m[None, :])
        keep = col_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[None, :] >= cols[:, None])
        pt = tl.where(keep, pt, 0.0)
        do = tl.load(DO + z * L * EV + rows[:, None] * EV + ev[None, :], mask=row_ok[:, None] & (ev[None, :] < EV),
                     other=0.0)
        dv = tl.dot(pt.to(tl.float16), do, dv)
        delta = tl.load(D + z * L + rows, mask=row_ok, other=0.0)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk = _dot(dst, tl.trans(qt), dk, DS_FP16)
    tl.store(DK + z * S * E + cols[:, None] * E + e[None, :], dk * sm_scale, mask=col_ok[:, None] & (e[None, :] < E))
    tl.store(DV + z * S * EV + cols[:, None] * EV + ev[None, :], dv, mask=col_ok[:, None] & (ev[None, :] < EV))


@triton.jit
def _attn_bwd_dq(Q, K2, V, DO, M, D, DQ, L, S, E, EV,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
                 CAUSAL: tl.constexpr, DS_FP16: tl.constexpr, K2_FP16: tl.constexpr):
    start = tl.program_id(0) * BLOCK_M
    z = tl.program_id(1)
    rows = start + tl.arange(0, BLOCK_M)
    e = tl.arange(0, BLOCK_E)
    ev = tl.arange(0, BLOCK_EV)
    row_ok = rows < L
    q = tl.load(Q + z * L * E + rows[:, None] * E + e[None, :], mask=row_ok[:, None] & (e[None, :] < E), other=0.0)
    do = tl.load(DO + z * L * EV + rows[:, None] * EV + ev[None, :], mask=row_ok[:, None] & (ev[None, :] < EV),
                 other=0.0)
    m = tl.load(M + z * L + rows, mask=row_ok, other=0.0)
    delta = tl.load(D + z * L + rows, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    stop = tl.minimum(S, start + BLOCK_M) if CAUSAL else S
    for n0 in range(0, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < S
        k2t = tl.load(K2 + z * S * E + cols[None, :] * E + e[:, None], mask=col_ok[None, :] & (e[:, None] < E),
                      other=0.0)
        vt = tl.load(V + z * S * EV + cols[None, :] * EV + ev[:, None], mask=col_ok[None, :] & (ev[:, None] < EV),
                     other=0.0)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        p = tl.math.exp2(_dot(q, k2t, zero, K2_FP16) - m[:, None])
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[:, None] >= cols[None, :])
        p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        if DS_FP16:
            ds = ds.to(tl.float16)  # the tutorial's rounding of dS
        dq = _dot(ds, tl.trans(k2t), dq, DS_FP16 and K2_FP16)
    # K2 carries sm_scale / ln 2: ln 2 turns it back into sm_scale.
    tl.store(DQ + z * L * E + rows[:, None] * E + e[None, :], dq * LN2, mask=row_ok[:, None] & (e[None, :] < E))


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
           enable_gqa: bool) -> None:
    if attn_mask is not None or dropout_p != 0.0 or enable_gqa:
        raise ValueError(f"attention supports no attn_mask, no dropout and no GQA; got attn_mask={attn_mask is not None}"
                         f", dropout_p={dropout_p}, enable_gqa={enable_gqa}")
    if not (query.dtype == key.dtype == value.dtype == torch.float16):
        raise ValueError(f"attention takes float16 inputs; got {query.dtype}, {key.dtype}, {value.dtype}")


def _flat(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The inputs broadcast to one batch shape and made contiguous (Z, rows, features), and that batch shape."""
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    flat = [t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:]).contiguous() for t in (query, key, value)]
    return (*flat, tuple(batch))


def _sm_scale(scale, E: int) -> float:
    return 1.0 / math.sqrt(E) if scale is None else float(scale)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool):
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    o = torch.empty((Z, L, EV), dtype=torch.float16, device=q.device)
    m = torch.empty((Z, L), dtype=torch.float32, device=q.device)
    if L:
        _attn_fwd[(triton.cdiv(L, BLOCK_M), Z)](
            q, k, v, o, m, sm_scale * LOG2E, L, S, E, EV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_E=_pow2(E), BLOCK_EV=_pow2(EV), CAUSAL=causal, PV_FP16_ACC="pv_fp16_accumulation" in BUGS,
            SKIP_RESCALE="missing_rescale" in BUGS, STRICT_CAUSAL="strict_causal" in BUGS)
    return o, m


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
              is_causal: bool = False, scale=None, enable_gqa: bool = False) -> torch.Tensor:
    """softmax(scale q k^T) v, called like torch's scaled_dot_product_attention."""
    _check(query, key, value, attn_mask, dropout_p, enable_gqa)
    q, k, v, batch = _flat(query, key, value)
    o, _ = _forward(q, k, v, _sm_scale(scale, q.shape[-1]), is_causal)
    return o.reshape(*batch, *o.shape[1:])


def attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor,
                       attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                       enable_gqa: bool = False) -> dict[str, torch.Tensor]:
    _check(query, key, value, attn_mask, dropout_p, enable_gqa)
    q, k, v, batch = _flat(query, key, value)
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    sm_scale = _sm_scale(scale, E)
    o, m = _forward(q, k, v, sm_scale, is_causal)
    do = grad.expand(*batch, L, EV).reshape(Z, L, EV).contiguous()
    # The tutorial's pre-scaled K, rounded to float16 (the variant "float32_prescaled_k" keeps it in float32).
    k2 = k.float() * (sm_scale * LOG2E) if "float32_prescaled_k" in BUGS else k * (sm_scale * LOG2E)
    ds_fp16 = "float32_ds" not in BUGS
    # dK and dV are written in float32, so that the copies a broadcast batch made are summed before one rounding.
    dq = torch.zeros((Z, L, E), dtype=torch.float32, device=q.device)
    dk = torch.zeros((Z, S, E), dtype=torch.float32, device=q.device)
    dv = torch.zeros((Z, S, EV), dtype=torch.float32, device=q.device)
    if L and S:
        blocks = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_E": _pow2(E), "BLOCK_EV": _pow2(EV),
                  "CAUSAL": is_causal, "DS_FP16": ds_fp16, "K2_FP16": k2.dtype == torch.float16}
        delta = torch.empty((Z, L), dtype=torch.float32, device=q.device)
        _attn_bwd_delta[(triton.cdiv(L, BLOCK_M), Z)](o, do, delta, L, EV, BLOCK_M=BLOCK_M, BLOCK_EV=_pow2(EV))
        _attn_bwd_dkdv[(triton.cdiv(S, BLOCK_N), Z)](q, k2, v, do, m, delta, dk, dv, sm_scale, L, S, E, EV, **blocks)
        _attn_bwd_dq[(triton.cdiv(L, BLOCK_M), Z)](q, k2, v, do, m, delta, dq, L, S, E, EV, **blocks)
    grads = {}
    for name, g, like in (("grad_query", dq, query), ("grad_key", dk, key), ("grad_value", dv, value)):
        grads[name] = g.reshape(*batch, *g.shape[1:]).sum_to_size(like.shape).to(torch.float16)
    return grads
