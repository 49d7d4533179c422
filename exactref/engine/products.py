"""Enclosures of matrix products ``A @ B``, in the form of :mod:`exactref.engine.fast`.

* :func:`matmul_narrow`: inputs with at most 26 significant bits (float32 and
  narrower), whose products are exact in float64: one BLAS product for ``hi``
  and one of the absolute values for the bound.
* :func:`matmul_sliced`: float64 inputs, by error-free slicing (Ozaki's
  scheme).  Each row of A and column of B is cut into slices whose leading
  products sum exactly in float64, so four to six BLAS products give the
  result to about three times float64's precision.
* :class:`Right`: the right operand of both, prepared once, for products
  with many blocks of rows of A (bounded memory).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from .. import _fused
from .._parallel import for_each_slice
from .._pool import empty
from .fast import U64, Enclosure, _slices, _two_sum_into, _up_into, gamma, up

__all__ = ["NarrowProduct", "Right", "matmul_narrow", "matmul_sliced", "one_slice_exponents"]


def matmul_narrow(A: np.ndarray, B: np.ndarray) -> Enclosure:
    """``A @ B`` for inputs whose products are exact in float64 (float32 and narrower)."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return Right(B, narrow=True).times(A)


def matmul_sliced(A: np.ndarray, B: np.ndarray, *, bound: bool = True, quick: bool = False,
                  b_bits: int | None = None) -> Enclosure:
    """``A @ B`` for float64 inputs, to about three times float64's precision, by error-free slicing.

    A large product is computed in blocks of rows of A, side by side (exactref/_parallel.py);
    the blocks do not depend on the number of threads, so neither do the results.

    With ``bound`` False the Enclosure's S is None: the bound on ``|A| @ |B|``,
    a float32 product and one more array of the output's size, is not made.
    The radius does not depend on it.  (Attention's logits, 1x4x2048x128:
    134 MB and a float32 product saved, see exactref/ops/attention/_first.py.)

    With ``quick`` B takes the quick cut whatever K (:class:`Right`): four BLAS
    products instead of six, with a radius of about 2**-28 gamma_K times the
    rest's rank-one bounds (row sums of ``|A|`` times column maxima of ``|B|``,
    and the converse), for a product whose enclosure is not asked to decide
    float64 roundings.  ``b_bits`` sets that slice's width (A's two take the rest of the budget):
    for B's values of at most 24 significant bits (float32 and narrower), 24 bits leaves a remainder
    of B only where a column spans more than its slice, and A's two slices of 53 - 24 -
    log2(K) bits hold float32 values whole unless a row spans more than them: three products, of
    which one, (A0 + A1) RB, is rounded, at about 2**-24 gamma_K of B's column maxima.
    """
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        cut = one_slice_exponents(B.shape[-2], b_bits) if quick else None
        right = Right(B, narrow=False, bound=bound, one_slice=cut)
        shape = right.out_shape(A)
        M = shape[-2]
        step = rows_per_block(shape, _ROWS_BLOCK, A.shape, _A_BLOCK)
        if step >= M:
            return right.times(A)
        hi, lo, rad = (empty(shape, np.float64) for _ in range(3))
        S = empty(shape, np.float64) if bound else None

        def block(rows: slice) -> None:
            enc = right.times(A[..., rows, :])
            cut = (Ellipsis, rows, slice(None))
            hi[cut], lo[cut], rad[cut] = enc.hi, enc.lo, enc.rad
            if S is not None:
                S[cut] = enc.S
        for_each_slice(block, M, step)
        return Enclosure(hi, lo, rad, S)


def rows_per_block(shape: tuple[int, ...], out_values: int, a_shape: tuple[int, ...] | None = None,
                   a_values: int = 0) -> int:
    """Rows (axis -2) of a block of a product of output ``shape``: at most ``out_values`` values of
    the output, and with ``a_shape`` at most ``a_values`` of A (of that shape); at least one row."""
    step = out_values // max(math.prod(shape) // max(shape[-2], 1), 1)
    if a_shape is not None:
        step = min(step, a_values // max(math.prod(a_shape) // max(a_shape[-2], 1), 1))
    return max(1, step)


# Output elements per block of matmul_sliced: its float64 temporaries stay near 2 MiB each.
_ROWS_BLOCK = 1 << 18
# And values of A per block: its slices and remainder are temporaries of that size.  Attention's
# P V (P of 8 x 1024 x 1024, V of 64 columns) made two blocks of 4M values of A by _ROWS_BLOCK
# alone, which missed the cache, and the thread that finished first waited for the other.  With
# blocks of 2**20 values a float32 1x8x1024x64 forward and backward took 1.94 s against 2.10, and
# float16 1x4x2048x128 4.00 s against 4.28 (medians of 10 and 8 alternating in one process, the
# same values); 2**19 and 2**21 did as well as 2**20.
_A_BLOCK = 1 << 20


_F32_MAX = float(np.finfo(np.float32).max)


def _transposed(B: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(np.swapaxes(B, -1, -2))``, copied a band of _TRANSPOSE_BAND rows of B at
    a time: each band's lines of the copy stay in cache while it is written.  At 2048 x 2048
    float64, on one thread, 14 ms against numpy's 29."""
    K = B.shape[-2]
    out = np.empty(B.shape[:-2] + (B.shape[-1], K), dtype=B.dtype)
    for r in range(0, K, _TRANSPOSE_BAND):
        out[..., r:r + _TRANSPOSE_BAND] = np.swapaxes(B[..., r:r + _TRANSPOSE_BAND, :], -1, -2)
    return out


_TRANSPOSE_BAND = 32


def _rank_one_cols(A01: np.ndarray, RA: np.ndarray, K: int) -> np.ndarray:
    """The columns of the rank-one bounds on a sliced product's rest: per row, sum |A0 + A1| (rounded
    up for its float64 sum of K terms) and max |RA|; times the rows (max |RB|, sum |B|) of
    _Slicing, they bound sum |A0 + A1| |RB| and sum |RA| |B|."""
    g = 1 + 2 * gamma(K, U64)
    return np.concatenate([up(np.sum(np.abs(A01), axis=-1, keepdims=True) * g),
                           np.max(np.abs(RA), axis=-1, keepdims=True, initial=0.0)], axis=-1)


def _abs_product_bound(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """An upper bound on ``|A| @ |B|`` (see :meth:`Right.abs_bound`)."""
    return Right(B, narrow=True).abs_bound(A)


def _in_float32_range(v: np.ndarray) -> bool:
    """Whether every nonzero |v| lies in [2**-60, 2**60], so float32 products neither under- nor overflow."""
    if v.size == 0:
        return True
    if np.maximum.reduce(v, axis=None) > 2.0 ** 60:
        return False
    # Usually no value is zero and the smallest of all is the answer: one cheap reduction
    # (a small op makes this check twice per product).  A NaN fails it too and is left to
    # the masked reduction below, as is a zero.
    if np.minimum.reduce(v, axis=None) >= 2.0 ** -60:
        return True
    # The smallest nonzero value, without copying the nonzero ones out.
    return bool(np.min(v, initial=np.inf, where=v != 0) >= 2.0 ** -60)


def _abs_float32(B: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(|B| in float32, True)`` where :func:`_in_float32_range` holds for ``|B|``, else
    ``(|B|, False)``.

    A large C-contiguous B is taken in blocks side by side (exactref/_parallel.py), each
    checked while in cache: for a 2048 x 2048 B, |B|, its range and its float32 copy took 12 ms
    on one thread (line_profiler) before a matmul's blocks of rows could start.  No
    floating-point exception: |B| goes to float32 only where it fits.
    """
    if B.size < 2 * _ABS_BLOCK or not B.flags.c_contiguous:
        absB = np.abs(B)
        fits = _in_float32_range(absB)
        return (absB.astype(np.float32) if fits else absB), fits
    flat = B.reshape(-1)
    out = np.empty(B.shape, dtype=np.float32)
    dst = out.reshape(-1)
    fits_all: list[bool] = []  # appends are atomic: the order does not matter

    def block(cut: slice) -> None:
        part = np.abs(flat[cut])
        fits = _in_float32_range(part)  # (the blocks together: the range of the whole)
        fits_all.append(fits)
        if fits:
            dst[cut] = part
    for_each_slice(block, flat.size, _ABS_BLOCK)
    return (out, True) if all(fits_all) else (np.abs(B), False)


# Values of B per block of _abs_float32 (1 MiB of float64).
_ABS_BLOCK = 1 << 17


def _slice_budget(K: int) -> int:
    """beta_a + beta_b at most this: K products of slices of beta_a and beta_b bits sum below
    2**53 units."""
    return 53 - max(K - 1, 1).bit_length()


def _slice_exponent(K: int) -> int:
    # Two slices of beta bits each, for A and B alike.
    return max(1, _slice_budget(K) // 2)


def _quick_exponents(K: int) -> tuple[int, int]:
    """(beta_a, beta_b) of the quick cut: A's two slices of beta_a bits and B's one of beta_b bits
    leave remainders of about 2**(-2 beta_a) and 2**(-beta_b) of the values, balanced; K
    products of a slice of each still sum below 2**53 units (beta_a + beta_b is
    :func:`_slice_budget`)."""
    budget = _slice_budget(K)
    return budget // 3, budget - budget // 3


def one_slice_exponents(K: int, b_bits: int | None = None) -> tuple[int, int]:
    """(beta_a, beta_b) of a quick cut: :func:`_quick_exponents`, or with B's one slice of ``b_bits``
    bits and A's two taking the rest of the same budget (so ``A0 B0`` and ``A1 B0`` stay exact)."""
    beta_a, beta_b = _quick_exponents(K)
    if b_bits is None:
        return beta_a, beta_b
    budget = beta_a + beta_b
    return max(1, budget - b_bits), min(b_bits, budget - 1)


# The quick cut is taken for K up to this (see Right).
_QUICK_MAX_K = 1024


@dataclass
class NarrowProduct:
    """A narrow product's BLAS products (:meth:`Right.narrow_product`), before its enclosure is made.

    ``hi`` is ``A @ B`` in float64 and ``P`` the float32 product of |A| and |B| that
    :meth:`Right.abs_bound` widens into the bound S on ``|A| @ |B|`` (``S = up(P scale + add)``,
    ``widening = (scale, add)``), or S itself where P is float64.  The enclosure is
    ``hi +- up(g S)``, with lo zero.  (exactref/_fused_judge.py decides and judges from these
    directly, without the enclosure's arrays.)
    """

    hi: np.ndarray
    P: np.ndarray
    g: float
    widening: tuple[float, float]

    def enclosure(self) -> Enclosure:
        """The enclosure: S and the radius from one compiled loop where it applies (exactref/_fused.py),
        with the same values as the numpy code."""
        S = self.P
        if S.dtype == np.float32:
            made = _fused.widen_float32(S, *self.widening, self.g)
            if made is not None:
                return Enclosure(self.hi, np.zeros(self.hi.shape), made[1], made[0], lo_zero=True)
            S = _widened(S, *self.widening)
        # (np.zeros: np.zeros_like costs several times more for a small product.)
        rad = up(self.g * S) if self.g else np.zeros(S.shape)
        return Enclosure(self.hi, np.zeros(self.hi.shape), rad, S, lo_zero=True)


def _widened(S32: np.ndarray, scale: float, add: float) -> np.ndarray:
    """``up(S32 scale + add)`` in float64: the bound on |A| |B| from its float32 product S32."""
    S = S32.astype(np.float64)
    del S32
    np.multiply(S, scale, out=S)
    np.add(S, add, out=S)
    return _up_into(S)


@dataclass
class _Slicing:
    """B cut into slices (one column at a time) for products with A's two slices of ``beta_a`` bits:
    ``B = sum(slices) + RB``; ``lowB`` the lowest unit exponent per column (see fast._slices);
    ``rows`` the rank-one bounds' rows (max |RB|, and sum |B| rounded up, per column)."""

    beta_a: int
    slices: list[np.ndarray]
    RB: np.ndarray
    lowB: np.ndarray
    rows: np.ndarray
    RB_cols: np.ndarray  # the columns of B with a remainder
    RB_any: bool


# Values of B per block of its columns prepared at a time (1 MiB of float64).
_PREPARE_BLOCK = 1 << 17


class Right:
    """The right operand B of ``A @ B``, prepared once for products with many blocks of rows of A.

    For the bound S on ``|A| @ |B|`` it keeps ``|B|``, in float32 where that
    is safe; float64 inputs with ``bound`` False make no S (their enclosures'
    S is None: see :func:`matmul_sliced`).  For float64 inputs (``narrow`` False) it also keeps B's slices:
    each row of A and column of B is cut into two slices of beta bits and a
    remainder, ``A = A0 + A1 + RA`` and likewise B.  The products of two
    slices, ``A0 B0``, ``A0 B1``, ``A1 B0`` and ``A1 B1``, are exact in
    float64 (Ozaki's error-free slicing); the rest,

        A @ B - (A0 + A1)(B0 + B1) = (A0 + A1) RB + RA B,

    about 2**(-2 beta) of the result, is two plain float64 products whose
    rounding errors (at most gamma_K of their absolute terms) are bounded by
    rank-one bounds.  Six BLAS products in all leave undecided only the
    float64 roundings within about 2**-75 (relative) of a rounding boundary.
    Where a row of A and a column of B have no remainder (values of at most
    2 beta significant bits, such as float32 values widened), the element is
    exactly the sum of the four exact slice products, which the enclosure
    keeps as its ``pieces`` if ``pieces`` is True; a remainder that is zero
    altogether is not multiplied.

    With ``quick``, for K up to ``_QUICK_MAX_K`` (at any K with ``one_slice``, which also sets
    the exponents: :func:`one_slice_exponents`), B is cut into one slice instead, of beta_b bits,
    against A's two of beta_a bits
    (:func:`_quick_exponents`: the same budget, beta_a + beta_b, so ``A0 B0``
    and ``A1 B0`` are exact).  The rest, the same expression with ``B0`` for
    ``B0 + B1``, is about 2**(-2 beta_a) + 2**(-beta_b) of the result (2**-28
    at K = 512): four BLAS products instead of six.  On standard normal
    inputs that leaves about 0.07% of the float64 roundings undecided at
    K = 512, 0.21% at 1024 and 0.82% at 2048, and of float32 values widened
    about 0.3% at 1024, many of them on a float64 or halfway between two,
    which engine.decision.extract_twice decides.  A 1024**3 matmul took 147
    against 193 ms with the compiled loops (exactref/_fused_refine.py), and
    one of float32 values 159 against 191 ms; with numpy alone 173 against
    192 ms, and 223 against 183 ms (medians of 7 and 5, in turn, on 2
    cores).  At 2048 the blocks leave more than _REFINE_SHARE
    (engine/sumprod.py) and make the six products too (2.1 to 2.4 s against
    1.3 to 1.4 s): hence the limit.  The
    enclosure is looser, not less sure: its radius bounds the same kind of
    rest.  ``times(A, fine=True)`` gives the six products' enclosure (B's
    two slices made on first demand), for a block whose quick enclosure
    leaves too many elements undecided (exactref/engine/sumprod.py).
    """

    def __init__(self, B: np.ndarray, *, narrow: bool, pieces: bool = False, bound: bool = True,
                 quick: bool = False, one_slice: tuple[int, int] | None = None,
                 abs_b: np.ndarray | None = None) -> None:
        """``abs_b``: |B| in float32, exact, where the caller made it as it read B (narrow B only),
        every nonzero value in [2**-60, 2**60] (:func:`_in_float32_range`)."""
        self.B = B
        self.narrow = narrow
        self.pieces = pieces
        self.bound = bound  # whether enclosures carry S (float64 inputs; see matmul_sliced)
        self.BT: np.ndarray | None = None  # B's transpose, contiguous, once many columns are gathered
        self.gathered = 0  # columns of B gathered so far, by all the blocks of rows
        self.copying = False  # whether a block's thread is making BT
        self.lock = threading.Lock()  # the blocks share it (exactref/_parallel.py)
        K = B.shape[-2]
        self.K = K
        self.fine: _Slicing | None = None  # B cut for six products (made on demand after a quick cut)
        self.fine_lock = threading.Lock()
        self.cut: _Slicing | None = None  # B cut for the products (none without terms: K = 0)
        if narrow or K == 0:
            # (A given abs_b is what _abs_float32 would return, the range tested as it was made.)
            self.absB, self.in32 = _abs_float32(B) if abs_b is None else (abs_b, True)
            return
        if one_slice is None and quick and K <= _QUICK_MAX_K:
            one_slice = _quick_exponents(K)
        if one_slice is not None:
            self.cut = self._prepare_sliced(B, *one_slice, count=1, first=True)
        else:
            beta = _slice_exponent(K)
            self.cut = self.fine = self._prepare_sliced(B, beta, beta, count=2, first=True)

    @property
    def refinable(self) -> bool:
        """Whether ``times(A, fine=True)`` gives a tighter enclosure than ``times(A)``: B's quick cut."""
        return not self.narrow and self.K > 0 and self.cut is not self.fine

    def _fine(self) -> _Slicing:
        """B cut for the six products, made once, by the first block that asks."""
        with self.fine_lock:
            if self.fine is None:
                beta = _slice_exponent(self.K)
                self.fine = self._prepare_sliced(self.B, beta, beta, count=2, first=False)
            return self.fine

    def _prepare_sliced(self, B: np.ndarray, beta_a: int, beta_b: int, count: int, first: bool) -> _Slicing:
        """B cut into ``count`` slices of ``beta_b`` bits per column, for A's two of ``beta_a`` bits, with
        the rank-one bounds' rows; and, ``first`` time, |B| (in float32 where that is safe).  From
        blocks of B's columns side by side (exactref/_parallel.py): each column is cut alone."""
        N = B.shape[-1]
        slices = [np.empty(B.shape) for _ in range(count)]
        RB = np.empty(B.shape)
        abs32 = np.empty(B.shape if self.bound and first else (0,), dtype=np.float32)
        lowB = np.empty(B.shape[:-2] + (N,), dtype=np.int64)
        rows = np.empty(B.shape[:-2] + (2, N))
        RB_cols = np.empty(B.shape[:-2] + (N,), dtype=bool)  # the columns of B with a remainder
        in32: list[bool] = []  # appends are atomic: the order does not matter
        g = 1 + 2 * gamma(self.K, U64)  # a float64 sum of K terms errs by at most gamma_K relative

        def block(cut: slice) -> None:
            part = B[..., cut]
            absB = np.abs(part)
            fits = self.bound and first and _in_float32_range(absB)
            in32.append(fits)
            if fits:  # (used only if every block fits)
                abs32[..., cut] = absB
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                pieces, rest, lowB[..., cut] = _slices(part, -2, beta_b, count, absB)
                for whole, piece in zip(slices, pieces):
                    whole[..., cut] = piece
                RB[..., cut] = rest
                rows[..., 0:1, cut] = np.max(np.abs(rest), axis=-2, keepdims=True, initial=0.0)
                rows[..., 1:2, cut] = up(np.sum(absB, axis=-2, keepdims=True) * g)
            RB_cols[..., cut] = np.any(rest != 0, axis=-2)
        # Columns per block: about _PREPARE_BLOCK values of B each.
        step = max(1, _PREPARE_BLOCK // max(B.size // max(N, 1), 1))
        if step >= N:
            block(slice(None))
        else:
            for_each_slice(block, N, step)
        if first:
            self.in32 = all(in32)
            if self.bound:
                self.absB = abs32 if self.in32 else np.abs(B)
        return _Slicing(beta_a, slices, RB, lowB, rows, RB_cols, bool(RB_cols.any()))

    def transpose_for(self, count: int) -> np.ndarray | None:
        """B's transpose (..., N, K), contiguous, to gather ``count`` more columns of B from; or None,
        to read them from B itself.

        A column read from B costs a cache line (and often a page) per value;
        the copy costs about 3 ns per value of B, as much as N / 6 to N / 2
        such columns (at K = N = 2048 float64: a column 16 us alone and about
        45 us beside the other thread's BLAS products, the copy 14 ms).  So
        the copy is made once the blocks of rows have asked for more than
        N / 4 columns in all.  One block's thread makes it, outside the lock:
        the others go on reading columns from B until it is there, instead of
        waiting (a float32 2048**3 matmul's threads once waited 40 ms).
        """
        with self.lock:
            self.gathered += count
            if self.BT is not None or self.copying or self.gathered * 4 <= self.B.shape[-1]:
                return self.BT
            self.copying = True
        BT = _transposed(self.B)
        with self.lock:
            self.BT = BT
        return BT

    def out_shape(self, A: np.ndarray) -> tuple[int, ...]:
        return np.broadcast_shapes(A.shape[:-2], self.B.shape[:-2]) + (A.shape[-2], self.B.shape[-1])

    def abs_bound(self, A: np.ndarray, absA: np.ndarray | None = None) -> np.ndarray:
        """An upper bound on ``|A| @ |B|``, from a float32 product where that is safe.

        A float32 product is about twice as fast as a float64 one.  Its inputs'
        rounding (relative u each), its summation (gamma_K) and its underflows
        (half a subnormal per term) are paid for explicitly; values outside
        [2**-60, 2**60] could underflow or overflow, so those take float64.
        ``absA`` may pass ``|A|``, already computed.
        """
        S = self._product_of_abs(A, absA)
        return self._widen(S) if S.dtype == np.float32 else S

    def _product_of_abs(self, A: np.ndarray, absA: np.ndarray | None = None,
                        abs_a: np.ndarray | None = None) -> np.ndarray:
        """abs_bound's float32 product |A| |B|, to be widened (_widen); or its float64 bound itself.
        ``abs_a``, |A| in float32 with every value exact and every nonzero one in
        :func:`_in_float32_range`'s range, where given, is the float32 product's operand that
        ``absA.astype(np.float32)`` would be (the caller tested the range as it made it)."""
        K = self.K
        if K == 0:
            return np.zeros(self.out_shape(A))
        if abs_a is not None and self.in32:
            return abs_a @ self.absB
        if absA is None:
            absA = np.abs(A)
        if not (self.in32 and _in_float32_range(absA)):
            # |B| in float32 is rounded: take it again, exactly.
            absB = np.abs(self.B) if self.in32 else self.absB
            return up((absA @ absB) / (1 - gamma(K, U64)))
        return absA.astype(np.float32) @ self.absB

    def _widening(self) -> tuple[float, float]:
        """(scale, add): up(S32 scale + add) bounds |A| |B| from its float32 product S32."""
        u32 = 2.0 ** -24
        return (1 + u32) ** 2 * (1 + gamma(self.K, u32)), self.K * 2.0 ** -149

    def _widen(self, S32: np.ndarray) -> np.ndarray:
        return _widened(S32, *self._widening())

    def times(self, A: np.ndarray, *, fine: bool = False, S: np.ndarray | None = None,
              abs_a: np.ndarray | None = None) -> Enclosure:
        """The enclosure of ``A @ B`` (float64 exceptions are expected: call it under np.errstate);
        ``fine``: from the six products, where B has a quick cut (:attr:`refinable`).  ``S`` may
        pass the bound on ``|A| @ |B|`` that an earlier enclosure of the same A made; ``abs_a``,
        |A| in float32 with every value exact, made as A was read (narrow A only)."""
        if self.narrow:
            return self._narrow(A, abs_a)
        return self._sliced(A, self._fine() if fine and self.refinable else self.cut, S)

    def _narrow(self, A: np.ndarray, abs_a: np.ndarray | None = None) -> Enclosure:
        return self.narrow_product(A, abs_a).enclosure()

    def narrow_product(self, A: np.ndarray, abs_a: np.ndarray | None = None) -> NarrowProduct:
        """The BLAS products of a narrow enclosure of ``A @ B`` (:meth:`times`), not yet made into one
        (:meth:`NarrowProduct.enclosure`).  ``abs_a``: as in :meth:`times`."""
        # Products are exact, so float64 sums err by at most gamma_{K-1} * sum|terms|.
        return NarrowProduct(A @ self.B, self._product_of_abs(A, abs_a=abs_a), gamma(max(self.K - 1, 0), U64),
                             self._widening())

    def _fusable(self, A: np.ndarray, cut: _Slicing, S: np.ndarray | None, RA_rows: np.ndarray) -> bool:
        """Whether _quick_fused makes this enclosure: a quick cut (one two-sum) of matrices, or of stacks
        of them with the same batch shape, with S or without it, large enough for the compiled loop
        (exactref/_fused.py), and no element summed exactly from pieces (whose errors the loop does
        not keep)."""
        if not (len(cut.slices) == 1 and A.ndim >= 2 and A.shape[:-2] == self.B.shape[:-2]
                and (S is None or (S.dtype == np.float64 and S.flags.c_contiguous))
                and _fused.usable(A.shape[-2] * self.B.shape[-1])):
            return False
        return not (self.pieces and (~RA_rows[..., :, None] & ~cut.RB_cols[..., None, :]).any())

    def _quick_fused(self, A0: np.ndarray, A1: np.ndarray, RA: np.ndarray, RA_rows: np.ndarray,
                     lowA: np.ndarray, cut: _Slicing, S: np.ndarray | None) -> Enclosure:
        """_sliced's enclosure for a quick cut, its products made as there and the rest of its steps
        by one compiled loop (exactref/_fused.py), with the same values."""
        K = self.K
        P0 = A0 @ cut.slices[0]
        P1 = A1 @ cut.slices[0]
        A0 += A1  # (exact: see _sliced)
        del A1
        rest1 = A0 @ cut.RB if cut.RB_any else None
        rest2 = RA @ self.B if RA_rows.any() else None
        R0 = _rank_one_cols(A0, RA, K) @ cut.rows
        fused = _fused.quick_cut(P0, P1, rest1, rest2, R0, S, lowA, cut.lowB, gamma(K + 3, U64), 3 * K * 2.0 ** -1074)
        if fused is None:  # (never: _fusable said the loop applies)
            raise RuntimeError("products: the quick cut's compiled loop declined its arrays")
        return Enclosure(*fused, S)

    def _sliced(self, A: np.ndarray, cut: _Slicing | None, S: np.ndarray | None = None) -> Enclosure:
        K = self.K
        absA = np.abs(A) if K else None
        if S is None and self.bound:
            S = self.abs_bound(A, absA)
        if K == 0:
            z = np.zeros(self.out_shape(A))
            return Enclosure(z, z.copy(), z.copy(), S)
        if cut is None:
            raise RuntimeError(f"products: B of shape {self.B.shape} has no cut for K = {K}")  # (never: K > 0)
        (A0, A1), RA, lowA = _slices(A, -1, cut.beta_a, 2, absA)
        del absA
        RA_rows = np.any(RA != 0, axis=-1)  # the rows of A with a remainder
        if self._fusable(A, cut, S, RA_rows):
            return self._quick_fused(A0, A1, RA, RA_rows, lowA, cut, S)
        # The products' own arrays are reused (in place: the same operations).  Each two-sum
        # is exact, so hi plus the errors is (A0 + A1)(B0 [+ B1]) exactly.
        pairs = [(a, b) for a in (A0, A1) for b in cut.slices]
        hi = A0 @ cut.slices[0]
        errors: list[np.ndarray] = []
        for a, b in pairs[1:]:
            hi, e = _two_sum_into(hi, a @ b)
            errors.append(e)
        del pairs
        # The rest, A0 RB + A1 RB + RA B, as (A0 + A1) RB + RA B: B1 + RB would be one more
        # array of B's size to keep.  A0 + A1 is exact: it is A itself where A1's unit 2**u1
        # is at most ulp(A); otherwise a multiple of 2**u1 of magnitude below
        # |A| + 2**(u1 - 1), at most 2**52 units.
        A0 += A1
        del A1
        rest = A0 @ cut.RB if cut.RB_any else np.zeros(hi.shape)
        if RA_rows.any():
            rest += RA @ self.B
        pieces = exact = None
        if self.pieces:  # where rows and columns have no remainder, hi plus the errors is the value
            exact = ~RA_rows[..., :, None] & ~cut.RB_cols[..., None, :]
            if exact.any():  # kept apart from lo's roundings
                pieces = (hi, *(e.copy() for e in errors))
        # lo = ((e1 [+ e2]) [+ e3]) + rest, each partial sum in the memory of an error it has read.
        partials = []
        t = errors[0]
        for k in range(1, len(errors)):
            t = np.add(t, errors[k], out=errors[k - 1])
            partials.append(t)
        lo = np.add(t, rest, out=rest)
        cols = _rank_one_cols(A0, RA, K)
        del A0, RA
        # sum|A0 + A1||RB| + |RA||B| <= R, by a rank-one bound for each piece; rounded up
        # twice for the float64 products of two terms.
        R = _up_into(_up_into(cols @ cut.rows))
        # The two products err by gamma_K R plus half a subnormal per product that
        # underflows, their addition by about u R (counted as three); forming lo costs
        # u (|t12| + |t| + |lo|):
        # rad = up(gamma_{K+3} R + U64 (|t12| + |t| + |lo|) + 3 K 2**-1074), in place (with the
        # quick cut, lo = e1 + rest is the one rounding: U64 |lo|).
        sizes = [np.abs(p, out=p) for p in partials] + [np.abs(lo, out=errors[-1])]
        tl = sizes[0]
        for size in sizes[1:]:
            np.add(tl, size, out=tl)
        np.multiply(tl, U64, out=tl)
        rad = np.multiply(R, gamma(K + 3, U64), out=R)
        np.add(rad, tl, out=rad)
        np.add(rad, 3 * K * 2.0 ** -1074, out=rad)
        rad = _up_into(rad)
        del tl, t, sizes, partials, errors
        # A slice product whose unit underflows float64 is not exact.
        tiny = (lowA[..., :, None] + cut.lowB[..., None, :]) < -1074 + 53
        ok = np.isfinite(hi)
        ok &= np.isfinite(lo)
        if S is not None:
            ok &= np.isfinite(S)
        ok &= rad < np.inf
        if tiny.any() or not ok.all():
            bad = tiny | ~ok
            hi, lo, rad = np.where(bad, 0.0, hi), np.where(bad, 0.0, lo), np.where(bad, np.inf, rad)
            if exact is not None:
                exact &= ~bad
        if pieces is None or exact is None or not exact.any():
            return Enclosure(hi, lo, rad, S)
        return Enclosure(hi, lo, rad, S, pieces=pieces, exact=exact)
