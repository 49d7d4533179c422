"""Attention input sets: shapes, masks, causal, scale, GQA and the hard classes, each as promised."""

import math

import numpy as np

import strategies as sx
from exactref.formats import format_of

from ._collect import each


def score_shape(case):
    q, k = case.query, case.key
    heads = (q.shape[-3],) if case.enable_gqa else ()
    qb = q.shape[:-3] if case.enable_gqa else q.shape[:-2]
    kb = k.shape[:-3] if case.enable_gqa else k.shape[:-2]
    return np.broadcast_shapes(qb, kb) + heads + (q.shape[-2], k.shape[-2])


def test_shapes_masks_and_options_are_consistent_and_all_appear():
    seen = set()

    def check(case):
        q, k, v = case.query, case.key, case.value
        assert q.shape[-1] == k.shape[-1] and k.shape[:-1] == v.shape[:-1]
        assert case.dropout_p == 0.0
        assert not (case.is_causal and case.attn_mask is not None), "PyTorch refuses both"
        scores = score_shape(case)
        assert case.grad.shape == scores[:-1] + (v.shape[-1],)
        if case.enable_gqa:
            assert q.shape[-3] % k.shape[-3] == 0
            seen.add("gqa groups" if q.shape[-3] > k.shape[-3] else "gqa")
        mask = case.attn_mask
        if mask is not None:
            assert np.broadcast_shapes(mask.shape, scores) == scores
            assert mask.ndim >= 2, "PyTorch refuses a mask of fewer dims"
            seen.add("bool mask" if mask.dtype == np.bool_ else "float mask")
            if mask.dtype != np.bool_ and np.isneginf(mask.astype(np.float64)).any():
                seen.add("-inf in a float mask")
        if case.is_causal and q.shape[-2] != k.shape[-2]:
            seen.add("causal with L != S")
        if case.scale is not None:
            seen.add("scale")
        if q.ndim > (3 if case.enable_gqa else 2) and q.shape[:-2] != k.shape[:-2]:
            seen.add("broadcast batch")
        return len(seen) == 8

    each(sx.scaled_dot_product_attention_inputs(), 400, check)
    assert seen == {"gqa", "gqa groups", "bool mask", "float mask", "-inf in a float mask", "causal with L != S",
                    "scale", "broadcast batch"}


def test_hard_classes_hold_and_appear_with_both_mask_kinds():
    seen = set()

    def check(case):
        mask = case.attn_mask
        for h in case.hard:
            if h.kinds == ("masked_row",):
                row = mask[h.index]
                if mask.dtype == np.bool_:
                    assert not row.any()
                    seen.add("bool masked row")
                else:
                    assert np.isneginf(row.astype(np.float64)).all()
                    seen.add("float masked row")
            else:
                assert h.kinds == ("large_scores",)
                *row, s = h.index
                scale = case.scale if case.scale is not None else 1 / math.sqrt(case.query.shape[-1])
                q = np.broadcast_to(case.query, score_shape(case)[:-1] + case.query.shape[-1:])
                if case.enable_gqa:
                    groups = case.query.shape[-3] // case.key.shape[-3]
                    k = np.repeat(case.key, groups, axis=-3)
                else:
                    k = case.key
                k = np.broadcast_to(k, score_shape(case)[:-2] + k.shape[-2:])
                score = float(np.dot(q[tuple(row)].astype(np.float64),
                                     k[tuple(row[:-1]) + (s,)].astype(np.float64))) * scale
                # exp(score) overflows the format unless the row maximum is subtracted first
                assert score > math.log(format_of(case.query.dtype).max_finite)
                if mask is not None:
                    m = np.broadcast_to(mask, score_shape(case))[tuple(row) + (s,)]
                    assert m if mask.dtype == np.bool_ else m == 0
                seen.add("large scores")
        return len(seen) == 3

    each(sx.scaled_dot_product_attention_inputs(dtypes=["float32", "float16"]), 400, check)
    assert seen == {"bool masked row", "float masked row", "large scores"}


def test_switches_turn_options_off():
    def check(case):
        assert case.attn_mask is None and not case.is_causal and not case.enable_gqa and case.scale is None
        assert case.hard == ()
    each(sx.scaled_dot_product_attention_inputs(masks=False, causal=False, gqa=False, scale=False, hard=False),
         40, check)


def test_plain_values_respect_max_abs():
    def check(case):
        for a in (case.query, case.key, case.value):
            assert np.abs(a.astype(np.float64)).max() <= 0.5
    each(sx.scaled_dot_product_attention_inputs(max_abs=0.5, specials=False, hard=False), 40, check)
