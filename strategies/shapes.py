"""Shapes and broadcast shape sets, built on Hypothesis's numpy strategies.

Every strategy here shrinks toward fewer dimensions and sides of
``min_side`` (1 by default).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ._draws import coin, ints
from ._validation import check_bool, check_int, check_side_range

__all__ = [
    "MATMUL_SIGNATURE",
    "broadcast_shapes",
    "gemm_shapes",
    "matmul_shapes",
    "shapes",
]

#: torch.matmul as a generalised-ufunc signature: either operand may be 1-D.
MATMUL_SIGNATURE = "(m?,n),(n,p?)->(m?,p?)"
# The same without optional dims; drawn first so that examples shrink to 2-D operands.
_MATMUL_2D = "(m,n),(n,p)->(m,p)"

# Hypothesis's own limit on the dims of a broadcast shape set.
_NDIM_MAX = 32


def _sides(min_side: int, max_side: int) -> tuple[int, int]:
    min_side = check_int("min_side", min_side, min_value=0)
    max_side = check_int("max_side", max_side, min_value=1)
    check_side_range("min_side", min_side, "max_side", max_side)
    return min_side, max_side


def _dims(min_dims: int, max_dims: int, *, names: tuple[str, str] = ("min_dims", "max_dims"),
          limit: int = _NDIM_MAX) -> tuple[int, int]:
    min_dims = check_int(names[0], min_dims, min_value=0, max_value=limit)
    max_dims = check_int(names[1], max_dims, min_value=0, max_value=limit)
    check_side_range(names[0], min_dims, names[1], max_dims)
    return min_dims, max_dims


def shapes(*, min_dims: int = 0, max_dims: int = 3, min_side: int = 1,
           max_side: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Draw an array shape.

    >>> from hypothesis import find
    >>> find(shapes(), lambda s: True)
    ()
    >>> find(shapes(max_side=8), lambda s: len(s) == 2 and s[1] >= 5)
    (1, 5)
    """
    min_dims, max_dims = _dims(min_dims, max_dims)
    min_side, max_side = _sides(min_side, max_side)
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def broadcast_shapes(*, num_shapes: int = 2, signature: str | None = None, min_dims: int = 0,
                     max_dims: int = 3, min_side: int = 1,
                     max_side: int = 4) -> st.SearchStrategy[hnp.BroadcastableShapes]:
    """Draw shapes that broadcast together, with the shape they broadcast to.

    A thin, validated front to ``hypothesis.extra.numpy.mutually_broadcastable_shapes``.
    With a gufunc ``signature`` such as ``"(m,n),(n,p)->(m,p)"`` the last dims
    of each shape are the core dims and ``num_shapes`` follows the signature.
    ``min_dims``/``max_dims`` count the broadcast (loop) dims only.

    >>> from hypothesis import find
    >>> find(broadcast_shapes(signature="(n),(n)->()"), lambda b: b.input_shapes[0] == (2,))
    BroadcastableShapes(input_shapes=((2,), (2,)), result_shape=())
    """
    min_dims, max_dims = _dims(min_dims, max_dims)
    min_side, max_side = _sides(min_side, max_side)
    if signature is not None:
        if not isinstance(signature, str):
            raise TypeError(f"signature={signature!r} must be a gufunc signature string such as "
                            f"{_MATMUL_2D!r}, or None")
        return hnp.mutually_broadcastable_shapes(signature=signature, min_dims=min_dims, max_dims=max_dims,
                                                 min_side=min_side, max_side=max_side)
    num_shapes = check_int("num_shapes", num_shapes, min_value=1)
    return hnp.mutually_broadcastable_shapes(num_shapes=num_shapes, min_dims=min_dims, max_dims=max_dims,
                                             min_side=min_side, max_side=max_side)


def batch_side(max_side: int, max_batch_side: int | None) -> int:
    """The checked bound on batch sides: by default ``max_side``, but at most 4.

    A kernel test that raises ``max_side`` to 64 wants larger matrices, not
    64**2 of them.
    """
    if max_batch_side is None:
        return min(max_side, 4)
    return check_int("max_batch_side", max_batch_side, min_value=1)


def _clamp_batch(b: hnp.BroadcastableShapes, cap: int) -> hnp.BroadcastableShapes:
    """Cap the batch sides of matmul shapes at ``cap`` (core sides stay as drawn).

    Sides that broadcast are equal or 1, so capping each keeps them broadcasting.
    """
    def clamp(shape: tuple[int, ...], core: int) -> tuple[int, ...]:
        cut = len(shape) - core
        return tuple(min(s, cap) for s in shape[:cut]) + shape[cut:]
    (a, bb), out = b.input_shapes, b.result_shape
    core_a, core_b = min(len(a), 2), min(len(bb), 2)
    core_out = (len(a) >= 2) + (len(bb) >= 2)
    return hnp.BroadcastableShapes(input_shapes=(clamp(a, core_a), clamp(bb, core_b)),
                                   result_shape=clamp(out, core_out))


def matmul_shapes(*, max_batch_dims: int = 2, min_side: int = 1, max_side: int = 4,
                  max_batch_side: int | None = None, allow_1d: bool = True
                  ) -> st.SearchStrategy[hnp.BroadcastableShapes]:
    """Draw the shapes of ``A`` and ``B`` for ``torch.matmul``, and of ``A @ B``.

    Batch dims broadcast against each other, with sides up to
    ``max_batch_side`` (by default ``max_side``, but at most 4).  With
    ``allow_1d`` either operand may also be 1-D, as the signature
    ``(m?,n),(n,p?)->(m?,p?)`` says; examples still shrink to 2-D operands
    with every side ``min_side``.

    >>> from hypothesis import find
    >>> find(matmul_shapes(), lambda b: len(b.input_shapes[0]) == 1).input_shapes
    ((1,), (1,))
    """
    max_batch_dims = check_int("max_batch_dims", max_batch_dims, min_value=0, max_value=_NDIM_MAX - 2)
    min_side, max_side = _sides(min_side, max_side)
    cap = batch_side(max_side, max_batch_side)
    allow_1d = check_bool("allow_1d", allow_1d)
    plain = hnp.mutually_broadcastable_shapes(signature=_MATMUL_2D, min_dims=0, max_dims=max_batch_dims,
                                              min_side=min_side, max_side=max_side)
    if allow_1d:
        # min_dims=0 lets Hypothesis omit the optional core dims (it never adds batch
        # dims to an operand that lost one, which is what torch.matmul requires too).
        optional = hnp.mutually_broadcastable_shapes(signature=MATMUL_SIGNATURE, min_dims=0,
                                                     max_dims=max_batch_dims, min_side=min_side,
                                                     max_side=max_side)
        plain = st.one_of(plain, optional)
    if cap >= max_side or max_batch_dims == 0:
        return plain
    return plain.map(lambda b: _clamp_batch(b, cap))


def draw_broadcastable_to(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts *to* ``shape`` without enlarging it.

    It drops some leading dims and keeps each other one or makes it 1.  The
    draws do not depend on ``shape``'s sides, so the shrinker can change those
    freely (Hypothesis's ``broadcastable_shapes`` needs them as bounds).
    """
    ndim = draw(ints(0, len(shape)))
    keep = [draw(coin()) for _ in range(ndim)]
    return tuple(side if k else 1 for side, k in zip(shape[len(shape) - ndim:], keep))


@st.composite
def _gemm_shapes(draw: st.DrawFn, matmul: st.SearchStrategy[hnp.BroadcastableShapes]
                 ) -> hnp.BroadcastableShapes:
    ab = draw(matmul)
    c = draw_broadcastable_to(draw, ab.result_shape)
    return hnp.BroadcastableShapes(input_shapes=(*ab.input_shapes, c), result_shape=ab.result_shape)


def gemm_shapes(*, max_batch_dims: int = 2, min_side: int = 1, max_side: int = 4,
                max_batch_side: int | None = None, allow_1d: bool = False
                ) -> st.SearchStrategy[hnp.BroadcastableShapes]:
    """Draw the shapes of ``A``, ``B`` and ``C`` for ``gemm``, and of its output.

    ``A`` and ``B`` are drawn as by :func:`matmul_shapes`; ``C`` broadcasts to
    the shape of ``A @ B`` without enlarging it.  Examples shrink toward a
    0-d ``C``.

    >>> from hypothesis import find
    >>> find(gemm_shapes(), lambda b: len(b.input_shapes[2]) == 2).input_shapes
    ((1, 1), (1, 1), (1, 1))
    """
    matmul = matmul_shapes(max_batch_dims=max_batch_dims, min_side=min_side, max_side=max_side,
                           max_batch_side=max_batch_side, allow_1d=allow_1d)
    return _gemm_shapes(matmul)
