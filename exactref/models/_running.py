"""Bounds for a declared summation order, from the exact partial sums of that order.

A kernel that sums ``t_1 .. t_n`` in a known order forms known partial sums
``s_v``, one per addition.  Each addition rounds once: its error is at most
``u`` times what it adds up, so the computed result is off by at most
``(1 + gamma_H) * (u * sum_v |s_v| + leaves)`` (Wilkinson's running error
bound, with exact partial sums in place of computed ones; the derivation is
in docs/tolerance-models.md, "Declared orders").  ExactRef knows the terms,
so it computes the ``s_v`` in float64 and bounds how far those are off.

A *source* gives the terms of every output element: ``segment(k0, k1)``,
the signed and absolute sums of ``t_k0 .. t_k1-1`` (float64, each within
``gamma64 * sum|t|``), and ``rows()``, the terms themselves in chunks of
elements, for orders whose partial sums are not contiguous segments.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..engine.fast import gamma, up
from ..formats import FLOAT64, Format
from ._orders import (
    PW_BLOCKSIZE,
    PW_UNROLL,
    Blocked,
    Order,
    pairwise_height,
    pairwise_split,
    tensor_core_of,
)
from ._tensor_core import TensorCore, tensor_core_error

__all__ = ["DotSource", "RowSource", "ordered_error"]

# Terms materialised at once for tree orders: 8 Mi float64 values, 64 MiB.
_CHUNK_VALUES = 1 << 23


class DotSource:
    """The terms ``X[..., i, k] * Y[..., k, j]`` of a matmul, for every (..., i, j)."""

    def __init__(self, X: np.ndarray, Y: np.ndarray) -> None:
        batch = np.broadcast_shapes(X.shape[:-2], Y.shape[:-2])
        self.X = np.broadcast_to(X, batch + X.shape[-2:])
        self.Y = np.broadcast_to(Y, batch + Y.shape[-2:])
        self.n = X.shape[-1]
        self.shape = batch + (X.shape[-2], Y.shape[-1])

    def segment(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.X[..., :, k0:k1], self.Y[..., k0:k1, :]
        return x @ y, np.abs(x) @ np.abs(y)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """sum t and sum t^2 of every element (float64)."""
        return self.X @ self.Y, (self.X * self.X) @ (self.Y * self.Y)

    def terms_at(self, index: tuple[int, ...]) -> np.ndarray:
        """The terms of one output element."""
        return self.X[index[:-1]] * self.Y[index[:-2] + (slice(None), index[-1])]

    def rows(self) -> Iterator[tuple[slice, np.ndarray]]:
        """(flat output slice, terms of shape (elements, n)), a few rows of one batch at a time."""
        M, N = self.shape[-2:]
        X = self.X.reshape((-1, M, self.n))
        Yt = np.swapaxes(self.Y, -1, -2).reshape((-1, N, self.n))
        step = max(1, _CHUNK_VALUES // max(1, N * self.n))
        for b in range(X.shape[0]):
            for i0 in range(0, M, step):
                i1 = min(M, i0 + step)
                P = X[b, i0:i1, None, :] * Yt[b, None, :, :]
                start = (b * M + i0) * N
                yield slice(start, start + (i1 - i0) * N), P.reshape((-1, self.n))


class RowSource:
    """The terms ``V[..., k]`` of a sum along the last axis."""

    def __init__(self, V: np.ndarray) -> None:
        self.V = V
        self.n = V.shape[-1]
        self.shape = V.shape[:-1]

    def terms_at(self, index: tuple[int, ...]) -> np.ndarray:
        return self.V[index]

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        return self.V.sum(axis=-1), (self.V * self.V).sum(axis=-1)

    def segment(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray]:
        v = self.V[..., k0:k1]
        return v.sum(axis=-1), np.abs(v).sum(axis=-1)

    def rows(self) -> Iterator[tuple[slice, np.ndarray]]:
        flat = self.V.reshape((-1, self.n))
        step = max(1, _CHUNK_VALUES // max(1, self.n))
        for e0 in range(0, flat.shape[0], step):
            e1 = min(flat.shape[0], e0 + step)
            yield slice(e0, e1), flat[e0:e1]


@dataclass
class _Stats:
    """What the bound needs, per element: sums over roundings that follow known partial sums,
    and over groups summed in an unknown order."""

    lin: np.ndarray  # sum of |s_v| over the budgeted additions
    sq: np.ndarray  # sum of s_v^2 over them
    nodes: int  # how many additions (the same for every element)
    group_lin: np.ndarray  # sum over groups summed in any order of d_g * T_g (T_g: sum |terms| of g)
    group_sq: np.ndarray  # sum over them of d_g * T_g^2
    group_roundings: int  # sum of d_g
    group_depth: int  # max d_g
    leaf_sq: np.ndarray  # sum of t_k^2 over the terms whose product rounding is a leaf of a tree
    height: int  # the most roundings on any term's path
    peak: np.ndarray  # the largest |partial sum| (T_g for a group: its partial sums are unknown)
    regular: np.ndarray  # where all terms, or all block sums, are equal: errors are far from independent

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> _Stats:
        z = np.zeros(shape)
        return cls(z.copy(), z.copy(), 0, z.copy(), z.copy(), 0, 0, z.copy(), 0, z.copy(),
                   np.zeros(shape, dtype=bool))


def ordered_error(source: DotSource | RowSource, order: Order, *, acc: Format, S: np.ndarray,
                  products_rounded: bool, final_is_root: bool, underflow: float = 0.0,
                  failure_rate: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bound on |computed - exact|, bound on every partial sum's magnitude) for ``order``.

    ``S`` bounds sum|t_k| per element.  ``products_rounded``: each term is a
    product rounded in ``acc`` before it is added.  ``final_is_root``: the
    last addition *is* the final rounding to the output format, which the
    acceptance interval budgets.  ``underflow`` is added once per term whose
    rounding may underflow.  With ``failure_rate``, the bound is the smaller
    of the sound one and one exceeded with at most that probability under
    the model of independent, mean-zero rounding errors.
    """
    n = source.n
    if n == 0 or 0 in source.shape:
        # An empty sum is exactly 0 in every order; an empty output has nothing to bound.
        return np.zeros(source.shape), np.zeros(source.shape)
    tc = tensor_core_of(order)
    if tc is not None:
        E, peak, _ = tensor_core_bound(source, tc[0], S, promote=tc[1])
        return E, peak
    st = _stats(source, order, products_rounded, final_is_root)
    u = acc.unit_roundoff
    # Each computed partial sum is within `slack` of the exact one (float64 segment and prefix sums).
    slack = gamma(2 * n + 4, FLOAT64.unit_roundoff) * S
    rel64 = 1 + gamma(2 * n + 8, FLOAT64.unit_roundoff)
    lin = st.lin * rel64 + st.nodes * slack
    # A rounded product is a leaf of the tree, except inside a block summed in any order (its group
    # counts it), and except when it is the only term: then it is the final rounding itself.
    in_groups = isinstance(order, Blocked) and order.inner == "any"
    leaves = u * S if products_rounded and not in_groups and not (n == 1 and final_is_root) else 0.0
    grow = 1 + gamma(st.height, u)
    # gamma_d = d u / (1 - d u) <= d * u / (1 - D u) for every group's d <= D.
    groups = st.group_lin * rel64 * (gamma(st.group_depth, u) / st.group_depth if st.group_depth else 0.0)
    raw = grow * (u * lin + groups + leaves) + n * underflow
    # Nothing rounds (one term, exact): E is 0, not up(0), so that only the exact value is accepted.
    E = np.where(raw > 0, up(raw), 0.0)
    if failure_rate is not None:
        # Equal terms (or block sums) round alike again and again, the textbook case against the
        # independent-error model: those elements keep the sound bound.
        E_prob = _probabilistic(st, E, slack, rel64, u, grow, failure_rate, n * underflow)
        E = np.where(st.regular | _nearly_constant(source), E, np.minimum(E, E_prob))
    # Where no partial sum can reach the overflow threshold, a kernel of this order cannot overflow.
    partial_max = up((np.minimum(st.peak, S) + E) * rel64 + slack)
    return E, partial_max


def tensor_core_bound(source: DotSource | RowSource, tc: TensorCore, S: np.ndarray, *,
                      promote: int | None = None, exact_terms: bool = True) -> tuple[np.ndarray, np.ndarray, float]:
    """:func:`tensor_core_error` over every element of ``source``, a chunk of rows at a time."""
    E, peak = np.zeros(source.shape), np.zeros(source.shape)
    sens = 0.0
    flat_E, flat_peak, flat_S = E.reshape(-1), peak.reshape(-1), np.broadcast_to(S, source.shape).reshape(-1)
    for where, P in source.rows():
        flat_E[where], flat_peak[where], sens = tensor_core_error(P, tc, flat_S[where], promote=promote,
                                                                        exact_terms=exact_terms)
    return E, peak, sens


def _nearly_constant(source: DotSource | RowSource) -> np.ndarray:
    """Where an element's terms are all within about 0.1% of each other: n sum t^2 <= (1 + 1e-6) (sum t)^2.

    Cauchy-Schwarz makes n sum t^2 >= (sum t)^2, with equality only for equal terms; the excess is the
    squared coefficient of variation.  Such sums round alike at every step.
    """
    if source.n < 2:
        return np.zeros(source.shape, dtype=bool)
    s1, s2 = source.moments()
    return source.n * s2 <= (1 + 1e-6) * s1 * s1


def _probabilistic(st: _Stats, E: np.ndarray, slack: np.ndarray, rel64: float, u: float, grow: float,
                   failure_rate: float, absolute: np.ndarray | float) -> np.ndarray:
    """Azuma-Hoeffding over the additions: each contributes delta_v * (computed operands), a
    martingale increment of magnitude at most u * (|s_v| + E)."""
    lam = math.sqrt(2 * math.log(2 / failure_rate))
    nodes = np.sqrt(np.maximum(st.sq, 0.0) * rel64) + st.nodes ** 0.5 * (slack + E)
    groups = np.sqrt(st.group_sq * rel64) + st.group_roundings ** 0.5 * E
    leaves = np.sqrt(st.leaf_sq * rel64)
    return up(grow * lam * u * np.sqrt(nodes * nodes + groups * groups + leaves * leaves) + absolute)


def _stats(source: DotSource | RowSource, order: Order, products_rounded: bool, final_is_root: bool) -> _Stats:
    if order == "any":
        # Nothing is known: the whole sum is one group in an unknown order.
        order = Blocked(max(source.n, 1))
    if isinstance(order, Blocked):
        return _blocked(source, order, products_rounded, final_is_root)
    st = _Stats.zeros(source.shape)
    flat = [a.reshape(-1) for a in (st.lin, st.sq, st.leaf_sq, st.peak)]
    tree = _sequential if order == "sequential" else _pairwise
    for where, P in source.rows():
        lin, sq, _, peak = tree(P, final_is_root)
        flat[0][where], flat[1][where] = lin, sq
        flat[3][where] = np.maximum(peak, np.abs(P).max(axis=-1, initial=0.0))
        if products_rounded:
            flat[2][where] = np.sum(P * P, axis=-1)
    st.nodes = max(source.n - 1, 0)
    st.height = source.n - 1 if order == "sequential" else pairwise_height(source.n)
    return st


Tree = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _sequential(P: np.ndarray, exclude_root: bool) -> Tree:
    """(sum |s|, sum s^2, total, max |s|) over the additions of one chain along the last axis."""
    if not P.shape[-1]:
        return (np.zeros(P.shape[:-1]),) * 4
    c = np.cumsum(P, axis=-1)
    nodes = c[..., 1:-1] if exclude_root else c[..., 1:]
    a = np.abs(c)
    return np.abs(nodes).sum(axis=-1), (nodes * nodes).sum(axis=-1), c[..., -1], a.max(axis=-1)


def _pairwise(P: np.ndarray, exclude_root: bool) -> Tree:
    """The same for numpy's pairwise_sum along the last axis."""
    n = P.shape[-1]
    if n < PW_UNROLL:
        # numpy starts from -0.0: the first addition is exact.
        return _sequential(P, exclude_root)
    if n <= PW_BLOCKSIZE:
        return _pairwise_leaf(P, exclude_root)
    half = pairwise_split(n)
    l_lin, l_sq, l_tot, l_peak = _pairwise(P[..., :half], False)
    r_lin, r_sq, r_tot, r_peak = _pairwise(P[..., half:], False)
    total = l_tot + r_tot
    lin, sq = l_lin + r_lin, l_sq + r_sq
    if not exclude_root:
        lin, sq = lin + np.abs(total), sq + total * total
    return lin, sq, total, np.maximum(np.maximum(l_peak, r_peak), np.abs(total))


def _pairwise_leaf(P: np.ndarray, exclude_root: bool) -> Tree:
    """8 <= n <= 128: eight strided accumulators, combined in a fixed tree, then the rest one by one."""
    n = P.shape[-1]
    body = n - n % PW_UNROLL
    chains = np.cumsum(P[..., :body].reshape(P.shape[:-1] + (body // PW_UNROLL, PW_UNROLL)), axis=-2)
    r = chains[..., -1, :]
    pairs = r[..., 0::2] + r[..., 1::2]
    quads = pairs[..., 0::2] + pairs[..., 1::2]
    res = quads[..., 0] + quads[..., 1]
    rest = res[..., None] + np.cumsum(P[..., body:], axis=-1)
    nodes = [chains[..., 1:, :].reshape(P.shape[:-1] + (-1,)), pairs, quads, res[..., None], rest]
    total = rest[..., -1] if rest.shape[-1] else res
    lin = sum(np.abs(v).sum(axis=-1) for v in nodes)
    sq = sum((v * v).sum(axis=-1) for v in nodes)
    peak = np.max([np.abs(v).max(axis=-1, initial=0.0) for v in nodes], axis=0)
    if exclude_root:
        lin, sq = lin - np.abs(total), sq - total * total
    return lin, sq, total, peak


def _blocked(source: DotSource | RowSource, order: Blocked, products_rounded: bool, final_is_root: bool) -> _Stats:
    n, b = source.n, order.size
    blocks = [(k0, min(n, k0 + b)) for k0 in range(0, n, b)] or [(0, 0)]
    per = -(-len(blocks) // order.splits)
    chains = [blocks[i:i + per] for i in range(0, len(blocks), per)]
    st = _Stats.zeros(source.shape)
    one_block = len(blocks) == 1
    if order.inner != "any":
        _inner_trees(st, source, order.inner, blocks, products_rounded, final_is_root and one_block)
    totals = []
    first_total = None
    st.regular = np.ones(source.shape, dtype=bool) if len(blocks) > 1 else st.regular
    for chain in chains:
        acc = None
        for j, (k0, k1) in enumerate(chain):
            total, absolute = source.segment(k0, k1)
            if len(blocks) > 1 and k1 - k0 == b:
                first_total = total if first_total is None else first_total
                st.regular &= total == first_total
            if order.inner == "any":
                d = k1 - k0 - 1 + (1 if products_rounded else 0) - (1 if final_is_root and one_block else 0)
                _add_group(st, max(d, 0), absolute)
                st.peak = np.maximum(st.peak, absolute)
            acc = total if acc is None else acc + total
            st.peak = np.maximum(st.peak, np.abs(acc))
            # Adding block j to the accumulator rounds once; the very last add may be the final rounding.
            if j and not (final_is_root and len(chains) == 1 and j == len(chain) - 1):
                _add_node(st, acc)
        totals.append(acc)
    if len(chains) > 1:
        # split-K: the chains' results are added in any order at the end.
        T = sum(np.abs(c) for c in totals)
        _add_group(st, len(chains) - 1 - (1 if final_is_root else 0), T)
        st.peak = np.maximum(st.peak, T)
    inner = b - 1 + (1 if products_rounded else 0) if order.inner == "any" else _tree_height(order.inner, b)
    st.height = inner + per - 1 + len(chains) - 1
    return st


def _add_node(st: _Stats, partial: np.ndarray) -> None:
    """One addition whose result is the exact partial sum ``partial``: it costs u * |partial|."""
    st.lin, st.sq, st.nodes = st.lin + np.abs(partial), st.sq + partial * partial, st.nodes + 1


def _add_group(st: _Stats, depth: int, T: np.ndarray) -> None:
    """A group of terms summed in an unknown order, each through at most ``depth`` roundings."""
    if depth <= 0:
        return
    st.group_lin = st.group_lin + depth * T
    st.group_sq = st.group_sq + depth * T * T
    st.group_roundings += depth
    st.group_depth = max(st.group_depth, depth)


def _inner_trees(st: _Stats, source: DotSource | RowSource, inner: str, blocks: list[tuple[int, int]],
                 products_rounded: bool, exclude_root: bool) -> None:
    """Add the additions inside every block, summed in ``inner`` order."""
    tree = _sequential if inner == "sequential" else _pairwise
    flat = [a.reshape(-1) for a in (st.lin, st.sq, st.leaf_sq, st.peak)]
    for where, P in source.rows():
        for k0, k1 in blocks:
            lin, sq, _, peak = tree(P[:, k0:k1], exclude_root)
            flat[0][where] += lin
            flat[1][where] += sq
            flat[3][where] = np.maximum(flat[3][where], peak)
        flat[3][where] = np.maximum(flat[3][where], np.abs(P).max(axis=-1, initial=0.0))
        if products_rounded:
            flat[2][where] += np.sum(P * P, axis=-1)
    # The root is left out only where there is one: a block of one term has no addition.
    st.nodes += sum(max(k1 - k0 - 1, 0) for k0, k1 in blocks) - (1 if exclude_root and n_root(blocks) else 0)


def n_root(blocks: list[tuple[int, int]]) -> bool:
    return any(k1 - k0 >= 2 for k0, k1 in blocks)


def _tree_height(order: str, n: int) -> int:
    return max(n - 1, 0) if order == "sequential" else pairwise_height(n)
