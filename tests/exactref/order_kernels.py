"""Numpy kernels that sum in a declared order, bit for bit, and planted bugs.

These are test tools, independent of the exactref code under test: they never
import exactref.  Each correct kernel emulates, exactly, a kernel that adds up
its terms in one declared order with every addition rounded in an
accumulation format:

* ``"sequential"``: one chain in index order, ``acc = t1; acc = fl(acc + t_k)``;
* ``"pairwise"``: numpy's ``pairwise_sum`` (numpy/_core/src/umath/
  loops_utils.h.src): below 8 terms a plain loop from -0.0; up to 128 terms
  eight strided accumulators, combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)),
  then the leftover n % 8 terms; above 128 terms a split at n//2 rounded down
  to a multiple of 8, each half summed the same way;
* ``"any"``: a random order drawn from ``rng`` (a random chain, random
  balanced pairing or a random coalescent tree, per output element);
* :class:`Blocked`: contiguous blocks of ``size`` terms, each summed in the
  ``inner`` order, the block sums added in a chain (``splits`` chains over
  contiguous groups of blocks, their results summed in a random order): the
  BLOCK_K loop of a tiled kernel.

Every kernel works on a terms array of shape ``(n, *out)`` and loops over the
reduced index only, never over output elements, so that it is fast enough for
K = 16384 and n = 10**6.

What numpy itself does (checked in test_order_kernels.py with numpy 2.4):
``np.sum`` of a 1-D float32 array, contiguous or strided, is bit for bit
``pairwise_sum`` of all n elements (up to the sign of a zero sum), for every n
tried up to 3 * 10**6: no buffer chunks.  Chunks appear only with a cast,
e.g. ``np.sum(x, dtype=np.float64)``; see :func:`numpy_add_reduce`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16,
           "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
HALF = (np.dtype(np.float16), BFLOAT16)


@dataclass(frozen=True)
class Blocked:
    """Contiguous blocks of ``size`` terms; block sums added in chains (see the module docstring).

    A twin of ``exactref.models.Blocked`` for the kernels; any object with
    ``size``, ``inner`` and ``splits`` attributes is accepted in its place.
    """

    size: int
    inner: str = "any"
    splits: int = 1


def fmt(dtype) -> np.dtype:
    """A numpy dtype from a name ("bfloat16" included) or a dtype."""
    return FORMATS[dtype] if isinstance(dtype, str) else np.dtype(dtype)


def default_acc(dtype) -> np.dtype:
    """float32 for half and float32 inputs (PyTorch's CPU kernels), float64 for float64."""
    return np.dtype(np.float64) if fmt(dtype) == np.float64 else np.dtype(np.float32)


# --------------------------------------------------------------------------
# Orders on a terms array T of shape (n, C): the sum over axis 0, in T's dtype.
# --------------------------------------------------------------------------

def sum_sequential(T: np.ndarray) -> np.ndarray:
    """acc = T[0]; acc = fl(acc + T[k]) for k = 1..n-1."""
    acc = T[0].copy()
    for k in range(1, T.shape[0]):
        acc = acc + T[k]
    return acc


@lru_cache(maxsize=64)
def pairwise_plan(n: int):
    """numpy's pairwise_sum recursion for n terms: ("leaf", start, length) or ("node", left, right)."""
    def plan(start, m):
        if m <= 128:
            return ("leaf", start, m)
        n2 = m // 2
        n2 -= n2 % 8
        return ("node", plan(start, n2), plan(start + n2, m - n2))
    return plan(0, n)


def _leaves(node, out):
    if node[0] == "leaf":
        out.append(node)
    else:
        _leaves(node[1], out)
        _leaves(node[2], out)
    return out


def _pairwise_leaf(G: np.ndarray) -> np.ndarray:
    """pairwise_sum's base cases on G of shape (leaves, L, C), all leaves of one length L."""
    L = G.shape[1]
    if L < 8:
        res = np.full(G.shape[:1] + G.shape[2:], -0.0, dtype=G.dtype)  # numpy starts from -0.0
        for i in range(L):
            res = res + G[:, i]
        return res
    r = G[:, 0:8].copy()
    end = L - L % 8
    for i in range(8, end, 8):
        r = r + G[:, i:i + 8]
    res = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
    for i in range(end, L):
        res = res + G[:, i]
    return res


def sum_pairwise(T: np.ndarray) -> np.ndarray:
    """numpy's pairwise_sum over axis 0, vectorised over columns and over leaves of equal length."""
    n = T.shape[0]
    if n == 0:
        return np.full(T.shape[1:], -0.0, dtype=T.dtype)
    plan = pairwise_plan(n)
    leaves = _leaves(plan, [])
    value = {}
    for L in sorted({leaf[2] for leaf in leaves}):
        same = [leaf for leaf in leaves if leaf[2] == L]
        starts = np.array([leaf[1] for leaf in same])
        sums = _pairwise_leaf(T[starts[:, None] + np.arange(L)])
        for leaf, s in zip(same, sums):
            value[leaf] = s

    def combine(node):
        if node[0] == "leaf":
            return value[node]
        return combine(node[1]) + combine(node[2])
    return combine(plan)


def _permuted(T: np.ndarray, rng) -> np.ndarray:
    """T with each column's entries in an independent random order."""
    idx = np.argsort(rng.random(T.shape), axis=0)
    return np.take_along_axis(T, idx, axis=0)


def _chain_random(T, rng):
    return sum_sequential(_permuted(T, rng))


def _pairing_random(T, rng):
    """Balanced tree: at every level the live partial sums are shuffled and added in pairs."""
    W = T
    while W.shape[0] > 1:
        W = _permuted(W, rng)
        h = W.shape[0] // 2
        pairs = W[0:2 * h:2] + W[1:2 * h:2]
        W = np.concatenate([pairs, W[2 * h:]]) if W.shape[0] % 2 else pairs
    return W[0].copy()


def _coalescent_random(T, rng):
    """Random tree shapes: n - 1 times, two random live partial sums per column are added."""
    W = T.copy()
    cols = np.arange(W.shape[1])
    for c in range(W.shape[0], 1, -1):
        i1 = rng.integers(0, c, W.shape[1])
        i2 = (i1 + rng.integers(1, c, W.shape[1])) % c  # distinct from i1
        W[i1, cols] = W[i1, cols] + W[i2, cols]
        W[i2, cols] = W[c - 1, cols]  # slot i2 is free: move the last live entry there
    return W[0].copy()


ANY_STYLES = (_chain_random, _pairing_random, _coalescent_random)


def sum_any(T: np.ndarray, rng, style: int | None = None) -> np.ndarray:
    """A random order: one of a random chain, random pairing or random coalescent tree (``style`` 0, 1, 2)."""
    if T.shape[0] == 1:
        return T[0].copy()
    style = rng.integers(len(ANY_STYLES)) if style is None else style
    return ANY_STYLES[style](T, rng)


def _sum_flat(T, inner, rng):
    if inner == "sequential":
        return sum_sequential(T)
    if inner == "pairwise":
        return sum_pairwise(T)
    if inner == "any":
        return sum_any(T, rng)
    raise ValueError(f"unknown order {inner!r}")


def block_sums(T: np.ndarray, size: int, inner: str, rng) -> list[np.ndarray]:
    """The sums of the contiguous blocks of ``size`` terms, full blocks vectorised as extra columns."""
    n, C = T.shape
    full = n // size
    sums = []
    if full:
        G = T[:full * size].reshape(full, size, C).transpose(1, 0, 2).reshape(size, full * C)
        sums = list(_sum_flat(G, inner, rng).reshape(full, C))
    if n % size:
        sums.append(_sum_flat(T[full * size:], inner, rng))
    return sums


def sum_blocked(T: np.ndarray, order, rng) -> np.ndarray:
    """Blocks summed in ``order.inner``; each of ``order.splits`` groups of blocks a chain; groups in any order."""
    sums = block_sums(T, order.size, order.inner, rng)
    per_group = math.ceil(len(sums) / order.splits)
    chains = [sum_sequential(np.stack(sums[g:g + per_group])) for g in range(0, len(sums), per_group)]
    return chains[0] if len(chains) == 1 else sum_any(np.stack(chains), rng)


def reduce_terms(T: np.ndarray, order, rng=None) -> np.ndarray:
    """The sum over axis 0 of T (shape (n, *out)) in ``order``, every addition rounded in T's dtype."""
    rng = np.random.default_rng() if rng is None else rng
    out_shape = T.shape[1:]
    T2 = T.reshape(T.shape[0], -1)
    if T.shape[0] == 0:
        return np.zeros(out_shape, dtype=T.dtype)
    if isinstance(order, str):
        res = _sum_flat(T2, order, rng)
    else:
        res = sum_blocked(T2, order, rng)
    return res.reshape(out_shape)


# --------------------------------------------------------------------------
# Rounding helpers.
# --------------------------------------------------------------------------

def round_to(x, dtype, mode: str = "nearest") -> np.ndarray:
    """x rounded to ``dtype``: to nearest, ties to even, or toward zero ("truncate")."""
    x = np.asarray(x)
    y = x.astype(fmt(dtype))
    if mode == "nearest":
        return y
    # The nearest value is one of the two neighbours of x; if it is the one farther
    # from zero, its neighbour toward zero is the truncation.
    wide = np.float64
    too_big = np.abs(y.astype(wide)) > np.abs(x.astype(wide))
    toward_zero = np.nextafter(y, np.zeros_like(y))
    return np.where(too_big, toward_zero, y)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> TF32 (10 fraction bits), round to nearest, ties to even; kept as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return bits.astype(np.uint32).view(np.float32)


def round_bf16_inputs(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32 (torch's "medium" float32 matmul precision)."""
    return np.asarray(x, dtype=np.float32).astype(BFLOAT16).astype(np.float32)


def fma_round32(acc: np.ndarray, p: np.ndarray) -> np.ndarray:
    """RN_float32(acc + p) for float32 acc and float64 p, with one rounding (a fused multiply-add).

    acc + p is computed in float64 rounded to odd (TwoSum gives the error; an
    inexact even result steps one ulp toward the exact value); rounding to odd
    with 53 >= 24 + 2 bits and then to float32 is a single correct rounding.
    """
    a = acc.astype(np.float64)
    s = a + p
    bb = s - a
    err = (a - (s - bb)) + (p - bb)
    even = (s.view(np.int64) & 1) == 0
    step = (err != 0) & even
    s = np.where(step, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


# --------------------------------------------------------------------------
# Correct kernels.
# --------------------------------------------------------------------------

def matmul_terms(A: np.ndarray, B: np.ndarray, acc) -> np.ndarray:
    """The K products A[:, k] B[k, :] as an array (K, M, N), each rounded once to ``acc``.

    Products of half inputs are exact in float32 and of float32 inputs in
    float64, so one rounding from float64 is the kernel's own multiply.
    """
    A64, B64 = np.asarray(A).astype(np.float64), np.asarray(B).astype(np.float64)
    return (A64.T[:, :, None] * B64[:, None, :]).astype(fmt(acc))


def _sequential_fma(A, B) -> np.ndarray:
    """float32 chain with fused multiply-adds: acc = RN(a0 b0); acc = RN(acc + a_k b_k)."""
    P = np.asarray(A).astype(np.float64).T[:, :, None] * np.asarray(B).astype(np.float64)[:, None, :]
    acc = P[0].astype(np.float32)
    for k in range(1, P.shape[0]):
        acc = fma_round32(acc, P[k])
    return acc


def _blocked_fma(A, B, order) -> np.ndarray:
    """Blocked(size, inner="sequential") with FMAs inside each block; block sums added in plain adds."""
    K = A.shape[1]
    sums = [_sequential_fma(A[:, s:s + order.size], B[s:s + order.size]) for s in range(0, K, order.size)]
    per_group = math.ceil(len(sums) / order.splits)
    chains = [sum_sequential(np.stack(sums[g:g + per_group])) for g in range(0, len(sums), per_group)]
    if len(chains) > 1:
        raise NotImplementedError("fma with splits > 1")
    return chains[0]


def dot_matmul(A, B, order, acc=None, out=None, rng=None, fma: bool = False, cast: str = "nearest"):
    """A @ B summed over K in ``order``, accumulated in ``acc``, rounded once to ``out``.

    ``acc`` defaults to float32 (float64 for float64 inputs) and ``out`` to the
    input format.  ``fma=True``: float32 products are not rounded before they
    are added (sequential chains only: "sequential" or Blocked(inner="sequential")).
    ``cast="truncate"``: the final conversion rounds toward zero (a planted bug).
    """
    A, B = np.asarray(A), np.asarray(B)
    acc = default_acc(A.dtype) if acc is None else fmt(acc)
    out = A.dtype if out is None else fmt(out)
    if fma:
        if acc != np.float32:
            raise NotImplementedError("fma emulation is for float32 accumulation")
        if order == "sequential":
            res = _sequential_fma(A, B)
        elif getattr(order, "inner", None) == "sequential":
            res = _blocked_fma(A, B, order)
        else:
            raise NotImplementedError("fma emulation is for sequential chains")
    else:
        res = reduce_terms(matmul_terms(A, B, acc), order, rng)
    return round_to(res, out, cast)


def reduce_sum(x, order, acc=None, out=None, rng=None, axis=None, cast: str = "nearest"):
    """The sum of x over ``axis`` (None: all), in ``order``, accumulated in ``acc``, rounded once to ``out``.

    Several reduced axes are flattened in C order into one index of the sum.
    """
    x = np.asarray(x)
    acc = default_acc(x.dtype) if acc is None else fmt(acc)
    out = x.dtype if out is None else fmt(out)
    axes = tuple(range(x.ndim)) if axis is None else tuple(np.atleast_1d(axis) % max(x.ndim, 1))
    keep = [d for d in range(x.ndim) if d not in axes]
    moved = np.transpose(x, axes + tuple(keep))
    T = moved.reshape((-1,) + tuple(x.shape[d] for d in keep)).astype(acc)
    return round_to(reduce_terms(T, order, rng), out, cast)


def numpy_add_reduce(x: np.ndarray, buffersize: int | None = None) -> np.generic:
    """The order np.add.reduce / np.sum uses for a 1-D float32 or float64 array (numpy 2.x).

    Without buffering (the array's own dtype, contiguous or strided) it is
    +0.0 + pairwise_sum(x) over the whole array: the identity +0.0 starts the
    result, so the only difference from pairwise_sum is that a -0.0 sum
    comes back as +0.0.  With a cast (``np.sum(x, dtype=...)``) numpy's
    iterator buffers ``buffersize`` elements (8192) at a time: each buffer is
    one pairwise_sum, added to the running result in a chain, i.e.
    Blocked(8192, inner="pairwise") starting from +0.0.  Float16 arrays
    follow the same rules with a float32 accumulator, rounded to float16 once
    per inner-loop call.
    """
    x = np.asarray(x)
    acc = np.zeros((), dtype=x.dtype)
    step = x.shape[0] if buffersize is None else buffersize
    for s in range(0, x.shape[0], max(step, 1)):
        acc = acc + sum_pairwise(x[s:s + step, None])[0]
    return acc


# --------------------------------------------------------------------------
# Planted bugs.  Each takes what the correct kernel takes and returns the same shape.
# --------------------------------------------------------------------------

def tf32_inputs_matmul(A, B, order, rng=None, **kw):
    """Inputs rounded to TF32 before the multiply (torch's "high" precision, judged as float32)."""
    return dot_matmul(round_tf32(A), round_tf32(B), order, rng=rng, **kw)


def bf16_inputs_matmul(A, B, order, rng=None, **kw):
    """Inputs rounded to bfloat16 before the multiply (torch's "medium" precision)."""
    return dot_matmul(round_bf16_inputs(A), round_bf16_inputs(B), order, rng=rng, **kw)


def skipped_term_matmul(A, B, order, rng, acc=None, out=None):
    """One index k of the K products (chosen by rng, the same for every output) is left out."""
    A, B = np.asarray(A), np.asarray(B)
    acc = default_acc(A.dtype) if acc is None else fmt(acc)
    T = matmul_terms(A, B, acc)
    T[rng.integers(T.shape[0])] = 0
    return round_to(reduce_terms(T, order, rng), A.dtype if out is None else fmt(out))


def skipped_term_sum(x, order, rng, acc=None, out=None):
    """One element of a 1-D sum (chosen by rng) is left out."""
    x = np.array(x)
    x[rng.integers(x.shape[0])] = 0
    return reduce_sum(x, order, acc, out, rng)


def ulps_off(y, k: int, rng) -> np.ndarray:
    """A copy of y with one element (chosen by rng) moved k ulps of its format, in a random direction."""
    y = np.array(y)
    flat = y.reshape(-1)
    i = rng.integers(flat.size)
    target = np.array(np.inf if rng.integers(2) else -np.inf, dtype=y.dtype)
    v = flat[i:i + 1]
    for _ in range(k):
        v = np.nextafter(v, target)
    flat[i] = v[0]
    return y


def half_chunks_matmul(A, B, chunk: int = 16, **_):
    """Products rounded to the half input format and added in it: chains of ``chunk`` terms, then across chunks."""
    A = np.asarray(A)
    return dot_matmul(A, B, Blocked(chunk, inner="sequential"), acc=A.dtype)


def half_chunks_sum(x, chunk: int = 16, **_):
    """A half-format sum accumulated in the half format: chains of ``chunk`` terms, then across chunks."""
    x = np.asarray(x)
    return reduce_sum(x, Blocked(chunk, inner="sequential"), acc=x.dtype)


def truncating_matmul(A, B, order, rng=None):
    """The right sum in a wider format (float32 for half inputs, float64 for float32), chopped to the output."""
    A = np.asarray(A)
    acc = np.float64 if A.dtype == np.float32 else np.float32
    return dot_matmul(A, B, order, acc=acc, rng=rng, cast="truncate")


def truncating_sum(x, order, rng=None):
    """The right sum in a wider format, chopped to the output format."""
    x = np.asarray(x)
    acc = np.float64 if x.dtype == np.float32 else np.float32
    return reduce_sum(x, order, acc=acc, rng=rng, cast="truncate")


def flush_small(y, magnitude, threshold: float = 2.0 ** -10) -> np.ndarray:
    """A correct result with every element below ``threshold`` times ``magnitude`` flushed to +0.

    ``magnitude`` is what the kernel knows, e.g. sum |terms| per element: an
    "it must be rounding noise" shortcut that is wrong where the small value is
    the true answer after cancellation.
    """
    y = np.array(y)
    small = np.abs(y.astype(np.float64)) < threshold * np.asarray(magnitude, dtype=np.float64)
    y[small] = 0
    return y


def abs_terms_matmul(A, B) -> np.ndarray:
    """sum_k |A[m, k] B[k, n]| in float64 (what flush_small compares against)."""
    return np.abs(np.asarray(A).astype(np.float64)) @ np.abs(np.asarray(B).astype(np.float64))
