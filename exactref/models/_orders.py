"""Summation orders: which sums a kernel forms, so that a bound can follow its partial sums.

An order is ``"any"`` (nothing is known: the classical bound for every
order), ``"sequential"`` (one chain in index order), ``"pairwise"``
(numpy's ``pairwise_sum``), a :class:`Blocked` tiling, or a tensor core's
chain of MMA steps (``_tensor_core.TensorCore``), alone or inside a block.  This module only
describes orders and their trees; ``_running`` turns an order and the exact
terms into a bound.  The derivation is in ``docs/tolerance-models.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from ._tensor_core import TensorCore

__all__ = ["INNER_ORDERS", "ORDERS", "Blocked", "Order", "check_order", "pairwise_height", "tensor_core_of"]

#: The orders named by a string; "any" is the default.
ORDERS = ("any", "sequential", "pairwise")
#: What the inside of a block may be.
INNER_ORDERS = ORDERS
# numpy's PW_BLOCKSIZE and its unroll factor (numpy/_core/src/umath/loops_utils.h.src).
PW_BLOCKSIZE = 128
PW_UNROLL = 8


@dataclass(frozen=True)
class Blocked:
    """Contiguous blocks of ``size`` terms along the reduced index, as a tiled kernel's BLOCK_K loop.

    Each block is summed in ``inner`` order (``"any"``, ``"sequential"``,
    ``"pairwise"``, or a tensor core's chain of MMA steps from a zero
    accumulator) into a block sum, and the block sums are added in index
    order into one accumulator (``acc = tl.dot(a, b, acc)``).  With
    ``splits`` > 1 (split-K) the blocks are dealt, in order, into ``splits``
    groups of ``ceil(blocks / splits)`` consecutive blocks; each group is
    its own chain, and the chains' results are added in any order at the end.

    >>> from exactref.models import Blocked
    >>> Blocked(32)
    Blocked(size=32, inner='any', splits=1)
    """

    size: int
    inner: str | TensorCore = "any"
    splits: int = 1

    def __post_init__(self) -> None:
        for name in ("size", "splits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Blocked: {name}={value!r} must be a positive int, e.g. Blocked(32)")
        if isinstance(self.inner, TensorCore):
            if self.splits != 1:
                raise ValueError(f"Blocked: splits={self.splits!r} with a tensor core inside is not modelled; "
                                 "use splits=1")
        elif self.inner not in INNER_ORDERS:
            raise ValueError(f"Blocked: inner={self.inner!r} must be one of {INNER_ORDERS} or "
                             "er.models.tensor_core(gpu, input_format)")

    def __str__(self) -> str:
        inner = repr(self.inner) if isinstance(self.inner, str) else str(self.inner)
        extra = (f", inner={inner}" if self.inner != "any" else "") + (
            f", splits={self.splits}" if self.splits != 1 else "")
        return f"Blocked({self.size}{extra})"


Order = Union[str, Blocked, TensorCore]


def check_order(order: object, argument: str = "order") -> Order:
    if isinstance(order, (Blocked, TensorCore)) or (isinstance(order, str) and order in ORDERS):
        return order
    raise ValueError(f"{argument}={order!r} is not a summation order; use 'any', 'sequential', 'pairwise', "
                     "er.models.Blocked(size, inner='any', splits=1) or er.models.tensor_core(gpu, input_format)")


def tensor_core_of(order: Order) -> tuple[TensorCore, int | None] | None:
    """(the tensor core, the promotion block or None) of an order that uses one, else None."""
    if isinstance(order, TensorCore):
        return order, None
    if isinstance(order, Blocked) and isinstance(order.inner, TensorCore):
        return order.inner, order.size
    return None


@lru_cache(maxsize=256)
def pairwise_height(n: int) -> int:
    """The most roundings any term meets in numpy's pairwise sum of ``n`` terms."""
    if n < PW_UNROLL:
        return max(n - 1, 0)
    if n <= PW_BLOCKSIZE:
        # The chains of the eight accumulators, three levels to combine them, then the rest one by one.
        return (n // PW_UNROLL - 1) + 3 + n % PW_UNROLL
    half = pairwise_split(n)
    return 1 + max(pairwise_height(half), pairwise_height(n - half))


def pairwise_split(n: int) -> int:
    """Where numpy's pairwise sum splits ``n`` > PW_BLOCKSIZE terms: half, down to a multiple of 8."""
    half = n // 2
    return half - half % PW_UNROLL
