"""Masking semantics of scaled_dot_product_attention: PyTorch's (the default) and JAX's.

PyTorch's math path adds the mask's -inf to the logits and gives 0 for a row
with no key to attend; ``jax.nn.dot_product_attention`` replaces masked
logits with a finite constant, so such a row weighs every key equally and a
NaN logit under the mask does not reach its row.  ``masked_rows="mean"`` and
``mask_nan="hide"`` select JAX's.  Expected values come from the independent
oracle (``_attention_oracle``, mpmath and Fractions) with the uniform rows'
terms added here in Fractions, and from the kernels themselves: torch's math
path and jax's dot_product_attention, each covered under its own semantics
and rejected under the other's.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

import exactref as er

from ._attention_oracle import Oracle, round_to

JAX = {"masked_rows": "mean", "mask_nan": "hide"}
GRADS = ("grad_query", "grad_key", "grad_value")


def _plus(x, y: Fraction):
    """An oracle value (Fraction or mpf) plus a Fraction, exactly where both are Fractions."""
    if isinstance(x, Fraction):
        return x + y
    return x + mpmath.mpf(y.numerator) / y.denominator


def _round(a: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda x: round_to(x, "float32"), otypes=[np.float64])(a)


def _masked_case():
    """float32: one query shared by two heads; head 0's row 1 masks every key, head 1's row 1 does not."""
    rng = np.random.default_rng(20260113)
    q = rng.uniform(-2, 2, (3, 2)).astype(np.float32)
    k = rng.uniform(-2, 2, (2, 4, 2)).astype(np.float32)
    v = rng.uniform(-2, 2, (2, 4, 3)).astype(np.float32)
    g = rng.uniform(-2, 2, (2, 3, 3)).astype(np.float32)
    mask = np.array([[[True, False, True, True], [False] * 4, [False, True, False, False]],
                     [[True, True, False, True], [False, False, True, True], [True] * 4]])
    return q, k, v, mask, g


def _expected(q, k, v, mask, g, mean: bool) -> dict[str, np.ndarray]:
    """The oracle's values rounded to float32; with ``mean``, a fully masked row weighs its S keys 1/S each."""
    o = Oracle(q, k, v, mask)
    out = o.out()
    grads = o.grads(g)
    if mean:
        S = k.shape[-2]
        for h, i in zip(*np.nonzero(~mask.any(axis=-1))):
            # The row's weights are constants: its output is the mean of v, grad_value gets dO_i / S per
            # key, and no gradient reaches its query or keys (the oracle's row adds nothing there).
            for c in range(v.shape[-1]):
                assert out[h, i, c] == 0
                out[h, i, c] = sum((Fraction(float(v[h, j, c])) for j in range(S)), Fraction(0)) / S
                for j in range(S):
                    grads["grad_value"][h, j, c] = _plus(grads["grad_value"][h, j, c],
                                                         Fraction(float(g[h, i, c])) / S)
    return {"out": _round(out), **{n: _round(a) for n, a in grads.items()}}


@pytest.mark.parametrize("mean", [False, True], ids=["zero", "mean"])
def test_fully_masked_row_matches_the_oracle(mean):
    q, k, v, mask, g = _masked_case()
    want = _expected(q, k, v, mask, g, mean)
    opts = {"masked_rows": "mean"} if mean else {}
    r = er.scaled_dot_product_attention(q, k, v, mask, **opts)
    assert np.array_equal(np.asarray(r.rounded, np.float64), want["out"])
    grads = r.backward(g)
    standalone = er.scaled_dot_product_attention.backward(q, k, v, g, mask, **opts)
    for name in GRADS:
        assert np.array_equal(np.asarray(grads[name].rounded, np.float64), want[name]), name
        assert np.array_equal(np.asarray(standalone[name].rounded, np.float64), want[name]), name
    # The semantics differ where they should: the uniform row's output and grad_value, nothing else.
    other = _expected(q, k, v, mask, g, not mean)
    assert not np.array_equal(other["out"][0, 1], want["out"][0, 1])
    assert np.array_equal(np.delete(other["out"][0], 1, axis=0), np.delete(want["out"][0], 1, axis=0))
    assert not np.array_equal(other["grad_value"], want["grad_value"])
    assert np.array_equal(other["grad_query"], want["grad_query"])


def test_mean_row_has_mean_value_and_no_query_gradient():
    # One row, every key masked: the mean of v over all S keys, rounded once (3 keys: 1/3 is inexact).
    q = np.array([[1.5, -0.5]], np.float32)
    k = np.array([[1.0, 2.0], [-1.0, 0.5], [0.25, 3.0]], np.float32)
    v = np.array([[1.0, 2.0], [2.0, -1.0], [4.0, 0.5]], np.float32)
    mask = np.zeros((1, 3), bool)
    r = er.scaled_dot_product_attention(q, k, v, mask, masked_rows="mean")
    assert r.rounded.tolist() == [[round_to(Fraction(7, 3), "float32"), round_to(Fraction(3, 6), "float32")]]
    g = np.array([[3.0, -6.0]], np.float32)
    grads = r.backward(g)
    assert np.asarray(grads["grad_query"].rounded).tolist() == [[0.0, 0.0]]
    assert np.asarray(grads["grad_key"].rounded).tolist() == [[0.0, 0.0]] * 3
    assert np.asarray(grads["grad_value"].rounded).tolist() == [[1.0, -2.0]] * 3


# ---------------------------------------------------------------- against the kernels


def _torch_math(q, k, v, mask, g):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, torch.tensor(mask))
    out.backward(torch.tensor(g))
    return out.detach().numpy(), {n: t.grad.numpy() for n, t in zip(GRADS, (tq, tk, tv))}


def _jax(q, k, v, mask, g):
    """jax.nn.dot_product_attention on (L, E) operands, as (1, L, 1, E) arrays; gradients from jax.vjp."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    m = jnp.asarray(mask[None, None])

    def f(a, b, c):
        return jax.nn.dot_product_attention(a, b, c, mask=m, implementation="xla")

    out, pull = jax.vjp(f, *(jnp.asarray(a[None, :, None, :]) for a in (q, k, v)))
    grads = pull(jnp.asarray(g[None, :, None, :]))
    return np.asarray(out)[0, :, 0], {n: np.asarray(x)[0, :, 0] for n, x in zip(GRADS, grads)}


def _covered(result, out, grads, g) -> tuple[bool, bool]:
    """(forward covered, every gradient covered)."""
    back = result.backward(g)
    return bool(result.covers(out).all()), all(bool(back[n].covers(grads[n]).all()) for n in GRADS)


def _each_covered_only_under_its_own(default, jaxlike, torch_res, jax_res, g) -> None:
    """torch's output covered under the default semantics and not JAX's, and JAX's the reverse, both directions."""
    assert _covered(default, *torch_res, g) == (True, True)
    assert _covered(jaxlike, *jax_res, g) == (True, True)
    assert _covered(default, *jax_res, g) == (False, False)
    assert _covered(jaxlike, *torch_res, g) == (False, False)


def _both_semantics(q, k, v, mask, g):
    """torch's math path and JAX's kernel (outputs, gradients), and exactref under each one's semantics."""
    return (_torch_math(q, k, v, mask, g), _jax(q, k, v, mask, g),
            er.scaled_dot_product_attention(q, k, v, mask), er.scaled_dot_product_attention(q, k, v, mask, **JAX))


def _special_case(bad: float):
    """Key 1 holds ``bad``: row 0 attends it, row 1 masks it, row 2 masks every key.

    Every query has a positive first feature, so an infinite key makes every logit of key 1 +inf.
    """
    q = np.array([[1.0, 0.5], [0.75, 1.0], [0.5, -1.5]], np.float32)
    k = np.array([[0.5, 1.0], [bad, 0.25], [-1.0, 0.75]], np.float32)
    v = np.array([[1.0, -2.0], [0.5, 1.5], [-1.25, 0.25]], np.float32)
    g = np.array([[1.0, 0.5], [-2.0, 1.0], [0.75, -1.0]], np.float32)
    mask = np.array([[True, True, True], [True, False, True], [False, False, False]])
    return q, k, v, mask, g


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_special_key_spreads_as_each_kernel_spreads_it(bad):
    q, k, v, mask, g = _special_case(bad)
    (torch_out, torch_grads), (jax_out, jax_grads), default, jaxlike = _both_semantics(q, k, v, mask, g)
    # PyTorch adds the mask, so key 1's logit (NaN or +inf) reaches every row, masked or not (+inf
    # plus the mask's -inf is NaN); JAX replaces it where masked.
    assert np.isnan(torch_out).all()
    assert np.array_equal(np.isnan(np.asarray(default.rounded)), np.isnan(torch_out))
    assert np.array_equal(np.isnan(np.asarray(jaxlike.rounded)), np.isnan(jax_out))
    assert np.isfinite(jax_out[1:]).all() and np.isnan(jax_out[0]).all()
    # Row 1 masks key 1: under mask_nan="hide" it is the oracle's row with key 1 zeroed (it takes no part).
    tame = Oracle(q, np.where(np.isfinite(k), k, 0.0), v, mask).out()
    assert np.asarray(jaxlike.rounded)[1].tolist() == _round(tame)[1].tolist()
    assert np.asarray(jaxlike.rounded)[2].tolist() == _round(np.array(
        [sum((Fraction(float(x)) for x in v[:, c]), Fraction(0)) / 3 for c in range(2)], dtype=object)).tolist()
    _each_covered_only_under_its_own(default, jaxlike, (torch_out, torch_grads), (jax_out, jax_grads), g)


def test_nan_query_of_a_fully_masked_row_is_hidden_in_its_output_not_in_grad_key():
    # Row 2 masks every key: JAX replaces all its logits, so its NaN query leaves the output the mean
    # of v; but grad_key = dS^T Q still meets 0 * NaN.  PyTorch's row 2 is NaN throughout.
    q, k, v, mask, g = _special_case(0.5)
    q[2, 0] = np.nan
    (torch_out, torch_grads), (jax_out, jax_grads), default, jaxlike = _both_semantics(q, k, v, mask, g)
    assert np.isnan(torch_out[2]).all() and np.isfinite(jax_out).all()
    assert np.isnan(jax_grads["grad_key"][:, 0]).all() and np.isfinite(jax_grads["grad_key"][:, 1]).all()
    _each_covered_only_under_its_own(default, jaxlike, (torch_out, torch_grads), (jax_out, jax_grads), g)


def test_nan_value_reaches_every_row_but_not_the_query_gradient_of_a_mean_row():
    # A NaN in v makes NaN of every output in its column (0 * NaN in P V) and of every dP and D, so
    # every dS of an attended row; a "mean" row's dS is exactly 0 (its logits are constants), so its
    # grad_query stays finite in JAX, where PyTorch's 0 * NaN makes it NaN.
    q, k, v, mask, g = _special_case(0.5)
    v[1, 0] = np.nan
    (torch_out, torch_grads), (jax_out, jax_grads), default, jaxlike = _both_semantics(q, k, v, mask, g)
    assert np.isnan(jax_out[:, 0]).all() and np.isnan(torch_out[:, 0]).all()
    assert jax_grads["grad_query"][2].tolist() == [0.0, 0.0] and np.isnan(torch_grads["grad_query"][2]).all()
    assert np.asarray(jaxlike.backward(g)["grad_query"].rounded)[2].tolist() == [0.0, 0.0]
    # No logit is NaN here, so masked_rows alone decides: its constant weights take no gradient.
    mean_only = er.scaled_dot_product_attention(q, k, v, mask, masked_rows="mean")
    assert _covered(mean_only, jax_out, jax_grads, g) == (True, True)
    _each_covered_only_under_its_own(default, jaxlike, (torch_out, torch_grads), (jax_out, jax_grads), g)


def test_fully_masked_row_each_kernel_covered_only_under_its_semantics():
    q, k, v, mask, g = _special_case(0.5)
    (torch_out, torch_grads), (jax_out, jax_grads), default, jaxlike = _both_semantics(q, k, v, mask, g)
    _each_covered_only_under_its_own(default, jaxlike, (torch_out, torch_grads), (jax_out, jax_grads), g)
    # mask_nan alone changes nothing without special values; masked_rows alone makes the difference.
    assert _covered(er.scaled_dot_product_attention(q, k, v, mask, masked_rows="mean"), jax_out, jax_grads, g) \
        == (True, True)


def test_minus_inf_logit_in_a_row_with_masked_keys_weighs_the_masked_keys():
    # Row 0 attends only key 1, whose logit is -inf: JAX's softmax then weighs its two masked keys
    # (finite fill) equally, giving (1 + 4) / 2; row 1 attends keys 0 and 2 as usual.
    q = np.array([[1.0], [1.0]], np.float32)
    k = np.array([[1.0], [-math.inf], [2.0]], np.float32)
    v = np.array([[1.0], [2.0], [4.0]], np.float32)
    g = np.array([[1.0], [-0.5]], np.float32)
    mask = np.array([[False, True, False], [True, True, True]])
    jax_out, jax_grads = _jax(q, k, v, mask, g)
    jaxlike = er.scaled_dot_product_attention(q, k, v, mask, **JAX)
    assert jax_out[0, 0] == 2.5 and np.asarray(jaxlike.rounded)[0, 0] == 2.5
    assert _covered(jaxlike, jax_out, jax_grads, g) == (True, True)
    assert not er.scaled_dot_product_attention(q, k, v, mask).covers(jax_out).all()


def test_jax_backend_kernel_is_covered_with_its_reference_options():
    pytest.importorskip("jax")
    from exactref.backends import jax as backend

    kernel = backend.EXACTREF_KERNELS["scaled_dot_product_attention"]
    assert kernel["reference_options"] == JAX
    q, k, v, mask, g = _masked_case()
    out = np.asarray(kernel["forward"](q, k, v, attn_mask=mask))
    grads = {n: np.asarray(x) for n, x in kernel["backward"](q, k, v, g, attn_mask=mask).items()}
    r = er.scaled_dot_product_attention(q, k, v, mask, **JAX)
    assert _covered(r, out, grads, g) == (True, True)
    assert _covered(er.scaled_dot_product_attention(q, k, v, mask), out, grads, g) == (False, False)


def test_jax_backend_known_failures_have_the_stated_causes():
    """float64: the weights are float32's; float16 backward: dP = dO V^T overflows in float16."""
    pytest.importorskip("jax")
    from exactref.backends import jax as backend

    kernel = backend.EXACTREF_KERNELS["scaled_dot_product_attention"]
    assert set(kernel["known_failures"]) == {"float64", "float16-backward"}
    # Three equal logits: exactly 1, but jax's three float32 weights 1/3 sum to 1 + 2**-25 in float64.
    q, k, v = np.zeros((1, 1)), np.zeros((3, 1)), np.ones((3, 1))
    out = np.asarray(kernel["forward"](q, k, v))
    assert out.dtype == np.float64 and out[0, 0] == 3 * float(np.float32(1 / 3)) == 1 + 2.0 ** -25
    assert not er.scaled_dot_product_attention(q, k, v, **JAX).covers(out).any()
    # One key: its weight is exactly 1, so dS = 0; 65504 * -3 overflows float16, and inf - inf is NaN.
    q, k, v = (np.array([[x]], np.float16) for x in (1.0, 1.0, -3.0))
    g = np.array([[65504.0]], np.float16)
    grads = kernel["backward"](q, k, v, g)
    assert np.isnan(np.asarray(grads["grad_query"])).all()
    ref = er.scaled_dot_product_attention(q, k, v, algorithm=er.AttentionAlgorithm.FLASH_ATTENTION, **JAX)
    exact = ref.backward(g)["grad_query"]
    assert np.asarray(exact.rounded).tolist() == [[0.0]]
    assert not exact.covers(np.asarray(grads["grad_query"])).any()


@pytest.mark.parametrize("gqa", [False, True])
def test_structural_zeros_counted_at_once_agree_term_by_term(monkeypatch, gqa):
    # Every element of every output, both ways: masked rows and keys, zero rows of dO and of V, a
    # row with one key, zero columns of q and k, and (with gqa) heads sharing key and value.
    from exactref.ops.attention import _certified

    rng = np.random.default_rng(3)
    H, Hkv, L, S, E = 4, (2 if gqa else 4), 6, 5, 3
    q, k, v = rng.standard_normal((H, L, E)), rng.standard_normal((Hkv, S, E)), rng.standard_normal((Hkv, S, 2))
    q[:, :, 1] = 0.0
    k[0, :, 2] = 0.0
    v[:, 3] = 0.0
    v[1] = 0.0
    mask = rng.random((H, L, S)) < 0.7
    mask[:, 0] = False  # a row with nothing to attend
    mask[:, 1] = False
    mask[:, 1, 2] = True  # a row with one key
    mask[:, :, 4] = False  # a key nobody attends
    grad = rng.standard_normal((H, L, 2))
    grad[:, 2] = 0.0
    checked = []
    real = _certified.Refiner.structural_zeros

    def both(self, which, flat):
        every = np.arange(math.prod(self.pb.flat_shape(which)))
        b, r, c = np.unravel_index(every, self.pb.flat_shape(which))
        counted = self._term_counts(which)[b, r, c] == 0
        np.testing.assert_array_equal(counted, self._zero_terms(which, b, r, c), err_msg=which)
        checked.append((which, int(counted.sum()), int((~counted).sum())))
        return real(self, which, flat)
    monkeypatch.setattr(_certified.Refiner, "structural_zeros", both)
    out = er.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    out.backward(grad)
    assert {w for w, _, _ in checked} == {"out", "query", "key", "value"}
    assert all(zeros and others for _, zeros, others in checked), checked  # both kinds in each output
