"""TRITON_FLASH_ATTENTION: the backward of Triton's fused-attention tutorial, emulated in numpy.

The emulation below does the tutorial's roundings one by one, in float32 and
float16 numpy arithmetic: a forward with an online softmax in base 2 over
blocks of 16 keys (weights rounded to float16 before P V, the output stored
in float16 and the base-2 logsumexp in float32), then a backward that
recomputes the weights as exp2(q . k' - M) from k' = K * (scale / ln 2)
rounded to float16, rounds dS = P (dP - D) to float16 (inf past 65504) and
multiplies it by that k' for grad_query.  On adversarial data (q scaled by 8,
every k' rounded up by 0.7 to 1 u_half against a q of its sign, |dS| on
both sides of 65504) its gradients are covered under TRITON_FLASH_ATTENTION,
not under FLASH_ATTENTION, and not once either new term is dropped.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import exactref as er
from exactref.ops.attention import _model

f16, f32 = np.float16, np.float32
TRITON = er.AttentionAlgorithm.TRITON_FLASH_ATTENTION
FLASH = er.AttentionAlgorithm.FLASH_ATTENTION
BLOCK = 16
LOG2E = 1.0 / math.log(2.0)


def tutorial_kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, causal: bool,
                    scale: float | None = None) -> dict[str, np.ndarray]:
    """The tutorial's forward and backward for float16 (L, E), (S, E), (S, Ev), (L, Ev): grads in float16."""
    L, E = q.shape
    S = k.shape[0]
    s = 1.0 / math.sqrt(E) if scale is None else scale
    q32, k32, v32, do32 = (a.astype(f32) for a in (q, k, v, do))
    keep = np.tril(np.ones((L, S), dtype=bool)) if causal else np.ones((L, S), dtype=bool)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # Forward: logits q k^T in float32, times the float32 sm_scale / ln 2, online over blocks.
        qk_scale = f32(s * LOG2E)
        m = np.full(L, -np.inf, dtype=f32)
        l_run = np.zeros(L, dtype=f32)
        acc = np.zeros((L, v.shape[1]), dtype=f32)
        for n0 in range(0, S, BLOCK):
            cols = slice(n0, n0 + BLOCK)
            x = ((q32 @ k32[cols].T) * qk_scale).astype(f32)
            x = np.where(keep[:, cols], x, f32(-np.inf))
            m_new = np.maximum(m, x.max(axis=1))
            p = np.exp2(x - m_new[:, None]).astype(f32)
            alpha = np.exp2(m - m_new).astype(f32)
            l_run = (l_run * alpha + p.sum(axis=1, dtype=f32)).astype(f32)
            acc = (acc * alpha[:, None] + p.astype(f16).astype(f32) @ v32[cols]).astype(f32)
            m = m_new
        o = (acc / l_run[:, None]).astype(f16)
        M = (m + np.log2(l_run)).astype(f32)
        # Backward: K' = K * (sm_scale / ln 2), in float32 and rounded to float16, once.
        k2 = (k32 * qk_scale).astype(f16).astype(f32)
        D = (o.astype(f32) * do32).sum(axis=1, dtype=f32)
        P = np.exp2((q32 @ k2.T).astype(f32) - M[:, None]).astype(f32)
        P = np.where(keep, P, f32(0))
        dP = (do32 @ v32.T).astype(f32)
        dS = (P * (dP - D[:, None]).astype(f32)).astype(f32)
        dS16 = dS.astype(f16).astype(f32)  # inf where |dS| >= 65520
        dq = ((dS16 @ k2).astype(f32) * f32(math.log(2.0))).astype(f32)
        dk = ((dS16.T @ q32).astype(f32) * f32(s)).astype(f32)
        dv = (P.astype(f16).astype(f32).T @ do32).astype(f32)
    return {"grad_query": dq.astype(f16), "grad_key": dk.astype(f16), "grad_value": dv.astype(f16)}


def judge(q, k, v, do, causal, algorithm, scale=None):
    g = er.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, algorithm=algorithm).backward(do)
    got = tutorial_kernel(q, k, v, do, causal, scale)
    return {name: g[name].covers(got[name]) for name in got}, got, g


def rounded_up_keys(n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """n float16 values in [1, 2) whose k * f32(scale / ln 2), rounded to float16, is at least 0.7 u_half high."""
    t = np.arange(1024, 2048, dtype=np.float64) / 1024  # every float16 in [1, 2)
    c = float(f32(scale * LOG2E))
    exact = t * (scale * LOG2E)
    got = (t.astype(f32) * f32(c)).astype(f16).astype(np.float64)
    rel = (got - exact) / exact
    best = t[rel > 0.7 * 2.0 ** -11]
    assert best.size >= 16  # the relative rounding errors of k c spread over [-u, u]
    return rng.choice(best, size=n).astype(f16)


def aligned_case(L: int, S: int, E: int, seed: int):
    """q about 8 with random signs, k' each rounded up against q's sign: every recomputed logit too high."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], size=E)
    q = (8 * sign * rng.uniform(0.9, 1.0, size=(L, E))).astype(f16)
    k = (sign * rounded_up_keys(S * E, rng, 1 / math.sqrt(E)).reshape(S, E)).astype(f16)
    v = rng.standard_normal((S, E)).astype(f16)
    do = rng.standard_normal((L, E)).astype(f16)
    return q, k, v, do


def overflow_case():
    """q = 0 and two keys: P = 1/2, D = 0 and dS = +-128 dO, so row 0's dS is +-65536 (inf in float16),
    row 1's +-65408 (finite, 3 ulps below the largest float16)."""
    q = np.zeros((2, 1), dtype=f16)
    k = np.array([[0.0], [1.0]], dtype=f16)
    v = np.array([[256.0], [-256.0]], dtype=f16)
    do = np.array([[512.0], [511.0]], dtype=f16)
    return q, k, v, do


@pytest.mark.parametrize("causal", [False, True])
def test_the_tutorial_backward_on_aligned_roundings_is_covered_only_by_the_new_class(causal):
    q, k, v, do = aligned_case(24, 40, 64, seed=1 + causal)
    ok, _, _ = judge(q, k, v, do, causal, TRITON)
    assert all(bool(c.all()) for c in ok.values()), {n: int((~c).sum()) for n, c in ok.items()}
    # The logits are 93 to 99 nats and each is about 0.8 u_half of that too high: the weights
    # 4% off, where FLASH_ATTENTION budgets float32 roundings of the logits.
    flash, _, _ = judge(q, k, v, do, causal, FLASH)
    assert not flash["grad_value"].all()


@pytest.mark.parametrize("seed, causal", [(3, False), (4, True)])
def test_the_tutorial_backward_on_random_data_with_q_scaled_by_8_is_covered(seed, causal):
    rng = np.random.default_rng(seed)
    L, S, E = 48, 80, 32
    q = (8 * rng.standard_normal((L, E))).astype(f16)
    k, v = rng.standard_normal((S, E)).astype(f16), rng.standard_normal((S, E)).astype(f16)
    do = rng.standard_normal((L, E)).astype(f16)
    ok, _, _ = judge(q, k, v, do, causal, TRITON)
    assert all(bool(c.all()) for c in ok.values()), {n: int((~c).sum()) for n, c in ok.items()}


def test_ds_overflow_is_accepted_only_where_ds_may_overflow():
    q, k, v, do = overflow_case()
    ok, got, g = judge(q, k, v, do, False, TRITON)
    assert np.isnan(got["grad_key"]).all() and np.isnan(got["grad_query"][0]).all()
    assert np.isfinite(got["grad_query"][1]).all()
    assert all(bool(c.all()) for c in ok.values()), ok
    # Row 1's dS stays finite: its grad_query must be finite, and within the finite tolerance.
    assert not g["grad_query"].covers(np.array([[np.inf], [np.inf]], dtype=f16))[1].any()
    assert not g["grad_query"].covers(np.array([[0.0], [0.0]], dtype=f16))[1].any()
    # grad_value does not use dS: NaN is not accepted there.
    assert not g["grad_value"].covers(np.full((2, 1), np.nan, dtype=f16)).any()


def test_without_the_prescaled_term_the_aligned_case_is_rejected(monkeypatch):
    # The mutation: the same class with prescaled_operands_in_input_format off.
    q, k, v, do = aligned_case(24, 40, 64, seed=1)
    tol = TRITON.backward_tolerance
    monkeypatch.setattr(er.AttentionAlgorithm, "backward_tolerance", property(
        lambda self: dataclasses.replace(tol, prescaled_operands_in_input_format=False) if self is TRITON
        else self.value[1]))
    ok, _, _ = judge(q, k, v, do, False, TRITON)
    assert not all(bool(c.all()) for c in ok.values())


def test_without_the_ds_overflow_the_nan_gradients_are_rejected(monkeypatch):
    # The mutation: no dS bound ever reaches 65504, so no overflow is accepted.
    q, k, v, do = overflow_case()
    monkeypatch.setattr(_model, "ds_kernel_bound", lambda fp, *args: np.zeros(fp.unmasked.shape))
    ok, _, _ = judge(q, k, v, do, False, TRITON)
    assert not ok["grad_key"].any() and not ok["grad_query"][0].any()
