"""Exact, correctly rounded sums of products: the engine behind every rational op.

An output part (a real output, or the real or imaginary part of a complex
one) is a list of *terms*, each contributing ``coef * (sum of products)``:

* :class:`MatmulTerm`: ``coef * (A @ B)`` with batch broadcasting;
* :class:`RowTerm`: ``coef * sum_k X[..., k] * Y[..., k]`` (Y may be None).

:func:`solve` encloses every element with the float64 fast path, decides the
rounding where the enclosure allows it (:mod:`.decision`), and computes the
rest exactly with integer arithmetic (:mod:`.exact`).  :func:`specials` gives
the IEEE special values (NaN, +-inf) an evaluation of the same terms produces
where an input is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from .. import _fused, _fused_refine
from .._parallel import for_each_slice
from ..formats import Format
from ..rounding import enclosure_bounds, round_dyadic, round_dyadic_down_up, round_float64
from . import decision, fast, products
from .exact import exact_dot_rows, round_rows

__all__ = ["MatmulTerm", "RowTerm", "Solution", "exact_values", "plain_narrow_product", "release_terms", "solve",
           "solve_in_blocks", "specials"]

# Sums longer than this take the BLAS path even when they come as rows.
_SHORT_ROW = 8
# Plain sums at least this long are added in blocks (fast.long_sums), in bounded memory.
_LONG_ROW = 1 << 14


@dataclass
class MatmulTerm:
    """``coef * (A @ B)`` for float64 arrays (..., M, K) and (..., K, N) holding exact values."""

    coef: float
    A: np.ndarray
    B: np.ndarray
    narrow: bool = True  # every value has at most 26 significant bits
    # B prepared once (|B|, its slices) and shared by the blocks of rows of A.
    right: products.Right | None = field(default=None, repr=False, compare=False)
    # The bound S of the last quick enclosure, where the term can refine (see enclose).
    _S: np.ndarray | None = field(default=None, repr=False, compare=False)
    # |A| and |B| in float32, exact, where the op made them as it read narrow A and B
    # (ops/matmul.py): the operands of products.Right's float32 bound on |A| |B|.  Given, every
    # nonzero value lies in [2**-60, 2**60] (products._in_float32_range holds).
    abs_A: np.ndarray | None = field(default=None, repr=False, compare=False)
    abs_B: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def out_shape(self) -> tuple[int, ...]:
        batch = np.broadcast_shapes(self.A.shape[:-2], self.B.shape[:-2])
        return batch + (self.A.shape[-2], self.B.shape[-1])

    @property
    def length(self) -> int:
        return self.A.shape[-1]

    def prepare(self) -> None:
        """Prepare B, once for all the blocks of rows."""
        if self.right is None:
            self.right = products.Right(self.B, narrow=self.narrow, pieces=True, quick=True,
                                        abs_b=self.abs_B if self.narrow else None)

    @property
    def refinable(self) -> bool:
        """Whether ``enclose(shape, fine=True)`` is the tighter (products.Right's quick cut)."""
        return self.right is not None and self.right.refinable

    def enclose(self, shape: tuple[int, ...], fine: bool = False) -> fast.Enclosure:
        self.prepare()
        if not fine:
            enc = self.right.times(self.A, abs_a=self.abs_A if self.narrow else None)
            # Kept for a fine enclosure of these rows (_solve_block): the bound on |A| |B| is the
            # same, and its float32 product costs about half of one of the six float64 ones.
            self._S = enc.S if self.right.refinable else None
            return enc
        S, self._S = self._S, None
        return self.right.times(self.A, fine=True, S=S)

    def rows(self, start: int, stop: int, shape: tuple[int, ...]) -> MatmulTerm:
        """The term of the output rows ``start:stop`` (axis -2)."""
        self.prepare()
        return MatmulTerm(self.coef, self.A[..., start:stop, :], self.B, self.narrow, self.right,
                          abs_A=None if self.abs_A is None else self.abs_A[..., start:stop, :])

    def gather(self, idx: np.ndarray, shape: tuple[int, ...],
               cols: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """The products' factors of the elements ``idx``, terms ``cols`` only, as (len(idx), terms) arrays."""
        *batch, i, j = np.unravel_index(idx, shape)
        a_batch = _batch_index(batch, self.A.shape[:-2], len(shape) - 2)
        b_batch = _batch_index(batch, self.B.shape[:-2], len(shape) - 2)
        X = self.A[..., cols][a_batch + (i, slice(None))]
        if self.B.ndim == 2:
            # np.take walks B's rows once, picking the columns from each: a third of the time of
            # indexing its transpose (23 columns of a 512 x 512 B: 18 against 51 us; 82 against
            # 260 at 2048), and a copy of B's transpose pays only past about 2N columns.
            Y = np.ascontiguousarray(np.take(self.B[cols], j, axis=1).T)
        else:
            # B's columns through its transpose, so that the advanced indices stay adjacent; once
            # the blocks of rows have gathered many columns, through a contiguous copy of it, kept
            # while B is prepared (products.Right.transpose_for says when it pays).
            BT = None if self.right is None else self.right.transpose_for(idx.size)
            Y = (np.swapaxes(self.B, -1, -2) if BT is None else BT)[..., cols][b_batch + (j, slice(None))]
        K = X.shape[-1]
        return X.reshape(idx.size, K), Y.reshape(idx.size, K)

    def special(self) -> np.ndarray:
        return _sign_class(self.A) @ _sign_class(self.B)


@dataclass
class RowTerm:
    """``coef * sum_k X[..., k] * Y[..., k]``; X and Y broadcast to (..., T).

    X and Y are float64, or X is float32 (a sum of narrow values, Y None)."""

    coef: float
    X: np.ndarray
    Y: np.ndarray | None = None
    narrow: bool = True  # every value has at most 26 significant bits
    # The enclosure of the sums, where the op computed it already (fast.long_sums, as it copied X).
    known: fast.Enclosure | None = None

    def shape_with(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape + (self.X.shape[-1],)

    @property
    def length(self) -> int:
        return self.X.shape[-1]

    refinable = False  # (see MatmulTerm)

    def enclose(self, shape: tuple[int, ...], fine: bool = False) -> fast.Enclosure:
        if self.known is not None and np.shape(self.known.hi) == shape:
            return self.known
        X = np.broadcast_to(self.X, self.shape_with(shape))
        Y = None if self.Y is None else np.broadcast_to(self.Y, self.shape_with(shape))
        if Y is None and X.shape[-1] >= _LONG_ROW:
            return fast.long_sums(X, self.narrow)
        X = X.astype(np.float64, copy=False)  # X may hold float32 values (exact ones)
        if X.shape[-1] <= _SHORT_ROW:
            return fast.rowdot(X, Y)
        if Y is None:
            Y = np.ones(X.shape[-1:])
        enc = (products.matmul_narrow if self.narrow else products.matmul_sliced)(X[..., None, :], Y[..., :, None])
        return fast.Enclosure(*(v[..., 0, 0] for v in (enc.hi, enc.lo, enc.rad, enc.S)))

    def prepare(self) -> None:
        """Nothing to prepare (:meth:`MatmulTerm.prepare`)."""

    def rows(self, start: int, stop: int, shape: tuple[int, ...]) -> RowTerm:
        """The term of the output rows ``start:stop`` (axis -2 of ``shape``, or its only axis), as views."""
        full = self.shape_with(shape)
        cut = (Ellipsis, slice(start, stop), slice(None), slice(None)) if len(shape) >= 2 else (slice(start, stop),)
        X = np.broadcast_to(self.X, full)[cut]
        Y = None if self.Y is None else np.broadcast_to(self.Y, full)[cut]
        return RowTerm(self.coef, X, Y, self.narrow)

    def gather(self, idx: np.ndarray, shape: tuple[int, ...],
               cols: slice = slice(None)) -> tuple[np.ndarray, np.ndarray | None]:
        """The factors of the elements ``idx``, terms ``cols`` only, as float64 (len(idx), terms) arrays."""
        full = self.shape_with(shape)
        rows = (int(np.prod(shape, dtype=np.int64)), full[-1])
        X = np.broadcast_to(self.X, full).reshape(rows)[:, cols][idx].astype(np.float64, copy=False)
        Y = None if self.Y is None else \
            np.broadcast_to(self.Y, full).reshape(rows)[:, cols][idx].astype(np.float64, copy=False)
        return X, Y

    def special(self, shape: tuple[int, ...]) -> np.ndarray:
        X = np.broadcast_to(_sign_class(self.X), self.shape_with(shape))
        if self.Y is None:
            return X.sum(axis=-1)
        return np.einsum("...k,...k->...", X, np.broadcast_to(_sign_class(self.Y), X.shape))


Term = MatmulTerm | RowTerm


def _batch_index(batch: list[np.ndarray], own: tuple[int, ...], ndim: int) -> tuple:
    """Index an operand's batch dims from broadcast batch indices (size-1 dims stay at 0)."""
    lead = ndim - len(own)
    return tuple(np.zeros_like(b) if n == 1 else b for b, n in zip(batch[lead:], own))


def _sign_class(x: np.ndarray) -> np.ndarray:
    # Finite nonzero values become +-1 so that sums cannot overflow, while
    # 0, inf and NaN keep their IEEE behaviour in products and sums.
    return np.where(np.isfinite(x), np.sign(x), x)


@dataclass
class Solution:
    """The rounded exact values of one part, float64 bounds on them, and sum|terms| for tolerances."""

    rounded: np.ndarray
    x_lo: np.ndarray
    x_hi: np.ndarray
    S: np.ndarray
    undecided: int
    # Where given, the elements a block's ``decide`` (solve_in_blocks) has judged already, by their
    # decided roundings: ``finish`` judges the others.
    judged: np.ndarray | None = None


# A block's own decisions and judgement (solve_in_blocks): decide(product, cut) -> (decided,
# judged, S) or None.
Decide = Callable[[products.NarrowProduct, tuple[slice, ...]], tuple[np.ndarray, np.ndarray, np.ndarray] | None]


def _enclose(term: Term, shape: tuple[int, ...], fine: bool) -> fast.Enclosure:
    enc = term.enclose(shape, fine)
    hi, lo, rad, S = enc.hi, enc.lo, enc.rad, enc.S
    if (type(hi) is np.ndarray and type(lo) is np.ndarray and type(rad) is np.ndarray and type(S) is np.ndarray
            and hi.shape == lo.shape == rad.shape == S.shape == shape):
        return enc  # the usual case, without np.shape's per-call cost
    return fast.Enclosure(*(v if np.shape(v) == shape else np.broadcast_to(v, shape)
                            for v in (enc.hi, enc.lo, enc.rad, enc.S)))


def enclose(terms: list[Term], shape: tuple[int, ...], fine: bool = False) -> fast.Enclosure:
    """The fast-path enclosure of ``sum(coef * term)`` and the bound S on sum|coef * products|
    (``fine``: each term's tighter one, where it has one)."""
    # A term with a zero coefficient is exactly zero (its inputs are finite here),
    # and enclosing it could only bring 0 * inf into the bounds.
    terms = [t for t in terms if t.coef != 0]
    if not terms:
        z = np.zeros(shape)
        return fast.Enclosure(z, z.copy(), z.copy(), z.copy())
    encs = [(t.coef, _enclose(t, shape, fine)) for t in terms]
    if len(encs) == 1 and encs[0][0] == 1.0:
        return encs[0][1]
    parts: list[np.ndarray] = []
    rad = np.zeros(shape)
    S = np.zeros(shape)
    unsafe = np.zeros(shape, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):
        for coef, enc in encs:
            c = np.float64(coef)
            for v in (enc.hi, enc.lo):
                p, e, safe = fast.two_prod(c, v)
                parts += [p, e]
                unsafe |= ~safe
            rad = rad + abs(coef) * enc.rad
            S = S + abs(coef) * enc.S
        hi, lo, r = fast.combine(parts, fast.up(rad))
        S = fast.up(S)
    return fast.Enclosure(hi, lo, np.where(unsafe, np.inf, r), S)


# Output elements per block of rows: the float64 temporaries of a block stay near 2 MiB each.
# An output of more than half a block makes two blocks, for two threads (exactref/_parallel.py).
# Blocks of 2**17 elements (64 rows of a 2048-column output) ran 12-30% slower at 1024**3
# and 2048**3 than blocks of 2**18: single-threaded BLAS products of so few rows of A
# reached 38 GFLOPS where 256 rows reached 47; at 2**19 the peak memory of a float64
# 2048**3 matmul passed 4x its inputs and output (benchmarks/bench_matmul.py).
_BLOCK = 1 << 18
# Float64 pieces gathered at once for the undecided elements: 32 MiB.
_PIECES = 1 << 22


def solve(terms: list[Term], shape: tuple[int, ...], fmt: Format) -> Solution:
    """Round ``sum(coef * term)`` to ``fmt`` element by element, exactly.

    A large output is solved in blocks of rows (axis -2), so that working
    memory is a few blocks' worth besides the result.
    """
    step = _rows_per_block(terms, shape)
    if step is None:
        # One block, the usual small op: directly, without the blocks' set-up.
        try:
            return _solve_block(terms, shape, fmt)
        finally:
            release_terms(terms)
    arrays = [np.empty(shape) for _ in range(4)]  # the output's, which the blocks fill in
    undecided: list[int] = []  # appends are atomic: the order does not matter

    def keep(sol: Solution, cut: tuple[slice, ...] | None) -> None:
        for array, part in zip(arrays, (sol.rounded, sol.x_lo, sol.x_hi, sol.S)):
            array[cut] = part
        undecided.append(sol.undecided)
    _blocks(terms, shape, fmt, keep, step)
    return Solution(*arrays, sum(undecided))


def solve_in_blocks(terms: list[Term], shape: tuple[int, ...], fmt: Format,
                    finish: Callable[[Solution, tuple[slice, ...] | None], None],
                    into: Callable[[tuple[slice, ...]], tuple[np.ndarray, ...] | None] | None = None,
                    decide: Decide | None = None) -> None:
    """:func:`solve`'s blocks of rows (axis -2), each handed to ``finish(sol, cut)`` on the thread
    that solved it, right after it: ``sol`` is the block's Solution and
    ``cut`` its place in ``shape`` (None where the whole output is one block).  ``finish`` must
    write only its own block's part of any output.  ``into(cut)``, where given, returns three
    arrays of the block's shape (C-contiguous float64), or None: the block's rounded values and
    bounds are written there as they are decided, instead of into arrays of their own.

    ``decide(product, cut)``, where given with ``into``, may make those decisions itself for a
    block whose one term is a 2-D narrow product with coefficient 1, from its BLAS products
    (products.NarrowProduct, before its enclosure is made), writing them into ``into(cut)``'s
    arrays, and judge the block too: it returns ``(decided, judged, S)``, of the block's shape,
    ``judged`` passed on to ``finish`` as the Solution's, S the enclosure's bound on the sums of
    |terms|; or None, to leave the decisions to the engine.  ``decided`` and ``S`` must be what
    the engine's enclosure and decisions would give.
    """
    _blocks(terms, shape, fmt, finish, _rows_per_block(terms, shape), into, decide)


def _blocks(terms: list[Term], shape: tuple[int, ...], fmt: Format,
            finish: Callable[[Solution, tuple[slice, ...] | None], None], step: int | None,
            into: Callable[[tuple[slice, ...]], tuple[np.ndarray, ...] | None] | None = None,
            decide: Decide | None = None) -> None:
    """:func:`solve_in_blocks` with its blocks' rows, ``step``, already known."""
    try:
        if step is None:
            finish(_solve_block(terms, shape, fmt), None)
            return
        axis = max(len(shape) - 2, 0)
        for t in terms:
            t.prepare()  # once, before the blocks share it

        def block(rows: slice) -> None:
            start, stop = rows.start, min(rows.stop, shape[axis])
            sub = [t.rows(start, stop, shape) for t in terms]
            cut = (slice(None),) * axis + (slice(start, stop),)
            finish(_solve_block(sub, shape[:axis] + (stop - start,) + shape[axis + 1:], fmt,
                                None if into is None else lambda: into(cut),
                                None if decide is None else lambda product: decide(product, cut)), cut)

        # The blocks are independent: side by side on the op's threads (exactref/_parallel.py).
        for_each_slice(block, shape[axis], step)
    finally:
        release_terms(terms)


def release_terms(terms: list[Term]) -> None:
    """Drop B's prepared slices and the operands' magnitudes: they are needed no more (the exact
    values use A and B alone), and a result keeps its terms."""
    for t in terms:
        if isinstance(t, MatmulTerm):
            t.right = t._S = t.abs_A = t.abs_B = None


def _rows_per_block(terms: list[Term], shape: tuple[int, ...]) -> int | None:
    """Rows (axis -2, or the only axis) of a block of about _BLOCK elements, or None for one block.

    A block's work is its elements times the terms of each, for short rows.
    """
    if not shape:
        return None
    axis = max(len(shape) - 2, 0)
    per_row = math.prod(shape) // max(shape[axis], 1)
    length = max([t.length for t in terms if isinstance(t, RowTerm) and t.length <= _SHORT_ROW] + [1])
    per_row = max(per_row * length, 1)
    M = shape[axis]
    if M * per_row <= _BLOCK // 2:
        return None
    # At least two blocks, for two threads; a block's rows are those of a thread's BLAS products.
    step = max(1, min(_BLOCK // per_row, -(-M // 2)))
    return None if step >= M else step


def _solve_block(terms: list[Term], shape: tuple[int, ...], fmt: Format,
                 place: Callable[[], tuple[np.ndarray, ...] | None] | None = None,
                 decide: Callable[[products.NarrowProduct], tuple[np.ndarray, np.ndarray, np.ndarray] | None]
                 | None = None) -> Solution:
    """The block's Solution; ``place()``, called once its products are made, may return three
    C-contiguous float64 arrays of ``shape``, where its rounded values and bounds are then written
    (a result's own: see solve_in_blocks), and ``decide(product)`` decide them there (see there too)."""
    product = plain_narrow_product(terms) if decide is not None and place is not None else None
    made = None
    if product is not None:
        into = place()
        made = None if into is None else decide(product)
        enc = None if made is not None else product.enclosure()
    else:
        enc = enclose(terms, shape)
        into = None if place is None else place()
    judged = None
    if made is not None:
        (rounded, x_lo, x_hi), (decided, judged, S) = into, made
    else:
        rounded, x_lo, x_hi, decided = _decide(enc, fmt, into)
        if any(t.refinable for t in terms):  # (first: a small op notices each microsecond)
            size = math.prod(shape)
            if size - np.count_nonzero(decided) > max(size * _REFINE_SHARE, _REFINE_MIN):
                # The quick enclosure left too many for the exact path (cancelling sums, say): the
                # six products' enclosure decides nearly all of them (products.Right).
                enc = enclose(terms, shape, fine=True)
                rounded, x_lo, x_hi, decided = _decide(enc, fmt, into)
        S = np.asarray(enc.S, dtype=np.float64).reshape(shape)
    # Fresh, writable float64 arrays (the undecided elements are written in below).
    if into is None:
        rounded, x_lo, x_hi = (_fresh(v).reshape(shape) for v in (rounded, x_lo, x_hi))
    undecided = ~np.asarray(decided)
    if not undecided.any():  # the usual case: cheaper than np.flatnonzero, which a small output notices
        return Solution(rounded, x_lo, x_hi, S, 0, judged)
    idx = np.flatnonzero(undecided)
    count = idx.size
    if enc is not None and enc.pieces is not None and enc.exact is not None:
        idx = _round_pieces(enc.pieces, enc.exact, idx, fmt,
                            rounded.reshape(-1), x_lo.reshape(-1), x_hi.reshape(-1))
    del enc
    per_row = max(1, 2 * _length(terms))
    if idx.size and per_row > _PIECES:
        # Rows too long to gather at once: exactly, a block of terms at a time.
        flat_r, flat_lo, flat_hi = rounded.reshape(-1), x_lo.reshape(-1), x_hi.reshape(-1)
        for i in idx:
            flat_r[i], flat_lo[i], flat_hi[i] = _exact_long(terms, shape, int(i), fmt)
    elif idx.size:
        step = max(1, _PIECES // per_row)
        for start in range(0, idx.size, step):
            _exact_round(terms, shape, idx[start:start + step], fmt,
                         rounded.reshape(-1), x_lo.reshape(-1), x_hi.reshape(-1))
    return Solution(rounded, x_lo, x_hi, S, count, judged)


# A block whose quick enclosure leaves more than this share of its elements undecided, and more
# than _REFINE_MIN of them, takes the fine one (see _solve_block).  At K = 512, on one thread, the
# exact path took 1.8-2.4 ms for the 85-89 undecided elements of a block of 256 rows of a
# standard normal product (about 23 us each), and the block's six products with their bounds
# 17.5 ms: they pay for themselves past about 760 elements, 1/170 of the block (1/128 leans to
# the exact path).  A few elements are cheaper exactly: with every element cancelling, 4 x 4 and
# 8 x 8 outputs took 1020 and 1099 us with the six products against 854 and 1011 us without;
# 16 x 16 took 1209 against 1625, and 32 x 32 2010 against 3569.
_REFINE_SHARE = 1 / 128
_REFINE_MIN = 128


def _plain_product(terms: list[Term]) -> MatmulTerm | None:
    """The one term of a block that is a 2-D product with coefficient 1 (a matmul's block), or None:
    the blocks the compiled gathers take, and, narrow, the compiled decision."""
    if len(terms) != 1:
        return None
    t = terms[0]
    ok = isinstance(t, MatmulTerm) and t.coef == 1 and t.A.ndim == 2 and t.B.ndim == 2
    return t if ok else None


def plain_narrow_product(terms: list[Term]) -> products.NarrowProduct | None:
    """The BLAS products of a narrow :func:`_plain_product` block, before its enclosure is made
    (solve_in_blocks's ``decide``)."""
    t = _plain_product(terms)
    if t is None or not t.narrow:
        return None
    t.prepare()
    return t.right.narrow_product(t.A, t.abs_A)


def _decide(enc: fast.Enclosure, fmt: Format, into: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rounding to ``fmt`` of the values in ``enc``, float64 bounds on them, and where decided;
    the first three written into ``into`` where given (see _solve_block), and returned as them."""
    # (The same values by one compiled loop where it applies: exactref/_fused.py.)
    if fmt.p == 53:
        fused = _fused.decide_float64(enc.hi, enc.lo, enc.rad, into)
        return fused if fused is not None else _placed(decision.decide_float64(enc.hi, enc.lo, enc.rad), into)
    if enc.lo_zero and _fused.decides(fmt):
        fused = _fused.decide_narrow(enc.hi, enc.rad, fmt, into)
        if fused is not None:
            return fused
    x_lo, x_hi = decision.bounds_lo_zero(enc.hi, enc.rad) if enc.lo_zero else enclosure_bounds(enc.hi, enc.lo, enc.rad)
    rounded, decided = decision.decide_narrow(x_lo, x_hi, fmt)
    return _placed((rounded, x_lo, x_hi, decided), into)


def _placed(decision: tuple[np.ndarray, ...], into: tuple[np.ndarray, ...] | None) -> tuple[np.ndarray, ...]:
    """``(rounded, x_lo, x_hi, decided)`` with the first three copied into ``into``, where given."""
    if into is None:
        return decision
    for dst, src in zip(into, decision):
        np.copyto(dst, np.asarray(src).reshape(dst.shape))
    return (*into, decision[3])


def _round_pieces(parts: tuple[np.ndarray, ...], exact: np.ndarray, idx: np.ndarray, fmt: Format,
                  flat_r: np.ndarray, flat_lo: np.ndarray, flat_hi: np.ndarray) -> np.ndarray:
    """Round exactly the elements of ``idx`` where ``exact`` says the few ``parts`` sum to the exact
    value (:class:`fast.Enclosure`), by math.fsum; returns the rest of ``idx``.  A zero sum is left
    to the exact path, which knows the sign of a zero."""
    mine = idx[exact.reshape(-1)[idx]]
    if not mine.size:
        return idx
    pieces = np.stack([np.asarray(p).reshape(-1)[mine] for p in parts], axis=1)
    value, lo, hi, ok = round_rows(pieces, fmt.p)
    if fmt.p != 53:
        value = round_float64(value, fmt)
    ok &= (lo != 0) | (hi != 0)
    done = mine[ok]
    flat_r[done], flat_lo[done], flat_hi[done] = value[ok], lo[ok], hi[ok]
    return np.setdiff1d(idx, done, assume_unique=True)


def _fresh(v: np.ndarray) -> np.ndarray:
    """``np.require(np.asarray(v, dtype=np.float64), requirements=["C", "W", "O"])``, without its
    per-call cost (a small op pays it three times per part) where ``v`` already is such an array."""
    if type(v) is np.ndarray and v.dtype == np.float64:
        flags = v.flags
        if flags.c_contiguous and flags.writeable and flags.owndata:
            return v
    return np.require(np.asarray(v, dtype=np.float64), requirements=["C", "W", "O"])


def _length(terms: list[Term]) -> int:
    return sum(t.length for t in terms if t.coef != 0)


def _exact_round(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray, fmt: Format,
                 flat_r: np.ndarray, flat_lo: np.ndarray, flat_hi: np.ndarray) -> None:
    """Fill in the correctly rounded values, and float64 bounds, of the elements ``idx``.

    Rows whose products split exactly into float64 pieces are first summed
    by a vectorised two-sum tree, whose enclosure decides nearly all of
    them; the few left (exact ties, exact float64 values, zeros) are summed
    with math.fsum; the rest (products underflowing or overflowing float64)
    go through the integer accumulator.  Every path gives the same values:
    the correct rounding and the float64 neighbours of the exact value.
    """
    pieces, safe = _pieces(terms, shape, idx)
    rows = np.flatnonzero(safe)
    value, lo, hi, ok = decision.refine(pieces if rows.size == idx.size else pieces[rows], fmt)
    if rows.size == idx.size and ok.all():  # the usual case: every row decided (the rest is for the few)
        flat_r[idx], flat_lo[idx], flat_hi[idx] = value, lo, hi
        return
    done_fast = rows[ok]
    flat_r[idx[done_fast]], flat_lo[idx[done_fast]], flat_hi[idx[done_fast]] = value[ok], lo[ok], hi[ok]
    slow = rows[~ok]
    value, lo, hi, ok = round_rows(pieces[slow], fmt.p)
    del pieces
    done = slow[ok]
    value, lo, hi = value[ok], lo[ok], hi[ok]
    if fmt.p != 53:
        value = round_float64(value, fmt)
    zero = (lo == 0) & (hi == 0)
    if zero.any():
        negzero = _all_negative_zero(terms, shape, idx[done[zero]])
        value[zero] = np.where(negzero, -0.0, 0.0)
    flat_r[idx[done]], flat_lo[idx[done]], flat_hi[idx[done]] = value, lo, hi
    left = np.ones(idx.size, dtype=bool)  # (np.setdiff1d sorts: 0.2 ms for 23 elements)
    left[done_fast] = left[done] = False
    rest = np.flatnonzero(left)
    if rest.size:
        values = exact_values(terms, shape, idx[rest])
        negzero = _all_negative_zero(terms, shape, idx[rest])
        for k, (n, e) in enumerate(values):
            i = idx[rest[k]]
            flat_r[i] = round_dyadic(n, e, fmt, negative_zero=bool(negzero[k]))
            flat_lo[i], flat_hi[i] = round_dyadic_down_up(n, e)


def _exact_long(terms: list[Term], shape: tuple[int, ...], i: int, fmt: Format) -> tuple[float, float, float]:
    """The rounding and float64 bounds of element ``i``, summed exactly a block of terms at a time."""
    # Fewer than 2**18 terms a block keep the integer accumulator on its fast (bincount) path.
    width = (1 << 18) - 1
    total = (0, 0)
    negzero, seen = True, False
    idx = np.array([i])
    for term in terms:
        for start in range(0, max(term.length, 1), width):
            cols = slice(start, start + width)
            if term.coef != 0:
                X, Y = term.gather(idx, shape, cols)
                (n, e), = exact_dot_rows(X, Y)
                cm, ce = _dyadic(term.coef)
                total = _add(total, (n * cm, e + ce))
            nz, s = _negative_zero_rows(term, shape, idx, cols)
            negzero &= bool(nz[0])
            seen |= s
    n, e = total
    return (round_dyadic(n, e, fmt, negative_zero=negzero and seen), *round_dyadic_down_up(n, e))


def _pieces(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 pieces whose row sums are the exact values of ``idx``, and which rows split safely."""
    t = _plain_product(terms)
    if t is not None:
        if t.narrow:
            # A float32 matmul's block, say: the same products by one compiled gather.
            made = _fused_refine.gather_products(t.A, t.B, idx)
        else:
            # A float64 matmul's block: the same products and errors by one compiled gather, B's
            # columns from a contiguous transpose once many are read (products.Right.transpose_for;
            # an F-contiguous B, a gradient's, is one already).
            BT = None if t.right is None or t.B.flags.f_contiguous else t.right.transpose_for(idx.size)
            made = _fused_refine.gather_two_products(t.A, t.B, idx, BT)
        if made is not None:
            return made
    cols: list[np.ndarray] = []
    safe = np.ones(idx.size, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for term in terms:
            if term.coef == 0:
                continue
            X, Y = term.gather(idx, shape)
            if Y is None:
                parts = [X]
            elif term.narrow:
                parts = [X * Y]  # exact: at most 26 significant bits each, far from underflow
            else:
                p, e, ok = fast.two_prod(X, Y)
                parts = [p, e]
                safe &= ok.all(axis=1)
            if term.coef != 1:
                scaled = []
                for v in parts:
                    p, e, ok = fast.two_prod(np.float64(term.coef), v)
                    scaled += [p, e]
                    safe &= ok.all(axis=1)
                parts = scaled
            cols += parts
    pieces = np.concatenate(cols, axis=1) if cols else np.zeros((idx.size, 0))
    safe &= np.isfinite(pieces).all(axis=1)
    return pieces, safe


def exact_values(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> list[tuple[int, int]]:
    """Exact ``(n, e)`` with value ``n * 2**e`` for the flat indices ``idx``."""
    totals = [(0, 0)] * idx.size
    for term in terms:
        if term.coef == 0:
            continue
        X, Y = term.gather(idx, shape)
        sums = exact_dot_rows(X, Y)
        cm, ce = _dyadic(term.coef)
        totals = [_add(t, (n * cm, e + ce)) for t, (n, e) in zip(totals, sums)]
    return totals


def exact_fraction(terms: list[Term], shape: tuple[int, ...], flat_index: int) -> Fraction:
    (n, e), = exact_values(terms, shape, np.array([flat_index]))
    return Fraction(n) * Fraction(2) ** e


def _dyadic(x: float) -> tuple[int, int]:
    m, e = math.frexp(x)
    return int(m * (1 << 53)), e - 53


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    (n1, e1), (n2, e2) = a, b
    if n1 == 0:
        return b
    if n2 == 0:
        return a
    if e1 <= e2:
        return n1 + (n2 << (e2 - e1)), e1
    return (n1 << (e1 - e2)) + n2, e2


def _all_negative_zero(terms: list[Term], shape: tuple[int, ...], idx: np.ndarray) -> np.ndarray:
    """Whether every product of the element is a zero with a minus sign (IEEE then sums to -0)."""
    result = np.ones(idx.size, dtype=bool)
    seen = False
    for term in terms:
        nz, s = _negative_zero_rows(term, shape, idx, slice(None))
        result &= nz
        seen |= s
    return result & seen


def _negative_zero_rows(term: Term, shape: tuple[int, ...], idx: np.ndarray, cols: slice) -> tuple[np.ndarray, bool]:
    """Whether the products ``cols`` of each element are all zeros with a minus sign, and whether there are any."""
    X, Y = term.gather(idx, shape, cols)
    zero = (X == 0) | (term.coef == 0)
    sign = np.signbit(X) ^ bool(np.signbit(term.coef))
    if Y is not None:
        zero |= Y == 0
        sign ^= np.signbit(Y)
    return np.all(zero & sign, axis=1), X.shape[1] > 0


def specials(terms: list[Term], shape: tuple[int, ...]) -> np.ndarray:
    """float64 array: NaN or +-inf where an IEEE evaluation of the terms gives one, 0 elsewhere."""
    total = np.zeros(shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for term in terms:
            s = term.special() if isinstance(term, MatmulTerm) else term.special(shape)
            total = total + np.float64(math.copysign(1.0, term.coef) if term.coef else 0.0) * s
    return np.where(np.isfinite(total), 0.0, total)
