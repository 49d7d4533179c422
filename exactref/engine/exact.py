"""Exact sums of products of floats, vectorised over many sums at once.

Every finite float is an integer times a power of two.  A product of two
float64 values is split into four integer products of at most 54 bits, and
every term is scattered into 32-bit limbs of a fixed-point accumulator (a
Kulisch accumulator) that spans the exponent range of the terms.  Limb sums
stay far below 2**53, so numpy adds them exactly; one carry pass then gives
each sum as a Python integer ``n`` with the sum equal to ``n * 2**e``.

The cost is linear in the number of terms whatever their exponents, so inputs
spanning the whole float32 or float64 range finish in bounded time.
"""

from __future__ import annotations

import math
import struct

import numpy as np

__all__ = ["exact_dot_rows", "exact_sum_rows", "round_rows"]

_LIMB = 32
_LIMB_MASK = (1 << _LIMB) - 1
# Cells per chunk of the accumulator: bounds memory at about 256 MiB.
_CHUNK_CELLS = 1 << 25


def _int_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integers ``m`` (|m| < 2**53) and exponents ``e`` with ``x == m * 2**e``."""
    frac, ex = np.frexp(x)
    return np.ldexp(frac, 53).astype(np.int64), ex.astype(np.int64) - 53


def _product_terms(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer terms (|m| < 2**55) and exponents whose sum is ``x * y`` exactly."""
    mx, ex = _int_parts(x)
    my, ey = _int_parts(y)
    xh, xl = mx >> 26, mx & ((1 << 26) - 1)
    yh, yl = my >> 26, my & ((1 << 26) - 1)
    e = ex + ey
    m = np.stack([xh * yh, xh * yl, xl * yh, xl * yl], axis=-1)
    shifts = np.array([52, 26, 26, 0], dtype=np.int64)
    return m, e[..., None] + shifts


def _products_exact(x: np.ndarray, y: np.ndarray, p: np.ndarray) -> bool:
    """Whether every float64 product ``p = x * y`` is exact.

    It is when both factors have at most 26 significant bits (float32 and
    narrower inputs) and no product falls below the normal range.
    """
    # frexp's fraction is in [0.5, 1): times 2**26 it is an integer exactly when it has at most 26 bits.
    narrow = np.float64(2.0 ** 26)
    for v in (x, y):
        frac = np.frexp(v)[0] * narrow
        if not np.array_equal(frac, np.trunc(frac)):
            return False
    tiny = (np.abs(p) < 2.0 ** -1022) & (x != 0) & (y != 0)
    return not tiny.any() and bool(np.isfinite(p).all())


def exact_dot_rows(x: np.ndarray, y: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Exact ``sum(x[i] * y[i])`` for each row ``i`` of two (rows, terms) float64 arrays.

    With ``y`` None the rows of ``x`` are summed.  Every value must be finite.
    Returns one ``(n, e)`` per row, the sum being ``n * 2**e``.
    """
    x = np.asarray(x, dtype=np.float64)
    rows = x.shape[0]
    if y is None:
        m, e = _int_parts(x)
    else:
        y = np.asarray(y, dtype=np.float64)
        with np.errstate(over="ignore", under="ignore"):
            p = x * y
        if _products_exact(x, y, p):
            m, e = _int_parts(p)
        else:
            m, e = _product_terms(x, y)
    m = m.reshape(rows, -1)
    e = e.reshape(rows, -1)
    return exact_sum_rows(m, e)


def exact_sum_rows(m: np.ndarray, e: np.ndarray) -> list[tuple[int, int]]:
    """Exact ``sum(m[i] * 2**e[i])`` per row, for int64 ``m`` with |m| < 2**62."""
    rows, terms = m.shape
    if rows == 0:
        return []
    nonzero = m != 0
    if not nonzero.any():
        return [(0, 0)] * rows
    base = int(e[nonzero].min())
    shift = np.where(nonzero, e - base, 0)
    limbs = int(shift.max()) // _LIMB + 5
    out: list[tuple[int, int]] = []
    step = max(1, _CHUNK_CELLS // (limbs + 8 * terms))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        acc = _accumulate(m[start:stop], shift[start:stop], limbs)
        out.extend((n, base) for n in _to_ints(acc))
    return out


def _accumulate(m: np.ndarray, shift: np.ndarray, limbs: int) -> np.ndarray:
    rows = m.shape[0]
    sign = np.sign(m)
    mag = np.abs(m).astype(np.uint64)
    row = np.broadcast_to(np.arange(rows)[:, None], m.shape)
    offset = (shift & (_LIMB - 1)).astype(np.uint64)
    first = shift >> 5
    cells, weights = [], []
    # |m| < 2**62 is two 31-bit-or-less chunks; each chunk shifted by < 32 bits
    # fits uint64, and splits into a low and a high 32-bit limb.
    for j, chunk in enumerate((mag & np.uint64(_LIMB_MASK), mag >> np.uint64(_LIMB))):
        v = chunk << offset
        for k, part in enumerate((v & np.uint64(_LIMB_MASK), v >> np.uint64(_LIMB))):
            cells.append((row * limbs + first + j + k).ravel())
            weights.append((sign * part.astype(np.int64)).ravel())
    idx = np.concatenate(cells)
    w = np.concatenate(weights)
    keep = w != 0
    idx, w = idx[keep], w[keep]
    per_cell_terms = 4 * m.shape[1]
    if per_cell_terms < (1 << 20):
        # Each weight is below 2**32 and a cell gets fewer than 2**20 of them,
        # so the float64 sums bincount forms are exact.
        acc = np.bincount(idx, weights=w.astype(np.float64), minlength=rows * limbs)
        acc = acc.astype(np.int64)
    else:
        acc = np.zeros(rows * limbs, dtype=np.int64)
        np.add.at(acc, idx, w)
    acc = acc.reshape(rows, limbs)
    for j in range(limbs - 1):
        carry = acc[:, j] >> _LIMB
        acc[:, j] -= carry << _LIMB
        acc[:, j + 1] += carry
    return acc


def _to_ints(acc: np.ndarray) -> list[int]:
    limbs = acc.shape[1]
    low = np.ascontiguousarray(acc[:, :-1].astype("<u4"))
    top = acc[:, -1].tolist()
    shift = _LIMB * (limbs - 1)
    return [
        int.from_bytes(low[i].tobytes(), "little") + (top[i] << shift)
        for i in range(acc.shape[0])
    ]


def _odd(x: float) -> bool:
    """Whether the last significand bit of float64 ``x`` is 1 (normal or subnormal alike)."""
    return bool(struct.unpack("<q", struct.pack("<d", x))[0] & 1)


def round_rows(pieces: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Correct roundings of the exact row sums of finite float64 ``pieces`` (rows, n), via math.fsum.

    Returns ``(value, x_lo, x_hi, ok)``: for ``p == 53`` the sum rounded to
    nearest float64; for ``p <= 51`` its round-to-odd at 53 bits, which a
    later rounding to nearest at ``p`` bits turns into the correct rounding
    (Boldo and Melquiond).  ``x_lo <= sum <= x_hi`` are float64 bounds, equal
    when the sum is a float64.  ``ok`` is False for a row whose partial sums
    overflow float64; the caller computes it another way.
    """
    rows = pieces.shape[0]
    value = np.zeros(rows)
    x_lo = np.zeros(rows)
    x_hi = np.zeros(rows)
    ok = np.ones(rows, dtype=bool)
    for i, row in enumerate(pieces.tolist()):
        try:
            r = math.fsum(row)
            row.append(-r)
            d = math.fsum(row)  # the exact residual's sign, since fsum rounds correctly
        except OverflowError:
            ok[i] = False
            continue
        if not math.isfinite(r):
            ok[i] = False
            continue
        if d == 0:
            value[i] = x_lo[i] = x_hi[i] = r
            continue
        nb = math.nextafter(r, math.copysign(math.inf, d))
        value[i] = r if p == 53 or _odd(r) else nb
        x_lo[i], x_hi[i] = (r, nb) if d > 0 else (nb, r)
    return value, x_lo, x_hi, ok
