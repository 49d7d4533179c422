"""JAX's own kernels on the CPU, as a kernel module: ``exactref audit --backend jax``.

Each op is jax.numpy's (or jax.nn's, jax.scipy's) function, backward through
``jax.vjp``.  Importing this module turns on ``jax_enable_x64``, so that
float64 and complex128 are computed, and judged, as themselves.

The kernels run eagerly (``jax.disable_jit``): under jit XLA compiles anew
for every shape the search draws, which costs about a second per shape.
expm and attention are the exceptions.  Eagerly, expm's scan of 16
conditional squarings costs 60 to 170 ms a call, so it runs under jit on
unbatched draws of sides 1 to 4.  Eagerly, each of its few dozen operations is
compiled anew per shape (about 2 s a call), so it runs under jit, except in
the half formats, where ``jax.jit(jax.nn.dot_product_attention)`` raises on
the CPU: in float16 always ("The precision 'F16_F16_F32' is not supported by
dot_general on CPU"), in bfloat16 for a (1, 1, 1, 1) query ("Algorithm not
supported by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32").  jax asks
einsum for that precision and falls back to the default in an except
clause, which catches the error eagerly, at trace time, but not under jit,
where it comes when XLA compiles.

XLA on the CPU flushes subnormal inputs and results to zero (in float64,
float32 and bfloat16): every op with a model is judged with
``flush_subnormals=True``.  matrix_exp's PADE13 has no flushing, so a
case with subnormal entries or results can fail for that reason alone.

Known failures:

* complex add's forward, of semantics rather than accuracy: jnp.add adds
  the parts separately (0 + (inf+0j) is inf+0j), where exactref's normal
  answer is torch's, inf+nanj.

* ``jax.scipy.linalg.expm`` chooses its scaling with floor where ceil is
  right (errors of about 1e8 ulps at a 1-norm near 10), judged under
  PADE13, the class of Padé scaling and squaring
  (tests/exactref/test_backends_jax.py has the evidence).
* attention in float64: ``jax.nn.dot_product_attention`` computes the
  softmax in float32 whatever the input format, so its float64 weights carry
  float32's errors (about 1e-8 relative) and no float64 class covers them.
* attention's float16 backward: dP = dO V^T is computed in float16 (the
  cotangent of the float16 product P V), so a dO near float16's largest
  value overflows it, and dS = P (dP - D) is inf - inf = NaN where the exact
  gradient is finite (one key: dS is exactly 0).

``jax.nn.dot_product_attention`` (implementation "xla") masks by
replacement: a masked logit becomes -0.7 times float32's largest value.  So
a row with every key masked gives the mean of v over its keys (PyTorch's
math path gives 0), and a NaN or infinite logit under the mask does not
reach its row (in PyTorch it makes the row NaN).  The reference is told so
(``masked_rows="mean"``, ``mask_nan="hide"``), and masks are drawn.  A
float mask goes in as a bool mask (its -inf entries) and a bias (the rest).
The softmax is computed in float32 and, for half inputs, the weights are
rounded to the input format before they multiply v: FLASH_ATTENTION's class
(float32 inputs: MATH).  jax needs key and value of one shape, so when v has
more or fewer features than q and k, the narrower ones are padded with
zeros, which changes no sum.  The attention classes have no
``flush_subnormals``: the draws keep away from subnormal special values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
except ImportError as exc:  # the backend of a library that is not installed says how to get it
    raise ImportError(f'exactref.backends.jax needs jax ({exc}): pip install "exactref[jax]"') from None

import exactref as er

jax.config.update("jax_enable_x64", True)

__all__ = ["EXACTREF_KERNELS"]

_REAL = ("float64", "float32", "float16", "bfloat16")
_FTZ = ("XLA on the CPU flushes subnormal inputs and results to zero, which no exactref error model allows "
        "yet; a case whose products or sums land in the subnormal range fails")
_COMPLEX_ADD = ("jnp.add adds complex parts separately: 0 + (inf+0j) gives inf+0j, where torch (and exactref's "
                "normal answer, which follows torch) gives inf+nanj")
_EXPM_FORMATS = ("float64", "float32", "complex64", "complex128")
# Traced in jax/_src/scipy/linalg.py, _calc_P_Q; the evidence is tests/exactref/test_backends_jax.py.
_EXPM = ("jax.scipy.linalg.expm chooses its scaling power as floor(log2(|A|_1 / theta)) where ceil is right "
         "(_calc_P_Q), so the Pade approximant is evaluated at norms up to 2 theta: [[0, 10.7], [-10.7, 0]] "
         "is 1.7e8 u off normwise in float64, and 8 u with the one more squaring that ceil gives")
# Subnormal special values are left out of the draws: see _FTZ.
_NORMAL_SPECIALS = ["signed_zero", "infinity", "nan", "min_normal", "max_finite", "power_of_two",
                    "near_power_of_two", "overflow"]


def _eager(f: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with jax.disable_jit():
            return f(*args, **kwargs)
    run.__name__ = getattr(f, "__name__", "kernel")
    return run


def _vjp(f: Any, names: tuple[str, ...]) -> Any:
    """A backward from ``jax.vjp`` of ``f`` over its array inputs, as a dict by gradient name."""
    def backward(*args: Any, **kwargs: Any) -> dict[str, Any]:
        *inputs, grad = args
        arrays = [i for i, a in enumerate(inputs) if hasattr(a, "shape")]

        def of_arrays(*xs: Any) -> Any:
            full = list(inputs)
            for i, x in zip(arrays, xs, strict=True):
                full[i] = x
            return f(*full, **kwargs)
        with jax.disable_jit():
            _, pull = jax.vjp(of_arrays, *(jnp.asarray(inputs[i]) for i in arrays))
            # JAX's vjp is linear in the cotangent; torch's gradient (exactref's) is its conjugate
            # taken at the conjugate cotangent, which differs for complex values.
            g = jnp.asarray(grad)
            grads = [jnp.conj(v) for v in pull(jnp.conj(g))] if jnp.iscomplexobj(g) else pull(g)
        return {f"grad_{names[i]}": g for i, g in zip(arrays, grads, strict=True)}
    return backward


def _matmul(A: Any, B: Any) -> Any:
    return jnp.matmul(jnp.asarray(A), jnp.asarray(B))


def _add(x: Any, y: Any, alpha: Any = 1) -> Any:
    return jnp.add(jnp.asarray(x), alpha * jnp.asarray(y)) if alpha != 1 else jnp.add(jnp.asarray(x), y)


def _multiply(x: Any, y: Any) -> Any:
    return jnp.multiply(jnp.asarray(x), y)


def _sum(x: Any, *, axis: Any = None, keepdims: bool = False) -> Any:
    x = jnp.asarray(x)
    if axis == () or x.ndim == 0:
        axis = None  # torch's (and exactref's) meaning of axis=() and of a 0-d input's axis
    return jnp.sum(x, axis=axis, keepdims=keepdims)


# expm runs under jit too: eagerly its scan of 16 conditional squarings costs 60 to 170 ms a call,
# against one compilation (about a second) per shape; the draws keep to unbatched sides 1 to 4.
_expm_jit = jax.jit(jsl.expm)


def _expm(A: Any) -> Any:
    return _expm_jit(jnp.asarray(A))


def _layout(qs: tuple[int, ...], ks: tuple[int, ...], vs: tuple[int, ...], enable_gqa: bool
            ) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
    """(lead batch, query heads N, key heads K, the output's head dims) of exactref's broadcasting."""
    qb, kb, vb = qs[:-2], ks[:-2], vs[:-2]
    if enable_gqa and qb and kb and vb and (kb[-1] != qb[-1] or vb[-1] != qb[-1]):
        # Grouped heads: query head n reads key head n // (Hq // Hk), jax's grouping and torch's.
        return tuple(np.broadcast_shapes(qb[:-1], kb[:-1], vb[:-1])), qb[-1], kb[-1], (qb[-1],)
    return tuple(np.broadcast_shapes(qb, kb, vb)), 1, 1, ()


def _attention_core(q: Any, k: Any, v: Any, mask: Any, bias: Any, scale: Any, *, is_causal: bool,
                    enable_gqa: bool) -> Any:
    """(..., L, E) operands as jax's (B, T, N, H), padded to one feature count; the output back."""
    (L, E), S, Ev = q.shape[-2:], k.shape[-2], v.shape[-1]
    lead, N, K, heads = _layout(q.shape, k.shape, v.shape, enable_gqa)
    if not heads:
        q, k, v = q[..., None, :, :], k[..., None, :, :], v[..., None, :, :]
    B = int(np.prod(lead, dtype=np.int64))
    F = max(E, Ev)  # jax takes key and value of one shape: zero features change no sum

    def bthd(a: Any, n_heads: int, n: int, d: int) -> Any:
        a = jnp.broadcast_to(a, lead + (n_heads, n, d)).reshape(B, n_heads, n, d)
        return jnp.swapaxes(jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, F - d))), 1, 2)

    out = jax.nn.dot_product_attention(bthd(q, N, L, E), bthd(k, K, S, E), bthd(v, K, S, Ev), bias, mask,
                                       scale=scale, is_causal=is_causal, implementation="xla")
    return jnp.swapaxes(out[..., :Ev], 1, 2).reshape(lead + heads + (L, Ev))


def _attention_grads(q: Any, k: Any, v: Any, g: Any, mask: Any, bias: Any, scale: Any, *, is_causal: bool,
                     enable_gqa: bool) -> Any:
    def f(a: Any, b: Any, c: Any) -> Any:
        return _attention_core(a, b, c, mask, bias, scale, is_causal=is_causal, enable_gqa=enable_gqa)
    return jax.vjp(f, q, k, v)[1](g)


# Attention runs under jit: eagerly, XLA compiles each of its few dozen operations anew for every
# shape (about 2 s a call), where jit compiles one program per shape (about 0.5 s) and reuses it.
# The half formats run eagerly all the same: under jit, jax's attention can fail on the CPU (see the
# module docstring).
_STATIC = ("is_causal", "enable_gqa")
_attention_jit = jax.jit(_attention_core, static_argnames=_STATIC)
_attention_grads_jit = jax.jit(_attention_grads, static_argnames=_STATIC)


def _jit_unless_half(q: np.ndarray) -> Any:
    return jax.disable_jit() if q.dtype.itemsize == 2 else contextlib.nullcontext()


def _attention_args(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, is_causal: bool,
                    scale: float | None, enable_gqa: bool) -> tuple[tuple[Any, ...], dict[str, bool]]:
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p!r}: this adapter passes no dropout to jax")
    q, k, v = np.asarray(query), np.asarray(key), np.asarray(value)
    (L, E), S = q.shape[-2:], k.shape[-2]
    lead, N, _, heads = _layout(q.shape, k.shape, v.shape, bool(enable_gqa))
    B = int(np.prod(lead, dtype=np.int64))
    mask = bias = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        m = m.reshape((1,) * (2 - m.ndim) + m.shape) if m.ndim < 2 else m
        m = np.broadcast_to(m if heads else m[..., None, :, :], lead + (N, L, S)).reshape(B, N, L, S)
        if m.dtype == np.bool_:
            mask = m
        else:
            # jax's mask is bool: a float mask's -inf entries mask, the rest is added as a bias.
            mask = m != -np.inf
            bias = np.where(mask, m, 0).astype(m.dtype)
    # jax's default scale is 1 / np.sqrt(E) in float64, rounded to the logits' format; so is this.
    s = np.float64(1.0 / np.sqrt(E) if scale is None else scale)
    return (q, k, v, mask, bias, s), {"is_causal": bool(is_causal), "enable_gqa": bool(enable_gqa)}


def _attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
    """jax.nn.dot_product_attention called like exactref's op: (..., L, E) operands, PyTorch's broadcasting."""
    args, static = _attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    with _jit_unless_half(args[0]):
        return _attention_jit(*args, **static)


def _attention_backward(query: Any, key: Any, value: Any, grad: Any, attn_mask: Any = None,
                        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False) -> dict[str, Any]:
    """jax.vjp of the same call: the gradients of query, key and value."""
    (q, k, v, *rest), static = _attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                               enable_gqa)
    with _jit_unless_half(q):
        grads = _attention_grads_jit(q, k, v, np.asarray(grad), *rest, **static)
    return dict(zip(("grad_query", "grad_key", "grad_value"), grads, strict=True))


# JAX's vjp rounds each broadcast copy's product to the format, then sums the copies in the format
# itself, half formats included: PyTorch's autograd roundings, and for half formats a reduced-precision
# reduction.
_XLA = er.models.DEFAULT.replace(name="xla_cpu", flush_subnormals=True)
_AUTODIFF = {f: (er.models.REDUCED_PRECISION_REDUCTION.replace(name="jax_half_autodiff", autograd_roundings=True,
                                                              flush_subnormals=True)
                 if f in ("float16", "bfloat16") else _XLA.replace(name="xla_cpu_autodiff", autograd_roundings=True))
             for f in er.FORMATS}


# jax.nn.dot_product_attention: a float32 softmax, its weights rounded to a half input's format
# (FLASH_ATTENTION's class) before they multiply v; float32 inputs are MATH's.
_ATTENTION = {"float64": er.AttentionAlgorithm.MATH, "float32": er.AttentionAlgorithm.MATH,
              "float16": er.AttentionAlgorithm.FLASH_ATTENTION, "bfloat16": er.AttentionAlgorithm.FLASH_ATTENTION}
_F64_SOFTMAX = ("jax.nn.dot_product_attention computes the softmax in float32 whatever the input format "
                "(_dot_product_attention_core), so float64 weights carry float32's errors")
# jax's attention backward computes dP = dO V^T as the cotangent of the float16 product P V, in
# float16: a large dO overflows it to inf, and dS = P (dP - D) becomes inf - inf = NaN.
_F16_DP = ("jax.nn.dot_product_attention's backward computes dP = dO V^T in float16 (the cotangent of the "
           "float16 P V einsum), which overflows for dO near float16's largest value: dS = P (dP - D) is then "
           "inf - inf = NaN where the exact gradient is finite")
# XLA compiles anew for every shape: small sides keep the shapes few.
_ATTENTION_DRAWS = {"max_side": 3, "max_batch_dims": 1}


def _entry(forward: Any, names: tuple[str, ...] | None, formats: tuple[str, ...] | None = None,
           **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"forward": _eager(forward), "arrays": "numpy", **extra}
    if names is not None:
        entry["backward"] = _vjp(forward, names)
        entry.setdefault("backward_model", _AUTODIFF)
    entry.setdefault("model", _XLA)
    if formats is not None:
        entry["formats"] = list(formats)
    options = entry.setdefault("strategy_options", {})
    options.setdefault("specials", _NORMAL_SPECIALS)
    return entry


EXACTREF_KERNELS: dict[str, Any] = {
    "matmul": _entry(_matmul, ("A", "B")),
    # jnp.add has no alpha: x + alpha * y rounds twice, so add is drawn with alpha=1.
    "add": _entry(_add, ("x", "y"), strategy_options={"alpha": 1},
                  known_failures=dict.fromkeys(("complex64-forward", "complex128-forward"), _COMPLEX_ADD)),
    "multiply": _entry(_multiply, ("x", "y")),
    # JAX's autodiff sums broadcast copies in the format itself (half formats included): the
    # REDUCED_PRECISION_REDUCTION class.
    "sum": _entry(_sum, ("x",)),
    # expm takes no half formats ("A.dtype=float16 is not supported").
    # Padé scaling and squaring (PADE13's class); 1-norms up to 12 reach the scalings floor gets wrong.
    "matrix_exp": {"forward": _expm, "arrays": "numpy", "formats": list(_EXPM_FORMATS), "model": er.models.PADE13,
                   "known_failures": dict.fromkeys(_EXPM_FORMATS, _EXPM),
                   "strategy_options": {"max_batch_dims": 0, "max_norm": 12.0}},
    "scaled_dot_product_attention": {
        "forward": _attention, "backward": _attention_backward, "arrays": "numpy", "formats": list(_REAL),
        "model": _ATTENTION, "backward_model": _ATTENTION,
        "reference_options": {"masked_rows": "mean", "mask_nan": "hide"},
        "known_failures": {"float64": _F64_SOFTMAX, "float16-backward": _F16_DP},
        "strategy_options": {"specials": _NORMAL_SPECIALS, **_ATTENTION_DRAWS}},
}
