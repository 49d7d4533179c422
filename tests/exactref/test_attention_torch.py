"""scaled_dot_product_attention against PyTorch: no false alarms on correct kernels, and a zoo of broken ones.

* PyTorch's math path (``sdpa_kernel(SDPBackend.MATH)``) is covered under
  AttentionAlgorithm.MATH, forward and backward, on generated cases of every
  kind: all four formats, bool and float masks, causal, non-default scale,
  GQA and broadcast batch dims.
* PyTorch's CPU fused kernel (``_scaled_dot_product_flash_attention_for_cpu``,
  what CPU dispatch picks without a mask or with is_causal) is covered under
  MATH for float32 and float64, and under FLASH_ATTENTION for float16 and
  bfloat16.
* Every broken kernel of the zoo is rejected under the default model, on an
  input where PyTorch's correct kernel is covered, so each rejection is the
  bug's doing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import exactref as er

TORCH = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
MATH = er.AttentionAlgorithm.MATH
FLASH = er.AttentionAlgorithm.FLASH_ATTENTION


def torch_sdpa(q, k, v, grad, backend=None, **kw):
    """PyTorch's output and gradients (grad_query, grad_key, grad_value) with the given backend."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if backend is None:
        out = F.scaled_dot_product_attention(*leaves, **kw)
    else:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def assert_covered(result, grads, out, torch_grads):
    assert result.covers(out).all(), "output"
    for name, got in zip(("grad_query", "grad_key", "grad_value"), torch_grads):
        assert grads[name].covers(got).all(), name


@st.composite
def torch_cases(draw, formats=("float32", "float64", "float16", "bfloat16")):
    fmt = draw(st.sampled_from(formats))
    kind = draw(st.sampled_from(["plain", "bool_mask", "float_mask", "causal", "gqa", "broadcast"]))
    H = draw(st.integers(1, 2))
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 9))
    E = draw(st.sampled_from([1, 3, 8, 16]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    magnitude = draw(st.sampled_from([0.01, 1.0, 4.0]))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, mag=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * mag).to(TORCH[fmt])

    qb, kb = (1, H), (1, H)
    kw = {}
    if kind == "gqa":
        qb, kb = (1, 2 * H), (1, H)
        kw["enable_gqa"] = True
    elif kind == "broadcast":
        qb, kb = (2, 1), (1, H)
    q = randn(*qb, L, E, mag=magnitude)
    k = randn(*kb, S, E, mag=magnitude)
    v = randn(*kb, S, E)
    if kind == "bool_mask":
        kw["attn_mask"] = torch.rand(L, S, generator=gen) < 0.7
    elif kind == "float_mask":
        m = randn(L, S, mag=2.0)
        m[torch.rand(L, S, generator=gen) < 0.2] = -math.inf
        kw["attn_mask"] = m
    elif kind == "causal":
        kw["is_causal"] = True
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.5, 0.3, 1.7]))
    out_batch = qb if kind == "gqa" else torch.broadcast_shapes(qb, kb)
    grad = randn(*out_batch, L, E)
    return fmt, q, k, v, grad, kw


@settings(deadline=None, max_examples=100)
@given(torch_cases())
def test_math_path_is_covered_under_MATH(case):
    _, q, k, v, grad, kw = case
    out, grads = torch_sdpa(q, k, v, grad, SDPBackend.MATH, **kw)
    r = er.scaled_dot_product_attention(q, k, v, **kw)
    assert_covered(r, r.backward(grad), out, grads)


@settings(deadline=None, max_examples=100)
@given(torch_cases(formats=("float32", "float64")), st.sampled_from([MATH, FLASH]))
def test_cpu_fused_kernel_is_covered_under_MATH_for_float32_and_float64(case, algorithm):
    _, q, k, v, grad, kw = case
    kw.pop("enable_gqa", None)
    if q.shape[:-2] != k.shape[:-2]:
        return  # the fused kernel takes no broadcast batch dims; dispatch would pick the math path
    out, grads = torch_sdpa(q, k, v, grad, SDPBackend.FLASH_ATTENTION, **kw)
    r = er.scaled_dot_product_attention(q, k, v, **kw, algorithm=algorithm)
    assert_covered(r, r.backward(grad), out, grads)


@settings(deadline=None, max_examples=100)
@given(torch_cases(formats=("float16", "bfloat16")))
def test_cpu_fused_kernel_is_covered_under_FLASH_for_half_formats(case):
    _, q, k, v, grad, kw = case
    kw.pop("enable_gqa", None)
    if q.shape[:-2] != k.shape[:-2]:
        return
    out, grads = torch_sdpa(q, k, v, grad, SDPBackend.FLASH_ATTENTION, **kw)
    r = er.scaled_dot_product_attention(q, k, v, **kw, algorithm=FLASH)
    assert_covered(r, r.backward(grad), out, grads)


def test_cpu_default_dispatch_is_the_fused_kernel():
    # The spec's third block relies on this: CPU dispatch sends float32 with
    # is_causal to the fused kernel, so the default model must cover it.
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with torch.profiler.profile() as prof:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.backward(torch.ones_like(out))
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names


@pytest.mark.parametrize("fmt,algorithm", [("float32", MATH), ("float16", FLASH), ("bfloat16", FLASH)])
@pytest.mark.parametrize("L,S", [(200, 40), (40, 600)])
def test_cpu_fused_kernel_with_several_blocks_is_covered(fmt, algorithm, L, S):
    # 200 query rows use 64-row blocks; 600 keys need two 512-key blocks of the online softmax.
    gen = torch.Generator().manual_seed(L + S)
    q, k, v = (torch.randn(1, 2, n, 32, generator=gen).to(TORCH[fmt]) for n in (L, S, S))
    grad = torch.randn(1, 2, L, 32, generator=gen).to(TORCH[fmt])
    for kw in ({}, {"is_causal": True}):
        out, grads = torch_sdpa(q, k * 3, v, grad, SDPBackend.FLASH_ATTENTION, **kw)
        r = er.scaled_dot_product_attention(q, k * 3, v, **kw, algorithm=algorithm)
        assert_covered(r, r.backward(grad), out, grads)


def test_math_half_formats_are_not_covered_by_MATH_when_the_fused_kernel_rounds_the_weights():
    # Documented: for float16 the CPU fused kernel rounds P to float16 before P V,
    # which the MATH class does not budget; FLASH_ATTENTION does.
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).to(torch.float16) for _ in range(3))
    out, _ = torch_sdpa(q, k, v, torch.ones(1, 2, 64, 64, dtype=torch.float16), SDPBackend.FLASH_ATTENTION)
    assert not er.scaled_dot_product_attention(q, k, v).covers(out).all()
    assert er.scaled_dot_product_attention(q, k, v, algorithm=FLASH).covers(out).all()


# ---------------------------------------------------------------------------- the zoo


def reference(q, k, v, mask=None, is_causal=False, scale=None, *, enable_gqa=False, bug=None):
    """A plain float32 attention with PyTorch autograd, and the bugs of the zoo switched in by name."""
    dtype = q.dtype
    q, k, v = (t.float() for t in (q, k, v))
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = 1 / math.sqrt(E) if scale is None else scale
    if bug == "wrong_scale":
        s = 1 / E
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    logits = q @ k.transpose(-2, -1)
    if is_causal:
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        shift = S - L if bug == "causal_bottom_right" else 0
        mask = j <= i + shift
    add = torch.zeros(L, S)
    if mask is not None and bug != "ignored_mask":
        add = torch.where(mask, 0.0, -math.inf) if mask.dtype == torch.bool else mask.float()
    x = (logits + add) * s if bug == "mask_scaled" else logits * s + add
    if bug == "no_max_subtraction":
        e = torch.exp(x.to(dtype)).float()  # exp in the half format overflows for logits above 11
        P = e / e.sum(-1, keepdim=True)
    else:
        P = torch.softmax(x, -1)
        if bug != "nan_masked_row":
            P = torch.where(torch.isnan(P), 0.0, P)
    if bug == "pv_in_half":
        acc = torch.zeros(P.shape[:-1] + (v.shape[-1],), dtype=dtype)
        for j in range(S):
            acc = acc + (P[..., :, j:j + 1].to(dtype) * v[..., j:j + 1, :].to(dtype))
        return acc
    return (P @ v).to(dtype)


def manual_backward(q, k, v, grad, *, enable_gqa=False, bug=None):
    """grad_query, grad_key and grad_value by the spec's formulas, with the backward bugs of the zoo."""
    dtype = q.dtype
    q, k, v, g = (t.float() for t in (q, k, v, grad))
    s = 1 / math.sqrt(q.shape[-1])
    group = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    ke, ve = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    P = torch.softmax(q @ ke.transpose(-2, -1) * s, -1)
    dP = g @ ve.transpose(-2, -1)
    D = dP.mean(-1, keepdim=True) if bug == "wrong_D" else (P * dP).sum(-1, keepdim=True)
    dS = P * (dP - D)
    gq = s * dS @ ke
    gk = dS.transpose(-2, -1) @ q * (1 if bug == "grad_key_unscaled" else s)
    gv = P.transpose(-2, -1) @ g
    if group > 1:
        shape = k.shape[:-3] + (k.shape[-3], group) + gk.shape[-2:]
        if bug == "gqa_not_summed":
            gk, gv = gk.reshape(shape)[..., 0, :, :], gv.reshape(shape)[..., 0, :, :]
        else:
            gk, gv = gk.reshape(shape).sum(-3), gv.reshape(shape).sum(-3)
    return [t.to(dtype) for t in (gq, gk, gv)]


def _inputs(fmt, q_shape, k_shape, seed, mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(*q_shape, generator=gen) * mag).to(TORCH[fmt])
    k = (torch.randn(*k_shape, generator=gen) * mag).to(TORCH[fmt])
    v = torch.randn(*k_shape, generator=gen).to(TORCH[fmt])
    return q, k, v


FORWARD_BUGS = {
    # bug: (format, query shape, key shape, magnitude, keyword arguments)
    "wrong_scale": ("float32", (1, 2, 6, 16), (1, 2, 6, 16), 1.0, {}),
    "causal_bottom_right": ("float32", (1, 2, 4, 8), (1, 2, 7, 8), 1.0, {"is_causal": True}),
    "ignored_mask": ("float32", (1, 2, 5, 8), (1, 2, 5, 8), 1.0, {"mask": "bool"}),
    "nan_masked_row": ("float32", (1, 2, 5, 8), (1, 2, 5, 8), 1.0, {"mask": "bool_empty_row"}),
    "no_max_subtraction": ("float16", (1, 2, 6, 16), (1, 2, 6, 16), 4.0, {}),
    "mask_scaled": ("float32", (1, 2, 5, 8), (1, 2, 5, 8), 1.0, {"mask": "float"}),
    "pv_in_half": ("float16", (1, 1, 4, 16), (1, 1, 256, 16), 0.5, {}),
}


def _mask(kind, L, S):
    gen = torch.Generator().manual_seed(11)
    if kind == "float":
        return torch.randn(L, S, generator=gen) * 3
    m = torch.rand(L, S, generator=gen) < 0.6
    m[:, 0] = True
    if kind == "bool_empty_row":
        m[1] = False
    return m


@pytest.mark.parametrize("bug", sorted(FORWARD_BUGS))
def test_zoo_forward_bug_is_rejected(bug):
    fmt, qs, ks, mag, kw = FORWARD_BUGS[bug]
    q, k, v = _inputs(fmt, qs, ks, seed=len(bug), mag=mag)
    kw = dict(kw)
    if "mask" in kw:
        kw["attn_mask"] = _mask(kw.pop("mask"), qs[-2], ks[-2])
    r = er.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(SDPBackend.MATH):
        correct = F.scaled_dot_product_attention(q, k, v, **kw)
    assert r.covers(correct).all()
    # Our own float32 reference without the bug is covered too, so what is rejected is the bug.
    assert r.covers(reference(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False))).all()
    broken = reference(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False), bug=bug)
    assert not r.covers(broken).all()
    with pytest.raises(er.MismatchError):
        r.check(broken)


BACKWARD_BUGS = {
    "wrong_D": ((1, 2, 6, 16), (1, 2, 6, 16), False),
    "grad_key_unscaled": ((1, 2, 6, 16), (1, 2, 6, 16), False),
    "gqa_not_summed": ((1, 4, 6, 16), (1, 2, 6, 16), True),
}


@pytest.mark.parametrize("bug", sorted(BACKWARD_BUGS))
def test_zoo_backward_bug_is_rejected(bug):
    qs, ks, gqa = BACKWARD_BUGS[bug]
    q, k, v = _inputs("float32", qs, ks, seed=len(bug))
    grad = torch.randn(*qs, generator=torch.Generator().manual_seed(5))
    g = er.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).backward(grad)
    names = ("grad_query", "grad_key", "grad_value")
    correct = manual_backward(q, k, v, grad, enable_gqa=gqa)
    assert all(g[n].covers(t).all() for n, t in zip(names, correct))
    broken = manual_backward(q, k, v, grad, enable_gqa=gqa, bug=bug)
    assert not all(g[n].covers(t).all() for n, t in zip(names, broken))


def test_zoo_pv_in_half_passes_as_float32_accumulation_but_not_in_half():
    # The same P V in float32 accumulation is covered even under FLASH_ATTENTION's
    # weights rounded to float16; accumulating in float16 is not.
    fmt, qs, ks, mag, _ = FORWARD_BUGS["pv_in_half"]
    q, k, v = _inputs(fmt, qs, ks, seed=3, mag=mag)
    r = er.scaled_dot_product_attention(q, k, v, algorithm=FLASH)
    assert r.covers(reference(q, k, v)).all()
    assert not r.covers(reference(q, k, v, bug="pv_in_half")).all()


def test_a_real_pytorch_bug_is_caught_the_cpu_fused_kernel_with_is_causal_and_a_negative_scale():
    # Found by this suite on torch 2.13: the CPU fused kernel fills the causal mask with -inf
    # before it multiplies by the scale, so a negative scale turns the masked logits into +inf
    # and every affected row into NaN.  The math path gets it right.
    q, k, v = _inputs("float32", (1, 2, 5, 8), (1, 2, 5, 8), seed=9)
    grad = torch.ones(1, 2, 5, 8)
    r = er.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.5)
    out_math, _ = torch_sdpa(q, k, v, grad, SDPBackend.MATH, is_causal=True, scale=-0.5)
    assert r.covers(out_math).all()
    out_fused, _ = torch_sdpa(q, k, v, grad, SDPBackend.FLASH_ATTENTION, is_causal=True, scale=-0.5)
    assert torch.isnan(out_fused).any()
    with pytest.raises(er.SpecialValueError, match="NaN where the exact value is finite"):
        r.check(out_fused)


@settings(deadline=None, max_examples=100)
@given(torch_cases(formats=("float32", "float16", "bfloat16")), st.data())
def test_math_path_special_values_are_covered(case, data):
    # A few inputs replaced by NaN or +-inf: the normal answer must match the math path's
    # special values exactly, and its finite values stay within tolerance.
    _, q, k, v, grad, kw = case
    tensors = [q, k, v, grad]
    for _ in range(data.draw(st.integers(1, 3))):
        t = tensors[data.draw(st.integers(0, 3))]
        flat = t.view(-1)
        flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(st.sampled_from([math.inf, -math.inf, math.nan]))
    out, grads = torch_sdpa(q, k, v, grad, SDPBackend.MATH, **kw)
    r = er.scaled_dot_product_attention(q, k, v, **kw)
    assert_covered(r, r.backward(grad), out, grads)
    assert np.array_equal(np.isnan(r.rounded.astype(np.float64)), out.isnan().numpy())
