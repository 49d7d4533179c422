"""JAX's own kernels on the CPU, as a kernel module: ``exactref audit --backend jax``.

Each op is jax.numpy's (or jax.nn's, jax.scipy's) function, backward through
``jax.vjp``.  Importing this module turns on ``jax_enable_x64``, so that
float64 and complex128 are computed, and judged, as themselves.

The kernels run eagerly (``jax.disable_jit``): under jit XLA compiles anew
for every shape the search draws, which costs about a second per shape.

XLA on the CPU flushes subnormal inputs and results to zero (in float64,
float32 and bfloat16): every op with a model is judged with
``flush_subnormals=True``.  matrix_exp has one tolerance model, without
flushing, so its subnormal cases can fail for that reason alone.

Known failures:

* complex add, of semantics rather than accuracy: jnp.add adds the parts
  separately (0 + (inf+0j) is inf+0j), where exactref's normal answer is
  torch's, inf+nanj.

* ``jax.scipy.linalg.expm`` chooses its scaling with floor where ceil is
  right (errors of about 1e8 ulps at a 1-norm near 10).
* ``jax.nn.dot_product_attention`` masks with a large finite negative, so a
  fully masked row gives the mean of v where PyTorch's math path (exactref's
  normal answer) gives NaN; the search draws no masks here.
"""

from __future__ import annotations

from typing import Any

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


def _expm(A: Any) -> Any:
    return jsl.expm(jnp.asarray(A))


# JAX's vjp rounds each broadcast copy's product to the format, then sums the copies in the format
# itself, half formats included: PyTorch's autograd roundings, and for half formats a reduced-precision
# reduction.
_XLA = er.models.DEFAULT.replace(name="xla_cpu", flush_subnormals=True)
_AUTODIFF = {f: (er.models.REDUCED_PRECISION_REDUCTION.replace(name="jax_half_autodiff", autograd_roundings=True,
                                                              flush_subnormals=True)
                 if f in ("float16", "bfloat16") else _XLA.replace(name="xla_cpu_autodiff", autograd_roundings=True))
             for f in er.FORMATS}


def _entry(forward: Any, names: tuple[str, ...] | None, formats: tuple[str, ...] | None = None,
           **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"forward": _eager(forward), "arrays": "numpy", **extra}
    if names is not None:
        entry["backward"] = _vjp(forward, names)
        entry.setdefault("backward_model", _AUTODIFF)
    if forward is not _expm:
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
                  known_failures=dict.fromkeys(("complex64", "complex128"), _COMPLEX_ADD)),
    "multiply": _entry(_multiply, ("x", "y")),
    # JAX's autodiff sums broadcast copies in the format itself (half formats included): the
    # REDUCED_PRECISION_REDUCTION class.
    "sum": _entry(_sum, ("x",)),
    # expm takes no half formats ("A.dtype=float16 is not supported").
    "matrix_exp": _entry(_expm, None, formats=_EXPM_FORMATS, known_failures=dict.fromkeys(_EXPM_FORMATS, _EXPM)),
}
