"""Attention's double-double pass: whole outputs in balls far inside a float64 ulp, for float64 results.

The first pass's float64 weights are good to about 2**-40 (its exp) and the
longdouble pass's to 2**-60, while deciding the rounding of a float64 output
takes an enclosure far inside one float64 ulp: without this pass nearly every
element of a float64 output went to Arb, one element at a time.  Here the
elementwise steps (logits, exp, softmax, dS) run in double-double balls
(:mod:`exactref.engine.balls`), whose radii are rigorous element by
element, and every product with an input matrix is a matrix product:

* X @ Y with X a ball (X.hi + X.lo +- X.rad) and Y exact is
  ``X.hi @ Y`` by error-free slicing (its radius 2**-80 to 2**-90 of the
  sum of |terms|, measured, against 2**-99 for the elementwise steps), plus
  the plain float64 ``X.lo @ Y`` (its error at most gamma_K |X.lo| @ |Y|,
  u**2 relative), plus the radius X.rad @ |Y|;
* D_i = sum_j P_ij dP_ij is computed as dO_i . O_i, the same number, from
  the output's ball;
* the logits and dP = dO V^T are the first pass's error-free products.

Every output element gets an enclosure; an element whose radius is inf
(an overflow, a split that could not be exact) goes on to Arb.
"""

from __future__ import annotations

import functools

import mpmath
import numpy as np

from ...engine import balls
from ...engine.balls import Ball
from ...engine.fast import two_sum, up
from ._first import FirstPass, U, _cat_cols, _cat_rows_t, by_rows, g, matmul_up, sliced
from ._problem import Problem, Scale

__all__ = ["DoublePass"]


def scale_ball(sc: Scale) -> Ball:
    """The softmax scale s as a ball of 0-dimensional arrays."""
    with mpmath.workprec(300):
        if sc.rational is not None:
            v = mpmath.mpf(sc.rational.numerator) / sc.rational.denominator
        else:
            v = 1 / mpmath.sqrt(sc.root_of)
        return Ball(*(np.array(c) for c in balls.constant(v)))


def _zero(like: np.ndarray) -> Ball:
    return balls.exact(np.zeros_like(like))


def _weight_rows(d_hi: np.ndarray, d_lo: np.ndarray, d_rad: np.ndarray, unmasked: np.ndarray,
                 additive: np.ndarray | None, M: np.ndarray, s: Ball) -> tuple[np.ndarray, ...]:
    """The weights P = softmax(s d + additive) of some rows, as (hi, lo, rad)."""
    x = balls.mul(Ball(d_hi, d_lo, d_rad), s)
    if additive is not None:
        x = balls.add(x, balls.exact(np.where(unmasked, additive, 0.0)))
    # M is an exact float (the first pass's row maximum): shifting by it changes nothing exactly.
    y = balls.add(x, balls.exact(-M[..., None]))
    y = balls.where(unmasked, y, _zero(d_hi))
    w = balls.where(unmasked, balls.exp(y), _zero(d_hi))
    W = balls.sum_last(w)
    full = ~unmasked.any(axis=-1)  # a row with no key: output and gradients exactly 0
    W = balls.where(full, balls.exact(np.ones_like(W.hi)), W)
    P = balls.div(w, W[..., None])
    return tuple(balls.where(unmasked, balls.finite(P), _zero(d_hi)))


def _ds_rows(P_hi: np.ndarray, P_lo: np.ndarray, P_rad: np.ndarray, dP_hi: np.ndarray, dP_lo: np.ndarray,
             dP_rad: np.ndarray, D_hi: np.ndarray, D_lo: np.ndarray, D_rad: np.ndarray, unmasked: np.ndarray
             ) -> tuple[np.ndarray, ...]:
    """dS = P (dP - D) of some rows, as (hi, lo, rad)."""
    D = Ball(D_hi, D_lo, D_rad)[..., None]
    T = balls.add(Ball(dP_hi, dP_lo, dP_rad), balls.neg(D))
    dS = balls.mul(Ball(P_hi, P_lo, P_rad), T)
    return tuple(balls.where(unmasked, balls.finite(dS), _zero(P_hi)))


def contract(X: Ball, Y: np.ndarray) -> Ball:
    """X @ Y for a ball X and exact float64 Y (batched over the leading axes)."""
    K = X.hi.shape[-1]
    hi1, lo1, rad1 = sliced(X.hi, Y)
    with np.errstate(over="ignore", invalid="ignore"):
        absY = np.abs(Y)
        c = X.lo @ Y
        # Any order of the K products and sums of X.lo @ Y: Higham's gamma_K, and an underflow each.
        rc = up(g(K) * matmul_up(np.abs(X.lo), absY) + K * 2.0 ** -1070)
        rp = matmul_up(X.rad, absY)
        hi, e = two_sum(hi1, c)
        lo = e + lo1
        rad = up(rad1 + rc + rp + U * np.abs(lo))
    return balls.finite(Ball(hi, lo, rad))


class DoublePass:
    """Enclosures of the outputs' elements, computed for the heads they need and cached.

    It has the interface of :class:`~exactref.ops.attention._second.SecondPass`:
    :meth:`enclose` gives the chosen elements' (hi, lo, rad).  A float64
    output asks for every element, so for every head; after the longdouble
    pass a narrower one asks for a few, and only their heads are computed.
    """

    def __init__(self, pb: Problem, fp: FirstPass, G: np.ndarray | None, rows_too: bool = True) -> None:
        self.pb, self.fp, self.G = pb, fp, G
        self._done: dict[tuple, Ball] = {}
        # False after the longdouble pass: what it leaves of the output or grad_query is few elements
        # whose Arb work is a row each, far less than this pass's work on their heads (and an exact
        # tie, which no precision decides, would cost a head's work here for nothing).  Elements of
        # grad_key and grad_value need their whole heads either way, and in Arb at far more cost.
        self.rows_too = rows_too

    @functools.cached_property
    def s(self) -> Ball:
        # (Only when needed: after the longdouble pass this pass usually has nothing to do.)
        return scale_ball(self.pb.scale)

    def _heads(self, a: np.ndarray | None, hs: np.ndarray) -> np.ndarray | None:
        """The heads ``hs`` of a per-head array (itself, not a copy, when they are all of them)."""
        if a is None or (hs.size == self.pb.H and (hs == np.arange(self.pb.H)).all()):
            return a
        return a[hs]

    def _P(self, hs: np.ndarray) -> Ball:
        # The weights and the output depend on the forward alone: kept on the first pass, they serve
        # the forward and every backward (each with its own DoublePass).
        fp, key = self.fp, ("P", hs.tobytes())
        if key not in fp.double:
            pb = self.pb
            args = (*fp.logit_parts, fp.unmasked, pb.additive, fp.M)
            parts = by_rows(_weight_rows, hs.size, pb.L, *(self._heads(a, hs) for a in args), self.s)
            fp.double[key] = Ball(*parts)
        return fp.double[key]

    def _out(self, hs: np.ndarray) -> Ball:
        fp, key = self.fp, ("out", hs.tobytes())
        if key not in fp.double:
            fp.double[key] = contract(self._P(hs), self._heads(fp.Vh, hs))
        return fp.double[key]

    def _dS(self, hs: np.ndarray) -> Ball:
        key = ("dS", hs.tobytes())
        if key not in self._done:
            pb, fp = self.pb, self.fp
            # D_i = dO_i . O_i = sum_j P_ij dP_ij.
            D = balls.sum_last(balls.mul(balls.exact(self._heads(self.G, hs)), self._out(hs)))
            dP = (self._heads(a, hs) for a in fp.dP_parts)
            parts = by_rows(_ds_rows, hs.size, pb.L, *self._P(hs), *dP, *D, self._heads(fp.unmasked, hs))
            self._done[key] = Ball(*parts)
        return self._done[key]

    def _grad(self, which: str, bs: np.ndarray) -> Ball:
        """Gradient ``which`` of the batch elements ``bs`` of its operand, summed over their copies."""
        pb, fp = self.pb, self.fp
        cop = pb.copies(which)[bs]  # (n, c): the heads reading each element
        hs = np.unique(cop)
        local = np.searchsorted(hs, cop)  # the heads' places among hs
        n, c = cop.shape
        if which == "query":
            X = Ball(*(_cat_cols(a, local) for a in self._dS(hs)))
            Y = fp.Kh[cop].reshape(n, c * pb.S, pb.E)
        elif which == "key":
            X = Ball(*(_cat_rows_t(a, local) for a in self._dS(hs)))
            Y = fp.Qh[cop].reshape(n, c * pb.L, pb.E)
        else:
            X = Ball(*(_cat_rows_t(a, local) for a in self._P(hs)))
            Y = self.G[cop].reshape(n, c * pb.L, pb.Ev)
        out = contract(X, Y)
        return out if which == "value" else balls.finite(balls.mul(out, self.s))

    def enclose(self, which: str, flats: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hi, lo, rad) float64 enclosures of the elements ``flats`` of output ``which``
        (radius inf for all of them where ``rows_too`` is False and ``which`` is "out" or "query")."""
        pb = self.pb
        if not self.rows_too and which in ("out", "query"):
            n = len(flats)
            return np.zeros(n), np.zeros(n), np.full(n, np.inf)
        per = max(int(np.prod(pb.flat_shape(which)[1:])), 1)  # elements per batch element
        flats = np.asarray(flats, dtype=np.int64)
        bs = np.unique(flats // per)
        key = (which, bs.tobytes())
        if key not in self._done:
            self._done[key] = self._out(bs) if which == "out" else self._grad(which, bs)
        at = np.searchsorted(bs, flats // per) * per + flats % per
        return tuple(a.reshape(-1)[at] for a in self._done[key])  # type: ignore[return-value]
